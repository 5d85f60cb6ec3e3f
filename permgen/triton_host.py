"""The Triton target's host side, written once for every variant: allocation and launches.

A generated module hands its kernels to `TritonBackend`; `permgen.ops` checks arguments and adds
autograd on top. Launch geometry (route tiles, row blocks, register caps) lives here as tuning
numbers; what a variant specialises is in its kernels.
"""

import functools
from typing import NamedTuple, Optional

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from .contract import FP8_DTYPES, out_dtype, scale_columns, scale_dtype, scale_kind, token_dtype
from .results import RowIdMap, route_words, row_map_words

_NO_CAP = 2**31 - 1  # row cap when num_out_tokens is not given: nothing is dropped
_ROW_BYTES_PER_WARP = 512  # 16-byte vectors for each of 32 lanes per step of a row loop
_NUM_WARPS = 4
_ROUTE_WARPS = 8
# Mask routing visits a token's live routes a tile at a time, the power of two nearest the average
# routes per token (rows / tokens, known on the host without a sync), at most 8 and the row map's
# width: a tile wider than a token's routes costs registers and occupancy for rows never live (at
# k = 2 a tile of 8 made unpermute 1.17x the copy floor instead of 1.08x); a token with more
# routes than the tile visits them a tile at a time.
_MAX_ROUTE_TILE = 8
_PAD_ROWS_PER_PROGRAM = 16
_TAIL_ROWS_PER_PROGRAM = 64  # rows past the last segment are zeroed by up to M / 64 programs
_CHUNK_TABLE_BLOCK = 1024  # chunks per step of the chunk table's one program
# The chunk sort copies 4 KiB of a row (or whole rows, if shorter) per step: on the H200 1.03x the copy
# floor at H = 2048 and 7168 (bf16), against 1.04-1.09x for tiles of 8-32 KiB.
_CHUNK_TILE_BYTES = 4096


class TritonKernels(NamedTuple):
    """One variant's kernels (the probs kernels only in variants with probs)."""

    route: JITFunction
    permute: JITFunction
    sum_routes: JITFunction
    scatter_routes: JITFunction
    unpermute: Optional[JITFunction] = None
    permute_backward: Optional[JITFunction] = None
    route_prob_grads: Optional[JITFunction] = None  # permute's backward for the probs alone
    unpermute_backward: Optional[JITFunction] = None


def _pow2(n):
    return 1 << (max(int(n), 1) - 1).bit_length()


def _cdiv(a, b):
    return -(-a // b)


_COMPILED = {}  # launch key (see _launch) -> (kernel, compiled kernel, launcher, handle, metadata, constexpr values)


def _hooked(hook):
    """Whether a launch hook is installed: a function (older Triton), or a HookChain with calls (Triton
    3.6 on: the chain object is always there, empty when nothing is hooked)."""
    return bool(getattr(hook, "calls", hook))


def _launch(kernel, programs, *args, **meta):
    """kernel[(programs,)](*args, **meta), at a fraction of the host cost once compiled.

    Triton's generic launch binds and specialises every argument on every call, which costs more
    host time than the launch itself. The key here holds what Triton specialises on: tensor dtypes
    and 16-byte alignment, and for ints whether they are 1, divisible by 16 and fit in 32 bits (no
    kernel takes None). A compiled kernel is then started through its launcher directly, unless a
    launch hook (a profiler) is installed. Every kernel's first argument is a tensor."""
    if not isinstance(kernel, JITFunction):  # the CPU interpreter
        kernel[(programs,)](*args, **meta)
        return
    device = args[0].get_device()
    # One comprehension, no call per argument: this runs for every launch. The kernel by id: a
    # JITFunction hashes in Python.
    key = (id(kernel), device, *meta.values(),
           *[(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor) else (a == 1, a & 15 == 0, a >> 31 == 0)
             for a in args])
    entry = _COMPILED.get(key)
    if entry is None or entry[0] is not kernel:  # an id can be reused once its kernel is gone
        compiled = kernel[(programs,)](*args, **meta)
        if isinstance(compiled, CompiledKernel):
            constexprs = tuple(meta[name] for name in kernel.arg_names[len(args):])
            _COMPILED[key] = kernel, compiled, compiled.run, compiled.function, compiled.packed_metadata, constexprs
        return
    _, compiled, launcher, function, packed_metadata, constexprs = entry
    stream = driver.active.get_current_stream(device)
    if not (_hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
        launcher(programs, 1, 1, stream, function, packed_metadata, None, None, None, *args, *constexprs)
    else:
        compiled[(programs, 1, 1)](*args, *constexprs, stream=stream)


_SCRATCH = {}  # device index -> permute's routing scratch on that device's default stream


def _routing_scratch(device, words):
    """int32 scratch for permute's routing, its first word (the ticket) zero.

    The routing kernel leaves the ticket at zero, and launches on one stream never overlap, so on
    a GPU's default stream one buffer is reused instead of zeroing a new one per call. On any other
    stream, and on the CPU interpreter, a fresh zeroed buffer is used: CUDA graphs are captured on
    other streams, and torch.compile's (mode "reduce-overhead") also warm up there, with every
    allocation going to their private pool, where a buffer that outlives the call is an error."""
    if device.type != "cuda" or driver.active.get_current_stream(device.index) != 0:  # 0: the default stream
        return torch.zeros(words, dtype=torch.int32, device=device)
    scratch = _SCRATCH.get(device.index)
    if scratch is None or scratch.numel() < words:
        scratch = _SCRATCH[device.index] = torch.zeros(max(words, 2 * (0 if scratch is None else scratch.numel())),
                                                       dtype=torch.int32, device=device)
    return scratch


def _register_cap(routes, scatter=False):
    """Registers per thread of the gathers (scatter=False) or scatters for a tile of `routes` rows,
    which they hold in fp32 (80-105 registers uncapped). H200: tiles of 8 at 64, 8 programs of 4 warps
    per SM instead of 4-6 (mask-routing unpermute backward: 1.19 -> 1.07x the copy floor; 48 made it
    1.12x). Gathers of tiles of 2 at 40, 12 programs instead of 10 (Mixtral's mask unpermute without
    topk: 1.099 -> 1.079x). Scatters keep 64: at 40, the small shape's index unpermute backward ran
    5% slower and Mixtral's no faster."""
    return 40 if routes <= 2 and not scatter else 64


def _row_block(t):
    """Row chunk per loop step for a tensor or dtype t: one 16-byte vector per lane."""
    return _ROW_BYTES_PER_WARP * _NUM_WARPS // t.itemsize


def _row_words(t):
    """The rows of a contiguous [R, C] tensor as the widest words (4, 2 or 1 bytes) that divide a row,
    for kernels that only copy rows: fp8 too, and no per-byte registers (a 4 KiB tile of uint8 spilled)."""
    row_bytes, offset_bytes = t.shape[1] * t.element_size(), t.storage_offset() * t.element_size()
    for dtype in (torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0 and offset_bytes % dtype.itemsize == 0:
            return t.view(dtype)
    return t.view(torch.uint8)


def _quantize_row_block(hidden):
    """Columns per step of a quantising permute: a quarter of the row, from 128 (one block128 block)
    to 2048 (H200, bf16 in: at H=7168 2048 columns ran 9% faster than 1024, at H=2048 512 columns 10%
    faster for block128)."""
    return max(128, min(2048, _pow2(hidden) // 4))


def _block_tokens(width):
    """Tokens per routing block: 1024 route slots, so the serial segment layout sees few blocks."""
    return max(1, 1024 // _pow2(width))


class TritonBackend:
    """Allocates and launches one variant's kernels (see permgen.ops for the interface)."""

    target = "triton"

    def __init__(self, variant: dict, kernels: TritonKernels):
        self.variant = variant
        self.kernels = kernels
        self.name = variant["name"]
        self.mask = variant["routing"] == "mask"
        self.pad = variant["pad"]
        self.fp8 = variant["dtype"] in FP8_DTYPES
        self.quantizes = variant["quantize"] != "none"  # float8_e4m3fn rows and their scales out
        self.has_scale = scale_kind(variant) != "none"  # permute returns scales (moved, or computed)
        self.token_dtype = token_dtype(variant)
        # Compiled kernels run on CUDA tensors; under TRITON_INTERPRET=1 they run on CPU tensors.
        # Decided once: torch.compile traces check_device, and cannot trace an isinstance of a kernel.
        self.device_type = "cuda" if isinstance(kernels.route, JITFunction) else "cpu"
        # lru_cache per instance: the launch geometry of each shape is worked out once.
        self._routing_launch = functools.lru_cache(maxsize=1024)(self._routing_geometry)
        self._rows_launch = functools.lru_cache(maxsize=1024)(self._rows_geometry)
        self._gather_launch = functools.lru_cache(maxsize=1024)(self._gather_geometry)
        self._prob_grads_launch = functools.lru_cache(maxsize=1024)(self._prob_grads_geometry)
        self._scatter_launch = functools.lru_cache(maxsize=1024)(self._scatter_geometry)

    def check_device(self, tokens):
        if tokens.device.type != self.device_type:
            raise ValueError(f"{self.name}: tokens are on {tokens.device}; the triton target runs on CUDA tensors "
                             "(CPU tensors under TRITON_INTERPRET=1)")

    # -- geometry --------------------------------------------------------------------------------

    def _max_route_tile(self, width, num_experts):
        if self.mask:
            return _pow2(min(num_experts, _MAX_ROUTE_TILE))
        return _pow2(width)

    @staticmethod
    def _widest_mask_tile(width, num_experts):
        """Mask routing's widest route tile: permute writes -1 to the dst rows of each token's slots
        from its route count up to it, so that a gather's first tile needs no count."""
        return _pow2(min(width, num_experts, _MAX_ROUTE_TILE))

    def _route_tile(self, width, num_experts, num_tokens, num_rows):
        """Route slots a kernel visits per step: all k of index routing at once; for mask routing the
        tile that holds a typical token's routes (see _MAX_ROUTE_TILE), with or without a topk hint."""
        if not self.mask:
            return _pow2(width)
        typical = round(num_rows / num_tokens) if num_tokens else 1
        return min(_pow2(typical), self._widest_mask_tile(width, num_experts))

    def _routing_geometry(self, num_tokens, width, num_experts):
        """(programs, scratch words, constexprs) of the routing kernel for one shape."""
        block_tokens = _block_tokens(self._max_route_tile(width, num_experts))
        # At least one routing program runs: the last one lays out the segments, even for N = 0.
        num_blocks = max(1, _cdiv(num_tokens, block_tokens))
        e_pow2 = _pow2(num_experts)
        meta = dict(K=width, E=num_experts, E_POW2=e_pow2, BLOCK_TOKENS=block_tokens)
        if self.mask:
            meta.update(EXPERT_CHUNK=max(1, min(e_pow2, 4096 // block_tokens)))
        else:
            meta.update(BLOCK_ROUTES=_pow2(block_tokens * width), BINS=_pow2(num_experts + 2))
        meta.update(CHUNK_BLOCKS=max(1, 8192 // e_pow2), PAD=self.pad)  # PAD 0: no padding
        # ticket, block counts, mask routing's ranks, block drops (see the routing kernel)
        scratch_words = 1 + num_blocks * (num_experts + 1) + (num_tokens * width if self.mask else 0)
        return num_blocks, scratch_words, meta

    def _zero_programs(self, num_experts, num_rows, tail):
        """(programs, tail programs, constexprs) of the programs that zero unwritten rows: pad rows of
        each expert, then the rows past the last segment (only when num_out_tokens fixed the row count)."""
        tail_programs = _cdiv(num_rows, _TAIL_ROWS_PER_PROGRAM) if tail else 0
        if not self.pad:  # PAD_GROUPS 0: the kernels compile without the pad rows' programs
            return tail_programs, tail_programs, dict(PAD_GROUPS=0, PAD_ROWS_PER_PROGRAM=0)
        pad_groups = _cdiv(self.pad - 1, _PAD_ROWS_PER_PROGRAM)
        return (num_experts * pad_groups + tail_programs, tail_programs,
                dict(PAD_GROUPS=pad_groups, PAD_ROWS_PER_PROGRAM=_PAD_ROWS_PER_PROGRAM))

    def _rows_geometry(self, num_tokens, hidden, width, num_experts, num_rows, capped, scale_columns_in):
        """(programs, zero programs, tail programs, constexprs) of the permute kernel for one shape.
        The constexprs are shared between calls: never changed by a caller."""
        route_meta = self._routing_launch(num_tokens, width, num_experts)[2]
        zero_programs, tail_programs, zero_meta = self._zero_programs(num_experts, num_rows, tail=capped)
        meta = dict(K=width, ROUTES=self._route_tile(width, num_experts, num_tokens, num_rows), E=num_experts,
                    BLOCK_TOKENS=route_meta["BLOCK_TOKENS"])
        if self.mask:
            meta.update(MAX_ROUTES=self._widest_mask_tile(width, num_experts))
        else:
            meta.update(BLOCK_ROUTES=route_meta["BLOCK_ROUTES"])
        # fp8 rows move as bytes, the same size as their dtype.
        meta.update(BLOCK_H=_quantize_row_block(hidden) if self.quantizes else _row_block(self.token_dtype))
        if scale_columns_in is not None:
            meta.update(BLOCK_S=min(_pow2(scale_columns_in), 256))
        if self.quantizes:
            # The interpreter's fp8 cast does not round to even: the kernel then converts in integers.
            meta.update(BLOCK_S=min(_pow2(scale_columns(self.variant, hidden)), 256),
                        HARDWARE_CAST=self.device_type == "cuda")
        meta.update(zero_meta, num_warps=_NUM_WARPS)
        return zero_programs + num_tokens, zero_programs, tail_programs, meta

    # The constexprs of the gathers, prob-grad and scatter kernels for one shape: dicts shared between
    # calls, never changed by a caller.

    def _route_meta(self, width, num_experts, num_tokens, num_rows, experts, prob_grads):
        """K and ROUTES of a kernel that visits each token's route slots; E where it takes the expert
        count (experts), and E_POW2 where it zeroes mask routing's rows of E prob grads (prob_grads)."""
        meta = dict(K=width, ROUTES=self._route_tile(width, num_experts, num_tokens, num_rows))
        if experts:
            meta.update(E=num_experts)
        if prob_grads and self.mask:
            meta.update(E_POW2=_pow2(num_experts))
        return meta

    def _gather_geometry(self, width, num_experts, num_tokens, num_rows, hidden_block, prob_grads):
        """The row sums' (unpermute, permute backward; prob_grads: with the prob grads)."""
        meta = self._route_meta(width, num_experts, num_tokens, num_rows, self.mask, prob_grads)
        meta.update(BLOCK_H=hidden_block, num_warps=_NUM_WARPS, maxnreg=_register_cap(meta["ROUTES"]))
        return meta

    def _prob_grads_geometry(self, width, num_experts, num_tokens, num_rows):
        """The prob grads' alone (permute backward of fp8 tokens)."""
        meta = self._route_meta(width, num_experts, num_tokens, num_rows, self.mask, True)
        meta.update(num_warps=_NUM_WARPS)
        return meta

    def _scatter_geometry(self, width, num_experts, num_tokens, num_rows, hidden_block, weighted):
        """(zero programs, tail programs, constexprs) of the scatters (unpermute backward): their first
        programs zero every row that is not some token's route."""
        zero_programs, tail_programs, zero_meta = self._zero_programs(num_experts, num_rows, tail=True)
        meta = self._route_meta(width, num_experts, num_tokens, num_rows, True, weighted)
        meta.update(BLOCK_H=hidden_block, **zero_meta, num_warps=_NUM_WARPS,
                    maxnreg=_register_cap(meta["ROUTES"], scatter=True))
        return zero_programs, tail_programs, meta

    def _gather_meta(self, row_id_map, hidden_block, prob_grads=False):
        return self._gather_launch(row_id_map.width, row_id_map.num_experts, row_id_map.num_tokens,
                                   row_id_map.num_rows, hidden_block, prob_grads)

    def row_id_map(self, row_map, routing, plan, num_rows):
        return RowIdMap(row_map, routing, plan.num_tokens, plan.width, plan.num_experts, num_rows, self.name)

    # -- ops ---------------------------------------------------------------------------------------

    def permute(self, plan, tokens, routing, probs, scale):
        """Two launches (routing, then rows)."""
        num_tokens, hidden, num_experts, width = plan.num_tokens, plan.hidden, plan.num_experts, plan.width
        device = tokens.device
        num_blocks, scratch_words, route_meta = self._routing_launch(num_tokens, width, num_experts)
        words = route_words(self.mask, num_tokens, width)
        row_map = torch.empty(row_map_words(self.mask, num_tokens, width, num_experts), dtype=torch.int32, device=device)
        tokens_per_expert = torch.empty(num_experts, dtype=torch.int64, device=device)
        scratch = _routing_scratch(device, scratch_words)
        if self.mask and routing.dtype == torch.bool:
            routing = routing.view(torch.uint8)  # bools are loaded as bytes
        cap = plan.num_out_tokens
        _launch(self.kernels.route, num_blocks, routing, row_map, tokens_per_expert, scratch,
                num_tokens, num_blocks, _NO_CAP if cap is None else cap, **route_meta, num_warps=_ROUTE_WARPS)
        # Without a cap the row count is data-dependent: permute's one host sync (rows in use = offsets[E]).
        num_rows = int(row_map[words + num_experts]) if cap is None else cap

        if self.fp8:
            # fp8 rows move as bytes: Triton's fp8 types need a recent GPU even for a plain copy.
            out = torch.empty((num_rows, hidden), dtype=torch.uint8, device=device)
            tokens = tokens.view(torch.uint8)
        elif self.quantizes:
            out = torch.empty((num_rows, hidden), dtype=torch.uint8, device=device)  # written as fp8 bytes
            if tokens.dtype == torch.bfloat16:
                tokens = tokens.view(torch.int16)  # widened to fp32 from the bits
        else:
            out = torch.empty((num_rows, hidden), dtype=tokens.dtype, device=device)
        out_probs = None if probs is None else torch.empty(num_rows, dtype=probs.dtype, device=device)
        out_scale = None  # the scales moved with the rows (fp8 variants), or computed (quantising variants)
        if self.has_scale:
            out_scale = torch.empty((num_rows, scale_columns(self.variant, hidden)), dtype=scale_dtype(self.variant),
                                    device=device)
        scale_columns_in = None if scale is None else scale.shape[1]
        programs, zero_programs, tail_programs, meta = self._rows_launch(
            num_tokens, hidden, width, num_experts, num_rows, cap is not None, scale_columns_in)
        if programs:
            args = [tokens] + ([] if self.mask else [routing]) + [row_map, scratch, out]
            if probs is not None:
                args += [probs, out_probs]
            if scale is not None:
                args += [scale, out_scale, scale.shape[1]]
            if self.quantizes:
                args += [out_scale, out_scale.shape[1]]
            _launch(self.kernels.permute, programs, *args, num_tokens, num_rows, hidden, num_blocks, zero_programs,
                    tail_programs, **meta)
        if self.fp8 or self.quantizes:
            out = out.view(out_dtype(self.variant))
        return out, out_probs, out_scale, tokens_per_expert, row_map, num_rows

    def unpermute(self, row_id_map, permuted, merging_probs):
        num_tokens, hidden = row_id_map.num_tokens, permuted.shape[1]
        out = torch.empty((num_tokens, hidden), dtype=permuted.dtype, device=permuted.device)
        if num_tokens and hidden:  # the gathers assume a column
            meta = self._gather_meta(row_id_map, _row_block(permuted))
            if merging_probs is not None:
                _launch(self.kernels.unpermute, num_tokens, permuted, row_id_map.row_map, merging_probs, out,
                        num_tokens, row_id_map.num_rows, hidden, **meta)
            else:
                _launch(self.kernels.sum_routes, num_tokens, permuted, row_id_map.row_map, out, num_tokens,
                        row_id_map.num_rows, hidden, **meta)
        return out

    def permute_backward(self, row_id_map, grad_out, grad_out_probs, probs_meta):
        num_tokens = row_id_map.num_tokens
        grad_tokens = grad_probs = None
        if grad_out is not None:
            grad_out = grad_out.contiguous()
            grad_tokens = torch.empty((num_tokens, grad_out.shape[1]), dtype=grad_out.dtype, device=grad_out.device)
        if grad_out_probs is not None:
            shape, dtype = probs_meta
            grad_probs = torch.empty(shape, dtype=dtype, device=grad_out_probs.device)
            grad_out_probs = grad_out_probs.contiguous()
            if num_tokens and grad_out is not None and grad_out.shape[1]:
                # One launch for both: the prob grads ride along with the row sums (which assume a column).
                _launch(self.kernels.permute_backward, num_tokens, grad_out, row_id_map.row_map, grad_out_probs,
                        grad_probs, grad_tokens, num_tokens, row_id_map.num_rows, grad_out.shape[1],
                        **self._gather_meta(row_id_map, _row_block(grad_out), prob_grads=True))
            elif num_tokens:
                meta = self._prob_grads_launch(row_id_map.width, row_id_map.num_experts, num_tokens,
                                               row_id_map.num_rows)
                _launch(self.kernels.route_prob_grads, num_tokens, row_id_map.row_map, grad_out_probs, grad_probs,
                        num_tokens, row_id_map.num_rows, **meta)
        elif grad_out is not None and num_tokens and grad_out.shape[1]:
            _launch(self.kernels.sum_routes, num_tokens, grad_out, row_id_map.row_map, grad_tokens, num_tokens,
                    row_id_map.num_rows, grad_out.shape[1], **self._gather_meta(row_id_map, _row_block(grad_out)))
        return grad_tokens, grad_probs

    def unpermute_backward(self, row_id_map, grad_out, permuted, merging_probs):
        num_tokens, num_rows, num_experts = row_id_map.num_tokens, row_id_map.num_rows, row_id_map.num_experts
        hidden = grad_out.shape[1]
        grad_permuted = torch.empty((num_rows, hidden), dtype=grad_out.dtype, device=grad_out.device)
        zero_programs, tail_programs, meta = self._scatter_launch(
            row_id_map.width, num_experts, num_tokens, num_rows, _row_block(grad_out), merging_probs is not None)
        programs = zero_programs + num_tokens
        sizes = (num_tokens, num_rows, hidden, zero_programs, tail_programs)
        if merging_probs is not None:
            grad_probs = torch.empty(merging_probs.shape, dtype=merging_probs.dtype, device=grad_out.device)
            if programs:
                _launch(self.kernels.unpermute_backward, programs, grad_out, row_id_map.row_map, merging_probs,
                        permuted, grad_probs, grad_permuted, *sizes, **meta)
            return grad_permuted, grad_probs
        if programs:
            _launch(self.kernels.scatter_routes, programs, grad_out, row_id_map.row_map, grad_permuted, *sizes, **meta)
        return grad_permuted, None

    # -- chunk sort (bound by the module after its chunk sort kernels: Ops.bind_sort_chunks) --------

    def bind_sort_chunks(self, table_kernel, gather_kernel, sort_kernel, sort_probs_kernel=None):
        self.chunk_table_kernel, self.gather_rows_kernel = table_kernel, gather_kernel
        self.sort_chunks_kernels = (sort_kernel, sort_probs_kernel)

    def chunk_table(self, split_sizes, sorted_idxs):
        """int32 [4, C + 1]: where each chunk starts, in the input and in the output (layout:
        permgen.ops.chunk_table), computed by one program on the device."""
        num_chunks = split_sizes.shape[0]
        table = torch.empty((4, num_chunks + 1), dtype=torch.int32, device=split_sizes.device)
        _launch(self.chunk_table_kernel, 1, split_sizes, sorted_idxs, table, num_chunks,
                BLOCK_C=min(_pow2(num_chunks), _CHUNK_TABLE_BLOCK), num_warps=_NUM_WARPS)
        return table

    def sort_chunks(self, table, inverse, tokens, probs):
        """The chunk sort of tokens [N, H] (and probs [N]) by a chunk table; inverse: the table's
        other half, which undoes the sort (the backward pass)."""
        starts, sources = table[2:] if inverse else table[:2]
        num_chunks = table.shape[1] - 1
        moved = _row_words(tokens)
        num_rows, hidden = moved.shape
        out = torch.empty_like(moved)
        out_probs = None if probs is None else torch.empty_like(probs)
        if num_rows:
            block_h = min(_pow2(hidden), _CHUNK_TILE_BYTES // moved.element_size())
            meta = dict(SEARCH_STEPS=num_chunks.bit_length(), BLOCK_H=block_h, num_warps=_NUM_WARPS,
                        BLOCK_ROWS=max(1, _CHUNK_TILE_BYTES // (block_h * moved.element_size())))
            programs = _cdiv(num_rows, meta["BLOCK_ROWS"])
            sort_kernel, sort_probs_kernel = self.sort_chunks_kernels
            if probs is None:
                _launch(sort_kernel, programs, moved, starts, sources, out, num_rows, hidden, num_chunks, **meta)
            else:
                _launch(sort_probs_kernel, programs, moved, probs, starts, sources, out, out_probs, num_rows, hidden,
                        num_chunks, **meta)
        return out.view(tokens.dtype), out_probs

    def gather_rows(self, rows, src):
        """out[r] = src[rows[r]] for a 2-D src, one program per entry of rows (expert parallelism's
        regrouping: rows may repeat or skip source rows)."""
        out = torch.empty((rows.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
        if rows.shape[0]:
            _launch(self.gather_rows_kernel, rows.shape[0], src, rows, out, src.shape[1], BLOCK_H=_row_block(src),
                    num_warps=_NUM_WARPS)
        return out
