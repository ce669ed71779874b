"""The batch format: one micro-batch of decoded samples as padded per-modality tensors.

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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

Decoded = dict[str, Any]  # modality -> decoded value; "meta" -> {field name: bytes}
Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]
"""Returns an uninitialized array of the shape and dtype (the service's points into shared memory)."""


def _private(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def _pad_stack(tensors: Sequence[torch.Tensor], alloc: Allocator = _private) -> torch.Tensor:
    """Stack tensors of equal rank, zero-padding every dimension to the largest, into an array from ``alloc``.

    The copies go through numpy: torch would run them on its intra-op thread pool, whose
    spinning threads take the cores the decode workers are using (measured: a fifth of the
    feed's CPU time).
    """
    arrays = [t.numpy() for t in tensors]
    shape = tuple(max(a.shape[d] for a in arrays) for d in range(arrays[0].ndim))
    out = alloc((len(arrays), *shape), arrays[0].dtype)
    if all(a.shape == shape for a in arrays):
        np.stack(arrays, out=out)
        return torch.from_numpy(out)
    out.fill(0)
    for row, array in enumerate(arrays):
        out[(row,) + tuple(slice(0, s) for s in array.shape)] = array
    return torch.from_numpy(out)


def _int64(values: list[Any], alloc: Allocator) -> torch.Tensor:
    source = np.asarray(values, dtype=np.int64)
    out = alloc(source.shape, source.dtype)
    out[...] = source
    return torch.from_numpy(out)


def _media(tensors: list[torch.Tensor], slots: list[int], name: str, length_dim: int | None,
           alloc: Allocator) -> dict[str, Any]:
    """One media modality: padded tensors, lengths along ``length_dim`` (time) if any, frame sizes, rows."""
    field: dict[str, Any] = {name: _pad_stack(tensors, alloc)}
    if length_dim is not None:
        field["lengths"] = _int64([t.shape[length_dim] for t in tensors], alloc)
    if name != "samples":  # images and video frames: (height, width) of each row before padding
        field["sizes"] = _int64([list(t.shape[-2:]) for t in tensors], alloc).reshape(len(tensors), 2)
    field["index"] = _int64(slots, alloc)
    return field


def collate(samples: Sequence[Decoded], keys: Sequence[str], info: dict[str, Any],
            alloc: Allocator = _private) -> dict[str, Any]:
    """One micro-batch of decoded samples in the documented batch format (tensor storage from ``alloc``)."""
    batch: dict[str, Any] = {"__key__": list(keys), "__info__": info}
    rows: dict[str, list[int]] = {}
    for slot, sample in enumerate(samples):
        for modality in sample:
            rows.setdefault(modality, []).append(slot)
    if "text" in rows:
        slots = rows["text"]
        tokens = [samples[i]["text"][1] for i in slots]
        batch["text"] = {
            "tokens": _pad_stack(tokens, alloc) if any(t.numel() for t in tokens)
            else torch.from_numpy(alloc((len(slots), 0), np.dtype(np.int64))),
            "lengths": _int64([t.numel() for t in tokens], alloc),
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
    """The decoded samples of a collated batch (collate's inverse, padding removed): copies, or views of it."""
    n = len(batch["__key__"])
    samples: list[Decoded] = [{} for _ in range(n)]
    if "text" in batch:
        text = batch["text"]
        for row, slot in enumerate(text["index"].tolist()):
            length = int(text["lengths"][row])
            tokens = text["tokens"][row, :length]
            samples[slot]["text"] = (text["strings"][row], torch.from_numpy(tokens.numpy().copy()) if copy else tokens)
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
            # numpy copies: torch's clone runs on its intra-op pool, which fights the decode threads (see _pad_stack)
            samples[slot][modality] = torch.from_numpy(np.ascontiguousarray(value.numpy())) if copy else value
    for name, values in batch.get("meta", {}).items():
        for slot, value in enumerate(values):
            if value is not None:
                samples[slot].setdefault("meta", {})[name] = value
    return samples
