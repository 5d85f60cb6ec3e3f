"""permgen: Mixture-of-Experts token permutation kernels generated from one spec.

    import permgen
    kernels = permgen.get_kernel("triton", dtype="bf16", routing="mask", probs=True)
    result = kernels.permute(tokens, routing_map, probs, num_out_tokens=n * k)

`permgen.VARIANTS` lists the generated variants (name -> axes). The generated kernels are the
package `permgen.generated` (the repository's generated/ folder); this package is the runtime
they share. TransformerEngine's functions (`permgen.moe_permute`, `moe_unpermute`, ...; see
permgen.te) dispatch to the generated variants. Importing permgen is cheap: torch is loaded only
when a result type, a kernel or one of those functions is used.
"""

import importlib.util
import os
import sys

from . import axes, contract
from .registry import GENERATED, find_variant, get_kernel

# pyproject.toml's version, written here so that importing permgen reads no package metadata
# (tests/test_package.py keeps the two equal).
__version__ = "0.1.0"


def _serve_checkout_kernels():
    """An installed wheel (or editable install) has permgen.generated; a source checkout used
    without installing keeps the generated kernels in ../generated: serve them under that name."""
    if importlib.util.find_spec(GENERATED) is not None:
        return
    init = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "generated", "__init__.py")
    if not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location(GENERATED, init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[GENERATED] = module
    spec.loader.exec_module(module)
    globals()["generated"] = module  # as the import system binds a loaded submodule on its parent


_serve_checkout_kernels()

# TransformerEngine's function names (permgen.te), loaded with torch on first use.
TE_FUNCTIONS = ("moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
                "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs")

__all__ = ["VARIANTS", "PermuteResult", "RowIdMap", "axes", "contract", "find_variant", "get_kernel", *TE_FUNCTIONS]


def __getattr__(name):
    if name == "VARIANTS":
        from .registry import variants
        return variants()
    if name in ("PermuteResult", "RowIdMap"):
        from . import results
        return getattr(results, name)
    if name in TE_FUNCTIONS:
        from . import te
        function = globals()[name] = getattr(te, name)  # kept: later calls skip this lookup
        return function
    raise AttributeError(f"module 'permgen' has no attribute {name!r}")
