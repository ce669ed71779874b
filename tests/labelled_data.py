"""Small labelled datasets for the value, transform and user-error tests: a tar of images with labels, and Parquet."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from omnifeed.loader import IndexConfig, SampleIndex, build_index


def png(seed: int, width: int = 40, height: int = 30) -> bytes:
    """A noise PNG (lossless, so every decode of it gives the same pixels)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_labelled_tar(path: Path, count: int = 12, *, missing_label: int | None = None) -> Path:
    """``sample-NN.png`` / ``.cls`` / ``.json`` / ``.seg`` (unknown type) / ``.txt`` members; sample
    ``missing_label`` has no ``.cls``."""
    with tarfile.open(path, "w") as tar:
        for i in range(count):
            fields = {
                "png": png(i, 40 + i, 30 + (i % 5)),
                "cls": f"{i % 3}\n".encode(),
                "json": json.dumps({"id": i, "tags": ["a", "b"][: i % 3], "w": 0.5}).encode(),
                "seg": bytes([i, 255]),
                "txt": f"caption {i}".encode(),
            }
            if i == missing_label:
                del fields["cls"]
            for name, data in fields.items():
                info = tarfile.TarInfo(f"sample-{i:02d}.{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def write_labelled_parquet(path: Path, count: int = 10) -> Path:
    """Columns ``__key__``, ``png`` (binary), ``label`` (int64), ``caption`` (string), ``score`` (float64),
    ``tags`` (list of strings), ``raw`` (binary, unknown type)."""
    table = pa.table(
        {
            "__key__": [f"row-{i:02d}" for i in range(count)],
            "png": pa.array([png(100 + i) for i in range(count)], pa.binary()),
            "label": pa.array([i % 4 for i in range(count)], pa.int64()),
            "caption": [f"a picture {i}" for i in range(count)],
            "score": [i / 2 for i in range(count)],
            "tags": [["x"] * (i % 3) for i in range(count)],
            "raw": pa.array([bytes([i]) for i in range(count)], pa.binary()),
        }
    )
    pq.write_table(table, path, row_group_size=4)
    return path


def index_of(sources: list[Path], out: Path, config: IndexConfig | None = None) -> SampleIndex:
    """The index of ``sources`` built into ``out`` (in this process: ``config.workers`` is 1)."""
    config = (config or IndexConfig()).model_copy(update={"workers": 1})
    return SampleIndex(build_index([str(p) for p in sources], out, config, progress=False).path)
