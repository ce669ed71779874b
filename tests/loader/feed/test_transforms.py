"""Deterministic augmentation: a new crop every epoch, the same batch after a resume, never frozen into the cache."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from labelled_data import index_of, write_labelled_tar
from pydantic import ValidationError

from omnifeed.cache import CacheConfig, NvmeTierConfig
from omnifeed.loader import ConfigError, Feed, FeedConfig, PlanConfig, SampleIndex
from omnifeed.loader.feed import RandomResizedCrop, TransformsConfig, _transforms, transform_generators
from omnifeed.loader.feed._transform_config import HorizontalFlip
from omnifeed.loader.feed._transforms import Transforms, crop_box, horizontal_flip, random_resized_crop

AUGMENT = {"image": [{"random_resized_crop": {"size": 16}}, {"horizontal_flip": {"p": 0.5}}]}


def config(transforms: dict[str, Any] | None = None, **extra: Any) -> FeedConfig:
    return FeedConfig(plan=PlanConfig(seed=7, batch_size=4), transforms=transforms or AUGMENT, **extra)


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    folder = tmp_path_factory.mktemp("augment")
    return index_of([write_labelled_tar(folder / "a.tar")], folder / "index")


def pixels_by_key(batches: list[dict]) -> dict[str, torch.Tensor]:
    return {
        key: b["image"]["pixels"][row] for b in batches for row, key in zip(b["image"]["index"].tolist(), b["__key__"])
    }


@pytest.mark.parametrize(
    ("height", "width", "scale", "ratio"),
    [
        (30, 40, (0.08, 1.0), (3 / 4, 4 / 3)),
        (224, 100, (0.5, 0.9), (1.0, 1.0)),
        (7, 300, (0.08, 1.0), (3 / 4, 4 / 3)),
        (50, 50, (2.0, 3.0), (3 / 4, 4 / 3)),  # no crop can have that area: torchvision's centre fallback
    ],
)
def test_crop_boxes_stay_inside_the_image_and_within_scale_and_ratio(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> None:
    for seed in range(200):
        top, left, h, w = crop_box(height, width, scale, ratio, np.random.default_rng(seed))
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h > 0 and w > 0
        drawn = (
            scale[0] * 0.8 <= h * w / (height * width) <= scale[1] * 1.2  # (rounding to whole pixels)
            and ratio[0] * 0.8 <= w / h <= ratio[1] * 1.2
        )
        fallback = (top, left) == ((height - h) // 2, (width - w) // 2) and (h == height or w == width)
        assert drawn or fallback
    if scale[0] > 1:
        assert (top, left, h, w) == (0, 0, 50, 50), "the fallback is the whole (ratio-clamped) image, centred"


def test_the_crop_has_the_configured_size_and_video_frames_share_one_crop() -> None:
    crop = random_resized_crop(RandomResizedCrop(size=(12, 20)))
    frame = np.random.default_rng(0).integers(0, 256, (3, 30, 40), dtype=np.uint8)
    assert crop(frame, "k", 0, np.random.default_rng(1)).shape == (3, 12, 20)
    video = crop(np.stack([frame, frame]), "k", 0, np.random.default_rng(1))
    assert video.shape == (2, 3, 12, 20) and np.array_equal(video[0], video[1])
    flip = horizontal_flip(HorizontalFlip(p=1.0))
    assert np.array_equal(flip(frame, "k", 0, np.random.default_rng(0)), frame[..., ::-1])


def test_generators_are_a_pure_function_of_seed_epoch_key_and_field() -> None:
    def draw(*args: Any) -> list[float]:
        return [g.random() for g in transform_generators(*args)]

    assert draw(7, 0, "k", "jpg", 2) == draw(7, 0, "k", "jpg", 2)
    assert (
        len(
            {
                tuple(draw(*a))
                for a in [
                    (7, 0, "k", "jpg", 2),
                    (7, 1, "k", "jpg", 2),
                    (8, 0, "k", "jpg", 2),
                    (7, 0, "j", "jpg", 2),
                    (7, 0, "k", "png", 2),
                ]
            }
        )
        == 5
    )
    assert draw(7, 0, "k", "jpg", 3)[:2] == draw(7, 0, "k", "jpg", 2), "a step added later leaves earlier draws alone"


def test_a_modality_without_steps_draws_no_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-field path when no step is configured: the value as it is, no SeedSequence (the hot path's promise)."""

    def no_seeding(*args: Any) -> list[np.random.Generator]:
        raise AssertionError("generators seeded for a modality without steps")

    monkeypatch.setattr(_transforms, "transform_generators", no_seeding)
    value = np.zeros((3, 4, 4), dtype=np.uint8)
    transforms = Transforms(TransformsConfig.model_validate({"video": AUGMENT["image"]}), seed=7)
    for modality in ("image", "audio", "text", "meta"):
        assert transforms.apply(modality, "f", "k", 0, value, "where") is value
    with pytest.raises(AssertionError, match="without steps"):  # the patch is live: video has steps
        transforms.apply("video", "f", "k", 0, value[None], "where")


def test_each_epoch_crops_anew_and_a_resume_repeats_the_same_batches(index: SampleIndex) -> None:
    with Feed(index, config()) as feed:
        epoch0, epoch1 = list(feed), list(feed)
        first, second = pixels_by_key(epoch0), pixels_by_key(epoch1)
        assert all(p.shape == (3, 16, 16) for p in first.values())
        assert sum(not torch.equal(first[k], second[k]) for k in first) >= len(first) - 1
    with Feed(index, config()) as straight:
        reference = [straight.next_batch() for _ in range(5)]
    with Feed(index, config()) as interrupted:
        for _ in range(2):
            interrupted.next_batch()
        state = interrupted.state_dict()
    with Feed(index, config()) as resumed:
        resumed.load_state_dict(state)
        for expected in reference[2:]:
            got = resumed.next_batch()
            assert got["__key__"] == expected["__key__"] and torch.equal(
                got["image"]["pixels"], expected["image"]["pixels"]
            )


def test_a_user_transform_by_import_path_gets_key_epoch_and_a_seeded_rng(
    index: SampleIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_augment.py").write_text(
        "import numpy as np\n"
        "def stamp(value, key, epoch, rng, base=0):\n"
        "    assert isinstance(rng, np.random.Generator)\n"
        "    out = np.zeros_like(value)\n"
        "    out[0, 0, 0] = base + epoch\n"
        "    out[1, 0, 0] = int(key.split('-')[1])\n"
        "    out[2, 0, 0] = rng.integers(0, 256)\n"
        "    return out\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    steps = {"image": [{"user": {"function": "my_augment:stamp", "kwargs": {"base": 10}}}]}
    with Feed(index, config(steps)) as feed:
        epoch0, epoch1 = pixels_by_key(list(feed)), pixels_by_key(list(feed))
    for key, value in epoch0.items():
        assert value[0, 0, 0] == 10 and value[1, 0, 0] == int(key.split("-")[1])
        assert epoch1[key][0, 0, 0] == 11
        expected = transform_generators(7, 0, key, "png", 1)[0].integers(0, 256)
        assert value[2, 0, 0] == expected, "the rng is the documented one"


def test_a_decoded_cache_holds_the_value_before_the_crop(index: SampleIndex, tmp_path: Path) -> None:
    source = Path(index.sample(0).shard.url)
    private = tmp_path / "a.tar"
    shutil.copy(source, private)
    moved = index_of([private], tmp_path / "index")
    cache = CacheConfig(nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 * 2**20), entries="decoded")
    with Feed(moved, config(cache=cache)) as cached, Feed(index, config()) as plain:
        first = pixels_by_key(list(cached))
        private.unlink()  # the second epoch comes from the decoded entries alone
        second, reference = pixels_by_key(list(cached)), (list(plain), pixels_by_key(list(plain)))[1]
        assert cached.metrics()["bad_samples"] == 0
    assert all(torch.equal(second[k], reference[k]) for k in reference), "the crop is drawn after the cache read"
    assert any(not torch.equal(first[k], second[k]) for k in first)


def test_transforms_from_yaml_are_validated_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "feed.yaml"
    path.write_text(yaml.safe_dump({"transforms": AUGMENT}))
    steps = FeedConfig.from_yaml(path).transforms.image
    assert steps[0].random_resized_crop == RandomResizedCrop(size=16) and steps[1].name == "horizontal_flip"
    path.write_text(
        yaml.safe_dump({"transforms": {"image": [{"random_resized_crop": {"size": 16}, "horizontal_flip": {}}]}})
    )
    with pytest.raises(ConfigError, match="exactly one of"):
        FeedConfig.from_yaml(path)
    for bad, message in [
        ({"audio": [{"horizontal_flip": {}}]}, "not audio"),
        ({"image": [{"random_resized_crop": {"size": 8, "scale": [0.9, 0.1]}}]}, "low <= high"),
        ({"image": [{"user": {"function": "no_colon"}}]}, "module:function"),
        ({"image": [{"rotate": {}}]}, "rotate"),
    ]:
        with pytest.raises(ValidationError, match=message):
            TransformsConfig(**bad)
    assert math.isclose(RandomResizedCrop(size=1).ratio[1], 4 / 3)


def test_a_transform_that_cannot_be_imported_fails_when_the_feed_is_made(index: SampleIndex) -> None:
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        Feed(index, config({"image": [{"user": {"function": "no_such_module:f"}}]}))


def test_a_torch_transform_seeded_from_the_rng_as_docs_say_is_deterministic(
    index: SampleIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/feed.md's recipe for transforms that draw from torch's global generator (torchvision v2 pipelines)
    (tmp_path / "torch_augment.py").write_text(
        "import threading\n"
        "import torch\n"
        "_lock = threading.Lock()\n"
        "def noise(value, key, epoch, rng):\n"
        "    seed = int(rng.integers(2**63))\n"
        "    with _lock, torch.random.fork_rng(devices=[]):\n"
        "        torch.manual_seed(seed)\n"
        "        image = torch.from_numpy(value)\n"
        "        return image ^ torch.randint(0, 256, image.shape, dtype=torch.uint8)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    steps = {"image": [{"random_resized_crop": {"size": 8}}, {"user": {"function": "torch_augment:noise"}}]}
    runs = []
    for _ in range(2):
        with Feed(index, config(steps, pools={"image": {"workers": 3}})) as feed:
            runs.append(pixels_by_key(list(feed)))
    assert runs[0].keys() == runs[1].keys() and all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
