"""What the benchmark scripts share: the command line of a timed run, host time per call, a CUDA
graph's capture, and the grouped bar chart they draw. Plain torch (and matplotlib where a chart is drawn): importing it
imports no permgen kernel."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def timed_run_parser(doc: str, iters: int, render_help: str) -> argparse.ArgumentParser:
    """--out (the results folder), --iters and --reps of the timing, --render-only (render_help says
    what it rewrites from the saved results); the script adds its own options."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--render-only", action="store_true", help=render_help)
    return parser


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, calls_per_block: int, blocks: int, warmup: int, fastest: bool = False) -> float:
    """Host time per call of fn, in us: `blocks` blocks of calls_per_block back-to-back calls after
    `warmup` calls, synchronised around each block (the device idle behind the calls); the median
    block, or with fastest the fastest."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(blocks):
        sync()
        start = time.perf_counter()
        for _ in range(calls_per_block):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls_per_block * 1e6)
    return min(times) if fastest else sorted(times)[blocks // 2]


def captured(fn, warmups: int = 1):
    """A CUDA graph of fn, captured after `warmups` calls on a side stream that the current stream
    then waits for (torch's warm-up before a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def grouped_bars(path, groups, series, ylabel: str, title: str, level=None, **xtick_options):
    """A bar chart saved to path: for each group (x labels), one bar of each series (label, one value
    per group) beside the others, in the order given; level: a horizontal line at that value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=label, color=f"C{i}")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], groups, fontsize=8, **xtick_options)
    if level is not None:
        ax.axhline(level, color="black", linewidth=0.6)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
