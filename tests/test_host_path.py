"""The host path of the calls users make: how far a TransformerEngine-style call travels through
permgen before its first launch, and (on a GPU) how many host reads each call makes."""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cases import DEVICE, HAS_CUDA, generator_for, host_reads
import permgen
from permgen import moe_permute, moe_permute_with_probs, moe_sort_chunks_by_index, moe_unpermute  # noqa: E402
from permgen.triton import host as triton_host

PERMGEN = str(Path(permgen.__file__).parent)
N, H, E, K = 32, 16, 8, 2


def inputs(g):
    ids = torch.rand(N, E, generator=g).topk(K, dim=1).indices
    mask = torch.zeros(N, E, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.rand(N, E, generator=g) * mask
    tokens = torch.randn(N, H, generator=g).to(torch.bfloat16)
    return tokens.to(DEVICE), mask.to(DEVICE), probs.to(DEVICE), ids.to(torch.int32).to(DEVICE)


def files_before_first_launch(call):
    """The permgen files a call enters, in order, until its first kernel launch (runs of one file
    collapsed)."""
    files, launched = [], []

    def profile(frame, event, arg):
        if launched or event != "call":
            return
        code = frame.f_code
        if code is triton_host.Launch.__call__.__code__:
            launched.append(True)
        elif code.co_filename.startswith(PERMGEN):
            name = os.path.relpath(code.co_filename, PERMGEN)
            if not files or files[-1] != name:
                files.append(name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert launched, "the call launched nothing"
    return files


@pytest.mark.parametrize("call", ["moe_permute", "moe_permute_num_out_tokens", "moe_permute_with_probs",
                                  "moe_permute_index", "moe_unpermute", "moe_sort_chunks_by_index"])
def test_te_call_goes_straight_to_its_launch(call, request):
    """A call like one already made reaches its first launch through at most 4 files, never coming back
    to a layer (a subpackage: integrations, core, triton) it left. Within the core, the dense ops call the
    op layer (permgen.core.oplayer: check memo, call routing) and go on."""
    tokens, mask, probs, ids = inputs(generator_for(request))
    _, row_id_map = permgen.moe_permute(tokens, mask, num_out_tokens=N * K)
    split = torch.full((E,), N * K // E, device=DEVICE)
    rows, order = tokens.repeat(K, 1), torch.arange(E, device=DEVICE).flip(0)
    calls = {
        "moe_permute": lambda: moe_permute(tokens, mask),
        "moe_permute_num_out_tokens": lambda: moe_permute(tokens, mask, num_out_tokens=N * K),
        "moe_permute_with_probs": lambda: moe_permute_with_probs(tokens, probs, mask, num_out_tokens=N * K),
        "moe_permute_index": lambda: moe_permute(tokens, ids, map_type="index"),
        "moe_unpermute": lambda: moe_unpermute(rows, row_id_map, restore_shape=tokens.shape),
        "moe_sort_chunks_by_index": lambda: moe_sort_chunks_by_index(rows, split, order),
    }
    calls[call]()  # the first call checks and plans; the path measured is every later one's
    files = files_before_first_launch(calls[call])
    assert len(set(files)) <= 4, files
    layers = [os.path.dirname(name) for name in files]
    layers = [layer for i, layer in enumerate(layers) if i == 0 or layers[i - 1] != layer]
    assert len(set(layers)) == len(layers), f"comes back to a layer it left: {files}"


def _host_reads(call):
    """The host reads of a call made like one before it."""
    call()
    torch.cuda.synchronize()
    return host_reads(call)


@pytest.mark.skipif(not HAS_CUDA, reason="host reads are counted on a GPU (torch.cuda.set_sync_debug_mode)")
def test_host_reads_are_those_transformer_engine_makes(request):
    """num_out_tokens=-1: one read (the rows in use, and the routing check with them); num_out_tokens
    given: none; index maps without an expert count: one (max id + 1); unpermute and the chunk sort
    on device sizes and order: none (an order on the device is never read, not even to know whether it
    moves anything); dropless dispatch: one."""
    tokens, mask, probs, ids = inputs(generator_for(request))
    out, row_id_map = permgen.moe_permute(tokens, mask, num_out_tokens=N * K)
    split = torch.full((E,), N * K // E, device=DEVICE)
    in_order, reversed_order = torch.arange(E, device=DEVICE), torch.arange(E, device=DEVICE).flip(0)
    expected = {
        "moe_permute bool mask, -1": (lambda: permgen.moe_permute(tokens, mask), 1),
        "moe_permute int32 mask, -1": (lambda: permgen.moe_permute(tokens, mask.int()), 1),
        "moe_permute_with_probs, -1": (lambda: permgen.moe_permute_with_probs(tokens, probs, mask), 1),
        "moe_permute, num_out_tokens": (lambda: permgen.moe_permute(tokens, mask, num_out_tokens=N * K), 0),
        "moe_permute_with_probs, num_out_tokens": (
            lambda: permgen.moe_permute_with_probs(tokens, probs, mask, num_out_tokens=N * K), 0),
        "moe_permute index": (lambda: permgen.moe_permute(tokens, ids, map_type="index"), 1),
        "moe_unpermute": (lambda: permgen.moe_unpermute(out, row_id_map, restore_shape=tokens.shape), 0),
        "moe_sort_chunks_by_index": (lambda: permgen.moe_sort_chunks_by_index(out, split, reversed_order), 0),
        "moe_sort_chunks_by_index in order": (lambda: permgen.moe_sort_chunks_by_index(out, split, in_order), 0),
        "moe_sort_chunks_by_index, a new order": (
            lambda: permgen.moe_sort_chunks_by_index(out, split, torch.arange(E, device=DEVICE)), 0),
    }
    got = {name: _host_reads(call) for name, (call, _) in expected.items()}
    assert got == {name: reads for name, (_, reads) in expected.items()}


@pytest.mark.skipif(not HAS_CUDA, reason="host reads are counted on a GPU; NCCL runs there")
def test_dropless_dispatch_reads_once(request):
    tokens, mask, probs, _ = inputs(generator_for(request))
    mod = permgen.get_kernel("triton", dtype="bf16", routing="mask", probs=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = dist.new_group(backend="nccl") if dist.is_initialized() else None
    if group is None:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        group = dist.group.WORLD
    try:
        assert _host_reads(lambda: mod.dispatch(tokens, mask, probs, group=group)) == 1
        handle = mod.dispatch(tokens, mask, probs, group=group, recv_capacity=N * K)
        assert _host_reads(lambda: mod.combine(handle.tokens, handle.handle, probs)) == 0
    finally:
        if group is dist.group.WORLD:
            dist.destroy_process_group()


@pytest.mark.parametrize("target", ["triton", "nki"])
def test_chunk_sort_in_order_moves_nothing(target, request, monkeypatch):
    """sorted_idxs 0..C-1 on the CPU (Megatron's order at expert- and tensor-parallel size 1, once
    permgen.integrations.megatron keeps it there; read on every call, no device sync): nothing launches.
    The rows come back copied, or as they are (the same tensors) for a caller that asks: megatron-core's
    dispatcher, which never writes into them. The gradients pass through."""
    mod = permgen.get_kernel(target, dtype="bf16", routing="mask", probs=True)
    device = DEVICE if target == "triton" else torch.device("cpu")
    g = generator_for(request)
    sizes = [3, 0, 5, 2]
    tokens = torch.randn(sum(sizes), H, generator=g).to(torch.bfloat16).to(device).requires_grad_()
    probs = torch.rand(sum(sizes), generator=g).to(device)
    split, order = torch.tensor(sizes), torch.arange(len(sizes))
    chunk_sort = mod._ops.chunk_sort
    with monkeypatch.context() as patches:
        for method in ("chunk_table", "sort_chunks"):
            patches.setattr(chunk_sort.kernels, method,
                            lambda *a, **k: pytest.fail("a launch for an order that moves nothing"))
        out, out_probs = mod.sort_chunks(tokens, split, order, probs)
        assert out is not tokens and out_probs is not probs
        assert torch.equal(out, tokens) and torch.equal(out_probs, probs)
        same, same_probs = chunk_sort.sort("sort", tokens, split, order, probs, alias_in_order=True)
        assert same is tokens and same_probs is probs
    (out.float().sum() + same.float().sum()).backward()
    assert torch.equal(tokens.grad, torch.full_like(tokens.grad, 2))


def test_one_rank_dispatch_makes_no_collective(request, monkeypatch):
    """With one rank, dispatch and combine (both modes, forward and backward) start no collective:
    the rows would only be copied to themselves. They still give permute's rows and unpermute's sums."""
    tokens, mask, probs, _ = inputs(generator_for(request))
    mod = permgen.get_kernel("triton", dtype="bf16", routing="mask", probs=True)
    fresh = not dist.is_initialized()
    if fresh:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if HAS_CUDA else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    group = dist.new_group(ranks=[0])
    collectives = []
    for name in ("all_to_all_single", "all_gather", "all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, lambda *a, name=name, **k: collectives.append(name))
    try:
        want = mod.permute(tokens, mask, probs)
        want_sum = mod.unpermute(want.tokens * 2, want.row_id_map, probs)
        for capacity in (None, N * K):
            t, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
            got = mod.dispatch(t, mask, p, group=group, recv_capacity=capacity)
            assert torch.equal(got.tokens[:want.tokens.shape[0]].view(torch.int16), want.tokens.view(torch.int16))
            assert torch.equal(got.probs[:want.probs.shape[0]], want.probs)
            combined = mod.combine(got.tokens * 2, got.handle, p)
            assert torch.equal(combined.view(torch.int16), want_sum.view(torch.int16))
            combined.float().sum().backward()
            assert t.grad is not None and p.grad is not None
        assert collectives == [], collectives
    finally:
        monkeypatch.undo()
        dist.destroy_process_group(group)
        if fresh:
            dist.destroy_process_group()
