"""Decode throughput: JPEG draft mode, and whether Pillow and PyAV release the GIL (threads vs processes).

    python benchmarks/bench_decode.py [--seconds 3] [--workers 2]
    python benchmarks/bench_decode.py --cpu-per-sample [--photos 200] [--rounds 3]
    python benchmarks/bench_decode.py --feed-epochs [--photos 400]

``--cpu-per-sample`` (issue 29, "decode less") instead reports the process CPU time per sample
of omnifeed's decoders against a torchvision-style DataLoader decode with the same output, on
the same generated inputs; ``--feed-epochs`` a whole Feed's CPU per sample by epoch, the
decoded cache off and on (see `benchmarks/bench_decode_cpu.py`).

Inputs are generated in memory (``omnifeed.tools._demo_data``): a 640×480 JPEG (quality 85)
decoded to short side 224; a 640×480 PNG likewise; a 2-second 320×240 H.264 clip at 25 fps
decoded to 8 uniformly spread frames (short side 224), and to all its 50 frames; 10 s of
44.1 kHz stereo FLAC resampled to 16 kHz mono. Each is decoded repeatedly for ``--seconds``
by 1 thread, by ``--workers`` threads and by ``--workers`` processes; the ratio
threads/1-thread near ``--workers`` (and ``threads_cpu_per_wall``, CPU seconds the threaded
run used per wall second, near ``--workers``) means the decoder releases the GIL. Run it on
an otherwise idle machine with at least ``--workers`` cores. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

import torch

from omnifeed.loader.decode._config import AudioDecodeConfig, ImageDecodeConfig, VideoDecodeConfig
from omnifeed.loader.decode._registry import decode_audio, decode_image, decode_video
from omnifeed.tools._demo_data import encode_flac, encode_image, encode_video


def _cases() -> dict[str, Callable[[], object]]:
    jpeg, png = encode_image(640, 480, "jpg"), encode_image(640, 480, "png")
    clip, flac = encode_video(50, 320, 240, 25), encode_flac(10.0, 44100, 2)
    draft, full = ImageDecodeConfig(draft=True), ImageDecodeConfig(draft=False)
    eight, every = VideoDecodeConfig(num_frames=8), VideoDecodeConfig(max_frames=64)
    audio = AudioDecodeConfig()
    return {
        "jpeg_640x480_draft": lambda: decode_image(jpeg, draft),
        "jpeg_640x480_no_draft": lambda: decode_image(jpeg, full),
        "png_640x480": lambda: decode_image(png, full),
        "video_320x240_50f_8_frames": lambda: decode_video(clip, eight),
        "video_320x240_50f_all_frames": lambda: decode_video(clip, every),
        "flac_10s_44k_stereo_to_16k_mono": lambda: decode_audio(flac, audio),
    }


_CASES: dict[str, Callable[[], object]] = {}
_CPU_PER_WALL: dict[str, float] = {}


def _loop(name: str, seconds: float) -> int:
    """Decode case ``name`` until ``seconds`` have passed; return how many were decoded."""
    if not _CASES:
        _CASES.update(_cases())
    run, count, end = _CASES[name], 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        run()
        count += 1
    return count


def _rate(name: str, seconds: float, workers: int, kind: str) -> float:
    if kind == "serial":
        return _loop(name, seconds) / seconds
    pool: Executor = (
        ThreadPoolExecutor(max_workers=workers)
        if kind == "threads"
        else ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver"))
    )
    with pool:
        list(pool.map(_loop, [name] * workers, [0.2] * workers))  # warm up (and start) the workers
        started, cpu = time.perf_counter(), time.process_time()
        counts = list(pool.map(_loop, [name] * workers, [seconds] * workers))
        wall = time.perf_counter() - started
        if kind == "threads":  # CPU seconds per wall second of this process: ~workers if the GIL is released
            _CPU_PER_WALL[name] = (time.process_time() - cpu) / wall
        return sum(counts) / wall


def main() -> None:
    """Run every case serially, on threads and on processes; print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpu-per-sample", action="store_true", help="CPU per sample against a DataLoader decode")
    parser.add_argument("--feed-epochs", action="store_true", help="a Feed's CPU per sample, epochs 1-3")
    parser.add_argument("--photos", type=int, default=200, help="--cpu-per-sample, --feed-epochs: generated photos")
    parser.add_argument("--rounds", type=int, default=3, help="--cpu-per-sample: passes over the inputs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.cpu_per_sample:
        from bench_decode_cpu import cpu_per_sample_report

        print(json.dumps(cpu_per_sample_report(args.photos, args.rounds), indent=2))
        return
    if args.feed_epochs:
        from bench_decode_cpu import feed_epochs_report

        print(json.dumps(feed_epochs_report(args.photos), indent=2))
        return
    _CASES.update(_cases())
    per_s: dict[str, dict[str, float]] = {}
    for name in _CASES:
        _loop(name, 0.2)
        rates = {kind: _rate(name, args.seconds, args.workers, kind) for kind in ("serial", "threads", "processes")}
        rates["thread_speedup"] = rates["threads"] / rates["serial"]
        rates["process_speedup"] = rates["processes"] / rates["serial"]
        rates["threads_cpu_per_wall"] = _CPU_PER_WALL[name]
        per_s[name] = {k: round(v, 2) for k, v in rates.items()}
    report = {"cpus": os.cpu_count(), "workers": args.workers, "seconds": args.seconds, "per_s": per_s}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
