"""Render every variant's sources from the templates, in memory or onto disk.

Output is deterministic (no timestamps, no machine paths), files are written only when their
content changes, and files no variant owns any more are removed.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import jinja2

from .spec import FP8_DTYPES, Variant

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
GENERATED = ROOT / "generated"

# What each spec dtype means to the target code.
TORCH_DTYPES = {
    "bf16": "torch.bfloat16",
    "fp16": "torch.float16",
    "fp32": "torch.float32",
    "fp8_e4m3": "torch.float8_e4m3fn",
    "fp8_e5m2": "torch.float8_e5m2",
}
# permute moves rows bitwise, as unsigned words of the token's width.
WORD_DTYPES = {"bf16": "torch.int16", "fp16": "torch.int16", "fp32": "torch.int32",
               "fp8_e4m3": "torch.uint8", "fp8_e5m2": "torch.uint8"}
ITEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
SCALES = {  # scale kind -> (columns per scale, torch dtype, word dtype for bitwise moves)
    "block128": (128, "torch.float32", "torch.int32"),
    "mx32": (32, "torch.uint8", "torch.uint8"),
}

MODULE_TEMPLATES = {"triton": "triton/module.py.jinja", "nki": "nki/module.py.jinja"}
REGISTRY_TEMPLATE = "registry.py.jinja"


class GenerationError(RuntimeError):
    pass


def make_environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def template_context(variant: Variant) -> dict:
    """Facts the templates need about one variant: the axes plus what each dtype means."""
    is_fp8 = variant.dtype in FP8_DTYPES
    ctx = dict(variant.axes())
    ctx.update(
        variant_literal=repr(variant.axes()),  # a Python dict literal, in axis order
        is_fp8=is_fp8,
        has_scale=variant.scale != "none",
        torch_dtype=TORCH_DTYPES[variant.dtype],
        word_dtype=WORD_DTYPES[variant.dtype],
        item_bytes=ITEM_BYTES[variant.dtype],
        # fp8 variants combine the experts' bf16 outputs; the others combine in the token dtype.
        combine_torch_dtype="torch.bfloat16" if is_fp8 else TORCH_DTYPES[variant.dtype],
    )
    if variant.scale != "none":
        cols, dtype, word = SCALES[variant.scale]
        ctx.update(scale_cols=cols, scale_torch_dtype=dtype, scale_word_dtype=word)
    return ctx


def _template_bytes(env: jinja2.Environment, target: str) -> bytes:
    """Bytes of every template a target's module may use: the fingerprint covers them all."""
    names = sorted(n for n in env.list_templates() if n.startswith(f"{target}/") or n.startswith("_"))
    return b"".join(n.encode() + b"\0" + (TEMPLATES / n).read_bytes() for n in names)


def fingerprint(variant: Variant, template_bytes: bytes) -> str:
    digest = hashlib.sha256(json.dumps(variant.axes(), sort_keys=True).encode() + b"\0" + template_bytes)
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Output:
    path: Path  # relative to generated/
    text: str


def render_all(variants: list[Variant]) -> list[Output]:
    env = make_environment()
    outputs: list[Output] = []
    for target, template_name in MODULE_TEMPLATES.items():
        template = env.get_template(template_name)
        tbytes = _template_bytes(env, target)
        owners = [v for v in variants if target in v.targets]
        for variant in owners:
            text = template.render(
                **template_context(variant),
                template_name=template_name,
                fingerprint=fingerprint(variant, tbytes),
            )
            outputs.append(Output(Path(target) / f"{variant.name}.py", text))
        outputs.append(Output(Path(target) / "__init__.py", env.get_template("package_init.py.jinja").render(target=target)))
    registry = env.get_template(REGISTRY_TEMPLATE).render(
        variants=[v.axes() for v in variants],
        template_name=REGISTRY_TEMPLATE,
        fingerprint=hashlib.sha256(
            json.dumps([v.axes() for v in variants], sort_keys=True).encode()
            + (TEMPLATES / REGISTRY_TEMPLATE).read_bytes()
        ).hexdigest()[:16],
    )
    outputs.append(Output(Path("__init__.py"), registry))
    paths = [o.path for o in outputs]
    if len(set(paths)) != len(paths):  # two variants may never claim one file
        raise GenerationError(f"two outputs share a path: {sorted(p for p in paths if paths.count(p) > 1)}")
    return outputs


def _existing_files(out_dir: Path) -> set[Path]:
    return {p.relative_to(out_dir) for p in out_dir.rglob("*.py")} if out_dir.exists() else set()


def write_all(outputs: list[Output], out_dir: Path = GENERATED) -> tuple[list[Path], list[Path]]:
    """Write changed files, delete files no variant owns; return (written, removed)."""
    out_dir = out_dir.resolve()
    written, removed = [], []
    wanted = {o.path for o in outputs}
    for output in outputs:
        dest = (out_dir / output.path).resolve()
        if out_dir not in dest.parents:  # names are validated identifiers; this is the last guard
            raise GenerationError(f"refusing to write outside {out_dir}: {dest}")
        if dest.exists() and dest.read_text(encoding="utf-8") == output.text:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(output.text, encoding="utf-8")
        written.append(output.path)
    for stale in sorted(_existing_files(out_dir) - wanted):
        (out_dir / stale).unlink()
        removed.append(stale)
    return written, removed


def diff_against(outputs: list[Output], out_dir: Path = GENERATED) -> str:
    """A unified diff from what is on disk to what the spec renders; empty when up to date."""
    chunks = []
    wanted = {o.path for o in outputs}
    for output in outputs:
        dest = out_dir / output.path
        current = dest.read_text(encoding="utf-8") if dest.exists() else ""
        if current != output.text:
            chunks.extend(difflib.unified_diff(
                current.splitlines(keepends=True), output.text.splitlines(keepends=True),
                fromfile=f"generated/{output.path} (on disk)", tofile=f"generated/{output.path} (from spec)"))
    for stale in sorted(_existing_files(out_dir) - wanted):
        chunks.append(f"generated/{stale}: no variant owns this file any more\n")
    return "".join(chunks)
