# cpdpkit: make setup | make run | make test | make bench
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

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

run: setup
	$(VENV)/bin/cpdpkit demo --nproc 2 --strategy cpdp --period 4

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
