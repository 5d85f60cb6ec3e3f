"""`python -m generator vendor <variant> -o FILE` writes one self-contained Triton file that imports
only torch, triton and the standard library, and passes the same numerical checks as the package."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import permgen
from cases import CASES, generator_for
from test_triton_kernels import check_permute_backward_case, check_permute_case, check_unpermute_case

ROOT = Path(__file__).resolve().parent.parent
TRITON_VARIANTS = [name for name, v in permgen.VARIANTS.items() if "triton" in v["targets"]]
STDLIB = set(sys.stdlib_module_names)
# One case with every feature (dropped routes, ragged rows) keeps this file quick; the package runs them all.
VENDOR_CASES = [c for c in CASES if c.name == "dropped"]


@pytest.fixture(scope="module")
def vendored(tmp_path_factory):
    """variant name -> the module loaded from its vendored file (written once per test module)."""
    out = tmp_path_factory.mktemp("vendored")
    modules = {}
    for name in TRITON_VARIANTS:
        path = out / f"vendored_{name}.py"
        proc = subprocess.run([sys.executable, "-m", "generator", "vendor", name, "-o", str(path)],
                              cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        spec = importlib.util.spec_from_file_location(f"vendored_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


@pytest.mark.parametrize("name", TRITON_VARIANTS)
def test_vendored_file_imports_only_torch_and_triton(name, vendored):
    tree = ast.parse(Path(vendored[name].__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported - STDLIB == {"torch", "triton"}, imported
    assert not any(isinstance(value, type(sys)) and value.__name__.startswith("permgen")
                   for value in vars(vendored[name]).values())


@pytest.mark.parametrize("case", VENDOR_CASES, ids=str)
@pytest.mark.parametrize("name", TRITON_VARIANTS)
def test_vendored_variant_matches_reference(name, case, vendored, poisoned_empty, request):
    module = vendored[name]
    assert module.VARIANT == {"name": name, **permgen.VARIANTS[name]}
    check_permute_case(module, case, generator_for(request, "permute"))
    check_unpermute_case(module, case, generator_for(request, "unpermute"))
    check_permute_backward_case(module, case, generator_for(request, "permute-bwd"))


def test_vendor_names_unknown_variants(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "generator", "vendor", "nope_mask", "-o", str(tmp_path / "x.py")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "no triton variant 'nope_mask'" in proc.stderr and "probs_bf16_mask" in proc.stderr
    assert not (tmp_path / "x.py").exists()

