"""The batch format: one micro-batch of decoded samples as padded per-modality arrays.

A batch is a dict:

``"__key__"``: list of the ``n`` delivered sample keys, in plan order.
``"__info__"``: ``{"epoch", "step", "micro_batch", "rank", "accum", "topology_version",
"replaced"}`` (and ``"segments"`` in packing mode: each slot's ``[start, stop)`` token range,
for slicing ``text.tokens`` and building ``cu_seqlens``); ``replaced`` lists ``[slot, bad_key, reason]`` for each sample
that could not be read or decoded and was replaced by a batch-mate (see ``_healing``).
``"text"``: ``tokens`` int64 ``[m, L]`` (0-padded), ``lengths`` int64 ``[m]``, ``strings``
(list of ``m`` str), ``index`` int64 ``[m]`` (the slot in ``0..n-1`` of each row).
``"image"``: ``pixels`` uint8 ``[m, 3, H, W]`` (padded bottom/right to the largest),
``sizes`` int64 ``[m, 2]`` (height, width), ``index``.
``"video"``: ``frames`` uint8 ``[m, T, 3, H, W]``, ``lengths`` (frames), ``sizes``, ``index``.
``"audio"``: ``samples`` float32 ``[m, C, S]``, ``lengths`` (samples), ``index``.
``"meta"``: ``{field name: values of the n slots}``, each field decoded by type
(``loader/decode/_meta.py``): labels (``cls``, ``label``, an int Parquet column, ...) as ints,
``.json`` parsed, text as str, bytes only where the type is unknown. A field that every slot
has as an int is an int64 array ``[n]`` (a float64 array ``[n]`` when every slot has a number
and one is a float); otherwise a list of ``n`` values with ``None`` where a slot lacks the
field (so a label missing from one sample makes that batch's labels a list: check
``isinstance(v, list)`` if the data may lack them). Arrays a user's decoder returns are copied
into the batch's memory; tuples become lists and numpy scalars Python numbers, so the
in-process feed and the service hand out the same values. (Before issue 18 every meta value
was its stored bytes.)

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

Decoded = dict[str, Any]  # modality -> decoded value; "meta" -> {field name: value}
Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]
"""Returns an array of the shape and dtype, its contents undefined (the service's points into reused shared memory):
`collate` writes every element, the padding's zeros included."""


def _private(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    # Zeroed by calloc: a large array is fresh pages the kernel maps as zeros, so padding left untouched costs no
    # writes and no memory (a batch of clips of both orientations pads every frame to a square several times larger).
    return np.zeros(shape, dtype=dtype)


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
    zeroed = alloc is _private  # calloc'd: its padding is zeros already
    for row, array in enumerate(arrays):
        covered: tuple[Any, ...] = (row,) + tuple(slice(0, s) for s in array.shape)
        out[covered] = array
        if zeroed:
            continue
        # zero only the padding: for each dimension, the slab past this row's extent inside the earlier ones
        for d, size in enumerate(array.shape):
            if size < shape[d]:
                out[covered[: d + 1] + (slice(size, None),)] = 0
    return out


def _int64(values: list[Any], alloc: Allocator) -> np.ndarray:
    source = np.asarray(values, dtype=np.int64)
    out = alloc(source.shape, source.dtype)
    out[...] = source
    return out


def _media(
    arrays: list[np.ndarray], slots: list[int], name: str, length_dim: int | None, alloc: Allocator
) -> dict[str, Any]:
    """One media modality: padded arrays, lengths along ``length_dim`` (time) if any, frame sizes, rows."""
    field: dict[str, Any] = {name: _pad_stack(arrays, alloc)}
    if length_dim is not None:
        field["lengths"] = _int64([a.shape[length_dim] for a in arrays], alloc)
    if name != "samples":  # images and video frames: (height, width) of each row before padding
        field["sizes"] = _int64([list(a.shape[-2:]) for a in arrays], alloc).reshape(len(arrays), 2)
    field["index"] = _int64(slots, alloc)
    return field


def collate(
    samples: Sequence[Decoded], keys: Sequence[str], info: dict[str, Any], alloc: Allocator = _private
) -> dict[str, Any]:
    """One micro-batch of decoded samples (numpy values) in the documented batch format, as numpy arrays from
    ``alloc``."""
    batch: dict[str, Any] = {"__key__": list(keys), "__info__": info}
    rows: dict[str, list[int]] = {}
    for slot, sample in enumerate(samples):
        for modality in sample:
            rows.setdefault(modality, []).append(slot)
    if "text" in rows:
        slots = rows["text"]
        tokens = [samples[i]["text"][1] for i in slots]
        batch["text"] = {
            "tokens": _pad_stack(tokens, alloc)
            if any(t.size for t in tokens)
            else alloc((len(slots), 0), np.dtype(np.int64)),
            "lengths": _int64([t.size for t in tokens], alloc),
            "strings": [samples[i]["text"][0] for i in slots],
            "index": _int64(slots, alloc),
        }
    for modality, name, length_dim in (("image", "pixels", None), ("video", "frames", 0), ("audio", "samples", -1)):
        if modality in rows:
            batch[modality] = _media(
                [samples[i][modality] for i in rows[modality]], rows[modality], name, length_dim, alloc
            )
    if "meta" in rows:
        names = sorted({name for i in rows["meta"] for name in samples[i]["meta"]})
        batch["meta"] = {name: _meta([s.get("meta", {}).get(name) for s in samples], alloc) for name in names}
    return batch


def _plain(value: Any, alloc: Allocator) -> Any:
    """A meta value as the batch carries it: arrays in ``alloc``'s memory, numpy scalars as Python numbers, lists."""
    if isinstance(value, np.ndarray):
        out = alloc(value.shape, value.dtype)
        out[...] = value
        return out
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v, alloc) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v, alloc) for k, v in value.items()}
    return value


def _is_int64(value: Any) -> bool:
    return type(value) is int and -(2**63) <= value < 2**63


def _meta(values: list[Any], alloc: Allocator) -> Any:
    """One meta field over the slots: int64 ``[n]`` when all are ints, float64 ``[n]`` when all are numbers
    (a float among them), else a list with None for the slots without it."""
    values = [_plain(v, alloc) for v in values]
    if values and all(_is_int64(v) for v in values):
        return _int64(values, alloc)
    if values and all(_is_int64(v) or type(v) is float for v in values):
        out = alloc((len(values),), np.dtype(np.float64))
        out[...] = values
        return out
    return values


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
        if isinstance(values, np.ndarray):  # a field every slot has as a number
            values = values.tolist()
        for slot, value in enumerate(values):
            if value is not None:
                if isinstance(value, np.ndarray) and copy:
                    value = value.copy()
                samples[slot].setdefault("meta", {})[name] = value
    return samples
