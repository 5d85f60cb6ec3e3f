"""dispatch and combine as every Triton variant module binds them (expert_parallel): their argument
checks (kept in the op layer's memo), the ranks' agreement before any collective, and autograd."""

from __future__ import annotations

import torch

from ..core.contract import check_permute, check_tensor, combine_dtype, prob_dtypes
from ..core.oplayer import backward_refusing_twice, call_key, eager_apply
from .compiled import EpOps
from .group import group_facts, live_group, word
from .plan import DispatchResult, EpHandle, plan_dispatch
from .rows import combine_grads, combine_rows, dispatch_grads, dispatch_rows

_EP_OPS = {}  # ops.prefix -> EpOps: each variant's dispatch and combine as custom ops (torch.compile)


def expert_parallel(ops):
    """(dispatch, combine) of one variant, for its generated module (and its custom ops)."""
    _EP_OPS[ops.prefix] = EpOps(ops)

    def dispatch_(tokens, routing, probs=None, scale=None, *, group, num_experts=None, recv_capacity=None,
                  topk=None, check_routing=None):
        """Send each routed row to the rank owning its expert; return this rank's experts' rows.

        tokens [N, H], routing, probs, scale: as the variant's permute takes them. group: the
        expert-parallel ProcessGroup (num_experts / its size experts per rank, in rank order).
        num_experts: all ranks' experts (index routing needs it; mask routing's columns say it).
        recv_capacity: None (dropless: one host read of the split sizes) or the rows each rank
        sends each rank (static sizes, no host sync; overflow dropped and counted). topk: permute's
        hint for mask routing (capacity mode sizes its buffer by it). check_routing: refuse bad
        routing on every rank (default: dropless mode, which reads its counts back anyway; in
        capacity mode it costs one host read); the same on every rank. Differentiable.
        Returns DispatchResult(tokens [M, H], probs [M] | None, scale [M, S] | None,
        tokens_per_expert int64 [L], handle)."""
        return run_dispatch(ops, tokens, routing, probs, scale, group=group, num_experts=num_experts,
                            recv_capacity=recv_capacity, topk=topk, check_routing=check_routing)

    def combine_(expert_out, handle, merging_probs=None):
        """Return each expert output row to its source rank and merge it as unpermute does
        (weighted by merging_probs, the probs given to dispatch, when passed). expert_out [M, H]
        in the combine dtype. Differentiable. Returns [N, H]."""
        return run_combine(ops, expert_out, handle, merging_probs)

    dispatch_.__name__, combine_.__name__ = "dispatch", "combine"
    return dispatch_, combine_


# -- dispatch --------------------------------------------------------------------------------------

_DISPATCH_LABELS = ("variant", "hidden size (tokens.shape[1])", "tokens.dtype", "num_experts",
                    "recv_capacity (None: dropless)", "routes per token (routing.shape[1] or topk)", "topk",
                    "probs columns (None: no probs)", "probs.dtype", "scale columns (None: no scale)", "scale.dtype",
                    "check_routing")
_REFUSED = (_DISPATCH_LABELS, (None,) * len(_DISPATCH_LABELS), (0,) * len(_DISPATCH_LABELS))  # (never compared)


def run_dispatch(ops, tokens, routing, probs=None, scale=None, *, group, num_experts=None, recv_capacity=None,
                 topk=None, check_routing=None) -> DispatchResult:
    name, family = ops.name, _EP_OPS[ops.prefix]
    check = recv_capacity is None if check_routing is None else check_routing
    if torch.compiler.is_compiling():  # (the ranks compile the same call: nothing to agree on)
        plan = _check_dispatch(ops, None, group.size(), tokens, routing, probs, scale, num_experts, recv_capacity,
                               topk, check_routing)
        if recv_capacity is None or check:
            raise ValueError(f"{name}: under torch.compile dispatch needs recv_capacity (dropless mode and "
                             "check_routing read sizes back from the device)")
        return family.dispatch(tokens, routing, probs, scale, group, plan.num_experts, plan.width, recv_capacity, topk)
    facts = group_facts(name, group)
    refused = None
    try:  # a rank refusing its input tells the others before any collective, so none waits on it
        plan, agreed = family.checked("dispatch", _dispatch_key, _checked_dispatch, ops, facts, tokens, routing, probs,
                                      scale, num_experts, recv_capacity, topk, check_routing, check)
    except (TypeError, ValueError) as e:
        refused, agreed = e, _REFUSED
    facts.exchange.agree(name, "dispatch", refused, agreed)
    serial = next(facts.serials)  # (after the agreement: a refused dispatch is no dispatch on any rank)
    with torch.no_grad():  # _Dispatch's backward pass runs permute's backward kernels itself
        res, handle, tokens_per_expert = plan_dispatch(ops, plan, facts, tokens, routing, probs, scale, topk,
                                                       recv_capacity, check, serial)
    if _needs_grad(tokens, probs):
        out, out_probs = _dispatch_apply(handle, res, tokens, probs)
    else:
        out, out_probs = dispatch_rows(handle, res.tokens, res.probs)
    out_scale = None if res.scale is None else dispatch_rows(handle, res.scale)[0]
    return DispatchResult(out, out_probs, out_scale, tokens_per_expert, handle)


def _dispatch_key(ops, facts, tokens, routing, probs, scale, num_experts, recv_capacity, topk, check_routing, check):
    """What an eager dispatch's checks read: the inputs, the settings, the group's size and device."""
    return (facts.world, facts.device_type,
            *call_key((tokens, routing, probs, scale), (num_experts, recv_capacity, topk, check_routing)))


def _checked_dispatch(ops, facts, tokens, routing, probs, scale, num_experts, recv_capacity, topk, check_routing,
                      check):
    """(permute's plan, what the ranks must agree on: (labels, values, words)) of an eager dispatch."""
    plan = _check_dispatch(ops, facts, facts.world, tokens, routing, probs, scale, num_experts, recv_capacity, topk,
                           check_routing)

    def columns(t):
        return None if t is None else (t.shape[1] if t.dim() > 1 else 1)

    values = (ops.name, tokens.shape[1], tokens.dtype, plan.num_experts, recv_capacity, plan.width, topk,
              columns(probs), None if probs is None else probs.dtype, columns(scale),
              None if scale is None else scale.dtype, bool(check))
    return plan, (_DISPATCH_LABELS, values, tuple(map(word, values)))


def _check_dispatch(ops, facts, world, tokens, routing, probs, scale, num_experts, recv_capacity, topk, check_routing):
    """This rank's input checks (raising before any collective); returns permute's plan. facts: the
    group's, None under torch.compile."""
    name = ops.name
    if num_experts is None and not ops.variant.mask:
        raise ValueError(f"{name}: dispatch needs num_experts, the experts of all ranks together (index routing "
                         "does not say how many there are); each rank owns num_experts / world size of them")
    if recv_capacity is not None and (isinstance(recv_capacity, bool) or not isinstance(recv_capacity, int)):
        raise TypeError(f"{name}: recv_capacity must be an int or None, got {type(recv_capacity).__name__}")
    if recv_capacity is not None and recv_capacity < 1:
        raise ValueError(f"{name}: recv_capacity must be at least 1, got {recv_capacity}")
    if check_routing is not None and not isinstance(check_routing, bool):
        raise TypeError(f"{name}: check_routing must be a bool or None, got {type(check_routing).__name__}")
    plan = check_permute(ops.variant, tokens, routing, probs, scale, num_experts, None, topk, False)
    ops.backend.check_device(tokens)
    if facts is not None:
        facts.check_device(name, tokens.device)
    if plan.num_experts % world:
        raise ValueError(f"{name}: num_experts={plan.num_experts} must be divisible by the group's {world} ranks "
                         "(experts are split evenly over the ranks)")
    return plan


# -- combine ---------------------------------------------------------------------------------------

_COMBINE_LABELS = ("variant", "hidden size", "the dispatch each rank's handle comes from (the ranks combine handles "
                   "of different dispatches)")


def run_combine(ops, expert_out, handle, merging_probs=None):
    name, family = ops.name, _EP_OPS[ops.prefix]
    if not isinstance(handle, EpHandle):
        raise TypeError(f"{name}: handle must be the DispatchResult.handle of this module's dispatch, "
                        f"got {type(handle).__name__}")
    if torch.compiler.is_compiling():
        _check_combine(ops, expert_out, handle, merging_probs)
        return family.combine(expert_out, handle, merging_probs)
    live_group(handle.facts.group_ref, name)  # (raises where it was destroyed)
    refused = None
    try:  # as in dispatch: a refusal here reaches every rank before the rows move
        family.checked("combine", _combine_key, _check_combine, ops, expert_out, handle, merging_probs)
    except (TypeError, ValueError) as e:
        refused = e
    # What every rank must have: the same dispatch's handle, so that what each returns to each
    # rank is what that rank expects back.
    variant, hidden, serial = handle.ops.name, handle.hidden, handle.serial
    agreed = (_COMBINE_LABELS, (variant, hidden, f"#{serial}"), (word(variant), hidden, serial))
    handle.facts.exchange.agree(name, "combine", refused, agreed, (handle.recv_splits, handle.send_splits))
    if _needs_grad(expert_out, merging_probs):
        return _combine_apply(handle, expert_out, merging_probs)
    return combine_rows(handle, expert_out, merging_probs)[0]


def _combine_key(ops, expert_out, handle, merging_probs):
    """What combine's checks read: the handle's variant and sizes, expert_out and merging_probs."""
    send_map = handle.send_map
    return (handle.ops.prefix, handle.num_out, handle.hidden, send_map.row_map.device, send_map.num_tokens,
            send_map.routing.shape[1], *call_key((expert_out, merging_probs), ()))


def _check_combine(ops, expert_out, handle, merging_probs):
    name = ops.name
    if handle.ops is not ops:
        raise ValueError(f"{name}: handle comes from variant {handle.ops.name}'s dispatch")
    device = handle.send_map.row_map.device
    check_tensor(ops.variant, "expert_out", expert_out, (handle.num_out, handle.hidden), (combine_dtype(ops.variant),),
                 device)
    if merging_probs is not None:
        if not ops.variant.probs:
            raise ValueError(f"{name}: this variant has no probs; use a variant with probs = true")
        send_map = handle.send_map
        check_tensor(ops.variant, "merging_probs", merging_probs, (send_map.num_tokens, send_map.routing.shape[1]),
                     prob_dtypes(), device)


# -- autograd of eager calls -------------------------------------------------------------------------

def _needs_grad(*tensors):
    """Whether autograd must see the call (its Function costs the host more than the rest of a combine)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Dispatch(torch.autograd.Function):
    """tokens, probs -> this rank's experts' rows and probs (res: permute's, the handle's plan)."""

    @staticmethod
    def forward(ctx, h, res, tokens, probs):
        ctx.h = h
        ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)
        out, out_probs = dispatch_rows(h, res.tokens, res.probs)
        if res.tokens.dtype != tokens.dtype or tokens.dtype.itemsize == 1:
            ctx.mark_non_differentiable(out)  # fp8 rows (moved or quantised) are never differentiated
        ctx.set_materialize_grads(False)
        return out, out_probs

    @staticmethod
    @backward_refusing_twice("dispatch")
    def backward(ctx, grad_out, grad_probs):
        needs = ctx.needs_input_grad
        grad_out = grad_out if needs[2] else None
        grad_probs = grad_probs if needs[3] else None
        if grad_out is None and grad_probs is None:
            return None, None, None, None
        return None, None, *dispatch_grads(ctx.h, grad_out, grad_probs, ctx.probs_meta)


class _Combine(torch.autograd.Function):
    """expert outputs -> their source ranks, merged by unpermute's kernels over the send row map."""

    @staticmethod
    def forward(ctx, h, expert_out, merging_probs):
        ctx.h = h
        out, returned = combine_rows(h, expert_out, merging_probs)
        ctx.save_for_backward(*((returned, merging_probs) if merging_probs is not None else ()))
        return out

    @staticmethod
    @backward_refusing_twice("combine")
    def backward(ctx, grad):
        returned, merging_probs = ctx.saved_tensors if ctx.saved_tensors else (None, None)
        needs = ctx.needs_input_grad
        grad_expert_out, grad_probs = combine_grads(ctx.h, grad, returned, merging_probs, needs[1])
        return None, grad_expert_out, grad_probs if needs[2] else None


_dispatch_apply, _combine_apply = eager_apply(_Dispatch), eager_apply(_Combine)
