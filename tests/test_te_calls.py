"""TransformerEngine users' own calls, unchanged, eagerly and under torch.compile(fullgraph=True).

Written from the documentation and signatures of transformer_engine.pytorch.permutation:
- moe_permute(inp, routing_map, num_out_tokens, max_token_num, map_type): mask maps [N, E] (rows
  expert-major, ascending token), index maps [N, k] expert ids (rows: a stable sort of the
  flattened ids). num_out_tokens: the rows of the output; index maps give N * k rows for 0 (and
  below); rows past the routes are zeros here. max_token_num: a workspace hint.
- moe_unpermute(inp, row_id_map, merging_probs, restore_shape, map_type, probs, pad_offsets):
  each token's kept rows summed, weighted by merging_probs; an index map without merging_probs is
  TE's topK = 1 unpermute over the N * k routes (row s * N + t: token t's route s).
- moe_permute_and_pad_with_probs(..., align_size) and moe_unpermute(..., pad_offsets).

The variants these calls need beyond the default spec (fp32 and fp16 maps with and without probs,
a second padded bf16 mask variant, as a team with FP8 and BF16 recipes has) are added the way a
user adds them: a spec edit, generated into a temporary folder, which permgen's registry and TE
functions then serve. Each call runs eagerly and compiled (backend "aot_eager" on the CPU).
"""

import importlib
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import permgen
from cases import (DEVICE, assert_bits_equal, assert_close, assert_fails_a_device_assertion, check_grads,
                   check_padded_with_probs, compiled_if, expert_ids, generator_for, leaf, load, routing_from_ids)
from cases import fresh_dynamo  # noqa: F401 (an autouse fixture: each test compiles from a clean dynamo)
from reference import permute_ref, unpermute_ref

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
H = 16
# The spec edit: what the calls below need on top of the default spec (Triton only: TE's functions run there).
EXTRA_VARIANTS = [
    'dtype = "fp32"\nrouting = "mask"',
    'dtype = "fp32"\nrouting = "mask"\nprobs = false',
    'dtype = "fp16"\nrouting = "mask"\nprobs = false',
    'dtype = "fp16"\nrouting = "index"',
    'dtype = "fp16"\nrouting = "index"\nprobs = false',
    'dtype = "fp32"\nrouting = "index"\nprobs = false',
    'dtype = "bf16"\nrouting = "mask"\npad = 16',
]


@pytest.fixture(scope="module")
def te(tmp_path_factory):
    """permgen.integrations.te serving the variants of the user's spec (the default one and EXTRA_VARIANTS)."""
    from permgen.core import registry

    root = tmp_path_factory.mktemp("te_spec")
    spec = root / "variants.toml"
    spec.write_text((ROOT / "variants.toml").read_text()
                    + "".join(f'\n[[variant]]\n{body}\ntargets = ["triton"]\n' for body in EXTRA_VARIANTS))
    out = root / "generated"
    done = subprocess.run([sys.executable, "-m", "generator", "generate", "--spec", str(spec), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    package = "permgen_te_calls_generated"
    found = importlib.util.spec_from_file_location(package, out / "__init__.py", submodule_search_locations=[str(out)])
    module = importlib.util.module_from_spec(found)
    sys.modules[package] = module
    found.loader.exec_module(module)
    default = registry.GENERATED
    registry.GENERATED = package
    try:
        yield importlib.reload(importlib.import_module("permgen.integrations.te"))
    finally:
        registry.GENERATED = default
        importlib.reload(importlib.import_module("permgen.integrations.te"))


@dataclass(frozen=True)
class Call:
    name: str
    dtype: str
    map_type: str
    N: int
    E: int
    k: int
    num_out_tokens: object  # an int, or "below" / "above" the route count
    with_probs: bool = False  # mask maps: moe_permute_with_probs instead of moe_permute
    max_token_num: int = -1

    def __str__(self):
        return self.name

    def rows_asked(self):
        routes = self.N * self.k
        return {"below": routes - 3, "above": routes + 5}.get(self.num_out_tokens, self.num_out_tokens)


CALLS = [
    Call("mask_fp32_all_probs_e7_k3", "fp32", "mask", N=9, E=7, k=3, num_out_tokens=-1, with_probs=True),
    Call("mask_fp16_below", "fp16", "mask", N=10, E=5, k=2, num_out_tokens="below"),
    Call("mask_bf16_above_probs_k1", "bf16", "mask", N=8, E=3, k=1, num_out_tokens="above", with_probs=True),
    Call("mask_bf16_zero_rows", "bf16", "mask", N=5, E=4, k=2, num_out_tokens=0, with_probs=True),
    Call("mask_empty", "bf16", "mask", N=0, E=4, k=2, num_out_tokens=-1, with_probs=True),
    Call("index_fp16_zero_k8_e9", "fp16", "index", N=6, E=9, k=8, num_out_tokens=0, max_token_num=16),
    Call("index_fp32_below_k1", "fp32", "index", N=9, E=5, k=1, num_out_tokens="below"),
    Call("index_bf16_above_k4", "bf16", "index", N=7, E=6, k=4, num_out_tokens="above"),
    Call("index_bf16_default", "bf16", "index", N=7, E=3, k=2, num_out_tokens=-1),
    Call("index_empty", "bf16", "index", N=0, E=3, k=2, num_out_tokens=-1),
]


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("call", CALLS, ids=str)
def test_te_call(te, call, mode, request):
    g = generator_for(request)
    dtype = DTYPES[call.dtype]
    tokens = (torch.randn(call.N, H, generator=g) * 4).to(dtype).to(DEVICE)
    ids = expert_ids(call.N, call.E, call.k, g)
    mask = routing_from_ids({"routing": "mask"}, ids, call.E)
    routing = (ids if call.map_type == "index" else mask).to(DEVICE)
    probs = torch.rand(call.N, call.k if call.map_type == "index" else call.E, generator=g).to(DEVICE)
    asked = call.rows_asked()

    def layer(inp, p):
        if call.map_type == "index":
            out, row_id_map = te.moe_permute(inp, routing, asked, call.max_token_num, map_type="index")
            merged = te.moe_unpermute(out * 2, row_id_map, p, map_type="index")
            return out, merged, te.moe_unpermute(out, row_id_map, map_type="index")
        if call.with_probs:
            out, permuted_probs, row_id_map = te.moe_permute_with_probs(inp, p, routing, asked)
        else:
            out, row_id_map = te.moe_permute(inp, routing, asked, call.max_token_num)
            permuted_probs = None
        merged = te.moe_unpermute(out * 2, row_id_map, p, restore_shape=inp.shape)
        return out, merged, te.moe_unpermute(out, row_id_map), permuted_probs

    inp, p = leaf(tokens), leaf(probs)
    ours = compiled_if(mode, layer, dynamic=False)(inp, p)

    # TE's row counts: index maps N * k for num_out_tokens <= 0; mask maps every route for -1.
    cap = (asked if asked > 0 else call.N * call.k) if call.map_type == "index" else (None if asked < 0 else asked)
    inp_r, p_r = leaf(tokens), leaf(probs)
    ref_out, ref_probs, _, _, routes = permute_ref(inp_r, routing, routing_kind=call.map_type, num_experts=call.E,
                                                   probs=p_r if call.with_probs else None, num_out_tokens=cap)
    ref_merged = unpermute_ref(ref_out * 2, routes, call.N, p_r)
    if call.map_type == "index":
        # Row s * N + t holds the row of token t's route s, zeros where the route was dropped.
        ref_third = torch.zeros(call.N * call.k, H, dtype=dtype, device=DEVICE).index_put(
            (routes.col * call.N + routes.token,), ref_out[routes.dst])
    else:
        ref_third = unpermute_ref(ref_out, routes, call.N)
    assert_bits_equal(ours[0], ref_out, "output")
    assert_close(ours[1], ref_merged, "merged")
    assert_close(ours[2], ref_third, "unpermuted without merging_probs")
    outputs, refs = list(ours[:3]), [ref_out, ref_merged, ref_third]
    if call.with_probs:
        assert_bits_equal(ours[3], ref_probs, "permuted_probs")
        outputs.append(ours[3])
        refs.append(ref_probs)
    check_grads(outputs, refs, (inp, p), (inp_r, p_r), g)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_pad_offsets_with_several_padded_variants(te, mode, request):
    """bf16 mask variants padded to 16 and to 128 are both generated: moe_unpermute(pad_offsets=...)
    finds the alignment in the row map, with no argument TE lacks (test_te_api pads to 128)."""
    g = generator_for(request)
    n, experts, k, align = 9, 3, 2, 16
    tokens = (torch.randn(n, H, generator=g) * 4).to(torch.bfloat16).to(DEVICE)
    mask = routing_from_ids({"routing": "mask"}, expert_ids(n, experts, k, g), experts).to(DEVICE)
    probs = torch.rand(n, experts, generator=g).to(DEVICE)

    def layer(inp, p):
        out, permuted_probs, row_id_map, pad_offsets, padded = te.moe_permute_and_pad_with_probs(
            inp, p, mask, mask.sum(0), align)
        return out, permuted_probs, te.moe_unpermute(out * 2, row_id_map, p, inp.shape, pad_offsets=pad_offsets)

    inp, p = leaf(tokens), leaf(probs)
    check_padded_with_probs(compiled_if(mode, layer, dynamic=False)(inp, p), (inp, p), tokens, probs, mask, align, g)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_sort_chunks_in_every_dtype(te, mode, request):
    g = generator_for(request)
    split_sizes, sorted_idxs = torch.tensor([2, 0, 3, 1]), torch.tensor([3, 1, 0, 2])
    sort = compiled_if(mode, te.moe_sort_chunks_by_index_with_probs)
    for dtype in DTYPES.values():
        tokens = torch.randn(6, H, generator=g).to(dtype).to(DEVICE)
        probs = torch.rand(6, generator=g).to(DEVICE)
        out, out_probs = sort(tokens, probs, split_sizes, sorted_idxs)
        chunks = torch.split(torch.arange(6), split_sizes.tolist())
        order = torch.cat([chunks[i] for i in sorted_idxs.tolist()]).to(DEVICE)
        assert_bits_equal(out, tokens[order], f"{dtype} rows")
        assert_bits_equal(out_probs, probs[order], f"{dtype} probs")


# ---------------------------------------------------------------------------------------------
# Bad routes are never silent
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["triton", "nki"])
@pytest.mark.parametrize("routing_kind", ["mask", "index"])
def test_dropped_routes_are_counted_on_the_device(target, routing_kind, request):
    """PermuteResult.dropped: the routes past num_out_tokens, plus index ids outside [-1, E) and mask
    routes past the topk hint (RowIdMap.unslotted), counted by permute itself on both targets."""
    g = generator_for(request)
    n, experts, k = 6, 5, 3
    mod = load(target, f"probs_{'fp16' if routing_kind == 'mask' else 'bf16'}_{routing_kind}")
    device = DEVICE if target == "triton" else torch.device("cpu")
    dtype = torch.float16 if routing_kind == "mask" else torch.bfloat16
    tokens = torch.randn(n, H, generator=g).to(dtype).to(device)
    ids = expert_ids(n, experts, k, g)
    if routing_kind == "index":
        ids[0, 0], ids[3, 2], ids[5, 1] = experts, -7, -1  # two ids out of range, one "no route"
        routing, width, bad = ids.to(device), k, 2
        probs = torch.rand(n, k, generator=g).to(device)
        kw = dict(num_experts=experts)
    else:
        routing = routing_from_ids({"routing": "mask"}, ids, experts).to(device)
        routing[1] = True  # a token routed to every expert: past topk=3 by 2
        width, bad = k, experts - k
        probs = torch.rand(n, experts, generator=g).to(device)
        kw = dict(topk=k, check_routing=False)
    routes = int((routing != 0).sum()) if routing_kind == "mask" else int(((ids >= 0) & (ids < experts)).sum())
    slotted = routes - bad if routing_kind == "mask" else routes
    cap = slotted - 4
    res = mod.permute(tokens, routing, probs, num_out_tokens=cap, **kw)
    assert res.dropped.device.type == device.type and res.dropped.dtype == torch.int32
    assert int(res.dropped) == 4 + bad and int(res.row_id_map.unslotted) == bad
    assert res.row_id_map.width == width
    assert int(mod.permute(tokens, routing, probs, num_out_tokens=slotted, **kw).dropped) == bad


ASSERTING_CALL = """
import torch
from permgen.integrations import te
device = "cuda" if torch.cuda.is_available() else "cpu"
tokens = torch.randn(6, 16, device=device).to(torch.bfloat16)
ids = torch.tensor([[0, 1], [2, 3], [1, -3], [0, 2], [3, 1], [2, 0]], device=device)
te.moe_permute(tokens, ids, 12, map_type="index")  # no check asked for: the bad id is only counted
te.check_routes_on_device(True)
te.moe_permute(tokens, ids, 12, map_type="index")
torch.empty(1, device=device).tolist()  # a sync: where a device assertion surfaces
"""


def test_out_of_range_ids_fail_a_device_assertion_when_asked():
    """check_routes_on_device(True): an id outside [-1, E) fails a device-side assertion (in its own process)."""
    assert_fails_a_device_assertion(ASSERTING_CALL, "moe_permute: routing_map holds expert ids outside [-1, E)")


def test_errors_name_the_te_function_and_argument(request):
    g = generator_for(request)
    tokens = torch.randn(7, H, generator=g).to(torch.bfloat16).to(DEVICE)
    ids = expert_ids(7, 6, 2, g).to(DEVICE)
    # [N, k] expert ids handed to a mask map: refused, saying what they look like.
    with pytest.raises(ValueError, match=r"^moe_permute: an integer routing mask must hold only 0 and 1.*"
                                         r"looks like \[N, k\] expert ids"):
        permgen.moe_permute(tokens, ids)
    mask = routing_from_ids({"routing": "mask"}, ids.cpu(), 6).to(DEVICE)
    with pytest.raises(ValueError, match=r"^moe_permute_with_probs: probs must have shape \[7, 6\]"):
        permgen.moe_permute_with_probs(tokens, torch.rand(7, 5, device=DEVICE), mask)
    with pytest.raises(ValueError, match=r"^moe_permute_with_probs: routing_map must have shape \[7, \*\]"):
        permgen.moe_permute_with_probs(tokens, torch.rand(6, 6, device=DEVICE), mask[:6])
    out, _, row_id_map = permgen.moe_permute_with_probs(tokens, torch.rand(7, 6, device=DEVICE), mask)
    with pytest.raises(ValueError, match=r"^moe_unpermute: restore_shape"):
        permgen.moe_unpermute(out, row_id_map, restore_shape=(8, H))
    with pytest.raises(ValueError, match=r"^moe_unpermute: pad_offsets given, but row_id_map comes from a permute "
                                         "without padding"):
        permgen.moe_unpermute(out, row_id_map, pad_offsets=torch.zeros(6, dtype=torch.long, device=DEVICE))
