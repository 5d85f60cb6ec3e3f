"""The Triton kernels and helpers no variant axis changes, written once.

permgen.triton.host launches the kernels here for every variant (the routing plan, unpermute, the
backward passes, the chunk sort, the row gather); each generated module (generated/triton/<variant>.py)
holds its permute kernel and imports the helpers it calls from here; `python -m generator vendor`
inlines them into its self-contained file. What a variant's axes change (its probs, scales and
quantisation: permute's data movement and signature) stays in the template; what differs only by a
constant is a `tl.constexpr` here, and Triton compiles the branch not taken away: PAD = 0 and
PAD_GROUPS = 0 mean no padding, MASK selects mask routing's row map and kernels.

Triton specialises each kernel on its pointers' dtypes, so one kernel serves every dtype.
"""

import triton
import triton.language as tl

from .fp8 import bf16_bits_as_fp32, fp32_to_bf16_bits

# Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, read as Triton reads it). Its
# fp32 -> bf16 conversion truncates and its bf16 -> fp32 one misreads subnormals, where GPUs round to
# nearest even and read them exactly: there as_fp32 and stored_as take the GPU's values from integer
# arithmetic; on a GPU they are the plain conversions (what it computes does not change).
INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)

# ----------------------------------------------------------------------------------------------
# The row map (int32 words; permgen.core.results.RowMapLayout states it for the hosts), for N tokens,
# K slots per token and E experts: dst rows [N * K]; mask routing only: experts [N * K], route
# counts [N]; then segment offsets [E + 1], segment counts [E], route tallies [2] (routes dropped,
# routes without a slot). These helpers are the kernels' one statement of it.
# ----------------------------------------------------------------------------------------------


@triton.jit
def row_map_parts(row_map_ptr, num_tokens, K: tl.constexpr, E: tl.constexpr, MASK: tl.constexpr):
    """(dst rows, segment offsets, segment counts) pointers into the row map; MASK: mask routing's,
    which holds each token's experts and route count between the dst rows and the segment table."""
    segment_offsets_ptr = row_map_ptr + (2 * K + 1 if MASK else K) * num_tokens
    return row_map_ptr, segment_offsets_ptr, segment_offsets_ptr + E + 1


@triton.jit
def token_routes(row_map_ptr, num_tokens, K: tl.constexpr):
    """(experts [N, K], route counts [N]) pointers into a mask routing row map; they follow the dst rows."""
    experts_ptr = row_map_ptr + num_tokens * K
    return experts_ptr, experts_ptr + num_tokens * K


@triton.jit
def live_routes(row_map_ptr, token, num_tokens, K: tl.constexpr, MASK: tl.constexpr):
    """How many of the token's K slots to visit: under mask routing its route count, else all K
    (index routing's ids outside [0, E) route nowhere)."""
    if MASK:
        _, route_counts_ptr = token_routes(row_map_ptr, num_tokens, K)
        # At most K: a forged map's count must not make a loop over the slots longer than a real one's.
        count = tl.minimum(tl.load(route_counts_ptr + token), K)
    else:
        count = K
    return count


# ----------------------------------------------------------------------------------------------
# Routing, one launch: each program counts its block's routes per expert (under mask routing it
# also ranks every route among the block's earlier routes to the same expert); the last program to
# finish lays out the expert segments. A route's row is then its segment's start + the routes to its
# expert in earlier blocks + its rank in the block, which the permute kernel finds (place_routes).
# ----------------------------------------------------------------------------------------------


@triton.jit
def scratch_parts(scratch_ptr, num_blocks, num_tokens, K: tl.constexpr, E: tl.constexpr, MASK: tl.constexpr):
    """(ticket, block counts [num_blocks, E], ranks [N, K], block drops [num_blocks]) pointers into
    permute's routing scratch. Only mask routing's scratch holds the ranks (index routing's permute
    finds them): there they are the block drops' pointer, which no index routing kernel reads as ranks."""
    block_counts_ptr = scratch_ptr + 1
    if MASK:
        ranks_ptr = block_counts_ptr + num_blocks * E
        block_drops_ptr = ranks_ptr + num_tokens * K
    else:
        block_drops_ptr = block_counts_ptr + num_blocks * E
        ranks_ptr = block_drops_ptr
    return scratch_ptr, block_counts_ptr, ranks_ptr, block_drops_ptr


@triton.jit
def plan_segments(
    block_counts_ptr,  # int32 [num_blocks, E] in: routes per block; out: routes in earlier blocks
    block_drops_ptr,  # int32 [num_blocks] in: routes of each block that have no slot
    segment_offsets_ptr,  # int32 [E + 1] out
    segment_counts_ptr,  # int32 [E] out, then the route tallies [2]: routes dropped, routes without a slot
    tokens_per_expert_ptr,  # int64 [E] out
    num_blocks,
    num_rows,  # row cap: segments are clipped to it
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
    PAD: tl.constexpr,  # each segment's length is rounded up to a multiple of PAD; 0: no padding
):
    expert = tl.arange(0, E_POW2)
    expert_ok = expert < E
    total = tl.zeros([E_POW2], dtype=tl.int32)
    unslotted = tl.zeros([CHUNK_BLOCKS], dtype=tl.int32)
    for b0 in range(0, num_blocks, CHUNK_BLOCKS):
        block = b0 + tl.arange(0, CHUNK_BLOCKS)
        ptrs = block_counts_ptr + block[:, None] * E + expert[None, :]
        ok = (block < num_blocks)[:, None] & expert_ok[None, :]
        # volatile: other programs wrote these counts; read them from L2, not a stale cache line
        counts = tl.load(ptrs, mask=ok, other=0, volatile=True)
        tl.store(ptrs, total[None, :] + tl.cumsum(counts, axis=0) - counts, mask=ok)
        total += tl.sum(counts, axis=0)
        unslotted += tl.load(block_drops_ptr + block, mask=block < num_blocks, other=0, volatile=True)
    if PAD:
        length = (total + PAD - 1) // PAD * PAD
    else:
        length = total
    start = tl.cumsum(length, axis=0) - length
    seg_start = tl.minimum(start, num_rows)
    seg_end = tl.minimum(start + length, num_rows)
    tl.store(segment_offsets_ptr + expert, seg_start, mask=expert_ok)
    tl.store(segment_offsets_ptr + E, tl.minimum(tl.sum(length, axis=0), num_rows))
    kept = tl.minimum(start + total, num_rows) - seg_start
    tl.store(segment_counts_ptr + expert, kept, mask=expert_ok)
    tl.store(tokens_per_expert_ptr + expert, (seg_end - seg_start).to(tl.int64), mask=expert_ok)
    # Dropped: the routes past the row cap, and those without a slot.
    no_slot = tl.sum(unslotted, axis=0)
    tl.store(segment_counts_ptr + E, tl.sum(total - kept, axis=0) + no_slot)
    tl.store(segment_counts_ptr + E + 1, no_slot)


@triton.jit
def plan_segments_when_counted(
    ticket_ptr,  # int32, zero on entry: the routing programs that have counted their block
    block_counts_ptr,
    block_drops_ptr,
    segment_offsets_ptr,
    segment_counts_ptr,
    tokens_per_expert_ptr,
    num_blocks,
    num_rows,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
    PAD: tl.constexpr,
):
    """A routing program's last step, once its block is counted: the last program to get here lays
    out the segments (plan_segments) from every block's counts."""
    tl.debug_barrier()
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == num_blocks - 1:
        plan_segments(block_counts_ptr, block_drops_ptr, segment_offsets_ptr, segment_counts_ptr, tokens_per_expert_ptr,
                      num_blocks, num_rows, E, E_POW2, CHUNK_BLOCKS, PAD)
        # Every other program has taken its ticket: leave it at zero for the next launch.
        tl.store(ticket_ptr, 0)


@triton.jit
def mask_route_kernel(
    mask_ptr,  # [N, E] routing mask, nonzero = routed
    row_map_ptr,  # int32 out: the experts, route counts and segment table (permute writes the dst rows)
    tokens_per_expert_ptr,  # int64 [E] out
    scratch_ptr,  # int32: a ticket (zero on entry, left at zero), block counts, ranks, block drops (scratch_parts)
    num_tokens,
    num_blocks,
    num_rows,
    K: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    EXPERT_CHUNK: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
    PAD: tl.constexpr,  # segment lengths round up to a multiple of PAD; 0: no padding
):
    """Mask routing's plan. Each program writes its tokens' experts in ascending order and their route
    counts, ranks each route among the block's earlier routes to the same expert and counts the
    block's routes per expert; block drops: its routes past the first K of their token."""
    block = tl.program_id(0)
    _, segment_offsets_ptr, segment_counts_ptr = row_map_parts(row_map_ptr, num_tokens, K, E, MASK=True)
    ticket_ptr, block_counts_ptr, ranks_ptr, block_drops_ptr = scratch_parts(scratch_ptr, num_blocks, num_tokens, K, E,
                                                                             MASK=True)
    experts_ptr, route_counts_ptr = token_routes(row_map_ptr, num_tokens, K)
    token = block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    token_ok = token < num_tokens
    token_row = token.to(tl.int64)
    seen = tl.zeros([BLOCK_TOKENS], dtype=tl.int32)  # routes found so far = slot of the next one
    for e0 in range(0, E, EXPERT_CHUNK):
        expert = e0 + tl.arange(0, EXPERT_CHUNK)
        routed = tl.load(
            mask_ptr + token_row[:, None] * E + expert[None, :],
            mask=token_ok[:, None] & (expert < E)[None, :],
            other=0,
        ) != 0
        slot = seen[:, None] + tl.cumsum(routed.to(tl.int32), axis=1) - 1
        # Only the first K routes of a token have a slot (K < E only under a topk hint).
        kept = (routed & (slot < K)).to(tl.int32)
        rank = tl.cumsum(kept, axis=0) - kept  # earlier tokens of the block routed to this expert
        tl.store(experts_ptr + token_row[:, None] * K + slot, expert[None, :] + tl.zeros_like(slot), mask=kept != 0)
        tl.store(ranks_ptr + token_row[:, None] * K + slot, rank, mask=kept != 0)
        tl.store(block_counts_ptr + block * E + expert, tl.sum(kept, axis=0), mask=expert < E)
        seen += tl.sum(routed.to(tl.int32), axis=1)
    count = tl.minimum(seen, K)
    tl.store(route_counts_ptr + token, count, mask=token_ok)
    tl.store(block_drops_ptr + block, tl.sum(seen - count, axis=0))
    plan_segments_when_counted(ticket_ptr, block_counts_ptr, block_drops_ptr, segment_offsets_ptr, segment_counts_ptr,
                               tokens_per_expert_ptr, num_blocks, num_rows, E, E_POW2, CHUNK_BLOCKS, PAD)


@triton.jit
def index_route_kernel(
    experts_ptr,  # [N, K] expert id per route
    row_map_ptr,  # int32 out: the segment table (permute writes the dst rows)
    tokens_per_expert_ptr,  # int64 [E] out
    scratch_ptr,  # int32: a ticket (zero on entry, left at zero), block counts, block drops (scratch_parts)
    num_tokens,
    num_blocks,
    num_rows,
    K: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_ROUTES: tl.constexpr,  # power of two >= BLOCK_TOKENS * K
    BINS: tl.constexpr,  # power of two > E + 1: bin E collects the -1 ids (no route), bin E + 1 ids out of range
    CHUNK_BLOCKS: tl.constexpr,
    PAD: tl.constexpr,  # segment lengths round up to a multiple of PAD; 0: no padding
):
    """Index routing's plan. Each program counts its block's routes per expert; block drops: its
    routes with ids outside [-1, E). The permute kernel ranks the routes."""
    block = tl.program_id(0)
    _, segment_offsets_ptr, segment_counts_ptr = row_map_parts(row_map_ptr, num_tokens, K, E, MASK=False)
    ticket_ptr, block_counts_ptr, _, block_drops_ptr = scratch_parts(scratch_ptr, num_blocks, num_tokens, K, E,
                                                                     MASK=False)
    offs = tl.arange(0, BLOCK_ROUTES)
    route = block * BLOCK_TOKENS * K + offs
    in_block = (offs < BLOCK_TOKENS * K) & (route < num_tokens * K)
    expert = tl.load(experts_ptr + route, mask=in_block, other=-1)
    # Compared before the cast: an int64 id past int32 is out of range, not some expert.
    expert = tl.where((expert >= 0) & (expert < E), expert, tl.where(expert == -1, E, E + 1)).to(tl.int32)
    bins = tl.arange(0, BINS)
    histogram = tl.histogram(expert, BINS)
    tl.store(block_counts_ptr + block * E + bins, histogram, mask=bins < E)
    tl.store(block_drops_ptr + block, tl.sum(tl.where(bins == E + 1, histogram, 0), axis=0))
    plan_segments_when_counted(ticket_ptr, block_counts_ptr, block_drops_ptr, segment_offsets_ptr, segment_counts_ptr,
                               tokens_per_expert_ptr, num_blocks, num_rows, E, E_POW2, CHUNK_BLOCKS, PAD)


# ----------------------------------------------------------------------------------------------
# permute: one program per token finds its routes' rows and writes them to the row map, then copies
# the token's row (probs, scales) to them. The variant's kernel does the copy, which its axes shape.
# ----------------------------------------------------------------------------------------------


@triton.jit
def place_routes(experts_ptr, dst_rows_ptr, segment_offsets_ptr, block_offsets_ptr, token, block, s0, live, num_rows,
                 K: tl.constexpr, ROUTES: tl.constexpr, E: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                 MASK: tl.constexpr, ranks_ptr=None, BLOCK_ROUTES: tl.constexpr = None, probs_ptr=None,
                 out_probs_ptr=None):
    """(dst row, kept) of the token's slots s0 .. s0 + ROUTES - 1 (live: the token's routes; block:
    its routing block, token // BLOCK_TOKENS): each route's row, stored into the row map (-1 where
    the route is not kept), and with probs_ptr the route's prob moved to out_probs at its row. The
    probs are [N, E] under mask routing, [N, K] under index routing.

    A route's rank among its block's earlier routes to the same expert is the routing kernel's under
    mask routing (ranks_ptr); under index routing it is found here, from the ids of the block's
    BLOCK_ROUTES route slots (BLOCK_ROUTES: a power of two >= BLOCK_TOKENS * K)."""
    slot = s0 + tl.arange(0, ROUTES)
    route = token * K + slot
    # Every slot of the row map is loaded, and only then masked by the count: the loads, and the
    # segment offsets' after them, need not wait for it. Past the count an expert is any number.
    # Ids are range-tested in their own width before they narrow to int32: an int64 id such as 2**32
    # or -2**32 would otherwise narrow to a valid expert and take another route's row.
    ids = tl.load(experts_ptr + route, mask=slot < K, other=-1)
    known = (ids >= 0) & (ids < E)
    expert = ids.to(tl.int32)
    valid = (slot < live) & known
    if MASK:
        rank = tl.load(ranks_ptr + route, mask=slot < K, other=0)  # beside the expert, not after it
    else:
        # Rank of each route among the earlier routes of its block that go to the same expert.
        block_route = block * BLOCK_TOKENS * K + tl.arange(0, BLOCK_ROUTES)
        block_ids = tl.load(experts_ptr + block_route, mask=block_route < token * K + K, other=-1)
        if block_ids.dtype.primitive_bitwidth > 32:  # compiled for int64 ids only
            # An id outside [0, E) becomes -1 before it narrows, so that it matches no expert.
            block_ids = tl.where((block_ids >= 0) & (block_ids < E), block_ids, -1)
        block_expert = block_ids.to(tl.int32)
        earlier_same = (block_route[None, :] < route[:, None]) & (block_expert[None, :] == expert[:, None])
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    # Segment starts are clipped to the row cap, so a route past the cap stays past it.
    expert_safe = tl.where(known, expert, 0)
    dst = (tl.load(segment_offsets_ptr + expert_safe, mask=known, other=0)
           + tl.load(block_offsets_ptr + block * E + expert_safe, mask=known, other=0)
           + rank)
    kept = valid & (dst < num_rows)
    tl.store(dst_rows_ptr + route, tl.where(kept, dst, -1), mask=slot < live)
    if probs_ptr is not None:
        if MASK:
            prob = tl.load(probs_ptr + token.to(tl.int64) * E + expert_safe, mask=kept)
        else:
            prob = tl.load(probs_ptr + route, mask=kept)
        tl.store(out_probs_ptr + dst, prob, mask=kept)
    return dst, kept


@triton.jit
def copy_row_to_routes(src, out_ptr, dst, kept, width, ROUTES: tl.constexpr, BLOCK: tl.constexpr):
    """The row at src (width entries) to the rows dst of out where kept, a tile of ROUTES: permute's
    copy of a token's row, or of its scales."""
    dst_row = dst.to(tl.int64)[:, None] * width
    for c0 in range(0, width, BLOCK):
        col = c0 + tl.arange(0, BLOCK)
        x = tl.load(src + col, mask=col < width)
        tl.store(out_ptr + dst_row + col[None, :], tl.broadcast_to(x[None, :], (ROUTES, BLOCK)),
                 mask=kept[:, None] & (col < width)[None, :])


# ----------------------------------------------------------------------------------------------
# Rows that no route writes (pad rows, rows past the last segment) must read as exact zeros.
# The first programs of the permute and unpermute-backward grids write them.
# ----------------------------------------------------------------------------------------------


@triton.jit
def zero_rows_of_program(
    program,
    segment_offsets_ptr,
    segment_counts_ptr,
    num_rows,
    E: tl.constexpr,
    PAD_GROUPS: tl.constexpr,  # programs per expert's pad rows; 0: no padding
    PAD_ROWS_PER_PROGRAM: tl.constexpr,
    tail_programs,
):
    """(begin, end, step) of the rows this zeroing program owns."""
    if PAD_GROUPS:
        if program < E * PAD_GROUPS:
            # Pad rows of one expert: [start + routed rows, next segment start), split in groups.
            expert = program // PAD_GROUPS
            # Clamped at row 0: a forged map's offsets must not send a write before the rows.
            pad_begin = tl.maximum(tl.load(segment_offsets_ptr + expert) + tl.load(segment_counts_ptr + expert), 0)
            pad_end = tl.load(segment_offsets_ptr + expert + 1)
            begin = pad_begin + (program % PAD_GROUPS) * PAD_ROWS_PER_PROGRAM
            return begin, tl.minimum(tl.minimum(begin + PAD_ROWS_PER_PROGRAM, pad_end), num_rows), 1
        program -= E * PAD_GROUPS
    # Rows past the last segment, strided over the tail programs.
    return tl.maximum(tl.load(segment_offsets_ptr + E), 0) + program, num_rows, tail_programs


@triton.jit
def zero_row(ptr, row, width, BLOCK: tl.constexpr):
    base = ptr + tl.cast(row, tl.int64) * width
    for c0 in range(0, width, BLOCK):
        col = c0 + tl.arange(0, BLOCK)
        tl.store(base + col, tl.zeros([BLOCK], dtype=ptr.dtype.element_ty), mask=col < width)


@triton.jit
def zero_rows(program, segment_offsets_ptr, segment_counts_ptr, num_rows, tail_programs, out_ptr, hidden,
              E: tl.constexpr, BLOCK_H: tl.constexpr, PAD_GROUPS: tl.constexpr, PAD_ROWS_PER_PROGRAM: tl.constexpr,
              out_probs_ptr=None, out_scale_ptr=None, scale_width=None, BLOCK_S: tl.constexpr = None):
    """Zero the rows this zeroing program owns (zero_rows_of_program) in out [M, hidden] and, where
    given, in the probs [M] and scales [M, scale_width] beside it."""
    begin, end, step = zero_rows_of_program(program, segment_offsets_ptr, segment_counts_ptr, num_rows, E, PAD_GROUPS,
                                            PAD_ROWS_PER_PROGRAM, tail_programs)
    for row in range(begin, end, step):
        zero_row(out_ptr, row, hidden, BLOCK_H)
        if out_probs_ptr is not None:
            zero_row(out_probs_ptr, row, 1, 2)
        if out_scale_ptr is not None:
            zero_row(out_scale_ptr, row, scale_width, BLOCK_S)


# ---------------------------------------------------------------------------------------------
# Chunk sort (TransformerEngine's moe_sort_chunks_by_index): the rows are cut into chunks of
# split_sizes and concatenated in the order sorted_idxs gives. One program finds every chunk's
# start in the input and in the output (the chunk table); then each program copies a tile of
# output rows, finding each row's chunk by binary search. The backward pass is the same copy with
# the table's inverse half: the gradient goes back the way the rows came.
# The row gather beside it (out[r] = src[rows[r]]) moves expert parallelism's rows.
# ---------------------------------------------------------------------------------------------


@triton.jit
def chunk_table_kernel(
    split_sizes_ptr,  # [C] rows of each input chunk (negative counts as empty)
    sorted_idxs_ptr,  # [C] the input chunk of each output chunk
    table_ptr,  # int32 [4, C + 1], written (see permgen.core.ops.chunk_table)
    num_chunks,
    BLOCK_C: tl.constexpr,
):
    """One program. Rows 0, 1: output chunk j's start in the output and in the input; rows 2, 3:
    input chunk i's start in the input and in the output. Entry C of rows 0 and 2 is the chunks'
    total, so rows 0 and 2 ascend to an end a binary search can stop at. The device's sizes are
    unchecked: as in permgen.core.ops.chunk_table, each is cut to [0, 2^31 - 1] and summed in int64 (no
    wrap), and each start is cut to 2^31 - 1 (where no row is) when written as int32, so the
    starts still ascend."""
    stride = num_chunks + 1
    chunk = tl.arange(0, BLOCK_C)
    total = tl.full((), 0, tl.int64)
    for c0 in range(0, num_chunks, BLOCK_C):  # input order: each chunk's start in the input
        inside = c0 + chunk < num_chunks
        size = _chunk_sizes(split_sizes_ptr, c0 + chunk, inside)
        tl.store(table_ptr + 2 * stride + c0 + chunk, _int32_start(total + tl.cumsum(size, 0) - size), mask=inside)
        total += tl.sum(size, 0)
    tl.store(table_ptr + num_chunks, _int32_start(total))
    tl.store(table_ptr + 2 * stride + num_chunks, _int32_start(total))
    tl.store(table_ptr + stride + num_chunks, 0)
    tl.store(table_ptr + 3 * stride + num_chunks, 0)
    tl.debug_barrier()  # the input starts above are read back below, by other threads
    total = tl.full((), 0, tl.int64)
    for c0 in range(0, num_chunks, BLOCK_C):  # output order
        inside = c0 + chunk < num_chunks
        # An index out of range (not checked on the device) reads a chunk in range instead.
        source = tl.load(sorted_idxs_ptr + c0 + chunk, mask=inside, other=0)
        source = tl.minimum(tl.maximum(source, 0), num_chunks - 1).to(tl.int32)
        size = _chunk_sizes(split_sizes_ptr, source, inside)
        start = _int32_start(total + tl.cumsum(size, 0) - size)
        tl.store(table_ptr + c0 + chunk, start, mask=inside)
        tl.store(table_ptr + stride + c0 + chunk, tl.load(table_ptr + 2 * stride + source, mask=inside), mask=inside)
        tl.store(table_ptr + 3 * stride + source, start, mask=inside)
        total += tl.sum(size, 0)


@triton.jit
def _chunk_sizes(split_sizes_ptr, chunks, inside):
    """The sizes of chunks as int64, each cut to [0, 2^31 - 1]: C of them sum without wrapping."""
    size = tl.load(split_sizes_ptr + chunks, mask=inside, other=0).to(tl.int64)
    return tl.minimum(tl.maximum(size, 0), 2147483647)


@triton.jit
def _int32_start(start):
    """An int64 start as the table's int32, cut to 2^31 - 1 (where no row is)."""
    return tl.minimum(start, 2147483647).to(tl.int32)


@triton.jit
def _sort_chunk_rows(tokens_ptr, starts_ptr, sources_ptr, out_ptr, num_rows, hidden, num_chunks,
                     SEARCH_STEPS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[r] = tokens[sources[j] + r - starts[j]] for the chunk j holding output row r, for this
    program's rows. Rows past the chunks' total (sizes that do not sum to N) are zeros. Returns the
    rows, their source rows, which rows moved data and which are rows of out."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    # The last chunk starting at or before each row: starts[low] <= row holds throughout.
    low = tl.zeros((BLOCK_ROWS,), tl.int32)
    high = tl.full((BLOCK_ROWS,), num_chunks + 1, tl.int32)
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high) // 2
        before = tl.load(starts_ptr + middle) <= rows
        low = tl.where(before, middle, low)
        high = tl.where(before, high, middle)
    # In int64: a chunk's start in the input may be 2^31 - 1 (device sizes are unchecked).
    source = tl.load(sources_ptr + low).to(tl.int64) + (rows - tl.load(starts_ptr + low))
    stored = rows < num_rows
    # Sizes summing past N would point outside the input: such rows read nothing either.
    moved = stored & (low < num_chunks) & (source >= 0) & (source < num_rows)
    src = tokens_ptr + source[:, None] * hidden  # rows x H can pass 2^31
    dst = out_ptr + rows.to(tl.int64)[:, None] * hidden
    cols = tl.arange(0, BLOCK_H)[None, :]
    for h0 in range(0, hidden, BLOCK_H):
        inside = h0 + cols < hidden
        tile = tl.load(src + h0 + cols, mask=moved[:, None] & inside, other=0)
        tl.store(dst + h0 + cols, tile, mask=stored[:, None] & inside)
    return rows, source, moved, stored


@triton.jit
def sort_chunks_kernel(
    tokens_ptr,  # [N, H]
    starts_ptr,  # int32 [C + 1]: each chunk's first row in the output, ascending; entry C: the total
    sources_ptr,  # int32 [C + 1]: each chunk's first row in the input
    out_ptr,  # [N, H]
    num_rows,
    hidden,
    num_chunks,
    SEARCH_STEPS: tl.constexpr,  # bit length of C: enough halvings to find a chunk among C + 1 entries
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    _sort_chunk_rows(tokens_ptr, starts_ptr, sources_ptr, out_ptr, num_rows, hidden, num_chunks,
                     SEARCH_STEPS, BLOCK_ROWS, BLOCK_H)


@triton.jit
def sort_chunks_probs_kernel(
    tokens_ptr,  # [N, H]
    probs_ptr,  # [N]
    starts_ptr,  # int32 [C + 1], as above
    sources_ptr,  # int32 [C + 1]
    out_ptr,  # [N, H]
    out_probs_ptr,  # [N]
    num_rows,
    hidden,
    num_chunks,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The chunk sort of the rows and, beside them, of probs."""
    rows, source, moved, stored = _sort_chunk_rows(tokens_ptr, starts_ptr, sources_ptr, out_ptr, num_rows, hidden,
                                                   num_chunks, SEARCH_STEPS, BLOCK_ROWS, BLOCK_H)
    tl.store(out_probs_ptr + rows, tl.load(probs_ptr + source, mask=moved, other=0), mask=stored)


@triton.jit
def gather_rows_kernel(
    src_ptr,  # [S, H]
    rows_ptr,  # int32 [M]: the row of src each output row copies (-1: a zero row)
    out_ptr,  # [M, H]
    hidden,
    BLOCK_H: tl.constexpr,
):
    """out[r] = src[rows[r]], zeros where rows[r] < 0; one program per row."""
    row = tl.program_id(0)
    source = tl.load(rows_ptr + row)
    src = src_ptr + tl.maximum(source, 0).to(tl.int64) * hidden
    readable = tl.where(source >= 0, hidden, 0)  # a zero row reads nothing
    dst = out_ptr + row.to(tl.int64) * hidden
    cols = tl.arange(0, BLOCK_H)
    for h0 in range(0, hidden, BLOCK_H):
        tl.store(dst + h0 + cols, tl.load(src + h0 + cols, mask=h0 + cols < readable, other=0),
                 mask=h0 + cols < hidden)


# ----------------------------------------------------------------------------------------------
# A token's routes, as the gathers and scatters visit them: a tile of ROUTES slots at a time.
# Index routing visits a token's K slots as one tile of ROUTES >= K; mask routing its live routes
# only (the host sizes the tile to the average routes per token).
# ----------------------------------------------------------------------------------------------


@triton.jit
def route_rows(row_map_ptr, token, s0, live, num_tokens, num_rows,
               K: tl.constexpr, ROUTES: tl.constexpr, E: tl.constexpr, MASK: tl.constexpr):
    """(dst row, kept, offset of the route's prob in the probs) of the token's slots s0 .. s0 + ROUTES - 1;
    the probs are [N, E] under mask routing, [N, K] under index routing.

    A route whose row is not among the num_rows rows handed in is not kept: TransformerEngine's
    moe_unpermute may be handed fewer rows than permute made, and the ones past them are dropped.

    live (mask routing): the token's route count, or None for its first tile (s0 = 0): permute wrote
    -1 to the dst rows of that tile's slots past the count, so its rows need not wait for the count."""
    slot = s0 + tl.arange(0, ROUTES)
    route = token * K + slot
    if MASK:
        # Every slot of the row map is loaded, the ones past the live routes too (not kept), without
        # waiting for the count. The route's expert is loaded beside its row rather than after it: one
        # dependent load less.
        dst = tl.load(row_map_ptr + route, mask=slot < K, other=-1)
        experts_ptr, _ = token_routes(row_map_ptr, num_tokens, K)
        expert = tl.load(experts_ptr + route, mask=slot < K, other=0)
        kept = (dst >= 0) & (dst < num_rows)
        if live is not None:
            kept = kept & (slot < live)  # past the first tile, slots after the count were never written
        # Clamped into the token's probs row (a forged map's expert must not reach another's); only
        # the prob loads and stores wait for it, not the rows.
        prob_offset = token.to(tl.int64) * E + tl.minimum(tl.maximum(expert, 0), E - 1)
    else:
        dst = tl.load(row_map_ptr + route, mask=slot < K, other=-1)
        kept = (dst >= 0) & (dst < num_rows)
        prob_offset = route
    return dst, kept, prob_offset


@triton.jit
def first_route_tile(row_map_ptr, token, num_tokens, num_rows,
                     K: tl.constexpr, ROUTES: tl.constexpr, E: tl.constexpr, MASK: tl.constexpr):
    """(live, dst, kept, prob_offset): the token's route count (live_routes) and its first tile
    (route_rows), which a gather loads once, at its top, for all it computes. Under mask routing the
    tile's loads do not wait for the count: only a token with more routes visits more tiles."""
    live = live_routes(row_map_ptr, token, num_tokens, K, MASK)
    if MASK:
        dst, kept, prob_offset = route_rows(row_map_ptr, token, 0, None, num_tokens, num_rows, K, ROUTES, E, MASK)
    else:
        dst, kept, prob_offset = route_rows(row_map_ptr, token, 0, live, num_tokens, num_rows, K, ROUTES, E, MASK)
    return live, dst, kept, prob_offset


@triton.jit
def as_fp32(x):
    """A loaded block in fp32, exactly (bf16 subnormals included)."""
    if INTERPRETED and x.dtype == tl.bfloat16:
        return bf16_bits_as_fp32(x.to(tl.int16, bitcast=True))
    return x.to(tl.float32)


@triton.jit
def stored_as(x, dtype: tl.constexpr):
    """fp32 x in dtype, rounded to nearest even as the GPU rounds (every NaN the GPU's bf16 NaN, 0x7FFF)."""
    if INTERPRETED and dtype == tl.bfloat16:
        return tl.where(x == x, fp32_to_bf16_bits(x), 0x7FFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------
# Gathers: one program per token sums its routes' rows in fp32 (unpermute, permute backward).
# probs_ptr None: the plain sum; Triton compiles the weighting away.
# ----------------------------------------------------------------------------------------------


@triton.jit
def sum_route_tile(rows_ptr, dst, kept, prob_offset, probs_ptr, out_ptr, token, hidden,
                   BLOCK_H: tl.constexpr, whole, MASK: tl.constexpr):
    """out[token] = sum of rows[dst] over the kept routes of one tile (route_rows), each times its
    merging prob unless probs_ptr is None, in fp32: a token whose routes one tile holds. Under mask
    routing stored only if whole (the tile holds all of them), which only the stores wait for."""
    if probs_ptr is not None:
        weight = as_fp32(tl.load(probs_ptr + prob_offset, mask=kept, other=0))
    src_row = dst.to(tl.int64)[:, None] * hidden
    out = out_ptr + token.to(tl.int64) * hidden
    if MASK:
        stored = tl.where(whole, hidden, 0)  # columns to store
    else:
        stored = hidden
    for h0 in range(0, hidden, BLOCK_H):
        col = h0 + tl.arange(0, BLOCK_H)
        x = as_fp32(tl.load(rows_ptr + src_row + col[None, :], mask=kept[:, None] & (col < hidden)[None, :], other=0))
        if probs_ptr is not None:
            x = x * weight[:, None]
        tl.store(out + col, stored_as(tl.sum(x, axis=0), out_ptr.dtype.element_ty), mask=col < stored)


@triton.jit
def sum_route_tiles(rows_ptr, row_map_ptr, probs_ptr, out_ptr, token, live, num_tokens, num_rows, hidden,
                    K: tl.constexpr, ROUTES: tl.constexpr, E: tl.constexpr, BLOCK_H: tl.constexpr):
    """As sum_route_tile for a mask routing token with more live routes than one tile holds: every
    column block visits them ROUTES at a time. (Narrower column blocks would save registers, but ran
    this path several times slower.)"""
    out = out_ptr + token.to(tl.int64) * hidden
    for h0 in range(0, hidden, BLOCK_H):
        col = h0 + tl.arange(0, BLOCK_H)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s0 in range(0, live, ROUTES):
            dst, kept, prob_offset = route_rows(row_map_ptr, token, s0, live, num_tokens, num_rows, K, ROUTES, E, True)
            x = as_fp32(tl.load(rows_ptr + dst.to(tl.int64)[:, None] * hidden + col[None, :],
                                mask=kept[:, None] & (col < hidden)[None, :], other=0))
            if probs_ptr is not None:
                x = x * as_fp32(tl.load(probs_ptr + prob_offset, mask=kept, other=0))[:, None]
            total += tl.sum(x, axis=0)
        tl.store(out + col, stored_as(total, out_ptr.dtype.element_ty), mask=col < hidden)


@triton.jit
def sum_rows(rows_ptr, row_map_ptr, probs_ptr, out_ptr, token, live, dst, kept, prob_offset, num_tokens, num_rows,
             hidden, K: tl.constexpr, ROUTES: tl.constexpr, E: tl.constexpr, BLOCK_H: tl.constexpr,
             MASK: tl.constexpr):
    """out[token] = sum over its routes of rows[dst], weighted unless probs_ptr is None, in fp32;
    (live, dst, kept, prob_offset) are its route count and first tile (first_route_tile).

    The host launches it only with columns. Told so, the compiler drops its exit for none, which had
    held the route count's load until the dst rows arrived (two memory round trips before the row
    loads instead of one)."""
    tl.assume(hidden > 0)
    if MASK:
        # The first tile is summed without waiting for the count; a token with more routes than the
        # tile discards that sum and visits all its routes.
        sum_route_tile(rows_ptr, dst, kept, prob_offset, probs_ptr, out_ptr, token, hidden, BLOCK_H,
                       live <= ROUTES, MASK)
        # Compiled only where a token can have more routes than a tile: it costs registers.
        if K > ROUTES:
            if live > ROUTES:
                sum_route_tiles(rows_ptr, row_map_ptr, probs_ptr, out_ptr, token, live, num_tokens, num_rows, hidden,
                                K, ROUTES, E, BLOCK_H)
    else:
        sum_route_tile(rows_ptr, dst, kept, prob_offset, probs_ptr, out_ptr, token, hidden, BLOCK_H, True, MASK)


@triton.jit
def sum_routes_kernel(
    rows_ptr,  # [M, H]
    row_map_ptr,  # int32
    out_ptr,  # [N, H]
    num_tokens,
    num_rows,
    hidden,
    K: tl.constexpr,
    ROUTES: tl.constexpr,
    E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MASK: tl.constexpr,
):
    """out[t] = sum of t's routes' rows (unpermute without probs, and permute backward)."""
    token = tl.program_id(0)
    live, dst, kept, prob_offset = first_route_tile(row_map_ptr, token, num_tokens, num_rows, K, ROUTES, E, MASK)
    sum_rows(rows_ptr, row_map_ptr, None, out_ptr, token, live, dst, kept, prob_offset,
             num_tokens, num_rows, hidden, K, ROUTES, E, BLOCK_H, MASK)


@triton.jit
def unpermute_kernel(
    rows_ptr,  # [M, H]
    row_map_ptr,  # int32
    probs_ptr,  # merging probs, [N, E] under mask routing, [N, K] under index routing
    out_ptr,  # [N, H]
    num_tokens,
    num_rows,
    hidden,
    K: tl.constexpr,
    ROUTES: tl.constexpr,
    E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MASK: tl.constexpr,
):
    """out[t] = sum over t's routes of p * row, in fp32."""
    token = tl.program_id(0)
    live, dst, kept, prob_offset = first_route_tile(row_map_ptr, token, num_tokens, num_rows, K, ROUTES, E, MASK)
    sum_rows(rows_ptr, row_map_ptr, probs_ptr, out_ptr, token, live, dst, kept, prob_offset,
             num_tokens, num_rows, hidden, K, ROUTES, E, BLOCK_H, MASK)


# ----------------------------------------------------------------------------------------------
# Prob grads: each kept route's into the grads shaped like the probs ([N, E] under mask routing,
# [N, K] under index routing); every other entry zero.
# ----------------------------------------------------------------------------------------------


@triton.jit
def store_route_grads(grad_probs_ptr, token, prob_offset, kept, grads, K: tl.constexpr, MASK: tl.constexpr):
    """Each kept route's prob grad into the grads. Mask routing: the caller zeroed the token's row
    first (zero_prob_grads), so experts without a kept route keep that zero. Index routing: slots
    without a kept route get zero."""
    if MASK:
        tl.store(grad_probs_ptr + prob_offset, stored_as(grads, grad_probs_ptr.dtype.element_ty), mask=kept)
    else:
        # Written as the slot, token * K folds away: the mask is known at compile time (slot < K
        # compared as prob_offset < (token + 1) * K costs a register spill).
        slot = prob_offset - token * K
        tl.store(grad_probs_ptr + prob_offset,
                 stored_as(tl.where(kept, grads, 0.0), grad_probs_ptr.dtype.element_ty),
                 mask=slot < K)


@triton.jit
def zero_prob_grads(grad_probs_ptr, token, E: tl.constexpr, E_POW2: tl.constexpr):
    """Zero the token's row of E prob grads (mask routing); a barrier orders it before the routed
    columns' stores."""
    columns = tl.arange(0, E_POW2)
    row = grad_probs_ptr + token.to(tl.int64) * E
    tl.store(row + columns, tl.zeros([E_POW2], dtype=grad_probs_ptr.dtype.element_ty), mask=columns < E)
    tl.debug_barrier()


@triton.jit
def route_prob_grads(row_map_ptr, grad_permuted_probs_ptr, grad_probs_ptr, token, live, dst, kept, prob_offset,
                     num_tokens, num_rows, K: tl.constexpr, ROUTES: tl.constexpr, E: tl.constexpr,
                     E_POW2: tl.constexpr, MASK: tl.constexpr):
    """The token's prob grads, given its route count and first tile (first_route_tile): each kept
    route's is its row's permuted-prob grad, the others zero."""
    grads = as_fp32(tl.load(grad_permuted_probs_ptr + dst, mask=kept, other=0))
    if MASK:
        # The first tile's loads are issued before the row is zeroed: they overlap the zeroing and its
        # barrier. Only a token with more routes visits more tiles.
        zero_prob_grads(grad_probs_ptr, token, E, E_POW2)
        store_route_grads(grad_probs_ptr, token, prob_offset, kept, grads, K, MASK)
        if K > ROUTES:  # compiled only where a token can have more routes than a tile (else the count goes unread)
            for s0 in range(ROUTES, live, ROUTES):
                dst, kept, prob_offset = route_rows(row_map_ptr, token, s0, live, num_tokens, num_rows, K, ROUTES, E,
                                                    MASK)
                grads = as_fp32(tl.load(grad_permuted_probs_ptr + dst, mask=kept, other=0))
                store_route_grads(grad_probs_ptr, token, prob_offset, kept, grads, K, MASK)
    else:
        store_route_grads(grad_probs_ptr, token, prob_offset, kept, grads, K, MASK)  # one tile holds all K slots


@triton.jit
def permute_backward_kernel(
    grad_rows_ptr,  # [M, H] grads of the permuted rows
    row_map_ptr,  # int32
    grad_permuted_probs_ptr,  # [M] grads of the permuted probs
    grad_probs_ptr,  # out, shaped like the probs
    grad_tokens_ptr,  # [N, H] out
    num_tokens,
    num_rows,
    hidden,
    K: tl.constexpr,
    ROUTES: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MASK: tl.constexpr,
):
    """Token grads summed and prob grads routed back to (token, column): one launch."""
    token = tl.program_id(0)
    # The count and the first tile are loaded once, before the prob grads' barrier: the sum's row
    # loads need not wait for a second round trip after it.
    live, dst, kept, prob_offset = first_route_tile(row_map_ptr, token, num_tokens, num_rows, K, ROUTES, E, MASK)
    route_prob_grads(row_map_ptr, grad_permuted_probs_ptr, grad_probs_ptr, token, live, dst, kept, prob_offset,
                     num_tokens, num_rows, K, ROUTES, E, E_POW2, MASK)
    sum_rows(grad_rows_ptr, row_map_ptr, None, grad_tokens_ptr, token, live, dst, kept, prob_offset,
             num_tokens, num_rows, hidden, K, ROUTES, E, BLOCK_H, MASK)


@triton.jit
def route_prob_grads_kernel(
    row_map_ptr,  # int32
    grad_permuted_probs_ptr,  # [M] grads of the permuted probs
    grad_probs_ptr,  # out, shaped like the probs
    num_tokens,
    num_rows,
    K: tl.constexpr,
    ROUTES: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    MASK: tl.constexpr,
):
    """permute's backward when only the probs need a grad (fp8 tokens carry none)."""
    token = tl.program_id(0)
    live, dst, kept, prob_offset = first_route_tile(row_map_ptr, token, num_tokens, num_rows, K, ROUTES, E, MASK)
    route_prob_grads(row_map_ptr, grad_permuted_probs_ptr, grad_probs_ptr, token, live, dst, kept, prob_offset,
                     num_tokens, num_rows, K, ROUTES, E, E_POW2, MASK)


# ----------------------------------------------------------------------------------------------
# Scatters: one program per token writes its grad row to its routes' rows (unpermute backward).
# probs_ptr None: the plain scatter, without prob grads; Triton compiles the weighting away.
# ----------------------------------------------------------------------------------------------


@triton.jit
def scatter_route_tile(grad_out_ptr, row_map_ptr, probs_ptr, permuted_ptr, grad_probs_ptr, grad_permuted_ptr,
                       token, s0, live, num_tokens, num_rows, hidden, K: tl.constexpr, ROUTES: tl.constexpr,
                       E: tl.constexpr, BLOCK_H: tl.constexpr, MASK: tl.constexpr):
    """The token's routes in slots s0 .. s0 + ROUTES - 1 (live: as route_rows takes it): each route's
    row gets p * grad_out[token] and its prob grad <row, grad_out[token]>, or without probs
    grad_out[token]."""
    src = grad_out_ptr + token.to(tl.int64) * hidden
    dst, kept, prob_offset = route_rows(row_map_ptr, token, s0, live, num_tokens, num_rows, K, ROUTES, E, MASK)
    if probs_ptr is not None:
        prob = as_fp32(tl.load(probs_ptr + prob_offset, mask=kept, other=0))
        prob_grad = tl.zeros([ROUTES], dtype=tl.float32)
    dst_row = dst.to(tl.int64)[:, None] * hidden
    for h0 in range(0, hidden, BLOCK_H):
        col = h0 + tl.arange(0, BLOCK_H)
        row_mask = kept[:, None] & (col < hidden)[None, :]
        g = as_fp32(tl.load(src + col, mask=col < hidden, other=0))
        if probs_ptr is not None:
            x = as_fp32(tl.load(permuted_ptr + dst_row + col[None, :], mask=row_mask, other=0))
            prob_grad += tl.sum(x * g[None, :], axis=1)
            rows = prob[:, None] * g[None, :]
        else:
            rows = tl.broadcast_to(g[None, :], (ROUTES, BLOCK_H))
        tl.store(grad_permuted_ptr + dst_row + col[None, :], stored_as(rows, grad_permuted_ptr.dtype.element_ty),
                 mask=row_mask)
    if probs_ptr is not None:
        store_route_grads(grad_probs_ptr, token, prob_offset, kept, prob_grad, K, MASK)


@triton.jit
def scatter_token(grad_out_ptr, row_map_ptr, probs_ptr, permuted_ptr, grad_probs_ptr, grad_permuted_ptr, token,
                  num_tokens, num_rows, hidden, K: tl.constexpr, ROUTES: tl.constexpr, E: tl.constexpr,
                  E_POW2: tl.constexpr, BLOCK_H: tl.constexpr, MASK: tl.constexpr):
    """Every route of the token (scatter_route_tile), a tile at a time; E_POW2 only with probs."""
    live = live_routes(row_map_ptr, token, num_tokens, K, MASK)
    if MASK:
        if probs_ptr is not None:
            zero_prob_grads(grad_probs_ptr, token, E, E_POW2)
        # The first tile does not wait for the count; only a token with more routes visits more tiles.
        scatter_route_tile(grad_out_ptr, row_map_ptr, probs_ptr, permuted_ptr, grad_probs_ptr, grad_permuted_ptr,
                           token, 0, None, num_tokens, num_rows, hidden, K, ROUTES, E, BLOCK_H, MASK)
        if K > ROUTES:  # compiled only where a token can have more routes than a tile
            for s0 in range(ROUTES, live, ROUTES):
                scatter_route_tile(grad_out_ptr, row_map_ptr, probs_ptr, permuted_ptr, grad_probs_ptr,
                                   grad_permuted_ptr, token, s0, live, num_tokens, num_rows, hidden, K, ROUTES, E,
                                   BLOCK_H, MASK)
    else:
        # One tile holds all K slots.
        scatter_route_tile(grad_out_ptr, row_map_ptr, probs_ptr, permuted_ptr, grad_probs_ptr, grad_permuted_ptr,
                           token, 0, live, num_tokens, num_rows, hidden, K, ROUTES, E, BLOCK_H, MASK)


@triton.jit
def scatter_program(grad_out_ptr, row_map_ptr, probs_ptr, permuted_ptr, grad_probs_ptr, grad_permuted_ptr, num_tokens,
                    num_rows, hidden, zero_programs, tail_programs, K: tl.constexpr, ROUTES: tl.constexpr,
                    E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_H: tl.constexpr, PAD_GROUPS: tl.constexpr,
                    PAD_ROWS_PER_PROGRAM: tl.constexpr, MASK: tl.constexpr):
    """One program of a scatter: the first zero_programs zero the rows no route writes (zero_rows), each
    of the others scatters one token (scatter_token)."""
    _, segment_offsets_ptr, segment_counts_ptr = row_map_parts(row_map_ptr, num_tokens, K, E, MASK)
    pid = tl.program_id(0)
    if pid < zero_programs:
        zero_rows(pid, segment_offsets_ptr, segment_counts_ptr, num_rows, tail_programs, grad_permuted_ptr, hidden, E,
                  BLOCK_H, PAD_GROUPS, PAD_ROWS_PER_PROGRAM)
    else:
        scatter_token(grad_out_ptr, row_map_ptr, probs_ptr, permuted_ptr, grad_probs_ptr, grad_permuted_ptr,
                      pid - zero_programs, num_tokens, num_rows, hidden, K, ROUTES, E, E_POW2, BLOCK_H, MASK)


@triton.jit
def scatter_routes_kernel(
    grad_out_ptr,  # [N, H]
    row_map_ptr,  # int32
    grad_permuted_ptr,  # [M, H] out
    num_tokens,
    num_rows,
    hidden,
    zero_programs,  # the first programs zero rows, the rest handle one token each
    tail_programs,
    K: tl.constexpr,
    ROUTES: tl.constexpr,
    E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAD_GROUPS: tl.constexpr,  # programs per expert's pad rows; 0: no padding
    PAD_ROWS_PER_PROGRAM: tl.constexpr,
    MASK: tl.constexpr,
):
    """Each route's row of grad_permuted gets grad_out[token]; other rows get zeros."""
    scatter_program(grad_out_ptr, row_map_ptr, None, None, None, grad_permuted_ptr, num_tokens, num_rows, hidden,
                    zero_programs, tail_programs, K, ROUTES, E, None, BLOCK_H, PAD_GROUPS, PAD_ROWS_PER_PROGRAM, MASK)


@triton.jit
def unpermute_backward_kernel(
    grad_out_ptr,  # [N, H]
    row_map_ptr,  # int32
    probs_ptr,  # merging probs, [N, E] under mask routing, [N, K] under index routing
    permuted_ptr,  # [M, H] unpermute's input, for the prob grads
    grad_probs_ptr,  # out, shaped like the probs
    grad_permuted_ptr,  # [M, H] out
    num_tokens,
    num_rows,
    hidden,
    zero_programs,  # the first programs zero rows, the rest handle one token each
    tail_programs,
    K: tl.constexpr,
    ROUTES: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAD_GROUPS: tl.constexpr,  # programs per expert's pad rows; 0: no padding
    PAD_ROWS_PER_PROGRAM: tl.constexpr,
    MASK: tl.constexpr,
):
    """Each route's row of grad_permuted gets p * grad_out[token], each prob grad <row, grad_out[token]>;
    other rows get zeros."""
    scatter_program(grad_out_ptr, row_map_ptr, probs_ptr, permuted_ptr, grad_probs_ptr, grad_permuted_ptr, num_tokens,
                    num_rows, hidden, zero_programs, tail_programs, K, ROUTES, E, E_POW2, BLOCK_H, PAD_GROUPS,
                    PAD_ROWS_PER_PROGRAM, MASK)
