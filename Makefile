# make test        create .venv (torch + build deps), build ampfused, run pytest
# make bench       same set-up, then the benchmark suite
# make bench-quick same set-up, then a short benchmark run
# PYTHON=python3   use an existing interpreter that already has torch (no venv, no downloads)
# TORCH_VERSION=2.11.0 VENV=path  a venv with another torch (a CUDA build; see .ci/oldest-torch)
TORCH_VERSION ?= 2.14.1
VENV ?= .venv
PIP_ARGS ?=
# Build and test dependencies (the framework tests skip without lightning/accelerate/transformers).
PY_DEPS := setuptools wheel ninja pytest numpy expecttest ruff clang-format matplotlib tabulate \
	tqdm lightning accelerate transformers
PYTEST_ARGS ?=
BENCH_ARGS ?=

# With no GPU visible, the CUDA kernels are compiled for one arch (9.0, Hopper), not the wheel's
# three (setup.py): the compile check is the same, at a third of the time.  An arch list in the
# environment wins.
ifeq ($(shell nvidia-smi -L 2>/dev/null),)
export TORCH_CUDA_ARCH_LIST ?= 9.0
endif

ifeq ($(PYTHON),)
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-$(TORCH_VERSION)
else
PY := $(PYTHON)
DEPS :=
endif

CXX_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu \
	csrc/cuda/*.cuh csrc/cuda/*.cpp csrc/cuda/*.h)
SOURCES := setup.py ampfused/_build_check.py ampfused/_build_config.py $(CXX_SOURCES)
# The host execution layer (tests only, built by tests/host_cuda.py) is linted with the rest.
LINT_CXX := $(CXX_SOURCES) $(wildcard csrc/host_cuda/*.cpp csrc/host_cuda/*.h)
# One in-place _C for the whole tree: the stamp names the interpreter it was built for, and
# installing for another interpreter deletes the other stamps so switching back rebuilds.
STAMP := build/.installed-$(subst /,_,$(PY))

.PHONY: test bench bench-quick install lint clean

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(PY) -m benchmarks --quick $(BENCH_ARGS)

install: $(STAMP)

# torch===X (exactly this version string): "==" also matches local builds such as 2.13.0+cpu,
# which a machine's local wheel folder may offer and pip then prefers; those compile no CUDA
# code.  PyPI's own Linux wheels are CUDA builds; the check after installing makes sure.
$(VENV)/.deps-$(TORCH_VERSION):
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install $(PIP_ARGS) "torch===$(TORCH_VERSION)" $(PY_DEPS)
	$(VENV)/bin/python -c "import sys, torch; sys.exit(0 if torch.version.cuda else \
	  f'make: torch {torch.__version__} in $(VENV) is a CPU build (torch.version.cuda is None), ' \
	  'so no CUDA kernel would be compiled or tested. Install a CUDA build of torch $(TORCH_VERSION) ' \
	  'there (PyPI\'s Linux wheels are), or use PYTHON=... to test with an interpreter of your own.')"
	touch $@

# The README's install command, editable so `import ampfused` uses the tree.
$(STAMP): $(DEPS) $(SOURCES)
	rm -f build/.installed-*
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	mkdir -p build && touch $@

CLANG_FORMAT := $(PY) -c "import sys, clang_format; sys.argv[0] = 'clang-format'; clang_format.clang_format()"

lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .
	$(CLANG_FORMAT) --dry-run --Werror $(LINT_CXX)

clean:
	rm -rf build *.egg-info ampfused/_C*.so
