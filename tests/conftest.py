"""Shared test set-up: run Triton kernels through the interpreter when there is no GPU."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit function is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def _poison(t):
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        t.view(torch.uint8).fill_(0x7F)  # NaN in both fp8 formats
    elif t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)
    return t


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty / empty_like the kernels' host code makes starts as NaN or a huge int."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(real_empty_like(*a, **k)))
