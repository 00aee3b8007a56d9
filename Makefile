# normexp: `make demo` trains the embedded CPU demo, `make test` runs the test suite.
# Both install into .venv first when needed; a second `make install` is a no-op.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: help install demo test test-fast lint format clean-runs

help:
	@echo "make install    create $(VENV) and install normexp with its dev extras"
	@echo "make demo       train the micro ViT (LayerNorm) on the embedded digits data"
	@echo "make test       run the whole test suite (slow end-to-end checks included)"
	@echo "make test-fast  run the tests not marked slow"
	@echo "make lint       ruff check"

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

clean-runs:
	rm -rf outputs multirun
