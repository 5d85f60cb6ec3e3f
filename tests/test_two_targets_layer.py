"""One MoE layer, two targets: the same spec entry's Triton variant (interpreted on the CPU, or on the
GPU) and NKI variant (emulator) in a small mixture-of-experts layer -- router top-k, permute, two
expert matmuls per expert segment, the routes' probs applied to the expert outputs, unpermute, a
loss -- forward and backward once each.

The loss is linear in the layer output, so both targets' backward passes start from the same
gradient: what the kernels move (permuted rows, probs, scales, row maps, segment sizes, gradient
rows) must be bit-identical, and so must everything PyTorch computes from them on the CPU (expert and
router weight gradients, the router probs' gradients; with Triton on a GPU, PyTorch's GPU matmuls
round differently, so those get a tolerance there); only values the kernels sum (the layer output,
the loss, the tokens' gradients) get the summed-value tolerance. Mask and index routing, with padding, and fp8
tokens with block128 and mx32 scales (quantised by the test, dequantised after permute).
"""

from __future__ import annotations

import pytest
import torch

from cases import DEVICE, assert_bits_equal, assert_sum_close, generator_for, load, to_device, variants_for
from reference import permute_ref, quantize_ref

N, H, E, K, F = 24, 64, 4, 2, 32  # tokens, hidden, experts, routes per token, expert ffn width

# Spec entries with both targets: mask and index routing, all padded, two with fp8 tokens and scales.
LAYERS = [name for name in ("probs_pad128_bf16_mask", "probs_pad16_bf16_index", "probs_pad128_fp8e4m3_block128_mask",
                            "probs_pad32_fp8e4m3_mx32_index")
          if name in variants_for("triton") and name in variants_for("nki")]


def quantise(x, scale_kind):
    """x [N, H] bf16 -> (fp8 e4m3 tokens, per-block scales) by the quantising variants' rule (quantize_ref),
    on the CPU: the same bits for both targets."""
    q, scale = quantize_ref(x.cpu(), scale_kind)
    return q.to(x.device), scale.to(x.device)


def dequantise(q, scale, scale_kind):
    cols = 128 if scale_kind == "block128" else 32
    step = scale.float() if scale_kind == "block128" else torch.exp2(scale.float() - 127)
    return (q.float() * step.repeat_interleave(cols, 1)[:, :q.shape[1]]).to(torch.bfloat16)


def layer(mod, x, router, w1, w2, loss_weight, experts, num_out_tokens):
    """Returns (loss, out, the routing and router probs as passed to permute, permute's result). experts [N, K]:
    the router's top-k, picked once on the CPU (a GPU's logits could order near-ties differently)."""
    spec = mod.VARIANT
    gate = (x.float() @ router).gather(1, experts).softmax(-1)
    if spec["routing"] == "mask":
        routing = torch.zeros(x.shape[0], E, dtype=torch.bool, device=x.device).scatter(1, experts, True)
        probs = torch.zeros(x.shape[0], E, device=x.device).scatter(1, experts, gate)
    else:
        routing, probs = experts.to(torch.int32), gate
    probs.retain_grad()
    tokens, scale = (x, None) if spec["scale"] == "none" else quantise(x.detach(), spec["scale"])
    res = mod.permute(tokens, routing, probs, scale, num_experts=E, num_out_tokens=num_out_tokens)
    rows = res.tokens if scale is None else dequantise(res.tokens, res.scale, spec["scale"])
    ends = res.tokens_per_expert.cumsum(0).tolist()
    hidden = torch.cat([torch.nn.functional.silu(rows[a:b] @ w1[e]) @ w2[e]
                        for e, (a, b) in enumerate(zip([0] + ends[:-1], ends))] + [rows[ends[-1]:] * 0])
    out = mod.unpermute(hidden * res.probs[:, None].to(hidden.dtype), res.row_id_map)
    return (out.float() * loss_weight).sum(), out, routing, probs, res


@pytest.mark.parametrize("name", LAYERS)
def test_one_layer_on_both_targets(name, request, poisoned_empty):
    g = generator_for(request)
    x = (torch.randn(N, H, generator=g) * 2).to(torch.bfloat16)
    router = torch.randn(H, E, generator=g) / H ** 0.5
    w1 = (torch.randn(E, H, F, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, F, H, generator=g) / F ** 0.5).to(torch.bfloat16)
    loss_weight = torch.randn(N, H, generator=g)
    experts = (x.float() @ router).topk(K, dim=1).indices
    runs = {}
    for target in ("triton", "nki"):
        mod = load(target, name)
        device = DEVICE if target == "triton" else torch.device("cpu")
        leaves = [t.requires_grad_() for t in to_device(device, x, router, w1, w2)]
        # index routing with a capacity (nothing read back), mask routing without one (the row count read back)
        cap = None if mod.VARIANT["routing"] == "mask" else N * K + E * (mod.VARIANT["pad"] - 1)
        loss, out, routing, probs, res = layer(mod, *leaves, loss_weight.to(device), experts.to(device), cap)
        loss.backward()
        # The reference's permuted probs for this target's own router probs (each device's matmul rounds its way).
        ref_probs = permute_ref(leaves[0].detach(), routing, routing_kind=mod.VARIANT["routing"], num_experts=E,
                                probs=probs.detach(), pad=mod.VARIANT["pad"], num_out_tokens=cap)[1]
        runs[target] = dict(loss=loss.detach(), out=out.detach(), res=res, ref_probs=ref_probs, probs_grad=probs.grad,
                            grads=[t.grad for t in leaves])

    t, n = runs["triton"], runs["nki"]
    tr, nr = t["res"], n["res"]
    assert_bits_equal(tr.tokens, nr.tokens, "permuted tokens")
    for target, run in runs.items():
        assert_bits_equal(run["res"].probs, run["ref_probs"], f"{target}'s permuted probs")
    if DEVICE.type == "cpu":  # the same router probs on both targets
        assert_bits_equal(tr.probs, nr.probs, "permuted probs")
    else:  # each device's router matmul rounds its own way
        torch.testing.assert_close(tr.probs.cpu(), nr.probs, rtol=1e-5, atol=1e-6)
    if nr.scale is not None:
        assert_bits_equal(tr.scale, nr.scale, "permuted scales")
    assert torch.equal(tr.tokens_per_expert.cpu(), nr.tokens_per_expert)
    assert torch.equal(tr.row_id_map.rows_by_column().cpu(), nr.row_id_map.rows_by_column())
    assert_sum_close(t["out"], n["out"], "layer output")
    torch.testing.assert_close(t["loss"].cpu(), n["loss"], rtol=2e-2, atol=2e-2)
    x_grad_t, router_t, w1_t, w2_t = t["grads"]
    x_grad_n, router_n, w1_n, w2_n = n["grads"]
    computed = (("router probs' gradients", n["probs_grad"], t["probs_grad"]), ("router weight gradients", router_n,
                router_t), ("w1 gradients", w1_n, w1_t), ("w2 gradients", w2_n, w2_t))
    for what, got, want in computed:
        if DEVICE.type == "cpu":  # the same PyTorch CPU ops on the same moved data and gradient rows
            assert_bits_equal(want, got, what)
        else:  # PyTorch's own GPU and CPU matmuls round differently
            torch.testing.assert_close(want.cpu(), got, rtol=2e-2, atol=2e-2)
    assert_sum_close(x_grad_t, x_grad_n, "token gradients")
