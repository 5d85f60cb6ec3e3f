"""Mask against index routing, kernel by kernel: GPU time per kernel (profiler) and each compiled
kernel's registers and spills, at Mixtral's and Qwen3's shapes.

    python3 benchmarks/mask_diag.py        (needs a CUDA GPU)
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from bench import load, make_inputs, permute_kwargs, graph_us
from permgen import triton_host as host
from permgen.contract import combine_dtype

for shape in [(16384, 4096, 8, 2), (16384, 2048, 128, 8)]:
    N, H, E, k = shape
    for vname in ("probs_bf16_mask", "probs_bf16_index"):
        mod = load(vname)
        tokens, routing, probs, scale, ids = make_inputs(mod, N, H, E, k)
        M, kw = permute_kwargs(mod, N, E, k)
        res = mod.permute(tokens, routing, probs, scale, **kw)
        permuted = torch.randn(M, H, device="cuda").to(combine_dtype(mod.VARIANT))
        for _ in range(3):
            mod.unpermute(permuted, res.row_id_map, probs)
            mod.permute(tokens, routing, probs, scale, **kw)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            for _ in range(20):
                mod.permute(tokens, routing, probs, scale, **kw)
                mod.unpermute(permuted, res.row_id_map, probs)
            torch.cuda.synchronize()
        for e in sorted(p.key_averages(), key=lambda e: -e.device_time_total)[:4]:
            print(f"{shape} {vname:18s} {e.key[:60]:60s} {e.device_time_total / e.count:8.1f} us")
for entry in host._COMPILED.values():
    kernel, compiled, constexprs = entry[0], entry[1], entry[-1]
    print(f"{kernel.fn.__name__:55s} regs={getattr(compiled, 'n_regs', '?')} spills={getattr(compiled, 'n_spills', '?')} "
          f"constexprs={constexprs}")
