"""Bad input to the generated Triton host functions and to the registry fails with a clear
TypeError / ValueError / LookupError that says what was expected, before any kernel runs; bad
expert ids with checking off route nowhere instead of writing out of bounds."""

import re

import pytest
import torch

import permgen
from cases import (
    DEVICE,
    META,
    assert_bits_equal,
    assert_sum_close,
    combine_dtype,
    expert_ids,
    generator_for,
    make_scale,
    make_tokens,
    routing_from_ids,
    to_device,
    token_dtype,
)
from cases import load as load_variant
from generator.spec import parse_spec
from permgen.contract import AXES
from permgen.triton_host import TritonKernels
from reference import permute_ref, unpermute_ref

MASK = "probs_bf16_mask"
INDEX = "probs_bf16_index"
INDEX_NO_PROBS = "bf16_index"
BLOCK128 = "probs_pad128_fp8e4m3_block128_mask"
MX32 = "probs_pad32_fp8e4m3_mx32_index"
N, H, E, K = 12, 72, 5, 2


def load(name):
    return load_variant("triton", name)


@pytest.fixture
def g(request):
    """A generator seeded from the test's id: fresh inputs per test, reproducible per test."""
    return generator_for(request)


def inputs(name, g, n=N, h=H, e=E, k=K):
    """Valid (tokens, routing, probs, scale, kwargs) for variant `name`: k distinct experts per token."""
    v = load(name).VARIANT
    tokens = make_tokens(v, n, h, g)
    routing = routing_from_ids(v, expert_ids(n, e, k, g), e)
    probs = torch.rand(routing.shape, generator=g) if v["probs"] else None
    scale = make_scale(v, n, h, g)
    kwargs = {} if v["routing"] == "mask" else {"num_experts": e}
    return (*to_device(DEVICE, tokens, routing, probs, scale), kwargs)


def raises(exc, *words):
    """pytest.raises that also checks every word appears in the message (literal match)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(w)})" for w in words))


def assert_no_kernel(monkeypatch, mod):
    """Make any launch fail loudly: the checks must fire before a kernel is reached.

    The backend's kernels become None (a launch raises TypeError: 'NoneType' is not
    subscriptable); its device check keeps the device the real kernels run on, decided when the
    backend was made."""
    monkeypatch.setattr(mod._ops.backend, "kernels", TritonKernels(*[None] * len(TritonKernels._fields)))


@pytest.fixture
def strict(monkeypatch):
    def apply(name):
        mod = load(name)
        assert_no_kernel(monkeypatch, mod)
        return mod
    return apply


def test_strict_modules_cannot_launch(g, strict):
    """The `strict` fixture is what makes the tests below mean something: valid input reaches a launch, which fails."""
    mod = strict(MASK)
    tokens, routing, probs, _, kw = inputs(MASK, g)
    with pytest.raises(TypeError, match="NoneType"):
        mod.permute(tokens, routing, probs, **kw)


# ---------------------------------------------------------------------------------------------
# permute: tokens
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [MASK, INDEX, BLOCK128])
def test_tokens_wrong_dtype(name, g, strict):
    mod = strict(name)
    tokens, routing, probs, scale, kw = inputs(name, g)
    with raises(TypeError, f"{name}: tokens must have dtype {token_dtype(mod.VARIANT)}", "got torch.float32"):
        mod.permute(tokens.float(), routing, probs, scale, **kw)


@pytest.mark.parametrize("shape", [(N * H,), (1, N, H), ()])
def test_tokens_not_2d(shape, g, strict):
    mod = strict(MASK)
    tokens, routing, probs, _, kw = inputs(MASK, g)
    with raises(ValueError, "tokens must have shape [*, *]", f"got {list(shape)}"):
        mod.permute(tokens.reshape(shape) if shape else tokens[0, 0], routing, probs, **kw)


def test_tokens_not_contiguous(g, strict):
    mod = strict(INDEX)
    tokens, routing, probs, _, kw = inputs(INDEX, g)
    strided = torch.empty(H, N, dtype=tokens.dtype, device=DEVICE).t()
    strided.copy_(tokens)
    with raises(ValueError, "tokens must be contiguous", ".contiguous()"):
        mod.permute(strided, routing, probs, **kw)
    with raises(ValueError, "tokens must be contiguous"):
        mod.permute(torch.empty(N, 2 * H, dtype=tokens.dtype, device=DEVICE)[:, ::2], routing, probs, **kw)


@pytest.mark.parametrize("bad", [[[1.0, 2.0]], None, 3.0])
def test_tokens_not_a_tensor(bad, g, strict):
    mod = strict(INDEX)
    _, routing, probs, _, kw = inputs(INDEX, g)
    with raises(TypeError, "tokens must be a torch.Tensor", f"got {type(bad).__name__}"):
        mod.permute(bad, routing, probs, **kw)


# ---------------------------------------------------------------------------------------------
# permute: routing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [MASK, INDEX])
def test_routing_token_count_mismatch(name, g, strict):
    mod = strict(name)
    tokens, routing, probs, _, kw = inputs(name, g)
    with raises(ValueError, "routing must have shape", f"[{N}, *]", f"got [{N - 1}, "):
        mod.permute(tokens, routing[:-1].contiguous(), probs, **kw)


@pytest.mark.parametrize("name", [MASK, INDEX])
def test_routing_1d(name, g, strict):
    mod = strict(name)
    tokens, routing, probs, _, kw = inputs(name, g)
    with raises(ValueError, "routing must have shape", f"[{N}, *]"):
        mod.permute(tokens, routing.reshape(-1), probs, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.bool])
def test_index_routing_dtype(dtype, g, strict):
    mod = strict(INDEX)
    tokens, routing, probs, _, kw = inputs(INDEX, g)
    with raises(TypeError, "routing must have dtype torch.int32 or torch.int64", f"got {dtype}"):
        mod.permute(tokens, routing.to(dtype), probs, **kw)


def test_index_routing_int64_is_accepted(g):
    mod = load(INDEX)
    tokens, routing, probs, _, kw = inputs(INDEX, g)
    a = mod.permute(tokens, routing, probs, **kw)
    b = mod.permute(tokens, routing.long(), probs, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.row_id_map.dst_rows, b.row_id_map.dst_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mask_routing_float(dtype, g, strict):
    mod = strict(MASK)
    tokens, routing, probs, _, kw = inputs(MASK, g)
    with raises(TypeError, "routing must be a bool or integer [N, E] mask", str(dtype)):
        mod.permute(tokens, routing.to(dtype), probs, **kw)


def test_mask_routing_not_a_tensor(g, strict):
    mod = strict(MASK)
    tokens, routing, probs, _, kw = inputs(MASK, g)
    with raises(TypeError, "routing must be a bool or integer [N, E] mask", "list"):
        mod.permute(tokens, routing.tolist(), probs, **kw)


@pytest.mark.parametrize("name", [MASK, INDEX])
def test_routing_not_contiguous(name, g, strict):
    mod = strict(name)
    tokens, routing, probs, _, kw = inputs(name, g)
    wide = torch.zeros(N, 2 * routing.shape[1], dtype=routing.dtype, device=DEVICE)
    wide[:, ::2] = routing
    with raises(ValueError, "routing must be contiguous"):
        mod.permute(tokens, wide[:, ::2], probs, **kw)


@pytest.mark.parametrize("name", [MASK, INDEX])
def test_routing_on_another_device(name, g, strict):
    if DEVICE == META:
        pytest.skip("inputs already on meta")
    mod = strict(name)
    tokens, routing, probs, _, kw = inputs(name, g)
    with raises(ValueError, "routing is on meta", f"expected {DEVICE}", "the tokens' device"):
        mod.permute(tokens, routing.to(META), probs, **kw)


@pytest.mark.parametrize("name", [MASK, INDEX])
def test_probs_on_another_device(name, g, strict):
    mod = strict(name)
    tokens, routing, probs, _, kw = inputs(name, g)
    with raises(ValueError, "probs is on meta", f"expected {DEVICE}"):
        mod.permute(tokens, routing, probs.to(META), **kw)


def test_scale_on_another_device(g, strict):
    mod = strict(MX32)
    tokens, routing, probs, scale, kw = inputs(MX32, g)
    with raises(ValueError, "scale is on meta", f"expected {DEVICE}"):
        mod.permute(tokens, routing, probs, scale.to(META), **kw)


# ---------------------------------------------------------------------------------------------
# permute: probs, scale
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, cols", [(MASK, "[N, E]"), (INDEX, "[N, k]"), (BLOCK128, "[N, E]"), (MX32, "[N, k]")])
def test_probs_missing(name, cols, g, strict):
    mod = strict(name)
    tokens, routing, _, scale, kw = inputs(name, g)
    with raises(ValueError, f"{name}: this variant permutes probs", f"pass probs {cols}"):
        mod.permute(tokens, routing, None, scale, **kw)


def test_probs_given_to_a_variant_without_probs(g, strict):
    mod = strict(INDEX_NO_PROBS)
    tokens, routing, _, _, kw = inputs(INDEX_NO_PROBS, g)
    with raises(ValueError, "bf16_index: this variant has no probs", "probs = true"):
        mod.permute(tokens, routing, torch.rand(N, K, generator=g), **kw)


@pytest.mark.parametrize("name, shape, want", [
    (MASK, (N, E + 1), f"[{N}, {E}]"), (MASK, (N, K), f"[{N}, {E}]"), (MASK, (N - 1, E), f"[{N}, {E}]"),
    (MASK, (N * E,), f"[{N}, {E}]"),
    (INDEX, (N, E), f"[{N}, {K}]"), (INDEX, (N, K + 1), f"[{N}, {K}]"), (INDEX, (N,), f"[{N}, {K}]"),
])
def test_probs_wrong_shape(name, shape, want, g, strict):
    mod = strict(name)
    tokens, routing, _, scale, kw = inputs(name, g)
    with raises(ValueError, "probs must have shape", want, f"got {list(shape)}"):
        mod.permute(tokens, routing, torch.rand(shape, generator=g), scale, **kw)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.bool])
def test_probs_wrong_dtype(dtype, g, strict):
    mod = strict(INDEX)
    tokens, routing, probs, _, kw = inputs(INDEX, g)
    with raises(TypeError, "probs must have dtype", "torch.float32", f"got {dtype}"):
        mod.permute(tokens, routing, probs.to(dtype), **kw)


@pytest.mark.parametrize("name, cols", [(BLOCK128, 128), (MX32, 32)])
def test_scale_missing(name, cols, g, strict):
    mod = strict(name)
    tokens, routing, probs, _, kw = inputs(name, g)
    with raises(ValueError, f"this variant moves {mod.VARIANT['scale']} scales", f"pass scale [N, ceil(H / {cols})]"):
        mod.permute(tokens, routing, probs, None, **kw)


@pytest.mark.parametrize("name, cols", [(BLOCK128, -(-H // 128)), (MX32, -(-H // 32))])
def test_scale_wrong_shape(name, cols, g, strict):
    mod = strict(name)
    tokens, routing, probs, scale, kw = inputs(name, g)
    for bad in (scale[:, :0], torch.cat([scale, scale], 1), scale[:-1], scale.reshape(-1)):
        with raises(ValueError, "scale must have shape", f"[{N}, {cols}]", f"got {list(bad.shape)}"):
            mod.permute(tokens, routing, probs, bad.contiguous(), **kw)


@pytest.mark.parametrize("name, bad_dtype, want", [
    (BLOCK128, torch.float16, "torch.float32"), (BLOCK128, torch.bfloat16, "torch.float32"),
    (BLOCK128, torch.int32, "torch.float32"),
    (MX32, torch.int8, "torch.uint8"), (MX32, torch.float32, "torch.uint8"),
    (MX32, torch.float8_e8m0fnu, "torch.uint8"),
])
def test_scale_wrong_dtype(name, bad_dtype, want, g, strict):
    mod = strict(name)
    tokens, routing, probs, scale, kw = inputs(name, g)
    with raises(TypeError, f"scale must have dtype {want}", f"got {bad_dtype}"):
        mod.permute(tokens, routing, probs, scale.to(bad_dtype), **kw)


@pytest.mark.parametrize("name", [MASK, INDEX, INDEX_NO_PROBS])
def test_scale_given_to_a_variant_without_scales(name, g, strict):
    mod = strict(name)
    tokens, routing, probs, _, kw = inputs(name, g)
    with raises(ValueError, "this variant moves no scales", "fp8 scale"):
        mod.permute(tokens, routing, probs, torch.ones(N, 1), **kw)


# ---------------------------------------------------------------------------------------------
# permute: num_experts, num_out_tokens, topk
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [INDEX, INDEX_NO_PROBS, MX32])
def test_index_routing_needs_num_experts(name, g, strict):
    mod = strict(name)
    tokens, routing, probs, scale, _ = inputs(name, g)
    with raises(ValueError, "index routing needs num_experts"):
        mod.permute(tokens, routing, probs, scale)


@pytest.mark.parametrize("bad", [0, -3, True, 5.0, "5"])
def test_index_num_experts_not_a_positive_int(bad, g, strict):
    mod = strict(INDEX)
    tokens, routing, probs, _, _ = inputs(INDEX, g)
    with raises(ValueError, "num_experts must be a positive int", repr(bad)):
        mod.permute(tokens, routing, probs, num_experts=bad)


@pytest.mark.parametrize("bad", [E - 1, E + 1, 1])
def test_mask_num_experts_mismatch(bad, g, strict):
    mod = strict(MASK)
    tokens, routing, probs, _, _ = inputs(MASK, g)
    with raises(ValueError, f"num_experts={bad}", f"the routing mask has {E} columns"):
        mod.permute(tokens, routing, probs, num_experts=bad)


def test_mask_num_experts_matching_is_accepted(g):
    mod = load(MASK)
    tokens, routing, probs, _, _ = inputs(MASK, g)
    assert mod.permute(tokens, routing, probs, num_experts=E).tokens_per_expert.shape == (E,)


@pytest.mark.parametrize("name", [MASK, INDEX])
@pytest.mark.parametrize("bad", [-1, True, False, 2**31 - 1, 2**40, 3.0, "8"])
def test_num_out_tokens_out_of_range(name, bad, g, strict):
    mod = strict(name)
    tokens, routing, probs, _, kw = inputs(name, g)
    with raises(ValueError, "num_out_tokens must be an int in [0, 2**31 - 1)", repr(bad)):
        mod.permute(tokens, routing, probs, num_out_tokens=bad, **kw)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_mask_topk_not_a_positive_int(bad, g, strict):
    mod = strict(MASK)
    tokens, routing, probs, _, _ = inputs(MASK, g)
    with raises(ValueError, "topk must be a positive int", repr(bad)):
        mod.permute(tokens, routing, probs, topk=bad)


# ---------------------------------------------------------------------------------------------
# permute: routing values, checking on
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad_id", [99, E, -5, -2])
@pytest.mark.parametrize("name", [INDEX, INDEX_NO_PROBS, MX32])
def test_expert_ids_out_of_range_with_checking(name, bad_id, g, strict):
    mod = strict(name)
    tokens, routing, probs, scale, kw = inputs(name, g)
    routing[3, 1] = bad_id
    expected = ("expert ids must be in [0, 5) or -1 for no route", str(bad_id))
    with raises(ValueError, *expected):
        mod.permute(tokens, routing, probs, scale, **kw, check_routing=True)
    with raises(ValueError, *expected):  # checking is the default when no row cap is given
        mod.permute(tokens, routing, probs, scale, **kw)
    with raises(ValueError, *expected):
        mod.permute(tokens, routing, probs, scale, **kw, num_out_tokens=N * K, check_routing=True)


def test_minus_one_is_no_route(g, poisoned_empty):
    mod = load(INDEX)
    tokens, routing, probs, _, kw = inputs(INDEX, g)
    routing[::3, 0] = -1
    res = mod.permute(tokens, routing, probs, **kw, check_routing=True)
    ref_tokens, ref_probs, _, ref_tpe, routes = permute_ref(tokens, routing, routing_kind="index", num_experts=E,
                                                             probs=probs)
    assert res.tokens.shape[0] == N * K - len(range(0, N, 3))
    assert torch.equal(res.tokens, ref_tokens) and torch.equal(res.probs, ref_probs)
    assert torch.equal(res.tokens_per_expert, ref_tpe)
    assert bool((res.row_id_map.dst_rows[::3, 0] == -1).all())


@pytest.mark.parametrize("cap", [None, "given"])
def test_mask_more_routes_than_topk_with_checking(cap, g, strict):
    mod = strict(MASK)
    tokens, routing, probs, _, _ = inputs(MASK, g)  # K = 2 routes per token
    routing[4, :3] = True
    routing[4, 3:] = False
    extra = {} if cap is None else {"num_out_tokens": N * 3}
    with raises(ValueError, "a token is routed to 3 experts, more than topk=2"):
        mod.permute(tokens, routing, probs, topk=2, check_routing=True, **extra)


def test_mask_topk_found_without_cap(g):
    mod = load(MASK)
    tokens, routing, probs, _, _ = inputs(MASK, g)
    routing[4] = True  # one token routed to every expert
    res = mod.permute(tokens, routing, probs)
    assert res.row_id_map.dst_rows.shape == (N, E)
    _, _, _, ref_tpe, _ = permute_ref(tokens, routing, routing_kind="mask", num_experts=E, probs=probs)
    assert torch.equal(res.tokens_per_expert, ref_tpe)


# ---------------------------------------------------------------------------------------------
# Routing values with checking off: ids out of range route nowhere, nothing is written out of bounds.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [INDEX, INDEX_NO_PROBS, MX32])
@pytest.mark.parametrize("cap", [None, "drop", "spare"])
def test_out_of_range_ids_unchecked_route_nowhere(name, cap, g, poisoned_empty):
    mod = load(name)
    n, k, e = 23, 3, 6
    tokens, routing, probs, scale, kw = inputs(name, g, n=n, e=e, k=k)
    kw["num_experts"] = e
    bad = torch.tensor([99, -5, e, -1, 2**31 - 1, -(2**31)], dtype=torch.int32)
    where = torch.rand(n, k, generator=g) < 0.35
    routing[where] = bad[torch.randint(0, len(bad), (int(where.sum()),), generator=g)].to(routing.device)
    routing[0, 0], routing[1, 2], routing[2, 1] = 99, -5, e  # each kind at least once
    pad = mod.VARIANT["pad"]
    needed = permute_ref(tokens, routing, routing_kind="index", num_experts=e, pad=pad)[4].num_rows
    num_out = {None: None, "drop": needed // 2, "spare": needed + 7}[cap]

    res = mod.permute(tokens, routing, probs, scale, **kw, num_out_tokens=num_out, check_routing=False)
    ref_tokens, ref_probs, ref_scale, ref_tpe, routes = permute_ref(
        tokens, routing, routing_kind="index", num_experts=e, probs=probs, scale=scale, pad=pad, num_out_tokens=num_out)
    assert_bits_equal(res.tokens, ref_tokens)
    assert torch.equal(res.tokens_per_expert, ref_tpe)
    if probs is not None:
        assert torch.equal(res.probs, ref_probs)
    if scale is not None:
        assert torch.equal(res.scale, ref_scale)
    dst = res.row_id_map.dst_rows
    assert bool(((dst >= -1) & (dst < res.tokens.shape[0])).all())
    bad_routes = (routing < 0) | (routing >= e)
    assert bool((dst[bad_routes] == -1).all())

    # unpermute sees the dropped routes as absent.
    combine = torch.randn(res.tokens.shape, generator=g).to(combine_dtype(mod.VARIANT)).to(DEVICE)
    out = mod.unpermute(combine, res.row_id_map, probs)
    assert_sum_close(out, unpermute_ref(combine, routes, n, probs))
    assert not out.isnan().any()


def test_mask_extra_routes_unchecked_stay_in_bounds(g, poisoned_empty):
    """More routes than topk with checking off: only the first topk experts of a token are kept."""
    mod = load(MASK)
    tokens, routing, probs, _, _ = inputs(MASK, g)
    routing[4] = True
    res = mod.permute(tokens, routing, probs, topk=K, check_routing=False)
    kept = routing.clone()
    kept[4] = False
    kept[4, :K] = True
    ref_tokens, ref_probs, _, ref_tpe, _ = permute_ref(tokens, kept, routing_kind="mask", num_experts=E, probs=probs)
    assert torch.equal(res.tokens, ref_tokens) and torch.equal(res.probs, ref_probs)
    assert torch.equal(res.tokens_per_expert, ref_tpe)


# ---------------------------------------------------------------------------------------------
# unpermute
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def permuted(g):
    def make(name):
        mod = load(name)
        tokens, routing, probs, scale, kw = inputs(name, g)
        res = mod.permute(tokens, routing, probs, scale, **kw)
        combine = torch.randn(res.tokens.shape, generator=g).to(combine_dtype(mod.VARIANT)).to(DEVICE)
        return mod, res, combine, probs
    return make


@pytest.mark.parametrize("name", [MASK, INDEX_NO_PROBS])
def test_unpermute_wrong_shape(name, permuted, monkeypatch):
    mod, res, combine, probs = permuted(name)
    assert_no_kernel(monkeypatch, mod)
    m = res.row_id_map.num_rows
    for bad in (combine[:-1], torch.cat([combine, combine[:1]]), combine.reshape(-1), combine[None]):
        with raises(ValueError, "permuted must have shape", f"[{m}, *]", f"got {list(bad.shape)}"):
            mod.unpermute(bad.contiguous(), res.row_id_map, probs)


@pytest.mark.parametrize("name", [BLOCK128, MX32])
def test_fp8_unpermute_expects_bf16(name, permuted, monkeypatch):
    mod, res, combine, probs = permuted(name)
    assert_no_kernel(monkeypatch, mod)
    assert combine_dtype(mod.VARIANT) == torch.bfloat16
    with raises(TypeError, "permuted must have dtype torch.bfloat16", f"got {res.tokens.dtype}"):
        mod.unpermute(res.tokens, res.row_id_map, probs)  # the fp8 rows themselves


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unpermute_wrong_dtype(dtype, permuted, monkeypatch):
    mod, res, combine, probs = permuted(MASK)
    assert_no_kernel(monkeypatch, mod)
    with raises(TypeError, "permuted must have dtype torch.bfloat16", f"got {dtype}"):
        mod.unpermute(combine.to(dtype), res.row_id_map, probs)


def test_unpermute_not_contiguous_or_elsewhere(permuted, monkeypatch):
    mod, res, combine, probs = permuted(INDEX)
    assert_no_kernel(monkeypatch, mod)
    strided = torch.empty(combine.shape[1], combine.shape[0], dtype=combine.dtype, device=DEVICE).t()
    with raises(ValueError, "permuted must be contiguous"):
        mod.unpermute(strided, res.row_id_map, probs)
    with raises(ValueError, "permuted is on meta"):
        mod.unpermute(combine.to(META), res.row_id_map, probs)


@pytest.mark.parametrize("bad", ["tuple", "list", "none"])
def test_unpermute_row_id_map_not_a_row_id_map(bad, permuted, monkeypatch):
    mod, res, combine, probs = permuted(INDEX)
    assert_no_kernel(monkeypatch, mod)
    row_id_map = {"tuple": tuple(res.row_id_map), "list": list(res.row_id_map), "none": None}[bad]
    with raises(TypeError, "row_id_map must be the RowIdMap from this module's permute",
                f"got {type(row_id_map).__name__}"):
        mod.unpermute(combine, row_id_map, probs)


def test_unpermute_row_id_map_of_another_variant(permuted, monkeypatch, g):
    """A RowIdMap, but from another variant's permute: its layout may differ, so it is refused."""
    mod, res, combine, probs = permuted(INDEX)
    assert_no_kernel(monkeypatch, mod)
    tokens, routing, _, _, kw = inputs(INDEX_NO_PROBS, g)
    other = load(INDEX_NO_PROBS).permute(tokens, routing, **kw).row_id_map
    assert other.num_rows == res.row_id_map.num_rows  # same sizes: only the variant differs
    with raises(ValueError, f"{INDEX}: row_id_map comes from variant {INDEX_NO_PROBS}'s permute"):
        mod.unpermute(combine, other, probs)


def test_unpermute_merging_probs_on_a_variant_without_probs(permuted, monkeypatch, g):
    mod, res, combine, _ = permuted(INDEX_NO_PROBS)
    assert_no_kernel(monkeypatch, mod)
    with raises(ValueError, "this variant has no probs"):
        mod.unpermute(combine, res.row_id_map, torch.rand(N, K, generator=g).to(DEVICE))


@pytest.mark.parametrize("name, shape, want", [(MASK, (N, K), f"[{N}, {E}]"), (INDEX, (N, E), f"[{N}, {K}]"),
                                               (INDEX, (N + 1, K), f"[{N}, {K}]")])
def test_unpermute_merging_probs_wrong_shape(name, shape, want, permuted, monkeypatch, g):
    mod, res, combine, _ = permuted(name)
    assert_no_kernel(monkeypatch, mod)
    with raises(ValueError, "merging_probs must have shape", want):
        mod.unpermute(combine, res.row_id_map, torch.rand(shape, generator=g).to(DEVICE))


@pytest.mark.parametrize("restore_shape", [(N + 1, H), (N, H - 1), (H, N), (N,), (N, H, 1)])
def test_unpermute_bad_restore_shape(restore_shape, permuted, monkeypatch):
    mod, res, combine, probs = permuted(MASK)
    assert_no_kernel(monkeypatch, mod)
    with raises(ValueError, f"restore_shape {tuple(restore_shape)} does not match", f"{N} tokens", f"hidden size {H}"):
        mod.unpermute(combine, res.row_id_map, probs, restore_shape=restore_shape)


@pytest.mark.parametrize("restore_shape", [N * H, 1.5])
def test_unpermute_restore_shape_not_a_sequence(restore_shape, permuted, monkeypatch):
    mod, res, combine, probs = permuted(MASK)
    assert_no_kernel(monkeypatch, mod)
    with raises((TypeError, ValueError), "restore_shape", "(N, H)"):
        mod.unpermute(combine, res.row_id_map, probs, restore_shape=restore_shape)


def test_unpermute_good_restore_shape(permuted):
    mod, res, combine, probs = permuted(MASK)
    out = mod.unpermute(combine, res.row_id_map, probs, restore_shape=torch.Size([N, H]))
    assert out.shape == (N, H)


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

def test_get_kernel_returns_the_matching_module():
    for name, spec in permgen.VARIANTS.items():
        if "triton" not in spec["targets"]:
            continue
        axes = {a: spec[a] for a in AXES if a != "targets"}
        mod = permgen.get_kernel("triton", **axes)
        assert mod.__name__ == f"permgen.generated.triton.{name}"
        assert mod.VARIANT == {"name": name, **spec}
        assert permgen.find_variant("triton", **axes) == name
        if "nki" in spec["targets"]:
            assert permgen.find_variant("nki", **axes) == name


def test_get_kernel_fills_axis_defaults():
    mod = permgen.get_kernel("triton", dtype="bf16", routing="mask")
    assert mod.__name__ == "permgen.generated.triton.probs_bf16_mask"
    mod = permgen.get_kernel("triton", dtype="bf16", routing="index", probs=False)
    assert mod.__name__ == "permgen.generated.triton.bf16_index"


@pytest.mark.parametrize("axes", [
    dict(dtype="fp16", routing="index", probs=False, pad=64),
    dict(dtype="fp16", routing="mask", probs=False),
    dict(dtype="fp8_e5m2", routing="mask", scale="mx32", pad=8),
])
def test_get_kernel_miss_names_nearest_and_the_variant_to_add(axes):
    with pytest.raises(LookupError) as info:
        permgen.get_kernel("triton", **axes)
    message = str(info.value)
    nearest = re.search(r"Nearest: ([\w, ]+)\.", message)
    assert nearest, message
    names = nearest.group(1).split(", ")
    assert names and all(n in permgen.VARIANTS for n in names)
    assert "[[variant]]" in message and "variants.toml" in message and "make generate" in message
    # The suggested entry is a valid spec for exactly the requested variant.
    entry = message[message.index("[[variant]]"):message.index("then run")]
    (variant,) = parse_spec(entry, "suggestion")
    wanted = {"probs": True, "scale": "none", "pad": 0, **axes}
    assert {a: getattr(variant, a) for a in wanted} == wanted
    assert variant.targets == ("triton",)


def test_nearest_variants_come_first():
    with pytest.raises(LookupError) as info:
        permgen.get_kernel("triton", dtype="fp16", routing="mask", probs=False)
    nearest = re.search(r"Nearest: ([\w, ]+)\.", str(info.value)).group(1).split(", ")
    assert set(nearest[:2]) == {"probs_fp16_mask", "bf16_mask"}  # each one axis away


@pytest.mark.parametrize("axes, words", [
    (dict(dtype="bf16", routing="mask", colour="red"), ["unknown axes ['colour']", "dtype"]),
    (dict(dtype="bf16", routing="mask", targets=["triton"]), ["unknown axes ['targets']"]),
    (dict(dtype="bf16", routing="mask", name="probs_bf16_mask"), ["unknown axes ['name']"]),
    (dict(routing="mask"), ["missing ['dtype']"]),
    (dict(dtype="bf16"), ["missing ['routing']"]),
])
def test_get_kernel_bad_axis_names(axes, words):
    with raises(TypeError, *words):
        permgen.get_kernel("triton", **axes)


@pytest.mark.parametrize("target", ["cuda", "Triton", "", None, "nki "])
def test_get_kernel_bad_target(target):
    with raises(ValueError, "target must be 'triton' or 'nki'", repr(target)):
        permgen.get_kernel(target, dtype="bf16", routing="mask")


@pytest.mark.parametrize("axes, key", [
    (dict(dtype="int8", routing="mask"), "dtype"),
    (dict(dtype="bf16", routing="topk"), "routing"),
    (dict(dtype="bf16", routing="mask", scale="mx32"), "scale"),
    (dict(dtype="bf16", routing="mask", pad=3), "pad"),
    (dict(dtype="bf16", routing="mask", probs="yes"), "probs"),
])
def test_get_kernel_impossible_axes_say_which_value_is_wrong(axes, key):
    with raises(ValueError, key, repr(axes[key])):
        permgen.get_kernel("triton", **axes)
