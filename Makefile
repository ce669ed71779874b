# Two entry points for a fresh clone: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTHON ?= python3

.PHONY: demo test test-soak bench bench-loaders clean

$(STAMP): pyproject.toml
	@echo "installing torch and omnifeed into $(VENV), ~2 min (once)"
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: on these CPU machines 2.13.0 is a local CPU build; an
	# unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/omnifeed demo

test: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -m "not soak"

# The long soaks, harness loops and benchmark smoke runs (marker `soak`): .ci/run runs them after `make test`.
test-soak: $(STAMP)
	$(PY) -m pytest -m soak

bench: $(STAMP)
	$(PY) benchmarks/bench_index.py
	$(PY) benchmarks/bench_bucketing.py
	$(PY) benchmarks/bench_feed.py
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_cache_policy.py
	$(PY) benchmarks/bench_cache.py
	$(PY) benchmarks/bench_dataloader.py
	$(PY) benchmarks/bench_handoff.py
	$(PY) benchmarks/bench_resize.py
	$(PY) benchmarks/bench_service_memory.py --malloc-stats
	$(MAKE) bench-loaders

# `omnifeed bench` beside the other loaders, in a venv of its own: MosaicML Streaming needs
# torchvision, which has no build for the CPU torch 2.13.0 above, so this one takes torch
# 2.14.1 + torchvision 0.29.1 (CUDA builds, several GB; they run on the CPU) for every loader alike.
PEERS ?= .venv-peers
PEERS_STAMP := $(PEERS)/.installed

$(PEERS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PEERS)/bin/python -m pip install --quiet mosaicml-streaming litdata nvidia-dali-cuda120
	$(PEERS)/bin/python -m pip install --quiet -e '.[bench]'
	touch $(PEERS_STAMP)

bench-loaders: $(PEERS_STAMP)
	$(PEERS)/bin/python benchmarks/bench_loaders.py

clean:
	rm -rf $(VENV) $(PEERS) demo-output benchmarks/_work
