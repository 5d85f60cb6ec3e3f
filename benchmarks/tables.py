"""The tables and figures of PERFORMANCE.md, the README and docs/, rendered from the committed benchmark
results, and the provenance every results file records.

    python3 benchmarks/tables.py            # rewrite every table and figure between its markers
    python3 benchmarks/tables.py --check    # exit 1, naming them, if a file is not current
    python3 benchmarks/tables.py --print    # print them instead

A table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->` on lines of their own; a figure
in a sentence between `<!-- fig:NAME -->` and `<!-- /fig -->` on one line. Everything between the
markers is replaced (tests/test_docs.py checks that nothing is stale). The sources are
benchmarks/results/*.json: bench.json, bench_quantize.json, bench_layer.json, bench_megatron.json
and bench_host.json (make bench), bench_ep.json (make bench-ep), nki_cost_lnc1.json and
nki_cost_lnc2.json (nki_cost.py --lnc 1 / 2), nki_a2av_cost.json (nki_a2av_cost.py). Where a file is
absent its tables and figures are not rendered, and --check names their markers. Needs no GPU.

Each results file records its run under "run" (RUN_FIELDS, written by run_metadata(), which every
benchmark script calls): date, commit, GPU, torch, Triton, megatron-core, Python and the command.
Values a run did not record are null; values read later from git history (the commit that added the
results) are named in the run's "from_git_history" and marked where they are shown.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FILES = (ROOT / "PERFORMANCE.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
OPS = ("permute", "unpermute", "permute_bwd", "unpermute_bwd")
OP_HEADERS = "permute | unpermute | permute bwd | unpermute bwd"
LARGE_SHAPES = {"deepseek_v3": ("DeepSeek-V3", "H=7168, E=256, k=8"), "qwen3_moe": ("Qwen3-MoE", "H=2048, E=128, k=8"),
                "mixtral": ("Mixtral", "H=4096, E=8, k=2")}
SMALL_SHAPES = {"deepseek_v3_4k": ("DeepSeek-V3, N=4096", ""), "small": ("small", "N=1024, H=1024, E=16, k=2"),
                "qwen3_moe_n2048": ("Qwen3-MoE, N=2048", "")}
SHAPES = {**LARGE_SHAPES, **SMALL_SHAPES}
ROWS = [("probs_bf16_mask", "plain"), ("probs_bf16_mask", "topk"), ("probs_bf16_index", "plain"),
        ("probs_pad128_bf16_mask", "plain"), ("probs_pad128_bf16_mask", "topk"),
        ("probs_pad128_fp8e4m3_block128_mask", "plain"), ("probs_pad128_fp8e4m3_block128_mask", "topk")]
HOST_COST_KEY = "host"  # bench.json's host cost of the small round trip, when the run measured it
RUN_FIELDS = ("date", "commit", "gpu", "torch", "triton", "megatron_core", "python", "command")


def git(*args):
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_metadata(command=None, gpu=None):
    """What a results file records of its run, under "run": the date (UTC), the checkout's commit
    ("+changes" when tracked files outside benchmarks/results differ from it), the GPU (default: CUDA
    device 0, or "none" without CUDA), the versions of torch, Triton, megatron-core (None where it is not
    installed) and Python, and the command (default: this process's, `python3 <script> <args>`, or under
    torchrun `torchrun --nproc-per-node <n> <script> <args>`)."""
    import torch
    import triton

    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"):
        commit += "+changes"
    if gpu is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    if command is None:
        script = Path(sys.argv[0]).resolve()
        script = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
        launcher = (["torchrun", "--nproc-per-node", os.environ["LOCAL_WORLD_SIZE"]]
                    if "TORCHELASTIC_RUN_ID" in os.environ else ["python3"])
        command = shlex.join([*launcher, str(script), *sys.argv[1:]])
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit,
                gpu=gpu, torch=torch.__version__, triton=triton.__version__, megatron_core=version("megatron-core"),
                python=platform.python_version(), command=command)


def run_cell(run, field):
    """One field of a run as shown: "not recorded" for a null, † for a value read from git history."""
    value = run.get(field)
    if value is None:
        return "not recorded"
    if field == "date":
        value = value[:10]
    if field == "command":
        value = f"`{value}`"
    return f"{value} †" if field in run.get("from_git_history", ()) else str(value)


def run_line(run):
    """A run in one line: GPU, versions, commit and date, command."""
    return (f"{run_cell(run, 'gpu')}, torch {run_cell(run, 'torch')}, Triton {run_cell(run, 'triton')}, megatron-core "
            f"{run_cell(run, 'megatron_core')}, permgen {run_cell(run, 'commit')}, {run_cell(run, 'date')}: "
            f"{run_cell(run, 'command')}")


RESULT_FILES = ("bench.json", "bench_host.json", "bench_quantize.json", "bench_layer.json", "bench_megatron.json",
                "bench_ep.json", "nki_cost_lnc1.json", "nki_cost_lnc2.json", "nki_a2av_cost.json")


def provenance_table(results):
    """One row per results file: the run that wrote it."""
    rows = []
    for name in RESULT_FILES:
        data = load(results, name)
        if data:
            rows.append([f"`{name}`", *(run_cell(data["run"], field) for field in RUN_FIELDS)])
    text = table(["results", "date", "permgen commit", "GPU", "torch", "Triton", "megatron-core", "Python",
                  "command"], rows)
    if any("†" in cell for row in rows for cell in row):
        text += ("\n\n† not recorded by the run; read from git history: the commit that added these results, its "
                 "date, or what its message states.")
    return text


def load(results, name):
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def shape_label(shape):
    name, sizes = SHAPES.get(shape, (shape, ""))
    return f"{name} ({sizes})" if sizes else name


def fmt(value, digits=2):
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def by_key(bench):
    return {(r["shape"], r["variant"], r["call"], r["op"]): r for r in bench["results"]}


def call_name(call):
    return "no hint" if call == "plain" else "topk"


def variants_table(bench):
    """Every variant and call at the large shapes: eager / graph ratio to the copy floor."""
    ours = by_key(bench)
    rows = []
    for shape in LARGE_SHAPES:
        label = shape_label(shape)
        for variant, call in ROWS:
            if (shape, variant, call, "permute") not in ours:
                continue
            cells = []
            for op in OPS:
                r = ours[shape, variant, call, op]
                if op == "permute_bwd" and "fp8" in variant:
                    cells.append("prob grads only")  # fp8 rows carry no gradient: a launch-bound few MB
                else:
                    cells.append(f"{r['ratio_to_floor']:.2f} / {r['graph_ratio_to_floor']:.2f}")
            rows.append([label, variant, call_name(call), *cells])
            label = ""
    return table(["shape", "variant", "call", *OP_HEADERS.split(" | ")], rows)


def small_shapes_table(bench):
    """The launch-bound shapes, as GPU time in us (graph replays), each variant as TE users call it."""
    ours = by_key(bench)
    rows = []
    for shape in SMALL_SHAPES:
        label = shape_label(shape)
        for variant, call in ROWS:
            if call != "plain" or (shape, variant, call, "permute") not in ours:
                continue
            cells = [f"{ours[shape, variant, call, op]['graph_time_us']:.1f}" for op in OPS]
            rows.append([label, variant, *cells])
            label = ""
    return table(["shape", "variant (no hint)", *OP_HEADERS.split(" | ")], rows)


def peers_table(bench):
    """Speedups over the PyTorch-native path and megatron-core's unfused permutation (eager calls on
    the same data; mask routing as TE users call it)."""
    ours = by_key(bench)
    rows = []
    for shape in LARGE_SHAPES:
        for variant in ("probs_bf16_mask",):
            if (shape, variant, "plain", "permute") not in ours:
                continue
            cells = [f"{fmt(r.get('speedup_vs_torch'), 1)} / {fmt(r.get('speedup_vs_megatron'), 1)}"
                     for r in (ours[shape, variant, "plain", op] for op in OPS)]
            rows.append([shape_label(shape), *cells])
    return table(["shape", *OP_HEADERS.split(" | ")], rows)


def readme_table(bench):
    ours = by_key(bench)
    rows = []
    for shape, (name, sizes) in LARGE_SHAPES.items():
        for variant, label in (("probs_bf16_index", f"{name} ({sizes}), index routing"),
                               ("probs_bf16_mask", f"{name}, mask routing, no `topk`")):
            if (shape, variant, "plain", "permute") in ours:
                cells = [f"{ours[shape, variant, 'plain', op]['graph_ratio_to_floor']:.2f}" for op in OPS]
                rows.append([label, *cells])
    header = ["shape", "permute (incl. routing)", "unpermute (merging probs)", "permute bwd", "unpermute bwd"]
    return table(header, rows)


def bandwidth_table(bench):
    rows = [["device-to-device copy (read + written): the floor", f"{bench['copy_gbps']:.0f}", "1.00"]]
    for name, gbps in bench.get("reference_gbps", {}).items():
        rows.append([name, f"{gbps:.0f}", f"{bench['copy_gbps'] / gbps:.2f}"])
    return table(["pattern (DeepSeek-V3's permute traffic)", "GB/s", "time over the copy floor"], rows)


def round_trip_table(bench):
    trips = bench.get("small_round_trip_us")
    if not trips:
        return ""
    rows = [[variant, *(fmt(t.get(key), 1) for key in
                        ("eager_us", "autograd_eager_us", "graph_replay_us", "compiled_reduce_overhead_us"))]
            for variant, t in trips.items() if isinstance(t, dict)]
    text = table(["variant", "eager", "eager, through autograd", "CUDA graph replay",
                  "torch.compile reduce-overhead"], rows)
    if "compiled_floor_us" in trips:
        text += (f"\n\nOne pointwise op on the same inputs, compiled the same way: "
                 f"{trips['compiled_floor_us']:.1f} us per call.")
    return text


HOST_LABELS = {"eager_ratio": "eager / its floor", "compiled_ratio": "compiled / its floor",
               "import_permgen_ms": "`import permgen` (fresh process)",
               "first_te_call_ms": "first TE round trip (fresh process)"}


def host_cost_table(bench):
    """bench.json's host cost of the small round trip (bench.py's host_cost), when the run measured it."""
    host = bench.get(HOST_COST_KEY)
    if not host:
        return ""
    header, cells = [], []
    for name, value in host.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # the shape, variant, device and compile mode: the caption
        header.append(HOST_LABELS.get(name, name))
        cells.append(f"{value:.2f}x" if name.endswith("_ratio") else
                     f"{value:.1f} ms" if name.endswith("_ms") else f"{value:.1f} us")
    shape = host.get("shape", {})
    caption = (f"{host.get('variant', '')}, " + ", ".join(f"{k}={v}" for k, v in shape.items())
               + f", on {host.get('device', '?')}, torch.compile mode {host.get('compile_mode', '?')}:")
    return caption + "\n\n" + table(header, [cells])


def bookkeeping_figures(bench):
    keep = bench.get("bookkeeping", {})
    return {f"bookkeeping-{v}": f"{b['ours_bytes'] / 1e6:.2f} MB" for v, b in keep.items()}


def bookkeeping_table(bench):
    keep = bench.get("bookkeeping")
    if not keep:
        return ""
    rows, sizes = [], set()
    for v, b in keep.items():  # one row per distinct layout (the mask variants keep the same map)
        if (b["ours_bytes"], b["dense_map_bytes"]) not in sizes:
            sizes.add((b["ours_bytes"], b["dense_map_bytes"]))
            rows.append([v, f"{b['ours_bytes'] / 1e6:.2f}", f"{b['dense_map_bytes'] / 1e6:.1f}"])
    return table(["variant (DeepSeek-V3, N=16384, no topk hint)", "row map, MB", "dense [N, 2E+1] map, MB"], rows)


def chunk_sort_table(bench):
    rows = [[shape_label(r["shape"]), f"{r['chunks']}", f"{r['ours_us']:.0f}", f"{r['floor_ratio']:.2f}",
             f"{r['torch_us']:.0f}", f"{r['speedup_vs_torch']:.2f}"] for r in bench.get("chunk_sort", [])]
    if not rows:
        return ""
    return table(["shape", "chunks", "ours, us", "ratio to floor", "torch.split + torch.cat, us", "speedup"], rows)


def quantize_table(quant):
    rows, seen = [], set()
    for r in quant["results"]:
        name, sizes = SHAPES[r["shape"]]
        label = name if r["shape"] in seen else f"{name} ({sizes})"
        seen.add(r["shape"])
        separate = f"{r['separate_us']:.0f} ({r['group_quant_us']:.0f} + {r['separate_us'] - r['group_quant_us']:.0f})"
        rows.append([label, r["variant"], str(r["rows"]), f"{r['quantising_us']:.0f}", f"{r['bf16_permute_us']:.0f}",
                     separate, f"{r['broadcast_us']:.0f}", f"{r['floor_us']:.0f}", f"{r['vs_bf16']:.2f}",
                     f"{r['vs_separate']:.2f}", f"{r['vs_broadcast']:.2f}", f"{r['vs_broadcast_per_byte']:.2f}",
                     f"{r['vs_floor']:.2f}"])
    return table(["shape", "quantising variant", "rows", "ours", "(a) bf16 permute", "(b) quantise + FP8 permute",
                  "(c) broadcast", "floor", "(a)/ours", "(b)/ours", "ours/(c)", "ours/(c) per byte", "ours/floor"],
                 rows)


EP_TIMES = (("a2a", "a2a"), ("dispatch", "dispatch"), ("combine", "combine"), ("dispatch bwd", "dispatch_backward"),
            ("combine bwd", "combine_backward"), ("permute", "permute"), ("unpermute", "unpermute"),
            ("permute bwd", "permute_backward"), ("unpermute bwd", "unpermute_backward"),
            ("torch dispatch", "torch_dispatch"), ("torch combine", "torch_combine"))
EP_CAPACITY_TIMES = (("a2a of C rows", "a2a_capacity"), ("dispatch", "dispatch_capacity"),
                     ("dispatch, graph replay", "dispatch_capacity_graph"), ("combine", "combine_capacity"),
                     ("combine, graph replay", "combine_capacity_graph"), ("permute of C rows", "permute_capacity"),
                     ("unpermute of C rows", "unpermute_capacity"))
EP_BEYOND = (("dispatch / permute", "dispatch_beyond_over_permute"),
             ("combine / unpermute", "combine_beyond_over_unpermute"),
             ("dispatch bwd / permute bwd", "dispatch_backward_beyond_over_permute_backward"),
             ("combine bwd / unpermute bwd", "combine_backward_beyond_over_unpermute_backward"),
             ("capacity dispatch / permute of C rows", "dispatch_capacity_beyond_over_permute_capacity"),
             ("capacity combine / unpermute of C rows", "combine_capacity_beyond_over_unpermute_capacity"))


def ep_times_table(ep):
    rows = [[SHAPES.get(r["shape"], (r["shape"],))[0], *(fmt(r["time_us"].get(key), 0) for _, key in EP_TIMES)]
            for r in ep["results"]]
    return table(["shape", *(name for name, _ in EP_TIMES)], rows)


def ep_capacity_table(ep):
    rows = [[SHAPES.get(r["shape"], (r["shape"],))[0], *(fmt(r["time_us"].get(key), 0) for _, key in EP_CAPACITY_TIMES)]
            for r in ep["results"]]
    return table(["shape", *(name for name, _ in EP_CAPACITY_TIMES)], rows)


def ep_beyond_table(ep):
    rows = [[SHAPES.get(r["shape"], (r["shape"],))[0], *(fmt(r.get("summary", {}).get(key)) for _, key in EP_BEYOND)]
            for r in ep["results"]]
    return table(["shape", *(name for name, _ in EP_BEYOND)], rows)


def ep_estimate_table(ep):
    """The paper estimate at EP=64, for shapes with at least one expert per rank."""
    rows = []
    for r in ep["results"]:
        est = r.get("ep64_estimate")
        if not est or r["E"] < 64:
            continue
        rows.append([SHAPES.get(r["shape"], (r["shape"],))[0], f"{est['bytes_per_rank'] / 1e9:.2f} GB",
                     f"{est['inter_node_bytes'] / 1e9:.2f} GB", f"{est['a2a_us'] / 1e3:.1f} ms",
                     f"{est['local_dispatch_us'] / 1e3:.2f} ms", f"{est['local_combine_us'] / 1e3:.2f} ms",
                     f"{100 * est['local_share_dispatch']:.1f}%"])
    return table(["shape", "bytes per rank", "to other nodes (56/64)", "all-to-all", "local dispatch",
                  "local combine", "local share of dispatch"], rows) if rows else ""


def layer_table(layer):
    """The expert layer, forward + backward (bench_layer.json): ms, ratios to the GEMMs on grouped
    rows, activation memory kept for the backward pass, the gather GEMM against torch._grouped_mm,
    and the FP8 expert_mlp (weights quantised once per step / in the call) with its lowest SQNR."""
    rows = []
    fp8 = all("layer_fp8" in r["time_us"] for r in layer["results"])
    for r in layer["results"]:
        t, kept = r["time_us"], r["activation_mib_kept_for_backward"]
        base = t["layer_grouped_rows"]
        rows.append([SHAPES.get(r["shape"], (r["shape"],))[0], *(f"{t[key] / 1e3:.2f}" for key in (
            "layer_grouped_rows", "layer_expert_mlp", "layer_fused", "layer_standalone", "layer_torch")),
            fmt(t["layer_expert_mlp"] / base), fmt(t["layer_fused"] / base),
            f"{kept['standalone'] / 1024:.2f} / {kept['fused'] / 1024:.2f}", fmt(t["gemm1_gather"] / t["gemm1_grouped_mm"])])
        if fp8:
            rows[-1] += [f"{t['layer_fp8'] / 1e3:.2f} / {t['layer_fp8_quantizing_weights'] / 1e3:.2f}",
                         f"{fmt(t['layer_fp8'] / t['layer_expert_mlp'])} / "
                         f"{fmt(t['layer_fp8_quantizing_weights'] / t['layer_expert_mlp'])}",
                         f"{min(r['fp8_sqnr_db'].values()):.1f}"]
    return table(["shape", "GEMMs on grouped rows", "expert_mlp", "save_memory=True", "permute + GEMMs + unpermute",
                  "PyTorch permutation", "expert_mlp / grouped", "save_memory / grouped",
                  "kept for backward, GiB (default / save_memory)", "gather GEMM / torch._grouped_mm"]
                 + (["FP8 expert_mlp (weights per step / per call)", "FP8 / bf16 expert_mlp",
                     "FP8 SQNR, lowest of output and gradients, dB"] if fp8 else []), rows)


MEGATRON_SHAPES = {**LARGE_SHAPES, "small": ("small", "H=1024, E=16, k=2")}


def megatron_table(mega):
    """megatron-core's dispatcher step: fused (permgen) / unfused, and permgen's own dispatch / combine."""
    rows = []
    for r in mega["results"]:
        paths, ratios = r.get("paths", {}), r.get("ratios", {})
        if "fused" not in paths or "unfused" not in paths:
            continue
        name, sizes = MEGATRON_SHAPES.get(r["shape"], (r["shape"], ""))
        rows.append([f"{name} ({sizes})", f"{r['N']:,}", fmt(paths["unfused"]["step_ms"]),
                     fmt(paths["fused"]["step_ms"]), fmt(paths.get("permgen_ep", {}).get("step_ms")),
                     fmt(ratios.get("fused_over_unfused")), fmt(ratios.get("ep_over_fused")),
                     f"{fmt(paths['unfused']['host_ms'])} / {fmt(paths['fused']['host_ms'])}"])
    head = run_line(mega["run"]) + "\n\n"
    return head + table(["shape", "N per rank", "unfused ms", "fused ms", "permgen ep ms", "fused / unfused",
                         "permgen ep / fused", "host ms, unfused / fused"], rows)


def host_calls_table(host):
    """Each public call's host time beside its launches at a bare Triton launch's cost (bench_host.py)."""
    rows = [[name, fmt(r["host_us"], 1), fmt(r["launches"]), fmt(r["host_reads"]), fmt(r.get("ratio"))]
            for name, r in host["calls"].items()]
    trip = host["round_trip"]
    shape = host["shape"]
    head = (f"{run_line(host['run'])}. N={shape['N']}, H={shape['H']}, E={shape['E']}, k={shape['k']}. "
            f"A bare Triton launch: {host['bare_triton_launch_us']} "
            f"us; one torch pointwise op: {host['one_torch_op_us']} us; torch's autograd through one op's backward: "
            f"{host.get('autograd_floor_us', '–')} us.\n\n")
    tail = (f"\n\nEager round trip (permute + unpermute): {trip['eager_us']} us; replayed from a CUDA graph: "
            f"{trip.get('graph_replay_us', '–')} us ({trip.get('ratio', '–')}x).")
    return head + table(["call", "host us", "launches", "host reads", "host / (launches x a bare launch)"],
                        rows) + tail


def span(values, digits=2, unit=""):
    """"lo-hi" of values as shown (one value where they round alike), with the unit."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def per_shape(rows, cell):
    """"value (shape), value (shape), ..." in the results' order."""
    return ", ".join(f"{cell(r)} ({SHAPES.get(r['shape'], (r['shape'],))[0]})" for r in rows)


def layer_figures(layer):
    large = [r for r in layer["results"] if r["N"] == 16384]
    small = [r for r in layer["results"] if r["N"] != 16384]
    t = lambda r, a, b: r["time_us"][a] / r["time_us"][b]  # noqa: E731
    figs = {
        "layer-default": span([t(r, "layer_expert_mlp", "layer_grouped_rows") for r in large], unit="x"),
        "layer-default-small": span([t(r, "layer_expert_mlp", "layer_grouped_rows") for r in small], unit="x"),
        "layer-vs-torch": span([t(r, "layer_torch", "layer_expert_mlp") for r in layer["results"]], unit="x"),
        "save-memory-gib": per_shape(large, lambda r: "{:.2f} GiB".format(
            (r["activation_mib_kept_for_backward"]["standalone"] - r["activation_mib_kept_for_backward"]["fused"]) / 1024)),
        "save-memory-time": per_shape(large, lambda r: f"{100 * (t(r, 'layer_fused', 'layer_expert_mlp') - 1):.1f}%"),
        "save-memory-time-small": span([100 * (t(r, "layer_fused", "layer_expert_mlp") - 1) for r in small], 1, "%"),
        "gather-gemm": span([t(r, "gemm1_gather", "gemm1_grouped_mm") for r in large], unit="x"),
        "gather-gemm-small": span([t(r, "gemm1_gather", "gemm1_grouped_mm") for r in small], unit="x"),
    }
    if all("layer_fp8" in r["time_us"] for r in layer["results"]):
        sqnr = lambda keys: [v for r in layer["results"] for k, v in r["fp8_sqnr_db"].items() if k in keys]  # noqa: E731
        figs.update({
            "fp8-over-bf16": span([t(r, "layer_fp8", "layer_expert_mlp") for r in large], unit="x"),
            "fp8-over-bf16-small": span([t(r, "layer_fp8", "layer_expert_mlp") for r in small], unit="x"),
            "fp8-quantize-weights": per_shape(large, lambda r: f"{r['time_us']['fp8_quantize_weights'] / 1e3:.1f} ms"),
            "fp8-per-call-over-bf16": per_shape(large, lambda r: f"{t(r, 'layer_fp8_quantizing_weights', 'layer_expert_mlp'):.2f}x"),
            "fp8-sqnr": span(sqnr({"y", "grad_x", "grad_probs", "grad_w1", "grad_w2"}), 1, " dB"),
            "fp8-sqnr-output": span(sqnr({"y"}), 1, " dB"),
            "fp8-sqnr-weights": span(sqnr({"grad_w1", "grad_w2"}), 1, " dB"),
        })
    return figs


def fp8_layer_table(layer):
    """The FP8 expert_mlp against the bf16 one, and its SQNR against bf16 (bench_layer.json)."""
    rows = []
    for r in layer["results"]:
        t, sq = r["time_us"], r["fp8_sqnr_db"]
        rows.append([f"{SHAPES.get(r['shape'], (r['shape'],))[0].split(',')[0]}, N={r['N']}, H={r['H']}, E={r['E']}, k={r['k']}, "
                     f"F={r['F']}", f"{t['layer_expert_mlp'] / 1e3:.2f}", f"{t['layer_fp8'] / 1e3:.2f}",
                     fmt(t["layer_fp8"] / t["layer_expert_mlp"]), fmt(t["fwd_fp8"] / t["fwd_expert_mlp"]),
                     ", ".join(f"{sq[k]:.1f}" for k in ("y", "grad_x", "grad_probs", "grad_w1", "grad_w2"))])
    return table(["shape", "bf16 expert_mlp, ms", "FP8 expert_mlp, ms", "FP8 / bf16", "forward alone, FP8 / bf16",
                  "SQNR dB: output, grad x, probs, w1, w2"], rows)


def megatron_figures(mega):
    speedups = [r["paths"]["unfused"]["step_ms"] / r["paths"]["fused"]["step_ms"] for r in mega["results"]
                if "fused" in r.get("paths", {}) and "unfused" in r["paths"]]
    return {"megatron-speedup": span(speedups, 1, "x")} if speedups else {}


def ep_figures(ep):
    figs = {"ep-dispatch-host": span([r["host_us"]["dispatch"] / 1e3 for r in ep["results"]], 2, " ms"),
            "ep-capacity-slack": span([r["capacity"] * r["world"] / (r["N"] * r["k"]) for r in ep["results"]], unit="x"),
            "ep-a2a-host": span([r["host_us"]["a2a"] for r in ep["results"]], 0, " us")}
    for r in ep["results"]:
        if r["shape"] == "mixtral":
            figs["ep-mixtral-host"] = f"{r['host_us']['dispatch']:.0f} of its {r['time_us']['dispatch']:.0f} us"
    return figs


def host_figures(host):
    ratios = [r["ratio"] for r in host["calls"].values() if r.get("ratio") is not None]
    return {"host-target": f"{host['call_target']}x",
            "host-within-target": f"{sum(r <= host['call_target'] for r in ratios)} of {len(ratios)}",
            "host-autograd-launches": f"{host['autograd_floor_us'] / host['bare_triton_launch_us']:.1f}"}


NKI_COST_COUNTS = (("instructions", "instructions"), ("indirect DMAs", "indirect_dmas"), ("DMA bytes", "dma_bytes"),
                   ("device-loop iterations", "device_loop_iterations"))


def nki_cost_table(rows):
    """Emulator counts per variant, topk hint and kernel (nki_cost.py)."""
    return table(["variant", "topk", "kernel", *(name for name, _ in NKI_COST_COUNTS)],
                 [[r["variant"], r["topk"].replace("-", "–"), r["kernel"], *(fmt(r[key]) for _, key in NKI_COST_COUNTS)]
                  for r in rows])


def nki_cost_key(r):
    return r["variant"], r["topk"], r["kernel"]


def nki_cost_tables(lnc1, lnc2):
    """LNC=1 whole, LNC=2 where it differs from LNC=1, and the figures the prose quotes."""
    tables = {}
    if lnc1:
        tables["nki-cost-lnc1"] = nki_cost_table(lnc1["results"])
        mask = next(r for r in lnc1["results"] if nki_cost_key(r) == ("probs_bf16_mask", "none", "permute"))
        tables["nki-mask-loop-iterations"] = f"{mask['device_loop_iterations']:,}"
    if lnc1 and lnc2:
        one = {nki_cost_key(r): r for r in lnc1["results"]}
        differ = [r for r in lnc2["results"] if any(r[key] != one[nki_cost_key(r)][key] for _, key in NKI_COST_COUNTS)]
        tables["nki-cost-lnc2"] = nki_cost_table(differ)
        two = {nki_cost_key(r): r for r in lnc2["results"]}
        a, b = one["probs_bf16_mask", "none", "sum_routes"], two["probs_bf16_mask", "none", "sum_routes"]
        tables["nki-lnc2-sum-routes"] = (f"sum_routes {a['instructions']:,} -> {b['instructions']:,} instructions, "
                                         f"{a['dma_bytes'] / 1e6:.0f} -> {b['dma_bytes'] / 1e6:.0f} MB")
    return tables


def nki_a2av_tables(a2av):
    rows = [[str(r["ep"]), r["generation"], r["exchange"], r["kernel"], fmt(r["instructions"]), fmt(r["indirect_dmas"]),
             fmt(r["dma_bytes"])] for r in a2av["results"]]
    tables = {"nki-a2av-cost": table(["EP", "generation", "exchange", "kernel", "instructions", "indirect DMAs",
                                      "DMA bytes"], rows)}
    by = {(r["ep"], r["exchange"], r["kernel"]): r for r in a2av["results"]}
    packed = [(ep, by[ep, "all_to_all", "permute_a2av"], r) for (ep, exchange, kernel), r in by.items()
              if exchange == "all_to_all_v_packed" and kernel == "permute_a2av"]
    if packed:
        ep, full, r = max(packed, key=lambda p: p[0])
        tables["nki-a2av-packed-ratio"] = f"{full['instructions'] / r['instructions']:.1f}x"
        tables["nki-a2av-packed-ep"] = f"EP={ep}"
    return tables


def render_all(results=RESULTS):
    """Table or figure name -> Markdown (absent where its results are absent)."""
    bench, quant, ep, layer = (load(results, name) for name in ("bench.json", "bench_quantize.json", "bench_ep.json",
                                                                  "bench_layer.json"))
    tables = {}
    if bench:
        tables.update({"variants": variants_table(bench),
                       "small-shapes": small_shapes_table(bench), "peers": peers_table(bench),
                       "readme-summary": readme_table(bench),
                       "bandwidth": bandwidth_table(bench), "round-trip": round_trip_table(bench),
                       "host-cost": host_cost_table(bench), "bookkeeping": bookkeeping_table(bench),
                       "chunk-sort": chunk_sort_table(bench), **bookkeeping_figures(bench)})
    if quant:
        tables["quantize"] = quantize_table(quant)
    if ep:
        tables.update({"ep-times": ep_times_table(ep), "ep-capacity": ep_capacity_table(ep),
                       "ep-beyond": ep_beyond_table(ep),
                       "ep-estimate": ep_estimate_table(ep)})
        tables.update(ep_figures(ep))
    if layer:
        tables.update({"layer": layer_table(layer), "fp8-layer": fp8_layer_table(layer), **layer_figures(layer)})
    mega, host = load(results, "bench_megatron.json"), load(results, "bench_host.json")
    if mega:
        tables.update({"megatron": megatron_table(mega), **megatron_figures(mega)})
    if host:
        tables.update({"host-calls": host_calls_table(host), **host_figures(host)})
    tables.update(nki_cost_tables(load(results, "nki_cost_lnc1.json"), load(results, "nki_cost_lnc2.json")))
    a2av = load(results, "nki_a2av_cost.json")
    if a2av:
        tables.update(nki_a2av_tables(a2av))
    tables["provenance"] = provenance_table(results)
    return tables


MARKED = re.compile(r"(<!-- table:([a-z0-9_-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)
FIGURE = re.compile(r"(<!-- fig:([a-z0-9_-]+) -->)([^\n]*?)(<!-- /fig -->)")


def rewrite(text, tables):
    """text with every marked table and figure replaced; the names of those that changed, and of the
    markers nothing renders (an unknown name, or results absent)."""
    changed, unknown = [], []

    def fill(match, block):
        name = match.group(2)
        if name not in tables:
            unknown.append(name)
            return match.group(0)
        body = tables[name] + ("\n" if block and tables[name] else "")
        if body != match.group(3):
            changed.append(name)
        return match.group(1) + body + match.group(4)

    text = MARKED.sub(lambda m: fill(m, True), text)
    return FIGURE.sub(lambda m: fill(m, False), text), changed, unknown


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file's tables or figures are not current")
    parser.add_argument("--print", action="store_true", help="print the tables and figures, write nothing")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
    args = parser.parse_args()
    tables = render_all(args.results)
    if args.print:
        for name, body in tables.items():
            print(f"{name}:\n{body}\n")
        return 0
    stale, errors = [], []
    for path in FILES:
        text = path.read_text()
        new, changed, unknown = rewrite(text, tables)
        errors += [f"{path.relative_to(ROOT)}: nothing renders {name!r}" for name in unknown]
        if changed and args.check:
            stale.append(f"{path.relative_to(ROOT)}: {', '.join(changed)}")
        elif changed:
            path.write_text(new)
            print(f"{path.relative_to(ROOT)}: rewrote {', '.join(changed)}")
    if stale:
        errors.append("out of date with benchmarks/results (run python3 benchmarks/tables.py):\n  " + "\n  ".join(stale))
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
