# The README's two commands: `make demo` and `make test` (ruff's lint and format check, then pytest). Both install
# what is missing first.
PYTHON ?= python3

.PHONY: install demo lint test bench

install:
	@$(PYTHON) scripts/check_install.py || $(PYTHON) -m pip install -e '.[test]'
	@sh scripts/install_browser.sh

demo: install
	$(PYTHON) examples/serve_demo.py

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: lint
	$(PYTHON) -m pytest

bench: install
	$(PYTHON) benchmarks/batching_sweep.py
