"""Buckets per modality mix: secondary streams (captions, transcripts) get cells of their own lengths."""

from __future__ import annotations

import numpy as np

from omnifeed.bucketing import CostModel, estimate_mix_layout, mix_buckets, mix_masks


def _lengths(n: int = 4000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    kind = rng.integers(0, 2, n)  # 0: documents, 1: images with captions
    text = np.where(kind == 0, rng.integers(200, 4000, n), rng.integers(5, 80, n))
    image = np.where(kind == 1, rng.integers(256, 1200, n), 0)
    return {"text": text, "image": image, "video": np.zeros(n, np.int64), "audio": np.zeros(n, np.int64)}


def test_captions_get_edges_from_captions_not_from_documents() -> None:
    lengths = _lengths()
    layout = estimate_mix_layout(lengths, CostModel(), budget=20000, window=4000, num_buckets=8)
    both = int(mix_masks(lengths, layout.streams).max())
    assert layout.primary[both] == "image"
    edges = layout.edges[both]["text"]
    assert 1 < edges.size <= 7 and edges.max() < 80, "caption cells lie within caption lengths"


def test_mixes_never_share_a_bucket_and_cells_follow_the_secondary_length() -> None:
    lengths = _lengths()
    layout = estimate_mix_layout(lengths, CostModel(), budget=20000, window=4000, num_buckets=8)
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
