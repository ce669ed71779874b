"""Decode every clip of one kind in a set of WebDataset shards on 1 and 2 threads: clips/s and CPU ms a clip.

    python benchmarks/bench_decode_mix.py video|audio|image|png|jpg [--shards 'DIR/*.tar'] [--passes 3] [--tries 3]

The clips are read into memory first (``.mp4`` for video, ``.flac`` for audio, ``.jpg`` and ``.png``
for image, or either alone) and decoded with the default `DecodeConfig` (`omnifeed.loader.decode`), ``--passes`` times
over per thread; each setting is run ``--tries`` times and the best kept (a shared machine only ever
slows a run down). A digest of every output is printed first, so two trees (an A/B with each first
on ``PYTHONPATH``) can be shown to decode the same pixels and samples. Default shards: the mix
`bench_service_production.py` generates.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from omnifeed.loader.decode import DecodeConfig, make_decoder

EXTENSIONS = {"video": ("mp4",), "audio": ("flac",), "image": ("jpg", "png"), "png": ("png",), "jpg": ("jpg",)}
MODALITY = {"png": "image", "jpg": "image"}  # a kind that is one format of a modality


def clips(pattern: str, kind: str) -> list[bytes]:
    """Every ``kind`` field in the shards matching ``pattern``, in shard order."""
    out: list[bytes] = []
    for shard in sorted(glob.glob(pattern)):
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.isfile() and member.name.rpartition(".")[2] in EXTENSIONS[kind]:
                    out.append(tar.extractfile(member).read())  # type: ignore[union-attr]
    return out


def decoder(kind: str) -> Callable[[bytes], np.ndarray]:
    """The default decoder of ``kind``."""
    decode = make_decoder(kind, DecodeConfig())
    return lambda data: np.asarray(decode(data, "clip"))


def run(decode: Callable[[bytes], np.ndarray], data: list[bytes], threads: int, passes: int) -> tuple[float, float]:
    """(clips a second, CPU ms a clip) of ``threads`` threads each decoding every clip ``passes`` times."""

    def work() -> None:
        for _ in range(passes):
            for item in data:
                decode(item)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    wall, cpu = time.perf_counter(), time.process_time()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = threads * passes * len(data)
    return n / wall, 1e3 * cpu / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(EXTENSIONS))
    parser.add_argument(
        "--shards", default=str(Path(tempfile.gettempdir()) / "omnifeed-bench-production/mixed-1024/shards/*.tar")
    )
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--tries", type=int, default=3)
    args = parser.parse_args()
    data = clips(args.shards, args.kind)
    if not data:
        names = " or ".join("." + extension for extension in EXTENSIONS[args.kind])
        raise SystemExit(f"no {names} in {args.shards}: run bench_service_production.py first")
    decode = decoder(MODALITY.get(args.kind, args.kind))
    digest = hashlib.sha1()
    for item in data:
        digest.update(decode(item).tobytes())
    print(f"{len(data)} clips, output digest {digest.hexdigest()[:12]}")
    for threads in (1, 2):
        results = [run(decode, data, threads, args.passes) for _ in range(args.tries)]
        print(
            f"{threads} thread(s): {max(r[0] for r in results):.0f} clips/s, "
            f"{min(r[1] for r in results):.2f} CPU ms a clip"
        )


if __name__ == "__main__":
    main()
