"""Every structural combination of the spec's axes, not only the default spec's ten variants.

The Triton templates branch on routing, probs, pad and scale (and the dtype's width). This test
writes a spec with all 16 combinations of routing x probs x padding x scale (dtypes rotated over
the allowed ones), generates those the default spec has no variant of into a temporary folder,
imports each module by file path and checks it against the reference, forward and backward, with
dropped routes and a ragged routing.
"""

import importlib.util
import itertools

import pytest

import permgen
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


def structure(v) -> tuple:
    """What the templates branch on, of a parsed spec entry or a VARIANTS dict."""
    get = (lambda a: v[a]) if isinstance(v, dict) else (lambda a: getattr(v, a))
    return get("routing"), get("probs"), get("pad") > 0, get("scale") != "none"


# The default spec's variants run through the same checks in test_triton_kernels.py, on more
# cases: the matrix generates only the combinations the spec has no plain variant of.
IN_THE_SPEC = {structure(v) for v in permgen.VARIANTS.values() if "triton" in v["targets"] and v["quantize"] == "none"}
MATRIX = parse_spec(matrix_spec(), "matrix.toml")
VARIANTS = [v for v in MATRIX if structure(v) not in IN_THE_SPEC]
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
    assert len({structure(v) for v in MATRIX}) == 16
    assert {v.dtype for v in MATRIX} == set(PLAIN_DTYPES) | {d for d, _ in SCALED}
    assert {v.scale for v in MATRIX} == {"none", "block128", "mx32"}
    assert {structure(v) for v in VARIANTS} | IN_THE_SPEC == {structure(v) for v in MATRIX}
    assert VARIANTS, "the spec has a variant of every combination: the matrix tests nothing"


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_variant_matches_reference(name, case, modules, poisoned_empty, request):
    check_case(modules[name], case, generator_for(request))
