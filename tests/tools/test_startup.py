"""The command line and the service start without torch: it is imported only where a torch tensor is made.

Module checks, not timings (the figures are in benchmarks/RESULTS.md, "Startup (issue 16)"): each
check runs in a fresh interpreter, since this one has torch loaded by other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
from feed_service import ServiceProcess, short_socket_dir, write_config

from omnifeed.trainer_adapter import FeedClient


def fresh(code: str) -> dict:
    """What ``code`` prints last (one JSON line), run in a new interpreter."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_the_loader_does_not_import_torch_until_the_drop_in_dataloader_is_asked_for() -> None:
    got = fresh(
        "import json, sys\n"
        "import omnifeed.loader as loader, omnifeed.trainer_adapter\n"
        "before = 'torch' in sys.modules\n"
        "from omnifeed.loader import DataLoader, ElasticBatchSampler\n"
        "print(json.dumps({'before': before, 'after': 'torch' in sys.modules, 'names': sorted(loader.__all__),\n"
        "                  'resolved': all(hasattr(loader, n) for n in loader.__all__),\n"
        "                  'listed': {'DataLoader', 'ElasticBatchSampler'} <= set(dir(loader))}))\n"
    )
    assert got["before"] is False, "import omnifeed.loader (or omnifeed.trainer_adapter) imported torch"
    assert got["after"] is True and got["resolved"] and got["listed"]
    assert {"DataLoader", "ElasticBatchSampler", "Feed"} <= set(got["names"])


HEAVY = (
    "numpy",
    "pyarrow",
    "pydantic",
    "torch",
    "PIL",
    "av",
    "lmdb",
    "ray",
    "fsspec",
    "yaml",
    "msgpack",
    "psutil",
    "webdataset",
    "omnifeed.loader",
    "omnifeed.cache",
    "omnifeed.bucketing",
    "omnifeed.trainer_adapter",
)


def test_help_and_version_import_nothing_heavy() -> None:
    """`omnifeed --help`, `--version` and every `COMMAND --help` parse flags only (the CLI starts fast on a busy
    node)."""
    got = fresh(
        "import contextlib, io, json, sys\n"
        "from omnifeed.tools._cli import _parser, main\n"
        "commands = [[], *[[name] for name in _parser()._subparsers._group_actions[0].choices], ['cache', 'list']]\n"
        "seen = {}\n"
        f"heavy = {HEAVY!r}\n"
        "for command in [['--version'], *[[*c, '--help'] for c in commands]]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main(command)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    seen[' '.join(command)] = sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy\n"
        "                                     or any(m.startswith(h + '.') for h in heavy))\n"
        "print(json.dumps(seen))\n"
    )
    assert {"--version", "--help", "index --help", "plan --help", "serve --help", "bench --help"} <= set(got)
    assert got == dict.fromkeys(got, []), {command: mods[:8] for command, mods in got.items() if mods}


def test_the_service_module_and_its_config_do_not_import_torch(index_dir: Path) -> None:
    got = fresh(
        "import json, sys\n"
        "from omnifeed.loader import FeedConfig, PlanConfig\n"
        "from omnifeed.loader.service._server import FeedService\n"
        "from omnifeed.loader.service._config import ServiceConfig\n"
        f"config = ServiceConfig(index={str(index_dir)!r}, feed=FeedConfig(plan=PlanConfig(batch_size=4)))\n"
        "print(json.dumps({'torch': 'torch' in sys.modules}))\n"
    )
    assert got == {"torch": False}


def torch_mapped(pid: int) -> bool:
    """Whether torch's shared library is mapped into process ``pid``."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_serving_service_and_its_decode_workers_never_load_torch(index_dir: Path, tmp_path: Path) -> None:
    socket = short_socket_dir() / "feed.sock"
    feed = {"plan": {"seed": 3, "batch_size": 4}, "pools": {"image": {"workers": 2, "processes": 1}}}
    service = ServiceProcess(write_config(tmp_path, index_dir, socket=socket, feed=feed), socket).start()
    try:
        with FeedClient(str(socket)) as client:
            batches = [client.next_batch() for _ in range(3)]
            assert any("image" in b for b in batches)  # decoded in a worker process, handed out as tensors
            processes = [psutil.Process(service.pid), *psutil.Process(service.pid).children(recursive=True)]
            assert len(processes) > 1, "the image decode worker process is missing"
            loaded = [p.pid for p in processes if torch_mapped(p.pid)]
        assert loaded == [], f"torch is loaded in the service's processes {loaded}: {service.output()}"
    finally:
        assert service.stop() == 0, service.output()
