"""A model of torch-neuronx's NKI custom-op contract, for CPU tests (torch-neuronx installs only on a
Trainium host). It stands in for `torch_neuronx` the way nki_emulator stands in for `nki`:

    import fake_torch_neuronx
    fake = fake_torch_neuronx.install()     # `import torch_neuronx` now gives this module
    ...                                     # modules imported from here on register their ops with fake.nki_op
    fake_torch_neuronx.uninstall()

It models only what the Neuron documentation states, each rule with its page (SDK 2.33):

[QS]  "Quickstart: Run an NKI kernel from torch-neuronx",
      https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/get-started/quickstart-nki-kernel.html
[HOW] "How to work with NKI kernels from torch-neuronx",
      https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/how-to-work-with-nki.html
[PT]  PyTorch's custom-op contract that nki_op registrations follow (mutation and aliasing),
      https://docs.pytorch.org/tutorials/advanced/python_custom_ops_mutable.html

Rules:
1. torch-neuronx imports `nki` when it loads [QS, Prerequisites]: installing this module makes
   `import nki` work (the emulator where the real package is absent).
2. A kernel becomes a PyTorch custom operator through the decorator `nki_op("namespace::name",
   mutates_args=...)` over a Python function [QS, HOW]: the name must be namespace-qualified, the
   in-place updates must be declared in `mutates_args` [HOW], and the schema comes from the function's
   annotations (every parameter and the return annotated; torch.library.infer_schema refuses others).
   The returned operator takes `register_fake` and `register_autograd` [HOW: "add a backward pass"].
3. A call may write only the arguments declared in `mutates_args`, and returns no input (nor an alias
   of one or of another output) [HOW: declaring in-place updates; PT]: checked on every call by
   comparing the undeclared inputs' bytes before and after, and the outputs' storages.
4. An `@nki.jit` kernel called with tensors on a Neuron device is run by torch-neuronx, and eager
   mode compiles it when it is first called with a new combination of tensor shapes, dtypes and
   non-tensor argument values, reusing that compile for repeated combinations [HOW, "How NKI kernels
   run in torch-neuronx"]: inside `neuron_device()`, CPU tensors play Neuron tensors (permgen takes
   its Neuron path and calls the kernels on them), each such call records its `compile_key` (the
   distinct keys are what a Neuron host would compile) and runs in nki.simulate.
5. Training goes through `register_autograd` [HOW]: backward through an operator without it fails
   (torch.library raises; nothing is added here).
6. Under `torch.compile(backend="neuron")` each kernel call is a single node of the captured graph,
   compiled with the PyTorch operations around it [HOW]: the "neuron" backend registered here traces
   through AOTAutograd (forward and backward graphs, as training does), records every node that
   calls an nki_op in `graph_ops` (tests check each call is there as its own operator), and runs the
   graphs eagerly.

What it does not model: Neuron memory and devices (CPU tensors stand in; the kernels run in the
emulator), the Neuron compiler, and anything the pages above do not state.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
import types

import torch

__version__ = "2.14.0"  # the torch-neuronx release the SDK 2.33 quickstart requires, with PyTorch 2.14 [QS]
__fake_torch_neuronx__ = True

registered: dict = {}  # "ns::name" -> (python function, declared mutated argument names)
graph_ops: list = []  # (graph kind, op name) of every nki_op node the "neuron" backend compiled
_BACKEND_REGISTERED = False


class NeuronContractError(RuntimeError):
    """A use of nki_op that the torch-neuronx documentation rules out."""


# ---------------------------------------------------------------------------------------------
# Rule 2 and 3: nki_op
# ---------------------------------------------------------------------------------------------

def nki_op(name, *, mutates_args):
    """@nki_op("namespace::name", mutates_args=...) over an annotated function -> a torch custom operator."""
    if not isinstance(name, str) or name.count("::") != 1 or not all(name.split("::")):
        raise NeuronContractError(f"nki_op needs a namespace-qualified name 'namespace::name', got {name!r}")
    if isinstance(mutates_args, str) and mutates_args != "unknown":
        raise NeuronContractError(f"{name}: mutates_args is a collection of argument names, got {mutates_args!r}")

    def register(fn):
        params = inspect.signature(fn).parameters
        declared = set(mutates_args)
        unknown = declared - set(params)
        if unknown:
            raise NeuronContractError(f"{name}: mutates_args names {sorted(unknown)}, which are not arguments")

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            bound = inspect.signature(fn).bind(*args, **kwargs)
            kept = {k: _bytes(v) for k, v in bound.arguments.items()
                    if k not in declared and isinstance(v, torch.Tensor)}
            out = fn(*args, **kwargs)
            for k, before in kept.items():
                if not torch.equal(_bytes(bound.arguments[k]), before):
                    raise NeuronContractError(f"{name} wrote its argument {k!r}, which mutates_args does not declare")
            _check_no_alias(name, bound.arguments, out)
            return out

        checked.__signature__ = inspect.signature(fn)
        op = torch.library.custom_op(name, checked, mutates_args=tuple(mutates_args))
        registered[name] = (fn, frozenset(declared))
        return op

    return register


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone() if t.numel() else t.detach().clone()


def _check_no_alias(name, arguments, out):
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    ins = [a for a in arguments.values() if isinstance(a, torch.Tensor)]
    seen = set()
    for o in outs:
        if not o.numel():
            continue
        ptr = o.untyped_storage().data_ptr()
        if ptr in seen or any(i.numel() and i.untyped_storage().data_ptr() == ptr for i in ins):
            raise NeuronContractError(f"{name} returned a tensor that aliases an input or another output")
        seen.add(ptr)


# ---------------------------------------------------------------------------------------------
# Rule 4: what eager mode compiles
# ---------------------------------------------------------------------------------------------

def compile_key(kernel, args, static):
    """What a first eager call compiles for: the kernel, its tensors' shapes and dtypes, its other values."""
    tensors = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else ("value", a) for a in args)
    return getattr(kernel, "__name__", repr(kernel)), tensors, tuple(sorted(static.items()))


@contextlib.contextmanager
def neuron_device():
    """CPU tensors play Neuron tensors inside the block: permgen's NKI host calls the kernels on them
    directly, and a kernel called with torch tensors runs as torch-neuronx would run it (here through
    nki.simulate, in the emulator). Yields the list of compile keys of those calls, in order;
    len(set(keys)) is how many compiles a Neuron host would make. Needs the emulator as `nki`."""
    from permgen.nki import emulator as nki_emulator
    from permgen.nki import custom_ops as neuron_ops
    from permgen.nki import host as nki_host

    if nki_emulator.real_nki_available():
        raise NeuronContractError("neuron_device() runs kernels in the emulator; the real nki is installed here")
    keys = []
    real_call, real_devices = nki_emulator.Kernel.__call__, neuron_ops.NEURON_DEVICES

    def call(kernel, *args, **kwargs):
        if not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            return real_call(kernel, *args, **kwargs)
        keys.append(compile_key(kernel, args, kwargs))
        convert = lambda a: nki_host.to_kernel(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
        outs = nki_emulator.simulate(kernel)(*map(convert, args), **{k: convert(v) for k, v in kwargs.items()})
        if isinstance(outs, (tuple, list)):
            return tuple(nki_host.from_kernel(o) for o in outs)
        return nki_host.from_kernel(outs)

    nki_emulator.Kernel.__call__ = call
    neuron_ops.NEURON_DEVICES = (*real_devices, "cpu")
    try:
        yield keys
    finally:
        nki_emulator.Kernel.__call__ = real_call
        neuron_ops.NEURON_DEVICES = real_devices


# ---------------------------------------------------------------------------------------------
# Rule 6: torch.compile(backend="neuron")
# ---------------------------------------------------------------------------------------------

def _nki_op_nodes(gm: torch.fx.GraphModule, kind: str):
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        op = getattr(target, "_schema", None)
        if op is None:
            continue
        if op.name in registered:
            graph_ops.append((kind, op.name))


def _compiler(kind):
    def compile_graph(gm, example_inputs):
        from functorch.compile import make_boxed_func

        _nki_op_nodes(gm, kind)
        return make_boxed_func(gm.forward)

    return compile_graph


def _register_backend():
    global _BACKEND_REGISTERED
    if _BACKEND_REGISTERED:
        return
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.registry import register_backend

    register_backend(name="neuron")(aot_autograd(fw_compiler=_compiler("forward"), bw_compiler=_compiler("backward")))
    _BACKEND_REGISTERED = True


# ---------------------------------------------------------------------------------------------
# Installation
# ---------------------------------------------------------------------------------------------

def real_torch_neuronx_available() -> bool:
    """True where the real torch-neuronx is installed (then this model must not stand in for it)."""
    module = sys.modules.get("torch_neuronx")
    if module is not None:
        return not getattr(module, "__fake_torch_neuronx__", False)
    return importlib.util.find_spec("torch_neuronx") is not None


def install() -> types.ModuleType:
    """Make `import torch_neuronx` give this module (and `import nki` work: rule 1). Refused where
    the real torch-neuronx is installed."""
    if real_torch_neuronx_available():
        raise NeuronContractError("the real torch-neuronx is installed: the model does not replace it")
    from permgen.nki import emulator as nki_emulator

    nki_emulator.install()
    _register_backend()
    module = sys.modules[__name__]
    sys.modules["torch_neuronx"] = module
    return module


def uninstall():
    if getattr(sys.modules.get("torch_neuronx"), "__fake_torch_neuronx__", False):
        del sys.modules["torch_neuronx"]
