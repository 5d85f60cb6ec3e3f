"""Load and validate `variants.toml`; derive each variant's canonical name.

The spec is data: every mistake is reported as a `SpecError` naming the file, the variant and
the key, so a user can fix it without reading this module.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from permgen.core.axes import (AXES, DTYPES, FP8_DTYPES, MAX_PAD, QUANTIZABLE_DTYPES,  # noqa: F401 (the tables)
                               QUANTIZES, ROUTINGS, SCALES, TARGETS)
from permgen.core.axes import AXIS_DEFAULTS, OPTION_DEFAULTS, OPTIONS
from permgen.core.variant import Variant, axis_error

ALLOWED_KEYS = frozenset(AXES) | frozenset(OPTIONS) | {"name"}
BUILTIN_DEFAULTS = {**AXIS_DEFAULTS, **OPTION_DEFAULTS}

_SAFE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class SpecError(ValueError):
    """A malformed spec; the message names file, variant and key."""


def variant_name(v: Variant) -> str:
    """One fixed rule (permgen.core.axes.variant_name), e.g. probs_pad128_fp8e4m3_block128_mask."""
    return v.name


def _fail(path, where: str, key: str | None, message: str):
    at = f"{path}: {where}" + (f", key '{key}'" if key else "")
    raise SpecError(f"{at}: {message}")


def _validate_entry(path, where: str, entry: dict) -> Variant:
    for key in entry:
        if key not in ALLOWED_KEYS:
            _fail(path, where, key, f"unknown key; allowed keys are {', '.join(sorted(ALLOWED_KEYS))}")
    for key in ("dtype", "routing"):
        if key not in entry:
            _fail(path, where, key, "missing (set it in the variant or in [defaults])")
    problem = axis_error(entry)  # the axis rules, shared with the registry's lookup (permgen.core.variant)
    if problem:
        _fail(path, where, *problem)
    targets = entry["targets"]
    if not isinstance(targets, list) or not targets:
        _fail(path, where, "targets", f"expected a non-empty list drawn from {list(TARGETS)}, got {targets!r}")
    for target in targets:
        if not isinstance(target, str) or target not in TARGETS:
            _fail(path, where, "targets", f"expected one of {', '.join(map(repr, TARGETS))}, got {target!r}")
    if len(set(targets)) != len(targets):
        _fail(path, where, "targets", f"lists a target twice: {targets!r}")
    variant = Variant(dtype=entry["dtype"], routing=entry["routing"], probs=entry["probs"], scale=entry["scale"],
                      quantize=entry["quantize"], pad=entry["pad"], targets=tuple(t for t in TARGETS if t in targets),
                      expert_mlp=entry["expert_mlp"])
    if "name" in entry:
        given = entry["name"]
        if not isinstance(given, str) or not _SAFE_NAME.match(given):
            _fail(path, where, "name", f"not a safe identifier: {given!r}")
        if given != variant.name:
            _fail(path, where, "name", f"non-canonical name {given!r}; the axes give {variant.name!r} (or drop the key)")
    if not _SAFE_NAME.match(variant.name):  # cannot happen with the checks above; kept as the last guard
        _fail(path, where, None, f"derived name {variant.name!r} is not a safe identifier")
    return variant


def parse_spec(text: str, path: str | Path = "variants.toml") -> list[Variant]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path}: not valid TOML: {err}") from None
    for key in data:
        if key not in ("defaults", "variant"):
            _fail(path, "top level", key, "unknown table; expected [defaults] and [[variant]]")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        _fail(path, "top level", "defaults", "expected a [defaults] table")
    for key in defaults:
        if key not in AXES and key not in OPTIONS:
            _fail(path, "[defaults]", key, f"unknown key; allowed keys are {', '.join(AXES + OPTIONS)}")
    entries = data.get("variant", [])
    if not isinstance(entries, list) or not entries:
        _fail(path, "top level", "variant", "expected at least one [[variant]] table")
    variants: list[Variant] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        where = f"variant #{i + 1}"
        if not isinstance(entry, dict):
            _fail(path, where, None, "expected a table")
        merged = {**BUILTIN_DEFAULTS, **defaults, **entry}
        if "name" in entry:
            where += f" ({entry['name']!r})"
        variant = _validate_entry(path, where, merged)
        if variant.name in seen:
            _fail(path, f"variant #{i + 1} ({variant.name})", None, f"duplicates variant #{seen[variant.name] + 1}")
        seen[variant.name] = i
        variants.append(variant)
    return variants


def load_spec(path: str | Path) -> list[Variant]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"{path}: cannot read spec: {err.strerror}") from None
    return parse_spec(text, path)
