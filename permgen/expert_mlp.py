"""The expert MLP with its permutation folded into the GEMMs, for Triton variants whose spec entry
says `expert_mlp = true` (their generated module binds it: `module.expert_mlp`).

    y = unpermute(swiglu(permute(tokens) @ w1[e]) @ w2[e], merging probs)

computed without the permuted copy of the tokens:

- forward: permute's routing alone (its row map, no rows moved); the first grouped GEMM gathers its
  A rows from the tokens through the row map (permgen.triton_gemm.gather_gemm); SwiGLU; the second
  grouped GEMM (torch._grouped_mm); the variant's unpermute kernels merge each expert row into its
  token (weighted by its prob) in a fixed order, so the result is deterministic.
- backward: unpermute's backward kernels, torch._grouped_mm for both data gradients and w2's
  gradient, permute's backward kernels sum each token's rows, and w1's gradient gathers its token
  rows in the prologue (permgen.triton_gemm.gather_wgrad).

The same function as permute -> torch._grouped_mm -> SwiGLU -> torch._grouped_mm -> unpermute
(tests/test_expert_mlp.py), minus the [M, H] permuted rows it neither writes, reads nor keeps for
the backward pass. The merge stays in unpermute's kernels rather than the second GEMM's epilogue:
a token's rows belong to different experts' tiles, which finish in no fixed order, so merging
there takes atomic adds, whose result depends on that order.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .triton_gemm import gather_gemm


def _row_tokens(row_id_map, num_rows):
    """int32 [num_rows]: the token of each row (-1: a pad row), from the row map's routes, on the device."""
    dst = row_id_map.dst_rows.long()
    live = dst >= 0
    if row_id_map.is_mask:  # a mask row map's slots past a token's route count hold no route
        slot = torch.arange(row_id_map.width, device=dst.device)
        live &= slot[None, :] < row_id_map.route_counts.long()[:, None]
    where = torch.where(live, dst, num_rows).reshape(-1)  # row num_rows: a sink for the dead slots
    tokens = torch.arange(row_id_map.num_tokens, dtype=torch.int32, device=dst.device)
    row_token = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=dst.device)
    row_token.scatter_(0, where, tokens.repeat_interleave(row_id_map.width))
    return row_token[:num_rows]


def _swiglu(h):
    gate, up = h.chunk(2, dim=1)
    return F.silu(gate) * up


class _Route(NamedTuple):
    """permute's routing of one call, as the GEMMs read it."""

    row_id_map: object  # permgen.results.RowIdMap
    row_token: torch.Tensor  # int32 [M]: each row's token (-1: pad row)
    seg_start: torch.Tensor  # int32 [E]: each expert's first row
    seg_count: torch.Tensor  # int32 [E]: its rows, pad rows included
    ends: torch.Tensor  # int32 [E]: seg_start + seg_count, torch._grouped_mm's offs
    gathered: Callable  # tokens -> their permuted rows [M, H] (w1's gradient reads them)


class _ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, route, tokens, probs, w1, w2):
        row_id_map, row_token, seg_start, seg_count, ends, _ = route
        h = gather_gemm(tokens, row_token, w1, seg_start, seg_count, row_id_map.num_rows)
        act = _swiglu(h)
        out = torch._grouped_mm(act, w2, offs=ends)
        ctx.ops, ctx.route = ops, route
        ctx.save_for_backward(tokens, probs, w1, w2, h, act, out)
        return ops.backend.unpermute(row_id_map, out, probs)

    @staticmethod
    def backward(ctx, grad_y):
        ops, route = ctx.ops, ctx.route
        row_id_map, ends = route.row_id_map, route.ends
        tokens, probs, w1, w2, h, act, out = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_out, grad_probs = ops.backend.unpermute_backward(row_id_map, grad_y.contiguous(),
                                                              out if probs is not None else None, probs)
        grad_w2 = torch._grouped_mm(act.t(), grad_out, offs=ends) if needs[5] else None
        grad_act = torch._grouped_mm(grad_out, w2.transpose(-2, -1), offs=ends)
        with torch.enable_grad():  # SwiGLU's own autograd formula, as the unfused layer runs it
            h_ = h.detach().requires_grad_()
            grad_h, = torch.autograd.grad(_swiglu(h_), h_, grad_act)
        # w1's gradient on the gathered rows: a permute pass and torch._grouped_mm beat a GEMM
        # gathering its rows (measured on the H200: benchmarks/results/bench_layer.txt)
        grad_w1 = torch._grouped_mm(route.gathered(tokens).t(), grad_h, offs=ends) if needs[4] else None
        grad_tokens = None
        if needs[2]:
            grad_rows = torch._grouped_mm(grad_h, w1.transpose(-2, -1), offs=ends)
            grad_tokens = ops.backend.permute_backward(row_id_map, grad_rows, None, None).rows
        return None, None, grad_tokens, grad_probs if needs[3] else None, grad_w1, grad_w2


def run_expert_mlp(ops, tokens, routing, probs, w1, w2, *, num_experts=None, num_out_tokens=None, topk=None):
    name, v = ops.name, ops.variant
    if probs is not None and not v.probs:
        raise ValueError(f"{name}: this variant has no probs; use a variant with probs = true")
    for label, w in (("w1", w1), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise ValueError(f"{name}: {label} must be a 3-D tensor [E, in, out], got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        if w.dtype != tokens.dtype or w.device != tokens.device:
            raise ValueError(f"{name}: {label} must be {tokens.dtype} on {tokens.device} like the tokens, "
                             f"got {w.dtype} on {w.device}")
    experts, hidden, width2 = w1.shape
    if hidden != tokens.shape[-1] or width2 % 2:
        raise ValueError(f"{name}: w1 must be [E, H, 2F] for SwiGLU with H = {tokens.shape[-1]} (the tokens' "
                         f"columns), got {tuple(w1.shape)}")
    if tuple(w2.shape) != (experts, width2 // 2, hidden):
        raise ValueError(f"{name}: w2 must be [E, F, H] = {(experts, width2 // 2, hidden)} for w1 "
                         f"{tuple(w1.shape)}, got {tuple(w2.shape)}")
    if num_experts is not None and num_experts != experts:
        raise ValueError(f"{name}: num_experts={num_experts} but the weights hold {experts} experts")
    tokens = tokens.contiguous()
    with torch.no_grad():  # permute's routing alone: the row map, no rows moved
        res = ops.permute(tokens.new_empty((tokens.shape[0], 0)), routing,
                          None if probs is None else probs.detach(), num_experts=experts,
                          num_out_tokens=num_out_tokens, topk=topk)
    row_id_map = res.row_id_map
    # Segments with their pad rows (zeros: row_token -1), so that torch._grouped_mm's groups, which
    # are contiguous, are the experts' own rows.
    offsets = row_id_map.segment_offsets.clamp(max=row_id_map.num_rows)
    seg_start, ends = offsets[:experts], offsets[1:experts + 1]

    def gathered(tokens):
        with torch.no_grad():
            return ops.permute(tokens, routing, None if probs is None else probs.detach(), num_experts=experts,
                               num_out_tokens=row_id_map.num_rows, topk=topk).tokens

    route = _Route(row_id_map, _row_tokens(row_id_map, row_id_map.num_rows), seg_start, ends - seg_start, ends,
                   gathered)
    return _ExpertMLP.apply(ops, route, tokens, probs, w1, w2)


def bind_expert_mlp(ops):
    """The variant's expert MLP (its generated module's `expert_mlp`)."""

    def expert_mlp_(tokens, routing, probs=None, w1=None, w2=None, *, num_experts=None, num_out_tokens=None,
                    topk=None):
        """y [N, H] = unpermute(swiglu(permute(tokens) @ w1[e]) @ w2[e], probs), without the permuted copy.

        tokens [N, H]; routing and probs as the variant's permute takes them (probs: the merging
        probs, as unpermute's); w1 [E, H, 2F] (SwiGLU: the gate's F columns, then the up
        projection's); w2 [E, F, H]. num_out_tokens and topk: permute's. Differentiable in tokens,
        probs, w1 and w2."""
        return run_expert_mlp(ops, tokens, routing, probs, w1, w2, num_experts=num_experts,
                              num_out_tokens=num_out_tokens, topk=topk)

    expert_mlp_.__name__ = "expert_mlp"
    return expert_mlp_
