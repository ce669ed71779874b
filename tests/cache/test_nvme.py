"""The NVMe tier: LMDB on local disk, byte-bounded, checksummed, shared by processes, degrading on a full disk."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omnifeed.cache import CacheChain, CacheConfig, NvmeTier, NvmeTierConfig, entry_key


def key(i: int) -> bytes:
    return entry_key("test", str(i), "f", "raw")


def value(i: int, size: int = 5000) -> bytes:
    return random.Random(i).randbytes(size)


def test_round_trip_persists_across_processes(tmp_path: Path) -> None:
    config = NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=8 * 2**20)
    with NvmeTier(config) as tier:
        for i in range(20):
            assert tier.put(key(i), value(i))
        assert tier.get(key(3)) == value(3) and tier.get(key(99)) is None
    script = textwrap.dedent(f"""
        from omnifeed.cache import NvmeTier, NvmeTierConfig, entry_key
        import random
        tier = NvmeTier(NvmeTierConfig(path={str(tmp_path / "nvme")!r}, capacity_bytes=8 * 2**20))
        ok = all(tier.get(entry_key("test", str(i), "f", "raw")) == random.Random(i).randbytes(5000) for i in range(20))
        print(ok, tier.stats()["entries"])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "20"]


def test_byte_budget_holds_under_churn(tmp_path: Path) -> None:
    capacity = 2**20
    rng = random.Random(0)
    with NvmeTier(NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=capacity)) as tier:
        for _ in range(1500):
            i = rng.randrange(400)
            got = tier.get(key(i))
            if got is None:
                tier.put(key(i), value(i, 500 + i * 30))
            else:
                assert got == value(i, 500 + i * 30)
            assert tier.stats()["bytes_used"] <= capacity
        stats = tier.stats()
        assert stats["evicted"] > 0 and stats["hits"] > 0
        assert len(list(tier.keys())) == stats["entries"]


def _flip_value_bytes(data_file: Path, needle: bytes) -> None:
    raw = bytearray(data_file.read_bytes())
    at = raw.find(needle)
    assert at >= 0, "the entry's bytes are in the LMDB file"
    raw[at + 10] ^= 0xFF
    with open(data_file, "r+b") as f:  # in place: the environment maps this file
        f.seek(at + 10)
        f.write(raw[at + 10 : at + 11])


def test_a_corrupt_entry_is_detected_dropped_and_refetched(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nvme = NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=8 * 2**20)
    origin_reads = []

    def fetch() -> bytes:
        origin_reads.append(1)
        return value(1)

    with CacheChain(CacheConfig(nvme=nvme)) as chain:
        assert chain.get(key(1), fetch) == value(1)
        assert chain.get(key(1), fetch) == value(1) and len(origin_reads) == 1
        _flip_value_bytes(tmp_path / "nvme" / "data.mdb", value(1)[:64])
        with caplog.at_level(logging.WARNING):
            assert chain.get(key(1), fetch) == value(1)  # never the corrupt bytes
        assert len(origin_reads) == 2
        assert "failed its checksum" in caplog.text
        stats = chain.stats()["nvme"]
        assert stats["corrupt"] == 1
        assert chain.get(key(1), fetch) == value(1) and len(origin_reads) == 2  # the refetched copy is cached


def test_a_discarded_entry_is_stored_anew_by_the_next_put(tmp_path: Path) -> None:
    """A reader that found an entry unusable (a decoded entry it cannot parse) discards it: the next put replaces it."""
    with NvmeTier(NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=8 * 2**20)) as tier:
        assert tier.put(key(1), b"unusable")
        assert tier.put(key(1), value(1)) and tier.get(key(1)) == b"unusable"  # a put keeps what is held
        tier.discard(key(1))
        assert tier.get(key(1)) is None and tier.stats()["entries"] == 0
        assert tier.put(key(1), value(1)) and tier.get(key(1)) == value(1)
        tier.discard(key(2))  # nothing held: nothing happens


def test_the_map_grows_when_it_fills(tmp_path: Path) -> None:
    with NvmeTier(NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 * 2**20)) as tier:
        assert tier.put(key(0), value(0))
        tier._env.set_mapsize(2**20)  # as if the map had been sized for less
        for i in range(1, 40):
            assert tier.put(key(i), value(i, 100_000))
        assert tier.stats()["map_grown"] >= 1
        assert all(tier.get(key(i)) == value(i, 100_000) for i in range(1, 40))


def test_a_map_that_cannot_grow_degrades_to_pass_through(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = CacheConfig(
        nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 * 2**20, max_map_bytes=2**20)
    )
    with caplog.at_level(logging.WARNING), CacheChain(config) as chain:
        for i in range(40):
            assert chain.get(key(i), lambda i=i: value(i, 100_000)) == value(i, 100_000)
        stats = chain.stats()["nvme"]
        assert stats["degraded"] and "max_map_bytes" in stats["degraded"]
        held = [i for i in range(40) if chain.tiers["nvme"].get(key(i)) is not None]
        assert held and all(chain.tiers["nvme"].get(key(i)) == value(i, 100_000) for i in held)
    assert caplog.text.count("stops caching") == 1


_FULL_DISK = textwrap.dedent("""
    import json, random, resource, signal, sys
    from omnifeed.cache import CacheChain, CacheConfig, NvmeTierConfig, entry_key
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like ENOSPC
    path = sys.argv[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 2**20, 2 * 2**20))
    chain = CacheChain(CacheConfig(nvme=NvmeTierConfig(path=path, capacity_bytes=64 * 2**20)))
    served = []
    for i in range(60):
        data = random.Random(i).randbytes(100_000)
        served.append(chain.get(entry_key("t", str(i), "f", "raw"), lambda d=data: d) == data)
    print(json.dumps({"served": all(served), "degraded": chain.stats()["nvme"]["degraded"]}))
""")


def test_a_full_disk_degrades_to_pass_through_without_corruption(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["served"] and report["degraded"]
    assert done.stderr.count("stops caching") == 1
    with NvmeTier(NvmeTierConfig(path=str(path), capacity_bytes=64 * 2**20)) as tier:  # still a sound database
        for k in tier.keys():
            assert tier.get(k) is not None
        assert tier.stats()["corrupt"] == 0


def _writer(path: str, seed: int, out: multiprocessing.Queue) -> None:
    tier = NvmeTier(NvmeTierConfig(path=path, capacity_bytes=2**20))
    rng = random.Random(seed)
    wrong = 0
    for _ in range(400):
        i = rng.randrange(200)
        got = tier.get(key(i))
        if got is None:
            tier.put(key(i), value(i, 2000 + 50 * i))
        elif got != value(i, 2000 + 50 * i):
            wrong += 1
    out.put(wrong)
    tier.close()


def test_two_jobs_sharing_a_directory_do_not_corrupt_it(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    jobs = [context.Process(target=_writer, args=(str(tmp_path / "nvme"), seed, out)) for seed in range(2)]
    for job in jobs:
        job.start()
    wrong = [out.get(timeout=120) for _ in jobs]
    for job in jobs:
        job.join(60)
    assert wrong == [0, 0] and [job.exitcode for job in jobs] == [0, 0]
    with NvmeTier(NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=2**20)) as tier:
        stats = tier.stats()
        assert stats["bytes_used"] <= 2**20 and stats["entries"] == len(list(tier.keys()))


def test_a_tier_reopens_after_fork_and_pickling(tmp_path: Path) -> None:
    tier = NvmeTier(NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=8 * 2**20))
    tier.put(key(1), value(1))
    copy = pickle.loads(pickle.dumps(tier))
    assert copy.get(key(1)) == value(1)
    pid = os.fork()
    if pid == 0:  # the child must open its own environment, not use the parent's
        os._exit(0 if tier.get(key(1)) == value(1) and tier.put(key(2), value(2)) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tier.get(key(2)) == value(2)
    copy.close()
    tier.close()


def test_another_capacity_in_another_process_does_not_break_a_running_tier(tmp_path: Path) -> None:
    path = str(tmp_path / "nvme")
    with NvmeTier(NvmeTierConfig(path=path, capacity_bytes=2**30)) as tier:
        tier.put(key(1), value(1))
        script = (
            "from omnifeed.cache import NvmeTier, NvmeTierConfig; "
            f"t = NvmeTier(NvmeTierConfig(path={path!r}, capacity_bytes=2**20)); print(t.stats()['degraded'])"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
        assert out.strip() == "None"
        assert tier.get(key(1)) == value(1)  # the shared sketch was not resized under this mapping
        assert tier.put(key(2), value(2)) and tier.get(key(2)) == value(2)


# -- owned or refused; entries keyed with the cache's secret (docs/security.md §1) ------------------------


def test_a_directory_others_can_write_is_refused_and_the_chain_runs_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "nvme"
    folder.mkdir()
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING), CacheChain(CacheConfig(nvme=NvmeTierConfig(path=str(folder)))) as chain:
        assert "nvme" not in chain.tiers
        assert chain.get(key(1), lambda: value(1)) == value(1)
    assert "running without the NVMe tier" in caplog.text and str(folder) in caplog.text and "mode 777" in caplog.text
    assert list(folder.iterdir()) == []  # nothing was written into it


def test_a_new_tier_is_private_with_a_secret_and_a_linked_path_of_ones_own_is_fine(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real").mkdir(mode=0o700)
    with NvmeTier(NvmeTierConfig(path=str(tmp_path / "link"), capacity_bytes=8 * 2**20)) as tier:
        assert tier.put(key(1), value(1)) and tier.get(key(1)) == value(1)
    secret = tmp_path / "real" / "secret"
    assert len(secret.read_bytes()) == 32 and secret.stat().st_mode & 0o777 == 0o600
    for name in ("data.mdb", "lock.mdb", "sketch.bin"):
        assert (tmp_path / "real" / name).stat().st_mode & 0o077 == 0, name


def test_a_tier_under_a_folder_others_can_write_is_refused_and_under_a_sticky_one_is_fine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Another user could rename the private folder away and put one of theirs in its place between
    # the check and LMDB opening it by name: the folders above must be stable too.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "mine").mkdir(mode=0o700)
    with (
        caplog.at_level(logging.WARNING),
        CacheChain(CacheConfig(nvme=NvmeTierConfig(path=str(shared / "mine")))) as chain,
    ):
        assert "nvme" not in chain.tiers
        assert chain.get(key(1), lambda: value(1)) == value(1)
    assert f"{shared} (of" in caplog.text and "mode 777" in caplog.text and "sticky" in caplog.text
    assert list((shared / "mine").iterdir()) == []
    shared.chmod(0o1777)  # as /tmp: only the owner of a folder in it can rename it
    with NvmeTier(NvmeTierConfig(path=str(shared / "mine"), capacity_bytes=8 * 2**20)) as tier:
        assert tier.degraded is None
        assert tier.put(key(1), value(1)) and tier.get(key(1)) == value(1)


def _forge(folder: Path, entry: bytes, forged: bytes) -> None:
    """Write ``forged`` as the entry, as a writer without the secret would: with the unkeyed checksum."""
    import lmdb
    import xxhash

    env = lmdb.open(str(folder), max_dbs=4)
    with env.begin(write=True) as txn:
        checksum = xxhash.xxh3_64_digest(forged, seed=int.from_bytes(entry[:8], "little"))
        txn.put(entry, checksum + forged, db=env.open_db(b"data", txn=txn))
    env.close()


def test_an_entry_forged_without_the_secret_is_not_served(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nvme = NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=8 * 2**20)
    with CacheChain(CacheConfig(nvme=nvme)) as chain:
        assert chain.get(key(1), lambda: value(1)) == value(1)
    _forge(tmp_path / "nvme", key(1), b"the attacker's bytes" * 100)
    fetched = []
    with caplog.at_level(logging.WARNING), CacheChain(CacheConfig(nvme=nvme)) as chain:
        assert chain.get(key(1), lambda: fetched.append(1) or value(1)) == value(1)  # refetched, never the forgery
        assert chain.stats()["nvme"]["corrupt"] == 1
    assert fetched == [1] and "failed its checksum" in caplog.text


def test_a_cache_without_a_secret_gets_one_and_drops_its_entries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvme = NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=8 * 2**20)
    with NvmeTier(nvme) as tier:
        assert tier.put(key(1), value(1)) and tier.put(key(2), value(2))
    (tmp_path / "nvme" / "secret").unlink()  # as a cache an earlier version wrote
    with caplog.at_level(logging.WARNING), NvmeTier(nvme) as tier:
        assert tier.stats()["entries"] == 0 and tier.get(key(1)) is None
        assert tier.put(key(1), value(1)) and tier.get(key(1)) == value(1)
    assert "dropped its 2 entries" in caplog.text
