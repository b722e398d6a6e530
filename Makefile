# The course's commands. `make book` and `make test` are the contract (see README.md); both
# create the environment in .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Notebooks run on one core, as the budgets assume; the test suite spreads them over both.
export OMP_NUM_THREADS ?= 1
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: env book test execute lab model kv-recall clean gpu gpu-plan compat

env: $(STAMP)

$(STAMP): requirements.txt requirements-lock.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -c requirements-lock.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (course)"
	touch $(STAMP)

# The static site, from the notebooks' stored outputs, warnings as errors.
book: $(STAMP)
	$(VENV)/bin/jupyter-book build --warningiserror --keep-going --path-output . .

# Every test: kernels, tooling, notebooks under nbval, labs with solutions, the site in a browser.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --durations=15

# Re-execute every book notebook in place, top to bottom, in the reference CPU environment.
execute: $(STAMP)
	$(PY) -m tools.notebooks execute book

# Train the course's tiny GPT (minutes on a CPU); the checkpoint is committed, nbval never retrains it.
model: $(STAMP)
	$(PY) -m kernels.model.train

# Train the three small multi-needle recall GPTs of the kv-eviction chapter (about a minute each on one core);
# the weights in models/kv-recall are committed, the notebook never retrains them.
kv-recall: $(STAMP)
	$(PY) -m kernels.kvcache.recall

# JupyterLab on the labs, on loopback only (it refuses to start as root without --allow-root).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --no-browser --notebook-dir=labs $(if $(filter 0,$(shell id -u)),--allow-root)

# One GPU run (benchmarks/gpu.py, README "On a GPU"): provenance, the native tests, each kernel at a real
# size against its reference, then the ratios against cuBLAS/SDPA/eager and the measured ceilings.
# `make gpu PY=python3` uses an interpreter that already has a CUDA PyTorch: no venv, no install, no
# network. It refuses on a machine without a GPU. GPU_OUT is where the JSON results go.
GPU_OUT ?= benchmarks/results/$(shell date -u +%Y-%m-%d)
gpu:
	@command -v $(PY) >/dev/null || { echo "make gpu: no interpreter $(PY); pass PY=python3 (one with a CUDA PyTorch)"; exit 2; }
	$(PY) -m benchmarks.gpu --out $(GPU_OUT)

# The steps of `make gpu` with their sizes and estimated compile and run times, against 8 minutes.
gpu-plan:
	@command -v $(PY) >/dev/null || { echo "make gpu-plan: no interpreter $(PY); pass PY=python3"; exit 2; }
	$(PY) -m benchmarks.gpu --plan

# The versions a lent GPU machine has (torch 2.11, triton 3.6), on the CPU: a side environment in
# .venv-compat with the course's requirements but those two pins, running the tests under the
# interpreter. Not part of `make test`. The CUDA 13.2 compile tools (nvcc, ptxas, nvdisasm) keep their
# pins, since the PTX probes emit PTX 9.2, which Triton 3.6's own ptxas (CUDA 12.8) refuses; only the
# CUDA runtime is left to torch 2.11, which pins its own 13.0 libraries; numpy stays below 2.4, where Triton 3.6's
# interpreter still runs (it converts one-element arrays to scalars, an error from numpy 2.4 on; the
# GPU run never uses the interpreter). PyPI's torch 2.11 for Linux x86_64 is its CUDA build: the
# first run downloads about 4 GB (torch and its nvidia-* libraries, triton 3.6 is 188 MB) and installs
# about 7 GB. COMPAT_TESTS picks the test files (default: all of tests/).
COMPAT       := .venv-compat
COMPAT_TESTS ?= tests
compat:
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	grep -v -E '^(torch|triton|numpy|nvidia-cuda-runtime)==' requirements.txt > $(COMPAT)/requirements.txt
	grep -v -E '^(torch|triton|numpy|nvidia-cuda-runtime)==' requirements-lock.txt > $(COMPAT)/constraints.txt
	$(COMPAT)/bin/python -m pip install --quiet torch==2.11.0 triton==3.6.0 "numpy<2.4" -r $(COMPAT)/requirements.txt -c $(COMPAT)/constraints.txt
	$(COMPAT)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(COMPAT)/bin/python -c "import torch, triton; print('compat: torch', torch.__version__, 'triton', triton.__version__)"
	$(COMPAT)/bin/python -m pytest -n 2 --dist loadfile -m "not slow" -p no:cacheprovider $(COMPAT_TESTS)

clean:
	rm -rf _build .pytest_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
