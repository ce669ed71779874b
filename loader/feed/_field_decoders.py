"""Which function decodes a field, and calling it: a user's field or modality decoder, a built-in, meta by type.

``Feed(decoders=...)`` keys are of two kinds:

- a modality (``image``, ``video``, ``audio``, ``text``, ``meta``): ``fn(data: bytes, key: str)``
  decodes every field of it, as before;
- anything else names a field: ``fn(data: bytes, key: str, field: str)`` decodes the fields of
  that name (``cls``, ``seg.json``), or whose last extension it is (``json`` for ``seg.json``);
  an exact name wins over an extension. Write ``field:image`` for a field named like a modality
  (a Parquet column ``image`` mapped to meta).

A field decoder wins over its modality's decoder. Without either, a meta field is decoded by
type (`decode_meta`), the others by the built-in decoders, in this thread or in the modality's
decode processes (``executor: processes``; a user's decoder always runs in threads: it may not
pickle). A user decoder's exception, or a value the batch cannot hold, is a ``DecodeError``
with reason ``user`` naming the function, the sample, the field and its file; a
``DecodeError`` it raises keeps its own reason (that is how a decoder says the input is bad).
A user tokenizer (``decode.text.tokenizer: module:function``) is user code in the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from multiprocessing import get_context
from typing import Any

import numpy as np

from .._modalities import FIELD_MODALITIES, MODALITIES
from ..decode import (
    ColumnKind,
    DecodeError,
    WorkerProcesses,
    as_numpy,
    decode_in_process,
    decode_meta,
    function_name,
    user_code_error,
)
from ..index import FieldLocation
from ._config import FeedConfig
from ._transforms import holdable

FIELD_PREFIX = "field:"
SCRATCH_SLACK = 16 * 2**20
"""Shared memory per decode process beyond its share of the buffer: the micro-batch being collated still holds
its own."""


def field_key(key: str) -> str:
    """The field name a ``Feed(decoders=...)`` key that is not a modality names (lower-cased, ``field:`` removed)."""
    return (key[len(FIELD_PREFIX) :] if key.startswith(FIELD_PREFIX) else key).lower()


def field_keys(keys: frozenset[str] | Mapping[str, Any]) -> frozenset[str]:
    """The field names among ``Feed(decoders=...)`` keys."""
    return frozenset(field_key(k) for k in keys if k not in FIELD_MODALITIES)


def matching_field(name: str, keys: frozenset[str] | Mapping[str, Any]) -> str | None:
    """The key of ``keys`` that decodes field ``name``: the name itself, else its last extension; None if neither."""
    if name in keys:
        return name
    last = name.rsplit(".", 1)[-1]
    return last if last != name and last in keys else None


def meta_value_problem(value: Any, depth: int = 0) -> str | None:
    """Why a batch (in process and through the service's msgpack) cannot carry meta ``value``; None when it can."""
    if depth > 64:
        return "nested more than 64 levels"
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return None
    if isinstance(value, int):
        return None if -(2**63) <= value < 2**64 else f"the integer {value} is wider than 64 bits"
    if isinstance(value, np.ndarray):
        return None if value.dtype.kind in "uifb" else f"an array of dtype {value.dtype}"
    if isinstance(value, np.generic):
        return None if value.dtype.kind in "uifb" else f"a numpy {value.dtype} scalar"
    if isinstance(value, (list, tuple)):
        return next((p for p in (meta_value_problem(v, depth + 1) for v in value) if p), None)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return "a dict with keys that are not str"
        return next((p for p in (meta_value_problem(v, depth + 1) for v in value.values()) if p), None)
    return f"a {type(value).__name__}"


class FieldDecoders:
    """The decoders of a feed: ``decoders`` holds the built-ins merged with the user's, ``custom`` the user's keys."""

    def __init__(
        self, config: FeedConfig, decoders: Mapping[str, Callable[..., Any]], custom: frozenset[str] = frozenset()
    ) -> None:
        self.modalities = {k: v for k, v in decoders.items() if k in FIELD_MODALITIES}
        self.fields = {field_key(k): v for k, v in decoders.items() if k not in FIELD_MODALITIES}
        self.custom = frozenset(k for k in custom if k in FIELD_MODALITIES)
        tokenizer = (config.decode.text.tokenizer or "").strip()
        self._tokenizer = tokenizer if ":" in tokenizer and "text" not in self.custom else None  # a user's function
        self._executors: dict[str, WorkerProcesses] = {}
        context = get_context("forkserver")  # workers fork from a clean server, not from this threaded process
        context.set_forkserver_preload(["omnifeed.loader"])
        self._decode_json = config.decode.model_dump_json()  # once: tasks send this str, not the model
        for modality in MODALITIES:
            pool = config.pool(modality)
            processes = pool.decode_processes
            if processes and modality not in self.custom:  # a user's decoder may not pickle: it runs in threads
                scratch = pool.buffer_bytes // processes + SCRATCH_SLACK if pool.shared_memory else 0
                self._executors[modality] = WorkerProcesses(processes, context, f"omnifeed-{modality}-decode", scratch)

    def decode(
        self,
        modality: str,
        location: FieldLocation,
        key: str,
        data: bytes,
        where: str,
        column: ColumnKind | None = None,
    ) -> Any:
        """The value of field ``location`` of sample ``key`` from its bytes (numpy arrays, never tensors).

        ``where`` names the field's file for messages; ``column`` is how a Parquet cell was stored.
        Raises DecodeError (reason 'user' for a failing user function), WorkerDied, or a storage error.
        """
        matched = matching_field(location.name, self.fields) if self.fields else None
        if matched is not None:
            return self._user(self.fields[matched], modality, key, where, data, key, location.name)
        if modality in self.custom:
            return self._user(self.modalities[modality], modality, key, where, data, key)
        if modality == "meta":
            return decode_meta(data, key, location.name, column)
        try:
            executor = self._executors.get(modality)
            if executor is not None:
                return executor.run(decode_in_process, modality, data, key, self._decode_json)
            decoder = self.modalities.get(modality)  # a built-in: numpy already
            return data if decoder is None else decoder(data, key)
        except (DecodeError, MemoryError):
            raise
        except Exception as exc:
            if modality == "text" and self._tokenizer is not None and not isinstance(exc, OSError):
                raise user_code_error(f"tokenizer {self._tokenizer}", exc, key, modality, where) from exc
            raise

    @staticmethod
    def _user(function: Callable[..., Any], modality: str, key: str, where: str, *args: Any) -> Any:
        try:
            value = as_numpy(function(*args))
        except DecodeError:
            raise
        except Exception as exc:
            raise user_code_error(f"decoder {function_name(function)}", exc, key, modality, where) from exc
        problem = meta_value_problem(value) if modality == "meta" else holdable(value, modality)
        if problem is not None:
            raise DecodeError(
                f"decoder {function_name(function)} returned a value the batch cannot hold: {problem} ({where})",
                key,
                modality,
                "user",
            )
        return value

    def close(self) -> None:
        """Stop the decode processes (idempotent)."""
        for executor in self._executors.values():
            executor.close()
        self._executors.clear()
