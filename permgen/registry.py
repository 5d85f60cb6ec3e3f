"""Find a generated variant by its axes: `permgen.get_kernel(target, **axes)`."""

from __future__ import annotations

import importlib

from . import contract

GENERATED = "permgen.generated"  # the package the generator writes (generated/ in the repository)
_LOOKUP_AXES = tuple(a for a in contract.AXES if a != "targets")
AXIS_DEFAULTS = {a: v for a, v in contract.AXIS_DEFAULTS.items() if a != "targets"}
AXIS_CHOICES = {"dtype": contract.DTYPES, "routing": contract.ROUTINGS, "scale": contract.SCALES,
                "quantize": contract.QUANTIZES}


def variants() -> dict:
    """Every generated variant: name -> its normalised spec entry."""
    return importlib.import_module(GENERATED).VARIANTS


def _check_target(target):
    if not isinstance(target, str) or target not in contract.TARGETS:
        raise ValueError(f"target must be {' or '.join(map(repr, contract.TARGETS))}, got {target!r}")


def _check_axis_values(axes):
    """Raise a ValueError naming the first axis whose value no variant can have."""
    for axis, choices in AXIS_CHOICES.items():
        if axis in axes and (not isinstance(axes[axis], str) or axes[axis] not in choices):
            raise ValueError(f"{axis} must be one of {', '.join(map(repr, choices))}, got {axes[axis]!r}")
    if "probs" in axes and not isinstance(axes["probs"], bool):
        raise ValueError(f"probs must be True or False, got {axes['probs']!r}")
    if "pad" in axes:
        pad = axes["pad"]
        if isinstance(pad, bool) or not isinstance(pad, int) or not (
                pad == 0 or (2 <= pad <= contract.MAX_PAD and pad & (pad - 1) == 0)):
            raise ValueError(f"pad must be 0 or a power of two from 2 to {contract.MAX_PAD}, got {pad!r}")
    scale = axes.get("scale", AXIS_DEFAULTS["scale"])
    if scale != "none" and axes["dtype"] not in contract.FP8_DTYPES:
        raise ValueError(f"scale {scale!r} needs an fp8 dtype ({', '.join(map(repr, contract.FP8_DTYPES))}), "
                         f"got dtype {axes['dtype']!r}; use scale='none'")
    quantize = axes.get("quantize", AXIS_DEFAULTS["quantize"])
    if quantize != "none" and (axes["dtype"] not in contract.QUANTIZABLE_DTYPES or scale != "none"):
        raise ValueError(f"quantize {quantize!r} needs a dtype in {', '.join(map(repr, contract.QUANTIZABLE_DTYPES))} "
                         f"and scale='none', got dtype {axes['dtype']!r}, scale {scale!r}")


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
