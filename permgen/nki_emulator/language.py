"""The `nki.language` subset the generated kernels use: memories, dtypes, operators, iterators."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import _core
from ._core import PSUM, SBUF, SHARED_HBM, PRIVATE_HBM, Tensor  # noqa: F401  (re-exported names)

# Memories. `hbm` is an alias of `private_hbm`.
sbuf = SBUF
psum = PSUM
shared_hbm = SHARED_HBM
private_hbm = PRIVATE_HBM
hbm = PRIVATE_HBM

# Data types.
bool_ = np.dtype(np.bool_)
int8, uint8 = np.dtype(np.int8), np.dtype(np.uint8)
int16, uint16 = np.dtype(np.int16), np.dtype(np.uint16)
int32, uint32 = np.dtype(np.int32), np.dtype(np.uint32)
float16, float32 = np.dtype(np.float16), np.dtype(np.float32)
bfloat16 = _core.bfloat16
float8_e4m3 = _core.float8_e4m3
float8_e4m3fn = _core.float8_e4m3fn
float8_e5m2 = _core.float8_e5m2


class tile_size:  # noqa: N801  (mirrors nl.tile_size)
    pmax = _core.PMAX
    psum_fmax = _core.PSUM_BANK_BYTES // 4
    gemm_stationary_fmax = _core.GEMM_STATIONARY_FMAX
    gemm_moving_fmax = _core.GEMM_MOVING_FMAX


@dataclass(frozen=True)
class Operator:
    name: str
    kind: str  # "arith" (computed in fp32) or "bitvec" (integer bit patterns)
    fn: Callable

    def __repr__(self) -> str:
        return f"nl.{self.name}"


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


def ndarray(shape, dtype, buffer=SBUF, name: str = "") -> Tensor:
    return _core.new_tensor(shape, dtype, buffer, name)


def affine_range(*args):
    return range(*args)


def sequential_range(*args):
    return range(*args)


def static_range(*args):
    return range(*args)


def dynamic_range(start, stop=None, step=1):
    """A loop run by the device: bounds are ints or VirtualRegisters, read when the loop starts;
    step a compile-time positive int. The loop variable is a register (usable as a scalar_offset,
    not as a Python int), and every iteration ends in an all-engine barrier (counted)."""
    if stop is None:
        start, stop = 0, start
    if isinstance(step, _core.VirtualRegister) or isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise _core.EmulatorError(f"dynamic_range step must be a compile-time positive int, got {step!r}")

    def bound(b, what):
        if isinstance(b, _core.VirtualRegister):
            return b.value(f"dynamic_range {what}")
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise _core.EmulatorError(f"dynamic_range {what} must be an int or a VirtualRegister, got {type(b).__name__}")
        return int(b)

    lo, hi = bound(start, "start"), bound(stop, "stop")
    for i in range(lo, hi, step):
        _core.current_cost().dynamic_iterations += 1
        yield _core.VirtualRegister(i)
