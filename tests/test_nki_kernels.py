"""Every generated NKI variant against the plain-PyTorch reference, forward and backward.

The public functions (`mod.permute`, `mod.unpermute`, gradients through torch.autograd) take torch
CPU tensors; permgen.nki.host runs the `@nki.jit` kernels through nki.simulate -- the NumPy
emulator here (strict: poisoned fresh memory, hardware tile limits, indirect DMA bounds), or the
real simulator where `nki` imports. Moved data must match bit for bit; only sums get tolerances.
Kernel-level tests call the kernels directly with NumPy arrays. Shapes are small: the emulator
runs every instruction in Python.

Kernels launch at the LNC the environment declares (NEURON_LOGICAL_NC_CONFIG; unset: 2, the Trn2
default), so these tests run at LNC=2 (two cores sharing HBM) unless they pin LNC=1. Quantising
variants run on Trn3: NeuronCore-v3 has no float8_e4m3fn compute, and they refuse it.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from permgen.nki import emulator as nki_emulator
from cases import (
    CASES,
    Case,
    check_permute,
    check_permute_backward,
    check_unpermute,
    expert_ids,
    generator_for,
    load,
    make_inputs,
    make_tokens,
    needed_rows,
    num_out_tokens_for,
    rows_by_column_ref,
    routing_from_ids,
    variants_for,
)
from permgen.nki import host as nki_host
from permgen.nki import kernels as nki_kernels
from permgen.core.results import RowMapLayout
from reference import plan_routes

NKI_VARIANTS = variants_for("nki")
CPU = torch.device("cpu")


def _with(**axes):
    return next(n for n in NKI_VARIANTS if all(load("nki", n).VARIANT[k] == v for k, v in axes.items()))


@contextlib.contextmanager
def generation_for(variant, monkeypatch):
    """The Trainium generation a variant runs on here: Trn3 (NeuronCore-v4) for quantising variants, which
    refuse NeuronCore-v3; the default (Trn2) for the others. NEURON_PLATFORM_TARGET_OVERRIDE picks the real
    simulator's target, nki_emulator.on the emulator's."""
    if variant["quantize"] == "none":
        yield
        return
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    with nki_emulator.on(nki_emulator.Platform("trn3")):
        yield


def launched(kernel):
    """A kernel as permgen.nki.host launches it: at the environment's LNC."""
    return kernel[nki_host.logical_cores()]


def inputs_and_cap(mod, case, g):
    tokens, routing, probs, scale = make_inputs(mod.VARIANT, case, CPU, g)
    return (tokens, routing, probs, scale), num_out_tokens_for(case, needed_rows(mod.VARIANT, routing, case.E))


def probs_shape(mod, case):
    return (case.N, case.E if mod.VARIANT["routing"] == "mask" else case.k)


def hints(name):
    """Mask variants run without and with the topk hint (device loop vs unrolled slots); index routing has no hint."""
    return [None, "k"] if load("nki", name).VARIANT["routing"] == "mask" else [None]


PARAMS = [pytest.param(name, case, hint, id=f"{name}-{case}-topk{'=k' if hint else ':none'}")
          for name in NKI_VARIANTS for case in CASES for hint in hints(name)]


def check_every_op(mod, case, hint, g):
    inputs, cap = inputs_and_cap(mod, case, g)
    topk = case.k if hint else None
    res, routes = check_permute(mod, *inputs, num_experts=case.E, num_out_tokens=cap, topk=topk)
    assert res.row_id_map.width == (case.k if hint or mod.VARIANT["routing"] == "index" else case.E)
    check_unpermute(mod, "nki", res, routes, probs_shape(mod, case), g)
    if mod.VARIANT["probs"]:
        check_unpermute(mod, "nki", res, routes, probs_shape(mod, case), g, merge=False)
    check_permute_backward(mod, *inputs, num_experts=case.E, num_out_tokens=cap, generator=g, topk=topk)


@pytest.mark.parametrize("name,case,hint", PARAMS)
def test_permute_unpermute_and_grads(name, case, hint, request, monkeypatch):
    """permute (rows, probs, scales, segment sizes, the row map's routes), unpermute with and
    without merging probs, and the gradients of both, against tests/reference.py (at LNC=2)."""
    mod = load("nki", name)
    with generation_for(mod.VARIANT, monkeypatch):
        check_every_op(mod, case, hint, generator_for(request))


LNC1_PARAMS = [pytest.param(name, hint, id=f"{name}-topk{'=k' if hint else ':none'}")
               for name, hint in [(_with(routing="mask", pad=0, dtype="bf16", probs=True), None),
                                  (_with(routing="mask", pad=0, dtype="bf16", probs=True), "k"),
                                  (_with(routing="index", pad=16), None),
                                  (_with(routing="mask", quantize="mx32"), None),
                                  (_with(quantize="rowwise"), None)]]


@pytest.mark.parametrize("name,hint", LNC1_PARAMS)
def test_every_op_at_lnc1(name, hint, request, monkeypatch):
    """The same kernels launched at LNC=1 (one core per logical core), where NEURON_LOGICAL_NC_CONFIG=1."""
    monkeypatch.setenv(nki_host.LNC_VARIABLE, "1")
    mod = load("nki", name)
    with generation_for(mod.VARIANT, monkeypatch):
        check_every_op(mod, next(c for c in CASES if c.name == "ragged"), hint, generator_for(request))


@pytest.mark.skipif(nki_emulator.real_nki_available(),
                    reason="the emulator's model of SDK 2.32; the installed nki is the release it is")
def test_every_op_on_neuron_sdk_2_32(request, monkeypatch):
    """The kernels run on both releases they are written for: NKI 0.7 (SDK 2.33, every other test) and NKI 0.6
    (SDK 2.32), where nl.fori_loop first appears; the device loop (mask routing, no topk hint) at both LNCs."""
    mod = load("nki", _with(routing="mask", pad=0, dtype="bf16", probs=True))
    case = next(c for c in CASES if c.name == "ragged")
    for lnc in (2, 1):
        monkeypatch.setenv(nki_host.LNC_VARIABLE, str(lnc))
        with nki_emulator.on(nki_emulator.Platform(sdk="2.32", lnc=lnc)):
            check_every_op(mod, case, None, generator_for(request))


def test_kernels_launch_at_the_lnc_the_environment_declares(monkeypatch):
    """kernel[lnc] with lnc = NEURON_LOGICAL_NC_CONFIG (unset: 2, the Trn2 default); the emulator fails a
    launch whose LNC differs from the declared one, as nki.jit says the runtime does."""
    mod = load("nki", _with(routing="index", probs=False))
    tokens = torch.randn(20, 8).to(torch.bfloat16)
    routing = torch.randint(0, 3, (20, 2), dtype=torch.int32)
    launches = []
    real = nki_emulator.Kernel.__getitem__
    monkeypatch.setattr(nki_emulator.Kernel, "__getitem__", lambda k, lnc: launches.append(lnc) or real(k, lnc))
    for declared, want in ((None, 2), ("1", 1), ("2", 2)):
        if declared is None:
            monkeypatch.delenv(nki_host.LNC_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(nki_host.LNC_VARIABLE, declared)
        launches.clear()
        mod.permute(tokens, routing, num_experts=3, num_out_tokens=40)
        assert launches == [want]
    monkeypatch.setenv(nki_host.LNC_VARIABLE, "4")
    with pytest.raises(ValueError, match="LNC can only be 1 or 2"):
        mod.permute(tokens, routing, num_experts=3, num_out_tokens=40)
    monkeypatch.setenv(nki_host.LNC_VARIABLE, "1")
    kernel = getattr(mod, f"{mod.VARIANT['name']}_permute")
    with pytest.raises(nki_emulator.EmulatorError, match="must match"):
        nki_emulator.simulate(kernel[2])(nki_host.to_kernel(tokens), routing.numpy(), num_experts=3, width=2,
                                         num_out_tokens=40)


@pytest.mark.parametrize("name", [n for n in NKI_VARIANTS if load("nki", n).VARIANT["quantize"] != "none"])
def test_quantizing_variants_need_neuroncore_v4(name, monkeypatch):
    """float8_e4m3fn rows come from the compute engines of NeuronCore-v4 (Trn3) on; on NeuronCore-v3
    (Trn2), which has only float8_e4m3 (largest value 240), the kernel refuses with what it needs."""
    mod = load("nki", name)
    case = next(c for c in CASES if c.name == "ragged")
    inputs, cap = inputs_and_cap(mod, case, torch.Generator().manual_seed(3))
    with nki_emulator.on(nki_emulator.Platform("trn2")):
        with pytest.raises(ValueError, match="float8_e4m3fn needs NeuronCore-v4"):
            mod.permute(*inputs, num_experts=case.E, num_out_tokens=cap)
    with generation_for(mod.VARIANT, monkeypatch):
        assert mod.permute(*inputs, num_experts=case.E, num_out_tokens=cap).tokens.dtype == torch.float8_e4m3fn


@pytest.mark.skipif(nki_emulator.real_nki_available(), reason="the emulator's default platform; nki.simulate's "
                    "is the chip it finds")
@pytest.mark.parametrize("name", [n for n in NKI_VARIANTS if load("nki", n).VARIANT["quantize"] != "none"])
def test_quantizing_variants_on_the_default_platform_say_how_to_select_trn3(name):
    """On CPU the emulator's platform is Trn2 unless chosen: the refusal names both ways to choose Trn3."""
    mod = load("nki", name)
    case = next(c for c in CASES if c.name == "ragged")
    inputs, cap = inputs_and_cap(mod, case, torch.Generator().manual_seed(4))
    with pytest.raises(ValueError) as refused:
        mod.permute(*inputs, num_experts=case.E, num_out_tokens=cap)
    assert 'permgen.nki.emulator.on(permgen.nki.emulator.Platform("trn3"))' in str(refused.value)
    assert "NEURON_PLATFORM_TARGET_OVERRIDE=trn3" in str(refused.value)


@pytest.mark.parametrize("name", [_with(routing="mask", pad=0, dtype="bf16"), _with(routing="mask", scale="block128")])
def test_topk_hint_below_the_routes_drops_the_later_experts(name, request):
    """With a topk hint smaller than a token's routes (and no check), its experts past the first
    topk (ascending) have no row: the same as routing only those first topk experts."""
    mod = load("nki", name)
    g = generator_for(request)
    n, e, k, topk = 45, 6, 4, 2
    routing = routing_from_ids(mod.VARIANT, expert_ids(n, e, k, g), e)
    kept = routing & (routing.cumsum(1) <= topk)
    tokens = make_tokens(mod.VARIANT, n, 40, g)
    probs = torch.rand(n, e, generator=g)
    scale = None if mod.VARIANT["scale"] == "none" else torch.rand(n, 1, generator=g)
    res = mod.permute(tokens, routing, probs, scale, topk=topk, check_routing=False)
    want = mod.permute(tokens, kept, probs, scale)
    assert torch.equal(res.tokens.view(torch.uint8), want.tokens.view(torch.uint8))
    assert torch.equal(res.tokens_per_expert, want.tokens_per_expert)
    assert torch.equal(res.row_id_map.rows_by_column(), want.row_id_map.rows_by_column())
    assert torch.equal(res.row_id_map.route_counts, kept.sum(1).int())


@pytest.mark.parametrize("name", [_with(routing="mask", pad=0, dtype="bf16"), _with(routing="index", probs=True, pad=16)])
def test_hidden_split_across_tiles(name, monkeypatch, request):
    """H wider than one SBUF tile: every kernel's column-block loop and its partial last block."""
    mod = load("nki", name)
    monkeypatch.setattr(nki_kernels, "H_TILE", 128)  # the kernels' column blocks are nki_kernels' helpers
    case = Case("wide", N=140, H=300, E=7, k=3, cap="drop")
    g = generator_for(request)
    inputs, cap = inputs_and_cap(mod, case, g)
    res, routes = check_permute(mod, *inputs, num_experts=case.E, num_out_tokens=cap)
    check_unpermute(mod, "nki", res, routes, probs_shape(mod, case), g)
    check_permute_backward(mod, *inputs, num_experts=case.E, num_out_tokens=cap, generator=g)


# ---------------------------------------------------------------------------------------------
# Static sizes: nothing read back when num_out_tokens is given
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [_with(routing="mask", pad=128, dtype="bf16"), _with(routing="index", probs=False)])
def test_nothing_read_back_with_num_out_tokens(name, monkeypatch, request):
    """With num_out_tokens, permute runs its one kernel and the host never reads a device value:
    NkiBackend._read_back (the target's only device -> host read) must not be called, and
    check_routing defaults to off. Without it, exactly one read back: the row count."""
    mod = load("nki", name)
    case = Case("static", N=150, H=64, E=5, k=2)
    g = generator_for(request)
    inputs, _ = inputs_and_cap(mod, case, g)
    reads = []
    real = nki_host.NkiBackend._read_back
    monkeypatch.setattr(nki_host.NkiBackend, "_read_back", lambda self, counts: reads.append(counts) or real(self, counts))
    monkeypatch.setattr("permgen.core.ops.routing_error",
                        lambda *a: pytest.fail("check_routing ran with num_out_tokens"))
    cap = needed_rows(mod.VARIANT, inputs[1], case.E) + 3
    with nki_emulator.recording() as runs:
        res = mod.permute(*inputs, num_experts=case.E, num_out_tokens=cap)
    assert reads == []
    assert [r.kernel for r in runs] == [f"{name}_permute"]
    assert res.tokens.shape[0] == res.row_id_map.num_rows == cap

    monkeypatch.undo()
    monkeypatch.setattr(nki_host.NkiBackend, "_read_back", lambda self, counts: reads.append(counts) or real(self, counts))
    with nki_emulator.recording() as runs:
        res = mod.permute(*inputs, num_experts=case.E)
    assert len(reads) == 1 and [r.kernel for r in runs] == [f"{name}_expert_counts", f"{name}_permute"]
    assert res.tokens.shape[0] == needed_rows(mod.VARIANT, inputs[1], case.E)


# ---------------------------------------------------------------------------------------------
# Mask routing: indirect DMAs grow with the routes, not with E
# ---------------------------------------------------------------------------------------------

def _permute_cost(mod, num_experts, k, topk, seed):
    g = torch.Generator().manual_seed(seed)
    routing = routing_from_ids(mod.VARIANT, expert_ids(256, num_experts, k, g), num_experts)
    tokens = make_tokens(mod.VARIANT, 256, 16, g)
    probs = torch.rand(256, num_experts, generator=g)
    with nki_emulator.recording() as runs:
        res = mod.permute(tokens, routing, probs, num_out_tokens=256 * k, topk=topk)
    (cost,) = runs
    return cost, res


def test_mask_permute_indirect_dmas_follow_the_routes_not_the_experts(monkeypatch):
    """Counted at LNC=1 (one core's instructions)."""
    monkeypatch.setenv(nki_host.LNC_VARIABLE, "1")
    mod = load("nki", _with(routing="mask", pad=0, dtype="bf16"))
    for topk in (None, 2):
        small, _ = _permute_cost(mod, 8, 2, topk, seed=1)
        large, res = _permute_cost(mod, 64, 2, topk, seed=1)
        # Per token tile: 2 route slots x (token id + prob) scatters, and the row gathers.
        assert small.indirect_dmas == large.indirect_dmas == 2 * 2 * 2 + 4
        assert large.dynamic_iterations == (0 if topk else 2 * 2)
        assert res.row_id_map.width == (topk or 64)


# ---------------------------------------------------------------------------------------------
# Kernel level: the @nki.jit kernels through nki.simulate with NumPy arrays
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [_with(routing="mask", pad=128, dtype="bf16"), _with(routing="index", pad=16)])
def test_permute_kernel_writes_the_row_map_layout(name, request):
    """The kernel's flat int32 row map: dst rows [N, W] (mask: then compacted experts [N, W] and
    route counts [N]), segment offsets [E + 1], segment counts [E] -- read straight from NumPy."""
    import nki

    mod = load("nki", name)
    mask = mod.VARIANT["routing"] == "mask"
    g = generator_for(request)
    n, h, e, k = 140, 24, 5, 2
    ids = expert_ids(n, e, k, g, ragged=True)
    routing = routing_from_ids(mod.VARIANT, ids, e)
    tokens = make_tokens(mod.VARIANT, n, h, g)
    probs = torch.rand(routing.shape, generator=g)
    width = k if mask else routing.shape[1]
    routes = plan_routes(routing, mod.VARIANT["routing"], e, mod.VARIANT["pad"])
    kernel = getattr(mod, f"{name}_permute")
    out, out_probs, row_map, tokens_per_expert = nki.simulate(launched(kernel))(
        nki_host.to_kernel(tokens), routing.int().numpy(), probs.numpy(), num_experts=e, width=width,
        num_out_tokens=routes.num_rows)
    assert row_map.dtype == np.int32 and row_map.shape == ((2 * width + 1) * n + 2 * e + 1 if mask else width * n + 2 * e + 1,)
    dst = row_map[:n * width].reshape(n, width)
    words = n * width
    if mask:
        experts = row_map[words:2 * words].reshape(n, width)
        counts = row_map[2 * words:2 * words + n]
        assert np.array_equal(counts, routing.sum(1).numpy())
        for t in range(n):
            assert np.array_equal(experts[t, :counts[t]], np.flatnonzero(routing[t].numpy()))
        words = 2 * words + n
    want = rows_by_column_ref(routes, n, routing.shape[1]).numpy()
    if mask:
        got = np.full_like(want, -1)
        for t in range(n):
            got[t, experts[t, :counts[t]]] = dst[t, :counts[t]]
    else:
        got = dst
    assert np.array_equal(got, want)
    offsets, seg_counts = row_map[words:words + e + 1], row_map[words + e + 1:]
    assert np.array_equal(offsets, np.append(routes.segment_start.numpy(), routes.num_rows))
    assert np.array_equal(seg_counts, np.bincount(routes.expert.numpy(), minlength=e))
    assert np.array_equal(tokens_per_expert.reshape(-1), routes.tokens_per_expert.numpy())
    assert out.shape == (routes.num_rows, h) and out_probs.shape == (routes.num_rows,)


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "index"])
def test_kernel_offsets_are_the_row_map_layout(mask):
    """The offsets every NKI kernel takes (permgen.nki.kernels) are permgen.core.results.RowMapLayout's."""
    for n, w, e in ((1, 1, 1), (37, 3, 7), (140, 8, 64), (5, 16, 16)):
        layout = RowMapLayout(mask, n, w, e)
        assert nki_kernels.segments_at(n, w, mask) == layout.segment_offsets
        assert nki_kernels.row_map_words(n, w, e, mask) == layout.route_tallies  # the kernel writes up to the tallies
        if mask:
            assert (nki_kernels.experts_at(n, w), nki_kernels.route_counts_at(n, w)) == (layout.experts,
                                                                                         layout.route_counts)


def test_sum_routes_kernel_directly():
    """The gather-sum kernel on a hand-written index row map: -1 adds nothing, rows sum in fp32."""
    import nki

    mod = load("nki", _with(routing="index", probs=False))
    rows_in = np.arange(5 * 3, dtype=np.float32).reshape(5, 3).astype(nki_host.ml_dtypes.bfloat16)
    dst = np.array([[0, 4], [-1, 2], [3, -1]], dtype=np.int32)
    table = np.array([0, 1, 2, 3, 4, 5, 1, 1, 1, 1, 1], dtype=np.int32)  # 5 experts, one row each
    row_map = np.concatenate([dst.reshape(-1), table])
    out = nki.simulate(launched(getattr(mod, f"{mod.VARIANT['name']}_sum_routes")))(rows_in, row_map, num_tokens=3,
                                                                                   width=2, num_experts=5)
    want = np.stack([rows_in[0].astype(np.float32) + rows_in[4], rows_in[2], rows_in[3]])
    assert np.array_equal(out.astype(np.float32), want)


# ---------------------------------------------------------------------------------------------
# The target's own errors (the shared contract's are tested in test_bad_inputs.py)
# ---------------------------------------------------------------------------------------------

def test_nki_limits_and_device():
    mod = load("nki", _with(routing="index", probs=False))
    tokens = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 512 experts"):
        mod.permute(tokens, torch.zeros(4, 2, dtype=torch.int32), num_experts=513)
    with pytest.raises(ValueError, match="expert ids must be in"):
        mod.permute(tokens, torch.full((4, 2), 7, dtype=torch.int32), num_experts=3)
    with pytest.raises(ValueError, match="nki target runs kernels through nki.simulate on CPU"):
        mod.permute(tokens.to("meta"), torch.zeros(4, 2, dtype=torch.int32, device="meta"), num_experts=3)


def test_hidden_size_bound_keeps_the_accumulators_in_sbuf():
    """unpermute's accumulators for every column block stay in SBUF across the device loop: H up to MAX_HIDDEN
    runs (at E = 512, k = 32 in fp32, the most SBUF it takes), one column more is refused before any launch."""
    mod = load("nki", _with(routing="index", probs=True, dtype="fp32"))
    g = torch.Generator().manual_seed(4106)
    num_tokens, num_experts, k, hidden = 2, 512, 32, nki_host.MAX_HIDDEN
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(num_tokens)]).int()
    probs = torch.rand(num_tokens, k, generator=g, requires_grad=True)
    tokens = torch.randn(num_tokens, hidden, generator=g, requires_grad=True)
    result = mod.permute(tokens, ids, probs, num_experts=num_experts, num_out_tokens=num_tokens * k)
    merged = mod.unpermute(result.tokens, result.row_id_map, probs)
    torch.testing.assert_close(merged, tokens * probs.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
    merged.sum().backward()  # permute's and unpermute's backward kernels at the same size
    torch.testing.assert_close(tokens.grad, probs.detach().sum(1, keepdim=True).expand(-1, hidden), rtol=1e-5, atol=1e-5)
    wider = torch.randn(num_tokens * k, hidden + 1, generator=g)
    with pytest.raises(ValueError, match=f"at most {nki_host.MAX_HIDDEN} columns"):
        mod.unpermute(wider, result.row_id_map, probs)
