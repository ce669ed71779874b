"""Output folders the commands write: never delete what omnifeed did not create.

A folder a command creates gets a marker file (``.omnifeed-output``, naming the command).
Running the command again replaces a folder holding its marker without asking; an empty folder
is taken; any other non-empty folder is refused with a one-line error, and nothing in it is
touched (``omnifeed demo --out .`` in a project folder must not delete the project).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from omnifeed.cache import NvmeTier
from omnifeed.loader import OmnifeedError

MARKER = ".omnifeed-output"


class ForeignDirectoryError(OmnifeedError):
    """An output folder holds files omnifeed did not write."""


def prepare_output_dir(path: Path, command: str) -> Path:
    """Make ``path`` an empty folder owned by ``command``'s output, replacing only omnifeed's own earlier output.

    Raises ForeignDirectoryError when ``path`` exists, is not empty and holds no marker of an
    omnifeed command (or is a file, or a symbolic link).
    """
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ForeignDirectoryError(f"{path} exists and is not a folder: give --out a new or empty folder")
    if path.is_dir() and any(path.iterdir()):
        if not (path / MARKER).is_file():
            raise ForeignDirectoryError(
                f"{path} is not empty and was not written by omnifeed: give --out a new or empty folder "
                "(omnifeed deletes only its own earlier output)"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text(json.dumps({"command": command, "pid": os.getpid()}) + "\n", encoding="utf-8")
    return path


def check_cache_dir(path: Path) -> None:
    """Refuse an NVMe tier folder that holds anything but a tier's own files (ForeignDirectoryError)."""
    if not path.is_dir():
        return
    foreign = sorted(p.name for p in path.iterdir() if p.name != MARKER and not NvmeTier.is_own_file(p.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ForeignDirectoryError(
            f"{path} holds files that are not an omnifeed cache ({shown}): give --cache a "
            "new or empty folder, or one that only holds an earlier omnifeed cache"
        )
