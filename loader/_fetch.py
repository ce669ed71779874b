"""Decoding one field's bytes in a worker process, for modalities configured with ``PoolConfig.processes``.

Reads happen in the feed's I/O threads (through the cache chain); a worker process only
decodes. The decoder is rebuilt from the ``DecodeConfig`` once per process and kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ._decode import make_decoder
from ._decode_config import DecodeConfig

Decoder = Callable[[bytes, str], Any]
_PROCESS_DECODERS: dict[tuple[str, str], Decoder] = {}


def decode_in_process(modality: str, data: bytes, key: str, config: DecodeConfig) -> Any:
    """Decode ``data`` in a worker process with the decoder of ``config``.

    Tensors travel back as numpy arrays: pickled by value through the pipe. (A torch tensor
    would go through torch's multiprocessing reduction, one shared-memory segment and file
    descriptor per tensor — several times slower for one image, and a leak risk.)
    """
    cache_key = (modality, config.model_dump_json())
    decoder = _PROCESS_DECODERS.get(cache_key)
    if decoder is None:
        decoder = _PROCESS_DECODERS[cache_key] = make_decoder(modality, config)
    return _to_numpy(decoder(data, key))


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
