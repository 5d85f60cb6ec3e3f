"""Expert parallelism on GPUs: `dispatch` and `combine` over torch.distributed, written once for
every Triton variant (each generated module binds them: `module.dispatch`, `module.combine`).

The experts are split evenly over the group's ranks in rank order: rank r owns experts
[r * L, (r + 1) * L), L = num_experts / world size. dispatch sends every route of this rank's
tokens to the rank owning its expert and returns, on each rank, the rows of its L experts:

    permute (the variant's kernels: rows expert-major, so destination-rank-major: the send buffer
             as it is, except for padded variants and capacity mode over several ranks, which pack
             it with one row gather)
      -> all_to_all_single of the rows (probs, scales beside them), split sizes per rank
      -> regroup the received rows from (source, local expert) to (local expert, source) order:
         one chunk sort (the variant's kernel, one pass at the copy floor), left out where the
         received rows already are in that order (one rank, or one local expert without capacity
         slots; never for padded variants)

Received rows are grouped by local expert; within an expert by source rank, then token (then
slot): the rows single-rank `permute` gives over all ranks' tokens concatenated in rank order,
restricted to this rank's experts. Padded variants pad on the receiver: each local expert's
segment, all sources together, is padded to a multiple of pad with zero rows, as single-rank
permute pads it (the sender's per-expert padding is not sent). combine runs the same steps
backwards (the inverse chunk sort, the reverse all-to-all) and merges with the variant's unpermute
kernels, which read the send buffer directly through permute's row map (padded variants and
packed sends: a copy of it whose routes point at their send rows, `send_map`, dropped routes at
-1). Both are differentiable: the backward pass of one is the other's data path, then permute's
(unpermute's) backward kernels over the same map.

Two modes:

- dropless (recv_capacity=None): the route counts per expert are counted on the device (by
  permute's routing kernel where permute's rows are known before the counts, else by a pass over
  the routing), exchanged with one small all-to-all and read back once, with the counts received
  and the routing check (the one device-to-host read, as Megatron's all-to-all dispatcher does);
  permute's rows move while the host waits for them and works out the split sizes. Nothing is
  dropped; expert ids out of range raise on every rank (check_routing=False skips it).
- fixed capacity (recv_capacity=C): C is per rank pair. Each rank sends every other rank (and
  itself) exactly C rows, so all split sizes are static: nothing is read back and nothing is
  allocated by data, so it is capturable in a CUDA graph and traces under
  torch.compile(fullgraph=True) (as custom ops: _EpOps). A sender keeps, per destination, its first C rows in its packed
  order (local expert, then token); the rest are dropped, never written anywhere, and contribute
  nothing in combine. The output has world_size * C rows (plus num_local_experts * (pad - 1) for
  padded variants): the kept rows in the layout above, then zero rows. `DispatchResult.dropped`
  counts, per source rank, the rows routed to this rank that did not fit. Mask routing sizes the
  sender's buffer by its routes per token: pass topk (permute's hint) or it is sized for
  num_experts routes per token. The routing is checked only with check_routing=True (one host read).

With one rank nothing is exchanged: the counts and rows a rank would send itself are used where they
are (dispatch's rows are permute's), so a one-rank group costs what permute and unpermute cost.

Before any collective sized by them, eager dispatch and combine swap a few words on the host (the
ranks' input refusals and settings) so that a rank refusing its input, or ranks that disagree on a
setting, raise on every rank instead of aborting gloo or leaving a peer waiting (_agree).

The collectives move bytes, so every dtype goes through gloo (CPU) and NCCL (GPU) alike.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ..core.contract import (_is_int, check_permute, check_tensor, combine_dtype, out_dtype, prob_dtypes,
                             routing_error, scale_columns, scale_dtype)
from ..core.ops import _call_key, _eager_apply, _prefix, _Registered, _remember
from ..core.results import RowIdMap, RowMapLayout, row_map_words


@dataclass
class EpHandle:
    """What dispatch leaves for combine and the backward passes (opaque to users)."""

    ops: object  # the variant's permgen.core.ops.Ops
    # A weak reference: a handle (and the autograd graph holding it) must not keep the process group
    # alive past destroy_process_group, or gloo's group is torn down at interpreter exit instead,
    # which aborted the process now and then ("terminate called without an active exception").
    group_ref: weakref.ref
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
        group = self.group_ref()
        if group is None:
            raise ValueError(f"{self.ops.name}: the process group of this dispatch was destroyed")
        return group


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
    return ops.chunk_sort.kernels.gather_rows(rows, moved).view(src.dtype)


def _wire(t):
    """t as the collectives move it: fp8 as bytes (gloo and NCCL have no fp8 types), the rest as it is."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype.is_floating_point else t


def _exchange_rows(x, out_splits, in_splits, group, rows):
    """all_to_all_single of the rows of x (1-D or 2-D) into `rows` rows; those past the received
    ones are zeros (the regroup's pad and empty rows). With one rank the exchange would copy x to
    itself: x is returned as it is (callers never write to it), or with its zero rows appended."""
    received = sum(out_splits)
    if len(out_splits) == 1:
        x = (x[:received] if x.shape[0] > received else x).contiguous()
        return x if rows == received else torch.cat((x, x.new_zeros((rows - received, *x.shape[1:]))))
    out = got = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if rows > received:
        got = out[:received]
        out[received:].zero_()
    dist.all_to_all_single(_wire(got), _wire(x.contiguous()), out_splits, in_splits, group=group)
    return out


def _sort(h: EpHandle, inverse, rows, probs):
    """The regroup's chunk sort (inverse: its undoing) of rows and probs beside them (either may be None)."""
    if rows is None:
        return None, h.ops.chunk_sort.kernels.sort_chunks(h.table, inverse, probs.contiguous().view(-1, 1), None)[0].view(-1)
    return h.ops.chunk_sort.kernels.sort_chunks(h.table, inverse, rows.contiguous(), None if probs is None else probs.contiguous())


def _to_experts(h: EpHandle, rows, probs=None):
    """Send rows (the send buffer's layout) -> this rank's expert-major rows (dispatch's
    direction), and probs beside them (either may be None). Output rows with no source (padding,
    empty slots) are zeros."""
    got, got_probs = (None if x is None else _exchange_rows(x, h.recv_splits, h.send_splits, h.group, h.num_out)
                      for x in (rows, probs))
    return (got, got_probs) if h.table is None else _sort(h, False, got, got_probs)


def _to_sources(h: EpHandle, rows, probs=None):
    """Expert-major rows -> the send buffer's layout on their source ranks (combine's direction),
    and probs beside them (either may be None). Send rows that carried no route (empty capacity
    slots) come back unspecified and are never read."""
    if h.table is not None:
        rows, probs = _sort(h, True, rows, probs)
    received, sent = sum(h.recv_splits), sum(h.send_splits)
    return tuple(None if x is None else _exchange_rows(x if x.shape[0] == received else x[:received], h.send_splits,
                                                       h.recv_splits, h.group, sent)
                 for x in (rows, probs))


def _pack(h: EpHandle, permuted):
    """permute's rows -> the send buffer: their first rows (a view), or the routed rows gathered
    (padded variants; capacity mode over several ranks, slotted)."""
    if h.pack_rows is None:
        sent = sum(h.send_splits)
        return permuted if permuted.shape[0] == sent else permuted[:sent]
    return _gather_rows(h.ops, h.pack_rows, permuted)


def _dispatch_rows(h: EpHandle, res):
    """permute's rows and probs -> this rank's experts' rows and probs."""
    if h.table is None and h.pack_rows is None and len(h.send_splits) == 1:  # one rank: permute's rows
        rows, probs, n = res.tokens, res.probs, h.num_out
        return (rows, probs) if rows.shape[0] == n else (rows[:n], None if probs is None else probs[:n])
    return _to_experts(h, _pack(h, res.tokens), None if res.probs is None else _pack(h, res.probs))


def _needs_grad(*tensors):
    """Whether autograd must see the call (its Function costs the host more than the rest of a combine)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Dispatch(torch.autograd.Function):
    """tokens, probs -> this rank's experts' rows and probs. The backward pass returns the
    gradients to the send buffer and runs permute's backward kernels over the send row map."""

    @staticmethod
    def forward(ctx, h, res, tokens, probs):
        ctx.h = h
        ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)
        out, out_probs = _dispatch_rows(h, res)
        if res.tokens.dtype != tokens.dtype or tokens.dtype.itemsize == 1:
            ctx.mark_non_differentiable(out)  # fp8 rows (moved or quantised) are never differentiated
        ctx.set_materialize_grads(False)
        return out, out_probs

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        h, needs = ctx.h, ctx.needs_input_grad
        grad_out = grad_out if needs[2] else None
        grad_probs = grad_probs if needs[3] else None
        if grad_out is None and grad_probs is None:
            return None, None, None, None
        grad_rows, grad_row_probs = _to_sources(h, grad_out, grad_probs)
        grad_tokens, grad_probs = h.ops.backend.permute_backward(
            h.send_map, grad_rows, grad_row_probs, None if grad_row_probs is None else ctx.probs_meta)
        return None, None, grad_tokens, grad_probs


class _Combine(torch.autograd.Function):
    """expert outputs -> their source ranks, merged by unpermute's kernels over the send row map."""

    @staticmethod
    def forward(ctx, h, expert_out, merging_probs):
        ctx.h = h
        returned = _to_sources(h, expert_out)[0]
        ctx.save_for_backward(*((returned, merging_probs) if merging_probs is not None else ()))
        return h.ops.backend.unpermute(h.send_map, returned, merging_probs)

    @staticmethod
    def backward(ctx, grad):
        h, needs = ctx.h, ctx.needs_input_grad
        returned, merging_probs = ctx.saved_tensors if ctx.saved_tensors else (None, None)
        grad_rows, grad_probs = h.ops.backend.unpermute_backward(h.send_map, grad.contiguous(), returned,
                                                                 merging_probs)
        grad_expert_out = _to_experts(h, grad_rows)[0] if needs[1] else None
        return None, grad_expert_out, grad_probs if needs[2] else None


_dispatch_apply, _combine_apply = _eager_apply(_Dispatch), _eager_apply(_Combine)


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


# -- plans: every size below is a device tensor, except in dropless mode after its one read ----------

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


def _exchange_counts(counts, group, world, local):
    """counts [E + 1]: this rank's routes to each expert, then its bad routes. One small
    all-to-all sends each rank its experts' counts and the bad routes. Returns (payload, received
    [W, L + 1]): the payload, what the host reads, is what was sent then what was received (with
    one rank they are the same, so only what was received)."""
    if world == 1:  # what one rank sends itself: no collective
        payload = received = counts.view(1, -1)
        return payload, received
    payload = counts.new_empty((2, world, local + 1))
    sent, received = payload
    torch.cat([counts[:-1].view(world, local), counts[-1:].expand(world, 1)], 1, out=sent)
    dist.all_to_all_single(received, sent, group=group)
    return payload, received


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


def _raise_bad_routing(ops, routing, num_experts, width, bad_per_source, me):
    """Every rank raises when any rank's routing is bad (the others would wait on it forever)."""
    if bad_per_source[me]:
        raise ValueError(f"{ops.name}: {routing_error(ops.variant, routing, num_experts, width)}")
    culprits = [s for s, bad in enumerate(bad_per_source) if bad]
    raise ValueError(f"{ops.name}: the routing of rank(s) {culprits} of the group is invalid (they raise the details); "
                     "no rank dispatched")


# ProcessGroup -> [world size, this process's rank in it, backend, host channel, checked dispatches]:
# what the checks learn once per group (the channel, a gloo group over the same ranks, is made on first
# use; the checked dispatches: _checked_dispatch's).
_GROUPS = weakref.WeakKeyDictionary()


def _check_group(name, group):
    """(world size, rank) of this process in the group, after checking it is one."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: torch.distributed is not initialised; call torch.distributed.init_process_group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: group must be a torch.distributed ProcessGroup (dist.group.WORLD for every rank), "
                        f"got {type(group).__name__}")
    facts = _GROUPS.get(group)
    if facts is None:
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"{name}: this process is not a member of the group")
        facts = _GROUPS[group] = [dist.get_world_size(group), rank, str(dist.get_backend(group)), None, {}]
    return facts[0], facts[1]


def _check_backend(name, group, device):
    if _GROUPS[group][2] == "nccl" and device.type != "cuda":
        raise ValueError(f"{name}: the group's backend is nccl but the tokens are on {device}")


# -- agreement: every rank refuses when any rank refused its input or the ranks' settings differ ------
#
# The words go over a gloo group on host memory: comparing them reads nothing from a device (no
# synchronisation, nothing captured in a CUDA graph), and a fixed number of words never depends on
# the settings being compared, so this exchange cannot itself mismatch. The collectives after it are
# sized by these settings; a rank that disagreed would abort gloo or leave NCCL waiting.

_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool)


def _dtype_word(t):
    if t is None:
        return 0
    return _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES) + (hash(str(t.dtype)) & 0xFFFF)


def _show(label, word):
    if label.endswith("dtype"):
        return str(_DTYPES[word]) if 0 < word < len(_DTYPES) else ("absent" if word == 0 else f"dtype #{word}")
    return "None" if word < 0 else str(word)


def _host_channel(group):
    """The group itself where it moves CPU tensors (gloo), else a gloo group over its ranks, made
    once by its members (the first dispatch on a group is a call every member makes)."""
    facts = _GROUPS[group]
    if facts[3] is None:
        if "gloo" in facts[2]:
            facts[3] = group
        else:
            facts[3] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                      use_local_synchronization=True)
    return facts[3]


def _agree(name, what, group, world, me, refused, labels, words):
    """One all_gather of 1 + len(words) int64 words over the host channel. Raises on every rank:
    the refusing ranks their own error (`refused`), the others naming them; else, where the ranks'
    words differ, naming each argument and every rank's value."""
    if world == 1:
        if refused is not None:
            raise refused
        return
    mine = torch.tensor([int(refused is not None), *words], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=_host_channel(group))
    rows = [t.tolist() for t in everyone]  # host memory: no device read
    if refused is not None:
        raise refused
    culprits = [r for r, row in enumerate(rows) if row[0]]
    if culprits:
        raise ValueError(f"{name}: {what} refused the input of rank(s) {culprits} of the group (they raise the "
                         f"details); no rank {what}ed")
    differ = ["{}: {}".format(label, ", ".join(f"rank {r} {_show(label, row[i + 1])}" for r, row in enumerate(rows)))
              for i, label in enumerate(labels) if len({row[i + 1] for row in rows}) > 1]
    if differ:
        raise ValueError(f"{name}: the ranks of the group disagree on what sizes the {what}'s collectives, so no "
                         f"rank {what}ed (rank {me} raises this too): " + "; ".join(differ))


_DISPATCH_WORDS = ("variant", "hidden size (tokens.shape[1])", "tokens.dtype", "num_experts",
                   "recv_capacity (None: dropless)", "routes per token (routing.shape[1] or topk)", "topk",
                   "probs columns (None: no probs)", "probs.dtype", "scale columns (None: no scale)", "scale.dtype",
                   "check_routing")


def _variant_word(ops):
    import zlib

    return zlib.crc32(ops.name.encode())


def _dispatch_words(ops, tokens, probs, scale, num_experts, width, capacity, topk, check):
    def cols(t):
        return -1 if t is None else (t.shape[1] if t.dim() > 1 else 1)

    return (_variant_word(ops), tokens.shape[1], _dtype_word(tokens), num_experts,
            -1 if capacity is None else capacity, width, -1 if topk is None else topk, cols(probs), _dtype_word(probs),
            cols(scale), _dtype_word(scale), int(bool(check)))


# -- the public functions ------------------------------------------------------------------------

def run_dispatch(ops, tokens, routing, probs=None, scale=None, *, group, num_experts=None, recv_capacity=None,
                 topk=None, check_routing=None) -> DispatchResult:
    name = ops.name
    compiling = torch.compiler.is_compiling()
    world, me = (group.size(), None) if compiling else _check_group(name, group)
    check = recv_capacity is None if check_routing is None else check_routing
    if compiling:
        plan = _check_dispatch(ops, tokens, routing, probs, scale, group, num_experts, recv_capacity, topk,
                               check_routing, world, compiling)
    else:
        refused, plan, words = _checked_dispatch(ops, tokens, routing, probs, scale, group, num_experts,
                                                 recv_capacity, topk, check_routing, world, check)
        _agree(name, "dispatch", group, world, me, refused, _DISPATCH_WORDS, words)
    num_experts = plan.num_experts
    if compiling:
        if recv_capacity is None or check:
            raise ValueError(f"{name}: under torch.compile dispatch needs recv_capacity (dropless mode and "
                             "check_routing read sizes back from the device)")
        return _COMPILED_EP[ops.prefix].dispatch(tokens, routing, probs, scale, group, num_experts, plan.width,
                                                 recv_capacity, topk)
    with torch.no_grad():  # _Dispatch's backward pass runs permute's backward kernels itself
        res, handle, tokens_per_expert = _plan(ops, plan, tokens, routing, probs, scale, group, world, topk,
                                               recv_capacity, check)
    if _needs_grad(tokens, probs):
        out, out_probs = _dispatch_apply(handle, res, tokens, probs)
    else:
        out, out_probs = _dispatch_rows(handle, res)
    out_scale = None if res.scale is None else _to_experts(handle, _pack(handle, res.scale))[0]
    return DispatchResult(out, out_probs, out_scale, tokens_per_expert, handle)


def _checked_dispatch(ops, tokens, routing, probs, scale, group, num_experts, recv_capacity, topk, check_routing,
                      world, check):
    """(this rank's refusal or None, permute's plan, the words _agree compares) of an eager dispatch. A
    call like one already checked on this group (the same shapes, dtypes, devices, contiguity and
    settings) costs a dict lookup: the checks and the words are kept with the group (_GROUPS)."""
    try:
        key = (ops.prefix, *_call_key((tokens, routing, probs, scale), (num_experts, recv_capacity, topk,
                                                                         check_routing)))
        checked = _GROUPS[group][4]
        kept = checked.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable arguments: the checks say what is wrong
        key = kept = checked = None
    if kept is not None:
        return None, *kept
    try:  # a rank refusing its input tells the others before any collective, so none waits on it
        plan = _check_dispatch(ops, tokens, routing, probs, scale, group, num_experts, recv_capacity, topk,
                               check_routing, world, False)
    except (TypeError, ValueError) as e:
        return e, None, (0,) * len(_DISPATCH_WORDS)
    words = () if world == 1 else _dispatch_words(ops, tokens, probs, scale, plan.num_experts, plan.width,
                                                  recv_capacity, topk, check)
    _remember(checked, key, (plan, words))
    return None, plan, words


def _check_dispatch(ops, tokens, routing, probs, scale, group, num_experts, recv_capacity, topk, check_routing,
                    world, compiling):
    """This rank's input checks (raising before any collective); returns permute's plan."""
    name = ops.name
    if num_experts is None and not ops.variant.mask:
        raise ValueError(f"{name}: dispatch needs num_experts, the experts of all ranks together (index routing "
                         "does not say how many there are); each rank owns num_experts / world size of them")
    if recv_capacity is not None and not _is_int(recv_capacity):
        raise TypeError(f"{name}: recv_capacity must be an int or None, got {type(recv_capacity).__name__}")
    if recv_capacity is not None and recv_capacity < 1:
        raise ValueError(f"{name}: recv_capacity must be at least 1, got {recv_capacity}")
    if check_routing is not None and not isinstance(check_routing, bool):
        raise TypeError(f"{name}: check_routing must be a bool or None, got {type(check_routing).__name__}")
    plan = check_permute(ops.variant, tokens, routing, probs, scale, num_experts, None, topk, False)
    ops.backend.check_device(tokens)
    if not compiling:
        _check_backend(name, group, tokens.device)
    if plan.num_experts % world:
        raise ValueError(f"{name}: num_experts={plan.num_experts} must be divisible by the group's {world} ranks "
                         "(experts are split evenly over the ranks)")
    return plan


def _plan(ops, plan, tokens, routing, probs, scale, group, world, topk, recv_capacity, check):
    """permute, the split sizes and the regroup: (PermuteResult, EpHandle, tokens_per_expert)."""
    local = plan.num_experts // world
    pad = ops.variant.pad
    if recv_capacity is None:
        res, send_map, pack_rows, send_splits, recv_splits, kept, num_out, dropped, tokens_per_expert = \
            _dropless_plan(ops, plan, tokens, routing, probs, scale, group, world, local, topk, check)
    else:
        res, send_map, pack_rows, kept, dropped = _capacity_plan(ops, plan, tokens, routing, probs, scale, group,
                                                                 world, local, topk, recv_capacity, check)
        send_splits = recv_splits = [recv_capacity] * world
        num_out = _capacity_rows(world, local, pad, recv_capacity)
        tokens_per_expert = None
    if _regroup_needed(world, local, pad, recv_capacity):
        blocks = (kept.sum(1) if recv_capacity is None
                  else torch.full((world,), recv_capacity, dtype=torch.int64, device=tokens.device))
        table, tokens_per_expert = _regroup_table(kept.long(), blocks, num_out, pad)
    else:
        table = None  # the received rows are already in (local expert, source) order
        if tokens_per_expert is None:
            tokens_per_expert = kept.sum(0, dtype=torch.int64)
    handle = EpHandle(ops, weakref.ref(group), send_map, send_splits, recv_splits, pack_rows, table, num_out,
                      plan.hidden, dropped)
    return res, handle, tokens_per_expert


def _capacity_rows(world, local, pad, capacity):
    """Rows of a capacity-mode dispatch's output."""
    return world * capacity + (local * (pad - 1) if pad else 0)


def _regroup_needed(world, local, pad, capacity):
    """Whether received rows need the chunk sort: not with one rank, nor with one local expert and no
    capacity slots, unless padded."""
    return bool(pad) or not (world == 1 or (local == 1 and capacity is None))


def _no_drops(world, device):
    return lambda: torch.zeros(world, dtype=torch.int64, device=device)


def _dropless_plan(ops, plan, tokens, routing, probs, scale, group, world, local, topk, check):
    """Route counts (and the routing check) exchanged and read back once; padded variants pack
    their routed rows (pad rows stay home).

    Where permute's rows are known before the counts (one per route slot: index routing, mask
    routing with topk, no padding), permute's routing kernel counts the routes and the bad ones, and
    the count exchange and its copy to the host are queued between its two launches: the host's
    wait for the counts, and its work after them (split sizes, the rows' all-to-all), overlap the
    rows' move instead of following it. The others (padded variants; mask routing without topk)
    count with a pass over the routing and run permute after the read."""
    num_experts, pad = plan.num_experts, ops.variant.pad
    early = not pad and (not ops.variant.mask or topk is not None)
    res = None
    if early:
        start, end = _count_words(ops.variant.mask, plan.num_tokens, plan.width, num_experts)
        queued = {}

        def exchange(row_map):  # the segment counts [E], then the dropped routes: all of them bad ones here
            payload, queued["received"] = _exchange_counts(row_map[start:end], group, world, local)
            queued["reading"] = _start_read(payload)

        res = ops.result(plan, routing, ops.backend.permute(_every_route(plan), tokens, routing, probs, scale,
                                                            routed=exchange))
        received, reading = queued["received"], queued["reading"]
    else:
        counts = _route_tally(ops, routing, num_experts, plan.width, check)
        payload, received = _exchange_counts(counts, group, world, local)
        reading = _start_read(payload)
    # Each local expert's rows (with a regroup, its table's segment sizes): with one rank, permute's own
    # counts; else summed over the sources, queued before the read, not after it.
    tokens_per_expert = None
    if world > 1 and not _regroup_needed(world, local, pad, None):
        tokens_per_expert = received[:, :local].sum(0, dtype=torch.int64)
    host = _finish_read(reading)  # the one device-to-host read
    step = local + 1
    got = host[-world * step:]  # [W, L + 1] per source: its counts of this rank's experts, its bad routes
    own = host[:world * step]  # the same for what this rank sent (with one rank, the same words)
    send_splits = [sum(own[d * step:d * step + local]) for d in range(world)]
    recv_splits = [sum(got[s * step:s * step + local]) for s in range(world)]
    if check and any(got[local::step]):
        _raise_bad_routing(ops, routing, num_experts, plan.width, got[local::step], dist.get_rank(group))
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
    if world == 1 and not pad:
        tokens_per_expert = res.tokens_per_expert
    return (res, send_map, pack_rows, send_splits, recv_splits, received[:, :local], num_out,
            _no_drops(world, tokens.device), tokens_per_expert)


@functools.lru_cache(maxsize=256)
def _count_words(mask, num_tokens, width, num_experts):
    """[start, end) of a row map's segment counts [E] and its dropped routes, consecutive words."""
    layout = RowMapLayout(mask, num_tokens, width, num_experts)
    return layout.segment_counts, layout.route_tallies + 1


@functools.lru_cache(maxsize=256)
def _every_route(plan):
    """permute's plan with a row for every route slot, its routing checked by the dispatch."""
    return plan._replace(num_out_tokens=plan.num_tokens * plan.width, check_routing=False)


def _capacity_plan(ops, plan, tokens, routing, probs, scale, group, world, local, topk, capacity, check):
    """Static sizes: every rank pair exchanges `capacity` rows; nothing is read back (unless
    check_routing asks for it)."""
    num_experts, pad = plan.num_experts, ops.variant.pad
    device = tokens.device
    if world == 1 and not pad:
        # One destination: the per-pair capacity is permute's own row cap (it keeps the first rows
        # in expert order, drops the rest and zeroes the rows it does not fill). The row map's
        # segment counts and route tallies (dropped, of them without a slot) are consecutive words:
        # they are what this rank receives from itself (no collective).
        res = ops.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=capacity,
                          topk=topk, check_routing=False)
        start = RowMapLayout(ops.variant.mask, plan.num_tokens, plan.width, num_experts).segment_counts
        counts_in = res.row_id_map.row_map[start:start + num_experts + 2]
        if check and counts_in[-1:].tolist()[0]:  # check_routing's host read
            _raise_bad_routing(ops, routing, num_experts, plan.width, [1], 0)
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
    counts_in = torch.empty((world, local + 2), dtype=torch.int64, device=device)
    dist.all_to_all_single(counts_in, torch.cat([fit, routed.expand(world, 1), bad.expand(world, 1)], 1),
                           group=group)
    if check:
        bad_per_source = counts_in[:, -1].tolist()  # check_routing's host read
        if any(bad_per_source):
            _raise_bad_routing(ops, routing, num_experts, plan.width, bad_per_source, dist.get_rank(group))
    kept = counts_in[:, :local]
    return res, send_map, pack_rows, kept, lambda: counts_in[:, local] - kept.sum(1)


def run_combine(ops, expert_out, handle, merging_probs=None):
    name = ops.name
    if not isinstance(handle, EpHandle):
        raise TypeError(f"{name}: handle must be the DispatchResult.handle of this module's dispatch, "
                        f"got {type(handle).__name__}")
    compiling = torch.compiler.is_compiling()
    group = handle.group
    refused = None
    try:  # as in dispatch: a refusal here reaches every rank before the rows move
        _check_combine(ops, expert_out, handle, merging_probs)
    except (TypeError, ValueError) as e:
        if compiling:
            raise
        refused = e
    if not compiling:
        world, me = _check_group(name, group)
        _agree(name, "combine", group, world, me, refused, ("variant",), (_variant_word(handle.ops),))
        return _combine_rows(ops, expert_out, handle, merging_probs)
    return _COMPILED_EP[ops.prefix].combine(expert_out, handle, merging_probs)


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


def _combine_rows(ops, expert_out, handle, merging_probs):
    if _needs_grad(expert_out, merging_probs):
        return _combine_apply(handle, expert_out, merging_probs)
    return ops.backend.unpermute(handle.send_map, _to_sources(handle, expert_out)[0], merging_probs)


# -- torch.compile: capacity mode as custom ops ------------------------------------------------------

_COMPILED_EP = {}  # ops.prefix -> _EpOps


def _empty(like, *shape, dtype=None):
    return like.new_empty(shape, dtype=like.dtype if dtype is None else dtype)


class _EpOps(_Registered):
    """Capacity-mode dispatch and combine of one variant as torch.library custom ops, so that
    torch.compile(fullgraph=True) sees each as one opaque op with static shapes (its sizes depend on
    the group's size, num_experts and recv_capacity only), with their backward passes as ops too.
    They run the eager code; absent outputs are empty tensors. Registered in the `permgen`
    namespace as `<target>_<variant>_ep_dispatch`, `_ep_dispatch_backward`, `_ep_combine`,
    `_ep_combine_backward`, on the first compiled call that needs them, never at import (the
    single-GPU ops' mechanism, permgen.core.ops._Registered; eager dispatch and combine use no op). The
    group travels as its name (torch.distributed resolves it)."""

    def __init__(self, ops):
        super().__init__(_prefix(ops.prefix, "ep"))
        self.ops = ops

    def _register(self):
        sizes = "str group_name, SymInt num_tokens, SymInt width, SymInt num_experts, SymInt capacity"
        self._define({
            "dispatch": (self._dispatch, self._dispatch_fake,
                         "(Tensor tokens, Tensor routing, Tensor? probs, Tensor? scale, str group_name, "
                         "SymInt num_experts, SymInt width, SymInt capacity, SymInt? topk) -> (Tensor out, "
                         "Tensor out_probs, Tensor out_scale, Tensor tokens_per_expert, Tensor send_row_map, "
                         "Tensor table, Tensor dropped)"),
            "dispatch_backward": (self._dispatch_backward, self._dispatch_backward_fake,
                                  f"(Tensor send_row_map, Tensor table, Tensor? grad_out, Tensor? grad_probs, {sizes}, "
                                  "SymInt prob_columns, ScalarType probs_dtype) -> (Tensor grad_tokens, "
                                  "Tensor grad_probs)"),
            "combine": (self._combine, self._combine_fake,
                        f"(Tensor expert_out, Tensor send_row_map, Tensor table, Tensor? merging_probs, {sizes}) "
                        "-> (Tensor out, Tensor returned)"),
            "combine_backward": (self._combine_backward, self._combine_backward_fake,
                                 f"(Tensor send_row_map, Tensor table, Tensor grad, Tensor returned, "
                                 f"Tensor? merging_probs, {sizes}) -> (Tensor grad_expert_out, Tensor grad_probs)"),
        })
        # Only the ops' autograd: eager calls take _Dispatch / _Combine, not the ops.
        self._custom_ops["dispatch"].register_autograd(self._dispatch_grad, setup_context=self._dispatch_setup)
        self._custom_ops["combine"].register_autograd(self._combine_grad, setup_context=self._combine_setup)

    # -- the handle from the ops' arguments --------------------------------------------------------

    def _sizes(self, group, num_experts, capacity):
        """(group, world size, rows of dispatch's output); group: a ProcessGroup, or its name."""
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group)
        world = group.size()
        return group, world, _capacity_rows(world, num_experts // world, self.ops.variant.pad, capacity)

    def _handle(self, send_row_map, table, group, num_tokens, width, num_experts, capacity, hidden, routing=None):
        group, world, num_out = self._sizes(group, num_experts, capacity)
        send_map = RowIdMap(send_row_map, routing, num_tokens, width, num_experts, world * capacity, self.ops.name)
        return EpHandle(self.ops, weakref.ref(group), send_map, [capacity] * world, [capacity] * world, None,
                        table if table.numel() else None, num_out, hidden, None)

    def _row_map_words(self, world, num_tokens, width, num_experts):
        if world == 1 and not self.ops.variant.pad:  # permute's own map (see _capacity_plan)
            return row_map_words(self.ops.variant.mask, num_tokens, width, num_experts)
        return RowMapLayout(self.ops.variant.mask, num_tokens, width, num_experts).route_tallies  # _send_row_map's

    # -- dispatch ----------------------------------------------------------------------------------

    def dispatch(self, tokens, routing, probs, scale, group, num_experts, width, capacity, topk):
        ops = self.ops
        out, out_probs, out_scale, tokens_per_expert, send_row_map, table, dropped = self.op["dispatch"](
            tokens, routing, probs, scale, group.group_name, num_experts, width, capacity, topk)
        handle = self._handle(send_row_map, table, group, tokens.shape[0], width, num_experts, capacity,
                              tokens.shape[1], routing)
        handle.dropped_rows = dropped
        return DispatchResult(out, out_probs if ops.variant.probs else None, out_scale if ops.variant.makes_scale else None,
                              tokens_per_expert, handle)

    def _dispatch(self, tokens, routing, probs, scale, group_name, num_experts, width, capacity, topk):
        ops = self.ops
        group, world, _ = self._sizes(group_name, num_experts, capacity)
        plan = check_permute(ops.variant, tokens, routing, probs, scale, num_experts, None, topk, False)
        res, h, tokens_per_expert = _plan(ops, plan, tokens, routing, probs, scale, group, world, topk, capacity,
                                          False)
        out, out_probs = _to_experts(h, _pack(h, res.tokens), None if res.probs is None else _pack(h, res.probs))
        out_scale = _to_experts(h, _pack(h, res.scale))[0] if res.scale is not None else _empty(tokens, 0, 0)
        table = h.table if h.table is not None else _empty(tokens, 0, 0, dtype=torch.int32)
        return (out, out_probs if out_probs is not None else _empty(tokens, 0, dtype=torch.float32), out_scale,
                tokens_per_expert, h.send_map.row_map, table, h.dropped)

    def _dispatch_fake(self, tokens, routing, probs, scale, group_name, num_experts, width, capacity, topk):
        ops, variant = self.ops, self.ops.variant
        _, world, num_out = self._sizes(group_name, num_experts, capacity)
        local, pad = num_experts // world, variant.pad
        hidden = tokens.shape[1]
        out = _empty(tokens, num_out, hidden, dtype=out_dtype(variant))
        out_probs = _empty(tokens, 0, dtype=torch.float32) if probs is None else _empty(probs, num_out)
        out_scale = _empty(tokens, 0, 0)
        if ops.variant.makes_scale:
            out_scale = _empty(tokens, num_out, scale_columns(variant, hidden), dtype=scale_dtype(variant))
        chunks = world * local + (local if pad else 0)
        table = _empty(tokens, *((4, chunks + 1) if _regroup_needed(world, local, pad, capacity) else (0, 0)),
                       dtype=torch.int32)
        words = self._row_map_words(world, tokens.shape[0], width, num_experts)
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
        grad_tokens, grad_in_probs = self.op["dispatch_backward"](send_row_map, table, grad_out, grad_probs,
                                                                  *ctx.sizes, *ctx.probs_meta)
        return (grad_tokens if grad_out is not None else None, None,
                grad_in_probs if grad_probs is not None else None, *(None,) * 6)

    def _dispatch_backward(self, send_row_map, table, grad_out, grad_probs, group_name, num_tokens, width,
                           num_experts, capacity, prob_columns, probs_dtype):
        hidden = 0 if grad_out is None else grad_out.shape[1]
        h = self._handle(send_row_map, table, group_name, num_tokens, width, num_experts, capacity, hidden)
        rows, row_probs = _to_sources(h, grad_out, grad_probs)
        grad_tokens, grad_in_probs = self.ops.backend.permute_backward(
            h.send_map, rows, row_probs, None if row_probs is None else ((num_tokens, prob_columns), probs_dtype))
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
        returned = _to_sources(h, expert_out)[0]
        out = self.ops.backend.unpermute(h.send_map, returned, merging_probs)
        if returned is expert_out:  # (one rank) an op's output may not alias its input: see _combine_setup
            returned = _empty(expert_out, 0, expert_out.shape[1])
        return out, returned

    def _combine_fake(self, expert_out, send_row_map, table, merging_probs, group_name, num_tokens, width,
                      num_experts, capacity):
        _, world, _ = self._sizes(group_name, num_experts, capacity)
        hidden = expert_out.shape[1]
        returned = 0 if world == 1 and not self.ops.variant.pad else world * capacity  # (see _combine)
        return _empty(expert_out, num_tokens, hidden), _empty(expert_out, returned, hidden)

    def _combine_setup(self, ctx, inputs, output):
        expert_out, send_row_map, table, merging_probs = inputs[:4]
        ctx.merging = merging_probs is not None
        # The rows that came back: with one rank, expert_out itself (the op returns no copy of it).
        returned = output[1] if output[1].shape[0] else expert_out
        ctx.save_for_backward(send_row_map, table, returned, *((merging_probs,) if ctx.merging else ()))
        ctx.sizes = inputs[4:]
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    def _combine_grad(self, ctx, grad, _):
        if grad is None:
            return (None,) * 9
        send_row_map, table, returned, *merging = ctx.saved_tensors
        grad_expert_out, grad_probs = self.op["combine_backward"](send_row_map, table, grad, returned,
                                                                  merging[0] if merging else None, *ctx.sizes)
        needs = ctx.needs_input_grad
        return (grad_expert_out if needs[0] else None, None, None, grad_probs if ctx.merging and needs[3] else None,
                *(None,) * 5)

    def _combine_backward(self, send_row_map, table, grad, returned, merging_probs, group_name, num_tokens, width,
                          num_experts, capacity):
        h = self._handle(send_row_map, table, group_name, num_tokens, width, num_experts, capacity, grad.shape[1])
        rows, grad_probs = self.ops.backend.unpermute_backward(h.send_map, grad.contiguous(),
                                                               returned if merging_probs is not None else None,
                                                               merging_probs)
        return _to_experts(h, rows)[0], grad_probs if grad_probs is not None else _empty(grad, 0, dtype=torch.float32)

    def _combine_backward_fake(self, send_row_map, table, grad, returned, merging_probs, group_name, num_tokens,
                               width, num_experts, capacity):
        _, _, num_out = self._sizes(group_name, num_experts, capacity)
        grad_probs = _empty(grad, 0, dtype=torch.float32) if merging_probs is None else torch.empty_like(merging_probs)
        return _empty(grad, num_out, grad.shape[1]), grad_probs


def expert_parallel(ops):
    """(dispatch, combine) of one variant, for its generated module (and its custom ops)."""
    _COMPILED_EP[ops.prefix] = _EpOps(ops)

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
