"""Every generated Triton variant against the plain-PyTorch reference, forward and backward.

On a machine without a GPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py).
Moved data must match exactly; only summed values get a tolerance. Fresh allocations are
poisoned, so an output a kernel forgot to write shows as NaN or a huge int, never as a lucky zero.
"""

import pytest
import torch

import permgen
from cases import (
    CASES,
    DEVICE,
    assert_sum_close,
    check_permute,
    check_permute_backward,
    check_roundtrip,
    check_unpermute,
    generator_for,
    rows_are_fp8,
    load,
    make_inputs,
    needed_rows,
    num_out_tokens_for,
    variants_for,
)
from reference import permute_grads_ref, plan_routes

TRITON_VARIANTS = variants_for("triton")


def _case_inputs(mod, case, g):
    """(tokens, routing, probs, scale) of `case` on DEVICE, and permute's sizes (num_experts, the row cap)."""
    tokens, routing, probs, scale = make_inputs(mod.VARIANT, case, DEVICE, g)
    cap = num_out_tokens_for(case, needed_rows(mod.VARIANT, routing, case.E))
    return (tokens, routing, probs, scale), dict(num_experts=case.E, num_out_tokens=cap)


def check_case(mod, case, g, merge=True):
    """permute, its backward, unpermute and its backward on `case`, each against the reference.

    Takes a module, so the tests of variants generated from other specs (test_axis_matrix) run it too."""
    inputs, sizes = _case_inputs(mod, case, g)
    return check_roundtrip(mod, "triton", *inputs, **sizes, generator=g, merge=merge)


# One op at a time, for tests of a single op (test_vendor).

def check_permute_case(mod, case, g):
    inputs, sizes = _case_inputs(mod, case, g)
    return check_permute(mod, *inputs, **sizes)


def check_unpermute_case(mod, case, g):
    inputs, sizes = _case_inputs(mod, case, g)
    res, routes = check_permute(mod, *inputs, **sizes)
    check_unpermute(mod, "triton", res, routes, inputs[1].shape, g)


def check_permute_backward_case(mod, case, g):
    inputs, sizes = _case_inputs(mod, case, g)
    check_permute_backward(mod, *inputs, **sizes, generator=g)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", TRITON_VARIANTS)
def test_matches_reference(name, case, poisoned_empty, request):
    check_case(load("triton", name), case, generator_for(request))


@pytest.mark.parametrize("name", [n for n in TRITON_VARIANTS if permgen.VARIANTS[n]["probs"]])
def test_unpermute_without_merging_probs(name, poisoned_empty, request):
    """Variants with probs also unpermute as a plain sum (merging_probs=None), with no prob grads."""
    check_case(load("triton", name), CASES[0], generator_for(request), merge=False)


@pytest.mark.parametrize("used", ["tokens", "probs"])
@pytest.mark.parametrize("name", [n for n in TRITON_VARIANTS
                                  if permgen.VARIANTS[n]["probs"] and not rows_are_fp8(permgen.VARIANTS[n])])
def test_permute_backward_through_one_output(name, used, poisoned_empty, request):
    """Only one of permute's outputs feeds the loss: its input gets the right grad, the other none."""
    mod, case = load("triton", name), CASES[0]
    v = mod.VARIANT
    g = generator_for(request)
    tokens, routing, probs, scale = make_inputs(v, case, DEVICE, g)
    tokens.requires_grad_()
    probs.requires_grad_()
    needed = needed_rows(v, routing, case.E)
    res = mod.permute(tokens, routing, probs, scale, num_experts=case.E, num_out_tokens=needed)
    routes = plan_routes(routing, v["routing"], case.E, v["pad"])
    out = res.tokens if used == "tokens" else res.probs
    grad_out = torch.randn(out.shape, generator=g).to(out.dtype).to(DEVICE)
    out.backward(grad_out)
    if used == "tokens":
        ref_tokens_grad, _ = permute_grads_ref(grad_out, routes, case.N)
        assert_sum_close(tokens.grad, ref_tokens_grad)
        assert probs.grad is None
    else:
        _, ref_probs_grad = permute_grads_ref(torch.zeros(needed, case.H, device=DEVICE), routes, case.N,
                                              probs.shape, grad_out)
        assert torch.equal(probs.grad, ref_probs_grad)
        assert tokens.grad is None
