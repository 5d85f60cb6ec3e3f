"""float8_e4m3fn quantisation written once, for the quantising permutes (templates/triton/_quantize.py.jinja
imports these helpers) and the FP8 expert MLP (permgen.layers.fp8_mlp): the bf16 and fp8 conversions,
the scale rule of every scale kind (scale_rule), and the one two-pass quantiser (quantize_along) that
the row quantiser, the column quantiser and the rowwise quantising permute run, each along its axis.

Scales are powers of two whose exponent is read from the bits of a row's (or block's) amax, and
the conversion rounds to nearest even and saturates at +-448, so the CPU interpreter, the GPU and
the plain-PyTorch reference (tests/reference.py, quantize_ref) agree bit for bit
(docs/quantization.md).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def ceil_exponent(amax_bits):
    """ceil(log2(amax / 448)) + 127, at least 0, exactly, from the bits of a finite amax >= 0.

    amax = m * 2^(b - 127) with m in [1, 2) and 448 = 1.75 * 2^8: the quotient lies in
    (2^(b - 136), 2^(b - 135)] when m <= 1.75 (mantissa bits <= 0x600000), else in (2^(b - 135), 2^(b - 134))."""
    return tl.maximum((amax_bits >> 23) - 8 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32), 0)


@triton.jit
def fp8_e4m3_bytes(y, HARDWARE_CAST: tl.constexpr):
    """y (fp32) as float8_e4m3fn bytes, rounded to nearest even, saturating at +-448; every NaN is
    0x7F, whatever its sign (docs/quantization.md).

    HARDWARE_CAST: the GPU's saturating conversion, which writes every NaN as 0x7F (H200: both signs).
    Otherwise the same in integer arithmetic (the CPU interpreter's fp8 cast neither rounds to even
    nor saturates, and a CPU keeps a NaN's sign)."""
    if HARDWARE_CAST:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    is_normal = magnitude >= 0x3C800000  # 2^-6, the smallest normal fp8
    # Normal fp8: keep 3 mantissa bits, ties to even; the fp8 exponent bias is 7, fp32's 127.
    rounded = tl.minimum(magnitude, 0x43E00000) + 0x7FFFF + ((magnitude >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal fp8: multiples of 2^-9; adding and removing 2^23 rounds |y| * 2^9 to an integer, ties to even.
    small = tl.where(is_normal, 0, magnitude).to(tl.float32, bitcast=True)
    subnormal = ((small * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(is_normal, normal, subnormal)
    code = tl.where(magnitude >= 0x43E00000, 0x7E, code)  # 448 and above (Inf included) saturate
    code = code | ((bits >> 24) & 0x80)
    return tl.where(magnitude > 0x7F800000, 0x7F, code).to(tl.uint8)  # NaN, without its sign


@triton.jit
def bf16_bits_as_fp32(bits):
    """bf16 values passed as their int16 bits, as fp32: the bits followed by 16 zero bits (exact for
    subnormals too, which the CPU interpreter's bf16 cast gets wrong)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(x):
    """fp32 x rounded to nearest even bf16, as int16 bits (NaN stays NaN): torch's rounding, which the
    CPU interpreter's cast (it truncates) does not give."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def magnitude_bits(x):
    """|x| of fp32 x as int32 bits: non-negative floats order like their bits, and NaN above Inf, so a
    max over them is exact and NaN-propagating on every target."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def scale_rule(amax_bits, E8M0: tl.constexpr):
    """(exponent, factor, tail) of a block whose largest |x| has the bits amax_bits (magnitude_bits): the
    block's scale is 2^(exponent - 127) and its values are multiplied by factor, then tail.

    fp32 scales (block128, rowwise: E8M0 false): amax clamped below at 1e-4 (0x38D1B717); a block
    holding NaN or Inf gets the scale 2^127. e8m0 scales (mx32): the exponent byte itself, 0 for an
    amax of at most 448 * 2^-127, 0xFF for NaN or Inf. A non-finite block's factor, 2^-127 (2^-128
    for e8m0), is subnormal (the GPU may flush it to zero): it is applied as 2^-126 and then 1/2
    (1/4), which is exact wherever the result can reach fp8."""
    non_finite = amax_bits >= 0x7F800000
    if E8M0:
        exponent = tl.where(non_finite, 255, ceil_exponent(amax_bits))
        tail = tl.where(non_finite, 0.25, 1.0)
    else:
        exponent = tl.where(non_finite, 254, ceil_exponent(tl.maximum(amax_bits, 0x38D1B717)))
        tail = tl.where(non_finite, 0.5, 1.0)
    factor = (tl.maximum(254 - exponent, 1) << 23).to(tl.float32, bitcast=True)
    return exponent, factor, tail


@triton.jit
def fp32_scale(exponent):
    """2^(exponent - 127) as fp32."""
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_fp32(ptrs, mask):
    """The values at ptrs as fp32 (0 where not mask): bf16 passed as its int16 bits (bf16_bits_as_fp32),
    other float dtypes converted."""
    values = tl.load(ptrs, mask=mask, other=0)
    if ptrs.dtype.element_ty == tl.int16:
        return bf16_bits_as_fp32(values)
    return values.to(tl.float32)


@triton.jit
def _along(i0, BLOCK: tl.constexpr, AXIS: tl.constexpr):
    """Indices i0 .. i0 + BLOCK - 1 laid along AXIS of a 2-D tile."""
    return tl.expand_dims(i0 + tl.arange(0, BLOCK), 1 - AXIS)


@triton.jit
def quantize_along(x_ptr, src, src_live, out_ptr, dst, dst_live, length, stride, AXIS: tl.constexpr,
                   BLOCK: tl.constexpr, HARDWARE_CAST: tl.constexpr):
    """The rowwise rule's two-pass quantiser (block128's rule over a whole vector): the vectors of a 2-D
    tile, each `length` values along AXIS (1: the tile's rows, 0: its columns), to float8_e4m3fn bytes
    with one fp32 power-of-two scale per vector, returned ([tile size across AXIS]).

    A vector's value i is read at x_ptr + src + i * stride (where src_live; None: everywhere) and its
    byte written to out_ptr + dst + i (where dst_live; dst may broadcast one vector to several rows).
    A first pass finds each vector's amax, BLOCK values at a time; a second, its loads served by the
    cache, scales, converts and stores (on the H200, holding a row in registers instead ran the Mixtral
    permute 1.05-1.2x slower). A vector stored across the tile (AXIS = 0) is transposed first, so that
    the stores run along the output's rows."""
    first = _along(0, BLOCK, AXIS)
    amax_bits = tl.zeros((src + first).shape, dtype=tl.int32)
    for i0 in range(0, length, BLOCK):
        i = _along(i0, BLOCK, AXIS)
        where = i < length if src_live is None else src_live & (i < length)
        amax_bits = tl.maximum(amax_bits, magnitude_bits(load_fp32(x_ptr + src + i * stride, where)))
    exponent, factor, tail = scale_rule(tl.max(amax_bits, axis=AXIS), E8M0=False)
    factor = tl.expand_dims(factor, AXIS)
    tail = tl.expand_dims(tail, AXIS)
    for i0 in range(0, length, BLOCK):
        i = _along(i0, BLOCK, AXIS)
        where = i < length if src_live is None else src_live & (i < length)
        q = fp8_e4m3_bytes(load_fp32(x_ptr + src + i * stride, where) * factor * tail, HARDWARE_CAST)
        if AXIS == 0:
            tl.store(tl.trans(out_ptr + dst + i), tl.trans(q), mask=tl.trans(dst_live & (i < length)))
        else:
            tl.store(out_ptr + dst + i, q, mask=dst_live & (i < length))
    return fp32_scale(exponent)


@triton.jit
def quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, rows, cols, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                         HARDWARE_CAST: tl.constexpr):
    """ROWS rows of bf16 x [rows, cols] (as int16 bits) per program: float8_e4m3fn bytes and one fp32
    scale per row (quantize_along over the tile's rows)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = row < rows
    base = row.to(tl.int64)[:, None] * cols
    scale = quantize_along(x_ptr, base, live[:, None], out_ptr, base, live[:, None], cols, 1, 1, BLOCK,
                           HARDWARE_CAST)
    tl.store(scale_ptr + row, scale, mask=live)


def _check_bf16(where, x, shape):
    """The quantisers read bf16 bits in place: refuse any other dtype, rank or layout."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != shape.count(",") + 1 \
            or not x.is_contiguous():
        got = (f"{'' if x.is_contiguous() else 'non-contiguous '}{x.dtype} {list(x.shape)}"
               if isinstance(x, torch.Tensor) else type(x).__name__)
        raise ValueError(f"{where}: x must be a contiguous torch.bfloat16 tensor {shape}, got {got}")


def row_tiles(rows, cols):
    """(programs, columns per step, rows per program) of a kernel that walks whole rows: steps of up to
    1024 columns, and narrow rows several to a program, so that a program still moves a few KiB."""
    block = min(1024, triton.next_power_of_2(cols))
    per_program = max(1, min(16, 2048 // block))
    return triton.cdiv(rows, per_program), block, per_program


def quantize_rows(x):
    """(float8_e4m3fn [R, C], fp32 scales [R]) of a contiguous bf16 x [R, C]: x = rows * scale[:, None]
    up to the fp8 rounding."""
    _check_bf16("quantize_rows", x, "[R, C]")
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows and cols:
        programs, block, per_program = row_tiles(rows, cols)
        quantize_rows_kernel[(programs,)](
            x.view(torch.int16), out, scale, rows, cols, BLOCK=block, ROWS=per_program,
            HARDWARE_CAST=x.device.type == "cuda", num_warps=4)
    return out.view(torch.float8_e4m3fn), scale


@triton.jit
def quantize_columns_kernel(x_ptr, out_ptr, scale_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                            HARDWARE_CAST: tl.constexpr):
    """BLOCK_C columns of matrix program_id(1) of bf16 x [B, rows, cols] (as int16 bits), transposed and
    quantised by the rowwise rule: out [B, cols, rows] float8_e4m3fn bytes, one fp32 scale per column
    (scale [B, cols]; quantize_along over the tile's columns)."""
    matrix = tl.program_id(1).to(tl.int64) * rows * cols
    col = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = (col < cols)[None, :]
    scale = quantize_along(x_ptr, matrix + col[None, :], live, out_ptr, matrix + col[None, :] * rows, live, rows,
                           cols, 0, BLOCK_R, HARDWARE_CAST)
    tl.store(scale_ptr + tl.program_id(1).to(tl.int64) * cols + col, scale, mask=col < cols)


def quantize_columns(x):
    """(float8_e4m3fn [B, C, R], fp32 scales [B, C]) of a contiguous bf16 x [B, R, C]: the rows of each
    x[b]^T quantised, bit for bit quantize_rows(x.transpose(1, 2).contiguous()), without the bf16
    transposed copy (one kernel reads x twice and writes the fp8 bytes once)."""
    _check_bf16("quantize_columns", x, "[B, R, C]")
    matrices, rows, cols = x.shape
    out = torch.empty((matrices, cols, rows), dtype=torch.uint8, device=x.device)
    scale = torch.empty((matrices, cols), dtype=torch.float32, device=x.device)
    if matrices and rows and cols:
        block_c = min(64, triton.next_power_of_2(cols))
        quantize_columns_kernel[(triton.cdiv(cols, block_c), matrices)](
            x.view(torch.int16), out, scale, rows, cols, BLOCK_R=64, BLOCK_C=block_c,
            HARDWARE_CAST=x.device.type == "cuda", num_warps=4)
    return out.view(torch.float8_e4m3fn), scale
