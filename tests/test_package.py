"""A wheel built from the repository installs one import package, permgen, with the generated
kernels (permgen.generated) and the NKI emulator (permgen.nki.emulator) under it; installed and used
outside the repository it runs the README's CPU snippet for the NKI variants; importing permgen
loads neither torch nor a target."""

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *_build_isolation(),
                           "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built, = out.glob("permgen-*.whl")
    return built


def test_wheel_installs_only_permgen(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"permgen", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for name, variant in permgen.VARIANTS.items():
        for target in variant["targets"]:
            assert f"permgen/generated/{target}/{name}.py" in names
    assert "permgen/generated/__init__.py" in names and "permgen/core/contract.py" in names
    # Nothing else: a variant removed from variants.toml must not ship from a stale build/.
    shipped = {n for n in names if re.fullmatch(r"permgen/generated/(triton|nki)/(?!__init__)\w+\.py", n)}
    expected = {f"permgen/generated/{t}/{name}.py" for name, v in permgen.VARIANTS.items() for t in v["targets"]}
    assert shipped == expected, f"not in variants.toml: {sorted(shipped - expected)} (a stale build/? make clean)"
    for module in ("__init__", "_core", "_cores", "api", "isa", "language", "collectives"):
        assert f"permgen/nki/emulator/{module}.py" in names


def readme_cpu_snippet() -> str:
    """The README's snippet that runs the NKI variants on CPU tensors from an installed permgen."""
    text = (ROOT / "README.md").read_text()
    start = text.index("An installed permgen runs the NKI variants on CPU tensors")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_installed_wheel_runs_the_nki_variants_on_cpu_outside_the_repository(wheel, tmp_path):
    """As a new user would: the wheel installed (without its dependencies: torch, numpy and ml_dtypes
    come from this environment) and the README's CPU snippet run from a directory outside the
    repository, with no Neuron package; permgen and the emulator must come from the installed wheel."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = f"""
import sys
from pathlib import Path
site = Path({str(site)!r})
assert Path(permgen.__file__).is_relative_to(site), permgen.__file__
from permgen.nki import emulator as nki_emulator
assert Path(nki_emulator.__file__).is_relative_to(site) and sys.modules["nki"].__nki_emulator__
assert not any(Path(p).resolve() == Path({str(ROOT)!r}) for p in sys.path if p)
torch.testing.assert_close(out.float(), x.float(), rtol=1e-2, atol=0)
assert x.grad is not None and torch.isfinite(x.grad.float()).all() and x.grad.abs().sum() > 0
print("installed ok")
"""
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NEURON_LOGICAL_NC_CONFIG")}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", readme_cpu_snippet() + checks], capture_output=True, text=True,
                         cwd=work, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("installed ok"), run.stderr[-4000:]


def test_import_permgen_is_light():
    code = ("import sys, permgen; permgen.find_variant('triton', dtype='bf16', routing='mask'); "
            "print(sorted(m for m in ('torch', 'triton', 'nki', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_min_torch_is_pyprojects():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (bound,) = [re.fullmatch(r"torch>=([\d.]+)", d).group(1) for d in deps if d.startswith("torch")]
    assert permgen.MIN_TORCH == tuple(int(part) for part in bound.split("."))


@pytest.mark.parametrize("found", ["2.10.0+cu128", "2.11.0", "2.13.0+cpu"])
def test_import_permgen_refuses_an_older_torch_by_name(found, tmp_path):
    """A torch older than pyproject's bound fails `import permgen` naming both versions and the fix,
    without importing torch (this stand-in cannot be imported); the bound and newer pass."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise RuntimeError('torch was imported')\n")
    (tmp_path / "torch" / "version.py").write_text(f"__version__ = '{found}'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", "import permgen"], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=120)
    minimum = ".".join(map(str, permgen.MIN_TORCH))
    if tuple(int(part) for part in re.findall(r"\d+", found)[:2]) >= permgen.MIN_TORCH:
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode != 0 and "ImportError" in out.stderr, out.stderr
        assert f"permgen needs torch >= {minimum}; this environment has torch {found}" in out.stderr
        assert f"pip install --upgrade 'torch>={minimum}'" in out.stderr


def test_import_permgen_loads_no_target_feature_or_integration():
    """`import permgen` loads the core only: the subpackages of the targets, the features and the
    integrations are imported when used."""
    code = ("import sys, permgen; permgen.find_variant('triton', dtype='bf16', routing='mask'); "
            "print(sorted(m for m in sys.modules if m.startswith('permgen.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = {m.split(".")[1] for m in eval(out.stdout)}
    assert "core" in loaded and not loaded & {"triton", "nki", "ep", "layers", "integrations", *permgen.MOVED}, loaded


# The paths users import from the package's flat layout, each under its new name.
OLD_PATHS = {**{f"permgen.{old}": f"permgen.{new}" for old, new in permgen.MOVED.items()},
             "permgen.nki_emulator.language": "permgen.nki.emulator.language",
             "permgen.nki_emulator.testing": "permgen.nki.emulator.testing",
             "permgen.nki_emulator.api": "permgen.nki.emulator.api",
             "permgen.ep": "permgen.ep", "permgen.integrations.megatron": "permgen.integrations.megatron"}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_import_path_is_the_moved_module(old):
    """An old path, imported before the new one, gives the new module object itself: one module,
    under its new name and spec, bound on its old parent too (`from permgen import te`)."""
    new = OLD_PATHS[old]
    parent, _, leaf = old.rpartition(".")
    code = f"""
import importlib, sys
old = importlib.import_module({old!r})
new = importlib.import_module({new!r})
assert old is new and sys.modules[{old!r}] is new, (old, new)
assert new.__name__ == {new!r} and new.__spec__.name == {new!r}, (new.__name__, new.__spec__)
assert getattr(importlib.import_module({parent!r}), {leaf!r}) is new
copies = dict((id(m), m) for m in list(sys.modules.values()) if getattr(m, "__file__", None) == new.__file__)
assert list(copies.values()) == [new], copies
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_old_names_stay_unimported_until_used():
    """`import permgen` imports no moved module for its old name; `permgen.te` then imports it."""
    code = ("import sys, permgen; print(sorted(m for m in sys.modules if m.startswith(('permgen.te', "
            "'permgen.integrations.te', 'torch')))); print(permgen.te is sys.modules['permgen.integrations.te'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"]


def test_version_is_pyproject_version():
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert permgen.__version__ == tomllib.load(f)["project"]["version"]


def test_readme_python_snippets_end_with_a_printed_check():
    """Each snippet shows its success: it ends by printing a check (before a process group's teardown)."""
    snippets = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert snippets
    for snippet in snippets:
        lines = [line for line in snippet.splitlines() if line.strip() and not line.startswith("#")]
        if lines[-1] == "dist.destroy_process_group()":
            lines.pop()
        assert lines[-1].startswith("print("), snippet
