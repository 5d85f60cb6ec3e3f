"""The expert MLP of an MoE layer in one call, for Triton variants whose spec entry says
`expert_mlp = true` (their generated module binds it: `module.expert_mlp`):

    y = unpermute(swiglu(permute(tokens) @ w1[e]) @ w2[e], merging probs)

Two ways, the same function (tests/test_expert_mlp.py), chosen by the caller:

- default: permute -> torch._grouped_mm -> SwiGLU -> torch._grouped_mm -> unpermute, the fastest
  on the H200 at every measured shape (benchmarks/results/bench_layer.txt).
- save_memory=True: no permuted copy of the tokens. permute's routing alone (its row map, no rows
  moved); the first grouped GEMM gathers its A rows from the tokens through the row map
  (permgen.triton.gemm); the rest as above. The backward pass gathers the rows again for w1's
  gradient instead of keeping them: [M, H] less activation memory between forward and backward
  (1.75 GiB per layer at DeepSeek-V3's shape, N=16384), for a few percent more time (the gather
  GEMM is slower than torch._grouped_mm; docs/expert_mlp.md gives the H200's figures).

Either way the variant's unpermute kernels merge each expert row into its token in a fixed order,
so the result is deterministic. The merge is not folded into the second GEMM's epilogue: a token's
rows belong to different experts' tiles, which finish in no fixed order, so merging there takes
atomic adds, whose result depends on that order.
"""

from __future__ import annotations

import torch

from ..core.contract import check_tensor
from ..core.oplayer import call_key
from ..triton.gemm import GatherOps
from .fp8_mlp import Fp8ExpertWeights, Fp8Ops, swiglu


def row_tokens(row_id_map):
    """int32 [M]: the token of each row (-1 for pad rows), from the row map's routes, on the device."""
    num_rows = row_id_map.num_rows
    # row num_rows: a sink for the slots without a route
    where = torch.where(row_id_map.live_routes, row_id_map.dst_rows, num_rows).reshape(-1).long()
    tokens = torch.arange(row_id_map.num_tokens, dtype=torch.int32, device=where.device)
    row_token = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=where.device)
    row_token.scatter_(0, where, tokens.repeat_interleave(row_id_map.width))
    return row_token[:num_rows]


def segment_ends(row_id_map, experts):
    """int32 [E + 1]: where each expert's rows start, pad rows included (torch._grouped_mm's groups
    are contiguous), then where the last ends; capped at the rows there are."""
    return row_id_map.segment_offsets[:experts + 1].clamp(max=row_id_map.num_rows)


def _check_weights(name, w1, w2, dtype, device, row_dtype, hidden=None):
    """w1 [E, H, 2F] and w2 [E, F, H] of `dtype` on `device` (None: w1's; any strides: torch._grouped_mm
    and the quantisers take either layout), H = hidden where given, H and F whole 16-byte rows of
    row_dtype. Returns E."""
    for label, w, shape in (("w1", w1, "[E, H, 2F]"), ("w2", w2, "[E, F, H]")):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name}: {label} must be a torch.Tensor {shape}, got {type(w).__name__}")
        if w.dim() != 3:
            raise ValueError(f"{name}: {label} must be a 3-D tensor {shape}, got {list(w.shape)} (E experts, H the "
                             "tokens' columns, F each expert's SwiGLU width)")
        if w.dtype != dtype:
            raise ValueError(f"{name}: {label} must be {dtype} (the variant's token dtype, which the layer's weights "
                             f"share), got {w.dtype}")
        if w.device != (device or w1.device):
            whose = "the tokens' device" if device else "w1's device"
            raise ValueError(f"{name}: {label} is on {w.device}, expected {device or w1.device} ({whose})")
    experts, rows, width2 = w1.shape
    if (hidden is not None and rows != hidden) or width2 % 2:
        with_hidden = "" if hidden is None else f" with H = {hidden} (the tokens' columns)"
        raise ValueError(f"{name}: w1 must be [E, H, 2F] for SwiGLU{with_hidden}, got {list(w1.shape)}")
    if tuple(w2.shape) != (experts, width2 // 2, rows):
        raise ValueError(f"{name}: w2 must be [E, F, H] = {(experts, width2 // 2, rows)} for w1 {list(w1.shape)}, "
                         f"got {list(w2.shape)}")
    # torch._grouped_mm takes rows of whole 16-byte multiples (its words: "strides should be multiple of 16 bytes").
    multiple = max(1, 16 // row_dtype.itemsize)
    for label, size in (("H (the tokens' columns)", rows), ("F (w2's rows, w1's columns / 2)", width2 // 2)):
        if size % multiple:
            raise ValueError(f"{name}: {label} = {size} must be a multiple of {multiple} for {row_dtype} rows "
                             "(the grouped GEMM reads rows of 16-byte multiples)")
    return experts


def _check_call(ops, fp8_ops, tokens, probs, w1, w2, num_experts, save_memory, fp8_weights):
    """The layer's argument checks (permute checks its own); returns E."""
    name, v = ops.name, ops.variant
    check_tensor(v, "tokens", tokens, (None, None), (v.token_dtype,), None)
    if probs is not None and not v.probs:
        raise ValueError(f"{name}: this variant has no probs; use a variant with probs = true")
    row_dtype = torch.float8_e4m3fn if fp8_ops is not None else tokens.dtype
    experts = _check_weights(name, w1, w2, tokens.dtype, tokens.device, row_dtype, tokens.shape[1])
    if num_experts is not None and num_experts != experts:
        raise ValueError(f"{name}: num_experts={num_experts} but the weights hold {experts} experts")
    if not isinstance(save_memory, bool):
        raise TypeError(f"{name}: save_memory must be a bool, got {type(save_memory).__name__}")
    if fp8_ops is None:
        if fp8_weights is not None:
            raise ValueError(f"{name}: fp8_weights are for the FP8 expert MLP (variants with quantize = 'rowwise')")
        return experts
    if save_memory:
        raise ValueError(f"{name}: save_memory=True is for bf16 variants; the FP8 expert MLP keeps no permuted rows "
                         "for the backward pass (it gathers the tokens again)")
    if fp8_weights is not None:
        if not isinstance(fp8_weights, Fp8ExpertWeights):
            raise TypeError(f"{name}: fp8_weights must be what expert_mlp.quantize_weights(w1, w2) returns, got "
                            f"{type(fp8_weights).__name__}")
        fp8_weights.check(name, w1, w2)
    return experts


def _call_key(ops, fp8_ops, tokens, probs, w1, w2, num_experts, save_memory, fp8_weights):
    """What _check_call reads: the tensors' shapes, dtypes, devices and layouts, and the settings."""
    copies = () if fp8_weights is None else tuple(fp8_weights)
    return call_key((tokens, w1, w2, *copies), (probs is None, num_experts, save_memory, type(fp8_weights)))


def run_expert_mlp(ops, gather_ops, tokens, routing, probs, w1, w2, *, num_experts=None, num_out_tokens=None,
                   topk=None, save_memory=False, fp8_ops=None, fp8_weights=None):
    experts = gather_ops.checked("expert_mlp", _call_key, _check_call, ops, fp8_ops, tokens, probs, w1, w2,
                                 num_experts, save_memory, fp8_weights)
    route_probs = None if probs is None else probs.detach()  # permute moves them; only unpermute's merge is differentiated
    if fp8_ops is not None:
        return _run_fp8(ops, fp8_ops, tokens, routing, route_probs, probs, w1, w2, experts, num_out_tokens, topk,
                        fp8_weights)
    if not save_memory:
        res = ops.permute(tokens, routing, route_probs, num_experts=experts, num_out_tokens=num_out_tokens, topk=topk)
        offs = segment_ends(res.row_id_map, experts)[1:]
        out = torch._grouped_mm(swiglu(torch._grouped_mm(res.tokens, w1, offs=offs)), w2, offs=offs)
        return ops.unpermute(out, res.row_id_map, probs)
    with torch.no_grad():  # permute's routing alone: the row map, no rows moved
        res = ops.permute(tokens.new_empty((tokens.shape[0], 0)), routing, route_probs, num_experts=experts,
                          num_out_tokens=num_out_tokens, topk=topk)
    ends = segment_ends(res.row_id_map, experts)
    h = gather_ops.gather_gemm(tokens.contiguous(), row_tokens(res.row_id_map), w1, ends, res.row_id_map)
    out = torch._grouped_mm(swiglu(h), w2, offs=ends[1:])
    return ops.unpermute(out, res.row_id_map, probs)


def _run_fp8(ops, fp8_ops, tokens, routing, route_probs, probs, w1, w2, experts, num_out_tokens, topk, fp8_weights):
    """permute-quantise -> FP8 MLP (permgen.layers.fp8_mlp) -> unpermute."""
    if fp8_weights is None:
        fp8_weights = fp8_ops.quantize_weights(w1, w2)
    res = ops.permute(tokens, routing, route_probs, num_experts=experts, num_out_tokens=num_out_tokens, topk=topk)
    m = res.row_id_map
    # permute's scales are [M, 1]: the [M] view is the GEMM's row scales, no copy.
    out, _ = fp8_ops.mlp(tokens, res.tokens, res.scale.view(-1), w1, w2, fp8_weights,
                         segment_ends(m, experts)[1:], row_tokens(m), m)
    return ops.unpermute(out, m, probs)


def bind_expert_mlp(ops):
    """The variant's expert MLP (its generated module's `expert_mlp`); its gather GEMM's ops are
    `expert_mlp.gather_ops`; a variant quantising rowwise runs the FP8 expert MLP (permgen.layers.fp8_mlp),
    whose weights `expert_mlp.quantize_weights(w1, w2)` quantises."""
    gather_ops = GatherOps(ops)
    fp8_ops = Fp8Ops(ops, gather_ops) if ops.variant.quantize == "rowwise" else None

    def expert_mlp_(tokens, routing, probs=None, w1=None, w2=None, *, num_experts=None, num_out_tokens=None,
                    topk=None, save_memory=False, fp8_weights=None):
        """y [N, H] = unpermute(swiglu(permute(tokens) @ w1[e]) @ w2[e], probs).

        tokens [N, H] bf16; routing and probs as the variant's permute takes them (probs: the
        merging probs, as unpermute's); w1 [E, H, 2F] (SwiGLU: the gate's F columns, then the up
        projection's); w2 [E, F, H]. num_out_tokens and topk: permute's. save_memory=True: the
        first GEMM reads the tokens through the row map, keeping no permuted copy for the backward
        pass (slower; see permgen.layers.expert_mlp). Differentiable in tokens, probs, w1 and w2.
        FP8 variants (quantize = "rowwise"): the GEMMs in float8_e4m3fn (permgen.layers.fp8_mlp); fp8_weights:
        quantize_weights(w1, w2), made once per optimizer step, else the call quantises w1 and w2."""
        return run_expert_mlp(ops, gather_ops, tokens, routing, probs, w1, w2, num_experts=num_experts,
                              num_out_tokens=num_out_tokens, topk=topk, save_memory=save_memory, fp8_ops=fp8_ops,
                              fp8_weights=fp8_weights)

    def quantize_weights(w1, w2):
        """Fp8ExpertWeights: the FP8 copies of w1 [E, H, 2F] and w2 [E, F, H] (the layer's dtype, bf16)
        that expert_mlp reads as fp8_weights; made once per optimizer step (the weights change there)."""
        _check_weights(ops.name, w1, w2, ops.variant.token_dtype, None, torch.float8_e4m3fn)
        return fp8_ops.quantize_weights(w1, w2)

    expert_mlp_.__name__ = "expert_mlp"
    expert_mlp_.gather_ops = gather_ops
    if fp8_ops is not None:
        expert_mlp_.fp8_ops = fp8_ops
        expert_mlp_.quantize_weights = quantize_weights
    return expert_mlp_
