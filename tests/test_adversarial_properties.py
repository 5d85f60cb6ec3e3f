"""Adversarial routing, drawn by hypothesis: every variant on both targets against tests/reference.py.

Each example draws a small problem and a hostile routing for it:
- index routing: ids of either integer width, with the int32 / int64 edges (2**31 - 1, 2**31, 2**32,
  -2**31 - 1, -2**32, int64 min / max, ids that narrow to a valid expert), -1 and other negatives,
  E itself, and the same expert twice in one token;
- mask routing: bool or integer masks; integer masks with values other than 0 and 1, which permute
  refuses when it checks the routing and otherwise routes wherever the value is nonzero
  (docs/architecture.md, "Routes and probs: what is read"), and more routes than the topk hint;
- probs and merging probs with NaN / Inf on every slot without a kept route (never read), and
  optionally on kept routes (propagated as IEEE arithmetic says);
- no row cap (the routing is checked: refused when bad, then run unchecked), or one below or above
  the rows the routes need.

Checked: permute's moved data (tokens, probs, scales) bit for bit, segment sizes, every route's
destination row, `dropped` and `row_id_map.unslotted` exactly, and unpermute's sums within SUM_TOL,
with fresh allocations poisoned; the NKI target leaves the caller's tensors resizable. The profile
(conftest.py) derandomizes, so a failure replays. When a problem has room, every adversarial value of
its width appears at least once. A self-test corrupts the reference's results in several ways and
expects each to be caught.

Then what a hostile caller does around the kernels:
- the chunk sort by any order (the one that moves nothing often), then by new values written into
  the same order tensor behind its version counter (.data, NumPy, DLPack, its storage): rows and
  probs as the reference sorts them each time, in new tensors; compiled (fullgraph) it refuses and
  accepts exactly what the eager call does, sizes and orders of any values;
- bf16 edge values (subnormals, the largest, rounding ties, products that overflow or underflow)
  through unpermute and its backward pass: the CPU targets (the Triton interpreter, the NKI
  emulator) agree bit for bit, and the grad rows are the reference's;
- any slice of a TransformerEngine row_id_map (mask, padded, index) is refused unless it is the
  whole map; tokens_per_expert of any shape or dtype but an integer [E] is refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import permgen
from cases import (DEVICE, PROB_GRAD_TOL, SUM_TOL, assert_bits_equal, combine_dtype, contract, device_of, expert_ids,
                   load, make_scale, make_tokens, needed_rows, random_like, resizable, routing_from_ids,
                   rows_by_column_ref, to_device, variants_for)
from cases import nki_generation_of_the_variant  # noqa: F401 (an autouse fixture: quantising variants on Trn3)
from reference import permute_ref, sort_chunks_ref, unpermute_grads_ref, unpermute_ref
from test_chunk_sort import WRITES, order_written_behind_its_version

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Bad ids of each width (E is added per problem); the last int64 ones narrow to 0..3 as int32.
BAD_IDS = {
    torch.int32: [INT32_MAX, INT32_MIN, -2, -7],
    torch.int64: [INT32_MAX, 2**31, 2**32, -2**31 - 1, -2**32, INT64_MIN, INT64_MAX, -2, -7,
                  2**32 + 1, -2**32 + 3, 2**33 + 2, 2**40],
}
# Nonzero values an integer mask may hold, by dtype: each routes (only 1 passes the routing check).
MASK_VALUES = {
    torch.uint8: [1, 2, 255],
    torch.int8: [1, 2, -1, 127, -128],
    torch.int16: [1, -1, 2**15 - 1, -2**15],
    torch.int32: [1, 2, -1, INT32_MAX, INT32_MIN],
    torch.int64: [1, 2, -1, INT32_MAX, 2**31, -2**31 - 1, INT64_MAX, INT64_MIN + 1],
}
# int64 mask values whose low 32 bits are zero: nonzero, so routed, by the documented rule.
MASK_VALUES_LOW_ZERO = [2**32, -2**32, INT64_MIN]
NON_FINITE = [float("nan"), float("inf"), -float("inf")]
# NaN and Inf probs make the interpreter's and the emulator's NumPy warn; the results are what is checked.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")




@dataclass(frozen=True)
class Problem:
    N: int
    H: int
    E: int
    k: int
    id_dtype: str  # index: "int32" / "int64"; mask: "bool" or an integer dtype
    bad: float  # chance a slot / mask entry holds an adversarial value
    duplicates: float  # index: chance a slot repeats the token's first expert
    low_zero: bool  # int64 masks: also values whose low 32 bits are zero
    topk: int | None  # mask routing's hint (may be below a token's route count)
    cap: str  # "none", "below" or "above"
    cap_fraction: float
    spoil_unkept: bool  # NaN / Inf on every prob without a kept route
    spoil_kept: float  # chance a kept route's prob is NaN / Inf
    unchecked: bool  # pass check_routing=False even where the routing is valid
    seed: int


MASK_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64"]


@st.composite
def problems(draw, mask: bool, max_tokens: int, max_hidden: int, max_experts: int):
    n = draw(st.integers(0, max_tokens))
    e = draw(st.integers(1, max_experts))
    k = draw(st.integers(1, min(e, 4) if mask else 4))  # index: k may exceed E (duplicates)
    id_dtype = draw(st.sampled_from(MASK_DTYPES if mask else ["int32", "int64"]))
    return Problem(
        N=n, H=draw(st.integers(1, max_hidden)), E=e, k=k, id_dtype=id_dtype,
        bad=draw(st.sampled_from([0.0, 0.2, 0.5])),
        duplicates=0.0 if mask else draw(st.sampled_from([0.0, 0.3])),
        low_zero=id_dtype == "int64" and draw(st.booleans()),
        topk=draw(st.none() | st.integers(1, e)) if mask else None,
        cap=draw(st.sampled_from(["none", "below", "above"])),
        cap_fraction=draw(st.floats(0.0, 0.99)),
        spoil_unkept=draw(st.booleans()),
        spoil_kept=draw(st.sampled_from([0.0, 0.3])),
        unchecked=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _pick(values, count, g, dtype):
    return torch.tensor(values, dtype=dtype)[torch.randint(len(values), (count,), generator=g)]


def _scatter_all(target, where, values, g):
    """target[where] = values drawn at random, each value at least once where there are places enough."""
    places = where.nonzero()
    places = places[torch.randperm(places.shape[0], generator=g)]
    picked = _pick(values, places.shape[0], g, target.dtype)
    every = min(len(values), places.shape[0])
    picked[:every] = torch.tensor(values, dtype=target.dtype)[torch.randperm(len(values), generator=g)[:every]]
    target[tuple(places.t())] = picked


def build_routing(mask: bool, p: Problem, g):
    """The routing of problem `p`: [N, k] ids or an [N, E] mask of p.id_dtype."""
    dtype = getattr(torch, p.id_dtype)
    if not mask:
        ids = torch.argsort(torch.rand(p.N, p.E, generator=g), dim=1)[:, :min(p.k, p.E)]
        ids = torch.cat([ids, torch.randint(p.E, (p.N, max(p.k - p.E, 0)), generator=g)], 1).to(dtype)
        dup = torch.rand(p.N, p.k, generator=g) < p.duplicates
        dup[:, 0] = False
        ids[dup] = ids[:, :1].expand_as(ids)[dup]
        where = torch.rand(p.N, p.k, generator=g) < p.bad
        _scatter_all(ids, where, BAD_IDS[dtype] + [-1, p.E, p.E + 1], g)
        return ids
    chosen = torch.argsort(torch.rand(p.N, p.E, generator=g), dim=1)[:, :p.k]
    routed = torch.zeros(p.N, p.E, dtype=torch.bool).scatter_(1, chosen, True)
    routed &= torch.rand(p.N, p.E, generator=g) >= 0.2  # some tokens with fewer routes, or none
    extra = torch.rand(p.N, p.E, generator=g) < p.bad  # more routes than k: past the topk hint
    routed |= extra
    if dtype == torch.bool:
        return routed
    values = MASK_VALUES[dtype] + (MASK_VALUES_LOW_ZERO if p.low_zero else [])
    routing = routed.to(dtype)
    odd = routed & (torch.rand(p.N, p.E, generator=g) < p.bad)
    _scatter_all(routing, odd, values, g)
    return routing


def slotted_routing(mask: bool, routing, width: int):
    """The routes that get a slot: for a mask, the first `width` nonzero columns of each token (as bool)."""
    if not mask:
        return routing
    nonzero = routing.cpu() != 0
    return nonzero & (nonzero.long().cumsum(1) <= width)


def tallies_ref(mask: bool, routing, slotted, routes, num_experts: int):
    """(dropped, unslotted): every route without a kept row, and of them those without a slot."""
    if mask:
        unslotted = int((routing.cpu() != 0).sum()) - int(slotted.sum())
        return int(slotted.sum()) - routes.dst.numel() + unslotted, unslotted
    ids = routing.cpu().long()  # compared in int64: the reference never narrows
    valid = int(((ids >= 0) & (ids < num_experts)).sum())
    unslotted = int(((ids < -1) | (ids >= num_experts)).sum())
    return valid - routes.dst.numel() + unslotted, unslotted


def routing_is_valid(mask: bool, routing, num_experts: int, width: int) -> bool:
    """What permute's routing check accepts (docs/architecture.md)."""
    r = routing.cpu()
    if mask:
        if r.dtype != torch.bool and bool(((r != 0) & (r != 1)).any()):
            return False
        return r.numel() == 0 or int((r != 0).sum(1).max()) <= width
    return r.numel() == 0 or bool(((r.long() >= -1) & (r.long() < num_experts)).all())


def spoil(values, where, g):
    values = values.clone()
    values[where] = _pick(NON_FINITE, int(where.sum()), g, values.dtype)
    return values


def same_values(got, want, what):
    """Bit for bit, except that a NaN compares by place only (its sign and payload are the machine's)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    got, want = got.detach().cpu(), want.detach().cpu()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at other places"
    zero = torch.zeros((), dtype=got.dtype)
    assert_bits_equal(torch.where(got.isnan(), zero, got), torch.where(want.isnan(), zero, want), what)


def check_problem(target: str, name: str, p: Problem, wrong=None):
    """Run problem `p`; `wrong`, for the self-test, corrupts the reference's results before comparing."""
    mod = load(target, name)
    v = mod.VARIANT
    mask = v["routing"] == "mask"
    device = device_of(target)
    g = torch.Generator().manual_seed(p.seed)
    routing = build_routing(mask, p, g)
    width = (p.topk or p.E) if mask else p.k
    slotted = slotted_routing(mask, routing, width)
    tokens = make_tokens(v, p.N, p.H, g)
    scale = make_scale(v, p.N, p.H, g)
    needed = needed_rows(v, slotted, p.E)
    cap = {"none": None, "below": int(needed * p.cap_fraction),
           "above": needed + 1 + int(8 * p.cap_fraction)}[p.cap]
    routes = permute_ref(tokens, slotted, routing_kind=v["routing"], num_experts=p.E, pad=v["pad"],
                         num_out_tokens=cap)[-1]
    kept_at = torch.zeros(routing.shape, dtype=torch.bool)
    kept_at[routes.token, routes.col] = True
    probs = merging = None
    if v["probs"]:
        probs, merging = torch.rand(routing.shape, generator=g), torch.rand(routing.shape, generator=g)
        if p.spoil_unkept:
            probs, merging = spoil(probs, ~kept_at, g), spoil(merging, ~kept_at, g)
        some = kept_at & (torch.rand(routing.shape, generator=g) < p.spoil_kept)
        probs, merging = spoil(probs, some, g), spoil(merging, some, g)
    tokens, routing_d, probs, merging, scale = to_device(device, tokens, routing, probs, merging, scale)

    kwargs = dict(num_experts=p.E, num_out_tokens=cap, **({"topk": p.topk} if p.topk is not None else {}))
    valid = routing_is_valid(mask, routing, p.E, width)
    if cap is None and not valid:  # checked by default without a cap: refused, then run unchecked
        with pytest.raises(ValueError):
            mod.permute(tokens, routing_d, probs, scale, **kwargs)
    check = {} if valid and not p.unchecked else {"check_routing": False}
    res = mod.permute(tokens, routing_d, probs, scale, **kwargs, **check)
    ref_tokens, ref_probs, ref_scale, ref_tpe, ref_routes = permute_ref(
        tokens, slotted.to(device), routing_kind=v["routing"], num_experts=p.E, probs=probs, scale=scale,
        pad=v["pad"], num_out_tokens=cap, quantize=v["quantize"])
    want_rows = rows_by_column_ref(ref_routes, p.N, routing.shape[1])
    want_tallies = tallies_ref(mask, routing, slotted, ref_routes, p.E)
    permuted = random_like((ref_routes.num_rows, p.H), combine_dtype(v), device, g)
    want_out = unpermute_ref(permuted, ref_routes, p.N, merging)
    if wrong is not None:
        ref_tokens, ref_probs, want_rows, want_tallies, want_out = wrong(ref_tokens, ref_probs, want_rows,
                                                                         want_tallies, want_out)

    assert_bits_equal(res.tokens, ref_tokens, "permuted tokens")
    assert torch.equal(res.tokens_per_expert.cpu(), ref_tpe.cpu()), (res.tokens_per_expert, ref_tpe)
    assert res.row_id_map.num_rows == ref_routes.num_rows
    if v["probs"]:
        same_values(res.probs, ref_probs, "permuted probs")
    else:
        assert res.probs is None
    if contract.scale_kind(v) != "none":
        assert_bits_equal(res.scale, ref_scale, "permuted scales")
    else:
        assert res.scale is None
    assert torch.equal(res.row_id_map.rows_by_column().cpu(), want_rows), "row map destinations differ"
    assert (int(res.dropped), int(res.row_id_map.unslotted)) == want_tallies, "route tallies differ"

    out = mod.unpermute(permuted, res.row_id_map, merging)
    assert out.shape == want_out.shape and out.dtype == want_out.dtype
    torch.testing.assert_close(out.cpu(), want_out.cpu(), **SUM_TOL[want_out.dtype], equal_nan=True,
                               msg=lambda m: f"unpermute: {m}")
    if not p.spoil_kept and (merging is None or torch.isfinite(merging[kept_at.to(device)]).all()):
        assert torch.isfinite(out).all(), "a prob without a kept route was read"
    if target == "nki":
        given = {"tokens": tokens, "routing": routing_d, "probs": probs, "scale": scale, "rows": permuted,
                 "merging_probs": merging}
        changed = [what for what, t in given.items() if t is not None and not resizable(t)]
        assert not changed, f"no longer resizable after the call: {changed}"
    return res, routes


def bounds(name: str, target: str) -> dict:
    """Small problems: every kernel runs interpreted or emulated. Padded segments cost E * pad rows
    (a program per row under the interpreter), so heavily padded variants draw fewer experts."""
    pad = permgen.VARIANTS[name]["pad"]
    mask = permgen.VARIANTS[name]["routing"] == "mask"
    if target == "nki":
        return dict(mask=mask, max_tokens=8, max_hidden=40, max_experts=max(1, min(5, 256 // pad)) if pad else 5)
    return dict(mask=mask, max_tokens=12, max_hidden=64, max_experts=max(1, min(6, 256 // pad)) if pad else 6)


EXAMPLES = 10


@pytest.mark.parametrize("name", variants_for("triton"))
@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_triton_adversarial(name, data, poisoned_empty):
    check_problem("triton", name, data.draw(problems(**bounds(name, "triton")), label="problem"))


@pytest.mark.parametrize("name", variants_for("nki"))
@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_nki_adversarial(name, data, poisoned_empty):
    check_problem("nki", name, data.draw(problems(**bounds(name, "nki")), label="problem"))


def _off_by_one_tally(tokens, probs, rows, tallies, out):
    return tokens, probs, rows, (tallies[0] + 1, tallies[1]), out


def _one_row_moved(tokens, probs, rows, tallies, out):
    rows = rows.clone()
    rows[rows >= 0] = rows[rows >= 0].roll(1)
    return tokens, probs, rows, tallies, out


def _token_bit_flipped(tokens, probs, rows, tallies, out):
    tokens = tokens.clone()
    tokens.view(torch.uint8).view(-1)[0] ^= 1
    return tokens, probs, rows, tallies, out


def _prob_changed(tokens, probs, rows, tallies, out):
    return tokens, probs.flip(0), rows, tallies, out


def _sum_off(tokens, probs, rows, tallies, out):
    return tokens, probs, rows, tallies, out * 1.1 + 0.1


# A hostile problem with routes kept and dropped, bad ids of both kinds and spoiled unkept probs.
SELF_TEST = Problem(N=9, H=24, E=4, k=3, id_dtype="int64", bad=0.3, duplicates=0.3, low_zero=False, topk=None,
                    cap="below", cap_fraction=0.7, spoil_unkept=True, spoil_kept=0.0, unchecked=False, seed=35)


@pytest.mark.parametrize("wrong", [_off_by_one_tally, _one_row_moved, _token_bit_flipped, _prob_changed, _sum_off])
@pytest.mark.parametrize("target", ["triton", "nki"])
def test_a_wrong_reference_fails(target, wrong, poisoned_empty):
    """The comparisons can fail: each corruption of the reference's results is caught."""
    check_problem(target, "probs_bf16_index", SELF_TEST)
    with pytest.raises(AssertionError):
        check_problem(target, "probs_bf16_index", SELF_TEST, wrong=wrong)


# ---------------------------------------------------------------------------------------------
# The chunk sort's order, read at each call and checked under torch.compile
# ---------------------------------------------------------------------------------------------

@st.composite
def chunk_problems(draw):
    """Chunk sizes (empty chunks among them), an order (often the one that moves nothing), the values
    written into the same order tensor afterwards, how they are written, and where the order lives."""
    chunks = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(0, 4), min_size=chunks, max_size=chunks))
    orders = st.just(list(range(chunks))) | st.permutations(range(chunks))
    how = draw(st.sampled_from(WRITES))
    on_device = how != "numpy" and draw(st.booleans())
    return sizes, list(draw(orders)), list(draw(orders)), how, on_device, draw(st.integers(0, 2**32 - 1))


@pytest.mark.parametrize("target", ["triton", "nki"])
@settings(max_examples=EXAMPLES, deadline=None)
@given(problem=chunk_problems())
def test_chunk_sort_follows_the_values_of_its_order(target, problem, poisoned_empty):
    """Rows and probs sorted by the order's values at each call, also once new values are written into
    its memory behind its version counter; the results in memory of their own (TE's new tensors)."""
    sizes, first, second, how, on_device, seed = problem
    mod = load(target, "probs_bf16_mask")
    device = device_of(target)
    g = torch.Generator().manual_seed(seed)
    tokens = make_tokens(mod.VARIANT, sum(sizes), 8, g).to(device)
    probs = torch.rand(sum(sizes), generator=g).to(device)
    order, write = order_written_behind_its_version(how, first, device if on_device else "cpu")
    for values in (first, second):
        if values is second:
            write(second)
        out, out_probs = mod.sort_chunks(tokens, torch.tensor(sizes), order, probs)
        assert_bits_equal(out.cpu(), sort_chunks_ref(tokens.cpu(), sizes, values), "rows")
        assert_bits_equal(out_probs.cpu(), sort_chunks_ref(probs.cpu(), sizes, values), "probs")
        if sum(sizes):
            assert out.untyped_storage().data_ptr() != tokens.untyped_storage().data_ptr()
            assert out_probs.untyped_storage().data_ptr() != probs.untyped_storage().data_ptr()


_COMPILED_SORTS = {}


def compiled_sort(target):
    """The target's chunk sort under torch.compile(fullgraph=True), made once (every call has the same shapes)."""
    if target not in _COMPILED_SORTS:
        mod = load(target, "probs_bf16_mask")
        _COMPILED_SORTS[target] = torch.compile(lambda t, s, o: mod.sort_chunks(t, s, o)[0], fullgraph=True,
                                                backend="inductor" if device_of(target).type == "cuda" else "aot_eager")
    return _COMPILED_SORTS[target]


def _outcome(sort, *args):
    """What a call gives: its error's type and words, or its output's bits."""
    try:
        return sort(*args).cpu().view(torch.int16).tolist()
    except ValueError as error:
        return type(error), str(error)


SORT_ROWS = 8
four = st.lists(st.integers(-2, 5), min_size=3, max_size=3)


@pytest.mark.parametrize("target", ["triton", "nki"])
@settings(max_examples=EXAMPLES, deadline=None)
@given(sizes=four.map(lambda s: s + [SORT_ROWS - sum(s)]) | st.lists(st.integers(-2, 5), min_size=4, max_size=4),
       order=st.permutations(range(4)) | st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_compiled_chunk_sort_refuses_what_eager_refuses(target, sizes, order):
    """Sizes and orders on the CPU of any values (negative, not summing to the rows, an order that repeats
    a chunk): the compiled sort gives the eager sort's rows or its error, word for word."""
    mod = load(target, "probs_bf16_mask")
    tokens = make_tokens(mod.VARIANT, SORT_ROWS, 8, torch.Generator().manual_seed(7)).to(device_of(target))
    args = tokens, torch.tensor(sizes), torch.tensor(list(order))
    assert _outcome(compiled_sort(target), *args) == _outcome(lambda *a: mod.sort_chunks(*a)[0], *args)


# ---------------------------------------------------------------------------------------------
# bf16 edge values: the CPU targets round alike
# ---------------------------------------------------------------------------------------------

# bf16 bits: subnormals, the smallest normal, the largest, values around 1, zeros of both signs.
EDGE_BF16 = [0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F81, 0x3F80, 0xBF81, 0x0000, 0x8000]
# Merging probs that make rounding ties, carries, overflow and subnormal products.
EDGE_PROBS = [0.5, 1.5, 1 + 2**-8, 1 + 3 * 2**-9, 1 - 2**-9, 2**-126, 2**-133, 3.0]


def _with_edges(values, edges, fraction, g):
    """values with a fraction of its entries replaced by edge values (bf16 bits, or floats)."""
    values = values.clone()
    where = torch.rand(values.shape, generator=g) < fraction
    if values.dtype == torch.bfloat16:
        bits = torch.tensor(edges, dtype=torch.int32).to(torch.int16)
        values.view(torch.int16)[where] = bits[torch.randint(len(edges), (int(where.sum()),), generator=g)]
    else:
        values[where] = _pick(edges, int(where.sum()), g, values.dtype)
    return values


@pytest.mark.parametrize("name", ["probs_bf16_mask", "probs_bf16_index"])
@settings(max_examples=EXAMPLES, deadline=None)
@given(n=st.integers(1, 8), hidden=st.integers(1, 40), experts=st.integers(1, 5), k=st.integers(1, 3),
       fraction=st.sampled_from([0.1, 0.5]), seed=st.integers(0, 2**32 - 1))
def test_targets_round_bf16_alike(name, n, hidden, experts, k, fraction, seed):
    """unpermute and its backward pass on bf16 edge values: the grad rows (one product each, rounded
    once) are the reference's on both targets; the sums agree bit for bit between the CPU targets,
    within SUM_TOL of a GPU's (it sums in another order); the prob grads (sums over H) within tolerance
    where they are far from overflowing."""
    k = min(k, experts)
    g = torch.Generator().manual_seed(seed)
    spec = permgen.VARIANTS[name]
    routing = routing_from_ids(spec, expert_ids(n, experts, k, g, ragged=True), experts)
    tokens, probs = make_tokens(spec, n, hidden, g), torch.rand(routing.shape, generator=g)
    rows = None
    results = {}
    for target in ("triton", "nki"):
        device = device_of(target)
        res = load(target, name).permute(*to_device(device, tokens, routing, probs), num_experts=experts)
        if rows is None:
            rows = _with_edges(random_like(res.tokens.shape, torch.bfloat16, "cpu", g), EDGE_BF16, fraction, g)
            merging = _with_edges(torch.rand(routing.shape, generator=g), EDGE_PROBS, fraction, g)
            grad_out = _with_edges(random_like((n, hidden), torch.bfloat16, "cpu", g), EDGE_BF16, fraction, g)
        leaves = [t.to(device).requires_grad_() for t in (rows, merging)]
        out = load(target, name).unpermute(leaves[0], res.row_id_map, leaves[1])
        results[target] = (out, *torch.autograd.grad(out, leaves, grad_out.to(device)))
    routes = permute_ref(tokens, routing, routing_kind=spec["routing"], num_experts=experts)[-1]
    want_rows, want_probs = unpermute_grads_ref(grad_out, rows, routes, merging)
    (out, grad_rows, grad_probs), (nki_out, nki_grad_rows, nki_grad_probs) = results["triton"], results["nki"]
    same_values(grad_rows, want_rows, "triton grad rows")
    same_values(nki_grad_rows, want_rows, "nki grad rows")
    if DEVICE.type == "cpu":
        same_values(out, nki_out, "unpermute")
    else:
        torch.testing.assert_close(out.cpu(), nki_out, **SUM_TOL[torch.bfloat16], equal_nan=True)
    moderate = want_probs.abs() < 2.0**100  # a sum near the overflow may overflow in one order, not in another
    for got in (grad_probs, nki_grad_probs):
        torch.testing.assert_close(got.cpu()[moderate], want_probs[moderate], **PROB_GRAD_TOL)


# ---------------------------------------------------------------------------------------------
# TransformerEngine's API: a part of a map, tokens_per_expert
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _te_map(map_type):
    """(rows, row_id_map) of a TE permute of 6 tokens, 3 experts, k = 2 (made once: the checks read it only)."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randn(6, 8, generator=g).to(torch.bfloat16).to(DEVICE)
    ids = expert_ids(6, 3, 2, g).to(DEVICE)
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), 3).to(DEVICE)
    if map_type == "index":
        return permgen.moe_permute(tokens, ids, map_type="index")
    if map_type == "padded":
        out, _, row_id_map, _, _ = permgen.moe_permute_and_pad_with_probs(
            tokens, torch.rand(6, 3, generator=g).to(DEVICE), mask, mask.sum(0), 128)
        return out, row_id_map
    return permgen.moe_permute(tokens, mask)


@settings(max_examples=3 * EXAMPLES, deadline=None)
@given(map_type=st.sampled_from(["mask", "padded", "index"]), data=st.data())
def test_a_part_of_a_te_map_is_refused(map_type, data):
    """Any slice of a row_id_map (a range and a step in each dimension) is refused by moe_unpermute
    unless it is the whole map, whose result it then gives."""
    out, row_id_map = _te_map(map_type)
    parts = []
    for size in row_id_map.shape:
        start = data.draw(st.integers(0, size - 1))
        parts.append(slice(start, data.draw(st.integers(start + 1, size)), data.draw(st.sampled_from([1, 1, 2]))))
    part = row_id_map[tuple(parts)]
    te_type = "index" if map_type == "index" else "mask"
    if part.shape == row_id_map.shape:  # all of it
        assert_bits_equal(permgen.moe_unpermute(out, part, map_type=te_type),
                          permgen.moe_unpermute(out, row_id_map, map_type=te_type), "the whole map")
    else:
        with pytest.raises(ValueError, match="moe_unpermute: "):
            permgen.moe_unpermute(out, part, map_type=te_type)


@settings(max_examples=EXAMPLES, deadline=None)
@given(shape=st.sampled_from([[3], [1], [1, 3], [2], [4], [], [3, 1]]),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.float32, torch.bool]))
def test_tokens_per_expert_is_one_integer_count_per_expert(shape, dtype):
    """moe_permute_and_pad_with_probs takes tokens_per_expert only as an integer tensor [E]."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(6, 8, generator=g).to(torch.bfloat16).to(DEVICE)
    mask = routing_from_ids({"routing": "mask"}, expert_ids(6, 3, 2, g), 3).to(DEVICE)
    probs = torch.rand(6, 3, generator=g).to(DEVICE)
    counts = torch.ones(shape, dtype=dtype, device=DEVICE)
    if shape == [3] and not dtype.is_floating_point and dtype != torch.bool:
        pad_offsets = permgen.moe_permute_and_pad_with_probs(tokens, probs, mask, counts, 128)[3]
        assert pad_offsets.shape == (3,)
    else:
        with pytest.raises((TypeError, ValueError), match="moe_permute_and_pad_with_probs: tokens_per_expert must"):
            permgen.moe_permute_and_pad_with_probs(tokens, probs, mask, counts, 128)
