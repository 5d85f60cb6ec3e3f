"""`python -m generator vendor <variant> -o FILE`: one self-contained Triton file for a variant.

The file is the permgen runtime the variant's module uses (the permgen modules it imports, and
those they import: core/contract, core/variant, core/results, core/ops, triton/host, ep, triton/kernels ...),
inlined each after the ones it imports, followed by the variant's generated kernels and binding;
it imports only torch, triton and the standard library (on CPU tensors Triton's interpreter also
imports numpy). Imports between the inlined modules are
dropped (inside functions too: the names they bind are the file's own), the others gathered at
the top; a top-level name defined by two parts is an error, so inlining can never silently rebind
one.
"""

import ast
from pathlib import Path

from .render import MARKER, GenerationError, Output

RUNTIME = Path(__file__).resolve().parent.parent / "permgen"


def _file(name: str) -> Path:
    """The file of the permgen module `name` (dotted, under permgen: "core.ops"; "ep" is a package)."""
    path = RUNTIME.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _is_module(name: str) -> bool:
    return bool(name) and _file(name).is_file()


def _package(name: str) -> str:
    """The package a module's relative imports start from: a package's own name, else its parent's."""
    return name if _file(name).name == "__init__.py" else name.rpartition(".")[0]


def _resolve(node: ast.stmt, package: str):
    """(the permgen modules, dotted under permgen, an import statement imports from; whether it binds
    them as modules: `from . import kernels`) for a statement in a module of `package`; ([], False)
    for any other import."""
    if isinstance(node, ast.Import):
        names = [a.name.split(".", 1) for a in node.names]
        return [parts[1] for parts in names if parts[0] == "permgen" and len(parts) == 2], False
    if not isinstance(node, ast.ImportFrom):
        return [], False
    parts = (node.module or "").split(".") if node.module else []
    if node.level == 0:
        if not parts or parts[0] != "permgen":
            return [], False
        base = parts[1:]
    else:
        up = package.split(".") if package else []
        base = up[:len(up) - (node.level - 1)] + parts
    base = ".".join(base)
    submodules = [".".join(filter(None, (base, a.name))) for a in node.names]
    if not base or all(_is_module(name) for name in submodules):
        return submodules, True  # from permgen import x / from . import x: x is a module
    return [base], False


def _internal_modules(node: ast.stmt, package: str) -> list:
    """The permgen modules (dotted under permgen) an import statement imports from; [] for any other import."""
    return _resolve(node, package)[0]


def _is_internal(node: ast.stmt) -> bool:
    """An import of permgen itself (inlined) or of __future__ (the inlined modules run without it)."""
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in ("permgen", "__future__")
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "permgen" for a in node.names)


def _runtime_order(source: str) -> list:
    """The permgen modules `source` needs, through their top-level imports, each after the ones it imports."""
    order, visiting = [], set()

    def visit(name):
        if name in order or name in visiting:
            return
        visiting.add(name)
        path = _file(name)
        if not path.is_file():
            raise GenerationError(f"vendor: permgen.{name} is imported but is not a module file ({path})")
        for dep in _top_level_deps(path.read_text(encoding="utf-8"), _label(name), _package(name)):
            visit(dep)
        order.append(name)

    for dep in _top_level_deps(source, "the generated module", ""):
        visit(dep)
    return order


def _label(name: str) -> str:
    return _file(name).relative_to(RUNTIME.parent).as_posix()


def _top_level_deps(source: str, label: str, package: str) -> list:
    deps = []
    for node in ast.parse(source, label).body:
        for name in _internal_modules(node, package):
            if name not in deps:
                deps.append(name)
    return deps


def _split(source: str, label: str, package: str, inlined):
    """(external imports, body text, top-level names) of one module, without its header comments,
    docstring and imports. An import of an inlined module inside a function becomes `pass` (its
    names are the file's own), or for a module bound to a name, that name for the file's module."""
    tree = ast.parse(source, label)
    lines = source.splitlines(keepends=True)
    imports, names = [], []
    drop = set(range(tree.body[0].lineno - 1))  # the @generated header comments, if any
    for i, node in enumerate(tree.body):
        span = range(node.lineno - 1, node.end_lineno)
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            drop.update(span)  # the module docstring
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if not _is_internal(node):
                imports.append(node)
            drop.update(span)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    replace = {}
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if id(node) in top or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        modules, as_modules = _resolve(node, package)
        if not modules or not set(modules) <= set(inlined):
            continue
        indent = lines[node.lineno - 1][:node.col_offset]
        as_modules = as_modules and isinstance(node, ast.ImportFrom)
        if as_modules:  # from . import triton_kernels as k: k holds this file's names
            binds = "; ".join(f"{a.asname or a.name} = types.SimpleNamespace(**globals())" for a in node.names)
            imports.append(ast.Import(names=[ast.alias("types")]))
        else:
            binds = "; ".join(f"{a.asname} = {a.name}" for a in node.names if a.asname) or "pass"
        replace[node.lineno - 1] = f"{indent}{binds}  # vendored: {', '.join(modules)} inlined in this file\n"
        drop.update(range(node.lineno, node.end_lineno))
    body = "".join(replace.get(j, line) for j, line in enumerate(lines) if j not in drop)
    return imports, body.strip("\n"), names


def _import_block(nodes) -> str:
    """The gathered imports, one line per module, standard library first."""
    plain, names = [], {}
    for node in nodes:
        if isinstance(node, ast.Import):
            plain.extend(ast.unparse(ast.Import(names=[a])) for a in node.names)
        else:
            names.setdefault(node.module, [])
            names[node.module].extend(ast.unparse(a) for a in node.names if ast.unparse(a) not in names[node.module])
    lines = sorted(set(plain)) + [f"from {module} import {', '.join(sorted(n))}" for module, n in sorted(names.items())]
    third_party = ("torch", "triton")
    ordered = sorted(lines, key=lambda line: (line.split()[1].split(".")[0] in third_party, line.split()[1], line))
    stdlib = [line for line in ordered if line.split()[1].split(".")[0] not in third_party]
    return "\n".join(stdlib) + "\n\n" + "\n".join(line for line in ordered if line not in stdlib)


def vendor(output: Output, variant_name: str) -> str:
    """The self-contained source for one generated Triton module (`output`, rendered in memory)."""
    runtime = _runtime_order(output.text)
    parts = [(_label(name), _package(name), _file(name).read_text(encoding="utf-8")) for name in runtime]
    parts.append((f"generated/{output.path.as_posix()}", "", output.text))
    imports, bodies, owner = [], [], {}
    for label, package, source in parts:
        part_imports, body, names = _split(source, label, package, runtime)
        for name in names:
            if name in owner:
                raise GenerationError(f"vendor: {name!r} is defined in both {owner[name]} and {label}")
            owner[name] = label
        imports.extend(part_imports)
        bodies.append(f"# {'-' * 94}\n# {label}\n# {'-' * 94}\n\n{body}\n")
    kernel_doc = ast.get_docstring(ast.parse(output.text)) or ""
    header = (f"{MARKER} vendor for variant {variant_name}: the permgen runtime inlined before the kernels.\n"
              "# DO NOT EDIT: change variants.toml or the sources, then vendor again.\n")
    inlined = ", ".join(_label(name) for name in runtime)
    doc = (f'"""{kernel_doc}\n\nSelf-contained: the permgen runtime ({inlined}) is inlined above\n'
           'the kernels; this file imports only torch, triton and the standard library.\n"""\n')
    return header + doc + "\n" + _import_block(imports) + "\n\n\n" + "\n\n\n".join(bodies)
