"""Errors of the cache tiers."""

from __future__ import annotations


class CacheError(Exception):
    """A cache tier cannot be opened or used as configured; the message says what to do."""
