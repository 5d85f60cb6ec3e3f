# permgen: `make generate` regenerates generated/ from variants.toml; `make test` runs the CPU suite.
# Both create .venv on first use. On a GPU machine with torch + triton installed, run
# `make test-gpu` / `make bench` with the system python instead.

PYTHON_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The torch the CPU suite is tested with. `torch==2.13.0` from PyPI is the CUDA build (several GB);
# the suite needs no GPU, so take the CPU build where you can: a local CPU wheel, or
# `make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: generate check list test test-gpu bench bench-ep bench-megatron clean gpu-ready

$(VENV)/.generator-deps:
	$(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q "jinja2>=3.1"
	touch $@

# megatron-core for tests/test_megatron.py: the newest release with a wheel for Python 3.11, without its
# torch requirement (which would pull the CUDA build); its imports need only numpy and packaging.
$(VENV)/.test-deps: pyproject.toml $(VENV)/.generator-deps
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "megatron-core==0.16.1"
	touch $@

generate: $(VENV)/.generator-deps
	$(PY) -m generator generate

check: $(VENV)/.generator-deps
	$(PY) -m generator check

list: $(VENV)/.generator-deps
	$(PY) -m generator list

test: $(VENV)/.test-deps
	$(PY) -m generator check
	$(PY) -m pytest -q -n 2 --dist worksteal tests

# On the GPU machine: the same suite, kernels running natively on the GPU (torch, triton, numpy,
# ml_dtypes, pytest, hypothesis preinstalled). The checkout is used as it is, not installed:
# permgen serves ../generated as permgen.generated. One worker per CPU core: most of the suite's
# time there is CPU work (compiling kernels, the NKI emulator), and the GPU has room for them all.
GPU_WORKERS ?= $(shell nproc 2>/dev/null || echo 8)
test-gpu: gpu-ready
	$(PYTHON_SYS) -m pytest -q -p no:cacheprovider -n $(GPU_WORKERS) --dist worksteal tests

bench: gpu-ready bench-megatron
	PYTHONPATH=$(CURDIR) $(PYTHON_SYS) benchmarks/bench_host.py --out benchmarks/results
	PYTHONPATH=$(CURDIR) $(PYTHON_SYS) benchmarks/bench.py --out benchmarks/results
	PYTHONPATH=$(CURDIR) $(PYTHON_SYS) benchmarks/bench_quantize.py --out benchmarks/results
	PYTHONPATH=$(CURDIR) $(PYTHON_SYS) benchmarks/bench_layer.py --out benchmarks/results

# Expert-parallel dispatch / combine over NCCL, one rank per GPU of the machine (world size 1 on one
# GPU; tests/test_ep.py runs over NCCL there too).
bench-ep: gpu-ready
	PYTHONPATH=$(CURDIR) $(PYTHON_SYS) -m torch.distributed.run \
		--nproc-per-node $$($(PYTHON_SYS) -c "import torch; print(torch.cuda.device_count())") \
		benchmarks/bench_ep.py --out benchmarks/results

# megatron-core's all-to-all token dispatcher in a training step, fused (permgen) against unfused, beside
# permgen's dispatch / combine: one rank per GPU over NCCL; skipped where megatron-core does not import.
# PYTHONPATH keeps what the caller had (where megatron-core was installed with --target).
bench-megatron: gpu-ready
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON_SYS) -m torch.distributed.run \
		--nproc-per-node $$($(PYTHON_SYS) -c "import torch; print(torch.cuda.device_count())") \
		benchmarks/bench_megatron.py --out benchmarks/results

# The GPU targets use the system Python's torch and a CUDA GPU: say so before anything runs.
gpu-ready:
	@$(PYTHON_SYS) -c "import torch, triton" 2>/dev/null || { echo "error: this target needs torch and triton in $(PYTHON_SYS) (a CUDA build) and a CUDA GPU; on a CPU-only machine run make test" >&2; exit 2; }
	@$(PYTHON_SYS) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "error: this target needs a CUDA GPU (torch.cuda.is_available() is False); on a CPU-only machine run make test" >&2; exit 2; }

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist *.egg-info
	find . -name __pycache__ -type d -prune -not -path "./.git/*" -exec rm -rf {} +
