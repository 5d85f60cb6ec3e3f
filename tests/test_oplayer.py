"""The op layer (permgen.core.oplayer): the check memo is one bounded LRU, the eager autograd fast path
falls back to public torch API with the same results, and second derivatives through the dense ops
and the chunk sort are computed (compared with the reference's), or refused where a family's
backward has no derivative of its own."""

import pytest
import torch

from cases import DEVICE, device_of, generator_for, load, make_inputs, Case
from reference import permute_ref, sort_chunks_ref, unpermute_ref
from permgen.core import oplayer
from permgen.core.ops import ChunkSort, Ops

# ---------------------------------------------------------------------------------------------
# The check memo
# ---------------------------------------------------------------------------------------------


def test_memo_drops_the_least_recently_used_and_stays_bounded():
    memo = oplayer.CheckMemo(3)
    for key in "abc":
        memo.put(key, key.upper())
    assert memo.get("a") == "A"  # a is now the most recently used
    memo.put("d", "D")  # drops b, the least recently used
    assert "b" not in memo and [k in memo for k in "acd"] == [True] * 3
    memo.put("c", "C2")  # a key put again moves to the end
    memo.put("e", "E")  # drops a
    assert list(memo.kept) == ["d", "c", "e"] and memo.get("c") == "C2"
    for i in range(100):
        memo.put(i, i)
        assert len(memo) <= 3
    assert list(memo.kept) == [97, 98, 99]
    assert memo.get("missing") is None
    with pytest.raises(TypeError):
        memo.get(["unhashable"])


def test_permute_checks_run_once_per_key_and_the_memo_evicts_the_least_recent(monkeypatch, request):
    """Every family's checks share CHECKS: a call like one already checked skips the checks; with the
    memo full, the key used least recently is checked again, the one used recently is not."""
    mod = load("triton", "probs_bf16_index")
    g = generator_for(request)
    monkeypatch.setattr(oplayer.CHECKS, "size", 3)
    oplayer.CHECKS.clear()
    checks = []
    real = Ops._check_permute
    monkeypatch.setattr(Ops, "_check_permute", lambda self, tokens, *a: checks.append(tokens.shape[0])
                        or real(self, tokens, *a))

    def permute(n):
        tokens = torch.randn(n, 8, generator=g).to(torch.bfloat16).to(DEVICE)
        ids = torch.randint(0, 4, (n, 2), generator=g, dtype=torch.int32).to(DEVICE)
        return mod.permute(tokens, ids, torch.rand(n, 2, generator=g).to(DEVICE), num_experts=4, num_out_tokens=2 * n)

    for n in (1, 2, 1, 2):
        permute(n)
    assert checks == [1, 2]
    permute(3)
    permute(1)  # 1 used more recently than 2
    permute(4)  # the memo is full: drops 2
    assert len(oplayer.CHECKS) == 3
    permute(1)
    permute(2)
    assert checks == [1, 2, 3, 4, 2]


# ---------------------------------------------------------------------------------------------
# The eager fast path and its fallback
# ---------------------------------------------------------------------------------------------


def test_dynamo_marks_a_constant_result_as_the_op_layer_does():
    def probe():
        return True

    assert vars(torch.compiler.assume_constant_result(probe)) == {"_dynamo_marked_constant": True}
    assert oplayer.registered._dynamo_marked_constant is True


def test_fast_path_feature_test(monkeypatch):
    """This torch has the private API the fast path uses; without it (a torch release that moved it),
    the feature test says so instead of raising, and eager_apply is Function.apply."""
    assert oplayer.fast_apply_parts() is not None
    monkeypatch.delattr(torch._C, "_are_functorch_transforms_active")
    assert oplayer.fast_apply_parts.__wrapped__() is None
    monkeypatch.setattr(oplayer, "fast_apply_parts", lambda: None)

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    assert oplayer.eager_apply(Double) == Double.apply


def run_with_grads(mod, chunk_sort, g):
    """permute, an expert stand-in, unpermute and a chunk sort, all differentiable; returns the outputs
    and the gradients of every input."""
    case = Case("c", N=13, H=24, E=5, k=2)
    tokens, routing, probs, _ = make_inputs(mod.VARIANT, case, DEVICE, g)
    tokens, probs = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    merging = probs.detach().clone().requires_grad_()
    res = mod.permute(tokens, routing, probs, num_experts=case.E)
    rows = res.tokens * res.probs[:, None].to(res.tokens.dtype)
    split = torch.tensor([3, rows.shape[0] - 3])
    rows_sorted, row_probs = chunk_sort.sort("sort", rows, split, torch.tensor([1, 0]), res.probs * 2)
    out = mod.unpermute(rows_sorted * row_probs[:, None].to(rows.dtype), res.row_id_map, merging)
    grads = torch.autograd.grad(out.float().square().sum(), (tokens, probs, merging))
    return (res.tokens, res.probs, rows_sorted, row_probs, out, *grads)


def test_fallback_gives_the_same_results_and_gradients(monkeypatch, request):
    """Families registered where the fast path is unavailable (the feature test forced to fail) run
    Function.apply: results and gradients bit for bit those of the fast path."""
    mod = load("triton", "probs_bf16_mask")
    want = run_with_grads(mod, mod._ops.chunk_sort, generator_for(request))
    monkeypatch.setattr(oplayer, "fast_apply_parts", lambda: None)
    ops = Ops(mod.VARIANT, mod._ops.backend)
    chunk_sort = ChunkSort(mod._ops.chunk_sort.kernels)

    class Module:  # the generated module's functions, over the new families
        VARIANT, permute, unpermute = mod.VARIANT, ops.permute, ops.unpermute

    got = run_with_grads(Module, chunk_sort, generator_for(request))
    for family in (ops, chunk_sort):
        for apply in family.eager.values():
            assert issubclass(apply.__self__, torch.autograd.Function)  # Function.apply itself
    assert ops.prefix != mod._ops.prefix
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


# ---------------------------------------------------------------------------------------------
# Second derivatives
# ---------------------------------------------------------------------------------------------

CASE = Case("second", N=11, H=16, E=5, k=2)


def second_derivatives(permute, unpermute, sort, x, probs, merging, g):
    """A loss through permute, unpermute and the chunk sort, its gradient (create_graph=True), and the
    gradient of a function of that gradient: the second derivatives, in x, probs and merging."""
    weights = {}

    def weight(t, name):  # fixed random weights, the same for ours and the reference
        if name not in weights:
            weights[name] = torch.rand(t.shape, generator=g).to(t.device)
        return weights[name]

    rows, row_probs, state = permute(x, probs)
    sorted_rows, sorted_probs = sort(rows, row_probs)
    hidden = sorted_rows.float().square() * weight(sorted_rows, "rows")
    out = unpermute(hidden.to(rows.dtype), state, merging)
    loss = (out.float().square() * weight(out, "out")).sum() + (sorted_probs.square() * weight(sorted_probs, "p")).sum()
    first = torch.autograd.grad(loss, (x, probs, merging), create_graph=True)
    penalty = sum((f.float() * weight(f, f"g{i}")).sum() for i, f in enumerate(first))
    return [f.detach() for f in first] + list(torch.autograd.grad(penalty, (x, probs, merging)))


def reference_second_derivatives(mod, routing, x, probs, merging, split, order, g):
    v = mod.VARIANT

    def permute(x, p):
        out, out_probs, _, _, routes = permute_ref(x, routing, routing_kind=v["routing"], num_experts=CASE.E,
                                                   probs=p, pad=v["pad"])
        return out, out_probs, routes

    def sort(rows, row_probs):
        return sort_chunks_ref(rows, split, order), sort_chunks_ref(row_probs, split, order)

    return second_derivatives(permute, lambda h, routes, m: unpermute_ref(h, routes, CASE.N, m), sort, x, probs,
                              merging, g)


@pytest.mark.parametrize("target", ["triton", "nki"])
@pytest.mark.parametrize("name", ["probs_fp32_index", "probs_bf16_mask", "probs_pad16_bf16_index"])
def test_second_derivatives_match_the_reference(target, name, request):
    """torch.autograd.grad(..., create_graph=True) through permute, the chunk sort and unpermute gives a
    gradient with its graph, whose own gradient is the reference's (each backward op is differentiable)."""
    mod = load(target, name)
    device = device_of(target)
    g = generator_for(request)
    tokens, routing, probs, _ = make_inputs(mod.VARIANT, CASE, device, g)
    tokens = (tokens.float() / 4).to(tokens.dtype)
    merging = torch.rand(probs.shape, generator=g).to(device)
    needed = permute_ref(tokens, routing, routing_kind=mod.VARIANT["routing"], num_experts=CASE.E,
                         pad=mod.VARIANT["pad"])[0].shape[0]
    split, order = torch.tensor([4, needed - 7, 3]), torch.tensor([2, 0, 1])
    seed = g.initial_seed()

    def leaves():
        return tokens.clone().requires_grad_(), probs.clone().requires_grad_(), merging.clone().requires_grad_()

    def permute(x, p):
        res = mod.permute(x, routing, p, num_experts=CASE.E)
        return res.tokens, res.probs, res.row_id_map

    ours = second_derivatives(permute, mod.unpermute, lambda r, p: mod.sort_chunks(r, split, order, p), *leaves(),
                              torch.Generator().manual_seed(seed))
    want = reference_second_derivatives(mod, routing, *leaves(), split, order, torch.Generator().manual_seed(seed))
    names = ["d tokens", "d probs", "d merging", "dd tokens", "dd probs", "dd merging"]
    for what, a, b in zip(names, ours, want):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        scale = b.float().abs().max().item() or 1.0
        tol = 1e-5 if a.dtype == torch.float32 and mod.VARIANT["dtype"] == "fp32" else 3e-2
        torch.testing.assert_close(a.float().cpu() / scale, b.float().cpu() / scale, rtol=0, atol=tol,
                                   msg=lambda m: f"{what}: {m}")


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # fp32 inputs: the kernels are fp32
def test_backward_ops_derivatives_match_finite_differences(request):
    """The backward ops' own backward passes (the second derivatives' formulas: permute_backward and
    unpermute_backward each other's transpose, the probs forms' bilinear ones), checked by gradcheck on
    the fp32 variant's ops (linear and bilinear: central differences are exact up to rounding)."""
    mod = load("triton", "probs_fp32_index")
    g = generator_for(request)
    case = Case("small", N=5, H=3, E=3, k=2)
    tokens, routing, probs, _ = make_inputs(mod.VARIANT, case, DEVICE, g)
    rim = mod.permute(tokens, routing, probs, num_experts=case.E).row_id_map
    sizes = (rim.row_map, rim.num_tokens, rim.width, rim.num_experts)
    ops = mod._ops.op

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE).requires_grad_()

    rows, grad_out, row_probs = leaf(rim.num_rows, case.H), leaf(case.N, case.H), leaf(rim.num_rows)
    merging = torch.rand(probs.shape, generator=g).to(DEVICE).requires_grad_()
    checks = {
        "permute_backward": (lambda r: ops["permute_backward"](sizes[0], r, *sizes[1:], rim.num_rows), (rows,)),
        "unpermute_backward": (lambda o: ops["unpermute_backward"](sizes[0], o, *sizes[1:], rim.num_rows),
                               (grad_out,)),
        "permute_backward_probs": (lambda r, p: ops["permute_backward_probs"](
            sizes[0], r, p, *sizes[1:], rim.num_rows, probs.shape[1], probs.dtype), (rows, row_probs)),
        "unpermute_backward_probs": (lambda o, r, m: ops["unpermute_backward_probs"](sizes[0], o, r, m, *sizes[1:]),
                                     (grad_out, rows, merging)),
    }
    for what, (fn, inputs) in checks.items():
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-2, atol=1e-3, rtol=1e-3, fast_mode=True), what


# ---------------------------------------------------------------------------------------------
# Refusals: a backward with no derivative of its own
# ---------------------------------------------------------------------------------------------


class Tripler(oplayer.OpFamily):
    """x * 3, whose backward op (grad * 3) declares no backward of its own."""

    def __init__(self):
        super().__init__(oplayer.take_prefix("test_tripler"))

    def declare(self):
        return {"triple": oplayer.Op(lambda x: x * 3, torch.empty_like, "(Tensor x) -> Tensor",
                                     backward=lambda ctx, grad: ctx.calls["triple_backward"](grad),
                                     setup=lambda ctx, inputs, output: None),
                "triple_backward": oplayer.Op(lambda grad: grad * 3, torch.empty_like, "(Tensor grad) -> Tensor")}


@pytest.mark.parametrize("route", ["eager", "op"])
def test_a_backward_without_derivative_refuses_differentiating_twice(route):
    family = Tripler()
    x = torch.randn(5, requires_grad=True)
    call = family.eager["triple"] if route == "eager" else family.op["triple"]
    y = call(x)
    (plain,) = torch.autograd.grad(y.square().sum(), x)  # a first derivative alone: as always
    assert torch.equal(plain, 3 * (2 * (3 * x.detach())))
    (grad,) = torch.autograd.grad(call(x).square().sum(), x, create_graph=True)
    assert torch.equal(grad.detach(), plain)
    with pytest.raises(RuntimeError, match="differentiating twice"):
        torch.autograd.grad(grad.sum(), x)
    # a gradient nothing differentiates again comes back as it is
    (constant,) = torch.autograd.grad(call(x).sum(), x, create_graph=True)
    assert not constant.requires_grad and torch.equal(constant, torch.full_like(x, 3.0))


def test_own_function_refuses_differentiating_twice():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @oplayer.backward_refusing_twice("square")
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 2 * x.detach()  # as a kernel would: no graph

    x = torch.randn(4, requires_grad=True)
    (grad,) = torch.autograd.grad(oplayer.eager_apply(Square)(x).sum(), x, create_graph=True)
    assert torch.equal(grad.detach(), 2 * x.detach())
    with pytest.raises(RuntimeError, match="square: differentiating twice"):
        grad.sum().backward()


def test_compiled_second_derivatives_are_refused_not_silent(request):
    """Under torch.compile, torch's AOT autograd refuses a second backward pass through the compiled
    region (it has no double backward): the gradient penalty raises instead of losing its term."""
    mod = load("triton", "probs_bf16_index")
    g = generator_for(request)
    tokens, routing, probs, _ = make_inputs(mod.VARIANT, CASE, DEVICE, g)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def layer(x, p):
        res = mod.permute(x, routing, p, num_experts=CASE.E, num_out_tokens=CASE.N * CASE.k)
        return mod.unpermute(res.tokens.float().square().to(x.dtype), res.row_id_map, p)

    x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    out = layer(x, p).float().square().sum()
    gx, gp = torch.autograd.grad(out, (x, p), create_graph=True)
    with pytest.raises(RuntimeError):
        (out + gx.float().square().sum() + gp.square().sum()).backward()


def test_every_differentiable_op_of_the_dense_families_declares_its_backward():
    """Only the chunk table (integers) and the checks are left without a derivative."""
    mod = load("triton", "probs_bf16_mask")
    for family in (mod._ops, mod._ops.chunk_sort):
        declared = family.declare()
        without = {name for name, op in declared.items() if op.backward is None}
        assert without <= {"chunk_table", "check_chunks"}, without
        assert set(family.eager) == set(declared) - without
