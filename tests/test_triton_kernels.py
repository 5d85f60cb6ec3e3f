"""Every generated Triton variant against the plain-PyTorch reference, forward and backward.

On a machine without a GPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py).
Moved data must match exactly; only summed values get a tolerance.
"""

import importlib

import pytest
import torch

from conftest import DEVICE
from inputs import CASES, make_inputs, num_out_tokens_for
from reference import permute_grads_ref, permute_ref, plan_routes, unpermute_grads_ref, unpermute_ref

import generated

TRITON_VARIANTS = [name for name, v in generated.VARIANTS.items() if "triton" in v["targets"]]
# Tolerances for values summed in fp32 and written in the combine dtype.
SUM_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3),
           torch.float32: dict(rtol=1e-5, atol=1e-5)}


def load(name):
    return importlib.import_module(f"generated.triton.{name}")


def bits(t):
    """Compare moved data bitwise (NaN-safe, fp8-safe)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view({2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


def run_permute(mod, case, seed):
    g = torch.Generator().manual_seed(seed)
    v = mod.VARIANT
    tokens, routing, probs, scale = make_inputs(v, case, DEVICE, g)
    needed = plan_routes(routing, v["routing"], case.E, v["pad"]).num_rows
    cap = num_out_tokens_for(case, needed)
    res = mod.permute(tokens, routing, probs, scale, num_experts=case.E, num_out_tokens=cap)
    ref = permute_ref(tokens, routing, routing_kind=v["routing"], num_experts=case.E, probs=probs, scale=scale,
                      pad=v["pad"], num_out_tokens=cap)
    return (tokens, routing, probs, scale), res, ref


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", TRITON_VARIANTS)
def test_permute_matches_reference(name, case, poisoned_empty):
    check_permute(load(name), case, seed=hash((name, case.name)) % 2**31)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", TRITON_VARIANTS)
def test_unpermute_forward_and_backward(name, case, poisoned_empty):
    check_unpermute(load(name), case, seed=hash((name, case.name, "unpermute")) % 2**31)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", TRITON_VARIANTS)
def test_permute_backward(name, case, poisoned_empty):
    check_permute_backward(load(name), case, seed=hash((name, case.name, "permute-bwd")) % 2**31)


# The checks, shared with the tests of variants generated from other specs.

def check_permute(mod, case, seed):
    _, res, (ref_tokens, ref_probs, ref_scale, ref_tpe, routes) = run_permute(mod, case, seed)
    assert res.tokens.shape == ref_tokens.shape and res.tokens.dtype == mod.TOKEN_DTYPE
    assert torch.equal(bits(res.tokens), bits(ref_tokens))
    assert torch.equal(res.tokens_per_expert, ref_tpe)
    assert res.row_id_map.num_rows == routes.num_rows
    if mod.VARIANT["probs"]:
        assert torch.equal(bits(res.probs), bits(ref_probs))
    else:
        assert res.probs is None
    if mod.VARIANT["scale"] != "none":
        assert torch.equal(bits(res.scale), bits(ref_scale))
    else:
        assert res.scale is None


def check_unpermute(mod, case, seed):
    (tokens, routing, probs, _), res, (*_, routes) = run_permute(mod, case, seed)
    g = torch.Generator().manual_seed(seed + 1)
    rows = res.row_id_map.num_rows
    permuted = (torch.randn(rows, case.H, generator=g)).to(mod.COMBINE_DTYPE).to(DEVICE).requires_grad_()
    merging = None
    if mod.VARIANT["probs"]:
        merging = torch.rand(probs.shape, generator=g).to(DEVICE).requires_grad_()
    out = mod.unpermute(permuted, res.row_id_map, merging)
    expected = unpermute_ref(permuted.detach(), routes, case.N, None if merging is None else merging.detach())
    assert out.dtype == mod.COMBINE_DTYPE and out.shape == (case.N, case.H)
    torch.testing.assert_close(out, expected, **SUM_TOL[mod.COMBINE_DTYPE])

    grad_out = torch.randn(case.N, case.H, generator=g).to(mod.COMBINE_DTYPE).to(DEVICE)
    inputs = [permuted] + ([merging] if merging is not None else [])
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref_grad_permuted, ref_grad_probs = unpermute_grads_ref(
        grad_out, permuted.detach(), routes, None if merging is None else merging.detach())
    # Each row is one product p * grad (or a copy): no sum, so exact -- except that the CPU
    # interpreter truncates fp32 -> bf16 where GPUs round to nearest: there, allow one bf16 ulp.
    if DEVICE.type == "cpu" and merging is not None and grads[0].dtype == torch.bfloat16:
        torch.testing.assert_close(grads[0], ref_grad_permuted, rtol=2**-7, atol=1e-30)
    else:
        assert torch.equal(bits(grads[0]), bits(ref_grad_permuted))
    if merging is not None:
        torch.testing.assert_close(grads[1], ref_grad_probs, rtol=1e-4, atol=1e-4)


def check_permute_backward(mod, case, seed):
    v = mod.VARIANT
    g = torch.Generator().manual_seed(seed)
    tokens, routing, probs, scale = make_inputs(v, case, DEVICE, g)
    differentiable_tokens = v["dtype"] not in ("fp8_e4m3", "fp8_e5m2")  # quantised tokens carry no grad
    if differentiable_tokens:
        tokens.requires_grad_()
    if probs is not None:
        probs.requires_grad_()
    if not differentiable_tokens and probs is None:
        return  # fp8 tokens without probs: nothing in permute is differentiable
    res = mod.permute(tokens, routing, probs, scale, num_experts=case.E,
                      num_out_tokens=num_out_tokens_for(case, plan_routes(routing, v["routing"], case.E, v["pad"]).num_rows))
    routes = plan_routes(routing, v["routing"], case.E, v["pad"], res.row_id_map.num_rows if case.cap != "none" else None)
    outputs, inputs, grads_out = [], [], []
    if differentiable_tokens:
        outputs.append(res.tokens)
        inputs.append(tokens)
        grads_out.append(torch.randn(res.tokens.shape, generator=g).to(tokens.dtype).to(DEVICE))
    if probs is not None:
        outputs.append(res.probs)
        inputs.append(probs)
        grads_out.append(torch.randn(res.probs.shape, generator=g).to(DEVICE))
    grads = torch.autograd.grad(outputs, inputs, grads_out)
    ref_tokens_grad, ref_probs_grad = permute_grads_ref(
        grads_out[0] if differentiable_tokens else torch.zeros(res.row_id_map.num_rows, case.H, device=DEVICE),
        routes, case.N, None if probs is None else probs.shape, grads_out[-1] if probs is not None else None)
    if differentiable_tokens:
        torch.testing.assert_close(grads[0], ref_tokens_grad, **SUM_TOL[tokens.dtype])
    if probs is not None:
        assert torch.equal(grads[-1], ref_probs_grad)  # routed back, not summed


@pytest.mark.parametrize("used", ["tokens", "probs"])
@pytest.mark.parametrize("name", [n for n in TRITON_VARIANTS
                                  if generated.VARIANTS[n]["probs"] and not generated.VARIANTS[n]["dtype"].startswith("fp8")])
def test_permute_backward_through_one_output(name, used, poisoned_empty):
    """Only one of permute's outputs feeds the loss: its input gets the right grad, the other none."""
    mod, case = load(name), CASES[0]
    v = mod.VARIANT
    g = torch.Generator().manual_seed(hash((name, used)) % 2**31)
    tokens, routing, probs, scale = make_inputs(v, case, DEVICE, g)
    tokens.requires_grad_()
    probs.requires_grad_()
    needed = plan_routes(routing, v["routing"], case.E, v["pad"]).num_rows
    res = mod.permute(tokens, routing, probs, scale, num_experts=case.E, num_out_tokens=needed)
    routes = plan_routes(routing, v["routing"], case.E, v["pad"])
    out = res.tokens if used == "tokens" else res.probs
    grad_out = torch.randn(out.shape, generator=g).to(out.dtype).to(DEVICE)
    out.backward(grad_out)
    if used == "tokens":
        ref_tokens_grad, _ = permute_grads_ref(grad_out, routes, case.N)
        torch.testing.assert_close(tokens.grad, ref_tokens_grad, **SUM_TOL[tokens.dtype])
        assert probs.grad is None
    else:
        _, ref_probs_grad = permute_grads_ref(torch.zeros(needed, case.H, device=DEVICE), routes, case.N,
                                              probs.shape, grad_out)
        assert torch.equal(probs.grad, ref_probs_grad)
        assert tokens.grad is None
