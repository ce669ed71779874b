"""The batch format round trip: `uncollate` recovers exactly the decoded samples `collate` padded together."""

from __future__ import annotations

import numpy as np
from decoded_values import same_values
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.loader.feed._collate import collate, uncollate


@st.composite
def decoded_samples(draw: st.DrawFn) -> list[dict]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    samples = []
    for _ in range(draw(st.integers(1, 6))):
        sample: dict = {}
        if draw(st.booleans()):
            length = draw(st.integers(0, 12))
            sample["text"] = ("x" * length, rng.integers(1, 255, (length,), dtype=np.int64))
        if draw(st.booleans()):
            sample["image"] = rng.integers(
                0, 255, (3, draw(st.integers(1, 9)), draw(st.integers(1, 9))), dtype=np.uint8
            )
        if draw(st.booleans()):
            frames = draw(st.integers(1, 4))
            sample["video"] = rng.integers(
                0, 255, (frames, 3, draw(st.integers(1, 5)), draw(st.integers(1, 5))), dtype=np.uint8
            )
        if draw(st.booleans()):
            sample["audio"] = rng.random((1, draw(st.integers(1, 50))), dtype=np.float32)
        if draw(st.booleans()):
            sample["meta"] = {"json": b'{"a": 1}'}
        samples.append(sample)
    return samples


@settings(max_examples=150, deadline=None)
@given(decoded_samples())
def test_uncollate_recovers_every_sample_without_padding(samples: list[dict]) -> None:
    keys = [f"k{i}" for i in range(len(samples))]
    batch = collate(samples, keys, {})
    recovered = uncollate(batch)
    assert same_values(recovered, samples)
    assert same_values(collate(recovered, keys, {}), batch)


def _dirty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Memory handed out with old contents in it, as the service's reused shared memory is."""
    out = np.empty(shape, dtype=dtype)
    out.view(np.uint8)[...] = 0xA5
    return out


@settings(max_examples=150, deadline=None)
@given(decoded_samples())
def test_padding_is_zeros_whatever_the_memory_held_before(samples: list[dict]) -> None:
    keys = [f"k{i}" for i in range(len(samples))]
    assert same_values(collate(samples, keys, {}, alloc=_dirty), collate(samples, keys, {}, alloc=np.zeros))


def test_the_trainer_side_hands_out_the_batch_as_tensors_sharing_its_memory() -> None:
    import torch

    from omnifeed.loader.feed._torch_batch import to_torch

    samples = [
        {"text": ("ab", np.array([97, 98])), "image": np.ones((3, 2, 4), np.uint8), "meta": {"cls": b"1"}},
        {"audio": np.zeros((1, 5), np.float32)},
    ]
    batch = collate(samples, ["a", "b"], {"step": 0})
    tensors = to_torch(batch)
    for modality, name, dtype in (
        ("text", "tokens", torch.int64),
        ("image", "pixels", torch.uint8),
        ("audio", "samples", torch.float32),
    ):
        assert tensors[modality][name].dtype == dtype and tensors[modality][name].shape == batch[modality][name].shape
        assert tensors[modality][name].data_ptr() == batch[modality][name].ctypes.data  # no copy
    assert tensors["__key__"] == ["a", "b"] and tensors["text"]["strings"] == ["ab"]
    assert tensors["meta"] == {"cls": [b"1", None]} and tensors["__info__"] == {"step": 0}
