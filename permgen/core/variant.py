"""One variant: its axes, the rules they keep, and every fact derived from them, computed once.

The spec validation (generator/spec.py), the registry's lookup, both targets' host code, the ops,
the row maps and the templates' render context read a `Variant` instead of recomputing what an
axis means. This module imports no torch at load time (the generator uses it without torch); the
torch dtypes are looked up once, by `bind_torch`, when a variant's ops are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .axes import (AXES, AXIS_DEFAULTS, DTYPES, EXPERT_MLP_DTYPES, EXPERT_MLP_QUANTIZES, FP8_DTYPES, MAX_PAD,
                   OPTION_DEFAULTS, PROB_DTYPE_NAMES, QUANTIZABLE_DTYPES, QUANTIZED_DTYPE, QUANTIZES, ROUTINGS, SCALE_FORMATS, SCALES,
                   TARGETS, TOKEN_DTYPE_NAMES, variant_name)

# Every Variant made in this process, by name (a name is derived from the axes, so it is the identity):
# a row map names its variant, and its layout follows from the variant's routing.
_BY_NAME: dict = {}


def axis_error(axes: dict) -> Optional[tuple]:
    """(key, what is wrong) for the first axis value no variant can have, or None. `axes` holds
    every axis but name; targets and the options may be absent (the spec validation checks the
    targets list itself)."""
    for key, choices in (("dtype", DTYPES), ("routing", ROUTINGS), ("scale", SCALES), ("quantize", QUANTIZES)):
        value = axes[key]
        if not isinstance(value, str) or value not in choices:
            return key, f"expected one of {', '.join(map(repr, choices))}, got {value!r}"
    if not isinstance(axes["probs"], bool):
        return "probs", f"expected true or false, got {axes['probs']!r}"
    pad = axes["pad"]
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0 or pad > MAX_PAD or (pad and pad & (pad - 1)):
        return "pad", f"expected 0 or a power of two <= {MAX_PAD}, got {pad!r}"
    if pad == 1:
        return "pad", "pad = 1 pads nothing; write 0"
    if axes["quantize"] != "none":
        if axes["dtype"] not in QUANTIZABLE_DTYPES:
            return "quantize", (f"quantize {axes['quantize']!r} needs a dtype to quantise from "
                                f"({', '.join(QUANTIZABLE_DTYPES)}), got dtype {axes['dtype']!r}")
        if axes["scale"] != "none":
            return "quantize", (f"quantize {axes['quantize']!r} computes the scales; it cannot also move "
                                f"scale {axes['scale']!r} (write scale = \"none\")")
    if axes["scale"] != "none" and axes["dtype"] not in FP8_DTYPES:
        return "scale", (f"scale {axes['scale']!r} needs an fp8 dtype ({', '.join(FP8_DTYPES)}), "
                         f"got dtype {axes['dtype']!r}")
    expert_mlp = axes.get("expert_mlp", False)
    if not isinstance(expert_mlp, bool):
        return "expert_mlp", f"expected true or false, got {expert_mlp!r}"
    if expert_mlp and (axes["dtype"] not in EXPERT_MLP_DTYPES or axes["quantize"] not in EXPERT_MLP_QUANTIZES):
        return "expert_mlp", (f"the expert MLP takes {', '.join(EXPERT_MLP_DTYPES)} tokens, kept as they are (the "
                              "dtype of torch._grouped_mm) or quantised 'rowwise' (the scales torch._scaled_grouped_mm "
                              f"takes on Hopper), got dtype {axes['dtype']!r}"
                              + (f" quantised to {axes['quantize']!r}" if axes["quantize"] != "none" else ""))
    targets = axes.get("targets", TARGETS)  # (the spec checks the list itself)
    if expert_mlp and isinstance(targets, (list, tuple)) and "triton" not in targets:
        return "expert_mlp", "the expert MLP is a Triton module's; add \"triton\" to targets"
    return None


@dataclass(frozen=True)
class Variant:
    """The axes of one variant (checked: a ValueError names the first bad one) and what they imply."""

    dtype: str
    routing: str
    probs: bool = AXIS_DEFAULTS["probs"]
    scale: str = AXIS_DEFAULTS["scale"]
    pad: int = AXIS_DEFAULTS["pad"]
    targets: tuple = TARGETS
    quantize: str = AXIS_DEFAULTS["quantize"]
    expert_mlp: bool = OPTION_DEFAULTS["expert_mlp"]  # an option (permgen.core.axes.OPTIONS), not in the name

    def __post_init__(self):
        problem = axis_error(self.__dict__)
        if problem:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        scale_kind = self.scale if self.quantize == "none" else self.quantize
        derived = dict(
            name=variant_name(self.__dict__),
            mask=self.routing == "mask",
            is_fp8=self.dtype in FP8_DTYPES,  # tokens are fp8: moved as bytes, combined in bf16
            quantizes=self.quantize != "none",  # float8_e4m3fn rows and their scales out
            has_scale=self.scale != "none",  # moves scales with the rows
            scale_kind=scale_kind,  # the scales permute returns: moved, computed, or "none"
            makes_scale=scale_kind != "none",  # permute returns scales
            prob_columns="E" if self.routing == "mask" else "k",
            token_dtype_name=TOKEN_DTYPE_NAMES[self.dtype],
            combine_dtype_name="bfloat16" if self.dtype in FP8_DTYPES else TOKEN_DTYPE_NAMES[self.dtype],
            out_dtype_name=TOKEN_DTYPE_NAMES[QUANTIZED_DTYPE if self.quantize != "none" else self.dtype],
            scale_block=SCALE_FORMATS[scale_kind][0] if scale_kind != "none" else None,  # token columns per scale
            scale_dtype_name=SCALE_FORMATS[scale_kind][1] if scale_kind != "none" else None,
        )
        for key, value in derived.items():
            object.__setattr__(self, key, value)
        _BY_NAME.setdefault(self.name, self)

    @classmethod
    def of(cls, axes) -> "Variant":
        """The Variant of a normalised spec entry (a generated module's VARIANT), or the Variant itself."""
        if isinstance(axes, Variant):
            return axes
        known = _BY_NAME.get(axes.get("name"))
        if known is not None:
            return known
        targets = axes.get("targets", TARGETS)
        return cls(**{a: axes.get(a, AXIS_DEFAULTS.get(a)) for a in AXES if a != "targets"},
                   targets=tuple(t for t in TARGETS if t in targets),
                   **{o: axes.get(o, default) for o, default in OPTION_DEFAULTS.items()})

    @staticmethod
    def named(name: str) -> "Variant":
        """The Variant made in this process under this name (every generated module makes its own)."""
        return _BY_NAME[name]

    def axes(self) -> dict:
        """The normalised spec entry, as plain data (what generated modules export as VARIANT)."""
        return {"name": self.name, "dtype": self.dtype, "routing": self.routing, "probs": self.probs,
                "scale": self.scale, "pad": self.pad, "targets": list(self.targets), "quantize": self.quantize,
                "expert_mlp": self.expert_mlp}

    def scale_columns(self, hidden: int) -> int:
        """Columns of the scales of a row of `hidden` tokens."""
        return 1 if self.scale_block == 0 else -(-hidden // self.scale_block)

    def bind_torch(self) -> "Variant":
        """Look up the torch dtypes once (before any call is traced): token_dtype, combine_dtype,
        out_dtype, scale_dtype (None without scales) and prob_dtypes."""
        if "token_dtype" not in self.__dict__:
            import torch

            for key in ("token_dtype", "combine_dtype", "out_dtype", "scale_dtype"):
                name = getattr(self, key + "_name")
                object.__setattr__(self, key, None if name is None else getattr(torch, name))
            object.__setattr__(self, "prob_dtypes", tuple(getattr(torch, n) for n in PROB_DTYPE_NAMES))
        return self
