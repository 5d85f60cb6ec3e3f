"""Adversarial routing and probs, on both targets, against the reference.

- Expert ids at the int32 / int64 edges, mixed with valid ids: an id outside [0, E) routes nowhere and is
  counted in `dropped`, whatever its width; in particular an int64 id that narrows to a valid expert
  (2**32 + e, -2**32 + e, int64 min) never takes a row. Through a variant's `permute` (with and without
  num_out_tokens) and TransformerEngine's `moe_permute(map_type="index")`.
- Non-finite probs: a prob on a slot or column that holds no kept route (no route, a bad id, a route past
  the row cap or past the topk hint, a column the mask does not route) is never read into any result; a
  non-finite prob (or prob gradient) on a kept route propagates as the arithmetic says, the same on both
  targets (docs/architecture.md, "Routes and probs: what is read").
"""

from __future__ import annotations

import pytest
import torch

import permgen
from cases import (SUM_TOL, assert_bits_equal, check_roundtrip, combine_dtype, device_of,
                   expert_ids, generator_for, load, make_tokens, needed_rows, random_like, routing_from_ids,
                   rows_by_column_ref, to_device)
from permgen.core.results import RowMapLayout
from reference import permute_grads_ref, permute_ref, plan_routes, unpermute_grads_ref, unpermute_ref

TARGETS = ["triton", "nki"]
N, H, E, K = 24, 40, 5, 3
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Ids outside [-1, E) as each width holds them, and -1 (no route).
EDGES = {
    torch.int32: [2**31 - 1, -2**31, -1, -2, E, E + 1],
    torch.int64: [2**31 - 1, 2**31, 2**32, -2**31 - 1, -2**32, INT64_MAX, INT64_MIN, -1, -2, E, E + 1,
                  # these narrow to a valid expert (to 1, 3, 2, 0 and 4 as int32)
                  2**32 + 1, -2**32 + 3, 2**33 + 2, 2**40, -2**35 + 4],
}
CAPS = ["none", "drop", "spare"]
# NaN and inf probs make the interpreter's and the emulator's NumPy warn; the results are what is checked.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _num_out_tokens(cap, needed):
    return {"none": None, "drop": needed * 2 // 3, "spare": needed + 3}[cap]


def _adversarial_ids(dtype, num_tokens, k, g, edges):
    """[N, k] ids: distinct valid experts per token, then every value of `edges` at random slots and a
    third of the other slots drawn from `edges` too."""
    ids = expert_ids(num_tokens, E, k, g).to(dtype)
    flat = ids.view(-1)
    order = torch.randperm(flat.numel(), generator=g)
    edge_values = torch.tensor(edges, dtype=dtype)
    flat[order[:len(edges)]] = edge_values
    more = order[len(edges):len(edges) + flat.numel() // 3]
    flat[more] = edge_values[torch.randint(len(edges), (more.numel(),), generator=g)]
    return ids


def _tallies_ref(ids, routes):
    """(dropped, without a slot): every valid route not kept, and every id outside [-1, E)."""
    ids = ids.cpu().long()  # an int64 compare: the reference never narrows
    valid = int(((ids >= 0) & (ids < E)).sum())
    bad = int(((ids < -1) | (ids >= E)).sum())
    return valid - routes.dst.numel() + bad, bad


class _Unchecked:
    """A variant module whose permute does not check the routing values (so out-of-range ids reach the
    kernels even without num_out_tokens, which would otherwise check them)."""

    def __init__(self, mod):
        self.mod, self.VARIANT, self.unpermute = mod, mod.VARIANT, mod.unpermute

    def permute(self, *args, **kwargs):
        return self.mod.permute(*args, check_routing=False, **kwargs)


# ---------------------------------------------------------------------------------------------
# Expert ids of every width at the edges
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("name", ["probs_bf16_index", "probs_pad16_bf16_index"])
@pytest.mark.parametrize("target", TARGETS)
def test_out_of_range_ids_are_dropped_and_counted(target, name, id_dtype, cap, request, poisoned_empty):
    """permute, unpermute and both backward passes against the reference, the row map's destinations
    bit for bit, and the route tallies exact."""
    mod = load(target, name)
    v = mod.VARIANT
    g = generator_for(request)
    device = device_of(target)
    ids = _adversarial_ids(id_dtype, N, K, g, EDGES[id_dtype])
    tokens = make_tokens(v, N, H, g)
    probs = torch.rand(N, K, generator=g)
    tokens, ids, probs = to_device(device, tokens, ids, probs)
    num_out_tokens = _num_out_tokens(cap, needed_rows(v, ids, E))
    if cap == "none":
        with pytest.raises(ValueError, match="expert ids must be in"):  # checked by default without a cap
            mod.permute(tokens, ids, probs, num_experts=E)
    res, _ = check_roundtrip(_Unchecked(mod), target, tokens, ids, probs, None, num_experts=E,
                             num_out_tokens=num_out_tokens, generator=g)
    routes = plan_routes(ids, "index", E, v["pad"], num_out_tokens)
    dropped, unslotted = _tallies_ref(ids, routes)
    assert (int(res.dropped), int(res.row_id_map.unslotted)) == (dropped, unslotted)


@pytest.mark.parametrize("cap", [-1, "drop"])
def test_te_index_map_drops_ids_that_narrow_to_an_expert(cap, request, poisoned_empty):
    """moe_permute counts the experts itself (max id + 1), so only negative ids can be past int32 there."""
    g = generator_for(request)
    negative = [-2**32, -2**32 + 3, -2**33 + 1, -2**35 + 4, INT64_MIN, -2**31 - 1, -2**31, -2]
    ids = _adversarial_ids(torch.int64, N, K, g, negative)
    ids[0, 0] = E - 1  # the expert count moe_permute reads: E
    tokens = random_like((N, H), torch.bfloat16, device_of("triton"), g).requires_grad_()
    ids = ids.to(tokens.device)
    num_out_tokens = N * K if cap == -1 else N * K // 3  # -1: TE's "every slot"
    out, row_id_map = permgen.moe_permute(tokens, ids, num_out_tokens=cap if cap == -1 else num_out_tokens,
                                          map_type="index")
    want, _, _, _, routes = permute_ref(tokens.detach(), ids, routing_kind="index", num_experts=E,
                                        num_out_tokens=num_out_tokens)
    assert_bits_equal(out, want, "permuted tokens")
    row_map = row_id_map[0].reshape(-1)
    layout = RowMapLayout(False, N, K, E)
    assert torch.equal(row_map[:N * K].view(N, K).long().cpu(), rows_by_column_ref(routes, N, K)), "dst rows"
    assert row_map[layout.route_tallies:layout.end].tolist() == list(_tallies_ref(ids, routes))

    merging = torch.rand(N, K, generator=g).to(tokens.device)
    merged = permgen.moe_unpermute(out, row_id_map, merging, map_type="index")
    torch.testing.assert_close(merged, unpermute_ref(out.detach(), routes, N, merging), **SUM_TOL[torch.bfloat16])
    grad = random_like(out.shape, out.dtype, out.device, g)
    (grad_tokens,) = torch.autograd.grad(out, tokens, grad)
    want_grad, _ = permute_grads_ref(grad, routes, N)
    torch.testing.assert_close(grad_tokens, want_grad, **SUM_TOL[torch.bfloat16])


# ---------------------------------------------------------------------------------------------
# Non-finite probs
# ---------------------------------------------------------------------------------------------

NON_FINITE = torch.tensor([float("nan"), float("inf"), -float("inf")])


def _routing(v, g):
    """Ragged routes; index routing adds ids outside [0, E) (to a column no route keeps)."""
    ids = expert_ids(N, E, K, g, ragged=True).long()
    if v["routing"] == "index":
        bad = torch.rand(N, K, generator=g) < 0.15
        ids[bad] = torch.tensor([E, -7, 2**32])[torch.randint(3, (int(bad.sum()),), generator=g)]
    return routing_from_ids(v, ids, E)


def _spoil(probs, where, g):
    """probs with NaN, inf or -inf at the entries `where` marks (a bool tensor shaped like probs)."""
    probs = probs.clone()
    probs[where] = NON_FINITE[torch.randint(3, (int(where.sum()),), generator=g)].to(probs.dtype)
    return probs


def _same_values(got, want, what):
    """NaN at the same places (its sign and payload are the machine's); every other value bit for bit."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    got, want = got.detach().cpu(), want.detach().cpu()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at other places"
    zero = torch.zeros((), dtype=got.dtype)
    assert_bits_equal(torch.where(got.isnan(), zero, got), torch.where(want.isnan(), zero, want), what)


@pytest.mark.parametrize("kept", ["finite", "non_finite"])
@pytest.mark.parametrize("name, topk", [("probs_bf16_index", None), ("probs_bf16_mask", None),
                                        ("probs_bf16_mask", K - 1)], ids=["index", "mask", "mask_topk"])
@pytest.mark.parametrize("target", TARGETS)
def test_probs_without_a_kept_route_are_never_read(target, name, topk, kept, request, poisoned_empty):
    """Every prob on a slot / column without a kept route is NaN or inf; with kept="non_finite" some kept
    routes' probs, permuted probs' gradients and unpermute's output gradients are too. permute, unpermute
    and both backward passes match the reference, which reads kept routes only."""
    mod = load(target, name)
    v = mod.VARIANT
    g = generator_for(request)
    device = device_of(target)
    routing = _routing(v, g)
    tokens = make_tokens(v, N, H, g)
    num_out_tokens = needed_rows(v, routing, E) * 3 // 4  # some routes past the cap
    slotted = routing
    if topk is not None:  # a token's routes past the topk hint have no slot: it keeps its first topk
        slotted = routing & (routing.cumsum(1) <= topk)
    routes = plan_routes(slotted, v["routing"], E, v["pad"], num_out_tokens)
    kept_at = torch.zeros(routing.shape, dtype=torch.bool)
    kept_at[routes.token, routes.col] = True
    probs, merging = torch.rand(routing.shape, generator=g), torch.rand(routing.shape, generator=g)
    probs, merging = _spoil(probs, ~kept_at, g), _spoil(merging, ~kept_at, g)
    grad_probs_out = torch.randn(num_out_tokens, generator=g)
    routed_rows = torch.zeros(num_out_tokens, dtype=torch.bool)
    routed_rows[routes.dst] = True
    grad_probs_out = _spoil(grad_probs_out, ~routed_rows, g)  # pad rows and rows past the segments
    if kept == "non_finite":
        some = kept_at & (torch.rand(routing.shape, generator=g) < 0.2)
        probs, merging = _spoil(probs, some, g), _spoil(merging, some, g)
        grad_probs_out = _spoil(grad_probs_out, routed_rows & (torch.rand(num_out_tokens, generator=g) < 0.2), g)
    tokens, routing, probs, merging, grad_probs_out = to_device(device, tokens, routing, probs, merging,
                                                                grad_probs_out)

    # permute, and its backward pass
    probs = probs.requires_grad_()
    tokens = tokens.requires_grad_()
    kwargs = dict(num_experts=E, num_out_tokens=num_out_tokens, topk=topk)
    res = mod.permute(tokens, routing, probs, **kwargs)
    ref_tokens, ref_probs, _, _, _ = permute_ref(tokens.detach(), slotted.to(device), routing_kind=v["routing"],
                                                 num_experts=E, probs=probs.detach(), num_out_tokens=num_out_tokens)
    assert_bits_equal(res.tokens, ref_tokens, "permuted tokens")
    assert torch.equal(res.tokens_per_expert.cpu(), routes.tokens_per_expert)
    assert torch.equal(res.row_id_map.rows_by_column().cpu(), rows_by_column_ref(routes, N, routing.shape[1]))
    _same_values(res.probs, ref_probs, "permuted probs")
    grad_rows = random_like(res.tokens.shape, res.tokens.dtype, device, g)
    grad_tokens, grad_probs = torch.autograd.grad([res.tokens, res.probs], [tokens, probs], [grad_rows, grad_probs_out])
    want_tokens, want_probs = permute_grads_ref(grad_rows, routes, N, probs.shape, grad_probs_out)
    torch.testing.assert_close(grad_tokens, want_tokens, **SUM_TOL[torch.bfloat16])
    _same_values(grad_probs, want_probs, "permute's prob grads")

    # unpermute, and its backward pass
    permuted = random_like(res.tokens.shape, combine_dtype(v), device, g).requires_grad_()
    merging = merging.requires_grad_()
    out = mod.unpermute(permuted, res.row_id_map, merging)
    want = unpermute_ref(permuted.detach(), routes, N, merging.detach())
    torch.testing.assert_close(out, want, **SUM_TOL[torch.bfloat16], equal_nan=True)
    if kept == "finite":
        assert torch.isfinite(out).all()
    grad_out = random_like(out.shape, out.dtype, device, g)
    if kept == "non_finite":  # a route that is not kept still gets a zero prob gradient
        grad_out = _spoil(grad_out.cpu(), torch.rand(out.shape, generator=g) < 0.02, g).to(device)
    grad_permuted, grad_merging = torch.autograd.grad(out, [permuted, merging], grad_out)
    want_permuted, want_merging = unpermute_grads_ref(grad_out, permuted.detach(), routes, merging.detach())
    _same_values(grad_permuted, want_permuted, "unpermute's grad rows")
    torch.testing.assert_close(grad_merging, want_merging, rtol=1e-4, atol=1e-4, equal_nan=True)
