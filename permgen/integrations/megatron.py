"""megatron-core's fused permutation path, run by permgen where TransformerEngine is not installed.

    import permgen.integrations.megatron
    permgen.integrations.megatron.enable()      # before the first MoE forward pass
    ... config = TransformerConfig(..., moe_permute_fusion=True) ...

With `moe_permute_fusion=True`, megatron-core's `moe_utils.permute`, `unpermute` and
`sort_chunks_by_idxs` call TransformerEngine's functions through names bound in `moe_utils`
(`fused_permute`, `fused_permute_with_probs`, `fused_unpermute`, `fused_sort_chunks_by_index`,
`fused_sort_chunks_by_index_with_probs`, and in newer releases `fused_permute_and_pad_with_probs`),
each call guarded by `HAVE_TE`. Without TransformerEngine those names are missing and `HAVE_TE` is
False, so the fused path raises. enable() binds them to permgen's TE-compatible functions
(permgen.integrations.te) and sets `HAVE_TE`; the other names behind that flag (fused routing, aux loss, GEMM)
become None, so megatron-core's own "not available" errors still name them. disable() puts back
what was there. Where TransformerEngine is installed, enable() changes nothing and returns False.
"""

from __future__ import annotations

import functools
import importlib

from . import te

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"

# megatron-core's name in moe_utils -> the permgen function it calls instead of TransformerEngine's
FUNCTIONS = {
    "fused_permute": te.moe_permute,
    "fused_permute_with_probs": te.moe_permute_with_probs,
    "fused_permute_and_pad_with_probs": te.moe_permute_and_pad_with_probs,
    "fused_unpermute": te.moe_unpermute,
    "fused_sort_chunks_by_index": te.moe_sort_chunks_by_index,
    "fused_sort_chunks_by_index_with_probs": te.moe_sort_chunks_by_index_with_probs,
}
# Other TransformerEngine names moe_utils guards with HAVE_TE: None, so its checks say they are missing.
UNAVAILABLE = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_topk_with_score_function",
               "te_general_gemm")
_MISSING = object()
_saved: dict = {}  # name -> what moe_utils held before enable() (_MISSING: nothing)


def enable() -> bool:
    """Make megatron-core's fused permutation run permgen. Returns True when it did, False when
    TransformerEngine is installed (its functions stay) or permgen is already enabled."""
    moe_utils = importlib.import_module(MOE_UTILS)
    if _saved or getattr(moe_utils, "HAVE_TE", False):
        return False
    names = ("HAVE_TE", "is_te_min_version", *FUNCTIONS, *UNAVAILABLE)
    _saved.update({name: moe_utils.__dict__.get(name, _MISSING) for name in names})
    for name in UNAVAILABLE:
        if getattr(moe_utils, name, None) is None:
            setattr(moe_utils, name, None)
    for name, function in FUNCTIONS.items():
        setattr(moe_utils, name, function)
    moe_utils.HAVE_TE = True
    if callable(_saved["is_te_min_version"]):
        # Newer releases ask for TransformerEngine's version on every fused unpermute; without TE each
        # ask is a failed import (about 100 us of host time per step). The answer cannot change while
        # the process runs: ask once per version.
        moe_utils.is_te_min_version = functools.lru_cache(maxsize=None)(_saved["is_te_min_version"])
    return True


def disable() -> None:
    """Undo enable(): megatron-core's names as they were."""
    if not _saved:
        return
    moe_utils = importlib.import_module(MOE_UTILS)
    for name, value in _saved.items():
        if value is _MISSING:
            moe_utils.__dict__.pop(name, None)
        else:
            setattr(moe_utils, name, value)
    _saved.clear()


def enabled() -> bool:
    return bool(_saved)
