# normexp: `make demo` trains the embedded CPU demo, `make test` runs the test suite.
# Both install into .venv first when needed; a second `make install` is a no-op.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

SCALE  ?= smoke
SEEDS  ?=
LAUNCHER ?=
TABLES := $(sort $(basename $(notdir $(wildcard configs/table/*.yaml))))
TABLE_ARGS = --scale $(SCALE) $(if $(SEEDS),--seeds $(SEEDS)) $(if $(LAUNCHER),--launcher $(LAUNCHER))
FIGURES := $(sort $(basename $(notdir $(wildcard configs/figure/*.yaml))))

.PHONY: help install demo test test-slow test-demos test-all lint format clean-runs tables dashboard bench gpu-check gpu-check-offline \
	$(addprefix table-,$(TABLES)) figures $(addprefix figure-,$(FIGURES))

help:
	@echo "make install    create $(VENV) and install normexp with its dev extras, at the tested versions"
	@echo "                (constraints.txt)"
	@echo "make demo       train the micro ViT (LayerNorm) on the embedded digits data"
	@echo "make test       the test suite: everything but the two tiers below (their durations: README)"
	@echo "make test-slow  the slow tier: multi-process, kill/resume, install, launcher, MLflow server,"
	@echo "                compiled-kernel and published-size model checks"
	@echo "make test-demos the documented demos trained to their accuracy targets"
	@echo "make test-all   all three"
	@echo "make lint       ruff check"
	@echo "make table-<id> run what a paper table needs, then render it [SCALE=smoke|full] [SEEDS=0,1,2]"
	@echo "                [LAUNCHER=slurm]; tables: $(TABLES)"
	@echo "make tables     every table (one after another; the others go on when one has a failed run)"
	@echo "make figure-<id> run what a paper figure needs (shared with the tables), analyse, render it to"
	@echo "                results/figures/<id>.png [SCALE=...] [SEEDS=...] [LAUNCHER=...]; figures: $(FIGURES)"
	@echo "make figures    every figure (one after another)"
	@echo "make dashboard  import every run record into MLflow and serve its UI on http://127.0.0.1:5000"
	@echo "make bench      normalizer, training-step and pre-training-step benchmarks -> results/bench/*.md"
	@echo "make gpu-check  on a CUDA machine: fused kernels, layer and ViT-B/DiT step benchmarks, a torchrun"
	@echo "                kill/resume run -> results/bench/gpu/*.md, within BUDGET seconds (default 480)"
	@echo "make gpu-check-offline WHEELS=<dir>  the same on a machine with torch but no package registry:"
	@echo "                installs the wheels in <dir> (hydra-core, omegaconf, antlr4, timm, ...) under"
	@echo "                build/site, no venv"

install: $(STAMP)

# the tested versions (constraints.txt) within the ranges pyproject.toml supports
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-input -c constraints.txt -e '.[dev]'
	$(PY) -m normexp.norms.kernels.native  # the native CPU kernels, built once per machine (about 20 s)
	touch $(STAMP)

demo: install
	$(PY) -m normexp

# one pytest worker per core (each single-threaded, see tests/conftest.py)
PYTEST := $(PY) -m pytest -n auto --dist worksteal

test: install
	$(PYTEST) -m "not slow and not demo" --durations=20

test-slow: install
	$(PYTEST) -m "slow and not demo" --durations=20

test-demos: install
	$(PYTEST) -m demo

test-all: install
	$(PYTEST)

lint: install
	$(VENV)/bin/ruff check .

format: install
	$(VENV)/bin/ruff format .

$(addprefix table-,$(TABLES)): table-%: install
	$(PY) -m normexp table run $* $(TABLE_ARGS)

tables: install
	@status=0; for t in $(TABLES); do $(PY) -m normexp table run $$t $(TABLE_ARGS) || status=1; done; exit $$status

$(addprefix figure-,$(FIGURES)): figure-%: install
	$(PY) -m normexp figure run $* $(TABLE_ARGS)

figures: install
	@status=0; for f in $(FIGURES); do $(PY) -m normexp figure run $$f $(TABLE_ARGS) || status=1; done; exit $$status

dashboard: install
	$(PY) -m normexp dashboard

# ViT-S/B token shapes at batch 8; whole ViT-S steps (batch 8, 224 px) with the references; ~10 min on 2 cores
bench: install
	$(PY) scripts/bench_norms.py --batch 8 --shapes vit_s --rounds 3 --repeats 10 --out results/bench/norms.md
	$(PY) scripts/bench_train.py --backbone vit_small --norms ln dyt dtn --batch 8 --warmup 2 --steps 2 \
		--rounds 3 --trainer-steps 3 --out results/bench/train.md
	$(PY) scripts/bench_pretrain.py --backbone vit_base --norms ln dyt dtn --batch 4 --local-crops 10 \
		--warmup 1 --steps 2 --rounds 2 --out results/bench/pretrain.md
	$(PY) scripts/bench_dit.py --backbone dit_b4 --norms ln dyt dtn --batch 4 --input-size 16 --warmup 1 \
		--steps 3 --rounds 3 --out results/bench/dit.md

clean-runs:
	rm -rf outputs multirun

# the GPU path (scripts/gpu_check.py --help): fused = plain kernels, bf16, benchmarks, a DDP run killed and resumed,
# most valuable first, each section's table written as it ends, within BUDGET seconds
BUDGET ?= 480
gpu-check: install
	$(PY) scripts/gpu_check.py --out results/bench/gpu --budget-s $(BUDGET)

# a GPU machine without a registry: the system python's torch, the wheels it lacks from WHEELS, nothing else
gpu-check-offline:
	@test -n "$(WHEELS)" || { echo "usage: make gpu-check-offline WHEELS=<folder of .whl files>"; exit 2; }
	$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target build/site \
		$(WHEELS)/*.whl
	PYTHONPATH=$(CURDIR):$(CURDIR)/build/site PYTHONUNBUFFERED=1 \
		$(PYTHON) scripts/gpu_check.py --out results/bench/gpu --budget-s $(BUDGET)
