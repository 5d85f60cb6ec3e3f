"""permgen's generator: variants.toml + templates/ -> generated/."""

from .render import render_all, write_all
from .spec import SpecError, Variant, load_spec, parse_spec, variant_name

__all__ = ["SpecError", "Variant", "load_spec", "parse_spec", "render_all", "variant_name", "write_all"]
