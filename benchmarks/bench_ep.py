"""Expert-parallel dispatch and combine (permgen.ep) over NCCL on every GPU of the machine (one
rank per GPU: world size 1 on one GPU), against a bare all_to_all_single of the same bytes, the
single-GPU permute / unpermute of the same rows and the PyTorch-native composition.

    make bench-ep     (torchrun --nproc-per-node <GPUs> benchmarks/bench_ep.py --out benchmarks/results)
    python3 benchmarks/bench_ep.py --out benchmarks/results      (spawns one rank per GPU)

Per shape (N tokens per rank, uniform top-k routing over E experts, E / world per rank), each rank
times, with CUDA events, the mean of `--iters` calls between barriers; a cell is the slowest
rank's time (median over `--reps` repetitions):

- a2a:            all_to_all_single of the routed rows with the dispatch's split sizes (bytes only)
- dispatch:       permgen dispatch, dropless (routing counts, count exchange, its one host read,
                  permute, all-to-all of rows and probs, regroup where there is one); also in
                  fixed-capacity mode, and both backward passes (through autograd)
                  (with one rank dispatch and combine start no collective: "beyond the all-to-all"
                  is then their whole time)
- combine:        permgen combine (regroup back, all-to-all, unpermute with merging probs)
- torch dispatch: argsort permute + bincount + count all-to-all + .tolist() + all_to_all_single +
                  torch.split / torch.cat regroup by (source, local expert)
- torch combine:  the reverse split / cat, all_to_all_single, weighted index_add
- permute / unpermute (and their backward passes): permgen's single-GPU ops on the same N tokens
                  over all E experts (the rows one rank moves), for the targets "time beyond the
                  all-to-all <= the single-GPU pass"
- regroup:        the chunk sort dispatch runs on a receiver of 8 ranks ((source, expert) ->
                  (expert, source)), on the same rows: at world size 1 dispatch has none to run
- copy:           a device-to-device copy of the same rows (the copy floor of the regroup)

Writes bench_ep.json, bench_ep.txt and bench_ep.png (with matplotlib) into --out. `--cpu-smoke`
runs the same script on tiny shapes over gloo under the Triton interpreter (no GPU): it checks the
script, not the speed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import permgen  # noqa: E402
from common import captured, grouped_bars, timed_run_parser  # noqa: E402  (benchmarks/, this script's folder)
from tables import run_metadata  # noqa: E402

SHAPES = [("deepseek_v3", 16384, 7168, 256, 8), ("qwen3_moe", 16384, 2048, 128, 8),
          ("mixtral", 16384, 4096, 8, 2)]  # name, N, H, E, k
SMOKE_SHAPES = [("smoke", 48, 40, 8, 2)]  # --cpu-smoke: the script's own logic, checked without GPUs
VARIANT = dict(dtype="bf16", routing="index", probs=True)
CAPACITY_SLACK = 1.25  # recv_capacity = this x the mean rows per rank pair


DEVICE = "cuda"  # "cpu" with --cpu-smoke: tiny shapes over gloo under the Triton interpreter


def timed(fn, group, iters, reps):
    """(time, host time) per call in us, each the slowest rank's mean over `iters` calls, median over
    reps. The host time is how long the calls took to return: where it is near the time, the host
    bounds the op, not the GPU."""
    for _ in range(1 if DEVICE == "cpu" else 3):
        fn()
    samples = []
    for _ in range(reps):
        dist.barrier(group)
        if DEVICE == "cpu":
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed_us = host_us = (time.perf_counter() - start) / iters * 1e6
        else:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            host_start = time.perf_counter()
            for _ in range(iters):
                fn()
            host_us = (time.perf_counter() - host_start) / iters * 1e6
            end.record()
            torch.cuda.synchronize()
            elapsed_us = start.elapsed_time(end) / iters * 1e3
        t = torch.tensor([elapsed_us, host_us], device=DEVICE)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        samples.append(t.tolist())
    middle = len(samples) // 2
    return sorted(x[0] for x in samples)[middle], sorted(x[1] for x in samples)[middle]


def torch_dispatch(tokens, ids, probs, num_experts, group, world):
    """The PyTorch-native composition (a non-fused Megatron all-to-all dispatcher)."""
    local = num_experts // world
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    permuted = tokens.index_select(0, order // ids.shape[1])
    permuted_probs = probs.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat, minlength=num_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    both = torch.cat([counts.view(world, local).sum(1), recv_counts.view(world, local).sum(1), recv_counts]).tolist()
    send, recv, chunk_sizes = both[:world], both[world:2 * world], both[2 * world:]
    received = tokens.new_empty((sum(recv), tokens.shape[1]))
    dist.all_to_all_single(received, permuted, recv, send, group=group)
    received_probs = probs.new_empty(sum(recv))
    dist.all_to_all_single(received_probs, permuted_probs, recv, send, group=group)
    chunks = torch.split(received, chunk_sizes)  # (source, local expert)
    prob_chunks = torch.split(received_probs, chunk_sizes)
    expert_major = [s * local + e for e in range(local) for s in range(world)]
    out = torch.cat([chunks[i] for i in expert_major])
    out_probs = torch.cat([prob_chunks[i] for i in expert_major])
    return out, out_probs, (order, send, recv, chunk_sizes, expert_major, ids.shape)


def torch_combine(expert_out, state, merging_probs, group, world):
    order, send, recv, chunk_sizes, expert_major, (num_tokens, k) = state
    sizes = [chunk_sizes[i] for i in expert_major]
    pieces = torch.split(expert_out, sizes)
    back = [None] * len(pieces)
    for piece, i in zip(pieces, expert_major):
        back[i] = piece
    source_major = torch.cat(back)
    returned = expert_out.new_empty((sum(send), expert_out.shape[1]))
    dist.all_to_all_single(returned, source_major, send, recv, group=group)
    weights = merging_probs.reshape(-1).index_select(0, order).to(returned.dtype)
    out = torch.zeros((num_tokens, expert_out.shape[1]), dtype=expert_out.dtype, device=expert_out.device)
    return out.index_add_(0, order // k, returned * weights[:, None])


def regroup_table(mod, counts, sources):
    """The chunk table of a regroup from (source, expert) to (expert, source) order over `sources`
    sources, each expert's rows split evenly between them: what dispatch's regroup does on a
    receiver of that many ranks (at world size 1 it has nothing to do)."""
    E = counts.shape[0]
    part = counts[None, :] // sources
    sizes = part.repeat(sources, 1)
    sizes[-1] += counts - part.sum(0)  # [source, expert]
    order = (torch.arange(sources, device=counts.device)[None, :] * E
             + torch.arange(E, device=counts.device)[:, None]).flatten()
    return mod._ops.chunk_sort.kernels.chunk_table(sizes.flatten(), order)


def run_shape(name, N, H, E, k, mod, group, rank, world, iters, reps):
    g = torch.Generator(device=DEVICE).manual_seed(1234 + rank)
    tokens = torch.randn(N, H, device=DEVICE, generator=g).to(torch.bfloat16)
    logits = torch.randn(N, E, device=DEVICE, generator=g)
    top, ids = logits.softmax(-1).topk(k, dim=-1)
    ids = ids.to(torch.int32)
    probs = top.contiguous()
    local = E // world
    rows = {}

    res = mod.dispatch(tokens, ids, probs, group=group, num_experts=E)
    h = res.handle
    send, recv = h.send_splits, h.recv_splits
    rows["sent"], rows["received"] = sum(send), sum(recv)
    rows["sent_remote"] = sum(s for d, s in enumerate(send) if d != rank)
    row_bytes = H * tokens.element_size()
    send_buf = torch.empty((sum(send), H), dtype=tokens.dtype, device=DEVICE)
    recv_buf = torch.empty((sum(recv), H), dtype=tokens.dtype, device=DEVICE)
    expert_out = torch.randn(res.tokens.shape, device=DEVICE, generator=g).to(torch.bfloat16)
    grad_experts = torch.randn(res.tokens.shape, device=DEVICE, generator=g).to(torch.bfloat16)
    grad_tokens_out = torch.randn(N, H, device=DEVICE, generator=g).to(torch.bfloat16)
    capacity = int(CAPACITY_SLACK * N * k / world)
    cap_res = mod.dispatch(tokens, ids, probs, group=group, num_experts=E, recv_capacity=capacity)
    cap_out = torch.randn(cap_res.tokens.shape, device=DEVICE, generator=g).to(torch.bfloat16)
    nat_out, nat_probs, nat_state = torch_dispatch(tokens, ids, probs, E, group, world)
    assert torch.equal(nat_out, res.tokens) and torch.equal(nat_probs, res.probs), "PyTorch dispatch disagrees"
    ours, theirs = mod.combine(expert_out, h, probs).float(), torch_combine(expert_out, nat_state, probs, group,
                                                                             world).float()
    assert torch.allclose(ours, theirs, rtol=2e-2, atol=2e-2 * float(ours.abs().max())), "PyTorch combine disagrees"
    single = mod.permute(tokens, ids, probs, num_experts=E, num_out_tokens=N * k)
    single_out = torch.randn(single.tokens.shape, device=DEVICE, generator=g).to(torch.bfloat16)
    # Capacity mode's rows on one GPU: permute capped at the rows a capacity dispatch moves (its
    # kept rows, then zero rows), and unpermute over that map.
    single_cap = mod.permute(tokens, ids, probs, num_experts=E, num_out_tokens=world * capacity)
    single_cap_out = torch.randn(single_cap.tokens.shape, device=DEVICE, generator=g).to(torch.bfloat16)
    grad_single = torch.randn(single.tokens.shape, device=DEVICE, generator=g).to(torch.bfloat16)
    sort_table = regroup_table(mod, res.tokens_per_expert, 8)
    copy_src = res.tokens.clone()
    copy_dst = torch.empty_like(copy_src)

    # The backward passes through autograd, their graphs kept (retain_graph) and rerun.
    t_in, p_in = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    d = mod.dispatch(t_in, ids, p_in, group=group, num_experts=E)
    e_in, m_in = expert_out.clone().requires_grad_(), probs.clone().requires_grad_()
    c = mod.combine(e_in, h, m_in)
    sp = mod.permute(t_in, ids, p_in, num_experts=E, num_out_tokens=N * k)
    u_in = single_out.clone().requires_grad_()
    su = mod.unpermute(u_in, single.row_id_map, m_in)

    cap_send = torch.empty((world * capacity, H), dtype=tokens.dtype, device=DEVICE)
    cap_recv = torch.empty_like(cap_send)

    def bare_a2a():
        dist.all_to_all_single(recv_buf, send_buf, recv, send, group=group)

    def bare_a2a_capacity():  # capacity mode's bytes: C rows per rank pair
        dist.all_to_all_single(cap_recv, cap_send, group=group)

    ops = {
        "a2a": bare_a2a,
        "a2a_capacity": bare_a2a_capacity,
        "dispatch": lambda: mod.dispatch(tokens, ids, probs, group=group, num_experts=E),
        "dispatch_capacity": lambda: mod.dispatch(tokens, ids, probs, group=group, num_experts=E,
                                                  recv_capacity=capacity),
        "combine": lambda: mod.combine(expert_out, h, probs),
        "combine_capacity": lambda: mod.combine(cap_out, cap_res.handle, probs),
        "dispatch_backward": lambda: torch.autograd.grad([d.tokens, d.probs], [t_in, p_in],
                                                         [grad_experts, nat_probs], retain_graph=True),
        "combine_backward": lambda: torch.autograd.grad(c, [e_in, m_in], grad_tokens_out, retain_graph=True),
        "torch_dispatch": lambda: torch_dispatch(tokens, ids, probs, E, group, world),
        "torch_combine": lambda: torch_combine(expert_out, nat_state, probs, group, world),
        "permute": lambda: mod.permute(tokens, ids, probs, num_experts=E, num_out_tokens=N * k),
        "unpermute": lambda: mod.unpermute(single_out, single.row_id_map, probs),
        "permute_capacity": lambda: mod.permute(tokens, ids, probs, num_experts=E, num_out_tokens=world * capacity),
        "unpermute_capacity": lambda: mod.unpermute(single_cap_out, single_cap.row_id_map, probs),
        "permute_backward": lambda: torch.autograd.grad([sp.tokens, sp.probs], [t_in, p_in],
                                                        [grad_single, single.probs], retain_graph=True),
        "unpermute_backward": lambda: torch.autograd.grad(su, [u_in, m_in], grad_tokens_out, retain_graph=True),
        "regroup_8_sources": lambda: mod._ops.chunk_sort.kernels.sort_chunks(sort_table, False, res.tokens, res.probs),
        "copy": lambda: copy_dst.copy_(copy_src),
    }
    # Capacity mode as CUDA-graph users run it, no host in the loop. (Not set against the graph's bare
    # all-to-all: at world size 1 NCCL's replayed all-to-all of large buffers ran up to 1.5x slower
    # than its eager call, while the replayed dispatch was not, so that difference means nothing.)
    if DEVICE == "cuda":
        for op in ("a2a_capacity", "dispatch_capacity", "combine_capacity"):
            ops[f"{op}_graph"] = captured(ops[op]).replay
    timings = {op: timed(fn, group, iters, reps) for op, fn in ops.items()}
    dropped = int(cap_res.handle.dropped.sum())
    dist.all_reduce(t := torch.tensor([dropped], device=DEVICE), group=group)
    return dict(shape=name, N=N, H=H, E=E, k=k, local_experts=local, capacity=capacity,
                capacity_dropped_rows=int(t.item()), rows=rows, row_bytes=row_bytes,
                a2a_bytes_per_rank=rows["sent"] * row_bytes, remote_bytes_per_rank=rows["sent_remote"] * row_bytes,
                time_us={op: round(t_, 1) for op, (t_, _) in timings.items()},
                host_us={op: round(h, 1) for op, (_, h) in timings.items()})


def summarise(r):
    t = r["time_us"]
    # Each against the bare all-to-all of its own bytes (capacity mode sends C rows per rank pair).
    single = dict(dispatch="permute", combine="unpermute", dispatch_capacity="permute_capacity",
                  combine_capacity="unpermute_capacity", dispatch_backward="permute_backward",
                  combine_backward="unpermute_backward")
    # With one rank dispatch and combine exchange nothing (the rows would be copied to themselves): all
    # of their time is beyond the all-to-all.
    beyond = {op: t[op] - (0.0 if r["world"] == 1 else t["a2a_capacity" if op.endswith("capacity") else "a2a"])
              for op in ("dispatch", "combine", "dispatch_capacity", "combine_capacity", "dispatch_backward",
                         "combine_backward")}
    out = {f"{op}_beyond_a2a_us": round(b, 1) for op, b in beyond.items()}
    out.update({f"{op}_beyond_over_{single[op]}": round(b / t[single[op]], 2) for op, b in beyond.items()})
    out.update(speedup_dispatch_vs_torch=round(t["torch_dispatch"] / t["dispatch"], 2),
               speedup_combine_vs_torch=round(t["torch_combine"] / t["combine"], 2),
               a2a_GBps_per_rank=round(r["a2a_bytes_per_rank"] / t["a2a"] / 1e3, 1),
               regroup_over_copy=round(t["regroup_8_sources"] / t["copy"], 2))
    return out


def estimate_ep64(r, gbps_inter=45.0, gbps_intra=350.0):
    """Paper estimate of the same layer at EP = 64 over 8 nodes of 8 GPUs: each rank sends its N * k
    routed rows spread uniformly over 64 ranks, 7/64 inside its node (NVLink, gbps_intra GB/s per
    GPU) and 56/64 to other nodes (gbps_inter GB/s per GPU: one 400 Gb/s NIC each). The local
    work is what this run measured beyond the all-to-all, plus, where this run had nothing to
    regroup (one rank) and EP = 64 has (E / 64 > 1 local experts), the measured regroup pass."""
    total = r["a2a_bytes_per_rank"]
    inter, intra = total * 56 / 64, total * 7 / 64
    a2a_us = max(inter / (gbps_inter * 1e3), intra / (gbps_intra * 1e3))
    s, t = summarise(r), r["time_us"]
    regroup = t["regroup_8_sources"] if r["world"] == 1 and r["E"] // 64 > 1 else 0.0
    local_dispatch = s["dispatch_beyond_a2a_us"] + regroup
    local_combine = s["combine_beyond_a2a_us"] + regroup
    return dict(bytes_per_rank=total, inter_node_bytes=int(inter), a2a_us=round(a2a_us, 1),
                local_dispatch_us=round(local_dispatch, 1), local_combine_us=round(local_combine, 1),
                dispatch_us=round(a2a_us + local_dispatch, 1), combine_us=round(a2a_us + local_combine, 1),
                local_share_dispatch=round(local_dispatch / (a2a_us + local_dispatch), 3))


COLUMNS = [("a2a", "a2a"), ("a2a_capacity", "a2a cap"), ("dispatch", "dispatch"), ("dispatch_capacity", "disp cap"),
           ("combine", "combine"),
           ("combine_capacity", "comb cap"), ("dispatch_backward", "disp bwd"), ("combine_backward", "comb bwd"),
           ("torch_dispatch", "torch disp"), ("torch_combine", "torch comb"), ("permute", "permute"),
           ("unpermute", "unpermute"), ("permute_capacity", "perm cap"), ("unpermute_capacity", "unperm cap"),
           ("permute_backward", "perm bwd"), ("unpermute_backward", "unperm bwd"),
           ("regroup_8_sources", "regroup"), ("copy", "copy")]


def report(results, gpu, world, backend):
    lines = [f"permgen expert parallelism, {world} x {gpu}, {backend}, variant {results[0]['variant']}",
             ""]
    lines.append("times in us (slowest rank, median):")
    lines.append(" | ".join(f"{h:>10}" for h in ["shape"] + [c[1] for c in COLUMNS]))
    for r in results:
        t = r["time_us"]
        lines.append(" | ".join([f"{r['shape']:>10}"] + [f"{t[k]:>10.1f}" for k, _ in COLUMNS]))
    lines.append("")
    for r in results:
        s, e = summarise(r), estimate_ep64(r)
        lines.append(f"{r['shape']}: rows sent {r['rows']['sent']} ({r['a2a_bytes_per_rank'] / 1e9:.2f} GB, "
                     f"{r['remote_bytes_per_rank'] / 1e9:.2f} GB to other ranks), a2a {s['a2a_GBps_per_rank']} GB/s; "
                     f"capacity {r['capacity']} rows per pair dropped {r['capacity_dropped_rows']} rows")
        lines.append("  beyond the a2a, as a multiple of the single-GPU pass (targets <= 1): "
                     + ", ".join(f"{op} {s[f'{op}_beyond_a2a_us']} us = {s[f'{op}_beyond_over_{ref}']}x {ref}"
                                 for op, ref in (("dispatch", "permute"), ("combine", "unpermute"),
                                                 ("dispatch_capacity", "permute_capacity"),
                                                 ("combine_capacity", "unpermute_capacity"),
                                                 ("dispatch_backward", "permute_backward"),
                                                 ("combine_backward", "unpermute_backward"))))
        if "host_us" in r:  # an op whose host time is near its time is the host's
            lines.append("  host time per call, us (time): " + ", ".join(
                f"{op} {r['host_us'][op]} ({r['time_us'][op]})" for op in
                ("dispatch", "dispatch_capacity", "combine", "dispatch_backward", "permute", "a2a")))
        lines.append(f"  vs PyTorch composition: dispatch {s['speedup_dispatch_vs_torch']}x, combine "
                     f"{s['speedup_combine_vs_torch']}x; regroup of 8 sources' rows {s['regroup_over_copy']}x the copy")
        lines.append(f"  EP=64 over 8 nodes (paper): a2a {e['a2a_us']} us, local dispatch {e['local_dispatch_us']} us, "
                     f"combine {e['local_combine_us']} us; dispatch {e['dispatch_us']} us, "
                     f"combine {e['combine_us']} us; local work {100 * e['local_share_dispatch']:.1f}% of dispatch")
    return "\n".join(lines) + "\n"


def plot(results, path, gpu, world):
    ops = ["a2a", "dispatch", "dispatch_capacity", "torch_dispatch", "permute", "combine", "combine_capacity",
           "torch_combine", "unpermute"]
    grouped_bars(path, ops, [(r["shape"], [r["time_us"][op] / 1e3 for op in ops]) for r in results],
                 "ms (slowest rank, median)",
                 f"permgen dispatch / combine on {world} x {gpu} (NCCL), N=16384 tokens per rank", rotation=20,
                 ha="right")


def render(out):
    """The summaries and bench_ep.txt of a run, recomputed from its measured times in bench_ep.json."""
    path = out / "bench_ep.json"
    run = json.loads(path.read_text())
    for r in run["results"]:
        r["summary"], r["ep64_estimate"] = summarise(r), estimate_ep64(r)
    path.write_text(json.dumps(run, indent=1))
    meta = run["meta"]
    (out / "bench_ep.txt").write_text(report(run["results"], run["run"]["gpu"], meta["world"], meta.get("backend", "nccl")))


def main(rank=None, world=None, args=None):
    if args is None:
        parser = timed_run_parser(__doc__, 10, "recompute the summaries and bench_ep.txt from --out/bench_ep.json "
                                               "(no GPU needed)")
        parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
        parser.add_argument("--cpu-smoke", action="store_true",
                            help="tiny shapes on the CPU over gloo under the Triton interpreter (no GPU needed)")
        args = parser.parse_args()
        if args.render_only:
            render(args.out)
            return
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    if rank is None and "RANK" not in os.environ:  # not under torchrun: spawn the ranks here
        import torch.multiprocessing as mp
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        world = 2 if args.cpu_smoke else torch.cuda.device_count()
        mp.start_processes(main, args=(world, args), nprocs=world, start_method="spawn")
        return
    if rank is None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if DEVICE == "cpu":
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    mod = permgen.get_kernel("triton", **VARIANT)
    results = []
    for name, N, H, E, k in SMOKE_SHAPES if DEVICE == "cpu" else SHAPES:
        if DEVICE != "cpu" and name not in args.shapes.split(","):
            continue
        r = run_shape(name, N, H, E, k, mod, group, rank, world, args.iters, args.reps)
        r["variant"], r["world"] = mod.VARIANT["name"], world
        r["summary"], r["ep64_estimate"] = summarise(r), estimate_ep64(r)
        results.append(r)
        if rank == 0:
            print(json.dumps(r), flush=True)
    if rank == 0:
        gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke run)"
        args.out.mkdir(parents=True, exist_ok=True)
        meta = dict(world=world, backend=dist.get_backend(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if DEVICE == "cuda" else None)
        run = dict(run=run_metadata(gpu=gpu), meta=meta, results=results)
        (args.out / "bench_ep.json").write_text(json.dumps(run, indent=1))
        text = report(results, gpu, world, dist.get_backend())
        (args.out / "bench_ep.txt").write_text(text)
        print(text, flush=True)
        try:
            plot(results, args.out / "bench_ep.png", gpu, world)
        except ImportError:
            print("matplotlib not installed: no plot")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
