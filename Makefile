# Two entry points for a fresh clone: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTHON ?= python3

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: on these CPU machines 2.13.0 is a local CPU build; an
	# unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/omnifeed demo

test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest

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

clean:
	rm -rf $(VENV) demo-output benchmarks/_work
