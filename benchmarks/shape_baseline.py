"""GPU times of a few shapes, today's checkout against an earlier one's, each in its own processes,
alternating (one process's figures of a launch-bound op vary by a few tenths of a us).

    git archive 899ed6f benchmarks generated | tar -x -C /tmp/baseline
    python3 benchmarks/shape_baseline.py /tmp/baseline [--runs 3] [--shapes small deepseek_v3_4k]

Each process runs its own checkout's `bench.run_shape` (CUDA-graph times); the table gives each
op's median over the runs. The baseline's mask variants are matched with today's `topk` call (the
only fast call they had), its index variants with today's plain call.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(shapes):
    """Run in a checkout's root: its own bench.py times the shapes; one JSON line per op."""
    sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
    import bench

    copy_bw = bench.copy_bandwidth()
    results = []
    for shape in bench.SHAPES:
        if shape[0] in shapes:
            bench.run_shape(*shape, bench.VARIANTS, copy_bw, results)
    for r in results:
        call = r.get("call") or ("topk" if r["variant"].endswith("_mask") else "plain")
        print("RESULT", json.dumps([r["shape"], r["variant"], call, r["op"], r["graph_time_us"]]), flush=True)


def run(checkout, shapes):
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *shapes], cwd=checkout, env=env,
                         capture_output=True, text=True, check=True).stdout
    return [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("baseline", nargs="?", type=lambda p: Path(p).resolve())
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shapes", nargs="*", default=["small", "deepseek_v3_4k"])
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    times = {"baseline": {}, "ours": {}}
    for _ in range(args.runs):
        for name, checkout in (("baseline", args.baseline), ("ours", ROOT)):
            for *key, us in run(checkout, args.shapes):
                times[name].setdefault(tuple(key), []).append(us)
    for key, base in sorted(times["baseline"].items()):
        ours = times["ours"].get(key)
        if ours:
            b, o = statistics.median(base), statistics.median(ours)
            print(f"{key[0]:15s} {key[1]:36s} {key[2]:5s} {key[3]:14s} baseline {b:8.2f} us  ours {o:8.2f} us "
                  f"({o / b:.3f})  runs {[round(t, 2) for t in base]} / {[round(t, 2) for t in ours]}")


if __name__ == "__main__":
    main()
