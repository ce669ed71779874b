"""What one child of `omnifeed bench` runs (`RunSpec`), and the code every Python loader in it shares: the
decode config of a pipeline, `SampleDecoder` (omnifeed's decoders by modality), omnifeed's collate, and the
samples of the folder form."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnifeed.loader import DecodeConfig, ImageDecodeConfig, IndexConfig
from omnifeed.loader.decode import make_decoder
from omnifeed.loader.feed import Decoded, collate

PIPELINES = ("image", "mixed")


@dataclass(frozen=True)
class RunSpec:
    """What one child runs: a loader, a pipeline, the dataset's forms, workers and batch size."""

    loader: str
    pipeline: str
    workers: int
    batch_size: int
    shards: list[str]  # WebDataset shards
    folder: str  # the same samples as files: {key}.{field}
    index: str  # omnifeed's index of the shards
    work: str  # scratch folder of this run (sockets, converted formats)
    converted: str = ""  # Streaming's MDS or LitData's chunks of the folder, written by `prepare`
    samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def decode_config(pipeline: str, draft: bool = False) -> DecodeConfig:
    """The decode work of ``pipeline``: images to 224×224 (short side, centre crop); other modalities as configured by
    default."""
    return DecodeConfig(image=ImageDecodeConfig(resize="short_side", size=224, crop="center", draft=draft))


class SampleDecoder:
    """A sample's fields (name -> bytes) decoded by modality into omnifeed's per-sample form, as the feed does."""

    def __init__(self, config: DecodeConfig) -> None:
        self.config = config
        self.modality_of = IndexConfig().modality_of
        self.decoders: dict[str, Callable[[bytes, str], object]] = {}

    def __call__(self, fields: dict[str, bytes], key: str) -> Decoded:
        """Decoded modalities of one sample; unknown fields kept as bytes under ``meta``."""
        out: Decoded = {}
        for name, data in fields.items():
            modality = self.modality_of(name)
            if modality == "meta":
                out.setdefault("meta", {})[name] = data
                continue
            if modality not in self.decoders:
                self.decoders[modality] = make_decoder(modality, self.config)
            out[modality] = self.decoders[modality](data, key)
        return out


def collate_samples(samples: list[tuple[str, Decoded]]) -> dict[str, Any]:
    """omnifeed's batch format for the peers (the same padding work the feed does), as torch tensors as the feed hands
    it out."""
    from omnifeed.loader.feed import to_torch

    batch: dict[str, Any] = to_torch(collate([s for _, s in samples], [k for k, _ in samples], {}))
    return batch


def folder_samples(folder: str) -> list[tuple[str, dict[str, Path]]]:
    """(key, {field: path}) of every sample under ``folder`` (files named ``key.field``), sorted by key."""
    grouped: dict[str, dict[str, Path]] = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            key, _, name = path.name.partition(".")
            grouped.setdefault(str(path.parent / key), {})[name] = path
    return sorted(grouped.items())
