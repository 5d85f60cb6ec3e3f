"""permgen: Mixture-of-Experts token permutation kernels generated from one spec.

    import permgen
    kernels = permgen.get_kernel("triton", dtype="bf16", routing="mask", probs=True)
    result = kernels.permute(tokens, routing_map, probs, num_out_tokens=n * k)

`permgen.VARIANTS` lists the generated variants (name -> axes). The generated kernels are the
package `permgen.generated` (the repository's generated/ folder); this package is the runtime
they share. TransformerEngine's functions (`permgen.moe_permute`, `moe_unpermute`, ...; see
permgen.integrations.te) dispatch to the generated variants. Importing permgen is cheap: torch is loaded only
when a result type, a kernel or one of those functions is used.
"""

import importlib
import importlib.abc
import importlib.util
import os
import re
import sys

# The oldest torch permgen supports: pyproject.toml's requirement (tests/test_package.py keeps the two equal).
MIN_TORCH = (2, 11)


def _refuse_an_older_torch():
    """Name an installed torch older than MIN_TORCH now, rather than let it fail later inside an op.
    The version is read from torch/version.py: importing torch takes seconds, its metadata tens of ms."""
    version = getattr(sys.modules.get("torch"), "__version__", None)
    if version is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return  # no torch yet: the first call that needs it raises ModuleNotFoundError
        try:
            with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as file:
                found = re.search(r"^__version__(?:\s*:\s*str)?\s*=\s*['\"]([^'\"]+)", file.read(), re.M)
        except OSError:
            found = None
        if found is None:
            return  # a torch without a release's version.py (a source build in progress): nothing to compare
        version = found.group(1)
    if tuple(int(part) for part in re.findall(r"\d+", version)[:2]) < MIN_TORCH:
        minimum = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"permgen needs torch >= {minimum}; this environment has torch {version}. "
                          f"Upgrade it: pip install --upgrade 'torch>={minimum}'")


_refuse_an_older_torch()

from .core import axes, contract  # noqa: E402
from .core.registry import GENERATED, find_variant, get_kernel  # noqa: E402

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

# The modules' paths before the runtime was split into subpackages by role: old -> new, so that
# `import permgen.te` or `from permgen import nki_emulator` keeps working. Each gives the new
# module object itself (imported only when the old name is), and names under an old package name
# (permgen.nki_emulator.testing) follow it.
MOVED = {"variant": "core.variant", "axes": "core.axes", "contract": "core.contract", "results": "core.results",
         "registry": "core.registry", "ops": "core.ops",
         "triton_host": "triton.host", "triton_kernels": "triton.kernels", "triton_gemm": "triton.gemm",
         "triton_fp8": "triton.fp8",
         "nki_host": "nki.host", "nki_kernels": "nki.kernels", "nki_a2av": "nki.a2av", "neuron_ops": "nki.custom_ops",
         "nki_emulator": "nki.emulator",
         "expert_mlp": "layers.expert_mlp", "fp8_gemm": "layers.fp8_mlp", "te": "integrations.te"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as the module at its new name."""

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != __name__ or parts[1] not in MOVED:
            return None
        new = ".".join((__name__, MOVED[parts[1]], *parts[2:]))
        if importlib.util.find_spec(new) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        parts = spec.name.split(".")
        module = importlib.import_module(".".join((__name__, MOVED[parts[1]], *parts[2:])))
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # The import system has set the old name's spec on the module, already run: its own goes back.
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

# TransformerEngine's function names (permgen.integrations.te), loaded with torch on first use.
TE_FUNCTIONS = ("moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
                "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs")

__all__ = ["VARIANTS", "PermuteResult", "RowIdMap", "axes", "contract", "find_variant", "get_kernel", *TE_FUNCTIONS]


def __getattr__(name):
    if name == "VARIANTS":
        from .core.registry import variants
        return variants()
    if name in ("PermuteResult", "RowIdMap"):
        from .core import results
        return getattr(results, name)
    if name in MOVED:  # as if the old module had been imported: permgen.te
        return importlib.import_module(f"{__name__}.{name}")
    if name in TE_FUNCTIONS:
        from .integrations import te
        function = globals()[name] = getattr(te, name)  # kept: later calls skip this lookup
        return function
    raise AttributeError(f"module 'permgen' has no attribute {name!r}")
