# Every target bootstraps .venv on first use, so a fresh clone needs only `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
# A deadlock fails the run instead of stalling it (seconds per mpiexec run).
RUN_TIMEOUT ?= 900
PYTEST := $(PY) -m pytest -q
SIZES  ?= 2 3 4

.PHONY: install test test-serial test-slurm lint format clean $(addprefix test-,$(SIZES))

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[mpich,test,dev]"
	touch $@

install: $(VENV)/.installed

# The whole suite serially, then under mpiexec at each size; any failing rank fails the run.
test: install test-serial $(addprefix test-,$(SIZES))

test-serial: install
	timeout -k 10 $(RUN_TIMEOUT) $(PYTEST)

# The jobs/ scripts on a single-node Slurm it installs and starts (root only; skips otherwise).
test-slurm: install
	PYTHON=$(abspath $(PY)) timeout -k 10 $(RUN_TIMEOUT) bash tests/slurm/run.sh

$(addprefix test-,$(SIZES)): test-%: install
	timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $* $(PYTEST) --with-mpi -p no:randomly

lint: install
	$(PY) -m ruff check mpistrat tests
	$(PY) -m ruff format --check mpistrat tests

format: install
	$(PY) -m ruff format mpistrat tests
	$(PY) -m ruff check --fix mpistrat tests

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis .ruff_cache results site
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
