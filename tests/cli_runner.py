"""Run `omnifeed COMMAND ...` as its own process without paying Python's start-up and imports for each one.

Every `omnifeed` process imports numpy, pyarrow, PyAV, Pillow and pydantic (a few tenths of a
second of CPU before the command does anything; torch too before issue 16); a test file that
runs dozens of commands would spend much of its time there.
A ``CliRunner`` starts interpreters that import the command line once and then fork one child
per command: each command still runs in a process of its own, with its own stdin, stdout and
stderr, its arguments in ``sys.argv``, ``sys.exit(main())`` as the console script does, and the
interpreter's normal shutdown (atexit handlers, non-daemon threads) before its exit status is
known. Successive commands alternate between two interpreters with different hash seeds, as a
command and the next one (a plan saved, then resumed) run in different processes with
different seeds in real use.

What a forked child does not cover is the console script file itself (two lines); tests that
run `omnifeed` as a real subprocess cover it.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OMNIFEED = str(Path(sys.executable).with_name("omnifeed"))  # the console script

# The forking interpreter: reads one request per line on the descriptor argv[1], answers on argv[2] (the child's
# pid, then its exit status as subprocess gives it).
_ZYGOTE = r"""
import gc, json, os, sys, threading
if os.environ.pop("OMNIFEED_TEST_POP_HASHSEED", None):
    del os.environ["PYTHONHASHSEED"]  # this interpreter's seed is set; the commands' own children draw theirs
from omnifeed.tools import _cli  # the expensive part, once
assert threading.active_count() == 1, f"threads before fork: {threading.enumerate()}"
requests, replies = os.fdopen(int(sys.argv[1]), "r", encoding="utf-8"), int(sys.argv[2])
os.write(replies, b"ready\n")
for line in requests:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    gc.freeze()  # the child's collections then skip what it inherited (no copy-on-write of every page at exit)
    pid = os.fork()
    if pid == 0:
        requests.close(); os.close(replies)
        for fd, (path, flags) in enumerate([(request["stdin"] or os.devnull, os.O_RDONLY),
                                            (request["stdout"], os.O_WRONLY), (request["stderr"], os.O_WRONLY)]):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = [request["script"], *request["argv"]]
        del request, line, requests, replies, pid
        break  # leave the loop: the command runs at the top level, as the console script does
    os.write(replies, f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    os.write(replies, f"{os.waitstatus_to_exitcode(status)}\n".encode())
else:
    raise SystemExit(0)
sys.exit(_cli.main())
"""


class _Zygote:
    def __init__(self, hash_seed: int) -> None:
        requests_read, self._requests = os.pipe()
        self._replies, replies_write = os.pipe()
        environment = dict(os.environ)
        if "PYTHONHASHSEED" not in environment:  # (one the user set is kept)
            environment.update(PYTHONHASHSEED=str(hash_seed), OMNIFEED_TEST_POP_HASHSEED="1")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, str(requests_read), str(replies_write)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=environment,
            pass_fds=(requests_read, replies_write),
        )
        os.close(requests_read)
        os.close(replies_write)
        self._buffer = b""
        if self._line(120.0) != "ready":
            raise RuntimeError("the command line interpreter did not start")

    def _line(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                return None
            chunk = os.read(self._replies, 4096)
            if not chunk:
                raise RuntimeError(f"the command line interpreter exited ({self.process.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def run(self, argv: list[str], stdin: str | None, stdout: str, stderr: str, timeout: float) -> int:
        request = {"script": OMNIFEED, "argv": argv, "stdin": stdin, "stdout": stdout, "stderr": stderr}
        os.write(self._requests, (json.dumps(request) + "\n").encode())
        pid = int(self._line(30.0) or "0")
        if not pid:
            raise RuntimeError("the command line interpreter did not fork")
        status = self._line(timeout)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            self._line(30.0)
            raise subprocess.TimeoutExpired(["omnifeed", *argv], timeout)
        return int(status)

    def close(self) -> None:
        os.close(self._requests)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._replies)


class CliRunner:
    """`omnifeed ARGS` in forked processes; ``run`` answers as
    ``subprocess.run(..., capture_output=True, text=True)``."""

    def __init__(self) -> None:
        first = random.randrange(1, 2**31)
        self._zygotes = [_Zygote(first), _Zygote(first + 1)]
        self._turn = 0
        self._folder = Path(tempfile.mkdtemp(prefix="of-cli-"))

    def run(self, *args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        zygote = self._zygotes[self._turn]
        self._turn = 1 - self._turn
        out, err, inp = (self._folder / name for name in ("stdout", "stderr", "stdin"))
        out.write_bytes(b"")
        err.write_bytes(b"")
        if stdin is not None:
            inp.write_text(stdin, encoding="utf-8")
        code = zygote.run(list(args), str(inp) if stdin is not None else None, str(out), str(err), timeout)
        return subprocess.CompletedProcess(
            ["omnifeed", *args], code, out.read_text(encoding="utf-8"), err.read_text(encoding="utf-8")
        )

    def close(self) -> None:
        for zygote in self._zygotes:
            zygote.close()
        for path in self._folder.iterdir():
            path.unlink()
        self._folder.rmdir()
