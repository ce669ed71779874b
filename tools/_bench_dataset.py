"""The dataset of `omnifeed bench` in every form the loaders read: WebDataset shards, a folder of ``key.field``
files and omnifeed's index, per pipeline (generated photos, the demo's multimodal mix, or a folder or shards
given with ``--data``)."""

from __future__ import annotations

import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omnifeed.loader import IndexConfig, build_index

from ._bench_config import BenchConfig
from ._bench_spec import folder_samples
from ._demo_data import DemoDatasetSpec, encode_image, write_folder, write_webdataset


@dataclass(frozen=True)
class Dataset:
    """One pipeline's samples as WebDataset shards, a folder of files and omnifeed's index."""

    pipeline: str
    shards: list[str]
    folder: str
    index: str
    samples: int


def write_images(out: Path, count: int, shards: int = 4) -> list[Path]:
    """``count`` 640×480 and 500×375 JPEG photos with a class label (``jpg``, ``cls``), as WebDataset shards."""
    import webdataset

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        path = out / f"images-{shard:04d}.tar"
        with open(path, "wb") as stream, webdataset.TarWriter(stream, encoder=False, mtime=0) as sink:
            for i in range(shard, count, shards):
                width, height = (640, 480) if i % 3 else (500, 375)
                sink.write(
                    {
                        "__key__": f"img-{i:06d}",
                        "jpg": encode_image(width, height, "jpg", seed=i),
                        "cls": str(i % 1000).encode(),
                    }
                )
        paths.append(path)
    return paths


def _shards_to_folder(shards: Sequence[Path], folder: Path) -> None:
    """Every member of the shards as a file ``key.field`` (the layout the folder loaders read)."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.isfile() and "/" not in member.name and not member.name.startswith("."):
                    source = tar.extractfile(member)
                    if source is not None:
                        (folder / member.name).write_bytes(source.read())


def _folder_to_shards(folder: Path, out: Path, shards: int = 4) -> list[Path]:
    """A folder of ``key.field`` files packed into WebDataset shards."""
    import webdataset

    items = folder_samples(str(folder))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        path = out / f"data-{shard:04d}.tar"
        with open(path, "wb") as stream, webdataset.TarWriter(stream, encoder=False, mtime=0) as sink:
            for key, files in items[shard::shards]:
                sink.write({"__key__": Path(key).name, **{n: p.read_bytes() for n, p in files.items()}})
        paths.append(path)
    return paths


def prepare_datasets(config: BenchConfig) -> dict[str, Dataset]:
    """Generate (or take) each pipeline's samples and write every form of them under ``config.work``."""
    datasets = {}
    for pipeline in config.pipelines:
        root = config.work / pipeline
        if pipeline == "image" and config.data is not None:
            given = sorted(config.data.glob("*.tar"))
            if given:
                shards = given
                _shards_to_folder(shards, root / "files")
            else:
                shards = _folder_to_shards(config.data, root / "shards")
                _shards_to_folder(shards, root / "files")  # keys and fields as the shards name them
        elif pipeline == "image":
            shards = write_images(root / "shards", config.images)
            _shards_to_folder(shards, root / "files")
        else:
            spec = DemoDatasetSpec(num_samples=config.mixed, num_shards=4, image_px=(160, 640))
            shards = write_webdataset(root / "shards", spec)
            write_folder(root / "files", spec)
        index = build_index([str(p) for p in shards], root / "index", IndexConfig(workers=1), progress=False)
        datasets[pipeline] = Dataset(
            pipeline, [str(p) for p in shards], str(root / "files"), str(index.path), index.num_samples
        )
    return datasets
