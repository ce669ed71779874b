"""`FixedBatchForm`: where any micro-batch of a fixed-size-batch plan is, without planning a window.

With fixed-size batches a window's micro-batches are consecutive chunks of ``B`` samples of the
stream, and a window's short last chunk is topped up from the next window's samples
(`omnifeed.bucketing.assemble_fixed`); so every chunk starts at a multiple of ``B`` and the
epoch's micro-batch ``g`` is the stream's samples ``[g·B, (g+1)·B)``: the last one short, or
dropped with ``drop_last``. The window a chunk belongs to is the one whose own samples it starts
in, and a window starts at its first sample rounded up to a multiple of ``B`` (what the samples
its predecessor borrowed leave it). This is what the cursor deals from: a step costs the few
micro-batches a rank asks for, a resume or a resize nothing, at any world size
(`tests/loader/plan/test_dealing_form.py` proves it deals what walking the windows deals).
"""

from __future__ import annotations

import numpy as np

from ._micro_batch import MicroBatch
from ._plan import Plan

CursorPlace = tuple[int, int, int, int, int]
"""The cursor's place before a micro-batch: (epoch, window, window start, offset in the window, micro-batch)."""


class FixedBatchForm:
    """The closed form of a fixed-size-batch plan's micro-batches and of the cursor's place between them."""

    def __init__(self, plan: Plan) -> None:
        if plan.bucketing is not None:
            raise ValueError("the closed form is of fixed-size batches; a cost budget's windows must be planned")
        self.plan = plan
        self.batch, self.num_samples = plan.config.batch_size, plan.num_samples
        full, short = divmod(self.num_samples, self.batch)
        self.per_epoch = full if plan.config.drop_last or not short else full + 1
        self._shard_windows = plan.config.shuffle == "shard_block"

    def micro_batch(self, epoch: int, g: int) -> MicroBatch:
        """Micro-batch ``g`` of ``epoch`` (``0 <= g < per_epoch``)."""
        return self.micro_batches([(epoch, g)])[0]

    def micro_batches(self, places: list[tuple[int, int]]) -> list[MicroBatch]:
        """The micro-batches at ``(epoch, g)`` places, their stream slices computed together per epoch."""
        out: list[MicroBatch | None] = [None] * len(places)
        for epoch in sorted({e for e, _ in places}):
            mine = [i for i, (e, _) in enumerate(places) if e == epoch]
            runs = [(places[i][1] * self.batch, min((places[i][1] + 1) * self.batch, self.num_samples)) for i in mine]
            for i, positions in zip(mine, self.plan.streams(epoch, runs)):
                g = places[i][1]
                out[i] = MicroBatch(
                    epoch, g, self.window_of(epoch, g), positions, float(len(positions)), None, g == self.per_epoch - 1
                )
        return out  # type: ignore[return-value]

    def _nominal_start(self, epoch: int, window: int) -> int:
        """Where window ``window``'s own samples begin in the stream (the number of samples, past the last)."""
        return 0 if window == 0 else self.plan._nominal_end(epoch, window - 1)

    def window_of(self, epoch: int, g: int) -> int:
        """The window micro-batch ``g`` belongs to: the last one whose own samples start at or before its first."""
        if self._shard_windows:
            starts = self.plan._stream.shard_window_starts(epoch)  # type: ignore[union-attr]
            return int(np.searchsorted(starts, g * self.batch, side="right")) - 1
        return g * self.batch // self.plan.window_size

    def window_start(self, epoch: int, window: int) -> int:
        """The stream offset window ``window`` starts at: its own first sample rounded up to a whole chunk."""
        return min(-(-self._nominal_start(epoch, window) // self.batch) * self.batch, self.num_samples)

    def _window_span(self, epoch: int, window: int) -> tuple[int, int, int]:
        """(window start, micro-batches it deals, where the next window starts)."""
        start = self.window_start(epoch, window)
        own_end = max(start, self._nominal_start(epoch, window + 1))
        chunks = -(-(own_end - start) // self.batch)
        first = start // self.batch
        return (
            start,
            max(0, min(first + chunks, self.per_epoch) - first),
            min(start + chunks * self.batch, self.num_samples),
        )

    def place(self, epoch: int, g: int) -> CursorPlace:
        """The cursor's place once ``g`` micro-batches of ``epoch`` are dealt (``0 <= g <= per_epoch``): within the
        window of the last one dealt, or past its end at the next window (the next epoch after the last window)."""
        if g == 0:
            return epoch, 0, 0, 0, 0
        window = self.window_of(epoch, g - 1)
        start, count, next_start = self._window_span(epoch, window)
        offset = g - start // self.batch
        if offset < count:
            return epoch, window, start, offset, g
        if next_start >= self.num_samples:
            return epoch + 1, 0, 0, 0, 0
        return epoch, window + 1, next_start, 0, g

    def advance(self, epoch: int, g: int, n: int) -> tuple[int, int]:
        """(epoch, micro-batch) ``n`` micro-batches after micro-batch ``g`` of ``epoch``, across epochs."""
        total = g + n
        return epoch + total // self.per_epoch, total % self.per_epoch


class FixedStep:
    """A fixed-size-batch step's micro-batches by place: the ``i``-th is ``i`` after its first."""

    def __init__(self, form: FixedBatchForm, epoch: int, first: int) -> None:
        self.form, self.epoch, self.first = form, epoch, first

    def __call__(self, i: int) -> MicroBatch:
        return self.form.micro_batch(*self.form.advance(self.epoch, self.first, i))

    def many(self, places: list[int]) -> list[MicroBatch]:
        """The micro-batches at ``places``, their samples computed together."""
        return self.form.micro_batches([self.form.advance(self.epoch, self.first, i) for i in places])
