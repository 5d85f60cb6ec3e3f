"""What every target's tests share: the cases, input construction, seeds, bit views and tolerances.

A seed comes from the test's node id through a stable hash (zlib.crc32), never from `hash()`, so a
failing test replays with the same inputs in any process. Inputs are built on the CPU from one
torch.Generator and then moved, so a case is the same on every device and target.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from permgen.core import axes, contract
from reference import permute_grads_ref, permute_ref, plan_routes, unpermute_grads_ref, unpermute_ref

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parent.parent

if os.environ.get("TRITON_INTERPRET") == "1":  # e.g. the expert-parallel ranks, which skip conftest.py
    import interpreter_patch

    interpreter_patch.install()

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")  # where the Triton target runs; NKI runs on CPU tensors
# Property tests' examples per test: few where every one runs interpreted or emulated kernels (the
# Triton interpreter on CPUs, the NKI emulator everywhere), more where the Triton kernels run
# natively (each new shape may still compile a kernel there: seconds of CPU time).
EMULATED_EXAMPLES = int(os.environ.get("PERMGEN_MAX_EXAMPLES", 3))
NATIVE_EXAMPLES = int(os.environ.get("PERMGEN_MAX_EXAMPLES", 20 if HAS_CUDA else EMULATED_EXAMPLES))
META = torch.device("meta")
LOOKUP_AXES = ("dtype", "routing", "probs", "scale", "quantize", "pad")


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    N: int
    H: int
    E: int
    k: int
    cap: str = "none"  # "none": no num_out_tokens; "drop": fewer rows than routes need; "spare": more rows
    ragged: bool = False  # routes per token vary (index: some -1 ids; mask: 0..k experts per token)

    def __str__(self):
        return self.name


CASES = [
    Case("basic", N=37, H=200, E=7, k=3),
    Case("empty", N=0, H=64, E=4, k=2),
    Case("one_token", N=1, H=130, E=5, k=2),
    Case("h123_e7_k5", N=23, H=123, E=7, k=5),  # nothing a power of two
    Case("pow2", N=16, H=256, E=8, k=2),
    Case("dropped", N=29, H=72, E=6, k=3, cap="drop"),
    Case("spare_rows", N=11, H=72, E=4, k=2, cap="spare"),
    Case("ragged", N=19, H=80, E=9, k=4, ragged=True),
    Case("k10", N=6, H=40, E=10, k=10),  # more routes per token than a route tile holds
    Case("no_columns", N=9, H=0, E=4, k=2),  # routing and prob grads, no row bytes
]


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------

def stable_seed(*parts) -> int:
    """A seed from strings or ints, the same in every process (unlike hash())."""
    return zlib.crc32("/".join(map(str, parts)).encode())


def seed_for(request, *salt) -> int:
    """The seed of a test: crc32 of its node id (plus an optional salt for a second stream)."""
    return stable_seed(request.node.nodeid, *salt)


def generator_for(request, *salt) -> torch.Generator:
    return torch.Generator().manual_seed(seed_for(request, *salt))


# ---------------------------------------------------------------------------------------------
# Variants and modules
# ---------------------------------------------------------------------------------------------

def variants_for(target: str) -> list[str]:
    import permgen

    return [name for name, spec in permgen.VARIANTS.items() if target in spec["targets"]]


def axes_of(name: str) -> dict:
    import permgen

    spec = permgen.VARIANTS[name]
    return {a: spec[a] for a in LOOKUP_AXES}


def load(target: str, name: str):
    """The generated module of variant `name` for `target`, found through the registry.

    NKI modules run on the NumPy emulator (installed as `nki` unless the real package imports)."""
    import permgen

    if target == "nki":
        from permgen.nki import emulator as nki_emulator

        nki_emulator.install()
    module = permgen.get_kernel(target, **axes_of(name))
    assert module.VARIANT["name"] == name
    return module


def device_of(target: str) -> torch.device:
    """Where a target's tensors live: the Triton target on DEVICE, the NKI target (emulated) on the CPU."""
    return DEVICE if target == "triton" else torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def token_dtype(variant: dict) -> torch.dtype:
    return contract.token_dtype(variant)


def combine_dtype(variant: dict) -> torch.dtype:
    return contract.combine_dtype(variant)


def is_fp8(variant: dict) -> bool:
    return variant["dtype"] in axes.FP8_DTYPES


def rows_are_fp8(variant: dict) -> bool:
    """permute returns fp8 rows (fp8 tokens, or quantised on permute): they carry no gradient."""
    return is_fp8(variant) or variant["quantize"] != "none"


def prob_columns(variant: dict, num_experts: int, k: int) -> int:
    return num_experts if variant["routing"] == "mask" else k


def expert_ids(num_tokens, num_experts, k, generator, ragged=False) -> torch.Tensor:
    """int32 [N, k]: k distinct experts per token in random order; -1 for slots without a route when ragged."""
    ids = torch.argsort(torch.rand(num_tokens, num_experts, generator=generator), dim=1)[:, :k].to(torch.int32)
    if ragged:
        ids[torch.rand(num_tokens, k, generator=generator) < 0.3] = -1
    return ids


def routing_from_ids(variant: dict, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The variant's routing for the routes in `ids` (-1 = none): the ids themselves, or the [N, E] bool mask."""
    if variant["routing"] == "index":
        return ids
    mask = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool)
    rows, cols = (ids >= 0).nonzero(as_tuple=True)
    mask[rows, ids[rows, cols].long()] = True
    return mask


def make_scale(variant: dict, num_tokens: int, hidden: int, generator):
    if variant["scale"] == "none":
        return None
    cols = contract.scale_columns(variant, hidden)
    if variant["scale"] == "block128":
        return torch.rand(num_tokens, cols, generator=generator) + 0.5
    return torch.randint(0, 256, (num_tokens, cols), dtype=torch.uint8, generator=generator)


def make_tokens(variant: dict, num_tokens: int, hidden: int, generator) -> torch.Tensor:
    return (torch.randn(num_tokens, hidden, generator=generator) * 4).to(token_dtype(variant))


def make_inputs(variant: dict, case: Case, device, generator: torch.Generator):
    """tokens, routing, probs, scale for `variant` (a generated VARIANT dict) on `case`, on `device`."""
    g = generator
    tokens = make_tokens(variant, case.N, case.H, g)
    routing = routing_from_ids(variant, expert_ids(case.N, case.E, case.k, g, case.ragged), case.E)
    probs = torch.rand(case.N, prob_columns(variant, case.E, case.k), generator=g) if variant["probs"] else None
    scale = make_scale(variant, case.N, case.H, g)
    return to_device(device, tokens, routing, probs, scale)


def to_device(device, *tensors):
    return tuple(None if t is None else t.to(device) for t in tensors)


def resizable(t: torch.Tensor) -> bool:
    """Whether t's storage can still grow (Tensor.numpy() marks a storage as never resizable again)."""
    try:
        t.detach().resize_(t.numel() + 1)
    except RuntimeError:
        return False
    return True


def random_like(shape, dtype, device, generator) -> torch.Tensor:
    """Expert outputs or incoming grads: standard normal values in `dtype`."""
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def needed_rows(variant: dict, routing, num_experts: int) -> int:
    """Rows permute writes without a cap (padding included)."""
    return plan_routes(routing, variant["routing"], num_experts, variant["pad"]).num_rows


def num_out_tokens_for(case: Case, needed: int):
    if case.cap == "drop":
        return needed * 2 // 3
    if case.cap == "spare":
        return needed + 5
    return None


# ---------------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------------

# Values summed in fp32 and written in the combine dtype.
SUM_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3),
           torch.float32: dict(rtol=1e-5, atol=1e-5)}
PROB_GRAD_TOL = dict(rtol=1e-4, atol=1e-4)  # <row, grad> summed over H in fp32


def leaf(t):
    return t.detach().clone().requires_grad_()


# torch.compile's backend in the tests: aot_eager on the CPU, where the kernels are interpreted.
COMPILE_BACKEND = "inductor" if HAS_CUDA else "aot_eager"


def compiled_if(mode, fn, **options):
    """fn under torch.compile(fullgraph=True, **options) when mode is "compiled", else fn itself."""
    return torch.compile(fn, fullgraph=True, backend=COMPILE_BACKEND, **options) if mode == "compiled" else fn


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from a clean torch._dynamo (no graphs or recompile counts of the tests before).
    Autouse in every module that imports it."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_close(got, want, what, tol=None):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    torch.testing.assert_close(got.cpu(), want.cpu(), **(tol or SUM_TOL[want.dtype]), msg=lambda m: f"{what}: {m}")


# Token grads that add several outputs' grads (autograd sums them in that dtype, in an order
# that differs between the kernels and the reference): a few ulps of the largest grad.
TOKEN_GRAD_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=8e-2), torch.float16: dict(rtol=2e-3, atol=1e-2),
                  torch.float32: dict(rtol=1e-5, atol=1e-5)}


def check_grads(ours, ref, leaves_ours, leaves_ref, g):
    """Backward of every output (random grads) through ours and through the reference: input grads agree."""
    grads = [torch.randn(o.shape, generator=g).to(o.dtype).to(DEVICE) for o in ref]
    torch.autograd.backward(list(ours), grads)
    torch.autograd.backward(list(ref), grads)
    for i, (a, b) in enumerate(zip(leaves_ours, leaves_ref)):
        assert_close(a.grad, b.grad, f"grad {i}", TOKEN_GRAD_TOL[a.dtype] if i == 0 else PROB_GRAD_TOL)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: moved data compares exactly (NaN == NaN, -0 != 0, fp8-safe)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "tensor"):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(bits(got.cpu()), bits(want.cpu())), f"{what}: moved data differs"


def assert_sum_close(got: torch.Tensor, want: torch.Tensor, what: str = "sum"):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    torch.testing.assert_close(got.cpu(), want.cpu(), **SUM_TOL[want.dtype], msg=lambda m: f"{what}: {m}")


def rows_by_column_ref(routes, num_tokens: int, columns: int) -> torch.Tensor:
    """int64 [N, columns]: the reference row of each (token, routing column), -1 where none lands."""
    want = torch.full((num_tokens, columns), -1, dtype=torch.long)
    want[routes.token, routes.col] = routes.dst
    return want


# ---------------------------------------------------------------------------------------------
# Checks against the reference, for any target's module (tensors on that target's device)
# ---------------------------------------------------------------------------------------------

def permute_and_reference(mod, tokens, routing, probs, scale, *, num_experts, num_out_tokens=None, topk=None):
    """(permute's result, the reference's (tokens, probs, scale, tokens_per_expert, Routes))."""
    v = mod.VARIANT
    hint = {} if topk is None else {"topk": topk}
    res = mod.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=num_out_tokens, **hint)
    ref = permute_ref(tokens, routing, routing_kind=v["routing"], num_experts=num_experts, probs=probs, scale=scale,
                      pad=v["pad"], num_out_tokens=num_out_tokens, quantize=v["quantize"])
    return res, ref


def assert_permute_matches(mod, res, ref, routing):
    """Moved data bit for bit, segment sizes, and every route's destination row in the row map."""
    v = mod.VARIANT
    ref_tokens, ref_probs, ref_scale, ref_tpe, routes = ref
    assert_bits_equal(res.tokens, ref_tokens, "permuted tokens")
    assert res.tokens_per_expert.dtype == torch.int64
    assert torch.equal(res.tokens_per_expert.cpu(), ref_tpe.cpu()), (res.tokens_per_expert, ref_tpe)
    assert res.row_id_map.num_rows == routes.num_rows
    if v["probs"]:
        assert_bits_equal(res.probs, ref_probs, "permuted probs")
    else:
        assert res.probs is None
    if contract.scale_kind(v) != "none":
        assert_bits_equal(res.scale, ref_scale, "permuted scales")
    else:
        assert res.scale is None
    num_tokens, columns = routing.shape
    got_rows = res.row_id_map.rows_by_column().cpu()
    assert torch.equal(got_rows, rows_by_column_ref(routes, num_tokens, columns)), "row map destinations differ"


def check_permute(mod, tokens, routing, probs, scale, *, num_experts, num_out_tokens=None, topk=None):
    res, ref = permute_and_reference(mod, tokens, routing, probs, scale, num_experts=num_experts,
                                     num_out_tokens=num_out_tokens, topk=topk)
    assert_permute_matches(mod, res, ref, routing)
    return res, ref[-1]


def check_unpermute(mod, target, res, routes, probs_shape, generator, merge=True):
    """unpermute of random expert outputs against the reference, then both its input grads.

    Returns (out, grads) for comparisons between runs."""
    v = mod.VARIANT
    device = res.tokens.device
    num_tokens, hidden = res.row_id_map.num_tokens, res.tokens.shape[1]
    cdt = combine_dtype(v)
    permuted = random_like((res.row_id_map.num_rows, hidden), cdt, device, generator).requires_grad_()
    merging = None
    if v["probs"] and merge:
        merging = torch.rand(probs_shape, generator=generator).to(device).requires_grad_()
    out = mod.unpermute(permuted, res.row_id_map, merging)
    detached = None if merging is None else merging.detach()
    assert out.shape == (num_tokens, hidden)
    assert_sum_close(out, unpermute_ref(permuted.detach(), routes, num_tokens, detached), "unpermute")

    grad_out = random_like((num_tokens, hidden), cdt, device, generator)
    inputs = [permuted] + ([merging] if merging is not None else [])
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref_grad_permuted, ref_grad_probs = unpermute_grads_ref(grad_out, permuted.detach(), routes, detached)
    assert_bits_equal(grads[0], ref_grad_permuted, "unpermute grad rows")
    if merging is not None:
        assert grads[1].dtype == merging.dtype
        torch.testing.assert_close(grads[1].cpu(), ref_grad_probs.cpu(), **PROB_GRAD_TOL)
    return out, grads


def check_permute_backward(mod, tokens, routing, probs, scale, *, num_experts, num_out_tokens, generator,
                           topk=None):
    """permute's token grads (gather-summed) and prob grads (routed back, exact) against the reference.

    fp8 tokens are quantised data, never differentiable: without probs nothing permute returns
    may carry autograd history; with probs only the probs' path is checked.

    Returns (permute's result, grads) for comparisons between runs."""
    v = mod.VARIANT
    hint = {} if topk is None else {"topk": topk}
    differentiable_tokens = not rows_are_fp8(v)  # quantising variants: tests/test_quantize.py's straight-through test
    if not differentiable_tokens and probs is None:
        res = mod.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=num_out_tokens, **hint)
        for t in (res.tokens, res.scale, res.tokens_per_expert, res.row_id_map.row_map):
            assert t is None or (t.grad_fn is None and not t.requires_grad)
        assert res.probs is None
        return res, ()
    tokens = tokens.detach().requires_grad_(differentiable_tokens)
    probs = None if probs is None else probs.detach().requires_grad_()
    res = mod.permute(tokens, routing, probs, scale, num_experts=num_experts, num_out_tokens=num_out_tokens, **hint)
    for t in (res.scale, res.tokens_per_expert, res.row_id_map.row_map):  # never differentiable
        assert t is None or not t.requires_grad
    routes = plan_routes(routing, v["routing"], num_experts, v["pad"], num_out_tokens)
    device = tokens.device
    outputs, inputs, grads_out = [], [], []
    if differentiable_tokens:
        outputs.append(res.tokens)
        inputs.append(tokens)
        grads_out.append(random_like(res.tokens.shape, tokens.dtype, device, generator))
    if probs is not None:
        outputs.append(res.probs)
        inputs.append(probs)
        grads_out.append(torch.randn(res.probs.shape, generator=generator).to(device))
    grads = torch.autograd.grad(outputs, inputs, grads_out)
    grad_rows = grads_out[0] if differentiable_tokens else torch.zeros(routes.num_rows, tokens.shape[1], device=device)
    ref_tokens_grad, ref_probs_grad = permute_grads_ref(
        grad_rows, routes, tokens.shape[0], None if probs is None else probs.shape,
        grads_out[-1] if probs is not None else None)
    if differentiable_tokens:
        assert_sum_close(grads[0], ref_tokens_grad, "permute grad tokens")
    if probs is not None:
        assert_bits_equal(grads[-1], ref_probs_grad, "permute grad probs")  # routed back, not summed
    return res, grads


def check_roundtrip(mod, target, tokens, routing, probs, scale, *, num_experts, num_out_tokens, generator,
                    topk=None, merge=True):
    """permute (through autograd where anything is differentiable) against the reference, its
    backward pass, then unpermute of random expert outputs and its backward pass: each kernel
    runs once. Returns (permute's result, (unpermute's output, permute's grads..., unpermute's grads...))."""
    v = mod.VARIANT
    res, permute_grads = check_permute_backward(mod, tokens, routing, probs, scale, num_experts=num_experts,
                                                num_out_tokens=num_out_tokens, generator=generator, topk=topk)
    ref = permute_ref(tokens, routing, routing_kind=v["routing"], num_experts=num_experts, probs=probs, scale=scale,
                      pad=v["pad"], num_out_tokens=num_out_tokens, quantize=v["quantize"])
    assert_permute_matches(mod, res, ref, routing)
    out, unpermute_grads = check_unpermute(mod, target, res, ref[-1], routing.shape, generator, merge=merge)
    return res, (out, *permute_grads, *unpermute_grads)


def check_padded_with_probs(outputs, leaves, tokens, probs, mask, align, generator):
    """outputs: (out, permuted_probs, unpermuted) of TE's moe_permute_and_pad_with_probs(tokens, probs,
    mask, ..., align) and moe_unpermute(out * 2, ..., pad_offsets=...), called on leaves (copies of
    tokens and probs), against the reference: rows and probs bit for bit (pad rows are zeros), the
    merged sums within tolerance, then every gradient."""
    inp_r, p_r = leaf(tokens), leaf(probs)
    ref_out, ref_probs, _, _, routes = permute_ref(inp_r, mask, routing_kind="mask", num_experts=mask.shape[1],
                                                   probs=p_r, pad=align)
    ref_unpermuted = unpermute_ref(ref_out * 2, routes, tokens.shape[0], p_r)
    out, permuted_probs, unpermuted = outputs
    assert_bits_equal(out, ref_out, "output (pad rows are zeros)")
    assert_bits_equal(permuted_probs, ref_probs, "permuted_probs")
    assert_close(unpermuted, ref_unpermuted, "unpermuted")
    check_grads(outputs, (ref_out, ref_probs, ref_unpermuted), leaves, (inp_r, p_r), generator)


def poison(t):
    """Fill a fresh tensor with what no kernel writes: NaN (fp8 too), True, or the largest int."""
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        t.view(torch.uint8).fill_(0x7F)  # NaN in both fp8 formats
    elif t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)
    return t


def host_reads(fn) -> int:
    """How many synchronising CUDA calls fn() makes, counted by torch.cuda.set_sync_debug_mode("warn")
    (whose own one-time warning, that the mode is a prototype, is not one)."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing" in str(w.message) for w in caught)


@pytest.fixture(autouse=True)
def nki_generation_of_the_variant(request, monkeypatch):
    """NKI quantising variants refuse NeuronCore-v3 (no float8_e4m3fn compute on Trn2): they run on
    Trn3. Autouse in every module that imports it (test_properties, test_adversarial_properties)."""
    import permgen
    from test_nki_kernels import generation_for

    name = request.node.callspec.params.get("name") if hasattr(request.node, "callspec") else None
    with generation_for(permgen.VARIANTS.get(name, {"quantize": "none"}), monkeypatch):
        yield


# ---------------------------------------------------------------------------------------------
# Fresh processes
# ---------------------------------------------------------------------------------------------

def run_python(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """code run by a fresh python, with the repository and tests/ importable and, without a GPU, the
    Triton kernels interpreted as in the suite: for what a test worker must not run itself."""
    paths = [str(ROOT), str(ROOT / "tests")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    if not HAS_CUDA:
        env.setdefault("TRITON_INTERPRET", "1")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_fails_a_device_assertion(code: str, message: str, *args: str, after: str | None = None):
    """code (ending in a sync) fails a device-side assertion, in a fresh python (run_python): on CUDA
    the assertion leaves its process's CUDA context unusable, so a test worker that ran it would fail
    every later test. CUDA reports "device-side assert"; on the CPU torch._assert_async raises
    `message`. after: a line code prints before the asserting call, which must have come out."""
    done = run_python(code, *args)
    want = "device-side assert" if HAS_CUDA else message
    assert done.returncode != 0 and want in done.stderr, \
        f"exit status {done.returncode}, expected a failure with {want!r}:\n{done.stderr[-3000:]}"
    assert after is None or after in done.stdout.splitlines(), f"{after!r} not printed:\n{done.stderr[-3000:]}"
