# The README's two commands: `make demo` and `make test`. Both install what is missing first.
PYTHON ?= python3

.PHONY: install demo test bench

install:
	@$(PYTHON) scripts/check_install.py || $(PYTHON) -m pip install -e '.[test]'

demo: install
	$(PYTHON) examples/serve_demo.py

test: install
	$(PYTHON) -m pytest

bench: install
	$(PYTHON) benchmarks/batching_sweep.py
