"""The feed as a trainer sees it: batches in plan order, exact resume, resize, lifecycle, metrics."""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import pytest
import torch

from omnifeed.loader import (
    Feed,
    FeedConfig,
    FeedError,
    IndexConfig,
    PlanConfig,
    PlanCursor,
    PoolConfig,
    SampleIndex,
    build_index,
)
from omnifeed.loader.feed import DecodeEngine
from omnifeed.loader.plan import Plan
from omnifeed.loader.plan._audit import read_delivery_logs, verify_coverage


@pytest.fixture(scope="module")
def index(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    out = tmp_path_factory.mktemp("feed") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1), progress=False)
    return SampleIndex(out)


def config(**plan: object) -> FeedConfig:
    return FeedConfig(plan=PlanConfig(seed=3, batch_size=4, **plan))


def omnifeed_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("omnifeed-")]


def decode_processes() -> list[int]:
    """Live worker processes: children of the multiprocessing fork server (which itself may stay)."""
    children = psutil.Process().children(recursive=True)
    servers = {p.pid for p in children if "forkserver" in " ".join(p.cmdline())}
    return [p.pid for p in children if p.ppid() in servers and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def same_batch(a: dict, b: dict) -> bool:
    if a.keys() != b.keys() or a["__key__"] != b["__key__"]:
        return False
    for modality in ("text", "image", "video", "audio"):
        for name, value in a.get(modality, {}).items():
            other = b[modality][name]
            if (
                isinstance(value, torch.Tensor)
                and not torch.equal(value, other)
                or not isinstance(value, torch.Tensor)
                and value != other
            ):
                return False
    return a.get("meta") == b.get("meta")


def test_batches_are_this_ranks_micro_batches_in_plan_order(index: SampleIndex) -> None:
    with Feed(index, config(), world_size=2, rank=1, grad_accum=2) as feed:
        got = [feed.next_batch()["__key__"] for _ in range(6)]
    cursor = PlanCursor(feed.plan, world_size=2, grad_accum=2)
    expected = [index.keys(mb.positions) for _ in range(3) for mb in cursor.next_step().for_rank(1)]
    assert got == expected


def test_the_batch_format_pads_each_modality_and_says_whose_rows_they_are(index: SampleIndex) -> None:
    with Feed(index, config()) as feed:
        batches = list(feed)
    assert sum(len(b["__key__"]) for b in batches) >= index.num_samples
    seen = set()
    for batch in batches:
        n = len(batch["__key__"])
        for modality, tensor_name, dtype in (
            ("image", "pixels", torch.uint8),
            ("video", "frames", torch.uint8),
            ("audio", "samples", torch.float32),
            ("text", "tokens", torch.int64),
        ):
            if modality not in batch:
                continue
            seen.add(modality)
            field = batch[modality]
            assert field[tensor_name].dtype == dtype and len(field[tensor_name]) == len(field["index"])
            assert field["index"].max() < n and field["index"].unique().numel() == len(field["index"])
        if "image" in batch:
            h, w = batch["image"]["pixels"].shape[-2:]
            assert (batch["image"]["sizes"] <= torch.tensor([h, w])).all()
        assert batch["__info__"]["replaced"] == []
    assert seen == {"image", "video", "audio", "text"}


@pytest.mark.parametrize("stop_after", [1, 3, 6])
def test_resume_anywhere_continues_byte_identically(index: SampleIndex, stop_after: int) -> None:
    cfg = config(window_size=8)  # windows of two micro-batches: stops fall inside and between windows
    with Feed(index, cfg, world_size=2, rank=0, grad_accum=2) as feed:
        uninterrupted = [feed.next_batch() for _ in range(9)]
    with Feed(index, cfg, world_size=2, rank=0, grad_accum=2) as first:
        head = [first.next_batch() for _ in range(stop_after)]
        state = first.state_dict()
    with Feed(index, cfg, world_size=2, rank=0, grad_accum=2) as second:
        second.load_state_dict(state)
        tail = [second.next_batch() for _ in range(9 - stop_after)]
    assert all(same_batch(a, b) for a, b in zip(head + tail, uninterrupted, strict=True))


def test_resize_at_a_step_boundary_keeps_exactly_once(index: SampleIndex, tmp_path: Path) -> None:
    logs = []
    feeds = []
    for rank in range(2):
        logs.append(tmp_path / f"rank{rank}.jsonl")
        feeds.append(Feed(index, config(), world_size=2, rank=rank, audit_log=logs[-1]))
    for _ in range(3):
        for feed in feeds:
            feed.next_batch()
    state = feeds[0].state_dict()
    assert state == feeds[1].state_dict(), "every rank holds the same global state"
    for feed in feeds:
        feed.close()
    grown = []
    for rank in range(3):  # an elastic restart at 3 ranks, each loading the checkpointed state
        logs.append(tmp_path / f"after{rank}.jsonl")
        feed = Feed(index, config(), world_size=3, rank=rank, audit_log=logs[-1])
        feed.load_state_dict(state)
        grown.append(feed)
    while not all(feed.epoch > 0 for feed in grown):
        for feed in grown:
            feed.next_batch()
    for feed in grown:
        feed.close()
    report = verify_coverage(index, 0, read_delivery_logs(logs))
    assert report.ok, report


def test_resize_in_the_middle_of_a_step_is_refused(index: SampleIndex) -> None:
    with Feed(index, config(), world_size=2, rank=0, grad_accum=2) as feed:
        feed.next_batch()
        with pytest.raises(FeedError, match="step boundary"):
            feed.resize(3, 0)
        feed.next_batch()
        feed.resize(3, 2)
        assert feed.next_batch()["__info__"]["topology_version"] == 1


def test_close_leaves_no_threads_or_processes_and_is_idempotent(index: SampleIndex) -> None:
    before = omnifeed_threads()
    processes = FeedConfig(plan=PlanConfig(seed=3, batch_size=4), pools={"image": PoolConfig(workers=2, processes=2)})
    feed = Feed(index, processes)  # images decode in worker processes
    feed.next_batch()
    assert omnifeed_threads() != before and decode_processes()
    feed.close()
    feed.close()
    assert omnifeed_threads() == before
    assert decode_processes() == []
    with pytest.raises(FeedError, match="closed"):
        feed.next_batch()


def test_metrics_report_buffers_latency_throughput_and_waiting(index: SampleIndex) -> None:
    with Feed(index, config()) as feed:
        for _ in range(5):
            feed.next_batch()
        metrics = feed.metrics()
    assert metrics["batches"] == 5 and metrics["samples"] == 20 and metrics["bytes_read"] > 0
    assert metrics["consumer_wait_s"] >= 0 and metrics["bad_samples"] == 0
    image = metrics["modalities"]["image"]
    assert image["decoded"] > 0 and image["decode_latency_s"]["p50"] > 0


def test_a_cost_model_that_mischarges_decoded_sizes_is_refused() -> None:
    from omnifeed.bucketing import BucketingConfig, CostModel
    from omnifeed.loader import DecodeConfig, ImageDecodeConfig, VideoDecodeConfig

    cropped = DecodeConfig(image=ImageDecodeConfig(crop="center", size=224))
    with pytest.raises(ValueError, match="crop 'center' is 'fixed'"):
        FeedConfig(plan=PlanConfig(bucketing=BucketingConfig(budget=1e5)), decode=cropped)
    FeedConfig(
        plan=PlanConfig(bucketing=BucketingConfig(budget=1e5, cost=CostModel(image_resize="fixed"))), decode=cropped
    )
    with pytest.raises(ValueError, match="video_max_frames"):
        FeedConfig(
            plan=PlanConfig(bucketing=BucketingConfig(budget=1e5)),
            decode=DecodeConfig(video=VideoDecodeConfig(num_frames=8)),
        )
    FeedConfig(decode=cropped)  # fixed-size batches charge nothing: no constraint


def test_a_packed_feeds_audit_log_verifies_exactly_once(index: SampleIndex, tmp_path: Path) -> None:
    from omnifeed.bucketing import BucketingConfig

    packing = BucketingConfig(mode="packing", budget=64, overlong="split")
    log = tmp_path / "packed.jsonl"
    with Feed(index, FeedConfig(plan=PlanConfig(seed=1, bucketing=packing)), audit_log=log) as feed:
        batches = list(feed)
    split = [b for b in batches if any(start > 0 for start, _ in b["__info__"]["segments"])]
    assert split, "some sample is longer than a pack and was split"
    assert verify_coverage(index, 0, read_delivery_logs([log])).ok


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_len_is_the_batches_iteration_yields_from_here(index: SampleIndex, grad_accum: int) -> None:
    with Feed(index, config(), world_size=3, rank=1, grad_accum=grad_accum) as feed:
        expected = len(feed)
        batches = iter(feed)
        first = [next(batches) for _ in range(3)]
        state = feed.state_dict()
        assert len(feed) == expected - len(first)  # mid-step too (grad_accum 2: 3 is not a step boundary)
        rest = list(batches)
    assert len(first) + len(rest) == expected
    with Feed(index, config(), world_size=3, rank=1, grad_accum=grad_accum) as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == len(rest)


def test_a_user_decoder_returning_torch_tensors_gives_the_same_batches(index: SampleIndex) -> None:
    from omnifeed.loader import DecodeConfig, make_decoder

    image = make_decoder("image", DecodeConfig())

    def as_tensor(data: bytes, key: str) -> torch.Tensor:  # the engine works in numpy: this is converted
        return torch.from_numpy(image(data, key)).requires_grad_(False)  # type: ignore[arg-type]

    with Feed(index, config()) as feed:
        expected = [feed.next_batch() for _ in range(3)]
    with Feed(index, config(), decoders={"image": as_tensor}) as feed:
        got = [feed.next_batch() for _ in range(3)]
    assert all(same_batch(a, b) for a, b in zip(got, expected))
    assert any(isinstance(b.get("image", {}).get("pixels"), torch.Tensor) for b in got)


def test_take_is_the_next_micro_batch_before_collation(index: SampleIndex) -> None:
    with Feed(index, config(), world_size=2, rank=1) as feed, Feed(index, config(), world_size=2, rank=1) as other:
        taken = [feed.take() for _ in range(2)]
        batches = [other.next_batch() for _ in range(2)]
        assert feed.state_dict() == other.state_dict()  # the position moved past them alike
    for one, batch in zip(taken, batches, strict=True):
        assert one.keys == batch["__key__"] == one.record["keys"] and len(one.samples) == len(one.keys)
        assert one.info == {k: v for k, v in batch["__info__"].items() if k in one.info}
    with pytest.raises(FeedError, match="closed"):
        feed.take()


def test_feeds_on_shared_resources_deliver_what_their_own_would_and_leave_them_open(index: SampleIndex) -> None:
    engine = DecodeEngine.build(index, config(), with_pools=False)
    shared = engine.shared(Plan.from_index(index, config().plan))
    try:
        for rank in range(2):  # one after the other, on the same reader
            with (
                Feed(index, config(), world_size=2, rank=rank, shared=shared) as feed,
                Feed(index, config(), world_size=2, rank=rank) as own,
            ):
                assert feed.plan is shared.plan
                assert [feed.next_batch()["__key__"] for _ in range(2)] == [
                    own.next_batch()["__key__"] for _ in range(2)
                ]
        assert engine.metrics.snapshot({})["batches"] == 4  # counted in the owner's metrics
        with pytest.raises(ValueError, match="shared field reader"):
            Feed(index, config(), shared=shared, decoders={"text": lambda data, key: data})
    finally:
        engine.close()


def test_a_budget_s_epoch_written_ahead_feeds_the_same_batches_and_length(
    demo_shards: list[Path], tmp_path: Path
) -> None:
    """`omnifeed plan --write-epochs` beside a feed's index: the feed deals from the files (nothing planned), its
    batches and `len` are those of planning live, and an audit log of the epoch verifies exactly once."""
    from omnifeed.bucketing import BucketingConfig
    from omnifeed.loader.plan import planned_epochs, write_planned_epochs

    build_index([str(p) for p in demo_shards], tmp_path / "index", IndexConfig(workers=1), progress=False)
    index = SampleIndex(tmp_path / "index")
    budget = FeedConfig(plan=PlanConfig(seed=2, bucketing=BucketingConfig(budget=2e4, overlong="alone")))
    with Feed(index, budget, world_size=2, rank=0) as live:
        live_length, live_keys = len(live), [b["__key__"] for b in live]
    write_planned_epochs(Plan.from_index(index, budget.plan), index.path, range(4))  # the read-ahead goes on
    log = tmp_path / "written.jsonl"
    with Feed(index, budget, world_size=2, rank=0, audit_log=log) as feed:
        assert planned_epochs(feed.plan) is not None and len(feed) == live_length
        assert [b["__key__"] for b in feed] == live_keys
        assert feed.plan.work == 0
    with Feed(index, budget, world_size=2, rank=1, audit_log=log) as other:
        list(other)
    assert verify_coverage(index, 0, read_delivery_logs([log])).ok
