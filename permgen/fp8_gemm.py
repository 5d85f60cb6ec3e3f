"""The FP8 expert MLP: what `expert_mlp` runs for variants that quantise rowwise on permute
(quantize = "rowwise", expert_mlp = true; docs/expert_mlp.md, "FP8").

    rows, row_scale = permute-quantise(tokens)                      float8_e4m3fn [M, H], fp32 [M]
    h   = scaled_grouped_mm(rows, row_scale, w1 in fp8)             bf16 [M, 2F]
    a   = quantise_rows(swiglu(h))
    out = scaled_grouped_mm(a, w2 in fp8)                           bf16 [M, H], then unpermute

torch._scaled_grouped_mm (Hopper: one fp32 scale per row of A and per column of B, B column-major)
reads permute's rows and scales as they are: the scales are a view of permute's [M, 1] output.
Weights are quantised per output column for the forward GEMMs and per input row for the backward
ones (quantize_expert_weights, once per optimizer step if the caller keeps the result).

Backward: the rows' gradients (dgrad) in FP8 -- the incoming gradient quantised rowwise, times the
weights quantised along their other dimension -- and the weights' gradients (wgrad) in bf16 with
torch._grouped_mm, on the tokens gathered again through the row map and on swiglu(h) recomputed: the
faster of the two on the H200 once the FP8 wgrad's quantisation passes are counted
(benchmarks/results/bench_layer.txt). The tokens' gradient is permute's backward of the rows'.

On the CPU (no kernel in torch) the scaled GEMM is emulated from its definition: the dequantised
operands' products, summed exactly (float64), stored in bf16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .ops import _Registered
from .triton_fp8 import quantize_rows


class Fp8ExpertWeights(NamedTuple):
    """w1 [E, H, 2F] and w2 [E, F, H] in float8_e4m3fn, each twice, every copy stored with its rows
    quantised (one fp32 scale per row) and read transposed, column-major, as torch._scaled_grouped_mm
    takes its second operand."""

    w1: torch.Tensor  # [E, 2F, H]: w1's columns, for h = x @ w1
    w1_scale: torch.Tensor  # [E, 2F]
    w1_t: torch.Tensor  # [E, H, 2F]: w1's rows, for the tokens' gradient dh @ w1^T
    w1_t_scale: torch.Tensor  # [E, H]
    w2: torch.Tensor  # [E, H, F]
    w2_scale: torch.Tensor  # [E, H]
    w2_t: torch.Tensor  # [E, F, H]
    w2_t_scale: torch.Tensor  # [E, F]


def emulated_scaled_grouped_mm(a, a_scale, b, b_scale, offs):
    """torch._scaled_grouped_mm's definition (2-D a, 3-D b, rowwise scales): for rows r of group e,
    out[r] = (a[r] * a_scale[r]) @ (b[e] * b_scale[e]), stored in bf16. Group e is rows
    [offs[e - 1], offs[e]) (the first from 0); rows past the last are not written.

    The products and sums are float64: exact for fp8 operands with power-of-two scales (a product
    holds 8 significant bits, and a row's products span far fewer than float64's 53), so the result
    is the exact sum rounded once, whatever the order (the GPU sums in fp32)."""
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
        return torch._scaled_grouped_mm(a, b, a_scale, b_scale, offs=offs, out_dtype=torch.bfloat16)
    return emulated_scaled_grouped_mm(a, a_scale, b, b_scale, offs)


def swiglu(h):
    """SwiGLU of h [M, 2F]: the gate's F columns, then the up projection's."""
    gate, up = h.chunk(2, dim=1)
    return F.silu(gate) * up


def _swiglu_backward(grad, h):
    """d swiglu(h) / dh for the gradient of its output, in fp32, stored as h's dtype."""
    gate, up = h.float().chunk(2, dim=1)
    sig = torch.sigmoid(gate)
    grad = grad.float()
    return torch.cat([grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig], dim=1).to(h.dtype)


class Fp8Ops(_Registered):
    """One variant's FP8 expert MLP as custom ops (`permgen::<target>_<variant>_fp8_...`, defined on
    first use): `fp8_mlp`, differentiable, between permute and unpermute; `fp8_quantize_rows` and
    `fp8_scaled_grouped_mm`, which it and its backward pass run. gather_ops: the variant's GatherOps,
    whose row gather the backward pass runs."""

    def __init__(self, ops, gather_ops):
        super().__init__(ops.prefix)
        self.ops, self.gather_ops = ops, gather_ops

    def _register(self):
        weights = ", ".join(f"Tensor {name}" for name in Fp8ExpertWeights._fields)
        self._define({
            "fp8_quantize_rows": (self._quantize_rows, self._quantize_rows_fake, "(Tensor x) -> (Tensor, Tensor)"),
            "fp8_scaled_grouped_mm": (self._scaled_grouped_mm, self._scaled_grouped_mm_fake,
                                      "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor offs) -> Tensor"),
            "fp8_mlp": (self._mlp, self._mlp_fake,
                        f"(Tensor tokens, Tensor rows, Tensor row_scale, Tensor w1, Tensor w2, {weights}, Tensor offs, "
                        "Tensor row_token, Tensor row_map, SymInt num_tokens, SymInt width, SymInt num_experts) "
                        "-> (Tensor, Tensor)"),
        })
        self._autograd("fp8_mlp", self._mlp_backward, self._mlp_setup)

    @staticmethod
    def _quantize_rows(x):
        return quantize_rows(x.contiguous())

    @staticmethod
    def _quantize_rows_fake(x):
        return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(x.shape[:1], dtype=torch.float32)

    @staticmethod
    def _scaled_grouped_mm(a, a_scale, b, b_scale, offs):
        return scaled_grouped_mm(a, a_scale, b, b_scale, offs)

    @staticmethod
    def _scaled_grouped_mm_fake(a, a_scale, b, b_scale, offs):
        return a.new_empty((a.shape[0], b.shape[2]), dtype=torch.bfloat16)

    @staticmethod
    def _mlp(tokens, rows, row_scale, w1, w2, w1_q, w1_scale, w1_t, w1_t_scale, w2_q, w2_scale, w2_t, w2_t_scale,
             offs, row_token, row_map, num_tokens, width, num_experts):
        h = scaled_grouped_mm(rows, row_scale, w1_q.transpose(1, 2), w1_scale, offs)
        a, a_scale = quantize_rows(swiglu(h))
        return scaled_grouped_mm(a, a_scale, w2_q.transpose(1, 2), w2_scale, offs), h

    @staticmethod
    def _mlp_fake(tokens, rows, row_scale, w1, w2, w1_q, *rest):
        return rows.new_empty((rows.shape[0], w2.shape[2]), dtype=torch.bfloat16), \
            rows.new_empty((rows.shape[0], w1.shape[2]), dtype=torch.bfloat16)

    def _mlp_setup(self, ctx, inputs, output):
        ctx.calls = self.op
        tokens, w1_t, w1_t_scale, w2_t, w2_t_scale, offs, row_token, row_map = (
            inputs[i] for i in (0, 7, 8, 11, 12, 13, 14, 15))
        ctx.save_for_backward(tokens, output[1], w1_t, w1_t_scale, w2_t, w2_t_scale, offs, row_token, row_map)
        ctx.sizes = inputs[16:]

    def _mlp_backward(self, ctx, grad_out, _grad_h):
        tokens, h, w1_t, w1_t_scale, w2_t, w2_t_scale, offs, row_token, row_map = ctx.saved_tensors
        calls = ctx.calls
        needs = ctx.needs_input_grad
        grad_out = grad_out.contiguous()
        g, g_scale = calls["fp8_quantize_rows"](grad_out)
        grad_h = _swiglu_backward(calls["fp8_scaled_grouped_mm"](g, g_scale, w2_t.transpose(1, 2), w2_t_scale, offs), h)
        grad_tokens = grad_w1 = grad_w2 = None
        if needs[0]:
            dh, dh_scale = calls["fp8_quantize_rows"](grad_h)
            grad_rows = calls["fp8_scaled_grouped_mm"](dh, dh_scale, w1_t.transpose(1, 2), w1_t_scale, offs)
            grad_tokens = self.ops.op["permute_backward"](row_map, grad_rows, *ctx.sizes, row_token.shape[0])
        if needs[3]:
            x = self.gather_ops.op["gather_rows"](tokens, row_token)
            grad_w1 = torch._grouped_mm(x.t(), grad_h, offs=offs)
        if needs[4]:
            grad_w2 = torch._grouped_mm(swiglu(h).t(), grad_out, offs=offs)
        return (grad_tokens, None, None, grad_w1, grad_w2) + (None,) * 14

    def quantize_rows(self, x):
        """quantize_rows as the op under torch.compile, else the kernel."""
        if torch.compiler.is_compiling():
            return self.op["fp8_quantize_rows"](x)
        return quantize_rows(x.contiguous())

    def mlp(self, tokens, rows, row_scale, w1, w2, weights, offs, row_token, row_id_map):
        """(out [M, H] bf16, h [M, 2F]): the op where autograd or torch.compile needs it, else its implementation."""
        m = row_id_map
        args = (tokens, rows, row_scale, w1, w2, *weights, offs, row_token, m.row_map, m.num_tokens, m.width,
                m.num_experts)
        calls = self._calls(tokens, w1, w2)
        return (self._mlp if calls is None else calls["fp8_mlp"])(*args)


def quantize_expert_weights(w1, w2, quantize=quantize_rows) -> Fp8ExpertWeights:
    """The FP8 copies of w1 [E, H, 2F] and w2 [E, F, H] the FP8 expert MLP reads (no gradient flows
    through them). Weights change once per optimizer step: a caller running several micro-batches
    quantises them once and passes the result as `fp8_weights`."""
    copies = []
    with torch.no_grad():
        for w in (w1, w2):
            experts, rows_in, cols_out = w.shape
            for stored in (w.transpose(1, 2).contiguous(), w.contiguous()):  # columns, then rows
                q, scale = quantize(stored.view(-1, stored.shape[2]))
                copies += [q.view(stored.shape), scale.view(stored.shape[:2])]
    return Fp8ExpertWeights(*copies)
