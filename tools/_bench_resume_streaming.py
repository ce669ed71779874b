"""MosaicML Streaming's phases of the resume benchmark: an MDS dataset of one int column (cached), the
``StreamingDataset`` state at the position mid-epoch, then resumed."""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

from ._bench_resume_measure import (
    ITERATE_LIMIT,
    SEED,
    WRITE_LIMIT_S,
    Missing,
    position_of,
    read_expected,
    timed_resume,
    write_expected,
)


def import_streaming() -> Any:
    """The ``streaming`` module, or ``Missing``."""
    try:
        import streaming
    except ImportError as exc:
        raise Missing(f"streaming does not import ({exc})") from exc
    return streaming


def write_mds(out: Path, samples: int, limit_s: float) -> tuple[int, float]:
    """An MDS dataset of up to ``samples`` one-int samples, written for at most ``limit_s``; count and seconds."""
    streaming = import_streaming()
    done = out / "done.json"
    if done.is_file():
        cached = json.loads(done.read_text(encoding="utf-8"))
        if cached["requested"] == samples:
            return int(cached["samples"]), float(cached["seconds"])
    started = time.perf_counter()
    written = 0
    with streaming.MDSWriter(out=str(out / "mds"), columns={"i": "int64"}, size_limit=1 << 26) as writer:
        while written < samples and (written % 10_000 or time.perf_counter() - started < limit_s):
            writer.write({"i": written})
            written += 1
    seconds = time.perf_counter() - started
    done.write_text(json.dumps({"requested": samples, "samples": written, "seconds": seconds}), encoding="utf-8")
    return written, seconds


def streaming_dataset(options: argparse.Namespace) -> Any:
    """A shuffled ``StreamingDataset`` over the local MDS dataset (no remote), seed 0."""
    return import_streaming().StreamingDataset(
        local=str(options.work / "mds"), shuffle=True, shuffle_seed=SEED, batch_size=options.batch_size
    )


def streaming_expected(dataset: Any, started: Any, position: int, batch_size: int) -> tuple[list[int], str]:
    """The batch the uninterrupted epoch ``started`` yields at ``position``: iterated for real when small,
    else read off the epoch's sample order (what its iterator computes first)."""
    if position <= ITERATE_LIMIT * batch_size:
        taken = [int(sample["i"]) for sample in itertools.islice(started, position + batch_size)]
        return taken[position:], "expected: the uninterrupted epoch iterated for real"
    from streaming.base.batching import generate_work

    world = dataset._parallel_rank_world.detect_workers()
    ids = generate_work(dataset.batching_method, dataset, world, 0, 0).reshape(-1)  # the whole epoch, in order
    return (
        [int(dataset[int(i)]["i"]) for i in ids[position : position + batch_size]],
        "expected: the epoch's sample order (streaming's generate_work from sample 0) at the position",
    )


def streaming_save(options: argparse.Namespace) -> dict[str, Any]:
    """The MDS dataset (cached), the dataset's state at the position mid-epoch, and the expected batch."""
    options.work.mkdir(parents=True, exist_ok=True)
    written, seconds = write_mds(options.work, options.samples, WRITE_LIMIT_S)
    options.samples = written
    position, _ = position_of(options)
    dataset = streaming_dataset(options)
    epoch = iter(dataset)
    first = next(epoch)  # the epoch is under way, as in training: before it, state_dict names epoch -1
    state = dataset.state_dict(position, True)
    expected, how = streaming_expected(dataset, itertools.chain([first], epoch), position, options.batch_size)
    (options.work / "state.json").write_text(json.dumps(state), encoding="utf-8")
    write_expected(options.work, expected)
    return {
        "status": "ok",
        "samples": written,
        "position": position,
        "build_s": round(seconds, 2),
        "how": f"StreamingDataset.state_dict({position}, from_beginning=True) one sample into epoch 0; {how}",
    }


def streaming_resume(options: argparse.Namespace) -> dict[str, Any]:
    """Open the dataset; time ``load_state_dict`` + the first ``batch_size`` samples of the resumed epoch."""
    import_streaming()
    options.samples = json.loads((options.work / "done.json").read_text(encoding="utf-8"))["samples"]
    started = time.perf_counter()
    dataset = streaming_dataset(options)
    open_s = time.perf_counter() - started
    text = (options.work / "state.json").read_text(encoding="utf-8")
    state = json.loads(text)

    def resume() -> list[int]:
        dataset.load_state_dict(state)
        iterator = iter(dataset)
        return [int(next(iterator)["i"]) for _ in range(options.batch_size)]

    batch, resume_s, memory = timed_resume(resume)
    ok = batch == read_expected(options.work)
    return {
        "status": "ok" if ok else "error: the first batch after resume is not the expected one",
        "samples": options.samples,
        "open_s": round(open_s, 4),
        "resume_s": round(resume_s, 4),
        **memory.figures(),
        "state_bytes": len(text.encode()),
        "first_batch_ok": ok,
        "timed": "StreamingDataset.load_state_dict + iter + batch_size samples (no DataLoader, no workers)",
    }
