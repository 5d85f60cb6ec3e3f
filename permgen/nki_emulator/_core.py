"""Tensors, memories and the checks every instruction shares.

A tensor is a NumPy view plus the memory it lives in. SBUF and PSUM tensors are tiles: axis 0 is
the partition axis (at most 128 partitions) and every other axis is free. Fresh tensors are
filled with NaN (floats) or a poison word (integers) so a read of anything never written shows up
in the results instead of passing silently as zero.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import ml_dtypes
import numpy as np


class EmulatorError(RuntimeError):
    """A kernel did something the NeuronCore would reject or that would read/write out of bounds."""


# ---------------------------------------------------------------------------------------------
# Hardware constants (Trainium2 NeuronCore).
PMAX = 128  # partitions of SBUF and PSUM
SBUF_PARTITION_BYTES = 192 * 1024  # 24 MiB SBUF / 128 partitions
PSUM_PARTITION_BYTES = 16 * 1024  # 2 MiB PSUM / 128 partitions: 8 banks of 2 KiB
PSUM_BANK_BYTES = 2 * 1024
GEMM_STATIONARY_FMAX = 128
GEMM_MOVING_FMAX = 512

INT_POISON = {1: 0xA5, 2: 0xA5A5, 4: 0x5A5AA5A5}  # unsigned bit patterns by item size


# ---------------------------------------------------------------------------------------------
# The machine a kernel runs on: rules that differ between Trainium generations read it.
@dataclass(frozen=True)
class Platform:
    """A Trainium generation and the rank layout of the collectives' world.

    generation: "trn2" (NeuronCore-v3, no NeuronSwitch fabric) or "trn3" (NeuronCore-v4, NeuronSwitch).
    lnc: logical NeuronCore degree; a rank is one logical core.
    ranks_per_device: logical cores per device (4 at LNC=2 on both generations: the all_to_all_v page
    says "4 under LNC=2" for Trn3; a Trn2 device has 8 physical cores).
    ranks_per_node: ranks of one EC2 instance (trn2.48xlarge: 16 devices x 4 at LNC=2). Tests shrink it
    to model several instances with few threads.
    """
    generation: str = "trn2"
    lnc: int = 2
    ranks_per_device: int = 4
    ranks_per_node: int = 64

    def __post_init__(self):
        if self.generation not in ("trn2", "trn3"):
            raise EmulatorError(f"Platform generation must be 'trn2' or 'trn3', got {self.generation!r}")
        if self.lnc not in (1, 2) or self.ranks_per_device < 1 or self.ranks_per_node < 1:
            raise EmulatorError(f"bad platform layout {self}")

    @property
    def nc_version(self) -> int:
        """NeuronCore version: v3 on Trainium2, v4 on Trainium3."""
        return 3 if self.generation == "trn2" else 4


_platform = [Platform()]  # one machine per process (rank threads share it)


def platform() -> Platform:
    return _platform[-1]


def push_platform(p: Platform) -> None:
    if not isinstance(p, Platform):
        raise EmulatorError(f"expected an nki_emulator.Platform, got {type(p).__name__}")
    _platform.append(p)


def pop_platform() -> None:
    if len(_platform) > 1:
        _platform.pop()


# ---------------------------------------------------------------------------------------------
# Memories.
@dataclass(frozen=True)
class Buffer:
    name: str

    @property
    def on_chip(self) -> bool:
        return self.name in ("sbuf", "psum")

    def __repr__(self) -> str:
        return f"nl.{self.name}"


SBUF = Buffer("sbuf")
PSUM = Buffer("psum")
PRIVATE_HBM = Buffer("private_hbm")
SHARED_HBM = Buffer("shared_hbm")
HBM_BUFFERS = (PRIVATE_HBM, SHARED_HBM)


# ---------------------------------------------------------------------------------------------
# Data types: NumPy dtypes, with ml_dtypes for bfloat16 and the fp8 formats.
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2}
INT_DTYPES = {np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.bool_)}
MATMUL_DTYPES = FLOAT_DTYPES


def as_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in FLOAT_DTYPES and dt not in INT_DTYPES:
        raise EmulatorError(f"unsupported NKI dtype {dt}")
    return dt


def is_int(dtype) -> bool:
    return np.dtype(dtype) in INT_DTYPES


def poison(shape, dtype: np.dtype) -> np.ndarray:
    if dtype in FLOAT_DTYPES:
        return np.full(shape, np.nan, dtype=np.float32).astype(dtype)
    word = INT_POISON[dtype.itemsize]
    return np.full(shape, word, dtype=np.dtype(f"u{dtype.itemsize}")).view(dtype)


def cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """What an engine writes: float results rounded to nearest even, integers rounded then wrapped."""
    if dtype in FLOAT_DTYPES:
        return np.asarray(values).astype(np.float32).astype(dtype) if dtype.itemsize < 4 else np.asarray(values).astype(dtype)
    values = np.asarray(values)
    if values.dtype.kind == "f":
        if np.isnan(values).any():
            raise EmulatorError("converting NaN to an integer dtype: the tile read memory that was never written")
        values = np.rint(values)
    return values.astype(np.int64).astype(dtype)


# ---------------------------------------------------------------------------------------------
# On-chip memory accounting: live tiles per partition, released when the last view goes away.
class _Ledger:
    def __init__(self):
        self.live = {SBUF: 0, PSUM: 0}

    def allocate(self, array: np.ndarray, buffer: Buffer, per_partition: int) -> None:
        limit = SBUF_PARTITION_BYTES if buffer is SBUF else PSUM_PARTITION_BYTES
        if self.live[buffer] + per_partition > limit:
            raise EmulatorError(
                f"{buffer!r} exhausted: {self.live[buffer]} bytes per partition live, "
                f"{per_partition} more requested, {limit} available")
        self.live[buffer] += per_partition
        weakref.finalize(array, self._release, buffer, per_partition)

    def _release(self, buffer: Buffer, per_partition: int) -> None:
        self.live[buffer] -= per_partition


_local = threading.local()  # one ledger per thread: ranks of a multi-rank run are threads


def ledger() -> _Ledger:
    if not hasattr(_local, "ledger"):
        _local.ledger = _Ledger()
    return _local.ledger


def reset_ledger() -> None:
    _local.ledger = _Ledger()


# ---------------------------------------------------------------------------------------------
# Cost counters: what one kernel run issued. Instructions are counted as executed (a dynamic
# loop's body counts once per iteration); DMA bytes are the bytes a copy actually moved (lanes an
# indirect copy skips move nothing).
@dataclass
class Cost:
    kernel: str
    instructions: int = 0  # every nki.isa / nki.collectives call that is an instruction
    indirect_dmas: int = 0  # dma_copy calls with a vector_offset on one side
    dma_bytes: int = 0  # bytes moved by dma_copy
    dynamic_iterations: int = 0  # iterations of nl.dynamic_range loops (each ends in an all-engine barrier)


def begin_cost(kernel: str) -> Cost:
    _local.cost = Cost(kernel)
    return _local.cost


def current_cost() -> Cost:
    cost = getattr(_local, "cost", None)
    if cost is None:
        cost = _local.cost = Cost("(outside a kernel)")
    return cost


def count_instruction(indirect: bool = False, dma_bytes: int = 0) -> None:
    cost = current_cost()
    cost.instructions += 1
    cost.indirect_dmas += int(indirect)
    cost.dma_bytes += int(dma_bytes)


def recorders() -> list:
    """Lists that collect this thread's finished kernel runs (see nki_emulator.recording)."""
    if not hasattr(_local, "recorders"):
        _local.recorders = []
    return _local.recorders


# ---------------------------------------------------------------------------------------------
# Virtual registers: scalars held by the engine sequencers (nisa.register_alloc / register_load),
# used as dynamic loop bounds (nl.dynamic_range) and dynamic offsets (.ap(scalar_offset=...)).
class VirtualRegister:
    """A register's value exists only on the device: it bounds dynamic loops and offsets access
    patterns, but a kernel cannot use it as a Python int (nki-dynamic-loops: "You cannot use it in
    host-side Python expressions")."""

    def __init__(self, value=None):
        self._value = None if value is None else int(value)

    def value(self, what: str) -> int:
        if self._value is None:
            raise EmulatorError(f"{what} reads a register that was never written")
        return self._value

    def _host_use(self, *_):
        raise EmulatorError("a VirtualRegister holds a device value: it cannot be used in host-side Python "
                            "expressions (ints, slices, comparisons, arithmetic); use it as a dynamic_range bound "
                            "or an access pattern's scalar_offset")

    __index__ = __int__ = __float__ = _host_use
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _host_use
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __floordiv__ = __mod__ = _host_use
    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        # `while reg:` is a documented device loop: it runs while the register is non-zero.
        return self.value("while <register>") != 0

    def __repr__(self) -> str:
        return "VirtualRegister(...)"


# ---------------------------------------------------------------------------------------------
class Tensor:
    """A tensor in one memory. Indexing with ints and slices gives views, as NKI tile slicing does."""

    def __init__(self, array: np.ndarray, buffer: Buffer, name: str = "", whole: bool = True):
        self.array = array
        self.buffer = buffer
        self.name = name
        self.whole = whole  # not a slice of a larger tensor: .ap() addresses its storage

    @property
    def shape(self) -> tuple:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def ndim(self) -> int:
        return self.array.ndim

    @property
    def itemsize(self) -> int:
        return self.array.dtype.itemsize

    def __repr__(self) -> str:
        return f"Tensor({self.name or '?'}, {self.shape}, {self.dtype}, {self.buffer!r})"

    def __getitem__(self, key) -> "Tensor":
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > self.ndim:
            raise EmulatorError(f"{len(key)} indices for a {self.ndim}-d tensor {self!r}")
        for axis, k in enumerate(key):
            size = self.shape[axis]
            if isinstance(k, slice):
                if k.step not in (None, 1):
                    raise EmulatorError("strided slices are not emulated; use .ap()")
                start, stop = 0 if k.start is None else k.start, size if k.stop is None else k.stop
                if not (0 <= start <= stop <= size):
                    raise EmulatorError(f"slice {start}:{stop} out of bounds for axis {axis} of size {size} in {self!r}")
            elif isinstance(k, (int, np.integer)):
                if not 0 <= k < size:
                    raise EmulatorError(f"index {k} out of bounds for axis {axis} of size {size} in {self!r}")
            else:
                raise EmulatorError(f"unsupported index {k!r}: use ints and slices, or .ap() for dynamic access")
        if self.buffer.on_chip and isinstance(key[0], (int, np.integer)):
            raise EmulatorError("a tile keeps its partition axis: index it with a slice, e.g. t[0:1, ...]")
        return Tensor(self.array[key], self.buffer, self.name, whole=False)

    def view(self, dtype) -> "Tensor":
        """The same bytes as another dtype (nki.language tensor .view): the last axis scales by the ratio
        of the item sizes. Used to zero fp8 tiles through an integer view."""
        dtype = as_dtype(dtype)
        old = self.dtype.itemsize
        if (self.shape[-1] * old) % dtype.itemsize:
            raise EmulatorError(f"view as {dtype}: the last axis of {self.shape} ({old}-byte items) does not split "
                                f"into {dtype.itemsize}-byte items")
        if not self.array.flags.c_contiguous and self.array.strides[-1] != old:
            raise EmulatorError("view needs a tensor whose last axis is contiguous")
        return Tensor(self.array.view(dtype), self.buffer, self.name, whole=self.whole)

    def ap(self, pattern, offset=0, vector_offset=None, indirect_dim=0, scalar_offset=None, dtype=None):
        if not self.whole:
            # NkiTensor (2.33) documents .ap() on any view as "a low-level access pattern override" of a
            # view sharing the tensor's storage, but not where the override's offset counts from; so
            # this is not emulated (it is not a hardware rule).
            raise EmulatorError(".ap() on a slice or view is not emulated; call it on the whole tensor")
        if dtype is not None:
            raise EmulatorError("only pattern/offset/scalar_offset/vector_offset/indirect_dim access patterns are emulated")
        if scalar_offset is not None and vector_offset is not None:
            raise EmulatorError("at most one of scalar_offset and vector_offset can be specified")
        if scalar_offset is not None and not isinstance(scalar_offset, VirtualRegister):
            raise EmulatorError(f"scalar_offset is emulated as a VirtualRegister, got {type(scalar_offset).__name__}")
        return AccessPattern(self, [list(map(int, p)) for p in pattern], int(offset), vector_offset, int(indirect_dim),
                             scalar_offset)


class AccessPattern:
    """tensor.ap(pattern=[[step, count], ...], offset, vector_offset=idx | scalar_offset=reg, indirect_dim=d).

    Element (i0, i1, ...) lives at flat storage address offset + sum_d i_d * step_d; with a
    vector offset, dimension d's index i_d is replaced by idx[i_d, 0] and moves by the base tensor's
    stride along its dimension d (the hardware takes the row stride from the tensor, not from the
    pattern's step: a probe of `.ap([[4, 2], [1, 4]], vector_offset=[1, 2])` on an [R, 8] tensor reads
    elements 8 and 16, not 4 and 8); a lane whose index lies outside the tensor's extent along
    that dimension is out of bounds. A scalar
    offset (a register) starts dimension d's access that many elements of d further on: the
    address grows by value * step_d; the whole access must stay inside the tensor.
    """

    def __init__(self, tensor: Tensor, pattern, offset, vector_offset, indirect_dim, scalar_offset=None):
        if not pattern or any(len(p) != 2 or p[1] < 0 for p in pattern):
            raise EmulatorError(f"access pattern must be a list of [step, count] pairs, got {pattern}")
        self.tensor, self.pattern, self.offset = tensor, pattern, offset
        self.vector_offset, self.indirect_dim = vector_offset, indirect_dim
        self.scalar_offset = scalar_offset
        if scalar_offset is not None and not 0 <= indirect_dim < len(pattern):
            raise EmulatorError(f"indirect_dim {indirect_dim} outside the {len(pattern)}-d pattern")
        if vector_offset is not None:
            # The DGE gathers/scatters rows of an HBM tensor with indices from SBUF: the indexed tensor
            # must be in HBM (nki.isa.dma_copy, 2.33: "gather or scatter ... using a list of dynamic
            # indices from SBUF"; NKI access patterns deep dive, nki/deep-dives/nki-aps.rst).
            if tensor.buffer not in HBM_BUFFERS:
                raise EmulatorError(f"vector_offset indexes HBM tensors only; {tensor!r} is in {tensor.buffer!r}")
            if indirect_dim >= tensor.ndim:
                raise EmulatorError(f"indirect_dim {indirect_dim} is not a dimension of the {tensor.ndim}-d {tensor!r}")
            if not isinstance(vector_offset, Tensor) or vector_offset.buffer is not SBUF:
                raise EmulatorError("vector_offset must be an SBUF tile")
            if vector_offset.dtype not in (np.dtype(np.int32), np.dtype(np.uint32)):
                raise EmulatorError(f"vector_offset must be int32/uint32, got {vector_offset.dtype}")
            if not 0 <= indirect_dim < len(pattern):
                raise EmulatorError(f"indirect_dim {indirect_dim} outside the {len(pattern)}-d pattern")
            lanes = pattern[indirect_dim][1]
            if vector_offset.shape != (lanes, 1):
                raise EmulatorError(f"vector_offset must have shape ({lanes}, 1) to index dimension "
                                    f"{indirect_dim} of {pattern}, got {vector_offset.shape}")

    @property
    def shape(self) -> tuple:
        return tuple(count for _, count in self.pattern)

    @property
    def dtype(self) -> np.dtype:
        return self.tensor.dtype

    @property
    def buffer(self) -> Buffer:
        return self.tensor.buffer

    def resolve(self):
        """(flat storage, addresses[shape], lanes in bounds along the indirect dim or None)."""
        storage = self.tensor.array.reshape(-1)
        start = self.offset
        if self.scalar_offset is not None:
            start += self.scalar_offset.value("scalar_offset") * self.pattern[self.indirect_dim][0]
        addresses = np.full(self.shape, start, dtype=np.int64)
        valid = None
        for d, (step, count) in enumerate(self.pattern):
            index = np.arange(count, dtype=np.int64)
            if self.vector_offset is not None and d == self.indirect_dim:
                index = self.vector_offset.array[:, 0].astype(np.int64)
                if self.vector_offset.dtype == np.dtype(np.int32) and (index == _as_signed(INT_POISON[4])).any():
                    raise EmulatorError("vector_offset holds never-written entries")
                step = self.tensor.array.strides[d] // self.tensor.dtype.itemsize
                extent = self.tensor.shape[d]
                valid = (index >= 0) & (index < extent)
                index = np.where(valid, index, 0)
            shape = [1] * len(self.pattern)
            shape[d] = count
            addresses = addresses + (index * step).reshape(shape)
        inside = (addresses >= 0) & (addresses < storage.size)
        if valid is not None:
            lane_shape = [1] * len(self.pattern)
            lane_shape[self.indirect_dim] = -1
            inside = inside | ~valid.reshape(lane_shape)
        if addresses.size and not inside.all():
            raise EmulatorError(f"access pattern {self.pattern} + {self.offset} leaves {self.tensor!r}")
        return storage, addresses, valid


def _as_signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def new_tensor(shape, dtype, buffer: Buffer, name: str = "") -> Tensor:
    shape = tuple(int(s) for s in shape)
    dtype = as_dtype(dtype)
    if any(s <= 0 for s in shape):
        raise EmulatorError(f"tensor {name or ''} shape {shape}: every dimension must be positive")
    if buffer.on_chip:
        if len(shape) < 2:
            raise EmulatorError(f"{buffer!r} tiles need a partition axis and a free axis, got shape {shape}")
        if shape[0] > PMAX:
            raise EmulatorError(f"{buffer!r} tile partition dimension {shape[0]} exceeds {PMAX}")
        per_partition = math.prod(shape[1:]) * dtype.itemsize
        if buffer is PSUM and per_partition > PSUM_BANK_BYTES:
            raise EmulatorError(f"PSUM tile of {per_partition} bytes per partition exceeds one {PSUM_BANK_BYTES}-byte bank")
        array = poison(shape, dtype)
        ledger().allocate(array, buffer, per_partition)
    else:
        array = poison(shape, dtype)
    return Tensor(array, buffer, name)
