"""The documented NKI surface, enforced on the emulator and on every NKI kernel.

tests/nki_api.json lists the NKI API as the aws-neuron-sdk stubs and pages document it (modules, functions with
their parameters in order, NkiTensor methods and attributes, enum members; NKI 0.7.0 (Neuron SDK 2.33) at the top
level, the 0.6.0 stubs with the changes the 2.33 pages state; snapshots of 0.3.0 - 0.6.0 under `by_version`; its
`source` field names the stub commits, `pages_0_7` the 2.33 pages read, `deprecated` what each release deprecates).

- The emulator (permgen.nki.emulator.api, what `import nki` gives without the Neuron packages)
  provides only documented names, each with the documented parameters in order, and refuses every
  documented name it does not emulate with a "not emulated" error.
- The emulator's surface follows its Platform's SDK release: at 2.33 (the default) exactly NKI 0.7.0's names,
  at 2.32 NKI 0.6.0's (nl.dynamic_range there too).
- Every NKI kernel (generated/nki/*.py, and the hand-written permgen/nki_*.py modules with @nki.jit
  kernels or exported kernel helpers) uses only names, attributes and keywords the NKI versions it claims to
  run on document, and none they deprecate: Neuron SDK 2.32 (NKI 0.6.0, the first with nl.fori_loop) and
  2.33 (NKI 0.7.0, the README's release).
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import re
from pathlib import Path

import pytest

from permgen.nki import emulator as nki_emulator
from permgen.nki.emulator import api
from permgen.nki.emulator.api import NotEmulated

ROOT = Path(__file__).resolve().parent.parent
API = json.loads((Path(__file__).parent / "nki_api.json").read_text())
SUPPORTED_VERSIONS = ("0.6.0", "0.7.0")  # Neuron SDK 2.32 (nl.fori_loop's first) and 2.33 (the README's)
SDK_OF = {"0.6.0": "2.32", "0.7.0": "2.33"}
SUBMODULES = {"nki": {"language", "isa", "collectives", "typing"}, "nki.isa": {"constants"}}
# Methods of the plain Python values (lists, dicts, strings) kernels use while tracing. None of them is an
# NkiTensor attribute, so a tensor using one still fails in the emulator (its tensors have only NKI's).
PYTHON_ATTRIBUTES = {"append", "extend", "insert", "pop", "index", "count", "items", "keys", "values", "get",
                     "join", "format"}


def surface(version: str) -> dict:
    """modules, tensor_methods, tensor_attributes, tile_size attributes and enum members of one version."""
    snap = API if version == API["nki_version"] else API["by_version"][version]
    return {"modules": snap["modules"], "tensor_methods": snap["tensor_methods"],
            "tensor_attributes": set(snap["tensor_attributes"]),
            "tile_size": set(API["attributes"]["nki.language.tile_size"] if snap is API else snap["tile_size_attributes"]),
            "enum_members": API["enum_members"]}


# --- the emulator's surface ------------------------------------------------------------------------
EMULATOR_MODULES = {"nki": api.package(nki_emulator.jit, nki_emulator.simulate), **api.MODULES}


def emulated_parameters(obj) -> list:
    names = []
    for p in inspect.signature(obj).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        names.append(prefix + p.name)
    return names


def check_signature(where: str, obj, params: list, defaults: dict, problems: list) -> None:
    if not callable(obj):
        problems.append(f"{where}: documented as callable, emulated as {type(obj).__name__}")
        return
    got = emulated_parameters(obj)
    if got != params:
        problems.append(f"{where}: parameters {got}, documented {params}")
        return
    for p in inspect.signature(obj).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if (p.default is not p.empty) != (p.name in defaults):
            problems.append(f"{where}: parameter {p.name} {'has' if p.default is not p.empty else 'lacks'} a default; "
                            f"documented {'with' if p.name in defaults else 'without'} one")


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_emulator_modules_provide_only_documented_names_with_documented_parameters(version):
    with nki_emulator.on(nki_emulator.Platform(sdk=SDK_OF[version])):
        check_emulator_modules(version)


def check_emulator_modules(version):
    doc = surface(version)
    problems, emulated = [], 0
    for module_name, names in doc["modules"].items():
        module = EMULATOR_MODULES[module_name]
        public = {n for n in dir(module) if not n.startswith("_")} - SUBMODULES.get(module_name, set())
        problems += [f"{module_name}.{n}: emulated but not documented" for n in sorted(public - set(names))]
        for name, params in names.items():
            where = f"{module_name}.{name}"
            try:
                obj = getattr(module, name)
            except NotEmulated as err:
                assert "not emulated" in str(err), where
                continue
            emulated += 1
            if params is not None:
                check_signature(where, obj, params, API["defaults"].get(module_name, {}).get(name, {}), problems)
            if where in doc["enum_members"]:
                members = {m.name for m in obj}
                if members != set(doc["enum_members"][where]):
                    problems.append(f"{where}: members {sorted(members)}, documented {doc['enum_members'][where]}")
    assert not problems, "\n".join(problems)
    assert emulated >= 60  # the subset the kernels use: dtypes, memories, operators, instructions, collectives


def test_emulator_tensors_have_only_documented_methods_and_attributes():
    doc = surface(API["nki_version"])
    nl = api.language
    tensor = nl.NkiTensor((2, 3), nl.float32, __import__("numpy").zeros((2, 3), "float32"), nl.shared_hbm, "t")
    pattern = tensor.ap([[3, 2], [1, 3]], offset=0)  # .ap() returns a view, documented as an NkiTensor too
    documented = doc["tensor_attributes"] | set(doc["tensor_methods"])
    problems = []
    for what, obj in (("NkiTensor", tensor), ("NkiTensor.ap(...)", pattern)):
        public = {n for n in dir(obj) if not n.startswith("_")}
        problems += [f"{what}.{n}: emulated but not documented" for n in sorted(public - documented)]
    for name in doc["tensor_attributes"]:
        getattr(tensor, name)
    for name, params in doc["tensor_methods"].items():
        check_signature(f"NkiTensor.{name}", getattr(tensor, name), params,
                        API["tensor_method_defaults"].get(name, {}), problems)
    assert not problems, "\n".join(problems)
    with pytest.raises(AttributeError):
        tensor.itemsize


def test_emulator_tile_size_has_only_documented_constants():
    doc = surface(API["nki_version"])
    tile_size = api.language.tile_size
    public = {n for n in dir(type(tile_size)) if not n.startswith("_")}
    assert public <= doc["tile_size"], public - doc["tile_size"]
    for name in doc["tile_size"]:
        try:
            assert isinstance(getattr(tile_size, name), int)
        except nki_emulator.EmulatorError as err:
            assert "not emulated" in str(err) or "not documented" in str(err), name


def test_names_outside_the_documentation_are_refused():
    for module, name in ((api.language, "arange"), (api.language, "par_dim"), (api.isa, "activate"),
                         (api.collectives, "run_ranks"), (api.language, "Operator"), (api.isa, "np")):
        with pytest.raises(NotEmulated, match="not emulated"):
            getattr(module, name)


# --- the kernels' use of NKI ------------------------------------------------------------------------
def kernel_files() -> list[Path]:
    generated = sorted(p for p in (ROOT / "generated" / "nki").glob("*.py") if p.name != "__init__.py")
    hand_written = sorted(p for p in (ROOT / "permgen" / "nki").glob("*.py") if "@nki.jit" in p.read_text())
    return generated + hand_written


def _aliases(tree: ast.Module) -> tuple[dict, dict, set]:
    """(name -> NKI module, name -> (module, attribute)) from the file's imports of nki, and the names its
    other imports bind (Python modules such as math: their attributes are not NKI's business)."""
    modules, names, python = {}, {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "nki" or a.name.startswith("nki."):
                    modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else "nki"
                else:
                    python.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module == "nki" or node.module.startswith("nki.")):
            for a in node.names:
                names[a.asname or a.name] = (node.module, a.name)
        elif isinstance(node, ast.ImportFrom):
            python.update(a.asname or a.name for a in node.names)
    return modules, names, python


def _kernel_functions(tree: ast.Module, modules: dict) -> list[ast.FunctionDef]:
    """The @nki.jit functions, the functions a module of kernel helpers exports (its __all__: permgen.nki.kernels,
    whose helpers the generated kernels call) and every module-level function they reach (called or passed by name)."""
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    exported = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = set(ast.literal_eval(node.value))

    def is_jit(decorator) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return (isinstance(target, ast.Attribute) and target.attr == "jit" and isinstance(target.value, ast.Name)
                and modules.get(target.value.id) == "nki")
    todo = [f for f in functions.values() if any(is_jit(d) for d in f.decorator_list) or f.name in exported]
    seen = {f.name for f in todo}
    for f in todo:
        for node in ast.walk(f):
            if isinstance(node, ast.Name) and node.id in functions and node.id not in seen:
                seen.add(node.id)
                todo.append(functions[node.id])
    return todo


def _chain(node) -> list[str] | None:
    """a.b.c -> ["a", "b", "c"] when the chain ends in a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


@functools.lru_cache(maxsize=None)
def uses(path: Path) -> tuple:
    """What the file's kernels use, in one pass over them:
    ("name", line, module, [attributes], call or None) for names of NKI modules (a call's positional
    count and keywords), ("method", line, attribute, call) and ("attribute", line, attribute) on other
    values, ("getattr", line, attribute) for getattr/hasattr with a literal name."""
    tree = ast.parse(path.read_text())
    modules, imported, python = _aliases(tree)
    found = []

    def resolve(chain):
        """(module, [attributes]) for a chain rooted at an NKI module alias or an imported NKI name."""
        if chain[0] in modules:
            module, rest = modules[chain[0]], chain[1:]
            while rest and rest[0] in SUBMODULES.get(module, ()):
                module, rest = f"{module}.{rest[0]}", rest[1:]
            return module, rest
        if chain[0] in imported:
            module, name = imported[chain[0]]
            return module, [name] + chain[1:]
        return None

    def call(node):
        return len(node.args), tuple(kw.arg for kw in node.keywords if kw.arg is not None)

    def visit(node) -> None:
        children = None
        if isinstance(node, ast.Call):
            chain = _chain(node.func)
            target = resolve(chain) if chain else None
            if target is not None:
                found.append(("name", node.lineno, *target, call(node)))
                children = node.args + [kw.value for kw in node.keywords]
            elif chain and chain[0] in python:
                children = node.args + [kw.value for kw in node.keywords]
            elif isinstance(node.func, ast.Attribute):
                found.append(("method", node.lineno, node.func.attr, call(node)))
                children = [node.func.value] + node.args + [kw.value for kw in node.keywords]
            elif (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)):
                found.append(("getattr", node.lineno, node.args[1].value))
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            target = resolve(chain) if chain else None
            if target is not None:
                found.append(("name", node.lineno, *target, None))
                return
            if chain and chain[0] in python:
                return
            found.append(("attribute", node.lineno, node.attr))
            children = [node.value]
        for child in children if children is not None else ast.iter_child_nodes(node):
            visit(child)

    for function in _kernel_functions(tree, modules):
        for statement in function.body:
            visit(statement)
    return tuple(found)


def findings(path: Path, version: str) -> list[str]:
    """The file's kernels' uses of NKI that NKI `version` does not document."""
    doc = surface(version)
    tensor_surface = doc["tensor_attributes"] | set(doc["tensor_methods"])
    out = []

    def check_call(line, params, what, call):
        if params is None or call is None or any(p.startswith("**") for p in params):
            return
        positional, keywords = call
        fixed = [p for p in params if not p.startswith("*")]
        if not any(p.startswith("*") for p in params) and positional > len(fixed):
            out.append(f"{path.name}:{line}: {what} takes {len(fixed)} parameters in NKI {version}, "
                       f"called with {positional} positional arguments")
        out.extend(f"{path.name}:{line}: {what}({k}=...) is not a parameter in NKI {version}"
                   for k in keywords if k not in fixed)

    def check_attribute(line, attr):
        if attr not in tensor_surface and attr not in PYTHON_ATTRIBUTES and not (
                attr.startswith("__") and attr.endswith("__")):
            out.append(f"{path.name}:{line}: .{attr} is not an attribute NKI {version} documents (NkiTensor's are the "
                       f"only documented attributes and methods; ReplicaGroup documents none)")

    deprecated = API["deprecated"].get(version, {})
    for use in uses(path):
        kind, line = use[0], use[1]
        if kind == "name":
            _, _, module, rest, call = use
            if not rest:
                continue
            names = doc["modules"].get(module)
            if names is None or rest[0] not in names:
                out.append(f"{path.name}:{line}: {module}.{rest[0]} is not in NKI {version}")
            elif f"{module}.{rest[0]}" in deprecated:
                out.append(f"{path.name}:{line}: {module}.{rest[0]} is deprecated in NKI {version}: "
                           f"{deprecated[f'{module}.{rest[0]}']}")
            elif len(rest) == 1:
                check_call(line, names[rest[0]], f"{module}.{rest[0]}", call)
            elif not (len(rest) == 2 and (rest[1] in doc["enum_members"].get(f"{module}.{rest[0]}", ()) or (
                    f"{module}.{rest[0]}" == "nki.language.tile_size" and rest[1] in doc["tile_size"]))):
                out.append(f"{path.name}:{line}: {'.'.join([module] + rest)} is not in NKI {version}")
        elif kind == "method":
            _, _, attr, call = use
            check_attribute(line, attr)
            if attr in doc["tensor_methods"]:
                check_call(line, doc["tensor_methods"][attr], f"NkiTensor.{attr}", call)
        elif kind == "attribute":
            check_attribute(line, use[2])
        elif use[2] not in tensor_surface:
            out.append(f"{path.name}:{line}: getattr(..., {use[2]!r}): not an attribute NKI {version} documents "
                       f"(NkiTensor's are the only documented attributes; ReplicaGroup documents none)")
    return sorted(set(out))


# Findings the kernels still have ("<file>: <what> ... in NKI <version>", the finding without its line
# number -> why it is not fixed yet), each its own strict xfail, so that fixing one is noticed.
KNOWN_FINDINGS: dict = {}


def _unlined(finding: str) -> str:
    name, _, rest = finding.split(":", 2)
    return f"{name}:{rest}"


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
@pytest.mark.parametrize("path", kernel_files(), ids=lambda p: p.name)
def test_kernels_use_only_documented_nki(path, version):
    found = [f for f in findings(path, version) if _unlined(f) not in KNOWN_FINDINGS]
    assert not found, "\n".join(found)


if KNOWN_FINDINGS:
    @pytest.mark.parametrize("finding", [pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=why))
                                         for f, why in KNOWN_FINDINGS.items()])
    def test_known_finding_is_fixed(finding):
        name, version = finding.split(":")[0], re.search(r"NKI (\d+\.\d+\.\d+)", finding).group(1)
        assert finding not in map(_unlined, findings(next(p for p in kernel_files() if p.name == name), version))


def test_the_scan_catches_undocumented_use(tmp_path):
    """The scan fails a kernel that uses an undocumented attribute, name or keyword, and passes its twin."""
    good = '''
import math

import nki
import nki.isa as nisa
import nki.language as nl

_WORD = {1: nl.uint8, 2: nl.uint16, 4: nl.uint32}

def _zero(tile, itemsize):
    nisa.memset(tile.view(_WORD[itemsize]), value=0)

@nki.jit
def kernel(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray((nl.tile_size.pmax, math.prod(a.shape[1:])), dtype=a.dtype, buffer=nl.sbuf)
    _zero(tile, 4)
    nisa.dma_copy(dst=out, src=tile, oob_mode=nisa.oob_mode.skip)
    return out
'''
    bad = (good.replace("tile.view(_WORD[itemsize])", "tile.view(_WORD[tile.itemsize])")
           .replace("oob_mode=nisa.oob_mode.skip", "oob_mode=nisa.oob_mode.drop, dst_rmw_op=nl.add")
           .replace("nl.tile_size.pmax", "nl.par_dim(128)"))
    (tmp_path / "good.py").write_text(good)
    (tmp_path / "bad.py").write_text(bad)
    assert findings(tmp_path / "good.py", "0.6.0") == []
    found = "\n".join(findings(tmp_path / "bad.py", "0.6.0"))
    for expected in (".itemsize is not an attribute NKI 0.6.0 documents", "nki.isa.oob_mode.drop is not in NKI",
                     "dma_copy(dst_rmw_op=...) is not a parameter", "nki.language.par_dim is not in NKI"):
        assert expected in found, found


def test_the_scan_catches_what_nki_0_7_removed_or_deprecated(tmp_path):
    """Against NKI 0.7.0 the scan fails nl.dynamic_range (removed) and the static range iterators (deprecated:
    "default to Python range"), and passes the twin written with nl.fori_loop and Python range."""
    good = '''
import nki
import nki.isa as nisa
import nki.language as nl

@nki.jit
def kernel(a, bound):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    for r0 in range(0, a.shape[0], 128):
        nisa.dma_copy(dst=out[r0:r0 + 1, :], src=a[r0:r0 + 1, :])
    nl.fori_loop(0, bound, lambda i: None)
    return out
'''
    bad = good.replace("range(0, a.shape[0], 128)", "nl.static_range(0, a.shape[0], 128)").replace(
        "nl.fori_loop(0, bound, lambda i: None)", "for i in nl.dynamic_range(bound):\n        pass")
    (tmp_path / "good.py").write_text(good)
    (tmp_path / "bad.py").write_text(bad)
    assert findings(tmp_path / "good.py", "0.7.0") == []
    found = "\n".join(findings(tmp_path / "bad.py", "0.7.0"))
    assert "nki.language.dynamic_range is not in NKI 0.7.0" in found, found
    assert "nki.language.static_range is deprecated in NKI 0.7.0" in found, found
    assert "dynamic_range is deprecated in NKI 0.6.0" in "\n".join(findings(tmp_path / "bad.py", "0.6.0"))
