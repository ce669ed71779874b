"""torchdata ``StatefulDataLoader``'s phases of the resume benchmark: a shuffled map-style dataset of indices,
its state at the position (iterated for real, or a real state with its counters moved), then resumed."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ._bench_resume_measure import (
    ITERATE_LIMIT,
    SEED,
    Missing,
    position_of,
    read_expected,
    timed_resume,
    write_expected,
)


def import_torchdata() -> Any:
    """``StatefulDataLoader``, or ``Missing``."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as exc:
        raise Missing(f"torchdata.stateful_dataloader does not import ({exc})") from exc
    return StatefulDataLoader


def indices_dataset(samples: int) -> Any:
    """A map-style dataset of ``samples`` items, item ``i`` being ``tensor(i)``."""
    import torch

    class Indices(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return samples

        def __getitem__(self, i: int) -> Any:
            return torch.tensor(i)

    return Indices()


def torchdata_loader(samples: int, batch_size: int, workers: int, seed: int) -> Any:
    """A shuffled ``StatefulDataLoader`` over ``indices_dataset``, its generator seeded with ``seed``."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(seed)
    return import_torchdata()(
        indices_dataset(samples),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        generator=generator,
        multiprocessing_context="fork" if workers else None,
    )


def torchdata_state(
    samples: int, batch_size: int, workers: int, batches: int, iterate_limit: int = ITERATE_LIMIT
) -> tuple[dict[str, Any], list[int], str]:
    """The loader's state after ``batches`` batches, the batch an uninterrupted run yields next, and how.

    Up to ``iterate_limit`` batches are iterated for real (the expected batch is then the real
    next one). Deeper, the state is a real one taken after a few batches with its position
    counters moved to ``batches`` (``shift_torchdata_state``), and the expected batch is the
    sampler's permutation (``torch.randperm`` from the state's generator) at the position.
    """
    loader = torchdata_loader(samples, batch_size, workers, SEED)
    iterator = iter(loader)
    real = batches <= iterate_limit
    for _ in range(batches if real else min(3, batches)):
        next(iterator)
    state = loader.state_dict()
    if real:
        expected = [int(i) for i in next(iterator)]
        how = f"iterated for real to batch {batches}; expected: the next batch of that run"
    else:
        state = shift_torchdata_state(state, batches, batch_size, workers)
        expected = permutation_batch(state, samples, batches * batch_size, batch_size, workers)
        how = (
            f"a real state after {min(3, batches)} batches, counters moved to batch {batches} (iterating "
            f"there takes ~1 ms a batch); expected: torch.randperm from the state's generator"
        )
    del iterator
    return state, expected, how


def shift_torchdata_state(state: dict[str, Any], batches: int, batch_size: int, workers: int) -> dict[str, Any]:
    """``state`` with every position counter at ``batches`` batches (the generator state is the epoch's, unchanged)."""
    main = state["_snapshot"]["_main_snapshot"] if workers else state
    main["_sampler_iter_state"]["samples_yielded"] = batches * batch_size
    main["_sampler_iter_state"]["sampler_iter_state"]["yielded"] = batches * batch_size
    main["_sampler_iter_yielded"] = batches
    if workers:
        state["_snapshot"]["_snapshot_step"] = batches
        state["_snapshot"]["_last_yielded_worker_id"] = (batches - 1) % workers
    else:
        state["_num_yielded"] = batches
    return state


def permutation_batch(state: dict[str, Any], samples: int, position: int, batch_size: int, workers: int) -> list[int]:
    """The sampler's epoch permutation (from the state's generator) at ``position``: the uninterrupted batch."""
    import torch

    main = state["_snapshot"]["_main_snapshot"] if workers else state
    generator = torch.Generator()
    generator.set_state(main["_sampler_iter_state"]["sampler_iter_state"]["generator"])
    return [int(i) for i in torch.randperm(samples, generator=generator)[position : position + batch_size]]


def _plain_state(value: Any) -> Any:
    """A state dict with its tensors (the generator's state) as tagged lists, for JSON."""
    import torch

    if isinstance(value, dict):
        return {k: _plain_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_state(v) for v in value]
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value


def _saved_size(state: dict[str, Any]) -> int:
    """Bytes of the state as a trainer checkpoints it (``torch.save``)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def _tensor_state(value: Any) -> Any:
    """The inverse of `_plain_state`."""
    import torch

    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        return {k: _tensor_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tensor_state(v) for v in value]
    return value


def torchdata_save(options: argparse.Namespace) -> dict[str, Any]:
    """The loader's state at the position (as JSON: nothing here unpickles) and the expected batch."""
    import_torchdata()
    position, batches = position_of(options)
    options.work.mkdir(parents=True, exist_ok=True)
    state, expected, how = torchdata_state(options.samples, options.batch_size, options.workers, batches)
    (options.work / "state.json").write_text(json.dumps(_plain_state(state)), encoding="utf-8")
    write_expected(options.work, expected)
    return {"status": "ok", "position": position, "build_s": 0.0, "how": how}


def torchdata_resume(options: argparse.Namespace) -> dict[str, Any]:
    """A new loader (another seed) + ``load_state_dict`` + the first batch; the sampler fast-forwards."""
    started = time.perf_counter()
    loader = torchdata_loader(options.samples, options.batch_size, options.workers, SEED + 1)
    open_s = time.perf_counter() - started
    path = options.work / "state.json"
    state = _tensor_state(json.loads(path.read_text(encoding="utf-8")))

    def resume() -> list[int]:
        loader.load_state_dict(state)
        iterator = iter(loader)
        batch = [int(i) for i in next(iterator)]
        del iterator
        return batch

    batch, resume_s, memory = timed_resume(resume)
    ok = batch == read_expected(options.work)
    return {
        "status": "ok" if ok else "error: the first batch after resume is not the expected one",
        "open_s": round(open_s, 4),
        "resume_s": round(resume_s, 4),
        **memory.figures(),
        "state_bytes": _saved_size(state),
        "first_batch_ok": ok,
        "timed": "StatefulDataLoader.load_state_dict + iter + next (workers started inside it)",
    }
