"""`IndexStream`: one epoch of a loader's index sampler, restartable at any task from a few values.

The index sampler (the batch sampler when the loader batches, else the sampler) yields one *task* per
batch. Resuming mid-epoch restarts its sequence after the last consumed task, in one of four ways
chosen from the sampler:

- ``stateful``: the sampler (or the sampler inside torch's ``BatchSampler``, or the sampler's iterator)
  has ``state_dict``/``load_state_dict``. Its state after each task is snapshotted; loading the snapshot
  of the last consumed task continues after it.
- ``fixed``: the order needs no randomness (``SequentialSampler``, ``DistributedSampler`` at a given
  epoch, the endless sampler of an iterable dataset): iterate again and skip the consumed tasks. The
  loader's generator (the base seed's), if given, is captured and restored as in ``rng``.
- ``seeded``: torch's ``RandomSampler`` without a generator draws one 64-bit seed from the global RNG as
  its iteration starts. That seed is read without consuming it; a replay iterates a copy of the sampler
  whose generator is seeded with it. The state is one integer.
- ``rng``: any other sampler. The RNG states it may read are captured as the epoch starts (its torch
  generators, the loader's generator, and the global torch RNG unless every sampler is a torch one with
  its own generator). A replay restores them, iterates from the start, redraws the loader's base seed
  where torch draws it, skips the consumed tasks, and puts the global RNG back as it found it. Exact for
  samplers that draw their randomness as their iteration starts, as all of torch's do.

Replay info (``replay``): ``None`` (nothing to replay, as for ``fixed`` without a generator), or a dict
with ``seed`` (``seeded``: int, or None before the first pull), ``global_rng`` (base64 of the global
torch RNG state, or None), ``generators`` (base64 states of the captured generators, in a fixed order),
``draws_base_seed`` (the epoch drew the worker base seed after ``iter(sampler)``, as a new torch
iterator does; an epoch on persistent workers does not) and ``pulled`` (the first task was pulled, so
the sampler has made its draws). Between epochs (a ``fresh`` or ``finished`` state) only ``generators``
matters: the states the next epoch starts from.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler
from torch.utils.data.dataloader import _InfiniteConstantSampler
from torch.utils.data.distributed import DistributedSampler

_FIXED_ORDER = (SequentialSampler, DistributedSampler, _InfiniteConstantSampler)
_OWN_GENERATOR = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def has_state(obj: object) -> bool:
    """Whether ``obj`` follows the ``state_dict``/``load_state_dict`` protocol (torchdata's ``Stateful``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _unchanged(obj: object, classes: type | tuple[type, ...]) -> bool:
    """``obj`` is one of ``classes`` and iterates exactly as that class does (no overridden ``__iter__``)."""
    for cls in classes if isinstance(classes, tuple) else (classes,):
        if isinstance(obj, cls) and type(obj).__iter__ is cls.__iter__:  # type: ignore[attr-defined]
            return True
    return False


def encode_rng(state: torch.Tensor) -> str:
    """A torch RNG state (uint8 tensor) as base64 text."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    """The RNG state of ``encode_rng`` text."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _peek_global_seed() -> int:
    """The seed ``RandomSampler`` will draw next from the global RNG, leaving the RNG untouched."""
    state = torch.get_rng_state()
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    torch.set_rng_state(state)
    return seed


class IndexStream:
    """The index sampler's tasks for one epoch, with what it takes to restart them after any task."""

    def __init__(self, index_sampler: Iterable[Any], generator: torch.Generator | None) -> None:
        self.index_sampler = index_sampler
        self._loader_generator = generator
        batching = _unchanged(index_sampler, BatchSampler)
        self._chain: list[Any] = (
            [index_sampler, index_sampler.sampler]  # type: ignore[attr-defined]
            if batching
            else [index_sampler]
        )
        self._stateful = next((s for s in self._chain if has_state(s)), None)
        base = self._chain[-1]
        if self._stateful is not None:
            self.mode = "stateful"
        elif _unchanged(base, _FIXED_ORDER):
            self.mode = "fixed"
        elif _unchanged(base, RandomSampler) and base.generator is None:
            self.mode = "seeded"
        else:
            self.mode = "rng"
        self._iterator: Iterator[Any] | None = None
        self._iterator_state = False
        self._lookahead: list[Any] = []  # a task pulled early, inside a replay's RNG window
        self.pulled = 0
        self.replay: dict[str, Any] | None = None

    # -- the RNGs a replay restores ---------------------------------------------------------
    def _generators(self) -> list[torch.Generator]:
        """The torch generators the epoch's order may read: the samplers' own, then the loader's."""
        candidates = [getattr(s, "generator", None) for s in self._chain] + [self._loader_generator]
        found: list[torch.Generator] = []
        for g in candidates:
            if isinstance(g, torch.Generator) and all(g is not h for h in found):
                found.append(g)
        return found

    def _reads_global_rng(self) -> bool:
        """Whether some sampler of the chain may draw from the global torch RNG."""
        for sampler in self._chain:
            if _unchanged(sampler, BatchSampler) or _unchanged(sampler, _FIXED_ORDER):
                continue
            if not (_unchanged(sampler, _OWN_GENERATOR) and isinstance(sampler.generator, torch.Generator)):
                return True
        return False

    def _capture(self, draws_base_seed: bool) -> dict[str, Any]:
        reads_global = self.mode == "rng" and self._reads_global_rng()
        return {
            "seed": None,
            "global_rng": encode_rng(torch.get_rng_state()) if reads_global else None,
            "generators": [encode_rng(g.get_state()) for g in self._generators()],
            "draws_base_seed": draws_base_seed,
            "pulled": False,
        }

    def _tracks_rng(self) -> bool:
        """Whether an epoch keeps replay info: its sampler draws, or the loader's generator may."""
        return self.mode in ("seeded", "rng") or (self.mode == "fixed" and bool(self._generators()))

    def idle_replay(self) -> dict[str, Any] | None:
        """Between epochs: the generators' states now, for the next epoch to start from (None without any)."""
        if self.mode == "stateful" or not self._generators():
            return None
        return {**self._capture(False), "global_rng": None}

    def restore_generators(self, replay: Mapping[str, Any]) -> None:
        """Put the captured generators back in the states ``replay`` holds: all of them, or (``ValueError``) none."""
        generators = self._generators()
        if len(replay["generators"]) != len(generators):
            raise ValueError(
                f"the state holds {len(replay['generators'])} generator states; this loader's "
                f"samplers use {len(generators)}: resume with the same sampler and generator"
            )
        before = [g.get_state() for g in generators]
        try:
            for g, text in zip(generators, replay["generators"]):
                g.set_state(decode_rng(text))
        except (TypeError, ValueError, RuntimeError) as exc:  # binascii.Error is a ValueError
            for g, old in zip(generators, before):
                g.set_state(old)
            raise ValueError(f"the state's generator states do not fit this loader's generators ({exc})") from None

    # -- an epoch -------------------------------------------------------------------------------
    def load_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        """Put a stateful sampler in the state ``snapshot`` holds (between epochs)."""
        if snapshot.get("sampler") is not None and self._stateful is not None:
            self._stateful.load_state_dict(copy.deepcopy(dict(snapshot["sampler"])))

    def begin(
        self,
        *,
        consumed: int = 0,
        replay: Mapping[str, Any] | None = None,
        snapshot: Mapping[str, Any] | None = None,
        draws_base_seed: bool = True,
    ) -> None:
        """Start the epoch, positioned after ``consumed`` tasks (a resume) or at its start (fresh).

        A fresh start creates the iterator only: the caller then draws the base seed, as torch does
        (``draws_base_seed=False``: it does not, as on persistent workers).
        """
        self.pulled = 0
        self.replay = None
        self._lookahead = []
        if snapshot is not None:
            self.load_snapshot(snapshot)
        iterator_snapshot = snapshot.get("iterator") if snapshot is not None else None
        if replay is not None and self.mode in ("seeded", "rng") and iterator_snapshot is None:
            self.replay = copy.deepcopy(dict(replay))
            self._iterator = self._replayed(self.replay, consumed)
            self._iterator_state = False
            return
        if replay is not None and self.mode == "fixed":  # a fixed order; the loader's generator drew the base seed
            self.replay = copy.deepcopy(dict(replay))
            self.restore_generators(self.replay)
            if self.replay["draws_base_seed"] and self._loader_generator is not None:
                torch.empty((), dtype=torch.int64).random_(generator=self._loader_generator)
        elif consumed == 0 and snapshot is None and self._tracks_rng():
            self.replay = self._capture(draws_base_seed)
        self._iterator = iter(self.index_sampler)
        self._iterator_state = has_state(self._iterator)
        if self._iterator_state:
            self.replay = None  # the iterator's own state replaces the replay
            if iterator_snapshot is not None:
                self._iterator.load_state_dict(copy.deepcopy(dict(iterator_snapshot)))  # type: ignore[attr-defined]
        if self.restartable_by_state:
            self.pulled = consumed
        else:
            for _ in range(consumed):
                self._skip()

    def _skip(self) -> None:
        assert self._iterator is not None
        try:
            next(self._iterator)
        except StopIteration:
            raise ValueError(
                f"the state is past the end of this sampler's epoch (task {self.pulled + 1}): it was saved "
                "with another dataset, sampler or batch size; resume with the same ones"
            ) from None
        self.pulled += 1

    def _replayed(self, replay: dict[str, Any], consumed: int) -> Iterator[Any]:
        """An iterator over the epoch ``replay`` describes, past its first ``consumed`` tasks.

        Restores the captured generators (left where the epoch leaves them, as in the original run)
        and, for the replay, the global RNG (then put back as it was).
        """
        self.restore_generators(replay)
        seeded = self.mode == "seeded"
        if seeded and replay["seed"] is None and consumed:
            raise ValueError("the state has consumed batches but no shuffle seed; was it edited by hand?")
        user_rng = torch.get_rng_state()
        try:
            if replay["global_rng"] is not None:
                torch.set_rng_state(decode_rng(replay["global_rng"]))
            if seeded and replay["seed"] is not None:  # the sampler's seed, drawn when the epoch began
                generator = torch.Generator()
                generator.manual_seed(int(replay["seed"]))
                copies = [copy.copy(s) for s in self._chain]
                copies[-1].generator = generator
                if len(copies) == 2:
                    copies[0].sampler = copies[1]
                self._iterator = iter(copies[0])
            else:
                self._iterator = iter(self.index_sampler)
            if replay["draws_base_seed"] and (self._loader_generator is not None or replay["global_rng"] is not None):
                torch.empty((), dtype=torch.int64).random_(generator=self._loader_generator)  # torch's base seed
            for _ in range(consumed):
                self._skip()
            # the next pull may draw too (a sampler draws on its first pull): keep it in this window, unless the
            # saved run had not pulled yet (its first pull then draws from the global RNG the caller restored)
            if not seeded and replay["pulled"]:
                try:
                    self._lookahead = [next(self._iterator)]
                except StopIteration:
                    self._lookahead = []
            return self._iterator
        finally:
            torch.set_rng_state(user_rng)

    def pull(self) -> Any:
        """The next task's index (or list of indices); ``StopIteration`` at the end of the epoch."""
        assert self._iterator is not None, "begin() first"
        if self._lookahead:
            index = self._lookahead.pop()
        else:
            if self.mode == "seeded" and self.replay is not None and self.replay["seed"] is None:
                self.replay["seed"] = _peek_global_seed()
            index = next(self._iterator)
        if self.replay is not None:
            self.replay["pulled"] = True
        self.pulled += 1
        return index

    @property
    def restartable_by_state(self) -> bool:
        """Whether restarts load a snapshot (a stateful sampler or iterator) rather than skip tasks."""
        return self.mode == "stateful" or self._iterator_state

    def snapshot(self) -> dict[str, Any] | None:
        """The sampler's (and its iterator's) state after the latest pull; None when restarts skip tasks."""
        if not self.restartable_by_state:
            return None
        return {
            "sampler": self._stateful.state_dict() if self._stateful is not None else None,
            "iterator": self._iterator.state_dict() if self._iterator_state else None,  # type: ignore[union-attr]
        }

    def idle_snapshot(self) -> dict[str, Any] | None:
        """The stateful sampler's live state between epochs (no iterator), or None."""
        if self._stateful is None:
            return None
        return {"sampler": self._stateful.state_dict(), "iterator": None}
