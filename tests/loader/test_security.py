"""docs/security.md, claim by claim: each test names the claim it enforces (§ numbers of that page)."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import resource
import socket
import stat
import struct
import tarfile
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from omnifeed.cache import NvmeTierConfig, RamTierConfig
from omnifeed.loader import IndexConfig, IndexFormatError, SampleIndex, SourceError, build_index
from omnifeed.loader._config import ConfigError, load_yaml
from omnifeed.loader.decode._config import DecodeConfig
from omnifeed.loader.decode._registry import DecodeError, make_decoder
from omnifeed.loader.index._records import FieldLocation, ShardSpec
from omnifeed.loader.index._scan import scan_shard
from omnifeed.loader.index._sources import read_field
from omnifeed.loader.service._arena import Segment
from omnifeed.loader.service._protocol import MAX_REPLY_BYTES, MAX_REQUEST_BYTES, ProtocolError, decode, receive
from omnifeed.tools._demo_data import encode_flac

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("loader", "cache", "bucketing", "trainer_adapter", "tools")


# -- §2 nothing received is unpickled or evaluated ----------------------------------------------------

# Calls that would run code or build arbitrary objects from bytes; each place allowed is listed with why.
DANGEROUS = re.compile(
    r"pickle\.loads?\(|\bUnpickler\b|\beval\(|\bexec\("
    r"|yaml\.(?:load|unsafe_load|full_load)(?:_all)?\(|marshal\.loads?\("
    r"|\bfrom\s+(?:pickle|marshal|yaml)\s+import\s+[^#]*\b(?:loads?|Unpickler|unsafe_load|full_load|Loader)\b"
    r"|\bimport\s+(?:pickle|marshal)\s+as\b"
    r"|\bdill\b|\bcloudpickle\b|\bshelve\b|jsonpickle|allow_pickle\s*=\s*True|torch\.load\((?!.*weights_only=True)"
)
ALLOWED = {
    (
        "loader/dataloader/_handoff.py",
        "Unpickler",
    ): "the drop-in DataLoader's batches from its own worker processes (as torch's DataLoader does)",
}


def test_no_code_path_unpickles_or_evaluates_anything_except_the_dataloaders_own_workers() -> None:
    found = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line in path.read_text(encoding="utf-8").splitlines():
                code = line.split("#", 1)[0]
                for match in DANGEROUS.finditer(code):
                    found.add((str(path.relative_to(ROOT)), match.group(0).rstrip("(")))
    assert found == set(ALLOWED), "a new unpickle/eval/unsafe load: justify it in docs/security.md and ALLOWED"


@pytest.mark.parametrize(
    "body",
    [
        pickle.dumps({"op": "hello"}),
        msgpack.packb({"op": "hello", "x": msgpack.ExtType(1, b"\0" * 16)}),  # a tensor reference, sent to the service
        msgpack.packb({"op": "hello", "x": msgpack.ExtType(42, b"os.system")}),
    ],
)
def test_the_control_protocol_accepts_plain_msgpack_only(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(body)


def test_config_files_are_read_with_yaml_safe_load(tmp_path: Path) -> None:
    (tmp_path / "feed.yaml").write_text("plan: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="could not determine a constructor") as caught:
        load_yaml(tmp_path / "feed.yaml")
    assert isinstance(caught.value.__cause__, yaml.constructor.ConstructorError)


# -- §3 sizes are bounded ------------------------------------------------------------------------------


def test_an_oversized_frame_is_refused_from_its_length_before_its_body_is_read() -> None:
    assert (MAX_REQUEST_BYTES, MAX_REPLY_BYTES) == (1 << 20, 256 << 20)
    reader, writer = socket.socketpair()
    with reader, writer:
        writer.sendall(struct.pack("!I", MAX_REQUEST_BYTES + 1) + b"body bytes")
        with pytest.raises(ProtocolError, match="over the limit"):
            receive(reader, MAX_REQUEST_BYTES)
        assert reader.recv(100) == b"body bytes"  # not read: no buffer of the claimed size was allocated


def test_a_release_of_more_than_4096_batches_is_refused_and_the_service_goes_on(index_dir: Path) -> None:
    from feed_service import short_socket_dir

    from omnifeed.loader import FeedConfig, PlanConfig
    from omnifeed.loader.service._config import ServiceConfig
    from omnifeed.loader.service._protocol import PROTOCOL
    from omnifeed.loader.service._server import FeedService
    from omnifeed.trainer_adapter import FeedClient

    def frame(message: dict) -> bytes:  # type: ignore[type-arg]
        body = msgpack.packb(message)
        return struct.pack("!I", len(body)) + body

    config = ServiceConfig(
        index=str(index_dir),
        feed=FeedConfig(plan=PlanConfig(seed=0, batch_size=2)),
        socket=str(short_socket_dir() / "feed.sock"),
    )
    with FeedService(config) as service:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(service.address)
            sock.sendall(
                frame(
                    {
                        "op": "hello",
                        "protocol": PROTOCOL,
                        "rank": 0,
                        "world_size": 1,
                        "dp_rank": 0,
                        "dp_world_size": 1,
                        "grad_accum": 1,
                        "state": None,
                    }
                )
            )
            assert receive(sock, MAX_REPLY_BYTES)[0]["op"] == "welcome"
            sock.sendall(frame({"op": "next", "release": list(range(4097))}))
            reply = receive(sock, MAX_REPLY_BYTES)[0]
            assert reply["op"] == "error" and reply["code"] == "protocol" and "at most 4096" in reply["message"]
        with FeedClient(service.address) as client:
            assert client.next_batch()["__key__"]


def test_a_client_refuses_a_tensor_reference_outside_its_segment() -> None:
    import mmap

    from omnifeed.loader.service._arena import _REF, DTYPES
    from omnifeed.trainer_adapter._segments import SegmentView

    def reference(offset: int, dtype: str, shape: tuple[int, ...], slot: int = 3) -> bytes:
        return _REF.pack(slot, 7, offset, DTYPES.index(dtype), len(shape)) + struct.pack(f"<{len(shape)}q", *shape)

    mapped = mmap.mmap(-1, 4096)
    view = SegmentView(mapped, 3, 7)
    assert tuple(view.tensor(reference(4096 - 64, "float32", (4, 4))).shape) == (4, 4)  # the last 64 bytes: fine
    for ref in (
        reference(4096 - 60, "float32", (4, 4)),  # 4 bytes past the end
        reference(0, "uint8", (1 << 20,)),
        reference(2, "float32", (1,)),  # misaligned
        reference(0, "int64", (1 << 61, 1 << 3)),  # a size that overflows 64 bits
        reference(0, "uint8", (1,), slot=4),  # another segment's
        reference(0, "uint8", (1,))[:-3],
    ):  # cut
        with pytest.raises(ProtocolError):
            view.tensor(ref)


def test_the_services_bounds_are_on_by_default() -> None:
    from omnifeed.loader.service._config import ServiceConfig
    from omnifeed.loader.service._handshake import MAX_GRAD_ACCUM

    defaults = {name: field.default for name, field in ServiceConfig.model_fields.items()}
    assert defaults["frame_timeout_s"] <= 10 and defaults["idle_timeout_s"] <= 300
    assert defaults["max_micro_batches_per_step"] <= 65_536 and MAX_GRAD_ACCUM <= 4096
    assert defaults["max_clients"] <= 256 and defaults["max_micro_batches_dealt"] <= 16 * 65_536


# -- §1 shared memory is private -------------------------------------------------------------------------


def test_batch_segments_are_anonymous_memfds_not_inherited_by_child_processes() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    segment = Segment(0, 0, 1)
    try:
        assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith("/memfd:omnifeed-batch-0")
        assert not os.get_inheritable(segment.fd)
        assert set(os.listdir("/dev/shm")) == shm_before  # no name another process could open
    finally:
        segment.close()


def test_the_nvme_tier_is_private_to_the_user(tmp_path: Path) -> None:
    from omnifeed.cache._nvme import NvmeTier

    tier = NvmeTier(NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=2**24))
    try:
        for path in [tmp_path / "nvme", *(tmp_path / "nvme").iterdir()]:
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    finally:
        tier.close()


@pytest.mark.parametrize("planted", ["segment open to others", "lock open to others", "segment is a link"])
def test_the_ram_tier_refuses_a_segment_open_to_other_users(
    planted: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from omnifeed.cache import CacheChain, CacheConfig, CacheError
    from omnifeed.cache._ram import RamTier

    name = f"security-test-{os.getpid()}"
    path = Path("/dev/shm") / f"omnifeed-ram-{name}"
    lock = path.with_name(path.name + ".lock")
    config = RamTierConfig(name=name, capacity_bytes=2**20)
    RamTier(config).close()
    try:
        if planted == "segment is a link":  # as another user could have planted it (a link to a file of the victim)
            (tmp_path / "target").write_bytes(path.read_bytes())
            path.unlink()
            path.symlink_to(tmp_path / "target")
        else:
            (path if planted == "segment open to others" else lock).chmod(0o666)
        with pytest.raises(CacheError) as refused:
            RamTier(config).close()
        assert str(path if planted != "lock open to others" else lock) in str(refused.value)
        with caplog.at_level(logging.WARNING), CacheChain(CacheConfig(ram=config)) as chain:
            assert "ram" not in chain.tiers  # the chain runs without the tier
            assert chain.get(b"k" * 16, lambda: b"value") == b"value"
        assert "running without the RAM tier" in caplog.text and str(path) in caplog.text
    finally:
        path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)


@pytest.mark.parametrize("planted", ["data.mdb open to others", "secret is a link"])
def test_an_nvme_tier_file_others_can_write_or_a_link_is_refused(
    planted: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from omnifeed.cache import CacheChain, CacheConfig, CacheError
    from omnifeed.cache._nvme import NvmeTier

    folder = tmp_path / "nvme"
    folder.mkdir(mode=0o700)  # the user's own directory, closed to others: only the file is wrong
    if planted == "data.mdb open to others":
        (folder / "data.mdb").touch()
        (folder / "data.mdb").chmod(0o666)
        words = rf"{folder / 'data.mdb'} belongs to uid {os.getuid()}\b.* with mode 666"
    else:
        (tmp_path / "elsewhere").write_bytes(b"s" * 32)  # a secret the planter knows
        (folder / "secret").symlink_to(tmp_path / "elsewhere")
        words = rf"{folder / 'secret'} is not a regular file"
    config = NvmeTierConfig(path=str(folder), capacity_bytes=2**24)
    with pytest.raises(CacheError, match=words):
        NvmeTier(config)
    with caplog.at_level(logging.WARNING), CacheChain(CacheConfig(nvme=config)) as chain:
        assert "nvme" not in chain.tiers and chain.get(b"k" * 16, lambda: b"value") == b"value"
    assert "running without the NVMe tier" in caplog.text
    assert sorted(p.name for p in folder.iterdir()) == ["data.mdb" if "data" in planted else "secret"]  # nothing new


def test_a_socket_directory_open_to_others_is_refused_left_as_it_is_and_no_chmod_suggested(tmp_path: Path) -> None:
    from omnifeed.loader import OmnifeedError
    from omnifeed.loader.service._listener import private_directory

    folder = tmp_path / "sockets"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(OmnifeedError) as refused:
        private_directory(folder)
    message = str(refused.value)
    assert "\n" not in message and str(folder) in message and "mode 755" in message
    assert "a directory only you can write" in message and "chmod" not in message
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755  # never chmod-ed


def test_the_dataloaders_worker_batches_cross_in_shared_memory_no_other_process_can_open() -> None:
    import torch

    from omnifeed.loader import DataLoader

    class Pictures(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((4, 4), i, dtype=torch.uint8)

    def named_shared_mappings() -> set[str]:  # mappings another process could open by their name
        lines = Path("/proc/self/maps").read_text().splitlines()
        return {line.split()[-1] for line in lines if "/dev/shm/" in line and not line.endswith("(deleted)")}

    before = named_shared_mappings()
    loader = DataLoader(Pictures(), batch_size=2, num_workers=2)
    held = list(loader)  # held: every slot and segment is still mapped
    assert loader.metrics()["handoff"]["shared_memory"] >= 2
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    assert named_shared_mappings() - before == set()
    assert [int(b[0, 0, 0]) for b in held] == [0, 2, 4, 6]


def test_the_metrics_endpoint_binds_localhost_and_serves_no_sample_data(tmp_path: Path) -> None:
    import urllib.request

    from feed_service import short_socket_dir

    from omnifeed.loader import FeedConfig, PlanConfig
    from omnifeed.loader.service._config import ServiceConfig
    from omnifeed.loader.service._server import FeedService
    from omnifeed.trainer_adapter import FeedClient

    shard = _tar(tmp_path / "s.tar", [(f"privatekey{i}.txt", f"privatetext{i}".encode()) for i in range(8)])
    index = build_index([str(shard)], tmp_path / "index", IndexConfig(workers=1), progress=False).path
    config = ServiceConfig(
        index=str(index),
        feed=FeedConfig(plan=PlanConfig(seed=0, batch_size=2)),
        socket=str(short_socket_dir() / "feed.sock"),
        metrics_port=0,
    )
    assert ServiceConfig.model_fields["metrics_host"].default == "127.0.0.1"
    with FeedService(config) as service, FeedClient(service.address) as client:
        assert client.next_batch()["__key__"][0].startswith("privatekey")
        assert service._metrics_server.host == "127.0.0.1"
        page = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=30).read().decode()
    assert "omnifeed_samples_total" in page and "privatekey" not in page and "privatetext" not in page


# -- §4 paths stay inside their roots ---------------------------------------------------------------------


def _tar(path: Path, members: list[tuple[str, bytes | str]]) -> Path:
    """Members as given; bytes are a regular file, a str is a symbolic link to it ('hard:' prefix: a hard link)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if isinstance(content, str):
                info.type = tarfile.LNKTYPE if content.startswith("hard:") else tarfile.SYMTYPE
                info.linkname = content.removeprefix("hard:")
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return path


@pytest.mark.parametrize("member", ["../../etc/passwd.txt", "/etc/passwd.txt", "a/../../b.txt", "..\\..\\c.txt"])
def test_a_tar_member_escaping_the_shard_is_refused_naming_the_shard_and_member(tmp_path: Path, member: str) -> None:
    shard = _tar(tmp_path / "evil.tar", [("ok.txt", b"fine"), (member, b"root:x:0:0")])
    with pytest.raises(SourceError, match=r"evil\.tar: member .* escapes its root") as caught:
        scan_shard(ShardSpec(str(shard), "tar"), IndexConfig())
    assert repr(member) in str(caught.value)
    good = _tar(tmp_path / "good.tar", [("a.txt", b"a")])
    report = build_index([str(good), str(shard)], tmp_path / "index", IndexConfig(workers=1), progress=False)
    assert report.num_samples == 1 and repr(member) in report.errors[0]["error"]  # the shard is left out


def test_tar_links_are_never_followed(tmp_path: Path) -> None:
    shard = _tar(
        tmp_path / "links.tar",
        [("a.txt", b"mine"), ("a.json", "/etc/passwd"), ("a.cls", "hard:a.txt"), ("b.txt", "../../etc/shadow")],
    )
    scan = scan_shard(ShardSpec(str(shard), "tar"), IndexConfig())
    assert [(s.key, [f.name for f in s.fields]) for s in scan.samples] == [("a", ["txt"])]


def test_a_folder_file_linking_outside_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("secret")
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("mine")
    (folder / "sub" / "b.txt").symlink_to(folder / "a.txt")  # inside the folder: fine
    assert len(scan_shard(ShardSpec(str(folder), "folder"), IndexConfig()).samples) == 2
    (folder / "c.txt").symlink_to(tmp_path / "outside" / "secret.txt")
    with pytest.raises(SourceError, match=r"folder: 'c\.txt' is a symbolic link to .*secret\.txt, outside the folder"):
        scan_shard(ShardSpec(str(folder), "folder"), IndexConfig())
    (folder / "c.txt").unlink()
    (folder / "d.jpg").symlink_to(tmp_path / "outside")  # a linked folder is no way out either
    with pytest.raises(SourceError, match="outside the folder"):
        scan_shard(ShardSpec(str(folder), "folder"), IndexConfig())


def test_a_folder_file_replaced_by_an_outside_link_after_indexing_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("secret")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("mine!!")
    scan = scan_shard(ShardSpec(str(folder), "folder"), IndexConfig())
    (folder / "a.txt").unlink()
    (folder / "a.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(SourceError, match="symbolic link to .*outside the folder"):
        read_field(scan.shard, scan.samples[0].fields[0])
    with pytest.raises(SourceError, match="escapes the folder"):
        read_field(scan.shard, FieldLocation("txt", "text", "../secret.txt", 0, 6))


@pytest.fixture()
def index_dir(tmp_path: Path) -> Path:
    shard = _tar(tmp_path / "s.tar", [(f"k{i}.txt", b"text") for i in range(4)])
    return build_index([str(shard)], tmp_path / "index", IndexConfig(workers=1, partitions=2), progress=False).path


def test_an_index_names_no_file_outside_its_directory(index_dir: Path) -> None:
    manifest = json.loads((index_dir / "manifest.json").read_text())
    manifest["partitions"][0]["file"] = "../../elsewhere/part-00000.parquet"
    (index_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexFormatError, match="'partitions' is not a list of"):
        SampleIndex(index_dir)


def test_an_index_names_its_shards_by_absolute_path_or_url(index_dir: Path) -> None:
    table = pq.read_table(index_dir / "shards.parquet")
    assert all(url.startswith("/") for url in table["url"].to_pylist())
    table = table.set_column(table.schema.get_field_index("url"), "url", pa.array(["../data/s.tar"]))
    pq.write_table(table, index_dir / "shards.parquet")
    with pytest.raises(IndexFormatError, match=r"shard path '\.\./data/s\.tar' is relative"):
        SampleIndex(index_dir)


def test_index_out_keeps_a_file_written_into_it_while_the_index_was_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from omnifeed.loader.index import _out_dir

    shard = _tar(tmp_path / "s.tar", [(f"k{i}.txt", b"text") for i in range(4)])
    out = build_index([str(shard)], tmp_path / "index", IndexConfig(workers=1), progress=False).path
    checked = _out_dir.index_files_to_replace

    def check_then_a_write(folder: Path) -> list[str]:  # someone writes into the index just after its last check
        names = checked(folder)
        (folder / "late.txt").write_text("mine")
        return names

    monkeypatch.setattr(_out_dir, "index_files_to_replace", check_then_a_write)
    with caplog.at_level(logging.WARNING):
        assert build_index([str(shard)], out, IndexConfig(workers=1), progress=False).num_samples == 4
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith(".index.old-")]
    assert [p.name for p in aside.iterdir()] == ["late.txt"] and (aside / "late.txt").read_text() == "mine"
    assert "they are kept in" in caplog.text and str(aside) in caplog.text
    assert SampleIndex(out).num_samples == 4


# -- §5 decompression bombs and other guards ------------------------------------------------------------


def _png_bomb(side: int) -> bytes:
    """A real 1-bit ``side × side`` PNG of zeros: tens of KB that would decode to ``side²`` bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer = zlib.compressobj(9)
    row = b"\0" * (1 + (side + 7) // 8)
    body = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("side", [12_000, 30_000])  # over image.max_pixels; over Pillow's own 2 × MAX_IMAGE_PIXELS
def test_a_png_bomb_is_refused_naming_the_key_without_allocating_its_pixels(
    side: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PIL import ImageFile

    bomb = _png_bomb(side)
    assert len(bomb) < 128 * 1024
    loads: list[object] = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: loads.append(image))  # where pixels are allocated
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(DecodeError, match="sample 'bomb-key'") as caught:
        make_decoder("image", DecodeConfig())(bomb, "bomb-key")
    assert caught.value.reason == "bomb" and caught.value.key == "bomb-key"
    assert loads == []  # refused from the header
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # its pixels: 144 MB or 900 MB


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_png_bomb_in_a_shard_is_refused_at_index_time_naming_the_member(tmp_path: Path) -> None:
    shard = _tar(tmp_path / "bombs.tar", [("big.png", _png_bomb(12_000))])
    with pytest.raises(SourceError, match=r"bombs\.tar: member 'big\.png' of sample 'big'.*decompression bomb"):
        scan_shard(ShardSpec(str(shard), "tar"), IndexConfig())


def _h264(width: int, height: int, frames: int) -> bytes:
    """A raw H.264 elementary stream (its own SPS: a stream concatenated after it changes the frame size)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="h264") as out:
        stream = out.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.options = {"threads": "1"}
        for i in range(frames):
            picture = av.VideoFrame.from_ndarray(np.full((height, width, 3), 40 * i, np.uint8), format="rgb24")
            out.mux(stream.encode(picture))
        out.mux(stream.encode())
    return buffer.getvalue()


def test_a_video_whose_frames_grow_past_max_pixels_mid_stream_is_refused() -> None:
    clip = _h264(64, 48, 2) + _h264(1280, 720, 2)  # the header (first SPS) says 64x48
    decoder = make_decoder("video", DecodeConfig.model_validate({"video": {"max_pixels": 64 * 48 * 4}}))
    with pytest.raises(DecodeError, match=r"frames of 1280x720 in the stream, over max_pixels = 12288") as caught:
        decoder(clip, "k")
    assert caught.value.reason == "bomb"
    larger = make_decoder("video", DecodeConfig.model_validate({"video": {"max_pixels": 1280 * 720}}))
    assert larger(clip, "k").shape[0] == 4


def test_video_packets_are_bounded_by_twice_the_file_size_while_demuxing(monkeypatch: pytest.MonkeyPatch) -> None:
    import av

    from omnifeed.loader.decode import _video

    clip = _h264(64, 48, 4)
    budgets: list[int] = []
    demux = _video._demux
    monkeypatch.setattr(_video, "_demux", lambda *args: budgets.append(args[2]) or demux(*args))
    assert make_decoder("video", DecodeConfig())(clip, "k").shape[0] == 4
    assert budgets == [2 * len(clip) + 2**20]
    with av.open(io.BytesIO(clip)) as container:  # packets adding up to more are refused as they are demuxed
        with pytest.raises(DecodeError, match="packets add up to more than 100 bytes") as caught:
            demux(container, container.streams.video[0], 100, "k")
    assert caught.value.reason == "bomb"


def test_every_decoder_has_a_guard_on_by_default() -> None:
    config = DecodeConfig()
    assert config.image.max_pixels <= 89_478_485  # Pillow's MAX_IMAGE_PIXELS
    assert config.video.max_pixels <= 7680 * 4320 and config.video.max_decoded_frames <= 10_000
    assert config.video.max_frames <= 64 and config.audio.max_seconds <= 600
    assert set(config.image.formats) <= {"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"}  # never EPS (Ghostscript)


def test_an_image_outside_the_default_formats_is_refused_without_running_its_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from PIL import EpsImagePlugin

    parsed: list[object] = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda image: parsed.append(image))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(DecodeError) as caught:
        make_decoder("image", DecodeConfig())(eps, "k")
    assert caught.value.reason == "corrupt" and parsed == []
    with pytest.raises(DecodeError):  # were EPS allowed, its parser (and so Ghostscript) would run
        make_decoder("image", DecodeConfig.model_validate({"image": {"formats": ["EPS"]}}))(eps, "k")
    assert parsed


def test_audio_whose_header_hides_its_length_is_stopped_while_decoding() -> None:
    flac = bytearray(encode_flac(3.0, 16000, 1))
    flac[8 + 13] &= 0xF0  # STREAMINFO's total samples (36 bits) := 0, "unknown"
    flac[8 + 14 : 8 + 18] = b"\0\0\0\0"
    with pytest.raises(DecodeError, match="samples after resampling") as caught:
        make_decoder("audio", DecodeConfig.model_validate({"audio": {"max_seconds": 1.0}}))(bytes(flac), "k")
    assert caught.value.reason == "too_long"


def test_a_text_field_is_bounded_by_its_member_size_and_max_tokens() -> None:
    decoder = make_decoder("text", DecodeConfig.model_validate({"text": {"max_tokens": 8, "tokenizer": "bytes"}}))
    with pytest.raises(DecodeError, match="over max_tokens = 8"):
        decoder(b"x" * 9, "k")
    assert np.array_equal(decoder(b"x" * 8, "k")[1], np.full(8, ord("x")))
    with pytest.raises(DecodeError) as caught:  # strict UTF-8: never replaced or cut silently
        decoder("naïve".encode("latin-1"), "k")
    assert caught.value.reason == "encoding"


def test_a_service_refused_at_start_leaves_the_running_services_socket_alone(index_dir: Path, tmp_path: Path) -> None:
    import shutil

    from feed_service import short_socket_dir, start_service

    from omnifeed.loader import OmnifeedError
    from omnifeed.loader.service._config import ServiceConfig
    from omnifeed.loader.service._protocol import request_metrics
    from omnifeed.loader.service._server import FeedService

    path = short_socket_dir() / "feed.sock"
    running = start_service(index_dir, path, tmp_path / "a.jsonl")
    try:
        second = FeedService(ServiceConfig(index=str(index_dir), socket=str(path)))
        with pytest.raises(OmnifeedError):
            second.start()  # a live service is there
        second.stop()
        assert path.exists()
        assert request_metrics(str(path))["clients"] is not None
    finally:
        running.stop()
        shutil.rmtree(path.parent, ignore_errors=True)
