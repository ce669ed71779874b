"""omnifeed's DataLoader behaves as torch's: every test runs against both classes (or compares them)."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import time
import warnings
from collections import namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from omnifeed.loader import DataLoader

LOADERS = [pytest.param(tud.DataLoader, id="torch"), pytest.param(DataLoader, id="omnifeed")]
pytestmark = pytest.mark.timeout(120)
Pair = namedtuple("Pair", "x label")


class Squares(Dataset):
    """Item i: a small tensor, a number, a string and a numpy array."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.tensor([i, i * i]), "i": i, "name": f"s{i}", "a": np.full(2, i, dtype=np.float32)}


class Failing(Squares):
    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == 5:
            raise ValueError(f"sample {i} is broken")
        return super().__getitem__(i)


class Sharded(IterableDataset):
    """Items 0..n-1, split between workers by ``get_worker_info()`` (worker w takes i with i % W == w)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(worker, self.n, workers))


class Uneven(IterableDataset):
    """Worker 0 yields 2 items, worker 1 yields 7."""

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        return iter(range(worker * 100, worker * 100 + (2 if worker == 0 else 7)))


class Counted(Sharded):
    def __len__(self) -> int:
        return self.n


class Randomness(Dataset):
    """What a worker's random generators give, and its seed."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[float, float, float, int]:
        info = get_worker_info()
        return random.random(), torch.rand(()).item(), float(np.random.rand()), info.seed if info else -1


class Pids(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return os.getpid()


class Slow(Squares):
    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == 0:
            time.sleep(1.5)
        return super().__getitem__(i)


class WithGetitems(Squares):
    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [{**self[i], "via": "getitems"} for i in indices]


def plain(batch: Any) -> Any:
    """A batch as plain Python values, to compare loaders."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", str(batch.dtype), batch.tolist())
    if isinstance(batch, np.ndarray):
        return ("ndarray", str(batch.dtype), batch.tolist())
    if isinstance(batch, dict):
        return {k: plain(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch).__name__, [plain(v) for v in batch]
    return batch


def ids(loader: Any) -> list[list[int]]:
    return [batch["i"].tolist() for batch in loader]


def consume(loader: Any) -> list[Any]:
    """Every batch; the workers are stopped even when a batch raises (torch's iterator, left to the garbage
    collector in the exception's reference cycle, can lose its queues first and wait 5 s per worker)."""
    iterator = iter(loader)
    try:
        return list(iterator)
    finally:
        stop = getattr(iterator, "_shutdown_workers", None) or getattr(iterator, "close", None)
        if stop is not None:
            stop()


# -- batches ---------------------------------------------------------------------------------
@pytest.mark.parametrize("Loader", LOADERS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_style_batches_in_order_with_drop_last(Loader: Any, num_workers: int) -> None:
    assert ids(Loader(Squares(), batch_size=3, num_workers=num_workers)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert ids(Loader(Squares(), batch_size=3, drop_last=True, num_workers=num_workers)) == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
    ]


@pytest.mark.parametrize("Loader", LOADERS)
def test_default_collate_and_convert_give_torch_types(Loader: Any) -> None:
    batch = next(iter(Loader(Squares(), batch_size=2)))
    assert plain(batch) == {
        "x": ("tensor", "torch.int64", [[0, 0], [1, 1]]),
        "i": ("tensor", "torch.int64", [0, 1]),
        "name": ("list", ["s0", "s1"]),
        "a": ("tensor", "torch.float32", [[0.0, 0.0], [1.0, 1.0]]),
    }
    item = next(iter(Loader(Squares(), batch_size=None)))
    assert plain(item) == {
        "x": ("tensor", "torch.int64", [0, 0]),
        "i": 0,
        "name": "s0",
        "a": ("tensor", "torch.float32", [0.0, 0.0]),
    }


@pytest.mark.parametrize("Loader", LOADERS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_samplers_batch_samplers_and_custom_collate(Loader: Any, num_workers: int) -> None:
    def collate(items: list[dict[str, Any]]) -> Pair:
        return Pair(torch.stack([it["x"] for it in items]), [it["i"] for it in items])

    by_sampler = Loader(Squares(), batch_size=2, sampler=[9, 0, 4, 4, 7], num_workers=num_workers, collate_fn=collate)
    assert [b.label for b in by_sampler] == [[9, 0], [4, 4], [7]]
    assert all(type(b) is Pair and b.x.shape[1] == 2 for b in by_sampler)
    by_batches = Loader(Squares(), batch_sampler=[[3, 1], [2], [8, 8, 8]], num_workers=num_workers)
    assert ids(by_batches) == [[3, 1], [2], [8, 8, 8]]


@pytest.mark.parametrize("Loader", LOADERS)
def test_getitems_is_used_for_batches(Loader: Any) -> None:
    assert next(iter(Loader(WithGetitems(), batch_size=2)))["via"] == ["getitems", "getitems"]


@pytest.mark.parametrize("Loader", LOADERS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_shards_itself_by_worker_info(Loader: Any, num_workers: int) -> None:
    batches = [b.tolist() for b in Loader(Sharded(10), batch_size=2, num_workers=num_workers)]
    if num_workers == 0:
        assert batches == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    else:  # workers take turns: worker 0 has 0,2,4,6,8; worker 1 has 1,3,5,7,9
        assert batches == [[0, 2], [1, 3], [4, 6], [5, 7], [8], [9]]


@pytest.mark.parametrize("Loader", LOADERS)
def test_iterable_workers_that_end_early_drop_out_of_the_rotation(Loader: Any) -> None:
    batches = [b.tolist() for b in Loader(Uneven(), batch_size=2, num_workers=2)]
    assert batches == [[0, 1], [100, 101], [102, 103], [104, 105], [106]]
    dropped = [b.tolist() for b in Loader(Uneven(), batch_size=2, num_workers=2, drop_last=True)]
    assert dropped == [[0, 1], [100, 101], [102, 103], [104, 105]]


# -- len -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("Loader", LOADERS)
def test_len_of_map_style_and_iterable_loaders(Loader: Any) -> None:
    assert len(Loader(Squares(), batch_size=3)) == 4
    assert len(Loader(Squares(), batch_size=3, drop_last=True)) == 3
    assert len(Loader(Squares(), batch_size=None)) == 10
    assert len(Loader(Counted(7), batch_size=2)) == 4
    assert len(Loader(Counted(7), batch_size=2, drop_last=True)) == 3
    with pytest.raises(TypeError):
        len(Loader(Sharded(7), batch_size=2))
    assert len(iter(Loader(Squares(), batch_size=4))) == 3


@pytest.mark.parametrize("Loader", LOADERS)
def test_iterable_yielding_more_than_its_len_warns(Loader: Any) -> None:
    class Liar(Sharded):
        def __len__(self) -> int:
            return 2

    loader = Loader(Liar(3), batch_size=1)
    assert len(loader) == 2
    with pytest.warns(UserWarning, match=r"was reported to be 2\(when accessing len\(dataloader\)\), but 3 samples"):
        assert len(list(loader)) == 3


# -- construction ---------------------------------------------------------------------------------
INVALID: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"num_workers": -1}, ValueError, "num_workers option should be non-negative"),
    ({"timeout": -1}, ValueError, "timeout option should be non-negative"),
    ({"prefetch_factor": 2}, ValueError, "prefetch_factor option could only be specified in multiprocessing"),
    ({"num_workers": 1, "prefetch_factor": -1}, ValueError, "prefetch_factor option should be non-negative"),
    ({"persistent_workers": True}, ValueError, "persistent_workers option needs num_workers > 0"),
    ({"sampler": [0], "shuffle": True}, ValueError, "sampler option is mutually exclusive with shuffle"),
    ({"batch_sampler": [[0]], "batch_size": 2}, ValueError, "batch_sampler option is mutually exclusive"),
    ({"batch_sampler": [[0]], "drop_last": True}, ValueError, "batch_sampler option is mutually exclusive"),
    ({"batch_size": None, "drop_last": True}, ValueError, "batch_size=None option disables auto-batching"),
    ({"multiprocessing_context": "spawn"}, ValueError, "multiprocessing_context can only be used with multi-process"),
    ({"num_workers": 1, "multiprocessing_context": "nope"}, ValueError, "should specify a valid start method"),
    ({"num_workers": 1, "multiprocessing_context": 3}, TypeError, "multiprocessing_context option should be a valid"),
]


@pytest.mark.parametrize("Loader", LOADERS)
@pytest.mark.parametrize(("kwargs", "error", "message"), INVALID)
def test_invalid_combinations_raise_torchs_errors(
    Loader: Any, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Loader(Squares(), **kwargs)


@pytest.mark.parametrize("Loader", LOADERS)
@pytest.mark.parametrize("kwargs", [{"shuffle": True}, {"sampler": [0]}, {"batch_sampler": [[0]]}])
def test_iterable_datasets_refuse_shuffle_and_samplers(Loader: Any, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="DataLoader with IterableDataset: expected unspecified"):
        Loader(Sharded(4), **kwargs)


@pytest.mark.parametrize("Loader", LOADERS)
@pytest.mark.parametrize(
    "name", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_frozen_attributes_refuse_reassignment(Loader: Any, name: str) -> None:
    loader = Loader(Squares(), batch_size=2)
    with pytest.raises(ValueError, match=f"{name} attribute should not be set after DataLoader is initialized"):
        setattr(loader, name, getattr(loader, name))
    loader.num_workers = 0  # not frozen


@pytest.mark.parametrize("Loader", LOADERS)
def test_public_attributes(Loader: Any) -> None:
    generator = torch.Generator()
    loader = Loader(
        Squares(),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        generator=generator,
        timeout=3,
        persistent_workers=True,
        in_order=False,
        worker_init_fn=print,
    )
    assert (loader.batch_size, loader.drop_last, loader.num_workers, loader.prefetch_factor) == (4, False, 2, 2)
    assert isinstance(loader.sampler, tud.RandomSampler) and loader.sampler.generator is generator
    assert isinstance(loader.batch_sampler, tud.BatchSampler) and loader.batch_sampler.batch_size == 4
    assert loader.collate_fn is tud.default_collate and loader.generator is generator
    assert (loader.timeout, loader.persistent_workers, loader.in_order, loader.worker_init_fn) == (
        3,
        True,
        False,
        print,
    )
    assert loader.multiprocessing_context is None and loader.pin_memory is False and isinstance(loader.dataset, Squares)
    assert Loader(Squares(), batch_size=None).collate_fn is tud.default_convert


def test_isinstance_of_torchs_dataloader_and_generic_subscript() -> None:
    assert isinstance(DataLoader(Squares()), tud.DataLoader)
    assert DataLoader[int] is not None and issubclass(DataLoader, tud.DataLoader)


# -- random streams (compared between the two) ------------------------------------------------------
def both(run: Callable[[Any], Any]) -> tuple[Any, Any]:
    return run(tud.DataLoader), run(DataLoader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_and_worker_seeds_match_torch_and_leave_the_same_rng_behind(num_workers: int) -> None:
    def run(Loader: Any) -> Any:
        torch.manual_seed(7)
        random.seed(7)
        np.random.seed(7)
        shuffled = ids(Loader(Squares(), batch_size=3, shuffle=True, num_workers=num_workers))
        draws = [plain(b) for b in Loader(Randomness(), batch_size=2, num_workers=num_workers)]
        return shuffled, draws, torch.rand(3).tolist()

    torch_run, omnifeed_run = both(run)
    assert torch_run == omnifeed_run


def test_persistent_workers_draw_one_base_seed_like_torch() -> None:
    def run(Loader: Any) -> Any:
        torch.manual_seed(3)
        loader = Loader(Randomness(), batch_size=2, shuffle=True, num_workers=2, persistent_workers=True)
        return [[plain(b) for b in loader] for _ in range(2)], torch.rand(2).tolist()

    torch_run, omnifeed_run = both(run)
    assert torch_run == omnifeed_run


def test_given_generator_drives_shuffle_and_base_seed_like_torch() -> None:
    def run(Loader: Any) -> Any:
        generator = torch.Generator().manual_seed(11)
        loader = Loader(Squares(), batch_size=4, shuffle=True, generator=generator, num_workers=2)
        return ids(loader), ids(loader), [plain(b) for b in Loader(Randomness(), num_workers=2, generator=generator)]

    torch_run, omnifeed_run = both(run)
    assert torch_run == omnifeed_run


# -- workers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("Loader", LOADERS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_exception_is_raised_with_its_traceback(Loader: Any, num_workers: int) -> None:
    loader = Loader(Failing(), batch_size=2, num_workers=num_workers)
    with pytest.raises(ValueError, match="sample 5 is broken") as raised:
        consume(loader)
    if num_workers:
        assert "Caught ValueError in DataLoader worker process" in str(raised.value)
        assert "in __getitem__" in str(raised.value)


@pytest.mark.parametrize("Loader", LOADERS)
def test_worker_init_fn_runs_in_each_worker_and_its_error_surfaces(Loader: Any) -> None:
    def init(worker_id: int) -> None:
        info = get_worker_info()
        assert info is not None and info.id == worker_id and info.num_workers == 2 and isinstance(info.dataset, Squares)
        if worker_id == 1:
            raise RuntimeError("init failed in worker 1")

    loader = Loader(Squares(), batch_size=2, num_workers=2, worker_init_fn=init)
    with pytest.raises(RuntimeError, match="init failed in worker 1"):
        consume(loader)
    assert get_worker_info() is None


@pytest.mark.parametrize("Loader", LOADERS)
def test_timeout_raises_when_a_worker_is_too_slow(Loader: Any) -> None:
    loader = Loader(Slow(), batch_size=2, num_workers=1, timeout=0.2)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.2 seconds"):
        consume(loader)


@pytest.mark.parametrize("Loader", LOADERS)
def test_timeout_without_workers_is_refused_at_iter(Loader: Any) -> None:
    with pytest.raises(AssertionError):
        iter(Loader(Squares(), timeout=1))


_KILLED_WORKER = """
import json, os, signal, sys
import torch.utils.data as tud
from omnifeed.loader import DataLoader

class Killed(tud.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        if i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"i": i}

loader = (tud.DataLoader if sys.argv[1] == "torch" else DataLoader)(Killed(), batch_size=1, num_workers=1)
try:
    for _ in loader:
        pass
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "message": str(exc)}), flush=True)
    os._exit(0)
print(json.dumps({"type": None}), flush=True)
"""


@pytest.mark.parametrize("which", ["torch", "omnifeed"])
def test_killed_worker_is_reported(which: str) -> None:
    # In a process of its own: the SIGCHLD handler both loaders install (torch's) raises once more, late and
    # anywhere in the main thread, which would land in whatever test runs next.
    run = subprocess.run([sys.executable, "-c", _KILLED_WORKER, which], capture_output=True, text=True, timeout=120)
    reported = json.loads(run.stdout.strip().splitlines()[-1])
    if which == "omnifeed":
        assert reported["type"] == "RuntimeError" and "DataLoader worker" in reported["message"], run.stderr
    else:  # torch sometimes fails first on the dead worker's file-descriptor socket
        assert reported["type"] in ("RuntimeError", "EOFError", "ConnectionResetError", "ConnectionError"), run.stderr


_AFTER_A_BROKEN_HEAP = """
import multiprocessing, multiprocessing.heap, sys
from omnifeed.loader import DataLoader

heap = multiprocessing.heap.BufferWrapper._heap  # what an allocation interrupted by an exception leaves behind:
heap._lengths.append(64)                          # a free-block size whose list is empty
heap._len_to_seq[64] = []
try:
    multiprocessing.RawArray("b", 8)
    raise SystemExit("the heap is not broken; the test no longer tests anything")
except IndexError:
    pass
loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, multiprocessing_context=sys.argv[1])
print([batch.tolist() for batch in loader])
"""


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_start_in_a_process_whose_multiprocessing_heap_an_interrupt_broke(context: str) -> None:
    """Ctrl-C (or a late SIGCHLD error) inside multiprocessing's shared heap breaks RawArray for good; loaders still
    start."""
    run = subprocess.run(
        [sys.executable, "-c", _AFTER_A_BROKEN_HEAP, context], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[[0, 1], [2, 3], [4, 5], [6, 7]]"


@pytest.mark.parametrize("Loader", LOADERS)
def test_persistent_workers_serve_every_epoch(Loader: Any) -> None:
    calls: list[int] = []
    loader = Loader(Pids(), batch_size=1, num_workers=2, persistent_workers=True, worker_init_fn=calls.append)
    first = {b.item() for b in loader}
    second = {b.item() for b in loader}
    assert first == second and len(first) == 2 and os.getpid() not in first
    fresh = Loader(Pids(), batch_size=1, num_workers=2)
    assert {b.item() for b in fresh}.isdisjoint({b.item() for b in fresh} | first)


@pytest.mark.parametrize("Loader", LOADERS)
def test_in_order_false_yields_every_batch(Loader: Any) -> None:
    batches = ids(Loader(Squares(12), batch_size=2, num_workers=2, in_order=False))
    assert sorted(map(tuple, batches)) == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]


@pytest.mark.parametrize("Loader", LOADERS)
def test_pin_memory_without_accelerator_warns_like_torch(Loader: Any) -> None:
    if torch.accelerator.is_available():
        batch = next(iter(Loader(Squares(), batch_size=2, pin_memory=True, num_workers=2)))
        assert batch["x"].is_pinned()
        return
    with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accelerator is found"):
        batch = next(iter(Loader(Squares(), batch_size=2, pin_memory=True)))
    assert not batch["x"].is_pinned()


@pytest.mark.parametrize("Loader", LOADERS)
def test_worker_batches_equal_main_process_batches(Loader: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        here = [plain(b) for b in Loader(Squares(), batch_size=4)]
        there = [plain(b) for b in Loader(Squares(), batch_size=4, num_workers=2)]
    assert here == there


@pytest.mark.parametrize("Loader", LOADERS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_pickles_after_iterating(Loader: Any, num_workers: int) -> None:
    loader = Loader(Squares(), batch_size=4, num_workers=num_workers)
    first = [b["i"].tolist() for b in loader]
    assert [b["i"].tolist() for b in pickle.loads(pickle.dumps(loader))] == first


def test_worker_count_warning_is_given_once() -> None:
    workers = (os.cpu_count() or 1) + 1  # more than the machine suggests
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(list(range(8)), batch_size=4, num_workers=workers)
        for _ in range(2):  # two epochs
            assert len(list(loader)) == 2
    assert sum("worker processes in total" in str(w.message) for w in caught) == 1
