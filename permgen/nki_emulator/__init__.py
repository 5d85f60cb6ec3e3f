"""A NumPy emulator of the NKI API subset permgen's generated kernels use.

The real compiler and simulator (`nki`, from the AWS Neuron package index) are not installable in
CI, so the generated NKI kernels are tested against this emulator instead. It runs a kernel as
plain Python over NumPy arrays and is as strict as the NKI documentation: tiles keep the hardware's
partition, SBUF and PSUM limits, fresh memory is poisoned, indirect DMA lanes that fall out of
bounds are an error unless the copy asks for `oob_mode.skip`, and rules that differ between
Trainium generations follow the Platform the kernel runs on (`on(Platform("trn3"))`; Trainium2
by default).

    from permgen import nki_emulator
    nki_emulator.install()      # registers `nki`, `nki.language`, `nki.isa`, `nki.collectives`
    import nki                  # ...only when the real package is not importable

Kernels run when called with NumPy arrays (like `nki.simulate(kernel)(*arrays)`), returning NumPy
arrays; `simulate` mirrors the real entry point's signature. Kernels that call collectives run on
several ranks at once through `run_ranks(fn, rank_args)` (see `collectives`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types

import numpy as np

from . import _core, collectives, isa, language
from ._core import Cost, EmulatorError, Platform, Tensor
from .collectives import run_ranks

__all__ = ["Cost", "EmulatorError", "Platform", "jit", "on", "recording", "simulate", "install", "real_nki_available",
           "run_ranks", "language", "isa", "collectives"]


@contextlib.contextmanager
def on(platform: Platform):
    """Run the kernels inside the block on `platform` (default outside: Trainium2):

        with nki_emulator.on(nki_emulator.Platform("trn3")):
            nki.simulate(kernel)(*arrays)
    """
    _core.push_platform(platform)
    try:
        yield platform
    finally:
        _core.pop_platform()


class Kernel:
    """An @nki.jit function. Calling it runs the kernel in the emulator."""

    def __init__(self, func):
        self.func = func
        functools.update_wrapper(self, func)

    def __call__(self, *args, **kwargs):
        return _run(self.func, args, kwargs)


def jit(func=None, **options):
    """@nki.jit or @nki.jit(...): the options of the real decorator are accepted and ignored."""
    if func is None:
        return lambda f: Kernel(f)
    return Kernel(func)


def simulate(kernel):
    """Mirror of `nki.simulate(kernel)`: a callable taking NumPy arrays and returning NumPy arrays."""
    func = kernel.func if isinstance(kernel, Kernel) else kernel
    return lambda *args, **kwargs: _run(func, args, kwargs)


def _to_input(x, name: str):
    if isinstance(x, np.ndarray):
        if x.ndim == 0 or 0 in x.shape:
            raise EmulatorError(f"kernel argument {name} has shape {x.shape}: NKI tensors need positive dimensions")
        _core.as_dtype(x.dtype)
        # Kernels get their own copy in HBM, so a kernel that wrote its inputs cannot alter the caller's arrays.
        return Tensor(np.array(x, copy=True), _core.SHARED_HBM, name)
    if hasattr(x, "__array__") and not isinstance(x, (int, float, bool)):
        raise EmulatorError(f"kernel argument {name}: pass NumPy arrays (got {type(x).__name__})")
    return x


def _to_output(x):
    if isinstance(x, Tensor):
        if x.buffer is not _core.SHARED_HBM or not x.whole:
            raise EmulatorError(f"kernel outputs must be whole tensors allocated in nl.shared_hbm, got {x!r}")
        return x.array.copy()
    if isinstance(x, (tuple, list)):
        return type(x)(_to_output(v) for v in x)
    raise EmulatorError(f"kernels return tensors, got {type(x).__name__}")


def _run(func, args, kwargs):
    _core.reset_ledger()
    cost = _core.begin_cost(getattr(func, "__name__", "?"))
    args = [_to_input(a, f"#{i}") for i, a in enumerate(args)]
    kwargs = {k: _to_input(v, k) for k, v in kwargs.items()}
    out = _to_output(func(*args, **kwargs))
    for runs in _core.recorders():
        runs.append(cost)
    return out


@contextlib.contextmanager
def recording():
    """Collect the Cost (instructions, indirect DMAs, DMA bytes, dynamic loop iterations) of every
    kernel run on this thread inside the block:

        with nki_emulator.recording() as runs:
            nki.simulate(kernel)(*arrays)
        runs[0].instructions
    """
    runs: list = []
    _core.recorders().append(runs)
    try:
        yield runs
    finally:
        active = _core.recorders()
        del active[next(i for i, r in enumerate(active) if r is runs)]


def real_nki_available() -> bool:
    """True when the real `nki` package (not this emulator) can be imported."""
    module = sys.modules.get("nki")
    if module is not None:
        return not getattr(module, "__nki_emulator__", False)
    return importlib.util.find_spec("nki") is not None


def _facade() -> types.ModuleType:
    nki = types.ModuleType("nki", "NKI emulator (nki_emulator) registered as `nki`.")
    nki.__nki_emulator__ = True
    nki.__path__ = []  # a package, so `import nki.language` resolves through sys.modules
    nki.jit, nki.simulate = jit, simulate
    nki.language, nki.isa, nki.collectives = language, isa, collectives
    return nki


def install(force: bool = False) -> bool:
    """Register the emulator as `nki` (and its submodules) unless the real package imports.

    Returns True when the emulator is what `import nki` now gives. `force=True` registers it even
    over the real package (tests use this to run the same kernels under both).
    """
    if not force and real_nki_available():
        return False
    sys.modules["nki"] = _facade()
    sys.modules["nki.language"] = language
    sys.modules["nki.isa"] = isa
    sys.modules["nki.collectives"] = collectives
    return True
