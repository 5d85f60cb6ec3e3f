"""The generated chunk sort of every variant on both targets against torch.split + torch.cat.

`sort_chunks(tokens, split_sizes, sorted_idxs, probs=None)` splits the rows into chunks and
concatenates them in the order sorted_idxs gives (TransformerEngine's moe_sort_chunks_by_index).
Rows are only moved, so outputs and gradients must match exactly; the gradient of a chunk sort is
the inverse sort of the incoming gradient.
"""

import numpy as np
import pytest
import torch

import permgen
from cases import assert_bits_equal, device_of, generator_for, is_fp8, load, make_tokens, variants_for
from permgen.core import ops
from reference import sort_chunks_grad_ref, sort_chunks_ref

HAS_PROBS = {name: v["probs"] for name, v in permgen.VARIANTS.items()}
TARGET_VARIANTS = [(t, n) for t in ("triton", "nki") for n in variants_for(t)]
# A chunk of zero rows, chunks of one row, and an order that moves every chunk.
SPLIT_SIZES = [3, 0, 5, 1, 4, 1]
SORTED_IDXS = [4, 2, 0, 5, 1, 3]


@pytest.mark.parametrize("with_probs", [False, True], ids=["tokens", "with_probs"])
@pytest.mark.parametrize("target, name", TARGET_VARIANTS, ids=[f"{t}-{n}" for t, n in TARGET_VARIANTS])
def test_sort_chunks(target, name, with_probs, request, poisoned_empty):
    if with_probs and not HAS_PROBS[name]:
        pytest.skip("variant without probs")
    mod = load(target, name)
    v = mod.VARIANT
    device = device_of(target)
    g = generator_for(request)
    split_sizes, sorted_idxs = torch.tensor(SPLIT_SIZES), torch.tensor(SORTED_IDXS)
    tokens = make_tokens(v, sum(SPLIT_SIZES), 40, g).to(device)
    probs = torch.rand(tokens.shape[0], generator=g).to(device) if with_probs else None
    differentiable = not is_fp8(v)
    inp = tokens.clone().requires_grad_(differentiable)
    p = None if probs is None else probs.clone().requires_grad_()
    out, out_probs = mod.sort_chunks(inp, split_sizes, sorted_idxs, p)
    assert_bits_equal(out, sort_chunks_ref(tokens, SPLIT_SIZES, SORTED_IDXS), "sorted rows")
    outputs, grads = [], []
    if differentiable:
        outputs.append(out)
        grads.append(torch.randn(out.shape, generator=g).to(out.dtype).to(device))
    if with_probs:
        assert_bits_equal(out_probs, sort_chunks_ref(probs, SPLIT_SIZES, SORTED_IDXS), "sorted probs")
        outputs.append(out_probs)
        grads.append(torch.randn(out_probs.shape, generator=g).to(device))
    else:
        assert out_probs is None
    if not outputs:
        assert not out.requires_grad
        return
    torch.autograd.backward(outputs, grads)
    if differentiable:
        assert_bits_equal(inp.grad, sort_chunks_grad_ref(grads[0], SPLIT_SIZES, SORTED_IDXS), "token grads")
    if with_probs:
        assert_bits_equal(p.grad, sort_chunks_grad_ref(grads[-1], SPLIT_SIZES, SORTED_IDXS), "prob grads")


@pytest.mark.parametrize("target", ["triton", "nki"])
def test_sort_chunks_of_no_rows(target):
    mod = load(target, "probs_bf16_mask")
    tokens = torch.zeros(0, 16, dtype=torch.bfloat16, device=device_of(target))
    out, out_probs = mod.sort_chunks(tokens, torch.tensor([0, 0]), torch.tensor([1, 0]),
                                     torch.zeros(0, device=device_of(target)))
    assert out.shape == (0, 16) and out_probs.shape == (0,)


def test_sort_chunks_checks_its_arguments():
    mod = load("triton", "bf16_index")
    device = device_of("triton")
    tokens = torch.zeros(4, 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="no probs"):
        mod.sort_chunks(tokens, torch.tensor([4]), torch.tensor([0]), torch.zeros(4, device=device))
    with pytest.raises(ValueError, match="one entry per chunk"):
        mod.sort_chunks(tokens, torch.tensor([2, 2]), torch.tensor([0]))
    with pytest.raises(TypeError, match="dtype"):
        mod.sort_chunks(tokens.float(), torch.tensor([4]), torch.tensor([0]))
    with pytest.raises(ValueError, match="non-negative and sum to the 4 rows"):
        mod.sort_chunks(tokens, torch.tensor([5, -1]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="non-negative and sum to the 4 rows"):
        mod.sort_chunks(tokens, torch.tensor([1, 2]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="a permutation of 0..1"):
        mod.sort_chunks(tokens, torch.tensor([2, 2]), torch.tensor([1, 1]))


def random_chunks(g, num_chunks, most_rows):
    """Chunk sizes with empty chunks among them, and a random order of the chunks."""
    sizes = torch.randint(0, most_rows + 1, (num_chunks,), generator=g)
    sizes[torch.rand(num_chunks, generator=g) < 0.3] = 0
    return sizes, torch.randperm(num_chunks, generator=g)


@pytest.mark.parametrize("target", ["triton", "nki"])
@pytest.mark.parametrize("num_chunks", [1, 7, 64])
def test_sort_chunks_random(target, num_chunks, request, poisoned_empty):
    """Random chunk sizes (empty chunks too) and orders, rows and gradients against torch.split + cat."""
    mod = load(target, "probs_bf16_index")
    g = generator_for(request)
    sizes, order = random_chunks(g, num_chunks, 5)
    device = device_of(target)
    tokens = make_tokens(mod.VARIANT, int(sizes.sum()), 24, g).to(device)
    probs = torch.rand(tokens.shape[0], generator=g).to(device)
    inp, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    out, out_probs = mod.sort_chunks(inp, sizes, order, p)
    assert_bits_equal(out, sort_chunks_ref(tokens, sizes.tolist(), order.tolist()), "sorted rows")
    assert_bits_equal(out_probs, sort_chunks_ref(probs, sizes.tolist(), order.tolist()), "sorted probs")
    grad = torch.randn(out.shape, generator=g).to(out.dtype).to(device)
    grad_probs = torch.randn(out_probs.shape, generator=g).to(device)
    torch.autograd.backward((out, out_probs), (grad, grad_probs))
    assert_bits_equal(inp.grad, sort_chunks_grad_ref(grad, sizes.tolist(), order.tolist()), "token grads")
    assert_bits_equal(p.grad, sort_chunks_grad_ref(grad_probs, sizes.tolist(), order.tolist()), "prob grads")


@pytest.mark.parametrize("num_chunks", [0, 1, 5, 1500])  # 1500: more chunks than one step of the table's program
def test_chunk_table_kernel_matches_torch(num_chunks, request, poisoned_empty):
    """The Triton target's one-program chunk table against the torch ops the NKI target uses."""
    mod = load("triton", "bf16_index")
    g = generator_for(request)
    sizes, order = random_chunks(g, num_chunks, 9)
    device = device_of("triton")
    want = permgen.core.ops.chunk_table(sizes, order)
    assert want.shape == (4, num_chunks + 1)
    assert_bits_equal(mod._ops.chunk_sort.kernels.chunk_table(sizes.to(device), order.to(device)).cpu(), want,
                      "chunk table")


@pytest.mark.parametrize("target", ["triton", "nki"])
@pytest.mark.parametrize("sizes", [[2, 1], [3, 9], [-4, 2, 2]], ids=["short", "long", "negative"])
def test_sort_chunks_unchecked_sizes(target, sizes, request, poisoned_empty):
    """Sizes on the device are not read back: rows past the chunks' total, and rows whose source
    would be past the input, are zeros; a negative size counts as empty. Both targets alike."""
    mod = load(target, "probs_bf16_index")
    g = generator_for(request)
    device = device_of(target)
    num_rows = 5
    split_sizes = torch.tensor(sizes)
    order = torch.arange(len(sizes)).flip(0)
    tokens = make_tokens(mod.VARIANT, num_rows, 16, g).to(device)
    probs = torch.rand(num_rows, generator=g).to(device)
    backend = mod._ops.chunk_sort.kernels
    table = backend.chunk_table(split_sizes.to(device), order.to(device))
    out, out_probs = backend.sort_chunks(table, False, tokens, probs)
    starts = [sum(max(x, 0) for x in sizes[:i]) for i in range(len(sizes))]
    source = [r for j in order.tolist() for r in range(starts[j], starts[j] + max(sizes[j], 0))]
    source = torch.tensor((source + [num_rows] * num_rows)[:num_rows])  # num_rows: no source
    moved = source < num_rows
    want = torch.where(moved[:, None], tokens.cpu()[source.clamp(max=num_rows - 1)], 0)
    want_probs = torch.where(moved, probs.cpu()[source.clamp(max=num_rows - 1)], 0)
    assert_bits_equal(out.cpu(), want, "rows")
    assert_bits_equal(out_probs.cpu(), want_probs, "probs")


@pytest.mark.parametrize("target", ["triton", "nki"])
def test_sort_chunks_sizes_that_wrap_int64_are_refused(target):
    """CPU split sizes are checked as Python ints: sizes near 2**62 whose int64 sum wraps to N are refused."""
    mod = load(target, "bf16_index")
    tokens = make_tokens(mod.VARIANT, 4, 16, torch.Generator().manual_seed(0)).to(device_of(target))
    sizes = torch.tensor([2**62, 2**62, 2**62, 2**62 + 4])  # sums to 4 modulo 2**64
    assert int(sizes.sum()) == 4
    with pytest.raises(ValueError, match="split_sizes must be non-negative and sum to the 4 rows"):
        mod.sort_chunks(tokens, sizes, torch.arange(4))


# Device sizes that wrap: their int64 sum, their int32 sum, and a size whose low 32 bits are small.
WRAPPING_SIZES = {"int64-wrap": [2**62, 2**62, 2**62, 2**62 + 5], "int32-wrap": [2**31 - 1, 2**31 - 1, 3, 2],
                  "truncated": [2**62 + 3, 2]}


WRAPPING_TABLES = [pytest.param(sizes, dtype, id=f"{name}-{str(dtype)[6:]}") for name, sizes in WRAPPING_SIZES.items()
                   for dtype in (torch.int64, torch.int32) if dtype == torch.int64 or max(sizes) < 2**31]


@pytest.mark.parametrize("sizes, dtype", WRAPPING_TABLES)
def test_chunk_table_of_wrapping_sizes_matches_torch(sizes, dtype, poisoned_empty):
    """The Triton target's table of device sizes that wrap is the torch ops' (the NKI target's): each
    size cut to 2^31 - 1 and summed without wrapping, each start cut to 2^31 - 1, so both ascend."""
    sizes = torch.tensor(sizes, dtype=dtype)
    order = torch.arange(len(sizes)).flip(0)
    device = device_of("triton")
    want = ops.chunk_table(sizes, order)
    assert (want[0].diff() >= 0).all() and (want[2].diff() >= 0).all()
    got = load("triton", "bf16_index")._ops.chunk_sort.kernels.chunk_table(sizes.to(device), order.to(device))
    assert_bits_equal(got.cpu(), want, "chunk table")


@pytest.mark.parametrize("target", ["triton", "nki"])
@pytest.mark.parametrize("sizes", WRAPPING_SIZES.values(), ids=WRAPPING_SIZES.keys())
def test_sort_chunks_wrapping_device_sizes_stay_in_bounds(target, sizes, request, poisoned_empty):
    """Sizes on the device are not checked, and may wrap in any width: every output row is then a
    row of the input or zeros (nothing is read or written outside the tensors), on both targets."""
    mod = load(target, "probs_bf16_index")
    g = generator_for(request)
    device = device_of(target)
    num_rows = 5
    tokens = make_tokens(mod.VARIANT, num_rows, 16, g).to(device)
    probs = torch.rand(num_rows, generator=g).to(device) + 1
    backend = mod._ops.chunk_sort.kernels
    order = torch.arange(len(sizes)).flip(0)
    table = backend.chunk_table(torch.tensor(sizes).to(device), order.to(device))
    out, out_probs = backend.sort_chunks(table, False, tokens, probs)
    for inverse in (False, True):  # and the backward pass's copy, by the table's other half
        out, out_probs = backend.sort_chunks(table, inverse, tokens, probs)
        assert out.shape == tokens.shape and out_probs.shape == probs.shape
        rows, bits = out.cpu().view(torch.int16), tokens.cpu().view(torch.int16)
        for r in range(num_rows):
            is_input_row = (rows[r] == bits).all(1).any() and bool((probs.cpu() == out_probs.cpu()[r]).any())
            assert is_input_row or (bool((rows[r] == 0).all()) and float(out_probs[r]) == 0), (inverse, r)


# ---------------------------------------------------------------------------------------------
# An order that moves nothing, an order rewritten in memory, and the checks under torch.compile
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("place", ["cpu", "device"])
@pytest.mark.parametrize("target", ["triton", "nki"])
def test_an_order_that_moves_nothing_gives_new_tensors(target, place, request):
    """sorted_idxs 0..C-1: the rows and probs come back equal, in new tensors as TransformerEngine's do:
    writing into them leaves the caller's; the gradients pass through."""
    if place == "device" and device_of(target).type == "cpu":
        pytest.skip("the rows' device is the CPU")
    mod = load(target, "probs_bf16_mask")
    device = device_of(target)
    g = generator_for(request)
    sizes = [3, 0, 5, 2]
    tokens = make_tokens(mod.VARIANT, sum(sizes), 16, g).to(device)
    probs = torch.rand(sum(sizes), generator=g).to(device)
    order_device = device if place == "device" else "cpu"
    sorts = [lambda t, p: mod.sort_chunks(t, torch.tensor(sizes), torch.arange(4, device=order_device), p)]
    if target == "triton":  # TransformerEngine's functions run the Triton target
        sorts.append(lambda t, p: permgen.moe_sort_chunks_by_index_with_probs(
            t, p, torch.tensor(sizes), torch.arange(4, device=order_device)))
    for sort in sorts:
        inp, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        out, out_probs = sort(inp, p)
        assert_bits_equal(out, tokens, "rows")
        assert_bits_equal(out_probs, probs, "probs")
        assert out.data_ptr() != inp.data_ptr() and out_probs.data_ptr() != p.data_ptr()
        grad = torch.randn(out.shape, generator=g).to(out.dtype).to(device)
        grad_probs = torch.randn(out_probs.shape, generator=g).to(device)
        torch.autograd.backward((out, out_probs), (grad, grad_probs))
        assert_bits_equal(inp.grad, grad, "row grads")
        assert_bits_equal(p.grad, grad_probs, "prob grads")
        with torch.no_grad():
            out.fill_(1)
            out_probs.fill_(1)
        assert_bits_equal(inp.detach(), tokens, "the caller's rows")
        assert_bits_equal(p.detach(), probs, "the caller's probs")


# Ways to write into an order tensor: in place (its version counter moves), and paths that leave the
# counter as it was.
WRITES = ["in place", "data", "numpy", "dlpack", "storage"]


def order_written_behind_its_version(how, values, device):
    """An order tensor holding `values` and a function that writes new values into it through `how`."""
    if how == "numpy":
        array = np.array(values, dtype=np.int64)
        return torch.from_numpy(array), lambda new: array.__setitem__(slice(None), new)
    order = torch.tensor(values, device=device)
    aliases = {"in place": lambda: order,
               "data": lambda: order.data,
               "dlpack": lambda: torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(order)),
               "storage": lambda: torch.tensor([], dtype=order.dtype, device=device).set_(order.untyped_storage())}
    return order, lambda new: aliases[how]().copy_(torch.tensor(new))


@pytest.mark.parametrize("how", WRITES)
@pytest.mark.parametrize("place", ["cpu", "device"])
@pytest.mark.parametrize("target", ["triton", "nki"])
def test_an_order_rewritten_in_memory_sorts_by_its_new_values(target, place, how, request):
    """An order tensor that moved nothing, then rewritten in its memory (by paths that do not move its
    version counter too): the next sort follows the new values."""
    if place == "device" and device_of(target).type == "cpu":
        pytest.skip("the rows' device is the CPU")
    if how == "numpy" and place == "device":
        pytest.skip("NumPy arrays are on the CPU")
    mod = load(target, "probs_bf16_mask")
    device = device_of(target)
    g = generator_for(request)
    sizes, new = [3, 0, 5, 2], [2, 0, 3, 1]
    tokens = make_tokens(mod.VARIANT, sum(sizes), 16, g).to(device)
    order_device = device if place == "device" else "cpu"
    order, write = order_written_behind_its_version(how, list(range(len(sizes))), order_device)
    assert_bits_equal(mod.sort_chunks(tokens, torch.tensor(sizes), order)[0], tokens, "rows in order")
    version = order._version
    write(new)
    assert order.tolist() == new and (order._version == version) == (how != "in place")
    assert_bits_equal(mod.sort_chunks(tokens, torch.tensor(sizes), order)[0],
                      sort_chunks_ref(tokens.cpu(), sizes, new).to(device), "rows sorted by the new order")


@pytest.mark.parametrize("target", ["triton", "nki"])
def test_compiled_sort_checks_sizes_and_order(target, request):
    """Under torch.compile(fullgraph=True) split_sizes and sorted_idxs on the CPU are checked as eagerly,
    when the graph runs (the values of one graph's inputs differ from call to call): a repeated or
    missing chunk, sizes not summing to the rows, a negative size are refused with the eager words."""
    mod = load(target, "probs_bf16_mask")
    device = device_of(target)
    g = generator_for(request)
    tokens = make_tokens(mod.VARIANT, 6, 16, g).to(device)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(lambda t, s, o: mod.sort_chunks(t, s, o)[0], fullgraph=True, backend=backend)
    sorts = [mod.sort_chunks, compiled]
    if target == "triton":  # TransformerEngine's functions run the Triton target
        sorts += [permgen.moe_sort_chunks_by_index,
                  torch.compile(permgen.moe_sort_chunks_by_index, fullgraph=True, backend=backend)]
    torch._dynamo.reset()
    try:
        assert_bits_equal(compiled(tokens, torch.tensor([2, 3, 1]), torch.tensor([2, 0, 1])),
                          sort_chunks_ref(tokens.cpu(), [2, 3, 1], [2, 0, 1]).to(device), "compiled sort")
        for sizes, order, words in [([2, 3, 1], [0, 0, 2], "a permutation of 0..2"),
                                    ([2, 3, 2], [2, 1, 0], "non-negative and sum to the 6 rows"),
                                    ([2, 3, 0], [2, 1, 0], "non-negative and sum to the 6 rows"),
                                    ([2, -1, 5], [1, 0, 2], "non-negative and sum to the 6 rows")]:
            for fn in sorts:
                with pytest.raises(ValueError, match=words):
                    fn(tokens, torch.tensor(sizes), torch.tensor(order))
    finally:
        torch._dynamo.reset()
