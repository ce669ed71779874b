"""`omnifeed stats`: the table names what limits throughput, from two synthetic snapshots; the command's errors."""

from __future__ import annotations

import copy
import importlib
import json
import types
from typing import Any

import pytest

from omnifeed.tools._cli import main
from omnifeed.tools._stats import render_stats
from omnifeed.tools._stats_limit import limiting, wait_share


def snapshot(
    elapsed: float,
    *,
    waited: float,
    samples: int,
    image: dict[str, Any],
    remote_reads: int = 0,
    remote_p95: float = 0.01,
    degraded: bool = False,
) -> dict[str, Any]:
    """Two clients that each waited ``waited`` seconds so far; one image modality as given."""
    return {
        "service": {
            "uptime_s": elapsed + 1,
            "protocol": 1,
            "index_fingerprint": "fp",
            "clients": 2,
            "streams": 2,
            "segments": 1,
            "segment_bytes": 1 << 20,
        },
        "elapsed_s": elapsed,
        "batches": samples // 8,
        "samples": samples,
        "samples_per_s": samples / elapsed,
        "bytes_read": 0,
        "consumer_wait_s": 2 * waited,
        "bad_samples": 0,
        "modalities": {
            "image": {
                "decoded": samples,
                "decoded_per_s": samples / elapsed,
                "decode_latency_s": {"p50": 0.03, "p90": 0.05, "p99": 0.08},
                "bad": {},
                **image,
            },
            "text": {
                "buffer_samples": 500,
                "buffer_bytes": 9000,
                "queued": 0,
                "decoded": samples,
                "decode_latency_s": {"p50": 0.001, "p90": 0.001, "p99": 0.002},
                "bad": {},
            },
        },
        "cache": {
            "ram": {"hits": samples, "misses": samples, "bytes_hit": 1000, "bytes_used": 10, "capacity_bytes": 100},
            "remote": {
                "reads": remote_reads,
                "bytes": remote_reads * 1000,
                "errors": 0,
                "degraded": degraded,
                "latency_s": {"p50": remote_p95 / 2, "p95": remote_p95, "p99": remote_p95 * 2},
            },
        },
        "storage_degraded": degraded,
        "read_ahead": 4 if degraded else 1,
        "clients": [
            {
                "client": f"c{r}",
                "rank": r,
                "dp_rank": r,
                "dp_world_size": 2,
                "batches": samples // 16,
                "waited_s": waited,
                "last_wait_s": 0.1,
            }
            for r in range(2)
        ],
        "resizes": 0,
        "resize_seconds": 0.0,
    }


def test_decode_limited_names_the_modality_with_its_queue_and_empty_buffer() -> None:
    before = snapshot(10, waited=1.0, samples=800, image={"buffer_samples": 0, "queued": 100})
    after = snapshot(20, waited=4.5, samples=1000, image={"buffer_samples": 0, "queued": 120})
    text = render_stats(after, before)
    assert text.splitlines()[-1] == (
        "clients waited 35% of the last interval; limiting: image decode (queue 120, buffer empty, p50 30 ms)"
    )
    assert wait_share(after, before) == pytest.approx(0.35)


def test_storage_limited_names_the_remote_latency_and_degraded_flag() -> None:
    before = snapshot(10, waited=2.0, samples=400, image={"buffer_samples": 0, "queued": 0}, remote_reads=100)
    after = snapshot(
        20,
        waited=7.0,
        samples=500,
        image={"buffer_samples": 0, "queued": 0},
        remote_reads=200,
        remote_p95=0.42,
        degraded=True,
    )
    last = render_stats(after, before).splitlines()[-1]
    assert last.startswith("clients waited 50% of the last interval; limiting: storage (remote p95 420 ms")
    assert "degraded" in last and "image buffer empty" in last


def test_idle_workers_with_origin_reads_are_storage_limited_even_when_not_degraded() -> None:
    before = snapshot(
        10, waited=2.0, samples=400, image={"buffer_samples": 0, "queued": 1}, remote_reads=100, remote_p95=0.08
    )
    after = snapshot(
        20, waited=7.0, samples=500, image={"buffer_samples": 0, "queued": 1}, remote_reads=200, remote_p95=0.08
    )  # reads (80 ms) slower than decoding (30 ms): the decoders wait for storage
    assert "limiting: storage (remote p95 80 ms" in limiting(after, before)


def test_a_starved_modality_that_decodes_slower_than_it_reads_is_decode_limited() -> None:
    before = snapshot(10, waited=2.0, samples=400, image={"buffer_samples": 0, "queued": 0}, remote_reads=100)
    after = snapshot(20, waited=7.0, samples=500, image={"buffer_samples": 0, "queued": 0}, remote_reads=200)
    # local files: read inside the decode task, so nothing queues; 30 ms decoding against 10 ms reads
    assert "limiting: image decode (buffer empty, queue 0, p50 30 ms against storage 10 ms" in limiting(after, before)


def test_clients_that_do_not_wait_make_the_trainer_the_bottleneck() -> None:
    before = snapshot(10, waited=0.1, samples=800, image={"buffer_samples": 0, "queued": 200}, degraded=True)
    after = snapshot(20, waited=0.3, samples=1800, image={"buffer_samples": 0, "queued": 200}, degraded=True)
    assert (
        render_stats(after, before).splitlines()[-1]
        == "clients do not wait (2% of the last interval): the trainer is the bottleneck"
    )


def test_without_a_previous_snapshot_the_share_is_since_the_start() -> None:
    now = snapshot(20, waited=10.0, samples=800, image={"buffer_samples": 3, "queued": 0})
    assert limiting(now, None).startswith("clients waited 50% since the start; limiting: delivery")


def test_a_previous_snapshot_from_before_a_restart_is_ignored() -> None:
    old = snapshot(500, waited=0.0, samples=90_000, image={"buffer_samples": 0, "queued": 50})
    now = snapshot(20, waited=10.0, samples=800, image={"buffer_samples": 0, "queued": 50})
    assert limiting(now, old).startswith("clients waited 50% since the start; limiting: image decode")


def test_nothing_queued_and_no_origin_reads_is_read_ahead() -> None:
    now = snapshot(20, waited=10.0, samples=800, image={"buffer_samples": 0, "queued": 0})
    assert "limiting: read-ahead (image buffer empty, queue 0" in limiting(now, None)


def test_a_sparse_snapshot_renders_without_failing() -> None:
    text = render_stats({"service": {"clients": 0}, "modalities": {"image": {}}}, {})
    assert text.splitlines()[-1] == "no clients connected"
    assert "image" in text


def test_the_remote_section_lists_where_each_actor_runs() -> None:
    node = "ab12cd34ef56" + "0" * 44
    actors = [
        {"node": node, "ip": "10.0.0.7", "pid": 4242, "state": "up", "decoded": 31, "lost": 0},
        {"node": "ffee" * 14, "ip": "10.0.0.8", "pid": 77, "state": "lost", "decoded": 5, "lost": 1},
    ]
    modality = {"workers": 1, "target": 2, "max_workers": 2, "decoded": 36, "lost": 1, "actors": actors}
    snap = {**snapshot(10, waited=1.0, samples=100, image={}), "remote": {"address": "h:6379", "connected": True}}
    snap["remote"]["modalities"] = {"video": modality}
    lines = render_stats(snap, None).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("actor of"))
    assert lines[header].split() == ["actor", "of", "node", "ip", "pid", "state", "decoded", "lost"]
    assert lines[header + 1].split() == ["video", "ab12cd34ef56", "10.0.0.7", "4242", "up", "31", "0"]
    assert lines[header + 2].split() == ["video", "ffeeffeeffee", "10.0.0.8", "77", "lost", "5", "1"]
    modality.pop("actors")
    assert "actor of" not in render_stats(snap, None)  # an older service's snapshot: no actor lines


def test_the_table_shows_rates_over_the_interval() -> None:
    before = snapshot(10, waited=1.0, samples=800, image={"buffer_samples": 0, "queued": 100})
    after = copy.deepcopy(before) | {"elapsed_s": 20.0, "samples": 1000}
    after["service"]["uptime_s"] = 21.0
    assert "samples/s 20.0" in render_stats(after, before)


@pytest.fixture
def wire() -> types.ModuleType:
    """``omnifeed.loader.service``, whose ``request_metrics`` the command line calls (tests replace it)."""
    return importlib.import_module("omnifeed.loader.service")


def test_stats_without_a_service_exits_1_with_the_reason(
    wire: types.ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    missing = tmp_path / "feed.sock"  # in a private directory: no service there, rather than an untrusted one
    assert main(["stats", "--socket", str(missing), "--once"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"omnifeed: error: no omnifeed service at {missing}: start it with `omnifeed serve --config FILE`"


def test_stats_once_prints_the_table_or_the_raw_snapshot(
    monkeypatch: pytest.MonkeyPatch, wire: types.ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    now = snapshot(20, waited=10.0, samples=800, image={"buffer_samples": 0, "queued": 50})
    monkeypatch.setattr(wire, "request_metrics", lambda address, timeout=5.0: now)
    assert main(["stats", "--socket", "/run/omnifeed.sock", "--once"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out and out.strip().splitlines()[-1].startswith("clients waited 50% since the start")
    assert main(["stats", "--socket", "/run/omnifeed.sock", "--once", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == now


@pytest.mark.parametrize("flags", [["--socket", "/run/a.sock"], ["--address", "/run/a.sock"], []])
def test_stats_takes_the_socket_as_serve_does_and_the_old_address_flag(
    monkeypatch: pytest.MonkeyPatch, wire: types.ModuleType, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    from omnifeed.loader.service._config import default_socket

    asked: list[str] = []
    monkeypatch.setattr(
        wire,
        "request_metrics",
        lambda address, timeout=5.0: (
            asked.append(address) or snapshot(1, waited=0.0, samples=1, image={"buffer_samples": 0, "queued": 0})
        ),
    )
    assert main(["stats", *flags, "--once", "--json"]) == 0
    assert asked == [flags[1] if flags else default_socket()]


def test_a_mixture_shows_a_rate_line_per_source_and_one_index_none() -> None:
    def sources(photos: int, docs: int) -> dict[str, Any]:
        return {
            "photos": {"samples": photos, "tokens": 10 * photos, "replaced": 1},
            "docs": {"samples": docs, "tokens": 500 * docs, "replaced": 0},
        }

    before = snapshot(10, waited=1.0, samples=800, image={}) | {"sources": sources(600, 200)}
    after = snapshot(20, waited=1.5, samples=1000, image={}) | {"sources": sources(760, 240)}
    rows = {line.split()[0]: line.split() for line in render_stats(after, before).splitlines() if line}
    assert rows["source"] == ["source", "samples/s", "tokens/s", "share", "replaced"]
    assert rows["photos"] == ["photos", "16.0", "160.0", "80%", "1"]
    assert rows["docs"] == ["docs", "4.0", "2000.0", "20%", "0"]
    assert "source" not in render_stats(snapshot(20, waited=1.5, samples=1000, image={}), None)
