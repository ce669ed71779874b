"""The service's listening socket and the rules for its path (docs/security.md §1).

- **The directory** is this user's real directory, closed to others: created 0700 (atomically),
  or checked with ``lstat`` (a link is refused wherever it points; an existing directory is
  never chmod-ed) — `private_directory`.
- **A stale socket** (a crashed service's) is removed at start; a live one makes this service
  refuse to start; anything else at the path is refused — `reap_stale_socket`.
- **The socket** is created 0600 (under a umask), and at stop only the socket file this
  service bound is removed, never one another service put there since — `remove_own_socket`.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from pathlib import Path

from .._errors import OmnifeedError, describe_uid

log = logging.getLogger("omnifeed.service")


MAX_SOCKET_PATH = 107  # bytes: sockaddr_un's sun_path holds 108, with its terminating NUL


class Listener:
    """A Unix socket listening at ``path``: its directory checked, a stale socket reaped, bound 0600."""

    def __init__(self, path: Path, backlog: int = 64) -> None:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise OmnifeedError(
                f"socket path {path} is {len(os.fsencode(path))} bytes, more than the "
                f"{MAX_SOCKET_PATH} a Unix socket path may have; choose a shorter one (omnifeed serve "
                "--socket, or `socket:` in the config), e.g. $HOME/.omnifeed/feed.sock"
            )
        private_directory(path.parent)
        reap_stale_socket(path)
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self._sock.bind(str(path))
        finally:
            os.umask(old_umask)
        self._sock.listen(backlog)
        bound = os.lstat(path)
        # remove() unlinks this socket file, never what replaced it: a freed inode number is soon reused, so the
        # change time (set when the socket was bound) must match too
        self._bound = (bound.st_dev, bound.st_ino, bound.st_ctime_ns)

    def accept(self) -> socket.socket:
        """The next connection (blocks); OSError once closed."""
        return self._sock.accept()[0]

    def close(self) -> None:
        """Stop listening and wake a thread blocked in `accept` (idempotent); the socket file stays until `remove`."""
        try:  # close() alone does not wake the thread blocked in accept()
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def remove(self) -> None:
        """Unlink the socket file this listener bound, if it is still the one at the path."""
        remove_own_socket(self.path, self._bound)


def private_directory(path: Path) -> None:
    """Create ``path`` with mode 0700 (atomically), or check that it is this user's real directory, closed to others.

    ``lstat``, never ``stat``: a link at ``path`` is refused wherever it points (another user
    could re-point it after the check). A directory that already exists is never chmod-ed.
    Raises OmnifeedError naming the directory, its owner or mode, and what to do.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    mode = stat.S_IMODE(info.st_mode)
    choose = (
        "choose a socket path in a directory only you can write (omnifeed serve --socket, or `socket:` in the "
        "config), e.g. $HOME/.omnifeed/feed.sock, which is created 0700"
    )
    if stat.S_ISLNK(info.st_mode):
        raise OmnifeedError(
            f"socket directory {path} is a symbolic link (to {os.readlink(path)}, owned by "
            f"{describe_uid(info.st_uid)}); {choose}"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise OmnifeedError(f"socket directory {path} is not a directory; {choose}")
    if info.st_uid != os.getuid():
        raise OmnifeedError(
            f"socket directory {path} belongs to {describe_uid(info.st_uid)}, not to this user "
            f"({describe_uid(os.getuid())}): that user could replace the socket; {choose}"
        )
    if mode & 0o077:
        raise OmnifeedError(f"socket directory {path} is open to other users (mode {mode:o}); {choose}")


def reap_stale_socket(path: Path) -> None:
    """Remove a socket left by a crashed service; refuse to start beside a live one (never follows a link)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OmnifeedError(f"{path} exists and is not a socket; remove it or choose another socket path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        log.warning("removing the socket of a service that is gone: %s", path)
        path.unlink()
        return
    finally:
        probe.close()
    raise OmnifeedError(f"an omnifeed service is already listening at {path}; stop it or choose another socket")


def remove_own_socket(path: Path, bound: tuple[int, int, int]) -> None:
    """Unlink the socket at ``path`` if it is the file ``bound`` (device, inode, change time) and still a socket; a
    file put there since is left alone."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(found.st_mode) and (found.st_dev, found.st_ino, found.st_ctime_ns) == bound:
        path.unlink()
