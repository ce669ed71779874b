"""The built-in demo dataset: three layouts agree, bytes are reproducible, media decode to truth."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import av
import pyarrow.parquet as pq
import pytest
import webdataset
from PIL import Image

from omnifeed.tools._demo_data import (
    FIELDS,
    DemoDatasetSpec,
    DemoSample,
    demo_samples,
    encode_flac,
    encode_image,
    encode_video,
    write_folder,
    write_parquet,
    write_webdataset,
)

Fields = dict[str, dict[str, bytes]]


def _truth(samples: list[DemoSample]) -> Fields:
    return {s.key: dict(s.fields) for s in samples}


def _read_tars(paths: list[Path]) -> Fields:
    out: Fields = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar:
                key, name = member.name.split(".", 1)
                out.setdefault(key, {})[name] = tar.extractfile(member).read()  # type: ignore[union-attr]
    return out


def _read_parquet(path: Path) -> Fields:
    rows = pq.read_table(path).to_pylist()
    return {
        r.pop("__key__"): {k: v.encode() if isinstance(v, str) else v for k, v in r.items() if v is not None}
        for r in rows
    }


def _read_folder(root: Path) -> Fields:
    out: Fields = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        key, name = path.name.split(".", 1)
        out.setdefault(key, {})[name] = path.read_bytes()
    return out


def _write_all(tmp: Path, spec: DemoDatasetSpec) -> dict[str, bytes]:
    samples = demo_samples(spec)
    files = write_webdataset(tmp / "wds", spec, samples=samples)
    files.append(write_parquet(tmp / "demo.parquet", spec, samples=samples))
    files += sorted(p for p in write_folder(tmp / "folder", spec, samples=samples).rglob("*") if p.is_file())
    return {str(p.relative_to(tmp)): p.read_bytes() for p in files}


def test_three_layouts_hold_the_same_keys_and_bytes(demo_truth, demo_shards, demo_parquet, demo_folder):
    truth = _truth(demo_truth)
    assert list(truth) == [f"sample-{i:06d}" for i in range(len(demo_truth))]
    assert _read_tars(demo_shards) == truth
    assert _read_parquet(demo_parquet) == truth
    assert _read_folder(demo_folder) == truth
    assert len({p.parent.name for p in demo_folder.rglob("*.json")}) == 2


def test_layouts_are_split_into_shards_row_groups_and_parts(demo_spec, demo_shards, demo_parquet):
    assert [p.name for p in demo_shards] == [f"shard-{i:04d}.tar" for i in range(demo_spec.num_shards)]
    meta = pq.ParquetFile(demo_parquet).metadata
    assert meta.num_row_groups == -(-demo_spec.num_samples // demo_spec.row_group_size) > 1
    assert pq.read_schema(demo_parquet).names == ["__key__", *FIELDS]


def test_same_seed_gives_same_bytes_and_another_seed_differs(tmp_path):
    spec = DemoDatasetSpec(num_samples=12, num_shards=2, seed=7)
    first, second = _write_all(tmp_path / "a", spec), _write_all(tmp_path / "b", spec)
    other = _write_all(tmp_path / "c", DemoDatasetSpec(num_samples=12, num_shards=2, seed=8))
    assert first == second
    containers = [name for name in first if name.endswith((".tar", ".parquet"))]
    assert len(containers) == 3 and all(first[name] != other[name] for name in containers)


def test_encoders_are_seeded_and_deterministic():
    for encode in (
        lambda seed: encode_image(40, 30, "jpg", seed=seed),
        lambda seed: encode_video(5, 64, 48, 10, seed=seed),
        lambda seed: encode_flac(0.3, 16000, 2, seed=seed),
    ):
        assert encode(1) == encode(1) != encode(2)


def test_vp9_videos_are_webm_whose_stream_frame_count_is_unknown():
    data = encode_video(6, 96, 72, 12, codec="libvpx-vp9", seed=3)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.frames) == ("vp9", 0)  # count only by decoding
        assert sum(1 for _ in container.decode(stream)) == 6


def test_webdataset_reads_the_shards_with_every_field(demo_truth, demo_shards):
    dataset = webdataset.WebDataset([str(p) for p in demo_shards], shardshuffle=False)
    got = {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in dataset}
    assert got == _truth(demo_truth)
    media = {"image": {"jpg", "png"}, "video": {"mp4"}, "audio": {"flac"}, "text": set()}
    for key, fields in got.items():
        meta = json.loads(fields["json"])
        assert (meta["source"], meta["index"]) == (
            "omnifeed-demo",
            int(key.removeprefix("sample-")),
        )
        extra = fields.keys() - {"txt", "json"}
        assert extra <= media[meta["kind"]] and len(extra) == (meta["kind"] != "text")


def test_images_decode_to_the_stated_size_and_format(demo_truth):
    images = [s for s in demo_truth if s.kind == "image"]
    assert {"jpg", "png"} <= {name for s in images for name in s.fields}
    for s in images:
        (name,) = s.fields.keys() & {"jpg", "png"}
        with Image.open(io.BytesIO(s.fields[name])) as img:
            assert (img.width, img.height, img.format) == (
                s.width,
                s.height,
                {"jpg": "JPEG", "png": "PNG"}[name],
            )


def test_videos_decode_to_the_stated_frames_size_and_rate(demo_truth):
    videos = [s for s in demo_truth if s.kind == "video"]
    assert videos
    for s in videos:
        with av.open(io.BytesIO(s.fields["mp4"])) as container:
            stream = container.streams.video[0]
            assert (stream.codec_context.name, stream.average_rate) == ("h264", s.fps)
            assert stream.frames == s.frames  # MP4 records the count; Matroska/WebM say 0
            decoded = [(f.width, f.height, f.format.name) for f in container.decode(stream)]
        assert decoded == [(s.width, s.height, "yuv420p")] * s.frames


def test_flac_decodes_to_the_stated_duration_rate_and_channels(demo_truth):
    clips = [s for s in demo_truth if s.kind == "audio"]
    assert clips
    for s in clips:
        with av.open(io.BytesIO(s.fields["flac"])) as container:
            stream = container.streams.audio[0]
            assert (stream.sample_rate, stream.codec_context.layout.nb_channels) == (
                s.sample_rate,
                s.channels,
            )
            decoded = sum(f.samples for f in container.decode(stream))
        assert abs(decoded - s.audio_samples) <= 1  # within one audio frame (sample) of truth
        assert s.seconds == pytest.approx(decoded / s.sample_rate, abs=1 / s.sample_rate)


def test_text_word_counts_are_true_and_every_kind_is_present(demo_spec, demo_truth):
    for s in demo_truth:
        assert len(s.fields["txt"].decode("utf-8").split()) == s.words >= 1
    counts = Counter(s.kind for s in demo_truth)
    for kind, share in {"image": 0.45, "text": 0.25, "video": 0.15, "audio": 0.15}.items():
        assert abs(counts[kind] - share * demo_spec.num_samples) < 1


def test_default_dataset_builds_within_its_stated_ranges(tmp_path):
    spec = DemoDatasetSpec()
    samples = demo_samples(spec)
    assert len(write_webdataset(tmp_path / "wds", spec, samples=samples)) == spec.num_shards
    write_parquet(tmp_path / "demo.parquet", spec, samples=samples)
    assert len(samples) == spec.num_samples == 240
    for s in samples:
        if s.kind == "image":
            assert 32 <= min(s.width, s.height) and max(s.width, s.height) <= 320
        elif s.kind == "text":
            assert 5 <= s.words <= 2000
        elif s.kind == "video":
            assert 4 <= s.frames <= 16 and 8 <= s.fps <= 25 and 64 <= s.width <= 160 and 48 <= s.height <= 120
        else:
            assert 0.2 <= s.seconds <= 3.0 and s.sample_rate in (16000, 22050) and s.channels in (1, 2)
    assert max(s.words for s in samples if s.kind == "text") > 20 * min(s.words for s in samples if s.kind == "text")


@pytest.mark.parametrize("kwargs", [{"num_shards": 0}, {"num_samples": 2, "num_shards": 3}, {"row_group_size": 0}])
def test_spec_rejects_impossible_layouts(kwargs):
    with pytest.raises(ValueError):
        DemoDatasetSpec(**kwargs)
