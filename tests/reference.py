"""The one plain-PyTorch reference for every op, shared by every target's tests.

It is written for clarity, not speed: routes are enumerated explicitly and sorted into the
contract's row order. Backward references come from autograd through these same functions.

Contract (../DESIGN.md, "Runtime contract"):
- a route is (token t, slot j, expert e). index routing: e = routing[t, j], and the route's
  prob column is j; mask routing: one route per set routing[t, e], slot j = its rank among the
  token's experts, prob column e. Expert ids outside [0, E) route nowhere.
- rows are expert-major; within an expert, ascending (token, slot). Each expert's segment is
  padded to a multiple of `pad` with zero rows.
- with `num_out_tokens`, routes whose row would be >= num_out_tokens are dropped, and the output
  has exactly num_out_tokens rows; rows past the last segment are zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routes:
    """Kept routes in row order: route i moves token[i] to row dst[i]; its prob is probs[token, col]."""

    token: torch.Tensor  # int64 [R]
    col: torch.Tensor  # int64 [R]
    expert: torch.Tensor  # int64 [R]
    dst: torch.Tensor  # int64 [R]
    num_rows: int
    tokens_per_expert: torch.Tensor  # int64 [E]: rows of each expert's segment present in the output
    segment_start: torch.Tensor  # int64 [E]


def enumerate_routes(routing: torch.Tensor, routing_kind: str, num_experts: int):
    """All valid routes as (token, slot, expert, col) in token-major order."""
    routing = routing.cpu()
    if routing_kind == "index":
        n, k = routing.shape
        token = torch.arange(n).repeat_interleave(k)
        slot = torch.arange(k).repeat(n)
        expert = routing.reshape(-1).long()
        valid = (expert >= 0) & (expert < num_experts)
        token, slot, expert = token[valid], slot[valid], expert[valid]
        return token, slot, expert, slot
    if routing_kind == "mask":
        token, expert = routing.bool().nonzero(as_tuple=True)  # row-major: token-major, ascending expert
        starts = torch.zeros(routing.shape[0] + 1, dtype=torch.long)
        starts[1:] = routing.bool().sum(1).cumsum(0)
        slot = torch.arange(token.numel()) - starts[token]
        return token, slot, expert, expert
    raise ValueError(routing_kind)


def plan_routes(routing, routing_kind: str, num_experts: int, pad: int = 0, num_out_tokens=None) -> Routes:
    token, slot, expert, col = enumerate_routes(routing, routing_kind, num_experts)
    num_tokens = routing.shape[0]
    # Row order: by expert, then token, then slot (a stable sort on one combined key).
    slots = int(slot.max()) + 1 if slot.numel() else 1
    order = torch.argsort((expert * (num_tokens + 1) + token) * slots + slot, stable=True)
    token, slot, expert, col = token[order], slot[order], expert[order], col[order]
    counts = torch.bincount(expert, minlength=num_experts)
    padded = (counts + pad - 1) // pad * pad if pad else counts
    start = torch.cumsum(padded, 0) - padded
    rank = torch.arange(token.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    dst = start[expert] + rank
    total = int(padded.sum())
    num_rows = total if num_out_tokens is None else num_out_tokens
    kept = dst < num_rows
    tokens_per_expert = (torch.clamp(start + padded, max=num_rows) - start).clamp(min=0)
    return Routes(token[kept], col[kept], expert[kept], dst[kept], num_rows, tokens_per_expert, start)


def sort_chunks_ref(rows, split_sizes, sorted_idxs):
    """TE's sort_chunks_by_index: `rows` cut into chunks of split_sizes rows, concatenated in sorted_idxs' order."""
    chunks = torch.split(rows, [int(s) for s in split_sizes], dim=0)
    return torch.cat([chunks[int(i)] for i in sorted_idxs], dim=0)


def sort_chunks_grad_ref(grad, split_sizes, sorted_idxs):
    """Backward of a chunk sort: each output row's gradient goes back to its source row."""
    source = sort_chunks_ref(torch.arange(grad.shape[0]), split_sizes, sorted_idxs)
    return torch.zeros_like(grad).index_copy(0, source.to(grad.device), grad)


FP8_E4M3_MAX = 448.0


def quantize_ref(tokens: torch.Tensor, kind: str):
    """Quantise tokens [N, H] to float8_e4m3fn: (rows, scales). README, "Quantising variants".

    Per block of `cols` channels (the last block of a row may be shorter), with amax = max |x| in fp32:
    - block128: e = ceil(log2(max(amax, 1e-4) / 448)) (2^127 for a block holding NaN or Inf);
      scale = 2^e as fp32; rows x * 2^-e.
    - rowwise: block128's rule with one block per row: scales [N, 1] fp32.
    - mx32: E = ceil(log2(amax / 448)) + 127 clamped to [0, 254] (0 for amax 0, 0xFF for NaN or
      Inf); scale = E as a uint8 (e8m0); rows x * 2^(127 - E).
    Rows are rounded to nearest even and saturate at +-448; every NaN is 0x7F, whatever its sign.
    """
    num_tokens, hidden = tokens.shape
    cols = {"block128": 128, "mx32": 32, "rowwise": max(hidden, 1)}[kind]
    blocks = 1 if kind == "rowwise" else -(-hidden // cols)  # rowwise: a scale even for a row of no columns
    x = torch.zeros(num_tokens, blocks * cols, dtype=torch.float32, device=tokens.device)
    x[:, :hidden] = tokens.float()
    x = x.view(num_tokens, blocks, cols)
    amax = x.abs().amax(dim=2)  # NaN propagates
    non_finite = ~torch.isfinite(amax)
    if kind != "mx32":
        amax = amax.clamp(min=1e-4)
    # ceil(log2(amax / 448)) exactly: amax = m * 2^p with m in [0.5, 1) and 448 = 0.875 * 2^9.
    m, p = torch.frexp(amax)
    exponent = p - 9 + (m > 0.875).to(p.dtype)
    if kind != "mx32":
        exponent = torch.where(non_finite, 127, exponent)
        scale = torch.exp2(exponent.float())
    else:
        exponent = torch.where(amax == 0, -127, exponent).clamp(-127, 127)
        exponent = torch.where(non_finite, 128, exponent)
        scale = (exponent + 127).to(torch.uint8)
    y = x * torch.exp2(-exponent.float())[:, :, None]  # a power of two: exact down to fp32's subnormals
    y = y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # saturate (torch's fp8 cast would give NaN)
    y = torch.where(y.isnan(), float("nan"), y)  # every NaN the positive one, 0x7F: a CPU keeps a NaN's sign
    rows = y.view(num_tokens, blocks * cols)[:, :hidden].to(torch.float8_e4m3fn)
    return rows, scale


def permute_ref(tokens, routing, *, routing_kind, num_experts, probs=None, scale=None, pad=0, num_out_tokens=None,
                quantize="none"):
    """Returns (permuted tokens, permuted probs | None, permuted scale | None, tokens_per_expert, Routes).

    quantize (block128 / mx32): quantise first (quantize_ref), then permute the fp8 rows and scales."""
    if quantize != "none":
        tokens, scale = quantize_ref(tokens, quantize)
    r = plan_routes(routing, routing_kind, num_experts, pad, num_out_tokens)
    dev = tokens.device
    token, dst = r.token.to(dev), r.dst.to(dev)

    def scatter_rows(src, fill_shape):
        out = torch.zeros(fill_shape, dtype=src.dtype, device=dev)
        if src.dtype.is_floating_point and src.dtype.itemsize == 1:  # fp8: move the bytes
            return out.view(torch.uint8).index_put((dst,), src.view(torch.uint8)[token]).view(src.dtype)
        return out.index_put((dst,), src[token])

    out = scatter_rows(tokens, (r.num_rows, tokens.shape[1]))
    out_probs = None
    if probs is not None:
        out_probs = torch.zeros(r.num_rows, dtype=probs.dtype, device=dev).index_put((dst,), probs[token, r.col.to(dev)])
    out_scale = scatter_rows(scale, (r.num_rows, scale.shape[1])) if scale is not None else None
    return out, out_probs, out_scale, r.tokens_per_expert.to(dev), r


def unpermute_ref(permuted, routes: Routes, num_tokens: int, merging_probs=None):
    """out[t] = sum over t's kept routes of p * permuted[dst], summed in fp32, cast to permuted's dtype."""
    dev = permuted.device
    token, dst = routes.token.to(dev), routes.dst.to(dev)
    rows = permuted[dst].float()
    if merging_probs is not None:
        rows = rows * merging_probs[token, routes.col.to(dev)].float()[:, None]
    out = torch.zeros(num_tokens, permuted.shape[1], dtype=torch.float32, device=dev).index_add(0, token, rows)
    return out.to(permuted.dtype)


def permute_grads_ref(grad_permuted, routes: Routes, num_tokens: int, probs_shape=None, grad_permuted_probs=None):
    """Backward of permute: token grads gather-summed in fp32, prob grads routed back to (t, col)."""
    dev = grad_permuted.device
    token, dst = routes.token.to(dev), routes.dst.to(dev)
    grad_tokens = torch.zeros(num_tokens, grad_permuted.shape[1], dtype=torch.float32, device=dev)
    grad_tokens = grad_tokens.index_add(0, token, grad_permuted[dst].float()).to(grad_permuted.dtype)
    grad_probs = None
    if grad_permuted_probs is not None:
        grad_probs = torch.zeros(probs_shape, dtype=grad_permuted_probs.dtype, device=dev)
        grad_probs[token, routes.col.to(dev)] = grad_permuted_probs[dst]
    return grad_tokens, grad_probs


def unpermute_grads_ref(grad_out, permuted, routes: Routes, merging_probs=None):
    """Backward of unpermute: rows get p * grad (zero where no route lands), probs get <row, grad> in fp32."""
    dev = grad_out.device
    token, dst, col = routes.token.to(dev), routes.dst.to(dev), routes.col.to(dev)
    g = grad_out[token].float()
    grad_rows = g if merging_probs is None else g * merging_probs[token, col].float()[:, None]
    grad_permuted = torch.zeros(permuted.shape, dtype=grad_out.dtype, device=dev)
    grad_permuted[dst] = grad_rows.to(grad_out.dtype)
    grad_probs = None
    if merging_probs is not None:
        grad_probs = torch.zeros(merging_probs.shape, dtype=torch.float32, device=dev)
        grad_probs[token, col] = (permuted[dst].float() * g).sum(1)
        grad_probs = grad_probs.to(merging_probs.dtype)
    return grad_permuted, grad_probs


def dequantize_ref(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The values of float8_e4m3fn rows [R, C] with rowwise scales [R, 1] (or [R]), as float64: a product
    of two holds 8 significant bits, so a GEMM of them in float64 sums exactly, in any order."""
    return rows.double() * scale.reshape(-1, 1).double()


def fp8_weight_ref(w: torch.Tensor, along: str) -> torch.Tensor:
    """w [K, N] quantised rowwise along its input dimension K (one scale per column: "in") or along
    its output dimension N (one scale per row: "out"), dequantised: float64 [K, N]."""
    if along == "in":
        return dequantize_ref(*quantize_ref(w.t().contiguous(), "rowwise")).t()
    return dequantize_ref(*quantize_ref(w.contiguous(), "rowwise"))


def _swiglu(h):
    gate, up = h.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def fp8_mlp_rows_ref(rows, scale, x_rows, w1, w2, segments):
    """The FP8 experts on permuted rows (docs/expert_mlp.md, "FP8"), from the definition: every GEMM
    input quantised rowwise (quantize_ref) along the dimension the GEMM sums over; a scaled GEMM is the
    exact product of the dequantised operands (float64), stored in bf16.

    rows, scale: the quantised rows; x_rows: the same rows in bf16; segments: (expert, row slice).
    Returns (out_rows, backward), backward(grad_rows) -> (grad_x_rows, grad_w1, grad_w2): the rows'
    gradients in FP8 (grad @ w2^T, then dh @ w1^T), the weights' in bf16 from the bf16 rows (x, a)."""
    bf16 = torch.bfloat16
    h_rows = torch.zeros(rows.shape[0], w1.shape[2], dtype=bf16)
    out_rows = torch.zeros(rows.shape[0], w2.shape[2], dtype=bf16)
    for e, rs in segments:
        h = (dequantize_ref(rows[rs], scale[rs]) @ fp8_weight_ref(w1[e], "in")).to(bf16)
        h_rows[rs] = h
        out_rows[rs] = (dequantize_ref(*quantize_ref(_swiglu(h), "rowwise")) @ fp8_weight_ref(w2[e], "in")).to(bf16)

    def backward(grad_rows):
        grad_x_rows = torch.zeros(x_rows.shape, dtype=bf16)
        grad_w1, grad_w2 = torch.zeros(w1.shape, dtype=bf16), torch.zeros(w2.shape, dtype=bf16)
        for e, rs in segments:
            h = h_rows[rs].float().requires_grad_()
            grad_a = dequantize_ref(*quantize_ref(grad_rows[rs], "rowwise")) @ fp8_weight_ref(w2[e], "out").t()
            (grad_h,) = torch.autograd.grad(_swiglu(h), h, grad_a.to(bf16).float())
            grad_h = grad_h.to(bf16)
            grad_x_rows[rs] = (dequantize_ref(*quantize_ref(grad_h, "rowwise")) @ fp8_weight_ref(w1[e], "out").t()).to(bf16)
            grad_w1[e] = (x_rows[rs].float().t() @ grad_h.float()).to(bf16)
            grad_w2[e] = (_swiglu(h_rows[rs]).float().t() @ grad_rows[rs].float()).to(bf16)
        return grad_x_rows, grad_w1, grad_w2

    return out_rows, backward


def fp8_expert_mlp_ref(tokens, routing, probs, w1, w2, grad_out, *, routing_kind, num_experts, pad, num_out_tokens):
    """The FP8 expert layer: permute-quantise, fp8_mlp_rows_ref, unpermute with probs; forward and
    backward: (y, {tokens, probs, w1, w2: gradient}) for the output gradient grad_out. The tokens'
    gradient sums each token's rows' gradients (straight through the quantisation)."""
    rows, _, scale, _, routes = permute_ref(tokens, routing, routing_kind=routing_kind, num_experts=num_experts,
                                            pad=pad, num_out_tokens=num_out_tokens, quantize="rowwise")
    x_rows = permute_ref(tokens, routing, routing_kind=routing_kind, num_experts=num_experts, pad=pad,
                         num_out_tokens=num_out_tokens)[0]
    out_rows, backward = fp8_mlp_rows_ref(rows, scale, x_rows, w1, w2, fp8_segments(routes, num_experts))
    y = unpermute_ref(out_rows, routes, tokens.shape[0], probs)
    grad_rows, grad_probs = unpermute_grads_ref(grad_out, out_rows, routes, probs)
    grad_x_rows, grad_w1, grad_w2 = backward(grad_rows)
    grad_tokens = permute_grads_ref(grad_x_rows, routes, tokens.shape[0])[0]
    return y, dict(tokens=grad_tokens, probs=grad_probs, w1=grad_w1, w2=grad_w2)


def fp8_segments(routes: Routes, num_experts: int):
    """(expert, slice of its rows) of every expert with rows, pad rows included."""
    start, counts = routes.segment_start.tolist(), routes.tokens_per_expert.tolist()
    return [(e, slice(start[e], start[e] + counts[e])) for e in range(num_experts) if counts[e] > 0]
