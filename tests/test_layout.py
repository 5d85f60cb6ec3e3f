"""The row map's layout is stated once per side: permgen.core.results.RowMapLayout for the hosts, one
helper in each shared kernel module for the kernels. These tests check the statements agree:
the offsets themselves, and the words a real permute writes where the layout says they are."""

import pytest
import torch
import triton
import triton.language as tl

from cases import DEVICE, device_of, generator_for, load
from permgen.nki import kernels as nki_kernels
from permgen.triton import kernels as triton_kernels
from permgen.core.results import RowMapLayout

SHAPES = [(0, 1, 1), (5, 2, 7), (23, 5, 7), (64, 8, 256)]  # N, W, E


@triton.jit
def _parts_kernel(words_ptr, out_ptr, num_tokens, K: tl.constexpr, E: tl.constexpr, MASK: tl.constexpr):
    """words[i] = i: what each helper's pointer loads is its offset in words."""
    dst, offsets, counts = triton_kernels.row_map_parts(words_ptr, num_tokens, K, E, MASK)
    tl.store(out_ptr + 0, tl.load(dst))
    tl.store(out_ptr + 1, tl.load(offsets))
    tl.store(out_ptr + 2, tl.load(counts))
    if MASK:
        experts, route_counts = triton_kernels.token_routes(words_ptr, num_tokens, K)
        tl.store(out_ptr + 3, tl.load(experts))
        tl.store(out_ptr + 4, tl.load(route_counts))


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "index"])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_helpers_agree(shape, mask):
    num_tokens, width, num_experts = shape
    layout = RowMapLayout(mask, num_tokens, width, num_experts)
    words = torch.arange(layout.end, dtype=torch.int32, device=DEVICE)
    out = torch.full((5,), -7, dtype=torch.int32, device=DEVICE)
    _parts_kernel[(1,)](words, out, num_tokens, K=width, E=num_experts, MASK=mask)
    want = [layout.dst_rows, layout.segment_offsets, layout.segment_counts]
    if mask:
        want += [layout.experts, layout.route_counts]
    assert out[:len(want)].tolist() == want


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "index"])
@pytest.mark.parametrize("shape", SHAPES)
def test_nki_helpers_agree(shape, mask):
    num_tokens, width, num_experts = shape
    layout = RowMapLayout(mask, num_tokens, width, num_experts)
    assert nki_kernels.segments_at(num_tokens, width, mask) == layout.segment_offsets
    assert nki_kernels.row_map_words(num_tokens, width, num_experts, mask) == layout.route_tallies
    if mask:
        assert nki_kernels.experts_at(num_tokens, width) == layout.experts
        assert nki_kernels.route_counts_at(num_tokens, width) == layout.route_counts


@pytest.mark.parametrize("target", ["triton", "nki"])
@pytest.mark.parametrize("name", ["probs_bf16_mask", "probs_pad16_bf16_index"])
def test_permute_writes_where_the_layout_says(target, name, request):
    """A permute's row map read at RowMapLayout's offsets: segment offsets that ascend to the rows in
    use, the tokens_per_expert they imply, routed counts that sum to the live routes, no route dropped."""
    mod = load(target, name)
    g = generator_for(request)
    num_tokens, num_experts, k = 11, 5, 2
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(num_tokens)])
    tokens = torch.randn(num_tokens, 8, generator=g).to(torch.bfloat16)
    if mod.VARIANT["routing"] == "mask":
        routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, ids, True)
    else:
        routing = ids.to(torch.int32)
    probs = torch.rand(routing.shape, generator=g)
    device = device_of(target)
    res = mod.permute(tokens.to(device), routing.to(device), probs.to(device), num_experts=num_experts)
    rim = res.row_id_map
    words = rim.row_map.cpu()
    layout = rim.layout
    assert words.numel() == layout.words
    offsets = words[layout.segment_offsets:layout.segment_offsets + num_experts + 1]
    assert offsets[0] == 0 and offsets[-1] == res.tokens.shape[0]
    assert torch.equal((offsets[1:] - offsets[:-1]).long(), res.tokens_per_expert.cpu())
    counts = words[layout.segment_counts:layout.segment_counts + num_experts]
    assert torch.equal(counts.long(), torch.bincount(ids.reshape(-1), minlength=num_experts))
    assert words[layout.route_tallies:layout.end].tolist() == [0, 0]
    if layout.mask:
        assert torch.equal(words[layout.route_counts:layout.route_counts + num_tokens], torch.full((num_tokens,), k,
                                                                                                 dtype=torch.int32))
