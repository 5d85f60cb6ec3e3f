"""TransformerEngine's permutation functions, served by the generated Triton variants.

    from permgen import moe_permute, moe_permute_with_probs, moe_unpermute   # instead of
    from transformer_engine.pytorch import moe_permute, ...                  # this

Same function names, arguments, semantics and return structures as
`transformer_engine.pytorch.permutation`. Each call picks the generated variant for the input's
dtype, the map type, whether probs are permuted and the alignment; when none is generated, the
registry's LookupError names the `[[variant]]` to add to variants.toml. The functions are
differentiable and trace under `torch.compile(fullgraph=True)` (the variants' ops are torch.library
custom ops).

`row_id_map` is an int32 tensor, as in TE, but it holds permgen's row map (permgen.core.results.te_row_id_map), shaped
so that moe_unpermute reads every size it needs from it, whatever arguments it is given:
    mask maps    [N + 2, 2E + 1]           the row map, viewed 2-D
    padded maps  [align_size, N + 2, 2E + 1]  the same, broadcast over a first dimension of
                                           align_size (stride 0: no memory), which carries the
                                           alignment to moe_unpermute
    index maps   [N + 1, N + 2E + 3, k, 1] the row map viewed [N + 2E + 3, k, 1], broadcast over a
                                           first dimension of N + 1 (stride 0): N without
                                           merging_probs or restore_shape
Pass it only to this module's moe_unpermute, whole (a slice or other part is refused, eagerly:
te_row_id_map_sizes); it is never copied (.contiguous() would materialise the broadcast). The README's "Coming from TransformerEngine" lists what remains different.

Dropped routes (past num_out_tokens, or index ids outside [-1, E)) are counted on the device, in
the row map (`route_tallies(row_id_map)` reads them); TE's return tuples have no place for the count,
so `check_routes_on_device(True)` makes every permute here assert on the device, asynchronously, that
no route lacked a slot. An integer mask given a row cap (no host read) is not checked on the host: its
values other than 0 and 1 (as [N, k] expert ids passed with map_type left at 'mask' hold) are counted
as routes without a slot, and such a call's rows mean nothing.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..core.axes import TOKEN_DTYPE_NAMES
from ..core.registry import get_kernel, variants
from ..core.results import RowIdMap, RowMapLayout, te_row_id_map, te_row_id_map_sizes
from ..core.variant import Variant
from ..triton.host import chunk_sort

# torch dtype -> the dtype axis of the variants that move it
_DTYPES = {getattr(torch, name): axis for axis, name in TOKEN_DTYPE_NAMES.items()}
_MAP_TYPES = ("mask", "index")
# What the variants call the arguments, and what TE's functions call them.
_ARGUMENT_NAMES = (("tokens", "inp"), ("routing", "routing_map"), ("permuted", "inp"))


def _te_errors(fn):
    """Errors raised by the variant a TE function runs name the TE function and its arguments: the
    user never chose the variant. (The registry's LookupError, which names the variant to add, and
    errors raised inside a compiled graph keep their words.)"""
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LookupError as error:  # no generated variant: name the function called, keep the [[variant]] text
            if type(error) is not LookupError:  # a KeyError / IndexError is no registry miss
                raise
            raise LookupError(f"{name}: {error.args[0] if error.args else error}") from None
        except (ValueError, TypeError) as error:
            where, sep, message = str(error).partition(": ")
            if not sep or (where not in _VARIANT_NAMES and where != name):
                raise
            for ours, theirs in _ARGUMENT_NAMES:
                if message.startswith(ours + " "):
                    message = theirs + message[len(ours):]
            variant = f" (variant {where})" if where in _VARIANT_NAMES else ""
            raise type(error)(f"{name}: {message}{variant}") from None

    return call


def _dtype_axis(t: torch.Tensor, where: str) -> str:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: inp must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{where}: inp has dtype {t.dtype}; the variants move {', '.join(map(str, _DTYPES))}")
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
_VARIANT_NAMES = frozenset(variants())


def _module(dtype: str, routing: str, probs: bool, pad: int):
    """The generated Triton module (LookupError naming the [[variant]] to add when there is none)."""
    mod = _MODULES.get((dtype, routing, probs, pad))
    if mod is None:
        return get_kernel("triton", dtype=dtype, routing=routing, probs=probs, scale="none", pad=pad)
    return mod


def _unpermute_module(dtype: str, routing: str, merging: bool, pad: int):
    """The module whose unpermute reads the row map: any variant with the same map type, dtype and
    padding lays rows out the same way; merging_probs need one with probs. A padded row map needs
    the variant's pad: its backward pass zeroes the pad rows."""
    if not merging and (dtype, routing, False, pad) in _MODULES:
        return _MODULES[(dtype, routing, False, pad)]
    return _module(dtype, routing, True, pad)  # a variant with probs also sums without merging_probs


def _rows_kept(num_out_tokens, map_type, where, num_routes):
    """TE's num_out_tokens as permgen's row cap. Mask maps: below 0 (or None) keeps every route;
    index maps: 0 or below gives N * k rows, as TE's. A tensor (Megatron passes its counts' sum) is
    read back."""
    if isinstance(num_out_tokens, torch.Tensor) and num_out_tokens.numel() == 1 \
            and not num_out_tokens.is_floating_point():
        num_out_tokens = int(num_out_tokens)
    if num_out_tokens is None:
        num_out_tokens = -1
    if isinstance(num_out_tokens, bool) or not isinstance(num_out_tokens, int):
        raise TypeError(f"{where}: num_out_tokens must be an int, got {num_out_tokens!r}")
    if map_type == "index":
        return num_out_tokens if num_out_tokens > 0 else num_routes
    return None if num_out_tokens < 0 else num_out_tokens


_ROUTE_CHECKS = {"on_device": False}


def check_routes_on_device(enabled: bool = True):
    """Make every permute of this module assert on the device, asynchronously (no host sync), that
    no route lacked a slot: no index id outside [-1, E), no integer mask value other than 0 and 1. A
    bad route fails the next synchronising call (on the CPU: the permute) with a device-side
    assertion. Off by default; the count is always in the row map (route_tallies)."""
    _ROUTE_CHECKS["on_device"] = bool(enabled)


def _te_row_id_map(res, map_type, where):
    rim = res.row_id_map
    if _ROUTE_CHECKS["on_device"]:
        torch._assert_async(rim.unslotted == 0, f"{where}: routing_map holds expert ids outside [-1, E)"
                            if map_type == "index" else f"{where}: routing_map holds values other than 0 and 1; "
                            "[N, k] expert ids need map_type='index'")
    pad = Variant.named(rim.variant).pad
    rows = te_row_id_map(rim, map_type, pad)
    if not torch.compiler.is_compiling():
        # What moe_unpermute would read back from the shape, kept with the tensor for calls that pass it on.
        rows._permgen_sizes = (map_type, rim.row_map, rim.num_tokens, rim.width, rim.num_experts, pad, rim.routing)
    return rows


def _permute(where, inp, routing_map, probs, num_out_tokens, map_type, pad=0):
    dtype = _dtype_axis(inp, where)
    _check_map_type(map_type)
    mod = _module(dtype, map_type, probs is not None, pad)
    if map_type == "index":
        if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2:
            raise ValueError(f"{where}: routing_map of an index map must be [N, k] expert ids, got "
                             f"{getattr(routing_map, 'shape', type(routing_map).__name__)}")
        cap = _rows_kept(num_out_tokens, map_type, where, routing_map.shape[0] * routing_map.shape[1])
        # TE's index maps carry no expert count: the op counts them (max id + 1) itself
        return mod.permute_counting_experts(inp, routing_map, probs, num_out_tokens=cap)
    cap = _rows_kept(num_out_tokens, map_type, where, None)
    res = mod.permute(inp, routing_map, probs, num_out_tokens=cap)
    if cap is not None and routing_map.dtype != torch.bool:
        _count_other_values(res.row_id_map, routing_map)
    return res


def _count_other_values(rim, routing_map):
    """An integer mask's values other than 0 and 1, added on the device to the row map's routes
    without a slot (and dropped): a capped permute reads nothing back, so the check that refuses
    them without a cap (one host read) cannot run; [N, k] expert ids passed as a mask land here.
    Through .data: the backward pass saved the row map, and never reads the tallies."""
    layout = rim.layout
    words = rim.row_map if torch.compiler.is_compiling() else rim.row_map.data
    words[layout.route_tallies:layout.end].add_((routing_map.ne(0) & routing_map.ne(1)).sum(dtype=torch.int32))


@_te_errors
def moe_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1, map_type="mask"):
    """Permute the tokens by the routing map: rows grouped by expert, ascending token within one.

    inp [N, H]; routing_map: [N, E] mask (bool, or integer 0 / 1) for map_type 'mask', [N, k] expert
    ids (int32 / int64) for 'index'. num_out_tokens: rows to keep; mask maps: -1 (or None) keeps
    every route; index maps: 0 or -1 gives N * k rows. The routes past it are dropped (counted in
    the row map). max_token_num: TE's workspace hint, unused (no workspace).
    Returns (output [rows, H], row_id_map)."""
    if isinstance(max_token_num, bool) or not isinstance(max_token_num, int):
        raise TypeError(f"moe_permute: max_token_num must be an int, got {max_token_num!r}")
    res = _permute("moe_permute", inp, routing_map, None, num_out_tokens, map_type)
    return res.tokens, _te_row_id_map(res, map_type, "moe_permute")


@_te_errors
def moe_permute_with_probs(inp, probs, routing_map, num_out_tokens=-1):
    """Permute tokens and their probs by a [N, E] routing mask.

    probs [N, E]: each row's prob moves with it. Returns (output, permuted_probs [rows], row_id_map)."""
    res = _permute("moe_permute_with_probs", inp, routing_map, probs, num_out_tokens, "mask")
    return res.tokens, res.probs, _te_row_id_map(res, "mask", "moe_permute_with_probs")


@_te_errors
def moe_permute_and_pad_with_probs(inp, probs, routing_map, tokens_per_expert, align_size):
    """moe_permute_with_probs with each expert's rows padded to a multiple of align_size (zero rows).

    tokens_per_expert [E]: the routes of each expert (as TE, used for pad_offsets; the rows come
    from the routing map). Returns (output, permuted_probs, row_id_map, pad_offsets [E] int64:
    the pad rows before each expert's segment, padded_tokens_per_expert [E] int64). The row map
    carries the alignment: moe_unpermute needs no pad_offsets (it accepts them)."""
    where = "moe_permute_and_pad_with_probs"
    if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.is_floating_point() \
            or tokens_per_expert.is_complex() or tokens_per_expert.dtype == torch.bool:
        raise TypeError(f"{where}: tokens_per_expert must be an integer tensor [E], got "
                        f"{getattr(tokens_per_expert, 'dtype', type(tokens_per_expert).__name__)}")
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size <= 0:
        raise ValueError(f"{where}: align_size must be a positive int, got {align_size!r}")
    res = _permute(where, inp, routing_map, probs, -1, "mask", pad=align_size)
    padded = res.tokens_per_expert
    if tokens_per_expert.shape != padded.shape:  # it would broadcast into pad_offsets of another shape
        raise ValueError(f"{where}: tokens_per_expert must have shape [{padded.shape[0]}] (one count per expert "
                         f"of routing_map), got {list(tokens_per_expert.shape)}")
    pad_rows = padded - tokens_per_expert.to(device=padded.device, dtype=padded.dtype)
    pad_offsets = torch.cumsum(pad_rows, 0) - pad_rows
    return res.tokens, res.probs, _te_row_id_map(res, "mask", where), pad_offsets, padded


@_te_errors
def moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask", probs=None,
                  pad_offsets=None):
    """Sum each token's permuted rows back into one row, weighted by merging_probs when given.

    inp [rows, H]: the experts' outputs in permuted order (fewer rows than permute made: the routes
    to the rows past them count as dropped); row_id_map: from this module's permute functions;
    merging_probs: [N, E] (mask) / [N, k] (index) probs, or None: a plain sum; probs: TE's old
    name of merging_probs. restore_shape: (N, H), checked (mask maps; TE's index maps ignore it).
    Index maps without merging_probs are TE's topK = 1 unpermute of the N * k routes: [N * k, H],
    row s * N + t the row of token t's route s. pad_offsets: accepted (the row map of
    moe_permute_and_pad_with_probs carries the alignment). Returns [N, H], accumulated in fp32."""
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("Both merging_probs and probs kwarg are provided. probs is deprecated.")
        warnings.warn("probs kwarg is deprecated. Use merging_probs kwarg instead.")
        merging_probs = probs
    dtype = _dtype_axis(inp, "moe_unpermute")
    _check_map_type(map_type)
    sizes = None if torch.compiler.is_compiling() else getattr(row_id_map, "_permgen_sizes", None)
    if sizes is not None and sizes[0] != map_type:
        raise ValueError(f"moe_unpermute: row_id_map comes from a permute with map_type={sizes[0]!r}, but "
                         f"map_type={map_type!r} was given (is map_type the one given to moe_permute?)")
    if sizes is not None:
        _, row_map, num_tokens, width, num_experts, pad, routing = sizes
    else:
        row_map, num_tokens, width, num_experts, pad = te_row_id_map_sizes(row_id_map, map_type, "moe_unpermute")
        routing = None
    if pad_offsets is not None and not pad:
        raise ValueError("moe_unpermute: pad_offsets given, but row_id_map comes from a permute without padding "
                         "(pad_offsets are those of moe_permute_and_pad_with_probs)")
    mod = _unpermute_module(dtype, map_type, merging_probs is not None, pad)
    num_rows = inp.shape[0]
    if map_type == "index" and merging_probs is None:
        # TE: topK = 1 over the N * k routes. The row map of N * k tokens of one slot each has the
        # same words, so the kernels sum one route per output row; TE's rows are slot-major.
        rim = RowIdMap(row_map, row_map[:1].expand(num_tokens * width, 1), num_tokens * width, 1,
                       num_experts, num_rows, mod.VARIANT["name"])
        out = mod.unpermute(inp, rim)
        if width == 1:
            return out
        return out.view(num_tokens, width, inp.shape[1]).transpose(0, 1).reshape(num_tokens * width, inp.shape[1])
    if routing is None:  # the routing columns only give the probs' shape to the checks: a view, no allocation
        routing = row_map[:1].expand(num_tokens, width)
    rim = RowIdMap(row_map, routing, num_tokens, width, num_experts, num_rows, mod.VARIANT["name"])
    return mod.unpermute(inp, rim, merging_probs, restore_shape if map_type == "mask" else None)


def route_tallies(row_id_map, map_type="mask"):
    """int32 [2] on the device, a view of the row map this module's permute functions returned:
    the routes dropped (past num_out_tokens, or without a slot), and of them those without a slot
    (index ids outside [-1, E); integer mask values other than 0 and 1). Reading it is the sync."""
    _check_map_type(map_type)
    sizes = getattr(row_id_map, "_permgen_sizes", None)
    if sizes is not None and sizes[0] != map_type:
        raise ValueError(f"route_tallies: row_id_map comes from a permute with map_type={sizes[0]!r}, but "
                         f"map_type={map_type!r} was given")
    row_map, num_tokens, width, num_experts, _ = te_row_id_map_sizes(row_id_map, map_type, "route_tallies")
    layout = RowMapLayout(map_type == "mask", num_tokens, width, num_experts)
    return row_map[layout.route_tallies:layout.end]


# ---------------------------------------------------------------------------------------------
# Chunk sort
# ---------------------------------------------------------------------------------------------

# The chunk sort depends on no variant: the Triton target's one (permgen.triton.host.chunk_sort) moves
# every token dtype.
_TOKEN_DTYPES = tuple(_DTYPES)
_CHUNK_SORT = chunk_sort()  # made here (no op is registered before its first call): calls look up no getter


@_te_errors
def moe_sort_chunks_by_index(inp, split_sizes, sorted_index, *, alias_in_order=False):
    """Split inp's rows [N, H] into chunks of split_sizes (they sum to N) and concatenate the chunks
    in the order of sorted_index; differentiable. Returns output [N, H], a new tensor (as TE's).

    alias_in_order (permgen's, not TE's): when sorted_index is on the CPU (read on every call) and
    moves nothing (0, 1, ..., C - 1), return inp itself, not a copy: for a caller that never writes
    into the output (megatron-core's dispatcher, permgen.integrations.megatron)."""
    return _CHUNK_SORT.sort("moe_sort_chunks_by_index", inp, split_sizes, sorted_index, None, _TOKEN_DTYPES,
                            alias_in_order=alias_in_order)[0]


@_te_errors
def moe_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_index, *, alias_in_order=False):
    """moe_sort_chunks_by_index, moving probs [N] with their rows. Returns (output, permuted_probs)."""
    return _CHUNK_SORT.sort("moe_sort_chunks_by_index_with_probs", inp, split_sizes, sorted_index, probs,
                            _TOKEN_DTYPES, alias_in_order=alias_in_order)


__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs", "check_routes_on_device",
           "route_tallies"]
