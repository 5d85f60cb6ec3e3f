"""Ops are registered on the first call of a variant that needs them, never at import: counted in
a fresh process (torch.library ops in the permgen namespace)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import torch
def ops():  # expert parallelism's ops (permgen.ep, `_ep_`) are counted apart
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("permgen::")]
    return sorted(n for n in names if "_ep_" not in n)
import permgen
print("import", len(ops()))
permgen.moe_permute  # loads permgen.te and the Triton variants it serves
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


def test_ops_are_registered_on_first_use():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not torch.cuda.is_available():  # the kernels run on CPU tensors under the interpreter
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["import"] == "0" and lines["te"] == "0"
    assert lines["eager"] == "0"  # a call without autograd runs the backend directly
    registered = lines["autograd"].split()
    assert registered and all(n.startswith("permgen::triton_bf16_index_") for n in registered), registered
