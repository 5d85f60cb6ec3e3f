"""`python -m generator vendor <variant> -o FILE` writes one self-contained Triton file that imports
only torch, triton and the standard library, and passes the same numerical checks as the package."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import permgen
from test_triton_kernels import CASES, check_permute, check_permute_backward, check_unpermute

ROOT = Path(__file__).resolve().parent.parent
TRITON_VARIANTS = [name for name, v in permgen.VARIANTS.items() if "triton" in v["targets"]]
STDLIB = set(sys.stdlib_module_names)
# One case with every feature (dropped routes) and the empty one keep this file quick.
VENDOR_CASES = [c for c in CASES if c.name in ("dropped", "empty")]


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
    assert "permgen" not in sys.modules.get(vendored[name].__name__).__dict__


@pytest.mark.parametrize("case", VENDOR_CASES, ids=str)
@pytest.mark.parametrize("name", TRITON_VARIANTS)
def test_vendored_variant_matches_reference(name, case, vendored, poisoned_empty, request):
    module = vendored[name]
    assert module.VARIANT == permgen.VARIANTS[name] | {"name": name}
    check_permute(module, case, seed=zlib_seed(request))
    check_unpermute(module, case, seed=zlib_seed(request) + 1)
    check_permute_backward(module, case, seed=zlib_seed(request) + 2)


def test_vendor_names_unknown_variants(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "generator", "vendor", "nope_mask", "-o", str(tmp_path / "x.py")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "no triton variant 'nope_mask'" in proc.stderr and "probs_bf16_mask" in proc.stderr
    assert not (tmp_path / "x.py").exists()


def zlib_seed(request):
    import zlib
    return zlib.crc32(request.node.nodeid.encode())
