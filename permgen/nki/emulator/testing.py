"""Helpers for testing generated NKI modules: load one on a backend, move tensors torch <-> NumPy."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from . import install, real_nki_available

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests use its generated/)
NKI_MODULE_NAMES = ("nki", "nki.language", "nki.isa", "nki.isa.constants", "nki.collectives", "nki.typing")
REAL_NKI = real_nki_available()
BACKENDS = ["emulator", "nki.simulate"]
NO_REAL_NKI = "the real `nki` package (AWS Neuron pip index) is not installed"

_WORDS = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16), torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
          torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype in _WORDS:
        word, np_dtype = _WORDS[t.dtype]
        return t.contiguous().view(word).numpy().view(np_dtype).copy()
    return t.numpy().copy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    for torch_dtype, (word, np_dtype) in _WORDS.items():
        if a.dtype == np.dtype(np_dtype):
            return torch.from_numpy(a.view(np.dtype(f"i{a.dtype.itemsize}") if word is torch.int16 else np.uint8).copy()).view(torch_dtype)
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: for exact comparison of moved data (NaN == NaN, -0 != 0)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@contextlib.contextmanager
def nki_modules_restored():
    """Put sys.modules' `nki` entries back as they were on leaving: install() replaces them."""
    saved = {k: sys.modules.get(k) for k in NKI_MODULE_NAMES}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


_cache: dict = {}


def load_variant(name: str, backend: str):
    """permgen.generated.nki.<name> running on the emulator or on the real nki.simulate."""
    if (name, backend) in _cache:
        return _cache[(name, backend)]
    if backend == "emulator" and REAL_NKI:
        # Import a private copy of the module while the emulator stands in for `nki`.
        with nki_modules_restored():
            install(force=True)
            spec = importlib.util.spec_from_file_location(f"_emulated_{name}", ROOT / "generated" / "nki" / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    else:
        if backend == "emulator":
            install()
        module = importlib.import_module(f"permgen.generated.nki.{name}")
    _cache[(name, backend)] = module
    return module
