"""The NVMe tier's directory: the user's own, not swappable by another user, and its checksum secret.

A tier refused here is a `CacheError` naming the path and what to do (the chain then runs
without it). Checksums are keyed with a per-cache secret (32 random bytes in ``secret``, 0600)
published whole with a link, so a writer without the secret cannot make an entry that passes.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import secrets
import stat
from pathlib import Path

import xxhash

from ._errors import CacheError

SECRET_BYTES = 32
FILES = ("data.mdb", "lock.mdb", "sketch.bin", "secret")  # what the tier keeps in its directory
DRAFT_PREFIX = ".secret-"  # a secret being written, where the file system has no O_TMPFILE


def checksum(secret: bytes, key: bytes, value: bytes | memoryview) -> bytes:
    """The entry's 8-byte checksum: xxh3-64 of ``value``, seeded by the BLAKE2b of ``key`` keyed with ``secret``.

    Fast on large values (a BLAKE2b of every value costs ~1 ms per MiB), and not computable
    without the secret.
    """
    seed = hashlib.blake2b(key, key=secret, digest_size=8).digest()
    return xxhash.xxh3_64_digest(value, seed=int.from_bytes(seed, "little"))


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _refuse_foreign(path: Path, info: os.stat_result, closed: int) -> None:
    """CacheError unless ``info`` (of ``path``) belongs to this user with none of the ``closed`` permission bits."""
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.getuid() or mode & closed:
        raise CacheError(
            f"{path} belongs to {_owner(info.st_uid)} with mode {mode:o}: another user could read or "
            "rewrite the cached samples; remove it, or point cache.nvme.path at a directory of your own "
            "(created 0700 when absent)"
        )


def _refuse_swappable(root: Path) -> None:
    """CacheError if another user could rename ``root`` (or a folder above it) away and put their own in its place.

    LMDB opens the checked directory again by name, so the path itself must be stable: each folder
    above it belongs to this user or root and is closed to writers, or is sticky (as /tmp is) with
    the next component this user's or root's (the rule of OpenSSH's StrictModes).
    """
    child = root
    for parent in root.parents:
        info = os.lstat(parent)
        mode = stat.S_IMODE(info.st_mode)
        owner = os.lstat(child).st_uid
        open_to_writers = info.st_uid not in (0, os.getuid()) or (mode & 0o022 and not mode & stat.S_ISVTX)
        if open_to_writers or (mode & 0o022 and owner not in (0, os.getuid())):
            raise CacheError(
                f"{parent} (of {_owner(info.st_uid)}, mode {mode:o}) lets another user replace {child} "
                f"and so the cache in {root}; point cache.nvme.path at a directory under folders "
                "only you (or root) can write, or under a sticky one like /tmp"
            )
        child = parent


def owned_directory(path: Path) -> Path:
    """``path`` with links resolved: a directory of this user that only it can write, created 0700 when absent.

    The files the tier keeps there must be regular files of this user that only it can write.
    Raises CacheError (another user's, or open to others), OSError (cannot be created).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    root = Path(os.path.realpath(path))
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"{path} is not a directory; point cache.nvme.path at a directory of your own")
    _refuse_foreign(root, info, 0o022)
    _refuse_swappable(root)
    for name in FILES:
        try:
            info = os.lstat(root / name)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode):
            raise CacheError(f"{root / name} is not a regular file (a link, say); remove it")
        _refuse_foreign(root / name, info, 0o022)
    return root


def cache_secret(root: Path) -> tuple[bytes, bool]:
    """The tier's secret, made now (``root/secret``, 0600, published whole with a link) if absent; (secret, made)."""
    path = root / "secret"
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            made = _make_secret(path)
            if made is not None:
                return made, True
            continue  # another process published one first: use it
        try:
            _refuse_foreign(path, os.fstat(fd), 0o077)
            secret = os.read(fd, SECRET_BYTES + 1)
        finally:
            os.close(fd)
        if len(secret) != SECRET_BYTES:
            raise CacheError(
                f"{path} is not a cache secret of {SECRET_BYTES} bytes; remove it (the cached entries "
                "are then read again from the source)"
            )
        return secret, False


def _make_secret(path: Path) -> bytes | None:
    """Write a new secret and link it at ``path`` whole; None if another process linked one first.

    An unnamed file (``O_TMPFILE``) when the file system has them, so a crash leaves nothing
    behind; else a draft file beside it, removed after the link.
    """
    secret = secrets.token_bytes(SECRET_BYTES)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    draft: str | None = None
    try:
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=folder)
        except (OSError, AttributeError):  # no O_TMPFILE on this system or file system
            draft = f"{DRAFT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            fd = os.open(
                draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder
            )
        try:
            os.write(fd, secret)
            os.fsync(fd)
            # atomic: readers find no secret, or a whole one (a dir_fd makes this linkat, following /proc's link)
            os.link(f"/proc/self/fd/{fd}" if draft is None else draft, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except FileExistsError:
            return None
        finally:
            os.close(fd)
            if draft is not None:
                os.unlink(draft, dir_fd=folder)
    finally:
        os.close(folder)
    return secret
