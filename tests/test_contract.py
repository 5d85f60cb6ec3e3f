"""Both targets keep one contract: the same public signatures, and for the same bad input to the
same spec entry, the same exception type with the same message (permgen.contract's words).

Each bad input is fed to the Triton and the NKI module of a variant. Per target, the error must
have the expected type and words; across targets, type and message must be identical (device
names aside: the Triton target runs where CUDA is, the NKI emulator on CPU tensors).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

import permgen
from cases import META, combine_dtype, device_of, expert_ids, load, make_scale, make_tokens, routing_from_ids, \
    stable_seed, to_device

TARGETS = ["triton", "nki"]
N, H, E, K = 12, 72, 5, 2


def _both_targets(spec):
    return all(t in spec["targets"] for t in TARGETS)


def _representatives():
    """One variant per combination of what the checks branch on: routing, probs, scales."""
    chosen = {}
    for name, spec in permgen.VARIANTS.items():
        if _both_targets(spec):
            chosen.setdefault((spec["routing"], spec["probs"], spec["scale"]), name)
    return sorted(chosen.values())


VARIANTS = _representatives()
SHARED_VARIANTS = sorted(n for n, s in permgen.VARIANTS.items() if _both_targets(s))


# ---------------------------------------------------------------------------------------------
# Valid inputs: the same values on both targets, each on its target's device
# ---------------------------------------------------------------------------------------------

_inputs_cache: dict = {}


def valid_inputs(target: str, name: str):
    """tokens, routing, probs, scale, kw (num_experts for index routing), and for unpermute: a
    permute result with matching expert outputs and merging probs. Values depend on `name` only."""
    key = (target, name)
    if key not in _inputs_cache:
        mod = load(target, name)
        v = mod.VARIANT
        g = torch.Generator().manual_seed(stable_seed("contract", name))
        tokens = make_tokens(v, N, H, g)
        routing = routing_from_ids(v, expert_ids(N, E, K, g), E)
        probs = torch.rand(routing.shape, generator=g) if v["probs"] else None
        scale = make_scale(v, N, H, g)
        device = device_of(target)
        tokens, routing, probs, scale = to_device(device, tokens, routing, probs, scale)
        kw = {} if v["routing"] == "mask" else {"num_experts": E}
        res = mod.permute(tokens, routing, probs, scale, **kw)
        combine = torch.randn(res.tokens.shape, generator=g).to(combine_dtype(v)).to(device)
        # device: as messages name it (cuda:0, not cuda)
        _inputs_cache[key] = SimpleNamespace(tokens=tokens, routing=routing, probs=probs, scale=scale, kw=kw,
                                             res=res, combine=combine, variant=v, device=tokens.device)
    return _inputs_cache[key]


def strided(t):
    """The same values, not contiguous."""
    wide = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype, device=t.device)
    wide[:, ::2] = t
    return wide[:, ::2]


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bad:
    name: str
    call: Callable  # (module, valid inputs) -> the call's result
    error: type
    words: tuple
    applies: Callable = lambda v: True

    def __str__(self):
        return self.name


def permute_with(**changes):
    """A permute call with some of the valid arguments replaced: f(x) -> new value."""
    def call(mod, x):
        args = {"tokens": x.tokens, "routing": x.routing, "probs": x.probs, "scale": x.scale}
        kw = dict(x.kw)
        for key, change in changes.items():
            value = change(x)
            if key in args:
                args[key] = value
            elif value is _DROP:
                kw.pop(key, None)
            else:
                kw[key] = value
        return mod.permute(args["tokens"], args["routing"], args["probs"], args["scale"], **kw)
    return call


def unpermute_with(**changes):
    def call(mod, x):
        args = {"permuted": x.combine, "row_id_map": x.res.row_id_map, "merging_probs": x.probs, "restore_shape": None}
        for key, change in changes.items():
            args[key] = change(x)
        return mod.unpermute(args["permuted"], args["row_id_map"], args["merging_probs"], args["restore_shape"])
    return call


_DROP = object()


def mask(v):
    return v["routing"] == "mask"


def index(v):
    return v["routing"] == "index"


def with_probs(v):
    return v["probs"]


def without_probs(v):
    return not v["probs"]


def with_scale(v):
    return v["scale"] != "none"


def without_scale(v):
    return v["scale"] == "none"


def _routed_everywhere(x):
    routing = x.routing.clone()
    routing[0] = True
    return routing


def _bad_expert_id(x):
    routing = x.routing.clone()
    routing[3, 1] = E
    return routing


BAD = [
    # tokens
    Bad("tokens_float64", permute_with(tokens=lambda x: x.tokens.double()), TypeError,
        ("tokens must have dtype", "got torch.float64")),
    Bad("tokens_1d", permute_with(tokens=lambda x: x.tokens.reshape(-1)), ValueError,
        ("tokens must have shape [*, *]", f"got [{N * H}]")),
    Bad("tokens_list", permute_with(tokens=lambda x: x.tokens.float().tolist()), TypeError,
        ("tokens must be a torch.Tensor", "got list")),
    Bad("tokens_strided", permute_with(tokens=lambda x: strided(x.tokens)), ValueError,
        ("tokens must be contiguous",)),
    # routing
    Bad("routing_rows", permute_with(routing=lambda x: x.routing[:-1].contiguous()), ValueError,
        ("routing must have shape", f"[{N}, *]", f"got [{N - 1}, ")),
    Bad("routing_1d", permute_with(routing=lambda x: x.routing.reshape(-1)), ValueError,
        ("routing must have shape", f"[{N}, *]")),
    Bad("routing_meta", permute_with(routing=lambda x: x.routing.to(META)), ValueError,
        ("routing is on meta", "the tokens' device")),
    Bad("routing_strided", permute_with(routing=lambda x: strided(x.routing)), ValueError,
        ("routing must be contiguous",)),
    Bad("mask_routing_float", permute_with(routing=lambda x: x.routing.float()), TypeError,
        ("routing must be a bool or integer [N, E] mask", "torch.float32"), mask),
    Bad("index_routing_float", permute_with(routing=lambda x: x.routing.float()), TypeError,
        ("routing must have dtype torch.int32 or torch.int64", "got torch.float32"), index),
    Bad("index_routing_bool", permute_with(routing=lambda x: x.routing > 0), TypeError,
        ("routing must have dtype torch.int32 or torch.int64", "got torch.bool"), index),
    Bad("index_expert_id_checked", permute_with(routing=_bad_expert_id), ValueError,
        (f"expert ids must be in [0, {E}) or -1 for no route",), index),
    Bad("mask_more_routes_than_topk", permute_with(routing=_routed_everywhere, topk=lambda x: K,
                                                   check_routing=lambda x: True), ValueError,
        (f"a token is routed to {E} experts, more than topk={K}",), mask),
    # sizes: bools are not ints
    Bad("num_experts_missing", permute_with(num_experts=lambda x: _DROP), ValueError,
        ("index routing needs num_experts",), index),
    Bad("num_experts_bool", permute_with(num_experts=lambda x: True), ValueError, ("num_experts", "True")),
    Bad("num_experts_zero", permute_with(num_experts=lambda x: 0), ValueError, ("num_experts", "0")),
    Bad("mask_num_experts_mismatch", permute_with(num_experts=lambda x: E + 1), ValueError,
        (f"num_experts={E + 1}", f"the routing mask has {E} columns"), mask),
    Bad("num_out_tokens_negative", permute_with(num_out_tokens=lambda x: -1), ValueError,
        ("num_out_tokens must be an int in [0, 2**31 - 1)", "-1")),
    Bad("num_out_tokens_oversize", permute_with(num_out_tokens=lambda x: 2**31), ValueError,
        ("num_out_tokens must be an int in [0, 2**31 - 1)", str(2**31))),
    Bad("num_out_tokens_bool", permute_with(num_out_tokens=lambda x: True), ValueError,
        ("num_out_tokens must be an int", "True")),
    Bad("num_out_tokens_float", permute_with(num_out_tokens=lambda x: 8.0), ValueError,
        ("num_out_tokens must be an int", "8.0")),
    Bad("topk_bool", permute_with(topk=lambda x: True), ValueError, ("topk must be a positive int", "True")),
    Bad("topk_zero", permute_with(topk=lambda x: 0), ValueError, ("topk must be a positive int", "0")),
    Bad("mask_topk_above_experts", permute_with(topk=lambda x: E + 1), ValueError,
        (f"topk={E + 1} is more than the {E} experts",), mask),
    Bad("index_topk_mismatch", permute_with(topk=lambda x: K + 1), ValueError,
        (f"topk={K + 1} but index routing has {K} columns",), index),
    Bad("check_routing_int", permute_with(check_routing=lambda x: 1), TypeError,
        ("check_routing must be True, False or None", "1")),
    # probs
    Bad("probs_missing", permute_with(probs=lambda x: None), ValueError,
        ("this variant permutes probs", "pass probs"), with_probs),
    Bad("probs_given_without_probs", permute_with(probs=lambda x: torch.rand(N, K).to(x.device)), ValueError,
        ("this variant has no probs", "probs = true"), without_probs),
    Bad("probs_columns", permute_with(probs=lambda x: x.probs[:, :-1].contiguous()), ValueError,
        ("probs must have shape", f"[{N}, "), with_probs),
    Bad("probs_rows", permute_with(probs=lambda x: x.probs[:-1].contiguous()), ValueError,
        ("probs must have shape", f"got [{N - 1}, "), with_probs),
    Bad("probs_float64", permute_with(probs=lambda x: x.probs.double()), TypeError,
        ("probs must have dtype", "got torch.float64"), with_probs),
    Bad("probs_int", permute_with(probs=lambda x: (x.probs * 10).int()), TypeError,
        ("probs must have dtype", "got torch.int32"), with_probs),
    Bad("probs_meta", permute_with(probs=lambda x: x.probs.to(META)), ValueError, ("probs is on meta",), with_probs),
    Bad("probs_strided", permute_with(probs=lambda x: strided(x.probs)), ValueError,
        ("probs must be contiguous",), with_probs),
    # scales
    Bad("scale_missing", permute_with(scale=lambda x: None), ValueError,
        ("scales; pass scale [N, ceil(H / ",), with_scale),
    Bad("scale_given_without_scales", permute_with(scale=lambda x: torch.ones(N, 1).to(x.device)), ValueError,
        ("this variant moves no scales", "fp8 scale"), without_scale),
    Bad("scale_columns", permute_with(scale=lambda x: torch.cat([x.scale, x.scale], 1)), ValueError,
        ("scale must have shape", f"[{N}, "), with_scale),
    Bad("scale_float16", permute_with(scale=lambda x: x.scale.half()), TypeError,
        ("scale must have dtype", "got torch.float16"), with_scale),
    Bad("scale_meta", permute_with(scale=lambda x: x.scale.to(META)), ValueError, ("scale is on meta",), with_scale),
    # unpermute
    Bad("permuted_float64", unpermute_with(permuted=lambda x: x.combine.double()), TypeError,
        ("permuted must have dtype", "got torch.float64")),
    Bad("permuted_rows", unpermute_with(permuted=lambda x: x.combine[:-1].contiguous()), ValueError,
        ("permuted must have shape",)),
    Bad("permuted_3d", unpermute_with(permuted=lambda x: x.combine[None]), ValueError, ("permuted must have shape",)),
    Bad("permuted_meta", unpermute_with(permuted=lambda x: x.combine.to(META)), ValueError, ("permuted is on meta",)),
    Bad("permuted_strided", unpermute_with(permuted=lambda x: strided(x.combine)), ValueError,
        ("permuted must be contiguous",)),
    Bad("row_id_map_tuple", unpermute_with(row_id_map=lambda x: tuple(x.res.row_id_map)), TypeError,
        ("row_id_map must be the RowIdMap from this module's permute", "got tuple")),
    Bad("row_id_map_none", unpermute_with(row_id_map=lambda x: None), TypeError,
        ("row_id_map must be the RowIdMap", "got NoneType")),
    Bad("row_id_map_other_variant", unpermute_with(row_id_map=lambda x: x.res.row_id_map._replace(variant="bf16_x")),
        ValueError, ("row_id_map comes from variant bf16_x's permute",)),
    Bad("restore_shape_tokens", unpermute_with(restore_shape=lambda x: (N + 1, H)), ValueError,
        (f"restore_shape ({N + 1}, {H}) does not match", f"{N} tokens", f"hidden size {H}")),
    Bad("restore_shape_hidden", unpermute_with(restore_shape=lambda x: (N, H - 1)), ValueError,
        (f"restore_shape ({N}, {H - 1}) does not match",)),
    Bad("restore_shape_1d", unpermute_with(restore_shape=lambda x: (N,)), ValueError, ("restore_shape",)),
    Bad("restore_shape_int", unpermute_with(restore_shape=lambda x: N * H), TypeError,
        ("restore_shape must be a sequence (N, H)",)),
    Bad("merging_probs_without_probs", unpermute_with(merging_probs=lambda x: torch.rand(N, K).to(x.device)),
        ValueError, ("this variant has no probs",), without_probs),
    Bad("merging_probs_columns", unpermute_with(merging_probs=lambda x: x.probs[:, :-1].contiguous()), ValueError,
        ("merging_probs must have shape",), with_probs),
    Bad("merging_probs_int", unpermute_with(merging_probs=lambda x: x.probs.int()), TypeError,
        ("merging_probs must have dtype", "got torch.int32"), with_probs),
    Bad("merging_probs_meta", unpermute_with(merging_probs=lambda x: x.probs.to(META)), ValueError,
        ("merging_probs is on meta",), with_probs),
]

CASES = [pytest.param(name, bad, id=f"{name}-{bad}") for name in VARIANTS for bad in BAD
         if bad.applies(permgen.VARIANTS[name])]


def raised(target, name, bad):
    """(exception type, message with the target's device written <device>) of the bad call."""
    x = valid_inputs(target, name)
    with pytest.raises(Exception) as info:
        bad.call(load(target, name), x)
    return type(info.value), str(info.value).replace(str(x.device), "<device>")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name, bad", CASES)
def test_bad_input_says_what_was_expected(target, name, bad):
    error, message = raised(target, name, bad)
    assert error is bad.error, f"{target}: {error.__name__}: {message}"
    assert message.startswith(f"{name}: "), message
    for word in bad.words:
        assert word in message, f"{target}: {word!r} not in {message!r}"


@pytest.mark.parametrize("name, bad", CASES)
def test_bad_input_same_error_on_both_targets(name, bad):
    assert raised("triton", name, bad) == raised("nki", name, bad)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", VARIANTS)
def test_everything_on_another_device_is_refused(target, name):
    """Every input on the meta device: the shared checks pass (the devices agree), the target's
    own device check refuses it, naming the device."""
    x = valid_inputs(target, name)
    tokens, routing, probs, scale = to_device(META, x.tokens, x.routing, x.probs, x.scale)
    with pytest.raises(ValueError, match="meta"):
        load(target, name).permute(tokens, routing, probs, scale, **x.kw)


def test_every_check_is_exercised_on_every_kind_of_variant():
    """The representatives cover mask and index routing, with and without probs, and both scale formats."""
    specs = [permgen.VARIANTS[n] for n in VARIANTS]
    assert {s["routing"] for s in specs} == {"mask", "index"}
    assert {s["probs"] for s in specs} == {True, False}
    assert {s["scale"] for s in specs} >= {"none", "block128", "mx32"}
    assert {b.name for b in BAD if not any(b.applies(s) for s in specs)} == set()


# ---------------------------------------------------------------------------------------------
# Signatures
# ---------------------------------------------------------------------------------------------

PERMUTE_PARAMETERS = ["tokens", "routing", "probs", "scale", "num_experts", "num_out_tokens", "topk", "check_routing"]
UNPERMUTE_PARAMETERS = ["permuted", "row_id_map", "merging_probs", "restore_shape"]


@pytest.mark.parametrize("name", SHARED_VARIANTS)
@pytest.mark.parametrize("function", ["permute", "unpermute"])
def test_public_signatures_are_identical(name, function):
    triton_sig = inspect.signature(getattr(load("triton", name), function))
    nki_sig = inspect.signature(getattr(load("nki", name), function))
    assert triton_sig == nki_sig, f"{name}.{function}: triton {triton_sig} vs nki {nki_sig}"


@pytest.mark.parametrize("target", TARGETS)
def test_signatures_are_the_documented_ones(target):
    mod = load(target, SHARED_VARIANTS[0])
    permute = inspect.signature(mod.permute).parameters
    assert list(permute) == PERMUTE_PARAMETERS
    assert [p.name for p in permute.values() if p.kind is p.KEYWORD_ONLY] == PERMUTE_PARAMETERS[4:]
    assert all(permute[p].default is None for p in PERMUTE_PARAMETERS[2:])
    unpermute = inspect.signature(mod.unpermute).parameters
    assert list(unpermute) == UNPERMUTE_PARAMETERS
    assert all(unpermute[p].default is None for p in UNPERMUTE_PARAMETERS[2:])
