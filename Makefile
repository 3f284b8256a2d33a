# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs. Override the torch build with e.g.
#   make test TORCH='torch>=2.5'          (any build; the default is the CPU wheel 2.13.0)
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint bench-cpu bench-gpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/piattn demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks experiments

bench-cpu: $(STAMP)
	$(PY) benchmarks/cpu_bench.py --out benchmarks/results

bench-gpu:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu_bench.py --out benchmarks/results

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
