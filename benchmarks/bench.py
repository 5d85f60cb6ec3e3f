"""GPU benchmark of the generated Triton kernels against the copy floor and a PyTorch-native path.

    python3 benchmarks/bench.py --out benchmarks/results        (make bench; needs a CUDA GPU)

For every op and shape it reports the median time (triton.testing.do_bench), the bytes the op
must move, effective GB/s, the ratio to the floor (those bytes at the device-to-device copy
bandwidth measured in the same run), the PyTorch-native path's time and, where megatron-core is
installed, the time of its unfused permutation (moe_utils with fused=False). permute's time includes
all routing-map processing. Writes bench.json and bench.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

import permgen
from permgen.core.contract import combine_dtype, token_dtype
from common import per_call_us  # benchmarks/, this script's folder
from tables import run_metadata

ROOT = Path(__file__).resolve().parent.parent

try:  # megatron-core's unfused permutation: the peer a Megatron user without TransformerEngine runs
    from megatron.core.transformer.moe import moe_utils as MOE_UTILS
except ImportError:
    MOE_UTILS = None


SHAPES = [  # name, N, H, E, k
    ("deepseek_v3", 16384, 7168, 256, 8),
    ("qwen3_moe", 16384, 2048, 128, 8),
    ("mixtral", 16384, 4096, 8, 2),
    ("deepseek_v3_4k", 4096, 7168, 256, 8),
    ("small", 1024, 1024, 16, 2),
]
LARGE = {"deepseek_v3", "qwen3_moe", "mixtral"}
VARIANTS = ["probs_bf16_mask", "probs_bf16_index", "probs_pad128_bf16_mask", "probs_pad128_fp8e4m3_block128_mask"]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def copy_bandwidth():
    """Bytes read + written per second by a device-to-device copy of 2 GiB."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src)) * 1e-6
    return 2 * src.numel() * src.element_size() / t


@triton.jit
def _broadcast_rows(src_ptr, dst_rows_ptr, out_ptr, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Permute's data movement without its routing: token row t is read once and written to the K
    rows dst_rows[t, :] (one program per token, one chunk of the row per step)."""
    token = tl.program_id(0)
    dst = tl.load(dst_rows_ptr + token * K + tl.arange(0, K)).to(tl.int64)[:, None] * hidden
    src = src_ptr + token.to(tl.int64) * hidden
    for h0 in range(0, hidden, BLOCK_H):
        col = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(src + col, mask=col < hidden)
        tl.store(out_ptr + dst + col[None, :], tl.broadcast_to(x[None, :], (K, BLOCK_H)), mask=(col < hidden)[None, :])


def expert_sorted_rows(N, E, k):
    """dst rows [N, k] in permute's layout (expert-major, ascending token within an expert) for random
    top-k experts."""
    experts = torch.rand(N, E, device="cuda").topk(k, dim=1).indices
    order = experts.flatten().argsort(stable=True)
    rows = torch.empty(N * k, dtype=torch.int32, device="cuda")
    rows[order] = torch.arange(N * k, dtype=torch.int32, device="cuda")
    return rows.view(N, k)


def reference_bandwidths():
    """Data movement with permute's shape of traffic, for context (GB/s, read + written): a write-only
    memset, permute's row copy without any routing (Triton, each row read once and written to 8
    expert-sorted rows: the ceiling permute's copy can reach), and PyTorch's broadcast copy."""
    N, H, k = 16384, 7168, 8
    tokens = torch.randn(N, H, device="cuda").to(torch.bfloat16)
    out = torch.empty(N, k, H, device="cuda", dtype=torch.bfloat16)
    words = out.view(torch.int32)  # PyTorch fills int32 with 16-byte stores, bf16 with 8-byte ones
    n = out.numel() * 2 + tokens.numel() * 2
    t_fill = bench(lambda: words.zero_()) * 1e-6
    rows = expert_sorted_rows(N, 256, k)
    t_triton = bench(lambda: _broadcast_rows[(N,)](tokens, rows, out, H, K=k, BLOCK_H=1024, num_warps=4)) * 1e-6
    t_torch = bench(lambda: out.copy_(tokens[:, None, :].expand(N, k, H))) * 1e-6
    return {"write-only memset": round(out.numel() * 2 / t_fill / 1e9, 1),
            "Triton 1-read-8-writes broadcast, no routing": round(n / t_triton / 1e9, 1),
            "PyTorch 1-read-8-writes broadcast copy": round(n / t_torch / 1e9, 1)}


def make_inputs(mod, N, H, E, k, seed=0):
    v = mod.VARIANT
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randn(N, H, device="cuda", generator=g).to(token_dtype(v))
    logits = torch.randn(N, E, device="cuda", generator=g)
    top_probs, ids = logits.softmax(-1).topk(k, dim=-1)
    if v["routing"] == "mask":
        routing = torch.zeros(N, E, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
        probs = torch.zeros(N, E, device="cuda").scatter_(1, ids, top_probs)
    else:
        routing, probs = ids.to(torch.int32), top_probs.contiguous()
    scale = None
    if v["scale"] == "block128":
        scale = torch.rand(N, triton.cdiv(H, 128), device="cuda", generator=g)
    return tokens, routing, probs, scale, ids


def permute_kwargs(mod, N, E, k, rows=None, hint=False):
    """(M, permute's keyword arguments) for a benchmark call. num_out_tokens = M, by default a static
    row cap that fits every padded layout, so permute does not synchronise with the host. The call
    users make (TransformerEngine's arguments) gives no topk; hint=True adds it (mask routing)."""
    pad = mod.VARIANT["pad"]
    M = rows if rows is not None else N * k + (E * (pad - 1) if pad else 0)
    kw = dict(num_experts=E, num_out_tokens=M)
    if hint:
        kw["topk"] = k
    return M, kw


def call_styles(mod):
    """How permute is called: without hints (first: what users call), and with topk for mask routing."""
    return ("plain", "topk") if mod.VARIANT["routing"] == "mask" else ("plain",)


def load(vname):
    return permgen.get_kernel("triton", **{a: permgen.VARIANTS[vname][a] for a in ("dtype", "routing", "probs",
                                                                                   "scale", "pad")})


# ---- the PyTorch-native path (as a non-fused Megatron dispatcher does it) ----------------------

def torch_permute(tokens, ids, probs_topk, num_experts, pad):
    """Sort routes by expert (stable), gather rows; pad segments by index arithmetic."""
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    src_token = order // k
    permuted = tokens.index_select(0, src_token)
    permuted_probs = probs_topk.reshape(-1).index_select(0, order)
    if pad:
        counts = torch.bincount(flat, minlength=num_experts)
        padded = (counts + pad - 1) // pad * pad
        dst = torch.repeat_interleave(torch.cumsum(padded, 0) - padded - (torch.cumsum(counts, 0) - counts), counts)
        dst = dst + torch.arange(flat.numel(), device=flat.device)
        out = torch.zeros(int(padded.sum()), tokens.shape[1], dtype=tokens.dtype, device=tokens.device)
        out[dst] = permuted
        return out, permuted_probs, src_token, dst
    return permuted, permuted_probs, src_token, None


def torch_unpermute(permuted, probs, src_token, N, dst=None):
    rows = permuted if dst is None else permuted[dst]
    weighted = rows * probs[:, None].to(rows.dtype)
    out = torch.zeros(N, permuted.shape[1], dtype=permuted.dtype, device=permuted.device)
    return out.index_add_(0, src_token, weighted)


# ---- bytes each op must move ------------------------------------------------------------------

def megatron_peer(mod, tokens, ids, probs_topk, N, E, k, grad_out):
    """(permute, unpermute, permute backward, unpermute backward) callables of megatron-core's
    unfused permutation (moe_utils.permute / unpermute with fused=False, what a Megatron user runs
    without TransformerEngine) on a mask of the same routes, or None: megatron-core not installed,
    or a padded / fp8 variant (megatron-core pads by rerouting tokens, not the same work)."""
    v = mod.VARIANT
    if MOE_UTILS is None or v["pad"] or v["dtype"].startswith("fp8"):
        return None
    mask = torch.zeros(N, E, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    probs = torch.zeros(N, E, device="cuda").scatter_(1, ids, probs_topk)
    rows = N * k

    def permute(t=tokens, p=probs):
        return MOE_UTILS.permute(t, mask, probs=p, num_out_tokens=rows, fused=False)

    permuted, _, sorted_indices, *_ = permute()  # newer releases also return pad_offsets and counts
    expert_out = torch.randn(permuted.shape, device="cuda").to(tokens.dtype)

    def unpermute(x=expert_out, p=probs):
        return MOE_UTILS.unpermute(x, sorted_indices, tokens.shape, probs=p, routing_map=mask, fused=False)

    tl_, pl_ = tokens.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    out, out_probs, *_ = permute(tl_, pl_)
    grads = [torch.ones_like(out), torch.ones_like(out_probs)]
    ul_, upl_ = expert_out.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    combined = unpermute(ul_, upl_)
    return (permute, unpermute,
            lambda: torch.autograd.grad([out, out_probs], [tl_, pl_], grads, retain_graph=True),
            lambda: torch.autograd.grad(combined, [ul_, upl_], grad_out, retain_graph=True))


def op_bytes(op, mod, N, H, E, k, M, routing, probs):
    """Bytes the op must read + write. R = N * k routed rows; M = rows of the permuted tensor
    (>= R: pad rows and rows past the last segment are written as zeros). Prob grads are written
    for the probs' whole shape ([N, E] for mask routing). fp8 tokens carry no grad, so their
    permute backward moves prob grads only."""
    tb = torch.empty((), dtype=token_dtype(mod.VARIANT)).element_size()
    cb = torch.empty((), dtype=combine_dtype(mod.VARIANT)).element_size()
    R = N * k
    # dst rows (+ the experts and route counts of mask routing); slots past a token's routes are untouched
    row_map = R * 4 + ((R + N) * 4 if mod.VARIANT["routing"] == "mask" else 0)
    prob_bytes = R * 4 if probs is not None else 0
    prob_grad_bytes = probs.numel() * 4 if probs is not None else 0
    token_rows = 0 if mod.VARIANT["dtype"].startswith("fp8") else 1
    scale_row = triton.cdiv(H, 128) * 4 if mod.VARIANT["scale"] == "block128" else 0
    if op == "permute":  # read tokens + routing, write every row (+ probs, scales) and the row map
        return (N * H * tb + routing.numel() * routing.element_size() + M * H * tb
                + prob_bytes + M * 4 * (probs is not None) + (N + M) * scale_row + row_map)
    if op == "unpermute":  # read the routed rows, probs and map, write tokens
        return R * H * cb + N * H * cb + prob_bytes + row_map
    if op == "permute_bwd":  # read the routed row grads, write token grads; read routed prob grads, write prob grads
        return token_rows * (R * H * cb + N * H * cb) + row_map + prob_bytes + prob_grad_bytes
    if op == "unpermute_bwd":  # read token grads and routed rows, write every row grad and prob grads
        return N * H * cb + R * H * cb + M * H * cb + row_map + prob_bytes + prob_grad_bytes
    raise ValueError(op)


def captured(fn):
    """A CUDA graph of fn, captured after one call outside it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(fn):
    """GPU time alone: the op replayed from a CUDA graph (no launch or Python overhead)."""
    return bench(captured(fn).replay)


def captured_backward(setup):
    """A CUDA graph of the backward pass setup() returns. The forward runs on a side stream, so
    autograd runs the backward there too, and autograd.grad is captured on that stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn = setup()
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def backward_graph_us(setup):
    """GPU time of a backward pass alone (captured_backward)."""
    return bench(captured_backward(setup).replay)


def backward_passes(mod, tokens, routing, probs, scale, kw, permuted, row_id_map, grads):
    """(permute backward, unpermute backward) as a training step runs them, through autograd: each,
    called, runs a fresh forward and returns the function that runs its backward. grads: those of
    the permuted rows (unused for fp8 tokens, which carry none), the permuted probs and the
    unpermuted tokens."""
    grad_rows, grad_row_probs, grad_out = grads
    grad_ok = not mod.VARIANT["dtype"].startswith("fp8")

    def permute_backward():
        t_in = tokens.detach().clone().requires_grad_(grad_ok)
        p_in = probs.detach().clone().requires_grad_()
        out = mod.permute(t_in, routing, p_in, scale, **kw)
        outs, ins = ([out.tokens] if grad_ok else []) + [out.probs], ([t_in] if grad_ok else []) + [p_in]
        out_grads = ([grad_rows] if grad_ok else []) + [grad_row_probs]
        return lambda: torch.autograd.grad(outs, ins, out_grads, retain_graph=True)

    def unpermute_backward():
        u_in = permuted.detach().clone().requires_grad_()
        m_in = probs.detach().clone().requires_grad_()
        out = mod.unpermute(u_in, row_id_map, m_in)
        return lambda: torch.autograd.grad(out, [u_in, m_in], grad_out, retain_graph=True)

    return permute_backward, unpermute_backward


def run_shape(name, N, H, E, k, variants, copy_bw, results):
    for vname in variants:
        mod = load(vname)
        for call in call_styles(mod):
            run_variant(name, N, H, E, k, mod, call, copy_bw, results)


def run_variant(name, N, H, E, k, mod, call, copy_bw, results):
    v = mod.VARIANT
    vname = v["name"]
    tokens, routing, probs, scale, ids = make_inputs(mod, N, H, E, k)
    pad = v["pad"]
    M, kw = permute_kwargs(mod, N, E, k, hint=call == "topk")
    fwd = lambda: mod.permute(tokens, routing, probs, scale, **kw)  # noqa: E731
    res = fwd()
    permuted = torch.randn(M, H, device="cuda").to(combine_dtype(v))
    unp = lambda: mod.unpermute(permuted, res.row_id_map, probs)  # noqa: E731

    grad_ok = not v["dtype"].startswith("fp8")  # fp8 tokens carry no grad
    g_out = torch.randn(N, H, device="cuda").to(combine_dtype(v))
    grads = (torch.randn(M, H, device="cuda").to(tokens.dtype) if grad_ok else None, torch.randn(M, device="cuda"),
             g_out)
    permute_backward, unpermute_backward = backward_passes(mod, tokens, routing, probs, scale, kw, permuted,
                                                           res.row_id_map, grads)
    pbwd, ubwd = permute_backward(), unpermute_backward()

    # the PyTorch-native path on the same data
    probs_topk = probs.gather(1, ids) if v["routing"] == "mask" else probs
    tok_native = tokens if grad_ok else tokens.to(torch.bfloat16)
    nat = torch_permute(tok_native, ids, probs_topk, E, pad)
    nat_fwd = lambda: torch_permute(tok_native, ids, probs_topk, E, pad)  # noqa: E731
    nat_perm = torch.randn(nat[0].shape, device="cuda").to(combine_dtype(v))
    nat_unp = lambda: torch_unpermute(nat_perm, nat[1], nat[2], N, nat[3])  # noqa: E731
    tn = tok_native.detach().clone().requires_grad_()
    pn = probs_topk.detach().clone().requires_grad_()
    nat2 = torch_permute(tn, ids, pn, E, pad)
    nat_pbwd = lambda: torch.autograd.grad([nat2[0], nat2[1]], [tn, pn], [torch.ones_like(nat2[0]), torch.ones_like(nat2[1])], retain_graph=True)  # noqa: E731
    un = nat_perm.detach().clone().requires_grad_()
    pn2 = nat[1].detach().clone().requires_grad_()
    nat_u = torch_unpermute(un, pn2, nat[2], N, nat[3])
    nat_ubwd = lambda: torch.autograd.grad(nat_u, [un, pn2], g_out, retain_graph=True)  # noqa: E731

    megatron = megatron_peer(mod, tok_native, ids, probs_topk, N, E, k, g_out) or [None] * 4

    for (op, fn, native), peer in zip((("permute", fwd, nat_fwd), ("unpermute", unp, nat_unp),
                                       ("permute_bwd", pbwd, nat_pbwd), ("unpermute_bwd", ubwd, nat_ubwd)), megatron):
        t = bench(fn)
        megatron_us = None if peer is None else bench(peer)
        t_graph = (graph_us(fn) if op in ("permute", "unpermute")
                   else backward_graph_us(permute_backward if op == "permute_bwd" else unpermute_backward))
        tn_us = bench(native)
        nbytes = op_bytes(op, mod, N, H, E, k, M, routing, probs)
        floor_us = nbytes / copy_bw * 1e6
        row = dict(shape=name, N=N, H=H, E=E, k=k, variant=vname, call=call, op=op, time_us=round(t, 2),
                   bytes=nbytes, gbps=round(nbytes / t / 1e3, 1), floor_us=round(floor_us, 2),
                   ratio_to_floor=round(t / floor_us, 3),
                   graph_time_us=None if t_graph is None else round(t_graph, 2),
                   graph_ratio_to_floor=None if t_graph is None else round(t_graph / floor_us, 3),
                   torch_us=round(tn_us, 2),
                   speedup_vs_torch=round(tn_us / t, 2),
                   megatron_us=None if megatron_us is None else round(megatron_us, 2),
                   speedup_vs_megatron=None if megatron_us is None else round(megatron_us / t, 2))
        results.append(row)
        print(f"{name:15s} {vname:36s} {call:6s} {op:14s} {t:9.1f} us  {row['gbps']:7.0f} GB/s  "
              f"x{row['ratio_to_floor']:.3f} floor  "
              + (f"graph x{row['graph_ratio_to_floor']:.3f}  " if t_graph is not None else " " * 15)
              + f"torch {tn_us:9.1f} us  ({row['speedup_vs_torch']:.1f}x)"
              + ("" if megatron_us is None else f"  megatron {megatron_us:9.1f} us  ({row['speedup_vs_megatron']:.1f}x)"),
              flush=True)
    del res, pbwd, ubwd, nat, nat2, nat_u, megatron
    torch.cuda.empty_cache()


def host_us(fn, calls=1000, blocks=5):
    """Host-measured time per call, on any device: the median of blocks of calls (the hosts' speed
    drifts, up to 2x between blocks of one process), after a warm-up."""
    return per_call_us(fn, max(1, calls // blocks), blocks, warmup=min(50, calls))


def round_trip_us(mod, N=1024, H=1024, E=16, k=2, calls=1000, grad=False):
    """Host-measured permute + unpermute per call, launch and Python overhead included.
    grad: inputs require grad, so both calls go through autograd (a training step's forward)."""
    tokens, routing, probs, scale, _ = make_inputs(mod, N, H, E, k)
    if grad:
        tokens.requires_grad_(tokens.is_floating_point() and tokens.element_size() > 1)
        probs.requires_grad_()
    M, kw = permute_kwargs(mod, N, E, k, rows=N * k)
    permuted = torch.randn(M, H, device="cuda").to(combine_dtype(mod.VARIANT)).requires_grad_(grad)

    def call(tokens, routing, probs, scale, permuted):
        return mod.unpermute(permuted, mod.permute(tokens, routing, probs, scale, **kw).row_id_map, probs)

    args = (tokens, routing, probs, scale, permuted)
    eager = host_us(lambda: call(*args), calls)
    if grad:
        return dict(eager_us=round(eager, 1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(*args)
    graph_us = host_us(graph.replay, calls)

    # What a compiled training stack gets: torch.compile's CUDA graphs (cudagraph trees).
    compiled = torch.compile(call, mode="reduce-overhead", fullgraph=True)
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    compiled_us = host_us(lambda: compiled(*args), calls)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips, "torch.compile skipped CUDA graphs"
    return dict(eager_us=round(eager, 1), graph_replay_us=round(graph_us, 1),
                compiled_reduce_overhead_us=round(compiled_us, 1))


def compiled_floor_us(N=1024, H=1024, E=16, k=2, calls=1000):
    """torch.compile(mode="reduce-overhead") of one pointwise op on the round trip's inputs: what a
    replay costs the host before any of our ops (guards, cudagraph-tree bookkeeping, input copies)."""
    tokens = torch.randn(N, H, device="cuda").to(torch.bfloat16)
    routing = torch.randint(0, E, (N, k), device="cuda", dtype=torch.int32)
    probs = torch.rand(N, k, device="cuda")
    permuted = torch.randn(N * k, H, device="cuda").to(torch.bfloat16)
    trivial = torch.compile(lambda tokens, routing, probs, permuted: permuted[:N] * 2 + tokens,
                            mode="reduce-overhead", fullgraph=True)
    return round(host_us(lambda: trivial(tokens, routing, probs, permuted), calls), 1)


CHUNK_SHAPES = [  # name, rows, H, chunks: rows received from 8 ranks, regrouped by (local expert, rank)
    ("deepseek_v3", 131072, 7168, 256),
    ("qwen3_moe", 131072, 2048, 128),
]


def chunk_sort(copy_bw):
    """moe_sort_chunks_by_index against torch.split + torch.cat of the same chunks (what a
    non-fused all-to-all dispatcher does), both moving every row once, bf16."""
    results = []
    for name, rows, H, chunks in CHUNK_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        inp = torch.randn(rows, H, device="cuda", generator=g).to(torch.bfloat16)
        # Uneven chunks (random cut points), as the per-(rank, expert) counts of a real dispatch are.
        cuts = torch.randint(0, rows + 1, (chunks - 1,), generator=torch.Generator().manual_seed(0)).sort().values
        split_sizes = torch.diff(torch.cat((torch.tensor([0]), cuts, torch.tensor([rows]))))
        ranks = 8
        # The regrouping after an all-to-all: chunk (rank r, expert e) goes to position (e, r).
        sorted_idxs = torch.arange(chunks).view(ranks, chunks // ranks).t().reshape(-1)
        sizes = split_sizes.tolist()
        order = sorted_idxs.tolist()
        def torch_sort():
            pieces = torch.split(inp, sizes)
            return torch.cat([pieces[i] for i in order])

        ours = permgen.moe_sort_chunks_by_index(inp, split_sizes, sorted_idxs)
        assert torch.equal(ours, torch_sort()), "chunk sort differs from torch.split + torch.cat"
        t_ours = bench(lambda: permgen.moe_sort_chunks_by_index(inp, split_sizes, sorted_idxs))
        t_torch = bench(torch_sort)
        floor = 2 * inp.numel() * inp.element_size() / copy_bw * 1e6
        row = dict(shape=name, rows=rows, H=H, chunks=chunks, ours_us=round(t_ours, 1), torch_us=round(t_torch, 1),
                   floor_ratio=round(t_ours / floor, 3), speedup_vs_torch=round(t_torch / t_ours, 2))
        print(f"chunk sort {name:12s} {rows} rows x {H}, {chunks} chunks: {t_ours:8.1f} us  x{t_ours / floor:.3f} floor  "
              f"torch.split+cat {t_torch:8.1f} us ({t_torch / t_ours:.2f}x)", flush=True)
        results.append(row)
    return results


def bookkeeping(mod, N, H, E, k):
    """Bytes permute keeps for unpermute / backward beyond its outputs, vs a dense [N, 2E+1] map."""
    tokens, routing, probs, scale, _ = make_inputs(mod, N, H, E, k)
    _, kw = permute_kwargs(mod, N, E, k)
    rm = mod.permute(tokens, routing, probs, scale, **kw).row_id_map
    # The row map: dst rows, compacted experts (mask routing; index routing keeps the user's ids)
    # and the segment table. The routing scratch is one reused buffer per stream, not per call.
    return rm.row_map.numel() * rm.row_map.element_size(), N * (2 * E + 1) * 4


def broadcast_ratio(summary):
    """The routing-free 1-read-8-writes broadcast's time over the copy floor: permute's ceiling."""
    gbps = summary["reference_gbps"].get("Triton 1-read-8-writes broadcast, no routing")
    return summary["copy_gbps"] / gbps if gbps else None


TARGETS = {"permute": 1.10, "unpermute": 1.05, "permute_bwd": 1.15, "unpermute_bwd": 1.15}


def plot(results, path, gpu, broadcast_ratio=None):
    """Ratio to the copy floor per op and shape: bars for eager calls, dots for CUDA-graph replays
    (GPU time alone), the dashed line for the op's target. The small shape is launch-bound and the
    fp8 variant's permute backward moves prob grads only: both are in bench.txt, not here."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(TARGETS)
    shapes = [s[0] for s in SHAPES if s[0] != "small"]
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in results)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4.8), sharey=True)
    width = 0.8 / len(variants)

    def shown(op, vname):
        return not (op == "permute_bwd" and "fp8" in vname)

    for ax, op in zip(axes, ops):
        for i, vname in enumerate(variants):
            rows = [next((r for r in results if r["op"] == op and r["shape"] == s and r["variant"] == vname), None)
                    for s in shapes]
            xs = [x + i * width for x in range(len(shapes))]
            if not shown(op, vname):
                continue
            ax.bar(xs, [r["ratio_to_floor"] if r else 0 for r in rows], width, label=vname, color=f"C{i}")
            ax.plot(xs, [r["graph_ratio_to_floor"] if r and r["graph_ratio_to_floor"] else float("nan") for r in rows],
                    "k.", ms=5)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(TARGETS[op], color="r", lw=1, ls="--")
        if op == "permute" and broadcast_ratio:
            ax.axhline(broadcast_ratio, color="0.4", lw=1, ls=":")
            ax.text(len(shapes) - 0.2, broadcast_ratio + 0.01, "routing-free broadcast", ha="right", fontsize=7,
                    color="0.3")
        ax.set_ylim(0.9, 2.0)
        ax.set_title(f"{op} (target {TARGETS[op]:.2f})")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=30, ha="right", fontsize=8)
    axes[0].set_ylabel("median time / copy floor (1 = floor)")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"permgen Triton kernels on {gpu}: bars eager, dots CUDA-graph replay (GPU time alone)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- host cost: what a call costs the host, beside the one-op floors of the same process --------

HOST_SHAPE = (1024, 1024, 16, 2)  # N, H, E, k: small enough that the host, not the GPU, sets the time
HOST_VARIANT = "probs_bf16_index"


def _fresh_process_s(code):
    """Seconds a fresh interpreter takes to run `code` (which prints them), from the repository root."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return float(proc.stdout.split()[-1])


_FIRST_CALL = """
import time
start = time.perf_counter()
import torch, permgen
device = "cuda" if torch.cuda.is_available() else "cpu"
N, H, E, k = {shape}
tokens = torch.randn(N, H, device=device).to(torch.bfloat16)
ids = torch.rand(N, E, device=device).topk(k, dim=1).indices.to(torch.int32)
probs = torch.rand(N, k, device=device)
ready = time.perf_counter()
out, row_id_map = permgen.moe_permute(tokens, ids, num_out_tokens=N * k, map_type="index")
permgen.moe_unpermute(out, row_id_map, merging_probs=probs, map_type="index")
if device == "cuda":
    torch.cuda.synchronize()
print(time.perf_counter() - ready)
"""


def host_cost(shape=HOST_SHAPE, calls=1000):
    """Host time per call of the small round trip (permute + unpermute of HOST_VARIANT, called as
    users call it: no hints) eagerly and under torch.compile(mode="reduce-overhead"), each beside
    the one-op floor of the same process; TE's index-map calls (moe_permute + moe_unpermute), which
    read the expert count back (one host sync); `import permgen` and the first TE call in a fresh
    process (the kernels then load from Triton's cache, or compile)."""
    N, H, E, k = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mod = load(HOST_VARIANT)
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randn(N, H, device=device, generator=g).to(torch.bfloat16)
    ids = torch.rand(N, E, device=device, generator=g).topk(k, dim=1).indices.to(torch.int32)
    probs = torch.rand(N, k, device=device, generator=g)
    permuted = torch.randn(N * k, H, device=device, generator=g).to(torch.bfloat16)

    def round_trip(tokens, ids, probs, permuted):
        res = mod.permute(tokens, ids, probs, num_experts=E, num_out_tokens=N * k)
        return mod.unpermute(permuted, res.row_id_map, probs)

    def te_round_trip(tokens, ids, probs, permuted):
        out, row_id_map = permgen.moe_permute(tokens, ids, num_out_tokens=N * k, map_type="index")
        return permgen.moe_unpermute(permuted, row_id_map, merging_probs=probs, map_type="index")

    def one_op(tokens, ids, probs, permuted):
        return permuted[:N] * 2 + tokens

    args = (tokens, ids, probs, permuted)
    rows = {}
    rows["eager one-op floor"] = host_us(lambda: one_op(*args), calls)
    rows["eager round trip"] = host_us(lambda: round_trip(*args), calls)
    rows["eager TE round trip (reads E back)"] = host_us(lambda: te_round_trip(*args), calls)
    grads = (tokens.clone().requires_grad_(), ids, probs.clone().requires_grad_(), permuted.clone().requires_grad_())
    rows["eager round trip, autograd"] = host_us(lambda: round_trip(*grads), calls)
    # CUDA graphs (what reduce-overhead replays) exist only on GPUs; on the CPU the plain compile runs.
    mode = "reduce-overhead" if device == "cuda" else None
    compiled_one_op = torch.compile(one_op, mode=mode, fullgraph=True)
    compiled = torch.compile(round_trip, mode=mode, fullgraph=True)
    rows["compiled one-op floor"] = host_us(lambda: compiled_one_op(*args), calls)
    rows["compiled round trip"] = host_us(lambda: compiled(*args), calls)
    result = {name: round(us, 1) for name, us in rows.items()}
    result.update(
        eager_ratio=round(rows["eager round trip"] / rows["eager one-op floor"], 2),
        compiled_ratio=round(rows["compiled round trip"] / rows["compiled one-op floor"], 2),
        import_permgen_ms=round(1e3 * _fresh_process_s(
            "import time; t = time.perf_counter(); import permgen; print(time.perf_counter() - t)"), 1),
        first_te_call_ms=round(1e3 * _fresh_process_s(_FIRST_CALL.format(shape=tuple(shape))), 1),
        shape=dict(N=N, H=H, E=E, k=k), variant=HOST_VARIANT, device=device, compile_mode=mode or "default")
    return result


def print_host_cost(host):
    print(f"host cost per call, {host['variant']} N={host['shape']['N']} H={host['shape']['H']} "
          f"E={host['shape']['E']} k={host['shape']['k']} on {host['device']}:")
    for name in ("eager one-op floor", "eager round trip", "eager TE round trip (reads E back)",
                 "eager round trip, autograd", "compiled one-op floor", "compiled round trip"):
        print(f"  {name:<40} {host[name]:9.1f} us")
    print(f"  {'eager round trip / one op':<40} {host['eager_ratio']:9.2f} x")
    print(f"  {'compiled round trip / one op':<40} {host['compiled_ratio']:9.2f} x  ({host['compile_mode']})")
    print(f"  {'import permgen (fresh process)':<40} {host['import_permgen_ms']:9.1f} ms")
    print(f"  {'first TE round trip (fresh process)':<40} {host['first_te_call_ms']:9.1f} ms", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--variants", nargs="*", default=VARIANTS)
    parser.add_argument("--plot-only", action="store_true", help="redraw bench.png from --out/bench.json")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host cost (also on the CPU, under TRITON_INTERPRET=1); updates --out/bench.json's "
                             "'host' entry")
    parser.add_argument("--host-shape", nargs=4, type=int, default=HOST_SHAPE, metavar=("N", "H", "E", "K"))
    parser.add_argument("--host-calls", type=int, default=1000)
    args = parser.parse_args()
    if args.host_only:
        host = host_cost(tuple(args.host_shape), args.host_calls)
        print_host_cost(host)
        path = args.out / "bench.json"
        summary = json.loads(path.read_text()) if path.exists() else {}
        summary["host"] = {**host, "run": run_metadata()}
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1) + "\n")
        return
    if args.plot_only:
        summary = json.loads((args.out / "bench.json").read_text())
        plot(summary["results"], args.out / "bench.png", summary["run"]["gpu"], broadcast_ratio(summary))
        return
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    args.out.mkdir(parents=True, exist_ok=True)
    copy_bw = copy_bandwidth()
    references = reference_bandwidths()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_bw / 1e9:.0f} GB/s (read + written); "
          + ", ".join(f"{k} {v:.0f} GB/s" for k, v in references.items()), flush=True)
    results = []
    for name, N, H, E, k in SHAPES:
        if name in args.shapes:
            run_shape(name, N, H, E, k, args.variants, copy_bw, results)
    small = {v: round_trip_us(load(v)) for v in args.variants}
    for v in args.variants:
        small[v]["autograd_eager_us"] = round_trip_us(load(v), grad=True)["eager_us"]
    small["compiled_floor_us"] = compiled_floor_us()
    print("small-shape permute + unpermute round trip, host-measured us/call:", small)
    host = host_cost()
    print_host_cost(host)
    chunks = chunk_sort(copy_bw)
    memory = {v: dict(zip(("ours_bytes", "dense_map_bytes"), bookkeeping(load(v), 16384, 7168, 256, 8)))
              for v in args.variants}
    print("bookkeeping kept by permute at N=16384, E=256, k=8:", memory)
    summary = dict(
        run=run_metadata(), copy_gbps=round(copy_bw / 1e9, 1), reference_gbps=references, results=results, small_round_trip_us=small, bookkeeping=memory,
        chunk_sort=chunks, host=host)
    (args.out / "bench.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(results, args.out / "bench.png", summary["run"]["gpu"], broadcast_ratio(summary))


if __name__ == "__main__":
    main()
