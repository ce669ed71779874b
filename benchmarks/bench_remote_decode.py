"""Decoding on Ray actors: feed throughput with remote workers vs local only, and the round trip's cost per sample.

    python benchmarks/bench_remote_decode.py [--samples 48] [--size 1280x720] [--nodes 2] [--remote 0,1,2]

Writes ``--samples`` H.264 clips (2 s at ``--size``, 25 fps) into a WebDataset tar and indexes it.
Starts a local Ray cluster (``ray.cluster_utils.Cluster``): a head with no CPUs and ``--nodes``
simulated nodes of one CPU each, all pinned to the cores other than ``--service-core``; then
pins this process (the feed: what the service runs) to ``--service-core`` alone. For each count
in ``--remote`` it reads one epoch through a `Feed` whose video pool has one local thread and
that many actors (0: local only), decoding 8 frames per clip, and reports samples/s and who
decoded what. The round trip is measured apart: one actor, one task at a time, vs decoding the
same field in this process; bytes moved = decoded bytes sent back. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from omnifeed.loader import DecodeConfig, Feed, FeedConfig, IndexConfig, PlanConfig, SampleIndex, build_index
from omnifeed.loader.decode._config import VideoDecodeConfig
from omnifeed.loader.decode._registry import make_decoder
from omnifeed.loader.feed._config import PoolConfig
from omnifeed.loader.feed._remote_actor import DecodeActor
from omnifeed.loader.feed._remote_config import RemoteConfig
from omnifeed.tools._demo_data import encode_video

DECODE = DecodeConfig(video=VideoDecodeConfig(num_frames=8))


def write_clips(folder: Path, samples: int, width: int, height: int) -> Path:
    """``samples`` clips in one tar, indexed; the index directory."""
    clip = encode_video(50, width, height, 25)
    tar_path = folder / "clips-0000.tar"
    with tarfile.open(tar_path, "w") as tar:
        for i in range(samples):
            info = tarfile.TarInfo(f"clip{i:06d}.mp4")
            info.size = len(clip)
            tar.addfile(info, io.BytesIO(clip))
    build_index([str(tar_path)], folder / "index", IndexConfig(workers=1), progress=False)
    return folder / "index"


def feed_config(actors: int) -> FeedConfig:
    remote = RemoteConfig(workers=actors, tasks_per_worker=2) if actors else None
    return FeedConfig(
        plan=PlanConfig(seed=1, batch_size=8),
        decode=DECODE,
        shared_workers=0,
        pools={"video": PoolConfig(workers=1, buffer_samples=32, remote=remote)},
    )


def epoch(index: Path, actors: int) -> dict[str, Any]:
    """One epoch's samples/s with ``actors`` remote workers (after they are up), and who decoded what."""
    with Feed(index, feed_config(actors)) as feed:
        remote = feed._reader.remote  # noqa: SLF001  the benchmark looks inside
        while remote is not None and remote.snapshot()["modalities"]["video"]["workers"] < actors:
            time.sleep(0.2)
        started, samples = time.perf_counter(), 0
        for batch in feed:
            samples += len(batch["__key__"])
        seconds = time.perf_counter() - started
        video = remote.snapshot()["modalities"]["video"] if remote is not None else {}
    return {
        "actors": actors,
        "samples": samples,
        "seconds": round(seconds, 3),
        "samples_per_s": round(samples / seconds, 1),
        "remote_decoded": video.get("decoded", 0),
        "local_decoded": video.get("local_decoded", samples),
        "round_trip_p50_ms": round(1e3 * video.get("round_trip_s", {}).get("p50", 0.0), 1),
    }


def round_trip(index: Path, calls: int) -> dict[str, Any]:
    """One actor, one task at a time: the round trip vs decoding here; the bytes sent back per sample."""
    sample_index = SampleIndex(index)
    samples = list(sample_index.samples(np.arange(min(calls, sample_index.num_samples))))
    actor = (
        ray.remote(DecodeActor)
        .options(num_cpus=1)
        .remote(DECODE.model_dump_json(), FeedConfig().cache.model_dump_json(), sample_index.fingerprint)
    )
    ray.get(actor.ready.remote())
    decoder = make_decoder("video", DECODE)
    trips, local, returned = [], [], 0
    for sample in samples:
        location = sample.fields[0]
        started = time.perf_counter()
        status, value, _ = ray.get(actor.decode.remote(sample, location, None))
        trips.append(time.perf_counter() - started)
        assert status == "ok", value
        returned += int(value.nbytes)
        with open(sample.shard.url, "rb") as f:
            f.seek(location.offset)
            data = f.read(location.size)
        started = time.perf_counter()
        decoder(data, sample.key)
        local.append(time.perf_counter() - started)
    ray.kill(actor)
    return {
        "calls": len(samples),
        "round_trip_p50_ms": round(1e3 * float(np.median(trips)), 2),
        "local_decode_p50_ms": round(1e3 * float(np.median(local)), 2),
        "overhead_p50_ms": round(1e3 * (float(np.median(trips)) - float(np.median(local))), 2),
        "bytes_back_per_sample": returned // max(1, len(samples)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--size", default="1280x720", help="clip width x height")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--remote", default="0,1,2", help="actor counts to measure, comma-separated")
    parser.add_argument("--service-core", type=int, default=0)
    args = parser.parse_args()
    cores = os.sched_getaffinity(0)
    others = cores - {args.service_core} or cores
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        width, height = (int(v) for v in args.size.split("x"))
        index = write_clips(Path(tmp), args.samples, width, height)
        os.sched_setaffinity(0, others)  # the cluster's processes inherit this
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, logging_level="WARNING")
        os.sched_setaffinity(0, {args.service_core})  # the feed: one core
        try:
            runs = [epoch(index, int(n)) for n in args.remote.split(",")]
            trip = round_trip(index, 32)
        finally:
            ray.shutdown()
            cluster.shutdown()
    print(
        json.dumps(
            {
                "size": args.size,
                "service_core": args.service_core,
                "cluster_cores": sorted(others),
                "nodes": args.nodes,
                "samples": args.samples,
                "epochs": runs,
                "round_trip": trip,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
