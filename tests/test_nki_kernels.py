"""Every generated NKI variant against the plain-PyTorch reference (tests/reference.py).

Each kernel runs in the NumPy emulator (strict: poisoned fresh memory, hardware tile limits,
indirect DMA bounds) and, where the real `nki` package imports, under nki.simulate as well.
Moved data must match bit for bit; only sums get tolerances.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
import torch

import generated
from nki_emulator.testing import BACKENDS, NO_REAL_NKI, REAL_NKI, bits, load_variant, to_numpy, to_torch
from tests.reference import permute_grads_ref, permute_ref, plan_routes, unpermute_grads_ref, unpermute_ref

NKI_VARIANTS = sorted(name for name, spec in generated.VARIANTS.items() if "nki" in spec["targets"])
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SUM_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@dataclasses.dataclass(frozen=True)
class Case:
    num_tokens: int
    hidden: int
    num_experts: int
    top_k: int
    drop: bool = False  # cap num_out_tokens below the rows the routes need

    def __str__(self):
        return f"N{self.num_tokens}-H{self.hidden}-E{self.num_experts}-k{self.top_k}{'-drop' if self.drop else ''}"


CASES = [
    Case(0, 64, 4, 2),
    Case(1, 200, 7, 5),
    Case(130, 300, 7, 5),
    Case(257, 200, 7, 3, drop=True),
]


def backend_param(backend):
    marks = [] if backend == "emulator" or REAL_NKI else [pytest.mark.skip(reason=NO_REAL_NKI)]
    return pytest.param(backend, marks=marks, id=backend)


parametrize_backend = pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
parametrize_variant = pytest.mark.parametrize("name", NKI_VARIANTS)
parametrize_case = pytest.mark.parametrize("case", CASES, ids=str)


@dataclasses.dataclass
class Inputs:
    spec: dict
    tokens: torch.Tensor
    routing: torch.Tensor
    probs: torch.Tensor | None
    scale: torch.Tensor | None
    num_out_tokens: int | None


def make_inputs(spec: dict, case: Case, seed: int) -> Inputs:
    """Fresh random inputs; index routing includes ids outside [0, E) and repeated experts."""
    gen = torch.Generator().manual_seed(seed)
    n, h, e = case.num_tokens, case.hidden, case.num_experts
    dtype = TORCH_DTYPES[spec["dtype"]]
    tokens = (torch.randn(n, h, generator=gen) * 4).to(dtype)
    if spec["routing"] == "index":
        routing = torch.randint(-1, e + 1, (n, case.top_k), generator=gen)
    else:
        routing = torch.rand(n, e, generator=gen) < 0.45
    probs = torch.rand(routing.shape, generator=gen) if spec["probs"] else None
    scale = None
    if spec["scale"] == "block128":
        scale = torch.rand(n, -(-h // 128), generator=gen) * 8
    elif spec["scale"] == "mx32":
        scale = torch.randint(0, 256, (n, -(-h // 32)), generator=gen, dtype=torch.uint8)
    num_out_tokens = None
    if case.drop:
        full = plan_routes(routing, spec["routing"], e, spec["pad"]).num_rows
        num_out_tokens = max(1, full * 2 // 3)
    return Inputs(spec, tokens, routing, probs, scale, num_out_tokens)


def combine_dtype(spec):
    return torch.bfloat16 if spec["dtype"].startswith("fp8") else TORCH_DTYPES[spec["dtype"]]


def assert_sum_close(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = SUM_TOLERANCE[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def run_permute(module, inp: Inputs, case: Case):
    return module.permute(
        to_numpy(inp.tokens), inp.routing.numpy(),
        to_numpy(inp.probs) if inp.probs is not None else None,
        to_numpy(inp.scale) if inp.scale is not None else None,
        num_experts=case.num_experts, num_out_tokens=inp.num_out_tokens)


@parametrize_backend
@parametrize_variant
@parametrize_case
def test_permute_and_unpermute(name, case, backend):
    module = load_variant(name, backend)
    spec = module.VARIANT
    inp = make_inputs(spec, case, seed=zlib.crc32(f"{name}/{case}".encode()))
    want_tokens, want_probs, want_scale, want_tpe, routes = permute_ref(
        inp.tokens, inp.routing, routing_kind=spec["routing"], num_experts=case.num_experts, probs=inp.probs,
        scale=inp.scale, pad=spec["pad"], num_out_tokens=inp.num_out_tokens)

    res = run_permute(module, inp, case)
    assert torch.equal(bits(to_torch(res.tokens)), bits(want_tokens))
    assert torch.equal(torch.from_numpy(res.tokens_per_expert), want_tpe)
    if spec["probs"]:
        assert torch.equal(to_torch(res.probs), want_probs)
    else:
        assert res.probs is None
    if spec["scale"] != "none":
        assert torch.equal(bits(to_torch(res.scale)), bits(want_scale))
    else:
        assert res.scale is None
    # row_id_map: each kept route's row, -1 elsewhere.
    want_map = torch.full(inp.routing.shape, -1, dtype=torch.int32)
    want_map[routes.token, routes.col] = routes.dst.int()
    assert torch.equal(torch.from_numpy(res.row_id_map), want_map)

    # unpermute combines expert outputs (bf16 for fp8 variants), not the permuted tokens.
    gen = torch.Generator().manual_seed(1)
    expert_out = torch.randn(routes.num_rows, case.hidden, generator=gen).to(combine_dtype(spec))
    merging = torch.rand(inp.routing.shape, generator=gen) if spec["probs"] else None
    got = module.unpermute(to_numpy(expert_out), res.row_id_map, to_numpy(merging) if merging is not None else None)
    assert_sum_close(to_torch(got), unpermute_ref(expert_out, routes, case.num_tokens, merging))


@parametrize_backend
@parametrize_variant
@parametrize_case
def test_backward(name, case, backend):
    module = load_variant(name, backend)
    spec = module.VARIANT
    inp = make_inputs(spec, case, seed=zlib.crc32(f"{name}/{case}/bwd".encode()))
    res = run_permute(module, inp, case)
    routes = plan_routes(inp.routing, spec["routing"], case.num_experts, spec["pad"], inp.num_out_tokens)
    gen = torch.Generator().manual_seed(2)
    n, m, h = case.num_tokens, routes.num_rows, case.hidden
    cdt = combine_dtype(spec)

    # permute backward
    grad_rows = torch.randn(m, h, generator=gen).to(cdt)
    if spec["probs"]:
        grad_row_probs = torch.randn(m, generator=gen)
        got_tokens, got_probs = module.permute_backward(to_numpy(grad_rows), res.row_id_map, to_numpy(grad_row_probs))
        want_tokens, want_probs = permute_grads_ref(grad_rows, routes, n, inp.routing.shape, grad_row_probs)
        assert torch.equal(to_torch(got_probs), want_probs)
    else:
        got_tokens = module.permute_backward(to_numpy(grad_rows), res.row_id_map)
        want_tokens, _ = permute_grads_ref(grad_rows, routes, n)
    assert_sum_close(to_torch(got_tokens), want_tokens)

    # unpermute backward
    grad_out = torch.randn(n, h, generator=gen).to(cdt)
    permuted = torch.randn(m, h, generator=gen).to(cdt)
    if spec["probs"]:
        merging = torch.rand(inp.routing.shape, generator=gen)
        got_rows, got_probs = module.unpermute_backward(to_numpy(grad_out), to_numpy(permuted), res.row_id_map, to_numpy(merging))
        want_rows, want_probs = unpermute_grads_ref(grad_out, permuted, routes, merging)
        torch.testing.assert_close(to_torch(got_probs), want_probs, rtol=1e-5, atol=1e-4)
    else:
        got_rows = module.unpermute_backward(to_numpy(grad_out), res.row_id_map, m)
        want_rows, _ = unpermute_grads_ref(grad_out, permuted, routes)
    # p * grad is one product rounded once: exact.
    assert torch.equal(bits(to_torch(got_rows)), bits(want_rows))


PROBS_VARIANTS = [n for n in NKI_VARIANTS if generated.VARIANTS[n]["probs"]]


@parametrize_backend
@pytest.mark.parametrize("name", PROBS_VARIANTS)
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=str)
def test_unpermute_without_merging_probs(name, case, backend):
    """Probs variants also unpermute with merging_probs=None: a plain fp32 sum of the routes' rows, whose
    backward scatters grad_out to the rows unweighted and has no prob gradient."""
    module = load_variant(name, backend)
    spec = module.VARIANT
    inp = make_inputs(spec, case, seed=zlib.crc32(f"{name}/{case}/nomerge".encode()))
    res = run_permute(module, inp, case)
    routes = plan_routes(inp.routing, spec["routing"], case.num_experts, spec["pad"], inp.num_out_tokens)
    gen = torch.Generator().manual_seed(3)
    n, m, h = case.num_tokens, routes.num_rows, case.hidden
    cdt = combine_dtype(spec)

    expert_out = torch.randn(m, h, generator=gen).to(cdt)
    got = module.unpermute(to_numpy(expert_out), res.row_id_map, None)
    assert_sum_close(to_torch(got), unpermute_ref(expert_out, routes, n))
    got_default = module.unpermute(to_numpy(expert_out), res.row_id_map, restore_shape=(n, h))
    assert np.array_equal(got_default.view(np.uint8), got.view(np.uint8))

    grad_out = torch.randn(n, h, generator=gen).to(cdt)
    got_rows, got_probs = module.unpermute_backward(to_numpy(grad_out), to_numpy(expert_out), res.row_id_map, None)
    assert got_probs is None
    want_rows, _ = unpermute_grads_ref(grad_out, expert_out, routes)
    assert torch.equal(bits(to_torch(got_rows)), bits(want_rows))
    # Every row no route lands on (pad rows, dropped capacity) is an exact zero.
    landed = torch.zeros(m, dtype=torch.bool)
    landed[routes.dst] = True
    assert torch.equal(bits(to_torch(got_rows))[~landed], torch.zeros_like(bits(want_rows)[~landed]))


def test_unpermute_without_merging_probs_empty():
    module = load_variant(PROBS_VARIANTS[0], "emulator")
    row_id_map = np.full((3, module.VARIANT["routing"] == "mask" and 4 or 2), -1, dtype=np.int32)
    permuted = np.zeros((0, 8), dtype=np.dtype(module.COMBINE_DTYPE) if module.COMBINE_DTYPE != "bfloat16" else to_numpy(torch.zeros(0, 8, dtype=torch.bfloat16)).dtype)
    grad_out = to_numpy(torch.ones(3, 8, dtype=torch.bfloat16)) if module.COMBINE_DTYPE == "bfloat16" else np.ones((3, 8), dtype=module.COMBINE_DTYPE)
    out = module.unpermute(permuted, row_id_map)
    assert out.shape == (3, 8) and not out.astype(np.float32).any()
    rows, probs = module.unpermute_backward(grad_out, permuted, row_id_map)
    assert rows.shape == (0, 8) and probs is None


@pytest.mark.parametrize("name", [NKI_VARIANTS[0], "probs_pad32_fp8e4m3_mx32_index"])
def test_hidden_split_across_tiles(name, monkeypatch):
    """H wider than one SBUF tile: the column loop and its partial last block."""
    module = load_variant(name, "emulator")
    monkeypatch.setattr(module, "H_TILE", 128)
    case = Case(140, 300, 7, 3)
    spec = module.VARIANT
    inp = make_inputs(spec, case, seed=7)
    want_tokens, *_ , routes = permute_ref(inp.tokens, inp.routing, routing_kind=spec["routing"], num_experts=7,
                                           probs=inp.probs, scale=inp.scale, pad=spec["pad"])
    res = run_permute(module, inp, case)
    assert torch.equal(bits(to_torch(res.tokens)), bits(want_tokens))
    expert_out = torch.randn(routes.num_rows, 300).to(combine_dtype(spec))
    merging = torch.rand(inp.routing.shape) if spec["probs"] else None
    got = module.unpermute(to_numpy(expert_out), res.row_id_map, to_numpy(merging) if merging is not None else None)
    assert_sum_close(to_torch(got), unpermute_ref(expert_out, routes, 140, merging))


def _variant_with(**axes):
    return next(n for n in NKI_VARIANTS if all(generated.VARIANTS[n][k] == v for k, v in axes.items()))


def test_bad_inputs_say_what_was_expected():
    module = load_variant(_variant_with(routing="index", probs=False, dtype="bf16"), "emulator")
    tokens = to_numpy(torch.randn(4, 8).to(torch.bfloat16))
    routing = np.zeros((4, 2), dtype=np.int64)
    with pytest.raises(TypeError, match="bfloat16"):
        module.permute(np.zeros((4, 8), dtype=np.float32), routing, num_experts=3)
    with pytest.raises(ValueError, match="num_experts"):
        module.permute(tokens, routing)
    with pytest.raises(ValueError, match="probs"):
        module.permute(tokens, routing, np.ones((4, 2), dtype=np.float32), num_experts=3)
    with pytest.raises(ValueError, match=r"shape \[4, \*\]"):
        module.permute(tokens, np.zeros((5, 2), dtype=np.int64), num_experts=3)
    with pytest.raises(TypeError, match="integer"):
        module.permute(tokens, routing.astype(np.float32), num_experts=3)

    module = load_variant(_variant_with(routing="mask", probs=True, dtype="bf16", pad=0), "emulator")
    mask = np.ones((4, 3), dtype=bool)
    with pytest.raises(ValueError, match=r"probs must have shape \[4, 3\]"):
        module.permute(tokens, mask, np.ones((4, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="pass probs"):
        module.permute(tokens, mask)
    with pytest.raises(ValueError, match="num_experts=5"):
        module.permute(tokens, mask, np.ones((4, 3), dtype=np.float32), num_experts=5)
    with pytest.raises(TypeError, match="NumPy array"):
        module.unpermute(torch.zeros(3, 8), np.zeros((4, 3), dtype=np.int32), np.ones((4, 3), dtype=np.float32))

    module = load_variant(_variant_with(scale="block128"), "emulator")
    fp8 = to_numpy(torch.randn(4, 200).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"scale must have shape \[4, 2\]"):
        module.permute(fp8, np.ones((4, 3), dtype=bool), np.ones((4, 3), dtype=np.float32), np.ones((4, 1), dtype=np.float32))
