"""The Markdown tables of PERFORMANCE.md and the README, from the committed benchmark results.

    python3 benchmarks/tables.py [--results benchmarks/results] [--baseline 899ed6f]

Prints three tables: every variant and call (eager / graph ratios to the copy floor, the
baseline's graph ratio in brackets beside the same call), the README's summary (graph ratios),
and the quantising variants. The baseline's results are read from git; its mask variants were
timed with `topk` (then the only fast call), its index variants without hints. Needs no GPU.
"""

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = ("permute", "unpermute", "permute_bwd", "unpermute_bwd")
SHAPES = {"deepseek_v3": ("DeepSeek-V3", "H=7168, E=256, k=8"), "qwen3_moe": ("Qwen3-MoE", "H=2048, E=128, k=8"),
          "mixtral": ("Mixtral", "H=4096, E=8, k=2")}
ROWS = [("probs_bf16_mask", "plain"), ("probs_bf16_mask", "topk"), ("probs_bf16_index", "plain"),
        ("probs_pad128_bf16_mask", "plain"), ("probs_pad128_bf16_mask", "topk"),
        ("probs_pad128_fp8e4m3_block128_mask", "plain"), ("probs_pad128_fp8e4m3_block128_mask", "topk")]


def by_key(results):
    """(shape, variant, call, op) -> result; results without a call are the baseline's."""
    table = {}
    for r in results:
        call = r.get("call") or ("topk" if r["variant"].endswith("_mask") else "plain")
        table[r["shape"], r["variant"], call, r["op"]] = r
    return table


def variants_table(ours, base):
    lines = ["| shape | variant | call | permute | unpermute | permute bwd | unpermute bwd |",
             "|---|---|---|---|---|---|---|"]
    for shape, (name, sizes) in SHAPES.items():
        label = f"{name} {sizes.replace(',', '')}"
        for variant, call in ROWS:
            cells = []
            for op in OPS:
                r = ours[shape, variant, call, op]
                if op == "permute_bwd" and "fp8" in variant:
                    cells.append("prob grads only")  # fp8 tokens carry no grad: a launch-bound few MB
                    continue
                cell = f"{r['ratio_to_floor']:.2f} / {r['graph_ratio_to_floor']:.2f}"
                b = base.get((shape, variant, call, op))
                cells.append(cell + (f" ({b['graph_ratio_to_floor']:.2f})" if b else ""))
            lines.append(f"| {label} | {variant} | {'no hint' if call == 'plain' else 'topk'} | {' | '.join(cells)} |")
            label = ""
    return "\n".join(lines)


def readme_table(ours):
    lines = ["| shape | permute (incl. routing) | unpermute (merging probs) | permute bwd | unpermute bwd |",
             "|---|---|---|---|---|"]
    for shape, (name, sizes) in SHAPES.items():
        for variant, label in (("probs_bf16_index", f"{name} ({sizes}), index routing"),
                               ("probs_bf16_mask", f"{name}, mask routing, no `topk`")):
            cells = [f"{ours[shape, variant, 'plain', op]['graph_ratio_to_floor']:.2f}" for op in OPS]
            lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def quantize_table(results):
    lines = ["| shape | quantising variant | rows | ours | (a) bf16 permute | (b) quantise + FP8 permute "
             "| (c) broadcast | floor | (a)/ours | (b)/ours | ours/(c) | ours/(c) per byte | ours/floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    seen = set()
    for r in results:
        name, sizes = SHAPES[r["shape"]]
        label = name if r["shape"] in seen else f"{name} ({sizes})"
        seen.add(r["shape"])
        separate = f"{r['separate_us']:.0f} ({r['group_quant_us']:.0f} + {r['separate_us'] - r['group_quant_us']:.0f})"
        lines.append(f"| {label} | {r['variant']} | {r['rows']} | {r['quantising_us']:.0f} "
                     f"| {r['bf16_permute_us']:.0f} | {separate} "
                     f"| {r['broadcast_us']:.0f} | {r['floor_us']:.0f} | {r['vs_bf16']:.2f} | {r['vs_separate']:.2f} "
                     f"| {r['vs_broadcast']:.2f} | {r['vs_broadcast_per_byte']:.2f} | {r['vs_floor']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--baseline", default="899ed6f", help="commit whose bench.json gives the bracketed ratios")
    args = parser.parse_args()
    ours = by_key(json.loads((args.results / "bench.json").read_text())["results"])
    shown = subprocess.run(["git", "show", f"{args.baseline}:benchmarks/results/bench.json"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    base = by_key(json.loads(shown)["results"])
    print(variants_table(ours, base), readme_table(ours), sep="\n\n")
    print()
    print(quantize_table(json.loads((args.results / "bench_quantize.json").read_text())["results"]))


if __name__ == "__main__":
    main()
