"""Expert parallelism (permgen.ep): every Triton variant's dispatch and combine over gloo, on 2 and
4 ranks, forward and backward, against the plain-PyTorch reference: single-rank permute over all
ranks' tokens concatenated in rank order, restricted to each rank's experts.

Each world size starts its processes once (importing torch and Triton is the slow part) and runs
every variant and case inside them; each (world size, variant, case) is then reported as its own
test. Every rank builds all ranks' inputs from the same replayable seed, so it computes the whole
reference itself. Moved data (rows, probs, scales, prob grads routed back) is compared bit for
bit, sums with tolerances; outputs start poisoned. With as many GPUs as ranks the same cases run
over NCCL with compiled kernels, plus capacity mode under torch.cuda.set_sync_debug_mode("error")
and a CUDA-graph replay (check_no_host_sync); world sizes beyond the GPU count are skipped there.

Also: the Triton dispatch against the NKI dispatch (`permute_a2av`, emulator) on identical inputs;
on a GPU, a process that captured dispatch and combine in a CUDA graph exits after the documented
teardown (docs/expert_parallel.md, "Shutdown").
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import permgen
from permgen.core.contract import scale_kind

from cases import (PROB_GRAD_TOL, assert_bits_equal, assert_sum_close, combine_dtype, expert_ids, host_reads, is_fp8,
                   load, make_scale, make_tokens, poison, prob_columns, routing_from_ids, stable_seed, variants_for)
from reference import permute_grads_ref, permute_ref, plan_routes, unpermute_grads_ref, unpermute_ref

WORLD_SIZES = (1, 2, 4)
HIDDEN = 40
# Where the ranks' tensors live: the CPU (gloo, Triton interpreter) unless every rank has a GPU
# (NCCL, compiled kernels); set in each process by `worker`.
EP_DEVICE = torch.device("cpu")


def on_device(*tensors):
    return tuple(None if t is None else t.to(EP_DEVICE) for t in tensors)


@dataclass(frozen=True)
class EpCase:
    name: str
    experts_per_rank: int  # padded variants: always 1 (each local expert is at least pad rows)
    k: int
    tokens: tuple  # tokens of each rank
    capacity: object = None  # rows per rank pair, or None (dropless)
    silent_last: int = 0  # no token is routed to the experts of the last `silent_last` ranks
    unpadded_only: bool = False  # padded variants skip it (their pad rows cost interpreter time)


# Small: the interpreter runs one program per row, and a padded variant's segments are at least pad
# rows long, so padded variants dominate the time: one local expert per rank except in one case,
# and the capacity case on 4 ranks for unpadded variants only (every variant runs it on 2 ranks).
CASES = {
    # One rank (NCCL's one-rank group on one GPU): nothing to regroup, capacity is permute's row cap.
    1: [
        EpCase("uneven", experts_per_rank=2, k=2, tokens=(7,)),
        EpCase("capacity", experts_per_rank=2, k=2, tokens=(9,), capacity=5),
    ],
    2: [
        # Uneven splits, two local experts per rank (the expert-major regroup across sources;
        # one for padded variants).
        EpCase("uneven", experts_per_rank=2, k=2, tokens=(7, 3)),
        # Fixed capacity, small enough that some rank pairs overflow.
        EpCase("capacity", experts_per_rank=1, k=2, tokens=(9, 4), capacity=3),
    ],
    4: [
        # Rank 0 has no tokens (sends nothing); nothing is routed to ranks 2 and 3 (they receive
        # nothing); the others send uneven splits.
        EpCase("silent", experts_per_rank=1, k=2, tokens=(0, 4, 3, 5), silent_last=2),
        EpCase("capacity", experts_per_rank=1, k=2, tokens=(5, 2, 6, 1), capacity=2, unpadded_only=True),
    ],
}


SUBGROUP_CASE = EpCase("subgroups", experts_per_rank=2, k=2, tokens=(5, 3))

# One rank's own paths (no regroup, permute's row cap as the capacity) depend on the routing kind
# and on what moves beside the rows: on the CPU these variants cover them (all run on a GPU).
ONE_RANK_ON_CPU = ("probs_bf16_index", "bf16_mask", "probs_fp8e5m2_index", "probs_bf16_to_fp8e4m3_block128_index")


def plain_variant():
    """A bf16, index-routed, unpadded variant: the NKI comparison's and the subgroup case's."""
    return next(n for n, v in permgen.VARIANTS.items()
                if "triton" in v["targets"] and v["dtype"] == "bf16" and v["routing"] == "index" and not v["pad"]
                and v["quantize"] == "none")


def cases_for(world, name):
    # (one rank needs k experts: its tokens route to k distinct ones)
    padded = permgen.VARIANTS[name]["pad"] > 0 and not torch.cuda.is_available() and world > 1
    if world == 1 and name not in ONE_RANK_ON_CPU and not torch.cuda.is_available():
        return []  # ONE_RANK_ON_CPU covers one rank's paths (padded variants pad as on two ranks)
    return [replace(c, experts_per_rank=1) if padded else c for c in CASES[world] if not (c.unpadded_only and padded)]


# ---------------------------------------------------------------------------------------------
# Inputs and reference (every rank computes all of it)
# ---------------------------------------------------------------------------------------------

def global_inputs(v, case, world, seed):
    """Per rank: (tokens, routing, probs, scale, expert ids), all from one seed."""
    g = torch.Generator().manual_seed(seed)
    num_experts = case.experts_per_rank * world
    reachable = num_experts - case.experts_per_rank * case.silent_last
    ranks = []
    for n in case.tokens:
        tokens = make_tokens(v, n, HIDDEN, g)
        ids = expert_ids(n, reachable, case.k, g)
        routing = routing_from_ids(v, ids, num_experts)
        probs = torch.rand(n, prob_columns(v, num_experts, case.k), generator=g) if v["probs"] else None
        ranks.append((tokens, routing, probs, make_scale(v, n, HIDDEN, g)))
    return ranks


def drop_overflow(v, ranks, world, num_experts, capacity):
    """The routings with the routes past capacity removed: from each source to each destination,
    the first `capacity` routes in (expert, token, slot) order are kept. Returns (routings,
    dropped[src][dst])."""
    local = num_experts // world
    routings, dropped = [], []
    for _, routing, _, _ in ranks:
        routing = routing.clone()
        r = plan_routes(routing, v["routing"], num_experts)
        dest = r.expert // local
        first = torch.searchsorted(dest, torch.arange(world))
        rank_in_dest = torch.arange(dest.numel()) - first[dest]
        drop = rank_in_dest >= capacity
        routing[r.token[drop], r.col[drop]] = -1 if v["routing"] == "index" else False
        routings.append(routing)
        dropped.append(torch.bincount(dest[drop], minlength=world).tolist())
    return routings, dropped


def cat_or_none(parts):
    return None if parts[0] is None else torch.cat(parts)


def expected(v, ranks, routings, world, me, num_experts, num_out):
    """Reference dispatch outputs of rank `me`, the global Routes and my row range in the global layout."""
    local = num_experts // world
    tokens = torch.cat([r[0] for r in ranks])
    routing = torch.cat(routings)
    probs = cat_or_none([r[2] for r in ranks])
    scale = cat_or_none([r[3] for r in ranks])
    out, out_probs, out_scale, tpe, routes = permute_ref(tokens, routing, routing_kind=v["routing"],
                                                         num_experts=num_experts, probs=probs, scale=scale,
                                                         pad=v["pad"], quantize=v["quantize"])
    start = int(routes.segment_start[me * local])
    end = start + int(tpe[me * local:(me + 1) * local].sum())
    if num_out is None:
        num_out = end - start

    def mine(t):
        if t is None:
            return None
        part = t[start:end]
        if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
            part = part.view(torch.uint8)
        tail = torch.zeros((num_out - part.shape[0], *part.shape[1:]), dtype=part.dtype)
        return torch.cat([part, tail]).view(t.dtype)

    return dict(tokens=mine(out), probs=mine(out_probs), scale=mine(out_scale),
                tokens_per_expert=tpe[me * local:(me + 1) * local], routes=routes, start=start, end=end,
                num_out=num_out)


# ---------------------------------------------------------------------------------------------
# One case on one rank: every collective first, then the checks
# ---------------------------------------------------------------------------------------------

@contextmanager
def poisoned():
    """Every torch.empty / empty_like allocation starts as NaN or a huge int."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def random_rows(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def run_case(mod, case, world, me, group):
    """Dispatch, combine and both backward passes on this rank; returns what the checks need."""
    v = mod.VARIANT
    seed = stable_seed("test_ep", world, v["name"], case.name)
    num_experts = case.experts_per_rank * world
    ranks = global_inputs(v, case, world, seed)
    tokens, routing, probs, scale = on_device(*ranks[me])
    differentiable = not is_fp8(v) and v["quantize"] == "none"  # fp8 rows out: never differentiated
    tokens = tokens.clone().requires_grad_(differentiable)
    probs = None if probs is None else probs.clone().requires_grad_()
    # Mask routing with the topk hint on 2 ranks, without it on 1 and 4: with it, dropless dispatch
    # counts the routes in permute's routing kernel (without, in a pass of its own first), and
    # capacity mode sizes its send buffer by it (without, for E routes per token).
    hint = dict(topk=case.k) if v["routing"] == "mask" and world == 2 else {}
    with poisoned():
        res = mod.dispatch(tokens, routing, probs, scale, group=group, num_experts=num_experts,
                           recv_capacity=case.capacity, **hint)
    num_out = res.tokens.shape[0]
    cdt = combine_dtype(v)
    run = dict(res=res, ranks=ranks, num_out=num_out, differentiable=differentiable)
    # dispatch backward
    outputs, grads = [], []
    if differentiable:
        outputs.append(res.tokens)
        grads.append(random_rows(res.tokens.shape, res.tokens.dtype, seed + 1 + me).to(EP_DEVICE))
    if probs is not None:
        outputs.append(res.probs)
        grads.append(random_rows(res.probs.shape, res.probs.dtype, seed + 11 + me).to(EP_DEVICE))
    inputs = ([tokens] if differentiable else []) + ([probs] if probs is not None else [])
    with poisoned():
        run["dispatch_grads"] = torch.autograd.grad(outputs, inputs, grads) if outputs else ()
    run["dispatch_grad_out"] = grads
    # combine and its backward
    expert_out = random_rows((num_out, HIDDEN), cdt, seed + 21 + me).to(EP_DEVICE).requires_grad_()
    merging = None
    if v["probs"]:
        merging = torch.rand(probs.shape, generator=torch.Generator().manual_seed(seed + 31 + me))
        merging = merging.to(EP_DEVICE).requires_grad_()
    with poisoned():
        out = mod.combine(expert_out, res.handle, merging)
    grad_out = random_rows(out.shape, out.dtype, seed + 41 + me).to(EP_DEVICE)
    with poisoned():
        run["combine_grads"] = torch.autograd.grad(out, [expert_out] + ([merging] if merging is not None else []),
                                                   grad_out)
    run.update(out=out, expert_out=expert_out.detach(), merging=None if merging is None else merging.detach(),
               combine_grad_out=grad_out)
    # The checks run on the CPU.
    run["res"] = res._replace(tokens=res.tokens.cpu(), probs=None if res.probs is None else res.probs.cpu(),
                              scale=None if res.scale is None else res.scale.cpu(),
                              tokens_per_expert=res.tokens_per_expert.cpu())
    for key in ("dispatch_grads", "combine_grads", "dispatch_grad_out"):
        run[key] = [g.cpu() for g in run[key]]
    for key in ("out", "expert_out", "merging", "combine_grad_out"):
        run[key] = None if run[key] is None else run[key].cpu()
    return run


def check_case(mod, case, world, me, run, gathered):
    """Compare this rank's results with the reference. `gathered` holds every rank's expert outputs,
    merging probs and incoming grads (exchanged after the run)."""
    v = mod.VARIANT
    num_experts = case.experts_per_rank * world
    local = num_experts // world
    ranks, res = run["ranks"], run["res"]
    routings = [r[1] for r in ranks]
    dropped = [[0] * world for _ in range(world)]
    if case.capacity is not None:
        routings, dropped = drop_overflow(v, ranks, world, num_experts, case.capacity)
    want = expected(v, ranks, routings, world, me, num_experts,
                    None if case.capacity is None else run["num_out"])
    if case.capacity is not None:
        assert run["num_out"] == world * case.capacity + (local * (v["pad"] - 1) if v["pad"] else 0)
    assert_bits_equal(res.tokens, want["tokens"], "dispatched tokens")
    assert res.tokens_per_expert.dtype == torch.int64
    assert torch.equal(res.tokens_per_expert, want["tokens_per_expert"]), (res.tokens_per_expert,
                                                                           want["tokens_per_expert"])
    if v["probs"]:
        assert_bits_equal(res.probs, want["probs"], "dispatched probs")
    else:
        assert res.probs is None
    if scale_kind(v) != "none":
        assert_bits_equal(res.scale, want["scale"], "dispatched scales")
    else:
        assert res.scale is None
    # The send buffer's row map (what combine and the backward passes read): a consistent segment table.
    send_map = res.handle.send_map
    offsets, counts = send_map.segment_offsets.long().cpu(), send_map.segment_counts.long().cpu()
    assert offsets[0] >= 0 and offsets[-1] <= send_map.num_rows and bool((offsets[1:] >= offsets[:-1] + counts).all())
    assert res.handle.dropped.tolist() == [dropped[src][me] for src in range(world)], res.dropped
    # The handle (and autograd's graph through it) must not keep the process group alive past
    # destroy_process_group: gloo's group torn down at interpreter exit instead aborted processes
    # (check_group_freed destroys one).
    held = [*vars(res.handle).values(), *vars(res.handle.facts).values(), *vars(res.handle.facts.exchange).values()]
    assert not any(isinstance(x, torch.distributed.ProcessGroup) for x in held), held
    if case.capacity is not None:
        assert sum(map(sum, dropped)) > 0, "the capacity case must overflow somewhere"

    # Global views: every rank's slice of the global layout.
    routes = want["routes"]
    bounds = [expected(v, ranks, routings, world, r, num_experts, None) for r in range(world)]
    total_rows = routes.num_rows
    sizes = [len(r[0]) for r in ranks]
    first_token = sum(sizes[:me])
    mine = slice(first_token, first_token + sizes[me])

    def global_rows(per_rank, hidden_dtype):
        full = torch.zeros((total_rows, *per_rank[0].shape[1:]), dtype=hidden_dtype)
        for r, b in enumerate(bounds):
            full[b["start"]:b["end"]] = per_rank[r][:b["end"] - b["start"]]
        return full

    # dispatch backward: token grads gather-summed, prob grads routed back exactly.
    grads = list(run["dispatch_grads"])
    g_tokens = gathered["dispatch_grad_tokens"]
    g_probs = gathered["dispatch_grad_probs"]
    probs_all = cat_or_none([r[2] for r in ranks])
    if g_tokens is not None or g_probs is not None:
        grad_rows = (global_rows(g_tokens, g_tokens[0].dtype) if g_tokens is not None
                     else torch.zeros(total_rows, HIDDEN))
        want_tokens, want_probs = permute_grads_ref(
            grad_rows, routes, sum(sizes), None if probs_all is None else probs_all.shape,
            None if g_probs is None else global_rows(g_probs, g_probs[0].dtype))
        if g_tokens is not None:
            assert_sum_close(grads.pop(0), want_tokens[mine], "dispatch grad tokens")
        if g_probs is not None:
            assert_bits_equal(grads.pop(0), want_probs[mine], "dispatch grad probs")

    # combine: unpermute over the global layout, then its backward.
    permuted = global_rows(gathered["expert_out"], combine_dtype(v))
    merging = None if gathered["merging"] is None else torch.cat(gathered["merging"])
    want_out = unpermute_ref(permuted, routes, sum(sizes), merging)
    assert_sum_close(run["out"], want_out[mine], "combine")
    grad_out = torch.cat(gathered["combine_grad_out"])
    want_grad_rows, want_grad_probs = unpermute_grads_ref(grad_out, permuted, routes, merging)
    b = bounds[me]
    tail = torch.zeros((run["num_out"] - (b["end"] - b["start"]), HIDDEN), dtype=want_grad_rows.dtype)
    want_grad_expert = torch.cat([want_grad_rows[b["start"]:b["end"]], tail])
    assert_bits_equal(run["combine_grads"][0], want_grad_expert, "combine grad expert rows")
    if merging is not None:
        torch.testing.assert_close(run["combine_grads"][1], want_grad_probs[mine], **PROB_GRAD_TOL)


def all_gather_objects(group, obj, world):
    out = [None] * world
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def check_bad_input(mod, group, world):
    """Clear errors before any collective runs."""
    v = mod.VARIANT
    num_experts = 2 * world
    g = torch.Generator().manual_seed(5)
    tokens = make_tokens(v, 4, HIDDEN, g)
    # No routes: the one valid dispatch below (for combine's handle) moves nothing.
    routing = routing_from_ids(v, torch.full((4, 2), -1, dtype=torch.int32), num_experts)
    probs = torch.rand(4, prob_columns(v, num_experts, 2), generator=g) if v["probs"] else None
    scale = make_scale(v, 4, HIDDEN, g)
    tokens, routing, probs, scale = args = on_device(tokens, routing, probs, scale)
    kw = dict(group=group, num_experts=num_experts)
    expect = [
        (TypeError, "ProcessGroup", dict(kw, group="world")),
        (TypeError, "ProcessGroup", dict(kw, group=None)),
        (ValueError, "divisible", dict(kw, num_experts=2 * world + 1) if v["routing"] == "index" and world > 1
         else None),
        (ValueError, "recv_capacity", dict(kw, recv_capacity=0)),
        (TypeError, "recv_capacity", dict(kw, recv_capacity=2.0)),
        (ValueError, "num_experts", dict(kw, num_experts=0)),
    ]
    for exc, words, kwargs in expect:
        if kwargs is None:
            continue
        with pytest.raises(exc, match=words):
            mod.dispatch(*args, **kwargs)
    with pytest.raises(ValueError, match="shape"):
        mod.dispatch(tokens[:3], routing, probs, scale, **kw)
    if v["routing"] == "index":
        with pytest.raises(ValueError, match="needs num_experts"):
            mod.dispatch(*args, group=group)
        # An id out of range on rank 0 only: every rank raises (dropless mode checks by default;
        # capacity mode when asked), none waits on the others' rows.
        bad = routing.clone()
        if torch.distributed.get_rank(group) == 0:
            bad[0, 0] = num_experts
        for extra in (dict(), dict(recv_capacity=2, check_routing=True)):
            with pytest.raises(ValueError, match="expert ids must be in|routing of rank"):
                mod.dispatch(tokens, bad, probs, scale, **kw, **extra)
        with pytest.raises(TypeError, match="check_routing"):
            mod.dispatch(*args, **kw, check_routing=1)
    else:
        # More mask routes than the topk hint on rank 0 only: every rank raises in dropless mode,
        # whether its routes are counted by permute's routing kernel (topk) or before it (none).
        crowded = routing.clone()
        if torch.distributed.get_rank(group) == 0:
            crowded[0, :2] = True
        for extra in (dict(topk=1), dict(topk=1, recv_capacity=2, check_routing=True)):
            with pytest.raises(ValueError, match="more than topk=1|routing of rank"):
                mod.dispatch(tokens, crowded, probs, scale, **kw, **extra)
    res = mod.dispatch(*args, **kw)
    cdt = combine_dtype(v)
    with pytest.raises(TypeError, match="handle"):
        mod.combine(torch.zeros(res.tokens.shape, dtype=cdt, device=EP_DEVICE), object())
    with pytest.raises(ValueError, match="expert_out"):
        mod.combine(torch.zeros(res.tokens.shape[0] + 1, HIDDEN, dtype=cdt, device=EP_DEVICE), res.handle)
    with pytest.raises(TypeError, match="expert_out"):
        mod.combine(torch.zeros(res.tokens.shape, dtype=torch.float64, device=EP_DEVICE), res.handle)
    other = load("triton", next(n for n in variants_for("triton") if n != v["name"]))
    with pytest.raises(ValueError, match="handle comes from"):
        other.combine(torch.zeros(res.tokens.shape, dtype=combine_dtype(other.VARIANT), device=EP_DEVICE), res.handle)


# The variants the disagreement checks run on (two ranks): index routing with probs, mask routing.
DISAGREE = ("probs_bf16_index", "bf16_mask")


def check_disagreement(mod, world, me):
    """Ranks that disagree on what sizes a collective, or one rank refusing its input, raise a
    ValueError on every rank before any collective that could abort or wait: each case on a group
    of its own with a short timeout, so a rank left waiting fails the case instead of hanging."""
    v = mod.VARIANT
    group = torch.distributed.new_group(list(range(world)), timeout=timedelta(seconds=30))
    num_experts, k = 2 * world, 2
    g = torch.Generator().manual_seed(7)

    def inputs(hidden=HIDDEN, experts=num_experts, width=k, n=4):
        tokens = make_tokens(v, n, hidden, g)
        ids = expert_ids(n, experts, width, g)
        routing = routing_from_ids(v, ids, experts)
        probs = torch.rand(n, prob_columns(v, experts, width), generator=g) if v["probs"] else None
        return on_device(tokens, routing, probs, make_scale(v, n, hidden, g))

    def on_rank1(mine, other):
        return other if me == 1 else mine

    kw = dict(group=group, num_experts=num_experts)
    cases = [  # (words the message holds, rank 0's and rank 1's (args, kwargs))
        ("hidden size", (inputs(), kw), (inputs(hidden=2 * HIDDEN), kw)),
        ("recv_capacity", (inputs(), dict(kw, recv_capacity=3)), (inputs(), dict(kw, recv_capacity=2))),
        ("recv_capacity", (inputs(), kw), (inputs(), dict(kw, recv_capacity=2))),
        # (one rank's input refused: the others name it)
        ("refused the input of rank\\(s\\) \\[1\\]|shape", (inputs(), kw), (inputs()[:1] + inputs(n=3)[1:], kw)),
    ]
    if v["routing"] == "index":
        cases += [
            ("num_experts", (inputs(), kw), (inputs(experts=2 * num_experts), dict(kw, num_experts=2 * num_experts))),
            ("routes per token", (inputs(), kw), (inputs(width=1), kw)),
        ]
    else:
        cases += [
            ("num_experts", (inputs(), kw), (inputs(experts=2 * num_experts), dict(kw, num_experts=None))),
            ("topk", (inputs(), dict(kw, topk=2)), (inputs(), kw)),
        ]
    for words, zero, one in cases:
        args, kwargs = on_rank1(zero, one)
        with pytest.raises(ValueError, match=words) as caught:
            mod.dispatch(*args, **kwargs)
        if "refused" not in words:
            assert "rank 0" in str(caught.value) and "rank 1" in str(caught.value), str(caught.value)
    # Rank 1 on another variant taking the same inputs: both ranks name the two variants.
    sibling = load("triton", sibling_variant(v))
    with pytest.raises(ValueError, match="variant") as caught:
        (sibling if me == 1 else mod).dispatch(*inputs(), **kw)
    assert f"rank 0 {v['name']}, rank 1 {sibling.VARIANT['name']}" in str(caught.value), str(caught.value)
    # A bad combine input on rank 1 only: rank 0 raises too instead of waiting for rank 1's rows.
    res = mod.dispatch(*inputs(), **kw)
    cdt = combine_dtype(v)
    rows = res.tokens.shape[0] + (1 if me == 1 else 0)
    with pytest.raises(ValueError, match="refused the input of rank\\(s\\) \\[1\\]|expert_out"):
        mod.combine(torch.zeros(rows, HIDDEN, dtype=cdt, device=EP_DEVICE), res.handle)
    # Each rank combining the handle of another dispatch: every rank raises, whether the split sizes
    # differ (3 tokens against 4: rank 0 would return rows rank 1 does not expect) or not (the same
    # inputs twice), instead of exchanging rows the other rank reads at the wrong offsets.
    again = inputs()
    for first, second in ((res, mod.dispatch(*inputs(n=3), **kw)),
                          (mod.dispatch(*again, **kw), mod.dispatch(*again, **kw))):
        mine = first if me == 0 else second
        with pytest.raises(ValueError, match="handles of different dispatches") as caught:
            mod.combine(torch.zeros(mine.tokens.shape, dtype=cdt, device=EP_DEVICE), mine.handle)
        assert "rank 0" in str(caught.value) and "rank 1" in str(caught.value), str(caught.value)
    # The group still works: nothing was left half-sent.
    out = mod.combine(torch.zeros(res.tokens.shape, dtype=cdt, device=EP_DEVICE), res.handle)
    assert out.shape == (4, HIDDEN)


def check_twice(mod, group, world, me):
    """A second derivative through dispatch or combine (a gradient penalty: torch.autograd.grad with
    create_graph=True, then a backward pass through that gradient) raises "differentiating twice"
    instead of using a gradient computed without its graph (the penalty's term silently lost)."""
    v = mod.VARIANT
    num_experts = 2 * world
    g = torch.Generator().manual_seed(stable_seed("twice", world, v["name"], me))
    tokens = make_tokens(v, 4, HIDDEN, g)
    routing = routing_from_ids(v, expert_ids(4, num_experts, 2, g), num_experts)
    probs = torch.rand(4, prob_columns(v, num_experts, 2), generator=g) if v["probs"] else None
    tokens, routing, probs = on_device(tokens, routing, probs)
    tokens.requires_grad_()
    weight = torch.randn(HIDDEN, generator=g).to(EP_DEVICE).requires_grad_()
    res = mod.dispatch(tokens, routing, probs, group=group, num_experts=num_experts)
    grad, = torch.autograd.grad((res.tokens.float() * weight).sum(), tokens, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiating twice"):
        torch.autograd.grad(grad.float().sum(), weight)
    expert_out = random_rows(res.tokens.shape, combine_dtype(v), stable_seed("twice", me)).to(EP_DEVICE)
    expert_out.requires_grad_()
    out = mod.combine(expert_out, res.handle)
    grad, = torch.autograd.grad((out.float() * weight).sum(), expert_out, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiating twice"):
        torch.autograd.grad(grad.float().sum(), weight)


def sibling_variant(v):
    """Another Triton variant taking the same inputs as v (dtype, routing, probs and scales)."""
    return next(n for n, w in permgen.VARIANTS.items() if n != v["name"] and "triton" in w["targets"]
                and all(w[axis] == v[axis] for axis in ("dtype", "routing", "probs", "scale")))


def check_group_freed(mod, world, me):
    """destroy_process_group frees a group that dispatched and combined, its results still alive:
    permgen keeps no strong reference to a group (a gloo group kept alive past it was torn down at
    interpreter exit instead, which aborted the process now and then); combine and the backward
    pass of the results then say their group is gone."""
    v = mod.VARIANT
    group = torch.distributed.new_group(list(range(world)))
    g = torch.Generator().manual_seed(stable_seed("group_freed", world, me))
    num_experts = 2 * world
    tokens = make_tokens(v, 5, HIDDEN, g)
    routing = routing_from_ids(v, expert_ids(5, num_experts, 2, g), num_experts)
    probs = torch.rand(5, prob_columns(v, num_experts, 2), generator=g) if v["probs"] else None
    tokens, routing, probs = on_device(tokens, routing, probs)
    tokens.requires_grad_()
    res = mod.dispatch(tokens, routing, probs, group=group, num_experts=num_experts)
    expert_out = torch.zeros(res.tokens.shape, dtype=combine_dtype(v), device=EP_DEVICE)
    mod.combine(expert_out, res.handle)
    freed = weakref.ref(group)
    torch.distributed.destroy_process_group(group)
    del group
    gc.collect()
    assert freed() is None, f"the group outlived destroy_process_group, held by {gc.get_referrers(freed())}"
    with pytest.raises(ValueError, match="destroyed"):
        mod.combine(expert_out, res.handle)
    with pytest.raises(ValueError, match="destroyed"):  # not an exchange over the default group
        torch.autograd.grad(res.tokens.float().sum(), tokens)


def check_no_host_sync(mod, group, world, me):
    """GPU: capacity mode makes no host synchronisation (forward and backward); dispatch -> experts
    -> combine -> backward captured in one CUDA graph and replayed on new inputs gives the eager
    results bit for bit; dropless dispatch reads back exactly once, its combine and both backward
    passes never."""
    v = mod.VARIANT
    case = CASES[world][-1]
    num_experts = case.experts_per_rank * world
    inputs = [on_device(*r) for r in global_inputs(v, case, world, stable_seed("no_host_sync", world, v["name"]))]
    fresh = [on_device(*r) for r in global_inputs(v, case, world, stable_seed("no_host_sync2", world, v["name"]))]
    kw = dict(group=group, num_experts=num_experts)
    cdt = combine_dtype(v)
    differentiable = not is_fp8(v) and v["quantize"] == "none"

    def leaves(tokens, routing, probs, scale):
        return (tokens.clone().requires_grad_(differentiable), routing.clone(),
                None if probs is None else probs.clone().requires_grad_(), None if scale is None else scale.clone())

    def step(tokens, routing, probs, scale, **mode):
        res = mod.dispatch(tokens, routing, probs, scale, **kw, **mode)
        out = mod.combine(res.tokens.to(cdt) * 2, res.handle, probs)
        wanted = [t for t in (tokens, probs) if t is not None and t.requires_grad]
        grads = torch.autograd.grad(out.float().sum(), wanted) if wanted else ()
        return (res.tokens, out, *grads)

    def no_syncs(fn, what):
        """fn() under set_sync_debug_mode("error"): a synchronising call raises where it is made."""
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError as e:
            raise AssertionError(f"{what} synchronised with the host:\n{traceback.format_exc()}") from e
        finally:
            torch.cuda.set_sync_debug_mode("default")

    capacity = dict(recv_capacity=case.capacity)
    args = leaves(*inputs[me])
    for _ in range(2):  # compile and warm up
        step(*args, **capacity)
        step(*args)
    no_syncs(lambda: step(*args, **capacity), "capacity mode")
    res = mod.dispatch(*args, **kw)
    torch.cuda.synchronize()
    assert host_reads(lambda: mod.dispatch(*args, **kw)) == 1, "dropless dispatch: not exactly one host read"

    def dropless_rest():
        out = mod.combine(res.tokens.to(cdt) * 2, res.handle, args[2])
        wanted = [t for t in (args[0], args[2]) if t is not None and t.requires_grad]
        if wanted:
            torch.autograd.grad([out.float().sum()] + ([res.tokens.float().sum()] if differentiable else []), wanted)

    no_syncs(dropless_rest, "dropless combine or a backward pass")
    # One CUDA graph of dispatch -> experts -> combine -> backward, replayed on new inputs.
    static = leaves(*inputs[me])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*static, **capacity)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static, **capacity)
    with torch.no_grad():
        for dst, src in zip(static, fresh[me]):
            if dst is not None:
                dst.copy_(src)
    graph.replay()
    eager = step(*leaves(*fresh[me]), **capacity)
    torch.cuda.synchronize()
    for name, got, want in zip(("dispatched tokens", "combined", "grad 0", "grad 1"), captured, eager):
        assert_bits_equal(got, want, f"graph replay: {name}")


# The variants compiled (each compile costs seconds): the plain one and a padded quantising one; on
# a GPU (Inductor) also mask routing and a padded index variant.
COMPILED = ("probs_bf16_index", "pad32_bf16_to_fp8e4m3_mx32_mask") + (
    ("bf16_mask", "probs_pad16_bf16_index") if torch.cuda.is_available() else ())


def check_compiled(mod, group, world, me):
    """Capacity mode under torch.compile(fullgraph=True) (custom ops): dispatch -> experts -> combine
    and both backward passes give the eager results bit for bit."""
    v = mod.VARIANT
    case = CASES[world][-1]
    num_experts = case.experts_per_rank * world
    tokens, routing, probs, scale = on_device(*global_inputs(v, case, world, stable_seed("compiled", world,
                                                                                        v["name"]))[me])
    cdt = combine_dtype(v)
    differentiable = not is_fp8(v) and v["quantize"] == "none"

    def layer(tokens, routing, probs, scale):
        res = mod.dispatch(tokens, routing, probs, scale, group=group, num_experts=num_experts,
                           recv_capacity=case.capacity)
        return res.tokens, res.tokens_per_expert, res.dropped, mod.combine(res.tokens.to(cdt) * 2, res.handle, probs)

    def run(fn):
        t = tokens.clone().requires_grad_(differentiable)
        p = None if probs is None else probs.clone().requires_grad_()
        outs = fn(t, routing, p, scale)
        wanted = [x for x in (t, p) if x is not None and x.requires_grad]
        grads = torch.autograd.grad(outs[-1].float().sum(), wanted) if wanted else ()
        return [o.detach() for o in outs] + list(grads)

    torch._dynamo.reset()
    backend = "inductor" if EP_DEVICE.type == "cuda" else "aot_eager"
    compiled = run(torch.compile(layer, fullgraph=True, backend=backend))
    for i, (got, want) in enumerate(zip(compiled, run(layer))):
        assert_bits_equal(got, want, f"compiled output {i}")


def nki_comparison_run(mod, group, world, me):
    """The Triton dispatch of the inputs test_triton_dispatch_matches_nki_permute_a2av rebuilds."""
    ids, tokens, num_experts = nki_inputs(world)[me]
    probs = torch.rand(ids.shape, generator=torch.Generator().manual_seed(me)) if mod.VARIANT["probs"] else None
    tokens, ids, probs = on_device(tokens, ids, probs)
    return mod.dispatch(tokens, ids, probs, group=group, num_experts=num_experts).tokens.cpu()


def nki_inputs(world):
    """Per rank (expert ids [N, k], bf16 tokens [N, H], E) with uneven counts, one rank without tokens."""
    g = torch.Generator().manual_seed(stable_seed("test_ep_nki", world))
    num_experts = 3 * world
    out = []
    for r in range(world):
        n = 0 if r == 1 else 4 + 3 * r
        out.append((expert_ids(n, num_experts, 2, g), (torch.randn(n, HIDDEN, generator=g) * 4).to(torch.bfloat16),
                    num_experts))
    return out


# ---------------------------------------------------------------------------------------------
# The processes
# ---------------------------------------------------------------------------------------------

def run_and_check(mod, case, world, me, group):
    """One case on this rank: every collective first (all ranks take part even after an error),
    then the checks; returns None or the error."""
    try:
        run = run_case(mod, case, world, me, group)
        error = None
    except Exception:  # noqa: BLE001 -- reported per case by the parent
        run, error = None, traceback.format_exc()
    # Every rank's random data, for the global reference.
    mine = None
    if run is not None:
        grads_out = list(run["dispatch_grad_out"])
        mine = dict(dispatch_grad_tokens=grads_out.pop(0) if run["differentiable"] else None,
                    dispatch_grad_probs=grads_out.pop(0) if grads_out else None,
                    expert_out=run["expert_out"], merging=run["merging"], combine_grad_out=run["combine_grad_out"])
    everyone = all_gather_objects(group, mine, world)
    if error is None and any(x is None for x in everyone):
        error = "another rank failed this case"
    if error is None:
        gathered = {key: (None if everyone[0][key] is None else [x[key] for x in everyone]) for key in everyone[0]}
        try:
            check_case(mod, case, world, me, run, gathered)
        except Exception:  # noqa: BLE001
            error = traceback.format_exc()
    return error


def record(results, key, check, *args):
    """Run check(*args) on this rank; results[key]: None, or its error for the parent to report."""
    try:
        check(*args)
        results[key] = None
    except Exception:  # noqa: BLE001
        results[key] = traceback.format_exc()


def worker(me, world, outdir):
    global EP_DEVICE
    gpus = torch.cuda.device_count()
    if gpus >= world:
        EP_DEVICE = torch.device("cuda", me)
        torch.cuda.set_device(EP_DEVICE)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    torch.distributed.init_process_group("nccl" if gpus >= world else "gloo", init_method=f"file://{outdir}/store",
                                         rank=me, world_size=world, device_id=EP_DEVICE if gpus >= world else None,
                                         timeout=timedelta(seconds=int(os.environ.get("PERMGEN_EP_TIMEOUT", "120"))))
    group = torch.distributed.group.WORLD
    results = {}
    try:
        only = os.environ.get("PERMGEN_EP_ONLY")  # comma-separated variant names, to debug one
        for name in variants_for("triton"):
            if only and name not in only.split(","):
                continue
            mod = load("triton", name)
            for case in cases_for(world, name):
                if os.environ.get("PERMGEN_EP_CASE", case.name) != case.name:
                    continue
                results[f"{name}-{case.name}"] = run_and_check(mod, case, world, me, group)
            if EP_DEVICE.type == "cuda":
                record(results, f"{name}-no_host_sync", check_no_host_sync, mod, group, world, me)
            if world <= max(1, torch.cuda.device_count()) and name in COMPILED:
                record(results, f"{name}-compiled", check_compiled, mod, group, world, me)
            if world == 2 and name in DISAGREE:
                record(results, f"{name}-disagree", check_disagreement, mod, world, me)
                record(results, f"{name}-twice", check_twice, mod, group, world, me)
            record(results, f"{name}-bad_input", check_bad_input, mod, group, world)
            torch.distributed.barrier(group)
        mod = load("triton", plain_variant())
        torch.save(nki_comparison_run(mod, group, world, me), f"{outdir}/nki_{me}.pt")
        if world == 2:
            record(results, f"{mod.VARIANT['name']}-group_freed", check_group_freed, mod, world, me)
        if world == 4:
            # Two groups of two ranks each, interleaved ([0, 2] and [1, 3]): the experts are split
            # over each group's ranks in group order, and the groups run at once.
            subgroups = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]
            results[f"{mod.VARIANT['name']}-subgroups"] = run_and_check(mod, SUBGROUP_CASE, 2, me // 2,
                                                                       subgroups[me % 2])
    finally:
        results["_cpu_seconds"] = time.process_time()  # this rank's CPU time, reported by the parent
        with open(f"{outdir}/rank{me}.json", "w") as f:
            json.dump(results, f)
        torch.distributed.destroy_process_group()


_RESULTS = {}


def _run_ranks(world, outdir):
    import torch.multiprocessing as mp

    if torch.cuda.is_available():
        method = "spawn"  # a fork server would have touched CUDA before forking
    else:  # the ranks fork from one process that imported torch, Triton and the kernels once
        import multiprocessing

        method = "forkserver"
        multiprocessing.set_forkserver_preload(
            ["test_ep"] + [f"permgen.generated.triton.{name}" for name in variants_for("triton")])
    mp.start_processes(worker, args=(world, outdir), nprocs=world, join=True, start_method=method)


def results_for(world):
    """Start `world` processes once per test run and run every case; ({key: [error or None per
    rank]}, the NKI comparison's dispatched rows per rank). Under pytest-xdist the workers share
    one run through a directory named after the test run, the first to get its lock runs it."""
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks need {world} GPUs (NCCL runs one rank per GPU)")
    if world not in _RESULTS:
        run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        if run_id:
            import fcntl

            outdir = os.path.join(tempfile.gettempdir(), f"permgen_ep_{run_id}_{world}")
            os.makedirs(outdir, exist_ok=True)
            with open(os.path.join(outdir, "lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not os.path.exists(os.path.join(outdir, "done")):
                    _run_ranks(world, outdir)
                    open(os.path.join(outdir, "done"), "w").close()
        else:
            outdir = tempfile.mkdtemp(prefix=f"permgen_ep{world}_")
            _run_ranks(world, outdir)
        per_rank = []
        for r in range(world):
            with open(f"{outdir}/rank{r}.json") as f:
                per_rank.append(json.load(f))
        _RESULTS[world] = ({k: [p.get(k) for p in per_rank] for k in per_rank[0]},
                           [torch.load(f"{outdir}/nki_{r}.pt") for r in range(world)])
        if not run_id:
            shutil.rmtree(outdir, ignore_errors=True)
    return _RESULTS[world]


GPU_ONLY = ["no_host_sync"] if torch.cuda.is_available() else []


def compiled_case(world, name):
    return ["compiled"] if world <= max(1, torch.cuda.device_count()) and name in COMPILED else []


PARAMS = [pytest.param(world, f"{name}-{case}", id=f"{world}-{name}-{case}") for world in WORLD_SIZES
          for name in variants_for("triton")
          for case in [c.name for c in cases_for(world, name)] + ["bad_input"] + GPU_ONLY + compiled_case(world, name)
          + (["disagree", "twice"] if world == 2 and name in DISAGREE else [])]
PARAMS.append(pytest.param(4, f"{plain_variant()}-subgroups", id=f"4-{plain_variant()}-subgroups"))
PARAMS.append(pytest.param(2, f"{plain_variant()}-group_freed", id=f"2-{plain_variant()}-group_freed"))


@pytest.mark.parametrize("world,key", PARAMS)
def test_dispatch_combine(world, key):
    errors, _ = results_for(world)
    assert key in errors, f"{key} did not run"
    failed = [f"rank {r}:\n{e}" for r, e in enumerate(errors[key]) if e]
    assert not failed, "\n".join(failed)


# ---------------------------------------------------------------------------------------------
# The same function as the NKI dispatch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1])  # NKI collectives need two ranks
def test_triton_dispatch_matches_nki_permute_a2av(world):
    """README, "Expert parallelism: the NKI dispatch": permute_a2av receives each source's routes in
    the order the source packs them; with the packing permute gives (expert-major, then token and
    slot), rank d's receive buffer is source-major [source s: its routes to d's experts, expert by
    expert]. The Triton dispatch returns the same rows expert-major: the chunk sort of the receive
    buffer's (source, local expert) chunks into (local expert, source) order."""
    from permgen.nki.emulator import run_ranks
    from permgen.nki.emulator.collectives import ReplicaGroup
    from permgen.nki.host import from_kernel, to_kernel

    _, triton_out = results_for(world)
    inputs = nki_inputs(world)
    num_experts = inputs[0][2]
    local = num_experts // world
    nki_mod = load("nki", variants_for("nki")[0])
    args, counts = [], []
    for ids, tokens, _ in inputs:
        k = ids.shape[1]
        rows = tokens.repeat_interleave(k, dim=0)  # routed rows: token t's slot j is row t * k + j
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)  # expert-major, then (token, slot): permute's order
        send = torch.bincount(flat // local, minlength=world).to(torch.int32)[None]
        counts.append(torch.bincount(flat, minlength=num_experts).view(world, local))
        args.append([to_kernel(rows), order.to(torch.int32).numpy(), send.numpy()])
    capacity = max(1, sum(len(a[1]) for a in args))
    group = ReplicaGroup([list(range(world))])
    received = run_ranks(nki_mod.permute_a2av, [a + [capacity, group] for a in args])
    for d in range(world):
        recv = from_kernel(received[d][0])
        chunks = torch.stack([c[d] for c in counts])  # [source, local expert] rows
        pieces = torch.split(recv[:int(chunks.sum())], chunks.flatten().tolist())
        regrouped = torch.cat([pieces[s * local + e] for e in range(local) for s in range(world)] or [recv[:0]])
        assert_bits_equal(triton_out[d], regrouped, f"rank {d}: Triton dispatch vs permute_a2av")
        assert not recv[int(chunks.sum()):].view(torch.int16).any()


# ---------------------------------------------------------------------------------------------
# Exit after a CUDA-graph capture (GPU)
# ---------------------------------------------------------------------------------------------

# One rank over NCCL (env://): capacity-mode dispatch and combine captured in a CUDA graph, replayed
# on new inputs and checked against eager, then the documented teardown (the graph reset or deleted,
# its outputs kept) and destroy_process_group. Prints each stage's time since start.
GRAPH_TEARDOWN = """
import gc, sys, time
start = time.perf_counter()
def stage(what):
    print(what, f"{time.perf_counter() - start:.2f}", flush=True)
import torch
import torch.distributed as dist
import permgen
mod = permgen.get_kernel("triton", dtype="bf16", routing="index", probs=True)
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
stage("init")
group = dist.group.WORLD
N, H, E, k, C = 64, 256, 8, 2, 100

def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(N, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(torch.int32)
    return [t.to(device) for t in (tokens, ids, torch.rand(N, k, generator=g))]

def step(tokens, ids, probs):
    res = mod.dispatch(tokens, ids, probs, group=group, num_experts=E, recv_capacity=C)
    return res.tokens, mod.combine(res.tokens * 2, res.handle, probs)

static = inputs(0)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    step(*static)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    captured = step(*static)
stage("captured")
fresh = inputs(1)
for dst, src in zip(static, fresh):
    dst.copy_(src)
graph.replay()
eager = step(*fresh)
torch.cuda.synchronize()
for got, want in zip(captured, eager):
    assert torch.equal(got, want), "graph replay differs from eager"
stage("replayed")
if sys.argv[1] == "reset":
    graph.reset()
else:
    del graph
gc.collect()
torch.cuda.synchronize()
stage("destroying")
dist.destroy_process_group()
stage("destroyed")
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a GPU")
@pytest.mark.parametrize("teardown", ["reset", "del"])
def test_exit_after_graph_capture(teardown):
    """destroy_process_group returns after dispatch and combine were captured in a CUDA graph and
    replayed, once the graph is reset or deleted (NCCL waits for graphs holding its collectives:
    a graph alive at destroy_process_group blocks it, with or without permgen; see
    tests/gpu_graph_teardown_repro.py)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env.pop("TRITON_INTERPRET", None)
    try:
        proc = subprocess.run([sys.executable, "-c", GRAPH_TEARDOWN, teardown], cwd=root, env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"the process did not exit within 120 s; stages reached (seconds since start):\n{out}")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    assert proc.stdout.split()[-2] == "destroyed", proc.stdout
