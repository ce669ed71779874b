"""Building and opening the index: contents, lengths, fingerprints, partitions, bad input."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnifeed.loader import IndexConfig, IndexFormatError, SampleIndex, SourceError, build_index, read_field
from omnifeed.loader.index import FieldLocation, IndexedSample, SampleLengths


@pytest.fixture(scope="module")
def tar_index(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    out = tmp_path_factory.mktemp("tar-index") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(partitions=4, workers=2), progress=False)
    return SampleIndex(out)


def _truth_by_key(demo_truth: list) -> dict:
    return {s.key: s for s in demo_truth}


def test_manifest_counts_samples_and_states_length_statistics(tar_index: SampleIndex, demo_truth: list) -> None:
    manifest = json.loads((tar_index.path / "manifest.json").read_text())
    assert manifest["num_samples"] == len(demo_truth) == tar_index.num_samples
    assert isinstance(manifest["fingerprint"], str) and manifest["fingerprint"] == tar_index.fingerprint
    has_video = sum(1 for s in demo_truth if "mp4" in s.fields)
    assert manifest["modalities"]["video"] == has_video
    assert manifest["lengths"]["video_frames"]["count"] == has_video
    assert {"min", "max", "mean", "p50", "p90", "p99"} <= set(manifest["lengths"]["text_tokens"])


def test_rows_are_partitioned_by_key_hash_and_sorted(tar_index: SampleIndex) -> None:
    start = 0
    for p, part in enumerate(tar_index.manifest["partitions"]):
        keys = tar_index.keys(np.arange(start, start + part["rows"]))
        assert keys == sorted(keys)
        assert all(xxhash.xxh64_intdigest(k.encode()) % 4 == p for k in keys)
        assert (tar_index.path / part["file"]).is_file()
        start += part["rows"]
    assert start == tar_index.num_samples


def test_lengths_match_what_was_generated(tar_index: SampleIndex, demo_truth: list) -> None:
    truth = _truth_by_key(demo_truth)
    for position in range(tar_index.num_samples):
        sample = tar_index.sample(position)
        expected = truth[sample.key]
        lengths = sample.lengths
        if expected.kind == "image":
            assert (lengths.image_width, lengths.image_height) == (expected.width, expected.height)
        if expected.kind == "video":
            assert (lengths.video_frames, lengths.video_width, lengths.video_height) == (
                expected.frames,
                expected.width,
                expected.height,
            )
            assert lengths.video_fps == pytest.approx(expected.fps)
        if expected.kind == "audio":
            assert lengths.audio_sample_rate == expected.sample_rate
            assert lengths.audio_seconds == pytest.approx(expected.seconds, abs=0.05)
        assert lengths.text_tokens > 0


@pytest.mark.parametrize("layout", ["tar", "parquet", "folder"])
def test_every_field_reads_back_by_its_index_location(
    layout: str, demo_shards: list[Path], demo_parquet: Path, demo_folder: Path, demo_truth: list, tmp_path: Path
) -> None:
    sources = {"tar": [str(p) for p in demo_shards], "parquet": [str(demo_parquet)], "folder": [str(demo_folder)]}[
        layout
    ]
    report = build_index(sources, tmp_path / "index", IndexConfig(partitions=3, workers=1), progress=False)
    assert report.ok, report.errors
    index, truth = SampleIndex(report.path), _truth_by_key(demo_truth)
    stem = lambda key: key.rsplit("/", 1)[-1]  # noqa: E731  folder keys keep their subfolder, as in WebDataset
    assert sorted(stem(k) for k in index.keys(np.arange(index.num_samples))) == sorted(truth)
    for position in range(index.num_samples):
        sample = index.sample(position)
        expected = truth[stem(sample.key)]
        assert {f.name for f in sample.fields} == set(expected.fields)
        for field in sample.fields:
            data = read_field(sample.shard, field, row_group=sample.row_group, row=sample.row)
            assert data == expected.fields[field.name], (sample.key, field.name)


def test_fingerprint_is_reproducible_and_follows_content(demo_shards: list[Path], tmp_path: Path) -> None:
    sources = [str(p) for p in demo_shards]
    one = build_index(sources, tmp_path / "a", IndexConfig(workers=1), progress=False)
    two = build_index(sources, tmp_path / "b", IndexConfig(workers=2), progress=False)
    assert one.fingerprint == two.fingerprint
    changed = tmp_path / "changed"
    shutil.copytree(demo_shards[0].parent, changed)
    sample = SampleIndex(one.path).sample(0)
    field = next(f for f in sample.fields if f.modality == "text")
    first_shard = next(i for i, p in enumerate(demo_shards) if str(p) == sample.shard.url)
    shard = changed / demo_shards[first_shard].name
    data = bytearray(shard.read_bytes())
    data[field.offset] ^= 0x01  # one flipped bit inside a text member: same sizes, other content
    shard.write_bytes(bytes(data))
    moved = [str(changed / p.name) for p in demo_shards]
    three = build_index(moved, tmp_path / "c", IndexConfig(workers=1), progress=False)
    assert three.fingerprint != one.fingerprint
    assert (
        build_index(sources, tmp_path / "d", IndexConfig(tokenizer="bytes"), progress=False).fingerprint
        != one.fingerprint
    )


def test_a_bad_shard_is_named_and_the_rest_still_indexed(demo_shards: list[Path], tmp_path: Path) -> None:
    bad = tmp_path / "broken.tar"
    bad.write_bytes(b"this is not a tar archive" * 40)
    report = build_index([str(p) for p in demo_shards] + [str(bad)], tmp_path / "index", IndexConfig(), progress=False)
    assert not report.ok
    assert [e["source"] for e in report.errors] == [str(bad)]
    assert "broken.tar" in report.errors[0]["error"]
    assert report.num_samples == SampleIndex(report.path).num_samples > 0
    assert SampleIndex(report.path).manifest["errors"] == report.errors


def test_a_key_in_two_shards_is_refused_naming_both_files(demo_shards: list[Path], tmp_path: Path) -> None:
    copy = tmp_path / "copy.tar"
    shutil.copy(demo_shards[0], copy)
    report = build_index([str(demo_shards[0]), str(copy)], tmp_path / "index", IndexConfig(), progress=False)
    index = SampleIndex(report.path)
    assert index.num_samples == len(report.errors) > 0, "each duplicated key reported once, the first kept"
    error = report.errors[0]
    assert str(copy) in error["error"] and str(demo_shards[0]) in error["error"] and error["key"] in error["error"]


def test_nothing_to_index_is_an_error_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="nothing-here"):
        build_index([str(tmp_path / "nothing-here-*.tar")], tmp_path / "index", progress=False)
    assert not (tmp_path / "index").exists()


def test_opening_maps_the_index_instead_of_reading_it(tar_index: SampleIndex) -> None:
    before = pa.total_allocated_bytes()
    index = SampleIndex(tar_index.path)
    assert pa.total_allocated_bytes() - before < 64 * 1024, "rows are memory-mapped, not copied"
    assert index.keys([0, 1]) == tar_index.keys([0, 1])


def test_missing_arrow_copies_are_rebuilt_from_parquet(tar_index: SampleIndex, tmp_path: Path) -> None:
    copy = tmp_path / "index"
    shutil.copytree(tar_index.path, copy, ignore=shutil.ignore_patterns("*.arrow"))
    reopened = SampleIndex(copy)
    assert reopened.keys(np.arange(reopened.num_samples)) == tar_index.keys(np.arange(tar_index.num_samples))


def test_arrow_copies_without_batch_counts_from_an_older_omnifeed_open_and_read_the_same(
    tar_index: SampleIndex, tmp_path: Path
) -> None:
    copy = tmp_path / "index"
    shutil.copytree(tar_index.path, copy)
    for path in copy.glob("part-*.arrow"):  # as omnifeed wrote them before batch counts were recorded
        table = pa.ipc.open_file(pa.BufferReader(path.read_bytes())).read_all()
        assert b"omnifeed.batch_rows" in table.schema.metadata  # what a build writes now: opening reads no batch
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema.remove_metadata()) as writer:
            writer.write_table(table.replace_schema_metadata(None), max_chunksize=7)
    reopened, positions = SampleIndex(copy), np.arange(tar_index.num_samples)
    assert reopened.keys(positions) == tar_index.keys(positions)
    assert reopened.samples(positions) == tar_index.samples(positions)


@pytest.mark.parametrize("derived", ["lengths.npy", "even-lengths.npz"])
@pytest.mark.parametrize("damage", ["missing", "truncated", "another size"])
def test_the_derived_length_files_give_what_the_rows_give_and_are_not_needed(
    tar_index: SampleIndex, tmp_path: Path, derived: str, damage: str
) -> None:
    positions = np.random.default_rng(0).permutation(tar_index.num_samples)
    built = (tar_index.length_columns(positions), tar_index.even_lengths(1 << 19))
    copy = tmp_path / "index"
    shutil.copytree(tar_index.path, copy)
    if damage == "missing":
        (copy / derived).unlink()
    elif damage == "truncated":
        (copy / derived).write_bytes((copy / derived).read_bytes()[:200])
    elif derived == "lengths.npy":
        np.save(copy / derived, np.zeros(3))
    else:
        np.savez(copy / derived, text_tokens=np.zeros(3))
    reopened = SampleIndex(copy)
    for got, want in zip((reopened.length_columns(positions), reopened.even_lengths(1 << 19)), built):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    with pytest.raises(IndexError):
        reopened.length_columns([tar_index.num_samples])


def test_a_directory_that_is_not_an_index_says_so(tmp_path: Path) -> None:
    with pytest.raises(IndexFormatError, match="omnifeed index"):
        SampleIndex(tmp_path)


def test_positions_of_unknown_keys_are_minus_one(tar_index: SampleIndex) -> None:
    keys = tar_index.keys([3, 1])
    assert tar_index.positions_of(keys + ["no-such-key"]).tolist() == [3, 1, -1]


def test_by_shard_order_lists_each_shard_in_member_order(tar_index: SampleIndex, demo_shards: list[Path]) -> None:
    starts = np.concatenate([[0], np.cumsum(tar_index.shard_sizes)])
    first_shard = tar_index.by_shard[starts[0] : starts[1]]
    offsets = [tar_index.sample(int(p)).fields[0].offset for p in first_shard]
    assert offsets == sorted(offsets)
    assert {tar_index.sample(int(p)).shard.url for p in first_shard} == {str(demo_shards[0])}


class _FlakyMemoryFS:
    """Builds an fsspec memory filesystem whose opens fail with ConnectionError a set number of times."""

    @staticmethod
    def register(failures: int) -> None:
        import fsspec
        from fsspec.implementations.memory import MemoryFileSystem

        class FlakyMemoryFileSystem(MemoryFileSystem):
            protocol = ("flaky",)
            remaining = failures

            @classmethod
            def _strip_protocol(cls, path):  # noqa: ANN001, ANN206
                return super()._strip_protocol(str(path).removeprefix("flaky://"))

            def _open(self, path, mode="rb", **kwargs):  # noqa: ANN001, ANN202
                if mode == "rb" and FlakyMemoryFileSystem.remaining > 0:
                    FlakyMemoryFileSystem.remaining -= 1
                    raise ConnectionError(f"injected storage error reading {path}")
                return super()._open(path, mode, **kwargs)

        fsspec.register_implementation("flaky", FlakyMemoryFileSystem, clobber=True)


@pytest.mark.parametrize("failures,indexed", [(2, True), (3, False)])
def test_storage_errors_are_retried_then_reported(
    demo_shards: list[Path], tmp_path: Path, failures: int, indexed: bool
) -> None:
    import fsspec

    _FlakyMemoryFS.register(failures)
    url = f"flaky://{tmp_path.name}/shard.tar"
    with fsspec.open(url, "wb") as f:
        f.write(demo_shards[0].read_bytes())
    if indexed:  # two failures, three attempts: indexed
        report = build_index([url], tmp_path / "index", IndexConfig(workers=1), progress=False)
        assert report.ok and report.num_samples > 0
    else:
        with pytest.raises(SourceError, match="storage error after 3 attempts.*injected storage error"):
            build_index([url], tmp_path / "index", IndexConfig(workers=1), progress=False)


@pytest.fixture(scope="module")
def arrow_rows(tar_index: SampleIndex) -> list[IndexedSample]:
    """Every row of the index as Arrow's own ``to_pylist`` reads its Parquet partitions: the reference."""
    index = tar_index
    partitions = sorted(index.path.glob("part-*.parquet"))
    rows = [row for path in partitions for row in pq.read_table(path).to_pylist()]
    lengths = [f.name for f in dataclasses.fields(SampleLengths)]
    return [
        IndexedSample(
            position=position,
            key=row["key"],
            shard=index.shards[row["shard"]],
            fields=tuple(FieldLocation(**field) for field in row["fields"]),
            lengths=SampleLengths(**{name: row[name] for name in lengths}),
            row_group=row["row_group"],
            row=row["row"],
        )
        for position, row in enumerate(rows)
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_samples_of_any_positions_are_the_rows_arrow_reads(
    tar_index: SampleIndex, arrow_rows: list[IndexedSample], data: st.DataObject
) -> None:
    # rows are read from views of the chunks' buffers, not through Arrow scalars: the same values as Arrow's reading
    n = tar_index.num_samples
    positions = data.draw(
        st.one_of(
            st.lists(st.integers(0, n - 1), max_size=40),  # scattered: a row or two per chunk
            st.permutations(range(n)),  # whole chunks
            st.integers(0, n - 1).flatmap(lambda start: st.just(list(range(start, min(n, start + 30))))),
        )
    )
    assert len(arrow_rows) == n
    assert tar_index.samples(positions) == [arrow_rows[p] for p in positions]
    assert [tar_index.sample(p) for p in positions] == [arrow_rows[p] for p in positions]


def test_keys_and_member_names_outside_ascii_read_back_as_written(tmp_path: Path) -> None:
    names = ["café.txt", "café.json", "文字/页.txt", "a.txt", "ünï.cls"]
    with tarfile.open(tmp_path / "names.tar", "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = len(name.encode())
            tar.addfile(info, io.BytesIO(name.encode()))
    build_index([str(tmp_path / "names.tar")], tmp_path / "index", IndexConfig(workers=1), progress=False)
    index = SampleIndex(tmp_path / "index")
    samples = index.samples(list(range(index.num_samples)))
    assert sorted(s.key for s in samples) == ["a", "café", "ünï", "文字/页"]
    assert sorted(f.member for s in samples for f in s.fields) == sorted(names)
    for sample in samples:
        for field in sample.fields:
            assert read_field(sample.shard, field) == field.member.encode()
