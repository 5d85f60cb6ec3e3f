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


# The static range iterators: Python loops, unrolled while the kernel is traced. "In NKI 0.7 and later, the
# static range iterators ... are deprecated and default to Python range" (NKI Loops, 2.33): still provided.
def affine_range(start, stop=None, step=1):
    return _host_range(start, stop, step)


def sequential_range(start, stop=None, step=1):
    return _host_range(start, stop, step)


def static_range(start, stop=None, step=1):
    return _host_range(start, stop, step)


# The migration guide (2.33.1, "Migrating from NKI 0.6.0 to NKI 0.7.0"): "This release updates kernel
# specialization and removes the dynamic loop constructs deprecated in NKI 0.6.0"; the announcement: "Kernels
# that use nl.dynamic_range or while loops with a virtual register must move to nki.language.fori_loop() and
# nki.language.while_loop()". api.py refuses nl.dynamic_range from SDK 2.33 on with these words.
REMOVED_IN_0_7 = ("NKI 0.7 (Neuron SDK 2.33) \"removes the dynamic loop constructs deprecated in NKI 0.6.0\" "
                  "(\"Migrating from NKI 0.6.0 to NKI 0.7.0\"): \"Kernels that use nl.dynamic_range or while loops "
                  "with a virtual register must move to nki.language.fori_loop() and nki.language.while_loop()\"")


def _device_bound(b, loop: str, what: str) -> int:
    """A compiled loop's bound: an int or a register, read when the loop starts. fori_loop (2.33): "A bound
    must be 32-bit: the loop compiles into a compare-and-branch that has no 64-bit form"."""
    if isinstance(b, _core.VirtualRegister):
        return b._read(f"{loop} {what}")
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
        raise _core.EmulatorError(f"{loop} {what} must be an int or a VirtualRegister, got {type(b).__name__}")
    if not -2**31 <= int(b) < 2**31:
        raise _core.EmulatorError(f"{loop} {what} {int(b)} does not fit 32 bits (nki.language.fori_loop: \"A bound "
                                  f"must be 32-bit\")")
    return int(b)


def _compile_time_step(step, loop: str) -> None:
    if isinstance(step, _core.VirtualRegister) or isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise _core.EmulatorError(f"{loop} step must be a compile-time positive int, got {step!r}")


class _TracedOnce:
    """A compiled loop's body is traced once and the device repeats what was recorded, so every iteration
    issues the same instructions: one whose Python state changes what it issues (a counter, a list it grows)
    would run differently on the device. The pages say to "carry any other loop state through SBUF/HBM"
    (fori_loop, while_loop, 2.32 / 2.33); the emulator checks the instruction count of each iteration."""

    def __init__(self, loop: str):
        self.loop, self.issued = loop, None

    def run(self, body, *args):
        before = _core.issued_here()
        result = body(*args)
        issued = _core.issued_here() - before
        if self.issued is not None and issued != self.issued:
            raise _core.EmulatorError(
                f"{self.loop}: an iteration issued {issued} instructions, the first {self.issued}; the body is traced "
                f"once, so its loop state must live in SBUF/HBM (\"carry any other loop state through SBUF/HBM\"), "
                f"not in Python values")
        self.issued = issued
        _core.current_cost().dynamic_iterations += 1
        return result


def dynamic_range(start, stop=None, step=1):
    """A loop run by the device (NKI 0.6 and older; removed in 0.7, see REMOVED_IN_0_7): bounds are ints or
    VirtualRegisters, read when the loop starts; step a compile-time positive int. The loop variable is a
    register (usable as a scalar_offset, not as a Python int). Iterations are counted
    (Cost.dynamic_iterations); no page says what an iteration costs beyond its instructions."""
    if stop is None:
        start, stop = 0, start
    _compile_time_step(step, "dynamic_range")
    lo, hi = _device_bound(start, "dynamic_range", "start"), _device_bound(stop, "dynamic_range", "stop")
    for i in range(lo, hi, step):
        _core.current_cost().dynamic_iterations += 1
        yield _core.VirtualRegister(i)


def fori_loop(lower, upper, body_fun, step=1):
    """body_fun(i) for i in range(lower, upper, step), as a loop the device runs (nki.language.fori_loop, 2.32 /
    2.33): bounds ints or VirtualRegisters, read when the loop starts, 32-bit; "step size, must be a
    compile-time positive integer"; body "(i) -> None", i "passed by value", so writing to it changes nothing.
    From 2.33 "i is a NkiScalar unless either lower or upper is a VirtualRegister, then it will be a
    VirtualRegister" (2.32: always a VirtualRegister); NkiScalar is not emulated."""
    _compile_time_step(step, "fori_loop")
    if not callable(body_fun):
        raise _core.EmulatorError(f"fori_loop body_fun must be a function (i) -> None, got {type(body_fun).__name__}")
    by_register = any(isinstance(b, _core.VirtualRegister) for b in (lower, upper))
    if not by_register and _core.platform().sdk_release >= (2, 33):
        raise _core.EmulatorError("fori_loop with int bounds passes its body an NkiScalar from NKI 0.7 (\"i is a "
                                  "NkiScalar unless either lower or upper is a VirtualRegister\"); NkiScalar is "
                                  "not emulated: bound the loop by a VirtualRegister, or use a Python range")
    lo, hi = _device_bound(lower, "fori_loop", "lower"), _device_bound(upper, "fori_loop", "upper")
    traced = _TracedOnce("fori_loop")
    for i in range(lo, hi, step):
        if traced.run(body_fun, _core.VirtualRegister(i)) is not None:
            raise _core.EmulatorError("fori_loop body_fun returns None (\"function (i) -> None\"); carry loop "
                                      "state through SBUF/HBM")


def while_loop(init, body_fun):
    """r = init; while r != 0: r = body_fun(r), as a loop the device runs (nki.language.while_loop, 2.32 / 2.33):
    init a VirtualRegister, "checking the condition before each iteration"; the body gets r "passed by value"
    and returns "the next condition register"."""
    if not isinstance(init, _core.VirtualRegister):
        raise _core.EmulatorError(f"while_loop init must be a VirtualRegister (\"Initial condition register\"), "
                                  f"got {type(init).__name__}")
    if not callable(body_fun):
        raise _core.EmulatorError(f"while_loop body_fun must be a function (r) -> VirtualRegister, got "
                                  f"{type(body_fun).__name__}")
    condition = init._read("while_loop init")
    traced = _TracedOnce("while_loop")
    while condition != 0:
        following = traced.run(body_fun, _core.VirtualRegister(condition))
        if not isinstance(following, _core.VirtualRegister):
            raise _core.EmulatorError(f"while_loop body_fun must return the next condition register (a "
                                      f"VirtualRegister), got {type(following).__name__}")
        condition = following._read("while_loop condition")


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
