# The README's two commands: `make demo` and `make test`. Both install what is missing first.
PYTHON ?= python3
STAMP := build/.installed-$(shell $(PYTHON) -c 'import sys; print(sys.prefix.replace("/", "_"))')

.PHONY: install demo test bench

$(STAMP): pyproject.toml
	$(PYTHON) -m pip install -e '.[test]'
	mkdir -p build && touch $@

install: $(STAMP)

demo: install
	$(PYTHON) examples/offline_demo.py

test: install
	$(PYTHON) -m pytest

bench: install
	$(PYTHON) benchmarks/bench_offline_batching.py
