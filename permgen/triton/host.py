"""The Triton target's host side, written once for every variant: allocation and launches.

A generated module hands its permute kernel to `TritonBackend` (a permgen.core.ops.Backend), which
launches it beside the kernels no variant axis changes (permgen.triton.kernels': the routing plan,
unpermute and the backward passes, each taking the routing kind as the constexpr MASK); `permgen.core.ops`
checks arguments and adds autograd on top. Launch geometry (route tiles, row blocks, register caps)
lives here as tuning numbers; what a variant specialises is in its permute kernel. The chunk sort and
the row gather, which no variant changes either, are `TritonChunkKernels` (one `chunk_sort()` for all).
"""

import functools
from typing import NamedTuple, Optional

import torch
from triton import knobs
from triton.language.core import TRITON_MAX_TENSOR_NUMEL
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from ..core.ops import ChunkSort, Grads, PermuteOutputs
from ..core.results import RowMapLayout
from ..core.variant import Variant
from .kernels import (chunk_table_kernel, gather_rows_kernel, index_route_kernel, mask_route_kernel,
                      permute_backward_kernel, route_prob_grads_kernel, scatter_routes_kernel,
                      sort_chunks_kernel, sort_chunks_probs_kernel, sum_routes_kernel, unpermute_backward_kernel,
                      unpermute_kernel)

_NO_CAP = 2**31 - 1  # row cap when num_out_tokens is not given: nothing is dropped
_ROW_BYTES_PER_WARP = 512  # 16-byte vectors for each of 32 lanes per step of a row loop
_NUM_WARPS = 4
_ROUTE_WARPS = 8
# Mask routing visits a token's live routes a tile at a time, the power of two nearest the average
# routes per token (rows / tokens, known on the host without a sync), at most 8 and the row map's
# width: a tile wider than a token's routes costs registers and occupancy for rows never live; a
# token with more routes than the tile visits them a tile at a time.
_MAX_ROUTE_TILE = 8
_PAD_ROWS_PER_PROGRAM = 16
_TAIL_ROWS_PER_PROGRAM = 64  # rows past the last segment are zeroed by up to M / 64 programs
_CHUNK_TABLE_BLOCK = 1024  # chunks per step of the chunk table's one program
_CHUNK_TILE_BYTES = 4096  # the chunk sort copies 4 KiB of a row (or whole rows, if shorter) per step
_GEOMETRIES = 1024  # launch geometries kept per kernel family (lru_cache)
# The routing plan holds a bin per expert, and two more, in one tensor (index routing's BINS, mask
# routing's E_POW2): a Triton tensor has at most TRITON_MAX_TENSOR_NUMEL (2**20) elements.
MAX_EXPERTS = TRITON_MAX_TENSOR_NUMEL - 2


def _pow2(n):
    return 1 << (max(int(n), 1) - 1).bit_length()


def _cdiv(a, b):
    return -(-a // b)


def _hooked(hook):
    """Whether a launch hook is installed: a function (older Triton), or a HookChain with calls (Triton
    3.6 on: the chain object is always there, empty when nothing is hooked)."""
    return bool(getattr(hook, "calls", hook))


def _aligned(*tensors) -> bool:
    """Whether every tensor's data starts on 16 bytes (what Triton specialises pointers on)."""
    pointers = 0
    for t in tensors:
        pointers |= t.data_ptr()
    return pointers & 15 == 0


class Launch:
    """kernel[(programs,)](*args, **meta) at one launch geometry: the grid, the constexprs and the
    values of the int arguments are fixed by the shape it was made for (the lru_caches below key
    it by them, and by the dtypes of the tensors that may vary), so only the tensors change.

    Triton's generic launch binds and specialises every argument on every call, which costs more
    host time than the launch itself. Once compiled for 16-byte aligned tensors, a call with
    aligned tensors on the same device starts the compiled kernel through its launcher directly,
    unless a launch hook (a profiler) is installed; any other call takes the generic launch."""

    __slots__ = ("kernel", "programs", "meta", "compiled")

    def __init__(self, kernel, programs, meta):
        self.kernel, self.programs, self.meta, self.compiled = kernel, programs, meta, None

    def __call__(self, device: int, aligned: bool, *args):
        """device: the tensors' CUDA device index; aligned: _aligned of the tensors not allocated here."""
        compiled = self.compiled
        if compiled is not None and aligned and compiled[0] == device and not (
                _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
            _, launcher, function, packed_metadata, constexprs = compiled
            launcher(self.programs, 1, 1, driver.active.get_current_stream(device), function, packed_metadata,
                     None, None, None, *args, *constexprs)
            return
        result = self.kernel[(self.programs,)](*args, **self.meta)
        if aligned and compiled is None and isinstance(result, CompiledKernel):
            constexprs = tuple(self.meta[name] for name in self.kernel.arg_names[len(args):])
            self.compiled = device, result.run, result.function, result.packed_metadata, constexprs


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
    which they hold in fp32 (80-105 registers uncapped): tiles of 8 at 64 let 8 programs of 4 warps
    share an SM instead of 4-6, gathers of tiles of 2 at 40 let 12 instead of 10; scatters keep 64,
    which were slower at 40."""
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


def _quantize_row_geometry(hidden):
    """(columns per step, warps) of a quantising permute: steps of up to 4096 columns (at least 128, one
    block128 block), and 2 warps for rows of up to 4096 columns. On the H200 this ran the Qwen3 and
    Mixtral shapes (H = 2048, 4096) 1.1-1.4x faster than quarter-row steps with 4 warps, and DeepSeek-V3's
    (H = 7168) as fast (benchmarks/bench_quantize.py)."""
    width = _pow2(hidden)
    return max(128, min(4096, width)), 2 if width <= 4096 else _NUM_WARPS


def _block_tokens(width):
    """Tokens per routing block: 1024 route slots, so the serial segment layout sees few blocks."""
    return max(1, 1024 // _pow2(width))


def _geometry(method):
    """A per-instance lru_cache of a geometry method: each shape's launches are worked out once."""
    @functools.wraps(method)
    def cached(self, *key):
        cache = self.__dict__.get(method.__name__)
        if cache is None:
            cache = self.__dict__[method.__name__] = functools.lru_cache(maxsize=_GEOMETRIES)(
                functools.partial(method, self))
        return cache(*key)
    return cached


class _PermuteProgram(NamedTuple):
    route: Launch  # the routing kernel's
    scratch_words: int
    words: int  # of the row map
    count_word: int  # the row map's word that holds the rows in use (segment offsets[E])
    end: int  # of the row map's words in use
    unslotted_step: int  # from count_word to the route tallies' routes without a slot
    rows: Optional[tuple]  # with a row cap: _rows_launch's (Launch or None, blocks, zero programs, tail programs)


class TritonBackend:
    """Allocates and launches one variant's kernels (permgen.core.ops.Backend): its permute kernel, and
    permgen.triton.kernels' for the rest."""

    target = "triton"
    checks_routing_in_read = True

    def __init__(self, variant, permute_kernel: JITFunction):
        self.variant = Variant.of(variant).bind_torch()
        self.permute_kernel = permute_kernel
        self.route_kernel = mask_route_kernel if self.variant.mask else index_route_kernel
        self.name = self.variant.name
        # Compiled kernels run on CUDA tensors; under TRITON_INTERPRET=1 they run on CPU tensors.
        # Decided once: torch.compile traces check_device, and cannot trace an isinstance of a kernel.
        self.device_type = "cuda" if isinstance(permute_kernel, JITFunction) else "cpu"

    @staticmethod
    def chunk_sort():
        return chunk_sort()

    def check_device(self, tokens):
        if tokens.device.type != self.device_type:
            raise ValueError(f"{self.name}: tokens are on {tokens.device}; the triton target runs on CUDA tensors "
                             "(CPU tensors under TRITON_INTERPRET=1)")

    # -- geometry: one Launch per kernel and shape -------------------------------------------------

    def _max_route_tile(self, width, num_experts):
        if self.variant.mask:
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
        if not self.variant.mask:
            return _pow2(width)
        typical = round(num_rows / num_tokens) if num_tokens else 1
        return min(_pow2(typical), self._widest_mask_tile(width, num_experts))

    def _routing_meta(self, num_tokens, width, num_experts):
        """(programs, scratch words, constexprs) of the routing kernel for one shape."""
        block_tokens = _block_tokens(self._max_route_tile(width, num_experts))
        # At least one routing program runs: the last one lays out the segments, even for N = 0.
        num_blocks = max(1, _cdiv(num_tokens, block_tokens))
        e_pow2 = _pow2(num_experts)
        meta = dict(K=width, E=num_experts, E_POW2=e_pow2, BLOCK_TOKENS=block_tokens)
        if self.variant.mask:
            meta.update(EXPERT_CHUNK=max(1, min(e_pow2, 4096 // block_tokens)))
        else:
            meta.update(BLOCK_ROUTES=_pow2(block_tokens * width), BINS=_pow2(num_experts + 2))
        meta.update(CHUNK_BLOCKS=max(1, 8192 // e_pow2), PAD=self.variant.pad)  # PAD 0: no padding
        # ticket, block counts, mask routing's ranks, block drops (see the routing kernel)
        scratch_words = 1 + num_blocks * (num_experts + 1) + (num_tokens * width if self.variant.mask else 0)
        return num_blocks, scratch_words, meta

    @_geometry
    def _routing_launch(self, num_tokens, width, num_experts, cap, routing_dtype):
        """(Launch, scratch words, row map layout) of the routing kernel."""
        num_blocks, scratch_words, meta = self._routing_meta(num_tokens, width, num_experts)
        return (Launch(self.route_kernel, num_blocks, dict(meta, num_warps=_ROUTE_WARPS)), scratch_words,
                RowMapLayout(self.variant.mask, num_tokens, width, num_experts))

    def _zero_programs(self, num_experts, num_rows, tail):
        """(programs, tail programs, constexprs) of the programs that zero unwritten rows: pad rows of
        each expert, then the rows past the last segment (only when num_out_tokens fixed the row count)."""
        pad = self.variant.pad
        tail_programs = _cdiv(num_rows, _TAIL_ROWS_PER_PROGRAM) if tail else 0
        if not pad:  # PAD_GROUPS 0: the kernels compile without the pad rows' programs
            return tail_programs, tail_programs, dict(PAD_GROUPS=0, PAD_ROWS_PER_PROGRAM=0)
        pad_groups = _cdiv(pad - 1, _PAD_ROWS_PER_PROGRAM)
        return (num_experts * pad_groups + tail_programs, tail_programs,
                dict(PAD_GROUPS=pad_groups, PAD_ROWS_PER_PROGRAM=_PAD_ROWS_PER_PROGRAM))

    @_geometry
    def _rows_launch(self, num_tokens, hidden, width, num_experts, num_rows, capped, scale_columns_in,
                     routing_dtype, probs_dtype):
        """(Launch or None, zero programs, tail programs) of the permute kernel for one shape."""
        v = self.variant
        num_blocks, _, route_meta = self._routing_meta(num_tokens, width, num_experts)
        zero_programs, tail_programs, zero_meta = self._zero_programs(num_experts, num_rows, tail=capped)
        meta = dict(K=width, ROUTES=self._route_tile(width, num_experts, num_tokens, num_rows), E=num_experts,
                    BLOCK_TOKENS=route_meta["BLOCK_TOKENS"])
        if v.mask:
            meta.update(MAX_ROUTES=self._widest_mask_tile(width, num_experts))
        else:
            meta.update(BLOCK_ROUTES=route_meta["BLOCK_ROUTES"])
        # fp8 rows move as bytes, the same size as their dtype.
        warps = _NUM_WARPS
        if v.quantizes:
            block_h, warps = _quantize_row_geometry(hidden)
            meta.update(BLOCK_H=block_h)
        else:
            meta.update(BLOCK_H=_row_block(v.token_dtype))
        if scale_columns_in is not None:
            meta.update(BLOCK_S=min(_pow2(scale_columns_in), 256))
        if v.quantizes:
            # The interpreter's fp8 cast does not round to even: the kernel then converts in integers.
            meta.update(BLOCK_S=min(_pow2(v.scale_columns(hidden)), 256), HARDWARE_CAST=self.device_type == "cuda")
        meta.update(zero_meta, num_warps=warps)
        programs = zero_programs + num_tokens
        return (Launch(self.permute_kernel, programs, meta) if programs else None), num_blocks, zero_programs, \
            tail_programs

    def _route_meta(self, width, num_experts, num_tokens, num_rows, prob_grads):
        """K, ROUTES, E and the routing kind (MASK) of a kernel that visits each token's route slots
        (permgen.triton.kernels' gathers and scatters take them all, used or not), and E_POW2 where it
        writes prob grads (prob_grads; mask routing zeroes rows of E of them)."""
        meta = dict(K=width, ROUTES=self._route_tile(width, num_experts, num_tokens, num_rows), E=num_experts)
        if prob_grads:
            meta.update(E_POW2=_pow2(num_experts))
        meta.update(MASK=self.variant.mask)
        return meta

    @_geometry
    def _gather_launch(self, kernel, width, num_experts, num_tokens, num_rows, hidden, dtypes, prob_grads):
        """The row sums' (unpermute, permute backward; prob_grads: with the prob grads); dtypes: the
        tensors' that may vary."""
        meta = self._route_meta(width, num_experts, num_tokens, num_rows, prob_grads)
        meta.update(BLOCK_H=_row_block(dtypes[0]), num_warps=_NUM_WARPS, maxnreg=_register_cap(meta["ROUTES"]))
        return Launch(kernel, num_tokens, meta)

    @_geometry
    def _prob_grads_launch(self, width, num_experts, num_tokens, num_rows, dtypes):
        """The prob grads' alone (permute backward of fp8 tokens)."""
        meta = self._route_meta(width, num_experts, num_tokens, num_rows, True)
        meta.update(num_warps=_NUM_WARPS)
        return Launch(route_prob_grads_kernel, num_tokens, meta)

    @_geometry
    def _scatter_launch(self, kernel, width, num_experts, num_tokens, num_rows, hidden, dtypes, weighted):
        """(Launch or None, zero programs, tail programs) of the scatters (unpermute backward): their
        first programs zero every row that is not some token's route."""
        zero_programs, tail_programs, zero_meta = self._zero_programs(num_experts, num_rows, tail=True)
        meta = self._route_meta(width, num_experts, num_tokens, num_rows, weighted)
        meta.update(BLOCK_H=_row_block(dtypes[0]), **zero_meta, num_warps=_NUM_WARPS,
                    maxnreg=_register_cap(meta["ROUTES"], scatter=True))
        programs = zero_programs + num_tokens
        return (Launch(kernel, programs, meta) if programs else None), zero_programs, \
            tail_programs

    # -- ops ---------------------------------------------------------------------------------------

    @_geometry
    def _permute_program(self, plan, routing_dtype, probs_dtype, scale_columns_in):
        """permute's launches for one checked plan, worked out once: the call then allocates and launches."""
        num_tokens, hidden, num_experts, width, cap = (plan.num_tokens, plan.hidden, plan.num_experts, plan.width,
                                                       plan.num_out_tokens)
        if num_experts > MAX_EXPERTS:  # (the NKI target's refusal, in the same words)
            raise ValueError(f"{self.name}: the triton target supports at most {MAX_EXPERTS} experts, "
                             f"got {num_experts}")
        route, scratch_words, layout = self._routing_launch(num_tokens, width, num_experts, cap, routing_dtype)
        rows = None if cap is None else self._rows_launch(num_tokens, hidden, width, num_experts, cap, True,
                                                          scale_columns_in, routing_dtype, probs_dtype)
        # Read without a cap: offsets[E] (the rows in use) and, E + 2 words on, the routes without a slot
        # (route tallies[1]), in one strided read.
        count_word = layout.segment_offsets + num_experts
        return _PermuteProgram(route, scratch_words, layout.words, count_word, layout.end, layout.end - 1 - count_word,
                               rows)

    def permute(self, plan, tokens, routing, probs, scale, routed=None) -> PermuteOutputs:
        """Two launches (routing, then rows). routed(row_map), when given, is called between them:
        expert parallelism queues its count exchange there, so that it runs before the rows move.
        Without a cap the row count is read back: permute's one host read, which also reads whether the
        routing is valid when the plan checks it (checks_routing_in_read)."""
        v = self.variant
        num_tokens, hidden, num_experts = plan.num_tokens, plan.hidden, plan.num_experts
        cap = plan.num_out_tokens
        routing_given = routing
        if v.mask and routing.dtype == torch.bool:
            routing = routing.view(torch.uint8)  # bools are loaded as bytes
        program = self._permute_program(plan, routing.dtype, None if probs is None else probs.dtype,
                                        None if scale is None else scale.shape[1])
        device = tokens.device
        index = tokens.get_device()
        aligned = (_aligned(tokens, routing) and (probs is None or _aligned(probs))
                   and (scale is None or _aligned(scale)))
        row_map = torch.empty(program.words, dtype=torch.int32, device=device)
        tokens_per_expert = torch.empty(num_experts, dtype=torch.int64, device=device)
        scratch = _routing_scratch(device, program.scratch_words)
        route = program.route
        num_blocks = route.programs
        route(index, aligned, routing, row_map, tokens_per_expert, scratch, num_tokens, num_blocks,
              _NO_CAP if cap is None else cap)
        if routed is not None:
            routed(row_map)
        bad_routing = None
        if cap is None:
            num_rows, bad_routing = self._read_rows(plan, program, row_map, routing_given)
        else:
            num_rows = cap

        if v.is_fp8 or v.quantizes:
            # fp8 rows move as bytes (Triton's fp8 types need a recent GPU even for a plain copy);
            # quantising variants write fp8 bytes
            out = torch.empty((num_rows, hidden), dtype=torch.uint8, device=device)
            if v.is_fp8:
                tokens = tokens.view(torch.uint8)
            elif tokens.dtype == torch.bfloat16:
                tokens = tokens.view(torch.int16)  # widened to fp32 from the bits
        else:
            out = torch.empty((num_rows, hidden), dtype=tokens.dtype, device=device)
        out_probs = None if probs is None else torch.empty(num_rows, dtype=probs.dtype, device=device)
        out_scale = None  # the scales moved with the rows (fp8 variants), or computed (quantising variants)
        if v.makes_scale:
            out_scale = torch.empty((num_rows, v.scale_columns(hidden)), dtype=v.scale_dtype, device=device)
        if cap is None:
            rows, _, zero_programs, tail_programs = self._rows_launch(
                num_tokens, hidden, plan.width, num_experts, num_rows, False,
                None if scale is None else scale.shape[1], routing.dtype, None if probs is None else probs.dtype)
        else:
            rows, _, zero_programs, tail_programs = program.rows
        if rows is not None:
            args = [tokens] + ([] if v.mask else [routing]) + [row_map, scratch, out]
            if probs is not None:
                args += [probs, out_probs]
            if scale is not None:
                args += [scale, out_scale, scale.shape[1]]
            if v.quantizes:
                args += [out_scale, out_scale.shape[1]]
            rows(index, aligned, *args, num_tokens, num_rows, hidden, num_blocks, zero_programs, tail_programs)
        if v.is_fp8 or v.quantizes:
            out = out.view(v.out_dtype)
        return PermuteOutputs(out, out_probs, out_scale, tokens_per_expert, row_map, num_rows, bad_routing)

    def _read_rows(self, plan, program, row_map, routing):
        """(rows in use, whether the routing breaks check_routing's rules or None) in one host read.
        The routing kernel counts the routes without a slot (ids outside [-1, E); mask routes past
        topk); an integer mask's values other than 0 and 1 are counted here, on the device."""
        if not plan.check_routing:
            return int(row_map[program.count_word]), None
        words = row_map[program.count_word:program.end:program.unslotted_step]  # offsets[E], unslotted
        if self.variant.mask and routing.dtype != torch.bool:
            other_values = (routing.ne(0) & routing.ne(1)).sum(dtype=torch.int32).reshape(1)
            words = torch.cat((words, other_values))
        read = words.tolist()
        return read[0], any(read[1:])

    def unpermute(self, row_id_map, permuted, merging_probs):
        num_tokens, hidden, row_map = row_id_map.num_tokens, permuted.shape[1], row_id_map.row_map
        out = torch.empty((num_tokens, hidden), dtype=permuted.dtype, device=permuted.device)
        if num_tokens and hidden:  # the gathers assume a column
            index = permuted.get_device()
            if merging_probs is not None:
                launch = self._gather_launch(unpermute_kernel, row_id_map.width, row_id_map.num_experts, num_tokens,
                                             row_id_map.num_rows, hidden, (permuted.dtype, merging_probs.dtype), False)
                launch(index, _aligned(permuted, row_map, merging_probs), permuted, row_map, merging_probs, out,
                       num_tokens, row_id_map.num_rows, hidden)
            else:
                launch = self._gather_launch(sum_routes_kernel, row_id_map.width, row_id_map.num_experts, num_tokens,
                                             row_id_map.num_rows, hidden, (permuted.dtype,), False)
                launch(index, _aligned(permuted, row_map), permuted, row_map, out, num_tokens, row_id_map.num_rows,
                       hidden)
        return out

    def permute_backward(self, row_id_map, grad_out, grad_out_probs, probs_meta) -> Grads:
        num_tokens, num_rows, row_map = row_id_map.num_tokens, row_id_map.num_rows, row_id_map.row_map
        sizes = (row_id_map.width, row_id_map.num_experts, num_tokens, num_rows)
        grad_tokens = grad_probs = None
        if grad_out is not None:
            grad_out = grad_out.contiguous()
            grad_tokens = torch.empty((num_tokens, grad_out.shape[1]), dtype=grad_out.dtype, device=grad_out.device)
        if grad_out_probs is not None:
            shape, dtype = probs_meta
            grad_probs = torch.empty(shape, dtype=dtype, device=grad_out_probs.device)
            grad_out_probs = grad_out_probs.contiguous()
            index = grad_out_probs.get_device()
            if num_tokens and grad_out is not None and grad_out.shape[1]:
                # One launch for both: the prob grads ride along with the row sums (which assume a column).
                hidden = grad_out.shape[1]
                launch = self._gather_launch(permute_backward_kernel, *sizes, hidden,
                                             (grad_out.dtype, grad_out_probs.dtype, dtype), True)
                launch(index, _aligned(grad_out, row_map, grad_out_probs), grad_out, row_map, grad_out_probs,
                       grad_probs, grad_tokens, num_tokens, num_rows, hidden)
            elif num_tokens:
                launch = self._prob_grads_launch(*sizes, (grad_out_probs.dtype, dtype))
                launch(index, _aligned(row_map, grad_out_probs), row_map, grad_out_probs, grad_probs, num_tokens,
                       num_rows)
        elif grad_out is not None and num_tokens and grad_out.shape[1]:
            hidden = grad_out.shape[1]
            launch = self._gather_launch(sum_routes_kernel, *sizes, hidden, (grad_out.dtype,), False)
            launch(grad_out.get_device(), _aligned(grad_out, row_map), grad_out, row_map, grad_tokens, num_tokens,
                   num_rows, hidden)
        return Grads(grad_tokens, grad_probs)

    def unpermute_backward(self, row_id_map, grad_out, permuted, merging_probs) -> Grads:
        num_tokens, num_rows, row_map = row_id_map.num_tokens, row_id_map.num_rows, row_id_map.row_map
        hidden = grad_out.shape[1]
        grad_permuted = torch.empty((num_rows, hidden), dtype=grad_out.dtype, device=grad_out.device)
        sizes = (row_id_map.width, row_id_map.num_experts, num_tokens, num_rows, hidden)
        index = grad_out.get_device()
        if merging_probs is not None:
            grad_probs = torch.empty(merging_probs.shape, dtype=merging_probs.dtype, device=grad_out.device)
            launch, zero_programs, tail_programs = self._scatter_launch(
                unpermute_backward_kernel, *sizes, (grad_out.dtype, merging_probs.dtype, permuted.dtype), True)
            if launch is not None:
                launch(index, _aligned(grad_out, row_map, merging_probs, permuted), grad_out, row_map, merging_probs,
                       permuted, grad_probs, grad_permuted, num_tokens, num_rows, hidden, zero_programs, tail_programs)
            return Grads(grad_permuted, grad_probs)
        launch, zero_programs, tail_programs = self._scatter_launch(scatter_routes_kernel, *sizes, (grad_out.dtype,),
                                                                    False)
        if launch is not None:
            launch(index, _aligned(grad_out, row_map), grad_out, row_map, grad_permuted, num_tokens, num_rows, hidden,
                   zero_programs, tail_programs)
        return Grads(grad_permuted, None)


class TritonChunkKernels:
    """The chunk sort and the row gather, for every dtype (permgen.core.ops.ChunkKernels): kernels that
    depend on no variant (permgen.triton.kernels')."""

    target = "triton"

    def __init__(self):
        self.table_kernel, self.gather_kernel = chunk_table_kernel, gather_rows_kernel
        self.sort_kernels = (sort_chunks_kernel, sort_chunks_probs_kernel)
        self.device_type = "cuda" if isinstance(chunk_table_kernel, JITFunction) else "cpu"

    def check_device(self, tokens):
        if tokens.device.type != self.device_type:
            raise ValueError(f"tokens are on {tokens.device}; the triton target runs on CUDA tensors "
                             "(CPU tensors under TRITON_INTERPRET=1)")

    @functools.lru_cache(maxsize=_GEOMETRIES)
    def _table_launch(self, num_chunks, dtypes):
        return Launch(self.table_kernel, 1, dict(BLOCK_C=min(_pow2(num_chunks), _CHUNK_TABLE_BLOCK),
                                                 num_warps=_NUM_WARPS))

    def chunk_table(self, split_sizes, sorted_idxs):
        """int32 [4, C + 1]: where each chunk starts, in the input and in the output (layout:
        permgen.core.ops.chunk_table), computed by one program on the device."""
        num_chunks = split_sizes.shape[0]
        table = torch.empty((4, num_chunks + 1), dtype=torch.int32, device=split_sizes.device)
        launch = self._table_launch(num_chunks, (split_sizes.dtype, sorted_idxs.dtype))
        launch(split_sizes.get_device(), _aligned(split_sizes, sorted_idxs), split_sizes, sorted_idxs, table,
               num_chunks)
        return table

    @functools.lru_cache(maxsize=_GEOMETRIES)
    def _sort_launch(self, num_rows, hidden, num_chunks, dtypes):
        word_bytes = dtypes[0].itemsize
        block_h = min(_pow2(hidden), _CHUNK_TILE_BYTES // word_bytes)
        meta = dict(SEARCH_STEPS=num_chunks.bit_length(), BLOCK_H=block_h, num_warps=_NUM_WARPS,
                    BLOCK_ROWS=max(1, _CHUNK_TILE_BYTES // (block_h * word_bytes)))
        return Launch(self.sort_kernels[len(dtypes) > 1], _cdiv(num_rows, meta["BLOCK_ROWS"]), meta)

    def sort_chunks(self, table, inverse, tokens, probs):
        """The chunk sort of tokens [N, H] (and probs [N]) by a chunk table; inverse: the table's
        other half, which undoes the sort (the backward pass). Returns (out, out_probs | None)."""
        starts, sources = (table[2], table[3]) if inverse else (table[0], table[1])  # selects: cheaper than unbind
        num_chunks = table.shape[1] - 1
        moved = _row_words(tokens)
        num_rows, hidden = moved.shape
        out = torch.empty_like(moved)
        out_probs = None if probs is None else torch.empty_like(probs)
        if num_rows:
            index = tokens.get_device()
            if probs is None:
                launch = self._sort_launch(num_rows, hidden, num_chunks, (moved.dtype,))
                launch(index, _aligned(moved, starts, sources), moved, starts, sources, out, num_rows, hidden,
                       num_chunks)
            else:
                launch = self._sort_launch(num_rows, hidden, num_chunks, (moved.dtype, probs.dtype))
                launch(index, _aligned(moved, probs, starts, sources), moved, probs, starts, sources, out, out_probs,
                       num_rows, hidden, num_chunks)
        return out.view(tokens.dtype), out_probs

    def gather_rows(self, rows, src):
        """out[r] = src[rows[r]] for a 2-D src (zeros where rows[r] < 0), one program per entry of
        rows (expert parallelism's packing; the expert MLP's gathered rows: rows may repeat or skip
        source rows)."""
        out = torch.empty((rows.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
        if rows.shape[0]:
            launch = self._gather_launch(rows.shape[0], src.shape[1], (src.dtype, rows.dtype))
            launch(src.get_device(), _aligned(src, rows), src, rows, out, src.shape[1])
        return out

    @functools.lru_cache(maxsize=_GEOMETRIES)
    def _gather_launch(self, num_rows, hidden, dtypes):
        return Launch(self.gather_kernel, num_rows, dict(BLOCK_H=_row_block(dtypes[0]), num_warps=_NUM_WARPS))


_CHUNK_SORT = None  # made on first use; every variant shares it, so its ops are registered once


def chunk_sort() -> ChunkSort:
    """The Triton target's chunk sort (permgen.triton.kernels' kernels), the same for every variant."""
    global _CHUNK_SORT
    if _CHUNK_SORT is None:
        _CHUNK_SORT = ChunkSort(TritonChunkKernels())
    return _CHUNK_SORT
