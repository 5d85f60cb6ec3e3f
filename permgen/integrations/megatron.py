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

megatron-core's `MoEAlltoAllTokenDispatcher` sorts its rows' chunks by two orders it makes once, on the
GPU when fused. At expert- and tensor-parallel size 1 they move nothing, on every call. permgen never
reads an order on the device (no device sync), so such an order would copy the rows; enable() makes
the dispatcher keep an order that moves nothing on the host (one read, when it is constructed). The
chunk sort reads a host order on every call and, for the dispatcher, returns the rows themselves when
it moves nothing (no launch, no copy: `alias_in_order`; the dispatcher never writes into them).
"""

from __future__ import annotations

import functools
import importlib

import torch

from . import te

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
# megatron-core as the README and the Makefile install it: without its torch requirement, which would
# pull torch's CUDA build (its imports need only numpy and packaging).
INSTALL = 'pip install --no-deps "megatron-core==0.16.1" numpy packaging'
TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
# The dispatcher's chunk orders: its attributes, made in its constructor.
DISPATCHER_ORDERS = ("sort_input_by_local_experts", "restore_output_by_local_experts")

# megatron-core's name in moe_utils -> the permgen function it calls instead of TransformerEngine's
FUNCTIONS = {
    "fused_permute": te.moe_permute,
    "fused_permute_with_probs": te.moe_permute_with_probs,
    "fused_permute_and_pad_with_probs": te.moe_permute_and_pad_with_probs,
    "fused_unpermute": te.moe_unpermute,
    "fused_sort_chunks_by_index": functools.partial(te.moe_sort_chunks_by_index, alias_in_order=True),
    "fused_sort_chunks_by_index_with_probs": functools.partial(te.moe_sort_chunks_by_index_with_probs,
                                                               alias_in_order=True),
}
# Other TransformerEngine names moe_utils guards with HAVE_TE: None, so its checks say they are missing.
UNAVAILABLE = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_topk_with_score_function",
               "te_general_gemm")
_MISSING = object()
_saved: dict = {}  # name -> what moe_utils held before enable() (_MISSING: nothing)
_saved_init: dict = {}  # the dispatcher class -> its __init__ before enable()


def _orders_that_move_nothing_on_the_host(init):
    """The dispatcher's constructor, then each of its chunk orders on a device that moves nothing moved
    to the host (see the module docstring)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for name in DISPATCHER_ORDERS:
            order = getattr(self, name, None)
            if isinstance(order, torch.Tensor) and order.device.type != "cpu":
                host = order.cpu()
                if host.tolist() == list(range(host.numel())):
                    setattr(self, name, host)

    return __init__


def _moe_utils():
    try:
        return importlib.import_module(MOE_UTILS)
    except ModuleNotFoundError as missing:
        if missing.name != "megatron" and not (missing.name or "").startswith("megatron."):
            raise
        raise ModuleNotFoundError(f"permgen.integrations.megatron needs megatron-core, which does not import "
                                  f"({missing}); install it with: {INSTALL}", name=missing.name) from missing


def enable() -> bool:
    """Make megatron-core's fused permutation run permgen. Returns True when it did, False when
    TransformerEngine is installed (its functions stay) or permgen is already enabled. Without
    megatron-core, a ModuleNotFoundError gives the command that installs it."""
    moe_utils = _moe_utils()
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
    try:
        dispatcher = importlib.import_module(TOKEN_DISPATCHER).MoEAlltoAllTokenDispatcher
    except (ImportError, AttributeError):  # a release without it: its orders stay where it puts them
        dispatcher = None
    if dispatcher is not None:
        _saved_init[dispatcher] = dispatcher.__init__
        dispatcher.__init__ = _orders_that_move_nothing_on_the_host(dispatcher.__init__)
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
    moe_utils = _moe_utils()
    for name, value in _saved.items():
        if value is _MISSING:
            moe_utils.__dict__.pop(name, None)
        else:
            setattr(moe_utils, name, value)
    _saved.clear()
    for dispatcher, init in _saved_init.items():
        dispatcher.__init__ = init
    _saved_init.clear()


def enabled() -> bool:
    return bool(_saved)
