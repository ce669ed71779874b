"""docs/security.md §1 against a second, real local user: what that user plants is refused, the feed goes on.

The victim is this process (root, so that the test can create the other user and act as it);
the other user is ``omnifeed-probe``, created if absent, whose actions run in a subprocess with
its uid and the system Python (stdlib only: it cannot read this checkout's virtualenv). Without
root, or without ``useradd``, every test here is skipped. Paths the other user must reach live
in a fresh sticky, world-writable directory under /tmp (as /tmp itself is), removed afterwards.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from omnifeed.cache import CacheConfig, NvmeTierConfig
from omnifeed.loader import Feed, FeedConfig, OmnifeedError, PlanConfig
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._protocol import UntrustedServiceError, encode
from omnifeed.loader.service._server import FeedService
from omnifeed.trainer_adapter import FeedClient

PROBE = "omnifeed-probe"

# A fake service, as another user would run it: a socket that answers any request with a prepared frame.
_FAKE_SERVICE = r"""
import os, socket, struct, sys
path, reply = sys.argv[1], bytes.fromhex(sys.argv[2])
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
os.chmod(path, 0o777)
server.listen(8)
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    print("connected", flush=True)
    try:
        (length,) = struct.unpack("!I", conn.recv(4, socket.MSG_WAITALL))
        conn.recv(length, socket.MSG_WAITALL)
        conn.sendall(reply)
    except (OSError, struct.error):
        pass
    conn.close()
"""

_FAKE_STATE = {"format": "omnifeed.feed-state/1", "plan": {"epoch": 0, "step": 0}, "accum_done": 0, "forged": True}
_WELCOME = encode(
    {
        "op": "welcome",
        "protocol": 1,
        "client": 1,
        "service": "fake",
        "state": _FAKE_STATE,
        "index_fingerprint": "f" * 32,
        "config_fingerprint": "f" * 32,
        "num_samples": 1,
        "batch_size": 1,
        "budget": None,
        "attempt": None,
    }
)


@dataclass
class OtherUser:
    """The second local user: its ids, and a Python it can run."""

    name: str
    uid: int
    gid: int
    python: str

    def _command(self, script: str, *args: str) -> dict:  # type: ignore[type-arg]
        return {
            "args": [self.python, "-c", script, *args],
            "user": self.uid,
            "group": self.gid,
            "extra_groups": [],
            "cwd": "/",
            "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        }

    def run(self, script: str, *args: str) -> str:
        """Run ``script`` as this user; its stdout (CalledProcessError if it fails)."""
        done = subprocess.run(**self._command(script, *args), capture_output=True, text=True, timeout=60, check=True)
        return done.stdout

    def start(self, script: str, *args: str) -> subprocess.Popen[str]:
        """Start ``script`` as this user; stdout is a pipe."""
        return subprocess.Popen(**self._command(script, *args), stdout=subprocess.PIPE, text=True)


@pytest.fixture(scope="session")
def other_user() -> Iterator[OtherUser]:
    """``omnifeed-probe`` (created for the session when absent, removed afterwards), or a skip."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root (to create it and switch to it)")
    if shutil.which("useradd") is None or shutil.which("getent") is None:
        pytest.skip("useradd/getent are not available to create a second local user")
    created = False
    if subprocess.run(["getent", "passwd", PROBE], capture_output=True).returncode != 0:
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PROBE],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.skip(f"cannot create the local user {PROBE}: {made.stderr.strip()}")
        created = True
    entry = pwd.getpwnam(PROBE)
    for python in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        user = OtherUser(PROBE, entry.pw_uid, entry.pw_gid, python)
        try:
            if user.run("import os; print(os.getuid())").strip() == str(entry.pw_uid):
                break
        except (OSError, subprocess.SubprocessError):
            continue
    else:
        pytest.skip(f"no Python that {PROBE} can run")
    yield user
    if created:
        subprocess.run(["userdel", PROBE], capture_output=True)


@pytest.fixture()
def shared_dir(other_user: OtherUser) -> Iterator[Path]:
    """A fresh directory both users can write to, sticky like /tmp (short: socket paths stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="of-x-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_fake_service(user: OtherUser, address: Path) -> subprocess.Popen[str]:
    fake = user.start(_FAKE_SERVICE, str(address), _WELCOME.hex())
    assert fake.stdout is not None and fake.stdout.readline().strip() == "listening"
    return fake


def connections(fake: subprocess.Popen[str]) -> list[str]:
    """What the fake service printed after it started listening (it is stopped first)."""
    fake.kill()
    out, _ = fake.communicate(timeout=30)
    return out.split()


# -- the client verifies its service ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_fake_service_in_a_directory_another_user_made_is_refused_before_connecting(
    other_user: OtherUser, shared_dir: Path
) -> None:
    address = shared_dir / "omnifeed-0" / "feed.sock"  # the victim's socket path, claimed first by the other user
    other_user.run(f"import os; os.mkdir({str(address.parent)!r}); os.chmod({str(address.parent)!r}, 0o755)")
    fake = start_fake_service(other_user, address)
    try:
        with pytest.raises(UntrustedServiceError) as refused:
            FeedClient(str(address), reconnect_timeout_s=300).state_dict()
    finally:
        printed = connections(fake)
    message = str(refused.value)
    assert "\n" not in message and str(address.parent) in message
    assert f"uid {other_user.uid} ({PROBE})" in message
    assert "chmod" not in message and "a directory only you can write" in message
    assert "connected" not in printed  # refused before it connected: the fake never saw the client


@pytest.mark.timeout(120)
def test_a_listener_of_another_user_is_refused_by_its_peer_credentials_unless_trusted(
    other_user: OtherUser, shared_dir: Path
) -> None:
    folder = Path(tempfile.mkdtemp(prefix="of-v-", dir="/tmp"))  # the victim's, 0700
    try:
        folder.chmod(0o777)  # open for a moment: the other user binds a listener in it ...
        fake = start_fake_service(other_user, folder / "feed.sock")
        folder.chmod(0o700)  # ... and the directory then passes every check: only SO_PEERCRED can tell
        try:
            with pytest.raises(UntrustedServiceError, match=rf"runs as uid {other_user.uid} \({PROBE}\)") as refused:
                FeedClient(str(folder / "feed.sock"), reconnect_timeout_s=300).state_dict()
            assert "\n" not in str(refused.value) and str(folder / "feed.sock") in str(refused.value)
            trusting = FeedClient(str(folder / "feed.sock"), trusted_uid=other_user.uid, reconnect_timeout_s=300)
            assert trusting.state_dict()["forged"]  # an explicitly trusted uid is served (here: by the fake)
            trusting.close()
        finally:
            printed = connections(fake)
        assert printed.count("connected") == 2
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(180)
def test_a_symlinked_socket_directory_is_refused_by_the_service_and_the_client(
    other_user: OtherUser, shared_dir: Path, index_dir: Path
) -> None:
    private = Path(tempfile.mkdtemp(prefix="of-v-", dir="/tmp"))  # the victim's own 0700 directory
    link = shared_dir / "omnifeed-0"
    other_user.run(f"import os; os.symlink({str(private)!r}, {str(link)!r})")  # planted where the victim looks
    config = ServiceConfig(
        index=str(index_dir), feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=4)), socket=str(private / "feed.sock")
    )
    try:
        refused_service = FeedService(config.model_copy(update={"socket": str(link / "feed.sock")}))
        try:
            with pytest.raises(OmnifeedError, match="is a symbolic link") as refused:
                refused_service.start()
            assert "\n" not in str(refused.value) and "chmod" not in str(refused.value)
        finally:  # never started: nothing to stop (stop() would remove what is at the socket path)
            refused_service._stopping.set()
            refused_service.pools.close()
            refused_service.reader.close()
        with FeedService(config):  # the victim's real service, in its real directory
            with pytest.raises(UntrustedServiceError, match="is a symbolic link"):
                FeedClient(str(link / "feed.sock"), reconnect_timeout_s=300).state_dict()
            with FeedClient(str(private / "feed.sock")) as client:  # the real path is served
                assert client.next_batch()["__key__"]
    finally:
        shutil.rmtree(private, ignore_errors=True)


# -- caches and logs: owned or refused -------------------------------------------------------------------


_PLANT_NVME = r"""
import os, sys
folder, mode = sys.argv[1], int(sys.argv[2], 8)
os.makedirs(folder, exist_ok=True)
if mode:
    os.chmod(folder, mode)
for name in ("data.mdb", "lock.mdb"):
    with open(os.path.join(folder, name), "wb"):
        pass
    os.chmod(os.path.join(folder, name), 0o666)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("whose", ["the other user's directory", "the victim's directory left open"])
def test_a_planted_nvme_directory_is_refused_with_a_warning_and_the_feed_still_delivers(
    other_user: OtherUser, shared_dir: Path, index_dir: Path, caplog: pytest.LogCaptureFixture, whose: str
) -> None:
    folder = shared_dir / "nvme"
    if whose == "the other user's directory":
        other_user.run(_PLANT_NVME, str(folder), "777")
        owner = f"uid {other_user.uid} ({PROBE})"
    else:
        folder.mkdir(mode=0o700)
        folder.chmod(0o777)  # the victim's, but open: the other user plants the LMDB files in it
        other_user.run(_PLANT_NVME, str(folder), "0")
        owner = "uid 0"
    config = FeedConfig(
        plan=PlanConfig(seed=3, batch_size=4),
        cache=CacheConfig(nvme=NvmeTierConfig(path=str(folder), capacity_bytes=2**24)),
    )
    with caplog.at_level(logging.WARNING), Feed(index_dir, config) as feed:
        assert feed.next_batch()["__key__"]
    warning = next(r.getMessage() for r in caplog.records if "running without the NVMe tier" in r.getMessage())
    assert str(folder) in warning and owner in warning and "directory of your own" in warning
    assert (folder / "data.mdb").stat().st_size == 0  # nothing of the victim's went into it
    assert not (folder / "secret").exists()


_PLANT_AUDIT = r"""
import os, sys
path, target = sys.argv[1], sys.argv[2]
if target:
    os.symlink(target, path)
else:
    with open(path, "w"):
        pass
    os.chmod(path, 0o666)
"""


@pytest.mark.parametrize("planted", ["symlink", "writable file"])
def test_a_planted_audit_log_is_refused_at_service_start(
    other_user: OtherUser, shared_dir: Path, index_dir: Path, planted: str
) -> None:
    victim_file = Path(tempfile.mkdtemp(prefix="of-v-", dir="/tmp")) / "precious.txt"
    victim_file.write_text("the victim's\n")
    audit = shared_dir / "audit.jsonl"
    other_user.run(_PLANT_AUDIT, str(audit), str(victim_file) if planted == "symlink" else "")
    try:
        with pytest.raises(OmnifeedError) as refused:
            FeedService(ServiceConfig(index=str(index_dir), audit_log=str(audit)))
        message = str(refused.value)
        assert "\n" not in message and str(audit) in message
        assert ("symbolic link" in message) if planted == "symlink" else (f"uid {other_user.uid}" in message)
        assert victim_file.read_text() == "the victim's\n"
    finally:
        shutil.rmtree(victim_file.parent, ignore_errors=True)


def test_a_new_audit_log_is_private_and_an_own_one_open_to_others_is_refused(tmp_path: Path, index_dir: Path) -> None:
    from omnifeed.loader.plan._audit import open_audit_log

    with open_audit_log(tmp_path / "audit.jsonl") as log:
        log.write("{}\n")
    assert stat.S_IMODE((tmp_path / "audit.jsonl").stat().st_mode) == 0o600
    (tmp_path / "audit.jsonl").chmod(0o622)
    with pytest.raises(OmnifeedError, match="mode 622"):
        Feed(index_dir, audit_log=tmp_path / "audit.jsonl")


def test_a_hard_link_planted_at_the_audit_log_is_refused(tmp_path: Path, index_dir: Path) -> None:
    # Where fs.protected_hardlinks is 0, another user can link any file of the victim's (same file system) at the
    # audit_log path: it passes O_NOFOLLOW and every owner/mode check, and records were appended to it (found by a
    # re-probe). This node may protect hard links, so the test plants the link itself.
    precious = tmp_path / "precious.txt"
    precious.write_text("the victim's\n")
    precious.chmod(0o644)
    audit = tmp_path / "audit.jsonl"
    os.link(precious, audit)
    with pytest.raises(OmnifeedError, match="2 hard links") as refused:
        FeedService(ServiceConfig(index=str(index_dir), audit_log=str(audit)))
    assert "\n" not in str(refused.value) and str(audit) in str(refused.value)
    with pytest.raises(OmnifeedError, match="2 hard links"):
        Feed(index_dir, audit_log=audit)
    assert precious.read_text() == "the victim's\n"


def test_a_hard_link_planted_at_the_ram_tier_segment_is_refused_and_the_file_kept(
    index_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from omnifeed.cache import RamTier, RamTierConfig

    name = f"probe-link-{os.getpid()}"
    segment = RamTier.SEGMENT_PREFIX + name
    precious = Path(
        tempfile.mkstemp(
            prefix="of-v-", dir=str(Path("/dev/shm") if Path("/dev/shm").is_dir() else tempfile.gettempdir())
        )[1]
    )
    planted = precious.with_name(segment)
    try:
        precious.write_bytes(b"the victim's\n" * 1000)
        os.link(precious, planted)  # what the tier would have initialised over
        config = FeedConfig(
            plan=PlanConfig(seed=3, batch_size=4), cache=CacheConfig(ram=RamTierConfig(name=name, capacity_bytes=2**20))
        )
        with caplog.at_level(logging.WARNING), Feed(index_dir, config) as feed:
            assert feed.next_batch()["__key__"]
        assert any("hard links" in r.getMessage() and segment in r.getMessage() for r in caplog.records)
        assert precious.read_bytes() == b"the victim's\n" * 1000
    finally:
        for path in (precious, planted, planted.with_name(segment + ".lock")):
            path.unlink(missing_ok=True)


def test_index_out_in_a_folder_another_user_made_is_refused_before_scanning(
    other_user: OtherUser, shared_dir: Path, demo_shards: list[Path]
) -> None:
    from omnifeed.loader import IndexConfig, build_index

    out = shared_dir / "index"
    other_user.run(f"import os; os.mkdir({str(out)!r}); os.chmod({str(out)!r}, 0o777)")
    with pytest.raises(OmnifeedError, match=rf"a folder of uid {other_user.uid} \({PROBE}\)") as refused:
        build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1), progress=False)
    assert "\n" not in str(refused.value) and "choose another --out" in str(refused.value)
    assert sorted(p.name for p in shared_dir.iterdir()) == ["index"]  # nothing left beside it (no .old-, .building-)
