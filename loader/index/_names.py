"""WebDataset's naming convention, for tar members and folder files: a path's key and field."""

from __future__ import annotations

import logging
import re

from .._errors import SourceError
from ._confined import escapes_root
from ._sources import RECREATE_SHARD

logger = logging.getLogger(__name__)

_WDS_META = re.compile(r"__[^/]*__($|/)")  # webdataset skips such members
# webdataset.tariterators.base_plus_ext's pattern, verbatim: importing webdataset imports torch,
# two seconds and hundreds of MB in every scan worker for one regular expression.
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def split_name(url: str, name: str) -> tuple[str, str] | None:
    """(key, field) of a member or file path by the WebDataset convention; None to skip it.

    The key is the path up to the first dot of its basename, the field the rest, lower-cased. Hidden
    names and WebDataset's ``__*__`` members are skipped; a name without an extension is skipped with a
    warning. Raises SourceError for a name escaping its root or not valid UTF-8.
    """
    if escapes_root(name):
        raise SourceError(f"{url}: member {name!r} escapes its root (absolute or '..'); {RECREATE_SHARD}", url=url)
    if not name.isascii():
        try:
            name.encode("utf-8")  # tarfile and os decode undecodable bytes to lone surrogates
        except UnicodeEncodeError:
            raise SourceError(
                f"{url}: member {name!r} is not valid UTF-8 (keys and field names must be); "
                f"rename it, or {RECREATE_SHARD}",
                url=url,
            ) from None
    if name.rsplit("/", 1)[-1].startswith(".") or _WDS_META.match(name):
        return None
    match = _BASE_PLUS_EXT.match(name)
    key, ext = (match.group(1), match.group(2)) if match else (None, None)
    if key is None or not ext:
        logger.warning("%s: skipping %r: no extension, so no field name", url, name)
        return None
    return key, ext.lower()
