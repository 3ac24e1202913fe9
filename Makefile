# make test        create .venv (torch + build deps), build ampfused, run pytest
# make bench       same set-up, then the benchmark suite
# make bench-quick same set-up, then a short benchmark run
# PYTHON=python3   use an existing interpreter that already has torch (no venv, no downloads)
TORCH_VERSION ?= 2.14.1
VENV ?= .venv
PYTEST_ARGS ?=
BENCH_ARGS ?=

ifeq ($(PYTHON),)
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-$(TORCH_VERSION)
else
PY := $(PYTHON)
DEPS :=
endif

SOURCES := setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cuda/*.cu csrc/cuda/*.cuh)
STAMP := build/.installed-$(notdir $(PY))

.PHONY: test bench bench-quick install lint clean

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(PY) -m benchmarks --quick $(BENCH_ARGS)

install: $(STAMP)

$(VENV)/.deps-$(TORCH_VERSION):
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install torch==$(TORCH_VERSION) setuptools wheel ninja pytest numpy expecttest ruff matplotlib tabulate tqdm
	touch $@

# The README's install command, editable so rebuilds reuse build/ (ninja, incremental).
$(STAMP): $(DEPS) $(SOURCES)
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	mkdir -p build && touch $@

lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

clean:
	rm -rf build *.egg-info ampfused/_C*.so
