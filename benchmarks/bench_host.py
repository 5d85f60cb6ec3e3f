"""What each public call costs the host, beside the launch floor measured in the same process.

    python3 benchmarks/bench_host.py --out benchmarks/results      (make bench; a CUDA GPU)
    TRITON_INTERPRET=1 python3 benchmarks/bench_host.py --smoke    (CPU: checks the script, not the speed)

At a small shape (N=1024, H=1024, E=16, k=2), where the host, not the GPU, sets the time, every
public call is timed as users make it (TransformerEngine-style arguments, no hints): the host time
per call (calls back to back, synchronised per block of calls: the GPU is idle behind them), the GPU
operations it starts (kernels and memsets, counted by the profiler, one call), and the host reads it
makes (torch.cuda.set_sync_debug_mode, one call). A backward pass is the difference between
forward + torch.autograd.grad and the forward alone; torch's own share of that (autograd.grad and the
engine through one pointwise op's backward) is reported beside it. The floor of a call is its launches at the cost
of a bare Triton launch measured in this process (a one-program kernel launched the way Triton's
users launch it); the target is host time <= 1.5x that floor. Also the eager round trip (permute,
unpermute) against its replay from a CUDA graph (target <= 3x), and one torch pointwise op.
Dispatch and combine run in a one-rank NCCL group (dropless and capacity mode).
Writes bench_host.json and bench_host.txt into --out.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import permgen  # noqa: E402
from permgen import (moe_permute, moe_permute_and_pad_with_probs, moe_permute_with_probs,  # noqa: E402
                     moe_sort_chunks_by_index, moe_sort_chunks_by_index_with_probs, moe_unpermute)
from common import captured, per_call_us, sync  # noqa: E402  (benchmarks/, this script's folder)
from tables import run_metadata  # noqa: E402

sys.path.append(str(ROOT / "tests"))
from cases import host_reads  # noqa: E402  (host reads counted as tests/test_host_path.py counts them)

SHAPE = (1024, 1024, 16, 2)  # N, H, E, k
SMOKE_SHAPE = (16, 32, 4, 2)
CALL_TARGET = 1.5  # host time / (launches x a bare launch)
GRAPH_TARGET = 3.0  # eager round trip / its CUDA-graph replay


@triton.jit
def _bare_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)


def host_us(fn, calls, blocks=7):
    """Host time per call: the fastest of `blocks` blocks of `calls` back-to-back calls, each synchronised."""
    return per_call_us(fn, calls, blocks, warmup=min(20, calls), fastest=True)


def gpu_operations(fn):
    """Kernels and memsets one call starts (the profiler's device events), and host reads it makes
    (counted as the tests count them)."""
    if not torch.cuda.is_available():
        return None, None
    fn()
    sync()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower())
    sync()
    host_reads(fn)  # the second call's count: the first under the debug mode may make one-time reads
    sync()
    return launches, host_reads(fn)


def _one_rank_group(device):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    return dist.group.WORLD


def calls_to_time(device, shape):
    """name -> (forward, backward or None): the calls a user makes, on fresh inputs of the shape."""
    N, H, E, k = shape
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randn(N, H, device=device, generator=g).to(torch.bfloat16)
    ids = torch.rand(N, E, device=device, generator=g).topk(k, dim=1).indices
    mask = torch.zeros(N, E, dtype=torch.bool, device=device).scatter_(1, ids, True)
    probs = torch.rand(N, E, device=device, generator=g) * mask
    ids = ids.to(torch.int32)
    permuted = torch.randn(N * k, H, device=device, generator=g).to(torch.bfloat16)
    grad = torch.randn(N, H, device=device, generator=g).to(torch.bfloat16)
    grad_rows = torch.randn(N * k, H, device=device, generator=g).to(torch.bfloat16)
    grad_probs = torch.randn(N * k, device=device, generator=g)
    split = torch.full((E,), N * k // E, device=device)
    split[0] += N * k - int(split.sum())
    order = torch.randperm(E, generator=torch.Generator().manual_seed(1)).to(device)
    mod = permgen.get_kernel("triton", dtype="bf16", routing="mask", probs=True)
    tok_g, probs_g, permuted_g = (t.clone().requires_grad_() for t in (tokens, probs, permuted))
    row_id_map = moe_permute_with_probs(tokens, probs, mask, num_out_tokens=N * k)[2]
    result = mod.permute(tokens, mask, probs, num_out_tokens=N * k)

    def grads(outs, inputs, out_grads):
        return lambda: torch.autograd.grad(outs(), inputs, out_grads)

    calls = {
        "module permute (num_out_tokens)": (lambda: mod.permute(tokens, mask, probs, num_out_tokens=N * k), None),
        "module permute (no cap)": (lambda: mod.permute(tokens, mask, probs), None),
        "module unpermute": (lambda: mod.unpermute(permuted, result.row_id_map, probs), None),
        "module permute + backward": (
            lambda: mod.permute(tok_g, mask, probs_g, num_out_tokens=N * k),
            grads(lambda: mod.permute(tok_g, mask, probs_g, num_out_tokens=N * k)[:2], (tok_g, probs_g),
                  (grad_rows, grad_probs))),
        "module unpermute + backward": (
            lambda: mod.unpermute(permuted_g, result.row_id_map, probs_g),
            grads(lambda: mod.unpermute(permuted_g, result.row_id_map, probs_g), (permuted_g, probs_g), grad)),
        "moe_permute (mask, num_out_tokens=-1)": (lambda: moe_permute(tokens, mask), None),
        "moe_permute (mask, num_out_tokens)": (lambda: moe_permute(tokens, mask, num_out_tokens=N * k), None),
        "moe_permute (index)": (lambda: moe_permute(tokens, ids, map_type="index"), None),
        "moe_permute_with_probs": (lambda: moe_permute_with_probs(tokens, probs, mask, num_out_tokens=N * k), None),
        "moe_permute_and_pad_with_probs": (
            lambda: moe_permute_and_pad_with_probs(tokens, probs, mask, split, 128), None),
        "moe_unpermute": (lambda: moe_unpermute(permuted, row_id_map, restore_shape=tokens.shape), None),
        "moe_unpermute + backward": (
            lambda: moe_unpermute(permuted_g, row_id_map, restore_shape=tokens.shape),
            grads(lambda: moe_unpermute(permuted_g, row_id_map, restore_shape=tokens.shape), (permuted_g,),
                  grad)),
        "moe_sort_chunks_by_index": (lambda: moe_sort_chunks_by_index(permuted, split, order), None),
        "moe_sort_chunks_by_index_with_probs + backward": (
            lambda: moe_sort_chunks_by_index_with_probs(permuted_g, probs_g.reshape(-1)[:N * k], split, order),
            grads(lambda: moe_sort_chunks_by_index_with_probs(permuted_g, probs_g.reshape(-1)[:N * k], split,
                                                                order), (permuted_g,), (grad_rows, grad_probs))),
    }
    group = _one_rank_group(device)
    for mode, capacity in (("dropless", None), ("capacity", N * k)):
        def dispatch(t=tokens, p=probs, capacity=capacity):
            return mod.dispatch(t, mask, p, group=group, recv_capacity=capacity)
        handle = dispatch().handle
        out = dispatch().tokens
        calls[f"dispatch ({mode})"] = (dispatch, None)
        calls[f"combine ({mode})"] = (lambda out=out, handle=handle: mod.combine(out, handle, probs), None)
    return calls, (tokens, mask, probs, permuted, mod, N * k)


def round_trip(device, tokens, mask, probs, permuted, mod, rows, calls):
    def step():
        res = mod.permute(tokens, mask, probs, num_out_tokens=rows)
        return mod.unpermute(permuted, res.row_id_map, probs)

    eager = host_us(step, calls)
    if device != "cuda":
        return dict(eager_us=round(eager, 1))
    graph = captured(step, warmups=3)
    replay = host_us(graph.replay, calls)
    graph.reset()
    return dict(eager_us=round(eager, 1), graph_replay_us=round(replay, 1), ratio=round(eager / replay, 2),
                target=GRAPH_TARGET)


def measure(device, shape, calls_per_block):
    bare_input = torch.zeros(1024, device=device)
    bare = host_us(lambda: _bare_kernel[(1,)](bare_input, 1000, BLOCK=1024), calls_per_block)
    one_op = host_us(lambda: bare_input * 2, calls_per_block)
    # torch's own share of a backward pass (torch.autograd.grad, the engine) through one pointwise op
    leaf, leaf_grad = torch.zeros(1024, device=device, requires_grad=True), torch.ones(1024, device=device)
    autograd_floor = host_us(lambda: torch.autograd.grad(leaf * 2, (leaf,), (leaf_grad,)), calls_per_block) - one_op
    calls, inputs = calls_to_time(device, shape)
    rows = {}
    for name, (forward, backward) in calls.items():
        us = host_us(backward or forward, calls_per_block)
        launches, reads = gpu_operations(backward or forward)
        if backward is not None:  # the backward pass alone: less the forward's share
            us -= host_us(forward, calls_per_block)
            fwd_launches, fwd_reads = gpu_operations(forward)
            if launches is not None:
                launches, reads = launches - fwd_launches, reads - fwd_reads
            name = name.replace(" + backward", " backward")
        row = dict(host_us=round(us, 1), launches=launches, host_reads=reads)
        if launches:
            row["ratio"] = round(us / (launches * bare), 2)
        rows[name] = row
        print(f"{name:48s} {us:7.1f} us  launches {launches}  reads {reads}  ratio {row.get('ratio')}", flush=True)
    trip = round_trip(device, *inputs, calls_per_block)
    print("round trip:", trip, flush=True)
    return dict(run=run_metadata(), shape=dict(zip("NHEk", shape)), bare_triton_launch_us=round(bare, 1), one_torch_op_us=round(one_op, 1),
                autograd_floor_us=round(autograd_floor, 1),
                call_target=CALL_TARGET, calls=rows, round_trip=trip)


def render(result) -> str:
    run = result["run"]
    lines = [f"Host time per call on {run['gpu']} (torch {run['torch']}, Triton {run['triton']}), "
             f"N={result['shape']['N']} H={result['shape']['H']} E={result['shape']['E']} k={result['shape']['k']}",
             f"`{run['command']}`", "",
             f"floor: a bare Triton launch {result['bare_triton_launch_us']} us; one torch pointwise op "
             f"{result['one_torch_op_us']} us. ratio = host time / (launches x a bare launch), target <= "
             f"{result['call_target']}. A backward pass also pays torch's autograd (torch.autograd.grad and "
             f"the engine): {result.get('autograd_floor_us')} us through one pointwise op's backward.", "",
             "| call | host us | launches | host reads | ratio |", "|---|---|---|---|---|"]
    for name, row in result["calls"].items():
        lines.append(f"| {name} | {row['host_us']} | {row['launches']} | {row['host_reads']} | "
                     f"{row.get('ratio', '')} |")
    trip = result["round_trip"]
    lines += ["", f"eager round trip (permute + unpermute): {trip['eager_us']} us"
              + (f"; replayed from a CUDA graph {trip['graph_replay_us']} us: {trip['ratio']}x (target <= "
                 f"{trip['target']})" if "ratio" in trip else "")]
    met = sum(1 for row in result["calls"].values() if row.get("ratio") is not None and row["ratio"] <= CALL_TARGET)
    counted = sum(1 for row in result["calls"].values() if row.get("ratio") is not None)
    lines.append(f"calls within {CALL_TARGET}x their launch floor: {met} of {counted}")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    assert device == "cpu" or torch.cuda.is_available(), "needs a CUDA GPU (or --smoke on the CPU)"
    result = measure(device, SMOKE_SHAPE if args.smoke else SHAPE, 3 if args.smoke else args.calls)
    text = render(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_host.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "bench_host.txt").write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
