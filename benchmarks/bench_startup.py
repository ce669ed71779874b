"""Start-up of the command line and the service: `omnifeed --help`, and `omnifeed serve` until it answers.

    python benchmarks/bench_startup.py [--runs 5] [--checkout DIR] [--out FILE]

1. ``help``: wall time of ``python -c "from omnifeed.tools._cli import main; main(['--help'])"``
   (what the ``omnifeed`` console script runs), ``--runs`` fresh processes; and the console
   script itself when measuring this checkout.
2. ``imports``: ``python -X importtime`` of ``omnifeed.tools._cli``: the cumulative import
   time of the CLI module, whether torch was imported, and the heavy packages' import times.
3. ``serve``: ``omnifeed serve --config`` of a small index (the demo dataset, 48 samples in 3
   WebDataset shards, built once in a temporary folder) in a fresh process; measured from the
   launch to the first accepted connection on its socket (``listening``) and to the first
   answered metrics request (``answering``, what ``wait_until_serving`` waits for); then a
   `FeedClient` in this process (torch already imported here) says hello and takes its first
   batch: ``first_batch`` is from its hello to that batch (the service opens the rank's stream,
   plans, reads and decodes the first micro-batch; the shards are in the page cache from the
   warm-up launch). Then the service is stopped with SIGTERM. Whether ``libtorch`` is mapped in
   the service process at that point is reported.

``--checkout DIR``: measure another checkout of omnifeed (a folder holding ``omnifeed/loader``,
``omnifeed/tools`` ... as packages, e.g. symlinks to a ``git archive`` of an older commit's
top-level folders), put first on ``PYTHONPATH``; the index is built with this checkout either
way. Prints one JSON object (seconds: median and min over the runs) and writes it to ``--out``
if given. The figures are wall times on a shared machine: compare runs made back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket as socketlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

_HELP = "from omnifeed.tools._cli import main; main(['--help'])"
_SERVE = "from omnifeed.tools._cli import main; raise SystemExit(main())"
_PACKAGES = (
    "torch",
    "omnifeed.loader",
    "omnifeed.cache",
    "numpy",
    "pyarrow",
    "av",
    "PIL.Image",
    "pydantic",
    "fsspec",
    "lmdb",
    "msgpack",
)  # cumulative import time where each is first imported (inside another's if nested)


def environment(checkout: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if checkout:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [checkout, env.get("PYTHONPATH")]))
    return env


def summary(seconds: list[float]) -> dict[str, float]:
    return {"median_s": round(statistics.median(seconds), 3), "min_s": round(min(seconds), 3), "runs": len(seconds)}


def wall(args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return time.perf_counter() - started


def imports(env: dict[str, str]) -> dict[str, Any]:
    """-X importtime of the CLI module: its cumulative time, torch's, and the slowest top-level packages."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import omnifeed.tools._cli"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    cumulative: dict[str, int] = {}
    for line in done.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \| *(\S+)", line)
        if match:
            cumulative[match[2]] = int(match[1])
    return {
        "cli_cumulative_s": round(cumulative.get("omnifeed.tools._cli", 0) / 1e6, 3),
        "torch_imported": "torch" in cumulative,
        "packages_s": {name: round(cumulative[name] / 1e6, 3) for name in _PACKAGES if name in cumulative},
    }


def build_demo_index(work: Path) -> Path:
    from omnifeed.loader import IndexConfig, build_index
    from omnifeed.tools._demo_data import DemoDatasetSpec, write_webdataset

    shards = write_webdataset(work / "shards", DemoDatasetSpec(num_samples=48, num_shards=3, seed=0))
    build_index([str(p) for p in shards], work / "index", IndexConfig(workers=1), progress=False)
    return work / "index"


def request_metrics(address: str) -> bool:
    """Whether the service at ``address`` answers a metrics request now."""
    from omnifeed.loader.service import request_metrics as request

    try:
        request(address, timeout=2.0)
        return True
    except (OSError, EOFError):
        return False


def serve_once(config: Path, address: str, env: dict[str, str]) -> dict[str, Any]:
    """One launch of `omnifeed serve`: seconds until it accepts a connection and until it answers."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE, "serve", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    listening = answering = None
    try:
        while answering is None:
            if process.poll() is not None:
                raise RuntimeError(f"omnifeed serve exited with {process.returncode}")
            if time.perf_counter() - started > 60:
                raise TimeoutError("omnifeed serve did not answer within 60 s")
            if listening is None:
                with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as probe:
                    try:
                        probe.connect(address)
                        listening = time.perf_counter() - started
                    except OSError:
                        time.sleep(0.005)
                        continue
            if request_metrics(address):
                answering = time.perf_counter() - started
            else:
                time.sleep(0.005)
        first_batch = first_batch_after_hello(address)
        torch = "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return {"listening": listening, "answering": answering, "first_batch": first_batch, "torch_loaded": torch}


def first_batch_after_hello(address: str) -> float:
    """Seconds from a new client's hello (its connection included) to its first batch."""
    import torch  # noqa: F401  (a trainer has it loaded before it asks for data)

    from omnifeed.trainer_adapter import FeedClient

    with FeedClient(address) as client:
        started = time.perf_counter()
        client.next_batch()
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per measurement (default 5)")
    parser.add_argument("--checkout", help="a folder with another omnifeed's packages, put first on PYTHONPATH")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args()
    env = environment(args.checkout)
    result: dict[str, Any] = {
        "checkout": args.checkout or "this one",
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
    }
    wall([sys.executable, "-c", _HELP], env)  # warm the page cache
    result["help"] = summary([wall([sys.executable, "-c", _HELP], env) for _ in range(args.runs)])
    if not args.checkout:
        script = str(Path(sys.executable).with_name("omnifeed"))
        result["help_console_script"] = summary([wall([script, "--help"], env) for _ in range(args.runs)])
    result["imports"] = imports(env)
    with tempfile.TemporaryDirectory(prefix="of-startup-", dir="/tmp") as tmp:
        work = Path(tmp)
        index = build_demo_index(work)
        address = str(work / "sock" / "feed.sock")
        (work / "sock").mkdir(mode=0o700)
        config = work / "service.yaml"
        config.write_text(
            yaml.safe_dump({"index": str(index), "socket": address, "feed": {"plan": {"seed": 0, "batch_size": 4}}}),
            encoding="utf-8",
        )
        serve_once(config, address, env)  # warm
        runs = [serve_once(config, address, env) for _ in range(args.runs)]
    result["serve_listening"] = summary([r["listening"] for r in runs])
    result["serve_answering"] = summary([r["answering"] for r in runs])
    result["first_batch_after_hello"] = summary([r["first_batch"] for r in runs])
    result["serve_torch_loaded"] = any(r["torch_loaded"] for r in runs)
    result["load_after"] = os.getloadavg()[0]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
