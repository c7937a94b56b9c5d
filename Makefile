# stnb: notebook-first distributed training (DP / DDP / FSDP) for sentence-transformers.
#
#   make lab    main job: create .venv, install what the course needs, start JupyterLab on notebooks/
#   make test   every test, notebooks included (nbval) and the browser test
#
# GPU machines: install the CUDA build of the same torch version, e.g.
#   make lab TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON          ?= python3
VENV            ?= .venv
TORCH_VERSION   ?= 2.13.0
# Optional: a PyTorch wheel index, e.g. https://download.pytorch.org/whl/cu128
TORCH_INDEX_URL ?=
# Extra arguments for pytest, e.g. make test PYTEST_ARGS="-x -k ddp"
PYTEST_ARGS     ?=

PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
# Two stamps: what a student needs (make lab: stnb[lab]), and the developers' tools on top of it
# (make test and the rest: stnb[dev]), each installed once; make test after make lab adds only the rest
LAB_STAMP  := $(VENV)/.installed-lab
STAMP      := $(VENV)/.installed
# Records which torch build was requested; changing TORCH_VERSION or
# TORCH_INDEX_URL re-runs the install (and swaps the torch build).
TORCH_CFG  := $(VENV)/.torch-config
TORCH_SPEC := $(strip torch==$(TORCH_VERSION) $(TORCH_INDEX_URL))

# Jupyter refuses to run as root unless told to; only pass the flag when root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
SUDO       := $(if $(filter 0,$(shell id -u)),,sudo)
CHROMIUM   ?= /usr/bin/chromium

# Environment for the test run: fast notebook profile, no network access.
TEST_ENV := STNB_PROFILE=ci \
	HF_HUB_OFFLINE=1 \
	TRANSFORMERS_OFFLINE=1 \
	HF_DATASETS_OFFLINE=1 \
	TOKENIZERS_PARALLELISM=false \
	PYTHONUNBUFFERED=1

# The committed outputs: the real thing (bundled MiniLM), offline; every figure also as a PNG
# (kaleido + Chromium), which GitHub's notebook view shows.
NOTEBOOK_ENV := STNB_PROFILE=workshop \
	STNB_STATIC_FIGURES=1 \
	HF_HUB_OFFLINE=1 \
	TRANSFORMERS_OFFLINE=1 \
	HF_DATASETS_OFFLINE=1 \
	TOKENIZERS_PARALLELISM=false

.PHONY: help venv install lab-install browser cluster-deps lab test test-fast test-under-load test-oldest mutants mutants-sample notebooks html bench hardware gpu-check gpu-kit gpu-kit-install clean distclean FORCE

help:
	@echo "stnb make targets:"
	@echo "  make lab        create $(VENV), install what the course needs (stnb[lab]), start JupyterLab on"
	@echo "                  notebooks/ (token auth, 127.0.0.1)"
	@echo "  make test       run every test, notebooks included (STNB_PROFILE=ci): the in-process tests, then the"
	@echo "                  slow ones on TEST_WORKERS=3 workers"
	@echo "  make test-fast  the in-process tests only (about a minute)"
	@echo "  make test-under-load  make test beside LOAD_PROCS=2 CPU-bound processes (a busy runner or laptop)"
	@echo "  make test-oldest  the fast tests and one notebook on the oldest supported versions ($(OLDEST_VENV),"
	@echo "                  constraints/oldest.txt)"
	@echo "  make mutants    mutmut over the modules that decide what users are told: survival rate per module;"
	@echo "                  exit 1 on a survivor neither killed nor listed in tests/mutants_equivalent.toml"
	@echo "                  (MUTANTS=\"results checks\" for some modules; docs/testing.md)"
	@echo "  make mutants-sample  a fixed-seed sample of them (MUTANTS_SAMPLE=150 MUTANTS_SEED=19), what CI runs"
	@echo "  make notebooks  run every notebook in place (STNB_PROFILE=workshop) and stamp the outputs that get committed"
	@echo "                  (NB=03: only notebooks/03_*.ipynb), then make html"
	@echo "  make html       the course as HTML pages from the committed notebooks (no execution): docs/course/"
	@echo "  make install    create $(VENV) and install stnb[dev], make lab's set and the developers' tools:"
	@echo "                  DeepSpeed, submitit, Ray, Playwright, mutmut, kaleido (alias: make venv)"
	@echo "  make lab-install  create $(VENV) and install only what the course needs: stnb[lab] (make lab's step)"
	@echo "  make browser    apt-get install chromium if $(CHROMIUM) is missing"
	@echo "  make cluster-deps  apt-get install slurm-wlm munge if slurmctld is missing (the cluster tests"
	@echo "                  start a one-node SLURM cluster themselves, tests/cluster/slurm_up.sh)"
	@echo "  make bench      python -m stnb bench --quick"
	@echo "  make hardware   python -m stnb hardware"
	@echo "  make gpu-check  run every GPU code path the visible GPUs allow (< 8 min on 1 GPU);"
	@echo "                  table on stdout, JSON in artifacts/gpu-check/report.json; no GPU: says why, exit 0"
	@echo "  make gpu-kit    build gpu-kit/out: the wheels a GPU machine without a registry lacks (Python"
	@echo "                  $(GPU_KIT_PYTHON)), stnb's wheel and the tokenizer; prints the size (docs/gpu.md)"
	@echo "  make gpu-kit-install  on that machine: install the kit with no network and run gpu-check"
	@echo "                  (= bash gpu-kit/install.sh; never runs make install)"
	@echo "  make clean      remove caches and build outputs (distclean also removes $(VENV))"
	@echo "Variables: VENV=$(VENV) PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) TORCH_INDEX_URL=$(TORCH_INDEX_URL)"

# ---------------------------------------------------------------- install --

venv install: $(STAMP)
lab-install: $(LAB_STAMP)

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "stnb needs Python >= 3.10, $(PYTHON) is " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(TORCH_CFG): FORCE | $(PY)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

# torch goes in first and explicitly (torch==$(TORCH_VERSION), CPU or CUDA build): pyproject.toml's
# torch range then keeps it. Every other package at CI's exact version: constraints/ci.txt.
$(LAB_STAMP): pyproject.toml constraints/ci.txt $(TORCH_CFG) | $(PY)
	$(if $(and $(filter $(TORCH_CFG),$?),$(wildcard $(LAB_STAMP) $(STAMP))),$(PIP) uninstall -y torch,)
	$(PIP) install $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),) "torch==$(TORCH_VERSION)"
	$(PIP) install -c constraints/ci.txt -e ".[lab]"
	@touch $@

# The developers' tools on top (the engines, the browser test's Playwright, mutmut, kaleido)
$(STAMP): $(LAB_STAMP)
	$(PIP) install -c constraints/ci.txt -e ".[dev]"
	# DeepSpeed's CPU communication op: compiled once here, not in the first test's ranks (about a minute)
	$(PY) -m stnb.strategies.deepspeed_ops
	@touch $@

# ---------------------------------------------------------------- browser --

browser:
	@if [ -x "$(CHROMIUM)" ]; then \
		echo "chromium: $(CHROMIUM)"; \
	else \
		echo "Installing Debian chromium (needed by the browser test)"; \
		$(SUDO) apt-get update; \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium fonts-liberation; \
	fi

# ----------------------------------------------------------- cluster-deps --

# The cluster tests (pytest -m cluster) start and stop a one-node SLURM cluster and a Ray cluster on this
# machine; SLURM and munge come from the OS packages (Ray from the dev extra)
cluster-deps:
	@if command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then \
		echo "slurm: $$(command -v slurmctld)"; \
	else \
		echo "Installing Debian slurm-wlm and munge (needed by the cluster tests)"; \
		$(SUDO) apt-get update; \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge; \
	fi

# -------------------------------------------------------------------- lab --

lab: lab-install
	@echo "Starting JupyterLab on 127.0.0.1 with token auth."
	@echo "Open the line below that looks like http://127.0.0.1:8888/lab?token=... (Ctrl-C to stop)."
	@echo "Remote machine? Tunnel first: ssh -L 8888:127.0.0.1:8888 <host>"
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --no-browser $(ALLOW_ROOT)

# ------------------------------------------------------------------- test --

# Two steps: the in-process tests first (about a minute; a failure there stops make before the slow tiers),
# then every slow test and the notebooks on TEST_WORKERS pytest-xdist workers (tests/tiers.py: a test file
# stays in one worker; TEST_WORKERS=0 runs them in this process). docs/testing.md says where the time goes.
TEST_WORKERS ?= 3

test: install browser cluster-deps
	$(TEST_ENV) $(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)
	$(TEST_ENV) $(PY) -m pytest tests --nbval-lax --nbval-current-env notebooks -m slow -n $(TEST_WORKERS) --dist loadgroup --durations=25 $(PYTEST_ARGS)

# make test with LOAD_PROCS CPU-bound processes stnb did not start beside it (tests/under_load.py): what a busy
# CI runner or laptop does to the suite; every one is stopped when make test ends
LOAD_PROCS ?= 2

test-under-load: install browser cluster-deps
	$(PY) tests/under_load.py --procs $(LOAD_PROCS) -- $(MAKE) test

# The in-process tests alone, while you work (no install step): about a minute
test-fast:
	$(TEST_ENV) $(PY) -m pytest tests -m "not slow" -q $(PYTEST_ARGS)

# ------------------------------------------------------------ test-oldest --

# The oldest versions pyproject.toml allows (constraints/oldest.txt, its lower bounds; torch 2.13, the
# oldest whose CPU wheel installs here) in a second venv: the fast tests and one notebook (docs/testing.md).
# Left out: the fsdp / zero2 training runs (transformers 5.17 is refused for them, which
# tests/test_versions.py checks) and three CLI runs that repeat what the others train.
OLDEST_VENV  ?= .venv-oldest
OLDEST_PY    := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed
OLDEST_TESTS := tests/test_versions.py tests/test_mixed_precision_save.py tests/test_run.py \
	tests/test_model_types.py tests/test_loss_params.py tests/test_widgets.py tests/test_plots.py \
	tests/test_results.py tests/test_data_columns.py tests/test_verification.py \
	--deselect tests/test_run.py::test_fsdp_shards_and_saves_a_loadable_model \
	--deselect "tests/test_model_types.py::test_reranker_trains_verified_and_saves_as_a_cross_encoder[fsdp]" \
	--deselect "tests/test_model_types.py::test_splade_trains_verified[fsdp]" \
	--deselect tests/test_loss_params.py::test_zero_stages_keep_the_loss_parameters_in_sync_too \
	--deselect tests/test_run.py::test_cli_run_json_last_line \
	--deselect tests/test_verification.py::test_cli_run_exits_nonzero_for_an_unverified_result \
	--deselect tests/test_verification.py::test_cli_bench_exits_nonzero_and_names_the_failed_runs
OLDEST_NOTEBOOK := notebooks/03_ddp_from_a_notebook.ipynb

$(OLDEST_STAMP): pyproject.toml constraints/oldest.txt
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --upgrade pip
	$(OLDEST_PY) -m pip install -c constraints/oldest.txt -e ".[test]"
	@touch $@

test-oldest: $(OLDEST_STAMP)
	$(TEST_ENV) STNB_CONSTRAINTS=constraints/oldest.txt $(OLDEST_PY) -m pytest -p no:cacheprovider \
		$(OLDEST_TESTS) --nbval-lax --nbval-current-env $(OLDEST_NOTEBOOK)

# ---------------------------------------------------------------- mutants --

# Modules to mutate (default: every one tests/mutants.py lists), e.g. make mutants MUTANTS="results checks"
MUTANTS ?=

mutants: install
	$(TEST_ENV) $(PY) tests/mutants.py $(MUTANTS)

# CI's share (.ci/run, after make test): a fixed-seed sample of the same mutants, a few minutes where the
# whole run takes about half an hour on 2 cores (docs/testing.md says why and what it costs)
MUTANTS_SAMPLE ?= 150
MUTANTS_SEED   ?= 19

mutants-sample: install
	$(TEST_ENV) $(PY) tests/mutants.py --sample $(MUTANTS_SAMPLE) --seed $(MUTANTS_SEED)

# -------------------------------------------------------------- notebooks --

# Outputs readers see without running anything; tests/test_notebook_outputs.py checks they are
# a complete workshop run of the current code cells. NB=03 reruns and stamps notebooks/03_*.ipynb only.
NB             ?=
NOTEBOOK_FILES  = $(sort $(wildcard notebooks/$(if $(NB),$(NB)_,[0-9][0-9]_)*.ipynb))
ifneq ($(NB),)
ifeq ($(NOTEBOOK_FILES),)
$(error no notebook matches NB=$(NB): expected notebooks/$(NB)_*.ipynb)
endif
endif

notebooks: install browser
	for nb in $(NOTEBOOK_FILES); do \
		start=$$SECONDS; \
		$(NOTEBOOK_ENV) $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
			--ExecutePreprocessor.timeout=1800 "$$nb"; \
		echo "$$nb: $$((SECONDS - start)) s"; \
	done
	$(PY) tests/notebook_outputs.py --stamp $(NOTEBOOK_FILES)
	$(PY) tests/course_html.py --out $(COURSE_HTML)

# The course as HTML pages (docs/course/index.html), from the committed notebooks and their outputs, nothing
# executed: for readers without Jupyter. Not committed (docs/course is ignored); tests/test_course_html.py builds
# them into a temporary folder and checks every page.
COURSE_HTML ?= docs/course

html: install
	$(PY) tests/course_html.py --out $(COURSE_HTML)

# ------------------------------------------------------------------ other --

bench: install
	$(PY) -m stnb bench --quick

hardware: install
	$(PY) -m stnb hardware

# GPU machines: make gpu-check TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Not tied to make install: a GPU machine without a registry installs stnb from the kit (make gpu-kit-install)
# into its own python3; with a .venv here, that one runs.
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)

gpu-check:
	@$(GPU_PY) -c 'import stnb' 2>/dev/null || { echo "gpu-check: stnb is not installed for $(GPU_PY): run make install (with a package registry) or make gpu-kit-install (with the kit, no registry)"; exit 1; }
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false $(GPU_PY) -m stnb gpu-check

# The GPU kit (docs/gpu.md): built here where a registry is reachable, installed there with --no-index.
# GPU_KIT_PYTHON: the target's Python (the GPU image's 3.12; tests/test_gpu_kit.py builds it for this one).
GPU_KIT_PYTHON ?= 3.12

# Built with $(VENV)'s Python (pip download, stnb's wheel, the bundled MiniLM's tokenizer files).
gpu-kit: install
	$(PY) gpu-kit/build.py --python-version $(GPU_KIT_PYTHON)

gpu-kit-install:
	bash gpu-kit/install.sh

clean:
	find . \( -path ./$(VENV) -o -path ./$(OLDEST_VENV) \) -prune -o -type d \( -name __pycache__ -o -name .ipynb_checkpoints \) -print0 | xargs -0 rm -rf
	rm -rf build dist *.egg-info .pytest_cache artifacts mutants

distclean: clean
	rm -rf $(VENV) $(OLDEST_VENV)

FORCE:
