# cpdpkit: make setup | make run | make test | make bench
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: setup run test bench clean

setup: $(STAMP)

# Idempotent: re-installs only when the project metadata or the pins change.
# constraints.txt pins torch to the CPU build on the machines' disk; never an open range.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[tools,dev]'
	touch $(STAMP)

# Holistic Trace Analysis (the profiler benchmark's peer) only for `make bench`.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	touch $(BENCH_STAMP)

run: setup
	mkdir -p runs
	$(VENV)/bin/cpdpkit bench --json runs/bench.json --plot runs/bench.png

test: setup
	$(PY) -m pytest -q

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
