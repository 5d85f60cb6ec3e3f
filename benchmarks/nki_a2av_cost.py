"""What the NKI expert-parallel kernels cost, counted by the CPU emulator, on each Trainium generation.

permute_a2av (dispatch) and unpermute_a2av (combine) run on EP ranks of the emulator's multi-rank
driver; per kernel run the emulator counts the instructions issued (every nki.isa / nki.collectives
call), the indirect DMAs and the bytes that dma_copy moved (the collectives' own traffic is not
counted as DMA bytes). The table shows the busiest rank. Routing is uniform: every token picks k
distinct experts of E, spread evenly over the ranks; the receive capacity is twice the mean. Each
generation runs its default exchange (permgen.nki.a2av), and trn3 groups of whole devices (EP a
multiple of 4, at least 8) the packed exchange too, at the LNC the environment declares
(--lnc sets it; at LNC=2 a count is both cores' of the rank together).

    .venv/bin/python benchmarks/nki_a2av_cost.py [--ep 2,8 --tokens 512 --h 1024 --e 64 --k 8] [--lnc 1|2] [--out DIR]

Writes nki_a2av_cost.json into --out (default benchmarks/results; docs/trainium.md's table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ml_dtypes  # noqa: E402

from permgen.nki import emulator as nki_emulator  # noqa: E402

nki_emulator.install()

from permgen.nki.emulator import Platform, run_ranks  # noqa: E402
from permgen.nki.emulator.collectives import ReplicaGroup  # noqa: E402
from permgen.nki.a2av import exchange_for, permute_a2av, unpermute_a2av  # noqa: E402
from permgen.nki.host import logical_cores  # noqa: E402
from tables import run_metadata  # noqa: E402  (benchmarks/, this script's folder)


def rank_inputs(ep, tokens, hidden, experts, k, seed):
    """(routed rows [T*k, H] bf16, destination-major packing, send counts [1, EP], probs [T, k])."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :k]
    dest = (ids // (experts // ep)).reshape(-1)
    rows = rng.standard_normal((tokens * k, hidden)).astype(ml_dtypes.bfloat16)
    order = np.argsort(dest, kind="stable").astype(np.int32)
    counts = np.bincount(dest, minlength=ep).astype(np.int32)[None]
    probs = rng.random((tokens, k)).astype(np.float32)
    return rows, order, counts, probs


def measure(generation, ep, tokens, hidden, experts, k, exchange=None):
    group = ReplicaGroup([list(range(ep))])
    capacity = 2 * tokens * k
    inputs = [rank_inputs(ep, tokens, hidden, experts, k, seed) for seed in range(ep)]

    def rank(rows, order, counts, probs):
        with nki_emulator.recording() as runs:
            recv, _ = permute_a2av(rows, order, counts, capacity, group, generation=generation, exchange=exchange)
            unpermute_a2av(recv, order, counts, probs, group, generation=generation, exchange=exchange)
        return runs

    per_rank = run_ranks(rank, inputs, platform=Platform(generation))
    # Each rank ran the dispatch, then the combine: report the rank that moved the most bytes in each.
    busiest = [max((runs[i] for runs in per_rank), key=lambda cost: cost.dma_bytes) for i in range(2)]
    return exchange_for(group, generation, exchange, logical_cores()), busiest


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", default="2,8", help="comma-separated EP sizes")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    parser.add_argument("--h", type=int, default=1024)
    parser.add_argument("--e", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--lnc", choices=("1", "2"), help="the LNC to declare (default: the environment's)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where nki_a2av_cost.json goes")
    args = parser.parse_args()
    if args.lnc:
        os.environ["NEURON_LOGICAL_NC_CONFIG"] = args.lnc
    print(f"{args.tokens} tokens per rank, H={args.h}, E={args.e}, k={args.k}, bf16 rows, "
          f"capacity {2 * args.tokens * args.k} rows")
    print("| EP | generation | exchange | kernel | instructions | indirect DMAs | DMA bytes |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for ep in (int(x) for x in args.ep.split(",")):
        runs = [("trn2", None), ("trn3", None)]
        if ep % 4 == 0 and ep >= 8 and logical_cores() == 2:  # whole devices at LNC=2: receive displacements too
            runs.append(("trn3", "all_to_all_v_packed"))
        for generation, asked in runs:
            exchange, costs = measure(generation, ep, args.tokens, args.h, args.e, args.k, asked)
            for cost in costs:
                print(f"| {ep} | {generation} | {exchange} | {cost.kernel.removesuffix('_kernel')} | {cost.instructions:,} | "
                      f"{cost.indirect_dmas:,} | {cost.dma_bytes:,} |")
                rows.append(dict(ep=ep, generation=generation, exchange=exchange,
                                 kernel=cost.kernel.removesuffix("_kernel"), instructions=cost.instructions,
                                 indirect_dmas=cost.indirect_dmas, dma_bytes=cost.dma_bytes))
    run = dict(run=run_metadata(gpu="none: counted by permgen's NKI emulator"),
               shape=dict(tokens_per_rank=args.tokens, H=args.h, E=args.e, k=args.k, capacity=2 * args.tokens * args.k),
               lnc=logical_cores(), results=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nki_a2av_cost.json").write_text(json.dumps(run, indent=1) + "\n")


if __name__ == "__main__":
    main()
