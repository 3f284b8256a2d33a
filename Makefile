# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs. Override the torch build with e.g.
#   make test TORCH='torch>=2.5'          (any build; the default is the CPU wheel 2.13.0)
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
# One stamp per set of extras: `make demo` installs only what the demo needs (plots), `make test` adds the
# test tools (triton, transformers, …) to the same environment.
BASE := $(VENV)/.installed-base
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test test-slow lint bench-cpu bench-gpu gpu clean

# One pip call per stamp (one resolver run), without pip's byte-compiling, which takes one core for half a
# minute: compileall then compiles the same files on every core. Left to the tests instead, each of the many
# interpreters they start compiles what it imports (3 minutes more of CPU on a fresh clone, measured). Its
# exit status is ignored: torch ships a file only Python 3.12 parses, which pip skips too.
# transformers' model folders are left out but for the two piattn imports (llama, auto): 2,600 files, 3 of the
# 19 s compileall takes on two cores; any other compiles on its first import and is then kept.
# Then the C kernels are compiled once (piattn.ops.pi.prebuild), so that no first call waits on the compiler.
define install
	@echo "installing $(TORCH) and piattn[$(1)] into $(VENV) (pip, quiet: 1-3 minutes on a fresh machine)"
	$(PY) -m pip install --quiet --no-compile "$(TORCH)" -e ".[$(1)]"
	$(PY) -m compileall -q -j 0 -x '/transformers/models/(?!llama/|auto/)[^/]+/' $(VENV)/lib > /dev/null || true
	$(PY) -m piattn.ops.pi.prebuild
endef

$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	touch $(BASE)

$(DEMO_STAMP): $(BASE)
	$(call install,plot)
	touch $(DEMO_STAMP)

$(TEST_STAMP): $(BASE)
	$(call install,test)
	touch $(TEST_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/piattn demo

# -n auto: one pytest worker per core (pytest-xdist); the suite's tests are independent of their order.
# --dist loadgroup: a file marked xdist_group runs on one worker, so its costly module fixture runs once.
# PYTHONDONTWRITEBYTECODE cleared: where the environment sets it, every interpreter the tests start (torchrun
# ranks, scripts, ~60 children) compiled piattn's sources again, and each worker rewrote every test module's asserts.
test: $(TEST_STAMP)
	@echo "running the tests (one worker per core; about 5 minutes on 2 cores; dots appear once workers start)"
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m "not slow" -n auto --dist loadgroup

test-slow: $(TEST_STAMP)
	$(PY) -m pytest -q -m "slow"

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks experiments

bench-cpu: $(DEMO_STAMP)
	$(PY) benchmarks/cpu_bench.py --out benchmarks/results/cpu_bench

bench-gpu:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu_bench.py --out benchmarks/results/gpu

# The prepared GPU session (docs/gpu.md), e.g. `make gpu OUT=/tmp/gpu_run`: its files go to OUT, which it needs
# (none by default: a run's files are read, then copied into benchmarks/results/gpu by hand). STEPS=kernels reruns one.
gpu:
	@test -n "$(OUT)" || { echo "make gpu needs OUT=DIR (the run's files go there)"; exit 2; }
	PYTHONPATH=src $(PYTHON) benchmarks/gpu_run.py --out "$(OUT)" $(if $(STEPS),--steps $(STEPS))

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
