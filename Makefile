# GradientFlow: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch and torchvision pinned here: these releases lie on this machine's disk; an unpinned
# torch would download a multi-GB build.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: install test test-oldest lint demo horovod compare converge lm readme bench experiment sweep simulate bench-algorithms bench-pipeline step-anatomy gpu-check bench-autotune test-ray clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e ".[test,experiments,spark,autotune]" $(TORCH_PINS)
	$(PY) -m gradientflow.kernels  # numba's cache filled now, not in a first training step
	touch $(STAMP)

test: install lint
	$(PY) -m pytest -q tests

# The oldest torch CI tests: 2.13.0, a CPU build on the machines' disk, in a venv of its own.
# The backend, conformance, hooks and compression, optimizer and Horovod-layer tests, plus the
# rest of tests/test_*.py and tests/reliability, run on it (not the slow torch-suite subset,
# which `make test` runs on 2.14; nor test_restart.py, which needs the experiments' torchvision:
# the one built for 2.13 on disk is a CUDA build that does not load with a CPU torch).
# torch 2.9.1, the oldest pyproject.toml allows, is not tested in CI: it is not on disk, so
# every fresh CI machine would download a multi-GB wheel; 2.13.0 already takes the same code
# path as 2.9-2.13 (a ProcessGroup subclass, no entry-point autoload), and 2.9.1 was checked
# by hand (docs/CONFORMANCE.md).
OLD_VENV  := .venv-oldest
OLD_PY    := $(OLD_VENV)/bin/python
OLD_STAMP := $(OLD_VENV)/.installed
OLD_PINS  := torch==2.13.0
# Beside [test]: what the Horovod examples and the hooks' tests import (the experiments extra
# would pull torchvision 0.29, and with it torch 2.14).
OLD_EXTRAS := cloudpickle scikit-learn tqdm

$(OLD_STAMP): pyproject.toml
	$(PYTHON) -m venv $(OLD_VENV)
	$(OLD_PY) -m pip install -q --upgrade pip
	$(OLD_PY) -m pip install -q $(OLD_PINS)
	$(OLD_PY) -m pip install -q -e ".[test]" $(OLD_EXTRAS) $(OLD_PINS)
	$(OLD_PY) -m gradientflow.kernels
	touch $(OLD_STAMP)

test-oldest: $(OLD_STAMP)
	$(OLD_PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(OLD_PY) -m pytest -q -m "not slow" tests/test_*.py tests/conformance tests/compression \
		tests/optim tests/horovod tests/reliability --ignore=tests/reliability/test_restart.py

lint: install
	$(PY) -m ruff check .

# GradientFlow beside DDP on Fashion-MNIST, accuracy against time and bytes, about 2 minutes
# (root: an emulated 1 Gbit/s switch; otherwise a modelled link, and it says so).
# make demo DATA=digits: the earlier demo, CSC 1% on scikit-learn's digits, one seed.
DATA ?= fashion
demo: install
ifeq ($(DATA),digits)
	$(PY) experiments/imagenet/run_experiment.py --demo
else
	$(PY) experiments/imagenet/demo.py
endif

# Horovod 0.28.1 for CPU with Gloo in its own environment, .venv-horovod (about 20 minutes of
# one core); make install never builds it
horovod: $(VENV)-horovod/.installed

$(VENV)-horovod/.installed: experiments/imagenet/build_horovod.sh | install
	experiments/imagenet/build_horovod.sh $(CURDIR)/$(VENV)-horovod

# GradientFlow against DDP, torch's fp16 hook and PowerSGD, and Horovod on Fashion-MNIST,
# AlexNet- and ResNet-shaped, on the emulated switch (root; resumes; experiments/imagenet/
# results/fashion/). Run it on an otherwise idle machine: it holds /work/timing.lock per run.
compare: install
	-$(MAKE) horovod  # a failed build leaves Horovod's rows saying why, not the run undone
	$(PY) experiments/imagenet/compare.py

# The README's first screen, rendered from the committed results of compare, converge and lm
# (experiments/imagenet/first_screen.py; tests/experiments/test_readme_numbers.py checks it).
readme: install
	$(PY) experiments/imagenet/first_screen.py --write

# Accuracy at convergence on report seeds 10-14 that no choice saw (experiments/imagenet/
# converge.py): both models, DDP, the CSC default with and without momentum correction, torch's
# FP16 hook and PowerSGD rank 4, warm-up + cosine for 30 epochs, each epoch scored on a
# validation split, the test set once at the end; loopback (accuracy does not depend on the
# link); resumes. make converge DATA=digits: the digits. JOBS=N: N runs at a time.
JOBS ?= 1
converge: install
	$(PY) experiments/imagenet/converge.py --jobs $(JOBS) \
		--data $(if $(filter digits,$(DATA)),digits,fashion-mnist)

# A byte-level GPT with AdamW on the Jargon File (Debian's jargon-text, installed on first use
# as root): DDP, CSC 1% and torch's FP16 hook, seeds 11-13 (experiments/lm/; resumes).
lm: install
	$(PY) experiments/lm/run_lm.py --jobs $(JOBS)

# every benchmark; make bench ARGS=--quick for tiny sizes (benchmarks/results/quick/)
ARGS ?=
bench: install
	$(PY) benchmarks/run.py $(ARGS)

experiment: install
	$(PY) experiments/imagenet/run_experiment.py

# density and chunk size against accuracy, bytes and a recommendation per link speed (resumes)
sweep: install
	$(PY) experiments/imagenet/run_experiment.py --densities 0.1,0.03,0.01,0.003,0.001 \
		--chunk-sizes 256,1024,4096 --seeds 0,1,2 --epochs 6

# collective algorithms on the emulated network (root: network namespaces, tbf);
# make bench-algorithms E2E=1: a ResNet-50 DDP step under each algorithm, dense and CSC 1%,
# 4 workers at 1 Gbit/s
E2E ?=
bench-algorithms: install
	$(PY) benchmarks/bench_algorithms$(if $(E2E),_e2e).py

# CSC fused and pipelined by the engine against no communication, ResNet-50 and AlexNet, DDP
# built as README.md recommends, medians over 3 launches (root)
bench-pipeline: install
	$(PY) -m benchmarks.bench_pipeline --models resnet50,alexnet --tiers 1,10 --bucket-view \
		--no-broadcast-buffers --steps 24 --rounds 6 --launches 3 \
		--out benchmarks/results/pipeline/bucket_view_no_broadcast

# where a CSC step's time goes: each thread's CPU and the tail after backward (root)
step-anatomy: install
	$(PY) -m benchmarks.step_anatomy --model resnet50 --tier 1 --bucket-view --no-broadcast-buffers

# autotune against a grid of the same settings, in one launch. MODE picks a variant:
#   MODE=matrix  the same on loopback and the emulated 10 Gbit/s network, 2 and 4 ranks, one
#                launch per folder (root), then the table below
#   MODE=table   the matrix of every launch folder under benchmarks/results/autotune (no run)
#   MODE=e2e     a CSC training run with autotune against the defaults (digits, time to the
#                same accuracy)
MODE ?=
AT = $(PY) benchmarks/bench_autotune.py --seed 0
AT_OUT = benchmarks/results/autotune
bench-autotune: install
ifeq ($(MODE),)
	$(PY) benchmarks/bench_autotune.py
else ifeq ($(MODE),matrix)
	for t in none 10; do for n in 2 4; do \
		if [ $$n = 2 ]; then rh="--reps 5 --h2h 8"; else rh="--reps 3 --h2h 6"; fi; \
		$(AT) --tiers $$t --worlds $$n --models resnet50,alexnet $$rh \
			--out $(AT_OUT)/t$${t}_w$${n}_resnet50+alexnet || exit 1; \
		if [ $$t = 10 -o $$n = 4 ]; then b="--reps 3 --h2h 6 --steps 2"; \
		else b="--reps 5 --h2h 8 --steps 3"; fi; \
		$(AT) --tiers $$t --worlds $$n --models bert-base $$b \
			--out $(AT_OUT)/t$${t}_w$${n}_bert-base || exit 1; \
	done; done
	$(PY) benchmarks/autotune_matrix.py
else ifeq ($(MODE),table)
	$(PY) benchmarks/autotune_matrix.py
else ifeq ($(MODE),e2e)
	$(PY) experiments/imagenet/autotune_e2e.py --runs default-0,autotune-0,autotune-1,default-1
else
	$(error bench-autotune: MODE is one of matrix, table, e2e (or unset), not "$(MODE)")
endif

# the scale model's tables, plots and calibration (benchmarks/results/simulate/)
simulate: install
	$(PY) benchmarks/bench_simulate.py

# The GPU acceptance check (benchmarks/gpu_check.py): on a machine with a CUDA device, with that
# machine's own python3, torch, Triton and numba (no venv, nothing installed); refuses at once
# without a GPU. Results in GPU_CHECK_OUT.
GPU_CHECK_OUT ?= benchmarks/results/gpu_check
gpu-check:
	python3 benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

# Ray is large and optional: its test skips unless ray[train] is installed
test-ray: install
	$(PY) -m pip install -q -e ".[ray]" $(TORCH_PINS)
	$(PY) -m pytest -q tests/horovod/test_ray.py

clean:
	rm -rf $(VENV) $(OLD_VENV) build *.egg-info .pytest_cache .hypothesis
