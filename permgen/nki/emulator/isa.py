"""The `nki.isa` subset the generated kernels use. Every call takes its destination first.

Engines compute arithmetic in fp32 and round once when writing the destination; DMA moves
elements and converts when the two sides' dtypes differ. Each instruction checks what the
documentation says the hardware checks: memories, partition counts, matching shapes, dtypes.
"""

from __future__ import annotations

import enum
import math

import numpy as np

from . import _core, _cores
from ._core import PSUM, SBUF, AccessPattern, EmulatorError, Tensor, VirtualRegister
from .language import Operator


def _mirrored(name: str, members: str) -> type[enum.Enum]:
    """The enum nisa.<name>: its members, each valued by its name."""
    return enum.Enum(name, [(member, member) for member in members.split()], module=__name__, qualname=name)


oob_mode = _mirrored("oob_mode", "error skip")
dge_mode = _mirrored("dge_mode", "unknown swdge hwdge none")
engine = _mirrored("engine", "tensor vector scalar gpsimd dma sync unknown")
# The functions below take arguments of these names: inside them, the enums by these.
_OobMode, _DgeMode, _Engine = oob_mode, dge_mode, engine


class nc_version(enum.Enum):  # noqa: N801  (mirrors nisa.nc_version)
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version():
    """The NeuronCore version of the Platform: gen3 on Trn2, gen4 on Trn3 (nisa.nc_version: "gen3 = 3,
    Trn2 target", "gen4 = 4, Trn3 target")."""
    return nc_version(_core.platform().nc_version)


def get_nc_sub_version():
    """ "0 - first revision (default)": the emulator models each generation's first revision."""
    return 0


def _tile(x, what: str) -> Tensor:
    """A compute engine's operand: an SBUF or PSUM tile of a dtype the engines of this NeuronCore handle."""
    if not isinstance(x, Tensor):
        raise EmulatorError(f"{what} must be a tile, got {type(x).__name__}")
    if not x.buffer.on_chip:
        raise EmulatorError(f"{what} must be in SBUF or PSUM, not {x.buffer!r}: compute engines cannot read HBM")
    if x.buffer is PSUM and math.prod(x._root.shape[1:]) > _core.PSUM_BANK_FMAX:
        raise EmulatorError(f"{what} is a PSUM tile wider than one bank ({x._root.shape}): not documented for any "
                            f"instruction but NeuronCore-v4's nc_matmul dst")
    # float8_e4m3fn on NeuronCore-v3 never gets here: no such tensor exists there (Tensor, NCC_EVRF051).
    return x


def _same_shape(dst: Tensor, src: Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise EmulatorError(f"{what}: shapes differ, dst {dst.shape} vs {src.shape}")


def _fp32(x: Tensor) -> np.ndarray:
    return x._array.astype(np.float32)


def _write(dst: Tensor, values: np.ndarray) -> None:
    dst._array[...] = _core.cast(values, dst._dtype)


def _convert(values: np.ndarray, dtype) -> np.ndarray:
    """A dtype conversion by DMA or a compute engine: "first casting from src._dtype to float32, then from
    float32 to dst._dtype" (nki.isa.dma_copy, 2.32; tensor_copy: an "intermediate FP32 cast when input and
    output data types differ"), so integers above 2^24 round."""
    return _core.cast(np.asarray(values).astype(np.float32), np.dtype(dtype))


def _engine(value, what: str, allowed) -> "engine":
    if not isinstance(value, _Engine) or value not in allowed:
        raise EmulatorError(f"{what} engine={value!r}: emulated for {', '.join(f'nisa.engine.{e.name}' for e in allowed)}")
    return value


def _operand(op: Operator, operand, data: Tensor, what: str):
    """A per-partition vector ([P, 1] tile) or a compile-time scalar, broadcast along the free axes."""
    if isinstance(operand, Tensor):
        _tile(operand, what)
        if operand.shape != (data.shape[0], 1):
            raise EmulatorError(f"{what} must be a ({data.shape[0]}, 1) tile or a scalar, got {operand.shape}")
        column = operand._array if op.kind == "bitvec" else _fp32(operand)
        return column.reshape((data.shape[0],) + (1,) * (data.ndim - 1))
    if not isinstance(operand, (int, float, np.integer, np.floating)) or isinstance(operand, bool):
        raise EmulatorError(f"{what} must be a tile or a Python number, got {type(operand).__name__}")
    # Arithmetic operators convert their inputs to fp32 ("Supported Math Operators for NKI ISA",
    # nki/api/nki.api.shared) and their scalar operands "must be float32" (nki.isa.tensor_scalar, 2.32):
    # a Python int is taken as that float32, as nki-library's kernels pass them (`op0=nl.add, operand0=1`
    # in moe_cte/bwmm_shard_on_I.py).
    if op.kind == "arith":
        return np.float32(operand)
    # A bitvec operator treats its inputs as bit patterns, but a scalar operand is typed `float` (tensor_scalar,
    # 2.33: "operand0: float | NkiTensor") and must be float32 (2.32): which bits an immediate holds is not
    # documented, so only an integer tile operand is emulated.
    raise EmulatorError(f"{what}={operand!r} with the bitvec operator {op!r}: how a scalar immediate is encoded for a "
                        f"bitvec operator is not documented (nki.isa.tensor_scalar types it float); pass an integer "
                        f"({data.shape[0]}, 1) tile")


def _apply(op: Operator, a, b, reverse: bool):
    return op.fn(b, a) if reverse else op.fn(a, b)


def _check_bitvec(op: Operator, *tiles: Tensor) -> None:
    if op.kind == "bitvec" and not all(_core.is_int(t._dtype) for t in tiles):
        raise EmulatorError(f"{op!r} is a bitvec operator: inputs and output must be integer tiles")


# ---------------------------------------------------------------------------------------------
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """dst = src. One side may be an indirect access pattern; its out-of-bounds lanes raise under
    oob_mode.error and are left untouched under oob_mode.skip.

    The DMA converts when the dtypes differ (nki.isa.dma_copy: "A cast will happen if the src and dst
    have different dtype"), through fp32 like every engine (see _convert), and needs equal element
    counts, not equal shapes (a direct copy moves the elements in row-major order; nki-library's
    a2av kernels note the assert "src and dst have the same number of elements"). An indirect copy
    keeps its lanes, so its two sides must have equal shapes. An access pattern with a vector_offset
    needs software DGE: "the DGE mode is constrained to swdge", `unknown` (the default) selecting it
    ("Descriptor Generation Engine (DGE) Reference", nki/deep-dives/nki-dge.rst, SDK 2.32)."""
    if priority is not None:
        raise EmulatorError("dma_copy(priority=...) is not emulated")
    if engine is not _Engine.unknown:
        raise EmulatorError("dma_copy(engine=...) is not emulated (it picks a hardware DGE trigger engine)")
    for side, what in ((dst, "dst"), (src, "src")):
        if not isinstance(side, (Tensor, AccessPattern)):
            raise EmulatorError(f"dma_copy {what} must be a tensor or access pattern")
    if not isinstance(dge_mode, _DgeMode):
        raise EmulatorError(f"dma_copy dge_mode must be an nisa.dge_mode member, got {dge_mode!r}")
    if not isinstance(oob_mode, _OobMode):
        raise EmulatorError(f"dma_copy oob_mode must be an nisa.oob_mode member, got {oob_mode!r}")
    # nki.isa.dma_copy (2.32): "data movement between memory locations (SBUF or HBM)"; "Both src and dst
    # tiles can be in HBM or SBUF".
    for side, what in ((dst, "dst"), (src, "src")):
        if side.buffer is PSUM:
            raise EmulatorError(f"dma_copy {what} is in PSUM: DMA moves data between SBUF and HBM")
    if isinstance(dst, AccessPattern) and isinstance(src, AccessPattern) and (
            dst._vector_offset is not None and src._vector_offset is not None):
        raise EmulatorError("only one side of a dma_copy may be indirect")
    indirect = any(isinstance(side, AccessPattern) and side._vector_offset is not None for side in (dst, src))
    if indirect and dge_mode not in (_DgeMode.unknown, _DgeMode.swdge):
        raise EmulatorError(f"dma_copy with a vector_offset access pattern and dge_mode={dge_mode.name}: nki-dge, "
                            f"\"the DGE mode is constrained to swdge\" (pass dge_mode=unknown or swdge)")
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
            return side._array.copy(), None, None
        storage, addresses, valid = side._resolve()
        return storage[addresses], (valid, side._indirect_dim), addresses

    values, src_lanes, src_addresses = read(src)
    if tuple(values.shape) != tuple(dst.shape):
        values = values.reshape(dst.shape)
    if values.dtype != dst._dtype:
        values = _convert(values, dst._dtype)
    if isinstance(dst, AccessPattern):
        storage, addresses, valid = dst._resolve()
        lanes = (valid, dst._indirect_dim)
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
    # Shared HBM at LNC > 1: what this core reads and writes (the cross-core race checks of _cores).
    if isinstance(src, Tensor):
        _cores.note_read(src, "dma_copy src", keep=keep.reshape(src.shape) if src.shape == values.shape else None)
    else:
        _cores.note_read(src._tensor, "dma_copy src", elements=src_addresses.reshape(values.shape)[keep])
    if storage is not None:
        _cores.note_write(dst._tensor, "dma_copy dst", values[keep], elements=addresses[keep])
        storage[addresses[keep]] = values[keep]
    else:
        _cores.note_write(dst, "dma_copy dst", values[keep], keep=keep)
        dst._array[keep] = values[keep]
    _core.count_instruction(indirect, int(np.count_nonzero(keep)) * src._dtype.itemsize)


def memset(dst, value, engine=engine.unknown, name=None):
    """dst = value, "using Vector or GpSimd Engine" (nki.isa.memset, 2.32)."""
    _core.count_instruction()
    _tile(dst, "memset dst")
    _engine(engine, "memset", (_Engine.unknown, _Engine.vector, _Engine.gpsimd))
    if engine is _Engine.gpsimd and dst.buffer is PSUM:
        raise EmulatorError("memset on engine=gpsimd into PSUM: GpSimd Engine cannot access PSUM")
    _write(dst, np.full(dst.shape, value, dtype=np.float64 if not _core.is_int(dst._dtype) else np.int64))


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, i...] = offset + p * channel_multiplier + sum_d i_d * step_d, computed in int32."""
    _core.count_instruction()
    _tile(dst, "iota dst")
    if dst.buffer is not SBUF:
        raise EmulatorError("iota writes SBUF only")
    if not 1 <= len(pattern) <= 4:
        raise EmulatorError(f"iota pattern {pattern}: \"a tensor access pattern of up to 4D\" (nki.isa.iota)")
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


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """dst = src on a compute engine: "bit-accurate copy when input and output data types are the same or
    (2) intermediate FP32 cast when input and output data types differ" (nki.isa.tensor_copy, 2.32)."""
    _core.count_instruction()
    _tile(dst, "tensor_copy dst")
    _tile(src, "tensor_copy src")
    _engine(engine, "tensor_copy", (_Engine.unknown, _Engine.vector, _Engine.scalar, _Engine.gpsimd))
    if engine is _Engine.gpsimd and PSUM in (dst.buffer, src.buffer):
        # nki.isa.tensor_copy: "since GpSimd Engine cannot access PSUM in NeuronCore, Scalar or Vector Engine
        # must be chosen when the input or output tile is in PSUM".
        raise EmulatorError("tensor_copy on engine=gpsimd with a PSUM tile: GpSimd Engine cannot access PSUM")
    _same_shape(dst, src, "tensor_copy")
    if src._dtype == dst._dtype:
        dst._array[...] = src._array
    else:
        dst._array[...] = _convert(src._array, dst._dtype)


_INTEGER_32 = (np.dtype(np.int32), np.dtype(np.uint32))


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """dst = data1 op data2, element-wise (nki.isa.tensor_tensor, 2.32). Arithmetic operators compute in
    fp32, except that "when all input/output tiles are int32 or uint32, the operation defaults to GpSimd
    Engine, which uses native integer arithmetic. This ensures exact results for all 32-bit integer
    values" (since 2.29); `engine=nki.isa.engine.vector`, or an operand in PSUM ("falls back to Vector
    Engine"), computes in fp32."""
    _core.count_instruction()
    for t, what in ((dst, "dst"), (data1, "data1"), (data2, "data2")):
        _tile(t, f"tensor_tensor {what}")
    _engine(engine, "tensor_tensor", (_Engine.unknown, _Engine.vector, _Engine.gpsimd))
    _same_shape(data1, data2, "tensor_tensor inputs")
    _same_shape(dst, data1, "tensor_tensor")
    if data1.buffer is PSUM and data2.buffer is PSUM:
        raise EmulatorError("tensor_tensor inputs cannot both be in PSUM")
    _check_bitvec(op, dst, data1, data2)
    if op.kind == "bitvec":
        _write(dst, op.fn(data1._array, data2._array))
        return
    integer = all(t._dtype in _INTEGER_32 for t in (dst, data1, data2))
    in_psum = any(t.buffer is PSUM for t in (dst, data1, data2))
    if integer and engine is _Engine.gpsimd and in_psum:
        raise EmulatorError("tensor_tensor on engine=gpsimd with a PSUM tile: GpSimd Engine cannot access PSUM")
    if integer and engine is not _Engine.vector and not in_psum and _core.platform().sdk_release >= (2, 29):
        exact = op.fn(data1._array.astype(np.int64), data2._array.astype(np.int64))
        info = np.iinfo(dst._dtype)
        if (exact < info.min).any() or (exact > info.max).any():
            raise EmulatorError(f"tensor_tensor {op!r} on GpSimd: a result outside {dst._dtype}; what native integer "
                                f"arithmetic does on overflow is not documented")
        dst._array[...] = exact.astype(dst._dtype)
        return
    _write(dst, op.fn(_fp32(data1), _fp32(data2)))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
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
    x = data._array if op0.kind == "bitvec" else _fp32(data)
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
    if op0.kind != "arith" or op1.kind != "arith":
        raise EmulatorError("tensor_tensor_scan: \"Both op0 and op1 can be any binary arithmetic operator\"; "
                            f"{op0!r}, {op1!r} given")
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
        if t._dtype not in _core.MATMUL_DTYPES:
            raise EmulatorError(f"nc_matmul {what} dtype {t._dtype} is not a Tensor Engine input type")
        # Input types (nki.isa.nc_matmul, "Data types": the 2.33 page,
        # https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.nc_matmul.html,
        # whose text is the nc_matmul docstring of aws-neuron-sdk's nki/api/nki/isa/__init__.py):
        # float8_e4m3 / float8_e5m2 / bfloat16 / float16 / tfloat32 / float32, and float8_e4m3fn
        # starting NeuronCore-v4 (before it no float8_e4m3fn tensor exists: Tensor, NCC_EVRF051).
    # Same page: the two inputs may differ in dtype, except that a float32 input needs a float32 partner
    # and legacy float8_e4m3 and OCP float8_e4m3fn cannot be mixed.
    if (stationary._dtype == np.float32) != (moving._dtype == np.float32):
        raise EmulatorError(f"nc_matmul input dtypes {stationary._dtype} x {moving._dtype}: fp32 pairs only with fp32")
    if {stationary._dtype, moving._dtype} == {_core.float8_e4m3, _core.float8_e4m3fn}:
        raise EmulatorError("nc_matmul cannot mix float8_e4m3 and float8_e4m3fn inputs")
    # Same page: dst is a float32 tile on NeuronCore-v2/v3; starting NeuronCore-v4 float32 or bfloat16.
    dst_dtypes = (np.float32,) if _core.platform().nc_version < 4 else (np.float32, _core.bfloat16)
    if not isinstance(dst, Tensor) or dst.buffer is not PSUM or dst._dtype not in dst_dtypes:
        raise EmulatorError("nc_matmul dst must be an fp32 PSUM tile" + ("" if len(dst_dtypes) == 1 else " or bf16"))
    if tile_position or tile_size or perf_mode is not None:
        raise EmulatorError("nc_matmul tiling (tile_position, tile_size) and perf_mode are not emulated")
    # is_*_onezero "hints to the compiler whether the ... operand is a tile with ones/zeros only" (2.32); what
    # the hint does to other values is not documented, so the emulator holds the kernel to it.
    for flag, t, what in ((is_stationary_onezero, stationary, "stationary"), (is_moving_onezero, moving, "moving")):
        if flag and not np.isin(_fp32(t), (0.0, 1.0)).all():
            raise EmulatorError(f"nc_matmul is_{what}_onezero=True, but the {what} tile holds values other than 0 and 1 "
                                f"(what the hint does to them is not documented)")
    if is_transpose or accumulate:
        raise EmulatorError("transpose/accumulate matmul modes are not emulated")
    k, m = stationary.shape
    if moving.shape[0] != k:
        raise EmulatorError(f"nc_matmul contraction (partition) sizes differ: {k} vs {moving.shape[0]}")
    moving_fmax = (_core.GEMM_MOVING_FMAX if _core.platform().nc_version < 4
                   else _core.GEMM_MOVING_FMAX_V4[np.dtype(dst._dtype).name])
    if m > _core.GEMM_STATIONARY_FMAX or moving.shape[1] > moving_fmax:
        raise EmulatorError(f"nc_matmul free sizes {m} (stationary, <= {_core.GEMM_STATIONARY_FMAX}) / {moving.shape[1]} "
                            f"(moving, <= {moving_fmax} on NeuronCore-v{_core.platform().nc_version} with a "
                            f"{dst._dtype} dst)")
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
    if src._dtype.itemsize > 4:
        raise EmulatorError(f"register_load reads values of up to 32 bits, got {src._dtype}")
    integer = _core.is_int(src._dtype)
    if not integer and _core.platform().sdk_release < (2, 33):
        raise EmulatorError(f"register_load of a {src._dtype} value before SDK 2.33 is not documented (the 2.33 "
                            f"page adds: \"src can be any valid NKI data type\"); load an integer tile")
    _cores.note_read(src, "register_load src")
    value = src._array.reshape(-1)[0]
    if integer and value == _core.poison((1,), src._dtype)[0]:
        raise EmulatorError("register_load reads memory that was never written")
    if not integer:
        # No page says how a float becomes the register's integer (truncated, rounded, its bits): a whole
        # number in int32's range reads the same under any of them but its bits; the value is taken.
        value = float(value)
        if not np.isfinite(value):
            raise EmulatorError("register_load reads a non-finite float (NaN: memory never written?); which integer "
                                "it becomes is not documented")
        if value != int(value) or not -2**31 <= value < 2**31:
            raise EmulatorError(f"register_load of the float {value}: which integer a fractional or out-of-range "
                                f"value becomes is not documented")
    dst._value = int(value)


# ---------------------------------------------------------------------------------------------
# Synchronisation between the cores of an LNC=2 launch (see _cores).
def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Every core waits here until all have arrived; writes to `data` made before it are then visible to
    the other core (nki.isa.core_barrier, 2.32 and 2.33; NKI 0.7 has no nki.lnc module, and 0.8 (SDK 2.34)
    keeps this one as a deprecated wrapper of nki.lnc.core_barrier; 2.32: "both cores can perform the write to data in HBM using
    nisa.dma_copy, and then signal to each other when the write operation is complete"). "This
    instruction is only allowed in NeuronCore-v3 or newer when LNC (Logical NeuronCore) is enabled.
    Currently only cores=(0, 1) is supported"; `data` "must be data in shared HBM". The barrier "will
    block execution on this engine, other engines will not be blocked", so it orders the accesses to
    `data` only."""
    launch, core = _cores.require("nisa.core_barrier")
    _core.count_instruction()
    if launch.lnc < 2 and _core.platform().sdk_release < (2, 33):
        raise EmulatorError("nisa.core_barrier at LNC=1: the instruction \"is only allowed ... when LNC (Logical "
                            "NeuronCore) is enabled\" (SDK 2.32; launch the kernel as kernel[2](...))")
    if launch.lnc < 2:
        # 2.33: "This applies at LNC degree 1 and 2": at LNC=1 the barrier pairs this physical core with the
        # other one of its HBM stack, which runs another kernel launch (another rank); the emulator runs one
        # launch per rank and does not model that pairing.
        raise EmulatorError("nisa.core_barrier at LNC=1 waits for the other physical core of the HBM stack, which "
                            "runs another launch (\"This applies at LNC degree 1 and 2\", SDK 2.33): the pairing of "
                            "two launches is not emulated")
    # The page says "a tuple of core indices"; nki-library's mlp_tkg passes the list [0, 1].
    if not isinstance(cores, (tuple, list)) or tuple(cores) != (0, 1):
        raise EmulatorError(f"nisa.core_barrier cores={cores!r}: \"Currently only cores=(0, 1) is supported\"")
    if not isinstance(data, Tensor) or data.buffer is not _core.SHARED_HBM:
        raise EmulatorError(f"nisa.core_barrier data must be a tensor in nl.shared_hbm, got {data!r}")
    _engine(engine, "core_barrier", tuple(_Engine))
    launch.sync(core, "nisa.core_barrier", key=(id(data._root), data.offset, data.shape),
                action=lambda: _cores.publish(data))
