"""What only a GPU can show: no host sync, CUDA-graph capture, int64 offsets at full size."""

import pytest
import torch

from cases import HAS_CUDA, Case, assert_sum_close, combine_dtype, generator_for, load, make_inputs
from reference import permute_ref, unpermute_ref

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run `make test-gpu` on the GPU machine)")

SYNC_FREE = ["probs_bf16_mask", "probs_bf16_index", "bf16_index", "probs_pad128_fp8e4m3_block128_mask"]


def static_call(name, case, request):
    """(module, its permute inputs on the GPU, keyword arguments that fix every output's size)."""
    mod = load("triton", name)
    kw = dict(num_experts=case.E, num_out_tokens=case.N * case.k + (case.E * mod.VARIANT["pad"]))
    if mod.VARIANT["routing"] == "mask":
        kw["topk"] = case.k
    return mod, make_inputs(mod.VARIANT, case, "cuda", generator_for(request)), kw


@pytest.mark.parametrize("name", SYNC_FREE)
def test_permute_makes_no_host_sync_with_num_out_tokens(name, request):
    case = Case("sync", N=512, H=512, E=16, k=4)
    mod, (tokens, routing, probs, scale), kw = static_call(name, case, request)
    mod.permute(tokens, routing, probs, scale, **kw)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = mod.permute(tokens, routing, probs, scale, **kw)
        out = mod.unpermute(res.tokens.to(combine_dtype(mod.VARIANT)), res.row_id_map, probs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == tokens.shape


@pytest.mark.parametrize("name", SYNC_FREE)
def test_permute_and_unpermute_capture_in_a_cuda_graph(name, request):
    case = Case("graph", N=300, H=384, E=12, k=3)
    mod, (tokens, routing, probs, scale), kw = static_call(name, case, request)
    permuted = torch.randn(kw["num_out_tokens"], case.H, device="cuda").to(combine_dtype(mod.VARIANT))
    eager = mod.permute(tokens, routing, probs, scale, **kw)
    eager_out = mod.unpermute(permuted, eager.row_id_map, probs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = mod.permute(tokens, routing, probs, scale, **kw)
        out = mod.unpermute(permuted, res.row_id_map, probs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(res.tokens.view(torch.uint8), eager.tokens.view(torch.uint8))
    assert torch.equal(out, eager_out)


def test_row_offsets_past_two_to_the_31_elements():
    """M * H > 2**31: destination offsets must be computed in int64."""
    mod = load("triton", "probs_bf16_index")
    N, H, E, k = 16384, 16384 + 64, 8, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.argsort(torch.rand(N, E, device="cuda", generator=g), dim=1)[:, :k].to(torch.int32)
    probs = torch.rand(N, k, device="cuda", generator=g)
    res = mod.permute(tokens, ids, probs, num_experts=E, num_out_tokens=N * k)
    assert res.tokens.shape[0] * H > 2**31
    ref_tokens, ref_probs, _, ref_tpe, routes = permute_ref(tokens, ids, routing_kind="index", num_experts=E, probs=probs)
    assert torch.equal(res.tokens.view(torch.int16), ref_tokens.view(torch.int16))
    assert torch.equal(res.tokens_per_expert, ref_tpe)
    out = mod.unpermute(res.tokens, res.row_id_map, probs)
    assert_sum_close(out, unpermute_ref(res.tokens, routes, N, probs))


@pytest.mark.parametrize("name", ["probs_bf16_mask", "probs_pad128_bf16_mask", "probs_bf16_index"])
def test_permute_repeats_exactly_on_several_streams(name, request):
    """permute keeps one launch-counter buffer per stream, which each launch leaves at zero:
    many calls, interleaved over two streams, must all give the reference result."""
    case = Case("streams", N=3000, H=256, E=64, k=6)
    mod, (tokens, routing, probs, scale), kw = static_call(name, case, request)
    first = mod.permute(tokens, routing, probs, scale, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    results = []
    for i in range(40):
        with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
            results.append(mod.permute(tokens, routing, probs, scale, **kw))
    torch.cuda.synchronize()
    for res in results:
        assert torch.equal(res.tokens.view(torch.int16), first.tokens.view(torch.int16))
        rim, first_rim = res.row_id_map, first.row_id_map  # the row map's words the kernels write:
        assert torch.equal(rim.rows_by_column(), first_rim.rows_by_column())
        assert torch.equal(rim.segment_offsets, first_rim.segment_offsets)
        assert torch.equal(rim.segment_counts, first_rim.segment_counts)
        assert torch.equal(res.tokens_per_expert, first.tokens_per_expert)
