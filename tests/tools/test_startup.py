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


def test_command_help_does_not_import_torch() -> None:
    got = fresh(
        "import contextlib, io, json, sys\n"
        "from omnifeed.tools._cli import main\n"
        "seen = {}\n"
        "for command in ([], ['index'], ['plan'], ['verify'], ['precache'], ['stats'], ['serve']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main([*command, '--help'])\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    seen[' '.join(command) or '--help'] = 'torch' in sys.modules\n"
        "print(json.dumps(seen))\n"
    )
    assert got == dict.fromkeys(got, False) and "plan" in got


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
