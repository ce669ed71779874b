"""Path-only media cells: a Parquet/Arrow media cell holding a file's path and no bytes, read beneath a root.

``datasets``' ``to_parquet`` of a dataset built from local files writes each image or audio cell as
``{bytes: null, path: "/home/me/pets/cat-1.png"}``: the path of a file on the machine that wrote
it. omnifeed reads such a file only beneath a folder the user names (``IndexConfig.media_root``,
``--media-root DIR``), confined as a folder source's files are (``open_beneath``: no link out of
it, no ``..``, no FIFO or device): a relative path is taken beneath the root, an absolute one
must lie beneath it. Without a root such a cell refuses its file (`path_only_error`: two lines,
the option and the embed alternative); with one, a file that is missing, outside the root or not
a regular file damages its row (``no_bytes``).

The field's location names the file: ``member`` is ``ROOT + MEDIA_SEP + RELATIVE`` (NUL is in no
column name and no path), ``offset`` 0, ``size`` the file's; `read_media_file` reads it back.
"""

from __future__ import annotations

import os

from .._errors import SourceError
from ._confined import OPENAT, escapes_root, inside_root, open_beneath, read_whole
from ._records import FieldLocation

MEDIA_SEP = "\0"
EMBED = (
    "embed the files before writing: ds.with_format('arrow').map(datasets.table.embed_table_storage, "
    "batched=True) before to_parquet (save_to_disk and push_to_hub embed them)"
)


def path_only_error(url: str, column: str, row: int, path: str) -> str:
    """The two-line refusal of a file whose media cells hold paths, with no media root given."""
    return (
        f"{url}: column {column!r} holds file paths, not the files (row {row}: {path!r}), as datasets' "
        "to_parquet writes a dataset of local files\n"
        "  give the folder they are in with --media-root DIR (IndexConfig.media_root), or " + EMBED
    )


def _relative_under(root: str, path: str) -> str | None:
    """``path``'s place beneath ``root`` (a relative path is taken beneath it); None when it is outside."""
    path = path.removeprefix("file://")
    if os.path.isabs(path):
        normal = os.path.normpath(path)
        for base in dict.fromkeys((root, os.path.realpath(root))):
            if normal != base and inside_root(base, normal):
                return normal[len(base.rstrip(os.sep)) + 1 :]
        return None
    return None if escapes_root(path) else path


def read_media_cell(root: str, path: str, url: str, where: str) -> tuple[str, bytes]:
    """(location member, bytes) of the file a path-only cell names, beneath ``root``.

    Raises SourceError (prefixed ``where``) for a path outside the root, a link leading out of it, a
    file that is not regular; OSError for a missing or unreadable file.
    """
    relative = _relative_under(root, path)
    if relative is None:
        raise SourceError(f"{where}: the path {path!r} is not beneath the media root {root}", url=url)
    if not OPENAT:
        raise SourceError(
            f"{where}: reading files beneath a media root needs openat() with O_NOFOLLOW, which this "
            "system lacks; embed the files instead",
            url=url,
        )
    descriptor = open_beneath(root, relative, where, url)
    try:
        return f"{root}{MEDIA_SEP}{relative}", read_whole(descriptor, os.fstat(descriptor).st_size)
    finally:
        os.close(descriptor)


def read_media_file(field: FieldLocation, url: str, where: str) -> bytes | None:
    """The bytes of a field whose location names a file beneath a media root; None for any other location.

    Raises SourceError when the file changed size since it was indexed, or is refused as at index time.
    """
    root, sep, relative = field.member.partition(MEDIA_SEP)
    if not sep:
        return None
    if escapes_root(relative) or not os.path.isabs(root) or not OPENAT:
        raise SourceError(f"{where}: not a file beneath a media root; re-run `omnifeed index`", url=url)
    descriptor = open_beneath(root, relative, where, url)
    try:
        size = os.fstat(descriptor).st_size
        if size != field.size:  # checked before reading: a file that grew is not read whole
            raise SourceError(
                f"{where}: changed: expected {field.size} bytes, the file has {size}; the media file "
                "changed since it was indexed: restore it or re-run `omnifeed index`",
                url=url,
            )
        return read_whole(descriptor, size)
    finally:
        os.close(descriptor)
