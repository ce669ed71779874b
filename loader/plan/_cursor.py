"""The cursor: the whole data state of a run, and how steps are dealt to data-parallel ranks.

A step at world size ``W`` with ``A`` gradient-accumulation micro-steps takes the next
``W * A`` micro-batches of the plan. Accumulation micro-step ``a`` of rank ``r`` gets the
step's micro-batch ``a * W + r``, so every accumulation micro-step is ``W`` consecutive
micro-batches (balanced when micro-batches cost the same). The cursor is a handful of
numbers and the few sample ids carried into the current window: resuming, at the same or
another world size, computes one window, never a replay.

State keys (``state_dict``): ``format``, ``index_fingerprint``, ``config_fingerprint``,
``topology_version``, ``world_size``, ``grad_accum``, ``step`` (steps dealt since training
began); the next micro-batch to deal: ``epoch``, ``window``, ``window_start`` (the window's
first stream offset), ``carried`` (the positions the window before carried into it, at most
``bucketing.carry``; ``[]`` when nothing is carried), ``offset`` (its place in the window),
``micro_batch`` (its place in the epoch); and ``budget``/``next_budget`` (the cost budget of this window and of the
windows after it, changed by memory feedback; ``null`` for fixed-size batches); with a mixture, ``mixture``: the
schedule's position at the window's start (`MixtureStream.state`: the weights' fingerprint, the phase in force, how far
into it, each source's count, a change still ahead), which a state saved under other weights is resumed from only
when the change is allowed (`change_mixture`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._errors import StateMismatchError
from ._fixed_form import FixedBatchForm, FixedStep
from ._plan import Plan, WindowPlan
from ._planned import PlannedEpoch, planned_epochs
from ._step import Step, WindowSpans

logger = logging.getLogger(__name__)

# /2 (issue 29): budget mode forms other micro-batches (cells and windows chosen from the data, equal windows,
# leftovers evened out within their modality mix); a /1 state would resume into another sequence, so it is refused.
STATE_FORMAT = "omnifeed.plan-state/2"
_STATE_KEYS = frozenset(
    {
        "format",
        "index_fingerprint",
        "config_fingerprint",
        "topology_version",
        "world_size",
        "grad_accum",
        "step",
        "epoch",
        "window",
        "window_start",
        "carried",
        "offset",
        "micro_batch",
        "budget",
        "next_budget",
        "mixture",
    }
)
_OPTIONAL_KEYS = frozenset({"mixture"})  # a mixture's only
_COUNTERS = (
    "topology_version",
    "step",
    "epoch",
    "window",
    "window_start",
    "offset",
    "micro_batch",
    "world_size",
    "grad_accum",
)


class DealingStopped(Exception):
    """`PlanCursor.next_step` was told to stop in the middle of dealing a step."""


def _check_positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class PlanCursor:
    """Deals the plan's micro-batches step by step; holds the run's entire data state."""

    def __init__(self, plan: Plan, *, world_size: int = 1, grad_accum: int = 1, epoch: int = 0) -> None:
        self.plan = plan
        self.world_size = _check_positive("world_size", world_size)
        self.grad_accum = _check_positive("grad_accum", grad_accum)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.topology_version = 0
        self.step = 0
        self.epoch, self.window, self.window_start, self.offset, self.micro_batch = epoch, 0, 0, 0, 0
        self.carried: np.ndarray = np.empty(0, dtype=np.int64)  # positions carried into the current window
        self.budget = self.next_budget = plan.budget
        self._current: WindowPlan | None = None
        self._form = FixedBatchForm(plan) if plan.bucketing is None else None  # fixed batches: no window planned
        self._schedule_checked: tuple[tuple[Any, ...], bool] | None = None  # `_on_schedule`'s last answer
        self._told_live = False  # that steps are planned live at a world size where that costs the world's step

    def epoch_delivered(self, epoch: int) -> bool:
        """True once every micro-batch of ``epoch`` has been dealt."""
        return self.epoch > epoch

    def next_step(self, stop: Callable[[], bool] | None = None) -> Step:
        """Deal the next step at the current topology and advance past it.

        The step computes a micro-batch when it is asked for one (`Step.for_rank`): with fixed-size
        batches dealing costs nothing more, with a cost budget it plans the windows the step spans.
        ``stop`` is asked before each window is planned: when it returns True, dealing is abandoned
        with `DealingStopped` and the cursor is left where it was before the step.
        """
        if stop is not None and stop():
            raise DealingStopped(f"dealing step {self.step} was stopped")
        size = self.world_size * self.grad_accum
        source = self._deal_fixed(size) if self._form is not None else self._deal_windows(size, stop)
        step = Step(self.step, self.world_size, self.grad_accum, self.topology_version, source)
        self.step += 1
        return step

    def _deal_fixed(self, size: int) -> FixedStep:
        form = self._form
        assert form is not None
        epoch, first = (self.epoch, self.micro_batch) if self.micro_batch < form.per_epoch else (self.epoch + 1, 0)
        last_epoch, last = form.advance(epoch, first, size - 1)
        self.epoch, self.window, self.window_start, self.offset, self.micro_batch = form.place(last_epoch, last + 1)
        return FixedStep(form, epoch, first)

    def _deal_windows(self, size: int, stop: Callable[[], bool] | None) -> WindowSpans:
        saved = (
            self.epoch,
            self.window,
            self.window_start,
            self.offset,
            self.micro_batch,
            self.budget,
            self.next_budget,
            self._current,
            self.carried,
        )
        spans, left, windows_planned = WindowSpans(), size, 0
        while left:
            planned = self._planned_epoch()
            if planned is not None:  # written ahead: by number, nothing planned
                take = min(left, planned.size - self.micro_batch)
                spans.add_run(planned.micro_batch, self.micro_batch, take)
                left -= take
                self.epoch, self.window, self.window_start, self.offset, self.micro_batch, self.carried = (
                    planned.state_before(self.micro_batch + take)
                )
                self._current = None
                continue
            if self._current is None and stop is not None and stop():
                (
                    self.epoch,
                    self.window,
                    self.window_start,
                    self.offset,
                    self.micro_batch,
                    self.budget,
                    self.next_budget,
                    self._current,
                    self.carried,
                ) = saved
                raise DealingStopped(f"dealing step {self.step} was stopped")
            windows_planned += self._current is None
            current = self._window_plan()
            take = min(left, len(current.micro_batches) - self.offset)
            if take > 0:  # a window left empty by its predecessor's borrowing deals nothing
                spans.add(current, self.offset, take)
                self.offset += take
                self.micro_batch += take
                left -= take
            if self.offset >= len(current.micro_batches):
                self._advance(current)
        if windows_planned > 2 and not self._told_live:  # the step spans whole windows: its cost is the world's
            self._told_live = True
            source = "--config FILE (with plan.mixture.plans set)" if self.plan.mixture is not None else "INDEX"
            logger.warning(
                "step %d planned %d windows live (%d micro-batches a step at dp %d x accum %d): every node plans the "
                "world's step; write the epochs ahead once, `omnifeed plan %s ... --write-epochs N`, and each step "
                "is dealt by look-up",
                self.step,
                windows_planned,
                size,
                self.world_size,
                self.grad_accum,
                source,
            )
        return spans

    def _planned_epoch(self) -> PlannedEpoch | None:
        """The epoch in progress as written ahead, when the cursor is where those files' walk is (else None)."""
        written = planned_epochs(self.plan)
        if written is None or self.budget != self.plan.budget or self.next_budget != self.budget:
            return None  # memory feedback changed the budget: the files are of the configured one
        planned = written.epoch(self.epoch)
        if planned is None or self.micro_batch >= planned.size:
            return None
        epoch, window, start, offset, micro_batch, carried = planned.state_before(self.micro_batch)
        if (epoch, window, start, offset, micro_batch) != (
            self.epoch,
            self.window,
            self.window_start,
            self.offset,
            self.micro_batch,
        ) or not np.array_equal(carried, self.carried):
            return None  # a state of another history (a budget changed and back): planned live
        if planned.schedule is not None and not self._on_schedule(planned):
            return None  # a mixture under other weights (changed, or resumed from another history): planned live
        return planned

    def _on_schedule(self, planned: PlannedEpoch) -> bool:
        """Whether the mixture's schedule is the one the epoch was written under: its position at the window in
        progress is the one recorded there (which, with the schedule's fingerprint, fixes every later one)."""
        mixture = self.plan.mixture
        assert mixture is not None and planned.schedule is not None
        # the schedule changes only when a state is loaded (`MixtureStream.resume`): checked once per window
        key = (planned, self.window, mixture.schedule, mixture.change_at)
        if self._schedule_checked is None or self._schedule_checked[0] != key:
            try:
                same = mixture.state(self.epoch, self.window_start) == planned.schedule[self.window]
            except ValueError:  # the schedule answers from a later sample on: not the files' path
                same = False
            if not same:
                planned.off_schedule()
            self._schedule_checked = (key, same)
        return self._schedule_checked[1]

    def _window_plan(self) -> WindowPlan:
        if self._current is None:
            self._current = self.plan.window(
                self.epoch,
                self.window,
                self.window_start,
                budget=self.budget,
                first_index=self.micro_batch - self.offset,
                carried=self.carried,
            )
        return self._current

    def _advance(self, current: WindowPlan) -> None:
        if current.last:
            self.epoch, self.window, self.window_start, self.micro_batch = self.epoch + 1, 0, 0, 0
            self.carried = np.empty(0, dtype=np.int64)
        else:
            self.window, self.window_start, self.carried = self.window + 1, current.next_start, current.carry
        self.offset = 0
        self.budget = self.next_budget
        self._current = None

    def resize(self, world_size: int, grad_accum: int | None = None) -> bool:
        """Deal later steps to ``world_size`` ranks (and ``grad_accum``); True if the topology changed."""
        world_size = _check_positive("world_size", world_size)
        grad_accum = self.grad_accum if grad_accum is None else _check_positive("grad_accum", grad_accum)
        if (world_size, grad_accum) == (self.world_size, self.grad_accum):
            return False
        self.world_size, self.grad_accum = world_size, grad_accum
        self.topology_version += 1
        return True

    def report_headroom(self, headroom: float) -> float | None:
        """Memory feedback: the fraction of accelerator memory left free at the last step's peak.

        Steers the budget of the windows after the current one toward the configured target
        headroom, within the configured bounds, and returns it (None for fixed-size batches).
        Report the same value on every rank (e.g. the minimum over ranks), or ranks disagree.
        """
        bucketing = self.plan.bucketing
        if bucketing is None or self.next_budget is None:
            return None
        if not 0.0 <= headroom <= 1.0:
            raise ValueError(f"headroom is a fraction of memory in [0, 1], got {headroom}")
        low, high = bucketing.bounds
        # Used memory scales with the budget: aim for (1 - target) of memory in use.
        scale = (1.0 - bucketing.target_headroom) / max(1.0 - headroom, 1e-6)
        self.next_budget = float(min(high, max(low, round(self.next_budget * min(scale, 1.25), 6))))
        return self.next_budget

    def state_dict(self) -> dict[str, Any]:
        """The whole data state: a small JSON-serializable dict of constant size."""
        return {
            "format": STATE_FORMAT,
            "index_fingerprint": self.plan.index_fingerprint,
            "config_fingerprint": self.plan.config_fingerprint,
            "topology_version": self.topology_version,
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "step": self.step,
            "epoch": self.epoch,
            "window": self.window,
            "window_start": self.window_start,
            "carried": [int(p) for p in self.carried],
            "offset": self.offset,
            "micro_batch": self.micro_batch,
            "budget": self.budget,
            "next_budget": self.next_budget,
            **({"mixture": self.plan.mixture.state(self.epoch, self.window_start)} if self.plan.mixture else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Continue from ``state``; a world size or accumulation other than this cursor's is a resize.

        Raises ``StateMismatchError`` for a state of another index or batching config, or (unless
        ``allow_mixture_change``: then `change_mixture`) of other mixture weights or phases, and ``ValueError`` for
        a malformed state. ``state`` is not modified.
        """
        keys = set(state) | (_OPTIONAL_KEYS - set(state))
        if keys != _STATE_KEYS:
            missing, unknown = sorted(_STATE_KEYS - keys), sorted(keys - _STATE_KEYS)
            raise ValueError(f"not a plan state: missing keys {missing}, unknown keys {unknown}")
        if state["format"] != STATE_FORMAT:
            raise ValueError(
                f"plan state format {state['format']!r}; this omnifeed reads {STATE_FORMAT!r}: the state was saved "
                "by another omnifeed version, whose plan forms other micro-batches; start the run without it "
                "or resume with the version that saved it"
            )
        for what in ("index_fingerprint", "config_fingerprint"):
            mine = getattr(self.plan, what)
            if state[what] != mine:
                raise StateMismatchError(
                    "the saved state belongs to another "
                    f"{'index' if what == 'index_fingerprint' else 'batching config'}: "
                    f"state {what} {state[what]} != {mine}. Resume with the index and plan config the state "
                    "was saved with, or start a new run without the state"
                )
        for name in _COUNTERS:
            value = state[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"plan state {name} must be a non-negative integer, got {value!r}")
        if state["window_start"] > self.plan.num_samples or state["offset"] > state["micro_batch"]:
            raise ValueError("plan state position is outside this index; was it edited by hand?")
        carried = _carried(state["carried"], self.plan)
        for name in ("budget", "next_budget"):
            if (state[name] is None) != (self.plan.budget is None):
                raise ValueError(f"plan state {name} {state[name]!r} does not fit this plan's batching")
        if self.plan.mixture is not None:
            entry = state.get("mixture")
            if not isinstance(entry, Mapping):
                raise ValueError("a mixture's plan state holds its schedule's position ('mixture'); this one has none")
            if entry.get("schedule") != self.plan.mixture.fingerprint:
                if not allow_mixture_change:
                    raise StateMismatchError(
                        f"the saved state was dealt under other mixture weights or phases (schedule "
                        f"{entry.get('schedule')} != {self.plan.mixture.fingerprint}): resume with the weights it was "
                        "saved with, or allow the change (allow_mixture_change=True, `--allow-mixture-change`) to go "
                        "on from each source's position under the new ones"
                    )
                entry = change_mixture(state, self.plan)["mixture"]
            self.plan.mixture.resume(entry, state["epoch"], state["window_start"])
        self.step, self.epoch, self.window = state["step"], state["epoch"], state["window"]
        self.window_start, self.offset, self.micro_batch = state["window_start"], state["offset"], state["micro_batch"]
        self.budget, self.next_budget = state["budget"], state["next_budget"]
        self.carried = carried
        self.topology_version = state["topology_version"]
        self._current = None
        if (state["world_size"], state["grad_accum"]) != (self.world_size, self.grad_accum):
            self.topology_version += 1


def change_mixture(state: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    """A plan state saved under other mixture weights or phases, as a state of ``plan``'s: the saved phase goes on
    through the window in progress and the samples it may borrow (they were dealt, or will be, as planned then),
    ``plan``'s weights after that, each source continuing from its count there. A documented event: the state names
    the change (``until``: where it takes effect, and the new schedule's fingerprint). Raises ValueError for a state
    without a mixture position, or one saved while an earlier change was still ahead (resume it, deal past that
    window, save again). A state of ``plan``'s own weights is returned as it is.
    """
    mixture = plan.mixture
    entry = state.get("mixture")
    if mixture is None or not isinstance(entry, Mapping):
        raise ValueError("only a mixture's plan state can change its mixture")
    if entry.get("schedule") == mixture.fingerprint:
        return dict(state)  # the same weights and phases: nothing changes
    if entry.get("until") is not None:
        raise ValueError(
            "this state was saved before an earlier mixture change took effect: resume it under the weights of that "
            "change, deal past the window in progress, and save again before changing them once more"
        )
    epoch, window = int(state["epoch"]), int(state["window"])
    seen = min(plan.window_reach(epoch, window, int(state["window_start"])), plan.num_samples)
    return {**state, "mixture": {**entry, "schedule": mixture.fingerprint, "until": epoch * plan.num_samples + seen}}


def _carried(value: Any, plan: Plan) -> np.ndarray:
    """The state's carried positions, checked: positions of this index (distinct, but in a mixture), no more than
    the plan carries."""
    if not isinstance(value, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        raise ValueError(f"plan state carried must be a list of sample positions, got {str(value)[:80]}")
    if len(value) > plan.carry_limit:
        raise ValueError(f"plan state carries {len(value)} samples; this plan carries at most {plan.carry_limit}")
    # a mixture's positions are its index's (all sources'), and a source passed more than once in a window repeats
    bound = plan.mixture.total_samples if plan.mixture is not None else plan.num_samples
    repeats = plan.mixture is None and len(set(value)) != len(value)
    if repeats or any(not 0 <= p < bound for p in value):
        raise ValueError(
            "plan state carried holds repeated positions or positions outside this index; was it edited by hand?"
        )
    return np.asarray(value, dtype=np.int64)


def steps_left_in_epoch(plan: Plan, state: Mapping[str, Any]) -> int:
    """Steps dealt from ``state`` (at its own topology) until its epoch is delivered.

    Plans the rest of the epoch window by window (O(samples left), nothing decoded or read):
    the number of micro-batches a cost budget makes is known only by planning them, unless the
    epoch was written ahead (`write_planned_epochs`): then it is a subtraction.
    """
    cursor = PlanCursor(plan, world_size=int(state["world_size"]), grad_accum=int(state["grad_accum"]))
    cursor.load_state_dict(state)
    planned = cursor._planned_epoch()
    if planned is not None:
        return -(-(planned.size - cursor.micro_batch) // (cursor.world_size * cursor.grad_accum))
    epoch, steps = cursor.epoch, 0
    while not cursor.epoch_delivered(epoch):
        cursor.next_step()
        steps += 1
    return steps
