"""The `nki.isa` subset the generated kernels use. Every call takes its destination first.

Engines compute arithmetic in fp32 and round once when writing the destination; DMA moves
elements and converts when the two sides' dtypes differ. Each instruction checks what the
documentation says the hardware checks: memories, partition counts, matching shapes, dtypes.
"""

from __future__ import annotations

import enum
import math

import numpy as np

from . import _core
from ._core import PSUM, SBUF, AccessPattern, EmulatorError, Tensor, VirtualRegister
from .language import Operator


class oob_mode(enum.Enum):  # noqa: N801  (mirrors nisa.oob_mode)
    error = "error"
    skip = "skip"


_OobMode = oob_mode


class dge_mode(enum.Enum):  # noqa: N801
    unknown = "unknown"
    none = "none"
    swdge = "swdge"
    hwdge = "hwdge"


def _tile(x, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise EmulatorError(f"{what} must be a tile, got {type(x).__name__}")
    if not x.buffer.on_chip:
        raise EmulatorError(f"{what} must be in SBUF or PSUM, not {x.buffer!r}: compute engines cannot read HBM")
    return x


def _same_shape(dst: Tensor, src: Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise EmulatorError(f"{what}: shapes differ, dst {dst.shape} vs {src.shape}")


def _fp32(x: Tensor) -> np.ndarray:
    return x.array.astype(np.float32)


def _write(dst: Tensor, values: np.ndarray) -> None:
    dst.array[...] = _core.cast(values, dst.dtype)


def _operand(op: Operator, operand, data: Tensor, what: str):
    """A per-partition vector ([P, 1] tile) or a compile-time scalar, broadcast along the free axes."""
    if isinstance(operand, Tensor):
        _tile(operand, what)
        if operand.shape != (data.shape[0], 1):
            raise EmulatorError(f"{what} must be a ({data.shape[0]}, 1) tile or a scalar, got {operand.shape}")
        column = operand.array if op.kind == "bitvec" else _fp32(operand)
        return column.reshape((data.shape[0],) + (1,) * (data.ndim - 1))
    if not isinstance(operand, (int, float, np.integer, np.floating)) or isinstance(operand, bool):
        raise EmulatorError(f"{what} must be a tile or a Python number, got {type(operand).__name__}")
    # Arithmetic operators convert their inputs to fp32 ("Supported Math Operators for NKI ISA",
    # nki/api/nki.api.shared); their scalar operands are floats (nki.isa.tensor_scalar and
    # scalar_tensor_tensor, 2.33 signatures: `operand0: float | NkiTensor`). Integer scalars belong to
    # bitvec operators, whose inputs are bit patterns.
    if op.kind == "arith" and isinstance(operand, (int, np.integer)):
        raise EmulatorError(f"{what}={operand!r} is an integer scalar for the arithmetic operator {op!r}: "
                            f"pass a float (e.g. {float(operand)!r})")
    return operand


def _apply(op: Operator, a, b, reverse: bool):
    return op.fn(b, a) if reverse else op.fn(a, b)


def _check_bitvec(op: Operator, *tiles: Tensor) -> None:
    if op.kind == "bitvec" and not all(_core.is_int(t.dtype) for t in tiles):
        raise EmulatorError(f"{op!r} is a bitvec operator: inputs and output must be integer tiles")


# ---------------------------------------------------------------------------------------------
def dma_copy(dst, src, dst_rmw_op=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, name=None):
    """dst = src. One side may be an indirect access pattern; its out-of-bounds lanes raise under
    oob_mode.error and are left untouched under oob_mode.skip.

    The DMA converts when the dtypes differ (nki.isa.dma_copy: "A cast will happen if the src and dst
    have different dtype"), and needs equal element counts, not equal shapes (a direct copy moves the
    elements in row-major order; nki-library's a2av kernels note the assert "src and dst have the same
    number of elements"). An indirect copy keeps its lanes, so its two sides must have equal shapes."""
    if dst_rmw_op is not None:
        raise EmulatorError("dst_rmw_op is not emulated")
    for side, what in ((dst, "dst"), (src, "src")):
        if not isinstance(side, (Tensor, AccessPattern)):
            raise EmulatorError(f"dma_copy {what} must be a tensor or access pattern")
    if isinstance(dst, AccessPattern) and isinstance(src, AccessPattern) and (
            dst.vector_offset is not None and src.vector_offset is not None):
        raise EmulatorError("only one side of a dma_copy may be indirect")
    indirect = any(isinstance(side, AccessPattern) and side.vector_offset is not None for side in (dst, src))
    if tuple(dst.shape) != tuple(src.shape):
        if indirect:
            raise EmulatorError(f"indirect dma_copy shapes differ: dst {tuple(dst.shape)} vs src {tuple(src.shape)}")
        if math.prod(dst.shape) != math.prod(src.shape):
            raise EmulatorError(f"dma_copy element counts differ: dst {tuple(dst.shape)} holds {math.prod(dst.shape)}, "
                                f"src {tuple(src.shape)} holds {math.prod(src.shape)}")
    if math.prod(dst.shape) == 0:
        _core.count_instruction(indirect)
        return

    def read(side):
        if isinstance(side, Tensor):
            return side.array.copy(), None
        storage, addresses, valid = side.resolve()
        return storage[addresses], (valid, side.indirect_dim)

    values, src_lanes = read(src)
    if tuple(values.shape) != tuple(dst.shape):
        values = values.reshape(dst.shape)
    if values.dtype != dst.dtype:
        values = _core.cast(values if _core.is_int(values.dtype) and _core.is_int(dst.dtype) else values.astype(np.float32),
                            dst.dtype)
    if isinstance(dst, AccessPattern):
        storage, addresses, valid = dst.resolve()
        lanes = (valid, dst.indirect_dim)
    else:
        storage, addresses, lanes = None, None, None
    lanes = lanes if lanes and lanes[0] is not None else src_lanes
    keep = np.ones(values.shape, dtype=bool)
    if lanes and lanes[0] is not None:
        valid, dim = lanes
        if not valid.all():
            if oob_mode is not _OobMode.skip:
                raise EmulatorError(f"indirect DMA index out of bounds at lanes {np.flatnonzero(~valid)[:8].tolist()} "
                                    f"(oob_mode.error); use oob_mode.skip to drop such lanes")
        shape = [1] * values.ndim
        shape[dim] = -1
        keep = np.broadcast_to(valid.reshape(shape), values.shape)
    if storage is not None:
        storage[addresses[keep]] = values[keep]
    else:
        dst.array[keep] = values[keep]
    _core.count_instruction(indirect, int(np.count_nonzero(keep)) * src.dtype.itemsize)


def memset(dst, value, engine=None, name=None):
    _core.count_instruction()
    _tile(dst, "memset dst")
    _write(dst, np.full(dst.shape, value, dtype=np.float64 if not _core.is_int(dst.dtype) else np.int64))


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, i...] = offset + p * channel_multiplier + sum_d i_d * step_d, computed in int32."""
    _core.count_instruction()
    _tile(dst, "iota dst")
    if dst.buffer is not SBUF:
        raise EmulatorError("iota writes SBUF only")
    counts = [int(c) for _, c in pattern]
    if math.prod(counts) != math.prod(dst.shape[1:]):
        raise EmulatorError(f"iota pattern {pattern} makes {math.prod(counts)} values per partition; dst holds {math.prod(dst.shape[1:])}")
    values = np.full([dst.shape[0]] + counts, offset, dtype=np.int64)
    values += (np.arange(dst.shape[0]) * channel_multiplier).reshape([-1] + [1] * len(counts))
    for d, (step, count) in enumerate(pattern):
        shape = [1] * (len(counts) + 1)
        shape[d + 1] = count
        values += (np.arange(count) * step).reshape(shape)
    _write(dst, values.astype(np.int32).reshape(dst.shape))


def tensor_copy(dst, src, engine=None, name=None):
    _core.count_instruction()
    _tile(dst, "tensor_copy dst")
    _tile(src, "tensor_copy src")
    _same_shape(dst, src, "tensor_copy")
    _write(dst, src.array if _core.is_int(src.dtype) and _core.is_int(dst.dtype) else _fp32(src))


def tensor_tensor(dst, data1, data2, op, engine=None, name=None):
    _core.count_instruction()
    for t, what in ((dst, "dst"), (data1, "data1"), (data2, "data2")):
        _tile(t, f"tensor_tensor {what}")
    _same_shape(data1, data2, "tensor_tensor inputs")
    _same_shape(dst, data1, "tensor_tensor")
    if data1.buffer is PSUM and data2.buffer is PSUM:
        raise EmulatorError("tensor_tensor inputs cannot both be in PSUM")
    _check_bitvec(op, dst, data1, data2)
    if op.kind == "bitvec":
        _write(dst, op.fn(data1.array, data2.array))
    else:
        _write(dst, op.fn(_fp32(data1), _fp32(data2)))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=None, name=None):
    """dst = (data op0 operand0) op1 operand1, operands broadcast along the free axes."""
    _core.count_instruction()
    _tile(dst, "tensor_scalar dst")
    _tile(data, "tensor_scalar data")
    _same_shape(dst, data, "tensor_scalar")
    if (op1 is None) != (operand1 is None):
        raise EmulatorError("tensor_scalar: op1 and operand1 go together")
    if op1 is not None and op1.kind != op0.kind:
        raise EmulatorError("tensor_scalar: op0 and op1 must both be arithmetic or both bitvec")
    _check_bitvec(op0, dst, data)
    x = data.array if op0.kind == "bitvec" else _fp32(data)
    x = _apply(op0, x, _operand(op0, operand0, data, "operand0"), reverse0)
    if op1 is not None:
        x = _apply(op1, x, _operand(op1, operand1, data, "operand1"), reverse1)
    _write(dst, x)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """dst = (data op0 operand0) op1 operand1, operand0 broadcast, operand1 a full tile."""
    _core.count_instruction()
    for t, what in ((dst, "dst"), (data, "data"), (operand1, "operand1")):
        _tile(t, f"scalar_tensor_tensor {what}")
    _same_shape(dst, data, "scalar_tensor_tensor")
    _same_shape(data, operand1, "scalar_tensor_tensor operand1")
    if op0.kind != "arith" or op1.kind != "arith":
        raise EmulatorError("scalar_tensor_tensor takes arithmetic operators only")
    if data.buffer is PSUM and operand1.buffer is PSUM:
        raise EmulatorError("scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    x = _apply(op0, _fp32(data), _operand(op0, operand0, data, "operand0"), reverse0)
    _write(dst, _apply(op1, x, _fp32(operand1), reverse1))


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce the trailing free axes `axis` (never the partition axis), in fp32."""
    _core.count_instruction()
    _tile(dst, "tensor_reduce dst")
    _tile(data, "tensor_reduce data")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if 0 in axes or sorted(axes) != list(range(data.ndim - len(axes), data.ndim)):
        raise EmulatorError(f"tensor_reduce axes {axes} must be the trailing free axes of a {data.ndim}-d tile")
    if op.kind != "arith" or op.name not in ("add", "maximum", "minimum", "multiply"):
        raise EmulatorError(f"tensor_reduce with {op!r} is not emulated")
    reducer = {"add": np.add, "maximum": np.maximum, "minimum": np.minimum, "multiply": np.multiply}[op.name]
    out = reducer.reduce(_fp32(data), axis=axes, keepdims=keepdims)
    if out.shape != dst.shape:
        raise EmulatorError(f"tensor_reduce result has shape {out.shape}, dst {dst.shape} (keepdims={keepdims})")
    _write(dst, -out if negate else out)


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Along the free axis: dst[:, i] = (data0[:, i] op0 dst[:, i-1]) op1 data1[:, i], dst[:, -1] = initial."""
    _core.count_instruction()
    for t, what in ((dst, "dst"), (data0, "data0"), (data1, "data1")):
        _tile(t, f"tensor_tensor_scan {what}")
        if t.ndim != 2:
            raise EmulatorError("tensor_tensor_scan is emulated for 2-d tiles")
    _same_shape(data0, data1, "tensor_tensor_scan inputs")
    _same_shape(dst, data0, "tensor_tensor_scan")
    if data0.buffer is PSUM and data1.buffer is PSUM:
        raise EmulatorError("tensor_tensor_scan inputs cannot both be in PSUM")
    if reverse0 or reverse1:
        raise EmulatorError("reversed scan operands are not emulated")
    prev = _operand(op0, initial, data0, "initial")
    prev = np.broadcast_to(np.asarray(prev, dtype=np.float32).reshape(-1), (data0.shape[0],)).copy() if np.ndim(prev) else np.full(data0.shape[0], prev, dtype=np.float32)
    a, b = _fp32(data0), _fp32(data1)
    out = np.empty_like(a)
    for i in range(a.shape[1]):
        prev = op1.fn(op0.fn(a[:, i], prev), b[:, i])
        out[:, i] = prev
    _write(dst, out)


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None):
    """dst[M, N] = stationary[K, M].T @ moving[K, N] on the Tensor Engine, fp32 in PSUM."""
    _core.count_instruction()
    for t, what in ((stationary, "stationary"), (moving, "moving")):
        if not isinstance(t, Tensor) or t.buffer is not SBUF:
            raise EmulatorError(f"nc_matmul {what} must be an SBUF tile")
        if t.ndim != 2:
            raise EmulatorError(f"nc_matmul {what} must be 2-d")
        if t.dtype not in _core.MATMUL_DTYPES:
            raise EmulatorError(f"nc_matmul {what} dtype {t.dtype} is not a Tensor Engine input type")
        # Input types (nki.isa.nc_matmul, "Data types": the 2.33 page,
        # https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.nc_matmul.html,
        # whose text is the nc_matmul docstring of aws-neuron-sdk's nki/api/nki/isa/__init__.py):
        # float8_e4m3 / float8_e5m2 / bfloat16 / float16 / tfloat32 / float32, and float8_e4m3fn
        # starting NeuronCore-v4.
        if t.dtype == _core.float8_e4m3fn and _core.platform().nc_version < 4:
            raise EmulatorError(f"nc_matmul {what} is float8_e4m3fn, a NeuronCore-v4 format; this platform is "
                                f"{_core.platform().generation} (NeuronCore-v{_core.platform().nc_version})")
    # Same page: the two inputs may differ in dtype, except that a float32 input needs a float32 partner
    # and legacy float8_e4m3 and OCP float8_e4m3fn cannot be mixed.
    if (stationary.dtype == np.float32) != (moving.dtype == np.float32):
        raise EmulatorError(f"nc_matmul input dtypes {stationary.dtype} x {moving.dtype}: fp32 pairs only with fp32")
    if {stationary.dtype, moving.dtype} == {_core.float8_e4m3, _core.float8_e4m3fn}:
        raise EmulatorError("nc_matmul cannot mix float8_e4m3 and float8_e4m3fn inputs")
    # Same page: dst is a float32 tile on NeuronCore-v2/v3; starting NeuronCore-v4 float32 or bfloat16.
    dst_dtypes = (np.float32,) if _core.platform().nc_version < 4 else (np.float32, _core.bfloat16)
    if not isinstance(dst, Tensor) or dst.buffer is not PSUM or dst.dtype not in dst_dtypes:
        raise EmulatorError("nc_matmul dst must be an fp32 PSUM tile" + ("" if len(dst_dtypes) == 1 else " or bf16"))
    if is_transpose or accumulate:
        raise EmulatorError("transpose/accumulate matmul modes are not emulated")
    k, m = stationary.shape
    if moving.shape[0] != k:
        raise EmulatorError(f"nc_matmul contraction (partition) sizes differ: {k} vs {moving.shape[0]}")
    if m > _core.GEMM_STATIONARY_FMAX or moving.shape[1] > _core.GEMM_MOVING_FMAX:
        raise EmulatorError(f"nc_matmul free sizes {m} (stationary, <= 128) / {moving.shape[1]} (moving, <= 512)")
    if dst.shape != (m, moving.shape[1]):
        raise EmulatorError(f"nc_matmul dst must be {(m, moving.shape[1])}, got {dst.shape}")
    _write(dst, (_fp32(stationary).astype(np.float64).T @ _fp32(moving).astype(np.float64)).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# Registers (nki.isa.register_alloc / register_load): scalars for dynamic loop bounds and offsets.
def register_alloc(x=None):
    """A new virtual register, holding the int x, or unwritten when x is None."""
    if x is not None and (isinstance(x, bool) or not isinstance(x, (int, np.integer))):
        raise EmulatorError(f"register_alloc takes an optional integer, got {type(x).__name__}")
    return VirtualRegister(x)


def register_load(dst, src):
    """dst (a register) = the one (up to 32-bit) value of src, a tensor of shape [1] or [1, 1] in SBUF or HBM."""
    _core.count_instruction()
    if not isinstance(dst, VirtualRegister):
        raise EmulatorError(f"register_load dst must be a register from nisa.register_alloc, got {type(dst).__name__}")
    if not isinstance(src, Tensor) or src.buffer is PSUM:
        raise EmulatorError("register_load src must be an SBUF or HBM tensor")
    if src.shape not in ((1,), (1, 1)):
        raise EmulatorError(f"register_load src must hold exactly one element (shape [1] or [1, 1]), got {src.shape}")
    if src.dtype.itemsize > 4:
        raise EmulatorError(f"register_load reads values of up to 32 bits, got {src.dtype}")
    if not _core.is_int(src.dtype):
        raise EmulatorError(f"register_load of a {src.dtype} value is not emulated; load an integer tile")
    value = src.array.reshape(-1)[0]
    if value == _core.poison((1,), src.dtype)[0]:
        raise EmulatorError("register_load reads memory that was never written")
    dst._value = int(value)
