"""TransformerEngine's permutation API served by permgen (permgen.integrations.te), eagerly and compiled.

Written from TE's documented behaviour: index maps put rows in the order of a stable sort of the
flattened expert ids; mask maps group rows by expert, ascending token; num_out_tokens below the
route count drops the tail; padding rounds each expert's rows up to align_size with zero rows;
unpermute sums each token's rows weighted by merging_probs. Each test runs eagerly and under
torch.compile(fullgraph=True) (backend="aot_eager" on the CPU, where the kernels are interpreted).
A dtype, map type or alignment with no generated variant must raise the registry's LookupError.
"""

import dataclasses

import pytest
import torch

import permgen
from cases import (DEVICE, assert_bits_equal, assert_close, assert_fails_a_device_assertion, check_grads,
                   check_padded_with_probs, compiled_if, expert_ids, generator_for, leaf, routing_from_ids)
from cases import fresh_dynamo  # noqa: F401 (an autouse fixture: each test compiles from a clean dynamo)
from reference import permute_ref, sort_chunks_ref, unpermute_ref

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ["eager", "compiled"]
N, H, E, K = 13, 24, 5, 2


def generated(dtype, routing, probs, pad=0):
    return any(v["dtype"] == dtype and v["routing"] == routing and v["probs"] == probs and v["pad"] == pad
               and v["scale"] == "none" and "triton" in v["targets"] for v in permgen.VARIANTS.values())


def inputs(g, dtype, n=N, columns=E):
    tokens = (torch.randn(n, H, generator=g) * 4).to(DTYPES[dtype]).to(DEVICE)
    ids = expert_ids(n, E, K, g)
    probs = torch.rand(n, columns, generator=g).to(DEVICE)
    return tokens, ids.to(DEVICE), probs


# ---------------------------------------------------------------------------------------------
# Mask maps
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cap", ["all", "dropped"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_map_with_probs(dtype, cap, mode, request):
    """moe_permute_with_probs -> expert work -> moe_unpermute(merging_probs), forward and backward."""
    g = generator_for(request)
    tokens, ids, probs = inputs(g, dtype)
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE)
    num_out_tokens = N * K * 2 // 3 if cap == "dropped" else -1
    if not generated(dtype, "mask", True):
        with pytest.raises(LookupError, match=r"\[\[variant\]\]"):
            permgen.moe_permute_with_probs(tokens, probs, mask, num_out_tokens)
        return

    def layer(inp, p):
        out, permuted_probs, row_id_map = permgen.moe_permute_with_probs(inp, p, mask, num_out_tokens)
        expert_out = out * 2
        unpermuted = permgen.moe_unpermute(expert_out, row_id_map, p, restore_shape=inp.shape)
        return out, permuted_probs, row_id_map, unpermuted

    inp, p = leaf(tokens), leaf(probs)
    out, permuted_probs, row_id_map, unpermuted = compiled_if(mode, layer)(inp, p)
    inp_r, p_r = leaf(tokens), leaf(probs)
    ref_out, ref_probs, _, _, routes = permute_ref(inp_r, mask, routing_kind="mask", num_experts=E, probs=p_r,
                                                   num_out_tokens=None if num_out_tokens < 0 else num_out_tokens)
    ref_unpermuted = unpermute_ref(ref_out * 2, routes, N, p_r)
    assert_bits_equal(out, ref_out, "output")
    assert_bits_equal(permuted_probs, ref_probs, "permuted_probs")
    assert row_id_map.dtype == torch.int32 and row_id_map.shape == (N + 2, 2 * E + 1)
    assert_close(unpermuted, ref_unpermuted, "unpermuted")
    check_grads((out, permuted_probs, unpermuted), (ref_out, ref_probs, ref_unpermuted), (inp, p), (inp_r, p_r), g)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_map_without_probs(dtype, request):
    """moe_permute (no probs) needs a variant without probs: none is generated for mask maps in the
    default spec, and the error says which [[variant]] to add."""
    tokens, ids, _ = inputs(generator_for(request), dtype)
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE)
    if generated(dtype, "mask", False):
        out, row_id_map = permgen.moe_permute(tokens, mask)
        ref_out = permute_ref(tokens, mask, routing_kind="mask", num_experts=E)[0]
        assert_bits_equal(out, ref_out, "output")
        return
    with pytest.raises(LookupError, match=rf'(?s)\[\[variant\]\].*dtype = "{dtype}".*routing = "mask".*probs = false'):
        permgen.moe_permute(tokens, mask)


# ---------------------------------------------------------------------------------------------
# Index maps
# ---------------------------------------------------------------------------------------------

def te_index_order(ids, num_out_tokens):
    """TE's index-map rows: a stable sort of the flattened expert ids; row r holds token order[r] // k."""
    order = torch.argsort(ids.reshape(-1).long(), stable=True)
    return order if num_out_tokens is None else order[:num_out_tokens]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cap", ["all", "dropped"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_index_map(dtype, cap, mode, request):
    """moe_permute(map_type='index') -> moe_unpermute with merging_probs [N, k], and as a plain sum."""
    g = generator_for(request)
    tokens, ids, probs = inputs(g, dtype, columns=K)
    num_out_tokens = N * K * 2 // 3 if cap == "dropped" else -1
    if not generated(dtype, "index", False):
        with pytest.raises(LookupError, match=r"\[\[variant\]\]"):
            permgen.moe_permute(tokens, ids, num_out_tokens, map_type="index")
        return

    def layer(inp, p):
        out, row_id_map = permgen.moe_permute(inp, ids, num_out_tokens, map_type="index")
        merged = permgen.moe_unpermute(out * 2, row_id_map, p, map_type="index")
        routes = permgen.moe_unpermute(out, row_id_map, map_type="index")  # TE: topK = 1 over the N * k routes
        return out, merged, routes

    inp, p = leaf(tokens), leaf(probs)
    out, merged, routes = compiled_if(mode, layer)(inp, p)
    # The reference, from TE's definition: row r is token order[r] // k; unpermute adds each kept row back.
    inp_r, p_r = leaf(tokens), leaf(probs)
    order = te_index_order(ids, None if num_out_tokens < 0 else num_out_tokens)
    token = order // K
    ref_out = inp_r[token]
    weights = p_r.reshape(-1)[order].float()[:, None]
    ref_merged = torch.zeros(N, H, device=DEVICE).index_add(0, token, (ref_out * 2).float() * weights).to(tokens.dtype)
    # Without probs: row s * N + t is the row of token t's route s (zero where dropped).
    slot_major = (order % K) * N + token
    ref_routes = torch.zeros(N * K, H, device=DEVICE).index_add(0, slot_major, ref_out.float()).to(tokens.dtype)
    assert_bits_equal(out, ref_out, "output")
    assert_close(merged, ref_merged, "merged")
    assert_close(routes, ref_routes, "routes")
    check_grads((out, merged, routes), (ref_out, ref_merged, ref_routes), (inp, p), (inp_r, p_r), g)


def test_index_map_expert_count_from_the_routing(request):
    """Eagerly, moe_permute(map_type='index') reads the expert count from the ids, as TE needs none."""
    tokens, ids, _ = inputs(generator_for(request), "bf16", columns=K)
    out, row_id_map = permgen.moe_permute(tokens, ids, map_type="index")
    assert_bits_equal(out, tokens[te_index_order(ids, None) // K], "output")
    experts = int(ids.max()) + 1
    assert row_id_map.shape == (N + 1, N + 2 * experts + 3, K, 1)


# ---------------------------------------------------------------------------------------------
# Padding
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype, align", [("bf16", 128), ("bf16", 16), ("fp16", 128)])
def test_permute_and_pad_with_merging_probs(dtype, align, mode, request):
    """Each expert's rows rounded up to align_size (zero rows); unpermute with pad_offsets and merging probs."""
    g = generator_for(request)
    n, experts = 7, 3
    tokens = (torch.randn(n, H, generator=g) * 4).to(DTYPES[dtype]).to(DEVICE)
    ids = expert_ids(n, experts, K, g)
    mask = routing_from_ids({"routing": "mask"}, ids, experts).to(DEVICE)
    probs = torch.rand(n, experts, generator=g).to(DEVICE)
    tokens_per_expert = mask.sum(0)
    if not generated(dtype, "mask", True, align):
        with pytest.raises(LookupError, match=rf"(?s)\[\[variant\]\].*pad = {align}"):
            permgen.moe_permute_and_pad_with_probs(tokens, probs, mask, tokens_per_expert, align)
        return

    def layer(inp, p):
        out, permuted_probs, row_id_map, pad_offsets, padded = permgen.moe_permute_and_pad_with_probs(
            inp, p, mask, tokens_per_expert, align)
        unpermuted = permgen.moe_unpermute(out * 2, row_id_map, p, restore_shape=inp.shape, pad_offsets=pad_offsets)
        return out, permuted_probs, pad_offsets, padded, unpermuted

    inp, p = leaf(tokens), leaf(probs)
    out, permuted_probs, pad_offsets, padded, unpermuted = compiled_if(mode, layer)(inp, p)
    want_padded = (tokens_per_expert + align - 1) // align * align
    assert padded.dtype == torch.int64 and torch.equal(padded.cpu(), want_padded.cpu())
    pad_rows = want_padded - tokens_per_expert
    assert torch.equal(pad_offsets.cpu(), (torch.cumsum(pad_rows, 0) - pad_rows).cpu())
    check_padded_with_probs((out, permuted_probs, unpermuted), (inp, p), tokens, probs, mask, align, g)


@pytest.mark.parametrize("bad", ["[1]", "[1, E]", "[E - 1]", "float", "bool", "int"])
def test_permute_and_pad_refuses_tokens_per_expert_not_one_count_per_expert(bad, request):
    """tokens_per_expert is an integer tensor [E]: one of another shape would broadcast into pad_offsets
    of the wrong shape or values, and a float one would be rounded into them; both are refused."""
    g = generator_for(request)
    tokens, ids, probs = inputs(g, "bf16")
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE)
    counts = mask.sum(0)
    given = {"[1]": counts[:1], "[1, E]": counts[None], "[E - 1]": counts[:-1], "float": counts.float(),
             "bool": counts > 0, "int": int(counts[0])}[bad]
    error, words = (TypeError, "must be an integer tensor") if bad in ("float", "bool", "int") else \
        (ValueError, rf"must have shape \[{E}\] \(one count per expert of routing_map\), got \[")
    with pytest.raises(error, match=rf"moe_permute_and_pad_with_probs: tokens_per_expert {words}"):
        permgen.moe_permute_and_pad_with_probs(tokens, probs, mask, given, 128)


# ---------------------------------------------------------------------------------------------
# Fewer rows than permute made
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("map_type", ["mask", "index", "padded"])
def test_unpermute_of_fewer_rows_than_permute_made(map_type, request, guarded_empty):
    """TE's row map does not record how many rows permute made, so moe_unpermute may be handed fewer:
    the routes to rows past them count as dropped, forward and backward, and nothing past them is read
    (the rows handed in are the front of a larger tensor whose other rows hold data) or written (the
    tensors the kernels write are the fronts of poisoned buffers, checked afterwards)."""
    g = generator_for(request)
    tokens, ids, probs = inputs(g, "bf16", columns=K if map_type == "index" else E)
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE)
    align = 128 if map_type == "padded" else 0
    if map_type == "index":
        out, row_id_map = permgen.moe_permute(tokens, ids, map_type="index")
        extra = dict(map_type="index")
    elif map_type == "mask":
        out, _, row_id_map = permgen.moe_permute_with_probs(tokens, probs, mask)
        extra = {}
    else:
        out, _, row_id_map, pad_offsets, _ = permgen.moe_permute_and_pad_with_probs(tokens, probs, mask, mask.sum(0),
                                                                                    align)
        extra = dict(pad_offsets=pad_offsets)
    routes = permute_ref(tokens, ids if map_type == "index" else mask, routing_kind="index" if map_type == "index"
                         else "mask", num_experts=E, pad=align)[4]
    # Mask and index: the last few routes' rows are cut. Padded: the cut falls inside the second
    # expert's segment, so its pad rows and all later segments are past the rows handed in.
    rows = int(routes.segment_start[1]) + 1 if map_type == "padded" else routes.num_rows - 5
    assert 0 < rows < out.shape[0] and bool((routes.dst >= rows).any())
    keep = routes.dst < rows
    kept = dataclasses.replace(routes, token=routes.token[keep], col=routes.col[keep], expert=routes.expert[keep],
                               dst=routes.dst[keep], num_rows=rows)
    full = out.detach() * 2  # rows past the cut hold data, not zeros
    inp, p = full[:rows].requires_grad_(), leaf(probs)
    unpermuted = permgen.moe_unpermute(inp, row_id_map, p, restore_shape=tokens.shape, **extra)
    inp_r, p_r = leaf(full[:rows]), leaf(probs)
    ref = unpermute_ref(inp_r, kept, N, p_r)
    assert_close(unpermuted, ref, "unpermuted")
    check_grads((unpermuted,), (ref,), (inp, p), (inp_r, p_r), g)
    assert inp.grad.shape == (rows, H)
    guarded_empty()


# ---------------------------------------------------------------------------------------------
# Empty input, chunk sort, arguments
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_empty_input(mode, request):
    tokens, ids, probs = inputs(generator_for(request), "bf16", n=0)
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE)

    def layer(inp, p):
        out, permuted_probs, row_id_map = permgen.moe_permute_with_probs(inp, p, mask)
        return out, permuted_probs, permgen.moe_unpermute(out, row_id_map, p, restore_shape=inp.shape)

    out, permuted_probs, unpermuted = compiled_if(mode, layer)(tokens, probs)
    assert out.shape == (0, H) and permuted_probs.shape == (0,) and unpermuted.shape == (0, H)
    index_out, row_id_map = permgen.moe_permute(tokens, ids, map_type="index")
    assert index_out.shape == (0, H)
    merged = permgen.moe_unpermute(index_out, row_id_map, torch.rand(0, K, device=DEVICE), map_type="index")
    assert merged.shape == (0, H)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_probs", [False, True], ids=["tokens", "with_probs"])
def test_sort_chunks_by_index(with_probs, mode, request):
    g = generator_for(request)
    split_sizes = torch.tensor([3, 0, 5, 2, 3])
    sorted_idxs = torch.tensor([2, 0, 4, 1, 3])
    tokens = torch.randn(int(split_sizes.sum()), H, generator=g).to(torch.bfloat16).to(DEVICE)
    probs = torch.rand(tokens.shape[0], generator=g).to(DEVICE)
    inp, p = leaf(tokens), leaf(probs)
    if with_probs:
        out, out_probs = compiled_if(mode, permgen.moe_sort_chunks_by_index_with_probs)(inp, p, split_sizes,
                                                                                        sorted_idxs)
        assert_bits_equal(out_probs, sort_chunks_ref(probs, split_sizes, sorted_idxs), "probs")
        (out.float().sum() + out_probs.sum()).backward()
        assert torch.equal(p.grad, torch.ones_like(probs))
    else:
        out = compiled_if(mode, permgen.moe_sort_chunks_by_index)(inp, split_sizes, sorted_idxs)
        out.float().sum().backward()
    assert_bits_equal(out, sort_chunks_ref(tokens, split_sizes, sorted_idxs), "output")
    assert torch.equal(inp.grad, torch.ones_like(tokens))


def test_deprecated_probs_argument(request):
    g = generator_for(request)
    tokens, ids, probs = inputs(g, "bf16")
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE)
    out, _, row_id_map = permgen.moe_permute_with_probs(tokens, probs, mask)
    with pytest.warns(UserWarning, match="deprecated"):
        old = permgen.moe_unpermute(out, row_id_map, probs=probs)
    assert_bits_equal(old, permgen.moe_unpermute(out, row_id_map, merging_probs=probs), "probs= vs merging_probs=")
    with pytest.raises(ValueError, match="Both merging_probs and probs"):
        permgen.moe_unpermute(out, row_id_map, merging_probs=probs, probs=probs)


def test_bad_arguments(request):
    tokens, ids, probs = inputs(generator_for(request), "bf16")
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE)
    with pytest.raises(ValueError, match="map_type"):
        permgen.moe_permute(tokens, mask, map_type="dense")
    with pytest.raises(TypeError, match="dtype"):
        permgen.moe_permute_with_probs(tokens.to(torch.int32), probs, mask)
    out, _, row_id_map = permgen.moe_permute_with_probs(tokens, probs, mask)
    with pytest.raises(ValueError, match="restore_shape"):
        permgen.moe_unpermute(out, row_id_map, probs, restore_shape=(N + 1, H))
    with pytest.raises(TypeError, match="moe_unpermute: row_id_map must be the int32 tensor"):
        permgen.moe_unpermute(out, row_id_map.float())
    with pytest.raises(ValueError, match=r"moe_unpermute: map_type=.mask., but row_id_map \[.*\] is not a mask map \[N \+ 2, 2E \+ 1\]"):
        permgen.moe_unpermute(out, row_id_map.reshape(-1))
    index_out, index_map = permgen.moe_permute(tokens, ids, map_type="index")
    assert index_map.shape == (N + 1, N + 2 * (int(ids.max()) + 1) + 3, K, 1)
    with pytest.raises(ValueError, match="is map_type the one given to moe_permute"):
        permgen.moe_unpermute(index_out, index_map)


# ---------------------------------------------------------------------------------------------
# Misuse: a map read as the other map type, [N, k] ids passed as a mask, forged maps, no variant
# ---------------------------------------------------------------------------------------------

def _bare(t):
    """The same view as a new tensor object: what a caller that rebuilt the map passes (no carried sizes)."""
    return t.as_strided(t.shape, t.stride())


@pytest.mark.parametrize("num_tokens", [127, 126])
def test_unpermute_refuses_an_index_map_read_as_a_mask_map(num_tokens, request):
    """An index map given with map_type left at 'mask' is refused naming map_type: from the map_type
    the map carries, and for a bare tensor from its shape (four dimensions), whatever N is."""
    g = generator_for(request)
    tokens = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16).to(DEVICE)
    ids = expert_ids(num_tokens, 4, 3, g).to(DEVICE)
    out, row_id_map = permgen.moe_permute(tokens, ids, map_type="index")
    with pytest.raises(ValueError, match="moe_unpermute: row_id_map comes from a permute with map_type='index', "
                                         "but map_type='mask' was given"):
        permgen.moe_unpermute(out, row_id_map)
    with pytest.raises(ValueError, match=rf"moe_unpermute: map_type='mask', but row_id_map \[{num_tokens + 1}, "
                                         rf"{num_tokens + 11}, 3, 1\] is not a mask map"):
        permgen.moe_unpermute(out, _bare(row_id_map))
    mask_out, mask_map = permgen.moe_permute(tokens, routing_from_ids({"routing": "mask"}, ids.cpu(), 4).to(DEVICE))
    with pytest.raises(ValueError, match="map_type='mask', but map_type='index' was given"):
        permgen.moe_unpermute(mask_out, mask_map, map_type="index")
    with pytest.raises(ValueError, match=r"map_type='index', but row_id_map .* is not an index map"):
        permgen.moe_unpermute(mask_out, _bare(mask_map), map_type="index")
    assert permgen.moe_unpermute(out, _bare(row_id_map), map_type="index").shape == (num_tokens * 3, H)


# A part of a map (te.py's layouts) -> what it would be read as without the checks: fewer tokens,
# other offsets, fewer experts or slots, another alignment.
_PARTS = {"mask": ["[1:]", "[:-1]", "[:, :-2]", "[2:, 2:]", ".view(-1)[:-2 * E - 1].view(-1, 2 * E + 1)"],
          "padded": ["[:64]", "[:, 1:]", "[:, :-1]", "[:, :, :-2]"],
          "index": ["[:-2]", "[:4]", "[:, :, :1]", "[:, :-2]"]}


@pytest.mark.parametrize("map_type, part", [(m, p) for m, parts in _PARTS.items() for p in parts])
def test_a_part_of_a_map_is_refused(map_type, part, request):
    """A slice or other view of the row_id_map a permute returned (its shape still a map's) is refused,
    by moe_unpermute and route_tallies; the map itself, a view of all of it, and a copy of it are not."""
    g = generator_for(request)
    tokens, ids, probs = inputs(g, "bf16")
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE)
    if map_type == "index":
        out, row_id_map = permgen.moe_permute(tokens, ids, map_type="index")
    elif map_type == "padded":
        out, _, row_id_map, _, _ = permgen.moe_permute_and_pad_with_probs(tokens, probs, mask, mask.sum(0), 128)
    else:
        out, row_id_map = permgen.moe_permute(tokens, mask)
    te_type = "index" if map_type == "index" else "mask"
    sliced = eval("row_id_map" + part)  # noqa: S307 (the parts above)
    with pytest.raises(ValueError, match=r"moe_unpermute: row_id_map .* is a part of the map a permute returned"):
        permgen.moe_unpermute(out, sliced, map_type=te_type)
    with pytest.raises(ValueError, match=r"route_tallies: row_id_map .* is a part of the map a permute returned"):
        permgen.integrations.te.route_tallies(sliced, te_type)
    want = permgen.moe_unpermute(out, row_id_map, map_type=te_type)
    for whole in (_bare(row_id_map), row_id_map.clone()):
        assert_bits_equal(permgen.moe_unpermute(out, whole, map_type=te_type), want, "a whole map")


# check_routes_on_device(True) with a 0 / 1 mask, then with [N, k] expert ids passed as a capped mask.
CAPPED_IDS_AS_A_MASK = """
import sys
import torch
from permgen.integrations import te
device = "cuda" if torch.cuda.is_available() else "cpu"
tokens, ids, mask, cap = torch.load(sys.argv[1])
tokens, ids, mask = tokens.to(device), ids.to(device), mask.to(device)
te.check_routes_on_device(True)
te.moe_permute(tokens, mask, num_out_tokens=cap)
torch.empty(1, device=device).tolist()  # a sync: where a device assertion surfaces
print("the 0 / 1 mask passed", flush=True)
te.moe_permute(tokens, ids, num_out_tokens=cap)
torch.empty(1, device=device).tolist()
"""


def test_expert_ids_passed_as_a_capped_mask_are_counted_and_asserted(request, tmp_path):
    """[N, k] expert ids with map_type left at 'mask' and num_out_tokens: no host read, so they are
    counted on the device as routes without a slot (te.route_tallies), and
    check_routes_on_device(True) fails the call (a device-side assertion: in its own process);
    a 0 / 1 integer mask counts nothing and passes the check."""
    g = generator_for(request)
    tokens, ids, _ = inputs(g, "bf16")
    _, row_id_map = permgen.moe_permute(tokens, ids.long(), num_out_tokens=N * K)
    other = int(((ids != 0) & (ids != 1)).sum())
    assert other > 0 and permgen.integrations.te.route_tallies(row_id_map).tolist() == [other, other]
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE).int()
    _, mask_map = permgen.moe_permute(tokens, mask, num_out_tokens=N * K)
    assert permgen.integrations.te.route_tallies(mask_map).tolist() == [0, 0]
    torch.save((tokens.cpu(), ids.long().cpu(), mask.cpu(), N * K), tmp_path / "inputs.pt")
    assert_fails_a_device_assertion(CAPPED_IDS_AS_A_MASK, "moe_permute: routing_map holds values other than 0 and 1",
                                    str(tmp_path / "inputs.pt"), after="the 0 / 1 mask passed")
    leafed = tokens.float().requires_grad_()  # the count leaves the saved row map usable by backward
    out, row_id_map = permgen.moe_permute(leafed.to(torch.bfloat16), ids.long(), num_out_tokens=N * K)
    out.float().sum().backward()
    assert leafed.grad is not None


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_forged_row_map_costs_no_more_than_a_real_one(map_type, request):
    """A row map whose count words are forged (10**6 routes, offsets far outside the rows) runs no
    longer than a real map of its shape, and reads and writes nothing outside the tensors."""
    import time
    g = generator_for(request)
    tokens, ids, probs = inputs(g, "bf16")
    routing = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE) if map_type == "mask" else ids
    out, row_id_map = permgen.moe_permute(tokens, routing, map_type=map_type)
    forged = row_id_map.clone()
    flat = forged.view(-1) if map_type == "mask" else forged[0].view(-1)
    flat[N * E:] = 10**6  # mask maps: experts, route counts and the segment table; index maps: all past the dst rows
    if map_type == "index":
        flat[N * K:] = -10**6
    start = time.monotonic()
    result = permgen.moe_unpermute(out.clone().requires_grad_(), forged,
                                   probs if map_type == "mask" else probs[:, :K].contiguous(), map_type=map_type)
    result.float().sum().backward()
    assert time.monotonic() - start < 30
    assert result.shape == (N, H)


def test_lookup_error_names_the_te_function(request):
    """No generated variant: the LookupError names the TE function called, and keeps the [[variant]] to paste."""
    align = next(a for a in (2, 4, 8, 16, 32, 64, 128, 256) if not generated("bf16", "mask", True, a))
    g = generator_for(request)
    tokens, ids, probs = inputs(g, "bf16")
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), E).to(DEVICE)
    with pytest.raises(LookupError, match=rf'(?s)^moe_permute_and_pad_with_probs: .*\[\[variant\]\].*pad = {align}'):
        permgen.moe_permute_and_pad_with_probs(tokens, probs, mask, mask.sum(0), align)
