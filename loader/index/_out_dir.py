"""The index's output folder: what may be replaced, and replacing it without deleting anyone else's files.

``build_index`` writes into a fresh folder beside ``out`` and swaps it in only when complete.
``out`` is replaced only when it is absent, or a folder of this user that is empty or holds an
omnifeed index and nothing else (its ``manifest.json`` says so); anything else is refused with
a one-line error before a shard is scanned. The old index is moved aside in one rename, so
``out`` never holds a mix of two indexes, and then only omnifeed's own files are deleted from it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

from .._errors import OmnifeedError, describe_uid
from ._damage import DAMAGED_FILE
from ._sample_index import BY_SHARD, INDEX_FORMAT, MANIFEST, SHARDS

log = logging.getLogger(__name__)

_OWN_FILE = re.compile(r"part-\d{5,}\.(parquet|arrow|arrow\.tmp)")  # partitions, and an Arrow copy being re-made
_OWN_NAMES = {MANIFEST, SHARDS, BY_SHARD, DAMAGED_FILE}


def index_files_to_replace(out: Path) -> list[str]:
    """The entries of ``out`` that replacing it deletes: none when absent or empty, an omnifeed
    index's own files when it holds one and nothing else; OmnifeedError (one line) otherwise."""
    what_to_do = f"choose another --out, or remove {out} yourself"
    if out.is_symlink():
        raise OmnifeedError(f"{out}: a symbolic link; omnifeed writes an index only to a real path: {what_to_do}")
    if not out.exists():
        return []
    if not out.is_dir():
        raise OmnifeedError(f"{out}: exists and is not a folder; {what_to_do}")
    owner = out.stat().st_uid
    if owner != os.getuid():
        raise OmnifeedError(f"{out}: a folder of {describe_uid(owner)}, not of this user "
                            f"({describe_uid(os.getuid())}); omnifeed writes an index only to a folder of yours: "
                            f"{what_to_do}")
    names = sorted(entry.name for entry in out.iterdir())
    if not names:
        return []
    foreign = [name for name in names if not (
        (name in _OWN_NAMES or _OWN_FILE.fullmatch(name)) and (out / name).is_file() and not (out / name).is_symlink())]
    if MANIFEST not in names or not _is_omnifeed_manifest(out / MANIFEST):
        raise OmnifeedError(f"{out}: not empty and not an omnifeed index (no omnifeed manifest.json); omnifeed "
                            f"replaces only an empty folder or an index it wrote: {what_to_do}")
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OmnifeedError(f"{out}: holds an omnifeed index and files omnifeed did not write ({shown}), which it "
                            f"will not delete: move them away, {what_to_do}")
    return names


def _is_omnifeed_manifest(path: Path) -> bool:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith(INDEX_FORMAT.split("/")[0] + "/")


def replace_index(out: Path, work: Path) -> None:
    """Move the finished index ``work`` to ``out``, deleting only the old index's own files."""
    old = index_files_to_replace(out)  # again: the folder may have changed while the sources were scanned
    if not out.exists():
        work.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        os.replace(out, aside)  # onto the empty folder just made: out never holds a mix of two indexes
    except OSError:
        aside.rmdir()
        raise
    work.rename(out)
    for name in old:
        (aside / name).unlink(missing_ok=True)
    try:
        aside.rmdir()
    except OSError:  # something was written into out while it was checked: left where it is now
        log.warning("%s: files appeared in the old index while it was replaced; they are kept in %s", out, aside)
