"""A dispatch's plan: permute, the split sizes, the send buffer's row map and the regroup's chunk
table, kept in the handle (EpHandle) that combine and both backward passes read.

Every size here is a device tensor, except in dropless mode after its one read; the one-rank case
differs only in its exchange (permgen.ep.group), whose steps it calls like any other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..core.contract import routing_error
from ..core.results import RowIdMap, RowMapLayout, row_map_words

from .group import GroupFacts, live_group


@dataclass
class EpHandle:
    """What dispatch leaves for combine and the backward passes (opaque to users)."""

    ops: object  # the variant's permgen.core.ops.Ops
    facts: GroupFacts  # the group's (which holds the group only weakly)
    serial: int  # the group's dispatch this is (GroupFacts.serials); -1 for a compiled one
    send_map: RowIdMap  # the sender's routes, their rows in the send buffer
    send_splits: list  # rows on the wire to each rank
    recv_splits: list  # rows on the wire from each rank
    pack_rows: Optional[torch.Tensor]  # int32 [send rows]: permute's row of each send row (None: the same rows)
    table: Optional[torch.Tensor]  # the regroup's chunk table (None: the received rows are in the output order)
    num_out: int  # M, rows of dispatch's output
    hidden: int
    # int64 [world size]: rows from each source rank that did not fit, or a function that computes
    # it on first use (most callers never look; a dispatch launches no kernel for it)
    dropped_rows: object

    @property
    def dropped(self) -> torch.Tensor:
        if callable(self.dropped_rows):
            self.dropped_rows = self.dropped_rows()
        return self.dropped_rows

    @property
    def group(self):
        return live_group(self.facts.group_ref, self.ops.name)


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


# -- sizes known without the data -------------------------------------------------------------------

def capacity_rows(world, local, pad, capacity):
    """Rows of a capacity-mode dispatch's output."""
    return world * capacity + (local * (pad - 1) if pad else 0)


def regroup_needed(world, local, pad, capacity):
    """Whether received rows need the chunk sort into (local expert, source) order: they are in it
    already when there is one source or one local expert without capacity slots, unless padded."""
    return bool(pad) or not (world == 1 or (local == 1 and capacity is None))


def capped_by_permute(exchange, variant):
    """Whether capacity mode's send buffer is permute's output capped at the capacity: with one
    destination (the exchange says so) and no pad rows to leave out."""
    return exchange.permute_caps and not variant.pad


def send_map_words(exchange, variant, num_tokens, width, num_experts):
    """Words of a capacity-mode dispatch's send row map: permute's own, or _send_row_map's."""
    if capped_by_permute(exchange, variant):
        return row_map_words(variant.mask, num_tokens, width, num_experts)
    return RowMapLayout(variant.mask, num_tokens, width, num_experts).route_tallies


# -- the plan ------------------------------------------------------------------------------------

def plan_dispatch(ops, plan, facts, tokens, routing, probs, scale, topk, capacity, check, serial):
    """permute, the split sizes and the regroup: (PermuteResult, EpHandle, tokens_per_expert)."""
    world = facts.world
    local, pad = plan.num_experts // world, ops.variant.pad
    regroup = regroup_needed(world, local, pad, capacity)
    args = ops, plan, facts.exchange, facts.rank, tokens, routing, probs, scale, local, topk, check
    if capacity is None:
        res, send_map, pack_rows, kept, dropped, send_splits, recv_splits, num_out, tokens_per_expert = \
            _dropless(*args, regroup)
    else:
        res, send_map, pack_rows, kept, dropped = _capacity(*args, capacity)
        send_splits = recv_splits = [capacity] * world
        num_out = capacity_rows(world, local, pad, capacity)
        tokens_per_expert = None if regroup else kept.sum(0, dtype=torch.int64)
    table = None  # (None: the received rows are already in (local expert, source) order)
    if regroup:
        blocks = (kept.sum(1) if capacity is None
                  else torch.full((world,), capacity, dtype=torch.int64, device=tokens.device))
        table, tokens_per_expert = _regroup_table(kept.long(), blocks, num_out, pad)
    handle = EpHandle(ops, facts, serial, send_map, send_splits, recv_splits, pack_rows, table, num_out, plan.hidden,
                      dropped)
    return res, handle, tokens_per_expert


def _dropless(ops, plan, exchange, rank, tokens, routing, probs, scale, local, topk, check, regroup):
    """Route counts (and the routing check) exchanged and read back once; padded variants pack
    their routed rows (pad rows stay home).

    Where permute's rows are known before the counts (one per route slot: index routing, mask
    routing with topk, no padding), permute's routing kernel counts the routes and the bad ones, and
    the count exchange and its copy to the host are queued between its two launches: the host's
    wait for the counts, and its work after them (split sizes, the rows' all-to-all), overlap the
    rows' move instead of following it. The others (padded variants; mask routing without topk)
    count with a pass over the routing and run permute after the read."""
    num_experts, pad = plan.num_experts, ops.variant.pad
    world = num_experts // local
    early = not pad and (not ops.variant.mask or topk is not None)
    res = None
    if early:
        start, end = _count_words(ops.variant.mask, plan.num_tokens, plan.width, num_experts)
        queued = {}

        def exchange_counts(row_map):  # the segment counts [E], then the dropped routes: all of them bad ones here
            payload, queued["received"] = exchange.counts(row_map[start:end], local)
            queued["reading"] = _start_read(payload)

        res = ops.result(plan, routing, ops.backend.permute(_every_route(plan), tokens, routing, probs, scale,
                                                            routed=exchange_counts))
        received, reading = queued["received"], queued["reading"]
    else:
        counts = _route_tally(ops, routing, num_experts, plan.width, check)
        payload, received = exchange.counts(counts, local)
        reading = _start_read(payload)
    kept = received[:, :local]
    # Without a regroup, each local expert's rows (its sources' counts summed), queued before the read.
    tokens_per_expert = None if regroup else exchange.rows_per_expert(kept, res)
    host = _finish_read(reading)  # the one device-to-host read
    step = local + 1
    got = host[-world * step:]  # [W, L + 1] per source: its counts of this rank's experts, its bad routes
    own = host[:world * step]  # the same for what this rank sent (with one rank, the same words)
    send_splits = [sum(own[d * step:d * step + local]) for d in range(world)]
    recv_splits = [sum(got[s * step:s * step + local]) for s in range(world)]
    if check and any(got[local::step]):
        raise_bad_routing(ops, routing, num_experts, plan.width, got[local::step], rank)
    num_out = sum(recv_splits)
    if pad:  # each local expert's segment, all sources together, padded to a multiple of pad
        num_out = sum(_round_up(sum(got[s * step + e] for s in range(world)), pad) for e in range(local))
    sent = sum(send_splits)
    pack_rows = None
    if early:  # the routed rows are permute's first rows
        send_map = res.row_id_map if sent == res.row_id_map.num_rows else res.row_id_map._replace(num_rows=sent)
    elif not pad:
        res = ops.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=sent, topk=topk,
                          check_routing=False)
        send_map = res.row_id_map
    else:
        permuted_rows = sum(_round_up(c, pad) for d in range(world) for c in own[d * step:d * step + local])
        counts = counts[:num_experts]
        res = ops.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=permuted_rows,
                          topk=topk, check_routing=False)
        pack_rows = _chunked_rows(counts, res.row_id_map.segment_offsets[:num_experts].long(),
                                  torch.ones_like(counts), sent)
        offsets = torch.cat([_exclusive_cumsum(counts, 0), counts.sum().reshape(1)])
        send_map = _send_row_map(res.row_id_map, _inverse_rows(pack_rows, permuted_rows, -1), offsets, counts, sent)
    return (res, send_map, pack_rows, kept, _no_drops(world, tokens.device), send_splits, recv_splits, num_out,
            tokens_per_expert)


def _capacity(ops, plan, exchange, rank, tokens, routing, probs, scale, local, topk, check, capacity):
    """Static sizes: every rank pair exchanges `capacity` rows; nothing is read back (unless
    check_routing asks for it). (PermuteResult, send row map, pack rows, kept [W, L], dropped)."""
    num_experts, pad = plan.num_experts, ops.variant.pad
    world = num_experts // local
    device = tokens.device
    if capped_by_permute(exchange, ops.variant):
        # The per-pair capacity is permute's own row cap (it keeps the first rows in expert order,
        # drops the rest and zeroes the rows it does not fill). The row map's segment counts and
        # route tallies (dropped, of them without a slot) are consecutive words: what this rank
        # receives from itself.
        res = ops.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=capacity,
                          topk=topk, check_routing=False)
        start = RowMapLayout(ops.variant.mask, plan.num_tokens, plan.width, num_experts).segment_counts
        counts_in = res.row_id_map.row_map[start:start + num_experts + 2]
        if check and counts_in[-1:].tolist()[0]:  # check_routing's host read
            raise_bad_routing(ops, routing, num_experts, plan.width, [1], rank)
        # Routes past the cap: those dropped less those without a slot.
        return (res, res.row_id_map, None, counts_in[:num_experts].view(1, local),
                lambda: (counts_in[num_experts:num_experts + 1] - counts_in[num_experts + 1:]).long())
    bound = plan.num_tokens * plan.width + (num_experts * (pad - 1) if pad else 0)  # rows permute can fill
    # One row more than permute can fill: row `bound` is always zero, the source of empty slots.
    res = ops.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=bound + 1,
                      topk=topk, check_routing=False)
    segment_counts = res.row_id_map.segment_counts.long().view(world, local)
    segment_offsets = res.row_id_map.segment_offsets[:num_experts].long().view(world, local)
    # Per destination, the first `capacity` rows in (local expert, token) order fit.
    fit = (capacity - _exclusive_cumsum(segment_counts, 1)).clamp(min=0).minimum(segment_counts)
    routed = segment_counts.sum(1, keepdim=True)
    column = torch.full((world, 1), bound, dtype=torch.int64, device=device)
    sizes = torch.cat([fit, capacity - fit.sum(1, keepdim=True)], 1).flatten()
    starts = torch.cat([segment_offsets, column], 1).flatten()
    steps = torch.cat([torch.ones_like(fit), torch.zeros_like(column)], 1).flatten()
    pack_rows = _chunked_rows(sizes, starts, steps, world * capacity)
    slot_of_row = _inverse_rows(pack_rows, bound, -1)  # (row `bound`, the zero row, is no route's)
    slot_starts = (torch.arange(world, device=device) * capacity)[:, None] + _exclusive_cumsum(fit, 1)
    offsets = torch.cat([slot_starts.flatten(), torch.full((1,), world * capacity, device=device)])
    send_map = _send_row_map(res.row_id_map, slot_of_row, offsets, fit.flatten(), world * capacity)
    # What each source sends here (kept rows per local expert, routed rows) and its routing check
    # (the routes permute found no slot for): one small all-to-all.
    bad = res.row_id_map.unslotted.to(torch.int64).reshape(1) if check else routed.new_zeros(1)
    counts_in = exchange.swap(torch.cat([fit, routed.expand(world, 1), bad.expand(world, 1)], 1))
    if check:
        bad_per_source = counts_in[:, -1].tolist()  # check_routing's host read
        if any(bad_per_source):
            raise_bad_routing(ops, routing, num_experts, plan.width, bad_per_source, rank)
    kept = counts_in[:, :local]
    return res, send_map, pack_rows, kept, lambda: counts_in[:, local] - kept.sum(1)


def raise_bad_routing(ops, routing, num_experts, width, bad_per_source, me):
    """Every rank raises when any rank's routing is bad (the others would wait on it forever)."""
    if bad_per_source[me]:
        raise ValueError(f"{ops.name}: {routing_error(ops.variant, routing, num_experts, width)}")
    culprits = [s for s, bad in enumerate(bad_per_source) if bad]
    raise ValueError(f"{ops.name}: the routing of rank(s) {culprits} of the group is invalid (they raise the details); "
                     "no rank dispatched")


def _no_drops(world, device):
    return lambda: torch.zeros(world, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=256)
def _count_words(mask, num_tokens, width, num_experts):
    """[start, end) of a row map's segment counts [E] and its dropped routes, consecutive words."""
    layout = RowMapLayout(mask, num_tokens, width, num_experts)
    return layout.segment_counts, layout.route_tallies + 1


@functools.lru_cache(maxsize=256)
def _every_route(plan):
    """permute's plan with a row for every route slot, its routing checked by the dispatch."""
    return plan._replace(num_out_tokens=plan.num_tokens * plan.width, check_routing=False)


# -- the tables, built on the device --------------------------------------------------------------

def _round_up(counts, pad):
    return (counts + pad - 1) // pad * pad if pad else counts


def _exclusive_cumsum(x, dim):
    return torch.cumsum(x, dim) - x


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


def _send_row_map(row_id_map, slot_of_row, offsets, counts, num_rows):
    """permute's row map with each route's row moved to its send row (slot_of_row[row], -1 for
    none: the route is dropped) and the send buffer's segments: the same layout (permgen.core.results),
    so the variant's unpermute and backward kernels read the send buffer directly."""
    dst, live = row_id_map.dst_rows.long(), row_id_map.live_routes
    lookup = torch.cat([slot_of_row, slot_of_row.new_full((1,), -1)])  # index -1: no route (also for 0 rows)
    moved = lookup[torch.where(live, dst, -1).reshape(-1)].to(torch.int32)
    words = dst.numel()
    table = torch.cat([offsets, counts]).to(torch.int32)
    rest = row_id_map.row_map[words:row_id_map.layout.segment_offsets]
    row_map = torch.cat([moved, rest, table])
    return RowIdMap(row_map, row_id_map.routing, row_id_map.num_tokens, row_id_map.width, row_id_map.num_experts,
                    num_rows, row_id_map.variant)


def _regroup_table(kept, blocks, num_out, pad):
    """The regroup's chunk table (the chunk sort's layout, permgen.core.ops.chunk_table) and the padded
    segment sizes [L], built on the device.

    Its input is the received rows, per source s a block of blocks[s] rows (kept[s, l] rows of each
    local expert l, then empty capacity slots), then zero rows up to num_out. Its chunks are the
    (s, l) runs and, for padded variants, each expert's pad rows (read from the zero rows); in the
    output, expert by expert, each expert's chunk of every source then its pad rows; the output
    rows after them are zeros. Empty slots are no chunk: in the inverse sort (combine's direction)
    they get rows nobody reads."""
    world, local = kept.shape
    real = kept.sum(0)
    segments = _round_up(real, pad)
    in_start = _exclusive_cumsum(blocks, 0)[:, None] + _exclusive_cumsum(kept, 1)  # [W, L]
    out_sizes, out_in_start = kept.t(), in_start.t()  # [L, W]: output order
    if pad:
        padding = segments - real
        pad_start = blocks.sum() + _exclusive_cumsum(padding, 0)
        out_sizes = torch.cat([out_sizes, padding[:, None]], 1)
        out_in_start = torch.cat([out_in_start, pad_start[:, None]], 1)
    out_start = _exclusive_cumsum(out_sizes.flatten(), 0).view(out_sizes.shape)
    in_order_start, in_order_out = in_start.flatten(), out_start[:, :world].t().flatten()
    if pad:
        in_order_start = torch.cat([in_order_start, pad_start])
        in_order_out = torch.cat([in_order_out, out_start[:, world]])
    total, zero = segments.sum().reshape(1), blocks.new_zeros(1)
    table = torch.stack([torch.cat([out_start.flatten(), total]), torch.cat([out_in_start.flatten(), zero]),
                         torch.cat([in_order_start, blocks.new_full((1,), num_out)]), torch.cat([in_order_out, zero])])
    return table.to(torch.int32), segments


def _route_tally(ops, routing, num_experts, width, check):
    """int64 [E + 1], counted on the device without a host sync: the routes to each expert, then
    the routing entries permute would refuse (ids outside [-1, E); tokens with more mask routes
    than width; 0 unless check). For the dispatches whose permute cannot count them first."""
    if ops.variant.mask:
        tally = torch.zeros(num_experts + 1, dtype=torch.int64, device=routing.device)
        routed = routing != 0
        torch.sum(routed, 0, out=tally[:num_experts])
        if check:
            torch.sum(routed.sum(1) > width, 0, out=tally[num_experts])
        return tally
    # One bucket per id: [0, E) the experts, E the ids check_routing refuses, E + 1 no route (-1).
    buckets = routing.reshape(-1).clamp(-2, num_experts).remainder_(num_experts + 2)
    tally = torch.zeros(num_experts + 2, dtype=torch.int64, device=routing.device)
    tally.index_add_(0, buckets, _ones(routing.device, buckets.shape[0]))
    return tally[:num_experts + 1]


_ONES = {}  # device -> int64 ones, the route tally's increments (read only)


def _ones(device, n):
    ones = _ONES.get(device)
    if ones is None or ones.shape[0] < n:
        ones = _ONES[device] = torch.ones(max(n, 2 * (0 if ones is None else ones.shape[0])), dtype=torch.int64,
                                          device=device)
    return ones[:n]


# -- the dropless read -------------------------------------------------------------------------------

_READ_BACK = {}  # (device, dtype) -> (side stream, pinned host buffer)


def _start_read(values):
    """Start copying integer `values` to the host; _finish_read waits for them. On a GPU the copy
    is queued into pinned memory and a side stream waits for it: kernels queued after this call
    (permute's) run while the host waits on the side stream, which waits for the copy alone (and
    torch's sync debug mode sees the wait, which an event's would hide)."""
    if values.device.type != "cuda":
        return values, None
    key = values.device, values.dtype
    side, host = _READ_BACK.get(key, (None, None))
    if side is None or host.shape[0] < values.numel():
        side = torch.cuda.Stream(values.device) if side is None else side
        host = torch.empty(max(values.numel(), 1024), dtype=values.dtype, pin_memory=True)
        _READ_BACK[key] = side, host
    host = host[:values.numel()].view(values.shape)
    host.copy_(values, non_blocking=True)
    side.wait_stream(torch.cuda.current_stream(values.device))
    return (values, side), host


def _finish_read(reading):
    """The values of a _start_read as a flat list: the dispatch's one host synchronisation."""
    source, host = reading
    if host is None:
        return source.reshape(-1).tolist()
    source[1].synchronize()  # (source[0], the device values, stays alive until the copy is done)
    return host.reshape(-1).tolist()
