# normexp: `make demo` trains the embedded CPU demo, `make test` runs the test suite.
# Both install into .venv first when needed; a second `make install` is a no-op.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: help install demo test test-fast lint format bench clean-runs

help:
	@echo "make install    create $(VENV) and install normexp with its dev extras"
	@echo "make demo       train the micro ViT (LayerNorm) on the embedded digits data"
	@echo "make test       run the whole test suite (slow end-to-end checks included)"
	@echo "make test-fast  run the tests not marked slow"
	@echo "make lint       ruff check"
	@echo "make bench      normalizer and training-step benchmarks at a small size -> results/bench/*.md"

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-input -e '.[dev]'
	touch $(STAMP)

demo: install
	$(PY) -m normexp

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

format: install
	$(VENV)/bin/ruff format .

# ViT-S/B token shapes at batch 8; whole ViT-S steps (batch 8, 224 px) with the references; ~10 min on 2 cores
bench: install
	$(PY) scripts/bench_norms.py --batch 8 --rounds 3 --repeats 10 --out results/bench/norms.md
	$(PY) scripts/bench_train.py --backbone vit_small --norms ln dyt dtn --batch 8 --warmup 2 --steps 2 \
		--rounds 3 --trainer-steps 3 --out results/bench/train.md

clean-runs:
	rm -rf outputs multirun
