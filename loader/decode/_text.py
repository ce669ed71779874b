"""Text: bytes → (str, int64 token ids), strict UTF-8 and a pluggable tokenizer.

- ``'bytes'``: the UTF-8 byte values (0–255) are the token ids (byte-level models).
- ``'module:function'``: ``function`` (a dotted attribute path is allowed, e.g.
  ``'my_pkg.tok:TOKENIZER.encode'``) is imported once per process and called with the text;
  it returns a sequence (or 1-D numpy array or torch tensor) of ints.

Errors: invalid UTF-8 is DecodeError 'encoding' (a leading BOM is kept, as in the index's
token counts); more than ``max_tokens`` ids is 'too_long' — never truncated silently. Empty
text is valid: ("", an empty array). An exception raised by a user tokenizer, or a result
that is not a sequence of ints, is a bug in the tokenizer, not a bad sample: it propagates
(TypeError for a wrong result) with a note naming the sample key.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import add_context
from .._user_code import import_function
from ._common import DecodeError, as_numpy
from ._config import TextDecodeConfig

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=32)
def resolve_tokenizer(spec: str) -> Callable[[str], Any] | None:
    """The tokenizer named by ``spec`` (None for 'bytes'); ValueError if it cannot be imported."""
    name = spec.strip()
    if name == "bytes":
        return None
    function = import_function(name, "tokenizer")  # ValueError naming what is wrong
    logger.debug("text tokenized by %s", name)
    return function


def _as_ids(result: Any, spec: str) -> np.ndarray:
    """int64 ids from a tokenizer's result; TypeError unless it is a 1-D sequence of ints."""
    result = as_numpy(result)  # a torch tensor, told without importing torch
    array = np.asarray(result)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(
            f"tokenizer {spec!r} returned {type(result).__name__} of {array.dtype} with shape {array.shape}: "
            "return a sequence of int token ids"
        )
    return array.astype(np.int64)


def decode_text(data: bytes, config: TextDecodeConfig, key: str = "?") -> tuple[str, np.ndarray]:
    """Decode UTF-8 ``data`` into (text, int64 token ids) with ``config.tokenizer``.

    Raises DecodeError 'encoding' (not UTF-8) or 'too_long' (over ``max_tokens``).
    """
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"invalid UTF-8 at byte {exc.start} ({exc.reason})", key, "text", "encoding") from exc
    tokenizer = resolve_tokenizer(config.tokenizer)
    limit = config.max_tokens
    if tokenizer is None:
        if limit is not None and len(data) > limit:
            raise DecodeError(f"{len(data)} byte tokens, over max_tokens = {limit}", key, "text", "too_long")
        return text, np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    try:
        ids = _as_ids(tokenizer(text), config.tokenizer)
    except Exception as exc:
        add_context(exc, f"tokenizer={config.tokenizer} key={key}")
        raise
    if limit is not None and ids.size > limit:
        raise DecodeError(f"{ids.size} tokens, over max_tokens = {limit}", key, "text", "too_long")
    return text, ids
