"""Bad input: one table, run on both targets. Each bad call of the table goes to the Triton and the
NKI module of a variant. On each target it must fail before any kernel launches, with the
expected exception type, the variant's name first and the expected words (permgen.core.contract's);
across targets, type and message must be identical (device names aside: the Triton target runs
where CUDA is, the NKI emulator on CPU tensors).

Then what the checks must let through (int64 ids, torch.Size shapes, -1 for no route, out-of-range
ids with checking off, which route nowhere and write nothing out of bounds), the registry's
errors, and the public signatures, which are the same on both targets.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

import permgen
from cases import META, assert_bits_equal, assert_sum_close, combine_dtype, device_of, expert_ids, generator_for, \
    load, make_scale, make_tokens, routing_from_ids, stable_seed, to_device, token_dtype
from generator.spec import parse_spec
from permgen.core.axes import AXES
from reference import permute_ref, unpermute_ref

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


def _other_variant(name):
    """Another variant with the same routing, the same padding where one has it: its row maps are
    alike, and only the variant's name can tell them apart."""
    v = permgen.VARIANTS[name]
    alike = [n for n in SHARED_VARIANTS if n != name and permgen.VARIANTS[n]["routing"] == v["routing"]]
    return min(alike, key=lambda n: permgen.VARIANTS[n]["pad"] != v["pad"])


# ---------------------------------------------------------------------------------------------
# Valid inputs: the same values on both targets, each on its target's device
# ---------------------------------------------------------------------------------------------

_inputs_cache: dict = {}


def valid_inputs(target: str, name: str):
    """tokens, routing, probs, scale, kw (num_experts for index routing), and for unpermute: a
    permute result with matching expert outputs. Values depend on `name` only."""
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
        _inputs_cache[key] = SimpleNamespace(target=target, tokens=tokens, routing=routing, probs=probs, scale=scale,
                                             kw=kw, res=res, combine=combine, variant=v, device=tokens.device)
    return _inputs_cache[key]


def strided(t):
    """The same values, not contiguous: every other column of a wider tensor."""
    wide = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype, device=t.device)
    wide[:, ::2] = t
    return wide[:, ::2]


def transposed(t):
    """The same values, not contiguous: the transpose of a column-major copy."""
    out = torch.empty(t.shape[1], t.shape[0], dtype=t.dtype, device=t.device).t()
    out.copy_(t)
    return out


class LaunchRefused(Exception):
    pass


def _refuse(*args, **kwargs):
    raise LaunchRefused("a kernel was about to launch: the checks let the input through")


def no_launch(monkeypatch, mod):
    """The module's backend refuses every kernel launch (its device check still runs): the checks
    must fire before a kernel is reached. One exception: a backend that checks the routing values
    in permute's one host read (checks_routing_in_read) runs an uncapped, checked permute, which
    must then report the routing as bad (permgen.core.ops raises before any result is returned)."""
    backend = mod._ops.backend
    for method in ("unpermute", "permute_backward", "unpermute_backward"):
        assert callable(getattr(backend, method))
        monkeypatch.setattr(backend, method, _refuse)
    permute = backend.permute

    def permute_reporting_bad_routing(plan, *args, **kwargs):
        if backend.checks_routing_in_read and plan.check_routing and plan.num_out_tokens is None:
            out = permute(plan, *args, **kwargs)
            if out.bad_routing:
                return out
        _refuse()

    monkeypatch.setattr(backend, "permute", permute_reporting_bad_routing)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bad:
    name: str
    call: Callable  # (module, valid inputs) -> the call's result
    error: type
    words: tuple | Callable  # the words the message holds, or (valid inputs) -> them
    applies: Callable = lambda v: True

    def __str__(self):
        return self.name

    def words_for(self, x):
        return self.words(x) if callable(self.words) else self.words


_DROP = object()


def permute_with(**changes):
    """A permute call with some of the valid arguments replaced: f(x) -> new value (_DROP: left out)."""
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


def not_fp32(v):
    return v["dtype"] != "fp32"


def scale_is(kind):
    return lambda v: v["scale"] == kind


def combine_is_not(dtype):
    return lambda v: combine_dtype(v) != dtype


def _routed_everywhere(x):
    routing = x.routing.clone()
    routing[0] = True
    return routing


def _three_routes(x):
    routing = x.routing.clone()
    routing[4, :3] = True
    routing[4, 3:] = False
    return routing


def _expert_id(value):
    def routing(x):
        ids = x.routing.clone()
        ids[3, 1] = value
        return ids
    return routing


def _shape(shape):
    return f"got {list(shape)}"


# Wrong shapes of probs [N, c] (c: E for mask routing, k for index routing).
PROB_SHAPES = (("columns_plus_one", lambda c: (N, c + 1)), ("columns_minus_one", lambda c: (N, c - 1)),
               ("columns_of_the_other_routing", lambda c: (N, K + E - c)), ("rows", lambda c: (N - 1, c)),
               ("rows_plus_one", lambda c: (N + 1, c)), ("1d", lambda c: (N * c,)))


BAD = [
    # tokens
    Bad("tokens_float64", permute_with(tokens=lambda x: x.tokens.double()), TypeError,
        lambda x: (f"tokens must have dtype {token_dtype(x.variant)}", "got torch.float64")),
    Bad("tokens_float32", permute_with(tokens=lambda x: x.tokens.float()), TypeError,
        lambda x: (f"tokens must have dtype {token_dtype(x.variant)}", "got torch.float32"), not_fp32),
    Bad("tokens_1d", permute_with(tokens=lambda x: x.tokens.reshape(-1)), ValueError,
        ("tokens must have shape [*, *]", _shape([N * H]))),
    Bad("tokens_3d", permute_with(tokens=lambda x: x.tokens[None]), ValueError,
        ("tokens must have shape [*, *]", _shape([1, N, H]))),
    Bad("tokens_0d", permute_with(tokens=lambda x: x.tokens[0, 0]), ValueError,
        ("tokens must have shape [*, *]", _shape([]))),
    Bad("tokens_list", permute_with(tokens=lambda x: x.tokens.float().tolist()), TypeError,
        ("tokens must be a torch.Tensor", "got list")),
    Bad("tokens_none", permute_with(tokens=lambda x: None), TypeError, ("tokens must be a torch.Tensor", "got NoneType")),
    Bad("tokens_float", permute_with(tokens=lambda x: 3.0), TypeError, ("tokens must be a torch.Tensor", "got float")),
    Bad("tokens_strided", permute_with(tokens=lambda x: strided(x.tokens)), ValueError,
        ("tokens must be contiguous", "call .contiguous() first")),
    Bad("tokens_transposed", permute_with(tokens=lambda x: transposed(x.tokens)), ValueError,
        ("tokens must be contiguous", "call .contiguous() first")),
    # routing
    Bad("routing_rows", permute_with(routing=lambda x: x.routing[:-1].contiguous()), ValueError,
        ("routing must have shape", f"[{N}, *]", f"got [{N - 1}, ")),
    Bad("routing_1d", permute_with(routing=lambda x: x.routing.reshape(-1)), ValueError,
        ("routing must have shape", f"[{N}, *]")),
    Bad("routing_meta", permute_with(routing=lambda x: x.routing.to(META)), ValueError,
        ("routing is on meta", "expected <device> (the tokens' device)")),
    Bad("routing_strided", permute_with(routing=lambda x: strided(x.routing)), ValueError,
        ("routing must be contiguous",)),
    Bad("index_routing_no_columns", permute_with(routing=lambda x: x.routing[:, :0].contiguous(),
                                                 probs=lambda x: None if x.probs is None else x.probs[:, :0]),
        ValueError,
        ("routing must have at least one column",), index),
    *[Bad(f"mask_routing_{str(dtype)[6:]}", permute_with(routing=lambda x, d=dtype: x.routing.to(d)), TypeError,
          ("routing must be a bool or integer [N, E] mask", str(dtype)), mask)
      for dtype in (torch.float32, torch.float16)],
    Bad("mask_routing_list", permute_with(routing=lambda x: x.routing.tolist()), TypeError,
        ("routing must be a bool or integer [N, E] mask", "got list"), mask),
    *[Bad(f"index_routing_{str(dtype)[6:]}", permute_with(routing=lambda x, d=dtype: x.routing.to(d)), TypeError,
          ("routing must have dtype torch.int32 or torch.int64", f"got {dtype}"), index)
      for dtype in (torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.bool)],
    # routing values (checking on: asked for, or by default without a row cap)
    *[Bad(f"index_expert_id_{name}{how}", permute_with(routing=_expert_id(value), **extra), ValueError,
          (f"expert ids must be in [0, {E}) or -1 for no route", str(value)), index)
      for name, value in (("99", 99), ("E", E), ("minus5", -5), ("minus2", -2))
      for how, extra in (("", {}), ("_checked", {"check_routing": lambda x: True}),
                         ("_checked_with_cap", {"check_routing": lambda x: True, "num_out_tokens": lambda x: N * K}))],
    Bad("mask_more_routes_than_topk", permute_with(routing=_routed_everywhere, topk=lambda x: K,
                                                   check_routing=lambda x: True), ValueError,
        (f"a token is routed to {E} experts, more than topk={K}",), mask),
    Bad("mask_three_routes_topk_2_with_cap", permute_with(routing=_three_routes, topk=lambda x: 2,
                                                          check_routing=lambda x: True,
                                                          num_out_tokens=lambda x: N * 3), ValueError,
        ("a token is routed to 3 experts, more than topk=2",), mask),
    Bad("mask_integer_routing_values", permute_with(routing=lambda x: x.routing.int() * 2), ValueError,
        ("an integer routing mask must hold only 0 and 1", "found values in [0, 2]"), mask),
    # sizes: bools are not ints
    Bad("num_experts_missing", permute_with(num_experts=lambda x: _DROP), ValueError,
        ("index routing needs num_experts",), index),
    *[Bad(f"num_experts_{label}", permute_with(num_experts=lambda x, b=bad: b), ValueError,
          ("num_experts must be a positive int", repr(bad)), index)
      for label, bad in (("zero", 0), ("negative", -3), ("bool", True), ("float", 5.0), ("str", "5"))],
    *[Bad(f"mask_num_experts_{label}", permute_with(num_experts=lambda x, b=bad: b), ValueError,
          (f"num_experts={bad}", f"the routing mask has {E} columns"), mask)
      for label, bad in (("above", E + 1), ("below", E - 1), ("one", 1), ("zero", 0), ("bool", True))],
    *[Bad(f"num_out_tokens_{label}", permute_with(num_out_tokens=lambda x, b=bad: b), ValueError,
          ("num_out_tokens must be an int in [0, 2**31 - 1)", f"got {bad!r}"))
      for label, bad in (("negative", -1), ("max_rows", 2**31 - 1), ("oversize", 2**31), ("huge", 2**40),
                         ("true", True), ("false", False), ("float", 8.0), ("str", "8"))],
    *[Bad(f"topk_{label}", permute_with(topk=lambda x, b=bad: b), ValueError,
          ("topk must be a positive int", repr(bad)))
      for label, bad in (("zero", 0), ("negative", -1), ("bool", True), ("float", 2.0))],
    Bad("mask_topk_above_experts", permute_with(topk=lambda x: E + 1), ValueError,
        (f"topk={E + 1} is more than the {E} experts",), mask),
    Bad("index_topk_mismatch", permute_with(topk=lambda x: K + 1), ValueError,
        (f"topk={K + 1} but index routing has {K} columns",), index),
    Bad("check_routing_int", permute_with(check_routing=lambda x: 1), TypeError,
        ("check_routing must be True, False or None", "1")),
    # probs
    Bad("probs_missing", permute_with(probs=lambda x: None), ValueError,
        lambda x: ("this variant permutes probs", f"pass probs [N, {'E' if mask(x.variant) else 'k'}]"), with_probs),
    Bad("probs_given_without_probs", permute_with(probs=lambda x: torch.rand(N, K).to(x.device)), ValueError,
        ("this variant has no probs", "probs = true"), without_probs),
    *[Bad(f"probs_{label}", permute_with(probs=lambda x, f=shape: torch.rand(f(x.probs.shape[1])).to(x.device)),
          ValueError, lambda x, f=shape: ("probs must have shape", f"[{N}, {x.probs.shape[1]}]",
                                          _shape(f(x.probs.shape[1]))), with_probs)
      for label, shape in PROB_SHAPES],
    *[Bad(f"probs_{str(dtype)[6:]}", permute_with(probs=lambda x, d=dtype: x.probs.to(d)), TypeError,
          ("probs must have dtype torch.float32", f"got {dtype}"), with_probs)
      for dtype in (torch.float64, torch.int32, torch.bool)],
    Bad("probs_meta", permute_with(probs=lambda x: x.probs.to(META)), ValueError,
        ("probs is on meta", "expected <device>"), with_probs),
    Bad("probs_strided", permute_with(probs=lambda x: strided(x.probs)), ValueError,
        ("probs must be contiguous",), with_probs),
    # scales
    Bad("scale_missing", permute_with(scale=lambda x: None), ValueError,
        lambda x: (f"this variant moves {x.variant['scale']} scales",
                   f"pass scale [N, ceil(H / {128 if x.variant['scale'] == 'block128' else 32})]"), with_scale),
    Bad("scale_given_without_scales", permute_with(scale=lambda x: torch.ones(N, 1).to(x.device)), ValueError,
        ("this variant moves no scales", "fp8 scale"), without_scale),
    *[Bad(f"scale_{label}", permute_with(scale=lambda x, f=change: f(x.scale).contiguous()), ValueError,
          lambda x, f=change: ("scale must have shape", f"[{N}, {x.scale.shape[1]}]", _shape(f(x.scale).shape)),
          with_scale)
      for label, change in (("no_columns", lambda s: s[:, :0]), ("columns_doubled", lambda s: torch.cat([s, s], 1)),
                            ("rows", lambda s: s[:-1]), ("1d", lambda s: s.reshape(-1)))],
    *[Bad(f"scale_{kind}_{str(dtype)[6:]}", permute_with(scale=lambda x, d=dtype: x.scale.to(d)), TypeError,
          (f"scale must have dtype {want}", f"got {dtype}"), scale_is(kind))
      for kind, dtype, want in (("block128", torch.float16, "torch.float32"), ("block128", torch.bfloat16, "torch.float32"),
                                ("block128", torch.int32, "torch.float32"), ("mx32", torch.int8, "torch.uint8"),
                                ("mx32", torch.float16, "torch.uint8"), ("mx32", torch.float32, "torch.uint8"),
                                ("mx32", torch.float8_e8m0fnu, "torch.uint8"))],
    Bad("scale_meta", permute_with(scale=lambda x: x.scale.to(META)), ValueError,
        ("scale is on meta", "expected <device>"), with_scale),
    # unpermute: the expert outputs
    *[Bad(f"permuted_{str(dtype)[6:]}", unpermute_with(permuted=lambda x, d=dtype: x.combine.to(d)), TypeError,
          lambda x, d=dtype: (f"permuted must have dtype {combine_dtype(x.variant)}", f"got {d}"), combine_is_not(dtype))
      for dtype in (torch.float64, torch.float32, torch.float16)],
    Bad("permuted_fp8_rows", unpermute_with(permuted=lambda x: x.res.tokens), TypeError,
        lambda x: ("permuted must have dtype torch.bfloat16", f"got {token_dtype(x.variant)}"), with_scale),
    *[Bad(f"permuted_{label}", unpermute_with(permuted=lambda x, f=change: f(x.combine).contiguous()), ValueError,
          lambda x, f=change: ("permuted must have shape", f"[{x.res.row_id_map.num_rows}, *]",
                               _shape(f(x.combine).shape)))
      for label, change in (("rows_minus_one", lambda c: c[:-1]), ("rows_plus_one", lambda c: torch.cat([c, c[:1]])),
                            ("1d", lambda c: c.reshape(-1)), ("3d", lambda c: c[None]))],
    Bad("permuted_meta", unpermute_with(permuted=lambda x: x.combine.to(META)), ValueError,
        ("permuted is on meta", "expected <device>")),
    Bad("permuted_strided", unpermute_with(permuted=lambda x: strided(x.combine)), ValueError,
        ("permuted must be contiguous",)),
    Bad("permuted_transposed", unpermute_with(permuted=lambda x: transposed(x.combine)), ValueError,
        ("permuted must be contiguous",)),
    # unpermute: the row map
    *[Bad(f"row_id_map_{label}", unpermute_with(row_id_map=lambda x, f=change: f(x.res.row_id_map)), TypeError,
          ("row_id_map must be the RowIdMap from this module's permute", f"got {type_name}"))
      for label, change, type_name in (("tuple", tuple, "tuple"), ("list", list, "list"),
                                       ("none", lambda m: None, "NoneType"))],
    Bad("row_id_map_renamed", unpermute_with(row_id_map=lambda x: x.res.row_id_map._replace(variant="bf16_x")),
        ValueError, ("row_id_map comes from variant bf16_x's permute",)),
    Bad("row_id_map_of_another_variant",
        unpermute_with(row_id_map=lambda x: valid_inputs(x.target, _other_variant(x.variant["name"])).res.row_id_map),
        ValueError, lambda x: (f"row_id_map comes from variant {_other_variant(x.variant['name'])}'s permute",)),
    # unpermute: restore_shape
    *[Bad(f"restore_shape_{label}", unpermute_with(restore_shape=lambda x, s=shape: s), ValueError,
          (f"restore_shape {shape} does not match", f"{N} tokens", f"hidden size {H}"))
      for label, shape in (("tokens", (N + 1, H)), ("hidden", (N, H - 1)), ("swapped", (H, N)), ("1d", (N,)),
                           ("3d", (N, H, 1)))],
    *[Bad(f"restore_shape_{label}", unpermute_with(restore_shape=lambda x, s=shape: s), TypeError,
          ("restore_shape must be a sequence (N, H)", repr(shape)))
      for label, shape in (("int", N * H), ("float", 1.5))],
    # unpermute: merging probs
    Bad("merging_probs_without_probs", unpermute_with(merging_probs=lambda x: torch.rand(N, K).to(x.device)),
        ValueError, ("this variant has no probs",), without_probs),
    *[Bad(f"merging_probs_{label}",
          unpermute_with(merging_probs=lambda x, f=shape: torch.rand(f(x.probs.shape[1])).to(x.device)), ValueError,
          lambda x, f=shape: ("merging_probs must have shape", f"[{N}, {x.probs.shape[1]}]",
                              _shape(f(x.probs.shape[1]))), with_probs)
      for label, shape in PROB_SHAPES],
    Bad("merging_probs_int", unpermute_with(merging_probs=lambda x: x.probs.int()), TypeError,
        ("merging_probs must have dtype", "got torch.int32"), with_probs),
    Bad("merging_probs_meta", unpermute_with(merging_probs=lambda x: x.probs.to(META)), ValueError,
        ("merging_probs is on meta",), with_probs),
]

CASES = [pytest.param(name, bad, id=f"{name}-{bad}") for name in VARIANTS for bad in BAD
         if bad.applies(permgen.VARIANTS[name])]


def raised(target, name, bad, monkeypatch):
    """(exception type, message with the target's device written <device>) of the bad call."""
    x = valid_inputs(target, name)
    mod = load(target, name)
    with monkeypatch.context() as patches:
        no_launch(patches, mod)
        with pytest.raises(Exception) as info:
            bad.call(mod, x)
    message = str(info.value).replace(str(x.device), "<device>")
    return type(info.value), message


@pytest.mark.parametrize("name, bad", CASES)
def test_bad_input_says_what_was_expected_on_both_targets(name, bad, monkeypatch):
    errors = {}
    for target in TARGETS:
        error, message = errors[target] = raised(target, name, bad, monkeypatch)
        assert error is bad.error, f"{target}: {error.__name__}: {message}"
        assert message.startswith(f"{name}: "), f"{target}: {message}"
        for word in bad.words_for(valid_inputs(target, name)):
            assert word in message, f"{target}: {word!r} not in {message!r}"
    assert errors["triton"] == errors["nki"]


def test_the_table_reaches_no_kernel_only_through_the_checks(monkeypatch):
    """What makes the table mean something: valid input, with launches refused, reaches a launch."""
    for target in TARGETS:
        for name in VARIANTS:
            x = valid_inputs(target, name)
            mod = load(target, name)
            with monkeypatch.context() as patches:
                no_launch(patches, mod)
                with pytest.raises(LaunchRefused):
                    mod.permute(x.tokens, x.routing, x.probs, x.scale, **x.kw)
                with pytest.raises(LaunchRefused):
                    mod.unpermute(x.combine, x.res.row_id_map, x.probs)


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
    """The representatives cover mask and index routing, with and without probs, and both scale
    formats; every bad input applies to one of them."""
    specs = [permgen.VARIANTS[n] for n in VARIANTS]
    assert {s["routing"] for s in specs} == {"mask", "index"}
    assert {s["probs"] for s in specs} == {True, False}
    assert {s["scale"] for s in specs} >= {"none", "block128", "mx32"}
    assert {b.name for b in BAD if not any(b.applies(s) for s in specs)} == set()
    assert len({b.name for b in BAD}) == len(BAD)


# ---------------------------------------------------------------------------------------------
# What the checks let through
# ---------------------------------------------------------------------------------------------

MASK = "probs_bf16_mask"
INDEX = "probs_bf16_index"
INDEX_NO_PROBS = "bf16_index"
MX32 = "probs_pad32_fp8e4m3_mx32_index"


def inputs(target, name, g, n=N, h=H, e=E, k=K):
    """Fresh valid (tokens, routing, probs, scale, kwargs) for variant `name`: k distinct experts per token."""
    v = permgen.VARIANTS[name] | {"name": name}
    tokens = make_tokens(v, n, h, g)
    routing = routing_from_ids(v, expert_ids(n, e, k, g), e)
    probs = torch.rand(routing.shape, generator=g) if v["probs"] else None
    scale = make_scale(v, n, h, g)
    kwargs = {} if v["routing"] == "mask" else {"num_experts": e}
    return (*to_device(device_of(target), tokens, routing, probs, scale), kwargs)


@pytest.fixture
def g(request):
    return generator_for(request)


@pytest.mark.parametrize("target", TARGETS)
def test_index_routing_int64_is_accepted(target, g):
    mod = load(target, INDEX)
    tokens, routing, probs, _, kw = inputs(target, INDEX, g)
    a = mod.permute(tokens, routing, probs, **kw)
    b = mod.permute(tokens, routing.long(), probs, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.row_id_map.dst_rows, b.row_id_map.dst_rows)


@pytest.mark.parametrize("target", TARGETS)
def test_mask_num_experts_matching_and_restore_shape_size_are_accepted(target, g):
    mod = load(target, MASK)
    tokens, routing, probs, _, _ = inputs(target, MASK, g)
    res = mod.permute(tokens, routing, probs, num_experts=E)
    assert res.tokens_per_expert.shape == (E,)
    combine = torch.randn(res.tokens.shape, generator=g).to(torch.bfloat16).to(tokens.device)
    out = mod.unpermute(combine, res.row_id_map, probs, restore_shape=torch.Size([N, H]))
    assert out.shape == (N, H)


@pytest.mark.parametrize("target", TARGETS)
def test_minus_one_is_no_route(target, g, poisoned_empty):
    mod = load(target, INDEX)
    tokens, routing, probs, _, kw = inputs(target, INDEX, g)
    routing[::3, 0] = -1
    res = mod.permute(tokens, routing, probs, **kw, check_routing=True)
    ref_tokens, ref_probs, _, ref_tpe, _ = permute_ref(tokens, routing, routing_kind="index", num_experts=E, probs=probs)
    assert res.tokens.shape[0] == N * K - len(range(0, N, 3))
    assert torch.equal(res.tokens, ref_tokens) and torch.equal(res.probs, ref_probs)
    assert torch.equal(res.tokens_per_expert, ref_tpe)
    assert bool((res.row_id_map.dst_rows[::3, 0] == -1).all())


@pytest.mark.parametrize("target", TARGETS)
def test_mask_topk_found_without_cap(target, g):
    mod = load(target, MASK)
    tokens, routing, probs, _, _ = inputs(target, MASK, g)
    routing[4] = True  # one token routed to every expert
    res = mod.permute(tokens, routing, probs)
    assert res.row_id_map.dst_rows.shape == (N, E)
    _, _, _, ref_tpe, _ = permute_ref(tokens, routing, routing_kind="mask", num_experts=E, probs=probs)
    assert torch.equal(res.tokens_per_expert, ref_tpe)


@pytest.mark.parametrize("target", TARGETS)
def test_mask_extra_routes_unchecked_stay_in_bounds(target, g, poisoned_empty):
    """More routes than topk with checking off: only the first topk experts of a token are kept."""
    mod = load(target, MASK)
    tokens, routing, probs, _, _ = inputs(target, MASK, g)
    routing[4] = True
    res = mod.permute(tokens, routing, probs, topk=K, check_routing=False)
    kept = routing.clone()
    kept[4] = False
    kept[4, :K] = True
    ref_tokens, ref_probs, _, ref_tpe, _ = permute_ref(tokens, kept, routing_kind="mask", num_experts=E, probs=probs)
    assert torch.equal(res.tokens, ref_tokens) and torch.equal(res.probs, ref_probs)
    assert torch.equal(res.tokens_per_expert, ref_tpe)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", [INDEX, INDEX_NO_PROBS, MX32])
@pytest.mark.parametrize("cap", [None, "drop", "spare"])
def test_out_of_range_ids_unchecked_route_nowhere(target, name, cap, g, poisoned_empty):
    """Ids outside [-1, E) with checking off route nowhere: nothing is written out of bounds, and
    unpermute sees those routes as absent."""
    mod = load(target, name)
    n, k, e = 23, 3, 6
    tokens, routing, probs, scale, kw = inputs(target, name, g, n=n, e=e, k=k)
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

    combine = torch.randn(res.tokens.shape, generator=g).to(combine_dtype(mod.VARIANT)).to(tokens.device)
    out = mod.unpermute(combine, res.row_id_map, probs)
    assert_sum_close(out, unpermute_ref(combine, routes, n, probs))
    assert not out.isnan().any()


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

def raises(exc, *words):
    """pytest.raises that also checks every word appears in the message (literal match)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(w)})" for w in words))


@pytest.mark.parametrize("target", TARGETS)
def test_get_kernel_returns_the_matching_module(target):
    for name, spec in permgen.VARIANTS.items():
        if target not in spec["targets"]:
            continue
        axes = {a: spec[a] for a in AXES if a != "targets"}
        mod = load(target, name)
        assert permgen.get_kernel(target, **axes) is mod
        assert mod.__name__ == f"permgen.generated.{target}.{name}"
        assert mod.VARIANT == {"name": name, **spec}
        assert permgen.find_variant(target, **axes) == name


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


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("axes, words", [
    (dict(dtype="bf16", routing="mask", colour="red"), ["unknown axes ['colour']", "dtype"]),
    (dict(dtype="bf16", routing="mask", targets=["triton"]), ["unknown axes ['targets']"]),
    (dict(dtype="bf16", routing="mask", name="probs_bf16_mask"), ["unknown axes ['name']"]),
    (dict(routing="mask"), ["missing ['dtype']"]),
    (dict(dtype="bf16"), ["missing ['routing']"]),
])
def test_get_kernel_bad_axis_names(target, axes, words):
    with raises(TypeError, *words):
        permgen.get_kernel(target, **axes)


@pytest.mark.parametrize("target", ["cuda", "Triton", "", None, "nki "])
def test_get_kernel_bad_target(target):
    with raises(ValueError, "target must be 'triton' or 'nki'", repr(target)):
        permgen.get_kernel(target, dtype="bf16", routing="mask")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("axes, key", [
    (dict(dtype="int8", routing="mask"), "dtype"),
    (dict(dtype="bf16", routing="topk"), "routing"),
    (dict(dtype="bf16", routing="mask", scale="mx32"), "scale"),
    (dict(dtype="bf16", routing="mask", pad=3), "pad"),
    (dict(dtype="bf16", routing="mask", probs="yes"), "probs"),
])
def test_get_kernel_impossible_axes_say_which_value_is_wrong(target, axes, key):
    with raises(ValueError, key, repr(axes[key])):
        permgen.get_kernel(target, **axes)


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


@pytest.mark.parametrize("target", TARGETS)
def test_too_many_experts_refused_in_the_same_words(target, g):
    """More experts than a target's kernels take: each target refuses with its limit, in the same
    words (the Triton target's had been an internal interpreter error)."""
    mod = load(target, INDEX)
    tokens, routing, probs, _, _ = inputs(target, INDEX, g)
    import permgen.nki.host
    import permgen.triton.host
    limit = {"triton": permgen.triton.host.MAX_EXPERTS, "nki": permgen.nki.host.MAX_EXPERTS}[target]
    with pytest.raises(ValueError, match=rf"^{INDEX}: the {target} target supports at most {limit} experts, "
                                         rf"got {2**20}$"):
        mod.permute(tokens, routing, probs, num_experts=2**20, num_out_tokens=N * K)
