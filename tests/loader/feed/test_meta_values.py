"""Labels and metadata as values in the batch: int64 tensors, parsed JSON, str; per-field decoders told their field."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from labelled_data import index_of, write_labelled_parquet, write_labelled_tar

from omnifeed.loader import Feed, FeedConfig, PlanConfig, SampleIndex
from omnifeed.loader.feed import collate
from omnifeed.loader.feed._collate import uncollate


def config(batch_size: int = 4) -> FeedConfig:
    return FeedConfig(plan=PlanConfig(seed=5, batch_size=batch_size))


@pytest.fixture(scope="module")
def tar_index(tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    folder = tmp_path_factory.mktemp("labelled-tar")
    return index_of([write_labelled_tar(folder / "a.tar")], folder / "index")


def test_labels_are_an_int64_tensor_json_is_parsed_and_unknown_fields_stay_bytes(tar_index: SampleIndex) -> None:
    with Feed(tar_index, config()) as feed:
        batch = feed.next_batch()
    meta, keys = batch["meta"], batch["__key__"]
    numbers = [int(k.split("-")[1]) for k in keys]
    assert meta["cls"].dtype == torch.int64 and meta["cls"].tolist() == [n % 3 for n in numbers]
    assert meta["json"] == [{"id": n, "tags": ["a", "b"][: n % 3], "w": 0.5} for n in numbers]
    assert meta["seg"] == [bytes([n, 255]) for n in numbers]
    assert batch["text"]["strings"] == [f"caption {n}" for n in numbers], "txt stays the text modality"


def test_a_label_some_samples_lack_is_a_list_with_none_for_them(tmp_path: Path) -> None:
    index = index_of([write_labelled_tar(tmp_path / "a.tar", count=4, missing_label=2)], tmp_path / "index")
    with Feed(index, config()) as feed:
        batch = feed.next_batch()
    expected = [None if k == "sample-02" else int(k[-2:]) % 3 for k in batch["__key__"]]
    assert batch["meta"]["cls"] == expected and isinstance(batch["meta"]["cls"], list)


def test_parquet_columns_come_back_by_their_type(tmp_path: Path) -> None:
    index = index_of([write_labelled_parquet(tmp_path / "t.parquet")], tmp_path / "index")
    with Feed(index, config()) as feed:
        batch = feed.next_batch()
    rows = [int(k.split("-")[1]) for k in batch["__key__"]]
    meta = batch["meta"]
    assert meta["label"].dtype == torch.int64 and meta["label"].tolist() == [r % 4 for r in rows]
    assert meta["score"].dtype == torch.float64 and meta["score"].tolist() == [r / 2 for r in rows]
    assert "caption" not in meta and batch["text"]["strings"] == [f"a picture {r}" for r in rows], (
        "a string column named like text is the text modality (issue 18, item 1)"
    )
    assert meta["tags"] == [["x"] * (r % 3) for r in rows]
    assert meta["raw"] == [bytes([r]) for r in rows]


def test_per_field_decoders_are_told_their_field_and_modality_decoders_keep_their_signature(
    tar_index: SampleIndex,
) -> None:
    calls: list[tuple[str, str]] = []

    def label(data: bytes, key: str, field: str) -> int:
        calls.append((key, field))
        return int(data) + 100

    def any_json(data: bytes, key: str, field: str) -> str:
        return f"{field}:{len(data)}"

    def image(data: bytes, key: str) -> np.ndarray:  # today's (bytes, key) modality decoder
        return np.zeros((3, 2, 2), np.uint8)

    with Feed(tar_index, config(), decoders={"cls": label, "json": any_json, "image": image}) as feed:
        batch = feed.next_batch()
    numbers = [int(k.split("-")[1]) for k in batch["__key__"]]
    assert batch["meta"]["cls"].tolist() == [100 + n % 3 for n in numbers]
    assert all(v.startswith("json:") for v in batch["meta"]["json"])
    assert batch["image"]["pixels"].shape == (4, 3, 2, 2)
    assert {field for _, field in calls} == {"cls"} and {key for key, _ in calls} >= set(batch["__key__"])


def test_a_field_named_like_a_modality_is_reached_with_the_field_prefix(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        for i in range(4):
            info = tarfile.TarInfo(f"s{i}.image")  # a meta field called 'image' (an unknown extension)
            info.size = 1
            tar.addfile(info, io.BytesIO(bytes([i])))
    index = index_of([tmp_path / "a.tar"], tmp_path / "index")
    with Feed(index, config(), decoders={"field:image": lambda data, key, field: f"{field}={data[0]}"}) as feed:
        assert sorted(feed.next_batch()["meta"]["image"]) == [f"image={i}" for i in range(4)]


def test_meta_values_survive_collate_and_uncollate_through_the_batch_memory() -> None:
    samples: list[dict[str, Any]] = [
        {"meta": {"cls": 1, "json": {"a": (1, 2)}, "mask": np.ones(2, np.uint8), "n": np.int64(4)}},
        {"meta": {"cls": 2, "n": 2.5}},
    ]
    arena: list[np.ndarray] = []

    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        arena.append(np.empty(shape, dtype))
        return arena[-1]

    batch = collate(samples, ["a", "b"], {}, alloc)
    meta = batch["meta"]
    assert meta["cls"].dtype == np.int64 and any(meta["cls"] is a for a in arena)
    assert meta["n"].dtype == np.float64 and meta["n"].tolist() == [4.0, 2.5]
    assert meta["json"] == [{"a": [1, 2]}, None], "tuples become lists, as msgpack hands them to a client"
    assert any(meta["mask"][0] is a for a in arena), "an array a decoder returned is copied into the batch memory"
    back = uncollate(batch)
    assert back[0]["meta"]["cls"] == 1 and type(back[0]["meta"]["cls"]) is int and "json" not in back[1]["meta"]
