# Two commands for a fresh machine: `make demo` (train on the built-in default) and `make test`; `make docs` builds the site.
# torch is pinned through a constraint file so CPU machines keep the CPU wheel.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: install install-test demo test docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/flowrl train

test: install
	$(BIN)/python -m pytest tests -n auto --dist loadgroup  # one worker per core (pytest-xdist); a group's tests on one

docs: install  # the site into site/ (mkdocs.yml; the test extra holds the docs extra); --strict: a broken link or a missing page is an error
	$(BIN)/mkdocs build --strict
