"""omnifeed's phases of the resume benchmark: the plan cursor stepped to the position and saved, then
resumed in a fresh process (cursor + index lookup, and a whole decoding ``Feed``)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ._bench_resume_measure import SEED, position_of, read_expected, timed_resume, write_expected


def omnifeed_save(options: argparse.Namespace) -> dict[str, Any]:
    """The index (cached), a plan cursor stepped for real to the position, its feed state and next keys."""
    from omnifeed.loader import SampleIndex
    from omnifeed.loader.feed import FEED_STATE_FORMAT
    from omnifeed.loader.plan import Plan, PlanCursor

    from ._synthetic_index import make_index

    options.work.mkdir(parents=True, exist_ok=True)
    path, built = make_index(options.work, options.samples)
    index = SampleIndex(path)
    position, batches = position_of(options)
    started = time.perf_counter()
    cursor = PlanCursor(Plan.from_index(index, omnifeed_config(options).plan))
    while cursor.micro_batch < batches:
        cursor.next_step()
    state = {"format": FEED_STATE_FORMAT, "plan": cursor.state_dict(), "accum_done": 0}
    stepped_s = time.perf_counter() - started
    (options.work / "state.json").write_text(json.dumps(state), encoding="utf-8")
    write_expected(options.work, [str(k) for k in index.keys(cursor.next_step().micro_batches[0].positions)])
    return {
        "status": "ok",
        "position": position,
        "build_s": built.get("build_s"),
        "built": not built["cached"],
        "how": f"a PlanCursor stepped for real to micro-batch {batches} ({stepped_s:.1f} s); expected: its next step",
    }


def omnifeed_config(options: argparse.Namespace) -> Any:
    """The feed config of both phases: seed 0, permutation shuffle, fixed batches."""
    from omnifeed.loader import FeedConfig, PlanConfig

    return FeedConfig(plan=PlanConfig(seed=SEED, batch_size=options.batch_size, shuffle="permutation"))


def omnifeed_resume(options: argparse.Namespace) -> dict[str, Any]:
    """Open the index and plan; time cursor load + next step + key lookup, then a whole decoding Feed."""
    from omnifeed.loader import Feed, SampleIndex
    from omnifeed.loader.plan import Plan, PlanCursor

    config = omnifeed_config(options)
    started = time.perf_counter()
    index = SampleIndex(options.work / f"index-{options.samples}")
    plan = Plan.from_index(index, config.plan)
    open_s = time.perf_counter() - started
    text = (options.work / "state.json").read_text(encoding="utf-8")
    state = json.loads(text)

    marks: list[float] = []

    def resume() -> list[str]:
        cursor = PlanCursor(plan)
        cursor.load_state_dict(state["plan"])
        marks.append(time.perf_counter())
        positions = cursor.next_step().micro_batches[0].positions
        marks.append(time.perf_counter())
        return [str(k) for k in index.keys(positions)]

    keys, resume_s, memory = timed_resume(resume)
    marks.append(time.perf_counter())
    expected = read_expected(options.work)

    def feed_resume() -> list[str]:
        with Feed(index, config) as feed:
            feed.load_state_dict(state)
            batch = feed.next_batch()
        return [str(k) for k in batch["__key__"]]

    feed_keys, feed_s, feed_memory = timed_resume(feed_resume)
    ok = keys == expected and feed_keys == expected
    return {
        "status": "ok" if ok else "error: the first batch after resume is not the expected one",
        "open_s": round(open_s, 4),
        "resume_s": round(resume_s, 4),
        **memory.figures(),
        "state_bytes": len(text.encode()),
        "first_batch_ok": ok,
        "resume_parts_s": {"next_step": round(marks[1] - marks[0], 4), "keys": round(marks[2] - marks[1], 4)},
        "feed_resume_s": round(feed_s, 4),
        "feed_peak_rss_mib": round(feed_memory.peak_mib, 1),
        "timed": "PlanCursor.load_state_dict + next_step + SampleIndex.keys of its micro-batch; "
        "feed_resume_s: Feed() + load_state_dict + next_batch (batch_size JPEGs read and decoded)",
    }
