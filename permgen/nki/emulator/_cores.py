"""Logical NeuronCores: a kernel launched at LNC=2 runs as two cores that share HBM.

`kernel[lnc](...)` (nki.jit; "Using Logical Neuron Cores (LNC)", nki/get-started/about/lnc.rst, SDK
2.32) runs the kernel's program once per physical core. Each core has its own SBUF, PSUM and
private HBM ("Only visible to each individual kernel instance in the SPMD grid", nki.language);
kernel arguments and `nl.shared_hbm` tensors ("Visible to all kernel instances") are shared: the
k-th shared_hbm allocation of every core is one tensor. A core learns its id from `nl.program_id(0)` (0 or 1) and
the core count from `nl.num_programs()`.

The cores take turns, deterministically: core 0 runs until it reaches a synchronisation point
(`nisa.core_barrier`, a collective, or the end of the kernel), then core 1 runs to the same point,
and so on. Every core must reach the same points in the same order (lnc.rst: the program on each
core must be "the same"). Because the hardware runs the cores at the same time, shared HBM bytes
carry marks for the current barrier epoch, and these accesses are races (errors):

- a core reads bytes another core wrote, and the reader did not write them too;
- a core overwrites, with different bytes, what another core wrote or read.

`nisa.core_barrier(data, cores=(0, 1))` clears the marks of `data` only: the page says the barrier
synchronises on "the shared data that all cores need to synchronize on" and blocks one engine
only, so it orders nothing else.

Collectives at LNC=2: a collective belongs to the logical core (one rank), so both cores issue it
with the same arguments and it runs once when both have arrived. No page says on which core's
queue it runs, nor whether its results are visible to both cores when they continue; so its
inputs and outputs must carry no writes of the current epoch, and its outputs are marked as
written by neither core: a core reads them only after a core_barrier on them ("not documented"
otherwise).
"""

from __future__ import annotations

import threading

import numpy as np

from . import _core
from ._core import EmulatorError, PeerFailed, current

COLLECTIVE = 7  # the mark bit of bytes a collective wrote (cores use bits 0 .. 6)


class Launch:
    """One kernel launch: its cores, the shared HBM allocations, and the turn-taking between cores."""

    def __init__(self, lnc: int, grid_ndim: int = 1):
        self.lnc = lnc
        self.grid_ndim = grid_ndim  # nl.program_ndim(): 0 for a launch without brackets
        self.cond = threading.Condition()
        self.turn = 0
        self.arrived: dict = {}  # core -> (kind, key, action) at the current synchronisation point
        self.epoch_points = 0  # synchronisation points passed
        self.shared: list = []  # shared_hbm allocations, in the order the cores make them
        self.marks: dict = {}  # id(root array) -> (root array, writers, readers): bit masks per byte
        self.failed = False

    # -- turn-taking ------------------------------------------------------------------------------
    def wait_turn(self, core: int) -> None:
        with self.cond:
            while self.turn != core and not self.failed:
                self.cond.wait()
            if self.failed:
                raise PeerFailed("the other core failed")

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def sync(self, core: int, kind: str, key=None, action=None, last: bool = False) -> None:
        """Wait at a synchronisation point until every core reached it; the last one to arrive runs
        `action` (a barrier's or a collective's effect), then core 0 continues first."""
        with self.cond:
            self.arrived[core] = (kind, key, action)
            point = self.epoch_points
            if len(self.arrived) < self.lnc:
                self.turn = next(c for c in range(self.lnc) if c not in self.arrived)
                self.cond.notify_all()
                while self.epoch_points == point and not self.failed:
                    self.cond.wait()
                if self.failed:
                    raise PeerFailed("the other core failed")
            else:
                kinds = {c: (k, kk) for c, (k, kk, _) in self.arrived.items()}
                if len({v for v in kinds.values()}) != 1:
                    self.failed = True
                    self.cond.notify_all()
                    seen = ", ".join(f"core {c} reached {k}" for c, (k, _) in sorted(kinds.items()))
                    raise EmulatorError(f"the cores diverged: {seen}. Every core must issue the same barriers and "
                                        f"collectives with the same arguments (lnc.rst: the program on each core "
                                        f"is \"the same\")")
                try:
                    if action is not None:
                        action()
                except BaseException:
                    self.failed = True
                    self.cond.notify_all()
                    raise
                self.arrived.clear()
                self.epoch_points += 1
                self.turn = 0
                self.cond.notify_all()
        if not last:
            self.wait_turn(core)

    # -- shared HBM -------------------------------------------------------------------------------
    def shared_allocation(self, core: int, index: int, shape, dtype, create):
        if index < len(self.shared):
            tensor = self.shared[index]
            if tensor.shape != tuple(shape) or tensor._dtype != dtype:
                raise EmulatorError(f"the cores diverged: core {core}'s shared_hbm allocation #{index} is {tuple(shape)} "
                                    f"{dtype}, another core's is {tensor.shape} {tensor._dtype}")
            return tensor
        tensor = create()
        self.shared.append(tensor)
        return tensor

    def _marks(self, root: np.ndarray):
        entry = self.marks.get(id(root))
        if entry is None:
            entry = self.marks[id(root)] = (root, np.zeros(root.nbytes, np.uint8), np.zeros(root.nbytes, np.uint8))
        return entry[1], entry[2]

    def read(self, who: int, root: np.ndarray, offsets: np.ndarray, what: str) -> None:
        writers, readers = self._marks(root)
        me = np.uint8(1 << who)
        marks = writers[offsets]
        # A byte another core wrote is a race unless this core wrote the same byte too (identical bytes,
        # or the write check would have failed); a byte a collective wrote is not known to be visible.
        unsafe = (((marks & ~me) != 0) & ((marks & me) == 0)) | ((marks & (1 << COLLECTIVE)) != 0)
        if unsafe.any():
            byte = int(offsets[np.flatnonzero(unsafe)[0]])
            if writers[byte] & (1 << COLLECTIVE):
                raise EmulatorError(f"{what} reads bytes a collective wrote before any nisa.core_barrier on them: not "
                                    f"documented whether a collective's results are visible to both cores when they "
                                    f"continue; call nisa.core_barrier(data=<the collective's output>, cores=(0, 1)) first")
            raise EmulatorError(f"race between cores: {what} on core {who} reads shared HBM bytes (byte {byte}) that "
                                f"another core wrote with no nisa.core_barrier on them in between")
        readers[offsets] |= me

    def write(self, who: int, root: np.ndarray, offsets: np.ndarray, new_bytes: np.ndarray, what: str) -> None:
        writers, readers = self._marks(root)
        me = np.uint8(1 << who)
        others = ((writers[offsets] | readers[offsets]) & ~me) != 0
        if others.any():
            current = root.reshape(-1).view(np.uint8)[offsets]
            changed = others & (current != new_bytes)
            if changed.any():
                byte = int(offsets[np.flatnonzero(changed)[0]])
                raise EmulatorError(f"race between cores: {what} on core {who} changes shared HBM bytes (byte {byte}) "
                                    f"another core wrote or read with no nisa.core_barrier on them in between")
        writers[offsets] |= me

    def publish(self, root: np.ndarray, offsets: np.ndarray) -> None:
        writers, readers = self._marks(root)
        writers[offsets] = 0
        readers[offsets] = 0


# ---------------------------------------------------------------------------------------------
# The calling thread's core.
def require(what: str) -> tuple[Launch, int]:
    state = current()
    if state is None:
        raise EmulatorError(f"{what} is called inside a kernel only")
    return state


def _first_bytes(tensor, elements=None, keep=None) -> np.ndarray:
    """The first byte, in the allocation, of each accessed element: the flat element indices `elements`
    of a whole tensor (an access pattern), or every element of the view (selected by the mask `keep`)."""
    array, root = tensor._array, tensor._root
    start = array.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    if elements is not None:
        return start + np.asarray(elements, dtype=np.int64).reshape(-1) * array.dtype.itemsize
    first = np.full(array.shape, start, dtype=np.int64)
    for d, (n, stride) in enumerate(zip(array.shape, array.strides)):
        shape = [1] * array.ndim
        shape[d] = n
        first = first + (np.arange(n, dtype=np.int64) * stride).reshape(shape)
    return first[keep] if keep is not None else first.reshape(-1)


def _bytes(tensor, elements=None, keep=None) -> np.ndarray:
    item = tensor._dtype.itemsize
    return (_first_bytes(tensor, elements, keep).reshape(-1, 1) + np.arange(item, dtype=np.int64)).reshape(-1)


def shared(tensor) -> bool:
    """True when accesses to tensor need the cross-core checks: an HBM tensor every core sees, at LNC > 1."""
    state = current()
    return state is not None and state[0].lnc > 1 and tensor.buffer is _core.SHARED_HBM


def note_read(tensor, what: str, elements=None, keep=None) -> None:
    if shared(tensor):
        launch, core = current()
        launch.read(core, tensor._root, _bytes(tensor, elements, keep), what)


def note_write(tensor, what: str, new_values, elements=None, keep=None) -> None:
    """Record a core's write of `new_values` (in the tensor's dtype, one per accessed element)."""
    if shared(tensor):
        launch, core = current()
        new_bytes = np.ascontiguousarray(np.asarray(new_values, dtype=tensor._dtype)).reshape(-1).view(np.uint8)
        launch.write(core, tensor._root, _bytes(tensor, elements, keep), new_bytes, what)


def note_collective_write(tensor) -> None:
    """A collective wrote tensor: no core may read it before a core_barrier on it (see the module doc)."""
    if shared(tensor):
        launch, _ = current()
        writers, _ = launch._marks(tensor._root)
        writers[_bytes(tensor)] = np.uint8(1 << COLLECTIVE)


def check_unwritten(tensor, what: str) -> None:
    """A collective's input or output at LNC > 1 carries no write of the current epoch (the other core's
    write could land after the collective read or wrote it)."""
    if shared(tensor):
        launch, _ = current()
        writers, _ = launch._marks(tensor._root)
        if writers[_bytes(tensor)].any():
            raise EmulatorError(f"{what} touches shared HBM written since the last nisa.core_barrier on it: not "
                                f"documented on which core's queue a collective runs at LNC=2, so publish its "
                                f"inputs and outputs with nisa.core_barrier(data=..., cores=(0, 1)) first")


def publish(tensor) -> None:
    """core_barrier on tensor: its bytes start a new epoch."""
    if shared(tensor):
        launch, _ = current()
        launch.publish(tensor._root, _bytes(tensor))
