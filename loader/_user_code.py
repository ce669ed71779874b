"""A user's function named by import path (``module:attr.path``): tokenizers, decoders, transforms."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_function(spec: str, what: str) -> Callable[..., Any]:
    """The callable ``spec`` names; ValueError saying, for the user's ``what`` (e.g. "tokenizer"), what is wrong."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"{what} {spec!r}: expected 'module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(target):
        raise ValueError(f"{what} {spec!r}: {attr_path!r} is a {type(target).__name__}, not a callable")
    return target  # type: ignore[no-any-return]
