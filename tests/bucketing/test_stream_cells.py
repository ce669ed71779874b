"""Buckets per modality mix: secondary streams (captions, transcripts) get cells of their own lengths, as many as the
data bears."""

from __future__ import annotations

import numpy as np
import pytest

from omnifeed.bucketing import (
    CostModel,
    assemble_budget,
    choose_window_layout,
    estimate_mix_layout,
    fill_slots,
    mix_buckets,
    mix_masks,
    padding_fraction,
)


def _lengths(n: int = 4000, transcripts: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Documents and images with captions (independent of the image), or speech with transcripts (following it)."""
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 2, n)  # 0: documents, 1: images with captions / speech with transcripts
    primary = np.where(kind == 1, rng.integers(256, 1200, n), 0)
    secondary = primary // 10 + rng.integers(0, 3, n) if transcripts else rng.integers(5, 80, n)
    text = np.where(kind == 0, rng.integers(200, 4000, n), secondary)
    zeros = np.zeros(n, np.int64)
    return {
        "text": text,
        "image": zeros if transcripts else primary,
        "video": zeros,
        "audio": primary if transcripts else zeros,
    }


def test_captions_get_edges_from_captions_not_from_documents() -> None:
    lengths = _lengths()
    layout = estimate_mix_layout(lengths, CostModel(), budget=20000, window=40000, num_buckets=8)
    both = int(mix_masks(lengths, layout.streams).max())
    assert layout.primary[both] == "image"
    edges = layout.edges[both]["text"]
    assert 1 <= edges.size and edges.max() < 80, "caption cells lie within caption lengths"


def test_mixes_never_share_a_bucket_and_cells_follow_the_secondary_length() -> None:
    lengths = _lengths()
    layout = estimate_mix_layout(lengths, CostModel(), budget=20000, window=40000, num_buckets=8)
    buckets, masks = mix_buckets(lengths, layout), mix_masks(lengths, layout.streams)
    for bucket in np.unique(buckets):
        assert len(set(masks[buckets == bucket].tolist())) == 1
    images = masks == masks.max()
    by_caption = np.argsort(lengths["text"][images], kind="stable")
    assert np.all(np.diff(buckets[images][by_caption]) >= 0), "longer captions, later cells"


def test_a_single_stream_mix_is_one_bucket_sorted_by_cost_later() -> None:
    lengths = _lengths()
    layout = estimate_mix_layout(lengths, CostModel(), budget=20000, window=4000, num_buckets=8)
    documents = mix_masks(lengths, layout.streams) == 1
    assert len(set(mix_buckets(lengths, layout)[documents].tolist())) == 1


def _cells(lengths: dict[str, np.ndarray], window: int) -> int:
    layout = estimate_mix_layout(lengths, CostModel(), budget=20000, window=window, num_buckets=8)
    return 1 + int(layout.edges[int(mix_masks(lengths, layout.streams).max())]["text"].size)


def _estimate(lengths: dict[str, np.ndarray], window: int) -> dict[str, float]:
    return estimate_mix_layout(lengths, CostModel(), budget=20000, window=window, num_buckets=8).estimate


def test_a_window_of_more_micro_batches_bears_more_cells_and_pads_less() -> None:
    captions = _lengths(40000)  # the probe: as large as the window
    assert _cells(captions, 4000) < _cells(captions, 40000), "each cell still fills enough micro-batches"
    small, large = _estimate(captions, 4000), _estimate(captions, 40000)
    assert all(large[s] < small[s] for s in small)


def test_a_secondary_that_follows_its_primary_keeps_both_tight_at_a_density_where_an_independent_one_cannot() -> None:
    captions, transcripts = _estimate(_lengths(40000), 4000), _estimate(_lengths(40000, transcripts=True), 4000)
    assert max(transcripts.values()) < 0.01 < 0.03 < max(captions.values())


def test_the_estimate_tracks_the_fill_it_stands_for() -> None:
    lengths = _lengths(20000)
    layout = estimate_mix_layout(lengths, CostModel(), budget=20000, window=20000, num_buckets=8)
    buckets = mix_buckets(lengths, layout)
    filled = assemble_budget(np.arange(20000), lengths, buckets, 20000, CostModel(), overlong="alone")
    real = padding_fraction(filled.batches, lengths)
    pools = mix_masks(lengths, layout.streams)  # leftovers meet within their modality mix
    estimated = {
        s: 1 - used / slots for s, (used, slots) in fill_slots(lengths, buckets, 20000, CostModel(), pools).items()
    }
    for stream in real:
        assert estimated[stream] == pytest.approx(real[stream], abs=0.01)
        assert layout.estimate[stream] == pytest.approx(real[stream], abs=0.01)


def test_the_window_is_the_smallest_whose_estimate_meets_the_target() -> None:
    lengths = _lengths(20000)
    small = choose_window_layout(lengths, CostModel(), 20000, [2000, 20000], num_buckets=8, target=0.5)
    assert small.window == 2000, "the target is met at the smaller window"
    strict = choose_window_layout(lengths, CostModel(), 20000, [2000, 20000], num_buckets=8, target=0.0)
    assert strict.window == 20000, "met nowhere: the window estimated to pad least"
    with pytest.raises(ValueError, match="at least one window"):
        choose_window_layout(lengths, CostModel(), 20000, [], num_buckets=8)
