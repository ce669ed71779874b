"""numpy's huge pages in a process that decodes: off unless the config or the user's environment asks for them.

numpy (1.22+) asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every array of 4 MiB or
more. A feed allocates such arrays all the time and keeps each for a step or two (a clip's decoded frames, a
micro-batch of pictures padded together), and where the kernel honours the advice each first touch of a fresh
2 MiB page zeroes it whole: on these machines collating a micro-batch into fresh memory took 60–75 ms of system CPU
with the advice, under 4 ms without, and the training scenario's in-process ranks spent 10–17 % less CPU a sample
(benchmarks/RESULTS.md, "numpy's huge pages"). The setting is numpy's, for the whole process: `FeedConfig`'s
``numpy_hugepages`` turns it back on, and ``NUMPY_MADVISE_HUGEPAGE`` in the environment (numpy's own override)
always wins.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

_NUMPY_ENV = "NUMPY_MADVISE_HUGEPAGE"


def _multiarray() -> Any:
    try:
        return importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy < 2 kept it here
        return importlib.import_module("numpy.core.multiarray")


def follow_numpy_hugepages(enabled: bool) -> None:
    """Set numpy's huge-page advice for this process to ``enabled``, unless the environment chose it already."""
    if _NUMPY_ENV not in os.environ:
        _multiarray()._set_madvise_hugepage(enabled)


def numpy_hugepages() -> bool:
    """Whether numpy advises huge pages for large arrays in this process now."""
    return bool(_multiarray()._get_madvise_hugepage())
