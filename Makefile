# The two set-up commands of the README: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The newest supported jax needs Python >= 3.12: the suite's second leg runs there.
# Found on PATH or under pyenv; set NEWEST_PYTHON= (empty) to skip that leg.
NEWEST_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) $(shell command -v python3.12 2>/dev/null))
NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_STAMP := $(NEWEST_VENV)/.installed
# The tests that reach every JAX (and Triton) internal taco_jax uses, the layers whose
# dependencies move with jax, and the edge, input and sampling tests: the newest-jax leg.
# (The trainer's loop and faults, orbax's side, run on the oldest leg.)
NEWEST_TESTS := tests/test_reliability.py tests/test_conventions.py tests/test_collectives.py \
	tests/test_row_kernels.py tests/test_flax.py tests/test_wire.py \
	tests/test_codec_edges.py tests/test_inputs.py tests/test_sampling.py
# 8 simulated CPU devices, set before jax is imported.
EIGHT_DEVICES := --xla_force_host_platform_device_count=8
CPU_DEVICES := XLA_FLAGS=$(EIGHT_DEVICES) JAX_PLATFORMS=cpu
# Both legs compile without XLA's backend optimizations: the suite's time is compiles
# (a quarter less CPU time on the oldest leg, half on the newest). The tests that need
# the production compiler's numerics (`tests/conftest.py`: `production_compiler`) then
# run on the newest leg with it.
PRODUCTION_COMPILER_TESTS := tests/test_wire.py tests/test_kernels.py
FAST_XLA_FLAGS := $(EIGHT_DEVICES) --xla_backend_optimization_level=0
FAST_COMPILES := XLA_FLAGS="$(FAST_XLA_FLAGS)" JAX_PLATFORMS=cpu
# The oldest jax's XLA also has the elemental emitters, which compile the suite's
# programs a third faster than the fusion emitters (the newest has only the latter).
OLDEST_FAST_COMPILES := XLA_FLAGS="$(FAST_XLA_FLAGS) --xla_cpu_use_fusion_emitters=false" JAX_PLATFORMS=cpu
# The suite on CPU: three workers on the two cores, stealing tests from each other, so
# that one waiting on a subprocess (the trainer's command line, a killed run) leaves no
# core idle and no file runs alone at the end.
PYTEST := -m pytest -q -n 3 --dist worksteal --durations=10

# The MaxText drop-in's leg: MaxText 0.2.5 (Python >= 3.12, jax 0.12) in its own
# environment, its tests on 8 simulated CPU devices (a few minutes; the compiles are
# kept in JAX's persistent cache, build/jax-cache, for the next run).
MAXTEXT_VENV ?= .venv-maxtext
MAXTEXT_PY := $(MAXTEXT_VENV)/bin/python
MAXTEXT_STAMP := $(MAXTEXT_VENV)/.installed

.PHONY: train test test-oldest test-newest test-slow test-maxtext lint docs bench-codec clean

# The whole suite on the oldest supported releases (.ci/oldest.txt). Every install skips
# pip's byte-compiling (--no-compile): Python compiles what it imports when it first
# does, and torch and transformers alone hold thousands of modules the suite never imports.
$(STAMP): pyproject.toml .ci/oldest.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c .ci/oldest.txt -e '.[flax,train,test,ref,docs]'
	touch $(STAMP)

# The newest releases pyproject.toml admits.
$(NEWEST_STAMP): pyproject.toml
	$(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install -q --upgrade pip
	$(NEWEST_PY) -m pip install -q --no-compile -e '.[flax,train,test]'
	touch $(NEWEST_STAMP)

# What the trainer needs (no test, reference-model or docs tools), at the versions the
# oldest leg tests; `make test` installs the rest into the same environment.
TRAIN_STAMP := $(VENV)/.installed-train
$(TRAIN_STAMP): pyproject.toml .ci/oldest.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c .ci/oldest.txt -e '.[flax,train]'
	touch $(TRAIN_STAMP)

train: $(TRAIN_STAMP)
	$(CPU_DEVICES) $(PY) -m taco_jax.train

# Lint, the docs build and both legs run side by side: each waits at times (on pip, a
# subprocess, the disk, its last tests), and together they keep both cores busy to the
# end. Their output is interleaved by whole lines.
test: $(STAMP)
	$(MAKE) --no-print-directory -j4 --output-sync=line lint docs test-oldest test-newest

# Formatting, lint rules and types (configured in pyproject.toml).
lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m mypy

# The documentation site, strict: a broken link, a missing reference or an undocumented
# public name fails it (mkdocs_hooks.py). Written to build/site.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

test-oldest: $(STAMP)
	$(PY) -c "import jax; print('jax', jax.__version__, '(oldest supported)')"
	$(OLDEST_FAST_COMPILES) $(PY) $(PYTEST) -m "not slow"

# The rest of every `cover` test's parameter product (tests/conftest.py), on the oldest leg.
test-slow: $(STAMP)
	$(CPU_DEVICES) $(PY) $(PYTEST) -m slow

ifeq ($(NEWEST_PYTHON),)
test-newest:
	@echo "test-newest skipped: no Python 3.12 found (set NEWEST_PYTHON=/path/to/python3.12)"
else
test-newest: $(NEWEST_STAMP)
	$(NEWEST_PY) -c "import jax; print('jax', jax.__version__, '(newest supported)')"
	$(FAST_COMPILES) $(NEWEST_PY) $(PYTEST) -m "not slow" $(NEWEST_TESTS)
	$(CPU_DEVICES) $(NEWEST_PY) -m pytest -q -m "production_compiler and not slow" $(PRODUCTION_COMPILER_TESTS)
endif

$(MAXTEXT_STAMP): pyproject.toml
	$(NEWEST_PYTHON) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_PY) -m pip install -q --upgrade pip
	$(MAXTEXT_PY) -m pip install -q --no-compile -e '.[flax,test,maxtext]'
	touch $(MAXTEXT_STAMP)

ifeq ($(NEWEST_PYTHON),)
test-maxtext:
	@echo "test-maxtext skipped: no Python 3.12 found (set NEWEST_PYTHON=/path/to/python3.12)"
else
test-maxtext: $(MAXTEXT_STAMP)
	$(CPU_DEVICES) $(MAXTEXT_PY) -m pytest -q --durations=10 tests/test_maxtext.py
endif

bench-codec: $(STAMP)
	$(PY) -m benchmarks.codec_error --out benchmarks/results/codec_error.json

clean:
	rm -rf $(VENV) $(NEWEST_VENV) $(MAXTEXT_VENV) .pytest_cache .hypothesis
