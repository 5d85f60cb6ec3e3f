"""The NKI variants behind the same torch API as the Triton ones, and their ops registered the way
torch-neuronx documents it (modelled by tests/fake_torch_neuronx.py; torch-neuronx installs only on
a Trainium host).

- every variant's ops go through `torch_neuronx.nki_op` when torch_neuronx imports, with the same
  schemas as the Triton module's ops;
- permute's backward pass (token and prob gradients) agrees with the Triton variant's for every
  variant (forward data, row maps, unpermute and its gradients: test_nki_triton_parity.py;
  signatures and errors: test_bad_inputs.py);
- permute -> experts -> unpermute compiles with torch.compile(backend="neuron", fullgraph=True),
  forward and backward, each kernel call one node of its own op, bit-identical to eager;
- calls through the dispatcher keep the nki_op contract (no undeclared writes, no aliasing);
- on Neuron tensors (CPU tensors standing in, kernels called on them as torch-neuronx runs them) the
  results are the CPU path's bit for bit;
- eager compiles (a kernel per distinct shapes, dtypes and static values): one per capacity with
  num_out_tokens; without it, new row counts reuse the power-of-two capacity's compile.

NKI kernels run on CPU tensors in the emulator (nki.simulate where the real `nki` imports); Triton
under TRITON_INTERPRET=1. Shapes are small.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch

import fake_torch_neuronx
from cases import (
    DEVICE,
    Case,
    PROB_GRAD_TOL,
    assert_bits_equal,
    assert_sum_close,
    generator_for,
    is_fp8,
    load,
    make_inputs,
    needed_rows,
    random_like,
    resizable,
    to_device,
    variants_for,
)
from test_nki_kernels import generation_for

ROOT = Path(__file__).resolve().parent.parent
NKI_VARIANTS = variants_for("nki")
BOTH = sorted(set(variants_for("triton")) & set(NKI_VARIANTS))
CASE = Case("torch", N=13, H=40, E=4, k=2, ragged=True)
_COPIES = {}


@pytest.fixture(scope="module")
def neuron():
    """torch_neuronx (the model) installed for this module's tests, removed afterwards. Where the real
    torch-neuronx is installed these tests, which check the model's rules on CPU tensors, skip."""
    if fake_torch_neuronx.real_torch_neuronx_available():
        pytest.skip("the real torch-neuronx is installed; these tests run its model on CPU tensors")
    module = fake_torch_neuronx.install()
    yield module
    fake_torch_neuronx.uninstall()


@pytest.fixture
def neuron_device(neuron):
    """CPU tensors standing in for Neuron tensors (the kernels then run in the emulator)."""
    from permgen.nki import emulator as nki_emulator

    if nki_emulator.real_nki_available():
        pytest.skip("the real nki is installed; the Neuron-tensor model runs kernels in the emulator")
    return fake_torch_neuronx.neuron_device


def neuron_module(name):
    """A fresh import of the generated NKI module of `name`, made while torch_neuronx imports: its ops
    are registered through torch_neuronx.nki_op (a module imported earlier registered them without)."""
    if name not in _COPIES:
        spec = importlib.util.spec_from_file_location(f"neuron_{name}", ROOT / "generated" / "nki" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _COPIES[name] = module
    return _COPIES[name]


def _unqualified(schema) -> str:
    """An op's schema without its name and return names: what both targets must share."""
    args = ", ".join(f"{a.type} {a.name}" for a in schema.arguments)
    returns = ", ".join(str(r.type) for r in schema.returns)
    return f"({args}) -> ({returns})"


# ---------------------------------------------------------------------------------------------
# Registration through nki_op
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NKI_VARIANTS)
def test_every_op_is_registered_through_nki_op(name, neuron):
    mod = neuron_module(name)
    ops = mod._ops
    assert ops.prefix.startswith(f"nki_{name}")
    for op, custom in ops.custom_ops.items():
        qualname = f"permgen::{ops.prefix}_{op}"
        assert qualname in neuron.registered, f"{qualname} was not registered through nki_op"
        assert neuron.registered[qualname][1] == frozenset(), "no permgen op writes its inputs"
    if name in BOTH:
        triton_ops = load("triton", name)._ops
        assert set(triton_ops.op) == set(ops.op)
        for op in ops.op:
            assert _unqualified(ops.op[op]._schema) == _unqualified(triton_ops.op[op]._schema), op


# ---------------------------------------------------------------------------------------------
# The same autograd on both targets: permute's backward pass
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BOTH)
def test_permute_backward_agrees_with_triton(name, request, poisoned_empty, monkeypatch):
    """Token gradients (gather-summed: exact between the CPU targets, which sum each token's routes in
    one order; within tolerance of a GPU's) and prob gradients (routed back: exact) of the same permute
    on both targets, and the same outputs that carry no gradient."""
    triton_mod, nki_mod = load("triton", name), load("nki", name)
    spec = nki_mod.VARIANT
    with generation_for(spec, monkeypatch):  # quantising variants: Trn3 (test_nki_kernels.py)
        backward_agrees(triton_mod, nki_mod, spec, request)


def backward_agrees(triton_mod, nki_mod, spec, request):
    g = generator_for(request)
    tokens, routing, probs, scale = make_inputs(spec, CASE, torch.device("cpu"), g)
    cap = needed_rows(spec, routing, CASE.E) - 1  # one route dropped: its gradient is zero on both
    grads = {}
    for target, mod in (("triton", triton_mod), ("nki", nki_mod)):
        device = DEVICE if target == "triton" else torch.device("cpu")
        t, r, p, s = to_device(device, tokens, routing, probs, scale)
        t.requires_grad_(t.dtype.itemsize > 1)  # fp8 tokens are quantised data, never differentiated
        if p is not None:
            p.requires_grad_()
        res = mod.permute(t, r, p, s, num_experts=CASE.E, num_out_tokens=cap)
        outputs, inputs, grad_outs = [], [], []
        gen = generator_for(request, "grads")
        if res.tokens.requires_grad:  # the same on both targets (compared below)
            outputs.append(res.tokens)
            inputs.append(t)
            grad_outs.append(random_like(res.tokens.shape, res.tokens.dtype, device, gen))
        if p is not None:
            outputs.append(res.probs)
            inputs.append(p)
            grad_outs.append(torch.randn(res.probs.shape, generator=gen).to(device))
        grad_inputs = torch.autograd.grad(outputs, inputs, grad_outs) if outputs else ()
        grads[target] = res.tokens.requires_grad, [x.cpu() for x in grad_inputs]
    (tokens_differentiable, want), (nki_tokens_differentiable, got) = grads["triton"], grads["nki"]
    assert tokens_differentiable == nki_tokens_differentiable and len(want) == len(got)
    if tokens_differentiable:
        (assert_bits_equal if DEVICE.type == "cpu" else assert_sum_close)(got[0], want[0], "token grads")
    if spec["probs"]:
        assert_bits_equal(got[-1], want[-1], "prob grads")


# ---------------------------------------------------------------------------------------------
# torch.compile(backend="neuron")
# ---------------------------------------------------------------------------------------------

def _layer(mod, num_out_tokens):
    def run(tokens, routing, probs, scale, weight):
        res = mod.permute(tokens, routing, probs, scale, num_experts=CASE.E, num_out_tokens=num_out_tokens)
        rows = res.tokens.to(weight.dtype)
        hidden = torch.nn.functional.silu(rows @ weight) * res.probs[:, None].to(weight.dtype)
        return mod.unpermute(hidden, res.row_id_map)

    return run


@pytest.mark.parametrize("name", ["probs_bf16_mask", "probs_pad32_fp8e4m3_mx32_index"])
def test_compiled_layer_on_the_neuron_backend(name, neuron, request):
    """fullgraph=True through AOTAutograd: every kernel call one op node, forward and backward, and
    outputs and gradients bit-identical to the eager call."""
    mod = neuron_module(name)
    torch._dynamo.reset()
    neuron.graph_ops.clear()
    results = []
    for compiled in (False, True):
        g = generator_for(request)
        tokens, routing, probs, scale = make_inputs(mod.VARIANT, CASE, torch.device("cpu"), g)
        weight = (random_like((CASE.H, CASE.H), torch.bfloat16, torch.device("cpu"), g) / CASE.H ** 0.5)
        leaves = [weight.requires_grad_(), probs.requires_grad_()] + ([] if is_fp8(mod.VARIANT) else [tokens])
        tokens.requires_grad_(not is_fp8(mod.VARIANT))
        run = _layer(mod, needed_rows(mod.VARIANT, routing, CASE.E))
        fn = torch.compile(run, backend="neuron", fullgraph=True) if compiled else run
        out = fn(tokens, routing, probs, scale, weight)
        grads = torch.autograd.grad(out, leaves, random_like(out.shape, out.dtype, out.device, g))
        results.append((out, grads))
    torch._dynamo.reset()
    (out, grads), (c_out, c_grads) = results
    assert_bits_equal(c_out, out, "compiled layer")
    for i, (got, want) in enumerate(zip(c_grads, grads)):
        assert_bits_equal(got, want, f"grad {i}")
    prefix = f"permgen::{mod._ops.prefix}_"
    nodes = {(kind, op[len(prefix):]) for kind, op in neuron.graph_ops}
    assert {("forward", "permute"), ("forward", "unpermute"), ("backward", "unpermute_backward")} <= nodes
    assert ("backward", "permute_backward_probs") in nodes


@pytest.mark.parametrize("name", ["probs_pad128_bf16_mask", "bf16_index"])
def test_ops_through_the_dispatcher_keep_the_nki_op_contract(name, neuron, request, monkeypatch):
    """Every op called as a torch operator (what torch.compile and opcheck call): the model checks
    on each call that nothing undeclared was written and no output aliases an input."""
    import test_compile

    monkeypatch.setattr(test_compile, "DEVICE", torch.device("cpu"))  # the NKI target's tensors, on any machine
    mod = neuron_module(name)
    g = generator_for(request)
    samples = test_compile.op_samples(mod, g, None)
    ops = {**mod._ops.chunk_sort.op, **mod._ops.op}  # the chunk sort's ops are the target's, not the variant's
    assert set(mod._ops.op) <= {op for op, _ in samples} <= set(ops)
    for op, args in samples:
        out = ops[op](*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
        assert out is not None


# ---------------------------------------------------------------------------------------------
# The documented contract: each rule of the model fires
# ---------------------------------------------------------------------------------------------

def test_the_model_refuses_what_the_documentation_rules_out(neuron):
    with pytest.raises(fake_torch_neuronx.NeuronContractError, match="namespace-qualified"):
        neuron.nki_op("no_namespace", mutates_args=())(lambda x: x)

    with pytest.raises(ValueError, match="type annotation"):  # the schema comes from the annotations
        neuron.nki_op("permgen_test::unannotated", mutates_args=())(lambda x: x)

    @neuron.nki_op("permgen_test::writes", mutates_args=())
    def writes(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x + 1

    with pytest.raises(fake_torch_neuronx.NeuronContractError, match="mutates_args does not declare"):
        writes(torch.zeros(3))

    @neuron.nki_op("permgen_test::writes_declared", mutates_args={"x"})
    def writes_declared(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x + 1

    x = torch.zeros(3)
    assert torch.equal(writes_declared(x), torch.full((3,), 2.0)) and torch.equal(x, torch.ones(3))

    @neuron.nki_op("permgen_test::aliases", mutates_args=())
    def aliases(x: torch.Tensor) -> torch.Tensor:
        return x.view(-1)

    with pytest.raises(Exception, match="alias"):
        aliases(torch.zeros(3))

    @neuron.nki_op("permgen_test::no_autograd", mutates_args=())
    def no_autograd(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with pytest.raises(RuntimeError, match="register_autograd"):
        no_autograd(torch.ones(2, requires_grad=True)).sum().backward()


# ---------------------------------------------------------------------------------------------
# Neuron tensors: the kernels called on the tensors (modelled), and what eager mode compiles
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["probs_pad16_bf16_index", "probs_pad128_fp8e4m3_block128_mask"])
def test_the_neuron_path_gives_the_cpu_path_results(name, neuron_device, request):
    """permute, unpermute and both backward passes on Neuron tensors (kernels called on the tensors,
    as torch-neuronx runs them) and on CPU tensors (nki.simulate with NumPy arrays): the same bits."""
    mod = load("nki", name)
    results = []
    for on_neuron in (False, True):
        g = generator_for(request)
        tokens, routing, probs, scale = make_inputs(mod.VARIANT, CASE, torch.device("cpu"), g)
        tokens.requires_grad_(tokens.dtype.itemsize > 1)
        probs.requires_grad_()
        with neuron_device() if on_neuron else contextlib.nullcontext([]) as keys:
            res = mod.permute(tokens, routing, probs, scale, num_experts=CASE.E)
            rows = res.tokens.to(torch.bfloat16) * 3
            out = mod.unpermute(rows, res.row_id_map, probs)
            leaves = [t for t in (tokens, probs) if t.requires_grad]
            grad_outs = (random_like(out.shape, out.dtype, out.device, g), torch.randn(res.probs.shape, generator=g))
            grads = torch.autograd.grad((out, res.probs), leaves, grad_outs)
        assert bool(keys) == on_neuron
        results.append((res.tokens, res.probs, res.scale, res.row_id_map.row_map, res.tokens_per_expert, out, *grads))
    for i, (got, want) in enumerate(zip(*results)):
        assert (got is None) == (want is None), i
        if got is not None:
            assert_bits_equal(got, want, f"output {i}")


def _permute_compiles(keys, mod):
    return {key for key in keys if key[0] == f"{mod.VARIANT['name']}_permute"}


@pytest.mark.parametrize("name", ["probs_bf16_index", "probs_bf16_mask"])
def test_row_counts_do_not_each_compile(name, neuron_device, request):
    """On Neuron tensors (modelled), with num_out_tokens: one permute compile for any routing.
    Without it: routings whose row counts differ but share a power-of-two capacity share one
    compile, and the outputs hold exactly the routed rows."""
    mod = load("nki", name)
    g = generator_for(request)
    case = Case("counts", N=24, H=16, E=4, k=2, ragged=True)
    inputs = [make_inputs(mod.VARIANT, case, torch.device("cpu"), g) for _ in range(6)]
    counts = [needed_rows(mod.VARIANT, x[1], case.E) for x in inputs]
    with neuron_device() as keys:
        for x in inputs:
            mod.permute(*x, num_experts=case.E, num_out_tokens=64)
    assert len(_permute_compiles(keys, mod)) == 1

    capacities = {mod._ops.backend.capacity(c, case.N, case.k if mod.VARIANT["routing"] == "index" else case.E,
                                            case.E) for c in counts}
    with neuron_device() as keys:
        for x, count in zip(inputs, counts):
            res = mod.permute(*x, num_experts=case.E)
            assert res.tokens.shape[0] == res.row_id_map.num_rows == count
    assert len(set(counts)) > len(capacities)  # some row counts share a capacity
    assert len(_permute_compiles(keys, mod)) == len(capacities)


def test_capacity_is_a_bounded_power_of_two():
    backend = load("nki", "probs_pad16_bf16_index")._ops.backend
    most = 10 * 2 + 4 * 15  # N * k slots, every segment padded
    for rows, want in [(1, 1), (5, 8), (16, 16), (17, 32), (70, 80), (80, 80)]:
        assert backend.capacity(rows, 10, 2, 4) == min(want, most)
    assert {backend.capacity(r, 10, 2, 4) for r in range(1, most + 1)} == {1, 2, 4, 8, 16, 32, 64, most}


# ---------------------------------------------------------------------------------------------
# The caller's tensors are the caller's
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["probs_bf16_mask", "probs_pad32_fp8e4m3_mx32_index"])
def test_calls_leave_the_callers_tensors_as_they_were(name, request, monkeypatch):
    """An emulated call (forward and backward, through the chunk sort too) reads the caller's tensors
    without changing them: their storages stay resizable, as before the call."""
    mod = load("nki", name)
    g = generator_for(request)
    with generation_for(mod.VARIANT, monkeypatch):
        tokens, routing, probs, scale = make_inputs(mod.VARIANT, CASE, torch.device("cpu"), g)
        leaves = [t.clone().requires_grad_(t.is_floating_point() and t.element_size() > 1) if t is not None else None
                  for t in (tokens, routing, probs, scale)]
        res = mod.permute(*leaves, num_experts=CASE.E)
        rows = random_like(res.tokens.shape, torch.bfloat16, torch.device("cpu"), g).requires_grad_()
        merging = torch.rand(leaves[2].shape, generator=g)
        out = mod.unpermute(rows, res.row_id_map, merging)
        grad_out = random_like(out.shape, out.dtype, torch.device("cpu"), g)
        out.backward(grad_out)
        split, order = torch.tensor([CASE.N - 3, 3]), torch.tensor([1, 0])
        chunks = tokens.clone()
        sorted_rows = mod.sort_chunks(chunks, split, order)
        callers = {"chunks": chunks, "tokens": leaves[0], "routing": leaves[1], "probs": leaves[2], "scale": leaves[3], "rows": rows,
                   "merging_probs": merging, "grad_out": grad_out, "split_sizes": split, "sorted_idxs": order}
    assert sorted_rows[0].shape == tokens.shape
    changed = [what for what, t in callers.items() if t is not None and not resizable(t)]
    assert not changed, f"no longer resizable after the call: {changed}"
