# The two set-up commands of the README: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# 8 simulated CPU devices, set before jax is imported.
CPU_DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu

.PHONY: train test bench-codec clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[flax,train,test,ref]'
	touch $(STAMP)

train: $(STAMP)
	$(CPU_DEVICES) $(PY) -m taco_jax.train

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

bench-codec: $(STAMP)
	$(PY) -m benchmarks.codec_error --out benchmarks/results/codec_error.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
