"""A wheel built from the repository installs one import package, permgen, with the generated
kernels under it (permgen.generated), and importing permgen loads neither torch nor a target."""

import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import permgen

ROOT = Path(__file__).resolve().parent.parent


def _build_isolation():
    """pip builds in an isolated environment, downloading setuptools; where an installed one meets
    pyproject's requirement (and needs no `wheel` package), it is used instead: hosts without a
    network build the wheel too."""
    try:
        major, minor = (int(part) for part in version("setuptools").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if (major, minor) >= (70, 1) else []


def test_wheel_installs_only_permgen(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *_build_isolation(),
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel, = tmp_path.glob("permgen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"permgen", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for name, variant in permgen.VARIANTS.items():
        for target in variant["targets"]:
            assert f"permgen/generated/{target}/{name}.py" in names
    assert "permgen/generated/__init__.py" in names and "permgen/contract.py" in names


def test_import_permgen_is_light():
    code = ("import sys, permgen; permgen.find_variant('triton', dtype='bf16', routing='mask'); "
            "print(sorted(m for m in ('torch', 'triton', 'nki', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
