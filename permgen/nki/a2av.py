"""Expert-parallel dispatch and combine on Trainium: `permute_a2av` / `unpermute_a2av`, written once
(they depend on no variant axis).

Dispatch: each rank packs its routed rows by destination rank and the ranks exchange them; every
rank receives the rows sent to it, source-major. Combine: the reverse exchange returns the expert
outputs to the ranks they came from, and each rank merges a token's rows with its router probs.
The rows are opaque here, so one kernel of each serves every variant.

The exchange is one of three, each on what the Neuron documentation allows
(nki.collectives.all_to_all_v "Current restrictions"; nki.collectives.all_to_all), picked by the
`exchange` argument, or by `generation` when it is None:

- "all_to_all_v" (default on "trn2", no NeuronSwitch): `all_to_all_v` with `has_rdispls=False`.
  Source j's rows land in slot j of a receive buffer of EP equal slots (slot = dst size / EP); a
  local compaction then packs the slots source-major. Send buffers are `S` rows and receive buffers
  `EP * S` rows, S = max(send rows, capacity): every slot holds what any one peer can send. On a
  Trn2 instance this needs SDK 2.33 or newer: 2.30 - 2.32 allow all_to_all_v on Trn2 only on
  inter-node rank-lists ("currently supports only inter-node replica groups"); 2.33 restricts only
  receive displacements to them.
- "all_to_all" (default on "trn3"): `all_to_all` on fixed slots of `recv_capacity` rows (equal on
  every rank) and the same compaction. Its page restricts no rank-list, so it serves any group, on
  SDK 2.30 or newer.
- "all_to_all_v_packed": `all_to_all_v` with `has_rdispls=True` into the packed layout (of a
  kernel-internal buffer, then copied out). On Trn2 the pages allow it only for inter-node rank-lists
  (same-indexed ranks of different instances) on SDK 2.30, 2.31 and 2.33; the 2.32 page allows it
  "only ... on NeuronSwitch-based instances (trn3 today)". On Trn3's NeuronSwitch: only at LNC=2, on
  more than one device, with rank-lists of sequential ranks holding every rank (4 under LNC=2) of each
  device they touch. Which ranks share a device is
  not documented (the page's own example rank-lists are [[1, 2, 3, 4], [5, 6, 7, 8]]), so permgen
  picks this exchange only when asked: the caller, who knows its topology, vouches for it.

LNC: the kernels run at the LNC the environment declares (permgen.nki.host.logical_cores(); trn3's
all_to_all_v needs LNC=2). At LNC=2 the two physical cores of the logical core (one rank) split
every row loop by tiles (tile i on core i mod 2, nl.program_id), both issue each collective, and
`nisa.core_barrier` on a shared HBM tensor separates one core's writes to it from the other core's
reads, and a collective's results from the cores' reads of them (nki.isa.core_barrier: both cores
write disjoint parts of a shared tensor, then both consume it).

The host functions take NumPy arrays (bfloat16 and fp8 as ml_dtypes arrays) and run the kernels
through nki.simulate; on a Trainium host, call the kernels directly (as kernel[lnc]). Every rank of
the replica group calls them together (in the CPU emulator: under nki_emulator.run_ranks, whose
Platform should name the same generation).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .host import ensure_nki, logical_cores

ensure_nki()

import nki  # noqa: E402
import nki.collectives as ncc  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

# Rows per tile, one per partition. A literal: nl.tile_size.pmax is a language constant, not a
# Python int, and sizes here feed min(), range steps and tile shapes (nki-library hard-codes 128 too).
P = 128
H_TILE = 2048  # hidden columns per SBUF tile
MAX_EXACT = 1 << 24  # whole numbers are exact in fp32 below this
A2AV_MAX_ELEMENTS = (1 << 32) - 1  # all_to_all_v counts and displacements are uint32 elements
GENERATIONS = ("trn2", "trn3")
EXCHANGES = ("all_to_all_v", "all_to_all", "all_to_all_v_packed")
DEFAULT_EXCHANGE = {"trn2": "all_to_all_v", "trn3": "all_to_all"}
# The unsigned integer dtype of each dtype's width, by dtype name (an NkiTensor has a dtype but no item
# size), for zeroing a tile of any dtype through an integer view.
_WORD = {str(dtype): word for word, dtypes in ((nl.uint8, (nl.float8_e4m3fn, nl.float8_e4m3, nl.float8_e5m2, nl.uint8, nl.int8)),
                                               (nl.uint16, (nl.bfloat16, nl.float16, nl.uint16, nl.int16)),
                                               (nl.uint32, (nl.float32, nl.uint32, nl.int32)))
         for dtype in dtypes}


def _odd_part(n):
    """(odd, shift) with n == odd << shift, for n >= 1."""
    shift = 0
    while n % 2 == 0:
        n //= 2
        shift += 1
    return n, shift


def exchange_for(replica_group, generation, exchange=None, lnc=2):
    """The exchange of the module docstring: `exchange`, or the generation's default when it is None,
    checked against what the pages state (an unknown name, or all_to_all_v on trn3 below LNC=2, is an error)."""
    if generation not in GENERATIONS:
        raise ValueError(f"generation must be one of {GENERATIONS}, got {generation!r}")
    if not isinstance(replica_group, ncc.ReplicaGroup):
        raise TypeError(f"replica_group must be an ncc.ReplicaGroup, got {type(replica_group).__name__}")
    if exchange is None:
        return DEFAULT_EXCHANGE[generation]
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES} or None, got {exchange!r}")
    if generation == "trn3" and exchange != "all_to_all" and lnc != 2:
        raise ValueError(f"exchange {exchange!r} on trn3 needs LNC=2 (all_to_all_v on a NeuronSwitch \"requires "
                         f"LNC=2\"); this launch runs LNC={lnc}: use exchange='all_to_all'")
    return exchange


# ---------------------------------------------------------------------------------------------
# Small device helpers
# ---------------------------------------------------------------------------------------------

def _cores():
    """(this physical core, cores of the launch): nl.program_id(0) and nl.num_programs() under an LNC
    launch grid (kernel[lnc]), else (0, 1)."""
    if nl.program_ndim():
        return nl.program_id(0), nl.num_programs()
    return 0, 1


def _my_tiles(num_rows):
    """Starts of the P-row tiles of [0, num_rows) this core handles: tile i on core i mod cores."""
    core, cores = _cores()
    return range(core * P, num_rows, cores * P)


def _sync(data):
    """Both cores' writes to the shared HBM tensor `data` (or a collective's into it) are done before either
    core goes on (nisa.core_barrier). One core has nothing to wait for; at LNC=1 the barrier would pair this
    rank with the other logical core of its HBM stack, another rank."""
    if _cores()[1] > 1:
        nisa.core_barrier(data, (0, 1))


def _first_core():
    return _cores()[0] == 0


def _zero(tile):
    """Zero a tile through an integer view of its width: all-zero bits are +0.0 in every float format,
    and no engine has to compute in the tile's own (possibly fp8) format."""
    nisa.memset(tile.view(_WORD[str(tile.dtype)]), value=0)


def _exclusive_scan(counts):
    """[1, EP] fp32 tile of row counts -> where each segment starts when the segments are packed in order."""
    ep = counts.shape[1]
    ones = nl.ndarray((1, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(ones, value=1.0)
    ends = nl.ndarray((1, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor_scan(dst=ends, data0=ones, data1=counts, initial=0.0, op0=nl.multiply, op1=nl.add)
    starts = nl.ndarray((1, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=starts, data1=ends, data2=counts, op=nl.subtract)
    return starts


def _on_every_partition(row):
    """[1, EP] fp32 tile -> [P, EP] fp32 tile holding it on every partition (ones[1, P].T @ row)."""
    ep = row.shape[1]
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(ones, value=1.0)
    spread = nl.ndarray((P, ep), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=spread, stationary=ones, moving=row)
    out = nl.ndarray((P, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=spread)
    return out


def _store_elements(dst, rows, hidden):
    """dst (a uint32 [1, EP] HBM row) = rows * hidden, exactly: rows * odd(hidden) is a whole number
    below 2^24, so exact in fp32; the power of two of hidden is then a left shift on the integers."""
    odd, shift = _odd_part(hidden)
    ep = rows.shape[1]
    scaled = nl.ndarray((1, ep), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=scaled, data=rows, op0=nl.multiply, operand0=float(odd))
    elements = nl.ndarray((1, ep), dtype=nl.uint32, buffer=nl.sbuf)
    shift_by = nl.ndarray((1, 1), dtype=nl.uint32, buffer=nl.sbuf)  # a tile: no page documents a bitvec immediate
    nisa.memset(shift_by, value=shift)
    nisa.tensor_scalar(dst=elements, data=scaled, op0=nl.left_shift, operand0=shift_by)
    nisa.dma_copy(dst=dst, src=elements)


def _metadata(send_f, recv_f, hidden, sends_back=False):
    """uint32 [4, EP] HBM: send counts, send displacements, receive counts, receive displacements in
    elements, segments packed in rank order. sends_back swaps the roles (the combine sends what the
    dispatch received)."""
    ep = send_f.shape[1]
    out_f, in_f = (recv_f, send_f) if sends_back else (send_f, recv_f)
    metadata = nl.ndarray((4, ep), dtype=nl.uint32, buffer=nl.shared_hbm)
    if _first_core():
        _store_elements(metadata[0:1, :], out_f, hidden)
        _store_elements(metadata[1:2, :], _exclusive_scan(out_f), hidden)
        _store_elements(metadata[2:3, :], in_f, hidden)
        _store_elements(metadata[3:4, :], _exclusive_scan(in_f), hidden)
    _sync(metadata)
    return metadata


def _exchange_counts(send_counts, replica_group):
    """(send, recv) row counts as [1, EP] fp32 tiles: recv[j] is what rank j of the rank-list sends
    here, learnt from one all_to_all of one count per peer."""
    ep = send_counts.shape[1]
    counts_in = nl.ndarray((1, ep), dtype=send_counts.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=counts_in, src=send_counts)
    counts_u = nl.ndarray((1, ep), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=counts_u, src=counts_in)
    count_send = nl.ndarray((ep, 1), dtype=nl.uint32, buffer=nl.shared_hbm)
    if _first_core():
        nisa.dma_copy(dst=count_send, src=counts_u)  # [1, EP] -> [EP, 1]: equal element counts
    _sync(count_send)
    count_recv = nl.ndarray((ep, 1), dtype=nl.uint32, buffer=nl.shared_hbm)
    ncc.all_to_all(srcs=[count_send], dsts=[count_recv], replica_group=replica_group, collective_dim=0)
    _sync(count_recv)
    recv_u = nl.ndarray((1, ep), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=recv_u, src=count_recv)
    send_f = nl.ndarray((1, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=send_f, src=counts_u)
    recv_f = nl.ndarray((1, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=recv_f, src=recv_u)
    return send_f, recv_f


def _slot_rows(first, rows, starts, counts, slot_rows):
    """int32 [P, 1]: for the packed positions first .. first+rows-1, where segment j covers
    [starts[j], starts[j] + counts[j]), the row j * slot_rows + (position - starts[j]) of the slotted
    layout; -1 for a position in no segment; past the whole slotted layout (an out-of-bounds row)
    where a segment overflows its slot. starts, counts: [P, EP] fp32, equal on every partition."""
    ep = starts.shape[1]
    position = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(position, pattern=[[0, 1]], offset=first, channel_multiplier=1)
    rel = nl.ndarray((P, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rel[0:rows, :], data=starts[0:rows, :], op0=nl.subtract, operand0=position[0:rows, :],
                       reverse0=True)
    inside = nl.ndarray((P, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=inside[0:rows, :], data1=rel[0:rows, :], data2=counts[0:rows, :], op=nl.less)
    nisa.scalar_tensor_tensor(dst=inside[0:rows, :], data=rel[0:rows, :], op0=nl.greater_equal, operand0=0.0,
                              op1=nl.multiply, operand1=inside[0:rows, :])
    # target + 1 = j * slot_rows + rel + 1, plus a whole layout more where rel >= slot_rows (overflow).
    target = nl.ndarray((P, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(target, pattern=[[slot_rows, ep]], offset=1, channel_multiplier=0)
    nisa.tensor_tensor(dst=target[0:rows, :], data1=target[0:rows, :], data2=rel[0:rows, :], op=nl.add)
    over = nl.ndarray((P, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=over[0:rows, :], data=rel[0:rows, :], op0=nl.greater_equal, operand0=float(slot_rows),
                       op1=nl.multiply, operand1=float(ep * slot_rows))
    nisa.tensor_tensor(dst=target[0:rows, :], data1=target[0:rows, :], data2=over[0:rows, :], op=nl.add)
    nisa.tensor_tensor(dst=target[0:rows, :], data1=target[0:rows, :], data2=inside[0:rows, :], op=nl.multiply)
    picked = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=picked[0:rows, :], op=nl.add, data=target[0:rows, :], axis=1, keepdims=True)
    index = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=index[0:rows, :], data=picked[0:rows, :], op0=nl.subtract, operand0=1.0)
    return index


def _move_rows(dst, src, r0, rows, index, scatter=False, oob_mode=nisa.oob_mode.error):
    """One tile of rows moved through SBUF, H_TILE columns at a time, by index (int32 [P, 1] SBUF row
    numbers): gathered, dst[r0 + i] = src[index[i]], or scattered, dst[index[i]] = src[r0 + i], for
    i < rows. Under oob_mode.skip a row whose index is out of bounds moves nothing: gathered, it reads
    as zeros."""
    hidden = src.shape[1]
    for h0 in range(0, hidden, H_TILE):
        width = min(H_TILE, hidden - h0)
        moved = nl.ndarray((P, H_TILE), dtype=src.dtype, buffer=nl.sbuf)
        indexed = (dst if scatter else src).ap([[hidden, rows], [1, width]], offset=h0,
                                               vector_offset=index[0:rows, :], indirect_dim=0)
        if scatter:
            nisa.dma_copy(dst=moved[0:rows, 0:width], src=src[r0:r0 + rows, h0:h0 + width])
            nisa.dma_copy(dst=indexed, src=moved[0:rows, 0:width], oob_mode=oob_mode)
        else:
            if oob_mode == nisa.oob_mode.skip:
                _zero(moved[0:rows, 0:width])
            nisa.dma_copy(dst=moved[0:rows, 0:width], src=indexed, oob_mode=oob_mode)
            nisa.dma_copy(dst=dst[r0:r0 + rows, h0:h0 + width], src=moved[0:rows, 0:width])


def _compact(out, slots, slot_rows, starts, counts):
    """out[r] = slots[j * slot_rows + r - starts[j]] for every row r of source j's segment; zero rows
    past the segments. Gathers only the rows out holds (none of a slot's unused tail)."""
    capacity = out.shape[0]
    for r0 in _my_tiles(capacity):
        rows = min(P, capacity - r0)
        _move_rows(out, slots, r0, rows, _slot_rows(r0, rows, starts, counts, slot_rows),
                   oob_mode=nisa.oob_mode.skip)


def _spread(slots, rows_in, num_rows, slot_rows, starts, counts):
    """slots[j * slot_rows + r - starts[j]] = rows_in[r] for the packed rows r < num_rows of segment j
    (the inverse of _compact). A segment longer than slot_rows is an out-of-bounds error."""
    for r0 in _my_tiles(num_rows):
        rows = min(P, num_rows - r0)
        _move_rows(slots, rows_in, r0, rows, _slot_rows(r0, rows, starts, counts, slot_rows), scatter=True,
                   oob_mode=nisa.oob_mode.skip)


def _checked_counts(counts, capacity):
    """counts ([1, EP] fp32 rows arriving from each source), passed through a check that fails on the device
    when more than `capacity` rows arrived: a one-element indirect read whose index is
    max(total - capacity, 0) leaves a one-row tensor unless the rows fit (oob_mode.error). The value read
    (0 when they fit) is added to the counts the compaction uses, so the check is part of the dataflow and
    no dead-code elimination (nki.jit's dead_code_elim) can drop it."""
    excess = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=excess, data=_row_total(counts), op0=nl.subtract, operand0=float(capacity),
                       op1=nl.maximum, operand1=0.0)
    guard = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.hbm)
    zero = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(zero, value=0)
    nisa.dma_copy(dst=guard, src=zero)
    probe = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=probe, src=guard.ap([[1, 1], [1, 1]], offset=0, vector_offset=excess, indirect_dim=0))
    probe_f = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=probe_f, src=probe)
    checked = nl.ndarray(counts.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=checked, data=counts, op0=nl.add, operand0=probe_f)
    return checked


def _row_total(counts):
    """[1, 1] fp32 tile: the sum of a [1, EP] row of counts."""
    total = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=total, op=nl.add, data=counts, axis=1, keepdims=True)
    return total


def _copy_rows(dst, src):
    """dst[0:R] = src (HBM [R, H] -> HBM), through SBUF tiles."""
    num_rows, hidden = src.shape
    for r0 in _my_tiles(num_rows):
        rows = min(P, num_rows - r0)
        for h0 in range(0, hidden, H_TILE):
            width = min(H_TILE, hidden - h0)
            moved = nl.ndarray((P, H_TILE), dtype=src.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=moved[0:rows, 0:width], src=src[r0:r0 + rows, h0:h0 + width])
            nisa.dma_copy(dst=dst[r0:r0 + rows, h0:h0 + width], src=moved[0:rows, 0:width])


def _zero_rows(dst):
    """Write zeros to every row of an HBM [M, H] tensor."""
    num_rows, hidden = dst.shape
    zeros = nl.ndarray((P, H_TILE), dtype=dst.dtype, buffer=nl.sbuf)
    _zero(zeros)
    for r0 in _my_tiles(num_rows):
        rows = min(P, num_rows - r0)
        for h0 in range(0, hidden, H_TILE):
            width = min(H_TILE, hidden - h0)
            nisa.dma_copy(dst=dst[r0:r0 + rows, h0:h0 + width], src=zeros[0:rows, 0:width])


def _exchange(send, out, slot_rows, out_f, in_f, metadata, replica_group, exchange):
    """Move every rank's packed `send` rows (segment j for rank j, sizes out_f) into `out`, source-major
    packed (segment sizes in_f), by `exchange` (module doc). out rows past the segments are zero. Both cores
    may have written send; both may read out afterwards."""
    hidden = send.shape[1]
    ep = out_f.shape[1]
    capacity = out.shape[0]
    _sync(send)
    if exchange == "all_to_all_v_packed":
        # The collective writes a kernel-internal buffer, copied out after (as nki-library's permute_a2av
        # does): a kernel's returned tensor is never a collective's destination.
        landing = nl.ndarray(out.shape, dtype=out.dtype, buffer=nl.shared_hbm)
        _zero_rows(landing)
        _sync(landing)
        ncc.all_to_all_v(srcs=[send], dsts=[landing], replica_group=replica_group, metadata_tensor=metadata,
                         recv_counts_known=True, has_rdispls=True)
        _sync(landing)
        _copy_rows(out, landing)
        _sync(out)
        return
    in_f = _checked_counts(in_f, capacity)
    in_starts = _on_every_partition(_exclusive_scan(in_f))
    in_counts = _on_every_partition(in_f)
    slots = nl.ndarray((ep * slot_rows, hidden), dtype=send.dtype, buffer=nl.shared_hbm)
    if exchange == "all_to_all_v":
        # Source j's segment lands at slot j (dst size / EP = slot_rows rows); the send buffer is one slot.
        ncc.all_to_all_v(srcs=[send], dsts=[slots], replica_group=replica_group, metadata_tensor=metadata,
                         recv_counts_known=True, has_rdispls=False)
    else:
        # all_to_all moves equal chunks: segment j goes to chunk j of a slotted send buffer first (a
        # chunk's tail past the segment is never written: the receiver's compaction reads no further).
        spread = nl.ndarray((ep * slot_rows, hidden), dtype=send.dtype, buffer=nl.shared_hbm)
        out_starts = _on_every_partition(_exclusive_scan(out_f))
        _spread(spread, send, send.shape[0], slot_rows, out_starts, _on_every_partition(out_f))
        _sync(spread)
        ncc.all_to_all(srcs=[spread], dsts=[slots], replica_group=replica_group, collective_dim=0)
    _sync(slots)
    _compact(out, slots, slot_rows, in_starts, in_counts)
    _sync(out)


def _exchange_plan(replica_group, generation, exchange, num_rows, capacity, hidden, ep):
    """(the exchange a kernel runs (exchange_for), the rows of one slot of its slotted layout) for num_rows
    packed rows on this rank and capacity rows of the dispatch's receive buffer: all_to_all's fixed slots
    hold capacity rows, all_to_all_v's the most either side holds. Sizes the kernels cannot count exactly
    are refused."""
    exchange = exchange_for(replica_group, generation, exchange, _cores()[1])
    slot_rows = capacity if exchange == "all_to_all" else max(num_rows, capacity)
    widest = max(num_rows, capacity)
    if widest * hidden > A2AV_MAX_ELEMENTS:
        raise ValueError(f"{widest} rows of {hidden} elements do not fit uint32 all_to_all_v metadata")
    if widest * _odd_part(hidden)[0] >= MAX_EXACT:
        raise ValueError(f"a2av kernels compute row counts times the odd part of H={hidden} exactly below {MAX_EXACT}")
    if 2 * ep * slot_rows + 1 >= MAX_EXACT:
        raise ValueError(f"{ep} slots of {slot_rows} rows: slot row indices must stay below {MAX_EXACT // 2}")
    return exchange, slot_rows


def _move_packed_rows(dst, src, packed_source_indices, num_rows, scatter):
    """Between the packed order and the routed rows, for i < num_rows: gathered, dst[i] =
    src[packed_source_indices[i]] (the dispatch), or scattered, dst[packed_source_indices[i]] = src[i]
    (the combine). An index out of bounds is an error."""
    for r0 in _my_tiles(num_rows):
        rows = min(P, num_rows - r0)
        index = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=index[0:rows, :], src=packed_source_indices[r0:r0 + rows])
        _move_rows(dst, src, r0, rows, index, scatter)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@nki.jit
def permute_a2av_kernel(hidden_states, packed_source_indices, send_counts, recv_capacity, replica_group,
                        generation="trn2", exchange=None):
    """Dispatch routed rows to their expert-parallel ranks.

    hidden_states [N, H] rows; packed_source_indices int32 [N], the source row of each packed row,
    destination-major: rows [sum(send_counts[:d]), sum(send_counts[:d + 1])) go to rank d of the
    replica group's rank-list; send_counts int32/uint32 [1, EP] rows per destination, summing to N;
    recv_capacity: static rows of the receive buffer (equal on every rank); replica_group: the EP
    ncc.ReplicaGroup; generation: "trn2" or "trn3" and exchange: None or one of EXCHANGES (static), which
    pick the exchange (module doc).

    Returns (recv [recv_capacity, H]: the rows every source rank sent here, source-major, each
    source's rows in its packed order, then zero rows; metadata uint32 [4, EP]: send counts, send
    displacements, receive counts, receive displacements of that packed layout, all in elements).
    More rows arriving than recv_capacity is an error.
    """
    num_rows, hidden = hidden_states.shape
    exchange, slot_rows = _exchange_plan(replica_group, generation, exchange, num_rows, recv_capacity, hidden,
                                         send_counts.shape[1])

    send_f, recv_f = _exchange_counts(send_counts, replica_group)
    metadata = _metadata(send_f, recv_f, hidden)
    # The packed send buffer; with receive slots it is one slot long (dst = EP x src).
    send = nl.ndarray((slot_rows if exchange == "all_to_all_v" else num_rows, hidden), dtype=hidden_states.dtype,
                      buffer=nl.shared_hbm)
    _move_packed_rows(send, hidden_states, packed_source_indices, num_rows, scatter=False)
    recv = nl.ndarray((recv_capacity, hidden), dtype=hidden_states.dtype, buffer=nl.shared_hbm)
    _exchange(send, recv, slot_rows, send_f, recv_f, metadata, replica_group, exchange)
    return recv, metadata


@nki.jit
def unpermute_a2av_kernel(expert_output, packed_source_indices, send_counts, merging_probs, replica_group,
                          generation="trn2", exchange=None):
    """Combine: return expert outputs to the ranks that dispatched them and merge each token's rows.

    expert_output [C, H]: one output row per row of permute_a2av's receive buffer, in its order
    (rows past what arrived are ignored); packed_source_indices int32 [N] and send_counts [1, EP]:
    the dispatch's inputs on this rank; merging_probs fp32 [T, k] with N = T * k: routed row
    t * k + j is token t's slot j; replica_group, generation, exchange: as for the dispatch.

    Returns out [T, H] in expert_output's dtype: out[t] = sum_j merging_probs[t, j] * (expert output
    of routed row t * k + j), accumulated in fp32.
    """
    capacity, hidden = expert_output.shape
    num_rows = packed_source_indices.shape[0]
    num_tokens, top_k = merging_probs.shape
    exchange, slot_rows = _exchange_plan(replica_group, generation, exchange, num_rows, capacity, hidden,
                                         send_counts.shape[1])

    # What the dispatch sent to j comes back from j, and what it received from j goes back to j.
    sent_f, held_f = _exchange_counts(send_counts, replica_group)
    metadata = _metadata(sent_f, held_f, hidden, sends_back=True)
    # Collective buffers are kernel-internal HBM: copy the expert outputs into the send buffer.
    send = nl.ndarray((slot_rows if exchange == "all_to_all_v" else capacity, hidden), dtype=expert_output.dtype,
                      buffer=nl.shared_hbm)
    _copy_rows(send, expert_output)
    back = nl.ndarray((num_rows, hidden), dtype=expert_output.dtype, buffer=nl.shared_hbm)
    _exchange(send, back, slot_rows, held_f, sent_f, metadata, replica_group, exchange)

    # back[i] is the output for routed row packed_source_indices[i]: put it at that row, then merge.
    # by_row is shared: a core's tiles of back scatter anywhere, and each core merges its own tokens.
    by_row = nl.ndarray((num_rows, hidden), dtype=expert_output.dtype, buffer=nl.shared_hbm)
    _move_packed_rows(by_row, back, packed_source_indices, num_rows, scatter=True)

    _sync(by_row)
    out = nl.ndarray((num_tokens, hidden), dtype=expert_output.dtype, buffer=nl.shared_hbm)
    for t0 in _my_tiles(num_tokens):
        rows = min(P, num_tokens - t0)
        probs = nl.ndarray((P, top_k), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=probs[0:rows, :], src=merging_probs[t0:t0 + rows, :])
        for h0 in range(0, hidden, H_TILE):
            width = min(H_TILE, hidden - h0)
            total = nl.ndarray((P, H_TILE), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(total[0:rows, 0:width], value=0.0)
            for j in range(top_k):
                # Token t's slot j is routed row t * k + j: rows t0 .. t0+rows-1, a stride of k rows.
                row = nl.ndarray((P, H_TILE), dtype=expert_output.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=row[0:rows, 0:width],
                              src=by_row.ap([[top_k * hidden, rows], [1, width]], offset=(t0 * top_k + j) * hidden + h0))
                nisa.scalar_tensor_tensor(dst=total[0:rows, 0:width], data=row[0:rows, 0:width], op0=nl.multiply,
                                          operand0=probs[0:rows, j:j + 1], op1=nl.add, operand1=total[0:rows, 0:width])
            result = nl.ndarray((P, H_TILE), dtype=expert_output.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=result[0:rows, 0:width], src=total[0:rows, 0:width])
            nisa.dma_copy(dst=out[t0:t0 + rows, h0:h0 + width], src=result[0:rows, 0:width])
    return out


# ---------------------------------------------------------------------------------------------
# Host functions: argument checks, then the kernels through nki.simulate
# ---------------------------------------------------------------------------------------------

def _array(x, what, shape, dtypes=None):
    """x as a contiguous NumPy array of the expected shape (None = any size) and dtype names, else TypeError/ValueError."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what} must be a NumPy array, got {type(x).__name__}")
    if dtypes is not None and str(x.dtype) not in dtypes:
        raise TypeError(f"{what} must have dtype {' or '.join(dtypes)}, got {x.dtype}")
    if x.ndim != len(shape) or any(want is not None and got != want for got, want in zip(x.shape, shape)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{what} must have shape {expected}, got {list(x.shape)}")
    return np.ascontiguousarray(x)


def _check_routing(packed_source_indices, send_counts, num_rows, replica_group, generation, exchange):
    """The checked (packed_source_indices, send_counts) of a dispatch of num_rows rows."""
    if not isinstance(packed_source_indices, np.ndarray) or packed_source_indices.dtype.kind not in "iu":
        raise TypeError("packed_source_indices must be a NumPy integer array")
    packed_source_indices = _array(packed_source_indices, "packed_source_indices", (num_rows,))
    if num_rows and (packed_source_indices.min() < 0 or packed_source_indices.max() >= num_rows):
        raise ValueError(f"packed_source_indices must lie in [0, {num_rows})")
    send_counts = _array(send_counts, "send_counts", (1, None), ("int32", "uint32"))
    if send_counts.shape[1] == 0:
        raise ValueError("send_counts must have one column per rank of the replica group")
    if (send_counts.astype(np.int64) < 0).any():
        raise ValueError(f"send_counts must be non-negative, got {send_counts.tolist()}")
    if int(send_counts.astype(np.int64).sum()) != num_rows:
        raise ValueError(f"send_counts {send_counts.tolist()} must sum to the {num_rows} routed rows")
    # One column per rank of the rank-list: ReplicaGroup documents no field to read its rank-lists from, so
    # the kernel's first collective (the counts' all_to_all, one count per peer) is what checks it.
    exchange_for(replica_group, generation, exchange, logical_cores())
    return packed_source_indices.astype(np.int32), send_counts


def permute_a2av(hidden_states, packed_source_indices, send_counts, recv_capacity, replica_group, *, generation="trn2",
                 exchange=None):
    """Expert-parallel dispatch of this rank's rows; every rank of replica_group's rank-list calls it together.

    hidden_states [N, H] NumPy rows of any NKI dtype (bfloat16 / fp8 as ml_dtypes arrays);
    packed_source_indices integer [N] in [0, N), destination-major (rank d's rows are positions
    [sum(send_counts[:d]), sum(send_counts[:d + 1]))); send_counts int32/uint32 [1, EP], non-negative,
    summing to N; recv_capacity rows (>= 1) of the receive buffer, equal on every rank, which must hold
    every row sent to this rank; replica_group an ncc.ReplicaGroup of EP-rank lists; generation
    "trn2" (default) or "trn3": the Trainium generation whose collectives the exchange uses; exchange
    None (the generation's default) or one of EXCHANGES (module doc). The kernel runs at the LNC the
    environment declares (permgen.nki.host.logical_cores()).

    Returns (recv [recv_capacity, H] in hidden_states' dtype: rows from rank 0, then rank 1, ..., then
    zeros; metadata uint32 [4, EP]: send counts, send displacements, receive counts, receive
    displacements, in elements, i.e. rows * H).
    """
    hidden_states = _array(hidden_states, "hidden_states", (None, None))
    num_rows, hidden = hidden_states.shape
    if hidden == 0:
        raise ValueError("hidden_states must have at least one column")
    packed_source_indices, send_counts = _check_routing(packed_source_indices, send_counts, num_rows, replica_group,
                                                        generation, exchange)
    if isinstance(recv_capacity, bool) or not isinstance(recv_capacity, (int, np.integer)) or recv_capacity < 1:
        raise ValueError(f"recv_capacity must be a positive int, got {recv_capacity!r}")
    if num_rows == 0:  # a rank with nothing to send still takes part in the exchange
        hidden_states = np.zeros((1, hidden), dtype=hidden_states.dtype)
        packed_source_indices = np.zeros(1, dtype=np.int32)
    # The rows are only moved: float8_e4m3fn ones travel as their bytes (Trainium2 has no such data type).
    recv, metadata = nki.simulate(permute_a2av_kernel[logical_cores()])(
        _moved_bytes(hidden_states), packed_source_indices, send_counts, recv_capacity=int(recv_capacity),
        replica_group=replica_group, generation=generation, exchange=exchange)
    return recv.view(hidden_states.dtype), metadata


def _moved_bytes(rows):
    """float8_e4m3fn rows as uint8 (neuronx-cc NCC_EVRF051: "Data type F8E4M3FN is not supported on TRN1/TRN2"),
    other rows as they are."""
    return rows.view(np.uint8) if rows.dtype == np.dtype(ml_dtypes.float8_e4m3fn) else rows


def unpermute_a2av(expert_output, packed_source_indices, send_counts, merging_probs, replica_group, *,
                   generation="trn2", exchange=None):
    """Expert-parallel combine, the reverse of permute_a2av; every rank of the rank-list calls it together.

    expert_output [C, H] NumPy rows (C = the dispatch's recv_capacity), one per row of this rank's
    dispatch receive buffer, in that order; packed_source_indices and send_counts: this rank's
    dispatch inputs; merging_probs float32 [T, k] with N = T * k routed rows (row t * k + j is token
    t's slot j); replica_group, generation, exchange: as for the dispatch.

    Returns [T, H] in expert_output's dtype: out[t] = sum_j merging_probs[t, j] * the expert output of
    routed row t * k + j, accumulated in fp32.
    """
    expert_output = _array(expert_output, "expert_output", (None, None))
    if expert_output.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        raise TypeError("expert_output is float8_e4m3fn, which the combine would compute with: Trainium2 has no such "
                        "data type (neuronx-cc NCC_EVRF051); pass the experts' bf16 outputs")
    capacity, hidden = expert_output.shape
    if hidden == 0 or capacity == 0:
        raise ValueError(f"expert_output must have rows and columns, got {list(expert_output.shape)}")
    merging_probs = _array(merging_probs, "merging_probs", (None, None), ("float32",))
    num_tokens, top_k = merging_probs.shape
    if top_k == 0:
        raise ValueError("merging_probs must have one column per routed slot (k >= 1)")
    packed_source_indices, send_counts = _check_routing(packed_source_indices, send_counts, num_tokens * top_k,
                                                        replica_group, generation, exchange)
    if num_tokens == 0:  # no tokens here: take part in the exchange with one dummy token, then drop it
        out = nki.simulate(unpermute_a2av_kernel[logical_cores()])(
            expert_output, np.arange(top_k, dtype=np.int32), send_counts, np.zeros((1, top_k), np.float32),
            replica_group=replica_group, generation=generation, exchange=exchange)
        return out[:0]
    return nki.simulate(unpermute_a2av_kernel[logical_cores()])(
        expert_output, packed_source_indices, send_counts, merging_probs, replica_group=replica_group,
        generation=generation, exchange=exchange)
