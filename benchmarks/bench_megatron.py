"""megatron-core's MoEAlltoAllTokenDispatcher in one training step: its fused permutation run by
permgen (moe_permute_fusion=True after permgen.integrations.megatron.enable()) against its unfused
PyTorch path (moe_permute_fusion=False), and permgen's own expert parallelism (permgen.ep dispatch /
combine, dropless) doing the same step.

    make bench-megatron      (part of make bench; skipped where megatron-core does not import)
    python3 -m torch.distributed.run --nproc-per-node <GPUs> benchmarks/bench_megatron.py --out benchmarks/results
    python3 benchmarks/bench_megatron.py --render-only      (bench_megatron.txt and .png from the JSON)
    TRITON_INTERPRET=1 python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_megatron.py --smoke

One rank per GPU over NCCL; the expert-parallel size is the world size (1 on one GPU, where
megatron-core skips its all-to-alls and permgen's dispatch / combine start no collective either). Each rank has N tokens [N, H] bf16 (requiring grad) routed top-k over E experts with random
router probs: megatron's routing_map [N, E] bool and probs [N, E] fp32 (requiring grad, zero off the
routes). One step:

- megatron (fused / unfused): dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> expert
  -> combine_preprocess -> token_combine -> combine_postprocess, the dispatcher's own calls;
- permgen ep: dispatch(tokens, routing_map, probs, topk=k) -> expert -> combine (the same inputs;
  permgen's bf16 mask-routing variant with probs);
- the expert is the same cheap op on every path, each row times its router prob (as megatron's
  experts apply it), so the figures are the dispatchers'; then the backward pass of the scalar loss
  sum(out * G), G a fixed random [N, H] bf16, entered as autograd.grad(out, (tokens, probs), G).

Sweep: N per rank in {512, 2048, 8192, 16384} at DeepSeek-V3 (H=7168, E=256, k=8), Qwen3-MoE
(H=2048, E=128, k=8), Mixtral (H=4096, E=8, k=2) and small (H=1024, E=16, k=2). Per point and path:

- step ms: the median over --reps repetitions of the mean step time of a block of back-to-back
  steps (sized to about --rep-seconds), each block between device synchronisations and a barrier;
  the slowest rank's. The paths' blocks are interleaved, so drift hits them alike.
- host ms: the CPU time of the two threads that issue one step, read from their thread CPU clocks
  (time.pthread_getcpuclockid): the Python thread (the forward pass, the collectives, the host
  reads) and autograd's device thread (which runs the backward pass of CUDA tensors), over one
  unsynchronised step started on an idle device; the median over --host-samples steps, the slowest
  rank's. It counts spin-waits at the step's own device-to-host reads, which then wait only for the
  routing work queued before them; other threads (NCCL's, the driver's, OpenMP's) are left out.
  Where host ms is near step ms, the host bounds the step.

Before any timing, fused and unfused (and permgen ep) run the same step on small points, one with an
expert that gets no tokens: dispatched rows, their probs, tokens per expert and the probs' grads
bit for bit; the combined output and the tokens' grads (sums of k bf16 rows, in a different order
per path) within bf16 tolerances. A mismatch stops the run before anything is timed. A point that
fails (out of memory, say) is recorded with its error and the sweep goes on.

Writes bench_megatron.json (raw numbers, device and versions), bench_megatron.txt (a table rendered
from the JSON) and bench_megatron.png (matplotlib) into --out, the JSON after every point.
--smoke runs the same script on tiny shapes with CPU tensors over gloo under the Triton
interpreter (any number of ranks), with CPU stand-ins for the CUDA stream calls megatron's
dispatcher makes (cpu_stand_ins): it checks the script and the paths' agreement, not the speed, and
writes into a temporary folder unless --out is given.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

if "--smoke" in sys.argv:  # the Triton interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import permgen  # noqa: E402
from tables import fmt, run_metadata, table  # noqa: E402

# megatron-core warns on import that TransformerEngine and Apex are missing: that is the setting here.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

SHAPES = [("deepseek_v3", 7168, 256, 8), ("qwen3_moe", 2048, 128, 8), ("mixtral", 4096, 8, 2),
          ("small", 1024, 16, 2)]  # name, H, E, k
TOKENS = [512, 2048, 8192, 16384]  # N per rank
LABELS = {"deepseek_v3": "DeepSeek-V3 (H=7168, E=256, k=8)", "qwen3_moe": "Qwen3-MoE (H=2048, E=128, k=8)",
          "mixtral": "Mixtral (H=4096, E=8, k=2)", "small": "small (H=1024, E=16, k=2)"}
# Checked before timing: many experts (several chunks per rank) and few; each with an empty expert.
CHECKS = [("check_many_experts", 512, 1024, 256, 8), ("check_few_experts", 512, 1024, 16, 2)]  # name, N, H, E, k
SMOKE_SHAPES = [("smoke_many", 32, 16, 4), ("smoke_few", 48, 4, 2)]
SMOKE_TOKENS = [8, 24]
SMOKE_CHECKS = [("smoke_check_many", 24, 32, 16, 4), ("smoke_check_few", 16, 48, 4, 2)]
PATHS = ("unfused", "fused", "permgen_ep")
PATH_LABELS = {"unfused": "megatron unfused", "fused": "megatron fused (permgen)", "permgen_ep": "permgen ep"}
VARIANT = dict(dtype="bf16", routing="mask", probs=True)  # megatron's inputs as they are: a [N, E] mask, [N, E] probs
# Sums of k bf16 rows added in another order (permgen adds in fp32, megatron's scatter_add in bf16).
SUM_TOL = dict(rtol=1.6e-2, atol=3e-2)
RESULT = "bench_megatron"

DEVICE = "cuda"  # "cpu" with --smoke


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def slowest(values, group):
    """Each value's maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def agree(failed, group):
    """True on every rank when any rank failed, so all take the same branch (no rank left waiting in
    a collective the others skipped)."""
    return slowest([1.0 if failed else 0.0], group)[0] > 0


# --- megatron-core ---------------------------------------------------------------------------------

class _HostStream:
    """What megatron-core's all-to-all dispatcher asks of its CUDA device-to-host stream, for CPU
    tensors (--smoke only): the counts it copies are on the host already, so its waits and events
    have nothing to wait for."""

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass


def cpu_stand_ins(token_dispatcher):
    """--smoke runs megatron-core's dispatcher on CPU tensors: its constructor makes a
    torch.cuda.Stream() (a class attribute, made once) and each dispatch enters torch.cuda.stream()
    on it and compares it with torch.cuda.current_stream(); its all-to-all allocates on
    torch.cuda.current_device() (more than one rank). CPU stand-ins for those calls; none of them
    moves data."""
    stream = _HostStream()
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    torch.cuda.current_stream = lambda device=None: stream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    # It hands its split sizes to the all-to-all as the numpy arrays of their device-to-host copy,
    # which it makes only of CUDA tensors; CPU tensors get the same conversion here.
    move = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_host(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host


def megatron_setup(world, smoke):
    """(token_dispatcher module, process groups, whether the fused path runs permgen, megatron version).
    megatron-core's dispatcher takes its groups from a ProcessGroupCollection: here the one its
    parallel_state builds, expert-parallel size = world size."""
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import token_dispatcher

    import permgen.integrations.megatron as integration

    # Before any TransformerConfig(moe_permute_fusion=True): its check wants the fused functions bound.
    # False where TransformerEngine is installed: then the fused path is TE's and this run says so.
    runs_permgen = integration.enable() or integration.enabled()
    if smoke:
        cpu_stand_ins(token_dispatcher)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    return token_dispatcher, groups, runs_permgen, getattr(megatron.core, "__version__", "?")


def megatron_dispatcher(token_dispatcher, groups, fused, H, E, k, rank, world, smoke):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
                               moe_router_topk=k, moe_token_dispatcher_type="alltoall",
                               moe_permute_fusion=fused, expert_model_parallel_size=world, bf16=True,
                               params_dtype=torch.bfloat16)
    local = E // world
    experts = list(range(rank * local, (rank + 1) * local))
    if smoke and fused:
        # With fusion on, the constructor puts its two chunk-order index tensors on
        # torch.device("cuda"); built with it off they are the same tensors on the CPU, and fusion
        # is read at every call after that.
        config.moe_permute_fusion = False
        dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher(local, experts, config, pg_collection=groups)
        config.moe_permute_fusion = True
        return dispatcher
    return token_dispatcher.MoEAlltoAllTokenDispatcher(local, experts, config, pg_collection=groups)


def te_probe_us(calls=200):
    """Host time of the TransformerEngine version check that megatron-core's fused unpermute makes
    on every call in releases that have it (without TE it tries `import transformer_engine` each
    time): part of the fused path's host time, whatever runs the kernels. None where unpermute
    makes no such check."""
    import inspect

    from megatron.core.transformer.moe import moe_utils
    if "is_te_min_version" not in inspect.getsource(moe_utils.unpermute):
        return None
    moe_utils.is_te_min_version("2.12.0")
    start = time.perf_counter()
    for _ in range(calls):
        moe_utils.is_te_min_version("2.12.0")
    return round((time.perf_counter() - start) / calls * 1e6, 1)


# --- the step ----------------------------------------------------------------------------------------

def expert(rows, row_probs):
    """The same cheap expert on every path: each row times its router prob."""
    return rows * row_probs[:, None].to(rows.dtype)


def megatron_step(dispatcher):
    def step(x, mask, p, g):
        rows, row_probs = dispatcher.dispatch_preprocess(x, mask, p)
        rows, row_probs = dispatcher.token_dispatch(rows, row_probs)
        rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(rows, row_probs)
        out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(
            expert(rows, row_probs))))
        return dict(out=out, rows=rows, row_probs=row_probs, tokens_per_expert=tokens_per_expert,
                    grads=torch.autograd.grad(out, (x, p), g))
    return step


def ep_step(mod, group, k):
    def step(x, mask, p, g):
        res = mod.dispatch(x, mask, p, group=group, topk=k)
        out = mod.combine(expert(res.tokens, res.probs), res.handle)
        return dict(out=out, rows=res.tokens, row_probs=res.probs, tokens_per_expert=res.tokens_per_expert,
                    grads=torch.autograd.grad(out, (x, p), g))
    return step


def make_inputs(N, H, E, k, rank, empty_expert=False):
    """tokens [N, H] bf16 and probs [N, E] fp32 (both requiring grad), routing_map [N, E] bool, G."""
    g = torch.Generator(device=DEVICE).manual_seed(1234 + rank)
    tokens = torch.randn(N, H, device=DEVICE, generator=g).to(torch.bfloat16).requires_grad_()
    logits = torch.randn(N, E, device=DEVICE, generator=g)
    if empty_expert:
        logits[:, E - 1] = -math.inf  # no token routes there: an empty chunk on the owning rank
    top, ids = logits.softmax(-1).topk(k, dim=-1)
    mask = torch.zeros(N, E, dtype=torch.bool, device=DEVICE).scatter_(1, ids, True)
    probs = torch.zeros(N, E, device=DEVICE).scatter_(1, ids, top).requires_grad_()
    grad_out = torch.randn(N, H, device=DEVICE, generator=g).to(torch.bfloat16)
    return tokens, mask, probs, grad_out


def build_paths(megatron, mod, group, H, E, k, rank, world, smoke):
    token_dispatcher, groups = megatron["module"], megatron["groups"]
    return {"unfused": megatron_step(megatron_dispatcher(token_dispatcher, groups, False, H, E, k, rank, world, smoke)),
            "fused": megatron_step(megatron_dispatcher(token_dispatcher, groups, True, H, E, k, rank, world, smoke)),
            "permgen_ep": ep_step(mod, group, k)}


# --- the check before timing -------------------------------------------------------------------------

def compare(got, want):
    """(exact, max abs difference) of two results' tensors, on the host."""
    got, want = torch.as_tensor(got).detach().cpu(), torch.as_tensor(want).detach().cpu()
    if got.shape != want.shape:
        return False, math.inf
    exact = torch.equal(got, want) if got.dtype == want.dtype else torch.equal(got.double(), want.double())
    diff = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    return exact, diff


def check_point(paths, inputs):
    """Every path's step against the unfused path's on the same inputs: fields -> (ok, max diff)."""
    ref = paths["unfused"](*inputs)
    report = {}
    for name in ("fused", "permgen_ep"):
        got = paths[name](*inputs)
        fields = {}
        for field, a, b in (("rows", got["rows"], ref["rows"]), ("row_probs", got["row_probs"], ref["row_probs"]),
                            ("tokens_per_expert", got["tokens_per_expert"], ref["tokens_per_expert"]),
                            ("prob_grads", got["grads"][1], ref["grads"][1])):
            exact, diff = compare(a, b)
            fields[field] = dict(ok=exact, exact=exact, max_abs_diff=diff)
        for field, a, b in (("out", got["out"], ref["out"]), ("token_grads", got["grads"][0], ref["grads"][0])):
            exact, diff = compare(a, b)
            ok = a.shape == b.shape and a.dtype == b.dtype and bool(torch.allclose(
                a.float().cpu(), b.float().cpu(), **SUM_TOL))
            fields[field] = dict(ok=ok, exact=exact, max_abs_diff=diff)
        report[name] = fields
    return report


def run_checks(checks, megatron, mod, group, rank, world, smoke):
    results, failed = [], False
    for name, N, H, E, k in checks:
        try:
            paths = build_paths(megatron, mod, group, H, E, k, rank, world, smoke)
            report = check_point(paths, make_inputs(N, H, E, k, rank, empty_expert=True))
            bad = [f"{path}.{field}" for path, fields in report.items() for field, r in fields.items() if not r["ok"]]
        except Exception as exc:  # noqa: BLE001 - a path that raises is as wrong as one that disagrees
            traceback.print_exc()
            report, bad = {}, [f"raised {error_text(exc)}"]
        paths = None
        # Every rank's verdict, so all ranks stop together.
        failed |= agree(bool(bad), group)
        results.append(dict(name=name, N=N, H=H, E=E, k=k, rank=rank, mismatches=bad, fields=report))
        if bad:
            print(f"rank {rank}: CHECK FAILED at {name} (N={N} H={H} E={E} k={k}): {', '.join(bad)}\n"
                  + json.dumps(report, indent=1), flush=True)
        free()
    return results, failed


# --- timing --------------------------------------------------------------------------------------------

def block(step, inputs, iters, group):
    """Mean ms per step over `iters` back-to-back steps between synchronisations."""
    sync()
    dist.barrier(group)
    start = time.perf_counter()
    for _ in range(iters):
        step(*inputs)
    sync()
    return (time.perf_counter() - start) / iters * 1e3


class HostClock:
    """CPU seconds of the threads that issue a step: this one, and the thread autograd runs a device's
    backward pass on (on a GPU not this one; found by a hook that runs there). Falls back to the
    whole process's CPU time where per-thread clocks are missing."""

    def __init__(self):
        seen = [threading.get_ident()]
        x = torch.zeros(1, device=DEVICE, requires_grad=True)
        y = x * 2
        y.register_hook(lambda grad: seen.append(threading.get_ident()))
        y.sum().backward()
        try:
            self.clocks = [time.pthread_getcpuclockid(t) for t in dict.fromkeys(seen)]
            self.kind = ("CPU clocks of the Python thread" + (" and autograd's device thread" if len(self.clocks) > 1
                                                              else " (which runs the backward pass too)"))
        except (AttributeError, OSError):
            self.clocks, self.kind = None, "time.process_time() (per-thread clocks unavailable)"

    def now(self):
        if self.clocks is None:
            return time.process_time()
        return sum(time.clock_gettime(c) for c in self.clocks)


def host_sample(step, inputs, group, clock):
    """(CPU ms, ms until it returned) of one unsynchronised step started on an idle device."""
    sync()
    dist.barrier(group)
    cpu, wall = clock.now(), time.perf_counter()
    result = step(*inputs)
    cpu, wall = clock.now() - cpu, time.perf_counter() - wall
    del result
    sync()
    return cpu * 1e3, wall * 1e3


def median(values):
    values, middle = sorted(values), len(values) // 2
    return values[middle] if len(values) % 2 else 0.5 * (values[middle - 1] + values[middle])


def error_text(exc):
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def free():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def time_point(paths, inputs, group, args):
    """path -> its figures, or {"error": ...} for a path that failed (every rank drops it together)."""
    out = {name: {} for name in paths}
    live = dict(paths)

    def attempt(name, fn):
        """fn() for path `name`; on any rank's failure the path is dropped everywhere."""
        try:
            value, err = fn(), None
        except Exception as exc:  # noqa: BLE001 - out of memory and the like: record it, go on
            value, err = None, error_text(exc)
            traceback.print_exc()  # the JSON keeps one line of it
        if agree(err is not None, group):
            out[name] = {"error": err or "failed on another rank"}
            live.pop(name, None)
            free()
            return None
        return value

    iters = {}
    for name, step in list(live.items()):
        if DEVICE == "cpu":  # the interpreter has nothing to warm up, and its times mean nothing
            iters[name] = 1
            continue

        def warm(step=step):
            for _ in range(2):  # the first step compiles the Triton kernels for this shape
                step(*inputs)
            return block(step, inputs, 1, group)  # one step's time, to size the timed blocks
        estimate = attempt(name, warm)
        if estimate is not None:
            estimate = slowest([estimate], group)[0]
            iters[name] = max(1, min(args.max_iters, round(args.rep_seconds * 1e3 / estimate)))
    samples = {name: [] for name in live}
    for _ in range(args.reps):  # interleaved: rep r of every path, then rep r + 1
        for name, step in list(live.items()):
            ms = attempt(name, lambda step=step, name=name: block(step, inputs, iters[name], group))
            if ms is not None:
                samples[name].append(ms)
    host = {name: [] for name in live}
    for _ in range(args.host_samples):
        for name, step in list(live.items()):
            sample = attempt(name, lambda step=step: host_sample(step, inputs, group, args.clock))
            if sample is not None:
                host[name].append(sample)
    for name in list(live):
        step_ms = slowest(samples[name], group)
        host_ms = slowest([s[0] for s in host[name]], group)
        return_ms = slowest([s[1] for s in host[name]], group)
        out[name] = dict(step_ms=round(median(step_ms), 4), host_ms=round(median(host_ms), 4),
                         return_ms=round(median(return_ms), 4), iters=iters[name],
                         step_ms_samples=[round(x, 4) for x in step_ms],
                         host_ms_samples=[round(x, 4) for x in host_ms])
    return out


def run_point(name, N, H, E, k, megatron, mod, group, rank, world, args):
    point = dict(shape=name, N=N, H=H, E=E, k=k)
    paths = inputs = None
    try:
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        inputs = make_inputs(N, H, E, k, rank)
        paths = build_paths(megatron, mod, group, H, E, k, rank, world, args.smoke)
        failed = False
    except Exception as exc:  # noqa: BLE001
        failed, point["error"] = True, error_text(exc)
    if agree(failed, group):
        point.setdefault("error", "failed on another rank")
    else:
        point["paths"] = time_point(paths, inputs, group, args)
        if DEVICE == "cuda":
            point["peak_gib"] = round(slowest([torch.cuda.max_memory_allocated() / 2**30], group)[0], 2)
    del paths, inputs
    free()
    return point


# --- results ---------------------------------------------------------------------------------------------

def ratios(point):
    """fused / unfused and permgen ep / fused step times, where both were measured."""
    p = point.get("paths", {})

    def ms(name):
        return p.get(name, {}).get("step_ms")

    out = {}
    if ms("fused") and ms("unfused"):
        out["fused_over_unfused"] = round(ms("fused") / ms("unfused"), 3)
    if ms("permgen_ep") and ms("fused"):
        out["ep_over_fused"] = round(ms("permgen_ep") / ms("fused"), 3)
    return out


def report(run):
    meta, prov = run["meta"], run["run"]
    lines = [f"megatron-core MoEAlltoAllTokenDispatcher, one training step (dispatch -> expert -> combine -> "
             f"backward), {meta['world']} x {prov['gpu']}, {meta['backend']}, expert-parallel size {meta['world']}",
             f"megatron-core {prov['megatron_core']}, torch {prov['torch']}, Triton {prov['triton']}, Python "
             f"{prov['python']}, permgen {prov['commit'] or '?'}; fused path run by "
             f"{'permgen' if meta['fused_runs_permgen'] else 'TransformerEngine'}; permgen ep: {meta['ep_variant']}, "
             f"dropless, topk=k",
             f"`{prov['command']}`", ""]
    checks = run.get("checks", [])
    if checks:
        bad = [c for c in checks if c["mismatches"]]
        lines.append("checked before timing (rows, probs, tokens per expert, prob grads bit for bit; output and "
                     "token grads within bf16 tolerance), against unfused: "
                     + ("; ".join(f"{c['name']} failed: {', '.join(c['mismatches'])}" for c in bad) if bad else
                        "fused and permgen ep agree at " + ", ".join(
                            f"N={c['N']} H={c['H']} E={c['E']} k={c['k']}" for c in checks if c.get("rank", 0) == 0)))
        lines.append("")
    if meta["world"] == 1:
        lines.append("One rank: megatron-core skips its all-to-alls; permgen's dispatch / combine start no "
                     "collective either.")
    lines.append("ms per step (median, slowest rank); host: CPU ms of the threads issuing one step (Python's and "
                 "autograd's)")
    lines.append("")
    rows, worst, shown = [], None, set()
    for point in run["results"]:
        name = LABELS.get(point["shape"], point["shape"])
        label = "" if name in shown else name  # each shape named once
        shown.add(name)
        if "error" in point:
            rows.append([label, fmt(point["N"]), f"failed: {point['error']}", "", "", "", "", ""])
            continue
        p, r = point["paths"], ratios(point)

        def cell(path, key="step_ms"):
            return fmt(p[path][key]) if key in p.get(path, {}) else "failed"

        rows.append([label, fmt(point["N"]), cell("unfused"), cell("fused"), cell("permgen_ep"),
                     fmt(r.get("fused_over_unfused")), fmt(r.get("ep_over_fused")),
                     " / ".join(cell(path, "host_ms") for path in PATHS)])
        if "fused_over_unfused" in r and (worst is None or r["fused_over_unfused"] > worst[0]):
            worst = (r["fused_over_unfused"], name, point["N"])
    lines.append(table(["shape", "N per rank", "unfused ms", "fused ms", "permgen ep ms", "fused / unfused",
                        "permgen ep / fused", "host ms: unfused / fused / ep"], rows))
    errors = [f"{LABELS.get(pt['shape'], pt['shape'])} N={pt['N']} {name}: {p['error']}"
              for pt in run["results"] for name, p in pt.get("paths", {}).items()
              if isinstance(p, dict) and "error" in p]
    if errors:
        lines += ["", "failed:"] + [f"  {e}" for e in errors]
    measured = [ratios(pt)["fused_over_unfused"] for pt in run["results"] if "fused_over_unfused" in ratios(pt)]
    if measured:
        lines += ["", f"fused / unfused <= 1.0 at {sum(x <= 1.0 for x in measured)} of {len(measured)} points; "
                      f"highest {worst[0]:.3f} ({worst[1]}, N={worst[2]})"]
    if meta.get("te_probe_us") is not None:
        lines.append(f"megatron-core's fused unpermute checks TransformerEngine's version on every call (without TE: "
                     f"a failed import): {meta['te_probe_us']} us of host time per step on this host, in the fused "
                     f"figures")
    return "\n".join(lines) + "\n"


def plot(run, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, prov = run["meta"], run["run"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    shapes = list(dict.fromkeys(pt["shape"] for pt in run["results"]))
    for i, shape in enumerate(shapes):
        pts = [pt for pt in run["results"] if pt["shape"] == shape and "paths" in pt]
        r = [(pt["N"], ratios(pt).get("fused_over_unfused")) for pt in pts]
        r = [(n, x) for n, x in r if x is not None]
        if r:
            left.plot(*zip(*r), "o-", color=f"C{i}", label=LABELS.get(shape, shape))
        for name, style in (("fused", "-"), ("unfused", "--"), ("permgen_ep", ":")):
            h = [(pt["N"], pt["paths"][name]["host_ms"]) for pt in pts if "host_ms" in pt["paths"].get(name, {})]
            if h:  # the colours are the left panel's shapes
                right.plot(*zip(*h), style, marker=".", color=f"C{i}")
    left.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    tokens = sorted({pt["N"] for pt in run["results"]})
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens, [str(n) for n in tokens])
        ax.minorticks_off()
        ax.set_xlabel("N tokens per rank")
    left.set_ylabel("fused / unfused step time")
    left.set_title("megatron-core fused (permgen) / unfused, one training step", fontsize=10)
    left.legend(fontsize=8)
    right.set_yscale("log")
    right.set_ylabel("host CPU ms per step")
    right.set_title("host CPU time per step (solid: fused, dashed: unfused, dotted: permgen ep)", fontsize=10)
    fig.suptitle(f"MoEAlltoAllTokenDispatcher on {meta['world']} x {prov['gpu']}, megatron-core "
                 f"{prov['megatron_core']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(out):
    """bench_megatron.txt and .png (with matplotlib) from bench_megatron.json in `out`, the ratios
    recomputed: (the text, the files written)."""
    run = json.loads((out / f"{RESULT}.json").read_text())
    for point in run["results"]:
        point["ratios"] = ratios(point)
    text = report(run)
    (out / f"{RESULT}.txt").write_text(text)
    written = [out / f"{RESULT}.txt"]
    try:
        plot(run, out / f"{RESULT}.png")
        written.append(out / f"{RESULT}.png")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return text, written


def save(out, run):
    for point in run["results"]:
        point["ratios"] = ratios(point)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{RESULT}.json").write_text(json.dumps(run, indent=1))


# --- main -------------------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default benchmarks/results; with --smoke a temporary folder)")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="N per rank, comma-separated")
    parser.add_argument("--reps", type=int, default=7, help="timed blocks per point and path (the median is kept)")
    parser.add_argument("--rep-seconds", type=float, default=0.2, help="about how long one timed block runs")
    parser.add_argument("--max-iters", type=int, default=50, help="most steps in one timed block")
    parser.add_argument("--host-samples", type=int, default=7, help="unsynchronised steps timed for host ms")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, CPU tensors over gloo under the Triton interpreter (no GPU needed)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite bench_megatron.txt and .png from --out/bench_megatron.json (no GPU needed)")
    args = parser.parse_args()
    if args.out is None:
        args.out = (Path(tempfile.gettempdir()) / "permgen_bench_megatron_smoke" if args.smoke
                    else ROOT / "benchmarks" / "results")
    if args.render_only:
        text, written = render(args.out)
        print(text + "wrote " + ", ".join(map(str, written)))
        return 0
    try:
        importlib.import_module("megatron.core")
    except ImportError as exc:
        print(f"bench_megatron: megatron-core does not import ({exc}; pip install --no-deps megatron-core): skipped",
              file=sys.stderr)
        return 0

    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
        args.reps, args.host_samples = 1, 1
    # Under torchrun the launcher sets these; run plainly, it is one rank.
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29517")):
        os.environ.setdefault(key, value)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if DEVICE == "cpu":
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    shapes = SMOKE_SHAPES if args.smoke else [s for s in SHAPES if s[0] in args.shapes.split(",")]
    tokens = SMOKE_TOKENS if args.smoke else [int(n) for n in args.tokens.split(",")]
    for name, H, E, k in shapes:
        if E % world:
            raise SystemExit(f"{name}: E={E} experts do not split over {world} ranks")

    args.clock = HostClock()
    module, groups, runs_permgen, megatron_version = megatron_setup(world, args.smoke)
    megatron = dict(module=module, groups=groups)
    mod = permgen.get_kernel("triton", **VARIANT)
    provenance = run_metadata(gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke run: not a speed)")
    provenance["megatron_core"] = provenance["megatron_core"] or megatron_version  # a source tree has no metadata
    meta = dict(world=world, backend=dist.get_backend(),
                nccl=".".join(map(str, torch.cuda.nccl.version())) if DEVICE == "cuda" else None,
                fused_runs_permgen=bool(runs_permgen), ep_variant=mod.VARIANT["name"], te_probe_us=te_probe_us(),
                reps=args.reps, rep_seconds=args.rep_seconds, host_samples=args.host_samples,
                host_ms=f"{args.clock.kind}, over one unsynchronised step started on an idle device")
    if rank == 0 and not runs_permgen:
        print("TransformerEngine is installed: megatron-core's fused path runs TE, not permgen", flush=True)

    checks, failed = run_checks(SMOKE_CHECKS if args.smoke else CHECKS, megatron, mod, group, rank, world, args.smoke)
    run = dict(run=provenance, meta=meta, checks=checks, results=[])
    if failed:
        if rank == 0:
            save(args.out, run)
            render(args.out)
            print(f"the paths disagree: nothing timed (details in {args.out / (RESULT + '.json')})",
                  file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 1
    if rank == 0:
        print(f"checks passed: {', '.join(c['name'] for c in checks)}", flush=True)
    for name, H, E, k in shapes:
        for N in tokens:
            start = time.perf_counter()
            point = run_point(name, N, H, E, k, megatron, mod, group, rank, world, args)
            point["seconds"] = round(time.perf_counter() - start, 1)
            run["results"].append(point)
            if rank == 0:
                save(args.out, run)  # after every point: a run cut short keeps what it measured
                p = point.get("paths", {})
                print(f"{name} N={N}: " + (point.get("error") or "  ".join(
                    f"{n} {p[n]['step_ms']:.3f} ms (host {p[n]['host_ms']:.3f})" if "step_ms" in p.get(n, {})
                    else f"{n} failed" for n in PATHS)) + f"  [{point['seconds']} s]", flush=True)
    if rank == 0:
        save(args.out, run)
        text, written = render(args.out)
        print("\n" + text + "wrote " + ", ".join(map(str, [args.out / f"{RESULT}.json", *written])), flush=True)
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
