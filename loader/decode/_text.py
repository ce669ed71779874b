"""Text: bytes → (str, int64 token ids), strict UTF-8 and a pluggable tokenizer.

The tokenizer is the index's (``IndexConfig.tokenizer``, recorded in its manifest) unless set, and a
set one must be the index's (`follow_index_tokenizer`): the plan's token budgets are counted by the
index, so a decoder that tokenized otherwise would overrun them (measured: 7.6× on one batch).

- ``'regex'`` (the index's default): the matches of ``\\w+|[^\\w\\s]``, as the index counts them;
  each id is the CRC-32 of the piece's UTF-8 bytes (0 ≤ id < 2**32; a hashing-trick id: take it
  modulo a vocabulary size).
- ``'whitespace'``: the pieces of ``str.split()``, ids as for ``'regex'``.
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
import re
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._errors import add_context
from .._user_code import import_function
from ._common import DecodeError, as_numpy
from ._config import DecodeConfig, TextDecodeConfig

logger = logging.getLogger(__name__)

INDEX_DEFAULT_TOKENIZER = "regex"
"""``IndexConfig.tokenizer``'s default: what an unset tokenizer means without an index to follow."""
_WORD_OR_SYMBOL = re.compile(r"\w+|[^\w\s]")  # the index's 'regex' measure (index/_tokenizers.py)


def regex_token_ids(text: str) -> list[int]:
    """CRC-32 ids of the index's 'regex' pieces: runs of word characters and single non-space symbols."""
    return [zlib.crc32(piece.encode("utf-8")) for piece in _WORD_OR_SYMBOL.findall(text)]


def whitespace_token_ids(text: str) -> list[int]:
    """CRC-32 ids of the whitespace-separated words (the index's 'whitespace' pieces)."""
    return [zlib.crc32(piece.encode("utf-8")) for piece in text.split()]


_BUILTIN_IDS: dict[str, Callable[[str], Any]] = {"regex": regex_token_ids, "whitespace": whitespace_token_ids}


def follow_index_tokenizer(
    decode: DecodeConfig, manifest: Mapping[str, Any], users_text_decoder: bool = False
) -> DecodeConfig:
    """``decode`` with its text tokenizer set to the index's (from the index ``manifest``) when unset.

    Raises ValueError (one line naming both) when a set tokenizer differs from the index's and the
    index holds text that the built-in decoder reads (not ``users_text_decoder``).
    """
    indexed = str(manifest.get("config", {}).get("tokenizer", INDEX_DEFAULT_TOKENIZER)).strip()
    chosen = decode.text.tokenizer
    if chosen is None:
        return decode.model_copy(update={"text": decode.text.model_copy(update={"tokenizer": indexed})})
    counts = manifest.get("modalities")
    has_text = counts is None or int(counts.get("text", 0)) > 0
    if chosen.strip() != indexed and has_text and not users_text_decoder:
        raise ValueError(
            f"decode.text.tokenizer {chosen!r} differs from the index's tokenizer {indexed!r}, which counted the "
            f"token budgets: leave decode.text.tokenizer unset to follow the index, or rebuild the index with "
            f"tokenizer {chosen!r}"
        )
    return decode


@functools.lru_cache(maxsize=32)
def resolve_tokenizer(spec: str | None) -> Callable[[str], Any] | None:
    """The tokenizer named by ``spec`` (None for 'bytes'; unset is the index's default); ValueError if it cannot be
    imported."""
    name = (spec or INDEX_DEFAULT_TOKENIZER).strip()
    if name == "bytes":
        return None
    if name in _BUILTIN_IDS:
        return _BUILTIN_IDS[name]
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
        ids = _as_ids(tokenizer(text), str(config.tokenizer))
    except Exception as exc:
        add_context(exc, f"tokenizer={config.tokenizer} key={key}")
        raise
    if limit is not None and ids.size > limit:
        raise DecodeError(f"{ids.size} tokens, over max_tokens = {limit}", key, "text", "too_long")
    return text, ids
