"""Where a RAM tier segment lives and how its header is laid out: what the tier and the outside view share.

The tier (``_ram``) creates and maps segments; the outside view (``_ram_segments``, behind
`omnifeed cache list` and `remove`) reads their first bytes without mapping them. Both read
the names and the header fields from here, so neither imports the other's internals.

The header is the segment's first 4 KiB: little-endian uint64 fields at the indices below.
``_H_MAGIC`` and ``_H_VERSION`` say whose layout it is; ``_H_READY`` is 1 once the segment is
initialised; ``_H_DIRTY`` is set for the duration of every mutation.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

_MAGIC = 0x3164656566696E6F  # b"onifeed1"
_VERSION = 1
_HEADER_BYTES = 4096

# header fields (uint64 indices)
(
    _H_MAGIC,
    _H_VERSION,
    _H_CAPACITY,
    _H_SLOTS,
    _H_WIDTH,
    _H_HEAD,
    _H_TAIL,
    _H_USED,
    _H_ENTRIES,
    _H_SKETCH_OPS,
    _H_DIRTY,
    _H_RESETS,
    _H_READY,
    _H_USED_AT,
) = range(14)  # _H_USED_AT: unix seconds of the last get/put
_H_FIELDS = _H_USED_AT + 1

SEGMENT_PREFIX = "omnifeed-ram-"
_SHM = Path("/dev/shm")


def _segment_name(name: str) -> str:
    """The segment's file name for ``RamTierConfig.name``."""
    return f"{SEGMENT_PREFIX}{name}"


def _segment_path(name: str) -> Path:
    """The segment's file: POSIX shared memory lives in /dev/shm on Linux (elsewhere: the temp directory)."""
    return (_SHM if _SHM.is_dir() else Path(tempfile.gettempdir())) / name
