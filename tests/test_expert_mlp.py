"""The expert MLP (`module.expert_mlp`, every Triton variant whose spec entry says expert_mlp =
true), in both ways (default; save_memory=True, whose first GEMM gathers the tokens through the
row map) against the plain-PyTorch layer: the reference
permute, each expert's SwiGLU MLP as fp32 matmuls rounded to bf16 (what a grouped GEMM stores),
the reference unpermute; forward and every gradient, through autograd.

Sums are compared with tolerances; the result must be deterministic (bit-identical reruns).
"""

import pytest
import torch
import torch.nn.functional as F

import permgen
from cases import DEVICE, HAS_CUDA, Case, assert_sum_close, expert_ids, generator_for, load, num_out_tokens_for, routing_from_ids, to_device
from reference import (fp8_expert_mlp_ref, fp8_mlp_rows_ref, fp8_segments, permute_grads_ref, permute_ref, quantize_ref,
                       unpermute_ref)

MLP_VARIANTS = sorted(n for n, v in permgen.VARIANTS.items()
                      if v["expert_mlp"] and "triton" in v["targets"] and v["quantize"] == "none")
FP8_VARIANTS = sorted(n for n, v in permgen.VARIANTS.items() if v["expert_mlp"] and v["quantize"] == "rowwise")
# H and F are multiples of 8: torch._grouped_mm's rows are 16-byte aligned on the GPU.
CASES = [
    (Case("basic", N=37, H=40, E=7, k=3), 24),
    (Case("empty", N=0, H=32, E=4, k=2), 16),
    (Case("one_expert_idle", N=12, H=48, E=9, k=2), 8),  # more experts than routes fill
    (Case("dropped", N=29, H=32, E=6, k=3, cap="drop"), 16),
    (Case("spare_rows", N=11, H=32, E=4, k=2, cap="spare"), 16),
    (Case("ragged", N=19, H=40, E=5, k=4, ragged=True), 24),
]


def swiglu(h):
    gate, up = h.chunk(2, dim=1)
    return F.silu(gate) * up


def mlp_ref(tokens, routing, probs, w1, w2, variant, num_experts, num_out_tokens):
    """permute_ref -> per expert, SwiGLU MLP (fp32 products rounded to the tokens' dtype) -> unpermute_ref."""
    rows, _, _, _, routes = permute_ref(tokens, routing, routing_kind=variant["routing"], num_experts=num_experts,
                                        pad=variant["pad"], num_out_tokens=num_out_tokens)
    start = routes.segment_start.tolist()
    counts = routes.tokens_per_expert.tolist()
    outs = []
    for e in range(num_experts):
        x = rows[start[e]:start[e] + counts[e]]
        h = (x.float() @ w1[e].float()).to(tokens.dtype)
        outs.append((swiglu(h).float() @ w2[e].float()).to(tokens.dtype))
    out = torch.cat(outs) if outs else rows.new_zeros((0, w2.shape[2]))
    # rows past the segments (spare rows) are zeros in permute; give them zero outputs too
    out = torch.cat([out, out.new_zeros((rows.shape[0] - out.shape[0], out.shape[1]))])
    return unpermute_ref(out, routes, tokens.shape[0], probs)


def make_case(name, case, width, g):
    variant = permgen.VARIANTS[name]
    tokens = torch.randn(case.N, case.H, generator=g).to(torch.bfloat16)
    routing = routing_from_ids(variant, expert_ids(case.N, case.E, case.k, g, case.ragged), case.E)
    probs = None
    if variant["probs"]:
        probs = torch.rand(case.N, case.E if variant["routing"] == "mask" else case.k, generator=g)
    w1 = (torch.randn(case.E, case.H, 2 * width, generator=g) * case.H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(case.E, width, case.H, generator=g) * width ** -0.5).to(torch.bfloat16)
    return variant, to_device(DEVICE, tokens, routing, probs, w1, w2)


def close(got, want, what):
    """Values summed in fp32 and rounded to bf16 (several roundings deep): 2% of the largest value."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    scale = float(want.detach().float().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=2e-2, atol=2e-2 * max(scale, 1e-3),
                               msg=lambda m: f"{what}: {m}")


def reference_case(name, case, width, request):
    """make_case's inputs for the test, with its generator, the num_out_tokens its cap asks for, and
    the variant's module."""
    g = generator_for(request)
    variant, tensors = make_case(name, case, width, g)
    tokens, routing = tensors[:2]
    needed = permute_ref(tokens, routing, routing_kind=variant["routing"], num_experts=case.E,
                         pad=variant["pad"])[0].shape[0]
    return g, variant, tensors, num_out_tokens_for(case, needed), load("triton", name)


def qwen3_like_inputs(seed):
    """A Qwen3-like layer at N=2048 on the GPU (H=2048, E=128, k=8, F=768): its generator, and x,
    ids, probs, w1, w2."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    N, H, E, k, width = 2048, 2048, 128, 8, 768
    x = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    top, ids = torch.randn(N, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    ids, probs = ids.to(torch.int32), top.contiguous()
    w1 = (torch.randn(E, H, 2 * width, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, width, H, device="cuda", generator=g) * width ** -0.5).to(torch.bfloat16)
    return g, (x, ids, probs, w1, w2)


def assert_compiles_like_eager(layer, inputs, g, same):
    """layer(*inputs) under torch.compile(fullgraph=True): one graph, and its output and gradients
    `same` as the eager call's. Returns the compiled layer and the leaves it was called on."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor" if HAS_CUDA else "aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    eager_in = [t.clone().requires_grad_() for t in inputs]
    compiled_in = [t.clone().requires_grad_() for t in inputs]
    want, got = layer(*eager_in), compiled(*compiled_in)
    assert counter.frame_count == 1
    assert same(got, want)
    grad = torch.randn(want.shape, generator=g).to(want.dtype).to(DEVICE)
    for a, b in zip(torch.autograd.grad(got, compiled_in, grad), torch.autograd.grad(want, eager_in, grad)):
        assert same(a, b)
    return compiled, compiled_in


@pytest.mark.parametrize("save_memory", [False, True], ids=["default", "save_memory"])
@pytest.mark.parametrize("case, width", CASES, ids=[c.name for c, _ in CASES])
@pytest.mark.parametrize("name", MLP_VARIANTS)
def test_expert_mlp_matches_reference(name, case, width, save_memory, request, poisoned_empty):
    g, variant, (tokens, routing, probs, w1, w2), num_out_tokens, mod = reference_case(name, case, width, request)
    ours_in = [t.clone().requires_grad_() for t in (tokens, w1, w2)]
    ref_in = [t.clone().requires_grad_() for t in (tokens, w1, w2)]
    p_ours = p_ref = None
    if probs is not None:
        p_ours, p_ref = probs.clone().requires_grad_(), probs.clone().requires_grad_()
    y = mod.expert_mlp(ours_in[0], routing, p_ours, ours_in[1], ours_in[2], num_experts=case.E,
                       num_out_tokens=num_out_tokens, save_memory=save_memory)
    want = mlp_ref(ref_in[0], routing, p_ref, ref_in[1], ref_in[2], variant, case.E, num_out_tokens)
    close(y, want, "output")
    grad = torch.randn(y.shape, generator=g).to(y.dtype).to(DEVICE)
    leaves_ours = ours_in + ([p_ours] if p_ours is not None else [])
    leaves_ref = ref_in + ([p_ref] if p_ref is not None else [])
    got_grads = torch.autograd.grad(y, leaves_ours, grad, allow_unused=True)
    want_grads = torch.autograd.grad(want, leaves_ref, grad, allow_unused=True)
    for label, a, b in zip(["tokens", "w1", "w2", "probs"], got_grads, want_grads):
        if b is None:  # nothing routed: the reference's graph does not reach this input
            assert a is None or not a.any(), f"grad {label}: nonzero without routes"
            continue
        close(a, b, f"grad {label}")
    # Deterministic: a rerun gives the same bits, forward and backward.
    again = mod.expert_mlp(ours_in[0], routing, p_ours, ours_in[1], ours_in[2], num_experts=case.E,
                           num_out_tokens=num_out_tokens, save_memory=save_memory)
    assert torch.equal(again, y)
    assert all(a is None or torch.equal(a, b) for a, b in
               zip(torch.autograd.grad(again, leaves_ours, grad, allow_unused=True), got_grads))


def test_expert_mlp_bad_input(request):
    name = "probs_bf16_index"
    g = generator_for(request)
    case = Case("bad", N=6, H=16, E=4, k=2)
    _, (tokens, routing, probs, w1, w2) = make_case(name, case, 8, g)
    mod = load("triton", name)
    with pytest.raises((TypeError, ValueError), match="tokens"):
        mod.expert_mlp(tokens.float(), routing, probs, w1.float(), w2.float(), num_experts=4)
    with pytest.raises((TypeError, ValueError), match="tokens"):
        mod.expert_mlp(tokens[0], routing, probs, w1, w2, num_experts=4)
    with pytest.raises(ValueError, match=r"w1 must be \[E, H, 2F\]"):
        mod.expert_mlp(tokens, routing, probs, w1[:, :8], w2, num_experts=4)
    with pytest.raises(ValueError, match=r"w2 must be \[E, F, H\]"):
        mod.expert_mlp(tokens, routing, probs, w1, w2[:, :4], num_experts=4)
    with pytest.raises(ValueError, match="w1 must be a 3-D tensor"):
        mod.expert_mlp(tokens, routing, probs, w1[0], w2, num_experts=4)
    with pytest.raises(ValueError, match="w2 must be torch.bfloat16"):
        mod.expert_mlp(tokens, routing, probs, w1, w2.float(), num_experts=4)
    with pytest.raises(ValueError, match="num_experts=5 but the weights hold 4 experts"):
        mod.expert_mlp(tokens, routing, probs, w1, w2, num_experts=5)
    with pytest.raises(ValueError, match="ids"):  # permute's own routing check
        mod.expert_mlp(tokens, torch.full_like(routing, 7), probs, w1, w2, num_experts=4)
    with pytest.raises(TypeError, match="save_memory must be a bool"):
        mod.expert_mlp(tokens, routing, probs, w1, w2, num_experts=4, save_memory="yes")
    plain = load("triton", "bf16_index")
    with pytest.raises(ValueError, match="this variant has no probs"):
        plain.expert_mlp(tokens, routing, probs, w1, w2, num_experts=4)


def test_only_spec_variants_have_it():
    """The option adds expert_mlp to exactly the Triton modules whose spec entry asks for it."""
    for name, v in permgen.VARIANTS.items():
        if "triton" in v["targets"]:
            assert hasattr(load("triton", name), "expert_mlp") == v["expert_mlp"], name


@pytest.mark.skipif(not HAS_CUDA, reason="a real shape needs the GPU")
@pytest.mark.parametrize("save_memory", [False, True], ids=["default", "save_memory"])
def test_expert_mlp_real_shape_matches_unfused_layer(save_memory):
    """Qwen3-like at N=2048 on the GPU: the same values as permute -> torch._grouped_mm -> unpermute."""
    mod = load("triton", "probs_bf16_index")
    g, (x, ids, probs, w1, w2) = qwen3_like_inputs(3)
    E = w1.shape[0]
    leaves = [t.clone().requires_grad_() for t in (x, probs, w1, w2)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, probs, w1, w2)]
    y = mod.expert_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], num_experts=E, save_memory=save_memory)
    res = mod.permute(ref_leaves[0], ids, ref_leaves[1], num_experts=E)
    m = res.row_id_map
    ends = (m.segment_offsets[:E] + m.segment_counts).to(torch.int32)
    h = torch._grouped_mm(res.tokens, ref_leaves[2], offs=ends)
    want = mod.unpermute(torch._grouped_mm(swiglu(h), ref_leaves[3], offs=ends), m, ref_leaves[1])
    close(y, want, "output")
    grad = torch.randn(y.shape, device="cuda", generator=g).to(torch.bfloat16)
    for label, a, b in zip(["x", "probs", "w1", "w2"], torch.autograd.grad(y, leaves, grad),
                           torch.autograd.grad(want, ref_leaves, grad)):
        close(a, b, f"grad {label}")


@pytest.mark.parametrize("save_memory", [False, True], ids=["default", "save_memory"])
def test_expert_mlp_compiles_without_graph_breaks(save_memory, request):
    """Under torch.compile(fullgraph=True) (num_out_tokens given: static shapes): one graph, and
    forward and gradients as the eager call gives them."""
    torch._dynamo.reset()
    name = "probs_bf16_index"
    case = Case("compile", N=9, H=32, E=3, k=2)
    g = generator_for(request)
    _, (tokens, routing, probs, w1, w2) = make_case(name, case, 16, g)
    mod = load("triton", name)

    def layer(x, p, a, b):
        return mod.expert_mlp(x, routing, p, a, b, num_experts=case.E, num_out_tokens=case.N * case.k,
                              save_memory=save_memory)

    # aot_eager runs the same kernels: the same bits. Inductor fuses SwiGLU's silu and product,
    # rounding once where eager rounds twice: the same values within the sums' tolerance.
    same = torch.equal if not HAS_CUDA else (lambda a, b: close(a, b, "compiled") is None)
    assert_compiles_like_eager(layer, (tokens, probs, w1, w2), g, same)
    torch._dynamo.reset()


def test_gather_ops_pass_opcheck(request):
    """The gather GEMM's custom ops: schema, fake implementations and registered autograd."""
    from permgen.layers.expert_mlp import row_tokens, segment_ends

    name = "probs_bf16_index"
    case = Case("opcheck", N=5, H=16, E=3, k=2)
    g = generator_for(request)
    _, (tokens, routing, probs, w1, _) = make_case(name, case, 8, g)
    mod = load("triton", name)
    m = mod.permute(tokens, routing, probs, num_experts=case.E).row_id_map
    row_token = row_tokens(m)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    ops = mod.expert_mlp.gather_ops.custom_ops
    torch.library.opcheck(ops["gather_gemm"], (tokens.clone().requires_grad_(), row_token, w1.clone().requires_grad_(),
                                               segment_ends(m, case.E), m.row_map, m.num_tokens, m.width,
                                               m.num_experts), test_utils=utils)
    torch.library.opcheck(ops["gather_rows"], (tokens.clone().requires_grad_(), row_token, m.row_map, m.num_tokens,
                                               m.width, m.num_experts), test_utils=utils)


@pytest.mark.parametrize("save_memory", [False, True], ids=["default", "save_memory"])
def test_weights_in_either_layout(save_memory, request):
    """Weights stored [E, out, in] and passed transposed (column-major views) give the same values."""
    name = "probs_bf16_index"
    case = Case("layout", N=13, H=32, E=3, k=2)
    g = generator_for(request)
    _, (tokens, routing, probs, w1, w2) = make_case(name, case, 16, g)
    mod = load("triton", name)
    row_major = mod.expert_mlp(tokens, routing, probs, w1, w2, num_experts=case.E, save_memory=save_memory)
    w1_t, w2_t = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))
    assert not w1_t.is_contiguous()
    column_major = mod.expert_mlp(tokens, routing, probs, w1_t, w2_t, num_experts=case.E, save_memory=save_memory)
    close(column_major, row_major, "column-major weights")


@pytest.mark.parametrize("hidden, width, words", [(12, 8, "H"), (16, 6, "F")])
def test_expert_mlp_sizes_not_multiples_of_8_are_refused_up_front(hidden, width, words, request):
    """torch._grouped_mm takes rows of 16-byte multiples: H and F of bf16 must be multiples of 8,
    refused with the argument named before anything runs (not torch's 'strides should be multiple of 16 bytes')."""
    name = "probs_bf16_index"
    _, (tokens, routing, probs, w1, w2) = make_case(name, Case("odd", N=6, H=hidden, E=4, k=2), width,
                                                   generator_for(request))
    with pytest.raises(ValueError, match=rf"{name}: {words} .* = {hidden if words == 'H' else width} must be a "
                                         r"multiple of 8"):
        load("triton", name).expert_mlp(tokens, routing, probs, w1, w2, num_experts=4)


# ---------------------------------------------------------------------------------------------
# The FP8 expert MLP (quantize = "rowwise"): H and F multiples of 16 (fp8 rows of 16-byte multiples)
# ---------------------------------------------------------------------------------------------

FP8_CASES = [
    (Case("basic", N=21, H=48, E=5, k=3), 32),
    (Case("empty", N=0, H=32, E=4, k=2), 16),
    (Case("dropped", N=17, H=32, E=6, k=3, cap="drop"), 16),
    (Case("spare_rows", N=11, H=32, E=4, k=2, cap="spare"), 16),
]


# The rows' GEMMs alone are exact (test_fp8_mlp_rows_match_reference); the whole layer is compared as a
# whole tensor, within the same bound on the GPU and under the CPU interpreter (which rounds bf16 as the GPU).
LAYER_BOUND = 1e-2


def near(got, want, what, bound=LAYER_BOUND):
    """The same values up to a relative error over the whole tensor."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    error = (got.float().cpu() - want.float().cpu()).norm()
    assert torch.isfinite(got.float()).all() and error <= bound * want.float().norm() + 1e-6, \
        f"{what}: relative error {float(error / want.float().norm().clamp(min=1e-30)):.2e}"


@pytest.mark.parametrize("name", FP8_VARIANTS)
def test_fp8_mlp_rows_match_reference(name, request, poisoned_empty):
    """The FP8 experts between permute and unpermute (the op fp8_mlp) on the quantising permute's
    rows: the output rows bit for bit the definition's (exact sums of fp8 products, rounded once);
    given the rows' gradients, the tokens' and weights' gradients within the sums' tolerance."""
    from permgen.layers.expert_mlp import row_tokens, segment_ends

    case, width = Case("rows", N=21, H=48, E=5, k=3), 32
    g = generator_for(request)
    variant, (tokens, routing, probs, w1, w2) = make_case(name, case, width, g)
    mod = load("triton", name)
    res = mod.permute(tokens, routing, probs, num_experts=case.E)
    m = res.row_id_map
    rows, _, scale, _, routes = permute_ref(tokens, routing, routing_kind=variant["routing"], num_experts=case.E,
                                            pad=variant["pad"], quantize="rowwise")
    x_rows = permute_ref(tokens, routing, routing_kind=variant["routing"], num_experts=case.E, pad=variant["pad"])[0]
    leaves = [t.clone().requires_grad_() for t in (tokens, w1, w2)]
    out, _ = mod.expert_mlp.fp8_ops.mlp(leaves[0], res.tokens, res.scale.view(-1), leaves[1], leaves[2],
                                        mod.expert_mlp.quantize_weights(w1, w2), segment_ends(m, case.E)[1:],
                                        row_tokens(m), m)
    want, backward = fp8_mlp_rows_ref(rows.cpu(), scale.cpu(), x_rows.cpu(), w1.cpu(), w2.cpu(),
                                      fp8_segments(routes, case.E))
    # On the GPU the scaled GEMMs sum with fast accumulation, and the GPU's sigmoid may round SwiGLU's
    # derivative one bf16 step away, which can move a value quantised after it by one fp8 step: there
    # the whole tensors are compared (near); the CPU's emulation sums exactly, as the definition.
    on_cpu = out.device.type == "cpu"
    if on_cpu:
        assert torch.equal(out, want)
    else:
        near(out, want, "output rows")
    grad_rows = torch.randn(out.shape, generator=g).to(out.dtype).to(DEVICE)
    grad_tokens, grad_w1, grad_w2 = torch.autograd.grad(out, leaves, grad_rows)
    want_x_rows, want_w1, want_w2 = backward(grad_rows.cpu())
    for label, got, ref in (("grad tokens", grad_tokens, permute_grads_ref(want_x_rows, routes, case.N)[0]),
                            ("grad w1", grad_w1, want_w1), ("grad w2", grad_w2, want_w2)):
        (assert_sum_close if on_cpu else near)(got, ref, label)


@pytest.mark.parametrize("case, width", FP8_CASES, ids=[c.name for c, _ in FP8_CASES])
@pytest.mark.parametrize("name", FP8_VARIANTS)
def test_fp8_expert_mlp_matches_reference(name, case, width, request, poisoned_empty):
    """Forward and every gradient against tests/reference.py's FP8 layer, built from the definition
    (quantize_ref, dequantised fp32 products); a rerun gives the same bits."""
    g, variant, (tokens, routing, probs, w1, w2), num_out_tokens, mod = reference_case(name, case, width, request)
    leaves = [t.clone().requires_grad_() for t in (tokens, probs, w1, w2)]
    y = mod.expert_mlp(leaves[0], routing, leaves[1], leaves[2], leaves[3], num_experts=case.E,
                       num_out_tokens=num_out_tokens)
    grad = torch.randn(y.shape, generator=g).to(y.dtype).to(DEVICE)
    want, want_grads = fp8_expert_mlp_ref(tokens.cpu(), routing.cpu(), probs.cpu(), w1.cpu(), w2.cpu(), grad.cpu(),
                                          routing_kind=variant["routing"], num_experts=case.E, pad=variant["pad"],
                                          num_out_tokens=num_out_tokens)
    near(y, want, "output")
    got_grads = torch.autograd.grad(y, leaves, grad, allow_unused=True)
    for label, got in zip(["tokens", "probs", "w1", "w2"], got_grads):
        if got is None:
            assert not want_grads[label].any(), label
            continue
        near(got, want_grads[label].to(got.dtype), f"grad {label}")
    # Deterministic; and weights quantised once (as per optimizer step) give the same bits.
    again = mod.expert_mlp(leaves[0], routing, leaves[1], leaves[2], leaves[3], num_experts=case.E,
                           num_out_tokens=num_out_tokens, fp8_weights=mod.expert_mlp.quantize_weights(w1, w2))
    assert torch.equal(again, y)
    assert all(a is None or torch.equal(a, b) for a, b in
               zip(torch.autograd.grad(again, leaves, grad, allow_unused=True), got_grads))


def test_fp8_swiglu_backward_matches_autograd(request):
    """The backward pass's fused kernel: d swiglu(h) / dh for a gradient, and swiglu(h), against torch's
    autograd of the definition in fp32 (one bf16 rounding apart), on a ragged width."""
    from permgen.layers.fp8_mlp import swiglu, swiglu_backward

    g = generator_for(request)
    h = (torch.randn(37, 2 * 1100, generator=g) * 3).to(torch.bfloat16)
    grad = torch.randn(37, 1100, generator=g).to(torch.bfloat16)
    poison = torch.full((2, 2 * 1100), float("nan"), dtype=torch.bfloat16)
    grad_h, a = swiglu_backward(grad.to(DEVICE), torch.cat([h, poison]).to(DEVICE)[:37])
    leaf = h.float().requires_grad_()
    (want,) = torch.autograd.grad(swiglu(leaf), leaf, grad.float())
    for got, ref, what in ((grad_h, want, "grad h"), (a, swiglu(h), "swiglu")):
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape, what
        torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=2 ** -7, atol=1e-6, msg=lambda m: f"{what}: {m}")


def test_fp8_row_quantiser_matches_reference(request):
    """The row quantiser the FP8 layer runs on activations, gradients and weights: bit for bit
    quantize_ref's rowwise rule, on the quantising permute's edge rows (test_quantize.edge_tokens)."""
    from permgen.triton.fp8 import quantize_rows
    from test_quantize import edge_tokens

    x = edge_tokens(16, 83, torch.bfloat16, generator_for(request)).to(DEVICE)
    rows, scale = quantize_rows(x)
    want_rows, want_scale = quantize_ref(x, "rowwise")
    assert torch.equal(rows.view(torch.uint8), want_rows.view(torch.uint8))
    assert torch.equal(scale, want_scale.view(-1))
    # it reads bf16 bits in place: other dtypes and layouts are refused, not read as bf16
    with pytest.raises(ValueError, match=r"quantize_rows: x must be a contiguous torch.bfloat16 tensor \[R, C\], got "
                                         r"torch.float32 \[16, 83\]"):
        quantize_rows(x.float())
    with pytest.raises(ValueError, match=r"got non-contiguous torch.bfloat16 \[83, 16\]"):
        quantize_rows(x.t())


@pytest.mark.parametrize("name", FP8_VARIANTS)
def test_fp8_expert_mlp_bad_input(name, request):
    g = generator_for(request)
    _, (tokens, routing, probs, w1, w2) = make_case(name, Case("bad", N=6, H=32, E=4, k=2), 16, g)
    mod = load("triton", name)
    with pytest.raises(ValueError, match="save_memory=True is for bf16 variants"):
        mod.expert_mlp(tokens, routing, probs, w1, w2, num_experts=4, save_memory=True)
    with pytest.raises(TypeError, match="fp8_weights must be what expert_mlp.quantize_weights"):
        mod.expert_mlp(tokens, routing, probs, w1, w2, num_experts=4, fp8_weights=(w1, w2))
    # a call checked once keeps its checks by what they read: the same shapes of another dtype are checked again
    weights = mod.expert_mlp.quantize_weights(w1, w2)
    mod.expert_mlp(tokens, routing, probs, w1, w2, num_experts=4, fp8_weights=weights)
    with pytest.raises(ValueError, match=r"fp8_weights.w2 must be contiguous torch.float8_e4m3fn \[4, 16, 32\]"):
        mod.expert_mlp(tokens, routing, probs, w1, w2, num_experts=4,
                       fp8_weights=weights._replace(w2=weights.w2.view(torch.float8_e5m2)))
    stale = mod.expert_mlp.quantize_weights(w1[:, :16], w2[:, :, :16])
    with pytest.raises(ValueError, match=r"fp8_weights.w1_t must be contiguous torch.float8_e4m3fn \[4, 32, 32\]"):
        mod.expert_mlp(tokens, routing, probs, w1, w2, num_experts=4, fp8_weights=stale)
    with pytest.raises(ValueError, match="fp8_weights are for the FP8 expert MLP"):
        load("triton", "probs_bf16_index").expert_mlp(tokens, routing, probs, w1, w2, num_experts=4,
                                                      fp8_weights=mod.expert_mlp.quantize_weights(w1, w2))
    _, (tokens, routing, probs, w1, w2) = make_case(name, Case("odd", N=6, H=24, E=4, k=2), 16, g)
    with pytest.raises(ValueError, match=r"H \(the tokens' columns\) = 24 must be a multiple of 16"):
        mod.expert_mlp(tokens, routing, probs, w1, w2, num_experts=4)


@pytest.mark.parametrize("name", FP8_VARIANTS)
def test_fp8_expert_mlp_compiles_without_graph_breaks(name, request):
    """torch.compile(fullgraph=True): one graph, and (aot_eager on the CPU: the same kernels) the same
    bits as the eager call, forward and gradients; its custom ops pass opcheck."""
    torch._dynamo.reset()
    case = Case("compile", N=9, H=32, E=3, k=2)
    g = generator_for(request)
    _, (tokens, routing, probs, w1, w2) = make_case(name, case, 16, g)
    mod = load("triton", name)

    def layer(x, p, a, b, fp8_weights=None):
        return mod.expert_mlp(x, routing, p, a, b, num_experts=case.E, num_out_tokens=case.N * case.k + 8,
                              fp8_weights=fp8_weights)

    same = torch.equal if not HAS_CUDA else (lambda a, b: near(a, b, "compiled") is None)
    compiled, compiled_in = assert_compiles_like_eager(layer, (tokens, probs, w1, w2), g, same)
    # fp8_weights are checked in compiled calls too: a copy of another fp8 dtype is refused, not read as e4m3
    weights = mod.expert_mlp.quantize_weights(w1, w2)
    with pytest.raises((ValueError, RuntimeError), match=r"fp8_weights.w1_t must be contiguous torch.float8_e4m3fn"):
        compiled(*compiled_in, weights._replace(w1_t=weights.w1_t.view(torch.float8_e5m2)))
    torch._dynamo.reset()
    ops = mod.expert_mlp.fp8_ops.custom_ops
    # (test_schema compares fp8 tensors with arithmetic the CPU has no fp8 kernel for)
    utils = ("test_faketensor",)
    x = tokens[:, :32].contiguous()
    torch.library.opcheck(ops["fp8_quantize_rows"], (x,), test_utils=utils)
    torch.library.opcheck(ops["fp8_quantize_columns"], (w1.detach()[:, :40, :24].contiguous(),), test_utils=utils)
    q, s = ops["fp8_quantize_rows"](x)
    weights = mod.expert_mlp.quantize_weights(w1, w2)
    offs = torch.tensor([3, 3, 9], dtype=torch.int32, device=x.device)
    torch.library.opcheck(ops["fp8_scaled_grouped_mm"], (q, s, weights.w1_t.transpose(1, 2), weights.w1_t_scale, offs),
                          test_utils=utils)


@pytest.mark.skipif(not HAS_CUDA, reason="torch._scaled_grouped_mm needs the GPU")
@pytest.mark.parametrize("name", FP8_VARIANTS)
def test_fp8_expert_mlp_real_shape(name):
    """Qwen3-like at N=2048 on the H200: torch._scaled_grouped_mm against its CPU emulation (the
    definition), and the layer within 20 dB of the bf16 layer, output and every gradient."""
    from permgen.layers.fp8_mlp import emulated_scaled_grouped_mm, scaled_grouped_mm

    mod, bf16 = load("triton", name), load("triton", "probs_bf16_index")
    g, (x, ids, probs, w1, w2) = qwen3_like_inputs(5)
    E = w1.shape[0]
    weights = mod.expert_mlp.quantize_weights(w1, w2)
    res = mod.permute(x, ids, probs, num_experts=E)
    offs = (res.row_id_map.segment_offsets[1:E + 1]).to(torch.int32)
    gpu = scaled_grouped_mm(res.tokens, res.scale.view(-1), weights.w1_t.transpose(1, 2), weights.w1_t_scale, offs)
    cpu = emulated_scaled_grouped_mm(*(t.cpu() for t in (res.tokens, res.scale.view(-1),
                                                         weights.w1_t.transpose(1, 2), weights.w1_t_scale, offs)))
    rows = int(offs[-1])
    close(gpu[:rows].cpu(), cpu[:rows], "torch._scaled_grouped_mm against its definition")
    leaves = [t.clone().requires_grad_() for t in (x, probs, w1, w2)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, probs, w1, w2)]
    y = mod.expert_mlp(*leaves[:1], ids, *leaves[1:], num_experts=E)
    want = bf16.expert_mlp(*ref_leaves[:1], ids, *ref_leaves[1:], num_experts=E)
    grad = torch.randn(y.shape, device="cuda", generator=g).to(torch.bfloat16)
    pairs = [("output", y, want)] + list(zip(["x", "probs", "w1", "w2"], torch.autograd.grad(y, leaves, grad),
                                              torch.autograd.grad(want, ref_leaves, grad)))
    for label, a, b in pairs:
        sqnr = 10 * torch.log10(b.float().pow(2).sum() / (a.float() - b.float()).pow(2).sum())
        assert sqnr >= 20, f"{label}: {float(sqnr):.1f} dB"


def test_fp8_column_quantiser_matches_transposed_rows(request):
    """The weights' column quantiser: bit for bit the row quantiser on the transposed copy it avoids
    (quantize_ref's rowwise rule), on edge values and ragged sizes; every byte and scale written."""
    from permgen.triton.fp8 import quantize_columns
    from test_quantize import edge_tokens

    g = generator_for(request)
    for matrices, rows, cols in ((3, 83, 70), (1, 130, 17), (2, 41, 129)):
        # edge_tokens' special rows become columns, the values a column's scale is taken over
        x = edge_tokens(matrices * cols, rows, torch.bfloat16, g).view(matrices, cols, rows).transpose(1, 2)
        x = x.contiguous().to(DEVICE)
        q, scale = quantize_columns(x)
        want_rows, want_scale = quantize_ref(x.transpose(1, 2).reshape(-1, rows), "rowwise")
        assert q.shape == (matrices, cols, rows) and scale.shape == (matrices, cols)
        assert torch.equal(q.view(torch.uint8).reshape(-1, rows), want_rows.view(torch.uint8))
        assert torch.equal(scale.reshape(-1), want_scale.view(-1))
    with pytest.raises(ValueError, match=r"quantize_columns: x must be a contiguous torch.bfloat16 tensor "
                                         r"\[B, R, C\], got torch.float16 \[2, 41, 129\]"):
        quantize_columns(x.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("name", FP8_VARIANTS)
def test_fp8_quantize_weights_refuses_other_dtypes(name, dtype, request):
    """The quantisers read bf16 bits: weights of any other dtype are refused by name, on both weights
    (they were read as bf16 and gave NaN or wrong rows)."""
    _, (_, _, _, w1, w2) = make_case(name, Case("dtype", N=4, H=32, E=3, k=2), 16, generator_for(request))
    quantize = load("triton", name).expert_mlp.quantize_weights
    with pytest.raises(ValueError, match=rf"{name}: w1 must be torch.bfloat16 .*got {dtype}"):
        quantize(w1.to(dtype), w2)
    with pytest.raises(ValueError, match=rf"{name}: w2 must be torch.bfloat16 .*got {dtype}"):
        quantize(w1, w2.to(dtype))


@pytest.mark.parametrize("name", FP8_VARIANTS)
def test_fp8_quantize_weights_refuses_bad_shapes(name, request):
    """quantize_weights checks w1 [E, H, 2F] and w2 [E, F, H] as expert_mlp does, naming the shapes
    it expects (a 2-D w1 failed with "not enough values to unpack")."""
    _, (_, _, _, w1, w2) = make_case(name, Case("shape", N=4, H=32, E=3, k=2), 16, generator_for(request))
    quantize = load("triton", name).expert_mlp.quantize_weights
    with pytest.raises(ValueError, match=r"w1 must be a 3-D tensor \[E, H, 2F\], got \[32, 32\]"):
        quantize(w1[0], w2)
    with pytest.raises(ValueError, match=r"w2 must be a 3-D tensor \[E, F, H\], got \[16, 32\]"):
        quantize(w1, w2[0])
    with pytest.raises(TypeError, match=r"w1 must be a torch.Tensor \[E, H, 2F\], got list"):
        quantize(w1.tolist(), w2)
    with pytest.raises(ValueError, match=r"w2 must be \[E, F, H\] = \(3, 16, 32\) for w1 \[3, 32, 32\], got \[3, 16, 16\]"):
        quantize(w1, w2[:, :, :16])
    with pytest.raises(ValueError, match=r"w1 must be \[E, H, 2F\] for SwiGLU, got \[3, 32, 31\]"):
        quantize(w1[:, :, :31], w2)
    with pytest.raises(ValueError, match=rf"w2 is on meta, expected {w1.device} \(w1's device\)"):
        quantize(w1, w2.to("meta"))
    _, (_, _, _, w1, w2) = make_case(name, Case("odd", N=4, H=24, E=3, k=2), 16, generator_for(request))
    with pytest.raises(ValueError, match=r"H \(.*\) = 24 must be a multiple of 16"):
        quantize(w1, w2)


@pytest.mark.parametrize("name", ["probs_bf16_index"] + FP8_VARIANTS)
def test_expert_mlp_second_derivatives_computed_or_refused(name, request):
    """torch.autograd.grad(..., create_graph=True) through the layer, then a second backward pass: the
    bf16 layer's second derivatives are computed, save_memory's (the gather GEMM's backward, its rows
    gathered again) the same as the default's; the FP8 layer's quantised GEMMs refuse them
    ("differentiating twice"), never a gradient silently without its graph."""
    g = generator_for(request)
    _, (tokens, routing, probs, w1, w2) = make_case(name, Case("twice", N=9, H=32, E=3, k=2), 16, g)
    mod = load("triton", name)
    fp8 = mod.VARIANT["quantize"] == "rowwise"
    names = ["tokens", "probs", "w1", "w2"]
    for at in (0, 2, 3):  # the gradient in tokens, w1, w2 (a penalty's term), differentiated again
        seconds = []
        for options in ([{}] if fp8 else [{"save_memory": False}, {"save_memory": True}]):
            leaves = [t.clone().requires_grad_() for t in (tokens, probs, w1, w2)]
            y = mod.expert_mlp(leaves[0], routing, *leaves[1:], num_experts=3, **options)
            (first,) = torch.autograd.grad((y.float() ** 2).sum(), leaves[at], create_graph=True)
            penalty = (first.float() ** 2).sum()
            if fp8:
                with pytest.raises(RuntimeError, match="differentiating twice"):
                    torch.autograd.grad(penalty, leaves)
            else:
                seconds.append(torch.autograd.grad(penalty, leaves))
        for what, default, saving in zip(names, *seconds) if seconds else ():
            close(saving, default, f"save_memory: d/d{what} of the gradient in {names[at]}")
