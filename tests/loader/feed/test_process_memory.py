"""numpy's huge-page advice in a process whose feed decodes: off by default, on when asked, the environment first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
from omnifeed.loader.feed._process_memory import numpy_hugepages
from omnifeed.loader.feed import DecodePools, FeedConfig
before = numpy_hugepages()
pools = DecodePools(FeedConfig.model_validate(json.loads(sys.argv[1])))
during = numpy_hugepages()
pools.close()
print(json.dumps([before, during]))
"""


def _advice(config: str, env: dict[str, str]) -> list[bool]:
    """numpy's advice in a fresh interpreter before and after a feed's pools start there."""
    environ = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"} | env
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, config], env=environ, capture_output=True, text=True, timeout=120, check=True
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    ("config", "env", "expected"),
    [
        ("{}", {}, [True, False]),  # numpy's default on, the feed turns it off
        ('{"numpy_hugepages": true}', {}, [True, True]),
        ("{}", {"NUMPY_MADVISE_HUGEPAGE": "1"}, [True, True]),  # the user's environment wins
        ('{"numpy_hugepages": true}', {"NUMPY_MADVISE_HUGEPAGE": "0"}, [False, False]),
    ],
)
def test_a_feed_turns_numpys_huge_pages_off_unless_asked_or_the_environment_chose(
    config: str, env: dict[str, str], expected: list[bool]
) -> None:
    assert _advice(config, env) == expected
