"""`python -m generator vendor <variant> -o FILE`: one self-contained Triton file for a variant.

The file is the permgen runtime the Triton target needs (contract, results, ops, triton_host),
inlined in dependency order, followed by the variant's generated kernels and binding; it imports
only torch, triton and the standard library. Imports between the inlined modules are dropped, the
others gathered at the top; a top-level name defined by two parts is an error, so inlining can
never silently rebind one.
"""

import ast
from pathlib import Path

from .render import MARKER, GenerationError, Output

RUNTIME = Path(__file__).resolve().parent.parent / "permgen"
# The runtime modules a Triton module uses, each after the ones it imports.
TRITON_RUNTIME = ("contract", "results", "ops", "triton_host", "ep", "triton_kernels")


def _is_internal(node: ast.stmt) -> bool:
    """An import of permgen itself (inlined) or of __future__."""
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in ("permgen", "__future__")
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "permgen" for a in node.names)


def _split(source: str, label: str):
    """(external imports, body text, top-level names) of one module, without its header
    comments, docstring and imports."""
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
    body = "".join(line for j, line in enumerate(lines) if j not in drop)
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
    parts = [(f"permgen/{name}.py", (RUNTIME / f"{name}.py").read_text(encoding="utf-8")) for name in TRITON_RUNTIME]
    parts.append((f"generated/{output.path.as_posix()}", output.text))
    imports, bodies, owner = [], [], {}
    for label, source in parts:
        part_imports, body, names = _split(source, label)
        for name in names:
            if name in owner:
                raise GenerationError(f"vendor: {name!r} is defined in both {owner[name]} and {label}")
            owner[name] = label
        imports.extend(part_imports)
        bodies.append(f"# {'-' * 94}\n# {label}\n# {'-' * 94}\n\n{body}\n")
    kernel_doc = ast.get_docstring(ast.parse(output.text)) or ""
    header = (f"{MARKER} vendor for variant {variant_name}: the permgen runtime inlined before the kernels.\n"
              "# DO NOT EDIT: change variants.toml or the sources, then vendor again.\n")
    runtime = ", ".join(f"permgen/{name}.py" for name in TRITON_RUNTIME)
    doc = (f'"""{kernel_doc}\n\nSelf-contained: the permgen runtime ({runtime}) is inlined above\n'
           'the kernels; this file imports only torch, triton and the standard library.\n"""\n')
    return header + doc + "\n" + _import_block(imports) + "\n\n\n" + "\n\n\n".join(bodies)
