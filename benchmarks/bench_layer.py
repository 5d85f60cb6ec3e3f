"""A whole MoE expert layer, forward + backward, on one GPU: permgen's expert_mlp (its default, and
save_memory=True, whose first GEMM gathers the tokens through the row map) against the same layer
with permgen's standalone permute / unpermute, a PyTorch-native permutation, and the same GEMMs on
rows already grouped (no permutation at all); and the activation memory each keeps for backward.
Beside them, the FP8 expert_mlp (variant probs_pad16_bf16_to_fp8e4m3_rowwise_index: rows quantised
on permute, torch._scaled_grouped_mm) with its weights quantised once per step (fp8_weights, as a
training step with several micro-batches reuses them) and quantised in every call, and its
signal-to-quantisation-noise ratio against the bf16 expert_mlp, output and every gradient.

    python3 benchmarks/bench_layer.py --out benchmarks/results      (part of `make bench`)

Per shape (N tokens, top-k routing over E experts from softmaxed random logits, SwiGLU experts of
width F, bf16, variant probs_bf16_index): us per call, CUDA events, median of --reps runs of
--iters calls. Also the first GEMM alone: the gather GEMM (tokens read through the row map) against
torch._grouped_mm on grouped rows. Writes bench_layer.json, .txt and .png (with matplotlib).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import permgen  # noqa: E402
from permgen.triton import gemm as triton_gemm  # noqa: E402
from permgen.layers.expert_mlp import row_tokens, segment_ends  # noqa: E402
from common import grouped_bars, timed_run_parser  # noqa: E402  (benchmarks/, this script's folder)
from tables import run_metadata  # noqa: E402

SHAPES = [("qwen3_moe", 16384, 2048, 128, 8, 768), ("deepseek_v3", 16384, 7168, 256, 8, 2048),
          ("mixtral", 16384, 4096, 8, 2, 14336)]  # name, N, H, E, k, F
SMALL_SHAPES = [("qwen3_moe_n2048", 2048, 2048, 128, 8, 768)]


def timed(fn, iters, reps):
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters * 1e3)
    return round(sorted(times)[len(times) // 2], 1)


def swiglu(h):
    gate, up = h.chunk(2, dim=1)
    return F.silu(gate) * up


def experts(rows, w1, w2, ends):
    return torch._grouped_mm(swiglu(torch._grouped_mm(rows, w1, offs=ends)), w2, offs=ends)


def relative_error(got, want):
    return round(float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)), 6)


def torch_layer(x, ids, probs, w1, w2, E):
    """The PyTorch-native permutation: argsort by expert, index_select, index_add_ back."""
    N, k = ids.shape
    order = torch.argsort(ids.reshape(-1), stable=True)
    ends = torch.cumsum(torch.bincount(ids.reshape(-1), minlength=E), 0).to(torch.int32)
    out = experts(x.index_select(0, order // k), w1, w2, ends)
    weights = probs.reshape(-1).index_select(0, order).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, out * weights[:, None])


def sqnr_db(got, want):
    """10 log10(|want|^2 / |got - want|^2), summed in chunks (no fp32 copy of a whole weight gradient)."""
    signal = noise = 0.0
    for a, b in zip(got.detach().reshape(-1).split(1 << 26), want.detach().reshape(-1).split(1 << 26)):
        signal += float(b.float().pow(2).sum())
        noise += float((a.float() - b.float()).pow(2).sum())
    return round(10 * torch.log10(torch.tensor(signal / max(noise, 1e-30))).item(), 1)


def run_shape(name, N, H, E, k, Fw, mod, fp8_mod, iters, reps):
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    top, ids = torch.randn(N, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    ids = ids.to(torch.int32)
    probs = top.contiguous().requires_grad_()
    w1 = (torch.randn(E, H, 2 * Fw, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, Fw, H, device="cuda", generator=g) * Fw ** -0.5).to(torch.bfloat16).requires_grad_()
    grad_y = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    leaves = [x, probs, w1, w2]

    def standalone():
        res = mod.permute(x, ids, probs, num_experts=E, num_out_tokens=N * k)
        m = res.row_id_map
        ends = (m.segment_offsets[:E] + m.segment_counts).to(torch.int32)
        return mod.unpermute(experts(res.tokens, w1, w2, ends), m, probs)

    def fused():  # the first GEMM gathers the token rows (no permuted copy)
        return mod.expert_mlp(x, ids, probs, w1, w2, num_experts=E, num_out_tokens=N * k, save_memory=True)

    def one_call():  # expert_mlp's default: the standalone composition in one call
        return mod.expert_mlp(x, ids, probs, w1, w2, num_experts=E, num_out_tokens=N * k)

    # Grouped rows: the layer's GEMMs and SwiGLU on rows already in expert order, no permutation.
    pre = mod.permute(x.detach(), ids, probs.detach(), num_experts=E, num_out_tokens=N * k)
    grouped = pre.tokens.clone().requires_grad_()
    ends = (pre.row_id_map.segment_offsets[:E] + pre.row_id_map.segment_counts).to(torch.int32)
    grad_grouped = torch.randn(grouped.shape, device="cuda", generator=g).to(torch.bfloat16)

    # Exactly the same function: the fused layer against the standalone one (sums in bf16: tolerances).
    ref, ours = standalone(), fused()
    ref_grads = torch.autograd.grad(ref, leaves, grad_y)
    our_grads = torch.autograd.grad(ours, leaves, grad_y)
    errors = {label: relative_error(a.detach()[:8], b.detach()[:8])  # the first 8 rows / experts: fp32 copies of
              for label, a, b in zip(["y", "grad_x", "grad_probs", "grad_w1", "grad_w2"],  # all would not fit
                                     (ours, *our_grads), (ref, *ref_grads))}
    del ref, ours, ref_grads, our_grads
    assert all(e < 2e-2 for e in errors.values()), f"{name}: fused layer disagrees: {errors}"

    def step(forward, inputs, grad):
        def run():
            out = forward()
            torch.autograd.grad(out, inputs, grad)
        return run

    # The FP8 layer against the bf16 one: SQNR of the output and of every gradient.
    fp8_weights = fp8_mod.expert_mlp.quantize_weights(w1.detach(), w2.detach())
    # Its segments are padded to 16 rows: the capacity is the rows this routing needs (nothing dropped).
    fp8_rows = fp8_mod.permute(x.detach(), ids, probs.detach(), num_experts=E).tokens.shape[0]

    def fp8_layer():
        return fp8_mod.expert_mlp(x, ids, probs, w1, w2, num_experts=E, num_out_tokens=fp8_rows,
                                  fp8_weights=fp8_weights)

    def fp8_layer_quantizing_weights():
        return fp8_mod.expert_mlp(x, ids, probs, w1, w2, num_experts=E, num_out_tokens=fp8_rows)

    ref, ours = one_call(), fp8_layer()
    sqnr = {"y": sqnr_db(ours, ref)}
    for label, a, b in zip(["grad_x", "grad_probs", "grad_w1", "grad_w2"], torch.autograd.grad(ours, leaves, grad_y),
                           torch.autograd.grad(ref, leaves, grad_y)):
        sqnr[label] = sqnr_db(a, b)
        del a, b
    del ref, ours

    m = pre.row_id_map
    row_token = row_tokens(m)
    bounds = segment_ends(m, E)
    times = {
        "layer_fp8": timed(step(fp8_layer, leaves, grad_y), iters, reps),
        "layer_fp8_quantizing_weights": timed(step(fp8_layer_quantizing_weights, leaves, grad_y), iters, reps),
        "fp8_quantize_weights": timed(lambda: fp8_mod.expert_mlp.quantize_weights(w1.detach(), w2.detach()),
                                      iters, reps),
        "fwd_fp8": timed(lambda: fp8_layer(), iters, reps),
        "fwd_expert_mlp": timed(lambda: one_call(), iters, reps),
        "layer_fused": timed(step(fused, leaves, grad_y), iters, reps),
        "layer_expert_mlp": timed(step(one_call, leaves, grad_y), iters, reps),
        "layer_standalone": timed(step(standalone, leaves, grad_y), iters, reps),
        "layer_torch": timed(step(lambda: torch_layer(x, ids, probs, w1, w2, E), leaves, grad_y), iters, reps),
        "layer_grouped_rows": timed(step(lambda: experts(grouped, w1, w2, ends), [grouped, w1, w2], grad_grouped),
                                    iters, reps),
        "fwd_fused": timed(lambda: fused(), iters, reps),
        "fwd_standalone": timed(lambda: standalone(), iters, reps),
        "fwd_grouped_rows": timed(lambda: experts(grouped, w1, w2, ends), iters, reps),
        "gemm1_gather": timed(lambda: triton_gemm.launch_gather_gemm(x.detach(), row_token, w1.detach(), bounds),
                              iters, reps),
        "gemm1_grouped_mm": timed(lambda: torch._grouped_mm(pre.tokens, w1, offs=ends), iters, reps),
        "permute": timed(lambda: mod.permute(x, ids, probs, num_experts=E, num_out_tokens=N * k), iters, reps),
    }
    kept = {"fused": kept_mib(fused), "standalone": kept_mib(standalone)}
    del fp8_weights
    return dict(shape=name, N=N, H=H, E=E, k=k, F=Fw, time_us=times, max_rel_error=errors,
                activation_mib_kept_for_backward=kept, fp8_sqnr_db=sqnr)


def kept_mib(forward):
    """MiB the forward pass leaves allocated for the backward pass (its output included)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    del out
    return round(kept / 2**20, 1)


def sweep(name, N, H, E, k, Fw, mod):
    """Tile shapes of the gather GEMM at one shape, us per call, beside permute + torch._grouped_mm."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randn(N, E, device="cuda", generator=g).topk(k, dim=-1).indices.to(torch.int32)
    probs = torch.rand(N, k, device="cuda", generator=g)
    w1 = torch.randn(E, H, 2 * Fw, device="cuda", generator=g).to(torch.bfloat16)
    pre = mod.permute(x, ids, probs, num_experts=E, num_out_tokens=N * k)
    m = pre.row_id_map
    row_token = row_tokens(m)
    bounds = segment_ends(m, E)
    ends = bounds[1:]
    out = {}
    for bm, bn, bk, group, warps, stages in [(128, 256, 64, 8, 8, 3), (128, 256, 64, 1, 8, 3), (128, 256, 64, 16, 8, 3),
                                             (256, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 4),
                                             (128, 128, 64, 8, 4, 4), (64, 256, 64, 8, 8, 4)]:
        tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages,
                     UPCAST=False)
        key = f"{bm}x{bn}x{bk} g{group} w{warps} s{stages}"
        try:
            out[f"gather {key}"] = timed(lambda: triton_gemm.launch_gather_gemm(x, row_token, w1, bounds, tiles), 5, 3)
        except Exception as e:  # noqa: BLE001 (out of shared memory: recorded, not fatal)
            out[f"gather {key}"] = f"failed: {type(e).__name__}"
    out["torch._grouped_mm"] = timed(lambda: torch._grouped_mm(pre.tokens, w1, offs=ends), 5, 3)
    out["permute + torch._grouped_mm"] = timed(
        lambda: torch._grouped_mm(mod.permute(x, ids, probs, num_experts=E, num_out_tokens=N * k).tokens, w1,
                                  offs=ends), 5, 3)
    return out


def main():
    parser = timed_run_parser(__doc__, 5, "rewrite bench_layer.txt and .png from --out/bench_layer.json (no GPU needed)")
    parser.add_argument("--sweep", action="store_true", help="time tile shapes of the gather GEMM instead")
    args = parser.parse_args()
    if args.render_only:
        render(args.out)
        return
    mod = permgen.get_kernel("triton", dtype="bf16", routing="index", probs=True)
    fp8_mod = permgen.get_kernel("triton", dtype="bf16", routing="index", probs=True, quantize="rowwise", pad=16)
    if args.sweep:  # writes bench_layer_sweep.txt, the source of permgen/triton/gemm.py's tile choice
        lines = [f"permgen gather GEMM tile sweep, {torch.cuda.get_device_name()} (torch {torch.__version__}, Triton "
                 f"{triton.__version__}): us per call of the first GEMM at each layer shape", ""]
        for shape in SHAPES:
            lines.append(f"{shape[0]} {json.dumps(sweep(*shape, mod), indent=1)}")
            print(lines[-1], flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_layer_sweep.txt").write_text("\n".join(lines) + "\n")
        return
    results = []
    for shape in SHAPES + SMALL_SHAPES:
        results.append(run_shape(*shape, mod, fp8_mod, args.iters, args.reps))
        print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_layer.json").write_text(json.dumps(dict(run=run_metadata(), results=results), indent=1) + "\n")
    render(args.out)


def report(run):
    lines = [f"permgen expert layer, forward + backward, {run['run']['gpu']}, torch {run['run']['torch']}, us per call",
             ""]
    for r in run["results"]:
        t = r["time_us"]
        lines.append(f"{r['shape']}: N={r['N']} H={r['H']} E={r['E']} k={r['k']} F={r['F']}")
        lines.append("  layer fwd+bwd: gather GEMM (save_memory) {layer_fused}  expert_mlp default {layer_expert_mlp}  "
                     "standalone permute {layer_standalone}  PyTorch permutation {layer_torch}  GEMMs on grouped rows "
                     "{layer_grouped_rows}".format(**t))
        kept = r["activation_mib_kept_for_backward"]
        lines.append(f"  kept for the backward pass: save_memory {kept['fused']} MiB, standalone {kept['standalone']} MiB")
        lines.append(f"  save_memory / grouped rows {t['layer_fused'] / t['layer_grouped_rows']:.3f}, "
                     f"standalone / grouped rows {t['layer_standalone'] / t['layer_grouped_rows']:.3f}")
        lines.append("  forward: save_memory {fwd_fused}  standalone {fwd_standalone}  grouped rows {fwd_grouped_rows}"
                     .format(**t))
        lines.append(f"  first GEMM: gather {t['gemm1_gather']} vs torch._grouped_mm {t['gemm1_grouped_mm']} "
                     f"({t['gemm1_gather'] / t['gemm1_grouped_mm']:.2f}x), permute {t['permute']}")
        if "layer_fp8" in t:
            sq = r["fp8_sqnr_db"]
            lines.append(f"  FP8 expert_mlp fwd+bwd: weights quantised once per step {t['layer_fp8']} "
                         f"({t['layer_fp8'] / t['layer_expert_mlp']:.3f}x bf16 expert_mlp), in every call "
                         f"{t['layer_fp8_quantizing_weights']} "
                         f"({t['layer_fp8_quantizing_weights'] / t['layer_expert_mlp']:.3f}x); quantize_weights "
                         f"{t['fp8_quantize_weights']}; forward {t['fwd_fp8']} vs bf16 {t['fwd_expert_mlp']} "
                         f"({t['fwd_fp8'] / t['fwd_expert_mlp']:.3f}x)")
            lines.append("  FP8 SQNR against bf16, dB: " + "  ".join(f"{key} {value}" for key, value in sq.items()))
    return "\n".join(lines) + "\n"


def plot(run, path):
    bars = [("layer_grouped_rows", "GEMMs on grouped rows"), ("layer_expert_mlp", "expert_mlp"),
            ("layer_fused", "expert_mlp(save_memory=True)"), ("layer_torch", "PyTorch permutation"),
            ("layer_fp8", "FP8 expert_mlp (weights quantised per step)"),
            ("layer_fp8_quantizing_weights", "FP8 expert_mlp (weights quantised per call)")]
    bars = [(key, label) for key, label in bars if all(key in r["time_us"] for r in run["results"])]
    results = run["results"]
    grouped_bars(path, [f"{r['shape']}\nN={r['N']}" for r in results],
                 [(label, [r["time_us"][key] / r["time_us"]["layer_grouped_rows"] for r in results])
                  for key, label in bars],
                 "time / GEMMs on grouped rows", f"MoE expert layer, forward + backward, SwiGLU, {run['run']['gpu']}",
                 level=1.0)


def render(out):
    """bench_layer.txt and bench_layer.png (with matplotlib) from --out/bench_layer.json."""
    run = json.loads((out / "bench_layer.json").read_text())
    text = report(run)
    (out / "bench_layer.txt").write_text(text)
    print(text)
    try:
        plot(run, out / "bench_layer.png")
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
