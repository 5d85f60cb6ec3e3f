"""Expert-parallel dispatch on Trainium: `permute_a2av`, written once (it depends on no variant axis).

Each rank packs its routed rows by destination rank and the ranks exchange them with
`ncc.all_to_all_v`. The rows are opaque here: no routing, probs or padding is involved, so one
kernel serves every variant. The host function takes NumPy arrays (bfloat16 and fp8 as ml_dtypes
arrays) and runs the kernel through nki.simulate; on a Trainium host, call the kernel directly.
Every rank of the replica group calls it together (in the CPU emulator: under
nki_emulator.run_ranks).
"""

from __future__ import annotations

import numpy as np

from .nki_host import ensure_nki

ensure_nki()

import nki  # noqa: E402
import nki.collectives as ncc  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

P = nl.tile_size.pmax  # rows per tile: one per partition
H_TILE = 2048  # hidden columns per SBUF tile
MAX_EXACT = 1 << 24  # whole numbers are exact in fp32 below this
A2AV_MAX_ELEMENTS = (1 << 32) - 1  # all_to_all_v counts and displacements are uint32 elements


def _odd_part(n):
    """(odd, shift) with n == odd << shift, for n >= 1."""
    shift = 0
    while n % 2 == 0:
        n //= 2
        shift += 1
    return n, shift


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


def _store_elements(dst, rows, hidden):
    """dst (a uint32 [1, EP] HBM row) = rows * hidden, exactly: rows * odd(hidden) is a whole number
    below 2^24, so exact in fp32; the power of two of hidden is then a left shift on the integers."""
    odd, shift = _odd_part(hidden)
    ep = rows.shape[1]
    scaled = nl.ndarray((1, ep), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=scaled, data=rows, op0=nl.multiply, operand0=float(odd))
    elements = nl.ndarray((1, ep), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=elements, data=scaled, op0=nl.left_shift, operand0=shift)
    nisa.dma_copy(dst=dst, src=elements)


def _zero_rows(dst):
    """Write zeros to every row of an HBM [M, H] tensor."""
    num_rows, hidden = dst.shape
    zeros = nl.ndarray((P, H_TILE), dtype=dst.dtype, buffer=nl.sbuf)
    nisa.memset(zeros, value=0.0)
    for r0 in nl.static_range(0, num_rows, P):
        rows = min(P, num_rows - r0)
        for h0 in nl.static_range(0, hidden, H_TILE):
            width = min(H_TILE, hidden - h0)
            nisa.dma_copy(dst=dst[r0:r0 + rows, h0:h0 + width], src=zeros[0:rows, 0:width])


@nki.jit
def permute_a2av_kernel(hidden_states, packed_source_indices, send_counts, recv_capacity, replica_group):
    """Dispatch routed rows to their expert-parallel ranks through ncc.all_to_all_v.

    hidden_states [N, H] rows; packed_source_indices int32 [N], the source row of each packed row,
    destination-major: rows [sum(send_counts[:d]), sum(send_counts[:d + 1])) go to rank d of the
    replica group's rank-list; send_counts int32/uint32 [1, EP] rows per destination, summing to N;
    recv_capacity: static rows of the receive buffer; replica_group: the EP ncc.ReplicaGroup.

    Returns (recv [recv_capacity, H]: the rows every source rank sent here, source-major, each
    source's rows in its packed order, then zero rows; metadata uint32 [4, EP]: send counts, send
    displacements, receive counts, receive displacements, all in elements).
    """
    num_rows, hidden = hidden_states.shape
    ep = send_counts.shape[1]
    widest = max(num_rows, recv_capacity)
    if widest * hidden > A2AV_MAX_ELEMENTS:
        raise ValueError(f"{widest} rows of {hidden} elements do not fit uint32 all_to_all_v metadata")
    if widest * _odd_part(hidden)[0] >= MAX_EXACT:
        raise ValueError(f"permute_a2av computes row counts times the odd part of H={hidden} exactly below {MAX_EXACT}")

    # Receive counts: one all-to-all of one count per peer tells each rank what arrives from whom.
    counts_in = nl.ndarray((1, ep), dtype=send_counts.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=counts_in, src=send_counts)
    counts_u = nl.ndarray((1, ep), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=counts_u, src=counts_in)
    count_send = nl.ndarray((ep, 1), dtype=nl.uint32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=count_send.ap([[ep, 1], [1, ep]], offset=0), src=counts_u)
    count_recv = nl.ndarray((ep, 1), dtype=nl.uint32, buffer=nl.shared_hbm)
    ncc.all_to_all(srcs=[count_send], dsts=[count_recv], replica_group=replica_group, collective_dim=0)
    recv_u = nl.ndarray((1, ep), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=recv_u, src=count_recv.ap([[ep, 1], [1, ep]], offset=0))

    # Pack: send row i = hidden_states[packed_source_indices[i]]; an index outside [0, N) is an error.
    send_rows = nl.ndarray((num_rows, hidden), dtype=hidden_states.dtype, buffer=nl.shared_hbm)
    for r0 in nl.static_range(0, num_rows, P):
        rows = min(P, num_rows - r0)
        source = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=source[0:rows, :], src=packed_source_indices.ap([[1, rows], [1, 1]], offset=r0))
        for h0 in nl.static_range(0, hidden, H_TILE):
            width = min(H_TILE, hidden - h0)
            moved = nl.ndarray((P, H_TILE), dtype=hidden_states.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=moved[0:rows, 0:width],
                          src=hidden_states.ap([[hidden, rows], [1, width]], offset=h0,
                                               vector_offset=source[0:rows, :], indirect_dim=0))
            nisa.dma_copy(dst=send_rows[r0:r0 + rows, h0:h0 + width], src=moved[0:rows, 0:width])

    # Metadata in elements: packed send segments, and receive segments packed source-major.
    send_f = nl.ndarray((1, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=send_f, src=counts_u)
    recv_f = nl.ndarray((1, ep), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=recv_f, src=recv_u)
    metadata = nl.ndarray((4, ep), dtype=nl.uint32, buffer=nl.shared_hbm)
    _store_elements(metadata[0:1, :], send_f, hidden)
    _store_elements(metadata[1:2, :], _exclusive_scan(send_f), hidden)
    _store_elements(metadata[2:3, :], recv_f, hidden)
    _store_elements(metadata[3:4, :], _exclusive_scan(recv_f), hidden)

    # Rows past what arrives stay zero: deterministic padding.
    recv = nl.ndarray((recv_capacity, hidden), dtype=hidden_states.dtype, buffer=nl.shared_hbm)
    _zero_rows(recv)
    ncc.all_to_all_v(srcs=[send_rows], dsts=[recv], replica_group=replica_group, metadata_tensor=metadata,
                     recv_counts_known=True, has_rdispls=True)
    return recv, metadata


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


def permute_a2av(hidden_states, packed_source_indices, send_counts, recv_capacity, replica_group):
    """Expert-parallel dispatch of this rank's rows; every rank of replica_group's rank-list calls it together.

    hidden_states [N, H] NumPy rows of any NKI dtype (bfloat16 / fp8 as ml_dtypes arrays);
    packed_source_indices integer [N] in [0, N), destination-major (rank d's rows are positions
    [sum(send_counts[:d]), sum(send_counts[:d + 1]))); send_counts int32/uint32 [1, EP], non-negative,
    summing to N; recv_capacity rows (>= 1) of the receive buffer, which must hold every row sent to
    this rank; replica_group an ncc.ReplicaGroup of EP ranks.

    Returns (recv [recv_capacity, H] in hidden_states' dtype: rows from rank 0, then rank 1, ..., then
    zeros; metadata uint32 [4, EP]: send counts, send displacements, receive counts, receive
    displacements, in elements, i.e. rows * H).
    """
    hidden_states = _array(hidden_states, "hidden_states", (None, None))
    num_rows, hidden = hidden_states.shape
    if hidden == 0:
        raise ValueError("hidden_states must have at least one column")
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
        raise ValueError(f"send_counts {send_counts.tolist()} must sum to the {num_rows} rows of hidden_states")
    if isinstance(recv_capacity, bool) or not isinstance(recv_capacity, (int, np.integer)) or recv_capacity < 1:
        raise ValueError(f"recv_capacity must be a positive int, got {recv_capacity!r}")
    if num_rows == 0:  # a rank with nothing to send still takes part in the exchange
        hidden_states = np.zeros((1, hidden), dtype=hidden_states.dtype)
        packed_source_indices = np.zeros(1, dtype=np.int32)
    return nki.simulate(permute_a2av_kernel)(hidden_states, packed_source_indices.astype(np.int32), send_counts,
                                             recv_capacity=int(recv_capacity), replica_group=replica_group)
