# `make test`, `make demo` and `make study` each create a virtualenv and install what they need.
# `make demo` and `make study` write only under runs/ (git-ignored); `make demo-docs` and
# `make study-docs` also refresh the pictures and tables the README shows, under docs/.
# PYTHON picks the interpreter (`make test PYTHON=python3.12`); each gets its own virtualenv,
# .venv for the default python3 and .venv-<interpreter> otherwise.
PYTHON ?= python3
VENV ?= $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
BIN := $(VENV)/bin

.PHONY: venv test demo demo-docs study study-docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# --no-compile: Python compiles a dependency's modules when they are first imported, not all of
# them at install (transformers alone has thousands the tests never import).
# The gemma package's tests (tests/test_gemma_package.py) install gemma without its
# dependencies: through kauldron they pull tensorflow (about 2 GB); gemma's attention needs
# none of them, and the tests stand in for the two kauldron names it imports.
GEMMA := 'gemma==3.3.0; python_version < "3.12"' 'gemma==4.0.1; python_version >= "3.12"'
# The trainers' own packages (tests/test_maxtext_package.py, tests/test_tunix_package.py).
# MaxText 0.2.5 needs Python >= 3.12 and JAX >= 0.11: the Python 3.12 suite only. It declares no
# dependencies beyond its cuda12/tpu extras (about 250 pins, torch among them): it goes in
# without them, and MAXTEXT_DEPS are what its decoders, loss and train state import. Tunix
# (both suites): its own dependencies pull transformers 5 (no Flax models) and safetensors<0.8,
# which the test extra cannot take; it goes in without them, with what its models and
# PeftTrainer import (sentencepiece: 0.2.3 with MaxText's on 3.12; 0.2.2 on 3.11, where gemma's
# protobuf fails to import 0.2.3).
PY312 := ; python_version >= "3.12"
MAXTEXT := 'maxtext==0.2.5$(PY312)'
MAXTEXT_DEPS := $(foreach p,omegaconf==2.4.0 pathwaysutils==0.1.13 jinja2==3.1.6 grain==0.2.18 drjax==0.2.1 \
  aqtp==0.9.0 tiktoken==0.14.0 sentencepiece==0.2.3 sympy==1.14.0,'$(p)$(PY312)')
TUNIX := google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 wrapt==2.5.2 perfetto==0.59.1 pandas==3.1.1 \
  einops==0.8.2 'sentencepiece==0.2.2; python_version < "3.12"'

$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -e '.[test,demo]' $(MAXTEXT_DEPS)
	$(BIN)/python -m pip install -q --no-compile --no-deps $(GEMMA) $(MAXTEXT) $(TUNIX)
	touch $@

# The virtualenv alone, with what the tests and the demo need (`.ci/run` builds both of its
# interpreters' side by side before running either suite).
venv: $(VENV)/.installed

# PYTHONDONTWRITEBYTECODE is emptied for the tests: with it set (some CI images do) and the
# dependencies installed --no-compile, every test process compiles every module it imports from
# source (jax, flax, transformers, MaxText and Tunix: 25-29 s against 9-11 s from bytecode, in
# each worker and subprocess); emptied, the first import writes the bytecode into the venv.
# --max-worker-restart=0: a worker that crashes ends the run, which names the test it ran
# (pytest-xdist 3.8 reruns that test in a new worker and, under --dist loadfile, can then wait
# forever: a crashed CI run hung until its time ran out).
test: $(VENV)/.installed
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n 2 --dist loadfile --max-worker-restart=0 -q --durations=20 tests

demo: $(VENV)/.installed
	$(BIN)/python examples/train_mla_lm.py --out runs/demo

# The demo, then its picture and summary table copied to docs/ for the README.
demo-docs: demo
	mkdir -p docs
	cp runs/demo/report.png docs/demo_report.png
	cp runs/demo/summary.txt docs/demo_summary.txt

# The stability study (examples/stability_study.py): every arm over 3 seeds, tau ablation.
study: $(VENV)/.installed
	$(BIN)/python examples/stability_study.py --out runs/study

# The study, with study.md and its pictures copied to docs/study/ for the README.
study-docs: $(VENV)/.installed
	$(BIN)/python examples/stability_study.py --out runs/study --docs docs/study

clean:
	rm -rf .venv .venv-* runs .pytest_cache
