"""The remote tier over a real HTTP server: ranged reads, retries, time-outs and the degraded-storage flag."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from range_http import RangeServer

from omnifeed.cache import RemoteTier, RemoteTierConfig, is_transient

pytest.importorskip("aiohttp")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RangeServer]:
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 64)
    with RangeServer(tmp_path).running() as running:
        yield running


def test_ranged_reads_return_exactly_the_bytes_asked(server: RangeServer) -> None:
    remote = RemoteTier(RemoteTierConfig(timeout_s=10))
    assert remote.read_range(f"{server.url}/blob.bin", 10, 5) == bytes(range(10, 15))
    assert remote.stats()["reads"] == 1
    remote.close()


def test_transient_errors_are_retried_until_the_read_succeeds(server: RangeServer) -> None:
    server.fail_fraction = 0.3
    remote = RemoteTier(RemoteTierConfig(timeout_s=10, retries=8, backoff_s=0.001))
    for offset in range(0, 4000, 100):
        assert remote.read_range(f"{server.url}/blob.bin", offset, 10) == (bytes(range(256)) * 64)[offset : offset + 10]
    assert server.failures > 0 and remote.stats()["retries"] == server.failures
    remote.close()


def test_a_permanent_outage_gives_up_naming_the_url(server: RangeServer) -> None:
    server.down = True
    remote = RemoteTier(RemoteTierConfig(timeout_s=10, retries=2, backoff_s=0.001))
    with pytest.raises(Exception) as caught:
        remote.read_range(f"{server.url}/blob.bin", 0, 10)
    assert is_transient(caught.value)
    assert any(
        "gave up after 3 attempts" in note and server.url in note for note in getattr(caught.value, "__notes__", [])
    )
    remote.close()


def test_a_missing_file_is_not_retried(server: RangeServer) -> None:
    remote = RemoteTier(RemoteTierConfig(timeout_s=10, retries=3))
    with pytest.raises(FileNotFoundError):
        remote.read_range(f"{server.url}/nope.bin", 0, 10)
    assert remote.stats()["retries"] == 0
    remote.close()


def test_a_stuck_read_times_out_and_is_retried(server: RangeServer) -> None:
    server.delay_s = 1.0
    remote = RemoteTier(RemoteTierConfig(timeout_s=0.1, retries=1, backoff_s=0.001))
    with pytest.raises(TimeoutError, match="cache.remote.timeout_s"):
        remote.read_range(f"{server.url}/blob.bin", 0, 10)
    assert remote.stats()["timeouts"] == 2
    remote.close()


def test_latency_flips_the_degraded_flag_and_back(server: RangeServer, caplog: pytest.LogCaptureFixture) -> None:
    # a wide gap between slow (0.4 s) and fast (local, well under 0.1 s even on a busy machine)
    remote = RemoteTier(RemoteTierConfig(timeout_s=10, latency_window=16, degraded_latency_s=0.2))
    url = f"{server.url}/blob.bin"
    with caplog.at_level(logging.WARNING):
        for _ in range(24):
            remote.read_range(url, 0, 10)
        assert not remote.degraded
        server.delay_s = 0.4
        for _ in range(12):  # the window is checked every 8 reads: half slow by the 8th, flipped then
            remote.read_range(url, 0, 10)
        assert remote.degraded and remote.stats()["latency_s"]["p95"] > 0.2
        server.delay_s = 0.0
        for _ in range(24):
            remote.read_range(url, 0, 10)
        assert not remote.degraded
    assert "remote storage degraded" in caplog.text and "remote storage recovered" in caplog.text
    assert remote.stats()["degraded_changes"] == 2
    remote.close()
