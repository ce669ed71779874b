"""The cost model: resize policies, patch and frame counts, and what padding costs."""

from __future__ import annotations

import numpy as np
import pytest

from omnifeed.bucketing import INDEX_COLUMNS, CostModel, padded_cost, sample_costs, stream_lengths


def _columns(**values: list[float]) -> dict[str, np.ndarray]:
    """Index length columns for len(values) samples; columns not given are all 0."""
    n = len(next(iter(values.values())))
    return {name: np.asarray(values.get(name, [0] * n), dtype=np.float64) for name in INDEX_COLUMNS}


@pytest.mark.parametrize(
    ("resize", "width", "height", "patches"),
    [
        ("short_side", 640, 480, 16 * 22),  # 224 x 299 after resize
        ("short_side", 480, 640, 22 * 16),  # portrait: the same, transposed
        ("short_side", 100, 100, 16 * 16),  # upscaled to 224 x 224
        ("short_side", 4000, 100, 74 * 2),  # long side capped: 8960 -> 1024, short 224 -> 26
        ("fixed", 640, 480, 16 * 16),
        ("fixed", 3, 5000, 16 * 16),
        ("none", 640, 480, 46 * 35),  # ceil(640/14) x ceil(480/14)
        ("none", 14, 14, 1),
        ("short_side", 0, 0, 0),  # no image: no patches
        ("fixed", 0, 0, 0),
    ],
)
def test_image_patches_follow_the_resize_policy(resize: str, width: int, height: int, patches: int) -> None:
    model = CostModel(image_resize=resize, image_size=224, patch_size=14, max_image_size=1024)
    lengths = stream_lengths(_columns(image_width=[width], image_height=[height]), model)
    assert lengths["image"].tolist() == [patches]
    assert lengths["image"].dtype == np.int64


def test_short_side_cap_scales_both_sides() -> None:
    model = CostModel(image_resize="short_side", image_size=224, patch_size=16, max_image_size=448)
    # 224 x 896 after the short-side resize, capped to 112 x 448
    lengths = stream_lengths(_columns(image_width=[100], image_height=[400]), model)
    assert lengths["image"].tolist() == [7 * 28]


@pytest.mark.parametrize(
    ("frames", "native_fps", "fps", "cap", "expected"),
    [
        (100, 25.0, None, None, 100),  # every frame
        (100, 25.0, 5.0, None, 20),  # 4 s at 5 fps
        (101, 25.0, 5.0, None, 21),  # a partial sampling interval still yields a frame
        (10, 2.0, 5.0, None, 10),  # never upsampled
        (100, 0.0, 5.0, None, 100),  # unknown native fps: every frame
        (100, 25.0, None, 16, 16),  # frame cap
        (100, 25.0, 5.0, 8, 8),  # sampled, then capped
        (0, 0.0, 5.0, 8, 0),  # no video
    ],
)
def test_video_frames_are_sampled_then_capped(
    frames: int, native_fps: float, fps: float | None, cap: int | None, expected: int
) -> None:
    model = CostModel(image_resize="fixed", image_size=28, patch_size=14, video_fps=fps, video_max_frames=cap)
    columns = _columns(video_frames=[frames], video_fps=[native_fps], video_width=[640], video_height=[360])
    assert stream_lengths(columns, model)["video"].tolist() == [expected * 4]


@pytest.mark.parametrize(
    ("seconds", "rate", "frames"), [(1.0, 50.0, 50), (0.01, 50.0, 1), (2.5, 100.0, 250), (0.0, 50.0, 0)]
)
def test_audio_frames_round_up(seconds: float, rate: float, frames: int) -> None:
    model = CostModel(audio_frames_per_second=rate)
    assert stream_lengths(_columns(audio_seconds=[seconds]), model)["audio"].tolist() == [frames]


def test_text_length_is_the_token_count() -> None:
    lengths = stream_lengths(_columns(text_tokens=[0, 7, 300]), CostModel())
    assert lengths["text"].tolist() == [0, 7, 300]
    assert set(lengths) == {"text", "image", "video", "audio"}


def test_padded_cost_pays_for_padding() -> None:
    model = CostModel(weights={"text": 1.0, "image": 2.0})
    lengths = {"text": np.array([10, 2, 0]), "image": np.array([5, 5, 5])}
    assert padded_cost(lengths, model) == 3 * 10 + 2.0 * 3 * 5
    assert padded_cost(lengths, model) > sample_costs(lengths, model).sum()


def test_padded_cost_ignores_empty_and_unweighted_streams() -> None:
    model = CostModel(weights={"text": 1.0})
    assert padded_cost({"text": np.zeros(0, dtype=np.int64), "audio": np.array([9, 9])}, model) == 0.0


def test_quadratic_term_charges_the_longest_squared_per_slot() -> None:
    model = CostModel(weights={"text": 1.0}, quadratic=0.5)
    lengths = {"text": np.array([4, 2])}
    assert padded_cost(lengths, model) == 2 * (4 + 0.5 * 16)
    assert sample_costs(lengths, model).tolist() == [4 + 0.5 * 16, 2 + 0.5 * 4]


def test_sample_costs_sum_over_weighted_streams() -> None:
    model = CostModel(weights={"text": 1.0, "audio": 0.5})
    costs = sample_costs({"text": np.array([3, 0]), "audio": np.array([0, 8]), "video": np.array([7, 7])}, model)
    assert costs.tolist() == [3.0, 4.0]
    assert sample_costs({}, model).shape == (0,)


def test_padded_cost_equals_sum_of_sample_costs_for_equal_lengths() -> None:
    model = CostModel(quadratic=0.01)
    lengths = {"text": np.full(5, 12), "audio": np.full(5, 40)}
    assert padded_cost(lengths, model) == pytest.approx(sample_costs(lengths, model).sum())
