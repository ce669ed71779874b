"""Kill -9 of a parent process that started decode workers: the test's side (start it, look inside, kill it, reap)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil


def kill_parent_and_reap(
    tmp_path: Path, script: str, while_up: Callable[[psutil.Process, list[psutil.Process]], None]
) -> int:
    """Run ``script`` until it prints "ready", call ``while_up(parent, its descendants)``, kill -9 it.

    Asserts that every descendant exits within 20 s of the kill (those that do not are killed, then reported);
    returns the parent's pid.
    """
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        children = psutil.Process(parent.pid).children(recursive=True)
        while_up(psutil.Process(parent.pid), children)
    finally:
        parent.kill()
        parent.wait()
    _, alive = psutil.wait_procs(children, timeout=20)
    for process in alive:
        process.kill()
    assert alive == [], [p.cmdline()[-1][:60] for p in alive]
    return parent.pid
