"""The service's Prometheus endpoint: scraped over HTTP from a synthetic snapshot, parsed with prometheus_client."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omnifeed.loader.service._metric_specs import METRICS
from omnifeed.loader.service._metrics import MetricsServer, start_metrics_server
from omnifeed.loader.service._metrics_collector import ServiceCollector, quantile_label

SNAPSHOT: dict[str, Any] = {
    "service": {
        "uptime_s": 12.5,
        "protocol": 1,
        "index_fingerprint": "fp123",
        "clients": 2,
        "streams": 2,
        "segments": 3,
        "segment_bytes": 4096,
    },
    "elapsed_s": 10.0,
    "batches": 40,
    "samples": 320,
    "samples_per_s": 32.0,
    "bytes_read": 10_000,
    "consumer_wait_s": 1.5,
    "bad_samples": 3,
    "modalities": {
        "image": {
            "buffer_samples": 7,
            "buffer_bytes": 7000,
            "queued": 120,
            "decoded": 300,
            "decoded_per_s": 30.0,
            "decode_latency_s": {"p50": 0.02, "p90": 0.05, "p99": 0.1},
            "bad": {"decode": 2, "read": 1},
        },
        "text": {
            "decoded": 320,
            "decoded_per_s": 32.0,
            "decode_latency_s": {"p50": 0.001, "p90": 0.002, "p99": 0.003},
            "bad": {},
        },
    },
    "cache": {
        "ram": {
            "hits": 30,
            "misses": 10,
            "bytes_hit": 3000,
            "puts": 10,
            "bytes_put": 1000,
            "rejected": 1,
            "evicted": 2,
            "reinserted": 0,
            "too_large": 0,
            "entries": 8,
            "bytes_used": 800,
            "capacity_bytes": 8192,
            "resets": 0,
        },
        "nvme": {
            "hits": 5,
            "misses": 5,
            "bytes_hit": 500,
            "degraded": "disk full",
            "entries": 1,
            "bytes_used": 10,
            "capacity_bytes": 1 << 30,
        },
        "remote": {
            "reads": 5,
            "bytes": 5000,
            "retries": 1,
            "timeouts": 0,
            "errors": 2,
            "degraded": True,
            "degraded_changes": 1,
            "latency_s": {"p50": 0.1, "p95": 0.42, "p99": 0.9},
            "window": 5,
        },
    },
    "storage_degraded": True,
    "read_ahead": 4,
    "clients": [
        {
            "client": "host-a:17",
            "rank": 0,
            "dp_rank": 0,
            "dp_world_size": 2,
            "batches": 20,
            "waited_s": 1.0,
            "last_wait_s": 0.05,
        },
        {
            "client": "host-a:18",
            "rank": 1,
            "dp_rank": 1,
            "dp_world_size": 2,
            "batches": 20,
            "waited_s": 0.5,
            "last_wait_s": 0.0,
        },
    ],
    "resizes": 1,
    "resize_seconds": 2.5,
}


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[MetricsServer] = []

    def start(snapshot: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        server, port = start_metrics_server(snapshot, 0)
        servers.append(server)
        assert port == server.port and port > 0
        return scrape(port)

    yield start
    for server in servers:
        server.shutdown()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def labels(**kw: Any) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, str(v)) for k, v in kw.items()))


def test_a_full_snapshot_scrapes_into_typed_labelled_families(serve: Any) -> None:
    got = serve(lambda: SNAPSHOT)
    assert got[("omnifeed_snapshot_ok", ())] == 1
    assert got[("omnifeed_service_info", labels(protocol=1, index_fingerprint="fp123"))] == 1
    assert got[("omnifeed_service_streams", ())] == 2 and got[("omnifeed_service_segment_bytes", ())] == 4096
    assert got[("omnifeed_samples_total", ())] == 320 and got[("omnifeed_samples_per_second", ())] == 32
    assert got[("omnifeed_buffer_samples", labels(modality="image"))] == 7
    assert got[("omnifeed_queued_tasks", labels(modality="image"))] == 120
    assert got[("omnifeed_decoded_total", labels(modality="text"))] == 320
    assert got[("omnifeed_decode_latency_seconds", labels(modality="image", quantile="0.99"))] == 0.1
    assert got[("omnifeed_bad_samples_total", labels(modality="image", reason="read"))] == 1
    assert got[("omnifeed_cache_hits_total", labels(tier="ram"))] == 30
    assert got[("omnifeed_cache_hit_ratio", labels(tier="ram"))] == 0.75
    assert got[("omnifeed_cache_hit_bytes_total", labels(tier="nvme"))] == 500
    assert got[("omnifeed_cache_degraded", labels(tier="nvme"))] == 1
    assert got[("omnifeed_storage_latency_seconds", labels(quantile="0.95"))] == 0.42
    assert got[("omnifeed_storage_degraded", ())] == 1 and got[("omnifeed_storage_read_bytes_total", ())] == 5000
    assert got[("omnifeed_client_waited_seconds_total", labels(client="host-a:18", rank=1, dp_rank=1))] == 0.5
    assert got[("omnifeed_resizes_total", ())] == 1 and got[("omnifeed_resize_seconds_total", ())] == 2.5
    assert got[("omnifeed_read_ahead", ())] == 4


def test_the_types_are_counters_for_totals_and_gauges_for_levels() -> None:
    server, port = start_metrics_server(lambda: SNAPSHOT, 0)
    with server, urllib.request.urlopen(server.url, timeout=10) as response:
        types = {f.name: f.type for f in text_string_to_metric_families(response.read().decode())}
    assert types["omnifeed_bad_samples"] == "counter" and types["omnifeed_client_waited_seconds"] == "counter"
    assert types["omnifeed_buffer_bytes"] == "gauge" and types["omnifeed_decode_latency_seconds"] == "gauge"
    assert types["omnifeed_service_info"] == "gauge"  # an info family, as the text format writes it
    assert {spec.name + ("_info" if spec.kind == "info" else "") for spec in METRICS} >= set(types)


def test_a_snapshot_missing_keys_still_scrapes(serve: Any) -> None:
    sparse = {
        "samples": 5,
        "modalities": {"audio": {"decoded": 2, "decode_latency_s": {}, "bad": None}, "odd": 3},
        "cache": {"remote": {"latency_s": {"p50": "slow"}}},
        "clients": [{"client": "c"}, "junk"],
    }
    got = serve(lambda: sparse)
    assert got[("omnifeed_snapshot_ok", ())] == 1 and got[("omnifeed_samples_total", ())] == 5
    assert got[("omnifeed_decoded_total", labels(modality="audio"))] == 2
    assert not any(name.startswith(("omnifeed_storage", "omnifeed_client", "omnifeed_cache")) for name, _ in got)


def test_a_failing_snapshot_answers_with_snapshot_ok_zero(serve: Any) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("the service is shutting down")

    assert serve(broken) == {("omnifeed_snapshot_ok", ()): 0}
    assert serve(lambda: ["not", "a", "dict"]) == {("omnifeed_snapshot_ok", ()): 0}


def test_each_scrape_reads_a_fresh_snapshot_and_shutdown_frees_the_port() -> None:
    calls = []
    server, port = start_metrics_server(lambda: calls.append(1) or {"batches": len(calls)}, 0)
    assert scrape(port)[("omnifeed_batches_total", ())] == 1
    assert scrape(port)[("omnifeed_batches_total", ())] == 2
    server.shutdown()
    server.shutdown()  # idempotent
    with pytest.raises(OSError):
        scrape(port)


@pytest.mark.parametrize(
    ("key", "quantile"),
    [
        ("p50", "0.5"),
        ("p90", "0.9"),
        ("p95", "0.95"),
        ("p99", "0.99"),
        ("p999", "0.999"),
        ("p5", "0.05"),
        ("max", None),
        ("p", None),
    ],
)
def test_percentile_keys_become_quantile_labels(key: str, quantile: str | None) -> None:
    assert quantile_label(key) == quantile


def exposed_names() -> list[str]:
    """Every metric family's name as the exposition writes it (counters end in ``_total``, info in ``_info``)."""
    return [
        spec.name + ("_total" if spec.kind == "counter" else "_info" if spec.kind == "info" else "") for spec in METRICS
    ]


SERVICE_DOCS = Path(__file__).parents[3] / "docs" / "service.md"


def test_the_docs_list_every_metric() -> None:
    docs = SERVICE_DOCS.read_text(encoding="utf-8")
    assert [name for name in exposed_names() if f"`{name}`" not in docs] == []


def test_every_metric_name_the_docs_mention_is_one_the_endpoint_exposes(serve: Any) -> None:
    mentioned = set(re.findall(r"\b(omnifeed_[a-z_]+)(\*?)", SERVICE_DOCS.read_text(encoding="utf-8")))
    scraped = {name for name, _ in serve(lambda: SNAPSHOT)}
    assert "omnifeed_decoded_total" in scraped and "omnifeed_decoded" not in scraped  # a counter's sample name
    known = set(exposed_names()) | scraped
    unknown = [
        name + star
        for name, star in mentioned
        if (name not in known if not star else not any(k.startswith(name) for k in known))  # `omnifeed_x_*`: a family
    ]
    assert sorted(unknown) == []


SOURCES = {
    "photos": {"samples": 300, "tokens": 9000, "replaced": 2, "samples_per_s": 30.0, "tokens_per_s": 900.0},
    "docs": {"samples": 20, "tokens": 40000, "replaced": 0, "samples_per_s": 2.0, "tokens_per_s": 4000.0},
}


def exposition(snapshot: Any) -> str:
    """The text a scrape of ``snapshot`` answers."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(lambda: snapshot))
    return generate_latest(registry).decode()


def test_a_mixtures_sources_scrape_as_counters_with_a_source_label(serve: Any) -> None:
    got = serve(lambda: SNAPSHOT | {"sources": SOURCES | {"junk": 3}})
    assert got[("omnifeed_source_samples_total", labels(source="photos"))] == 300
    assert got[("omnifeed_source_tokens_total", labels(source="docs"))] == 40000
    assert got[("omnifeed_source_replaced_total", labels(source="photos"))] == 2
    assert got[("omnifeed_source_replaced_total", labels(source="docs"))] == 0
    assert not any(dict(label).get("source") == "junk" for _, label in got)
    types = {f.name: f.type for f in text_string_to_metric_families(exposition(SNAPSHOT | {"sources": SOURCES}))}
    assert {types[f"omnifeed_source_{n}"] for n in ("samples", "tokens", "replaced")} == {"counter"}


def test_a_single_index_snapshot_scrapes_as_before_with_no_source_families() -> None:
    plain, mixed = exposition(SNAPSHOT), exposition(SNAPSHOT | {"sources": SOURCES})
    assert "source" not in plain
    assert "\n".join(line for line in mixed.splitlines() if "omnifeed_source_" not in line) == plain.rstrip("\n")
