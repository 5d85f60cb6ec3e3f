"""The FP8 expert MLP: what `expert_mlp` runs for variants that quantise rowwise on permute
(quantize = "rowwise", expert_mlp = true; docs/expert_mlp.md, "FP8").

    rows, row_scale = permute-quantise(tokens)                      float8_e4m3fn [M, H], fp32 [M]
    h   = scaled_grouped_mm(rows, row_scale, w1_t in fp8)           bf16 [M, 2F]
    a   = quantise_rows(swiglu(h))
    out = scaled_grouped_mm(a, w2_t in fp8)                         bf16 [M, H], then unpermute

torch._scaled_grouped_mm (Hopper: one fp32 scale per row of A and per column of B, B column-major)
reads permute's rows and scales as they are: the scales are a view of permute's [M, 1] output.
Weights are quantised per output column for the forward GEMMs and per input row for the backward
ones (Fp8ExpertWeights, made by quantize_expert_weights once per optimizer step if the caller keeps
the result).

This module holds the layer between permute and unpermute: the weights' fp8 copies, the scaled GEMM,
SwiGLU's backward kernel and the custom ops. expert_mlp (permgen.layers.expert_mlp) checks the
arguments and runs permute and unpermute around it; the quantisers are permgen.triton.fp8's.

Backward: the rows' gradients (dgrad) in FP8 -- the incoming gradient quantised rowwise, times the
weights quantised along their other dimension -- and the weights' gradients (wgrad) in bf16 with
torch._grouped_mm, on the tokens gathered again through the row map and on swiglu(h) recomputed by
the one kernel that also writes d swiglu / dh. bf16 wgrad: on the H200 the FP8 2-D x 2-D GEMM saved
too little at some shapes and lost at others, before the two column-wise quantisation passes over x
and dh per expert it needs (docs/expert_mlp.md). The tokens' gradient is permute's backward of the
rows'.

The GPU GEMMs use Hopper's fast accumulation (use_fast_accum): without it the FP8 GEMMs ran slower
than bf16's on the H200 (docs/expert_mlp.md, with the layer's SQNR against bf16). On the CPU (no
kernel in torch) the scaled GEMM is emulated from its definition: the dequantised operands'
products, summed exactly (float64), stored in bf16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..core.oplayer import Op, OpFamily
from ..triton.fp8 import bf16_bits_as_fp32, fp32_to_bf16_bits, quantize_columns, quantize_rows, row_tiles


class Fp8ExpertWeights(NamedTuple):
    """The FP8 copies of w1 [E, H, 2F] and w2 [E, F, H] that the FP8 expert MLP reads, made by
    `expert_mlp.quantize_weights(w1, w2)`: each weight twice, w and its transpose w_t, each copy
    float8_e4m3fn with its rows quantised (one fp32 scale per row), contiguous. torch._scaled_grouped_mm
    reads a copy transposed, column-major, as it takes its second operand: w_t for the forward GEMMs
    (x @ w), w for the tokens' gradients (grad @ w^T)."""

    w1_t: torch.Tensor  # [E, 2F, H]: w1 transposed, a scale per column of w1, for h = x @ w1
    w1_t_scale: torch.Tensor  # [E, 2F]
    w1: torch.Tensor  # [E, H, 2F]: a scale per row of w1, for the tokens' gradient dh @ w1^T
    w1_scale: torch.Tensor  # [E, H]
    w2_t: torch.Tensor  # [E, H, F]
    w2_t_scale: torch.Tensor  # [E, H]
    w2: torch.Tensor  # [E, F, H]
    w2_scale: torch.Tensor  # [E, F]

    def check(self, name, w1, w2):
        """Raise a ValueError unless these are the copies of weights shaped as w1 and w2 are, on their device."""
        (experts, hidden, width2), width = w1.shape, w1.shape[2] // 2
        shapes = dict(w1_t=(experts, width2, hidden), w1_t_scale=(experts, width2), w1=(experts, hidden, width2),
                      w1_scale=(experts, hidden), w2_t=(experts, hidden, width), w2_t_scale=(experts, hidden),
                      w2=(experts, width, hidden), w2_scale=(experts, width))
        for field, shape in shapes.items():
            t = getattr(self, field)
            dtype = torch.float32 if field.endswith("scale") else torch.float8_e4m3fn
            if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype
                    or t.device != w1.device or not t.is_contiguous()):
                got = (f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"{name}: fp8_weights.{field} must be contiguous {dtype} {list(shape)} on "
                                 f"{w1.device} (quantize_weights of these w1 and w2), got {got}")


def emulated_scaled_grouped_mm(a, a_scale, b, b_scale, offs):
    """torch._scaled_grouped_mm's definition (2-D a, 3-D b, rowwise scales): for rows r of group e,
    out[r] = (a[r] * a_scale[r]) @ (b[e] * b_scale[e]), stored in bf16. Group e is rows
    [offs[e - 1], offs[e]) (the first from 0); rows past the last are not written.

    The products and sums are float64: exact for fp8 operands with power-of-two scales (a product
    holds 8 significant bits, and a row's products span far fewer than float64's 53), so the result
    is the exact sum rounded once, whatever the order (the GPU's fast accumulation sums in reduced
    precision, so its results differ by the sums' rounding)."""
    out = torch.empty((a.shape[0], b.shape[2]), dtype=torch.bfloat16, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        x = a[start:end].double() * a_scale[start:end, None].double()
        out[start:end] = (x @ (b[e].double() * b_scale[e][None, :].double())).to(torch.bfloat16)
        start = end
    return out


def scaled_grouped_mm(a, a_scale, b, b_scale, offs):
    """a [M, K] float8_e4m3fn row-major, a_scale [M]; b [E, K, N] float8_e4m3fn column-major, b_scale
    [E, N]; offs int32 [E] (each group's end) -> bf16 [M, N]."""
    if a.device.type == "cuda":
        return torch._scaled_grouped_mm(a, b, a_scale, b_scale, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
    return emulated_scaled_grouped_mm(a, a_scale, b, b_scale, offs)


def swiglu(h):
    """SwiGLU of h [M, 2F]: the gate's F columns, then the up projection's."""
    gate, up = h.chunk(2, dim=1)
    return F.silu(gate) * up


@triton.jit
def _swiglu_backward_kernel(grad_ptr, h_ptr, grad_h_ptr, a_ptr, rows, width, BLOCK: tl.constexpr,
                            ROWS: tl.constexpr):
    """ROWS rows per program of bf16 h [rows, 2 * width] (gate, then up) and grad [rows, width] (as int16
    bits): d swiglu(h) / dh for grad [rows, 2 * width] and swiglu(h) [rows, width], both bf16, the
    math in fp32 (the sigmoid once for both)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = row < rows
    h_row = row.to(tl.int64)[:, None] * (2 * width)
    a_row = row.to(tl.int64)[:, None] * width
    for c0 in range(0, width, BLOCK):
        col = c0 + tl.arange(0, BLOCK)[None, :]
        where = live[:, None] & (col < width)
        gate = bf16_bits_as_fp32(tl.load(h_ptr + h_row + col, mask=where, other=0))
        up = bf16_bits_as_fp32(tl.load(h_ptr + h_row + width + col, mask=where, other=0))
        grad = bf16_bits_as_fp32(tl.load(grad_ptr + a_row + col, mask=where, other=0))
        sig = tl.sigmoid(gate)
        silu = gate * sig
        tl.store(grad_h_ptr + h_row + col, fp32_to_bf16_bits(grad * up * sig * (1 + gate * (1 - sig))), mask=where)
        tl.store(grad_h_ptr + h_row + width + col, fp32_to_bf16_bits(grad * silu), mask=where)
        # swiglu's own rounding: silu(gate) to bf16, then the product
        tl.store(a_ptr + a_row + col, fp32_to_bf16_bits(bf16_bits_as_fp32(fp32_to_bf16_bits(silu)) * up), mask=where)


def swiglu_backward(grad, h):
    """(d swiglu(h) / dh for grad, swiglu(h)) of bf16 h [M, 2F] and grad [M, F]: one pass over both."""
    rows, width = grad.shape
    grad_h, a = torch.empty_like(h), torch.empty_like(grad)
    if rows and width:
        programs, block, per_program = row_tiles(rows, width)
        _swiglu_backward_kernel[(programs,)](
            grad.view(torch.int16), h.view(torch.int16), grad_h.view(torch.int16), a.view(torch.int16), rows, width,
            BLOCK=block, ROWS=per_program,
            num_warps=4)
    return grad_h, a


class Fp8Ops(OpFamily):
    """One variant's FP8 expert MLP as custom ops (`permgen::<target>_<variant>_fp8_...`, defined on
    first use): `fp8_mlp`, differentiable, between permute and unpermute; the quantisers, the scaled
    GEMM and SwiGLU's backward kernel, which it and its backward pass run (their outputs refuse a
    second derivative). gather_ops: the variant's GatherOps, whose row gather the backward pass runs."""

    def __init__(self, ops, gather_ops):
        super().__init__(ops.prefix)
        self.ops, self.gather_ops = ops, gather_ops

    def declare(self):
        # (the fp8 copies get their own parameter names: Inductor refuses an op with two parameters w1)
        weights = ", ".join(f"Tensor fp8_{name}" for name in Fp8ExpertWeights._fields)
        return {
            "fp8_quantize_rows": Op(self._quantize_rows, self._quantize_rows_fake, "(Tensor x) -> (Tensor, Tensor)"),
            "fp8_quantize_columns": Op(self._quantize_columns, self._quantize_columns_fake,
                                       "(Tensor x) -> (Tensor, Tensor)"),
            "fp8_scaled_grouped_mm": Op(self._scaled_grouped_mm, self._scaled_grouped_mm_fake,
                                        "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor offs) -> Tensor"),
            "fp8_swiglu_backward": Op(self._swiglu_backward, self._swiglu_backward_fake,
                                      "(Tensor grad, Tensor h) -> (Tensor, Tensor)"),
            "fp8_mlp": Op(self._mlp, self._mlp_fake,
                          f"(Tensor tokens, Tensor rows, Tensor row_scale, Tensor w1, Tensor w2, {weights}, Tensor offs, "
                          "Tensor row_token, Tensor row_map, SymInt num_tokens, SymInt width, SymInt num_experts) "
                          "-> (Tensor, Tensor)", backward=self._mlp_backward, setup=self._mlp_setup),
        }

    @staticmethod
    def _quantize_rows(x):
        return quantize_rows(x.contiguous())

    @staticmethod
    def _quantize_rows_fake(x):
        return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(x.shape[:1], dtype=torch.float32)

    @staticmethod
    def _quantize_columns(x):
        return quantize_columns(x.contiguous())

    @staticmethod
    def _quantize_columns_fake(x):
        return x.new_empty((x.shape[0], x.shape[2], x.shape[1]), dtype=torch.float8_e4m3fn), \
            x.new_empty((x.shape[0], x.shape[2]), dtype=torch.float32)

    @staticmethod
    def _scaled_grouped_mm(a, a_scale, b, b_scale, offs):
        return scaled_grouped_mm(a, a_scale, b, b_scale, offs)

    @staticmethod
    def _scaled_grouped_mm_fake(a, a_scale, b, b_scale, offs):
        return a.new_empty((a.shape[0], b.shape[2]), dtype=torch.bfloat16)

    @staticmethod
    def _swiglu_backward(grad, h):
        return swiglu_backward(grad.contiguous(), h.contiguous())

    @staticmethod
    def _swiglu_backward_fake(grad, h):
        return torch.empty_like(h), torch.empty_like(grad)

    @staticmethod
    def _mlp(tokens, rows, row_scale, w1, w2, fp8_w1_t, fp8_w1_t_scale, fp8_w1, fp8_w1_scale, fp8_w2_t,
             fp8_w2_t_scale, fp8_w2, fp8_w2_scale, offs, row_token, row_map, num_tokens, width, num_experts):
        h = scaled_grouped_mm(rows, row_scale, fp8_w1_t.transpose(1, 2), fp8_w1_t_scale, offs)
        a, a_scale = quantize_rows(swiglu(h))
        return scaled_grouped_mm(a, a_scale, fp8_w2_t.transpose(1, 2), fp8_w2_t_scale, offs), h

    @staticmethod
    def _mlp_fake(tokens, rows, row_scale, w1, w2, *rest):
        return rows.new_empty((rows.shape[0], w2.shape[2]), dtype=torch.bfloat16), \
            rows.new_empty((rows.shape[0], w1.shape[2]), dtype=torch.bfloat16)

    @staticmethod
    def _mlp_setup(ctx, inputs, output):
        # the tokens, the fp8 copies w1, w1_scale, w2, w2_scale (the gradients' GEMMs), offs, row_token, row_map
        tokens, fp8_w1, fp8_w1_scale, fp8_w2, fp8_w2_scale, offs, row_token, row_map = (
            inputs[i] for i in (0, 7, 8, 11, 12, 13, 14, 15))
        ctx.save_for_backward(tokens, output[1], fp8_w1, fp8_w1_scale, fp8_w2, fp8_w2_scale, offs, row_token, row_map)
        ctx.sizes = inputs[16:]

    def _mlp_backward(self, ctx, grad_out, _grad_h):
        tokens, h, fp8_w1, fp8_w1_scale, fp8_w2, fp8_w2_scale, offs, row_token, row_map = ctx.saved_tensors
        calls = ctx.calls
        needs = ctx.needs_input_grad
        grad_out = grad_out.contiguous()
        g, g_scale = calls["fp8_quantize_rows"](grad_out)
        grad_a = calls["fp8_scaled_grouped_mm"](g, g_scale, fp8_w2.transpose(1, 2), fp8_w2_scale, offs)
        grad_h, a = calls["fp8_swiglu_backward"](grad_a, h)
        grad_tokens = grad_w1 = grad_w2 = None
        if needs[0]:
            dh, dh_scale = calls["fp8_quantize_rows"](grad_h)
            grad_rows = calls["fp8_scaled_grouped_mm"](dh, dh_scale, fp8_w1.transpose(1, 2), fp8_w1_scale, offs)
            grad_tokens = self.ops.op["permute_backward"](row_map, grad_rows, *ctx.sizes, row_token.shape[0])
        if needs[3]:
            x = self.gather_ops.op["gather_rows"](tokens, row_token, row_map, *ctx.sizes)
            grad_w1 = torch._grouped_mm(x.t(), grad_h, offs=offs)
        if needs[4]:
            grad_w2 = torch._grouped_mm(a.t(), grad_out, offs=offs)
        return (grad_tokens, None, None, grad_w1, grad_w2) + (None,) * 14

    def quantize_weights(self, w1, w2):
        """quantize_expert_weights, its quantisers the ops under torch.compile, else the kernels."""
        if torch.compiler.is_compiling():
            return quantize_expert_weights(w1, w2, self.op["fp8_quantize_rows"], self.op["fp8_quantize_columns"])
        return quantize_expert_weights(w1, w2)

    def mlp(self, tokens, rows, row_scale, w1, w2, weights, offs, row_token, row_id_map):
        """(out [M, H] bf16, h [M, 2F]): the op where autograd or torch.compile needs it, else its implementation."""
        m = row_id_map
        args = (tokens, rows, row_scale, w1, w2, *weights, offs, row_token, m.row_map, m.num_tokens, m.width,
                m.num_experts)
        calls = self.calls(tokens, w1, w2)
        return (self._mlp if calls is None else calls["fp8_mlp"])(*args)


def quantize_expert_weights(w1, w2, rows=quantize_rows, columns=quantize_columns) -> Fp8ExpertWeights:
    """The FP8 copies of bf16 w1 [E, H, 2F] and w2 [E, F, H] the FP8 expert MLP reads (no gradient flows
    through them; the caller checks them): each weight's columns (its transpose's rows, one kernel:
    columns), then its rows.
    Weights change once per optimizer step: a caller running several micro-batches quantises them
    once and passes the result as `fp8_weights`."""
    copies = []
    with torch.no_grad():
        for w in (w1, w2):
            w = w.contiguous()
            q, scale = columns(w)
            copies += [q, scale]
            q, scale = rows(w.view(-1, w.shape[2]))
            copies += [q.view(w.shape), scale.view(w.shape[:2])]
    return Fp8ExpertWeights(*copies)
