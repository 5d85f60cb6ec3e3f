"""The spec's axes: the values each may take, what each dtype and scale means, and the rule that
names a variant by its axes. Read by the spec validation (generator/), the typed Variant, the
registry, the argument checks and the tests; it imports nothing, so the generator can use it
without torch installed."""

DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")
ROUTINGS = ("mask", "index")
SCALES = ("none", "block128", "mx32")
# Quantise on permute: bf16/fp16/fp32 tokens in, float8_e4m3fn rows and their scales out (the scale
# formats of SCALE_FORMATS; their definitions are in docs/quantization.md).
QUANTIZES = ("none", "block128", "mx32", "rowwise")
QUANTIZABLE_DTYPES = ("bf16", "fp16", "fp32")
QUANTIZED_DTYPE = "fp8_e4m3"
TARGETS = ("triton", "nki")
MAX_PAD = 256
AXES = ("dtype", "routing", "probs", "scale", "quantize", "pad", "targets")
# Values every variant gets unless it or [defaults] says otherwise.
AXIS_DEFAULTS = {"probs": True, "scale": "none", "quantize": "none", "pad": 0, "targets": list(TARGETS)}

# Options: what a variant's modules offer beside its permutation. Not part of its name: two entries
# that differ only in options are the same variant.
#   expert_mlp  true: the Triton module has `expert_mlp`, the expert MLP with the permutation folded
#               into its GEMMs (permgen.layers.expert_mlp); bf16 tokens (torch._grouped_mm's dtype), or bf16
#               quantised rowwise (torch._scaled_grouped_mm's FP8 GEMMs, permgen.layers.fp8_mlp)
OPTIONS = ("expert_mlp",)
OPTION_DEFAULTS = {"expert_mlp": False}
EXPERT_MLP_DTYPES = ("bf16",)
EXPERT_MLP_QUANTIZES = ("none", "rowwise")

# The torch dtype (by attribute name) of each token dtype.
TOKEN_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                     "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# scale kind -> (token columns per scale, 0: the whole row; torch dtype name of the scales)
SCALE_FORMATS = {"block128": (128, "float32"), "mx32": (32, "uint8"), "rowwise": (0, "float32")}
PROB_DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Row numbers and route counts are int32 on every target.
MAX_ROWS = 2**31 - 1


def variant_name(axes: dict) -> str:
    """One fixed rule: [probs_][pad<P>_]<dtype>[_<scale>][_to_fp8e4m3_<quantize>]_<routing>, e.g.
    probs_pad128_fp8e4m3_block128_mask, probs_bf16_to_fp8e4m3_mx32_index."""
    parts = ["probs"] if axes["probs"] else []
    if axes["pad"]:
        parts.append(f"pad{axes['pad']}")
    parts.append(axes["dtype"].replace("_", ""))
    if axes["scale"] != "none":
        parts.append(axes["scale"])
    if axes.get("quantize", "none") != "none":
        parts += ["to", QUANTIZED_DTYPE.replace("_", ""), axes["quantize"]]
    parts.append(axes["routing"])
    return "_".join(parts)
