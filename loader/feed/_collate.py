"""The batch format: one micro-batch of decoded samples as padded per-modality arrays.

A batch is a dict:

``"__key__"``: list of the ``n`` delivered sample keys, in plan order.
``"__info__"``: ``{"epoch", "step", "micro_batch", "rank", "accum", "topology_version",
"replaced"}`` (and ``"segments"`` in packing mode: each slot's ``[start, stop)`` token range,
for slicing ``text.tokens`` and building ``cu_seqlens``); ``replaced`` lists ``[slot, bad_key, reason]`` for each sample that could
not be read or decoded and was replaced by a batch-mate (see ``_healing``).
``"text"``: ``tokens`` int64 ``[m, L]`` (0-padded), ``lengths`` int64 ``[m]``, ``strings``
(list of ``m`` str), ``index`` int64 ``[m]`` (the slot in ``0..n-1`` of each row).
``"image"``: ``pixels`` uint8 ``[m, 3, H, W]`` (padded bottom/right to the largest),
``sizes`` int64 ``[m, 2]`` (height, width), ``index``.
``"video"``: ``frames`` uint8 ``[m, T, 3, H, W]``, ``lengths`` (frames), ``sizes``, ``index``.
``"audio"``: ``samples`` float32 ``[m, C, S]``, ``lengths`` (samples), ``index``.
``"meta"``: ``{field name: list of n bytes or None}`` (JSON, class labels, ... as stored).

A modality no sample of the micro-batch has is absent from the dict; rows exist only for
samples that have the modality, and ``index`` says whose they are.

`collate` builds the batch as numpy arrays (the feed engine and the service never import
torch); the trainer side hands it out with every array as a torch tensor sharing its memory
(`Feed` through ``_torch_batch.to_torch``, `FeedClient` from the segment), same dtypes and shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Decoded = dict[str, Any]  # modality -> decoded value; "meta" -> {field name: bytes}
Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]
"""Returns an uninitialized array of the shape and dtype (the service's points into shared memory)."""


def _private(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def _pad_stack(arrays: Sequence[np.ndarray], alloc: Allocator = _private) -> np.ndarray:
    """Stack arrays of equal rank, zero-padding every dimension to the largest, into an array from ``alloc``.

    The copies are numpy's, in the calling thread: torch would run them on its intra-op thread
    pool, whose spinning threads take the cores the decode workers are using (measured: a
    fifth of the feed's CPU time).
    """
    shape = tuple(max(a.shape[d] for a in arrays) for d in range(arrays[0].ndim))
    out = alloc((len(arrays), *shape), arrays[0].dtype)
    if all(a.shape == shape for a in arrays):
        np.stack(arrays, out=out)
        return out
    out.fill(0)
    for row, array in enumerate(arrays):
        out[(row,) + tuple(slice(0, s) for s in array.shape)] = array
    return out


def _int64(values: list[Any], alloc: Allocator) -> np.ndarray:
    source = np.asarray(values, dtype=np.int64)
    out = alloc(source.shape, source.dtype)
    out[...] = source
    return out


def _media(arrays: list[np.ndarray], slots: list[int], name: str, length_dim: int | None,
           alloc: Allocator) -> dict[str, Any]:
    """One media modality: padded arrays, lengths along ``length_dim`` (time) if any, frame sizes, rows."""
    field: dict[str, Any] = {name: _pad_stack(arrays, alloc)}
    if length_dim is not None:
        field["lengths"] = _int64([a.shape[length_dim] for a in arrays], alloc)
    if name != "samples":  # images and video frames: (height, width) of each row before padding
        field["sizes"] = _int64([list(a.shape[-2:]) for a in arrays], alloc).reshape(len(arrays), 2)
    field["index"] = _int64(slots, alloc)
    return field


def collate(samples: Sequence[Decoded], keys: Sequence[str], info: dict[str, Any],
            alloc: Allocator = _private) -> dict[str, Any]:
    """One micro-batch of decoded samples (numpy values) in the documented batch format, as numpy arrays from ``alloc``."""
    batch: dict[str, Any] = {"__key__": list(keys), "__info__": info}
    rows: dict[str, list[int]] = {}
    for slot, sample in enumerate(samples):
        for modality in sample:
            rows.setdefault(modality, []).append(slot)
    if "text" in rows:
        slots = rows["text"]
        tokens = [samples[i]["text"][1] for i in slots]
        batch["text"] = {
            "tokens": _pad_stack(tokens, alloc) if any(t.size for t in tokens)
            else alloc((len(slots), 0), np.dtype(np.int64)),
            "lengths": _int64([t.size for t in tokens], alloc),
            "strings": [samples[i]["text"][0] for i in slots],
            "index": _int64(slots, alloc),
        }
    for modality, name, length_dim in (("image", "pixels", None), ("video", "frames", 0), ("audio", "samples", -1)):
        if modality in rows:
            batch[modality] = _media([samples[i][modality] for i in rows[modality]], rows[modality], name, length_dim, alloc)
    if "meta" in rows:
        names = sorted({name for i in rows["meta"] for name in samples[i]["meta"]})
        batch["meta"] = {name: [s.get("meta", {}).get(name) for s in samples] for name in names}
    return batch


def uncollate(batch: dict[str, Any], copy: bool = True) -> list[Decoded]:
    """The decoded samples of a collated numpy batch (collate's inverse, padding removed): copies, or views of it."""
    n = len(batch["__key__"])
    samples: list[Decoded] = [{} for _ in range(n)]
    if "text" in batch:
        text = batch["text"]
        for row, slot in enumerate(text["index"].tolist()):
            length = int(text["lengths"][row])
            tokens = text["tokens"][row, :length]
            samples[slot]["text"] = (text["strings"][row], tokens.copy() if copy else tokens)
    for modality, name in (("image", "pixels"), ("video", "frames"), ("audio", "samples")):
        if modality not in batch:
            continue
        field = batch[modality]
        for row, slot in enumerate(field["index"].tolist()):
            value = field[name][row]
            if modality == "video":
                value = value[: int(field["lengths"][row])]
            if modality == "audio":
                value = value[..., : int(field["lengths"][row])]
            if "sizes" in field:
                height, width = field["sizes"][row].tolist()
                value = value[..., :height, :width]
            samples[slot][modality] = np.ascontiguousarray(value) if copy else value
    for name, values in batch.get("meta", {}).items():
        for slot, value in enumerate(values):
            if value is not None:
                samples[slot].setdefault("meta", {})[name] = value
    return samples
