"""What the NKI kernels cost, counted by the CPU emulator: instructions, indirect DMAs, DMA bytes.

For the bf16 mask and index variants (probs_bf16_mask, probs_bf16_index) at N=4096, H=4096, E=64,
k=8 by default, every kernel of a training step runs once in the emulator (nki_emulator), which
counts per kernel run the instructions issued (every nki.isa / nki.collectives call, as executed:
a device loop's body once per iteration), the indirect (gather/scatter) DMAs, the bytes DMAs moved
(lanes an indirect DMA skips move nothing) and the iterations of device loops (nl.fori_loop; what an
iteration costs beyond its instructions no page says). Mask routing runs without and with the topk hint. Kernels launch
at the LNC the environment declares (NEURON_LOGICAL_NC_CONFIG, unset: 2, the Trn2 default; --lnc
sets it); at LNC=2 a count is both cores' together.

    .venv/bin/python benchmarks/nki_cost.py [--n 4096 --h 4096 --e 64 --k 8] [--lnc 1|2] [--root REPO] [--out DIR]

Writes nki_cost_lnc<LNC>.json into --out (default benchmarks/results; docs/trainium.md's tables).

--root counts the generated modules of another checkout (e.g. a `git worktree` of an older
commit, whose modules had NumPy host functions); the emulator is always this one. Counting needs
the data movement to run: at the default size a variant takes about a minute on one CPU core.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from permgen.nki import emulator as nki_emulator  # noqa: E402
from tables import run_metadata  # noqa: E402  (benchmarks/, this script's folder)

nki_emulator.install()

VARIANTS = ("probs_bf16_mask", "probs_bf16_index")


def load_module(root: Path, name: str):
    path = root / "generated" / "nki" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_nki_cost_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(routing_kind, n, h, e, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(n, h, generator=g).to(torch.bfloat16)
    ids = torch.argsort(torch.rand(n, e, generator=g), dim=1)[:, :k]
    if routing_kind == "mask":
        routing = torch.zeros(n, e, dtype=torch.bool).scatter_(1, ids, True)
    else:
        routing = ids.to(torch.int32)
    probs = torch.rand(routing.shape, generator=g)
    return tokens, routing, probs


def _np(t):
    from permgen.nki.host import to_kernel
    return to_kernel(t)


def run_torch_api(mod, tokens, routing, probs, e, k, topk):
    """The current modules: permute through the public function, the rest through the backend's kernels."""
    import nki

    backend = mod._ops.backend
    n, h = tokens.shape
    cap = n * k
    name = mod.VARIANT["name"]
    width = topk or (e if mod.VARIANT["routing"] == "mask" else k)
    kernel_routing = (routing != 0).int() if mod.VARIANT["routing"] == "mask" else routing
    from permgen.nki.host import logical_cores

    nki.simulate(backend.kernels.expert_counts[logical_cores()])(_np(kernel_routing), num_experts=e, width=width)
    res = mod.permute(tokens, routing, probs, num_experts=e, num_out_tokens=cap, topk=topk)
    rows = torch.randn(cap, h).to(torch.bfloat16)
    row_id_map = res.row_id_map
    mod.unpermute(rows, row_id_map, probs)
    mod.unpermute(rows, row_id_map)
    backend.permute_backward(row_id_map, rows, torch.randn(cap), (probs.shape, probs.dtype))
    grad_out = torch.randn(n, h).to(torch.bfloat16)
    backend.unpermute_backward(row_id_map, grad_out, rows, probs)
    backend.unpermute_backward(row_id_map, grad_out, None, None)
    return name


def run_numpy_api(mod, tokens, routing, probs, e, k):
    """Modules of the NumPy-host generation (before permgen.nki.host)."""
    n, h = tokens.shape
    cap = n * k
    name = mod.VARIANT["name"]
    routing_np = routing.numpy()
    kernel_routing = (routing_np != 0).astype(np.int32) if mod.VARIANT["routing"] == "mask" else routing_np.astype(np.int32)
    mod._expert_counts(kernel_routing, e)
    res = mod.permute(_np(tokens), routing_np, probs.numpy(), num_experts=e, num_out_tokens=cap)
    rows = _np(torch.randn(cap, h).to(torch.bfloat16))
    mod.unpermute(rows, res.row_id_map, probs.numpy())
    mod.unpermute(rows, res.row_id_map)
    mod.permute_backward(rows, res.row_id_map, torch.randn(cap).numpy())
    grad_out = _np(torch.randn(n, h).to(torch.bfloat16))
    mod.unpermute_backward(grad_out, rows, res.row_id_map, probs.numpy())
    mod.unpermute_backward(grad_out, rows, res.row_id_map, None)
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--e", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--lnc", choices=("1", "2"), help="the LNC to declare (default: the environment's)")
    ap.add_argument("--root", type=Path, default=ROOT, help="checkout whose generated/nki modules to count")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where nki_cost_lnc<LNC>.json goes")
    args = ap.parse_args()
    if args.lnc:
        os.environ["NEURON_LOGICAL_NC_CONFIG"] = args.lnc
    from permgen.nki.host import logical_cores

    print(f"NKI kernel costs (emulator counts), N={args.n} H={args.h} E={args.e} k={args.k}, bf16 tokens, "
          f"fp32 probs, num_out_tokens = N*k, LNC={logical_cores()}; modules from {args.root}")
    header = f"| {'variant':<24} | {'topk hint':<9} | {'kernel':<22} | {'instructions':>12} | {'indirect DMAs':>13} | " \
             f"{'DMA bytes':>14} | {'device-loop iters':>17} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    rows = []
    for name in VARIANTS:
        mod = load_module(args.root, name)
        mask = mod.VARIANT["routing"] == "mask"
        tokens, routing, probs = make_inputs(mod.VARIANT["routing"], args.n, args.h, args.e, args.k)
        torch_api = hasattr(mod, "_ops")
        for topk in ((None, args.k) if mask and torch_api else (None,)):
            start = time.time()
            with nki_emulator.recording() as runs:
                if torch_api:
                    run_torch_api(mod, tokens, routing, probs, args.e, args.k, topk)
                else:
                    run_numpy_api(mod, tokens, routing, probs, args.e, args.k)
            hint = "-" if not mask else (str(topk) if topk else "none")
            for cost in runs:
                kernel = cost.kernel[len(name) + 1:] if cost.kernel.startswith(name) else cost.kernel
                print(f"| {name:<24} | {hint:<9} | {kernel:<22} | {cost.instructions:>12,} | {cost.indirect_dmas:>13,} | "
                      f"{cost.dma_bytes:>14,} | {cost.dynamic_iterations:>17,} |")
                rows.append(dict(variant=name, topk=hint, kernel=kernel, instructions=cost.instructions,
                                 indirect_dmas=cost.indirect_dmas, dma_bytes=cost.dma_bytes,
                                 device_loop_iterations=cost.dynamic_iterations))
            print(f"({name}, topk {hint}: {time.time() - start:.0f} s in the emulator)", file=sys.stderr)
    run = dict(run=run_metadata(gpu="none: counted by permgen's NKI emulator"),
               shape=dict(N=args.n, H=args.h, E=args.e, k=args.k), lnc=logical_cores(), modules=str(args.root),
               results=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"nki_cost_lnc{logical_cores()}.json").write_text(json.dumps(run, indent=1) + "\n")


if __name__ == "__main__":
    main()
