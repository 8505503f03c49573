# GradientFlow: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch and torchvision pinned here: these releases lie on this machine's disk; an unpinned
# torch would download a multi-GB build.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: install test test-fast demo bench bench-quick experiment clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e ".[test,experiments]" $(TORCH_PINS)
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

demo: install
	$(PY) experiments/imagenet/run_experiment.py --demo

bench: install
	$(PY) benchmarks/run.py

bench-quick: install
	$(PY) benchmarks/run.py --quick

experiment: install
	$(PY) experiments/imagenet/run_experiment.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
