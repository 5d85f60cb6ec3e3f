"""GPU times of the small shape's ops, today's modules against an earlier checkout's, in one
process: the two CUDA graphs of an op are replayed in turn, round after round, on the same inputs.

    git archive 899ed6f benchmarks generated | tar -x -C /tmp/baseline
    PYTHONPATH=. python3 benchmarks/interleaved_baseline.py /tmp/baseline [--rounds 21] [--control] \
        [--variants probs_bf16_mask ...] [--ops permute_bwd ...] [--processes 1]

Launch-bound figures (~6-10 us at N=1024) move by a few tenths of a us between processes, so
shape_baseline.py's medians over processes resolve 2% poorly; here both sides share a process,
each with its own copy of the same inputs. --processes repeats each child process, which draws new
addresses, and prints each run and the median ratio over them. --control times today's modules against themselves:
what placement in memory alone does to a figure. Each (variant, op) runs in a child process of its own: with
several backward graphs in one process the baseline's modules (899ed6f) hit an illegal memory
access, which --control did not. The baseline's modules are imported as `generated.triton.<variant>`
from the given folder (the layout before the permgen package); its mask variants are called with
topk (its only fast call), and so are today's here.
"""

import argparse
import importlib
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import triton

import bench

N, H, E, k = 1024, 1024, 16, 2
OPS = ("unpermute", "permute_bwd", "unpermute_bwd")


def graphs(mod, x):
    """op -> a function capturing a CUDA graph of it for one module, on inputs x (as bench.run_variant times it)."""
    kw = dict(num_experts=E, num_out_tokens=x["M"], **({"topk": k} if mod.VARIANT["routing"] == "mask" else {}))
    res = mod.permute(x["tokens"], x["routing"], x["probs"], x["scale"], **kw)
    permute_backward, unpermute_backward = bench.backward_passes(
        mod, x["tokens"], x["routing"], x["probs"], x["scale"], kw, x["permuted"], res.row_id_map,
        (x["grad_rows"], x["grad_row_probs"], x["grad_out"]))
    return {"unpermute": lambda: bench.captured(lambda: mod.unpermute(x["permuted"], res.row_id_map, x["probs"])),
            "permute_bwd": lambda: bench.captured_backward(permute_backward),
            "unpermute_bwd": lambda: bench.captured_backward(unpermute_backward)}


def inputs(mod):
    """The op's inputs, drawn from fixed seeds: each side gets equal values at its own addresses."""
    tokens, routing, probs, scale, _ = bench.make_inputs(mod, N, H, E, k)
    M = bench.permute_kwargs(mod, N, E, k)[0]
    cdt = bench.combine_dtype(mod.VARIANT)
    gen = torch.Generator(device="cuda").manual_seed(1)
    return dict(tokens=tokens, routing=routing, probs=probs, scale=scale, M=M,
                permuted=torch.randn(M, H, device="cuda", generator=gen).to(cdt),
                grad_rows=torch.randn(M, H, device="cuda", generator=gen).to(cdt),
                grad_row_probs=torch.randn(M, device="cuda", generator=gen),
                grad_out=torch.randn(N, H, device="cuda", generator=gen).to(cdt))


def child(baseline, vname, op, rounds, control):
    ours = bench.load(vname)
    if control:
        theirs = ours
    else:
        sys.path.insert(0, baseline)
        theirs = importlib.import_module(f"generated.triton.{vname}")
    pair = graphs(theirs, inputs(ours))[op](), graphs(ours, inputs(ours))[op]()
    times = ([], [])
    for _ in range(rounds):
        for graph, out in zip(pair, times):
            out.append(triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median") * 1e3)
    print("RESULT", *(f"{statistics.median(t):.3f}" for t in times), *(f"{min(t):.3f}" for t in times), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("baseline", type=lambda p: str(Path(p).resolve()))
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--control", action="store_true", help="today's modules against themselves")
    parser.add_argument("--variants", nargs="+", default=bench.VARIANTS, choices=bench.VARIANTS)
    parser.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    parser.add_argument("--processes", type=int, default=1, help="child processes per (variant, op)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.baseline, *args.child, args.rounds, args.control)
        return
    print(f"{'variant':36s} {'op':14s} {'control' if args.control else 'baseline':>9s} {'ours':>7s} ratio   (minima)")
    for vname in args.variants:
        for op in args.ops:
            cmd = [sys.executable, __file__, args.baseline, "--rounds", str(args.rounds), "--child", vname, op]
            ratios = []
            for _ in range(args.processes):
                child_run = subprocess.run(cmd + (["--control"] if args.control else []), capture_output=True, text=True)
                if child_run.returncode:
                    sys.exit(f"{vname} {op}: the child process failed:\n{child_run.stderr[-4000:]}")
                base, ours, base_min, ours_min = map(float, child_run.stdout.split("RESULT")[-1].split())
                ratios.append(ours / base)
                print(f"{vname:36s} {op:14s} {base:9.2f} {ours:7.2f} {ours / base:.3f}   ({base_min:.2f} / {ours_min:.2f})",
                      flush=True)
            if args.processes > 1:
                print(f"{vname:36s} {op:14s} median ratio over {args.processes} processes: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
