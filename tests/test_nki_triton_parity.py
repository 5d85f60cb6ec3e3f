"""The Triton and NKI sources of one variant compute the same function: same moved data, bit for
bit, and matching sums, on the same inputs (Triton on the GPU, or under TRITON_INTERPRET=1 on the
CPU as conftest.py sets it; NKI in the emulator)."""

from __future__ import annotations

import importlib
import os
import zlib

import pytest
import torch

import generated
from conftest import DEVICE
from nki_emulator.testing import bits, load_variant, to_numpy, to_torch

BOTH = sorted(n for n, spec in generated.VARIANTS.items() if {"triton", "nki"} <= set(spec["targets"]))
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SUM_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def load_triton(name):
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    try:
        return importlib.import_module(f"generated.triton.{name}")
    except ImportError as err:  # no triton installed
        pytest.skip(f"generated.triton.{name} does not import: {err}")


@pytest.mark.parametrize("name", BOTH)
@pytest.mark.parametrize("num_tokens,hidden,drop", [(1, 72, False), (130, 200, False), (131, 136, True)])
def test_triton_and_nki_agree(name, num_tokens, hidden, drop):
    triton_mod = load_triton(name)
    nki_mod = load_variant(name, "emulator")
    spec = nki_mod.VARIANT
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{num_tokens}/{hidden}/{drop}".encode()))
    num_experts, top_k = 7, 3
    dtype = TORCH_DTYPES[spec["dtype"]]
    combine = torch.bfloat16 if spec["dtype"].startswith("fp8") else dtype
    tokens = (torch.randn(num_tokens, hidden, generator=gen) * 4).to(dtype)
    if spec["routing"] == "index":
        routing = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    else:
        routing = torch.rand(num_tokens, num_experts, generator=gen) < 0.45
    probs = torch.rand(routing.shape, generator=gen) if spec["probs"] else None
    scale = None
    if spec["scale"] == "block128":
        scale = torch.rand(num_tokens, -(-hidden // 128), generator=gen)
    elif spec["scale"] == "mx32":
        scale = torch.randint(0, 256, (num_tokens, -(-hidden // 32)), generator=gen, dtype=torch.uint8)
    num_out_tokens = None
    if drop:
        counts = nki_mod._expert_counts(routing.numpy().astype("int32"), num_experts)  # rows every route needs
        num_out_tokens = int(counts.sum()) * 2 // 3

    on_device = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    t = triton_mod.permute(on_device(tokens), on_device(routing), on_device(probs), on_device(scale),
                           num_experts=num_experts, num_out_tokens=num_out_tokens)
    t = t._replace(tokens=t.tokens.cpu(), tokens_per_expert=t.tokens_per_expert.cpu(),
                   probs=None if t.probs is None else t.probs.cpu(), scale=None if t.scale is None else t.scale.cpu())
    n = nki_mod.permute(to_numpy(tokens), routing.numpy(), None if probs is None else to_numpy(probs),
                        None if scale is None else to_numpy(scale), num_experts=num_experts, num_out_tokens=num_out_tokens)
    assert torch.equal(bits(t.tokens), bits(to_torch(n.tokens)))
    assert torch.equal(t.tokens_per_expert.long(), torch.from_numpy(n.tokens_per_expert))
    if spec["probs"]:
        assert torch.equal(t.probs, to_torch(n.probs))
    if scale is not None:
        assert torch.equal(bits(t.scale), bits(to_torch(n.scale)))

    expert_out = torch.randn(t.tokens.shape, generator=gen).to(combine)
    merging = torch.rand(routing.shape, generator=gen) if spec["probs"] else None
    got_t = triton_mod.unpermute(on_device(expert_out), t.row_id_map, on_device(merging)).cpu()
    got_n = to_torch(nki_mod.unpermute(to_numpy(expert_out), n.row_id_map, None if merging is None else to_numpy(merging)))
    tol = SUM_TOLERANCE[combine]
    torch.testing.assert_close(got_t.float(), got_n.float(), rtol=tol, atol=tol)

    if spec["probs"] and drop:
        # merging_probs=None: both targets sum the routes' rows unweighted, and scatter the gradient unweighted.
        plain_t = triton_mod.unpermute(on_device(expert_out), t.row_id_map, None).cpu()
        plain_n = to_torch(nki_mod.unpermute(to_numpy(expert_out), n.row_id_map, None))
        torch.testing.assert_close(plain_t.float(), plain_n.float(), rtol=tol, atol=tol)

        grad_out = torch.randn(num_tokens, hidden, generator=gen).to(combine)
        leaf = on_device(expert_out).clone().requires_grad_(True)
        triton_mod.unpermute(leaf, t.row_id_map, None).backward(on_device(grad_out))
        rows_n, probs_n = nki_mod.unpermute_backward(to_numpy(grad_out), to_numpy(expert_out), n.row_id_map, None)
        assert probs_n is None
        assert torch.equal(bits(leaf.grad.cpu()), bits(to_torch(rows_n)))
