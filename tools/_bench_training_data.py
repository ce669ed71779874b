"""The training scenario's data and configs: a four-modality mix in every form its loaders read, one decode, one budget.

The demo generator's mix (45 % photos with captions, 25 % long-tailed text, 15 % H.264 clips with
captions, 15 % speech-like FLAC audio with transcripts) written as WebDataset shards (indexed for
omnifeed, with the ``bytes`` tokenizer the decode uses) and as a folder of files (the
DataLoader's map-style dataset). Every loader decodes with the same `DecodeConfig` through the
same decoders (``omnifeed.loader.decode.make_decoder``): images and video frames short side 224,
aspect kept (long side at most 1,024), audio 16 kHz mono, text as UTF-8 bytes. omnifeed's plan
is in budget mode with the cost model of the token model (`_bench_training_rank`) and the budget
`omnifeed plan --suggest-budget` would print for the DataLoader's batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnifeed.bucketing import BucketingConfig, CostModel
from omnifeed.loader import (
    FIELD_MODALITIES,
    DecodeConfig,
    FeedConfig,
    ImageDecodeConfig,
    IndexConfig,
    PlanConfig,
    PoolConfig,
    build_index,
)
from omnifeed.loader.feed import Decoded

from ._bench_spec import SampleDecoder, folder_samples
from ._demo_data import DemoDatasetSpec, demo_samples, write_folder, write_webdataset

PATCH_PX = 14  # the token model's vision patch side, pixels (`_bench_training_rank`)
AUDIO_TOKENS_PER_S = 25.0  # the token model's audio tokens per second


@dataclass(frozen=True)
class TrainingData:
    """The mix as shards, their omnifeed index and a folder of files, and the budget omnifeed's plan uses."""

    shards: list[str]
    index: str
    folder: str
    samples: int
    budget: dict[str, Any]  # what `suggest_budget` printed: suggested_budget, samples_per_micro_batch, ...


def training_decode() -> DecodeConfig:
    """The one decode of every loader: images and frames short side 224 (aspect kept), 16 kHz mono, UTF-8 bytes."""
    return DecodeConfig(image=ImageDecodeConfig(resize="short_side", size=224, crop="none"))


def training_cost() -> CostModel:
    """The plan's cost model: the token model of the simulated job (patches of 14 px, 25 audio tokens a second)."""
    decode = training_decode()
    return CostModel(
        patch_size=PATCH_PX,
        image_resize="short_side",
        image_size=decode.image.size,
        max_image_size=decode.image.max_size,
        audio_frames_per_second=AUDIO_TOKENS_PER_S,
    )


def _plan(budget: float) -> PlanConfig:
    return PlanConfig(
        seed=0, bucketing=BucketingConfig(mode="budget", budget=budget, cost=training_cost(), overlong="alone")
    )


def feed_config(budget: float, decode_threads: int) -> FeedConfig:
    """omnifeed's feed: the plan at ``budget``, the shared decode, ``decode_threads`` threads serving every modality."""
    return FeedConfig(
        plan=_plan(budget),
        decode=training_decode(),
        pools={m: PoolConfig(workers=0) for m in FIELD_MODALITIES},
        shared_workers=decode_threads,
    )


def write_training_data(root: Path, samples: int, batch_size: int) -> TrainingData:
    """Generate the mix under ``root`` (shards, index, files) and find the budget for ``batch_size`` samples a batch."""
    from omnifeed.loader.index import SampleIndex
    from omnifeed.loader.plan import Plan, suggest_budget

    spec = DemoDatasetSpec(num_samples=samples, num_shards=4, image_px=(160, 640))
    generated = demo_samples(spec)
    shards = write_webdataset(root / "shards", spec, samples=generated)
    write_folder(root / "files", spec, samples=generated)
    index = build_index(
        [str(p) for p in shards], root / "index", IndexConfig(workers=1, tokenizer="bytes"), progress=False
    )
    plan = Plan.from_index(SampleIndex(str(index.path)), _plan(1.0))  # the search replaces the budget
    budget = suggest_budget(plan, batch_size)
    return TrainingData([str(p) for p in shards], str(index.path), str(root / "files"), index.num_samples, budget)


class TrainingFolder:
    """Map-style: sample ``i`` of the folder, read and decoded with ``decode`` (the DataLoader's dataset)."""

    def __init__(self, folder: str, decode: DecodeConfig) -> None:
        self.items = [(Path(key).name, paths) for key, paths in folder_samples(folder)]
        self.decode = SampleDecoder(decode)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[str, Decoded]:
        key, paths = self.items[i]
        return key, self.decode({name: path.read_bytes() for name, path in paths.items()}, key)
