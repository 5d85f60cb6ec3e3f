"""Find a generated variant by its axes: `permgen.get_kernel(target, **axes)`."""

from __future__ import annotations

import importlib

from . import axes
from .variant import axis_error

GENERATED = "permgen.generated"  # the package the generator writes (generated/ in the repository)
_LOOKUP_AXES = tuple(a for a in axes.AXES if a != "targets")
AXIS_DEFAULTS = {a: v for a, v in axes.AXIS_DEFAULTS.items() if a != "targets"}
AXIS_CHOICES = {"dtype": axes.DTYPES, "routing": axes.ROUTINGS, "scale": axes.SCALES,
                "quantize": axes.QUANTIZES}


def variants() -> dict:
    """Every generated variant: name -> its normalised spec entry."""
    return importlib.import_module(GENERATED).VARIANTS


def _check_target(target):
    if not isinstance(target, str) or target not in axes.TARGETS:
        raise ValueError(f"target must be {' or '.join(map(repr, axes.TARGETS))}, got {target!r}")


def _check_axis_values(axes):
    """Raise a ValueError naming the first axis whose value no variant can have (the spec's rules,
    permgen.core.variant.axis_error)."""
    problem = axis_error({**AXIS_DEFAULTS, **axes})
    if problem:
        key, message = problem
        raise ValueError(f"{key}: {message}")


def find_variant(target, **axes) -> str:
    """The name of the variant with exactly these axes (unset axes take AXIS_DEFAULTS) for `target`.

    TypeError for unknown or missing axes, ValueError for a value the spec does not allow,
    LookupError (naming the nearest variants and the [[variant]] to add) when none is generated.
    """
    _check_target(target)
    unknown = sorted(set(axes) - set(_LOOKUP_AXES))
    if unknown:
        raise TypeError(f"unknown axes {unknown}; the axes are {list(_LOOKUP_AXES)}")
    missing = [a for a in ("dtype", "routing") if a not in axes]
    if missing:
        raise TypeError(f"give at least dtype and routing; missing {missing}")
    _check_axis_values(axes)
    wanted = {**AXIS_DEFAULTS, **axes}
    known = variants()
    for name, spec in known.items():
        if all(spec[a] == wanted[a] for a in _LOOKUP_AXES) and target in spec["targets"]:
            return name

    def distance(spec):
        return sum(spec[a] != wanted[a] for a in _LOOKUP_AXES) + (target not in spec["targets"])

    nearest = sorted(known, key=lambda n: (distance(known[n]), n))[:3]
    entry = "\n".join(f"{a} = {wanted[a]!r}".replace("True", "true").replace("False", "false").replace("'", '"')
                      for a in _LOOKUP_AXES)
    raise LookupError(
        f"no generated {target} variant has {wanted}. Nearest: {', '.join(nearest)}. "
        f"To add it, append to variants.toml:\n\n[[variant]]\n{entry}\ntargets = [\"{target}\"]\n\n"
        f"then run `make generate`.")


def get_kernel(target, **axes):
    """The generated module for `target` ('triton' or 'nki') whose variant has these axes."""
    _check_target(target)
    name = find_variant(target, **axes)
    return importlib.import_module(f"{GENERATED}.{target}.{name}")
