"""The `nki.collectives` subset the generated kernels use, and the multi-rank driver that runs them.

A collective needs every rank of its rank-list to take part, so kernels that call one run under
`run_ranks`: it runs the same program once per rank, each rank in its own thread with its own
inputs, and the collectives meet at a barrier, exchange HBM buffers and check what the runtime
checks. Strict by design: a rank that sends past its source buffer, a receive that does not fit
its destination, overlapping receive intervals, all_to_all chunks of different sizes, or ranks
calling different collectives are errors, and an error on one rank fails them all.

    results = run_ranks(fn, [args_rank0, args_rank1, ...])   # fn(*args) on every rank
    results = run_ranks(fn, rank_args, platform=Platform("trn3"))

The world runs on a Platform (default: Trainium2, every rank on one instance), and all_to_all_v
enforces that generation's documented restrictions (nki.collectives.all_to_all_v, 2.33, "Current
restrictions"): on Trn3's NeuronSwitch fabric it needs LNC=2, more than one device, and rank-lists
of consecutive ranks holding every rank of each device they touch; on Trn2, has_rdispls=True only
on inter-node rank-lists (same-indexed ranks of different instances).

`fn` is any Python callable: a kernel, or host code that launches kernels through nki.simulate.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from . import _core, _cores
from ._core import EmulatorError, PeerFailed, Platform, Tensor

__all__ = ["Platform", "ReplicaGroup", "all_to_all", "all_to_all_v", "rank_id", "run_ranks"]

BARRIER_TIMEOUT_S = 120.0


class ReplicaGroup:
    """The ranks taking part in a collective, as a list of disjoint rank-lists; a collective runs
    independently within each rank-list."""

    def __init__(self, *args):
        # Called positionally with the rank-lists, ReplicaGroup([[0, 1], ...]) (the stub: `*args`).
        if len(args) != 1:
            raise EmulatorError(f"ReplicaGroup takes one argument, the list of rank-lists; got {len(args)}")
        groups = args[0]
        self.groups = [[int(r) for r in g] for g in groups]
        seen = [r for g in self.groups for r in g]
        if not self.groups or any(not g for g in self.groups):
            raise EmulatorError(f"ReplicaGroup needs non-empty rank-lists, got {groups}")
        if len(seen) != len(set(seen)):
            raise EmulatorError(f"ReplicaGroup rank-lists overlap: {groups}")

    def __repr__(self) -> str:
        return f"ReplicaGroup({self.groups})"

    def rank_list(self, rank: int) -> list[int]:
        for g in self.groups:
            if rank in g:
                return g
        raise EmulatorError(f"rank {rank} is in no rank-list of {self!r}")


# ---------------------------------------------------------------------------------------------
# The world of one run_ranks call, and each rank thread's view of it.
@dataclass
class _World:
    size: int
    barrier: threading.Barrier
    mailbox: dict = field(default_factory=dict)  # rank -> what it published for the current collective


_local = threading.local()


def _context() -> tuple[_World, int]:
    world = getattr(_local, "world", None)
    if world is None:
        raise EmulatorError("collectives run only under the multi-rank driver: nki_emulator.run_ranks(fn, rank_args)")
    return world, _local.rank


def _rank_context():
    return getattr(_local, "world", None), getattr(_local, "rank", None)


def _enter_rank_context(context) -> None:
    """The cores of a kernel launched on a rank belong to that rank."""
    _local.world, _local.rank = context


def rank_id(name=None) -> int:
    """The calling rank's id in the run_ranks world (both cores of a rank at LNC=2 see the same)."""
    return _context()[1]


def _wait(world: _World) -> None:
    try:
        world.barrier.wait(timeout=BARRIER_TIMEOUT_S)
    except threading.BrokenBarrierError:
        raise PeerFailed("another rank failed or never reached this collective") from None


def _exchange(kind: str, replica_group, payload) -> tuple[list[int], int, dict]:
    """Publish this rank's payload, wait for every rank, return (rank-list, my position, payloads by rank)."""
    world, rank = _context()
    if not isinstance(replica_group, ReplicaGroup):
        raise EmulatorError(f"{kind}: replica_group must be an ncc.ReplicaGroup, got {type(replica_group).__name__}")
    ranks = replica_group.rank_list(rank)
    if any(not 0 <= r < world.size for r in ranks):
        raise EmulatorError(f"{kind}: {replica_group!r} names ranks outside the {world.size}-rank world")
    world.mailbox[rank] = (kind, replica_group.groups, payload)
    _wait(world)
    posts = {r: world.mailbox[r] for r in ranks}
    _wait(world)  # every rank has read the mailbox: it may be reused by the next collective
    for r, (other_kind, groups, _) in posts.items():
        if other_kind != kind or groups != replica_group.groups:
            raise EmulatorError(f"rank {rank} called {kind} on {replica_group.groups} while rank {r} called "
                                f"{other_kind} on {groups}: every rank must issue the same collectives in the same order")
    return ranks, ranks.index(rank), {r: p for r, (_, _, p) in posts.items()}


def _hbm_list(tensors, what: str, kind: str) -> Tensor:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        raise EmulatorError(f"{kind}: {what} must be a list of exactly one tensor")
    t = tensors[0]
    if not isinstance(t, Tensor) or t.buffer not in _core.HBM_BUFFERS:
        raise EmulatorError(f"{kind}: {what} must be HBM tensors, got {t!r}")
    if not t._whole:
        raise EmulatorError(f"{kind}: {what} must be whole tensors, not slices")
    return t


# ---------------------------------------------------------------------------------------------
def all_to_all(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    return _on_the_rank("ncc.all_to_all", _all_to_all, (srcs, dsts, replica_group, collective_dim, priority, name),
                        inputs=list(srcs) if isinstance(srcs, (list, tuple)) else [],
                        outputs=list(dsts) if isinstance(dsts, (list, tuple)) else [])


def _all_to_all(srcs, dsts, replica_group, collective_dim, priority, name):
    """Split src along dim 0 into one chunk per rank of the rank-list; chunk j goes to rank j, and
    the chunk from rank i lands as chunk i of dst. HBM only; collective_dim 0 only."""
    kind = "all_to_all"
    _core.count_instruction()
    src, dst = _hbm_list(srcs, "srcs", kind), _hbm_list(dsts, "dsts", kind)
    if collective_dim != 0:
        raise EmulatorError(f"{kind}: only collective_dim=0 is supported")
    if src._dtype != dst._dtype or src.shape != dst.shape:
        raise EmulatorError(f"{kind}: src {src.shape} {src._dtype} and dst {dst.shape} {dst._dtype} must match")
    ranks, me, posts = _exchange(kind, replica_group, src._array.copy())
    size = len(ranks)
    if src.shape[0] % size:
        raise EmulatorError(f"{kind}: dim 0 of {src.shape} does not split into {size} equal chunks")
    chunk = src.shape[0] // size
    if any(posts[r].shape != src.shape for r in ranks):
        raise EmulatorError(f"{kind}: the ranks' buffers differ in shape ({sorted({posts[r].shape for r in ranks})}): "
                            f"every rank splits the same shape into equal chunks")
    for i, r in enumerate(ranks):
        dst._array[i * chunk:(i + 1) * chunk] = posts[r][me * chunk:(me + 1) * chunk]


def _check_generation(kind: str, ranks: list[int], has_rdispls: bool) -> None:
    """The platform's documented restrictions on all_to_all_v (nki.collectives.all_to_all_v, 2.33,
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.collectives.all_to_all_v.html,
    "Current restrictions")."""
    plat = _core.platform()
    if plat.generation == "trn3":
        per_device = plat.ranks_per_device
        devices = sorted({r // per_device for r in ranks})
        state = _core.current()
        lnc = state[0].lnc if state is not None else plat.logical_cores
        if lnc != 2:
            raise EmulatorError(f"{kind} on a NeuronSwitch (trn3) platform requires LNC=2, this one runs LNC={lnc}")
        if len(devices) < 2:
            raise EmulatorError(f"{kind} on a NeuronSwitch (trn3) platform needs more than one participating device; "
                                f"rank-list {ranks} lies on device {devices[0]} ({per_device} ranks per device)")
        whole = [r for d in devices for r in range(d * per_device, (d + 1) * per_device)]
        if ranks != whole:
            raise EmulatorError(f"{kind} on a NeuronSwitch (trn3) platform: rank-list {ranks} must be consecutive ranks "
                                f"holding every rank of each device it touches ({whole}); keep an unused rank in the "
                                f"list with send count 0")
        return
    # Elsewhere (Trn2): 2.33, "has_rdispls=True is currently only supported on inter-node replica groups";
    # 2.30 - 2.32, "all_to_all_v currently supports only inter-node replica groups" (any has_rdispls). The 2.32
    # stub also says of has_rdispls=True: "Currently only supported on NeuronSwitch-based instances (trn3
    # today)", which its 2.30 / 2.31 stubs do not say: on 2.32 no Trn2 rank-list may use it.
    if has_rdispls and plat.sdk_release == (2, 32):
        raise EmulatorError(f"{kind}(has_rdispls=True) on trn2 with SDK 2.32: \"Currently only supported on "
                            f"NeuronSwitch-based instances (trn3 today)\" (nki.collectives.all_to_all_v, 2.32). "
                            f"Use has_rdispls=False on an inter-node rank-list, or SDK 2.33")
    if has_rdispls or plat.sdk_release < (2, 33):
        nodes = [r // plat.ranks_per_node for r in ranks]
        local = {r % plat.ranks_per_node for r in ranks}
        if len(set(nodes)) != len(nodes) or len(local) != 1:
            what = f"{kind}(has_rdispls=True)" if plat.sdk_release >= (2, 33) else f"{kind} on SDK {plat.sdk}"
            hint = ("Use has_rdispls=False (receive slots of dst.size / group size)" if plat.sdk_release >= (2, 33)
                    else "SDK 2.33 lifts this for has_rdispls=False")
            raise EmulatorError(f"{what} on trn2 needs an inter-node rank-list (same-indexed ranks of different "
                                f"instances, {plat.ranks_per_node} ranks per instance); {ranks} is not one. {hint}")


def all_to_all_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                 priority=None, name=None):
    listed = (lambda x: list(x) if isinstance(x, (list, tuple)) else [])
    return _on_the_rank("ncc.all_to_all_v", _all_to_all_v,
                        (srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls, priority, name),
                        inputs=listed(srcs) + [metadata_tensor],
                        outputs=listed(dsts) + ([] if recv_counts_known else [metadata_tensor]))


def _all_to_all_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls, priority, name):
    """Variable all-to-all over flat element buffers.

    metadata_tensor: uint32 HBM [rows, group size]; row 0 send counts, row 1 send displacements,
    row 2 receive counts, row 3 receive displacements (read when has_rdispls, else receive slot j
    starts at j * dst.size / group size), all in elements. Row 2 is never read: with
    recv_counts_known=True it is left untouched, otherwise the runtime writes what arrived there
    (all_to_all_v, 2.33: metadata rows). Sender j's elements src_j[sdispl_j[me] : + scount_j[me]]
    land at dst[rdispl[j] : + count]. The platform's generation restrictions apply (_check_generation).
    """
    kind = "all_to_all_v"
    _core.count_instruction()
    src, dst = _hbm_list(srcs, "srcs", kind), _hbm_list(dsts, "dsts", kind)
    meta = metadata_tensor
    if not isinstance(meta, Tensor) or meta.buffer not in _core.HBM_BUFFERS or not meta._whole:
        raise EmulatorError(f"{kind}: metadata_tensor must be a whole HBM tensor, got {meta!r}")
    if meta._dtype != np.dtype(np.uint32) or meta.ndim != 2:
        raise EmulatorError(f"{kind}: metadata_tensor must be 2-d uint32, got {meta.shape} {meta._dtype}")
    if src._dtype != dst._dtype:
        raise EmulatorError(f"{kind}: src is {src._dtype} but dst is {dst._dtype}")
    need_rows = 4 if has_rdispls else 3
    if meta.shape[0] < need_rows:
        raise EmulatorError(f"{kind}: metadata_tensor needs {need_rows} rows (has_rdispls={has_rdispls}), got {meta.shape}")
    values = meta._array.astype(np.int64)
    read_rows = [0, 1] + ([3] if has_rdispls else [])
    if (values[read_rows] == _core.INT_POISON[4]).any():
        raise EmulatorError(f"{kind}: metadata_tensor holds never-written entries")
    ranks, me, posts = _exchange(kind, replica_group, (src._array.reshape(-1).copy(), values[0].copy(), values[1].copy()))
    size = len(ranks)
    if meta.shape[1] != size:
        raise EmulatorError(f"{kind}: metadata_tensor has {meta.shape[1]} columns for a rank-list of {size} ranks")
    _check_generation(kind, ranks, has_rdispls)

    # What each peer sends this rank, checked against the peer's source buffer.
    arriving = []
    for j, r in enumerate(ranks):
        flat, counts, displs = posts[r]
        count, displ = int(counts[me]), int(displs[me])
        if displ + count > flat.size:
            raise EmulatorError(f"{kind}: rank {r} sends elements [{displ}, {displ + count}) to rank {ranks[me]}, "
                                f"past the end of its {flat.size}-element source")
        arriving.append(flat[displ:displ + count])
    counts = np.array([a.size for a in arriving], dtype=np.int64)
    if has_rdispls:
        starts = values[3]
        limits = np.full(size, dst._array.size, dtype=np.int64)
    else:
        slot = dst._array.size // size
        starts = np.arange(size, dtype=np.int64) * slot
        limits = starts + slot
    out = dst._array.reshape(-1)
    for j in range(size):
        start, end = int(starts[j]), int(starts[j]) + int(counts[j])
        if end > limits[j]:
            raise EmulatorError(f"{kind}: receive capacity exceeded on rank {ranks[me]}: {counts[j]} elements from rank "
                                f"{ranks[j]} at {start} overflow the {dst._array.size}-element destination"
                                f"{'' if has_rdispls else f' slot [{start}, {int(limits[j])})'}")
    order = np.argsort(starts, kind="stable")
    for a, b in zip(order[:-1], order[1:]):
        if counts[a] and counts[b] and starts[a] + counts[a] > starts[b]:
            raise EmulatorError(f"{kind}: receive intervals from ranks {ranks[a]} and {ranks[b]} overlap on rank {ranks[me]}")
    for j in range(size):
        out[int(starts[j]):int(starts[j]) + int(counts[j])] = arriving[j]
    if not recv_counts_known:
        meta._array[2] = counts.astype(np.uint32)


def _on_the_rank(kind: str, op, args, inputs, outputs):
    """Run a collective for the calling rank. At LNC=2 both cores of the rank issue it with the same
    arguments and it runs once, when both have arrived (see _cores: its inputs and outputs carry no
    write of the current barrier epoch; no core reads its outputs before a core_barrier on them)."""
    if args[-2] is not None:
        raise EmulatorError(f"{kind}(priority=...) is not emulated")
    state = _core.current()
    if state is None or state[0].lnc == 1:
        return op(*args)
    launch, core = state
    tensors = [t for t in inputs + outputs if isinstance(t, Tensor)]

    def run_once():
        for t in inputs + outputs:
            if isinstance(t, Tensor):
                _cores.check_unwritten(t, kind)
        op(*args)
        for t in outputs:
            if isinstance(t, Tensor):
                _cores.note_collective_write(t)

    key = (tuple(id(t) for t in tensors), repr(args[2]), tuple(a for a in args[3:] if not isinstance(a, Tensor)))
    launch.sync(core, kind, key=key, action=run_once)


# ---------------------------------------------------------------------------------------------
def run_ranks(fn: Callable, rank_args: Sequence[Sequence[Any]], rank_kwargs: Sequence[dict] | None = None,
              platform: Platform | None = None) -> list:
    """Run fn(*rank_args[r], **rank_kwargs[r]) on ranks 0 .. len(rank_args)-1, one thread per rank,
    on `platform` (default: the current one, Trainium2 unless set), and return their results in
    rank order. If any rank raises, the others are released from their barriers and the first
    rank's own error is raised (with a note naming the rank)."""
    if platform is not None:
        _core.push_platform(platform)
        try:
            return run_ranks(fn, rank_args, rank_kwargs)
        finally:
            _core.pop_platform()
    size = len(rank_args)
    if size < 1:
        raise EmulatorError("run_ranks needs at least one rank")
    rank_kwargs = list(rank_kwargs) if rank_kwargs is not None else [{} for _ in range(size)]
    if len(rank_kwargs) != size:
        raise EmulatorError("rank_args and rank_kwargs must have one entry per rank")
    world = _World(size, threading.Barrier(size))

    def body(rank: int):
        _local.world, _local.rank = world, rank
        try:
            return fn(*rank_args[rank], **rank_kwargs[rank])
        finally:
            _local.world = None

    return _core.run_threads(size, "nki-rank", body, release=world.barrier.abort,
                             where=lambda rank: f"raised on rank {rank} of {size}")
