# GradientFlow: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch and torchvision pinned here: these releases lie on this machine's disk; an unpinned
# torch would download a multi-GB build.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: install test lint demo bench bench-quick experiment simulate test-ray clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e ".[test,experiments,spark,autotune]" $(TORCH_PINS)
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

lint: install
	$(PY) -m ruff check .

demo: install
	$(PY) experiments/imagenet/run_experiment.py --demo

bench: install
	$(PY) benchmarks/run.py

bench-quick: install
	$(PY) benchmarks/run.py --quick

experiment: install
	$(PY) experiments/imagenet/run_experiment.py

# the scale model's tables, plots and calibration (benchmarks/results/simulate/)
simulate: install
	$(PY) benchmarks/bench_simulate.py

# Ray is large and optional: its test skips unless ray[train] is installed
test-ray: install
	$(PY) -m pip install -q -e ".[ray]" $(TORCH_PINS)
	$(PY) -m pytest -q tests/horovod/test_ray.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
