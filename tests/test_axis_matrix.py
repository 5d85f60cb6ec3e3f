"""Every structural combination of the spec's axes, not only the default spec's ten variants.

The Triton templates branch on routing, probs, pad and scale (and the dtype's width). This test
writes a spec with all 16 combinations of routing x probs x padding x scale (dtypes rotated over
the allowed ones), generates it into a temporary folder, imports each module by file path and
checks it against the reference, forward and backward, with dropped routes and a ragged routing.
"""

import importlib.util
import itertools

import pytest

from generator import render_all, write_all
from generator.spec import parse_spec
from cases import Case, generator_for
from test_triton_kernels import check_case

PLAIN_DTYPES = ["bf16", "fp16", "fp32"]
SCALED = [("fp8_e4m3", "block128"), ("fp8_e5m2", "mx32")]


def matrix_spec():
    entries = []
    for i, (routing, probs, pad, scaled) in enumerate(itertools.product(("mask", "index"), (True, False), (0, 8), (False, True))):
        dtype, scale = SCALED[(i // 2) % 2] if scaled else (PLAIN_DTYPES[(i // 2) % 3], "none")
        entries.append(f'[[variant]]\ndtype = "{dtype}"\nrouting = "{routing}"\nprobs = {str(probs).lower()}\n'
                       f'scale = "{scale}"\npad = {pad}\ntargets = ["triton"]\n')
    return "\n".join(entries)


VARIANTS = parse_spec(matrix_spec(), "matrix.toml")
CASES = [Case("dropped", N=29, H=72, E=6, k=3, cap="drop"), Case("ragged", N=19, H=80, E=9, k=4, ragged=True)]


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    write_all(render_all(VARIANTS), out)
    loaded = {}
    for v in VARIANTS:
        spec = importlib.util.spec_from_file_location(f"matrix_{v.name}", out / "triton" / f"{v.name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded[v.name] = module
    return loaded


def test_the_matrix_covers_every_structural_combination():
    assert len({(v.routing, v.probs, v.pad > 0, v.scale != "none") for v in VARIANTS}) == 16
    assert {v.dtype for v in VARIANTS} == set(PLAIN_DTYPES) | {d for d, _ in SCALED}
    assert {v.scale for v in VARIANTS} == {"none", "block128", "mx32"}


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_variant_matches_reference(name, case, modules, poisoned_empty, request):
    check_case(modules[name], case, generator_for(request))
