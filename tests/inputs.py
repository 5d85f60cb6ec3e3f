"""Fresh random inputs for a variant, shared by every target's tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_COLS = {"block128": 128, "mx32": 32}


@dataclass(frozen=True)
class Case:
    name: str
    N: int
    H: int
    E: int
    k: int
    cap: str = "none"  # "none": no num_out_tokens; "drop": fewer rows than routes; "spare": more rows
    ragged: bool = False  # routes per token vary (index: some -1 ids; mask: 0..k experts per token)

    def __str__(self):
        return self.name


CASES = [
    Case("basic", N=37, H=200, E=7, k=3),
    Case("empty", N=0, H=64, E=4, k=2),
    Case("one_token", N=1, H=130, E=5, k=2),
    Case("e7_k5", N=23, H=96, E=7, k=5),
    Case("pow2", N=16, H=256, E=8, k=2),
    Case("dropped", N=29, H=72, E=6, k=3, cap="drop"),
    Case("spare_rows", N=11, H=72, E=4, k=2, cap="spare"),
    Case("ragged", N=19, H=80, E=9, k=4, ragged=True),
]


def make_inputs(variant: dict, case: Case, device, generator: torch.Generator | None = None):
    """tokens, routing, probs, scale for `variant` (a generated VARIANT dict) on `case`."""
    g = generator
    N, H, E, k = case.N, case.H, case.E, case.k
    tokens = torch.randn(N, H, generator=g) * 4
    tokens = tokens.to(TORCH_DTYPES[variant["dtype"]])
    # k distinct experts per token, random order.
    ids = torch.argsort(torch.rand(N, E, generator=g), dim=1)[:, :k].to(torch.int32)
    if case.ragged:
        ids[torch.rand(N, k, generator=g) < 0.3] = -1
    if variant["routing"] == "mask":
        routing = torch.zeros(N, E, dtype=torch.bool)
        rows, cols = (ids >= 0).nonzero(as_tuple=True)
        routing[rows, ids[rows, cols].long()] = True
        prob_cols = E
    else:
        routing = ids
        prob_cols = k
    probs = torch.rand(N, prob_cols, generator=g) if variant["probs"] else None
    scale = None
    if variant["scale"] != "none":
        cols = -(-H // SCALE_COLS[variant["scale"]])
        if variant["scale"] == "block128":
            scale = torch.rand(N, cols, generator=g) + 0.5
        else:
            scale = torch.randint(0, 256, (N, cols), dtype=torch.uint8, generator=g)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(tokens), to(routing), to(probs), to(scale)


def num_out_tokens_for(case: Case, needed_rows: int):
    if case.cap == "drop":
        return needed_rows * 2 // 3
    if case.cap == "spare":
        return needed_rows + 5
    return None
