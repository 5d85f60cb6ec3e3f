"""Ops are registered on the first call of a variant that needs them, never at import: counted in
a fresh process (every torch.library op in the permgen namespace, expert parallelism's too)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

OPS = """
import torch
def ops():
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("permgen::"))
"""

SCRIPT = OPS + """
import permgen
print("import", len(ops()))
permgen.moe_permute  # loads permgen.integrations.te and the Triton variants it serves (each with dispatch / combine)
permgen.moe_permute_with_probs
print("te", len(ops()))
N, E, k = 6, 4, 2
device = "cuda" if torch.cuda.is_available() else "cpu"
tokens = torch.randn(N, 8).to(torch.bfloat16).to(device)
ids = torch.stack([torch.randperm(E)[:k] for _ in range(N)]).to(torch.int32).to(device)
out, row_id_map = permgen.moe_permute(tokens, ids, num_out_tokens=N * k, map_type="index")
print("eager", len(ops()))
tokens.requires_grad_()
permgen.moe_permute(tokens, ids, num_out_tokens=N * k, map_type="index")
print("autograd", " ".join(ops()))
"""

# Capacity-mode dispatch -> experts -> combine -> backward under torch.compile(fullgraph=True) on a
# one-rank group (gloo; NCCL on a GPU): it must register its variant's ep ops and nothing else, and give the eager
# results bit for bit.
COMPILED_EP = OPS + """
import sys
import torch.distributed as dist
import permgen
mod = permgen.get_kernel("triton", dtype="bf16", routing="index", probs=True)
print("load", len(ops()))
cuda = torch.cuda.is_available()  # NCCL and CUDA tensors on a GPU machine, gloo and the interpreter elsewhere
dist.init_process_group("nccl" if cuda else "gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
group = dist.group.WORLD
device = "cuda" if cuda else "cpu"
N, H, E, k, C = 9, 16, 4, 2, 11
g = torch.Generator().manual_seed(0)
tokens = torch.randn(N, H, generator=g).to(torch.bfloat16).to(device)
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(torch.int32).to(device)
probs = torch.rand(N, k, generator=g).to(device)

def layer(tokens, ids, probs):
    res = mod.dispatch(tokens, ids, probs, group=group, num_experts=E, recv_capacity=C)
    return res.tokens, res.tokens_per_expert, mod.combine(res.tokens * 2, res.handle, probs)

def run(fn):
    t, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    outs = fn(t, ids, p)
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs[-1].float().sum(), [t, p]))

compiled = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
print("compiled", " ".join(ops()))
eager = run(layer)
print("eager", len(ops()))
for i, (a, b) in enumerate(zip(compiled, eager)):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (i, a, b)
dist.destroy_process_group()
print("equal", len(compiled))
"""


def run_fresh(script, *args):
    """{first word of a line: the rest} of the lines script prints, run in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not torch.cuda.is_available():  # the kernels run on CPU tensors under the interpreter
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines())


def test_ops_are_registered_on_first_use():
    lines = run_fresh(SCRIPT)
    assert lines["import"] == "0" and lines["te"] == "0"
    assert lines["eager"] == "0"  # a call without autograd runs the backend directly
    registered = lines["autograd"].split()
    assert registered and all(n.startswith("permgen::triton_bf16_index_") for n in registered), registered
    assert not any("_ep_" in n for n in registered), registered


def test_compiled_dispatch_registers_only_its_ep_ops(tmp_path):
    lines = run_fresh(COMPILED_EP, str(tmp_path / "store"))
    assert lines["load"] == "0"
    ep = "permgen::triton_probs_bf16_index_ep_"
    assert lines["compiled"].split() == sorted(ep + op for op in ("combine", "combine_backward", "dispatch",
                                                                  "dispatch_backward")), lines["compiled"]
    assert lines["eager"] == "4"  # eager dispatch and combine (and their backward passes) use no op
    assert lines["equal"] == "5"
