"""Every generated Triton kernel compiles ahead of time to a cubin for Hopper (and Blackwell), on the CPU.

The host code of each variant is driven on CPU tensors with launches recorded instead of run;
each recorded launch (signature + constexprs) is then compiled with triton.compile for a GPU
target: what the GPU machine would JIT-compile, checked without a GPU. Triton decides at import
time whether it interprets, so the compiling runs in a fresh process without TRITON_INTERPRET
(`python tests/test_triton_compile.py <variant>`).
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from cases import Case, combine_dtype, make_inputs, rows_are_fp8, variants_for  # noqa: E402

TRITON_VARIANTS = variants_for("triton")
ARCHS = [90, 100]
TYPE_CODES = {torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
              torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.bool: "i1"}


@pytest.mark.parametrize("name", TRITON_VARIANTS)
def test_every_kernel_compiles_for_gpu(name):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, name], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"compiled {name}:" in proc.stdout


def record_launches(module, jit_function_class):
    """Run permute, unpermute and both backward passes with every kernel launch recorded, not run."""
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    jit_function_class.run = record
    # Launches are recorded, never run: CPU tensors stand in for CUDA ones.
    module._ops.backend.check_device = lambda tokens: None
    module._ops.chunk_sort.kernels.check_device = lambda tokens: None
    v = module.VARIANT
    case = Case("aot", N=8, H=300, E=6, k=2)
    tokens, routing, probs, scale = make_inputs(v, case, "cpu", torch.Generator().manual_seed(0))
    if not rows_are_fp8(v):
        tokens.requires_grad_()
    if probs is not None:
        probs.requires_grad_()
    # num_out_tokens (and topk) keep the host from reading the unlaunched kernels' outputs.
    extra = {"topk": case.k} if v["routing"] == "mask" else {}
    res = module.permute(tokens, routing, probs, scale, num_experts=case.E, num_out_tokens=20,
                         check_routing=False, **extra)
    outputs = [res.tokens] if tokens.requires_grad else []
    outputs += [res.probs] if probs is not None else []
    if outputs:
        torch.autograd.grad(outputs, [t for t in (tokens, probs) if t is not None and t.requires_grad],
                            [torch.ones_like(o) for o in outputs])
    if probs is not None and tokens.requires_grad:  # the probs-only backward has its own kernel
        only_probs = module.permute(tokens.detach(), routing, probs, scale, num_experts=case.E, num_out_tokens=20,
                                    check_routing=False, **extra)
        torch.autograd.grad(only_probs.probs, probs, torch.ones_like(only_probs.probs))
    for chunk_probs in (None, torch.rand(case.N)):  # the target's chunk sort (permgen.triton.kernels), any variant
        module._ops.chunk_sort.sort("chunk sort", tokens.detach(), torch.tensor([3, 5]), torch.tensor([1, 0]),
                                    chunk_probs)
    module._ops.chunk_sort.kernels.gather_rows(torch.tensor([2, 0, 7], dtype=torch.int32), tokens.detach().view(torch.uint8))  # as permgen.ep
    permuted = torch.zeros(20, case.H, dtype=combine_dtype(v), requires_grad=True)
    for merging in ([None, torch.rand(probs.shape, requires_grad=True)] if probs is not None else [None]):
        out = module.unpermute(permuted, res.row_id_map, merging)
        torch.autograd.grad(out, [t for t in (permuted, merging) if t is not None], torch.ones_like(out))
    return launches


def signature_of(fn, args, kwargs):
    signature, constexprs = {}, {}
    for i, param in enumerate(fn.params):
        value = args[i] if i < len(args) else kwargs[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPE_CODES[value.dtype]
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif value is None:  # STYLE.md: no None pointers passed to kernels
            raise TypeError(f"{fn.__name__}: launched with {param.name}=None; pass a real buffer or "
                            "generate a kernel without the argument")
        else:
            raise TypeError(f"{fn.__name__}: unexpected argument {param.name}={value!r}")
    return signature, constexprs


def compile_variant(name):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from permgen.triton import kernels as triton_kernels

    module = importlib.import_module(f"permgen.generated.triton.{name}")
    launches = record_launches(module, JITFunction)
    kernels = {getattr(module, n) for n in dir(module) if n.endswith("_kernel")}
    shared = {getattr(triton_kernels, n) for n in dir(triton_kernels) if n.endswith("_kernel")}
    launched = {fn for fn, _, _ in launches}
    assert kernels <= launched, f"kernels never launched: {sorted(k.__name__ for k in kernels - launched)}"
    # The rest are the target's kernels that no variant axis changes (the routing plan, unpermute, the
    # backward passes, the chunk sort): every variant launches those of its routing kind.
    assert launched <= kernels | shared, sorted(k.__name__ for k in launched - kernels - shared)
    seen = set()
    for fn, args, kwargs in launches:
        signature, constexprs = signature_of(fn, args, kwargs)
        key = (fn.__name__, tuple(signature.items()), tuple(constexprs.items()))
        if key in seen:
            continue
        seen.add(key)
        for arch in ARCHS:
            compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                                      options={name: kwargs[name] for name in ("num_warps", "maxnreg") if name in kwargs})
            assert compiled.asm.get("cubin"), f"{fn.__name__}: no cubin for sm_{arch}"
            assert f"sm_{arch}" in compiled.asm["ptx"], f"{fn.__name__}: PTX is not for sm_{arch}"
    print(f"compiled {name}: {len(seen)} kernel specialisations x sm_{', sm_'.join(map(str, ARCHS))}")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"
    compile_variant(sys.argv[1])
