"""The `nki.language` subset the generated kernels use: memories, dtypes, operators, iterators."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import _core, _cores
from ._core import PSUM, SBUF, SHARED_HBM, PRIVATE_HBM, Tensor  # noqa: F401  (re-exported names)

# Memories. `hbm` is an alias of `private_hbm`.
sbuf = SBUF
psum = PSUM
shared_hbm = SHARED_HBM
private_hbm = PRIVATE_HBM
hbm = PRIVATE_HBM

# Data types: NKI's are strings ("DType = str", the nki.language stub), each naming a NumPy dtype
# (ml_dtypes for bfloat16 and the fp8 formats).
bool_ = "bool_"
int8, uint8, int16, uint16, int32, uint32 = "int8", "uint8", "int16", "uint16", "int32", "uint32"
float16, float32, bfloat16 = "float16", "float32", "bfloat16"
float8_e4m3, float8_e4m3fn, float8_e5m2 = "float8_e4m3", "float8_e4m3fn", "float8_e5m2"


class _TileSize:
    """nl.tile_size: the hardware tile constants (nki.language.tile_size page, SDK 2.32) of the current
    Platform's NeuronCore. Those whose value no page gives are refused as not emulated."""

    pmax = _core.PMAX
    psum_bank_fmax = _core.PSUM_BANK_FMAX  # tiling overview: "psum_bank_fmax == 512"
    psum_fmax = _core.PSUM_BANK_FMAX  # deprecated alias of psum_bank_fmax (0.4)
    psum_bank_fmax_bytes = _core.PSUM_BANK_BYTES
    gemm_stationary_fmax = _core.GEMM_STATIONARY_FMAX
    _NOT_EMULATED = ("bn_stats_fmax", "psum_min_align", "sbuf_min_align", "sbuf_fmax", "sbuf_fmax_bytes",
                     "total_available_sbuf_size", "psum_num_banks")

    @property
    def gemm_moving_fmax(self) -> int:
        if _core.platform().nc_version >= 4:
            raise _core.EmulatorError("nl.tile_size.gemm_moving_fmax on NeuronCore-v4: nc_matmul allows 4096 (fp32 dst) "
                                      "or 8192 (bf16 dst); which one the constant holds is not documented")
        return _core.GEMM_MOVING_FMAX

    @property
    def sbuf_size_bytes(self) -> int:
        """"Total SBUF capacity in bytes (all partitions combined)": 28 MiB on NeuronCore-v3, 32 MiB on v4."""
        return _core.SBUF_PARTITION_BYTES[_core.platform().nc_version] * _core.PMAX

    def __getattr__(self, name):
        if name in _TileSize._NOT_EMULATED:
            raise _core.EmulatorError(f"nl.tile_size.{name} is documented but not emulated (its value is not given "
                                      f"by the pages the emulator follows)")
        raise AttributeError(f"nl.tile_size has no attribute {name!r}")


tile_size = _TileSize()


@dataclass(frozen=True)
class Operator:
    name: str
    kind: str  # "arith" (computed in fp32) or "bitvec" (integer bit patterns)
    fn: Callable

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __call__(self, x, y, dtype=None):
        raise _core.EmulatorError(f"nl.{self.name}(x, y) on tiles (the nki.language tile functions) is not emulated; "
                                  f"pass nl.{self.name} as an instruction's op")


def _cmp(f):
    return lambda a, b: f(a, b).astype(np.float32)


add = Operator("add", "arith", np.add)
subtract = Operator("subtract", "arith", np.subtract)
multiply = Operator("multiply", "arith", np.multiply)
maximum = Operator("maximum", "arith", np.maximum)
minimum = Operator("minimum", "arith", np.minimum)
equal = Operator("equal", "arith", _cmp(np.equal))
not_equal = Operator("not_equal", "arith", _cmp(np.not_equal))
greater = Operator("greater", "arith", _cmp(np.greater))
greater_equal = Operator("greater_equal", "arith", _cmp(np.greater_equal))
less = Operator("less", "arith", _cmp(np.less))
less_equal = Operator("less_equal", "arith", _cmp(np.less_equal))
bitwise_and = Operator("bitwise_and", "bitvec", np.bitwise_and)
bitwise_or = Operator("bitwise_or", "bitvec", np.bitwise_or)
left_shift = Operator("left_shift", "bitvec", np.left_shift)
right_shift = Operator("right_shift", "bitvec", np.right_shift)


NkiTensor = Tensor


def ndarray(shape, dtype, buffer=SBUF, name: str = "", address=None) -> Tensor:
    if address is not None:
        raise _core.EmulatorError("nl.ndarray(address=...) (manual allocation) is not emulated")
    return _core.new_tensor(shape, dtype, buffer, name)


def _host_range(start, stop, step):
    return range(start, stop, step) if stop is not None else range(start)


def affine_range(start, stop=None, step=1):
    return _host_range(start, stop, step)


def sequential_range(start, stop=None, step=1):
    return _host_range(start, stop, step)


def static_range(start, stop=None, step=1):
    return _host_range(start, stop, step)


def dynamic_range(start, stop=None, step=1):
    """A loop run by the device: bounds are ints or VirtualRegisters, read when the loop starts;
    step a compile-time positive int. The loop variable is a register (usable as a scalar_offset,
    not as a Python int). Iterations are counted (Cost.dynamic_iterations); no page says what an iteration
    costs beyond its instructions."""
    if stop is None:
        start, stop = 0, start
    if isinstance(step, _core.VirtualRegister) or isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise _core.EmulatorError(f"dynamic_range step must be a compile-time positive int, got {step!r}")

    def bound(b, what):
        if isinstance(b, _core.VirtualRegister):
            return b._read(f"dynamic_range {what}")
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise _core.EmulatorError(f"dynamic_range {what} must be an int or a VirtualRegister, got {type(b).__name__}")
        return int(b)

    lo, hi = bound(start, "start"), bound(stop, "stop")
    for i in range(lo, hi, step):
        _core.current_cost().dynamic_iterations += 1
        yield _core.VirtualRegister(i)


# ---------------------------------------------------------------------------------------------
# SPMD programs: at LNC=2 a kernel runs once per core ("Using Logical Neuron Cores (LNC)",
# nki/get-started/about/lnc.rst, SDK 2.32). The launch grid is one axis of LNC programs.
def program_id(axis=0) -> int:
    """This core's index, 0 or 1 at LNC=2 and 0 at LNC=1 (lnc.rst: "In the case of LNC=2, this API will
    return either 0 or 1. When not using LNC, this API will return 0")."""
    launch, core = _cores.require("nl.program_id")
    if axis != 0:
        raise _core.EmulatorError(f"nl.program_id({axis!r}): an LNC launch grid has one axis, 0")
    return core


def num_programs(axes=0) -> int:
    """The cores the kernel runs on: 1 without LNC, 2 at LNC=2 (lnc.rst)."""
    launch, _ = _cores.require("nl.num_programs")
    if axes not in (0, None, (0,), [0]):
        raise _core.EmulatorError(f"nl.num_programs({axes!r}): an LNC launch grid has one axis, 0")
    return launch.lnc


def program_ndim() -> int:
    """Dimensions of the launch grid: 1 for kernel[lnc](...), "0 if no grid" (a plain kernel(...) call)."""
    launch, _ = _cores.require("nl.program_ndim")
    return launch.grid_ndim
