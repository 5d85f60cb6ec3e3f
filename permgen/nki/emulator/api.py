"""The modules the emulator registers as `nki`, `nki.language`, `nki.isa`, `nki.collectives`,
`nki.isa.constants` and `nki.typing`: exactly the documented NKI names it emulates, nothing else.

A documented name it does not emulate, and any name NKI does not document, raise `NotEmulated`
(an EmulatorError and an AttributeError, so `from nki.language import x` fails with it as well).
Names that one NKI release added or removed (BY_RELEASE) follow the Platform's SDK release: at SDK 2.33 (NKI
0.7, the default) `nl.dynamic_range` is refused with the migration guide's words. tests/test_nki_surface.py
checks these modules against the documented API of each release (tests/nki_api.json).

    from permgen.nki.emulator.api import language as nl, isa as nisa, collectives as ncc
"""

from __future__ import annotations

import types

from . import _core, collectives as _collectives, isa as _isa, language as _language


class NotEmulated(_core.EmulatorError, AttributeError):
    """A name the emulator does not provide: documented but not emulated, or not NKI."""


_DTYPES = ("bool_", "int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "float32", "bfloat16",
           "float8_e4m3", "float8_e4m3fn", "float8_e5m2")
_OPERATORS = ("add", "subtract", "multiply", "maximum", "minimum", "equal", "not_equal", "greater", "greater_equal",
              "less", "less_equal", "bitwise_and", "bitwise_or", "left_shift", "right_shift")

EMULATED = {
    "nki.language": _DTYPES + _OPERATORS + (
        "sbuf", "psum", "hbm", "private_hbm", "shared_hbm", "tile_size", "NkiTensor", "ndarray",
        "affine_range", "sequential_range", "static_range", "fori_loop", "while_loop",
        "program_id", "num_programs", "program_ndim"),
    "nki.isa": (
        "oob_mode", "dge_mode", "engine", "nc_version", "get_nc_version", "get_nc_sub_version",
        "dma_copy", "memset", "iota", "tensor_copy", "tensor_tensor", "tensor_scalar", "scalar_tensor_tensor",
        "tensor_reduce", "tensor_tensor_scan", "nc_matmul", "register_alloc", "register_load", "core_barrier"),
    "nki.isa.constants": ("oob_mode", "dge_mode"),
    "nki.collectives": ("ReplicaGroup", "all_to_all", "all_to_all_v", "rank_id"),
    "nki.typing": (),
}
# Names of one NKI release range only: name -> (first SDK release, first SDK release without it, why not).
# The Platform's sdk (nki_emulator.Platform, 2.33 by default) picks the surface a kernel sees.
BY_RELEASE = {
    "nki.language": {"dynamic_range": ((2, 29), (2, 33), _language.REMOVED_IN_0_7)},
}
_SOURCES = {"nki.language": _language, "nki.isa": _isa, "nki.isa.constants": _isa, "nki.collectives": _collectives}


def _module(name: str, names, source, submodules=()) -> types.ModuleType:
    module = types.ModuleType(name, f"{name} as permgen's NKI emulator provides it (see permgen.nki.emulator.api).")
    for n in names:
        setattr(module, n, getattr(source, n))
    for n, sub in submodules:
        setattr(module, n, sub)
    public = set(names) | {n for n, _ in submodules}

    by_release = BY_RELEASE.get(name, {})

    def __getattr__(attr):  # noqa: N807  (a module's attribute hook, PEP 562)
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr in by_release:
            if _released(name, attr):
                return getattr(source, attr)
            raise NotEmulated(f"{name}.{attr} is not in NKI on Neuron SDK {_core.platform().sdk}: "
                              f"{by_release[attr][2]}")
        raise NotEmulated(f"{name}.{attr} is not emulated by permgen's NKI emulator (it emulates the documented "
                          f"NKI names its kernels use; a name outside the NKI documentation is not NKI at all)")

    module.__getattr__ = __getattr__
    module.__dir__ = lambda: sorted(public | {n for n in by_release if _released(name, n)})
    module.__nki_emulator__ = True
    return module


def _released(module_name: str, attr: str) -> bool:
    first, gone, _ = BY_RELEASE[module_name][attr]
    return first <= _core.platform().sdk_release < gone


language = _module("nki.language", EMULATED["nki.language"], _language)
constants = _module("nki.isa.constants", EMULATED["nki.isa.constants"], _isa)
isa = _module("nki.isa", EMULATED["nki.isa"], _isa, submodules=[("constants", constants)])
isa.__path__ = []  # a package: `import nki.isa.constants` resolves through sys.modules
collectives = _module("nki.collectives", EMULATED["nki.collectives"], _collectives)
typing = _module("nki.typing", EMULATED["nki.typing"], None)

# sys.modules name -> module, for install().
MODULES = {"nki.language": language, "nki.isa": isa, "nki.isa.constants": constants, "nki.collectives": collectives,
           "nki.typing": typing}


def package(jit, simulate) -> types.ModuleType:
    """The `nki` package: jit, simulate and the submodules."""
    nki = types.ModuleType("nki", "NKI emulator (permgen.nki.emulator) registered as `nki`.")
    nki.__path__ = []  # a package, so `import nki.language` resolves through sys.modules
    nki.__nki_emulator__ = True
    nki.jit, nki.simulate = jit, simulate
    nki.language, nki.isa, nki.collectives, nki.typing = language, isa, collectives, typing
    public = {"jit", "simulate", "language", "isa", "collectives", "typing"}

    def __getattr__(attr):  # noqa: N807
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise NotEmulated(f"nki.{attr} is not emulated by permgen's NKI emulator")

    nki.__getattr__ = __getattr__
    nki.__dir__ = lambda: sorted(public)
    return nki
