"""The expert MLP of an MoE layer in one call, for Triton variants whose spec entry says
`expert_mlp = true` (their generated module binds it: `module.expert_mlp`):

    y = unpermute(swiglu(permute(tokens) @ w1[e]) @ w2[e], merging probs)

Two ways, the same function (tests/test_expert_mlp.py), chosen by the caller:

- default: permute -> torch._grouped_mm -> SwiGLU -> torch._grouped_mm -> unpermute, the fastest
  on the H200 at every measured shape (benchmarks/results/bench_layer.txt).
- save_memory=True: no permuted copy of the tokens. permute's routing alone (its row map, no rows
  moved); the first grouped GEMM gathers its A rows from the tokens through the row map
  (permgen.triton_gemm); the rest as above. The backward pass gathers the rows again for w1's
  gradient instead of keeping them: [M, H] less activation memory between forward and backward
  (1.75 GiB per layer at DeepSeek-V3's shape, N=16384), for 0.6-5% more time at N=16384 (the
  gather GEMM runs 1.08-1.16x torch._grouped_mm's time).

Either way the variant's unpermute kernels merge each expert row into its token in a fixed order,
so the result is deterministic. The merge is not folded into the second GEMM's epilogue: a token's
rows belong to different experts' tiles, which finish in no fixed order, so merging there takes
atomic adds, whose result depends on that order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import check_tensor
from .triton_gemm import GatherOps


def _row_tokens(row_id_map):
    """int32 [M]: the token of each row (-1 for pad rows), from the row map's routes, on the device."""
    num_rows = row_id_map.num_rows
    # row num_rows: a sink for the slots without a route
    where = torch.where(row_id_map.live_routes, row_id_map.dst_rows, num_rows).reshape(-1).long()
    tokens = torch.arange(row_id_map.num_tokens, dtype=torch.int32, device=where.device)
    row_token = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=where.device)
    row_token.scatter_(0, where, tokens.repeat_interleave(row_id_map.width))
    return row_token[:num_rows]


def _swiglu(h):
    gate, up = h.chunk(2, dim=1)
    return F.silu(gate) * up


def _segment_ends(row_id_map, experts):
    """int32 [E + 1]: where each expert's rows start, pad rows included (torch._grouped_mm's groups
    are contiguous), then where the last ends; capped at the rows there are."""
    return row_id_map.segment_offsets[:experts + 1].clamp(max=row_id_map.num_rows)


def run_expert_mlp(ops, gather_ops, tokens, routing, probs, w1, w2, *, num_experts=None, num_out_tokens=None,
                   topk=None, save_memory=False):
    name, v = ops.name, ops.variant
    check_tensor(v, "tokens", tokens, (None, None), (v.token_dtype,), None)
    if probs is not None and not v.probs:
        raise ValueError(f"{name}: this variant has no probs; use a variant with probs = true")
    for label, w in (("w1", w1), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise ValueError(f"{name}: {label} must be a 3-D tensor [E, in, out], got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        if w.dtype != tokens.dtype or w.device != tokens.device:
            raise ValueError(f"{name}: {label} must be {tokens.dtype} on {tokens.device} like the tokens, "
                             f"got {w.dtype} on {w.device}")  # (any strides: torch._grouped_mm takes either layout)
    experts, hidden, width2 = w1.shape
    if hidden != tokens.shape[1] or width2 % 2:
        raise ValueError(f"{name}: w1 must be [E, H, 2F] for SwiGLU with H = {tokens.shape[1]} (the tokens' "
                         f"columns), got {tuple(w1.shape)}")
    if tuple(w2.shape) != (experts, width2 // 2, hidden):
        raise ValueError(f"{name}: w2 must be [E, F, H] = {(experts, width2 // 2, hidden)} for w1 "
                         f"{tuple(w1.shape)}, got {tuple(w2.shape)}")
    # torch._grouped_mm takes rows of whole 16-byte multiples (its words: "strides should be multiple of 16 bytes").
    multiple = max(1, 16 // tokens.element_size())
    for label, size in (("H (the tokens' columns)", hidden), ("F (w2's rows, w1's columns / 2)", width2 // 2)):
        if size % multiple:
            raise ValueError(f"{name}: {label} = {size} must be a multiple of {multiple} for {tokens.dtype} "
                             "(the grouped GEMM reads rows of 16-byte multiples)")
    if num_experts is not None and num_experts != experts:
        raise ValueError(f"{name}: num_experts={num_experts} but the weights hold {experts} experts")
    if not isinstance(save_memory, bool):
        raise TypeError(f"{name}: save_memory must be a bool, got {type(save_memory).__name__}")
    route_probs = None if probs is None else probs.detach()  # permute moves them; only unpermute's merge is differentiated
    if not save_memory:
        res = ops.permute(tokens, routing, route_probs, num_experts=experts, num_out_tokens=num_out_tokens, topk=topk)
        offs = _segment_ends(res.row_id_map, experts)[1:]
        out = torch._grouped_mm(_swiglu(torch._grouped_mm(res.tokens, w1, offs=offs)), w2, offs=offs)
        return ops.unpermute(out, res.row_id_map, probs)
    with torch.no_grad():  # permute's routing alone: the row map, no rows moved
        res = ops.permute(tokens.new_empty((tokens.shape[0], 0)), routing, route_probs, num_experts=experts,
                          num_out_tokens=num_out_tokens, topk=topk)
    ends = _segment_ends(res.row_id_map, experts)
    h = gather_ops.gather_gemm(tokens.contiguous(), _row_tokens(res.row_id_map), w1, ends, res.row_id_map)
    out = torch._grouped_mm(_swiglu(h), w2, offs=ends[1:])
    return ops.unpermute(out, res.row_id_map, probs)


def bind_expert_mlp(ops):
    """The variant's expert MLP (its generated module's `expert_mlp`); its gather GEMM's ops are
    `expert_mlp.gather_ops`."""
    gather_ops = GatherOps(ops)

    def expert_mlp_(tokens, routing, probs=None, w1=None, w2=None, *, num_experts=None, num_out_tokens=None,
                    topk=None, save_memory=False):
        """y [N, H] = unpermute(swiglu(permute(tokens) @ w1[e]) @ w2[e], probs).

        tokens [N, H] bf16; routing and probs as the variant's permute takes them (probs: the
        merging probs, as unpermute's); w1 [E, H, 2F] (SwiGLU: the gate's F columns, then the up
        projection's); w2 [E, F, H]. num_out_tokens and topk: permute's. save_memory=True: the
        first GEMM reads the tokens through the row map, keeping no permuted copy for the backward
        pass (slower; see permgen.expert_mlp). Differentiable in tokens, probs, w1 and w2."""
        return run_expert_mlp(ops, gather_ops, tokens, routing, probs, w1, w2, num_experts=num_experts,
                              num_out_tokens=num_out_tokens, topk=topk, save_memory=save_memory)

    expert_mlp_.__name__ = "expert_mlp"
    expert_mlp_.gather_ops = gather_ops
    return expert_mlp_
