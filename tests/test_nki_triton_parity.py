"""The Triton and NKI modules of one variant compute the same function through the same API: the
same moved data bit for bit, the same segment sizes, the same row map (compared route by route with
RowIdMap.rows_by_column), matching sums and gradients, on the same inputs. Triton runs on the GPU,
or on the CPU under TRITON_INTERPRET=1 (conftest.py); NKI runs in the emulator on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from cases import (
    DEVICE,
    Case,
    assert_bits_equal,
    assert_sum_close,
    combine_dtype,
    expert_ids,
    generator_for,
    load,
    make_inputs,
    needed_rows,
    num_out_tokens_for,
    random_like,
    routing_from_ids,
    to_device,
    variants_for,
)
from test_nki_kernels import generation_for
from test_quantize import edge_tokens

BOTH = sorted(set(variants_for("triton")) & set(variants_for("nki")))
# Small: the CPU Triton interpreter runs one program per token. (NKI's multi-tile shapes are in test_nki_kernels.py.)
CASES = [Case("one_token", N=1, H=72, E=4, k=2), Case("ragged", N=29, H=136, E=5, k=3, ragged=True),
         Case("dropped", N=31, H=72, E=4, k=3, cap="drop")]


def load_triton(name):
    try:
        return load("triton", name)
    except ImportError as err:  # no triton installed
        pytest.skip(f"the triton module of {name} does not import: {err}")


def hints(name, case):
    """Mask routing also with a topk hint below the routes of some tokens (routes past it dropped)."""
    return [None, 2] if load("nki", name).VARIANT["routing"] == "mask" and case.cap == "drop" else [None]


PARAMS = [pytest.param(name, case, topk, id=f"{name}-{case}-topk{topk}") for name in BOTH for case in CASES
          for topk in hints(name, case)]


@pytest.mark.parametrize("name,case,topk", PARAMS)
def test_triton_and_nki_agree(name, case, topk, request, monkeypatch):
    triton_mod, nki_mod = load_triton(name), load("nki", name)
    spec = nki_mod.VARIANT
    with generation_for(spec, monkeypatch):  # quantising variants: Trn3 (test_nki_kernels.py)
        agree(triton_mod, nki_mod, spec, case, topk, request)


def agree(triton_mod, nki_mod, spec, case, topk, request):
    g = generator_for(request)
    inputs = make_inputs(spec, case, torch.device("cpu"), g)
    cap = num_out_tokens_for(case, needed_rows(spec, inputs[1], case.E))
    kwargs = dict(num_experts=case.E, num_out_tokens=cap, topk=topk, check_routing=False if topk else None)
    t = triton_mod.permute(*to_device(DEVICE, *inputs), **kwargs)
    n = nki_mod.permute(*inputs, **kwargs)
    assert_bits_equal(t.tokens.cpu(), n.tokens, "tokens")
    assert torch.equal(t.tokens_per_expert.cpu(), n.tokens_per_expert)
    assert torch.equal(t.row_id_map.rows_by_column().cpu(), n.row_id_map.rows_by_column())
    assert (t.row_id_map.width, t.row_id_map.num_rows) == (n.row_id_map.width, n.row_id_map.num_rows)
    assert torch.equal(t.row_id_map.segment_offsets.cpu(), n.row_id_map.segment_offsets)
    assert torch.equal(t.row_id_map.segment_counts.cpu(), n.row_id_map.segment_counts)
    if spec["probs"]:
        assert_bits_equal(t.probs.cpu(), n.probs, "probs")
    if spec["scale"] != "none" or spec["quantize"] != "none":  # moved, or computed by quantising
        assert_bits_equal(t.scale.cpu(), n.scale, "scales")

    # unpermute and its gradients through autograd, with merging probs where the variant has them.
    cdt = combine_dtype(spec)
    expert_out = random_like(n.tokens.shape, cdt, torch.device("cpu"), g)
    merging = torch.rand(inputs[2].shape, generator=g) if spec["probs"] else None
    grad_out = random_like((case.N, case.H), cdt, torch.device("cpu"), g)
    grads = {}
    for target, res in (("triton", t), ("nki", n)):
        leaves = [x.clone().to(DEVICE if target == "triton" else "cpu").requires_grad_()
                  for x in (expert_out, merging) if x is not None]
        out = (triton_mod if target == "triton" else nki_mod).unpermute(leaves[0], res.row_id_map, *leaves[1:])
        grads[target] = (out.detach().cpu(), *(g_.cpu() for g_ in torch.autograd.grad(out, leaves, grad_out.to(out.device))))
    if DEVICE.type == "cpu":  # both targets sum each token's routes in slot order, and round alike
        assert_bits_equal(grads["triton"][0], grads["nki"][0], "unpermute")
    else:  # a GPU sums them in another order
        assert_sum_close(grads["triton"][0], grads["nki"][0], "unpermute")
    assert_bits_equal(grads["triton"][1], grads["nki"][1], "unpermute grad rows")
    if spec["probs"]:
        torch.testing.assert_close(grads["triton"][2], grads["nki"][2], rtol=1e-4, atol=1e-4)


QUANTIZING_BOTH = [name for name in BOTH if load("nki", name).VARIANT["quantize"] != "none"]


@pytest.mark.parametrize("name", QUANTIZING_BOTH)
def test_quantizing_variants_agree_on_edge_rows(name, request, monkeypatch):
    """The quantising permute on rows at the edges of the scale definitions (zero rows, tiny and huge amax,
    NaN of both signs and Inf, rounding ties; test_quantize.edge_tokens): the same fp8 bytes and scales on both
    targets, NaN included, pad rows and their scales zero on both."""
    triton_mod, nki_mod = load_triton(name), load("nki", name)
    spec = nki_mod.VARIANT
    g = generator_for(request)
    num_tokens, num_experts = 16, 5
    tokens = edge_tokens(num_tokens, 200, torch.bfloat16, g)
    routing = routing_from_ids(spec, expert_ids(num_tokens, num_experts, 2, g, ragged=True), num_experts)
    probs = torch.rand(routing.shape, generator=g) if spec["probs"] else None
    with generation_for(spec, monkeypatch):
        n = nki_mod.permute(tokens, routing, probs, num_experts=num_experts)
    t = triton_mod.permute(*to_device(DEVICE, tokens, routing, probs), num_experts=num_experts)
    assert_bits_equal(t.tokens.cpu(), n.tokens, "tokens")
    # Edge row 7's NaNs of both signs: the one NaN byte, 0x7F (docs/quantization.md), in every row they reach.
    nan_bytes = n.tokens.view(torch.uint8)[(n.tokens.view(torch.uint8) & 0x7F) == 0x7F]
    assert len(nan_bytes) >= 2 and (nan_bytes == 0x7F).all(), nan_bytes
    assert_bits_equal(t.scale.cpu(), n.scale, "scales")
    assert torch.equal(t.tokens_per_expert.cpu(), n.tokens_per_expert)
