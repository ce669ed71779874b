"""Every Python snippet of README.md runs as written: copied in order into one script, run as a user would run it.

The snippets are executed as a real script file (``python readme.py`` in a fresh process, the working
directory holding the data they name), against a real `omnifeed serve` for the client snippet. Only
what a user has to bring is given: a dataset, a checkpoint dict, an optimizer, and the shards at the
path the snippet names. The cache example's NVMe path (a node's disk) and RAM segment name are the only substitutions.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnifeed.tools._demo_data import DemoDatasetSpec, write_webdataset

README = Path(__file__).resolve().parents[1] / "README.md"
_PRELUDE = """\
import torch
rank = 0                                        # what a training script has: its rank, a checkpoint, an optimizer
checkpoint = {}
dataset = [torch.full((3,), float(i)) for i in range(96)]
optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
"""
_FEED_YAML = {"plan": {"seed": 0, "batch_size": 8}}


def readme_snippets() -> list[str]:
    """The README's fenced Python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_the_readme_has_snippets() -> None:
    assert len(readme_snippets()) >= 5


@pytest.mark.timeout(600)
def test_every_readme_snippet_runs_as_written(tmp_path: Path) -> None:
    work, private = tmp_path / "project", tmp_path / "tmp"
    work.mkdir()
    private.mkdir(mode=0o700)
    write_webdataset(work / "data", DemoDatasetSpec(num_samples=48, num_shards=6))
    (work / "feed.yaml").write_text(yaml.safe_dump(_FEED_YAML), encoding="utf-8")
    ram = f"readme-{os.getpid()}"  # the cache example's RAM tier, under a name no one else uses
    script = _PRELUDE + "\n".join(readme_snippets()).replace("/nvme/omnifeed", str(tmp_path / "nvme")).replace(
        'name="job"', f'name="{ram}"'
    )
    (work / "readme.py").write_text(script, encoding="utf-8")
    env = {**os.environ, "TMPDIR": str(private), "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    service = None
    try:
        # the first snippet builds ./index, which the service needs: run it alone first, as written
        (work / "build.py").write_text(_PRELUDE + readme_snippets()[0], encoding="utf-8")
        subprocess.run([sys.executable, "build.py"], cwd=work, env=env, check=True, timeout=300)
        (work / "service.yaml").write_text(yaml.safe_dump({"index": "index", "feed": _FEED_YAML}), encoding="utf-8")
        service = subprocess.Popen(
            [sys.executable, "-m", "omnifeed.tools", "serve", "--config", "service.yaml"],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert service.stdout is not None
        assert "serving" in service.stdout.readline()
        ran = subprocess.run(
            [sys.executable, "readme.py"], cwd=work, env=env, capture_output=True, text=True, timeout=500
        )
        assert ran.returncode == 0, ran.stderr[-3000:]
    finally:
        if service is not None:
            service.send_signal(signal.SIGTERM)
            service.wait(timeout=60)
        for segment in Path("/dev/shm").glob(f"omnifeed-ram-{ram}*"):
            segment.unlink()


def test_the_readme_links_only_to_files_in_the_repository() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert local, "no links found"
    outside = [link for link in local if not (README.parent / link).resolve().is_relative_to(README.parent)]
    assert not outside, f"links outside the repository: {outside}"
    missing = [link for link in local if not (README.parent / link).exists()]
    assert not missing, missing
