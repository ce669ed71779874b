"""`DealtSteps`: each step of the plan dealt once for every pipeline that shares it (the service's streams).

Every data-parallel rank's pipeline deals whole steps (`PlanCursor.next_step`: the step's
``W × A`` micro-batches, of which it keeps its own). A node service runs one pipeline per rank
in one process, so without sharing it dealt every step once per rank, on one interpreter lock:
at batch 8 on a mixed set a step took ~2.7 ms, the largest per-batch cost of the service's
planner (benchmarks/RESULTS.md, "Service production per core (issue 29)").

A step is a pure function of the cursor's state (the plan's invariant), so the first pipeline
to reach a state deals it and the others take the same `Step` and the state after it. Steps
are kept by the state they start from (topology version, world size and accumulation
included), the last ``keep`` of them and no more than ``max_micro_batches`` micro-batches in
all (a step of a large world deals ``W × A``; the newest step is kept whatever its size). The cursors that deal are
kept too, each under the state it stands at, so the cursor that dealt a step deals the next one (a cursor plans a
shuffle window once for all its micro-batches; a cursor loaded from a state plans it again). One lock:
steps are dealt one at a time, which costs nothing on one interpreter lock and means a step is
never dealt twice.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from ..plan import Plan, PlanCursor, Step


def _key(state: Mapping[str, Any]) -> str:
    return json.dumps(state, sort_keys=True)


class DealtSteps:
    """Steps of one plan by the cursor state they start from, shared by the pipelines over that plan."""

    def __init__(self, plan: Plan, keep: int = 64, cursors: int = 8, max_micro_batches: int = 8192) -> None:
        self.plan = plan
        self._keep, self._max_cursors, self._max_held = keep, cursors, max_micro_batches
        self._held = 0  # micro-batches of the steps kept
        self._lock = threading.Lock()
        self._steps: OrderedDict[str, tuple[Step, dict[str, Any]]] = OrderedDict()
        self._cursors: OrderedDict[str, PlanCursor] = OrderedDict()  # by the state each stands at
        self.dealt = 0  # steps dealt here
        self.shared = 0  # steps handed to a pipeline that another one had dealt

    def next_step(
        self, state: Mapping[str, Any], stop: Callable[[], bool] | None = None
    ) -> tuple[Step, dict[str, Any]]:
        """The step that starts at cursor state ``state`` (at that state's own topology) and the state after it.

        ``stop`` as in `PlanCursor.next_step` (``DealingStopped`` leaves everything as it was).
        """
        key = _key(state)
        with self._lock:
            known = self._steps.get(key)
            if known is not None:
                self.shared += 1
                return known
            cursor = self._cursors.pop(key, None)
            if cursor is None:
                cursor = PlanCursor(self.plan, world_size=int(state["world_size"]), grad_accum=int(state["grad_accum"]))
                cursor.load_state_dict(state)
            try:
                step = cursor.next_step(stop)
            finally:  # stopped: the cursor is back where it was
                after = cursor.state_dict()
                self._cursors[_key(after)] = cursor
                while len(self._cursors) > self._max_cursors:
                    self._cursors.popitem(last=False)
            self.dealt += 1
            self._steps[key] = (step, after)
            self._held += step.size
            while len(self._steps) > 1 and (len(self._steps) > self._keep or self._held > self._max_held):
                self._held -= self._steps.popitem(last=False)[1][0].size
            return step, after
