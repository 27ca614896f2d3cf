# Two entry points on a fresh machine: `make run` (the main job on a small default)
# and `make test`. Both create the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# This machine's disk holds the CPU build of torch 2.13.0; override on a CUDA box if needed.
TORCH_SPEC ?= torch==2.13.0
ARGS ?= --max-batch 8

# The GPU machine has torch with CUDA and every dependency installed and no network: gpu-check
# runs there with its own python3, from the checkout, without a virtual environment.
GPU_PYTHON ?= python3

.PHONY: run test setup clean gpu-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

run: $(VENV)/.installed
	$(PY) -m flexh2o.run $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q

gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) -m pytest -q tests/test_cuda.py
	PYTHONPATH=. $(GPU_PYTHON) scripts/gpu_check.py

clean:
	rm -rf $(VENV)
