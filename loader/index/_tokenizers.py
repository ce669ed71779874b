"""Pluggable text length measures: how many tokens a text field counts for in bucketing.

The index stores one integer per sample for its text; which integer is chosen by
``IndexConfig.tokenizer``:

- ``'regex'`` (the default): the number of matches of ``\\w+|[^\\w\\s]``, i.e. runs of
  word characters plus each punctuation or symbol character on its own. It tracks
  sub-word tokenizers within a small factor, needs no model and is stable across
  versions, so it is a good default for bucketing.
- ``'whitespace'``: the number of whitespace-separated words (``len(text.split())``).
- ``'bytes'``: the UTF-8 length in bytes (byte-level models).
- ``'module:function'``: ``function`` imported from ``module`` (``function`` may be a
  dotted attribute path, e.g. ``'my_pkg.tok:TOKENIZER.encode'``); it is called with
  the text and returns either an ``int`` or a sequence whose ``len`` is taken.

The built-in counters are module-level functions and an imported one is a
``functools.partial`` over the imported function, so a counter pickles (for
scanning processes) whenever its function does.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any

from .._user_code import import_function

logger = logging.getLogger(__name__)

TokenCounter = Callable[[str], int]

_WORD_OR_SYMBOL = re.compile(r"\w+|[^\w\s]")
BUILTIN_COUNTERS: tuple[str, ...] = ("regex", "whitespace", "bytes")


def count_regex_tokens(text: str) -> int:
    """Count runs of word characters plus single non-space symbols (the default measure)."""
    return sum(1 for _ in _WORD_OR_SYMBOL.finditer(text))


def count_whitespace_tokens(text: str) -> int:
    """Count whitespace-separated words."""
    return len(text.split())


def count_utf8_bytes(text: str) -> int:
    """Count the bytes of the text encoded as UTF-8."""
    return len(text.encode("utf-8"))


_BUILTINS: dict[str, TokenCounter] = {
    "regex": count_regex_tokens,
    "whitespace": count_whitespace_tokens,
    "bytes": count_utf8_bytes,
}


def _call_imported(function: Callable[[str], Any], spec: str, text: str) -> int:
    """Call a user counter and turn its result (an int or a sequence of tokens) into a count."""
    result = function(text)
    if isinstance(result, bool):
        raise TypeError(f"tokenizer {spec!r} returned a bool; return an int or a sequence of tokens")
    if isinstance(result, int):
        return result
    try:
        return len(result)
    except TypeError:
        raise TypeError(
            f"tokenizer {spec!r} returned {type(result).__name__}; return an int or a sequence of tokens"
        ) from None


def make_token_counter(spec: str = "regex") -> TokenCounter:
    """Return the text length measure named by ``spec`` (see the module docstring).

    Raises ValueError naming the valid choices when ``spec`` is unknown or cannot be imported.
    """
    name = spec.strip()
    if name in _BUILTINS:
        return _BUILTINS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown tokenizer {spec!r}: use one of {', '.join(repr(b) for b in BUILTIN_COUNTERS)} "
            "or 'module:function'"
        )
    function = import_function(name, "tokenizer")
    logger.debug("text lengths measured by %s", name)
    return functools.partial(_call_imported, function, name)
