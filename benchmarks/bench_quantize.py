"""GPU benchmark of quantise-on-permute (variants with `quantize`): bf16 tokens in, FP8 rows and scales out.

    python3 benchmarks/bench_quantize.py --out benchmarks/results        (part of make bench; needs a CUDA GPU)

For each shape, the quantising permute (called as users call it: no topk hint; num_out_tokens the
rows the routing needs, so nothing is read back) against
  (a) the bf16 permute of the same routing (the variant without `quantize`),
  (b) the separate path: a Triton per-token-group quantisation kernel (same scales and bytes),
      then the FP8 permute that moves the bytes and scales (rowwise: permgen's row quantiser, then
      the FP8 permute of the bytes alone -- no variant moves [N, 1] scales -- a lower bound),
  (c) the routing-free broadcast of the same bytes (each bf16 row read once, written as k one-byte
      rows plus scales to expert-sorted rows): permute's practical ceiling,
and the copy floor (the bytes the op must move at device-to-device copy bandwidth, measured in the
same run). Times are GPU time alone, each call replayed from a CUDA graph (medians of
triton.testing.do_bench), as bench.py's graph columns: eager calls of ~100 us are bound by the
host's Python on these hosts. Writes bench_quantize.json, bench_quantize.txt and, with
matplotlib, bench_quantize.png into --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # the generator renders the comparison variants the spec does not list

import permgen  # noqa: E402
from permgen.triton.fp8 import quantize_rows  # noqa: E402
from bench import copy_bandwidth, expert_sorted_rows, graph_us  # noqa: E402
from tables import run_metadata  # noqa: E402

SHAPES = [  # name, N, H, E, k
    ("deepseek_v3", 16384, 7168, 256, 8),
    ("qwen3_moe", 16384, 2048, 128, 8),
    ("mixtral", 16384, 4096, 8, 2),
]
# The quantising variants of the spec; each is compared with the bf16 variant and the FP8 variant
# (moving the scales) with the same routing, probs and padding.
QUANTIZING = ["probs_bf16_to_fp8e4m3_block128_index", "pad32_bf16_to_fp8e4m3_mx32_mask",
              "probs_pad16_bf16_to_fp8e4m3_rowwise_index"]
GROUP = {"block128": 128, "mx32": 32, "rowwise": 1024}  # rowwise: (c) writes one word per row (one step of 1024)


AXES = ("dtype", "routing", "probs", "scale", "quantize", "pad")


def variant_module(**axes):
    """The generated Triton module with these axes; for a comparison variant the spec does not list,
    the same templates rendered by the generator into a temporary module."""
    try:
        return permgen.get_kernel("triton", **axes)
    except LookupError:
        from generator.render import MODULE_TEMPLATES, make_environment, template_context
        from generator.spec import Variant
        variant = Variant(targets=("triton",), **axes)
        text = make_environment().get_template(MODULE_TEMPLATES["triton"]).render(
            **template_context(variant), template_name=MODULE_TEMPLATES["triton"], fingerprint="benchmark")
        path = Path(tempfile.mkdtemp()) / f"{variant.name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"bench_{variant.name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def comparison_modules(name):
    """(the quantising module, the bf16 module, the FP8 module of the separate path) for a quantising variant."""
    axes = {a: permgen.VARIANTS[name][a] for a in AXES}
    bf16 = variant_module(**{**axes, "quantize": "none"})
    scale = "none" if axes["quantize"] == "rowwise" else axes["quantize"]
    fp8 = variant_module(**{**axes, "dtype": "fp8_e4m3", "scale": scale, "quantize": "none"})
    return variant_module(**axes), bf16, fp8


# ---- (b): per-token-group quantisation as its own kernel (the scales of the README's definitions) ----

@triton.jit
def group_quant_kernel(x_ptr, q_ptr, s_ptr, hidden, scale_width, GROUP: tl.constexpr, MX: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    for h0 in range(0, hidden, BLOCK_H):
        col = h0 + tl.arange(0, BLOCK_H)
        x = (tl.load(x_ptr + token * hidden + col, mask=col < hidden, other=0).to(tl.int32) << 16).to(
            tl.float32, bitcast=True)
        blocks = tl.reshape(x, [BLOCK_H // GROUP, GROUP])
        amax = tl.max(blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        if not MX:
            amax = tl.maximum(amax, 0x38D1B717)
        e = tl.maximum((amax >> 23) - 8 + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32), 0)
        e = tl.where(amax >= 0x7F800000, 255 if MX else 254, e)
        factor = (tl.maximum(254 - e, 1) << 23).to(tl.float32, bitcast=True)
        tail = tl.where(e == 255, 0.25, tl.where(e == 254, 0.5, 1.0))
        q = tl.reshape((blocks * factor[:, None] * tail[:, None]).to(tl.float8e4nv), [BLOCK_H])
        tl.store(q_ptr + token * hidden + col, q.to(tl.uint8, bitcast=True), mask=col < hidden)
        s_col = h0 // GROUP + tl.arange(0, BLOCK_H // GROUP)
        s = e.to(tl.uint8) if MX else (e << 23).to(tl.float32, bitcast=True)
        tl.store(s_ptr + token * scale_width + s_col, s, mask=s_col < scale_width)


def group_quant(tokens, kind):
    N, H = tokens.shape
    width = triton.cdiv(H, GROUP[kind])
    q = torch.empty(N, H, dtype=torch.uint8, device=tokens.device)
    s = torch.empty(N, width, dtype=torch.uint8 if kind == "mx32" else torch.float32, device=tokens.device)
    group_quant_kernel[(N,)](tokens.view(torch.int16), q, s, H, width, GROUP=GROUP[kind], MX=kind == "mx32",
                             BLOCK_H=1024, num_warps=4)
    return q.view(torch.float8_e4m3fn), s


# ---- (c): the routing-free broadcast of the same bytes ---------------------------------------------

@triton.jit
def broadcast_bytes_kernel(x_ptr, dst_rows_ptr, out_ptr, out_scale_ptr, hidden, scale_width, K: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_H: tl.constexpr):
    """Read a bf16 row once, write its high bytes to K rows and one 4-byte word per group (no math, no routing)."""
    token = tl.program_id(0).to(tl.int64)
    dst = tl.load(dst_rows_ptr + token * K + tl.arange(0, K)).to(tl.int64)
    for h0 in range(0, hidden, BLOCK_H):
        col = h0 + tl.arange(0, BLOCK_H)
        x = (tl.load(x_ptr + token * hidden + col, mask=col < hidden, other=0) >> 8).to(tl.uint8)
        tl.store(out_ptr + dst[:, None] * hidden + col[None, :], tl.broadcast_to(x[None, :], (K, BLOCK_H)),
                 mask=(col < hidden)[None, :])
        s_col = h0 // GROUP + tl.arange(0, BLOCK_H // GROUP)
        s = tl.reshape(x.to(tl.int32), [BLOCK_H // GROUP, GROUP]).sum(axis=1)
        tl.store(out_scale_ptr + dst[:, None] * scale_width + s_col[None, :],
                 tl.broadcast_to(s[None, :], (K, BLOCK_H // GROUP)).to(out_scale_ptr.dtype.element_ty),
                 mask=(s_col < scale_width)[None, :])


def routing_inputs(mod, N, E, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(N, E, device="cuda", generator=g)
    top_probs, ids = logits.softmax(-1).topk(k, dim=-1)
    if mod.VARIANT["routing"] == "mask":
        routing = torch.zeros(N, E, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
        probs = torch.zeros(N, E, device="cuda").scatter_(1, ids, top_probs)
    else:
        routing, probs = ids.to(torch.int32), top_probs.contiguous()
    return routing, (probs if mod.VARIANT["probs"] else None)


def run(name, N, H, E, k, qname, copy_bw):
    mod, bf16, fp8 = comparison_modules(qname)
    kind = mod.VARIANT["quantize"]
    tokens = torch.randn(N, H, device="cuda").to(torch.bfloat16)
    routing, probs = routing_inputs(mod, N, E, k)
    # num_out_tokens: the rows this routing needs (padding included), as a caller with a capacity passes it.
    first = mod.permute(tokens, routing, probs, num_experts=E)
    M = first.tokens.shape[0]
    kw = dict(num_experts=E, num_out_tokens=M)
    S = first.scale.shape[1]
    scale_bytes = first.scale.element_size()
    row = {"shape": name, "N": N, "H": H, "E": E, "k": k, "variant": qname, "rows": M}

    quantising = graph_us(lambda: mod.permute(tokens, routing, probs, **kw))
    plain = graph_us(lambda: bf16.permute(tokens, routing, probs, **kw))
    moved = N * H * 2 + M * H + M * S * scale_bytes + (0 if probs is None else M * 4)
    row.update(quantising_us=quantising, bf16_permute_us=plain, bytes=moved, floor_us=moved / copy_bw * 1e6)

    quantize = (lambda: quantize_rows(tokens)) if kind == "rowwise" else (lambda: group_quant(tokens, kind))

    def separate():
        q, s = quantize()
        return fp8.permute(q, routing, probs, None if kind == "rowwise" else s, **kw)

    # The separate path gives the same rows and scales (rowwise: the same rows).
    sep, ours = separate(), mod.permute(tokens, routing, probs, **kw)
    row["separate_matches"] = bool(torch.equal(sep.tokens.view(torch.uint8), ours.tokens.view(torch.uint8))
                                   and (kind == "rowwise" or torch.equal(sep.scale, ours.scale)))
    row["separate_us"] = graph_us(separate)
    row["group_quant_us"] = graph_us(quantize)
    rows = expert_sorted_rows(N, E, k)
    out = torch.empty(N * k, H, dtype=torch.uint8, device="cuda")
    out_scale = torch.empty(N * k, S, dtype=first.scale.dtype, device="cuda")
    x16 = tokens.view(torch.int16)
    row["broadcast_us"] = graph_us(lambda: broadcast_bytes_kernel[(N,)](
        x16, rows, out, out_scale, H, S, K=k, GROUP=GROUP[kind], BLOCK_H=1024, num_warps=4))
    # (c) writes the routed rows only; per byte, ours against it: (ours / our floor) / ((c) / its floor).
    broadcast_bytes = N * H * 2 + N * k * (H + S * scale_bytes)
    row.update(vs_bf16=plain / quantising, vs_separate=row["separate_us"] / quantising,
               vs_broadcast=quantising / row["broadcast_us"], vs_floor=quantising / row["floor_us"],
               vs_broadcast_per_byte=(quantising / moved) / (row["broadcast_us"] / broadcast_bytes))
    return row


def table(results, copy_gbps, gpu):
    lines = [f"{gpu}; device-to-device copy {copy_gbps:.0f} GB/s; times in us (CUDA-graph replay, do_bench medians)", "",
             "| shape | quantising variant | rows | quantising permute | (a) bf16 permute | (b) quantise + fp8 permute "
             "| (c) broadcast of the bytes | copy floor | (a)/ours | (b)/ours | ours/(c) | per byte | ours/floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        sep = f"{r['separate_us']:.0f} ({r['group_quant_us']:.0f} + permute)"
        lines.append(f"| {r['shape']} | {r['variant']} | {r['rows']} | {r['quantising_us']:.0f} | {r['bf16_permute_us']:.0f} "
                     f"| {sep} | {r['broadcast_us']:.0f} | {r['floor_us']:.0f} | {r['vs_bf16']:.2f} | {r['vs_separate']:.2f} "
                     f"| {r['vs_broadcast']:.2f} | {r['vs_broadcast_per_byte']:.2f} | {r['vs_floor']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(results, path, gpu):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['shape']}\n{permgen.VARIANTS[r['variant']]['quantize']}" for r in results]
    series = [("quantising permute", "quantising_us"), ("(a) bf16 permute", "bf16_permute_us"),
              ("(b) quantise + fp8 permute", "separate_us"), ("(c) broadcast of the bytes", "broadcast_us"),
              ("copy floor", "floor_us")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.16
    for i, (label, key) in enumerate(series):
        xs = [j + (i - 2) * width for j, r in enumerate(results) if key in r]
        ax.bar(xs, [r[key] for r in results if key in r], width, label=label)
    ax.set_xticks(range(len(results)), labels)
    ax.set_ylabel("us (median)")
    ax.set_title(f"Quantise on permute, {gpu}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    args.out.mkdir(parents=True, exist_ok=True)
    copy_bw = copy_bandwidth()
    results = []
    for name, N, H, E, k in SHAPES:
        if name in args.shapes:
            for qname in QUANTIZING:
                results.append(run(name, N, H, E, k, qname, copy_bw))
                print({key: round(v, 2) if isinstance(v, float) else v for key, v in results[-1].items()}, flush=True)
    gpu = torch.cuda.get_device_name()
    text = table(results, copy_bw / 1e9, gpu)
    print(text)
    summary = dict(run=run_metadata(), copy_gbps=round(copy_bw / 1e9, 1), results=results)
    (args.out / "bench_quantize.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "bench_quantize.txt").write_text(text)
    plot(results, args.out / "bench_quantize.png", gpu)


if __name__ == "__main__":
    main()
