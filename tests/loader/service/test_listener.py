"""The socket's path rules: a private directory (made 0700, or checked with lstat), a crashed predecessor's socket
reaped, a live one refused, and only the socket this service bound removed at stop. The other-user cases are in
tests/loader/test_security_local_user.py."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnifeed.loader import OmnifeedError
from omnifeed.loader.service._listener import Listener, private_directory, reap_stale_socket


@pytest.fixture
def folder() -> Iterator[Path]:
    """A fresh private folder under /tmp (socket paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="of-lis-", dir="/tmp"))
    yield path
    for child in sorted(path.rglob("*"), reverse=True):
        child.unlink() if not child.is_dir() or child.is_symlink() else child.rmdir()
    path.rmdir()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_directory_is_created_0700_and_an_existing_one_is_never_chmodded(folder: Path) -> None:
    private_directory(folder / "a" / "sockets")
    assert mode(folder / "a" / "sockets") == 0o700
    (folder / "open").mkdir(mode=0o755)
    os.chmod(folder / "open", 0o755)
    with pytest.raises(OmnifeedError, match="open to other users"):
        private_directory(folder / "open")
    assert mode(folder / "open") == 0o755


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p.symlink_to(p.parent), "is a symbolic link"),
        (lambda p: p.write_text("x"), "is not a directory"),
    ],
)
def test_a_directory_that_is_a_link_or_a_file_is_refused(  # type: ignore[no-untyped-def]
    folder: Path, make, words: str
) -> None:
    make(folder / "sockets")
    with pytest.raises(OmnifeedError, match=words) as refused:
        private_directory(folder / "sockets")
    assert "\n" not in str(refused.value)


def test_a_dead_socket_is_reaped_a_live_one_or_a_file_refused(folder: Path) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(folder / "dead.sock"))
    dead.close()  # a crashed service's socket: nobody listens
    reap_stale_socket(folder / "dead.sock")
    assert not (folder / "dead.sock").exists()
    reap_stale_socket(folder / "absent.sock")
    (folder / "file.sock").write_text("x")
    with pytest.raises(OmnifeedError, match="is not a socket"):
        reap_stale_socket(folder / "file.sock")
    with Listening(folder / "live.sock"):
        with pytest.raises(OmnifeedError, match="already listening"):
            reap_stale_socket(folder / "live.sock")


def test_the_listener_binds_0600_accepts_and_removes_only_its_own_socket(folder: Path) -> None:
    path = folder / "sockets" / "feed.sock"
    listener = Listener(path)
    assert mode(folder / "sockets") == 0o700 and mode(path) == 0o600
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(path))
        listener.accept().close()
    listener.close()
    listener.close()  # idempotent
    with pytest.raises(OSError):
        listener.accept()
    path.rename(folder / "moved.sock")  # (kept: a file made now must not reuse its inode number)
    with Listening(path):  # another service's socket, put there since: left alone
        listener.remove()
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    path.unlink()
    path.write_text("not a socket")  # nor is anything that is not a socket removed
    listener.remove()
    assert path.read_text() == "not a socket"


def test_stop_removes_the_socket_it_bound(folder: Path) -> None:
    listener = Listener(folder / "feed.sock")
    listener.close()
    listener.remove()
    assert not (folder / "feed.sock").exists()


class Listening:
    """A socket that listens at ``path`` while in the block."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)

    def __enter__(self) -> Listening:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_a_socket_path_too_long_for_unix_sockets_is_refused_in_one_line_saying_what_to_do(folder: Path) -> None:
    # A deep --out or a long user name made the raw "AF_UNIX path too long" reach users, with no hint.
    deep = folder / ("d" * 60) / ("e" * 60)
    with pytest.raises(OmnifeedError) as refused:
        Listener(deep / "feed.sock")
    message = str(refused.value)
    assert "\n" not in message and str(deep / "feed.sock") in message and "more than the 107" in message
    assert "--socket" in message and not deep.exists()  # refused before anything was created
