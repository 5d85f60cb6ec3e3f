"""megatron-core's fused permutation path run by permgen (permgen.integrations.megatron.enable()),
against megatron-core's own unfused path: the release from PyPI, unchanged.

megatron-core's moe_utils.permute / unpermute / sort_chunks_by_idxs with fused=True call
TransformerEngine's functions; without TransformerEngine, enable() points them at permgen. Each
test calls the same megatron-core function with fused=True and fused=False on the same inputs:
moved rows and probs are bit for bit equal, sums within the dtype's tolerance, grads too.
"""

import inspect

import pytest
import torch

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

from cases import DEVICE, HAS_CUDA, PROB_GRAD_TOL, SUM_TOL, assert_bits_equal, expert_ids, generator_for  # noqa: E402
from permgen.integrations import megatron  # noqa: E402

N, H, E, K = 11, 24, 6, 2
# Token grads of unpermute's backward add k routes' bf16 grads (fused: in fp32, unfused: in bf16).
TOKEN_GRAD_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=3e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.fixture(autouse=True)
def permgen_enabled():
    if moe_utils.HAVE_TE:
        pytest.skip("TransformerEngine is installed: megatron-core's fused path runs it, not permgen")
    assert megatron.enable()
    yield
    megatron.disable()


def routing(g, num_tokens=N, num_experts=E, k=K):
    ids = expert_ids(num_tokens, num_experts, k, g)
    mask = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, ids.long(), True)
    probs = torch.rand(num_tokens, num_experts, generator=g) * mask
    return mask.to(DEVICE), probs.to(DEVICE)


def tokens_of(g, dtype=torch.bfloat16, n=N):
    return (torch.randn(n, H, generator=g) * 4).to(dtype).to(DEVICE)


def both(fn, *tensors):
    """fn(fused, *leaves) for fused True and False, each on its own copy of the leaves."""
    results = []
    for fused in (True, False):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
        results.append((fn(fused, *leaves), leaves))
    return results


def close(got, want, what, tol=None):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **(tol or SUM_TOL[want.dtype]),
                               msg=lambda m: f"{what}: {m}")


def test_enable_is_reversible():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as dispatcher

    assert moe_utils.HAVE_TE and moe_utils.fused_permute is not None
    wrapped = dispatcher.__init__
    assert wrapped.__wrapped__ is not None  # its orders that move nothing kept on the host
    assert not megatron.enable()  # already on
    megatron.disable()
    assert not moe_utils.HAVE_TE and getattr(moe_utils, "fused_permute", None) is None  # newer releases bind None
    assert dispatcher.__init__ is wrapped.__wrapped__
    with pytest.raises(ValueError, match="fused_permute is not available"):
        moe_utils.permute(tokens_of(torch.Generator()), routing(torch.Generator())[0], fused=True)
    assert megatron.enable()


def test_transformer_engine_version_asked_once_per_version(monkeypatch):
    """Releases whose fused unpermute asks is_te_min_version on every call (0.19 on) get the same
    answers, asked of megatron-core once per version; disable() puts megatron-core's function back."""
    megatron.disable()
    asked = []

    def is_te_min_version(version, check_equality=True):
        asked.append(version)
        return False

    monkeypatch.setattr(moe_utils, "is_te_min_version", is_te_min_version, raising=False)
    assert megatron.enable()
    assert [moe_utils.is_te_min_version("2.12.0") for _ in range(3)] == [False] * 3
    assert not moe_utils.is_te_min_version("2.13.0")
    assert asked == ["2.12.0", "2.13.0"]
    megatron.disable()
    assert moe_utils.is_te_min_version is is_te_min_version
    assert megatron.enable()


@pytest.mark.parametrize("num_out_tokens", ["routes", "none"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
def test_permute_and_unpermute(with_probs, num_out_tokens, request):
    """A training round trip through megatron-core: permute, expert work, unpermute (merging the
    probs when permute did not carry them), backward of everything."""
    g = generator_for(request)
    mask, probs = routing(g)
    tokens = tokens_of(g)
    cap = N * K if num_out_tokens == "routes" else None

    def layer(fused, inp, p):
        out, permuted_probs, mapping, *_ = moe_utils.permute(inp, mask, probs=p if with_probs else None,
                                                             num_out_tokens=cap if fused else unfused_cap(cap, mask),
                                                             fused=fused)
        expert_out = out * 2
        if with_probs:
            expert_out = expert_out * permuted_probs[:, None].to(expert_out.dtype)
        restored = moe_utils.unpermute(expert_out, mapping, inp.shape, probs=None if with_probs else p,
                                       routing_map=mask, fused=fused)
        return out, permuted_probs, restored

    (fused, fused_leaves), (plain, plain_leaves) = both(layer, tokens, probs)
    assert_bits_equal(fused[0], plain[0], "permuted tokens")
    if with_probs:
        assert_bits_equal(fused[1], plain[1], "permuted probs")
    close(fused[2], plain[2], "unpermuted")
    grads = [torch.randn(o.shape, generator=g).to(o.dtype).to(DEVICE) for o in plain if o is not None]
    for outs in (fused, plain):
        torch.autograd.backward([o for o in outs if o is not None], grads)
    close(fused_leaves[0].grad, plain_leaves[0].grad, "token grads", TOKEN_GRAD_TOL[tokens.dtype])
    close(fused_leaves[1].grad, plain_leaves[1].grad, "prob grads", PROB_GRAD_TOL)


def unfused_cap(cap, mask):
    """Newer releases' unfused permute needs num_out_tokens; the route count keeps every route."""
    return int(mask.sum()) if cap is None else cap


def test_fp16_tokens_and_int_mask(request):
    """An fp16 model with an integer 0 / 1 routing mask (megatron-core casts it with .bool() unfused)."""
    g = generator_for(request)
    mask, probs = routing(g, num_experts=5, k=3)
    tokens = tokens_of(g, torch.float16)
    fused = moe_utils.permute(tokens, mask.to(torch.int32), probs=probs * mask, fused=True)
    plain = moe_utils.permute(tokens, mask.to(torch.int32), probs=probs * mask, num_out_tokens=unfused_cap(None, mask),
                              fused=False)
    assert_bits_equal(fused[0], plain[0], "permuted tokens")
    assert_bits_equal(fused[1], plain[1], "permuted probs")
    close(moe_utils.unpermute(fused[0], fused[2], tokens.shape, probs=probs, routing_map=mask, fused=True),
          moe_utils.unpermute(plain[0], plain[2], tokens.shape, probs=probs, routing_map=mask), "unpermuted")


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
def test_sort_chunks_by_idxs(with_probs, request):
    """The chunk sort between the all-to-all and the experts: chunks of rows (one per rank and local
    expert) reordered, probs with them."""
    g = generator_for(request)
    split_sizes = torch.tensor([3, 0, 4, 2, 5, 1])
    sorted_idxs = torch.tensor([0, 3, 1, 4, 2, 5])
    rows = int(split_sizes.sum())
    tokens, probs = tokens_of(g, n=rows), torch.rand(rows, generator=g).to(DEVICE)

    def sort(fused, inp, p):
        sizes, order = (split_sizes.to(DEVICE), sorted_idxs.to(DEVICE)) if fused else (split_sizes, sorted_idxs)
        return moe_utils.sort_chunks_by_idxs(inp, sizes, order, probs=p if with_probs else None, fused=fused)

    (fused, fused_leaves), (plain, plain_leaves) = both(sort, tokens, probs)
    assert_bits_equal(fused[0], plain[0], "sorted rows")
    outs = [0]
    if with_probs:
        assert_bits_equal(fused[1], plain[1], "sorted probs")
        outs.append(1)
    grads = [torch.randn(plain[i].shape, generator=g).to(plain[i].dtype).to(DEVICE) for i in outs]
    for result in (fused, plain):
        torch.autograd.backward([result[i] for i in outs], grads)
    assert_bits_equal(fused_leaves[0].grad, plain_leaves[0].grad, "row grads")
    if with_probs:
        assert_bits_equal(fused_leaves[1].grad, plain_leaves[1].grad, "prob grads")


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
def test_sort_chunks_by_an_order_that_moves_nothing(with_probs, request):
    """The dispatcher's order at expert- and tensor-parallel size 1, kept on the host (enable()): the
    fused sort returns the rows themselves (no launch, no copy; the dispatcher never writes into them)
    and the gradients pass through. The order is read on every call: rewritten in its memory behind
    its version counter, the next sort follows it."""
    g = generator_for(request)
    split_sizes, order = torch.tensor([3, 0, 4, 2]), torch.arange(4)
    tokens, probs = tokens_of(g, n=9).requires_grad_(), torch.rand(9, generator=g).to(DEVICE).requires_grad_()
    rows, row_probs = moe_utils.sort_chunks_by_idxs(tokens, split_sizes, order, probs=probs if with_probs else None,
                                                    fused=True)
    assert rows is tokens and (row_probs is probs if with_probs else row_probs is None)
    order.data.copy_(torch.tensor([2, 0, 3, 1]))
    assert order._version == 0
    rows, _ = moe_utils.sort_chunks_by_idxs(tokens, split_sizes, order, fused=True)
    plain, _ = moe_utils.sort_chunks_by_idxs(tokens, split_sizes, order, fused=False)
    assert rows is not tokens
    assert_bits_equal(rows, plain, "rows sorted by the rewritten order")


def test_padding_for_quantization(request):
    """Padding the experts' rows for FP8 GEMMs: megatron-core's pad_routing_map routes extra tokens
    until each expert's count is a multiple of the alignment, and permute keeps every route
    (num_out_tokens = the padded routing map's sum); releases with permute(align_size=) pad in the
    fused kernel instead (moe_permute_and_pad_with_probs), tested where the release has it."""
    g = generator_for(request)
    mask, probs = routing(g, num_tokens=40)
    tokens = tokens_of(g, n=40)
    padded = moe_utils.pad_routing_map(mask, 16)
    probs = probs + padded * 1e-3  # the extra routes carry probs too
    cap = padded.sum()  # a tensor, as megatron-core's dispatcher passes it

    def layer(fused, inp, p):
        out, permuted_probs, mapping, *_ = moe_utils.permute(inp, padded, probs=p, num_out_tokens=cap, fused=fused)
        restored = moe_utils.unpermute(out * permuted_probs[:, None].to(out.dtype), mapping, inp.shape,
                                       routing_map=padded, fused=fused)
        return out, permuted_probs, restored

    (fused, _), (plain, _) = both(layer, tokens, probs)
    assert fused[0].shape[0] % 16 == 0 or int(cap) % 16 != 0
    assert_bits_equal(fused[0], plain[0], "permuted tokens")
    assert_bits_equal(fused[1], plain[1], "permuted probs")
    close(fused[2], plain[2], "unpermuted")
    if "align_size" in inspect.signature(moe_utils.permute).parameters:
        probs = probs * mask
        out, permuted_probs, mapping, pad_offsets, padded_counts = moe_utils.permute(
            tokens, mask, probs=probs, fused=True, tokens_per_expert=mask.sum(0), align_size=128)
        assert bool((padded_counts % 128 == 0).all()) and out.shape[0] == int(padded_counts.sum())
        restored = moe_utils.unpermute(out * permuted_probs[:, None].to(out.dtype), mapping, tokens.shape,
                                       routing_map=mask, fused=True, pad_offsets=pad_offsets)
        plain, plain_probs, plain_mapping, *_ = moe_utils.permute(tokens, mask, probs=probs, fused=False,
                                                                  num_out_tokens=unfused_cap(None, mask))
        close(restored, moe_utils.unpermute(plain * plain_probs[:, None].to(plain.dtype), plain_mapping, tokens.shape,
                                            routing_map=mask, fused=False), "unpermuted after fused padding")


@pytest.mark.skipif(not HAS_CUDA, reason="MoEAlltoAllTokenDispatcher needs CUDA: its constructor makes a "
                    "torch.cuda.Stream(), and with moe_permute_fusion=True it puts its index tensors on "
                    "torch.device('cuda') (megatron-core's token_dispatcher.py)")
def test_alltoall_dispatcher_world_size_one(request):
    """One forward and backward of megatron-core's MoEAlltoAllTokenDispatcher with
    moe_permute_fusion=True, against the same with fusion off: dispatch, expert work, combine."""
    import datetime
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    parallel_state.initialize_model_parallel()
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        g = generator_for(request)
        num_experts, topk = 8, 2
        mask, probs = routing(g, num_tokens=64, num_experts=num_experts, k=topk)
        hidden = tokens_of(g, n=64)
        results = []
        for fused in (True, False):
            config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1,
                                       num_moe_experts=num_experts, moe_router_topk=topk,
                                       moe_token_dispatcher_type="alltoall", moe_permute_fusion=fused,
                                       bf16=True, params_dtype=torch.bfloat16)
            dispatcher = MoEAlltoAllTokenDispatcher(num_experts, list(range(num_experts)), config,
                                                    pg_collection=pg_collection)
            # One rank: its orders move nothing; kept on the host, where the fused sort reads them.
            assert dispatcher.sort_input_by_local_experts.device.type == "cpu"
            assert dispatcher.restore_output_by_local_experts.device.type == "cpu"
            x, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
            rows, row_probs = dispatcher.dispatch_preprocess(x, mask, p)
            rows, row_probs = dispatcher.token_dispatch(rows, row_probs)
            rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(rows, row_probs)
            expert_out = rows * 2 * row_probs[:, None].to(rows.dtype)
            out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(expert_out)))
            out.float().square().sum().backward()
            results.append((rows, out, x.grad, p.grad, tokens_per_expert))
        (rows, out, gx, gp, tpe), (rows_ref, out_ref, gx_ref, gp_ref, tpe_ref) = results
        assert torch.equal(torch.as_tensor(tpe).cpu(), torch.as_tensor(tpe_ref).cpu())
        assert_bits_equal(rows, rows_ref, "dispatched rows")
        close(out, out_ref, "combined")
        close(gx, gx_ref, "token grads", TOKEN_GRAD_TOL[torch.bfloat16])
        close(gp, gp_ref, "prob grads", dict(rtol=2e-2, atol=2e-2))
    finally:
        parallel_state.destroy_model_parallel()
