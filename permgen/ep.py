"""Expert parallelism on GPUs: `dispatch` and `combine` over torch.distributed, written once for
every Triton variant (each generated module binds them: `module.dispatch`, `module.combine`).

The experts are split evenly over the group's ranks in rank order: rank r owns experts
[r * L, (r + 1) * L), L = num_experts / world size. dispatch sends every route of this rank's
tokens to the rank owning its expert and returns, on each rank, the rows of its L experts:

    permute (the variant's kernels: rows expert-major, so destination-rank-major too)
      -> capacity mode, or padded variants: pack the routed rows for each destination into the send
         buffer (row gather kernel): pad rows never travel; in capacity mode each destination's
         rows fill a fixed slot
      -> all_to_all_single of the rows (probs, scales beside them), split sizes per rank
      -> regroup the received rows expert-major (the variant's row gather kernel)

Received rows are grouped by local expert; within an expert by source rank, then token (then
slot): the rows single-rank `permute` gives over all ranks' tokens concatenated in rank order,
restricted to this rank's experts. Padded variants pad on the receiver: each local expert's
segment, all sources together, is padded to a multiple of pad with zero rows, as single-rank
permute pads it (the sender's per-expert padding is not sent). combine runs the same steps
backwards (the inverse gather, the reverse all-to-all) and merges with the variant's unpermute
kernels, which read the send buffer directly through a copy of permute's row map whose routes
point at their send rows (`send_map`; dropped routes at -1). Both are differentiable: the
backward pass of one is the other's data path, then permute's (unpermute's) backward kernels over
the same map.

Two modes:

- dropless (recv_capacity=None): the route counts per expert are counted on the device,
  exchanged with one small all-to-all, and read back once (send and receive split sizes
  together: the one device-to-host read, as Megatron's all-to-all dispatcher does). Nothing is
  dropped.
- fixed capacity (recv_capacity=C): C is per rank pair. Each rank sends every other rank (and
  itself) exactly C rows, so all split sizes are static: no host synchronisation, capturable in a
  CUDA graph. A sender keeps, per destination, its first C rows in its packed order (local expert,
  then token); the rest are dropped, never written anywhere, and contribute nothing in combine.
  The output has world_size * C rows (plus num_local_experts * (pad - 1) for padded variants):
  the kept rows in the layout above, then zero rows. `DispatchResult.dropped` counts, per source
  rank, the rows routed to this rank that did not fit. Mask routing sizes the sender's buffer by
  its routes per token: pass topk (permute's hint) or it is sized for num_experts routes per token.

Row gathers use the variant's generated row gather kernel (out[r] = src[rows[r]]) on the rows'
bytes, so one compiled kernel serves tokens, expert outputs, gradients and scales; rows with no
source (padding, empty slots) read a zero row appended to the source. The collectives move bytes,
so every dtype goes through gloo (CPU) and NCCL (GPU) alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .contract import _is_int, check_permute, check_tensor, combine_dtype, prob_dtypes
from .results import RowIdMap, route_words


@dataclass
class EpHandle:
    """What dispatch leaves for combine and the backward passes (opaque to users)."""

    ops: object  # the variant's permgen.ops.Ops
    group: object
    send_map: RowIdMap  # the sender's routes, their rows in the send buffer
    send_splits: list  # rows on the wire to each rank
    recv_splits: list  # rows on the wire from each rank
    slot_rows: Optional[torch.Tensor]  # int32 [send rows]: permute's row of each (None: the same rows)
    regroup_rows: torch.Tensor  # int32 [M]: received row of each output row (received rows: none)
    regroup_inverse: torch.Tensor  # int32 [received rows]: output row of each received row
    num_out: int  # M, rows of dispatch's output
    hidden: int
    dropped: torch.Tensor  # int64 [world size]: rows from each source rank that did not fit


class DispatchResult(NamedTuple):
    tokens: torch.Tensor  # [M, H] rows of this rank's local experts, expert-major
    probs: Optional[torch.Tensor]  # [M] each row's router prob (variants with probs)
    scale: Optional[torch.Tensor]  # [M, S] each row's scales (fp8 variants with scales)
    tokens_per_expert: torch.Tensor  # int64 [L] rows of each local expert's segment, padding included
    handle: EpHandle  # for combine

    @property
    def dropped(self) -> torch.Tensor:
        """int64 [world size]: rows routed to this rank from each source rank that were dropped
        (capacity mode; zeros when dropless)."""
        return self.handle.dropped


# -- row movement ------------------------------------------------------------------------------

def _gather_rows(ops, rows, src):
    """out[r] = src[rows[r]]: 2-D rows through the variant's row gather kernel on their bytes,
    1-D values (probs) by index_select."""
    if src.dim() == 1:
        return src.index_select(0, rows)
    moved = src.contiguous().view(torch.uint8)
    return ops.backend.gather_rows(rows, moved).view(src.dtype)


def _row_bytes(t):
    """A contiguous tensor's rows as bytes: [rows, bytes per row]."""
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _exchange_rows(x, out_splits, in_splits, group, zero_row):
    """all_to_all_single of the rows of x (any dtype, 1-D or 2-D, moved as bytes); with zero_row
    one zero row follows the received rows (the source of rows that receive nothing)."""
    received = sum(out_splits)
    out = torch.empty((received + zero_row, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if zero_row:
        out[received:].zero_()
    dist.all_to_all_single(_row_bytes(out[:received]), _row_bytes(x.contiguous()), out_splits, in_splits, group=group)
    return out


def _to_experts(h: EpHandle, x):
    """Send rows (the send buffer's layout) -> this rank's expert-major rows (dispatch's direction).
    Output rows with no source (padding, rows past the last expert) are zeros."""
    received = _exchange_rows(x, h.recv_splits, h.send_splits, h.group, zero_row=True)
    return _gather_rows(h.ops, h.regroup_rows, received)


def _to_sources(h: EpHandle, y):
    """Expert-major rows -> the send buffer's layout on their source ranks (combine's direction).
    Send rows that carried no route (empty capacity slots) come back unspecified and are never read."""
    back = _gather_rows(h.ops, h.regroup_inverse, y)
    return _exchange_rows(back, h.send_splits, h.recv_splits, h.group, zero_row=False)


def _pack(h: EpHandle, permuted):
    """permute's rows -> the send buffer (the routed rows only, in capacity mode slotted)."""
    return permuted if h.slot_rows is None else _gather_rows(h.ops, h.slot_rows, permuted)


class _Dispatch(torch.autograd.Function):
    """tokens, probs -> this rank's experts' rows and probs. The backward pass returns the
    gradients to the send buffer and runs permute's backward kernels over the send row map."""

    @staticmethod
    def forward(ctx, h, res, tokens, probs):
        ctx.h = h
        ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)
        out = _to_experts(h, _pack(h, res.tokens))
        out_probs = None if res.probs is None else _to_experts(h, _pack(h, res.probs))
        if res.tokens.dtype != tokens.dtype or tokens.dtype.itemsize == 1:
            ctx.mark_non_differentiable(out)  # fp8 rows (moved or quantised) are never differentiated
        return out, out_probs

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        h, needs = ctx.h, ctx.needs_input_grad
        grad_rows = _to_sources(h, grad_out.contiguous()) if needs[2] and grad_out is not None else None
        grad_row_probs = _to_sources(h, grad_probs.contiguous()) if needs[3] and grad_probs is not None else None
        if grad_rows is None and grad_row_probs is None:
            return None, None, None, None
        grad_tokens, grad_probs = h.ops.backend.permute_backward(
            h.send_map, grad_rows, grad_row_probs, None if grad_row_probs is None else ctx.probs_meta)
        return None, None, grad_tokens, grad_probs


class _Combine(torch.autograd.Function):
    """expert outputs -> their source ranks, merged by unpermute's kernels over the send row map."""

    @staticmethod
    def forward(ctx, h, expert_out, merging_probs):
        ctx.h = h
        returned = _to_sources(h, expert_out)
        ctx.save_for_backward(*((returned, merging_probs) if merging_probs is not None else ()))
        return h.ops.backend.unpermute(h.send_map, returned, merging_probs)

    @staticmethod
    def backward(ctx, grad):
        h, needs = ctx.h, ctx.needs_input_grad
        returned, merging_probs = ctx.saved_tensors if ctx.saved_tensors else (None, None)
        grad_rows, grad_probs = h.ops.backend.unpermute_backward(h.send_map, grad.contiguous(), returned,
                                                                 merging_probs)
        grad_expert_out = _to_experts(h, grad_rows) if needs[1] else None
        return None, grad_expert_out, grad_probs if needs[2] else None


def _send_row_map(row_id_map, slot_of_row, offsets, counts, num_rows):
    """permute's row map with each route's row moved to its send row (slot_of_row[row], -1 for
    none: the route is dropped) and the send buffer's segments: the same layout (permgen.results),
    so the variant's unpermute and backward kernels read the send buffer directly."""
    dst = row_id_map.dst_rows.long()
    live = dst >= 0
    if row_id_map.is_mask:  # a mask row map's slots past a token's route count hold no route
        slot = torch.arange(row_id_map.width, device=dst.device)
        live &= slot[None, :] < row_id_map.route_counts.long()[:, None]
    lookup = torch.cat([slot_of_row, slot_of_row.new_full((1,), -1)])  # index -1: no route (also for 0 rows)
    moved = lookup[torch.where(live, dst, -1).reshape(-1)].to(torch.int32)
    words = dst.numel()
    table = torch.cat([offsets, counts]).to(torch.int32)
    rest = row_id_map.row_map[words:route_words(row_id_map.is_mask, row_id_map.num_tokens, row_id_map.width)]
    row_map = torch.cat([moved, rest, table])
    return RowIdMap(row_map, row_id_map.routing, row_id_map.num_tokens, row_id_map.width, row_id_map.num_experts,
                    num_rows, row_id_map.variant)


# -- plans ---------------------------------------------------------------------------------------

def _round_up(counts, pad):
    return (counts + pad - 1) // pad * pad if pad else counts


def _chunked_rows(sizes, starts, steps, num_out):
    """int32 [num_out]: chunk c covers sizes[c] consecutive output rows reading starts[c],
    starts[c] + steps[c], ... (steps 0: every row reads the same source, e.g. a zero row).
    Built with torch ops on the device: no host synchronisation."""
    device = sizes.device
    chunk = torch.repeat_interleave(torch.arange(sizes.shape[0], device=device), sizes, output_size=num_out)
    first = torch.cumsum(sizes, 0) - sizes
    rows = starts[chunk] + (torch.arange(num_out, device=device) - first[chunk]) * steps[chunk]
    return rows.to(torch.int32)


def _inverse_rows(rows, num_src, none):
    """int32 [num_src]: which output row reads each source row (`none` where no row does).
    rows may read index num_src (the zero row); that entry is dropped."""
    inverse = torch.full((num_src + 1,), none, dtype=torch.int64, device=rows.device)
    inverse.scatter_(0, rows.long(), torch.arange(rows.shape[0], device=rows.device))
    return inverse[:num_src].to(torch.int32)


def _regroup_plan(kept, base, pad, num_out, zero_row):
    """(rows, padded segment sizes [L]) of the receiver's regroup: output rows per local expert l
    read, source by source, kept[s, l] rows starting at received row base[s, l], then pad rows
    (the zero row) up to a multiple of pad, and after the last expert zero rows up to num_out."""
    num_sources, num_local = kept.shape
    device = kept.device
    real = kept.sum(0)
    segments = _round_up(real, pad)
    sizes = torch.cat([kept.t(), (segments - real)[:, None]], 1).flatten()
    sizes = torch.cat([sizes, (num_out - segments.sum()).reshape(1)])
    zero = torch.full((num_local, 1), zero_row, dtype=torch.int64, device=device)
    starts = torch.cat([torch.cat([base.t(), zero], 1).flatten(), zero[:1, 0]])
    steps = torch.cat([torch.cat([torch.ones_like(base.t()), torch.zeros_like(zero)], 1).flatten(),
                       torch.zeros(1, dtype=torch.int64, device=device)])
    return _chunked_rows(sizes, starts, steps, num_out), segments


def _exclusive_cumsum(x, dim):
    return torch.cumsum(x, dim) - x


def _route_counts(ops, routing, num_experts):
    """int64 [E]: routes to each expert (ids outside [0, E) route nowhere), without a host sync."""
    if ops.mask:
        return (routing != 0).sum(0, dtype=torch.int64)
    ids = routing.reshape(-1).long()
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=routing.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))[:num_experts]


def _check_group(name, group, device):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: torch.distributed is not initialised; call torch.distributed.init_process_group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: group must be a torch.distributed ProcessGroup (dist.group.WORLD for every rank), "
                        f"got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name}: this process is not a member of the group")
    backend = str(dist.get_backend(group))
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"{name}: the group's backend is nccl but the tokens are on {device}")
    return dist.get_world_size(group)


# -- the public functions ------------------------------------------------------------------------

def run_dispatch(ops, tokens, routing, probs=None, scale=None, *, group, num_experts, recv_capacity=None,
                 topk=None) -> DispatchResult:
    name = ops.name
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"{name}: num_experts must be a positive int, got {num_experts!r}")
    if recv_capacity is not None and not _is_int(recv_capacity):
        raise TypeError(f"{name}: recv_capacity must be an int or None, got {type(recv_capacity).__name__}")
    if recv_capacity is not None and recv_capacity < 1:
        raise ValueError(f"{name}: recv_capacity must be at least 1, got {recv_capacity}")
    plan = check_permute(ops.variant, tokens, routing, probs, scale, num_experts, None, topk, False)
    ops.backend.check_device(tokens)
    world = _check_group(name, group, tokens.device)
    if num_experts % world:
        raise ValueError(f"{name}: num_experts={num_experts} must be divisible by the group's {world} ranks "
                         "(experts are split evenly over the ranks)")
    local = num_experts // world

    with torch.no_grad():  # _Dispatch's backward pass runs permute's backward kernels itself
        if recv_capacity is None:
            plan_ = _dropless_plan(ops, tokens, routing, probs, scale, group, world, local, num_experts, topk)
        else:
            plan_ = _capacity_plan(ops, tokens, routing, probs, scale, group, world, local, num_experts, topk,
                                   plan.num_tokens * plan.width, recv_capacity)
    res, send_map, slot_rows, send_splits, recv_splits, kept, base, num_out, dropped = plan_
    received = sum(recv_splits)
    regroup_rows, tokens_per_expert = _regroup_plan(kept, base, ops.variant["pad"], num_out, received)
    handle = EpHandle(ops, group, send_map, send_splits, recv_splits, slot_rows, regroup_rows,
                      _inverse_rows(regroup_rows, received, 0), num_out, plan.hidden, dropped)
    out, out_probs = _Dispatch.apply(handle, res, tokens, probs)
    out_scale = None if res.scale is None else _to_experts(handle, _pack(handle, res.scale))
    return DispatchResult(out, out_probs, out_scale, tokens_per_expert, handle)


def _dropless_plan(ops, tokens, routing, probs, scale, group, world, local, num_experts, topk):
    """Route counts exchanged and read back once; permute sized exactly; padded variants pack
    their routed rows (pad rows stay home)."""
    pad = ops.variant["pad"]
    device = tokens.device
    counts = _route_counts(ops, routing, num_experts)
    recv_counts = torch.empty((world, local), dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_counts, counts.view(world, local), group=group)
    host = torch.cat([counts, recv_counts.flatten()]).tolist()  # the one device-to-host read
    send_splits = [sum(host[d * local:(d + 1) * local]) for d in range(world)]
    recv_splits = [sum(host[num_experts + s * local:num_experts + (s + 1) * local]) for s in range(world)]
    totals = [sum(host[num_experts + s * local + l] for s in range(world)) for l in range(local)]
    num_out = sum(-(-t // pad) * pad if pad else t for t in totals)
    permuted_rows = sum(-(-c // pad) * pad if pad else c for c in host[:num_experts])
    res = ops.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=permuted_rows,
                      topk=topk, check_routing=False)
    send_map, slot_rows = res.row_id_map, None
    if pad:
        sent = sum(send_splits)
        slot_rows = _chunked_rows(counts, res.row_id_map.segment_offsets[:num_experts].long(),
                                  torch.ones_like(counts), sent)
        offsets = torch.cat([_exclusive_cumsum(counts, 0), counts.sum().reshape(1)])
        send_map = _send_row_map(res.row_id_map, _inverse_rows(slot_rows, permuted_rows, -1), offsets, counts, sent)
    base = (_exclusive_cumsum(torch.tensor(recv_splits, dtype=torch.int64, device=device), 0)[:, None]
            + _exclusive_cumsum(recv_counts, 1))
    dropped = torch.zeros(world, dtype=torch.int64, device=device)
    return res, send_map, slot_rows, send_splits, recv_splits, recv_counts, base, num_out, dropped


def _capacity_plan(ops, tokens, routing, probs, scale, group, world, local, num_experts, topk, route_slots,
                   capacity):
    """Static sizes: every rank pair exchanges `capacity` rows; nothing is read back."""
    pad = ops.variant["pad"]
    device = tokens.device
    bound = route_slots + (num_experts * (pad - 1) if pad else 0)  # rows permute can fill
    # One row more than permute can fill: row `bound` is always zero, the source of empty slots.
    res = ops.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=bound + 1,
                      topk=topk, check_routing=False)
    segment_counts = res.row_id_map.segment_counts.long().view(world, local)
    segment_offsets = res.row_id_map.segment_offsets[:num_experts].long().view(world, local)
    # Per destination, the first `capacity` rows in (local expert, token) order fit.
    fit = (capacity - _exclusive_cumsum(segment_counts, 1)).clamp(min=0).minimum(segment_counts)
    column = torch.full((world, 1), bound, dtype=torch.int64, device=device)
    sizes = torch.cat([fit, capacity - fit.sum(1, keepdim=True)], 1).flatten()
    starts = torch.cat([segment_offsets, column], 1).flatten()
    steps = torch.cat([torch.ones_like(fit), torch.zeros_like(column)], 1).flatten()
    slot_rows = _chunked_rows(sizes, starts, steps, world * capacity)
    slot_of_row = _inverse_rows(slot_rows, bound + 1, -1)
    slot_of_row[bound] = -1  # the zero row every empty slot reads
    slot_starts = (torch.arange(world, device=device) * capacity)[:, None] + _exclusive_cumsum(fit, 1)
    offsets = torch.cat([slot_starts.flatten(), torch.full((1,), world * capacity, device=device)])
    send_map = _send_row_map(res.row_id_map, slot_of_row, offsets, fit.flatten(), world * capacity)
    # What each source sends here (kept, routed) per local expert: one small all-to-all.
    counts_in = torch.empty((world, 2 * local), dtype=torch.int64, device=device)
    dist.all_to_all_single(counts_in, torch.cat([fit, segment_counts], 1), group=group)
    kept, routed = counts_in[:, :local], counts_in[:, local:]
    base = (torch.arange(world, device=device) * capacity)[:, None] + _exclusive_cumsum(kept, 1)
    num_out = world * capacity + (local * (pad - 1) if pad else 0)
    splits = [capacity] * world
    return res, send_map, slot_rows, splits, splits, kept, base, num_out, (routed - kept).sum(1)


def run_combine(ops, expert_out, handle, merging_probs=None):
    name = ops.name
    if not isinstance(handle, EpHandle):
        raise TypeError(f"{name}: handle must be the DispatchResult.handle of this module's dispatch, "
                        f"got {type(handle).__name__}")
    if handle.ops is not ops:
        raise ValueError(f"{name}: handle comes from variant {handle.ops.name}'s dispatch")
    device = handle.regroup_rows.device
    check_tensor(ops.variant, "expert_out", expert_out, (handle.num_out, handle.hidden), (combine_dtype(ops.variant),),
                 device)
    if merging_probs is not None:
        if not ops.has_probs:
            raise ValueError(f"{name}: this variant has no probs; use a variant with probs = true")
        send_map = handle.send_map
        check_tensor(ops.variant, "merging_probs", merging_probs, (send_map.num_tokens, send_map.routing.shape[1]),
                     prob_dtypes(), device)
    return _Combine.apply(handle, expert_out, merging_probs)


def expert_parallel(ops):
    """(dispatch, combine) of one variant, for its generated module."""

    def dispatch_(tokens, routing, probs=None, scale=None, *, group, num_experts, recv_capacity=None, topk=None):
        """Send each routed row to the rank owning its expert; return this rank's experts' rows.

        tokens [N, H], routing, probs, scale: as the variant's permute takes them. group: the
        expert-parallel ProcessGroup (num_experts / its size experts per rank, in rank order).
        recv_capacity: None (dropless: one host read of the split sizes) or the rows each rank
        sends each rank (static sizes, no host sync; overflow dropped and counted). topk: permute's
        hint for mask routing (capacity mode sizes its buffer by it). Differentiable.
        Returns DispatchResult(tokens [M, H], probs [M] | None, scale [M, S] | None,
        tokens_per_expert int64 [L], handle)."""
        return run_dispatch(ops, tokens, routing, probs, scale, group=group, num_experts=num_experts,
                        recv_capacity=recv_capacity, topk=topk)

    def combine_(expert_out, handle, merging_probs=None):
        """Return each expert output row to its source rank and merge it as unpermute does
        (weighted by merging_probs, the probs given to dispatch, when passed). expert_out [M, H]
        in the combine dtype. Differentiable. Returns [N, H]."""
        return run_combine(ops, expert_out, handle, merging_probs)

    dispatch_.__name__, combine_.__name__ = "dispatch", "combine"
    return dispatch_, combine_
