"""The op layer: how every op family of permgen registers its torch.library ops, keeps its argument
checks, routes a call and differentiates, written once. The families: permute / unpermute of each
variant and the chunk sort (permgen.core.ops), expert parallelism's dispatch / combine (permgen.ep),
the gather GEMM (permgen.triton.gemm) and the FP8 expert MLP (permgen.layers.fp8_mlp).

A family subclasses `OpFamily` and declares its ops, each an `Op`: its implementation, fake
implementation, schema and, when it is differentiable, its backward formula and setup_context:

    class GatherOps(OpFamily):
        def __init__(self, ops):
            super().__init__(ops.prefix)            # op names: permgen::<prefix>_<op>
        def declare(self):
            return {"gather_gemm": Op(self._gemm, self._gemm_fake, "(Tensor tokens, ...) -> Tensor",
                                      backward=self._gemm_backward, setup=self._gemm_setup),
                    "gather_rows": Op(self._rows, self._rows_fake, "(Tensor tokens, Tensor rows) -> Tensor")}

Ops are defined on a family's first call that needs them (under torch.compile, or with autograd),
never at import. A call then takes one of three routes (`OpFamily.calls`): under torch.compile the
ops (`family.op`: their registered autograd and fake implementations make each one opaque node);
eagerly, when a gradient can flow, the same formulas as autograd.Functions over the implementations
(`family.eager`: the dispatcher's custom-op path costs the host a few times more per call); else
None, and the family calls its implementation (or its backend) directly. Every route runs the same
implementation on the same arguments, so results are identical.

Backward formulas call the ops they need through `ctx.calls[name]`: the ops under torch.compile,
the implementations in an eager backward pass, and in an eager backward pass that builds a graph
(`create_graph=True`) differentiable calls again: the eager functions of ops that declare a
backward, and for the others their implementation behind a node that raises "differentiating
twice" if a second backward pass ever reaches it (`refuse_twice`). An op declared without a backward
gets that refusal as its registered autograd too. So a second derivative is either computed (the
family declares the backward ops' own backward) or refused; never a gradient silently without its
graph. autograd.Functions of a family's own (expert parallelism's eager dispatch) wrap their
backward in `backward_refusing_twice`.

The argument-check memo: `OpFamily.checked(what, key_of, check, *args)` runs `check(*args)` once per key
(what the checks read: the tensors' shapes, dtypes, devices and contiguity, the other arguments'
values: `args_key`, or a family's own key) and keeps its value (a plan, or that they
passed) in `CHECKS`, one bounded LRU for the process.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Callable, NamedTuple, Optional

import torch

NAMESPACE = "permgen"
MEMO_SIZE = 1024  # checked calls kept (CHECKS), for every family together

# Op name prefixes taken in this process, kept on torch's namespace object so that every copy of this
# runtime shares them (a vendored file inlines its own): two copies never define the same name, nor
# reuse one whose copy was freed (torch.ops would hand back that op's stale handle).
_TAKEN = getattr(torch.ops, NAMESPACE).__dict__.setdefault("_permgen_prefixes_taken", set())


def take_prefix(*parts: str) -> str:
    """A new op name prefix `<part>_<part>...` (e.g. `<target>_<variant>`); a second family asking for
    the same one (a vendored copy, a test's own spec) gets a numbered prefix, since an op name can be
    registered only once per process."""
    prefix = base = "_".join(parts)
    number = 1
    while prefix in _TAKEN:
        number += 1
        prefix = f"{base}_{number}"
    _TAKEN.add(prefix)
    return prefix


def define_op(qualname: str, impl, schema: str):
    """torch.library's custom op (the default definer; the NKI target passes its own: permgen.nki.custom_ops)."""
    return torch.library.custom_op(qualname, impl, mutates_args=(), schema=schema)


class Op(NamedTuple):
    """One op of a family. backward(ctx, *grads) returns a gradient (or None) per input and calls
    other ops through ctx.calls[name]; setup(ctx, inputs, output) saves what it needs. An op without
    a backward is differentiated by no one: it runs inside backward passes (or takes no gradient)."""

    impl: Callable
    fake: Callable
    schema: str
    backward: Optional[Callable] = None
    setup: Optional[Callable] = None


# ---------------------------------------------------------------------------------------------
# The eager autograd fast path
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def fast_apply_parts():
    """(the C++ apply of autograd.Function subclasses, the test of whether a functorch transform is
    active) where this torch has them and they behave as expected on a probe; else None, and
    eager_apply falls back to Function.apply. Private torch API: looked up once, on first use."""
    try:
        node_apply = torch._C._FunctionBase.__dict__["apply"]
        transforms_active = torch._C._are_functorch_transforms_active
        if transforms_active() is not False:
            return None

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, factor):
                ctx.factor = factor
                return x * factor

            @staticmethod
            def backward(ctx, grad):
                return grad * ctx.factor, None

        x = torch.ones(2, requires_grad=True)
        out = node_apply.__get__(None, Probe)(x, 3.0)
        (grad,) = torch.autograd.grad(out.sum(), x)
        if out.tolist() != [3.0, 3.0] or grad.tolist() != [3.0, 3.0]:
            return None
    except Exception:  # any change of those internals: the public path
        return None
    return node_apply, transforms_active


def eager_apply(function):
    """function.apply (an autograd.Function subclass), without Function.apply's Python layer where no
    functorch transform is active: that layer's per-call work (binding default arguments, unwrapping
    tensors that escaped a finished transform) costs the host more than the autograd node itself, and
    permgen's functions take only what permgen's own code passes. Where this torch lacks the private
    API that needs (fast_apply_parts), Function.apply itself."""
    parts = fast_apply_parts()
    if parts is None:
        return function.apply
    node_apply, transforms_active = parts
    apply, fast = function.apply, node_apply.__get__(None, function)

    def eager_apply_(*args):
        return apply(*args) if transforms_active() else fast(*args)

    return eager_apply_


# ---------------------------------------------------------------------------------------------
# Second derivatives: computed where a family declares them, else refused
# ---------------------------------------------------------------------------------------------

def twice_error(where: str) -> RuntimeError:
    return RuntimeError(f"{where}: differentiating twice is not supported here: this gradient was computed by "
                        "a backward pass with no derivative of its own (a second backward pass, as "
                        "torch.autograd.grad(..., create_graph=True) sets up, reached it)")


class _Refused(torch.autograd.Function):
    """Passes tensors through; differentiating them raises (refuse_twice)."""

    @staticmethod
    def forward(ctx, where, count, *tensors):
        ctx.where = where
        return tensors[:count]

    @staticmethod
    def backward(ctx, *grads):
        raise twice_error(ctx.where)


def refuse_twice(where: str, outputs, sources):
    """outputs (a tensor, or a tuple of tensors and Nones), computed from sources by code autograd does
    not see, in a backward pass. Where a second backward pass could differentiate them (grad mode is on,
    as in a backward pass with create_graph=True, and a source requires grad), they come back attached
    to a node that raises "differentiating twice" when that pass reaches it; else as they are."""
    if not torch.is_grad_enabled():
        return outputs
    needed = [s for s in sources if isinstance(s, torch.Tensor) and s.requires_grad]
    if not needed:
        return outputs
    single = isinstance(outputs, torch.Tensor)
    outs = (outputs,) if single else tuple(outputs)
    at = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())]
    if not at:
        return outputs
    passed = _Refused.apply(where, len(at), *(outs[i] for i in at), *needed)
    outs = list(outs)
    for i, t in zip(at, passed):
        outs[i] = t
    return outs[0] if single else tuple(outs)


def backward_refusing_twice(where: str):
    """Decorator for the backward of an autograd.Function whose formula has no derivative of its own
    (it runs kernels): in a backward pass with create_graph=True its gradients refuse a second one
    (refuse_twice) instead of coming back without a graph."""

    def decorate(backward):
        @functools.wraps(backward)
        def backward_(ctx, *grads):
            if not torch.is_grad_enabled():
                return backward(ctx, *grads)
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            return refuse_twice(where, outputs, (*grads, *ctx.saved_tensors))

        return backward_

    return decorate


def _refusal(where):
    def backward(ctx, *grads):
        raise twice_error(where)

    return backward


def _refusing(where, impl):
    def call(*args):
        return refuse_twice(where, impl(*args), args)

    return call


# ---------------------------------------------------------------------------------------------
# The argument-check memo
# ---------------------------------------------------------------------------------------------

class CheckMemo:
    """What calls' checks gave (a plan, or True: they passed), kept by what they read; at most `size`,
    the least recently used dropped first."""

    def __init__(self, size: int = MEMO_SIZE):
        self.size = size
        self.kept = OrderedDict()  # key -> value, the least recently used first

    def get(self, key):
        """The value kept under key, or None (also for an unhashable key's TypeError: raised)."""
        kept = self.kept
        value = kept.get(key)
        if value is not None:
            try:
                kept.move_to_end(key)
            except KeyError:  # dropped meanwhile by another thread
                pass
        return value

    def put(self, key, value):
        kept = self.kept
        kept[key] = value
        kept.move_to_end(key)
        while len(kept) > self.size:
            kept.popitem(last=False)

    def __len__(self):
        return len(self.kept)

    def __contains__(self, key):
        return key in self.kept

    def clear(self):
        self.kept.clear()


CHECKS = CheckMemo()  # every family's checked calls


def args_key(*args) -> tuple:
    """What checks of these arguments read, as a key: each tensor's shape, dtype, device and contiguity,
    every other argument's type and value (True and 1 differ)."""
    return tuple([(a.shape, a.dtype, a.device, a.is_contiguous()) if isinstance(a, torch.Tensor) else (type(a), a)
                  for a in args])


def call_key(tensors, settings) -> tuple:
    """What a call's checks read, as a key: each tensor's shape, dtype, device and contiguity (None when
    absent), then the settings and their types (True and 1 differ). Raises AttributeError for what is
    not a tensor."""
    return (*(None if t is None else (t.shape, t.dtype, t.device, t.is_contiguous()) for t in tensors),
            *settings, *map(type, settings))


# ---------------------------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------------------------

_FAMILIES = {}  # key -> OpFamily: registered() takes a string, which Dynamo passes as a constant


def registered(key: str) -> bool:
    """Register the ops of the family with this key on its first call that needs them. Under
    torch.compile this runs while Dynamo traces, as plain Python (no op can be defined from traced
    code); the handles are read only after it. Its argument is a string because Dynamo (torch 2.11)
    calls a constant-result function only with constant arguments."""
    family = _FAMILIES[key]
    if not family.is_registered:
        family.register()
    return True


# What torch.compiler.assume_constant_result(registered) sets, set without importing Dynamo, which
# would add seconds to every import of a variant (tests/test_oplayer.py checks the two agree).
registered._dynamo_marked_constant = True


class OpFamily:
    """A family of custom ops named `permgen::<prefix>_<op>`, defined on first use (declare), with their
    eager autograd functions, call routing (calls) and argument-check memo (checked).

    prefix: the family's op name prefix (take_prefix for a new one; a family may share another's, as
    long as their op names differ). define(qualname, impl, schema): defines one op (define_op)."""

    def __init__(self, prefix: str, define=None):
        self.prefix = prefix
        self.define = define_op if define is None else define
        self.is_registered = False
        self._op, self._eager, self._custom_ops, self._impl, self._twice = {}, {}, {}, {}, {}
        self._key = f"{prefix}#{len(_FAMILIES)}"
        _FAMILIES[self._key] = self

    def declare(self) -> dict:
        """{op name: Op}: the family's ops; called once, on first use."""
        raise NotImplementedError

    @property
    def op(self) -> dict:
        """{op name: OpOverload}, the cheapest handle to call."""
        registered(self._key)
        return self._op

    @property
    def eager(self) -> dict:
        """{op name: apply}: the ops with a backward as autograd.Functions over the implementations."""
        registered(self._key)
        return self._eager

    @property
    def custom_ops(self) -> dict:
        """{op name: torch.library CustomOpDef} (opcheck takes these)."""
        registered(self._key)
        return self._custom_ops

    def calls(self, *inputs) -> Optional[dict]:
        """The route of a call whose differentiable inputs are `inputs` (tensors or None): the ops under
        torch.compile; the eager autograd functions when a gradient can flow; else None: the caller
        runs the implementation directly (the plain call costs the host the least)."""
        if torch.compiler.is_compiling():
            return self.op
        if torch.is_grad_enabled():
            for t in inputs:
                if t is not None and t.requires_grad:
                    return self.eager
        return None

    def checked(self, what: str, key_of, check, *args):
        """check(*args), whose value (a plan; None: the checks passed) is kept by what they read,
        key_of(*args) (a tuple: args_key, or a family's own built with call_key), in CHECKS: a call like
        one already checked costs a lookup. Under torch.compile the checks run as written (traced once
        per graph; Dynamo must not read the memo, it would guard on it). A key that cannot be made (an
        argument of the wrong type: key_of raises AttributeError or TypeError) or hashed leaves the
        checks to say what is wrong."""
        if torch.compiler.is_compiling():
            return check(*args)
        kept = CHECKS.kept
        try:
            key = (self.prefix, what, key_of(*args))
            value = kept.get(key)
        except (AttributeError, TypeError):
            return check(*args)
        if value is None:
            value = check(*args)
            CHECKS.put(key, True if value is None else value)
            return value
        try:
            kept.move_to_end(key)
        except KeyError:  # dropped meanwhile by another thread
            pass
        return value

    def register(self):
        """Define the declared ops, their fake implementations and autograd (see the module docstring)."""
        ns = getattr(torch.ops, NAMESPACE)
        declared = self.declare()
        for name, op in declared.items():
            qualname = f"{NAMESPACE}::{self.prefix}_{name}"
            custom = self.define(qualname, op.impl, op.schema)
            custom.register_fake(op.fake)
            self._custom_ops[name] = custom
            self._impl[name] = op.impl
            self._op[name] = getattr(ns, f"{self.prefix}_{name}").default
        for name, op in declared.items():
            custom, qualname = self._custom_ops[name], f"{NAMESPACE}::{self.prefix}_{name}"
            if op.backward is None:
                custom.register_autograd(_refusal(qualname))
                self._twice[name] = _refusing(qualname, op.impl)
            else:
                custom.register_autograd(op.backward, setup_context=self._op_setup(op.setup))
                self._eager[name] = self._twice[name] = eager_apply(self._eager_function(name, op))
        self.is_registered = True

    def _op_setup(self, setup):
        def setup_context(ctx, inputs, output):
            if setup is not None:
                setup(ctx, inputs, output)
            ctx.calls = self._op

        return setup_context

    def _eager_function(self, name, op):
        """The op's formula as an autograd.Function over its implementation."""
        impl, setup, backward, family = op.impl, op.setup, op.backward, self

        class Eager(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                output = impl(*args)
                if setup is not None:
                    setup(ctx, args, output)
                return output

            @staticmethod
            def backward(ctx, *grads):
                # create_graph=True turns grad mode on: then the backward's own calls must be differentiable
                ctx.calls = family._twice if torch.is_grad_enabled() else family._impl
                return backward(ctx, *grads)

        Eager.__name__ = f"{self.prefix}_{name}"
        return Eager
