"""The NKI target's host side, written once for every variant: conversion and kernel launches.

A generated NKI module hands its `@nki.jit` kernels to `NkiBackend`; `permgen.core.ops` checks arguments
and adds autograd on top, exactly as for Triton, and the op layer (`permgen.core.oplayer`) defines the
custom ops through `define_op` here, `permgen.nki.custom_ops` (torch-neuronx's `nki_op` on a Trainium host). Neuron tensors (device
"neuron", torch-neuronx) go to the kernels as they are: torch-neuronx compiles a kernel on its first
call for the call's shapes, dtypes and non-tensor argument values and reuses it afterwards. CPU
tensors run through `nki.simulate`: they go in as NumPy arrays (bfloat16 and fp8 as ml_dtypes
arrays) and the outputs come back as torch tensors. Where the real `nki` package (AWS Neuron) does
not import, permgen's NumPy emulator (`permgen.nki.emulator`) stands in for it.

Static sizes: every size that shapes a kernel is a Python int, so a distinct value is a distinct
compile on Neuron. With `num_out_tokens` given, permute passes it as the row capacity and reads
nothing back from the device: one compile per (variant, shapes, capacity). Without it the output's
row count is data-dependent (as on Triton), so it must reach the host: the one read back is the
row count (the sum of the expert counts). The kernel then runs at a capacity rounded up to a power
of two (never above the most rows the routing can need) and the output is its first rows, so a
new row count recompiles only when it crosses a power of two: at most log2 of the largest
capacity compiles per (variant, shapes), not one per distinct count.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable, NamedTuple, Optional

import ml_dtypes
import numpy as np
import torch

from ..core.ops import ChunkSort, Grads, PermuteOutputs, chunk_table
from ..core.results import RowMapLayout, write_route_tallies
from ..core.variant import Variant
from . import custom_ops

# The NKI kernels' limits: expert counts are one matmul moving tile and one PSUM bank (512 fp32
# columns), and row numbers are computed exactly in fp32.
MAX_EXPERTS = 512
MAX_ROWS = 1 << 24
# The sums over a token's routes (unpermute, permute's token gradients) and unpermute's gradients keep one
# fp32 accumulator (or gradient) tile per 2048 hidden columns live across their device loop, 8 KiB per partition
# each, beside the loop body's working tiles: Trainium2 has "128 partitions of 224KiB" of SBUF (trainium2_arch).
# Eight column blocks fit with E = 512 experts and k = 32 slots in fp32 (the emulator counts live SBUF). Permute
# quantising rowwise holds a tile of rows whole (up to 64 KiB per partition in fp32) until their amax is known.
MAX_HIDDEN = 16384
LNC_VARIABLE = "NEURON_LOGICAL_NC_CONFIG"


def logical_cores() -> int:
    """The LNC (physical cores per logical NeuronCore) the environment declares, which every kernel is launched
    with as kernel[lnc] (nki.jit, SDK 2.31: "The LNC value must match the NEURON_LOGICAL_NC_CONFIG environment
    variable set for the Neuron Runtime. Mismatching the two will cause a runtime error"):
    NEURON_LOGICAL_NC_CONFIG, 1 or 2; unset, 2, the runtime's default on Trn2 ("Logical NeuronCore
    configuration": LNC=2 "is the default setting on Trainium2 devices"), which the CPU emulator assumes too."""
    declared = os.environ.get(LNC_VARIABLE, "").strip()
    if not declared:
        return 2
    if declared not in ("1", "2"):
        raise ValueError(f"{LNC_VARIABLE}={declared!r}: the LNC can only be 1 or 2")
    return int(declared)


def ensure_nki() -> None:
    """Make `import nki` work: the real package, or where it is absent the repository's CPU emulator."""
    if "nki" in sys.modules or importlib.util.find_spec("nki") is not None:
        return
    from . import emulator  # ships with permgen: the NKI variants run on CPU tensors without Neuron

    emulator.install()


ensure_nki()


class NkiKernels(NamedTuple):
    """One variant's kernels (the probs kernels only in variants with probs) and how to run them."""

    expert_counts: Callable
    permute: Callable
    sum_routes: Callable
    scatter_routes: Callable
    unpermute: Optional[Callable] = None
    permute_backward: Optional[Callable] = None
    unpermute_backward: Optional[Callable] = None
    simulate: Optional[Callable] = None  # nki.simulate of the `nki` the kernels were defined with


# torch dtypes NumPy lacks: moved as raw words and viewed as ml_dtypes.
_VIEWS = {torch.bfloat16: (torch.int16, np.int16, ml_dtypes.bfloat16),
          torch.float8_e4m3fn: (torch.uint8, np.uint8, ml_dtypes.float8_e4m3fn),
          torch.float8_e5m2: (torch.uint8, np.uint8, ml_dtypes.float8_e5m2)}
_FROM_NUMPY = {np.dtype(np_dtype): (torch_dtype, word) for torch_dtype, (_, word, np_dtype) in _VIEWS.items()}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Rows a kernel only moves, as a kernel operand: float8_e4m3fn as its uint8 bytes, since Trainium2 has no
    such data type (neuronx-cc NCC_EVRF051: "Data type F8E4M3FN is not supported on TRN1/TRN2"; its fp8 is
    float8_e4m3); every other dtype as it is. from_bytes(out, t.dtype) undoes it on a kernel's output."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def from_bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if dtype == torch.float8_e4m3fn else t


def to_kernel(t: torch.Tensor) -> np.ndarray:
    """A kernel argument: the tensor's data as a NumPy array (what nki.simulate takes), shared through
    DLPack: Tensor.numpy() would mark the caller's storage as never resizable again."""
    t = t.detach().contiguous()
    if t.dtype in _VIEWS:
        word, _, np_dtype = _VIEWS[t.dtype]
        return np.from_dlpack(t.view(word)).view(np_dtype)
    return np.from_dlpack(t)


def from_kernel(a: np.ndarray) -> torch.Tensor:
    """A kernel output as a torch tensor (no values are inspected)."""
    a = np.ascontiguousarray(a)
    if a.dtype in _FROM_NUMPY:
        torch_dtype, word = _FROM_NUMPY[a.dtype]
        return torch.from_numpy(a.view(word)).view(torch_dtype)
    return torch.from_numpy(a)


def _check_device(where, tokens):
    if tokens.device.type == "cpu" or (custom_ops.is_neuron(tokens) and custom_ops.torch_neuronx() is not None):
        return
    raise ValueError(f"{where}tokens are on {tokens.device}; the nki target runs kernels through "
                     "nki.simulate on CPU tensors, or on Neuron tensors where torch-neuronx imports")


def _run(simulate, kernel, *args, **static):
    """kernel[lnc](*args, **static) at the environment's LNC (logical_cores()): tensors in, tensors out;
    static sizes are ints. Neuron tensors go to the kernel as they are (torch-neuronx runs it); CPU
    tensors through `simulate` (nki.simulate) as NumPy arrays."""
    kernel = kernel[logical_cores()]
    if custom_ops.is_neuron(args[0]):
        return kernel(*(a.contiguous() for a in args), **static)
    outs = simulate(kernel)(*(to_kernel(a) for a in args), **static)
    if isinstance(outs, (tuple, list)):
        return tuple(from_kernel(o) for o in outs)
    return from_kernel(outs)


class NkiBackend:
    """Converts and launches one variant's kernels (permgen.core.ops.Backend)."""

    target = "nki"
    checks_routing_in_read = False  # permgen.core.ops checks the routing before permute

    def __init__(self, variant, kernels: NkiKernels):
        self.variant = Variant.of(variant).bind_torch()
        self.kernels = kernels
        self.name = self.variant.name

    def check_device(self, tokens):
        _check_device(f"{self.name}: ", tokens)

    @staticmethod
    def define_op(qualname, impl, schema):
        return custom_ops.define_op(qualname, impl, schema)

    @staticmethod
    def chunk_sort():
        return chunk_sort()

    # -- launches -------------------------------------------------------------------------------

    def _run(self, kernel, *args, **static):
        return _run(self.kernels.simulate, kernel, *args, **static)

    def _read_back(self, counts: torch.Tensor) -> int:
        """The one device -> host read of the NKI target: the row count, when num_out_tokens is not given."""
        return int(counts.sum())

    def capacity(self, num_rows: int, num_tokens: int, width: int, num_experts: int) -> int:
        """The kernel's row capacity for a read-back row count: the next power of two, capped at the most
        rows the routing can need (every slot routed, every segment padded), so the compiles a new row
        count can cause are few (a capacity is a static size: one compile each on Neuron)."""
        pad = self.variant.pad
        most = num_tokens * width + (num_experts * (pad - 1) if pad else 0)
        return max(num_rows, min(most, MAX_ROWS - 1, 1 << max(num_rows - 1, 0).bit_length()))

    @staticmethod
    def _sizes(row_id_map):
        return dict(num_tokens=row_id_map.num_tokens, width=row_id_map.width, num_experts=row_id_map.num_experts)

    # -- ops --------------------------------------------------------------------------------------

    def permute(self, plan, tokens, routing, probs, scale, routed=None) -> PermuteOutputs:
        """One launch (two without num_out_tokens: the expert counts first, then one read back).
        routed(row_map), when given, is called once the row map is written (the kernel moves the rows
        in the same launch, so before nothing)."""
        out = self._permute(plan, tokens, routing, probs, scale)
        if routed is not None:
            routed(out.row_map)
        return out

    def _permute(self, plan, tokens, routing, probs, scale) -> PermuteOutputs:
        num_tokens, hidden, num_experts, width = plan.num_tokens, plan.hidden, plan.num_experts, plan.width
        if num_experts > MAX_EXPERTS:
            raise ValueError(f"{self.name}: the nki target supports at most {MAX_EXPERTS} experts, got {num_experts}")
        if num_tokens * width >= MAX_ROWS:
            raise ValueError(f"{self.name}: the nki target supports fewer than {MAX_ROWS} routes, got N * W = "
                             f"{num_tokens * width}")
        v = self.variant
        if v.quantize == "rowwise" and hidden > MAX_HIDDEN:
            raise ValueError(f"{self.name}: the nki target quantises rows of at most {MAX_HIDDEN} columns rowwise (a tile "
                             f"of rows stays in SBUF, 224 KiB per partition on Trainium2, until the rows' amax is "
                             f"known), got H = {hidden}")
        routing_given = routing  # for the route tallies, which count the ids outside [-1, E)
        if v.mask:
            routing = (routing != 0).to(torch.int32)
        else:  # ids outside [0, E) route nowhere; clamping keeps them outside while fitting int32
            routing = routing.clamp(-1, num_experts).to(torch.int32)
        num_rows = capacity = plan.num_out_tokens
        if num_rows is None:
            num_rows = capacity = 0
            if num_tokens:
                counts = self._run(self.kernels.expert_counts, routing, num_experts=num_experts, width=width)
                num_rows = self._read_back(counts)
                capacity = self.capacity(num_rows, num_tokens, width, num_experts)
        if num_rows >= MAX_ROWS:
            raise ValueError(f"{self.name}: the nki target supports fewer than {MAX_ROWS} permuted rows, got {num_rows}")
        device = tokens.device
        if num_tokens == 0:  # no routes: empty segments, zero rows
            out = torch.zeros((num_rows, hidden), dtype=v.out_dtype, device=device)
            out_probs = None if probs is None else torch.zeros(num_rows, dtype=probs.dtype, device=device)
            out_scale = None  # the scales moved with the rows (fp8 variants), or computed (quantising variants)
            if v.makes_scale:
                out_scale = torch.zeros((num_rows, v.scale_columns(hidden)), dtype=v.scale_dtype, device=device)
            row_map = torch.zeros(RowMapLayout(v.mask, 0, width, num_experts).words, dtype=torch.int32, device=device)
            tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=device)
            return PermuteOutputs(out, out_probs, out_scale, tokens_per_expert, row_map, num_rows)
        if hidden == 0:  # kernels take no empty tensors: move a zero column, return none
            tokens = torch.zeros((num_tokens, 1), dtype=tokens.dtype, device=device)
            scale = None if scale is None else torch.zeros((num_tokens, 1), dtype=scale.dtype, device=device)
        args = [as_bytes(tokens), routing] + [t for t in (probs, scale) if t is not None]
        outs = list(self._run(self.kernels.permute, *args, num_experts=num_experts, width=width,
                              num_out_tokens=capacity))
        out = from_bytes(outs.pop(0)[:num_rows, :hidden], tokens.dtype)
        out_probs = None if probs is None else outs.pop(0)[:num_rows]
        out_scale = outs.pop(0)[:num_rows, :v.scale_columns(hidden)] if v.makes_scale else None  # rowwise: [M, 1] at H = 0
        row_map, tokens_per_expert = outs
        spare = RowMapLayout(v.mask, num_tokens, width, num_experts).words - row_map.shape[0]
        if spare:  # a row map is allocated as whole rows (permgen.core.results.RowMapLayout.words)
            row_map = torch.cat((row_map, row_map.new_zeros(spare)))
        write_route_tallies(v, routing_given, row_map, num_tokens, width, num_experts)
        return PermuteOutputs(out, out_probs, out_scale, tokens_per_expert.reshape(-1).to(torch.int64), row_map,
                              num_rows)

    def _check_hidden(self, hidden: int) -> None:
        if hidden > MAX_HIDDEN:
            raise ValueError(f"{self.name}: the nki target sums and scatters rows of at most {MAX_HIDDEN} columns (its "
                             f"accumulators for every column stay in SBUF, 224 KiB per partition on Trainium2), got "
                             f"H = {hidden}")

    def _sum_routes(self, row_id_map, rows_in):
        num_tokens, hidden = row_id_map.num_tokens, rows_in.shape[1]
        self._check_hidden(hidden)
        if num_tokens == 0 or hidden == 0 or rows_in.shape[0] == 0:
            return torch.zeros((num_tokens, hidden), dtype=rows_in.dtype, device=rows_in.device)
        return self._run(self.kernels.sum_routes, rows_in, row_id_map.row_map, **self._sizes(row_id_map))

    def unpermute(self, row_id_map, permuted, merging_probs):
        if merging_probs is None:
            return self._sum_routes(row_id_map, permuted)
        num_tokens, hidden = row_id_map.num_tokens, permuted.shape[1]
        self._check_hidden(hidden)
        if num_tokens == 0 or hidden == 0 or permuted.shape[0] == 0:
            return torch.zeros((num_tokens, hidden), dtype=permuted.dtype, device=permuted.device)
        return self._run(self.kernels.unpermute, permuted, row_id_map.row_map, merging_probs,
                         **self._sizes(row_id_map))

    def permute_backward(self, row_id_map, grad_out, grad_out_probs, probs_meta) -> Grads:
        if grad_out_probs is None:
            return Grads(self._sum_routes(row_id_map, grad_out.contiguous()), None)
        num_tokens, num_rows = row_id_map.num_tokens, row_id_map.num_rows
        shape, dtype = probs_meta
        hidden = 0 if grad_out is None else grad_out.shape[1]
        self._check_hidden(hidden)
        if num_tokens == 0 or num_rows == 0:
            grad_tokens = None if grad_out is None else torch.zeros((num_tokens, hidden), dtype=grad_out.dtype,
                                                                    device=grad_out.device)
            return Grads(grad_tokens, torch.zeros(shape, dtype=dtype, device=grad_out_probs.device))
        # One launch for both; without a token gradient (or columns) a zero column stands in.
        rows_in = grad_out if hidden else torch.zeros(
            (num_rows, 1), dtype=self.variant.combine_dtype if grad_out is None else grad_out.dtype,
            device=grad_out_probs.device)
        grad_tokens, grad_probs = self._run(self.kernels.permute_backward, rows_in, row_id_map.row_map,
                                            grad_out_probs, **self._sizes(row_id_map))
        return Grads(None if grad_out is None else grad_tokens[:, :hidden], grad_probs.to(dtype))

    def unpermute_backward(self, row_id_map, grad_out, permuted, merging_probs) -> Grads:
        num_tokens, num_rows, hidden = row_id_map.num_tokens, row_id_map.num_rows, grad_out.shape[1]
        self._check_hidden(hidden)
        empty = num_tokens == 0 or num_rows == 0 or hidden == 0
        if merging_probs is None:
            if empty:
                return Grads(torch.zeros((num_rows, hidden), dtype=grad_out.dtype, device=grad_out.device), None)
            return Grads(self._run(self.kernels.scatter_routes, grad_out, row_id_map.row_map, num_rows=num_rows,
                                   **self._sizes(row_id_map)), None)
        if empty:  # no routes, or dot products over no columns
            return Grads(torch.zeros((num_rows, hidden), dtype=grad_out.dtype, device=grad_out.device),
                         torch.zeros(merging_probs.shape, dtype=merging_probs.dtype, device=grad_out.device))
        return Grads(*self._run(self.kernels.unpermute_backward, grad_out, permuted, row_id_map.row_map, merging_probs,
                                **self._sizes(row_id_map)))


class NkiChunkKernels:
    """The chunk sort, for every dtype (permgen.core.ops.ChunkKernels): the chunk table with torch ops,
    the rows moved by a row gather kernel that depends on no variant (permgen.nki.kernels)."""

    target = "nki"

    def __init__(self, rows_kernel, rows_and_probs_kernel, simulate):
        self.rows_kernel, self.rows_and_probs_kernel, self.simulate = rows_kernel, rows_and_probs_kernel, simulate

    @staticmethod
    def check_device(tokens):
        _check_device("", tokens)

    @staticmethod
    def define_op(qualname, impl, schema):
        return custom_ops.define_op(qualname, impl, schema)

    @staticmethod
    def chunk_table(split_sizes, sorted_idxs):
        return chunk_table(split_sizes, sorted_idxs)

    def sort_chunks(self, table, inverse, tokens, probs):
        """The chunk sort by a chunk table (permgen.core.ops.chunk_table; inverse: its undoing half) as a
        row gather: each output row's source row found on the host by a sorted search."""
        starts, sources = table[2:] if inverse else table[:2]
        num_rows = tokens.shape[0]
        rows = torch.arange(num_rows, dtype=torch.int32, device=tokens.device)
        chunk = torch.searchsorted(starts, rows, right=True) - 1  # starts[0] = 0: every row has one
        source = sources[chunk] + rows - starts[chunk]
        # Rows past the chunks' total are zeros; so are rows whose source wrapped (device sizes are unchecked).
        moved = (chunk < starts.shape[0] - 1) & (source >= 0) & (source < num_rows)
        out, out_probs = self._gather_rows(torch.where(moved, source, 0), tokens, probs)
        out = out.view(torch.uint8).masked_fill(~moved[:, None], 0).view(out.dtype)  # as bytes: fp8 too
        return out, None if out_probs is None else out_probs.masked_fill(~moved, 0)

    def _gather_rows(self, rows, tokens, probs):
        """out[r] = tokens[rows[r]] (and probs); kernels take no empty tensors, so none runs for N = 0."""
        num_rows, hidden = tokens.shape
        if num_rows == 0:
            return torch.zeros_like(tokens), None if probs is None else torch.zeros_like(probs)
        # A zero column stands in for no columns.
        moved = tokens if hidden else torch.zeros((num_rows, 1), dtype=tokens.dtype, device=tokens.device)
        rows = rows.to(torch.int32).reshape(num_rows, 1)
        if probs is None:
            return from_bytes(_run(self.simulate, self.rows_kernel, as_bytes(moved), rows)[:, :hidden], tokens.dtype), None
        out, out_probs = _run(self.simulate, self.rows_and_probs_kernel, as_bytes(moved), probs.reshape(num_rows, 1), rows)
        return from_bytes(out[:, :hidden], tokens.dtype), out_probs.reshape(num_rows)


_CHUNK_SORT = None  # made on first use; every variant shares it, so its ops are registered once


def chunk_sort() -> ChunkSort:
    """The NKI target's chunk sort (permgen.nki.kernels' row gathers), the same for every variant."""
    global _CHUNK_SORT
    if _CHUNK_SORT is None:
        import nki

        from . import kernels
        _CHUNK_SORT = ChunkSort(NkiChunkKernels(kernels.sort_chunks, kernels.sort_chunks_probs, nki.simulate))
    return _CHUNK_SORT
