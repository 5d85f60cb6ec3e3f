"""Where a dispatch's host time goes, on one GPU over NCCL (world size 1): each step of
permgen.ep timed on the host (inclusive, us per call, 100 calls) in both modes, beside the host
cost of the collectives alone. Explains the bench_ep figures that the host bounds.

    python3 benchmarks/ep_host_time.py --out benchmarks/results     (writes ep_host_time.txt)
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import permgen  # noqa: E402
from permgen import ep  # noqa: E402

SHAPES = [("qwen3_moe", 16384, 2048, 128, 8), ("mixtral", 16384, 4096, 8, 2)]  # name, N, H, E, k
STEPS = ["run_dispatch", "check_permute", "_check_group", "_plan", "_dropless_plan", "_capacity_plan",
         "_exchange_counts", "_start_read", "_finish_read", "_dispatch_rows", "_exchange_rows"]

spent, calls = collections.defaultdict(float), collections.Counter()


def timed(owner, name, label):
    """Replace owner.name by a wrapper adding its inclusive host time to spent[label]."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, wrapper)


def host_us(fn, n=200):
    """Mean host time of fn's call, the GPU idle before each."""
    for _ in range(10):
        fn()
    total = 0.0
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return total / n * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29517",
                            device_id=torch.device("cuda:0"))
    group = dist.group.WORLD
    mod = permgen.get_kernel("triton", dtype="bf16", routing="index", probs=True)
    for name in STEPS:
        timed(ep, name, name)
    timed(dist, "all_to_all_single", "all_to_all_single (each)")
    timed(type(mod._ops.backend), "permute", "permute's launches (with the count exchange)")
    lines = [f"permgen dispatch host time, {torch.cuda.get_device_name()}, NCCL world size 1, probs_bf16_index",
             "us per dispatch call: a step's time summed over its calls in one dispatch (\"2 per call\": both), and including the steps it calls", ""]
    for shape, N, H, E, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(1)
        tokens = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
        probs, ids = torch.randn(N, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
        ids = ids.to(torch.int32)
        rows = torch.empty((N * k, H), dtype=torch.bfloat16, device="cuda")
        rows_out = torch.empty_like(rows)
        counts = torch.zeros(E + 1, dtype=torch.int64, device="cuda")
        alone = {
            "all_to_all_single of the rows, buffers reused": lambda: dist.all_to_all_single(
                rows_out, rows, [N * k], [N * k], group=group),
            "all_to_all_single of the rows, output allocated per call": lambda: dist.all_to_all_single(
                torch.empty_like(rows), rows, [N * k], [N * k], group=group),
            "all_to_all_single of the counts": lambda: dist.all_to_all_single(torch.empty_like(counts), counts,
                                                                             group=group),
            "permute (single GPU)": lambda: mod.permute(tokens, ids, probs, num_experts=E, num_out_tokens=N * k),
        }
        lines.append(f"{shape}: N={N} H={H} E={E} k={k}")
        for label, fn in alone.items():
            lines.append(f"    {label:60s} {host_us(fn):8.1f}")
        for mode, kwargs in (("dropless", {}), ("capacity", dict(recv_capacity=int(1.25 * N * k)))):
            fn = functools.partial(mod.dispatch, tokens, ids, probs, group=group, num_experts=E, **kwargs)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            spent.clear()
            calls.clear()
            n = 100
            start = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / n * 1e6
            lines.append(f"  dispatch, {mode}: {wall:.1f} us per call back to back")
            for label, seconds in sorted(spent.items(), key=lambda x: -x[1]):
                lines.append(f"    {label:60s} {seconds / n * 1e6:8.1f}  ({calls[label] // n} per call)")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ep_host_time.txt").write_text(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
