"""Capacity-mode dispatch and combine of one variant as custom ops (an op layer family), so that
torch.compile(fullgraph=True) sees each as one opaque op with static shapes: its sizes depend on the
group's size, num_experts and recv_capacity only. Registered in the `permgen` namespace as
`<target>_<variant>_ep_dispatch`, `_ep_dispatch_backward`, `_ep_combine`, `_ep_combine_backward`, on
the first compiled call that needs them, never at import; eager calls use no op. They run the same
steps as eager calls (permgen.ep.plan, permgen.ep.rows); absent outputs are empty tensors. The group
travels as its name (torch.distributed resolves it)."""

from __future__ import annotations

import torch

from ..core.contract import check_permute, out_dtype, scale_columns, scale_dtype
from ..core.oplayer import Op, OpFamily, take_prefix
from ..core.results import RowIdMap
from .group import group_facts
from .plan import DispatchResult, EpHandle, capacity_rows, capped_by_permute, plan_dispatch, regroup_needed, \
    send_map_words
from .rows import combine_grads, combine_rows, dispatch_grads, dispatch_rows


def _empty(like, *shape, dtype=None):
    return like.new_empty(shape, dtype=like.dtype if dtype is None else dtype)


class EpOps(OpFamily):
    """The custom ops of one variant's dispatch and combine (see the module docstring)."""

    def __init__(self, ops):
        super().__init__(take_prefix(ops.prefix, "ep"))
        self.ops = ops

    def declare(self):
        sizes = "str group_name, SymInt num_tokens, SymInt width, SymInt num_experts, SymInt capacity"
        return {
            "dispatch": Op(self._dispatch, self._dispatch_fake,
                           "(Tensor tokens, Tensor routing, Tensor? probs, Tensor? scale, str group_name, "
                           "SymInt num_experts, SymInt width, SymInt capacity, SymInt? topk) -> (Tensor out, "
                           "Tensor out_probs, Tensor out_scale, Tensor tokens_per_expert, Tensor send_row_map, "
                           "Tensor table, Tensor dropped)",
                           backward=self._dispatch_grad, setup=self._dispatch_setup),
            "dispatch_backward": Op(self._dispatch_backward, self._dispatch_backward_fake,
                                    f"(Tensor send_row_map, Tensor table, Tensor? grad_out, Tensor? grad_probs, "
                                    f"{sizes}, SymInt prob_columns, ScalarType probs_dtype) -> (Tensor grad_tokens, "
                                    "Tensor grad_probs)"),
            "combine": Op(self._combine, self._combine_fake,
                          f"(Tensor expert_out, Tensor send_row_map, Tensor table, Tensor? merging_probs, {sizes}) "
                          "-> (Tensor out, Tensor returned)",
                          backward=self._combine_grad, setup=self._combine_setup),
            "combine_backward": Op(self._combine_backward, self._combine_backward_fake,
                                   f"(Tensor send_row_map, Tensor table, Tensor grad, Tensor returned, "
                                   f"Tensor? merging_probs, {sizes}) -> (Tensor grad_expert_out, Tensor grad_probs)"),
        }

    # -- the handle from the ops' arguments --------------------------------------------------------

    def _facts(self, group):
        """The facts of a group, or of the group a name resolves to (the ops' argument)."""
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group)
        return group_facts(self.ops.name, group)

    def _num_out(self, facts, num_experts, capacity):
        return capacity_rows(facts.world, num_experts // facts.world, self.ops.variant.pad, capacity)

    def _handle(self, send_row_map, table, group, num_tokens, width, num_experts, capacity, hidden, routing=None):
        facts = self._facts(group)
        world, num_out = facts.world, self._num_out(facts, num_experts, capacity)
        send_map = RowIdMap(send_row_map, routing, num_tokens, width, num_experts, world * capacity, self.ops.name)
        return EpHandle(self.ops, facts, -1, send_map, [capacity] * world, [capacity] * world, None,
                        table if table.numel() else None, num_out, hidden, None)

    # -- dispatch ----------------------------------------------------------------------------------

    def dispatch(self, tokens, routing, probs, scale, group, num_experts, width, capacity, topk):
        variant = self.ops.variant
        out, out_probs, out_scale, tokens_per_expert, send_row_map, table, dropped = self.op["dispatch"](
            tokens, routing, probs, scale, group.group_name, num_experts, width, capacity, topk)
        handle = self._handle(send_row_map, table, group, tokens.shape[0], width, num_experts, capacity,
                              tokens.shape[1], routing)
        handle.dropped_rows = dropped
        return DispatchResult(out, out_probs if variant.probs else None, out_scale if variant.makes_scale else None,
                              tokens_per_expert, handle)

    def _dispatch(self, tokens, routing, probs, scale, group_name, num_experts, width, capacity, topk):
        ops = self.ops
        plan = check_permute(ops.variant, tokens, routing, probs, scale, num_experts, None, topk, False)
        res, h, tokens_per_expert = plan_dispatch(ops, plan, self._facts(group_name), tokens, routing, probs, scale,
                                                  topk, capacity, False, -1)
        out, out_probs = dispatch_rows(h, res.tokens, res.probs)
        out_scale = dispatch_rows(h, res.scale)[0] if res.scale is not None else _empty(tokens, 0, 0)
        table = h.table if h.table is not None else _empty(tokens, 0, 0, dtype=torch.int32)
        return (out, out_probs if out_probs is not None else _empty(tokens, 0, dtype=torch.float32), out_scale,
                tokens_per_expert, h.send_map.row_map, table, h.dropped)

    def _dispatch_fake(self, tokens, routing, probs, scale, group_name, num_experts, width, capacity, topk):
        variant, facts = self.ops.variant, self._facts(group_name)
        world = facts.world
        local, pad = num_experts // world, variant.pad
        num_out, hidden = self._num_out(facts, num_experts, capacity), tokens.shape[1]
        out = _empty(tokens, num_out, hidden, dtype=out_dtype(variant))
        out_probs = _empty(tokens, 0, dtype=torch.float32) if probs is None else _empty(probs, num_out)
        out_scale = _empty(tokens, 0, 0)
        if variant.makes_scale:
            out_scale = _empty(tokens, num_out, scale_columns(variant, hidden), dtype=scale_dtype(variant))
        chunks = world * local + (local if pad else 0)
        table = _empty(tokens, *((4, chunks + 1) if regroup_needed(world, local, pad, capacity) else (0, 0)),
                       dtype=torch.int32)
        words = send_map_words(facts.exchange, variant, tokens.shape[0], width, num_experts)
        return (out, out_probs, out_scale, _empty(tokens, local, dtype=torch.int64),
                _empty(tokens, words, dtype=torch.int32), table, _empty(tokens, world, dtype=torch.int64))

    def _dispatch_setup(self, ctx, inputs, output):
        tokens, _, probs, _, group_name, num_experts, width, capacity, _ = inputs
        ctx.save_for_backward(output[4], output[5])
        ctx.sizes = (group_name, tokens.shape[0], width, num_experts, capacity)
        ctx.probs_meta = (0, torch.float32) if probs is None else (probs.shape[1], probs.dtype)
        if self.ops.variant.is_fp8 or self.ops.variant.quantizes:
            ctx.mark_non_differentiable(output[0])
        ctx.set_materialize_grads(False)

    def _dispatch_grad(self, ctx, grad_out, grad_probs, *_):
        send_row_map, table = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_out = grad_out if needs[0] else None
        grad_probs = grad_probs if needs[2] else None
        if grad_out is None and grad_probs is None:
            return (None,) * 9
        grad_tokens, grad_in_probs = ctx.calls["dispatch_backward"](send_row_map, table, grad_out, grad_probs,
                                                                    *ctx.sizes, *ctx.probs_meta)
        return (grad_tokens if grad_out is not None else None, None,
                grad_in_probs if grad_probs is not None else None, *(None,) * 6)

    def _dispatch_backward(self, send_row_map, table, grad_out, grad_probs, group_name, num_tokens, width,
                           num_experts, capacity, prob_columns, probs_dtype):
        hidden = 0 if grad_out is None else grad_out.shape[1]
        h = self._handle(send_row_map, table, group_name, num_tokens, width, num_experts, capacity, hidden)
        grad_tokens, grad_in_probs = dispatch_grads(h, grad_out, grad_probs, ((num_tokens, prob_columns), probs_dtype))
        return (grad_tokens if grad_tokens is not None else _empty(send_row_map, num_tokens, 0, dtype=torch.float32),
                grad_in_probs if grad_in_probs is not None else _empty(send_row_map, num_tokens, 0,
                                                                       dtype=torch.float32))

    def _dispatch_backward_fake(self, send_row_map, table, grad_out, grad_probs, group_name, num_tokens, width,
                                num_experts, capacity, prob_columns, probs_dtype):
        grad_tokens = (_empty(send_row_map, num_tokens, 0, dtype=torch.float32) if grad_out is None
                       else _empty(grad_out, num_tokens, grad_out.shape[1]))
        grad_probs = (_empty(send_row_map, num_tokens, 0, dtype=torch.float32) if grad_probs is None
                      else _empty(send_row_map, num_tokens, prob_columns, dtype=probs_dtype))
        return grad_tokens, grad_probs

    # -- combine -----------------------------------------------------------------------------------

    def combine(self, expert_out, handle, merging_probs):
        m = handle.send_map
        return self.op["combine"](expert_out, m.row_map, handle.table if handle.table is not None else
                                  _empty(m.row_map, 0, 0), merging_probs, handle.group.group_name, m.num_tokens,
                                  m.width, m.num_experts, handle.send_splits[0])[0]

    def _combine(self, expert_out, send_row_map, table, merging_probs, group_name, num_tokens, width, num_experts,
                 capacity):
        h = self._handle(send_row_map, table, group_name, num_tokens, width, num_experts, capacity,
                         expert_out.shape[1])
        out, returned = combine_rows(h, expert_out, merging_probs)
        if returned is expert_out:  # (capped by permute: nothing moved) an op's output may not alias its input
            returned = _empty(expert_out, 0, expert_out.shape[1])
        return out, returned

    def _combine_fake(self, expert_out, send_row_map, table, merging_probs, group_name, num_tokens, width,
                      num_experts, capacity):
        facts = self._facts(group_name)
        returned = 0 if capped_by_permute(facts.exchange, self.ops.variant) else facts.world * capacity  # (_combine)
        return _empty(expert_out, num_tokens, expert_out.shape[1]), _empty(expert_out, returned, expert_out.shape[1])

    def _combine_setup(self, ctx, inputs, output):
        expert_out, send_row_map, table, merging_probs = inputs[:4]
        ctx.merging = merging_probs is not None
        # The rows that came back: expert_out itself where the op returns no copy of it (see _combine).
        returned = output[1] if output[1].shape[0] else expert_out
        ctx.save_for_backward(send_row_map, table, returned, *((merging_probs,) if ctx.merging else ()))
        ctx.sizes = inputs[4:]
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    def _combine_grad(self, ctx, grad, _):
        if grad is None:
            return (None,) * 9
        send_row_map, table, returned, *merging = ctx.saved_tensors
        grad_expert_out, grad_probs = ctx.calls["combine_backward"](send_row_map, table, grad, returned,
                                                                    merging[0] if merging else None, *ctx.sizes)
        needs = ctx.needs_input_grad
        return (grad_expert_out if needs[0] else None, None, None, grad_probs if ctx.merging and needs[3] else None,
                *(None,) * 5)

    def _combine_backward(self, send_row_map, table, grad, returned, merging_probs, group_name, num_tokens, width,
                          num_experts, capacity):
        h = self._handle(send_row_map, table, group_name, num_tokens, width, num_experts, capacity, grad.shape[1])
        grad_expert_out, grad_probs = combine_grads(h, grad, returned, merging_probs)
        return grad_expert_out, grad_probs if grad_probs is not None else _empty(grad, 0, dtype=torch.float32)

    def _combine_backward_fake(self, send_row_map, table, grad, returned, merging_probs, group_name, num_tokens,
                               width, num_experts, capacity):
        num_out = self._num_out(self._facts(group_name), num_experts, capacity)
        grad_probs = _empty(grad, 0, dtype=torch.float32) if merging_probs is None else torch.empty_like(merging_probs)
        return _empty(grad, num_out, grad.shape[1]), grad_probs
