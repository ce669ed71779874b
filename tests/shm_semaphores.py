"""POSIX semaphores of a process (``/dev/shm/sem.*``), to prove a stopped command left none of its own behind.

Other processes on the machine create and remove semaphores at the same time, so names seen before
and after prove nothing; a process's own are told by inode, from its memory maps.
"""

from __future__ import annotations

import os


def semaphore_inodes(pid: int) -> set[int]:
    """The inodes of the POSIX semaphores process ``pid`` has mapped.

    glibc maps a semaphore's file under a temporary name before linking it to its own, so the
    mapping names another file; its inode is the semaphore's.
    """
    with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
        return {int(line.split()[4]) for line in maps if "/dev/shm/sem." in line}


def shm_inodes() -> set[int]:
    """The inodes of the semaphores in /dev/shm now (anyone's)."""
    found = set()
    for entry in os.scandir("/dev/shm"):
        if entry.name.startswith("sem."):
            try:
                found.add(entry.inode())
            except OSError:  # removed meanwhile
                pass
    return found
