"""One field fetched by its index location and decoded: the unit of work of a decode worker.

Runs in a worker thread, or in a worker process for modalities configured with
``PoolConfig.processes`` (their decoders hold the GIL too much to scale in threads; see
benchmarks/RESULTS.md). In a process the decoder is rebuilt from the ``DecodeConfig`` once
and kept, so each task ships only the location and gets back the decoded value.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ._decode import make_decoder
from ._decode_config import DecodeConfig
from ._records import FieldLocation, ShardSpec
from ._sources import read_field

Decoder = Callable[[bytes, str], Any]
TRANSIENT = (ConnectionError, TimeoutError)
_PROCESS_DECODERS: dict[tuple[str, str], Decoder] = {}


def fetch_and_decode(
    shard: ShardSpec, location: FieldLocation, row_group: int, row: int, key: str, decoder: Decoder | None,
    retries: int, backoff_s: float,
) -> tuple[Any, int, int]:
    """(decoded value — the bytes for meta fields —, bytes read, retries used).

    Transient storage errors are retried with doubling backoff; the last one propagates, as
    do ``SourceError`` and ``DecodeError``.
    """
    for attempt in range(retries + 1):
        try:
            data = read_field(shard, location, row_group=row_group, row=row)
            break
        except TRANSIENT:
            if attempt == retries:
                raise
            time.sleep(backoff_s * 2**attempt)
    value = data if decoder is None else decoder(data, key)
    return value, len(data), attempt


def fetch_and_decode_in_process(
    shard: ShardSpec, location: FieldLocation, row_group: int, row: int, key: str, config: DecodeConfig,
    retries: int, backoff_s: float,
) -> tuple[Any, int, int]:
    """`fetch_and_decode` in a worker process, with the decoder of ``config`` built once per process.

    Tensors travel back as numpy arrays: pickled by value through the pipe. (A torch tensor
    would go through torch's multiprocessing reduction, one shared-memory segment and file
    descriptor per tensor — several times slower for one image, and a leak risk.)
    """
    cache_key = (location.modality, config.model_dump_json())
    decoder = _PROCESS_DECODERS.get(cache_key)
    if decoder is None:
        decoder = _PROCESS_DECODERS[cache_key] = make_decoder(location.modality, config)
    value, read, retried = fetch_and_decode(shard, location, row_group, row, key, decoder, retries, backoff_s)
    return _to_numpy(value), read, retried


def from_process(value: Any) -> Any:
    """Undo `_to_numpy` in the parent: numpy arrays become tensors sharing their memory."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, tuple):
        return tuple(from_process(v) for v in value)
    return value


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, tuple):
        return tuple(_to_numpy(v) for v in value)
    return value
