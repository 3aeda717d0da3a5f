# Two commands set up everything on a machine that has only Python 3.10+:
#   make demo   create .venv, install graphpass and its dependencies, run the main job
#   make test   same set-up, then the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull several GB of CUDA packages.
TORCH_PIN ?= torch==2.13.0
MODEL ?= llama
FP8 ?= tensorwise

.PHONY: demo test bench setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: setup
	$(PY) -m graphpass report --model $(MODEL) --size real --fp8 $(FP8)

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/memory.py

clean:
	rm -rf $(VENV) build *.egg-info
