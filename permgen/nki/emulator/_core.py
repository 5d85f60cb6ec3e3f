"""Tensors, memories and the checks every instruction shares.

A tensor is a NumPy view plus the memory it lives in. SBUF and PSUM tensors are tiles: axis 0 is
the partition axis (at most 128 partitions) and every other axis is free. Fresh tensors are
filled with NaN (floats) or a poison word (integers) so a read of anything never written shows up
in the results instead of passing silently as zero.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from dataclasses import dataclass

import ml_dtypes
import numpy as np


class EmulatorError(RuntimeError):
    """A kernel did something the NeuronCore would reject or that would read/write out of bounds."""


class PeerFailed(EmulatorError):
    """Raised in a core or rank released from its wait because another one failed: not the error to report."""


# ---------------------------------------------------------------------------------------------
# Hardware constants of the NeuronCore (those that differ by version: Platform).
PMAX = 128  # partitions of SBUF and PSUM
# SBUF per partition, by NeuronCore version: "NeuronCore-v3 SBUF capacity is 28MiB (or, 128 partitions
# of 224KiB)" (nki/guides/architecture/trainium2_arch.rst, SDK 2.32); "The NeuronCore-v4 SBUF capacity is
# 32 MiB" (trainium3_arch.rst), 256 KiB per partition.
SBUF_PARTITION_BYTES = {3: 224 * 1024, 4: 256 * 1024}
PSUM_PARTITION_BYTES = 16 * 1024  # "PSUM capacity remains the same at 2MiB": 8 banks of 2 KiB per partition
PSUM_BANK_BYTES = 2 * 1024
# "For tiles in PSUM, the F dimension size must not exceed nki.language.tile_size.psum_bank_fmax == 512"
# (nki/get-started/about/tiling-overview.rst, Tile-Size Constraint#2).
PSUM_BANK_FMAX = 512
GEMM_STATIONARY_FMAX = 128
# nc_matmul's moving free size (nki.isa.nc_matmul, 2.32, "Tile size"): "On NeuronCore-v2 and -v3 ... must
# not exceed 512 ... Starting NeuronCore-v4, ... can go up to 4096 for float32 dst or 8192 for bfloat16
# dst, matching the size of 8x PSUM banks (the entire PSUM)".
GEMM_MOVING_FMAX = 512
GEMM_MOVING_FMAX_V4 = {"float32": 4096, "bfloat16": 8192}

INT_POISON = {1: 0xA5, 2: 0xA5A5, 4: 0x5A5AA5A5}  # unsigned bit patterns by item size


# ---------------------------------------------------------------------------------------------
# The machine a kernel runs on: rules that differ between Trainium generations read it.
@dataclass(frozen=True)
class Platform:
    """A Trainium generation and the rank layout of the collectives' world.

    generation: "trn2" (NeuronCore-v3, no NeuronSwitch fabric) or "trn3" (NeuronCore-v4, NeuronSwitch).
    lnc: the logical NeuronCore degree the runtime is configured with, i.e. what
    NEURON_LOGICAL_NC_CONFIG declares; None (default) reads that variable, unset meaning 2 (the
    Logical NeuronCore configuration page: "LNC=2 (default)" on Trn2; the emulator assumes the same of
    Trn3, "similar to Trainium2"). `nki_emulator.on(Platform(lnc=1))` sets the variable for its block,
    so host code that reads it agrees. A kernel launched with another LNC fails (nki.jit).
    ranks_per_device: logical cores per device (4 at LNC=2 on both generations: the all_to_all_v page
    says "4 under LNC=2" for Trn3; a Trn2 device has 8 physical cores).
    ranks_per_node: ranks of one EC2 instance (trn2.48xlarge: 16 devices x 4 at LNC=2). Tests shrink it
    to model several instances with few threads.
    sdk: the Neuron SDK release ("2.33"), for rules whose pages changed between releases (all_to_all_v's
    restrictions on Trn2; tensor_tensor's exact int32 arithmetic from 2.29).
    """
    generation: str = "trn2"
    lnc: int | None = None
    ranks_per_device: int = 4
    ranks_per_node: int = 64
    sdk: str = "2.33"

    def __post_init__(self):
        if self.generation not in ("trn2", "trn3"):
            raise EmulatorError(f"Platform generation must be 'trn2' or 'trn3', got {self.generation!r}")
        if self.lnc is not None:
            _check_lnc(self.lnc, "Platform lnc")
        if self.ranks_per_device < 1 or self.ranks_per_node < 1:
            raise EmulatorError(f"bad platform layout {self}")
        if not (isinstance(self.sdk, str) and self.sdk.count(".") == 1 and all(p.isdigit() for p in self.sdk.split("."))):
            raise EmulatorError(f"Platform sdk must be a Neuron SDK release like '2.33', got {self.sdk!r}")

    @property
    def sdk_release(self) -> tuple:
        """The SDK release as (major, minor), e.g. (2, 33)."""
        return tuple(int(p) for p in self.sdk.split("."))

    @property
    def nc_version(self) -> int:
        """NeuronCore version: v3 on Trainium2, v4 on Trainium3."""
        return 3 if self.generation == "trn2" else 4

    @property
    def logical_cores(self) -> int:
        """The LNC the environment declares: `lnc`, else NEURON_LOGICAL_NC_CONFIG, else 2."""
        if self.lnc is not None:
            return self.lnc
        declared = os.environ.get(LNC_VARIABLE, "").strip()
        if not declared:
            return 2
        try:
            value = int(declared)
        except ValueError:
            raise EmulatorError(f"{LNC_VARIABLE}={declared!r}: LNC can only be set to 1 or 2") from None
        return _check_lnc(value, LNC_VARIABLE)


LNC_VARIABLE = "NEURON_LOGICAL_NC_CONFIG"


def _check_lnc(value, what: str) -> int:
    # Logical NeuronCore configuration page: "LNC can only be set to 1 or 2".
    if isinstance(value, bool) or not isinstance(value, int) or value not in (1, 2):
        raise EmulatorError(f"{what} is {value!r}: LNC can only be set to 1 or 2")
    return value


_platform = [Platform()]  # one machine per process (rank threads share it)
_saved_lnc_variable: list = []  # NEURON_LOGICAL_NC_CONFIG as it was before each pushed platform


def platform() -> Platform:
    return _platform[-1]


def push_platform(p: Platform) -> None:
    """Make p the machine; a p with an explicit lnc declares it in NEURON_LOGICAL_NC_CONFIG too."""
    if not isinstance(p, Platform):
        raise EmulatorError(f"expected an nki_emulator.Platform, got {type(p).__name__}")
    _platform.append(p)
    _saved_lnc_variable.append(os.environ.get(LNC_VARIABLE))
    if p.lnc is not None:
        os.environ[LNC_VARIABLE] = str(p.lnc)


def pop_platform() -> None:
    if len(_platform) > 1:
        _platform.pop()
        saved = _saved_lnc_variable.pop()
        if saved is None:
            os.environ.pop(LNC_VARIABLE, None)
        else:
            os.environ[LNC_VARIABLE] = saved


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


def dtype_name(dtype: np.dtype) -> str:
    """The NKI name of a dtype: nl.float32 is "float32" (the nki.language stub: `DType = str`)."""
    return "bool_" if dtype == np.dtype(np.bool_) else str(dtype)


def as_dtype(dtype) -> np.dtype:
    """The NumPy dtype behind an NKI dtype (a name such as "bfloat16", or a NumPy dtype)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise EmulatorError(f"unsupported NKI dtype {dtype!r}") from None
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
        limit = SBUF_PARTITION_BYTES[platform().nc_version] if buffer is SBUF else PSUM_PARTITION_BYTES
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
    dynamic_iterations: int = 0  # iterations of device loops (nl.fori_loop, nl.while_loop; nl.dynamic_range to 2.32)


def begin_cost(kernel: str) -> Cost:
    _local.cost = Cost(kernel)
    return _local.cost


def set_cost(cost: Cost) -> None:
    """Count this thread's instructions into `cost` (the cores of one launch share one)."""
    _local.cost = cost


def current_cost() -> Cost:
    cost = getattr(_local, "cost", None)
    if cost is None:
        cost = _local.cost = Cost("(outside a kernel)")
    return cost


def count_instruction(indirect: bool = False, dma_bytes: int = 0) -> None:
    _local.issued = issued_here() + 1
    cost = current_cost()
    cost.instructions += 1
    cost.indirect_dmas += int(indirect)
    cost.dma_bytes += int(dma_bytes)


def issued_here() -> int:
    """Instructions this thread (one core of one rank) has issued: a compiled loop compares its iterations by it."""
    return getattr(_local, "issued", 0)


def recorders() -> list:
    """Lists that collect this thread's finished kernel runs (see nki_emulator.recording)."""
    if not hasattr(_local, "recorders"):
        _local.recorders = []
    return _local.recorders


# ---------------------------------------------------------------------------------------------
# Virtual registers: scalars held by the engine sequencers (nisa.register_alloc / register_load),
# used as device loop bounds (nl.fori_loop, nl.while_loop) and dynamic offsets (.ap(scalar_offset=...)).
class VirtualRegister:
    """A register's value exists only on the device: it bounds dynamic loops and offsets access
    patterns, but a kernel cannot use it as a Python int (nki-dynamic-loops: "You cannot use it in
    host-side Python expressions")."""

    def __init__(self, value=None):
        self._value = None if value is None else int(value)

    def _read(self, what: str) -> int:
        if self._value is None:
            raise EmulatorError(f"{what} reads a register that was never written")
        return self._value

    def _host_use(self, *_):
        raise EmulatorError("a VirtualRegister holds a device value: it cannot be used in host-side Python "
                            "expressions (ints, slices, comparisons, arithmetic); use it as a fori_loop bound "
                            "or an access pattern's scalar_offset")

    __index__ = __int__ = __float__ = _host_use
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _host_use
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __floordiv__ = __mod__ = _host_use
    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        # `while reg:` is a device loop up to NKI 0.6 (deprecated there); NKI 0.7 removed it.
        if platform().sdk_release >= (2, 33):
            raise EmulatorError("`while <register>:` was removed in NKI 0.7 (Neuron SDK 2.33): \"Kernels that use "
                                "nl.dynamic_range or while loops with a virtual register must move to "
                                "nki.language.fori_loop() and nki.language.while_loop()\" (Migrating from NKI 0.6.0 "
                                "to NKI 0.7.0)")
        return self._read("while <register>") != 0

    def __repr__(self) -> str:
        return "VirtualRegister(...)"


# ---------------------------------------------------------------------------------------------
class Tensor:
    """nki.language.NkiTensor: a tensor in one memory. Indexing with ints and slices gives views, as NKI
    tile slicing does.

    Its attributes are those NkiTensor documents (0.6 stub, aws-neuron-sdk nki/api/nki/language):
    `shape, strides, offset, name, dtype, buffer, ndim, size`; no `itemsize` (nki-library sizes a
    dtype from the dtype itself)."""

    def __init__(self, shape, dtype, storage, buffer=None, name: str = ""):
        # NkiTensor(shape, dtype, storage, buffer=sbuf, name=''): storage is the backend's handle, here
        # a NumPy array of that shape and dtype.
        if not isinstance(storage, np.ndarray) or storage.shape != tuple(shape) or storage.dtype != as_dtype(dtype):
            raise EmulatorError(f"NkiTensor storage must be a NumPy array of shape {tuple(shape)} and dtype {dtype}")
        self._init(storage, SBUF if buffer is None else buffer, name, True, storage)

    def _init(self, array, buffer, name, whole, root):
        if array.dtype == float8_e4m3fn and platform().nc_version < 4:
            # The compiler's NCC_EVRF051 ("Data type F8E4M3FN is not supported on TRN1/TRN2"): it "raises this
            # error for an F8E4M3FN operand targeting Trn1 or Trn2"; Trainium2's fp8 is float8_e4m3.
            raise EmulatorError(f"a float8_e4m3fn tensor on {platform().generation} (NeuronCore-v{platform().nc_version}): "
                                f"\"Data type F8E4M3FN is not supported on TRN1/TRN2\" (neuronx-cc error NCC_EVRF051); "
                                f"move its bytes as uint8, or use float8_e4m3")
        self._array = array
        self.buffer = buffer
        self.name = name
        self._whole = whole  # not a slice of a larger tensor: .ap() addresses its storage
        self._root = root  # the allocation's array (cross-core checks address its bytes)
        return self

    @classmethod
    def _wrap(cls, array: np.ndarray, buffer: "Buffer", name: str = "", whole: bool = True, root=None) -> "Tensor":
        return cls.__new__(cls)._init(array, buffer, name, whole, array if root is None else root)

    @property
    def shape(self) -> tuple:
        return self._array.shape

    @property
    def dtype(self) -> str:
        """The NKI dtype: its name, as NKI's are strings (`DType = str`)."""
        return dtype_name(self._array.dtype)

    @property
    def _dtype(self) -> np.dtype:
        return self._array.dtype

    @property
    def ndim(self) -> int:
        return self._array.ndim

    @property
    def size(self) -> int:
        """The number of elements."""
        return self._array.size

    @property
    def strides(self) -> tuple:
        """Per dimension, the elements of the storage one step along it moves."""
        return tuple(s // self._array.dtype.itemsize for s in self._array.strides)

    @property
    def offset(self) -> int:
        """Where the view starts in its storage, in elements."""
        start = self._array.__array_interface__["data"][0] - self._root.__array_interface__["data"][0]
        return start // self._array.dtype.itemsize

    def __repr__(self) -> str:
        return f"NkiTensor({self.name or '?'}, {self.shape}, {self.dtype}, {self.buffer!r})"

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
            elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                if not 0 <= k < size:
                    raise EmulatorError(f"index {k} out of bounds for axis {axis} of size {size} in {self!r}")
            else:
                raise EmulatorError(f"unsupported index {k!r}: use ints and slices, or .ap() for dynamic access")
        if self.buffer.on_chip and isinstance(key[0], (int, np.integer)):
            raise EmulatorError("a tile keeps its partition axis: index it with a slice, e.g. t[0:1, ...]")
        return Tensor._wrap(self._array[key], self.buffer, self.name, False, self._root)

    def view(self, dtype) -> "Tensor":
        """The same bytes as another dtype (NkiTensor.view): the last axis scales by the ratio of the item
        sizes; "the last dimension must be contiguous in memory". Used to zero fp8 tiles through an
        integer view."""
        dtype = as_dtype(dtype)
        old = self._dtype.itemsize
        if (self.shape[-1] * old) % dtype.itemsize:
            raise EmulatorError(f"view as {dtype}: the last axis of {self.shape} ({old}-byte items) does not split "
                                f"into {dtype.itemsize}-byte items")
        if not self._array.flags.c_contiguous and self._array.strides[-1] != old:
            raise EmulatorError("view needs a tensor whose last axis is contiguous")
        return Tensor._wrap(self._array.view(dtype), self.buffer, self.name, self._whole, self._root)

    reinterpret_cast = view  # the stub: `reinterpret_cast = ...`, documented beside view as the same operation

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """NkiTensor.ap: an explicit [[step, count], ...] pattern over the tensor's storage (see AccessPattern)."""
        if not self._whole:
            # NkiTensor.ap (0.6 stub) composes `offset` with a view's base storage offset; emulated on
            # whole tensors only (a refusal, not a hardware rule).
            raise EmulatorError(".ap() on a slice or view is not emulated; call it on the whole tensor")
        if dtype is not None:
            raise EmulatorError(".ap(dtype=...) is not emulated; use .view(dtype) on the whole tensor")
        if scalar_offset is not None and vector_offset is not None:
            raise EmulatorError("at most one of scalar_offset and vector_offset can be specified (nki-aps)")
        if isinstance(scalar_offset, Tensor):
            # nki-aps: a scalar offset is a register or an SBUF (1, 1) tensor. Its value is an integer element
            # offset; no page says how a float tensor's value would be taken, so an integer one is required.
            if (scalar_offset.buffer is not SBUF or scalar_offset.shape != (1, 1) or not is_int(scalar_offset._dtype)
                    or scalar_offset._dtype.itemsize > 4):
                raise EmulatorError(f"a tensor scalar_offset is an SBUF (1, 1) integer tensor of up to 32 bits (nki-aps), "
                                    f"got {scalar_offset!r}")
        elif scalar_offset is not None and not isinstance(scalar_offset, VirtualRegister):
            raise EmulatorError(f"scalar_offset is a VirtualRegister or an SBUF (1, 1) tensor (nki-aps), got "
                                f"{type(scalar_offset).__name__}")
        return AccessPattern(self, [list(map(int, p)) for p in pattern], 0 if offset is None else int(offset),
                             vector_offset, int(indirect_dim), scalar_offset)

    def get_pattern(self) -> list:
        """The view's [[stride, count], ...] pattern (NkiTensor.get_pattern)."""
        return [[stride, count] for stride, count in zip(self.strides, self.shape)]

    def is_contiguous(self) -> bool:
        """NkiTensor.is_contiguous: every non-size-1 dimension's stride is the product of the inner sizes;
        on SBUF/PSUM the partition dimension is skipped."""
        first = 1 if self.buffer.on_chip else 0
        inner = 1
        for d in range(self.ndim - 1, first - 1, -1):
            if self.shape[d] != 1 and self.strides[d] != inner:
                return False
            inner *= self.shape[d]
        return True

    def is_indirect(self) -> bool:
        return False  # the emulator's views never carry an indirect index (.ap() returns an AccessPattern)

    # Documented view methods the kernels do not use: refused, with their documented parameters.
    def _refuse(self, name):
        raise EmulatorError(f"NkiTensor.{name} is documented but not emulated; the emulator covers the subset "
                            f"permgen's kernels use (slices, .view, .ap)")

    def permute(self, dims):
        self._refuse("permute")

    def broadcast(self, dim, size):
        self._refuse("broadcast")

    def expand_dim(self, dim):
        self._refuse("expand_dim")

    def squeeze_dim(self, dim):
        self._refuse("squeeze_dim")

    def reshape_dim(self, dim, shape):
        self._refuse("reshape_dim")

    def flatten_dims(self, start_dim, end_dim):
        self._refuse("flatten_dims")

    def reshape(self, shape):
        self._refuse("reshape")

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None):
        self._refuse("rearrange")

    def slice(self, dim, start, end, step=1):
        self._refuse("slice")

    def select(self, dim, index):
        self._refuse("select")

    def vector_select(self, dim, vector_offset):
        self._refuse("vector_select")

    def indirect(self, index, num_elem=None):
        self._refuse("indirect")


class AccessPattern:
    """tensor.ap(pattern=[[step, count], ...], offset, scalar_offset=reg | vector_offset=idx, indirect_dim=d).

    Element (i0, i1, ...) lives at flat storage address offset + sum_k i_k * step_k ("NKI Access
    Patterns", nki/deep-dives/nki-aps.rst, SDK 2.32). `indirect_dim` names a dimension of the base
    tensor ("the dimension is relative to the base tensor, not relative to the pattern specified").

    - scalar_offset (a register): the access starts at
      `offset + scalar_offset * prod(A.shape[indirect_dim+1:])`, "read from the shape of the base
      tensor, not from the access pattern". The whole access must stay inside the tensor.
    - vector_offset (an int32/uint32 [lanes, 1] SBUF tile): "only indirect_dim=0 is supported";
      pattern dimension 0's index i_0 is replaced by idx[i_0, 0] and moves by the base tensor's row
      stride ("the stride specified in the leading dimension of the pattern ... is currently
      ignored"); the indexed tensor is in HBM. A lane whose index lies outside the tensor's rows is
      out of bounds (dma_copy's oob_mode decides).
    """

    def __init__(self, tensor: Tensor, pattern, offset, vector_offset, indirect_dim, scalar_offset=None):
        if not pattern or any(len(p) != 2 or p[1] < 0 for p in pattern):
            raise EmulatorError(f"access pattern must be a list of [step, count] pairs, got {pattern}")
        self._tensor, self._pattern, self.offset = tensor, pattern, offset
        self._vector_offset, self._indirect_dim = vector_offset, indirect_dim
        self._scalar_offset = scalar_offset
        if (scalar_offset is not None or vector_offset is not None) and not 0 <= indirect_dim < tensor.ndim:
            raise EmulatorError(f"indirect_dim {indirect_dim} is not a dimension of the {tensor.ndim}-d {tensor!r} "
                                f"(nki-aps: the dimension is relative to the base tensor)")
        if vector_offset is not None:
            if indirect_dim != 0:
                raise EmulatorError(f"vector_offset with indirect_dim={indirect_dim}: nki-aps, \"Currently, only "
                                    f"indirect_dim=0 is supported\"")
            # The DGE gathers/scatters rows of an HBM tensor with indices from SBUF (nki.isa.dma_copy:
            # "gather or scatter ... using a list of dynamic indices from SBUF"; nki-aps, vector_select:
            # "the source must be an HBM tensor").
            if tensor.buffer not in HBM_BUFFERS:
                raise EmulatorError(f"vector_offset indexes HBM tensors only; {tensor!r} is in {tensor.buffer!r}")
            if not isinstance(vector_offset, Tensor) or vector_offset.buffer is not SBUF:
                raise EmulatorError("vector_offset must be an SBUF tile")
            if vector_offset._dtype not in (np.dtype(np.int32), np.dtype(np.uint32)):
                raise EmulatorError(f"vector_offset must be int32/uint32, got {vector_offset._dtype}")
            lanes = pattern[0][1]
            if vector_offset.shape != (lanes, 1):
                raise EmulatorError(f"vector_offset must have shape ({lanes}, 1) to index dimension 0 of {pattern}, "
                                    f"got {vector_offset.shape}")

    @property
    def shape(self) -> tuple:
        return tuple(count for _, count in self._pattern)

    @property
    def dtype(self) -> str:
        return self._tensor.dtype

    @property
    def _dtype(self) -> np.dtype:
        return self._tensor._dtype

    @property
    def buffer(self) -> Buffer:
        return self._tensor.buffer

    def _scalar_value(self) -> int:
        offset = self._scalar_offset
        if isinstance(offset, VirtualRegister):
            return offset._read("scalar_offset")
        value = offset._array.reshape(-1)[0]
        if value == poison((1,), offset._dtype)[0]:
            raise EmulatorError("scalar_offset reads an SBUF (1, 1) tensor that was never written")
        return int(value)

    def _resolve(self):
        """(flat storage, addresses[shape], lanes in bounds along pattern dimension 0 or None)."""
        storage = self._tensor._array.reshape(-1)
        start = self.offset
        if self._scalar_offset is not None:
            start += self._scalar_value() * math.prod(self._tensor.shape[self._indirect_dim + 1:])
        addresses = np.full(self.shape, start, dtype=np.int64)
        valid = None
        for d, (step, count) in enumerate(self._pattern):
            index = np.arange(count, dtype=np.int64)
            if self._vector_offset is not None and d == 0:
                index = self._vector_offset._array[:, 0].astype(np.int64)
                if self._vector_offset._dtype == np.dtype(np.int32) and (index == _as_signed(INT_POISON[4])).any():
                    raise EmulatorError("vector_offset holds never-written entries")
                step = math.prod(self._tensor.shape[1:])
                valid = (index >= 0) & (index < self._tensor.shape[0])
                index = np.where(valid, index, 0)
            shape = [1] * len(self._pattern)
            shape[d] = count
            addresses = addresses + (index * step).reshape(shape)
        inside = (addresses >= 0) & (addresses < storage.size)
        if valid is not None:
            inside = inside | ~valid.reshape([-1] + [1] * (len(self._pattern) - 1))
        if addresses.size and not inside.all():
            raise EmulatorError(f"access pattern {self._pattern} + {self.offset} leaves {self._tensor!r}")
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
        free = math.prod(shape[1:])
        per_partition = free * dtype.itemsize
        if buffer is PSUM and (free > PSUM_BANK_FMAX or per_partition > PSUM_BANK_BYTES):
            # NeuronCore-v4's nc_matmul writes up to the whole PSUM (8 banks) in one dst tile; no page
            # lets any other instruction use such a tile (isa._tile refuses it).
            if platform().nc_version < 4 or per_partition > PSUM_PARTITION_BYTES:
                raise EmulatorError(f"PSUM tile {shape} {dtype}: the free size must not exceed one bank, "
                                    f"psum_bank_fmax = {PSUM_BANK_FMAX} elements ({PSUM_BANK_BYTES} bytes) per "
                                    f"partition (tiling overview, Tile-Size Constraint#2)"
                                    + ("" if platform().nc_version < 4 else "; NeuronCore-v4's nc_matmul dst up to "
                                       "the whole PSUM"))
        array = poison(shape, dtype)
        ledger().allocate(array, buffer, per_partition)
        return Tensor._wrap(array, buffer, name)
    if buffer is SHARED_HBM and current() is not None and current()[0].lnc > 1:
        # At LNC > 1 the k-th shared_hbm allocation of every core is one tensor.
        launch, core = current()
        return launch.shared_allocation(core, next_shared_index(), shape, dtype,
                                        lambda: Tensor._wrap(poison(shape, dtype), buffer, name))
    return Tensor._wrap(poison(shape, dtype), buffer, name)



# -- which core this thread runs (permgen.nki.emulator._cores launches them) ---------------------

_local = threading.local()


def current():
    """(the _cores.Launch, this core's index) while a kernel runs on this thread, else None."""
    return getattr(_local, "core", None)


def enter(launch, core: int) -> None:
    _local.core = (launch, core)
    _local.shared_index = 0


def leave() -> None:
    _local.core = None


def next_shared_index() -> int:
    """The index of this core's next shared_hbm allocation in its kernel run."""
    index = _local.shared_index
    _local.shared_index += 1
    return index


def run_threads(count: int, name: str, body, release, where) -> list:
    """body(i) for i < count, one daemon thread each (the cores of a launch, the ranks of run_ranks),
    and their results in order. A thread that raises calls release(), which frees the others from
    their waits (they raise PeerFailed); once every thread has ended, the first error that is not a
    PeerFailed (else the first) is raised here, with the note where(i) naming the thread it came from."""
    results: list = [None] * count
    errors: list = [None] * count

    def thread(i: int) -> None:
        try:
            results[i] = body(i)
        except BaseException as err:  # noqa: BLE001  (re-raised below, on the calling thread)
            errors[i] = err
            release()

    threads = [threading.Thread(target=thread, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    if failed:
        i, err = next(((i, e) for i, e in failed if not isinstance(e, PeerFailed)), failed[0])
        err.add_note(where(i))
        raise err
    return results
