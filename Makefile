# Two commands: `make demo` (the main job) and `make test`. Both create .venv if missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_WHEEL := $(firstword $(wildcard /opt/wheels/torch-2.13.0*.whl))

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# A CPU build of torch 2.13.0 where one is available locally; otherwise pip resolves torch>=2.4.
	$(BIN)/python -m pip install -q torch==2.13.0 || true
	$(BIN)/python -m pip install -q -e '.[triton,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/cocoweave demo

test: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	TRITON_INTERPRET=1 $(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
