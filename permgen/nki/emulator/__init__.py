"""A NumPy emulator of the NKI API subset permgen's generated kernels use.

The real compiler and simulator (`nki`, from the AWS Neuron package index) are not installable in
CI, so the generated NKI kernels are tested against this emulator instead. It runs a kernel as
plain Python over NumPy arrays and is as strict as the NKI documentation: tiles keep the hardware's
partition, SBUF and PSUM limits, fresh memory is poisoned, indirect DMA lanes that fall out of
bounds are an error unless the copy asks for `oob_mode.skip`, and rules that differ between
Trainium generations follow the Platform the kernel runs on (`on(Platform("trn3"))`; Trainium2
by default). Where no page says what the hardware does, it refuses with "not documented".

    from permgen.nki import emulator as nki_emulator
    nki_emulator.install()      # registers `nki`, `nki.language`, `nki.isa`, `nki.collectives`, ...
    import nki                  # ...only when the real package is not importable

`import nki` then gives the modules of `nki_emulator.api`: exactly the documented NKI names the
emulator emulates (NKI 0.7, Neuron SDK 2.33, by default; NKI 0.6 at Platform(sdk="2.32")), with their
documented parameters; any other name raises `api.NotEmulated`. API_CHECKED.md gives the page and sentence of every rule.

Kernels run when called with NumPy arrays (like `nki.simulate(kernel)(*arrays)`), returning NumPy
arrays; `simulate` mirrors the real entry point's signature. Kernels that call collectives run on
several ranks at once through `run_ranks(fn, rank_args)` (see `collectives`).

Logical NeuronCores (LNC). A kernel launches at the LNC the environment declares, as nki.jit
requires ("The LNC value must match the NEURON_LOGICAL_NC_CONFIG environment variable"):
`kernel(...)` and `nki.simulate(kernel)` run at LNC=1, `kernel[2](...)` and
`nki.simulate(kernel[2])` at LNC=2, and any other pairing fails. The environment is
NEURON_LOGICAL_NC_CONFIG, unset meaning 2 (Trn2's default); `on(Platform(lnc=1))` sets it for its
block. So host code launches `kernel[int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))]`.

At LNC=2 the kernel's program runs once per core, the two cores sharing HBM (kernel arguments and
`nl.shared_hbm` tensors; each core has its own SBUF, PSUM and `nl.private_hbm`). A kernel gets its
core id from `nl.program_id(0)` (0 or 1; 0 at LNC=1) and the core count from `nl.num_programs()`
(2; 1 at LNC=1), both Python ints, and splits its work with them:

    me, cores = nl.program_id(0), nl.num_programs()
    rows = n // cores
    ...                                  # this core writes out[me * rows:(me + 1) * rows]
    nisa.core_barrier(data=out, cores=(0, 1))
    ...                                  # now either core may read all of out

Reading shared HBM the other core wrote (or overwriting with different bytes what it wrote or
read) before an `nisa.core_barrier` on that tensor is a race, reported as an error; writing the
same bytes from both cores is not. Both cores must issue the same barriers, collectives and
shared_hbm allocations in the same order. A collective at LNC=2 is issued by both cores and runs
once for the rank (a rank is a logical core); publish what it reads and writes with a core_barrier
before it, and its outputs with one after it before reading them (no page says more; see `_cores`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys

import numpy as np

from . import _core, _cores, api, collectives, isa, language
from ._core import Cost, EmulatorError, Platform, Tensor
from .collectives import run_ranks

__all__ = ["Cost", "EmulatorError", "Platform", "jit", "on", "recording", "simulate", "install", "real_nki_available",
           "run_ranks", "api", "language", "isa", "collectives"]


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
    """An @nki.jit function. `kernel(...)` runs it at LNC=1, `kernel[2](...)` at LNC=2 (nki.jit: "The
    LNC (Logical NeuronCore) degree can be set at the callsite using bracket syntax: kernel[lnc](args).
    The default is LNC=1")."""

    def __init__(self, func, lnc: int | None = None):
        self.func = func
        self.lnc = lnc  # None: launched without brackets (LNC=1, no launch grid)
        functools.update_wrapper(self, func)

    def __getitem__(self, lnc) -> "Kernel":
        # lnc.rst: "The bracket syntax must contain only one number"; LNC "can only be set to 1 or 2".
        return Kernel(self.func, _core._check_lnc(lnc, f"{getattr(self.func, '__name__', 'kernel')}[...]"))

    def __call__(self, *args, **kwargs):
        return _run(self.func, args, kwargs, self.lnc)


def jit(fn=None, **kwargs):
    """@nki.jit or @nki.jit(...): the keyword options of the real decorator are accepted and ignored."""
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def simulate(kernel):
    """Mirror of `nki.simulate(kernel)` / `nki.simulate(kernel[2])`: a callable taking NumPy arrays and
    returning NumPy arrays, run at the kernel's LNC."""
    if isinstance(kernel, Kernel):
        return lambda *args, **kwargs: _run(kernel.func, args, kwargs, kernel.lnc)
    return lambda *args, **kwargs: _run(kernel, args, kwargs, None)


def _to_input(x, name: str):
    if isinstance(x, np.ndarray):
        if x.ndim == 0 or 0 in x.shape:
            raise EmulatorError(f"kernel argument {name} has shape {x.shape}: NKI tensors need positive dimensions")
        _core.as_dtype(x.dtype)
        # Kernels get their own copy in HBM, so a kernel that wrote its inputs cannot alter the caller's arrays.
        return Tensor._wrap(np.array(x, copy=True), _core.SHARED_HBM, name)
    if hasattr(x, "__array__") and not isinstance(x, (int, float, bool)):
        raise EmulatorError(f"kernel argument {name}: pass NumPy arrays (got {type(x).__name__})")
    return x


def _to_output(x):
    if isinstance(x, Tensor):
        if x.buffer is not _core.SHARED_HBM or not x._whole:
            raise EmulatorError(f"kernel outputs must be whole tensors allocated in nl.shared_hbm, got {x!r}")
        return x._array.copy()
    if isinstance(x, (tuple, list)):
        return type(x)(_to_output(v) for v in x)
    raise EmulatorError(f"kernels return tensors, got {type(x).__name__}")


def _run(func, args, kwargs, grid):
    name = getattr(func, "__name__", "?")
    lnc = 1 if grid is None else grid
    declared = _core.platform().logical_cores
    if lnc != declared:
        # nki.jit: "The LNC value must match the NEURON_LOGICAL_NC_CONFIG environment variable set for the
        # Neuron Runtime. Mismatching the two will cause a runtime error."
        raise EmulatorError(f"{name} launched with LNC={lnc}, but the environment declares LNC={declared} "
                            f"({_core.LNC_VARIABLE}): launch it as {name}[{declared}](...); nki.jit: the LNC "
                            f"value must match {_core.LNC_VARIABLE}")
    if _core.current() is not None:
        raise EmulatorError(f"{name}: a kernel cannot launch another kernel")
    _core.reset_ledger()
    cost = _core.begin_cost(name)
    args = [_to_input(a, f"#{i}") for i, a in enumerate(args)]
    kwargs = {k: _to_input(v, k) for k, v in kwargs.items()}
    if lnc == 1:
        _core.enter(_cores.Launch(1, grid_ndim=0 if grid is None else 1), 0)
        try:
            out = _to_output(func(*args, **kwargs))
        finally:
            _core.leave()
    else:
        out = _to_output(_run_cores(func, args, kwargs, lnc, cost))
    for runs in _core.recorders():
        runs.append(cost)
    return out


def _run_cores(func, args, kwargs, lnc: int, cost):
    """Run the kernel's program on `lnc` cores sharing HBM (see _cores), one thread each, taking turns."""
    launch = _cores.Launch(lnc)
    rank = collectives._rank_context()

    def core(c: int):
        collectives._enter_rank_context(rank)
        _core.reset_ledger()  # each core has its own SBUF and PSUM
        _core.set_cost(cost)  # one Cost for the launch: both cores' instructions
        _core.enter(launch, c)
        try:
            launch.wait_turn(c)
            result = func(*args, **kwargs)
            launch.sync(c, "the end of the kernel", last=True)
            return result
        finally:
            _core.leave()

    results = _core.run_threads(lnc, "nki-core", core, release=launch.fail,
                                where=lambda c: f"raised on core {c} of {lnc} (LNC={lnc})")
    if any(_same_outputs(results[0], r) is False for r in results[1:]):
        raise EmulatorError("the cores returned different tensors: at LNC > 1 every core returns the same "
                            "shared_hbm outputs")
    return results[0]


def _same_outputs(a, b) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_outputs(x, y) for x, y in zip(a, b))
    return a is b


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


def install(force: bool = False) -> bool:
    """Register the emulator as `nki` (and its submodules) unless the real package imports.

    Returns True when the emulator is what `import nki` now gives. `force=True` registers it even
    over the real package (tests use this to run the same kernels under both).
    """
    if not force and real_nki_available():
        return False
    sys.modules["nki"] = api.package(jit, simulate)
    sys.modules.update(api.MODULES)
    return True
