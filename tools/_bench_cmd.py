"""`omnifeed bench` and `omnifeed chaos`: their flags, and the runners that import the harness when the command runs.

Only the standard library is imported here: `omnifeed --help` parses flags only (tests/tools/test_startup.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._bench_names import LOADERS as BENCH_LOADERS


def add_bench_commands(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """The ``chaos`` and ``bench`` subcommands under ``sub``; ``command(sub, name, summary, *examples)`` makes each."""
    chaos = command(
        sub,
        "chaos",
        "a bounded fault-injection soak: kill the service, decode workers and trainer "
        "ranks, resize, storage errors and latency; then verify exactly-once, leaks and orphans",
        "omnifeed chaos --minutes 5",
        "omnifeed chaos --minutes 0.5 --quick --seed 3",
    )
    chaos.add_argument(
        "--minutes",
        type=_positive_minutes,
        required=True,
        help="how long to inject faults; the job then finishes its epoch",
    )
    chaos.add_argument("--seed", type=int, default=0, help="seeds the dataset, the plan and the fault schedule")
    chaos.add_argument("--out", default="chaos-output", help="working directory (recreated): data, logs, summary.json")
    chaos.add_argument(
        "--quick", action="store_true", help="48 samples, 1 or 2 ranks, a fault every 1-2.5 s (the test suite's)"
    )
    chaos.set_defaults(run=_run_chaos)

    bench = command(
        sub,
        "bench",
        "omnifeed beside DataLoader, WebLoader, StatefulDataLoader, Streaming, LitData "
        "and DALI (those installed): throughput, CPU, memory, resume cost, as ratios",
        "omnifeed bench --data /data/shards --loaders omnifeed,dataloader --rounds 3",
        "omnifeed bench --scenario training --mixed 1024 --rounds 3",
    )
    bench.add_argument(
        "--scenario",
        choices=("loaders", "training", "scale"),
        default="loaders",
        help="loaders: each loader's throughput, CPU, memory, resume cost (default); training: a simulated "
        "synchronous data-parallel job of --node-ranks ranks over the multimodal mix, GPU utilisation per loader; "
        "scale: the planning side of a large job (dealing CPU per step, state, resume, resize, index open)",
    )
    bench.add_argument(
        "--data",
        metavar="DIR",
        help="a folder of JPEG files or of WebDataset shards for the image pipeline (default: generated)",
    )
    bench.add_argument("--images", type=_positive_int, default=2048, help="generated images (default 2048)")
    bench.add_argument("--mixed", type=_positive_int, default=1536, help="generated multimodal samples (default 1536)")
    bench.add_argument("--workers", type=_positive_int, default=2, help="CPU workers every loader gets (default 2)")
    bench.add_argument(
        "--batch-size", type=_positive_int, help="samples per batch (default 64; 8 in the training scenario)"
    )
    bench.add_argument("--rounds", type=_positive_int, default=1, help="runs per loader, alternating; medians reported")
    bench.add_argument(
        "--loaders", default=",".join(BENCH_LOADERS), help=f"comma-separated subset of {','.join(BENCH_LOADERS)}"
    )
    bench.add_argument("--pipelines", default="image,mixed", help="comma-separated subset of image,mixed")
    bench.add_argument(
        "--resume-samples",
        type=int,
        default=10_000_000,
        metavar="N",
        help="index size of the resume-cost comparison (0: skip it; default 10,000,000)",
    )
    bench.add_argument(
        "--out", default="bench-output", help="working directory (recreated): data, report.json, bench.png"
    )
    bench.add_argument(
        "--node-ranks",
        type=int,
        default=2,
        metavar="N",
        help="trainer ranks of the node scenario (N data-parallel ranks, then N tensor-parallel peers, "
        "one service against a DataLoader per rank; 0: skip) and of the training scenario (default 2)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="tiny sizes: checks the harness, not speed (the test suite's)"
    )
    scale = bench.add_argument_group("scale scenario")
    scale.add_argument(
        "--scale-samples",
        type=_int_list,
        default=(1_000_000_000,),
        metavar="N,...",
        help="plan sizes in samples (synthetic lengths, no data; default 1000000000)",
    )
    scale.add_argument(
        "--world-sizes", type=_int_list, default=(64, 1024, 4096), metavar="DP,...", help="default 64,1024,4096"
    )
    scale.add_argument("--accums", type=_int_list, default=(1, 16), metavar="A,...", help="default 1,16")
    scale.add_argument(
        "--cell-seconds",
        type=float,
        default=40.0,
        metavar="S",
        help="CPU limit of each measurement of a cell (steps, resume, resize); a step still dealing then is "
        "stopped and recorded as cut (default 40)",
    )
    scale.add_argument(
        "--written-samples",
        type=int,
        default=20_000_000,
        metavar="N",
        help="samples of the budget-written cells: one epoch planned and written ahead (`omnifeed plan "
        "--write-epochs`), then dealt by look-up; a step's cost does not depend on N (0: skip; default 20000000, "
        "~65 s of CPU to write)",
    )
    scale.add_argument(
        "--index-rows",
        type=_count_list,
        default=(1_000_000,),
        metavar="N,...",
        help="rows of each synthetic index whose open, memory, plan and resume are measured "
        "(0: skip; default 1000000; e.g. 1000000,10000000,100000000: ~200 bytes a row on disk)",
    )
    scale.add_argument(
        "--index-cache",
        metavar="DIR",
        help="folder keeping the synthetic indexes across runs (a 10^8-row one takes ~8 minutes to write); "
        "default: made under --out on every run",
    )
    bench.set_defaults(run=_run_bench)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def _count_list(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(",") if part)
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"must be comma-separated counts, not {text}")
    return tuple(v for v in values if v > 0)


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(",") if part)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, not {text}")
    return values


def _run_bench(args: argparse.Namespace) -> int:
    if args.scenario == "training":
        return _run_bench_training(args)
    if args.scenario == "scale":
        return _run_bench_scale(args)
    from ._bench import bench_command
    from ._bench_config import BenchConfig

    loaders = [name for name in args.loaders.split(",") if name]
    pipelines = [name for name in args.pipelines.split(",") if name]
    unknown = sorted(set(loaders) - set(BENCH_LOADERS)) + sorted(set(pipelines) - {"image", "mixed"})
    if unknown:
        raise ValueError(
            f"unknown loader or pipeline {', '.join(unknown)}: choose from {', '.join(BENCH_LOADERS)} and image, mixed"
        )
    sizes = (
        dict(images=64, mixed=32, batch_size=16, limit_seconds=0.5)
        if args.quick
        else dict(images=args.images, mixed=args.mixed, batch_size=args.batch_size or 64)
    )
    config = BenchConfig(
        work=Path(args.out),
        workers=args.workers,
        rounds=args.rounds,
        loaders=loaders,
        pipelines=pipelines,
        data=Path(args.data) if args.data else None,
        node_ranks=max(0, args.node_ranks),
        **sizes,
    )
    resume = min(args.resume_samples, 20_000) if args.quick else args.resume_samples
    return bench_command(config, resume_samples=resume)


def _run_bench_training(args: argparse.Namespace) -> int:
    from ._bench_training import TrainingConfig, training_command

    if args.node_ranks < 2:
        raise ValueError("--scenario training needs --node-ranks 2 or more (the data-parallel ranks)")
    sizes = (
        dict(samples=64, batch_size=4, rounds=1, warmup_runs=0)
        if args.quick
        else dict(samples=args.mixed, batch_size=args.batch_size or 8, rounds=args.rounds)
    )
    config = TrainingConfig(work=Path(args.out), ranks=args.node_ranks, workers=args.workers, **sizes)
    return training_command(config)


def _run_bench_scale(args: argparse.Namespace) -> int:
    from ._bench_scale import ScaleConfig, scale_command

    config = ScaleConfig(
        work=Path(args.out),
        samples=args.scale_samples,
        world_sizes=args.world_sizes,
        accums=args.accums,
        cell_seconds=args.cell_seconds,
        written_samples=args.written_samples,
        batch_size=args.batch_size or 8,
        index_rows=args.index_rows,
        index_cache=Path(args.index_cache) if args.index_cache else None,
    )
    return scale_command(config)


def _positive_minutes(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of minutes, not {text}")
    return value


def _run_chaos(args: argparse.Namespace) -> int:
    from ._chaos import run_chaos
    from ._chaos_config import ChaosConfig

    out = Path(args.out)
    config = (
        ChaosConfig.quick(out, seed=args.seed, minutes=args.minutes)
        if args.quick
        else ChaosConfig(minutes=args.minutes, out=out, seed=args.seed)
    )
    return run_chaos(config)
