# Two commands set up everything on a machine that has only Python 3.10+:
#   make demo   create .venv, install graphpass and its dependencies, run the main job
#   make test   same set-up, then the whole test suite (property tests: their fixed examples)
#   make hunt   the property tests with new random examples (EXAMPLES=60 each)
# Other torch versions each get their own virtualenv: `make test TORCH=2.11.0` uses .venv-2.11.0,
# `make test TORCH=2.15.0` uses .venv-2.15.0 (.ci/run runs 2.13.0, 2.11.0 and 2.15.0). Each
# version's pin is requirements/torch-<version>.txt.
PYTHON ?= python3
TORCH_VERSIONS := 2.11.0 2.13.0 2.14.1 2.15.0
TORCH ?= 2.13.0
ifeq ($(filter $(TORCH),$(TORCH_VERSIONS)),)
$(error TORCH=$(TORCH) is not a tested version; use one of: $(TORCH_VERSIONS))
endif
# The default version lives in .venv, the README's one environment; 2.13.0 is a CPU wheel.
# 2.11.0, 2.14.1 and 2.15.0 come from PyPI as CUDA builds (several GB), which run on a CPU-only
# machine.
# Never an unpinned torch: it would pull whatever is newest, untested.
ifeq ($(TORCH),2.13.0)
VENV := .venv
else
VENV := .venv-$(TORCH)
endif
PY     := $(VENV)/bin/python
# torchtitan (tests/test_trainer_torchtitan.py) without its declared dependencies, which its
# models never import (datasets, tensorboard, wandb, torchdata, torch_checkpointing: hundreds of
# MB); what they do import is listed. Its models import triton, which the CUDA wheels bring and
# the 2.13.0 CPU wheel does not. Those imports are installed with everything else, and torchtitan
# last, alone, with --no-deps: pip checks no dependencies in that run, so the set-up prints no
# resolver ERROR about the ones left out (a later plain `pip install` into the venv lists them).
TITAN  := "torchtitan==0.3.0"
TITAN_DEPS := "spmd_types==0.2.3" tyro einops $(if $(filter 2.13.0,$(TORCH)),"triton==3.7.1")
# Workers for the suite: pytest-xdist's -n (auto: one per CPU core); PYTEST_WORKERS=0 runs serially.
# --dist worksteal: an idle worker takes queued tests from a busy one, so the few minute-long
# tests (Inductor compiles, training runs) do not leave one core idle at the end.
PYTEST_WORKERS ?= auto
MODEL ?= llama
FP8 ?= tensorwise

# `make hunt`: the property tests in HUNT_TESTS draw EXAMPLES new random examples each (the
# "hunt" Hypothesis profile, tests/conftest.py), where `make test` and CI run a fixed set. Keep
# each counterexample it finds as an @example on its test. On 2 cores, an example takes about
# 1.3 s (random stacks), 2 s (random DAGs of shared linears), 20 s
# (tests/test_regions.py::test_one_answer_per_arithmetic, not hunted by default).
EXAMPLES ?= 60
HUNT_TESTS ?= tests/test_memory_passes.py::test_random_stacks_and_policies \
	tests/test_fp8_shared_tensors.py::test_random_dags_of_shared_linears

.PHONY: demo test hunt bench setup clean

setup: $(VENV)/.installed

# One pip run installs torch, the test and docs extras and torchtitan's imports (one resolution;
# a torch already at $(TORCH), a +cpu build included, is kept). --no-compile: byte-compiling every
# installed module (torch, transformers, sympy: over 10,000 files) costs more than compiling the
# ones the suite imports.
$(VENV)/.installed: pyproject.toml Makefile requirements/torch-$(TORCH).txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -r requirements/torch-$(TORCH).txt -e ".[test,docs]" \
		$(TITAN_DEPS)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile --no-deps $(TITAN)
	touch $@

demo: setup
	$(PY) -m graphpass report --model $(MODEL) --size real --fp8 $(FP8)

test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal

hunt: setup
	GRAPHPASS_PROPERTY_EXAMPLES=$(EXAMPLES) $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal $(HUNT_TESTS)

bench: setup
	$(PY) benchmarks/memory.py

clean:
	rm -rf .venv $(addprefix .venv-,$(TORCH_VERSIONS)) build *.egg-info
