# cpdpkit: make setup | make run | make test | make bench | make lint | make docs | make fixtures
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: setup run test lint bench docs fixtures clean

setup: $(STAMP)

# Idempotent: re-installs only when the project metadata or the pins change.
# constraints.txt pins torch to the CPU build on the machines' disk; never an open range.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[tools,dev,mnist1d,data]'
	touch $(STAMP)

# Holistic Trace Analysis (the profiler benchmark's peer) only for `make bench`.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	touch $(BENCH_STAMP)

run: setup
	mkdir -p runs
	$(VENV)/bin/cpdpkit bench --json runs/bench.json --plot runs/bench.png

# ruff, then the import layering (tools/check_layers.py), then the tests; `make test TEST_WORKERS=3` runs
# them on 3 pytest-xdist workers (the tests that share spawned ranks on one worker: their xdist_group,
# tests/conftest.py). 0 (no workers) by default: under heavy load a test past its pytest-timeout crashed
# its worker, and xdist's loadgroup scheduler then aborted the whole session (docs/results.md).
TEST_WORKERS ?= 0
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

lint: setup
	$(VENV)/bin/ruff check .
	$(PY) tools/check_layers.py
	$(PY) tools/docs_cli.py --check

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py

# docs/cli.md from the commands' --help (docs/results.md tables: python tools/docs_tables.py runs/*.json)
docs: setup
	$(PY) tools/docs_cli.py

# tests/data/hta/ from ../shared/traces (committed; the tests never read ../shared)
fixtures: setup
	$(PY) tools/build_fixtures.py

clean:
	rm -rf $(VENV) build *.egg-info
