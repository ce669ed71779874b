"""Decoding one field's bytes in a worker process, for modalities configured with ``PoolConfig.processes``.

Reads happen in the feed's I/O threads (through the cache chain); a worker process only
decodes. The decoder is rebuilt from the ``DecodeConfig`` once per process and kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._config import DecodeConfig
from ._registry import make_decoder

Decoder = Callable[[bytes, str], Any]
_PROCESS_DECODERS: dict[tuple[str, str], Decoder] = {}


def decode_in_process(modality: str, data: bytes, key: str, config_json: str) -> Any:
    """Decode ``data`` in a worker process with the decoder of ``config_json`` (a ``DecodeConfig`` as JSON).

    The config travels as its JSON, made once by the caller, and keys the decoder kept here:
    pickling the model with every task (and dumping it here to make the key) cost ~40 µs per call.
    Values travel back as numpy arrays (what the decoders return), through the worker's shared
    scratch area (`_scratch`) or pickled through the pipe. (A torch tensor would go through torch's multiprocessing
    reduction, one shared-memory segment and file descriptor per tensor — several times slower for one image,
    and a leak risk.)
    """
    cache_key = (modality, config_json)
    decoder = _PROCESS_DECODERS.get(cache_key)
    if decoder is None:
        decoder = _PROCESS_DECODERS[cache_key] = make_decoder(modality, DecodeConfig.model_validate_json(config_json))
    return decoder(data, key)
