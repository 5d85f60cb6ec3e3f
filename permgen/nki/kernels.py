"""The NKI kernels and kernel helpers that no variant axis changes, written once.

The generated modules (permgen.generated.nki.<variant>) hold the kernels a variant's axes shape
(permute, unpermute, the backward passes) and build them from these: the tiles one core moves,
the row map's layout, the routes of a token tile and the expert segments, the walk over a token
tile's route slots, the row gathers and scatters, and the chunk sort.

Row order is expert-major and, within an expert, by ascending (token, slot); permute writes the row
map of permgen.core.results.RowIdMap (its layout below, in one place). Tiles put one token (or permuted
row) on each partition: P of them per tile, H_TILE hidden columns per SBUF tile. Every size that
shapes a kernel is a static Python int: a kernel compiles once per shape and row count.

LNC: permgen.nki.host launches every kernel at the LNC the environment declares (2 by default on
Trn2 and Trn3). Core 0 does the work; it is not split between the cores. Outputs live in shared HBM,
so only core 0 writes them (`store`). A kernel whose loops run on the device (mask routing without a
topk hint: nl.fori_loop) runs whole on both cores, so that both run the same device loops with
the same bounds: the LNC guide leaves cores whose dynamic control flow differs undefined. Any other
kernel returns at once on core 1 (`idle`).

Routing kinds: mask routing ([N, E] flags) and index routing ([N, k] expert ids) each have their
helpers here, named mask_* and index_*, with the same parameters where a kernel calls either.
"""

from __future__ import annotations

import importlib.util
import sys

if "nki" not in sys.modules and importlib.util.find_spec("nki") is None:
    from . import emulator  # the NKI variants run on CPU tensors where the Neuron SDK is absent

    emulator.install()

import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

__all__ = [
    "P", "H_TILE", "core", "idle", "store", "filled", "expert_columns",
    "experts_at", "route_counts_at", "segments_at", "row_map_words",
    "mask_token_routes", "index_token_routes", "expert_segments", "write_expert_counts", "store_segment_table",
    "no_token_rows", "route_tokens", "mask_write_routes", "index_write_routes", "gather_token_rows",
    "mask_for_each_slot", "index_for_each_slot", "load_probs",
    "mask_slot_prob", "index_slot_prob", "mask_store_slot_value", "index_store_slot_value",
    "gather_sum", "gather_prob_grads", "scatter_rows", "scatter_route_grads",
    "gather_rows", "sort_chunks", "sort_chunks_probs",
]

# Tokens (or permuted rows) per tile, one per partition. A literal: nl.tile_size.pmax is a language
# constant, not a Python int, and P feeds min(), range steps and tile shapes (nki-library hard-codes 128).
P = 128
H_TILE = 2048  # hidden columns per SBUF tile
# The unsigned integer dtype of each dtype's width, by dtype name: an NkiTensor has a dtype but no item
# size, so a tile's width comes from its dtype (nki-library sizes dtypes the same way).
_WORD = {str(dtype): word for word, dtypes in ((nl.uint8, (nl.float8_e4m3fn, nl.float8_e4m3, nl.float8_e5m2, nl.uint8, nl.int8)),
                                               (nl.uint16, (nl.bfloat16, nl.float16, nl.uint16, nl.int16)),
                                               (nl.uint32, (nl.float32, nl.uint32, nl.int32)))
         for dtype in dtypes}


# ---------------------------------------------------------------------------------------------
# Cores and tiles
# ---------------------------------------------------------------------------------------------

def core():
    """The physical core running this program: nl.program_id(0) under an LNC launch grid (kernel[lnc]), else 0."""
    return nl.program_id(0) if nl.program_ndim() else 0


def idle(device_loops=False):
    """True where this program has nothing to do: on core 1 of an LNC=2 launch, unless the kernel loops on
    the device (device_loops), in which case both cores run it whole."""
    return core() != 0 and not device_loops


def store(dst, src, **kwargs):
    """dma_copy into a kernel output, which the cores of an LNC=2 launch share: issued on core 0 only, so a core
    running the kernel beside it never overwrites what core 0 wrote."""
    if core() == 0:
        nisa.dma_copy(dst=dst, src=src, **kwargs)


def _zero(tile):
    """Zero a tile through an unsigned integer view of its width: all-zero bits are +0.0 in every float
    format, so no engine computes in the tile's own format (fp8 included)."""
    nisa.memset(tile.view(_WORD[str(tile.dtype)]), value=0)


def filled(shape, value, dtype=nl.float32):
    """An SBUF tile of `shape` holding `value` everywhere."""
    tile = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    nisa.memset(tile, value=value)
    return tile


def expert_columns(num_experts):
    """[P, E] fp32 tile whose every partition holds 0, 1, ..., E-1."""
    ids = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(ids, pattern=[[1, num_experts]], offset=0, channel_multiplier=0)
    return ids


def _as_float(tile, rows, cols):
    out = nl.ndarray((P, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out[0:rows, :], src=tile[0:rows, 0:cols])
    return out


# ---------------------------------------------------------------------------------------------
# The row map (permgen.core.results.RowIdMap): one flat int32 HBM tensor, W slots per token,
#   dst rows [N, W] | mask routing only: experts [N, W], route counts [N] | segment offsets [E + 1] | segment counts [E]
# (the route tallies after them are the host's). Every kernel takes its offsets from these.
# ---------------------------------------------------------------------------------------------

def experts_at(num_tokens, width):
    """Word offset of the experts [N, W] (mask routing)."""
    return width * num_tokens


def route_counts_at(num_tokens, width):
    """Word offset of the route counts [N] (mask routing)."""
    return 2 * width * num_tokens


def segments_at(num_tokens, width, mask):
    """Word offset of the segment table: the words of the per-route parts."""
    return (2 * width + 1) * num_tokens if mask else width * num_tokens


def row_map_words(num_tokens, width, num_experts, mask):
    """Words permute's kernel writes: the per-route parts and the segment table."""
    return segments_at(num_tokens, width, mask) + 2 * num_experts + 1


def _tile_columns(row_map, t0, rows, width, offset):
    """int32 [P, W] tile of the row map's [N, W] part at `offset`, rows t0 .. t0+rows-1."""
    part = nl.ndarray((P, width), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=part[0:rows, :], src=row_map.ap([[width, rows], [1, width]], offset=offset + t0 * width))
    return part


def _slot_access(row_map, t0, rows, width, offset, slot):
    """The access of column `slot` (a register) of rows t0 .. t0+rows-1 of the row map's [N, W] part at `offset`.

    A scalar offset moves the start by slot * prod(shape[indirect_dim + 1:]) of the base tensor (NKI access
    patterns): dimension 0 of the flat row map, whose trailing shape is empty, so the start moves by slot elements."""
    return row_map.ap([[width, rows], [1, 1]], offset=offset + t0 * width, scalar_offset=slot, indirect_dim=0)


def _slot_column(row_map, t0, rows, width, offset, slot):
    """int32 [P, 1] tile: column `slot` (a register) of the row map's [N, W] part at `offset`."""
    column = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=column[0:rows, :], src=_slot_access(row_map, t0, rows, width, offset, slot))
    return column


# ---------------------------------------------------------------------------------------------
# Routes of one token tile (one token per partition) and the expert segments
# ---------------------------------------------------------------------------------------------

def mask_token_routes(routing, t0, rows, width, ones_e):
    """(kept, position) of tokens t0 .. t0+rows-1 as [P, E] fp32 tiles; ones_e: [P, E] ones.

    position[t, e] counts the set columns of routing[t, 0..e] (an inclusive scan along the experts),
    so a set column's slot is position - 1; kept[t, e] = 1 where routing[t, e] is set and its slot
    is below the row map's width (routes past a topk hint are dropped), else 0.
    """
    num_experts = routing.shape[1]
    flags = nl.ndarray((P, num_experts), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=flags[0:rows, :], src=routing[t0:t0 + rows, :])
    routed = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=routed[0:rows, :], src=flags[0:rows, :])
    position = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor_scan(dst=position[0:rows, :], data0=ones_e[0:rows, :], data1=routed[0:rows, :], initial=0.0,
                            op0=nl.multiply, op1=nl.add)
    if width == num_experts:
        return routed, position
    kept = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=kept[0:rows, :], data=position[0:rows, :], op0=nl.less_equal, operand0=float(width),
                              op1=nl.multiply, operand1=routed[0:rows, :])
    return kept, position


def index_token_routes(routing, t0, rows, width, expert_ids):
    """(counts, onehot) of tokens t0 .. t0+rows-1; expert_ids: expert_columns(E). counts[t, e] is how many of
    token t's slots (routing's k columns, the row map's W) pick expert e, and onehot[t, j*E + e] is 1 where
    slot j picks expert e. An id outside [0, E) matches no column.
    """
    num_slots = routing.shape[1]
    num_experts = expert_ids.shape[1]
    ids = nl.ndarray((P, num_slots), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids[0:rows, :], src=routing[t0:t0 + rows, :])
    ids_f = nl.ndarray((P, num_slots), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=ids_f[0:rows, :], src=ids[0:rows, :])
    onehot = nl.ndarray((P, num_slots * num_experts), dtype=nl.float32, buffer=nl.sbuf)
    counts = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(counts[0:rows, :], value=0.0)
    for j in range(num_slots):
        slot = onehot[0:rows, j * num_experts:(j + 1) * num_experts]
        nisa.tensor_scalar(dst=slot, data=expert_ids[0:rows, :], op0=nl.equal, operand0=ids_f[0:rows, j:j + 1])
        nisa.tensor_tensor(dst=counts[0:rows, :], data1=counts[0:rows, :], data2=slot, op=nl.add)
    return counts, onehot


def expert_segments(routing, token_routes, columns, width, pad):
    """(segment start, segment rows, routed rows) of every expert, [P, E] fp32 tiles equal on every partition.

    token_routes(routing, t0, rows, width, columns) is the routing kind's (mask_token_routes, index_token_routes).
    The Tensor Engine sums each token tile's route counts over its partitions: ones[rows, P].T @ counts
    puts the per-expert total on every output partition. A segment holds the expert's routes, rounded up
    to a multiple of pad (a power of two; 0: none); an inclusive scan along the experts gives each segment's end.
    """
    num_tokens = routing.shape[0]
    num_experts = columns.shape[1]
    ones = filled((P, P), 1.0)
    routed = filled((P, num_experts), 0.0)
    for t0 in range(0, num_tokens, P):
        rows = min(P, num_tokens - t0)
        counts, _ = token_routes(routing, t0, rows, width, columns)
        tile_total = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=tile_total, stationary=ones[0:rows, :], moving=counts[0:rows, :])
        nisa.tensor_tensor(dst=routed, data1=routed, data2=tile_total, op=nl.add)

    seg_rows = routed
    if pad:
        # (routed + pad - 1) & -pad rounds up to a multiple of the power of two pad, exactly, in int32. The mask
        # is an int32 tile: no page documents how a bitvec operator encodes a scalar immediate.
        padded = nl.ndarray((P, num_experts), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=padded, data=routed, op0=nl.add, operand0=float(pad - 1))
        nisa.tensor_scalar(dst=padded, data=padded, op0=nl.bitwise_and, operand0=filled((P, 1), -pad, nl.int32))
        seg_rows = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=seg_rows, src=padded)
    ones_seg = filled((P, num_experts), 1.0)
    seg_end = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor_scan(dst=seg_end, data0=ones_seg, data1=seg_rows, initial=0.0, op0=nl.multiply, op1=nl.add)
    seg_start = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=seg_start, data1=seg_end, data2=seg_rows, op=nl.subtract)
    return seg_start, seg_rows, routed


def write_expert_counts(counts, routing, token_routes, columns, width, pad):
    """counts [1, E] int32 = the rows of every expert's segment (expert_segments' arguments)."""
    num_experts = columns.shape[1]
    _, seg_rows, _ = expert_segments(routing, token_routes, columns, width, pad)
    as_int = nl.ndarray((1, num_experts), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=as_int, src=seg_rows[0:1, :])
    store(dst=counts, src=as_int)


def store_segment_table(row_map, tokens_per_expert, seg_start, seg_rows, routed, route_words, num_rows):
    """The row map's segment table and tokens_per_expert, every row clipped to num_rows:
    offsets[e] = min(start_e, M), offsets[E] = min(rows of all segments, M),
    counts[e] = min(start_e + routed_e, M) - offsets[e], tokens_per_expert[e] = offsets[e + 1] - offsets[e]."""
    num_experts = seg_start.shape[1]
    table = nl.ndarray((1, 2 * num_experts + 1), dtype=nl.float32, buffer=nl.sbuf)
    offsets = table[0:1, 0:num_experts + 1]
    counts = table[0:1, num_experts + 1:2 * num_experts + 1]
    nisa.memset(table[0:1, 0:1], value=0.0)
    nisa.tensor_tensor(dst=table[0:1, 1:num_experts + 1], data1=seg_start[0:1, :], data2=seg_rows[0:1, :], op=nl.add)
    nisa.tensor_scalar(dst=offsets, data=offsets, op0=nl.minimum, operand0=float(num_rows))
    nisa.tensor_tensor(dst=counts, data1=seg_start[0:1, :], data2=routed[0:1, :], op=nl.add)
    nisa.tensor_scalar(dst=counts, data=counts, op0=nl.minimum, operand0=float(num_rows))
    nisa.tensor_tensor(dst=counts, data1=counts, data2=table[0:1, 0:num_experts], op=nl.subtract)
    table_i = nl.ndarray((1, 2 * num_experts + 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=table_i, src=table)
    store(dst=row_map.ap([[2 * num_experts + 1, 1], [1, 2 * num_experts + 1]], offset=route_words), src=table_i)
    sizes = nl.ndarray((1, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=sizes, data1=table[0:1, 1:num_experts + 1], data2=table[0:1, 0:num_experts], op=nl.subtract)
    sizes_i = nl.ndarray((1, num_experts), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=sizes_i, src=sizes)
    store(dst=tokens_per_expert, src=sizes_i)


# ---------------------------------------------------------------------------------------------
# permute: the routes' rows, written to the row map, and the rows gathered
# ---------------------------------------------------------------------------------------------

def no_token_rows(row_token, out_probs=None):
    """row_token[r] = -1 (no token: a pad row, or unused capacity) for every row, and out_probs[r] = 0."""
    out_rows = row_token.shape[0]
    no_token = filled((P, 1), -1, nl.int32)
    if out_probs is not None:
        no_prob = filled((P, 1), 0.0, out_probs.dtype)
    for r0 in range(0, out_rows, P):
        rows = min(P, out_rows - r0)
        nisa.dma_copy(dst=row_token[r0:r0 + rows, :], src=no_token[0:rows, :])
        if out_probs is not None:
            store(dst=out_probs.ap([[1, rows], [1, 1]], offset=r0), src=no_prob[0:rows, :])


def _rank_tiles():
    """(strictly_before, ones), the [P, P] fp32 tiles _first_rows takes: strictly_before[q, p] = 1 where q < p."""
    strictly_before = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(strictly_before, pattern=[[1, P]], offset=0, channel_multiplier=-1)
    nisa.tensor_scalar(dst=strictly_before, data=strictly_before, op0=nl.greater, operand0=0.0)
    return strictly_before, filled((P, P), 1.0)


def _first_rows(counts, next_row, strictly_before, ones, rows):
    """first_row [P, E] fp32: the row of each token's first route to each expert, given next_row[:, e], the row
    of expert e's next route, which moves past the tile's routes.

    strictly_before[q, p] = 1 where q < p: strictly_before.T @ counts sums the counts of the tokens above
    each partition of a tile, i.e. each token's rank within its experts; ones.T @ counts is the tile's total."""
    num_experts = counts.shape[1]
    above = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=above[0:rows, :], stationary=strictly_before[0:rows, 0:rows], moving=counts[0:rows, :])
    tile_total = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=tile_total, stationary=ones[0:rows, :], moving=counts[0:rows, :])
    first_row = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=first_row[0:rows, :], data1=next_row[0:rows, :], data2=above[0:rows, :], op=nl.add)
    nisa.tensor_tensor(dst=next_row, data1=next_row, data2=tile_total, op=nl.add)
    return first_row


def _scatter_route(dst, slot, rows, row_token, token_ids, out_probs=None, probs_f=None, slot_prob=None,
                   expert_ids=None):
    """Write the route's token id (and, with out_probs, its prob: slot_prob(probs_f, slot, rows, expert_ids)) to
    its row; lanes at -1 (no route, dropped) are skipped."""
    nisa.dma_copy(dst=row_token.ap([[1, rows], [1, 1]], offset=0, vector_offset=dst, indirect_dim=0),
                  src=token_ids[0:rows, :], oob_mode=nisa.oob_mode.skip)
    if out_probs is None:
        return
    prob = nl.ndarray((P, 1), dtype=out_probs.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=prob[0:rows, :], src=slot_prob(probs_f, slot, rows, expert_ids))
    store(dst=out_probs.ap([[1, rows], [1, 1]], offset=0, vector_offset=dst, indirect_dim=0),
          src=prob[0:rows, :], oob_mode=nisa.oob_mode.skip)


def _compact_slot(dst_rows, experts, slot, rows, kept, position, dest, expert_ids1):
    """Column `slot` of the token tile's dst rows and experts ([rows, 1] int32): the kept route whose
    position is slot + 1 (a one-hot select along the experts), -1 where the token has no such route.

    slot: a Python int, or a [P, 1] fp32 tile holding slot + 1 (inside the device loop)."""
    num_experts = kept.shape[1]
    pick = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    target = float(slot + 1) if isinstance(slot, int) else slot
    nisa.scalar_tensor_tensor(dst=pick[0:rows, :], data=position[0:rows, :], op0=nl.equal, operand0=target,
                              op1=nl.multiply, operand1=kept[0:rows, :])
    for out, values in ((dst_rows, dest), (experts, expert_ids1)):
        # values hold row + 1 / expert + 1, so the sum is 0 where nothing is picked: subtract 1.
        chosen = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=chosen[0:rows, :], data1=pick[0:rows, :], data2=values[0:rows, :], op=nl.multiply)
        total = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=total[0:rows, :], op=nl.add, data=chosen[0:rows, :], axis=1, keepdims=True)
        nisa.tensor_scalar(dst=out, data=total[0:rows, :], op0=nl.subtract, operand0=1.0)


def mask_write_routes(row_map, t0, rows, num_tokens, width, num_rows, kept, position, first_row, expert_ids1,
                      *scatter_args):
    """Mask routing: write the token tile's dst rows, experts and route counts to the row map and scatter its
    routes (_scatter_route(dst, experts, rows, *scatter_args)). expert_ids1: expert_columns(E) + 1.

    With a topk hint (W < E) the tile's W slots are unrolled; without (W = E) it visits only as many slots as
    its busiest token has routes, in a device loop (nl.fori_loop)."""
    num_experts = kept.shape[1]
    # dest[t, e] = row + 1 of route (t, e) where it is kept and its row is < M, else 0.
    dest = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=dest[0:rows, :], data=first_row[0:rows, :], op0=nl.add, operand0=1.0,
                              op1=nl.multiply, operand1=kept[0:rows, :])
    fits = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=fits[0:rows, :], data=dest[0:rows, :], op0=nl.less_equal, operand0=float(num_rows))
    nisa.tensor_tensor(dst=dest[0:rows, :], data1=dest[0:rows, :], data2=fits[0:rows, :], op=nl.multiply)
    # Route counts: a token's kept routes fill its first slots.
    route_count = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=route_count[0:rows, :], op=nl.add, data=kept[0:rows, :], axis=1, keepdims=True)
    route_count_i = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=route_count_i[0:rows, :], src=route_count[0:rows, :])
    store(dst=row_map.ap([[1, rows], [1, 1]], offset=route_counts_at(num_tokens, width) + t0),
          src=route_count_i[0:rows, :])
    experts_offset = experts_at(num_tokens, width)
    if width == num_experts:
        # The loop's state lives in SBUF, as nl.fori_loop requires: slot1 holds slot + 1.
        slot1 = filled((P, 1), 0.0)

        def write_slot(j):
            nisa.tensor_scalar(dst=slot1, data=slot1, op0=nl.add, operand0=1.0)
            dst = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
            experts = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
            _compact_slot(dst[0:rows, :], experts[0:rows, :], slot1[0:rows, :], rows, kept, position, dest, expert_ids1)
            store(dst=_slot_access(row_map, t0, rows, width, 0, j), src=dst[0:rows, :])
            store(dst=_slot_access(row_map, t0, rows, width, experts_offset, j), src=experts[0:rows, :])
            _scatter_route(dst[0:rows, :], _as_float(experts, rows, 1)[0:rows, :], rows, *scatter_args)

        nl.fori_loop(0, _partition_max(route_count, rows), write_slot)
        return
    dst = nl.ndarray((P, width), dtype=nl.int32, buffer=nl.sbuf)
    experts = nl.ndarray((P, width), dtype=nl.int32, buffer=nl.sbuf)
    for j in range(width):
        _compact_slot(dst[0:rows, j:j + 1], experts[0:rows, j:j + 1], j, rows, kept, position, dest, expert_ids1)
    store(dst=row_map.ap([[width, rows], [1, width]], offset=t0 * width), src=dst[0:rows, :])
    store(dst=row_map.ap([[width, rows], [1, width]], offset=experts_offset + t0 * width), src=experts[0:rows, :])
    experts_f = _as_float(experts, rows, width)
    for j in range(width):
        _scatter_route(dst[0:rows, j:j + 1], experts_f[0:rows, j:j + 1], rows, *scatter_args)


def index_write_routes(row_map, t0, rows, num_tokens, width, num_rows, counts, onehot, first_row, *scatter_args):
    """Index routing: write the token tile's dst rows to the row map and scatter its routes
    (_scatter_route(dst, j, rows, *scatter_args) for slot j)."""
    num_experts = counts.shape[1]
    # dest[t, j] = row + 1 of slot j of token t; it lands after the token's earlier slots that picked the same expert.
    dest = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
    earlier = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(earlier[0:rows, :], value=0.0)
    hit = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(width):
        slot = onehot[0:rows, j * num_experts:(j + 1) * num_experts]
        nisa.tensor_tensor(dst=hit[0:rows, :], data1=first_row[0:rows, :], data2=earlier[0:rows, :], op=nl.add)
        nisa.scalar_tensor_tensor(dst=hit[0:rows, :], data=hit[0:rows, :], op0=nl.add, operand0=1.0,
                                  op1=nl.multiply, operand1=slot)
        nisa.tensor_reduce(dst=dest[0:rows, j:j + 1], op=nl.add, data=hit[0:rows, :], axis=1, keepdims=True)
        nisa.tensor_tensor(dst=earlier[0:rows, :], data1=earlier[0:rows, :], data2=slot, op=nl.add)
    # Drop routes whose row is >= num_out_tokens, then shift: -1 marks "lands nowhere".
    fits = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=fits[0:rows, :], data=dest[0:rows, :], op0=nl.less_equal, operand0=float(num_rows))
    nisa.tensor_tensor(dst=dest[0:rows, :], data1=dest[0:rows, :], data2=fits[0:rows, :], op=nl.multiply)
    dst = nl.ndarray((P, width), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=dst[0:rows, :], data=dest[0:rows, :], op0=nl.subtract, operand0=1.0)
    store(dst=row_map.ap([[width, rows], [1, width]], offset=t0 * width), src=dst[0:rows, :])
    for j in range(width):
        _scatter_route(dst[0:rows, j:j + 1], j, rows, *scatter_args)


def route_tokens(row_map, row_token, routing, seg_start, width, num_rows, token_routes, columns, write_routes,
                 *write_args, out_probs=None, probs=None, slot_prob=None, expert_ids=None):
    """Give every route its row, a token tile at a time: a tile's routes to expert e follow the routes of the
    tiles before it, from seg_start[e] on. write_routes(row_map, t0, rows, num_tokens, width, num_rows, counts,
    routes, first_row, *write_args, *scatter_args), the routing kind's (token_routes and columns its too), writes
    them to the row map and row_token (and their probs to out_probs: slot_prob of probs with expert_ids)."""
    num_tokens = routing.shape[0]
    num_experts = seg_start.shape[1]
    strictly_before, ones = _rank_tiles()
    # next_row[:, e] = row of expert e's next route, carried from tile to tile.
    next_row = nl.ndarray((P, num_experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=next_row, src=seg_start)
    for t0 in range(0, num_tokens, P):
        rows = min(P, num_tokens - t0)
        counts, routes = token_routes(routing, t0, rows, width, columns)
        first_row = _first_rows(counts, next_row, strictly_before, ones, rows)
        token_ids = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(token_ids, pattern=[[0, 1]], offset=t0, channel_multiplier=1)
        scatter_args = (row_token, token_ids)
        if out_probs is not None:
            scatter_args += (out_probs, load_probs(probs, t0, rows), slot_prob, expert_ids)
        write_routes(row_map, t0, rows, num_tokens, width, num_rows, counts, routes, first_row, *write_args,
                     *scatter_args)

def gather_token_rows(out_tokens, tokens, row_token, quantize_tile=None, quantize_rows=None, out_scale=None,
                      scale=None):
    """Permuted row r = tokens[row_token[r]]; rows at -1 (pad rows, unused capacity) keep the tile's zeros.

    quantize_tile(out_tokens, out_scale, moved, has_row, rows, r0, h0, cols), where given, writes each gathered
    tile and its scales (has_row [P, 1]: 0.0 for rows at -1). quantize_rows(out_tokens, out_scale, moved_tiles,
    has_row, rows, r0), where given instead, gets every column tile of a row tile at once, as (h0, cols, moved) in
    column order: a scale per whole row needs the row's amax before the first tile is converted. scale, where
    given, moves with the rows to out_scale."""
    out_rows, hidden = out_tokens.shape
    for r0 in range(0, out_rows, P):
        rows = min(P, out_rows - r0)
        source = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=source[0:rows, :], src=row_token[r0:r0 + rows, :])
        if quantize_tile is not None or quantize_rows is not None:
            has_row = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=has_row[0:rows, :], src=source[0:rows, :])
            nisa.tensor_scalar(dst=has_row[0:rows, :], data=has_row[0:rows, :], op0=nl.greater_equal, operand0=0.0)
        moved_tiles = []
        for h0 in range(0, hidden, H_TILE):
            cols = min(H_TILE, hidden - h0)
            moved = nl.ndarray((P, H_TILE), dtype=tokens.dtype, buffer=nl.sbuf)
            _zero(moved[0:rows, 0:cols])
            nisa.dma_copy(dst=moved[0:rows, 0:cols],
                          src=tokens.ap([[hidden, rows], [1, cols]], offset=h0, vector_offset=source[0:rows, :], indirect_dim=0),
                          oob_mode=nisa.oob_mode.skip)
            if quantize_rows is not None:
                moved_tiles.append((h0, cols, moved))
            elif quantize_tile is not None:
                quantize_tile(out_tokens, out_scale, moved, has_row, rows, r0, h0, cols)
            else:
                store(dst=out_tokens[r0:r0 + rows, h0:h0 + cols], src=moved[0:rows, 0:cols])
        if quantize_rows is not None:
            quantize_rows(out_tokens, out_scale, moved_tiles, has_row, rows, r0)
        if scale is not None:
            scale_cols = scale.shape[1]
            moved_scale = nl.ndarray((P, scale_cols), dtype=scale.dtype, buffer=nl.sbuf)
            _zero(moved_scale[0:rows, :])
            nisa.dma_copy(dst=moved_scale[0:rows, :],
                          src=scale.ap([[scale_cols, rows], [1, scale_cols]], offset=0, vector_offset=source[0:rows, :],
                                       indirect_dim=0),
                          oob_mode=nisa.oob_mode.skip)
            store(dst=out_scale[r0:r0 + rows, :], src=moved_scale[0:rows, :])


# ---------------------------------------------------------------------------------------------
# The walk over a token tile's route slots (unpermute and the backward passes)
# ---------------------------------------------------------------------------------------------

def _partition_max(values, rows):
    """A register holding the largest of values[0:rows, 0] (a [P, 1] fp32 tile of whole numbers).

    The Tensor Engine turns the column into a row (values.T @ identity), the Vector Engine takes its maximum."""
    identity = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(identity, pattern=[[1, P]], offset=0, channel_multiplier=-1)
    nisa.tensor_scalar(dst=identity, data=identity, op0=nl.equal, operand0=0.0)
    as_row = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=as_row[0:1, 0:rows], stationary=values[0:rows, 0:1], moving=identity[0:rows, 0:rows])
    most = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=most, op=nl.maximum, data=as_row[0:1, 0:rows], axis=1, keepdims=True)
    most_i = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=most_i, src=most)
    bound = nisa.register_alloc()
    nisa.register_load(bound, most_i)
    return bound


def _tile_slots(row_map, t0, rows, num_tokens, width):
    """A register holding the most routes of any token t0 .. t0+rows-1 (read from the row map's route counts)."""
    counts = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=counts[0:rows, :], src=row_map.ap([[1, rows], [1, 1]], offset=route_counts_at(num_tokens, width) + t0))
    counts_f = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=counts_f[0:rows, :], src=counts[0:rows, :])
    return _partition_max(counts_f, rows)


def mask_for_each_slot(row_map, t0, rows, num_tokens, width, num_experts, body, *args):
    """Call body(dst, experts, rows, *args) for every route slot of tokens t0 .. t0+rows-1 (mask routing):
    dst is the slot's rows ([rows, 1] int32, -1 where the route lands nowhere), experts the slot's experts
    ([rows, 1] fp32, -1 where the slot is empty)."""
    experts_offset = experts_at(num_tokens, width)
    if width == num_experts:
        # No topk hint: the row map has a slot per expert, but a token tile visits only as many slots as
        # its busiest token has routes, in a loop the device runs with that bound (nl.fori_loop).
        def visit_slot(j):
            dst = _slot_column(row_map, t0, rows, width, 0, j)
            experts = _as_float(_slot_column(row_map, t0, rows, width, experts_offset, j), rows, 1)
            body(dst[0:rows, :], experts[0:rows, :], rows, *args)

        nl.fori_loop(0, _tile_slots(row_map, t0, rows, num_tokens, width), visit_slot)
        return
    dst = _tile_columns(row_map, t0, rows, width, 0)
    experts = _as_float(_tile_columns(row_map, t0, rows, width, experts_offset), rows, width)
    for j in range(width):
        body(dst[0:rows, j:j + 1], experts[0:rows, j:j + 1], rows, *args)


def index_for_each_slot(row_map, t0, rows, num_tokens, width, num_experts, body, *args):
    """Call body(dst, j, rows, *args) for every route slot j of tokens t0 .. t0+rows-1 (index routing):
    dst is the slot's rows ([rows, 1] int32, -1 where the route lands nowhere)."""
    dst = _tile_columns(row_map, t0, rows, width, 0)
    for j in range(width):
        body(dst[0:rows, j:j + 1], j, rows, *args)


def load_probs(probs, t0, rows):
    """fp32 [P, C] tile of probs [N, C] rows t0 .. t0+rows-1."""
    cols = probs.shape[1]
    loaded = nl.ndarray((P, cols), dtype=probs.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=loaded[0:rows, :], src=probs[t0:t0 + rows, :])
    as_f = nl.ndarray((P, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=as_f[0:rows, :], src=loaded[0:rows, :])
    return as_f


def _select_bits(dst, data, op, operand):
    """dst (an int32 tile) = all ones where `data op operand` holds, else 0: a mask that selects fp32 values by
    their bits. A select, not a product: 0 * NaN and 0 * inf are NaN, so a 0 / 1 product would let a value
    that is not selected spoil the result."""
    nisa.tensor_scalar(dst=dst, data=data, op0=op, operand0=operand, op1=nl.multiply, operand1=-1.0)


def _kept_only(value, dst, rows):
    """[rows, 1] fp32: value (a [rows, 1] fp32 tile) where the slot's route is kept (dst >= 0), else 0, whatever
    value holds there."""
    kept = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
    _select_bits(kept[0:rows, :], dst, nl.greater_equal, 0.0)
    nisa.tensor_tensor(dst=kept[0:rows, :], data1=kept[0:rows, :], data2=value.view(nl.int32), op=nl.bitwise_and)
    return kept[0:rows, :].view(nl.float32)


def mask_slot_prob(probs_f, experts, rows, expert_ids):
    """[rows, 1] fp32: the prob of each token's route in the slot whose experts are `experts` (0 for an empty
    slot), picked from the [P, E] probs by its bits and summed with zeros: exact, NaN and inf included (-0.0
    comes out as +0.0); the other columns are never read into it."""
    num_experts = expert_ids.shape[1]
    picked = nl.ndarray((P, num_experts), dtype=nl.int32, buffer=nl.sbuf)
    _select_bits(picked[0:rows, :], expert_ids[0:rows, :], nl.equal, experts)
    nisa.tensor_tensor(dst=picked[0:rows, :], data1=picked[0:rows, :], data2=probs_f[0:rows, :].view(nl.int32),
                       op=nl.bitwise_and)
    prob = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=prob[0:rows, :], op=nl.add, data=picked[0:rows, :].view(nl.float32), axis=1, keepdims=True)
    return prob[0:rows, :]


def index_slot_prob(probs_f, j, rows, expert_ids=None):
    """[rows, 1] fp32: the prob of each token's route in slot j, column j of the [P, k] probs."""
    return probs_f[0:rows, j:j + 1]


def mask_store_slot_value(dense, experts, value, rows, expert_ids):
    """dense[t, the slot's expert] = value[t], its bits or-ed into that column, which is zero before: a
    non-finite value stays in its column."""
    num_experts = expert_ids.shape[1]
    picked = nl.ndarray((P, num_experts), dtype=nl.int32, buffer=nl.sbuf)
    _select_bits(picked[0:rows, :], expert_ids[0:rows, :], nl.equal, experts)
    nisa.tensor_scalar(dst=picked[0:rows, :], data=picked[0:rows, :], op0=nl.bitwise_and, operand0=value.view(nl.int32))
    dense_bits = dense[0:rows, :].view(nl.int32)
    nisa.tensor_tensor(dst=dense_bits, data1=dense_bits, data2=picked[0:rows, :], op=nl.bitwise_or)


def index_store_slot_value(dense, j, value, rows, expert_ids=None):
    """dense[t, j] = value[t]."""
    nisa.tensor_copy(dst=dense[0:rows, j:j + 1], src=value)


# ---------------------------------------------------------------------------------------------
# Sums over a token's routes (unpermute, permute's token gradients)
# ---------------------------------------------------------------------------------------------

def _add_route_rows(dst, slot, rows, rows_in, totals, probs_f=None, slot_prob=None, expert_ids=None):
    """totals (fp32 [P, H_TILE] tiles, one per column block) += the slot's rows of rows_in (none at -1), weighted
    by the route's prob (slot_prob(probs_f, slot, rows, expert_ids)) where probs_f is given."""
    hidden = rows_in.shape[1]
    # A slot with no kept route reads a zero row: its prob is selected away, not multiplied by that zero.
    weight = None if probs_f is None else _kept_only(slot_prob(probs_f, slot, rows, expert_ids), dst, rows)
    for c in range(len(totals)):
        h0 = c * H_TILE
        cols = min(H_TILE, hidden - h0)
        total = totals[c]
        row = nl.ndarray((P, H_TILE), dtype=rows_in.dtype, buffer=nl.sbuf)
        _zero(row[0:rows, 0:cols])
        nisa.dma_copy(dst=row[0:rows, 0:cols],
                      src=rows_in.ap([[hidden, rows], [1, cols]], offset=h0, vector_offset=dst, indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip)
        if weight is None:
            nisa.tensor_tensor(dst=total[0:rows, 0:cols], data1=total[0:rows, 0:cols], data2=row[0:rows, 0:cols],
                               op=nl.add)
        else:
            nisa.scalar_tensor_tensor(dst=total[0:rows, 0:cols], data=row[0:rows, 0:cols], op0=nl.multiply,
                                      operand0=weight, op1=nl.add, operand1=total[0:rows, 0:cols])


def gather_sum(out, rows_in, row_map, num_tokens, width, num_experts, for_each_slot, probs=None, slot_prob=None,
               expert_ids=None):
    """out[t] = sum over t's routes (for_each_slot: the routing kind's) of rows_in[route's row] (rows at -1 add
    nothing), each weighted by the route's prob where probs [N, C] are given (slot_prob, the routing kind's,
    with expert_ids), accumulated in fp32 and written in out's dtype."""
    hidden = rows_in.shape[1]
    blocks = -(-hidden // H_TILE)
    for t0 in range(0, num_tokens, P):
        rows = min(P, num_tokens - t0)
        totals = []
        for c in range(blocks):
            total = nl.ndarray((P, H_TILE), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(total[0:rows, :], value=0.0)
            totals.append(total)
        probs_f = None if probs is None else load_probs(probs, t0, rows)
        for_each_slot(row_map, t0, rows, num_tokens, width, num_experts, _add_route_rows, rows_in, totals, probs_f,
                      slot_prob, expert_ids)
        for c in range(blocks):
            h0 = c * H_TILE
            cols = min(H_TILE, hidden - h0)
            result = nl.ndarray((P, H_TILE), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=result[0:rows, 0:cols], src=totals[c][0:rows, 0:cols])
            store(dst=out[t0:t0 + rows, h0:h0 + cols], src=result[0:rows, 0:cols])


def _gather_prob_grad(dst, slot, rows, grad_permuted_probs, grads, store_slot_value, expert_ids):
    """grads[t, route's column] = grad_permuted_probs[route's row] (zero where the route lands nowhere)."""
    got = nl.ndarray((P, 1), dtype=grad_permuted_probs.dtype, buffer=nl.sbuf)
    nisa.memset(got[0:rows, :], value=0.0)
    nisa.dma_copy(dst=got[0:rows, :],
                  src=grad_permuted_probs.ap([[1, rows], [1, 1]], offset=0, vector_offset=dst, indirect_dim=0),
                  oob_mode=nisa.oob_mode.skip)
    got_f = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=got_f[0:rows, :], src=got[0:rows, :])
    store_slot_value(grads, slot, got_f[0:rows, :], rows, expert_ids)


def gather_prob_grads(grad_probs, grad_permuted_probs, row_map, num_tokens, width, num_experts, for_each_slot,
                      store_slot_value, expert_ids=None):
    """grad_probs[t, route's column] = grad_permuted_probs[route's row], zero where the route landed nowhere
    (store_slot_value: the routing kind's, with expert_ids)."""
    num_cols = grad_probs.shape[1]
    for t0 in range(0, num_tokens, P):
        rows = min(P, num_tokens - t0)
        grads = nl.ndarray((P, num_cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(grads[0:rows, :], value=0.0)
        for_each_slot(row_map, t0, rows, num_tokens, width, num_experts, _gather_prob_grad, grad_permuted_probs, grads,
                      store_slot_value, expert_ids)
        grads_out = nl.ndarray((P, num_cols), dtype=grad_permuted_probs.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=grads_out[0:rows, :], src=grads[0:rows, :])
        store(dst=grad_probs[t0:t0 + rows, :], src=grads_out[0:rows, :])


# ---------------------------------------------------------------------------------------------
# Scatters to a token's rows (the gradients of unpermute)
# ---------------------------------------------------------------------------------------------

def _zero_rows(dst):
    """Write zeros to every row of an HBM [M, H] tensor."""
    num_rows, hidden = dst.shape
    zeros = nl.ndarray((P, H_TILE), dtype=dst.dtype, buffer=nl.sbuf)
    _zero(zeros)
    for r0 in range(0, num_rows, P):
        rows = min(P, num_rows - r0)
        for h0 in range(0, hidden, H_TILE):
            cols = min(H_TILE, hidden - h0)
            store(dst=dst[r0:r0 + rows, h0:h0 + cols], src=zeros[0:rows, 0:cols])


def _load_grad_blocks(grad_out, t0, rows):
    """grad_out rows t0 .. t0+rows-1 as ([P, H_TILE] tiles in its dtype, the same in fp32), one per column block."""
    hidden = grad_out.shape[1]
    blocks, blocks_f = [], []
    for h0 in range(0, hidden, H_TILE):
        cols = min(H_TILE, hidden - h0)
        grad = nl.ndarray((P, H_TILE), dtype=grad_out.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=grad[0:rows, 0:cols], src=grad_out[t0:t0 + rows, h0:h0 + cols])
        grad_f = nl.ndarray((P, H_TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=grad_f[0:rows, 0:cols], src=grad[0:rows, 0:cols])
        blocks.append(grad)
        blocks_f.append(grad_f)
    return blocks, blocks_f


def _scatter_route_rows(dst, slot, rows, grad_permuted, blocks):
    """grad_permuted[route's row] = the token's gradient rows (lanes at -1 skipped)."""
    hidden = grad_permuted.shape[1]
    for c in range(len(blocks)):
        h0 = c * H_TILE
        cols = min(H_TILE, hidden - h0)
        store(dst=grad_permuted.ap([[hidden, rows], [1, cols]], offset=h0, vector_offset=dst, indirect_dim=0),
              src=blocks[c][0:rows, 0:cols], oob_mode=nisa.oob_mode.skip)


def scatter_rows(grad_permuted, grad_out, row_map, num_tokens, width, num_experts, for_each_slot):
    """grad_permuted[r] = grad_out[t] for every row r of a route of token t (for_each_slot: the routing kind's);
    rows no route lands on (pad rows, rows past the routes) get zeros: everything is zeroed first."""
    _zero_rows(grad_permuted)
    for t0 in range(0, num_tokens, P):
        rows = min(P, num_tokens - t0)
        blocks, _ = _load_grad_blocks(grad_out, t0, rows)
        for_each_slot(row_map, t0, rows, num_tokens, width, num_experts, _scatter_route_rows, grad_permuted, blocks)


def _route_grads(dst, slot, rows, grad_permuted, permuted, blocks_f, probs_f, dots, slot_prob, store_slot_value,
                expert_ids=None):
    """The route's row gets p * grad_out[t]; the route's prob gradient is <permuted row, grad_out[t]> in fp32,
    stored in dots."""
    hidden = grad_permuted.shape[1]
    weight = slot_prob(probs_f, slot, rows, expert_ids)
    dot = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dot[0:rows, :], value=0.0)
    for c in range(len(blocks_f)):
        h0 = c * H_TILE
        cols = min(H_TILE, hidden - h0)
        grad_f = blocks_f[c]
        scaled = nl.ndarray((P, H_TILE), dtype=grad_permuted.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=scaled[0:rows, 0:cols], data=grad_f[0:rows, 0:cols], op0=nl.multiply, operand0=weight)
        store(dst=grad_permuted.ap([[hidden, rows], [1, cols]], offset=h0, vector_offset=dst, indirect_dim=0),
              src=scaled[0:rows, 0:cols], oob_mode=nisa.oob_mode.skip)
        row = nl.ndarray((P, H_TILE), dtype=permuted.dtype, buffer=nl.sbuf)
        _zero(row[0:rows, 0:cols])
        nisa.dma_copy(dst=row[0:rows, 0:cols],
                      src=permuted.ap([[hidden, rows], [1, cols]], offset=h0, vector_offset=dst, indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip)
        product = nl.ndarray((P, H_TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=product[0:rows, 0:cols], data1=row[0:rows, 0:cols], data2=grad_f[0:rows, 0:cols],
                           op=nl.multiply)
        partial = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=partial[0:rows, :], op=nl.add, data=product[0:rows, 0:cols], axis=1, keepdims=True)
        nisa.tensor_tensor(dst=dot[0:rows, :], data1=dot[0:rows, :], data2=partial[0:rows, :], op=nl.add)
    # A slot with no kept route read a zero row, but 0 * a non-finite grad_out is NaN: its gradient is 0.
    store_slot_value(dots, slot, _kept_only(dot[0:rows, :], dst, rows), rows, expert_ids)


def scatter_route_grads(grad_permuted, grad_probs, grad_out, permuted, merging_probs, row_map, num_tokens, width,
                        num_experts, for_each_slot, slot_prob, store_slot_value, expert_ids=None):
    """The gradients of unpermute with merging probs: the row of each route (t, c) gets merging_probs[t, c] *
    grad_out[t], rows no route lands on get zeros (everything is zeroed first); grad_probs[t, c] is
    <permuted row, grad_out[t]> in fp32. for_each_slot, slot_prob, store_slot_value: the routing kind's."""
    num_cols = merging_probs.shape[1]
    _zero_rows(grad_permuted)
    for t0 in range(0, num_tokens, P):
        rows = min(P, num_tokens - t0)
        probs_f = load_probs(merging_probs, t0, rows)
        _, blocks_f = _load_grad_blocks(grad_out, t0, rows)
        dots = nl.ndarray((P, num_cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dots[0:rows, :], value=0.0)
        for_each_slot(row_map, t0, rows, num_tokens, width, num_experts, _route_grads, grad_permuted, permuted, blocks_f,
                      probs_f, dots, slot_prob, store_slot_value, expert_ids)
        dots_out = nl.ndarray((P, num_cols), dtype=merging_probs.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dots_out[0:rows, :], src=dots[0:rows, :])
        store(dst=grad_probs[t0:t0 + rows, :], src=dots_out[0:rows, :])


# ---------------------------------------------------------------------------------------------
# Chunk sort (TransformerEngine's moe_sort_chunks_by_index): output row r is input row rows[r].
# permgen.nki.host finds rows from the chunk table (each chunk's start in the input and the output);
# the backward pass runs the same kernel on the gradients with rows from the table's inverse half.
# Rows are gathered a tile of P at a time by one indirect DMA per column tile.
# ---------------------------------------------------------------------------------------------

def gather_rows(out, tokens, rows, out_probs=None, probs=None):
    """out[r] = tokens[rows[r]] (and out_probs[r] = probs[rows[r]]): rows [N, 1] int32, every one in range."""
    num_rows, hidden = tokens.shape
    for r0 in range(0, num_rows, P):
        count = min(P, num_rows - r0)
        source = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=source[0:count, :], src=rows[r0:r0 + count, :])
        for h0 in range(0, hidden, H_TILE):
            cols = min(H_TILE, hidden - h0)
            moved = nl.ndarray((P, H_TILE), dtype=tokens.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=moved[0:count, 0:cols],
                          src=tokens.ap([[hidden, count], [1, cols]], offset=h0, vector_offset=source[0:count, :],
                                        indirect_dim=0))
            store(dst=out[r0:r0 + count, h0:h0 + cols], src=moved[0:count, 0:cols])
        if probs is not None:
            moved_probs = nl.ndarray((P, 1), dtype=probs.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=moved_probs[0:count, :],
                          src=probs.ap([[1, count], [1, 1]], offset=0, vector_offset=source[0:count, :], indirect_dim=0))
            store(dst=out_probs[r0:r0 + count, :], src=moved_probs[0:count, :])


@nki.jit
def sort_chunks(tokens, rows):
    """out[r] = tokens[rows[r]]: tokens [N, H], rows [N, 1] int32 source rows. Returns [N, H]."""
    out = nl.ndarray(tokens.shape, dtype=tokens.dtype, buffer=nl.shared_hbm)
    if not idle():  # no device loops: core 0 alone runs it
        gather_rows(out, tokens, rows)
    return out


@nki.jit
def sort_chunks_probs(tokens, probs, rows):
    """The chunk sort of tokens [N, H] and probs [N, 1] by rows [N, 1]. Returns ([N, H], [N, 1])."""
    out = nl.ndarray(tokens.shape, dtype=tokens.dtype, buffer=nl.shared_hbm)
    out_probs = nl.ndarray(probs.shape, dtype=probs.dtype, buffer=nl.shared_hbm)
    if not idle():
        gather_rows(out, tokens, rows, out_probs, probs)
    return out, out_probs

