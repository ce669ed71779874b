"""One rank of the training scenario of `omnifeed bench`: take a batch, "compute" on it, meet the other ranks.

A rank is a process of its own (``multiprocessing`` spawn) that builds its loader, waits at the
barrier for every rank to be ready, then runs steps until any rank's loader is exhausted:

1. take its next batch (the time it waits is its *stall*);
2. "compute" for ``c`` seconds per padded token of the batch (`batch_tokens`), as a sleep: a GPU
   kernel does not take a CPU core, and a sleep does not either, so the loader keeps every
   core it would have beside a real GPU job;
3. wait at the barrier for the other ranks (the all-reduce of a synchronous data-parallel job).

It records (stall, compute, barrier wait, padded tokens, useful tokens, samples) per step and the
CPU seconds of its process tree (its DataLoader workers; rank 0 also the service's tree) from the
end of the first step, which is left out of every figure (start-up), to the end.

**The token model** (what the simulated accelerator processes; the batch is padded per
modality to its longest member, and the padding is processed too):

- text: one token per tokenizer id (the ``bytes`` tokenizer: a UTF-8 byte);
- image: its 14×14-pixel patches, ``ceil(h/14) · ceil(w/14)`` of its own size (``sizes``): a
  vision transformer at native aspect ratio takes an image as a sequence of patches;
- video: frames × patches per frame, one sequence per clip;
- audio: 25 tokens per second of waveform at the decode sample rate.

Each modality's rows are padded to its longest sequence in the batch: padded tokens are
``rows × longest``, useful tokens the sum of the rows' own lengths.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._bench_training_data import AUDIO_TOKENS_PER_S, PATCH_PX, TrainingFolder

TRAINING_LOADERS = ("dataloader", "omnifeed", "omnifeed-service")


@dataclass(frozen=True)
class TrainingRankSpec:
    """What one rank runs: its loader over the dataset's forms, its share, and the compute per padded token."""

    loader: str  # one of TRAINING_LOADERS
    rank: int
    ranks: int
    batch_size: int  # DataLoader's samples per batch
    workers: int  # DataLoader worker processes of this rank
    folder: str  # the samples as files {key}.{field} (DataLoader)
    service: dict[str, Any]  # a ServiceConfig as JSON (omnifeed in-process: its feed and index)
    seconds_per_token: float  # c: the compute of one padded token, seconds (0: no compute)
    socket: str = ""  # the service's socket (omnifeed-service)
    service_pid: int = 0  # counted in rank 0's CPU seconds


def _patches(height: int, width: int) -> int:
    return math.ceil(height / PATCH_PX) * math.ceil(width / PATCH_PX)


def _audio_tokens(samples: int, sample_rate: int) -> int:
    return math.ceil(samples / sample_rate * AUDIO_TOKENS_PER_S)


def batch_tokens(batch: dict[str, Any], sample_rate: int) -> tuple[int, int]:
    """(padded, useful) tokens of a batch in omnifeed's batch format, by the token model above."""
    padded = useful = 0
    if "text" in batch:
        count, longest = batch["text"]["tokens"].shape
        padded += count * longest
        useful += int(sum(batch["text"]["lengths"].tolist()))
    rows = []
    if "image" in batch:
        rows.append([_patches(h, w) for h, w in batch["image"]["sizes"].tolist()])
    if "video" in batch:
        video = batch["video"]
        rows.append([n * _patches(h, w) for n, (h, w) in zip(video["lengths"].tolist(), video["sizes"].tolist())])
    if "audio" in batch:
        rows.append([_audio_tokens(n, sample_rate) for n in batch["audio"]["lengths"].tolist()])
    for lengths in rows:
        padded += len(lengths) * max(lengths)
        useful += sum(lengths)
    return padded, useful


def _loader(spec: TrainingRankSpec) -> Iterable[dict[str, Any]]:
    from omnifeed.loader.service import ServiceConfig
    from omnifeed.trainer_adapter import FeedClient

    config = ServiceConfig.model_validate(spec.service)
    if spec.loader == "omnifeed-service":
        return FeedClient(spec.socket, rank=spec.rank, world_size=spec.ranks)
    if spec.loader == "omnifeed":
        return FeedClient.in_process(config, rank=spec.rank, world_size=spec.ranks)
    import torch.utils.data

    from ._bench_spec import collate_samples

    dataset = TrainingFolder(spec.folder, config.feed.decode)
    sampler = torch.utils.data.DistributedSampler(  # type: ignore[var-annotated]
        dataset,  # type: ignore[arg-type]
        num_replicas=spec.ranks,
        rank=spec.rank,
        shuffle=True,
        seed=0,
    )
    return torch.utils.data.DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_size=spec.batch_size,
        sampler=sampler,
        num_workers=spec.workers,
        collate_fn=collate_samples,
    )


def _tree_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds so far of these processes and their live descendants."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system + times.children_user + times.children_system
    return total


def run_rank(spec: TrainingRankSpec, barrier: Any, done: Any) -> dict[str, Any]:
    """Build the loader, meet the others, run steps until any rank runs out: per-step records and CPU seconds."""
    import os

    from omnifeed.loader.service import ServiceConfig

    sample_rate = ServiceConfig.model_validate(spec.service).feed.decode.audio.sample_rate
    pids = [os.getpid()] + ([spec.service_pid] if spec.rank == 0 and spec.service_pid else [])
    loader = _loader(spec)
    barrier.wait()  # every rank has its loader: go
    batches = iter(loader)
    steps: list[list[float]] = []
    cpu_start = wall_start = wall_end = 0.0
    while True:
        taking = time.perf_counter()
        batch = next(batches, None)
        taken = time.perf_counter()
        padded = useful = samples = 0
        if batch is None:
            done[spec.rank] = len(steps) + 1  # the step (from 1) at which this rank ran out
        else:
            padded, useful = batch_tokens(batch, sample_rate)
            samples = len(batch["__key__"])
            del batch
            if spec.seconds_per_token > 0:
                time.sleep(spec.seconds_per_token * padded)
        computed = time.perf_counter()
        barrier.wait()
        met = time.perf_counter()
        if any(0 < out <= len(steps) + 1 for out in done[:]):  # a step needs every rank: the epoch ends
            break  # for all at the first rank without a batch (a rank a step ahead may have run out after it)
        steps.append([taken - taking, computed - taken, met - computed, padded, useful, samples])
        wall_end = met
        if len(steps) == 1:
            cpu_start, wall_start = _tree_cpu_seconds(pids), met
    cpu_end = _tree_cpu_seconds(pids)
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return {
        "rank": spec.rank,
        "steps": steps,
        "wall_s": wall_end - wall_start,
        "cpu_s": cpu_end - cpu_start,
    }


def rank_process(spec: TrainingRankSpec, barrier: Any, done: Any, results: Any) -> None:
    """A rank's process: `run_rank`, its result (or its error) put on ``results``; the barrier broken on error."""
    try:
        results.put(run_rank(spec, barrier, done))
    except BaseException as exc:
        barrier.abort()
        results.put({"rank": spec.rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
