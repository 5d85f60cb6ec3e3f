"""Shared test set-up: run Triton kernels through the interpreter when there is no GPU, poison
fresh allocations, and a replayable hypothesis profile."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from cases import EMULATED_EXAMPLES, HAS_CUDA, bits, poison  # noqa: E402

if not HAS_CUDA:
    # Must be set before any @triton.jit function is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_patch  # noqa: E402

    interpreter_patch.install()

# Property tests replay: examples derive from the test, not from a clock; no deadline, since an
# interpreted kernel's first call compiles nothing but still takes its time. The profile's example
# count is the emulated one (cases.py); tests of natively run kernels ask for more.
settings.register_profile(
    "permgen",
    derandomize=True,
    deadline=None,
    max_examples=EMULATED_EXAMPLES,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    database=None,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "permgen"))

# The files of the longest tests, longest first. They start first, so that under pytest-xdist no
# worker is still in one of them when the others run out of tests.
SLOW_FIRST = ("test_ep.py", "test_properties.py", "test_compile.py", "test_axis_matrix.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: file order otherwise


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty / empty_like the kernels' host code makes starts as NaN or a huge int."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


@pytest.fixture
def guarded_empty(monkeypatch):
    """As poisoned_empty for torch.empty, and each tensor it makes is the front of a buffer five
    times its size whose rest is poisoned too. The fixture's value, called, fails the test if any
    of that rest changed: a kernel wrote past the end of a tensor it was handed."""
    real_empty = torch.empty
    buffers = []

    def empty(*size, **kwargs):
        shape = torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size)
        buffer = poison(real_empty(5 * shape.numel() + 16, **kwargs))
        buffers.append((buffer, shape.numel(), buffer[shape.numel():].clone()))
        return buffer[:shape.numel()].view(shape)

    monkeypatch.setattr(torch, "empty", empty)

    def check():
        for buffer, numel, rest in buffers:
            assert torch.equal(bits(buffer[numel:].cpu()), bits(rest.cpu())), "a kernel wrote past a tensor's end"

    return check
