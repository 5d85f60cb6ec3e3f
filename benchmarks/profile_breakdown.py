"""Where the time goes: host cost per call of each piece, and GPU time per kernel.

    python3 benchmarks/profile_breakdown.py [variant]        (needs a CUDA GPU)
"""

import importlib
import sys
import time
from pathlib import Path

import torch

from permgen.contract import combine_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import make_inputs, permute_kwargs  # noqa: E402


def host_us(fn, calls=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "probs_bf16_mask"
    mod = importlib.import_module(f"permgen.generated.triton.{name}")
    N, H, E, k = 1024, 1024, 16, 2
    tokens, routing, probs, scale, _ = make_inputs(mod, N, H, E, k)
    M, kw = permute_kwargs(mod, N, E, k, rows=N * k)
    res = mod.permute(tokens, routing, probs, scale, **kw)
    permuted = torch.randn(M, H, device="cuda").to(combine_dtype(mod.VARIANT))
    out = torch.empty(N, H, device="cuda", dtype=combine_dtype(mod.VARIANT))
    rm = res.row_id_map
    print(f"host us per call, {name}, N={N} H={H} E={E} k={k}")
    print(f"  torch.empty                 {host_us(lambda: torch.empty(N, H, device='cuda')):7.1f}")
    print(f"  torch.zeros(1)              {host_us(lambda: torch.zeros(1, dtype=torch.int32, device='cuda')):7.1f}")
    print(f"  slice + view                {host_us(lambda: out[2:10].view(-1)):7.1f}")
    print(f"  current stream handle       {host_us(lambda: torch.cuda.current_stream().cuda_stream):7.1f}")
    gather = getattr(mod, f"{name}_sum_routes_kernel")
    meta = {name: value for name, value in mod._ops.backend._gather_meta(rm, 1024).items() if name != "maxnreg"}
    launch_us = host_us(lambda: gather[(N,)](permuted, rm.row_map, out, N, M, H, **meta))
    print(f"  one triton launch (gather)  {launch_us:7.1f}")
    compiled = gather[(N,)](permuted, rm.row_map, out, N, M, H, **meta)
    values = (permuted, rm.row_map, out, N, M, H, *(v for name, v in meta.items() if name != "num_warps"))
    print(f"  compiled[grid](*args)       {host_us(lambda: compiled[(N, 1, 1)](*values)):7.1f}")
    stream = torch.cuda.current_stream().cuda_stream
    compiled._init_handles()
    raw = lambda: compiled.run(N, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)  # noqa: E731
    try:
        print(f"  compiled.run(...) raw       {host_us(raw):7.1f}")
    except Exception as exc:  # the launcher's signature differs between Triton versions
        print(f"  compiled.run(...) raw       failed: {exc}")
    print(f"  permute                     {host_us(lambda: mod.permute(tokens, routing, probs, scale, **kw)):7.1f}")
    print(f"  unpermute                   {host_us(lambda: mod.unpermute(permuted, rm, probs)):7.1f}")
    print(f"  round trip                  {host_us(lambda: mod.unpermute(permuted, mod.permute(tokens, routing, probs, scale, **kw).row_id_map, probs)):7.1f}")

    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        mod.permute(tokens, routing, probs, scale, **kw)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)

    # GPU time per kernel at a large shape
    N, H, E, k = 16384, 7168, 256, 8
    tokens, routing, probs, scale, _ = make_inputs(mod, N, H, E, k)
    _, kw = permute_kwargs(mod, N, E, k)
    for _ in range(3):
        mod.permute(tokens, routing, probs, scale, **kw)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            mod.permute(tokens, routing, probs, scale, **kw)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
