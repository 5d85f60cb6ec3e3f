"""permute and unpermute, written once for every variant and target.

A generated module binds its kernels to a target backend (`permgen.triton_host.TritonBackend`,
`permgen.nki_host.NkiBackend`) and exposes `Ops(VARIANT, backend).permute / .unpermute`. This
module checks the arguments (permgen.contract), runs the backend, and wires autograd; a backend
only allocates and launches. Backend methods:

    permute(plan, tokens, routing, probs, scale)
        -> (out, out_probs | None, out_scale | None, tokens_per_expert, row_map, num_rows)
    unpermute(row_id_map, permuted, merging_probs | None) -> out
    permute_backward(row_id_map, grad_out | None, grad_out_probs | None, (probs shape, dtype) | None)
        -> (grad_tokens | None, grad_probs | None)
    unpermute_backward(row_id_map, grad_out, permuted | None, merging_probs | None)
        -> (grad_permuted, grad_probs | None)
"""

import torch

from .contract import check_permute, check_unpermute, combine_dtype, routing_error, token_dtype
from .results import PermuteResult, RowIdMap


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, plan, tokens, routing, probs, scale):
        out, out_probs, out_scale, tokens_per_expert, row_map, num_rows = backend.permute(
            plan, tokens, routing, probs, scale)
        ctx.mark_non_differentiable(*(t for t in (out_scale, tokens_per_expert, row_map) if t is not None))
        ctx.save_for_backward(row_map, routing)
        ctx.set_materialize_grads(False)  # no zero-filled grads for outputs nothing flowed back to
        ctx.backend, ctx.plan, ctx.num_rows = backend, plan, num_rows
        ctx.probs_meta = None if probs is None else (probs.shape, probs.dtype)
        return out, out_probs, out_scale, tokens_per_expert, row_map

    @staticmethod
    def backward(ctx, grad_out, grad_out_probs, *_):
        row_map, routing = ctx.saved_tensors
        backend, plan = ctx.backend, ctx.plan
        # Grads were not materialised: None means no gradient reached that output.
        if not ctx.needs_input_grad[2]:
            grad_out = None
        if not ctx.needs_input_grad[4]:
            grad_out_probs = None
        row_id_map = backend.row_id_map(row_map, routing, plan, ctx.num_rows)
        grad_tokens, grad_probs = backend.permute_backward(row_id_map, grad_out, grad_out_probs, ctx.probs_meta)
        return None, None, grad_tokens, None, grad_probs, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, row_id_map, permuted, merging_probs):
        if merging_probs is not None:
            ctx.save_for_backward(permuted, merging_probs)
        ctx.backend, ctx.row_id_map = backend, row_id_map
        ctx.set_materialize_grads(False)
        return backend.unpermute(row_id_map, permuted, merging_probs)

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:  # no gradient reached the output
            return None, None, None, None
        permuted, merging_probs = ctx.saved_tensors if ctx.saved_tensors else (None, None)
        grad_permuted, grad_probs = ctx.backend.unpermute_backward(
            ctx.row_id_map, grad_out.contiguous(), permuted, merging_probs)
        return None, None, grad_permuted, grad_probs


class Ops:
    """The public functions of one variant on one target."""

    def __init__(self, variant: dict, backend):
        self.variant = variant
        self.backend = backend
        self.token_dtype = token_dtype(variant)
        self.combine_dtype = combine_dtype(variant)

    def permute(self, tokens, routing, probs=None, scale=None, *, num_experts=None, num_out_tokens=None, topk=None,
                check_routing=None) -> PermuteResult:
        """Move each token to the rows of the experts it is routed to (expert-major, stable).

        tokens [N, H] in the variant's dtype; routing: a [N, E] bool/integer mask (mask variants)
        or [N, k] int32/int64 expert ids, -1 for no route (index variants, which need
        num_experts); probs: [N, E] / [N, k] float router probs, required by variants with probs
        and refused by the others; scale: [N, ceil(H / 128 or 32)] for fp8 variants with scales.

        num_out_tokens: rows of the output. Routes whose row would be >= num_out_tokens are
            dropped; rows past the last expert segment are zeros. When given, permute makes no
            host synchronisation, so it can be captured in a CUDA graph.
        topk: optional, mask routing: the most routes of any token. The call costs the same with
            or without it; it only shrinks the row map from E to topk slots per token (routes
            past topk are dropped, or refused when check_routing is on).
        check_routing: verify the routing values (one host sync). Default: only when
            num_out_tokens is None (that call synchronises anyway).
        """
        variant, backend = self.variant, self.backend
        plan = check_permute(variant, tokens, routing, probs, scale, num_experts, num_out_tokens, topk, check_routing)
        backend.check_device(tokens)
        if plan.check_routing:
            problem = routing_error(variant, routing, plan.num_experts, plan.width)
            if problem:
                raise ValueError(f"{variant['name']}: {problem}")
        # Autograd only when a gradient can flow: the plain call costs the host far less.
        if torch.is_grad_enabled() and (tokens.requires_grad or (probs is not None and probs.requires_grad)):
            out, out_probs, out_scale, tokens_per_expert, row_map = _Permute.apply(
                backend, plan, tokens, routing, probs, scale)
            num_rows = out.shape[0]
        else:
            out, out_probs, out_scale, tokens_per_expert, row_map, num_rows = backend.permute(
                plan, tokens, routing, probs, scale)
        row_id_map = backend.row_id_map(row_map, routing, plan, num_rows)
        return PermuteResult(out, out_probs, out_scale, row_id_map, tokens_per_expert)

    def unpermute(self, permuted, row_id_map, merging_probs=None, restore_shape=None):
        """Sum each token's expert rows back into one row, weighted by merging_probs when given.

        permuted: [M, H] in the combine dtype (bf16 for fp8 variants); row_id_map: the
        PermuteResult.row_id_map of the matching permute; merging_probs: [N, E] / [N, k] float
        probs, or None for a plain sum (variants without probs refuse them); restore_shape:
        optional (N, H), checked. Returns [N, H], accumulated in fp32, deterministic.
        """
        check_unpermute(self.variant, permuted, row_id_map, merging_probs, restore_shape, RowIdMap)
        if torch.is_grad_enabled() and (permuted.requires_grad
                                        or (merging_probs is not None and merging_probs.requires_grad)):
            return _Unpermute.apply(self.backend, row_id_map, permuted, merging_probs)
        return self.backend.unpermute(row_id_map, permuted, merging_probs)
