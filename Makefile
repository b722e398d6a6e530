# The course's commands. `make book` and `make test` are the contract (see README.md); both
# create the environment in .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Notebooks run on one core, as the budgets assume; the test suite spreads them over both.
export OMP_NUM_THREADS ?= 1
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: env book test execute lab model clean

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

# JupyterLab on the labs, on loopback only (it refuses to start as root without --allow-root).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --no-browser --notebook-dir=labs $(if $(filter 0,$(shell id -u)),--allow-root)

clean:
	rm -rf _build .pytest_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
