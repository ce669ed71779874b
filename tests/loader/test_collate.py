"""The batch format round trip: `uncollate` recovers exactly the decoded samples `collate` padded together."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.loader._collate import collate, uncollate


@st.composite
def decoded_samples(draw: st.DrawFn) -> list[dict]:
    samples = []
    for _ in range(draw(st.integers(1, 6))):
        sample: dict = {}
        if draw(st.booleans()):
            length = draw(st.integers(0, 12))
            sample["text"] = ("x" * length, torch.randint(1, 255, (length,), dtype=torch.int64))
        if draw(st.booleans()):
            sample["image"] = torch.randint(0, 255, (3, draw(st.integers(1, 9)), draw(st.integers(1, 9))), dtype=torch.uint8)
        if draw(st.booleans()):
            frames = draw(st.integers(1, 4))
            sample["video"] = torch.randint(0, 255, (frames, 3, draw(st.integers(1, 5)), draw(st.integers(1, 5))),
                                            dtype=torch.uint8)
        if draw(st.booleans()):
            sample["audio"] = torch.rand(1, draw(st.integers(1, 50)))
        if draw(st.booleans()):
            sample["meta"] = {"json": b'{"a": 1}'}
        samples.append(sample)
    return samples


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=150, deadline=None)
@given(decoded_samples())
def test_uncollate_recovers_every_sample_without_padding(samples: list[dict]) -> None:
    keys = [f"k{i}" for i in range(len(samples))]
    batch = collate(samples, keys, {})
    recovered = uncollate(batch)
    assert same(recovered, samples)
    assert same(collate(recovered, keys, {}), batch)
