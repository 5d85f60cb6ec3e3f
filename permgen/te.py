"""TransformerEngine's permutation functions, served by the generated Triton variants.

    from permgen import moe_permute, moe_permute_with_probs, moe_unpermute   # instead of
    from transformer_engine.pytorch import moe_permute, ...                  # this

Same function names, arguments and return structures as `transformer_engine.pytorch.permutation`.
Each call picks the generated variant for the input's dtype, the map type, whether probs are
permuted and the alignment; when none is generated, the registry's LookupError names the
`[[variant]]` to add to variants.toml. The functions are differentiable and trace under
`torch.compile(fullgraph=True)` (the variants' ops are torch.library custom ops).

`row_id_map` is an int32 tensor, as in TE, but it holds permgen's row map (permgen.results):
    mask maps   [N + 1, 2E + 1]  the row map of a permute without a topk hint, viewed 2-D; the
                                 shape gives N and E (TE's mask row_id_map is [N, 2E + 1])
    index maps  [N + 2E + 1, k]  the row map as it is allocated (permgen.results.row_map_words);
                                 the shape gives k, and N (from merging_probs [N, k] or
                                 restore_shape, as TE takes it) gives E
Pass it only to this module's moe_unpermute. The README's "Coming from TransformerEngine" lists
every remaining difference.
"""

from __future__ import annotations

import warnings

import torch

from .contract import AXES, TOKEN_DTYPE_NAMES
from .registry import get_kernel, variants

# torch dtype -> the dtype axis of the variants that move it
_DTYPES = {getattr(torch, name): axis for axis, name in TOKEN_DTYPE_NAMES.items()}
_MAP_TYPES = ("mask", "index")


def _dtype_axis(t: torch.Tensor) -> str:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"inp must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"inp has dtype {t.dtype}; the variants move {', '.join(map(str, _DTYPES))}")
    return _DTYPES[t.dtype]


def _check_map_type(map_type):
    if map_type not in _MAP_TYPES:
        raise ValueError(f"map_type should be one of 'mask' or 'index', got {map_type!r}")


def _load_modules() -> dict:
    """(dtype, routing, probs, pad) -> the generated Triton module of every variant without scales.

    Loaded once, when this module is imported: torch.compile then traces a dict lookup, never an import."""
    modules = {}
    for name, v in variants().items():
        if "triton" in v["targets"] and v["scale"] == "none" and v["quantize"] == "none":
            axes = (v["dtype"], v["routing"], v["probs"], v["pad"])
            modules[axes] = get_kernel("triton", **dict(zip(("dtype", "routing", "probs", "pad"), axes)))
    return modules


_MODULES = _load_modules()


def _module(dtype: str, routing: str, probs: bool, pad: int):
    """The generated Triton module (LookupError naming the [[variant]] to add when there is none)."""
    mod = _MODULES.get((dtype, routing, probs, pad))
    if mod is None:
        return get_kernel("triton", dtype=dtype, routing=routing, probs=probs, scale="none", pad=pad)
    return mod


def _unpermute_module(dtype: str, routing: str, merging: bool, padded: bool, align_size):
    """The module whose unpermute reads the row map: any variant with the same map type, dtype and
    padding lays rows out the same way; merging_probs need one with probs. A padded row map needs
    the variant's pad: its backward pass zeroes the pad rows."""
    pad = 0
    if padded:
        pads = sorted({p for (d, r, probs, p) in _MODULES
                       if p and d == dtype and r == routing and (probs or not merging)})
        if align_size is not None:
            pads = [align_size]
        if len(pads) != 1:
            raise ValueError(f"pad_offsets given: {'several' if pads else 'no'} padded {dtype} {routing} variants "
                             f"({pads}); pass align_size= the align_size given to moe_permute_and_pad_with_probs")
        pad = pads[0]
    if not merging and (dtype, routing, False, pad) in _MODULES:
        return _MODULES[(dtype, routing, False, pad)]
    return _module(dtype, routing, True, pad)  # a variant with probs also sums without merging_probs


def _cap(num_out_tokens, map_type):
    """TE's num_out_tokens: -1 keeps every route (index maps: any value <= 0, as TE's index path)."""
    if isinstance(num_out_tokens, bool) or not isinstance(num_out_tokens, int):
        raise TypeError(f"num_out_tokens must be an int, got {num_out_tokens!r}")
    if num_out_tokens < 0 or (map_type == "index" and num_out_tokens == 0):
        return None
    return num_out_tokens


def _num_experts(routing_map, num_experts):
    """Index maps: TE takes no expert count; permgen's row map has one segment per expert."""
    if num_experts is not None:
        return num_experts
    if torch.compiler.is_compiling():
        raise ValueError("moe_permute(map_type='index') under torch.compile needs num_experts=E: without it the "
                         "expert count is read from the routing map (a host sync)")
    return int(routing_map.max()) + 1 if routing_map.numel() else 1


def _te_row_id_map(res, map_type):
    rim = res.row_id_map
    if map_type == "mask":
        return rim.row_map.view(rim.num_tokens + 1, 2 * rim.num_experts + 1)
    return rim.row_map.view(-1, rim.width)


def _permute(inp, routing_map, probs, num_out_tokens, map_type, pad=0, num_experts=None):
    dtype = _dtype_axis(inp)
    _check_map_type(map_type)
    mod = _module(dtype, map_type, probs is not None, pad)
    if map_type == "index":
        num_experts = _num_experts(routing_map, num_experts)
    return mod.permute(inp, routing_map, probs, num_experts=num_experts,
                       num_out_tokens=_cap(num_out_tokens, map_type))


def moe_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1, map_type="mask", *, num_experts=None):
    """Permute the tokens by the routing map: rows grouped by expert, ascending token within one.

    inp [N, H]; routing_map: [N, E] mask (bool or integer, nonzero = routed) for map_type 'mask',
    [N, k] expert ids (int32/int64) for 'index'. num_out_tokens: rows to keep (-1: all routes);
    the routes past it are dropped. max_token_num: TE's workspace hint, unused (no workspace).
    num_experts (permgen, index maps only): the expert count; without it, max id + 1 is read from
    the routing map, which torch.compile cannot trace.
    Returns (output [num_out_tokens, H], row_id_map)."""
    if isinstance(max_token_num, bool) or not isinstance(max_token_num, int):
        raise TypeError(f"max_token_num must be an int, got {max_token_num!r}")
    res = _permute(inp, routing_map, None, num_out_tokens, map_type, num_experts=num_experts)
    return res.tokens, _te_row_id_map(res, map_type)


def moe_permute_with_probs(inp, probs, routing_map, num_out_tokens=-1):
    """Permute tokens and their probs by a [N, E] routing mask.

    probs [N, E]: each row's prob moves with it. Returns (output, permuted_probs [rows], row_id_map)."""
    res = _permute(inp, routing_map, probs, num_out_tokens, "mask")
    return res.tokens, res.probs, _te_row_id_map(res, "mask")


def moe_permute_and_pad_with_probs(inp, probs, routing_map, tokens_per_expert, align_size):
    """moe_permute_with_probs with each expert's rows padded to a multiple of align_size (zero rows).

    tokens_per_expert [E]: the routes of each expert (as TE, used for pad_offsets; the rows come
    from the routing map). Returns (output, permuted_probs, row_id_map, pad_offsets [E] int64:
    the pad rows before each expert's segment, padded_tokens_per_expert [E] int64)."""
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise TypeError(f"tokens_per_expert must be a tensor [E], got {type(tokens_per_expert).__name__}")
    res = _permute(inp, routing_map, probs, -1, "mask", pad=align_size)
    padded = res.tokens_per_expert
    pad_rows = padded - tokens_per_expert.to(device=padded.device, dtype=padded.dtype)
    pad_offsets = torch.cumsum(pad_rows, 0) - pad_rows
    return res.tokens, res.probs, _te_row_id_map(res, "mask"), pad_offsets, padded


def moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask", probs=None,
                  pad_offsets=None, *, align_size=None):
    """Sum each token's permuted rows back into one row, weighted by merging_probs when given.

    inp [rows, H]: the experts' outputs in permuted order (fewer rows than permute made: the routes
    to the rows past them count as dropped); row_id_map: from this module's permute functions;
    merging_probs: [N, E] (mask) / [N, k] (index) probs or None (plain sum); restore_shape: (N, H),
    checked; index maps without merging_probs need it for N; probs: TE's old name of merging_probs;
    pad_offsets: from moe_permute_and_pad_with_probs (selects the padded variant); align_size
    (permgen): which padded variant, when several are generated. Returns [N, H], accumulated in fp32."""
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("Both merging_probs and probs kwarg are provided. probs is deprecated.")
        warnings.warn("probs kwarg is deprecated. Use merging_probs kwarg instead.")
        merging_probs = probs
    dtype = _dtype_axis(inp)
    _check_map_type(map_type)
    if not isinstance(row_id_map, torch.Tensor) or row_id_map.dtype != torch.int32 or row_id_map.dim() != 2:
        raise TypeError("row_id_map must be the 2-D int32 tensor returned by permgen's moe_permute functions")
    mod = _unpermute_module(dtype, map_type, merging_probs is not None, pad_offsets is not None, align_size)
    row_map = row_id_map.reshape(-1)
    if map_type == "mask":
        if row_id_map.shape[1] % 2 == 0:
            raise ValueError(f"row_id_map of a mask map must be [N + 1, 2E + 1], got {list(row_id_map.shape)}")
        num_tokens, num_experts = row_id_map.shape[0] - 1, (row_id_map.shape[1] - 1) // 2
        width = columns = num_experts
    else:
        if merging_probs is not None:
            num_tokens = merging_probs.shape[0]
        elif restore_shape is not None:
            num_tokens = restore_shape[0]
        else:
            raise ValueError("moe_unpermute(map_type='index') without merging_probs needs restore_shape=(N, H)")
        width = columns = row_id_map.shape[1]
        num_experts = (row_id_map.shape[0] - num_tokens - 1) // 2
        if num_experts < 1 or num_tokens + 2 * num_experts + 1 != row_id_map.shape[0]:
            raise ValueError(f"row_id_map is {list(row_id_map.shape)}, which no index map of {num_tokens} tokens has "
                             f"([N + 2E + 1, k]); pass the merging_probs (or restore_shape) of its permute")
    # The routing columns only give the probs' shape to the checks: a view, no allocation.
    routing = row_map[0].expand(num_tokens, columns)
    rim = mod._ops._row_id_map(row_map, num_tokens, width, num_experts, inp.shape[0], routing)
    return mod.unpermute(inp, rim, merging_probs, restore_shape)


# ---------------------------------------------------------------------------------------------
# Chunk sort
# ---------------------------------------------------------------------------------------------

_AXES = tuple(a for a in AXES if a != "targets")  # the axes get_kernel looks a variant up by


def _load_chunk_sort_modules() -> dict:
    """(dtype, probs) -> a generated Triton module whose chunk sort moves that dtype (with probs: and
    probs). Every variant has one; the first by name serves its dtype."""
    known = variants()
    modules = {}
    for name in sorted(known):
        v = known[name]
        if "triton" in v["targets"]:
            modules.setdefault((v["dtype"], v["probs"]), get_kernel("triton", **{a: v[a] for a in _AXES}))
    return modules


_CHUNK_SORT_MODULES = _load_chunk_sort_modules()


def _chunk_sort_module(inp, with_probs: bool):
    dtype = _dtype_axis(inp)
    mod = _CHUNK_SORT_MODULES.get((dtype, with_probs))
    if mod is None and not with_probs:  # a variant with probs sorts rows alone too
        mod = _CHUNK_SORT_MODULES.get((dtype, True))
    if mod is None:
        return get_kernel("triton", dtype=dtype, routing="mask", probs=with_probs)
    return mod


def moe_sort_chunks_by_index(inp, split_sizes, sorted_idxs):
    """Split inp's rows [N, H] into chunks of split_sizes (they sum to N) and concatenate the chunks
    in the order of sorted_idxs. The generated chunk sort kernel of a variant with inp's dtype;
    differentiable. Returns output [N, H]."""
    return _chunk_sort_module(inp, False).sort_chunks(inp, split_sizes, sorted_idxs)[0]


def moe_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_idxs):
    """moe_sort_chunks_by_index, moving probs [N] with their rows. Returns (output, permuted_probs)."""
    return _chunk_sort_module(inp, True).sort_chunks(inp, split_sizes, sorted_idxs, probs)


__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"]
