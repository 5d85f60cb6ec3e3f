"""permgen: Mixture-of-Experts token permutation kernels generated from one spec.

    import permgen
    kernels = permgen.get_kernel("triton", dtype="bf16", routing="mask", probs=True)
    result = kernels.permute(tokens, routing_map, probs, num_out_tokens=n * k)

`permgen.VARIANTS` lists the generated variants (name -> axes). The generated kernels are the
package `permgen.generated` (the repository's generated/ folder); this package is the runtime
they share. Importing it is cheap: torch is loaded only when a result type or kernel is used.
"""

from . import contract
from .registry import find_variant, get_kernel

__all__ = ["VARIANTS", "PermuteResult", "RowIdMap", "contract", "find_variant", "get_kernel"]


def __getattr__(name):
    if name == "VARIANTS":
        from .registry import variants
        return variants()
    if name in ("PermuteResult", "RowIdMap"):
        from . import results
        return getattr(results, name)
    raise AttributeError(f"module 'permgen' has no attribute {name!r}")
