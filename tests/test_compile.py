"""The torch.library ops of every Triton variant under torch.compile, and of one variant of each
kind of op registration under torch.library.opcheck.

permute -> arbitrary torch work -> unpermute compiles with fullgraph=True (no graph break) and
gives bit-identical outputs and gradients to the eager call, with num_out_tokens (static shapes)
and without it (a data-dependent row count). On the CPU the kernels run under TRITON_INTERPRET=1
and the graphs go through AOTAutograd with backend="aot_eager"; on a GPU, Inductor compiles them.
Shapes are small: every kernel call is interpreted.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import permgen
from permgen.core.ops import chunk_table
from cases import (
    COMPILE_BACKEND,
    DEVICE,
    HAS_CUDA,
    Case,
    assert_bits_equal,
    generator_for,
    is_fp8,
    rows_are_fp8,
    load,
    make_inputs,
    needed_rows,
    random_like,
    variants_for,
)
from cases import fresh_dynamo  # noqa: F401 (an autouse fixture: each test compiles from a clean dynamo)

TRITON_VARIANTS = variants_for("triton")
CASE = Case("compile", N=9, H=32, E=3, k=2)
OPCHECK_CASE = Case("opcheck", N=4, H=16, E=2, k=2)
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck_variants():
    """The least padded variant of each kind the ops' schemas and fake implementations tell apart:
    routing, probs, scales, quantising, fp8 tokens. Padding and the other widths change no op's
    registration (every variant still compiles in test_compiled_layer_matches_eager)."""
    chosen = {}
    for name in sorted(TRITON_VARIANTS, key=lambda n: (permgen.VARIANTS[n]["pad"], n)):
        v = permgen.VARIANTS[name]
        chosen.setdefault((v["routing"], v["probs"], v["scale"], v["quantize"], v["dtype"].startswith("fp8")), name)
    return sorted(chosen.values())


OPCHECK_VARIANTS = _opcheck_variants()


def layer(mod, num_out_tokens):
    """What a MoE layer does around permute: experts' work on the permuted rows, then unpermute."""
    v = mod.VARIANT

    def run(tokens, routing, probs, scale, weight):
        res = mod.permute(tokens, routing, probs, scale, num_experts=CASE.E, num_out_tokens=num_out_tokens)
        # Stands in for the experts: a matmul, which eager and Inductor both hand to cuBLAS. Pointwise
        # work and reductions here would be Inductor's own kernels, whose roundings and summation
        # orders differ in bits from eager's; the ops under test must not.
        hidden = res.tokens.to(weight.dtype) @ weight
        if res.probs is not None:
            # The permuted probs become column 0: their gradient is that column's, no sum to reorder.
            hidden = torch.cat((res.probs[:, None].to(hidden.dtype), hidden[:, 1:]), dim=1)
        merging = probs if v["probs"] else None
        out = mod.unpermute(hidden.contiguous(), res.row_id_map, merging)
        return out, res.tokens_per_expert

    return run


def leaves(mod, request):
    """The layer's inputs, built twice from one seed: one set for eager, one for compiled."""
    v = mod.VARIANT

    def build():
        g = generator_for(request)
        tokens, routing, probs, scale = make_inputs(v, CASE, DEVICE, g)
        cdt = mod._ops.variant.combine_dtype
        weight = (random_like((CASE.H, CASE.H), cdt, DEVICE, g) / CASE.H ** 0.5).requires_grad_()
        if not rows_are_fp8(v):
            tokens.requires_grad_()
        if probs is not None:
            probs.requires_grad_()
        return tokens, routing, probs, scale, weight

    return build(), build()


@pytest.mark.parametrize("cap", ["static", "dynamic"])
@pytest.mark.parametrize("name", TRITON_VARIANTS)
def test_compiled_layer_matches_eager(name, cap, request):
    """fullgraph=True: no graph break; forward outputs and every gradient bit-identical to eager."""
    mod = load("triton", name)
    eager_in, compiled_in = leaves(mod, request)
    num_out_tokens = needed_rows(mod.VARIANT, eager_in[1], CASE.E) if cap == "static" else None
    run = layer(mod, num_out_tokens)
    counter = CompileCounterWithBackend(COMPILE_BACKEND)
    compiled = torch.compile(run, fullgraph=True, backend=counter)

    results = []
    for fn, inputs in ((run, eager_in), (compiled, compiled_in)):
        out, tokens_per_expert = fn(*inputs)
        grad_out = random_like(out.shape, out.dtype, DEVICE, generator_for(request, "grad"))
        out.backward(grad_out)
        results.append((out, tokens_per_expert, [t.grad for t in inputs if t is not None and t.requires_grad]))
    assert counter.frame_count == 1
    (out, tpe, grads), (c_out, c_tpe, c_grads) = results
    assert_bits_equal(c_out, out, "compiled unpermute")
    assert torch.equal(c_tpe, tpe)
    # tokens and weight (plus probs); fp8 rows pass no gradient to the tokens
    assert len(grads) == len(c_grads) >= (1 if rows_are_fp8(mod.VARIANT) and not mod.VARIANT["probs"] else 2)
    for i, (got, want) in enumerate(zip(c_grads, grads)):
        assert_bits_equal(got, want, f"grad {i}")


def test_no_graph_break_counted_by_explain(request):
    """torch._dynamo.explain of the layer: one graph, no break (what TE's suite checks with fullgraph)."""
    mod = load("triton", "probs_bf16_mask")
    inputs, _ = leaves(mod, request)
    explained = torch._dynamo.explain(layer(mod, None))(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_new_token_counts_do_not_recompile(request):
    """dynamic=True: a second and third token count reuse the first graph."""
    mod = load("triton", "probs_bf16_index")
    v = mod.VARIANT
    counter = CompileCounterWithBackend(COMPILE_BACKEND)

    @torch.compile(fullgraph=True, dynamic=True, backend=counter)
    def run(tokens, routing, probs, num_out_tokens):
        res = mod.permute(tokens, routing, probs, num_experts=CASE.E, num_out_tokens=num_out_tokens)
        return mod.unpermute(res.tokens * 2, res.row_id_map, probs)

    g = generator_for(request)
    for n in (7, 13, 21):
        tokens, routing, probs, _ = make_inputs(v, Case("n", N=n, H=CASE.H, E=CASE.E, k=CASE.k), DEVICE, g)
        out = run(tokens, routing, probs, n * CASE.k)
        res = mod.permute(tokens, routing, probs, num_experts=CASE.E, num_out_tokens=n * CASE.k)
        assert_bits_equal(out, mod.unpermute(res.tokens * 2, res.row_id_map, probs), f"N={n}")
    assert counter.frame_count == 1


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU (run `make test-gpu` on the GPU machine)")
@pytest.mark.parametrize("name", ["probs_bf16_mask", "probs_bf16_index", "probs_pad128_fp8e4m3_block128_mask"])
def test_reduce_overhead_replays_cuda_graphs(name, request):
    """mode="reduce-overhead": the layer is captured in CUDA graphs (no skip) and replays bit-identical results."""
    mod = load("triton", name)
    inputs, _ = leaves(mod, request)
    inputs = [None if t is None else t.detach() for t in inputs]
    run = layer(mod, needed_rows(mod.VARIANT, inputs[1], CASE.E))
    compiled = torch.compile(run, mode="reduce-overhead", fullgraph=True)
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    with torch.no_grad():
        want, want_tpe = run(*inputs)
        for call in range(3):  # the first calls record, the later ones replay
            got, got_tpe = compiled(*inputs)
            assert_bits_equal(got, want, f"call {call}")
            assert torch.equal(got_tpe, want_tpe)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips


def test_routing_errors_are_raised_inside_the_compiled_op(request):
    """check_routing (the default without num_out_tokens) runs inside the op: the same ValueError."""
    mod = load("triton", "probs_bf16_index")
    g = generator_for(request)
    tokens, routing, probs, _ = make_inputs(mod.VARIANT, CASE, DEVICE, g)
    routing[0, 0] = CASE.E  # an expert that does not exist

    @torch.compile(fullgraph=True, backend=COMPILE_BACKEND)
    def run(tokens, routing, probs):
        return mod.permute(tokens, routing, probs, num_experts=CASE.E).tokens

    with pytest.raises(ValueError, match="expert ids must be in"):
        run(tokens, routing, probs)


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck: schema, autograd registration, fake implementation, AOT dispatch
# ---------------------------------------------------------------------------------------------

def op_samples(mod, g, num_out_tokens):
    """(op name, args) for every op of the variant, on OPCHECK_CASE.

    opcheck compares outputs of separate runs bit for bit. A mask-routing row map leaves the slots
    past each token's route count unwritten (never read), so mask routing runs with topk = k here,
    where every token's k routes fill every slot."""
    v, ops, case = mod.VARIANT, mod._ops, OPCHECK_CASE
    tokens, routing, probs, scale = make_inputs(v, case, DEVICE, g)
    hint = {"topk": case.k} if v["routing"] == "mask" else {}
    res = mod.permute(tokens, routing, probs, scale, num_experts=case.E, num_out_tokens=num_out_tokens, **hint)
    rim = res.row_id_map
    rows, sizes = rim.num_rows, (rim.num_tokens, rim.width, rim.num_experts)
    cdt = ops.variant.combine_dtype
    permuted = random_like((rows, case.H), cdt, DEVICE, g)
    grad_out = random_like((case.N, case.H), cdt, DEVICE, g)
    grad_rows = random_like((rows, case.H), cdt, DEVICE, g)
    differentiable_tokens = tokens.clone().requires_grad_(not rows_are_fp8(v))
    samples = [
        ("permute", (differentiable_tokens, routing, None if probs is None else probs.clone().requires_grad_(),
                     scale, rim.num_experts, rim.width, num_out_tokens, num_out_tokens is None)),
        ("unpermute", (permuted.clone().requires_grad_(), rim.row_map, None, *sizes)),
        # the backward ops are differentiable too (second derivatives): their own autograd is checked
        ("permute_backward", (rim.row_map, grad_rows.clone().requires_grad_(), *sizes, rows)),
        ("unpermute_backward", (rim.row_map, grad_out.clone().requires_grad_(), *sizes, rows)),
    ]
    if v["probs"]:
        merging = torch.rand(routing.shape, generator=g).to(DEVICE)
        grad_probs = torch.randn(rows, generator=g).to(DEVICE)
        samples += [
            ("unpermute", (permuted.clone().requires_grad_(), rim.row_map, merging.clone().requires_grad_(),
                           *sizes)),
            ("permute_backward_probs", (rim.row_map, None, grad_probs.clone().requires_grad_(), *sizes, rows,
                                        routing.shape[1], probs.dtype)),
            ("unpermute_backward_probs", (rim.row_map, grad_out.clone().requires_grad_(),
                                          permuted.clone().requires_grad_(), merging.clone().requires_grad_(),
                                          *sizes)),
        ]
    split_sizes, sorted_idxs = torch.tensor([1, 0, 3], device=DEVICE), torch.tensor([2, 0, 1], device=DEVICE)
    table = chunk_table(split_sizes, sorted_idxs).to(DEVICE)
    samples.append(("chunk_table", (split_sizes, sorted_idxs)))
    samples.append(("check_chunks", (split_sizes.cpu(), sorted_idxs.cpu(), 4, "sort_chunks")))
    for inverse in (False, True):
        samples.append(("sort_chunks", (tokens.clone().requires_grad_(not is_fp8(v)), table, inverse)))
        if v["probs"]:
            samples.append(("sort_chunks_probs", (tokens.clone().requires_grad_(not is_fp8(v)),
                                                  torch.rand(case.N, generator=g).to(DEVICE).requires_grad_(),
                                                  table, inverse)))
    # fp8 rows carry no gradient: their permute backward has the probs-only form.
    if v["probs"] and not rows_are_fp8(v):
        samples.append(("permute_backward_probs", (rim.row_map, grad_rows.clone().requires_grad_(),
                                                   grad_probs.clone().requires_grad_(), *sizes, rows,
                                                   routing.shape[1], probs.dtype)))
    return samples


@pytest.mark.parametrize("name", OPCHECK_VARIANTS)
def test_opcheck(name, request):
    """Every op of the variant passes torch.library.opcheck, permute with and without num_out_tokens."""
    mod = load("triton", name)
    g = generator_for(request)
    needed = needed_rows(mod.VARIANT, make_inputs(mod.VARIANT, OPCHECK_CASE, DEVICE, generator_for(request))[1],
                         OPCHECK_CASE.E)
    samples = op_samples(mod, g, needed)
    samples.append(op_samples(mod, g, None)[0])
    # Words a kernel never writes (an index map's allocation after its segment table) compare only
    # if fresh memory is filled: on the GPU as torch's deterministic mode fills it.
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        check_ops(mod, samples)
    finally:
        torch.use_deterministic_algorithms(deterministic)


CHUNK_SORT_OPS = ("chunk_table", "check_chunks", "sort_chunks", "sort_chunks_probs")


def check_ops(mod, samples):
    for op, args in samples:
        utils = OPCHECK_UTILS
        if (op == "permute" and rows_are_fp8(mod.VARIANT)) or (op.startswith("sort_chunks") and is_fp8(mod.VARIANT)):
            # The schema and AOT checks reduce fp8 tensors (sum, mul), which the CPU has no fp8 kernels
            # for; test_compiled_layer_matches_eager compiles these variants' permute instead.
            utils = ("test_autograd_registration", "test_faketensor")
        owner = mod._ops.chunk_sort if op in CHUNK_SORT_OPS else mod._ops
        torch.library.opcheck(owner.custom_ops[op], args, test_utils=utils)


def test_every_op_is_registered_in_the_permgen_namespace():
    for name in TRITON_VARIANTS:
        ops = load("triton", name)._ops
        want = {"permute", "unpermute", "permute_backward", "unpermute_backward"}
        if permgen.VARIANTS[name]["probs"]:
            want |= {"permute_backward_probs", "unpermute_backward_probs"}
        assert set(ops.op) == want
        # the chunk sort depends on no variant: one set of ops for the target (numbered when another copy
        # of the runtime in this process, a vendored file, took the target's name first)
        sort_prefix = ops.chunk_sort.prefix
        assert sort_prefix == "triton" or sort_prefix.startswith("triton_")
        assert {op: o.name() for op, o in ops.chunk_sort.op.items()} == {
            op: f"permgen::{sort_prefix}_{op}" for op in CHUNK_SORT_OPS}
        for op, overload in ops.op.items():
            assert overload.name() == f"permgen::{ops.prefix}_{op}"
            assert ops.prefix.startswith(f"triton_{name}")
