# permgen: `make generate` regenerates generated/ from variants.toml; `make test` runs the CPU suite.
# Both create .venv on first use. On a GPU machine with torch + triton installed, run
# `make test-gpu` / `make bench` with the system python instead.

PYTHON_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build this project is tested with; the suite needs no GPU.
TORCH_SPEC ?= torch==2.13.0

.PHONY: generate check list test test-gpu bench bench-ep clean

$(VENV)/.generator-deps:
	$(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q "jinja2>=3.1"
	touch $@

$(VENV)/.test-deps: pyproject.toml $(VENV)/.generator-deps
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

generate: $(VENV)/.generator-deps
	$(PY) -m generator generate

check: $(VENV)/.generator-deps
	$(PY) -m generator check

list: $(VENV)/.generator-deps
	$(PY) -m generator list

test: $(VENV)/.test-deps
	$(PY) -m generator check
	$(PY) -m pytest -q -n 2 tests

# On the GPU machine: the same suite, kernels running natively on the GPU (torch, triton, numpy,
# ml_dtypes, pytest, hypothesis preinstalled). The checkout is used as it is, not installed:
# permgen serves ../generated as permgen.generated.
test-gpu:
	$(PYTHON_SYS) -m pytest -q -p no:cacheprovider -n 8 tests

bench:
	PYTHONPATH=$(CURDIR) $(PYTHON_SYS) benchmarks/bench.py --out benchmarks/results
	PYTHONPATH=$(CURDIR) $(PYTHON_SYS) benchmarks/bench_quantize.py --out benchmarks/results

# Expert-parallel dispatch / combine on 2 GPUs over NCCL (tests/test_ep.py runs over NCCL there too).
bench-ep:
	PYTHONPATH=$(CURDIR) $(PYTHON_SYS) -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_ep.py --out benchmarks/results

clean:
	rm -rf $(VENV) .pytest_cache
