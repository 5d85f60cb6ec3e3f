"""The NKI target's custom ops, registered the way torch-neuronx documents it for NKI kernels.

On a Trainium host (torch-neuronx imports) every op of an NKI variant is defined with
`torch_neuronx.nki_op(name, mutates_args=...)` over an annotated Python function, as the Neuron
guide "How to work with NKI kernels from torch-neuronx" (SDK 2.33) and its quickstart describe:
the op's schema is inferred from the function's annotations, no op writes its inputs (nothing is
declared in `mutates_args`), and the op layer (`permgen.core.oplayer`) then adds the fake implementation
and `register_autograd` on the object `nki_op` returns, exactly as for the Triton target's
`torch.library.custom_op`. Without torch-neuronx the same functions are plain
`torch.library.custom_op`s (CPU tensors, kernels through nki.simulate or the emulator).

permgen's ops are declared with schema strings (`permgen.core.ops`); `prototype` turns one into the
annotated signature `nki_op` infers it back from, so both targets register the same schema.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import Optional

import torch

# torch.device types of Neuron tensors: "neuron" under TorchNeuron (torch-neuronx 2.14, SDK 2.33); "xla" under
# the earlier torch-xla based torch-neuronx, where an @nki.jit kernel called on XLA tensors also runs on the device.
NEURON_DEVICES = ("neuron", "xla")

# Schema argument types permgen's ops use -> the annotation torch.library.infer_schema maps back to them.
_ANNOTATIONS = {"Tensor": torch.Tensor, "Tensor?": Optional[torch.Tensor], "SymInt": int, "SymInt?": Optional[int],
                "bool": bool, "ScalarType": torch.dtype, "str": str}


def torch_neuronx():
    """The torch_neuronx module where it imports (a Trainium host), else None."""
    try:
        return importlib.import_module("torch_neuronx")
    except ImportError:
        return None


def is_neuron(t: torch.Tensor) -> bool:
    return t.device.type in NEURON_DEVICES


def prototype(impl, schema: str):
    """A function calling impl whose signature carries the schema's argument and return types."""
    args, returns = re.fullmatch(r"\((.*)\) -> (.*)", schema).groups()
    params = []
    for arg in args.split(", "):
        kind, name = arg.rsplit(" ", 1)
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_ANNOTATIONS[kind]))
    outs = [r.split(" ")[0] for r in returns.strip("()").split(", ")]
    ret = torch.Tensor if len(outs) == 1 else tuple.__class_getitem__(tuple(_ANNOTATIONS[o] for o in outs))

    @functools.wraps(impl)
    def op(*a, **k):
        return impl(*a, **k)

    op.__signature__ = inspect.Signature(params, return_annotation=ret)
    op.__annotations__ = {p.name: p.annotation for p in params} | {"return": ret}
    return op


def define_op(qualname: str, impl, schema: str):
    """Define one NKI op: through torch_neuronx.nki_op where torch-neuronx imports, else torch.library.
    Returns the custom op object (it has register_fake and register_autograd)."""
    neuronx = torch_neuronx()
    if neuronx is None:
        return torch.library.custom_op(qualname, impl, mutates_args=(), schema=schema)
    return neuronx.nki_op(qualname, mutates_args=())(prototype(impl, schema))
