"""The grouped GEMM that reads its rows through permute's row map, so that the expert MLP
(permgen.layers.expert_mlp, save_memory=True) needs no permuted copy of the tokens. GatherOps registers
it as a torch.library custom op on first use, so the layer traces under torch.compile.

Rows are expert-major, as permute lays them out: expert e owns rows [ends[e], ends[e + 1]) (pad
rows included). row_token [M] is the token of each row (-1: a pad row, read as zeros).

    gather_gemm: out[r] = tokens[row_token[r]] @ w[e]    r in expert e's rows
    backward:    tokens' gradient: permute's backward of grad @ w[e]^T; w's: gathered rows^T @ grad

The GEMM accumulates in fp32 and stores in the tokens' dtype, as torch._grouped_mm does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.oplayer import Op, OpFamily
from .kernels import as_fp32, stored_as


@triton.jit
def _segment_of_tile(tile_ends_ptr, tile, E: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, its first tile) of a program's row tile; expert == E: past the last tile."""
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(tile_ends_ptr + experts, mask=experts < E, other=2**30)
    expert = tl.sum((ends <= tile).to(tl.int32), axis=0)
    first = tl.load(tile_ends_ptr + expert - 1, mask=expert > 0, other=0)
    return expert, first


@triton.jit
def gather_gemm_kernel(
    tokens_ptr,  # [T, K] token rows
    row_token_ptr,  # int32 [M]: each row's token (-1: pad row)
    w_ptr,  # [E, K, N] (any strides)
    out_ptr,  # [M, N] out
    ends_ptr,  # int32 [E + 1]: each expert's first row, then the end of the last
    tile_ends_ptr,  # int32 [E]: row tiles of experts 0..e together
    N,
    K,
    stride_we,
    stride_wk,
    stride_wn,
    row_tiles,
    n_tiles,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,  # dot fp32 copies of the (exact) inputs: the CPU interpreter's dot has no bf16
):
    # Programs run GROUP_M row tiles by all column tiles at a time, row tiles fastest: the weight
    # columns they load stay in L2 for the group's other row tiles.
    pid = tl.program_id(0)
    in_group = GROUP_M * n_tiles
    first_tile = pid // in_group * GROUP_M
    group_rows = tl.minimum(row_tiles - first_tile, GROUP_M)
    tile = first_tile + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    expert, first = _segment_of_tile(tile_ends_ptr, tile, E, BLOCK_E)
    if expert < E:
        seg_start = tl.load(ends_ptr + expert)
        seg_end = tl.load(ends_ptr + expert + 1)
        rows = seg_start + (tile - first) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_seg = rows < seg_end
        token = tl.load(row_token_ptr + rows, mask=in_seg, other=-1)
        live = token >= 0
        src = tokens_ptr + tl.where(live, token, 0).to(tl.int64)[:, None] * K
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            a = tl.load(src + k[None, :], mask=live[:, None] & (k[None, :] < K), other=0.0)
            b = tl.load(w + k[:, None].to(tl.int64) * stride_wk, mask=(k[:, None] < K) & (cols[None, :] < N),
                        other=0.0)
            if UPCAST:
                a, b = as_fp32(a), as_fp32(b)
            acc = tl.dot(a, b, acc)
        dst = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(dst, stored_as(acc, out_ptr.dtype.element_ty), mask=in_seg[:, None] & (cols[None, :] < N))


# Tile shapes for the H200 (bf16, wgmma; the best of a sweep at three layer shapes:
# benchmarks/results/bench_layer_sweep.txt); the CPU interpreter uses the smallest tl.dot allows.
_GPU_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, UPCAST=False)
_CPU_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, UPCAST=True)


def launch_gather_gemm(tokens, row_token, w, ends, tiles=None):
    """[M, N] = per expert, its gathered token rows @ w[e]; rows past ends[E] are not written.
    tiles: the kernel's tile constexprs (default: this module's choice)."""
    E, K, N = w.shape
    num_rows = row_token.shape[0]
    out = torch.empty((num_rows, N), dtype=tokens.dtype, device=tokens.device)
    meta = tiles or dict(_GPU_TILES if tokens.device.type == "cuda" else _CPU_TILES)
    tile_ends = torch.cumsum((ends[1:] - ends[:-1] + meta["BLOCK_M"] - 1) // meta["BLOCK_M"], 0, dtype=torch.int32)
    n_tiles = triton.cdiv(N, meta["BLOCK_N"])
    row_tiles = triton.cdiv(num_rows, meta["BLOCK_M"]) + E  # at most one partial tile per expert
    if num_rows and N and E:
        gather_gemm_kernel[(row_tiles * n_tiles,)](
            tokens, row_token, w, out, ends, tile_ends, N, K, w.stride(0), w.stride(1), w.stride(2),
            row_tiles, n_tiles, E=E, BLOCK_E=triton.next_power_of_2(E), **meta)
    return out


class GatherOps(OpFamily):
    """One variant's gather GEMM as a custom op, `permgen::<target>_<variant>_gather_gemm` (defined on
    first use, as every permgen op), differentiable, and the row gather its backward pass runs,
    `..._gather_rows`: permute's row move without the kernel's other work, differentiable as permute
    is. The tokens' gradient of either is the variant's own permute backward (its op) of the rows'
    gradient: each token's rows summed in a fixed order. Their backward formulas are made of
    differentiable ops, so second derivatives are computed."""

    def __init__(self, ops):
        super().__init__(ops.prefix)
        self.ops = ops

    def declare(self):
        sizes = "Tensor row_map, SymInt num_tokens, SymInt width, SymInt num_experts"
        return {
            "gather_gemm": Op(self._gather_gemm, self._gather_gemm_fake,
                              f"(Tensor tokens, Tensor row_token, Tensor w, Tensor ends, {sizes}) -> Tensor",
                              backward=self._gather_gemm_backward, setup=self._gather_gemm_setup),
            "gather_rows": Op(self._gather_rows, self._gather_rows_fake,
                              f"(Tensor tokens, Tensor row_token, {sizes}) -> Tensor",
                              backward=self._gather_rows_backward, setup=self._gather_rows_setup),
        }

    @staticmethod
    def _gather_gemm(tokens, row_token, w, ends, row_map, num_tokens, width, num_experts):
        return launch_gather_gemm(tokens, row_token, w, ends)

    @staticmethod
    def _gather_gemm_fake(tokens, row_token, w, ends, row_map, num_tokens, width, num_experts):
        return tokens.new_empty((row_token.shape[0], w.shape[2]))

    def _gather_rows(self, tokens, row_token, row_map, num_tokens, width, num_experts):
        return self.ops.chunk_sort.kernels.gather_rows(row_token, tokens)

    @staticmethod
    def _gather_rows_fake(tokens, row_token, row_map, num_tokens, width, num_experts):
        return tokens.new_empty((row_token.shape[0], tokens.shape[1]))

    @staticmethod
    def _gather_rows_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])
        ctx.sizes = (*inputs[3:], inputs[1].shape[0])

    def _gather_rows_backward(self, ctx, grad):
        (row_map,) = ctx.saved_tensors
        grad_tokens = self.ops.op["permute_backward"](row_map, grad, *ctx.sizes) if ctx.needs_input_grad[0] else None
        return grad_tokens, None, None, None, None, None

    @staticmethod
    def _gather_gemm_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:5])
        ctx.sizes = inputs[5:]

    def _gather_gemm_backward(self, ctx, grad):
        tokens, row_token, w, ends, row_map = ctx.saved_tensors
        needs = ctx.needs_input_grad
        offs = ends[1:]  # torch._grouped_mm's groups: [offs[e - 1], offs[e]), the first from row 0
        grad_tokens = grad_w = None
        if needs[0]:
            grad_rows = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs)
            grad_tokens = self.ops.op["permute_backward"](row_map, grad_rows, *ctx.sizes, row_token.shape[0])
        if needs[2]:
            rows = ctx.calls["gather_rows"](tokens, row_token, row_map, *ctx.sizes)
            grad_w = torch._grouped_mm(rows.t(), grad, offs=offs)
        return grad_tokens, None, grad_w, None, None, None, None, None

    def gather_gemm(self, tokens, row_token, w, ends, row_id_map):
        """The op where autograd or torch.compile needs it, else the kernel alone."""
        calls = self.calls(tokens, w)
        if calls is None:
            return launch_gather_gemm(tokens, row_token, w, ends)
        m = row_id_map
        return calls["gather_gemm"](tokens, row_token, w, ends, m.row_map, m.num_tokens, m.width, m.num_experts)
