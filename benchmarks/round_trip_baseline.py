"""The small round trip's eager host time, today's modules against an earlier checkout's, in one
process, alternating (the GPU machine's host speed drifts between and within processes).

    git archive 899ed6f benchmarks generated | tar -x -C /tmp/baseline
    PYTHONPATH=. python3 benchmarks/round_trip_baseline.py /tmp/baseline

The baseline's generated modules are imported as `generated.triton.<variant>` from the given folder
(the layout before the permgen package). Mask variants of the baseline are called with topk, the only
fast call they had; today's are timed both with and without it.
"""

import importlib
import sys

import bench


def main(baseline_dir, repeats=3):
    sys.path.insert(0, baseline_dir)
    N, H, E, k = 1024, 1024, 16, 2
    rows = []
    for vname in bench.VARIANTS:
        ours = bench.load(vname)
        theirs = importlib.import_module(f"generated.triton.{vname}")
        tokens, routing, probs, scale, _ = bench.make_inputs(ours, N, H, E, k)
        M, kw = bench.permute_kwargs(ours, N, E, k, rows=N * k)
        hint = dict(kw, topk=k) if ours.VARIANT["routing"] == "mask" else kw
        permuted = bench.torch.randn(M, H, device="cuda").to(bench.combine_dtype(ours.VARIANT))

        def round_trip(mod, kwargs):
            return lambda: mod.unpermute(permuted, mod.permute(tokens, routing, probs, scale, **kwargs).row_id_map,
                                         probs)

        calls = {"ours": round_trip(ours, kw), "ours_topk": round_trip(ours, hint), "baseline": round_trip(theirs, hint)}
        times = {name: [] for name in calls}
        for _ in range(repeats):
            for name, fn in calls.items():
                times[name].append(bench.host_us(fn))
        row = {name: round(min(t), 1) for name, t in times.items()}
        print(f"{vname:36s} eager round trip, us (best of {repeats} medians): {row}", flush=True)
        rows.append((vname, row))
    return rows


if __name__ == "__main__":
    main(sys.argv[1])
