"""`omnifeed index`, `omnifeed precache` and `omnifeed plan`: their flags (the runners are `_index_commands`'s and
`_plan_cmd`'s, imported when the command runs).

Only the standard library is imported here: `omnifeed --help` parses flags only (tests/tools/test_startup.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ._exit_codes import INDEX_DAMAGED_EXIT


def add_index_commands(
    sub: Any, command: Callable[..., argparse.ArgumentParser], runs: Callable[[str, str], Any]
) -> None:
    """The ``index``, ``precache`` and ``plan`` subcommands under ``sub``; ``command(sub, name, summary, *examples)``
    makes each, ``runs(module, name)`` is its runner imported when it runs."""
    index = command(
        sub,
        "index",
        "scan sources into a hash-partitioned sample index",
        "omnifeed index 'shards/train-{0000..0099}.tar' --out index --config omnifeed.yaml --workers 8",
        "omnifeed index hf/train-00000-of-00002.parquet hf/train-00001-of-00002.parquet --out index",
    )
    index.description = (
        f"{index.description}. Exit status: 0 every sample indexed; {INDEX_DAMAGED_EXIT} indexed, "
        "with damaged samples left out (each named on stderr, counted in the manifest); "
        "1 a source, a shard or a key refused (the index holds the rest) or an error; "
        "143 stopped by SIGTERM (nothing written). Sources: docs/your-data.md."
    )
    index.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="tar shards, Parquet or Arrow files, folders (fsspec URLs, globs, {a..b})",
    )
    index.add_argument("--out", required=True, help="index directory to write")
    index.add_argument("--config", help="YAML file; its 'index' section is an IndexConfig")
    index.add_argument("--partitions", type=int, help="Parquet partitions (default 16)")
    index.add_argument("--workers", type=int, help="scan processes (default: the CPUs this process may run on)")
    index.add_argument("--tokenizer", help="text length measure: regex, whitespace, bytes or module:function")
    index.add_argument(
        "--key-column",
        metavar="NAME",
        help="Parquet/Arrow column holding the sample key (default __key__, else keys '<file stem>/<row>')",
    )
    index.add_argument(
        "--strict",
        action="store_true",
        default=None,
        help="refuse a whole shard at its first damaged sample, instead of leaving that sample out",
    )
    index.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="scan on the Ray cluster at ADDRESS (HOST:PORT; default: auto, the one this machine is in), "
        "one task per group of shards; needs pip install 'omnifeed[ray]'",
    )
    index.add_argument(
        "--class-folders",
        choices=["auto", "always", "never"],
        help="folder sources: class folders as an int64 'label' (sorted names, as torchvision's "
        "ImageFolder); auto (default): when every sample is one media file in one of 2+ class folders",
    )
    index.add_argument(
        "--media-root",
        metavar="DIR",
        help="read Parquet/Arrow media cells that hold only a file path (datasets' to_parquet of local "
        "files) from beneath DIR, confined to it",
    )
    index.add_argument(
        "--allow-meta-only",
        action="store_true",
        default=None,
        help="index a folder whose samples have no image, video, audio or text field (a warning), "
        "instead of refusing it",
    )
    index.add_argument(
        "--json",
        action="store_true",
        help="print the summary as one JSON object (for scripts) instead of the human summary",
    )
    index.add_argument("--no-progress", action="store_true", help="no progress bar")
    index.set_defaults(run=runs("._index_commands", "run_index"))

    precache = command(
        sub,
        "precache",
        "fill the node's NVMe cache tier from an index ahead of training (resumable)",
        "omnifeed precache index --cache /local_nvme/omnifeed-cache --capacity 500G",
        "omnifeed precache index --config feed.yaml --partitions 0-7",
    )
    precache.add_argument("index", metavar="INDEX_DIR", help="an index written by `omnifeed index`")
    precache.add_argument(
        "--cache", metavar="DIR", help="NVMe tier directory, node-local (default: cache.nvme.path of --config)"
    )
    precache.add_argument(
        "--config",
        metavar="FEED_YAML",
        help="the feed's config: its decode and cache settings (entries, nvme, remote) are used, "
        "so the feed finds every entry",
    )
    precache.add_argument(
        "--decode",
        action="store_true",
        help="cache decoded values, as a feed with cache.entries: decoded reads them (default: as "
        "--config says, else raw bytes)",
    )
    precache.add_argument(
        "--capacity",
        metavar="BYTES",
        help="tier capacity: bytes, or with K/M/G/T (x1024) or KB/MB/GB/TB (x1000), e.g. 500G "
        "(default: --config's, else 64G)",
    )
    precache.add_argument(
        "--partitions", metavar="LIST", help="index partitions to cache, e.g. 0,3,8-11 (default: all)"
    )
    precache.add_argument(
        "--workers", type=int, metavar="N", help="local worker processes (default: the CPUs, at most one per partition)"
    )
    precache.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="run as Ray tasks, one per node and partition, on the cluster at ADDRESS (HOST:PORT; "
        "default: auto); needs pip install 'omnifeed[ray]'",
    )
    precache.add_argument("--no-progress", action="store_true", help="no progress bar")
    precache.set_defaults(run=runs("._index_commands", "run_precache"))

    plan = command(
        sub,
        "plan",
        "print which samples each rank receives at each step (JSON lines)",
        "omnifeed plan index --world-size 8 --batch-size 32 --steps 10 --save-state state.json",
        "omnifeed plan --config mixture.yaml --world-size 4 --stats",
    )
    plan.add_argument(
        "index",
        nargs="?",
        metavar="INDEX_DIR",
        help="an index written by `omnifeed index` (none with a --config whose plan has a mixture: "
        "it names the indexes)",
    )
    plan.add_argument(
        "--world-size", type=int, help="data-parallel ranks sharing each step (needed to deal; not to --write-epochs)"
    )
    plan.add_argument("--seed", type=int, help="shuffle seed (default 0)")
    plan.add_argument("--epoch", type=int, help="start epoch (new run) and the epoch to deliver fully")
    plan.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per step (default 1)")
    plan.add_argument("--batch-size", type=int, help="samples per micro-batch (default 8)")
    plan.add_argument(
        "--shuffle",
        choices=["permutation", "shard_block", "none"],
        help="permutation (all samples, default), shard_block (shuffled shards, sequential reads) or none",
    )
    plan.add_argument("--shards-per-window", type=int, help="shards per window with --shuffle shard_block (default 4)")
    plan.add_argument(
        "--drop-last",
        action="store_true",
        default=None,
        help="drop each epoch's last, short micro-batch (fixed-size batches)",
    )
    plan.add_argument(
        "--window-size",
        type=int,
        help="samples per window of the shuffled stream (default: 64 "
        "micro-batches' worth; 65,536 samples with --budget)",
    )
    plan.add_argument(
        "--budget", type=float, help="cost budget per micro-batch: length-bucketed batches instead of --batch-size"
    )
    plan.add_argument("--packing", action="store_true", help="with --budget: pack sequences of tokens up to the budget")
    plan.add_argument(
        "--overlong",
        choices=["reject", "alone", "split"],
        help="a sample over the budget: reject (error), alone (own micro-batch), split (packing)",
    )
    plan.add_argument(
        "--stats",
        action="store_true",
        help="print one JSON object: padding, balance, and the same for fixed-size batches; for a mixture "
        "also 'sources': each one's realised and planned share, cost share, padding, samples its filter removed",
    )
    plan.add_argument("--worst", type=int, metavar="N", help="print the N costliest micro-batches (JSON lines)")
    plan.add_argument(
        "--suggest-budget",
        type=float,
        metavar="N",
        help="print the cost budget whose micro-batches hold N samples on average (JSON); "
        "the cost model comes from --config",
    )
    plan.add_argument(
        "--config", help="YAML file; its 'plan' section is a PlanConfig (with a mixture: paths relative to the file)"
    )
    plan.add_argument("--steps", type=int, help="steps to deal (default: until the epoch is fully delivered)")
    plan.add_argument("--resume", metavar="STATE_JSON", help="continue from a saved state (any world size)")
    plan.add_argument(
        "--allow-mixture-change",
        action="store_true",
        help="with --resume and a --config of other mixture weights or phases: each source goes on from its position",
    )
    plan.add_argument("--save-state", metavar="STATE_JSON", help="write the state after the last step")
    plan.add_argument(
        "--write-epochs",
        type=int,
        metavar="N",
        help="with --budget: plan N epochs (from --epoch, default 0; with --resume, from the state's next whole "
        "epoch) once and write them under INDEX_DIR/plans/ (a mixture: into its config's plan.mixture.plans), so "
        "that every rank deals a step by look-up instead of planning the world's windows (thousands of ranks)",
    )
    plan.set_defaults(run=runs("._plan_cmd", "run_plan"))
