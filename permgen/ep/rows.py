"""The rows' paths through a dispatch's handle, each written once for eager calls, autograd and the
custom ops: dispatch (permute's rows -> this rank's experts' rows), combine (expert outputs -> their
source ranks, merged) and the backward pass of each, which is the other's data path followed by
permute's (unpermute's) backward kernels over the send row map."""

from __future__ import annotations

import torch

from .plan import EpHandle


def dispatch_rows(h: EpHandle, rows, probs=None):
    """permute's rows (and probs beside them, or None) -> this rank's experts' rows and probs."""
    return to_experts(h, _pack(h, rows), None if probs is None else _pack(h, probs))


def dispatch_grads(h: EpHandle, grad_out, grad_probs, probs_meta):
    """The gradients of dispatch's rows and probs (either may be None) -> those of its tokens and
    probs (probs_meta: the probs' (shape, dtype))."""
    rows, row_probs = to_sources(h, grad_out, grad_probs)
    return h.ops.backend.permute_backward(h.send_map, rows, row_probs, None if row_probs is None else probs_meta)


def combine_rows(h: EpHandle, expert_out, merging_probs):
    """Expert outputs -> this rank's tokens, merged as unpermute merges; (out, the rows that came
    back, which the probs' gradient reads)."""
    returned = to_sources(h, expert_out)[0]
    return h.ops.backend.unpermute(h.send_map, returned, merging_probs), returned


def combine_grads(h: EpHandle, grad, returned, merging_probs, rows_needed=True):
    """The gradient of combine's output -> those of the expert outputs (None unless rows_needed) and
    merging probs (None without merging probs)."""
    rows, grad_probs = h.ops.backend.unpermute_backward(h.send_map, grad.contiguous(),
                                                        None if merging_probs is None else returned, merging_probs)
    return to_experts(h, rows)[0] if rows_needed else None, grad_probs


def to_experts(h: EpHandle, rows, probs=None):
    """Send rows (the send buffer's layout) -> this rank's expert-major rows (dispatch's
    direction), and probs beside them (either may be None). Output rows with no source (padding,
    empty slots) are zeros."""
    move = h.facts.exchange.rows
    got = None if rows is None else move(rows, h.recv_splits, h.send_splits, h.num_out)
    got_probs = None if probs is None else move(probs, h.recv_splits, h.send_splits, h.num_out)
    return (got, got_probs) if h.table is None else _sort(h, False, got, got_probs)


def to_sources(h: EpHandle, rows, probs=None):
    """Expert-major rows -> the send buffer's layout on their source ranks (combine's direction),
    and probs beside them (either may be None). Send rows that carried no route (empty capacity
    slots) come back unspecified and are never read."""
    if h.table is not None:
        rows, probs = _sort(h, True, rows, probs)
    exchange, received, sent = h.facts.exchange, sum(h.recv_splits), sum(h.send_splits)
    return tuple(None if x is None else exchange.rows(x if x.shape[0] == received else x[:received], h.send_splits,
                                                      h.recv_splits, sent)
                 for x in (rows, probs))


def _pack(h: EpHandle, permuted):
    """permute's rows -> the send buffer: their first rows (a view), or the routed rows gathered
    (padded variants; capacity mode over several ranks, slotted)."""
    if h.pack_rows is None:
        sent = sum(h.send_splits)
        return permuted if permuted.shape[0] == sent else permuted[:sent]
    if permuted.dim() == 1:
        return permuted.index_select(0, h.pack_rows)
    moved = permuted.contiguous().view(torch.uint8)  # the row gather moves bytes
    return h.ops.chunk_sort.kernels.gather_rows(h.pack_rows, moved).view(permuted.dtype)


def _sort(h: EpHandle, inverse, rows, probs):
    """The regroup's chunk sort (inverse: its undoing) of rows and probs beside them (either may be None)."""
    sort = h.ops.chunk_sort.kernels.sort_chunks
    if rows is None:
        return None, sort(h.table, inverse, probs.contiguous().view(-1, 1), None)[0].view(-1)
    return sort(h.table, inverse, rows.contiguous(), None if probs is None else probs.contiguous())
