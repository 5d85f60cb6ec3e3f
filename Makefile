# permgen: `make help` lists the targets. The CPU targets create .venv on first use; the GPU targets
# (test-gpu, bench*) use the system python's torch and triton.

PYTHON_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The torch the CPU suite is tested with. `torch==2.13.0` from PyPI is the CUDA build (several GB);
# the suite needs no GPU, so take the CPU build where you can: a local CPU wheel, or
# `make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: help generate check list vendor test test-cpu-torch wheel test-gpu bench bench-ep bench-megatron \
	nki-cost nki-a2av-cost clean gpu-ready

# The variant `make vendor` writes, and where.
VARIANT ?=
OUT ?= $(VARIANT).py

help:
	@echo "make generate                 regenerate generated/ from variants.toml (creates .venv with Jinja2)"
	@echo "make check                    name the files of generated/ that are out of date"
	@echo "make list                     list the variants of variants.toml"
	@echo "make vendor VARIANT=<name>    write one self-contained Triton file, <name>.py (OUT=FILE to rename)"
	@echo "make test                     the CPU suite, as CI runs it (installs torch==2.13.0 from PyPI: CUDA, GBs)"
	@echo "make test-cpu-torch           the same, installing the CPU-only torch build instead"
	@echo "make wheel                    build dist/permgen-*.whl from a clean build/"
	@echo "make clean                    remove .venv, build/, dist/, caches"
	@echo "make test-gpu                 the suite on a CUDA GPU, with the system python"
	@echo "make bench                    the single-GPU benchmarks and megatron's dispatcher (CUDA GPU)"
	@echo "make bench-ep                 expert-parallel dispatch / combine, one rank per GPU (CUDA GPU)"
	@echo "make bench-megatron           megatron-core's dispatcher step, fused against unfused (CUDA GPU)"
	@echo "make nki-cost                 the NKI kernels' instruction and DMA counts, in the CPU emulator (LNC=2)"
	@echo "make nki-a2av-cost            the same for the NKI expert-parallel kernels"

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

vendor: $(VENV)/.generator-deps
	@test -n "$(VARIANT)" || { echo "error: name the variant: make vendor VARIANT=<name> (make list shows them)" >&2; exit 2; }
	$(PY) -m generator vendor $(VARIANT) -o $(OUT)

test: $(VENV)/.test-deps
	$(PY) -m generator check
	$(PY) -m pytest -q -n 2 --dist worksteal tests

# The suite needs no GPU: the CPU-only torch is a fraction of the CUDA build's download.
test-cpu-torch:
	$(MAKE) test TORCH_SPEC="$(TORCH_SPEC) --index-url https://download.pytorch.org/whl/cpu"

# setuptools copies build/lib into the wheel as it finds it, so a variant removed since the last
# build would ship again: build from an empty build/.
wheel: $(VENV)/.generator-deps
	rm -rf build
	$(PY) -m pip wheel -q --no-deps -w dist .
	rm -rf build

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
	$(PYTHON_SYS) benchmarks/tables.py   # the docs' tables and figures from the new results

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

# What the NKI kernels issue (instructions, indirect DMAs, DMA bytes), counted by the CPU emulator:
# docs/trainium.md's tables. Minutes of CPU each; LNC=1 is faster.
nki-cost: $(VENV)/.test-deps
	$(PY) benchmarks/nki_cost.py

nki-a2av-cost: $(VENV)/.test-deps
	$(PY) benchmarks/nki_a2av_cost.py

# The GPU targets use the system Python's torch and a CUDA GPU: say so before anything runs.
gpu-ready:
	@$(PYTHON_SYS) -c "import torch, triton" 2>/dev/null || { echo "error: this target needs torch and triton in $(PYTHON_SYS) (a CUDA build) and a CUDA GPU; on a CPU-only machine run make test" >&2; exit 2; }
	@$(PYTHON_SYS) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "error: this target needs a CUDA GPU (torch.cuda.is_available() is False); on a CPU-only machine run make test" >&2; exit 2; }

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist *.egg-info
	find . -name __pycache__ -type d -prune -not -path "./.git/*" -exec rm -rf {} +
