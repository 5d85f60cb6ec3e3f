"""Quantise on permute: every quantising variant on both targets, bit for bit against the reference
(quantise with tests/reference.py's quantize_ref, then permute), on tokens built to hit the edges of
the scale definitions: blocks of zeros, tiny and subnormal amax, values that saturate, NaN and Inf,
exact powers of two and rounding ties, and a ragged last block. Then the straight-through backward:
token grads are unpermute(grad_rows) -- the sum kernel bf16 variants' permute backward runs -- and
prob grads come back through autograd.
"""

import importlib.util

import pytest
import torch

import permgen
from generator import render_all, write_all
from permgen.nki import host as nki_host
from permgen.nki import kernels as nki_kernels
from generator.spec import parse_spec
from cases import (
    assert_bits_equal,
    assert_sum_close,
    check_permute,
    check_roundtrip,
    device_of,
    expert_ids,
    generator_for,
    load,
    needed_rows,
    routing_from_ids,
    to_device,
    variants_for,
)
from reference import permute_grads_ref, plan_routes, quantize_ref

QUANTIZING = {target: [n for n in variants_for(target) if permgen.VARIANTS[n]["quantize"] != "none"]
              for target in ("triton", "nki")}
TARGET_VARIANTS = [(t, n) for t, names in QUANTIZING.items() for n in names]


@pytest.fixture(autouse=True)
def _on_neuroncore_v4(monkeypatch):
    """The NKI quantising kernels refuse NeuronCore-v3 (no float8_e4m3fn compute on Trn2): run them on Trn3."""
    from test_nki_kernels import generation_for

    with generation_for({"quantize": "mx32"}, monkeypatch):
        yield
# The other dtypes the axis takes, with the other scale kind, routing and padding than the spec's
# variants: generated into a temporary folder by the test.
OTHER_DTYPES_SPEC = """
[[variant]]
dtype = "fp16"
routing = "mask"
quantize = "block128"
pad = 8

[[variant]]
dtype = "fp32"
routing = "index"
probs = false
quantize = "mx32"

[[variant]]
dtype = "fp32"
routing = "mask"
probs = false
quantize = "rowwise"
"""


def edge_tokens(num_tokens: int, hidden: int, dtype, generator) -> torch.Tensor:
    """Random rows, and rows whose blocks sit on the edges of the scale definitions. Every special
    row starts at column 0, so it covers the first block of both block sizes; H is not a multiple
    of 32, so each row's last block is ragged."""
    x = torch.randn(num_tokens, hidden, generator=generator) * 4
    rnd = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    x[0] = 0.0  # amax 0
    x[1] = rnd(hidden) * 1e-39  # subnormal bf16 amax (mx32 scale 0x00; block128 clamps to 1e-4)
    x[2] = rnd(hidden) * 1e-30  # tiny amax
    x[3] = rnd(hidden) * 1e37  # near the top of the range...
    x[3, 5] = 3.3e38  # ...up to bf16's largest finite values
    x[4, :40] = 448.0 * torch.tensor([2.0 ** -k for k in range(40)])  # amax exactly 448: scale 1, powers of two
    x[5, :33] = 449.0  # just above 448: the next scale, values round at the top of fp8's range
    # Rounding ties between fp8 neighbours (amax 448 keeps them unscaled), normal and subnormal.
    x[6, :8] = torch.tensor([448.0, 1.0 + 1 / 16, 1.0 + 3 / 16, 2.0 ** -7 * 1.5, 2.0 ** -10, 3 * 2.0 ** -10,
                             -(2.0 ** -11), -0.0])
    x[8, hidden - 1] = float("inf")
    x[8, 0] = -float("inf")
    x[9, :] = -0.0
    x[10, :] = 1e-4 * (rnd(hidden).abs() < 1).float()  # block128's amax floor itself
    x = x.to(dtype)
    # NaNs of both signs, by their bits: torch's conversions do not keep a NaN's sign (fp32 -> bf16 gives 0xFFFF).
    words = x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
    words[7, 3], words[7, 4] = NAN_BITS[dtype]
    return x


# (positive, negative) quiet NaN of each token dtype, as signed integers of its width.
NAN_BITS = {torch.bfloat16: (0x7FC0, -0x40), torch.float16: (0x7E00, -0x200), torch.float32: (0x7FC00000, -0x400000)}


def _inputs(mod, target, generator, num_tokens=24, hidden=200, num_experts=6, k=3):
    """tokens (edge_tokens), routing and probs for the variant on the target's device, and E."""
    v = mod.VARIANT
    tokens = edge_tokens(num_tokens, hidden, torch.bfloat16 if v["dtype"] == "bf16" else
                         getattr(torch, {"fp16": "float16", "fp32": "float32"}[v["dtype"]]), generator)
    routing = routing_from_ids(v, expert_ids(num_tokens, num_experts, k, generator, ragged=True), num_experts)
    probs = torch.rand(num_tokens, routing.shape[1], generator=generator) if v["probs"] else None
    return to_device(device_of(target), tokens, routing, probs), num_experts


def test_reference_scale_definitions():
    """quantize_ref on values whose scales are known by hand."""
    h = 160  # block128: one full block and a ragged one of 32; mx32: five blocks
    x = torch.zeros(6, h)
    x[1, 0] = 448.0  # scale exactly 1
    x[2, 0] = 449.0  # rounds up to 2
    x[3, 0] = 1e-30  # block128: clamped at 1e-4 -> 2^-22; mx32: ceil(log2(1e-30 / 448)) = -108
    x[4, 0] = float("nan")
    x.view(torch.int32)[4, 1] = NAN_BITS[torch.float32][1]  # a negative NaN: 0x7F too
    x[5, 130] = float("inf")  # second block128 block, fifth mx32 block
    for kind in ("block128", "mx32", "rowwise"):
        assert quantize_ref(x, kind)[0].view(torch.uint8)[4, :2].tolist() == [0x7F, 0x7F]
    rows, scale = quantize_ref(x, "block128")
    assert scale.dtype == torch.float32 and scale.shape == (6, 2)
    assert scale[:, 0].tolist() == [2.0 ** -22, 1.0, 2.0, 2.0 ** -22, 2.0 ** 127, 2.0 ** -22]
    assert scale[5, 1].item() == 2.0 ** 127 and rows.view(torch.uint8)[5, 130].item() == 0x7E  # Inf saturates
    assert rows.view(torch.uint8)[4, 0].item() == 0x7F and rows.view(torch.uint8)[2, 0].item() == 0x76  # NaN; 224.5 -> 224
    rows, scale = quantize_ref(x, "mx32")
    assert scale.dtype == torch.uint8 and scale.shape == (6, 5)
    assert scale[:, 0].tolist() == [0, 127, 128, 127 - 108, 255, 0]
    assert scale[5].tolist() == [0, 0, 0, 0, 255]
    assert rows.view(torch.uint8)[1, 0].item() == 0x7E  # 448
    rows, scale = quantize_ref(x, "rowwise")  # block128's rule, one block per row
    assert scale.dtype == torch.float32 and scale.shape == (6, 1)
    assert scale[:, 0].tolist() == [2.0 ** -22, 1.0, 2.0, 2.0 ** -22, 2.0 ** 127, 2.0 ** 127]
    assert rows.view(torch.uint8)[5, 130].item() == 0x7E and rows.view(torch.uint8)[5, 0].item() == 0  # Inf; 0 * 2^-127


@pytest.mark.parametrize("target,name", TARGET_VARIANTS)
@pytest.mark.parametrize("cap", ["none", "drop"])
def test_quantizing_permute_matches_reference(target, name, cap, poisoned_empty, request):
    """Rows, scales, probs and row map bit for bit (pad rows and their scales zero, dropped routes
    write nothing), then unpermute of bf16 expert outputs and the backward passes."""
    mod = load(target, name)
    g = generator_for(request)
    (tokens, routing, probs), num_experts = _inputs(mod, target, g)
    needed = needed_rows(mod.VARIANT, routing, num_experts)
    num_out_tokens = None if cap == "none" else needed * 2 // 3
    res, _ = check_roundtrip(mod, target, tokens, routing, probs, None, num_experts=num_experts,
                             num_out_tokens=num_out_tokens, generator=g)
    assert res.tokens.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("target,name", TARGET_VARIANTS)
def test_straight_through_backward(target, name, poisoned_empty, request):
    """The cast is the identity for gradients: token grads are the sum of the routes' bf16 row grads
    (unpermute without probs, the kernel of bf16 permute's backward); prob grads flow through autograd."""
    mod = load(target, name)
    v = mod.VARIANT
    g = generator_for(request)
    (tokens, routing, probs), num_experts = _inputs(mod, target, g, num_tokens=13, hidden=72)
    probs = None if probs is None else probs.requires_grad_()
    res = mod.permute(tokens, routing, probs, num_experts=num_experts)
    assert not res.tokens.requires_grad and not res.scale.requires_grad
    routes = plan_routes(routing, v["routing"], num_experts, v["pad"])
    grad_rows = torch.randn(res.tokens.shape, generator=g).to(torch.bfloat16).to(tokens.device)
    want_tokens, _ = permute_grads_ref(grad_rows, routes, tokens.shape[0])
    assert_sum_close(mod.unpermute(grad_rows, res.row_id_map), want_tokens, "straight-through token grads")
    if probs is not None:
        grad_probs_out = torch.randn(res.probs.shape, generator=g).to(tokens.device)
        (grad_probs,) = torch.autograd.grad(res.probs, probs, grad_probs_out)
        _, want_probs = permute_grads_ref(grad_rows, routes, tokens.shape[0], probs.shape, grad_probs_out)
        assert_bits_equal(grad_probs, want_probs, "prob grads")


@pytest.mark.parametrize("target,name", TARGET_VARIANTS)
def test_scale_argument_refused(target, name):
    mod = load(target, name)
    tokens = torch.zeros(2, 32, dtype=torch.bfloat16, device=device_of(target))
    routing = to_device(device_of(target), routing_from_ids(mod.VARIANT, torch.tensor([[0], [1]]), 2))[0]
    probs = torch.rand(routing.shape, device=tokens.device) if mod.VARIANT["probs"] else None
    with pytest.raises(ValueError, match="computes its .* scales; pass no scale"):
        mod.permute(tokens, routing, probs, torch.ones(2, 1, device=tokens.device), num_experts=2)


@pytest.fixture(scope="module")
def other_dtype_modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantize_dtypes")
    variants = parse_spec(OTHER_DTYPES_SPEC, "quantize_dtypes.toml")
    write_all(render_all(variants), out)
    modules = {}
    for v in variants:
        for target in v.targets:
            spec = importlib.util.spec_from_file_location(f"quantize_{target}_{v.name}", out / target / f"{v.name}.py")
            modules[target, v.name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[target, v.name])
    return modules


@pytest.mark.parametrize("target", ["triton", "nki"])
@pytest.mark.parametrize("name", ["probs_pad8_fp16_to_fp8e4m3_block128_mask", "fp32_to_fp8e4m3_mx32_index",
                                  "fp32_to_fp8e4m3_rowwise_mask"])
def test_fp16_and_fp32_tokens(target, name, other_dtype_modules, poisoned_empty, request):
    """fp16 and fp32 tokens quantise by the same definitions (in fp16 the edge rows beyond its range are Inf blocks)."""
    mod = other_dtype_modules[target, name]
    g = generator_for(request)
    (tokens, routing, probs), num_experts = _inputs(mod, target, g, num_tokens=16, hidden=72)
    check_roundtrip(mod, target, tokens, routing, probs, None, num_experts=num_experts, num_out_tokens=None,
                    generator=g)


# ---------------------------------------------------------------------------------------------
# NKI: rows quantised in SBUF column tiles (permgen.nki.kernels.H_TILE columns each)
# ---------------------------------------------------------------------------------------------

def tile_spanning_rows(tokens: torch.Tensor, tile: int) -> torch.Tensor:
    """Rows 11-14 of edge_tokens rows, rewritten so that what sets a scale sits in a later column tile
    than the row's first: the largest |x| in the last tile, a NaN or an Inf in the second, and a row
    whose first tile alone is large (its later tiles round to zero or subnormal fp8)."""
    hidden = tokens.shape[1]
    x = tokens.float()
    x[11] = x[11] * 1e-3
    x[11, hidden - 2] = -3000.0  # the row's amax, in its last tile
    x[12, tile + 1] = float("nan")
    x[13, tile] = float("inf")
    x[14, :tile] = x[14, :tile] * 1e6
    return x.to(tokens.dtype)


@pytest.mark.parametrize("name", QUANTIZING["nki"])
def test_nki_rows_across_column_tiles(name, monkeypatch, poisoned_empty, request):
    """With tiles of 128 columns, H = 300 spans three (the last ragged): block scales come from the tile
    their block lies in, a row's scale (rowwise) from every tile of the row, read before the first is
    converted. Rows, scales, pad rows and their zero scales bit for bit against the reference."""
    monkeypatch.setattr(nki_kernels, "H_TILE", 128)
    mod = load("nki", name)
    g = generator_for(request)
    (tokens, routing, probs), num_experts = _inputs(mod, "nki", g, hidden=300)
    tokens = tile_spanning_rows(tokens, 128)
    for cap in (None, needed_rows(mod.VARIANT, routing, num_experts) * 2 // 3):
        res, _ = check_permute(mod, tokens, routing, probs, None, num_experts=num_experts, num_out_tokens=cap)
        assert res.tokens.dtype == torch.float8_e4m3fn


ROWWISE_NKI = [n for n in QUANTIZING["nki"] if permgen.VARIANTS[n]["quantize"] == "rowwise"]


@pytest.mark.parametrize("name", ROWWISE_NKI)
def test_nki_rowwise_rows_of_the_widest_hidden(name, poisoned_empty, request):
    """H = 16384 (nki_host.MAX_HIDDEN), eight SBUF column tiles of a row held at once: one scale per row
    from all of them. Wider rows are refused before any launch."""
    mod = load("nki", name)
    g = generator_for(request)
    hidden = nki_host.MAX_HIDDEN
    (tokens, routing, probs), num_experts = _inputs(mod, "nki", g, num_tokens=16, hidden=hidden, num_experts=4, k=2)
    tokens = tile_spanning_rows(tokens, nki_kernels.H_TILE)
    res, _ = check_permute(mod, tokens, routing, probs, None, num_experts=num_experts)
    assert res.scale.shape == (res.tokens.shape[0], 1)
    wider = torch.zeros(2, hidden + 1, dtype=tokens.dtype)
    with pytest.raises(ValueError, match=f"rows of at most {hidden} columns rowwise"):
        mod.permute(wider, routing[:2], None if probs is None else probs[:2], num_experts=num_experts)


@pytest.mark.parametrize("name", ROWWISE_NKI)
def test_nki_rowwise_rows_of_no_columns(name):
    """H = 0: rowwise still gives every row a scale ([M, 1]), that of a row of zeros, as the reference does."""
    mod = load("nki", name)
    tokens = torch.zeros(3, 0, dtype=torch.bfloat16)
    routing = routing_from_ids(mod.VARIANT, torch.tensor([[0], [1], [1]]), 2)
    probs = torch.rand(routing.shape) if mod.VARIANT["probs"] else None
    res, _ = check_permute(mod, tokens, routing, probs, None, num_experts=2)
    assert res.scale.shape == (res.tokens.shape[0], 1)
