"""permute, unpermute and the chunk sort, written once for every variant and target: argument
checks, autograd and the torch.library ops over a target's backend, each an op family of the op
layer (permgen.core.oplayer: registration, check memo, call routing and autograd machinery).

A generated module binds its kernels to a backend (`permgen.triton.host.TritonBackend`,
`permgen.nki.host.NkiBackend`, both `Backend`s below) and exposes `ops = Ops(VARIANT, backend)`:
`ops.permute` and `ops.unpermute` are the module's public functions. A call checks its arguments
(permgen.core.contract), then runs the backend, which allocates and launches; nothing else sits between.

Custom ops. A variant registers, in the `permgen` namespace under the prefix `<target>_<variant>_`
(e.g. `permgen::triton_probs_bf16_mask_permute`), on its first call that needs them (under
torch.compile, or with autograd), never at import:

    permute                  (tokens, routing, probs?, scale?, num_experts, width, num_out_tokens?,
                              check_routing) -> (out, [out_probs], [out_scale], tokens_per_expert, row_map)
    unpermute                (permuted, row_map, merging_probs?, num_tokens, width, num_experts) -> out
    permute_backward         (row_map, grad_out, num_tokens, width, num_experts, num_rows) -> grad_tokens
    unpermute_backward       (row_map, grad_out, num_tokens, width, num_experts, num_rows) -> grad_permuted
  variants with probs also:
    permute_backward_probs   (row_map, grad_out?, grad_out_probs, ..., prob_columns, probs_dtype)
                              -> (grad_tokens ([N, 0] without grad_out), grad_probs)
    unpermute_backward_probs (row_map, grad_out, permuted, merging_probs, ...) -> (grad_permuted, grad_probs)

Every one of them is differentiable, so second derivatives are computed: permute and unpermute are
linear in the rows, so permute_backward (each token's rows summed) and unpermute_backward (each
token's row copied to its rows) are each other's backward; with probs the backward passes are
bilinear, and their own backward passes are these ops again (see the formulas below).

The chunk sort depends on no variant: each target has one `ChunkSort`, whose ops are
`permgen::<target>_chunk_table`, `<target>_sort_chunks` and `<target>_sort_chunks_probs` (a sort's
backward pass is the sort undone, its own backward the sort again).

Only tensors and ints cross an op boundary: the row map travels as its int32 tensor and
`RowIdMap` is rebuilt in Python from the static sizes. permute and unpermute carry registered
autograd (their backward passes are the ops above) and fake implementations, so
`torch.compile(fullgraph=True)` sees each as one opaque op. With `num_out_tokens` the output
shapes are static; without it permute's row count is a data-dependent size (an unbacked SymInt).

Under torch.compile every call goes through the ops. Eagerly, a call that needs no autograd runs the
backend directly, and a call that needs autograd runs the same formulas as an autograd.Function
over the op implementations (OpFamily.calls). All paths run the same backend code on the same
arguments, so results are identical. A call like one already checked skips its checks
(OpFamily.checked).
"""

from typing import NamedTuple, Optional, Protocol

import torch

from .contract import PermutePlan, check_permute, check_tensor, check_unpermute, prob_dtypes, routing_error
from .oplayer import Op, OpFamily, args_key, take_prefix
from .results import PermuteResult, RowIdMap, row_map_words
from .variant import Variant

# ---------------------------------------------------------------------------------------------
# The backend interface: what a target implements, once for every variant
# ---------------------------------------------------------------------------------------------

class PermuteOutputs(NamedTuple):
    tokens: torch.Tensor  # [M, H] permuted rows, in the variant's out dtype
    probs: Optional[torch.Tensor]  # [M] (variants with probs)
    scale: Optional[torch.Tensor]  # [M, S] moved or computed scales (variants that return scales)
    tokens_per_expert: torch.Tensor  # int64 [E]
    row_map: torch.Tensor  # int32, laid out as permgen.core.results.RowMapLayout says
    num_rows: int  # M
    # Whether the routing broke check_routing's rules, when the backend read that with the row count
    # (Backend.checks_routing_in_read); None when it did not.
    bad_routing: Optional[bool] = None


class Grads(NamedTuple):
    """A backward pass's gradients: of the rows (tokens for permute, permuted rows for unpermute) and of the probs."""

    rows: Optional[torch.Tensor]
    probs: Optional[torch.Tensor]


class Backend(Protocol):
    """Allocates and launches one variant's kernels on one target; `Ops` has checked the arguments."""

    target: str
    # Whether permute, given a plan without a row cap that checks the routing, reads the routing's
    # validity together with the row count (PermuteOutputs.bad_routing): then the check costs no
    # host read of its own. Otherwise permgen.core.ops checks the routing before permute (one more read).
    checks_routing_in_read: bool

    def check_device(self, tokens: torch.Tensor) -> None: ...

    def permute(self, plan, tokens, routing, probs, scale, routed=None) -> PermuteOutputs:
        """routed(row_map), when given, is called once the row map is written and before the rows
        move (expert parallelism queues its count exchange there)."""

    def unpermute(self, row_id_map: RowIdMap, permuted, merging_probs) -> torch.Tensor: ...

    def permute_backward(self, row_id_map: RowIdMap, grad_out, grad_out_probs, probs_meta) -> Grads:
        """probs_meta: (shape, dtype) of the probs' gradient, with grad_out_probs."""

    def unpermute_backward(self, row_id_map: RowIdMap, grad_out, permuted, merging_probs) -> Grads: ...

    def chunk_sort(self) -> "ChunkSort":
        """The target's chunk sort: one ChunkSort, which every variant shares."""

    # A backend (or ChunkKernels) may have define_op(qualname, impl, schema): it then defines the ops
    # (the NKI target's go through torch-neuronx); else permgen.core.oplayer.define_op.


class ChunkKernels(Protocol):
    """A target's chunk sort, for every dtype (its rows move as words)."""

    target: str

    def check_device(self, tokens: torch.Tensor) -> None: ...

    def chunk_table(self, split_sizes, sorted_idxs) -> torch.Tensor:
        """int32 [4, C + 1] (layout: chunk_table below)."""

    def sort_chunks(self, table, inverse: bool, tokens, probs) -> tuple:
        """(out, out_probs | None): tokens [N, H] (and probs [N]) sorted by the table's chunks;
        inverse: by the table's other half, which undoes the sort."""

    def gather_rows(self, rows, src) -> torch.Tensor:
        """out[r] = src[rows[r]] of a 2-D src, zeros where rows[r] < 0. Targets whose expert parallelism
        runs over torch.distributed (permgen.ep) provide it; the NKI target's runs its own kernels."""


# ---------------------------------------------------------------------------------------------
# Helpers of the chunk sort and of index routing
# ---------------------------------------------------------------------------------------------

def chunk_arguments(where: str, split_sizes, sorted_idxs, num_rows: int) -> bool:
    """Check split_sizes and sorted_idxs: 1-D integer tensors of one entry per chunk, and those on the
    CPU by their values (read as Python ints: no device sync, no overflow whatever the sizes): sizes
    non-negative summing to num_rows, the order a permutation of the chunks. Under torch.compile only
    their shapes (ChunkSort.sort checks the values when the graph runs). Returns whether sorted_idxs
    was read as 0, 1, ..., C - 1 (an order on the device is never read: no device sync)."""
    for name, t in (("split_sizes", split_sizes), ("sorted_idxs", sorted_idxs)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{where}: {name} must be a 1-D integer tensor")
    if split_sizes.shape != sorted_idxs.shape:
        raise ValueError(f"{where}: split_sizes {list(split_sizes.shape)} and sorted_idxs "
                         f"{list(sorted_idxs.shape)} must have one entry per chunk")
    if torch.compiler.is_compiling():
        return False
    if split_sizes.device.type == "cpu":
        sizes = split_sizes.tolist()
        if min(sizes, default=0) < 0 or sum(sizes) != num_rows:
            raise ValueError(f"{where}: split_sizes must be non-negative and sum to the {num_rows} rows, got {sizes}")
    if sorted_idxs.device.type != "cpu":
        return False
    order, chunks = sorted_idxs.tolist(), list(range(sorted_idxs.shape[0]))
    if order == chunks:
        return True
    if sorted(order) != chunks:
        raise ValueError(f"{where}: sorted_idxs must order the {len(order)} chunks (a permutation of "
                         f"0..{len(order) - 1}), got {order}")
    return False


def _to_device(t, device, compiling):
    if t.device == device:
        return t
    if device.type == "cuda" and not compiling:
        # From pinned memory the copy is asynchronous: the host does not wait for the device.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


_INT32_MAX = 2**31 - 1


def chunk_table(split_sizes, sorted_idxs):
    """The chunk sort's table, int32 [4, C + 1], with torch ops (the NKI target's; the Triton target
    computes the same in one kernel program). Rows 0, 1: output chunk j's first row in the output
    and in the input (output chunk j is input chunk sorted_idxs[j]); rows 2, 3: input chunk i's
    first row in the input and in the output. Entry C of rows 0 and 2 is the chunks' total, of rows
    1 and 3 zero. Rows 0 and 2 ascend, so a row's chunk is found by binary search; rows 2, 3 undo
    the sort. On the device nothing is read back: a negative size counts as empty, an index out of
    range is clamped, and sizes that would wrap (in int64 or in the table's int32) are cut: each to
    2^31 - 1, and the starts to 2^31 - 1, where no row is."""
    num_chunks = split_sizes.shape[0]
    sizes = split_sizes.long().clamp(0, _INT32_MAX)  # C such sizes sum in int64 without wrapping
    order = sorted_idxs.long().clamp(0, max(num_chunks - 1, 0))
    total = sizes.sum().reshape(1)
    in_starts = torch.cumsum(sizes, 0) - sizes
    out_sizes = sizes[order]
    out_starts = torch.cumsum(out_sizes, 0) - out_sizes
    zero = total.new_zeros(1)
    table = torch.stack((torch.cat((out_starts, total)), torch.cat((in_starts[order], zero)),
                         torch.cat((in_starts, total)),
                         torch.cat((torch.zeros_like(sizes).scatter(0, order, out_starts), zero))))
    return table.clamp_(max=_INT32_MAX).to(torch.int32)  # clamped, the starts still ascend


# Index routing's expert count read from the ids is at most this: a larger id is more likely a bug
# than an expert, and would size the routing plan by it.
MAX_EXPERTS_FROM_IDS = 1 << 16


def experts_from_ids(where, routing) -> int:
    """max id + 1 of index routing (at least 1): one host sync."""
    high = int(routing.max()) if routing.numel() else 0
    if high >= MAX_EXPERTS_FROM_IDS:
        raise ValueError(f"{where}: the routing holds expert id {high}; with no expert count given the ids "
                         f"must be below {MAX_EXPERTS_FROM_IDS} (pass num_experts)")
    return max(high + 1, 1)


# ---------------------------------------------------------------------------------------------
# The chunk sort: one per target, for every dtype
# ---------------------------------------------------------------------------------------------

class ChunkSort(OpFamily):
    """TransformerEngine's moe_sort_chunks_by_index on one target, differentiable, and its ops
    `permgen::<target>_chunk_table` (split_sizes, sorted_idxs) -> table, `<target>_sort_chunks`
    (tokens, table, inverse) -> out and `<target>_sort_chunks_probs` (tokens, probs, table, inverse)
    -> (out, out_probs). The backward pass of a sort is the same op with inverse flipped."""

    def __init__(self, kernels: ChunkKernels):
        super().__init__(take_prefix(kernels.target), define=getattr(kernels, "define_op", None))
        self.kernels = kernels
        self.prob_dtypes = prob_dtypes()

    def declare(self):
        return {
            "chunk_table": Op(self.kernels.chunk_table, self._chunk_table_fake,
                              "(Tensor split_sizes, Tensor sorted_idxs) -> Tensor"),
            "check_chunks": Op(self._check_chunks_impl, self._check_chunks_fake,
                               "(Tensor split_sizes, Tensor sorted_idxs, SymInt num_rows, str where) -> Tensor"),
            "sort_chunks": Op(self._sort_impl, self._sort_fake, "(Tensor tokens, Tensor table, bool inverse) -> Tensor",
                              self._sort_backward, self._sort_setup),
            "sort_chunks_probs": Op(self._sort_probs_impl, self._sort_probs_fake,
                                    "(Tensor tokens, Tensor probs, Tensor table, bool inverse) "
                                    "-> (Tensor out, Tensor out_probs)", self._sort_probs_backward, self._sort_setup),
        }

    @staticmethod
    def _chunk_table_fake(split_sizes, sorted_idxs):
        return split_sizes.new_empty((4, split_sizes.shape[0] + 1), dtype=torch.int32)

    @staticmethod
    def _check_chunks_impl(split_sizes, sorted_idxs, num_rows, where):
        """chunk_arguments when a compiled graph runs; split_sizes again (a copy: an op's output is its own)."""
        chunk_arguments(where, split_sizes, sorted_idxs, num_rows)
        return split_sizes.clone()

    @staticmethod
    def _check_chunks_fake(split_sizes, sorted_idxs, num_rows, where):
        return torch.empty_like(split_sizes)

    def _sort_impl(self, tokens, table, inverse):
        return self.kernels.sort_chunks(table, inverse, tokens.contiguous(), None)[0]

    @staticmethod
    def _sort_fake(tokens, table, inverse):
        return torch.empty_like(tokens, memory_format=torch.contiguous_format)

    def _sort_probs_impl(self, tokens, probs, table, inverse):
        return tuple(self.kernels.sort_chunks(table, inverse, tokens.contiguous(), probs.contiguous()))

    @staticmethod
    def _sort_probs_fake(tokens, probs, table, inverse):
        return (torch.empty_like(tokens, memory_format=torch.contiguous_format),
                torch.empty_like(probs, memory_format=torch.contiguous_format))

    @staticmethod
    def _sort_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[-2])
        ctx.inverse = inputs[-1]
        if inputs[0].element_size() == 1:  # fp8 rows are quantised data, never differentiated
            ctx.mark_non_differentiable(output[0] if isinstance(output, tuple) else output)

    @staticmethod
    def _sort_backward(ctx, grad_out):
        (table,) = ctx.saved_tensors
        return ctx.calls["sort_chunks"](grad_out, table, not ctx.inverse), None, None

    @staticmethod
    def _sort_probs_backward(ctx, grad_out, grad_probs):
        (table,) = ctx.saved_tensors
        grad_tokens, grad_probs = ctx.calls["sort_chunks_probs"](grad_out, grad_probs, table, not ctx.inverse)
        needs = ctx.needs_input_grad
        return (grad_tokens if needs[0] else None), (grad_probs if needs[1] else None), None, None

    def sort(self, where, tokens, split_sizes, sorted_idxs, probs=None, token_dtypes=None, *, alias_in_order=False):
        """Split the rows of tokens [N, H] into chunks of split_sizes (they sum to N) and concatenate
        the chunks in the order of sorted_idxs; probs [N] move with their rows. Returns (out,
        out_probs | None), new tensors. token_dtypes: those allowed (None: any). Errors start with `where`.

        split_sizes and sorted_idxs on the CPU are checked (under torch.compile too, when the graph
        runs) and copied to the device without a device sync (but not capturable in a CUDA graph); on
        the device they are not read: a negative size counts as empty, and rows past sizes that do not
        sum to N are zeros. A sorted_idxs on the CPU is read on every call: when it is 0, 1, ..., C - 1
        nothing launches, and the rows come back copied, or with alias_in_order as they are (the same
        tensors: for a caller that never writes into the sorted rows, megatron-core's dispatcher)."""
        if token_dtypes is None:
            token_dtypes = (getattr(tokens, "dtype", None),)
        compiling = torch.compiler.is_compiling()
        self.checked("sort", args_key, self._check_sort, where, tokens, probs, token_dtypes)
        num_tokens = tokens.shape[0]
        if chunk_arguments(where, split_sizes, sorted_idxs, num_tokens):  # an order that moves nothing
            if alias_in_order:
                return tokens, probs
            return tokens.clone(memory_format=torch.contiguous_format), \
                None if probs is None else probs.clone(memory_format=torch.contiguous_format)
        if compiling and "cpu" in (split_sizes.device.type, sorted_idxs.device.type):
            # The values are checked when the graph runs, by an op whose output the table waits for.
            split_sizes = self.op["check_chunks"](split_sizes, sorted_idxs, num_tokens, where)
        sizes, order = _to_device(split_sizes, tokens.device, compiling), _to_device(sorted_idxs, tokens.device, compiling)
        calls = self.calls(tokens, probs)
        if calls is None:
            return tuple(self.kernels.sort_chunks(self.kernels.chunk_table(sizes, order), False, tokens, probs))
        table = calls["chunk_table"](sizes, order) if torch.compiler.is_compiling() else \
            self.kernels.chunk_table(sizes, order)
        if probs is None:
            return calls["sort_chunks"](tokens, table, False), None
        return tuple(calls["sort_chunks_probs"](tokens, probs, table, False))

    def _check_sort(self, where, tokens, probs, token_dtypes):
        check_tensor(where, "tokens", tokens, (None, None), token_dtypes, None)
        if probs is not None:
            check_tensor(where, "probs", probs, (tokens.shape[0],), self.prob_dtypes, tokens.device)
        self.kernels.check_device(tokens)


# ---------------------------------------------------------------------------------------------
# One variant's permute and unpermute
# ---------------------------------------------------------------------------------------------

class Ops(OpFamily):
    """The public functions of one variant on one target, and its custom ops."""

    def __init__(self, variant, backend: Backend):
        self.variant = Variant.of(variant).bind_torch()  # torch dtypes looked up before any call is traced
        self.backend = backend
        self.chunk_sort = backend.chunk_sort()  # the target's, the same for every variant
        self.name = self.variant.name
        super().__init__(take_prefix(backend.target, self.name), define=getattr(backend, "define_op", None))

    def declare(self):
        """This variant's ops (see the module docstring)."""
        v = self.variant
        sizes = "SymInt num_tokens, SymInt width, SymInt num_experts"
        permute_returns = ", ".join(["Tensor out"] + ["Tensor out_probs"] * v.probs
                                    + ["Tensor out_scale"] * v.makes_scale + ["Tensor tokens_per_expert",
                                                                              "Tensor row_map"])
        ops = {
            "permute": Op(self._permute_impl, self._permute_fake,
                          "(Tensor tokens, Tensor routing, Tensor? probs, Tensor? scale, SymInt? num_experts, "
                          f"SymInt width, SymInt? num_out_tokens, bool check_routing) -> ({permute_returns})",
                          self._permute_backward, self._permute_setup),
            "unpermute": Op(self._unpermute_impl, self._unpermute_fake,
                            f"(Tensor permuted, Tensor row_map, Tensor? merging_probs, {sizes}) -> Tensor",
                            self._unpermute_backward, self._unpermute_setup),
            "permute_backward": Op(self._permute_backward_impl, self._permute_backward_fake,
                                   f"(Tensor row_map, Tensor grad_out, {sizes}, SymInt num_rows) -> Tensor",
                                   _adjoint("unpermute_backward"), _row_map_setup),
            "unpermute_backward": Op(self._unpermute_backward_impl, self._unpermute_backward_fake,
                                     f"(Tensor row_map, Tensor grad_out, {sizes}, SymInt num_rows) -> Tensor",
                                     _adjoint("permute_backward"), _row_map_setup),
        }
        if v.probs:
            ops["permute_backward_probs"] = Op(
                self._permute_backward_probs_impl, self._permute_backward_probs_fake,
                f"(Tensor row_map, Tensor? grad_out, Tensor grad_out_probs, {sizes}, SymInt num_rows, "
                "SymInt prob_columns, ScalarType probs_dtype) -> (Tensor grad_tokens, Tensor grad_probs)",
                self._permute_backward_probs_backward, self._permute_backward_probs_setup)
            ops["unpermute_backward_probs"] = Op(
                self._unpermute_backward_probs_impl, self._unpermute_backward_probs_fake,
                f"(Tensor row_map, Tensor grad_out, Tensor permuted, Tensor merging_probs, {sizes}) "
                "-> (Tensor grad_permuted, Tensor grad_probs)",
                _unpermute_backward_probs_backward, _unpermute_backward_probs_setup)
        return ops

    def _row_id_map(self, row_map, num_tokens, width, num_experts, num_rows, routing=None):
        return RowIdMap(row_map, routing, num_tokens, width, num_experts, num_rows, self.name)

    # -- permute -----------------------------------------------------------------------------------

    def _run_permute(self, plan, tokens, routing, probs, scale, routed=None) -> PermuteOutputs:
        if plan.num_experts is None:
            plan = plan._replace(num_experts=experts_from_ids(self.name, routing))
        in_read = plan.check_routing and plan.num_out_tokens is None and self.backend.checks_routing_in_read
        if plan.check_routing and not in_read:
            self._check_routing(plan, routing)
        out = self.backend.permute(plan, tokens, routing, probs, scale, routed)
        if in_read and out.bad_routing:
            self._check_routing(plan, routing)  # the words of the error: reads the routing again
            raise AssertionError(f"{self.name}: the routing check and the row map's route tallies disagree")
        return out

    def _check_routing(self, plan, routing):
        problem = routing_error(self.variant, routing, plan.num_experts, plan.width)
        if problem:
            raise ValueError(f"{self.name}: {problem}")

    def _op_outputs(self, outs) -> PermuteOutputs:
        """The permute op's outputs (a variant-length tuple: the schema has no optional outputs) by name."""
        v = self.variant
        probs = outs[1] if v.probs else None
        scale = outs[1 + v.probs] if v.makes_scale else None
        return PermuteOutputs(outs[0], probs, scale, outs[-2], outs[-1], outs[0].shape[0])

    def _permute_impl(self, tokens, routing, probs, scale, num_experts, width, num_out_tokens, check_routing):
        plan = PermutePlan(tokens.shape[0], tokens.shape[1], num_experts, width, num_out_tokens, check_routing)
        out = self._run_permute(plan, tokens, routing, probs, scale)
        return tuple(t for t in out[:5] if t is not None)

    def _permute_fake(self, tokens, routing, probs, scale, num_experts, width, num_out_tokens, check_routing):
        v = self.variant
        num_tokens, hidden = tokens.shape
        num_rows = num_out_tokens
        if num_rows is None:  # the rows the routes need: known only once the routing is read
            num_rows = torch.library.get_ctx().new_dynamic_size()
        if num_experts is None:  # index routing's max id + 1, read from the ids
            num_experts = torch.library.get_ctx().new_dynamic_size(min=1)
        outs = [tokens.new_empty((num_rows, hidden), dtype=v.out_dtype)]
        if v.probs:
            outs.append(probs.new_empty((num_rows,)))
        if v.makes_scale:
            outs.append(tokens.new_empty((num_rows, v.scale_columns(hidden)), dtype=v.scale_dtype))
        outs.append(tokens.new_empty((num_experts,), dtype=torch.int64))
        outs.append(tokens.new_empty((row_map_words(v.mask, num_tokens, width, num_experts),), dtype=torch.int32))
        return tuple(outs)

    def _permute_setup(self, ctx, inputs, output):
        v = self.variant
        tokens, routing, probs, _, _, width, _, _ = inputs
        ctx.save_for_backward(output[-1])
        ctx.sizes = (tokens.shape[0], width, output[-2].shape[0], output[0].shape[0])  # [-2]: tokens_per_expert [E]
        ctx.probs_meta = None if probs is None else (probs.shape[1], probs.dtype)
        # fp8 rows are quantised data, never differentiated: autograd would cast their grads to fp8.
        # Quantising variants' token grads are unpermute(grad_rows, row_id_map), the straight-through sum.
        frozen = [output[0]] if v.is_fp8 or v.quantizes else []
        if v.makes_scale:
            frozen.append(output[1 + v.probs])
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        ctx.set_materialize_grads(False)  # no zero-filled grads for outputs nothing flowed back to

    def _permute_backward(self, ctx, grad_out, *grads):
        (row_map,) = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_out = grad_out if needs[0] else None
        grad_out_probs = grads[0] if self.variant.probs and needs[2] else None
        grad_tokens = grad_probs = None
        if grad_out_probs is not None:
            columns, dtype = ctx.probs_meta
            grad_tokens, grad_probs = ctx.calls["permute_backward_probs"](
                row_map, grad_out, grad_out_probs, *ctx.sizes, columns, dtype)
            grad_tokens = None if grad_out is None else grad_tokens
        elif grad_out is not None:
            grad_tokens = ctx.calls["permute_backward"](row_map, grad_out, *ctx.sizes)
        return grad_tokens, None, grad_probs, None, None, None, None, None

    def _permute_backward_impl(self, row_map, grad_out, num_tokens, width, num_experts, num_rows):
        row_id_map = self._row_id_map(row_map, num_tokens, width, num_experts, num_rows)
        return self.backend.permute_backward(row_id_map, grad_out.contiguous(), None, None).rows

    def _permute_backward_fake(self, row_map, grad_out, num_tokens, width, num_experts, num_rows):
        return grad_out.new_empty((num_tokens, grad_out.shape[1]))

    def _permute_backward_probs_impl(self, row_map, grad_out, grad_out_probs, num_tokens, width, num_experts,
                                     num_rows, prob_columns, probs_dtype):
        row_id_map = self._row_id_map(row_map, num_tokens, width, num_experts, num_rows)
        grad_tokens, grad_probs = self.backend.permute_backward(
            row_id_map, None if grad_out is None else grad_out.contiguous(), grad_out_probs.contiguous(),
            ((num_tokens, prob_columns), probs_dtype))
        if grad_tokens is None:
            grad_tokens = grad_out_probs.new_empty((num_tokens, 0), dtype=self.variant.combine_dtype)
        return grad_tokens, grad_probs

    def _permute_backward_probs_fake(self, row_map, grad_out, grad_out_probs, num_tokens, width, num_experts,
                                     num_rows, prob_columns, probs_dtype):
        if grad_out is None:
            grad_tokens = grad_out_probs.new_empty((num_tokens, 0), dtype=self.variant.combine_dtype)
        else:
            grad_tokens = grad_out.new_empty((num_tokens, grad_out.shape[1]))
        return grad_tokens, grad_out_probs.new_empty((num_tokens, prob_columns), dtype=probs_dtype)

    @staticmethod
    def _permute_backward_probs_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.sizes = inputs[3:7]  # num_tokens, width, num_experts, num_rows
        ctx.set_materialize_grads(False)

    def _permute_backward_probs_backward(self, ctx, grad_tokens, grad_probs):
        """permute_backward_probs is linear in (grad_out, grad_out_probs): its backward copies each token's
        row to its rows (unpermute_backward) and moves each route's prob to its row, as permute does."""
        (row_map,) = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_rows = grad_row_probs = None
        if grad_tokens is not None and needs[1]:
            grad_rows = ctx.calls["unpermute_backward"](row_map, grad_tokens, *ctx.sizes)
        if grad_probs is not None and needs[2]:
            grad_row_probs = self._route_values_to_rows(row_map, grad_probs, *ctx.sizes)
        return None, grad_rows, grad_row_probs, None, None, None, None, None, None

    def _route_values_to_rows(self, row_map, values, num_tokens, width, num_experts, num_rows):
        """[M]: each row's entry of values [N, routing columns], as permute moves probs (0 in pad rows),
        with torch ops (differentiable again)."""
        rows = self._row_id_map(row_map, num_tokens, width, num_experts, num_rows).rows_by_column()
        to = torch.where(rows >= 0, rows, num_rows).reshape(-1)  # entry num_rows: a sink for the unrouted
        return values.new_zeros(num_rows + 1).scatter(0, to, values.reshape(-1))[:num_rows]

    # -- unpermute ---------------------------------------------------------------------------------

    def _unpermute_impl(self, permuted, row_map, merging_probs, num_tokens, width, num_experts):
        row_id_map = self._row_id_map(row_map, num_tokens, width, num_experts, permuted.shape[0])
        return self.backend.unpermute(row_id_map, permuted, merging_probs)

    def _unpermute_fake(self, permuted, row_map, merging_probs, num_tokens, width, num_experts):
        return permuted.new_empty((num_tokens, permuted.shape[1]))

    @staticmethod
    def _unpermute_setup(ctx, inputs, output):
        permuted, row_map, merging_probs, num_tokens, width, num_experts = inputs
        ctx.merging = merging_probs is not None
        ctx.save_for_backward(row_map, *((permuted, merging_probs) if ctx.merging else ()))
        ctx.sizes = (num_tokens, width, num_experts)
        ctx.num_rows = permuted.shape[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def _unpermute_backward(ctx, grad_out):
        if grad_out is None:  # no gradient reached the output
            return None, None, None, None, None, None
        needs = ctx.needs_input_grad
        grad_probs = None
        if ctx.merging:
            row_map, permuted, merging_probs = ctx.saved_tensors
            grad_permuted, grad_probs = ctx.calls["unpermute_backward_probs"](
                row_map, grad_out, permuted, merging_probs, *ctx.sizes)
        else:
            (row_map,) = ctx.saved_tensors
            grad_permuted = ctx.calls["unpermute_backward"](row_map, grad_out, *ctx.sizes, ctx.num_rows)
        return (grad_permuted if needs[0] else None), None, (grad_probs if needs[2] else None), None, None, None

    def _unpermute_backward_impl(self, row_map, grad_out, num_tokens, width, num_experts, num_rows):
        row_id_map = self._row_id_map(row_map, num_tokens, width, num_experts, num_rows)
        return self.backend.unpermute_backward(row_id_map, grad_out.contiguous(), None, None).rows

    def _unpermute_backward_fake(self, row_map, grad_out, num_tokens, width, num_experts, num_rows):
        return grad_out.new_empty((num_rows, grad_out.shape[1]))

    def _unpermute_backward_probs_impl(self, row_map, grad_out, permuted, merging_probs, num_tokens, width,
                                       num_experts):
        row_id_map = self._row_id_map(row_map, num_tokens, width, num_experts, permuted.shape[0])
        return tuple(self.backend.unpermute_backward(row_id_map, grad_out.contiguous(), permuted, merging_probs))

    def _unpermute_backward_probs_fake(self, row_map, grad_out, permuted, merging_probs, num_tokens, width,
                                       num_experts):
        return grad_out.new_empty((permuted.shape[0], grad_out.shape[1])), torch.empty_like(merging_probs)

    # -- the public functions ----------------------------------------------------------------------

    def permute(self, tokens, routing, probs=None, scale=None, *, num_experts=None, num_out_tokens=None, topk=None,
                check_routing=None) -> PermuteResult:
        """Move each token to the rows of the experts it is routed to (expert-major, stable).

        tokens [N, H] in the variant's dtype; routing: a [N, E] bool/integer mask (mask variants)
        or [N, k] int32/int64 expert ids, -1 for no route (index variants, which need
        num_experts); probs: [N, E] / [N, k] float router probs, required by variants with probs
        and refused by the others; scale: [N, ceil(H / 128 or 32)] for fp8 variants with scales.

        num_out_tokens: rows of the output. Routes whose row would be >= num_out_tokens are
            dropped; rows past the last expert segment are zeros. When given, permute makes no
            host synchronisation, so it can be captured in a CUDA graph, and under torch.compile
            the output shapes are static. Without it the row count is read back from the device
            (under torch.compile: a data-dependent size).
        topk: optional, mask routing: the most routes of any token. The call costs the same with
            or without it; it only shrinks the row map from E to topk slots per token (routes
            past topk are dropped, or refused when check_routing is on).
        check_routing: verify the routing values (one host sync). Default: only when
            num_out_tokens is None (that call synchronises anyway).
        PermuteResult.dropped counts, on the device, the routes dropped (past num_out_tokens, ids
        outside [-1, E), routes past topk): permute never reads it back.
        """
        return self.permute_counting_experts(tokens, routing, probs, scale, num_experts=num_experts,
                                             num_out_tokens=num_out_tokens, topk=topk, check_routing=check_routing,
                                             from_ids=False)

    def permute_counting_experts(self, tokens, routing, probs=None, scale=None, *, num_experts=None,
                                 num_out_tokens=None, topk=None, check_routing=None, from_ids=True) -> PermuteResult:
        """permute; with from_ids, index routing without num_experts takes max id + 1 as the expert
        count (one host sync; under torch.compile a data-dependent size), as TransformerEngine's
        index maps do (permgen.integrations.te calls it)."""
        plan = self._plan(tokens, routing, probs, scale, num_experts, num_out_tokens, topk, check_routing, from_ids)
        calls = self.calls(tokens, probs)
        if calls is None:
            out = self._run_permute(plan, tokens, routing, probs, scale)
        else:
            out = self._op_outputs(calls["permute"](tokens, routing, probs, scale, plan.num_experts, plan.width,
                                                    plan.num_out_tokens, plan.check_routing))
        return self.result(plan, routing, out)

    def _plan(self, *args):
        """check_permute's plan (args: permute_counting_experts' in order), kept by everything the checks
        read: the tensors' shapes, dtypes, devices and contiguity, the ints (the row cap among them: the
        plan carries it) and their types."""
        return self.checked("permute", args_key, self._check_permute, *args)

    def _check_permute(self, tokens, routing, probs, scale, *settings):
        plan = check_permute(self.variant, tokens, routing, probs, scale, *settings)
        self.backend.check_device(tokens)
        return plan

    def result(self, plan, routing, out: PermuteOutputs) -> PermuteResult:
        """The PermuteResult of a backend's permute outputs (expert parallelism runs the backend itself)."""
        num_experts = plan.num_experts if plan.num_experts is not None else out.tokens_per_expert.shape[0]
        row_id_map = RowIdMap(out.row_map, routing, plan.num_tokens, plan.width, num_experts, out.num_rows, self.name)
        return PermuteResult(out.tokens, out.probs, out.scale, row_id_map, out.tokens_per_expert)

    def unpermute(self, permuted, row_id_map, merging_probs=None, restore_shape=None):
        """Sum each token's expert rows back into one row, weighted by merging_probs when given.

        permuted: [M, H] in the combine dtype (bf16 for fp8 variants); row_id_map: the
        PermuteResult.row_id_map of the matching permute; merging_probs: [N, E] / [N, k] float
        probs, or None for a plain sum (variants without probs refuse them); restore_shape:
        optional (N, H), checked. Returns [N, H], accumulated in fp32, deterministic.
        """
        self.checked("unpermute", _unpermute_key, self._check_unpermute, permuted, row_id_map, merging_probs,
                     restore_shape)
        calls = self.calls(permuted, merging_probs)
        if calls is not None:
            return calls["unpermute"](permuted, row_id_map.row_map, merging_probs, row_id_map.num_tokens,
                                      row_id_map.width, row_id_map.num_experts)
        return self.backend.unpermute(row_id_map, permuted, merging_probs)

    def sort_chunks(self, tokens, split_sizes, sorted_idxs, probs=None):
        """Split the rows of tokens [N, H] into chunks of split_sizes (they sum to N) and concatenate
        the chunks in the order of sorted_idxs (TransformerEngine's moe_sort_chunks_by_index); probs
        [N] (variants with probs) move with their rows. Differentiable. Returns (out, out_probs | None);
        see ChunkSort.sort."""
        if probs is not None and not self.variant.probs:
            raise ValueError(f"{self.name}: this variant has no probs; use a variant with probs = true")
        return self.chunk_sort.sort(self.name, tokens, split_sizes, sorted_idxs, probs, (self.variant.token_dtype,))

    def _check_unpermute(self, permuted, row_id_map, merging_probs, restore_shape):
        check_unpermute(self.variant, permuted, row_id_map, merging_probs, restore_shape, RowIdMap)


def _unpermute_key(permuted, row_id_map, merging_probs, restore_shape):
    """What Ops._check_unpermute reads of its arguments."""
    m = row_id_map
    return (type(m), m.variant, m.num_rows, m.num_tokens, m.routing.shape, m.row_map.device,
            None if restore_shape is None else (type(restore_shape), tuple(restore_shape)),
            permuted.shape, permuted.dtype, permuted.device, permuted.is_contiguous(),
            None if merging_probs is None else (merging_probs.shape, merging_probs.dtype, merging_probs.device,
                                                merging_probs.is_contiguous()))


# -- the backward passes' own backward passes ----------------------------------------------------------

def _row_map_setup(ctx, inputs, output):
    """permute_backward's and unpermute_backward's: (row_map, grad_out, num_tokens, width, num_experts, num_rows)."""
    ctx.save_for_backward(inputs[0])
    ctx.sizes = inputs[2:]
    ctx.set_materialize_grads(False)


def _adjoint(op):
    """The backward of permute_backward (each token's rows summed), which is unpermute_backward (each
    token's row copied to its rows), and the other way round: each is linear, the other's transpose."""
    def backward(ctx, grad):
        if grad is None or not ctx.needs_input_grad[1]:
            return None, None, None, None, None, None
        (row_map,) = ctx.saved_tensors
        return None, ctx.calls[op](row_map, grad, *ctx.sizes), None, None, None, None

    return backward


def _unpermute_backward_probs_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])  # row_map, grad_out, permuted, merging_probs
    ctx.sizes = inputs[4:]
    ctx.set_materialize_grads(False)


def _unpermute_backward_probs_backward(ctx, grad_rows, grad_probs):
    """unpermute_backward_probs is bilinear: (g, x, p) -> (S(g, p), D(g, x)), where S(g, p) copies each
    token's g[t], times p[t, s], to its route's row and D(g, x)[t, s] is the route's row x[r] dotted with
    g[t]. With U(x, p) = unpermute, its backward for (grad_rows, grad_probs) is
        g: U(grad_rows, p) + U(x, grad_probs)    x: S(g, grad_probs)    p: D(g, grad_rows),
    each half of an unpermute_backward_probs call."""
    row_map, g, x, p = ctx.saved_tensors
    calls, needs, sizes = ctx.calls, ctx.needs_input_grad, ctx.sizes
    grad_g = grad_x = grad_p = None
    if grad_rows is not None:
        grad_rows = grad_rows.contiguous()
    if grad_probs is not None:
        grad_probs = grad_probs.contiguous()
    if needs[1]:
        terms = [calls["unpermute"](rows, row_map, probs, *sizes)
                 for rows, probs in ((grad_rows, p), (x, grad_probs)) if rows is not None and probs is not None]
        grad_g = terms[0] + terms[1] if len(terms) == 2 else (terms[0] if terms else None)
    if needs[2] and grad_probs is not None:
        grad_x = calls["unpermute_backward_probs"](row_map, g, x, grad_probs, *sizes)[0]
    if needs[3] and grad_rows is not None:
        grad_p = calls["unpermute_backward_probs"](row_map, g, grad_rows, p, *sizes)[1]
    return None, grad_g, grad_x, grad_p, None, None, None
