# `make test` and `make demo` each create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,demo]'
	touch $@

test: $(VENV)/.installed
	$(BIN)/python -m pytest -n 2 -q tests

# The demo's picture and summary table are copied to docs/ for the README.
demo: $(VENV)/.installed
	$(BIN)/python examples/train_mla_lm.py --out runs/demo
	mkdir -p docs
	cp runs/demo/report.png docs/demo_report.png
	cp runs/demo/summary.txt docs/demo_summary.txt

clean:
	rm -rf $(VENV) runs .pytest_cache
