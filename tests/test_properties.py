"""Property tests: every variant on both targets against tests/reference.py on drawn problems.

Hypothesis draws the sizes (N from 0, H from 1, E from 1, k <= E), which experts get no route,
how many route slots are dropped (-1), tokens without any route, and a row cap below or above
what the routes need (or none). For each problem: permute's moved data bit for bit and its row
map's destinations, unpermute's sums within tolerance, and both backward passes. Mask variants
also run with the optional topk hint, which must change nothing but the row map's width.

The Triton target runs under the interpreter on CPUs; the NKI target runs in the NumPy emulator,
which is slower, so its problems are smaller and fewer. The profile (conftest.py) derandomizes:
a failure replays, and the drawn problem is printed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import permgen
from cases import (
    HAS_CUDA,
    NATIVE_EXAMPLES,
    nki_generation_of_the_variant,  # noqa: F401 (an autouse fixture: quantising variants on Trn3)
    bits,
    check_roundtrip,
    device_of,
    load,
    make_scale,
    make_tokens,
    needed_rows,
    routing_from_ids,
    to_device,
    variants_for,
)



@dataclass(frozen=True)
class Problem:
    N: int
    H: int
    E: int
    k: int
    dead_experts: tuple  # experts no token is routed to
    drop: float  # chance that a route slot is dropped (-1)
    routeless: int  # tokens with no route at all
    cap: str  # "none", "below" or "above" the rows the routes need
    cap_fraction: float
    merge: bool  # unpermute with merging probs (variants with probs)
    seed: int


@st.composite
def problems(draw, max_tokens=40, max_hidden=160, max_experts=12, max_k=6):
    n = draw(st.integers(0, max_tokens))
    e = draw(st.integers(1, max_experts))
    return Problem(
        N=n,
        H=draw(st.integers(1, max_hidden)),
        E=e,
        k=draw(st.integers(1, min(e, max_k))),
        dead_experts=tuple(sorted(draw(st.sets(st.integers(0, e - 1), max_size=e)))),
        drop=draw(st.sampled_from([0.0, 0.25, 0.6])),
        routeless=draw(st.integers(0, n)),
        cap=draw(st.sampled_from(["none", "below", "above"])),
        cap_fraction=draw(st.floats(0.0, 0.99)),
        merge=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def build(variant: dict, p: Problem, device):
    """tokens, routing, probs, scale, num_out_tokens of problem `p` for `variant` on `device`."""
    g = torch.Generator().manual_seed(p.seed)
    tokens = make_tokens(variant, p.N, p.H, g)
    # k distinct live experts per token by random score; dead experts score below every live one.
    scores = torch.rand(p.N, p.E, generator=g)
    scores[:, list(p.dead_experts)] = -1.0
    top, ids = scores.sort(dim=1, descending=True)
    ids = torch.where(top[:, :p.k] >= 0, ids[:, :p.k], -1).to(torch.int32)
    ids[torch.rand(p.N, p.k, generator=g) < p.drop] = -1
    ids[torch.randperm(p.N, generator=g)[:p.routeless]] = -1
    routing = routing_from_ids(variant, ids, p.E)
    probs = torch.rand(routing.shape, generator=g) if variant["probs"] else None
    scale = make_scale(variant, p.N, p.H, g)
    needed = needed_rows(variant, routing, p.E)
    cap = {"none": None, "below": int(needed * p.cap_fraction), "above": needed + 1 + int(16 * p.cap_fraction)}[p.cap]
    return (*to_device(device, tokens, routing, probs, scale), cap)


def check_problem(target: str, name: str, p: Problem):
    mod = load(target, name)
    v = mod.VARIANT
    tokens, routing, probs, scale, cap = build(v, p, device_of(target))
    sizes = dict(num_experts=p.E, num_out_tokens=cap)

    def check_all(topk):
        g = torch.Generator().manual_seed(p.seed ^ 0x5EED)  # the same expert outputs and grads for every topk
        return check_roundtrip(mod, target, tokens, routing, probs, scale, **sizes, generator=g, topk=topk,
                               merge=p.merge)

    res, results = check_all(topk=None)
    if v["routing"] == "mask":
        # The hint (k >= the most routes of any token) narrows the row map; every result stays the same.
        hinted, hinted_results = check_all(topk=p.k)
        assert res.row_id_map.width == p.E and hinted.row_id_map.width == p.k
        assert torch.equal(hinted.row_id_map.rows_by_column(), res.row_id_map.rows_by_column())
        outputs = (res.tokens, res.probs, res.scale, res.tokens_per_expert, *results)
        hinted_outputs = (hinted.tokens, hinted.probs, hinted.scale, hinted.tokens_per_expert, *hinted_results)
        for got, want in zip(hinted_outputs, outputs, strict=True):
            assert (got is None and want is None) or torch.equal(bits(got), bits(want)), \
                "a result changed with the topk hint"


def bounds(name: str, target: str) -> dict:
    """Problem sizes per variant. The NKI emulator runs every instruction in Python: smaller
    problems there. Padded segments cost E * pad rows however few tokens route there, so heavily
    padded variants draw fewer experts: at most 512 rows of padding natively, 256 under the
    interpreter, which runs a program per row (two experts at pad 128: still a padded boundary)."""
    pad = permgen.VARIANTS[name]["pad"]
    if target == "nki":
        return dict(max_tokens=24, max_hidden=96, max_experts=8, max_k=4)
    padding_rows = 512 if HAS_CUDA else 256
    return dict(max_tokens=40, max_hidden=160, max_experts=min(12, padding_rows // pad) if pad else 12, max_k=6)


@pytest.mark.parametrize("name", variants_for("triton"))
@settings(max_examples=NATIVE_EXAMPLES)
@given(data=st.data())
def test_triton_matches_reference(name, data, poisoned_empty):
    check_problem("triton", name, data.draw(problems(**bounds(name, "triton")), label="problem"))


@pytest.mark.parametrize("name", variants_for("nki"))
@given(data=st.data())  # the profile's examples: the emulator runs every kernel, on every machine
def test_nki_matches_reference(name, data, poisoned_empty):
    check_problem("nki", name, data.draw(problems(**bounds(name, "nki")), label="problem"))
