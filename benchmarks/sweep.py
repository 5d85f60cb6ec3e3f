"""Sweep the launch parameters of one variant: the row copies' warps and bytes per warp per step,
(`routing`) the tokens per routing block, or (`registers`) the gathers' and scatters' register cap.

    python3 benchmarks/sweep.py [variant] [rows|routing|registers]        (needs a CUDA GPU)

Times are CUDA-graph replays, so they are GPU time only; the floor is the copy bandwidth.
"""

import importlib
import itertools
import sys
from pathlib import Path

import torch

from permgen import triton_host as host
from permgen.contract import combine_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402
from bench import call_styles, copy_bandwidth, graph_us, make_inputs, op_bytes, permute_kwargs  # noqa: E402

SHAPES = [shape for shape in bench.SHAPES if shape[0] in bench.LARGE]
SMALL = next(shape for shape in bench.SHAPES if shape[0] == "small")


def forget_geometry(backend):
    """The backend caches each shape's launch geometry: a changed setting counts from the next call."""
    for cache in (backend._routing_launch, backend._rows_launch, backend._gather_launch, backend._prob_grads_launch,
                  backend._scatter_launch):
        cache.cache_clear()


def sweep_register_caps(mod, bw):
    """The gathers' (unpermute) and scatters' (unpermute backward) times against their register cap,
    in each call style (mask routing: with and without topk)."""
    default = host._register_cap
    for (shape, N, H, E, k), call in itertools.product(SHAPES + [SMALL], call_styles(mod)):
        tokens, routing, probs, scale, _ = make_inputs(mod, N, H, E, k)
        M, kw = permute_kwargs(mod, N, E, k, hint=call == "topk")
        res = mod.permute(tokens, routing, probs, scale, **kw)
        permuted = torch.randn(M, H, device="cuda").to(combine_dtype(mod.VARIANT))
        grad = torch.randn(N, H, device="cuda").to(combine_dtype(mod.VARIANT))
        backward = res.row_id_map, grad, permuted, probs
        f_u = op_bytes("unpermute", mod, N, H, E, k, M, routing, probs) / bw * 1e6
        f_b = op_bytes("unpermute_bwd", mod, N, H, E, k, M, routing, probs) / bw * 1e6
        for regs in (32, 40, 48, 64):
            host._register_cap = lambda routes, scatter=False, regs=regs: regs
            forget_geometry(mod._ops.backend)
            t_u = graph_us(lambda: mod.unpermute(permuted, res.row_id_map, probs))
            t_b = graph_us(lambda: mod._ops.backend.unpermute_backward(*backward))
            print(f"{shape:12s} {call:5s} maxnreg={regs:3d}  unpermute {t_u:8.1f} us x{t_u / f_u:.3f}"
                  f"   unpermute backward (kernels) {t_b:8.1f} us x{t_b / f_b:.3f}", flush=True)
    host._register_cap = default
    forget_geometry(mod._ops.backend)


def sweep_routing_blocks(mod, bw):
    """permute's time against the tokens per routing block (route slots = tokens * k)."""
    default = host._block_tokens
    backend = mod._ops.backend
    for shape, N, H, E, k in SHAPES:
        tokens, routing, probs, scale, _ = make_inputs(mod, N, H, E, k)
        M, kw = permute_kwargs(mod, N, E, k)
        floor = op_bytes("permute", mod, N, H, E, k, M, routing, probs) / bw * 1e6
        for slots in (128, 256, 512, 1024, 2048):
            host._block_tokens = lambda k, slots=slots: max(1, slots // host._pow2(k))
            forget_geometry(backend)
            t = graph_us(lambda: mod.permute(tokens, routing, probs, scale, **kw))
            print(f"{shape:12s} route slots per block={slots:5d}  permute {t:8.1f} us x{t / floor:.3f}", flush=True)
        host._block_tokens = default
        forget_geometry(backend)


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "probs_bf16_index"
    mod = importlib.import_module(f"permgen.generated.triton.{name}")
    bw = copy_bandwidth()
    print(f"copy {bw / 1e9:.0f} GB/s; {name}")
    if sys.argv[2:] == ["routing"]:
        sweep_routing_blocks(mod, bw)
        return
    if sys.argv[2:] == ["registers"]:
        sweep_register_caps(mod, bw)
        return
    for shape, N, H, E, k in SHAPES + [SMALL]:
        tokens, routing, probs, scale, _ = make_inputs(mod, N, H, E, k)
        M, kw = permute_kwargs(mod, N, E, k)
        permuted = torch.randn(M, H, device="cuda").to(combine_dtype(mod.VARIANT))
        for warps, row_bytes in itertools.product((4, 8, 16), (256, 512, 1024)):
            host._NUM_WARPS, host._ROW_BYTES_PER_WARP = warps, row_bytes
            forget_geometry(mod._ops.backend)
            res = mod.permute(tokens, routing, probs, scale, **kw)
            t_p = graph_us(lambda: mod.permute(tokens, routing, probs, scale, **kw))
            t_u = graph_us(lambda: mod.unpermute(permuted, res.row_id_map, probs))
            f_p = op_bytes("permute", mod, N, H, E, k, M, routing, probs) / bw * 1e6
            f_u = op_bytes("unpermute", mod, N, H, E, k, M, routing, probs) / bw * 1e6
            print(f"{shape:12s} warps={warps:2d} bytes/warp={row_bytes:4d}  permute {t_p:8.1f} us x{t_p / f_p:.3f}"
                  f"   unpermute {t_u:8.1f} us x{t_u / f_u:.3f}", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            host._NUM_WARPS, host._ROW_BYTES_PER_WARP = 4, 512
            forget_geometry(mod._ops.backend)
            for _ in range(5):
                mod.unpermute(permuted, mod.permute(tokens, routing, probs, scale, **kw).row_id_map, probs)
            torch.cuda.synchronize()
        for e in sorted(p.key_averages(), key=lambda e: -e.device_time_total)[:5]:
            print(f"   {e.key:28s} {e.device_time_total / e.count:9.1f} us/call")


if __name__ == "__main__":
    main()
