"""The contract every variant keeps on every target: the argument checks of the public functions
and the dtypes a variant's tensors take (the spec's axis values are permgen.core.axes').

Both targets' host code and the tests call these checks; they raise the same exception with the
same words whichever target runs the variant. This module imports no torch at load time.
"""

from typing import NamedTuple, Optional

# The spec's tables, also served here, where they were first published (permgen.core.contract.DTYPES, ...).
from .axes import (AXES, AXIS_DEFAULTS, DTYPES, FP8_DTYPES, MAX_PAD, MAX_ROWS, PROB_DTYPE_NAMES,  # noqa: F401
                   QUANTIZABLE_DTYPES, QUANTIZED_DTYPE, QUANTIZES, ROUTINGS, SCALE_FORMATS, SCALES, TARGETS,
                   TOKEN_DTYPE_NAMES, variant_name)
from .variant import Variant


def _variant(variant):
    """The Variant of a normalised spec entry (a generated module's VARIANT), torch dtypes bound; a
    Variant as it is (permgen.core.ops binds its torch dtypes once; the checks run on every call)."""
    if isinstance(variant, dict):
        return Variant.of(variant).bind_torch()
    return variant


def combine_dtype_name(variant) -> str:
    """unpermute's input and output dtype: the experts' outputs (bf16 for fp8 variants)."""
    return _variant(variant).combine_dtype_name


def scale_kind(variant) -> str:
    """The scales permute returns: those it moves (`scale`) or those it computes (`quantize`), or "none"."""
    return _variant(variant).scale_kind


def out_dtype_name(variant) -> str:
    """The dtype of permute's rows: the token dtype, or float8_e4m3fn for quantising variants."""
    return _variant(variant).out_dtype_name


def scale_columns(variant, hidden: int) -> int:
    return _variant(variant).scale_columns(hidden)


# ---------------------------------------------------------------------------------------------
# Argument checks (shared by both targets)
# ---------------------------------------------------------------------------------------------

_TORCH = []


def _torch():
    if not _TORCH:
        import torch
        _TORCH.append(torch)
    return _TORCH[0]


class PermutePlan(NamedTuple):
    """permute's sizes once its arguments are checked."""

    num_tokens: int
    hidden: int
    num_experts: int
    width: int  # route slots per token in the row map: k (index), topk or E (mask)
    num_out_tokens: Optional[int]  # the row cap, or None: as many rows as the routes need
    check_routing: bool  # verify the routing values (one host sync)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_tensor(variant, name: str, t, shape, dtypes, device):
    """Raise a TypeError / ValueError that says what tensor `name` of `variant` (a Variant, a spec
    entry, or the name errors start with) should have been.

    shape: a tuple of sizes (None = any); dtypes: torch dtypes; device: the tokens' device, or None."""
    torch = _torch()
    # The common case first, with the fewest Python operations: this runs on every call.
    if (isinstance(t, torch.Tensor) and t.dtype in dtypes and (device is None or t.device == device)
            and t.is_contiguous()):
        got = t.shape
        if len(got) == len(shape):
            for want, have in zip(shape, got):
                if want is not None and want != have:
                    break
            else:
                return
    where = variant if isinstance(variant, str) else _variant(variant).name
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{where}: {name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{where}: {name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{where}: {name} is on {t.device}, expected {device} (the tokens' device)")
    raise ValueError(f"{where}: {name} must be contiguous; call .contiguous() first")


def token_dtype(variant):
    return _variant(variant).token_dtype


def combine_dtype(variant):
    return _variant(variant).combine_dtype


def prob_dtypes():
    torch = _torch()
    return tuple(getattr(torch, name) for name in PROB_DTYPE_NAMES)


def scale_dtype(variant):
    return _variant(variant).scale_dtype


def out_dtype(variant):
    return _variant(variant).out_dtype


def check_permute(variant, tokens, routing, probs, scale, num_experts, num_out_tokens, topk,
                  check_routing, num_experts_from_ids=False) -> PermutePlan:
    """Check permute's arguments against the variant; return its sizes. num_experts_from_ids: index
    routing without num_experts is allowed, and the plan's num_experts is None (read from the ids)."""
    torch = _torch()
    variant = _variant(variant)
    where = variant.name
    check_tensor(variant, "tokens", tokens, (None, None), (variant.token_dtype,), None)
    num_tokens, hidden = tokens.shape
    device = tokens.device
    if variant.mask:
        if not isinstance(routing, torch.Tensor) or routing.is_floating_point() or routing.is_complex():
            got = getattr(routing, "dtype", type(routing).__name__)
            raise TypeError(f"{where}: routing must be a bool or integer [N, E] mask tensor, got {got}")
        check_tensor(variant, "routing", routing, (num_tokens, None), (routing.dtype,), device)
        if num_experts is not None and num_experts != routing.shape[1]:
            raise ValueError(f"{where}: num_experts={num_experts} but the routing mask has {routing.shape[1]} columns")
        num_experts = routing.shape[1]
    else:
        check_tensor(variant, "routing", routing, (num_tokens, None), (torch.int32, torch.int64), device)
        if num_experts is None and not num_experts_from_ids:
            raise ValueError(f"{where}: index routing needs num_experts")
    if (num_experts is not None or variant.mask) and (not _is_int(num_experts) or num_experts < 1):
        raise ValueError(f"{where}: num_experts must be a positive int, got {num_experts!r}")
    if num_out_tokens is not None and (not _is_int(num_out_tokens) or not 0 <= num_out_tokens < MAX_ROWS):
        raise ValueError(f"{where}: num_out_tokens must be an int in [0, 2**31 - 1), got {num_out_tokens!r}")
    if topk is not None and (not _is_int(topk) or topk < 1):
        raise ValueError(f"{where}: topk must be a positive int, got {topk!r}")
    if variant.probs:
        if probs is None:
            raise ValueError(f"{where}: this variant permutes probs; pass probs [N, {variant.prob_columns}]")
        check_tensor(variant, "probs", probs, (num_tokens, routing.shape[1]), variant.prob_dtypes, device)
    elif probs is not None:
        raise ValueError(f"{where}: this variant has no probs; use a variant with probs = true")
    if variant.has_scale:
        if scale is None:
            raise ValueError(f"{where}: this variant moves {variant.scale} scales; pass scale "
                             f"[N, ceil(H / {variant.scale_block})]")
        check_tensor(variant, "scale", scale, (num_tokens, variant.scale_columns(hidden)), (variant.scale_dtype,),
                     device)
    elif scale is not None:
        if variant.quantizes:
            raise ValueError(f"{where}: this variant computes its {variant.quantize} scales; pass no scale")
        raise ValueError(f"{where}: this variant moves no scales; use a variant with an fp8 scale")
    if check_routing is not None and not isinstance(check_routing, bool):
        raise TypeError(f"{where}: check_routing must be True, False or None, got {check_routing!r}")

    if variant.mask:
        # The row map keeps topk slots per token when the caller knows the most routes of any
        # token, else one per expert; kernels visit each token's live routes either way.
        width = topk if topk is not None else num_experts
        if width > num_experts:
            raise ValueError(f"{where}: topk={topk} is more than the {num_experts} experts")
    else:
        width = routing.shape[1]
        if width < 1:
            raise ValueError(f"{where}: routing must have at least one column")
        if topk is not None and topk != width:
            raise ValueError(f"{where}: topk={topk} but index routing has {width} columns")
    if num_tokens * width >= MAX_ROWS:
        raise ValueError(f"{where}: N * k = {num_tokens * width} routes; at most 2**31 - 2 are supported")
    check = check_routing if check_routing is not None else num_out_tokens is None
    return PermutePlan(num_tokens, hidden, num_experts, width, num_out_tokens, check)


def routing_error(variant, routing, num_experts: int, width: int) -> Optional[str]:
    """What is wrong with the routing values, or None (reads them: one host sync)."""
    if routing.numel() == 0:
        return None
    if _variant(variant).mask:
        torch = _torch()
        if routing.dtype == torch.bool:
            routes = int(routing.sum(1).max())
        else:
            routes, low, high = torch.stack(((routing != 0).sum(1).max(), routing.min().long(),
                                             routing.max().long())).tolist()
            if low < 0 or high > 1:
                looks = (f"[N, k] expert ids (index routing, k = {routing.shape[1]}): use map_type='index' or an "
                         f"index variant" if low >= -1 else "neither a mask nor expert ids")
                return (f"an integer routing mask must hold only 0 and 1, found values in [{low}, {high}]; this looks "
                        f"like {looks}")
        if routes > width:
            return f"a token is routed to {routes} experts, more than topk={width}"
        return None
    low, high = int(routing.min()), int(routing.max())
    if low < -1 or high >= num_experts:
        return f"expert ids must be in [0, {num_experts}) or -1 for no route; found ids in [{low}, {high}]"
    return None


def check_unpermute(variant, permuted, row_id_map, merging_probs, restore_shape, row_map_type):
    """Check unpermute's arguments against the variant and the row map permute returned."""
    variant = _variant(variant)
    where = variant.name
    if not isinstance(row_id_map, row_map_type):
        raise TypeError(f"{where}: row_id_map must be the RowIdMap from this module's permute, "
                        f"got {type(row_id_map).__name__}")
    if row_id_map.variant != where:
        raise ValueError(f"{where}: row_id_map comes from variant {row_id_map.variant}'s permute")
    num_tokens = row_id_map.num_tokens
    device = row_id_map.row_map.device
    check_tensor(variant, "permuted", permuted, (row_id_map.num_rows, None), (variant.combine_dtype,), device)
    if restore_shape is not None:
        if not isinstance(restore_shape, (tuple, list)):  # torch.Size is a tuple
            raise TypeError(f"{where}: restore_shape must be a sequence (N, H), got {restore_shape!r}")
        if tuple(restore_shape) != (num_tokens, permuted.shape[1]):
            raise ValueError(f"{where}: restore_shape {tuple(restore_shape)} does not match the row map's "
                             f"{num_tokens} tokens and hidden size {permuted.shape[1]}")
    if variant.probs:
        if merging_probs is not None:
            check_tensor(variant, "merging_probs", merging_probs, (num_tokens, row_id_map.routing.shape[1]),
                         variant.prob_dtypes, device)
    elif merging_probs is not None:
        raise ValueError(f"{where}: this variant has no probs; use a variant with probs = true")
