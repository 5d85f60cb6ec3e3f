"""variants.toml validation and variant naming.

Every malformed spec must fail with a SpecError whose message names the file, the place in the
spec (the variant, [defaults] or the top level) and the offending key.
"""

import itertools
import json
import keyword
import re
from pathlib import Path

import pytest

from generator.spec import (
    DTYPES,
    FP8_DTYPES,
    QUANTIZABLE_DTYPES,
    QUANTIZES,
    MAX_PAD,
    ROUTINGS,
    SCALES,
    TARGETS,
    SpecError,
    Variant,
    load_spec,
    parse_spec,
    variant_name,
)

SPEC_PATH = "specs/team_variants.toml"  # a path that is not the default, so the message must use it

GOOD_PADS = [0] + [2**i for i in range(1, MAX_PAD.bit_length())]
CANONICAL = re.compile(
    r"^(?P<probs>probs_)?(?:pad(?P<pad>\d+)_)?(?P<dtype>bf16|fp16|fp32|fp8e4m3|fp8e5m2)"
    r"(?:_(?P<scale>block128|mx32))?(?:_to_fp8e4m3_(?P<quantize>block128|mx32|rowwise))?_(?P<routing>mask|index)$"
)


def toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: same escapes
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def spec_text(*variants, defaults=None, extra=""):
    """A spec with a [defaults] table (when given) and one [[variant]] table per dict."""
    lines = []
    if defaults is not None:
        lines.append("[defaults]")
        lines += [f"{k} = {toml_value(v)}" for k, v in defaults.items()]
        lines.append("")
    for variant in variants:
        lines.append("[[variant]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in variant.items()]
        lines.append("")
    return "\n".join(lines) + extra


def spec_error(text) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(text, SPEC_PATH)
    message = str(info.value)
    assert message.startswith(f"{SPEC_PATH}: "), message
    return message


def assert_names(message, where, key):
    assert where in message, message
    if key is not None:
        assert f"key '{key}'" in message, message


def valid_matrix():
    """Every valid combination of axes (targets aside)."""
    for dtype, routing, probs, pad in itertools.product(DTYPES, ROUTINGS, (False, True), GOOD_PADS):
        for scale in SCALES if dtype in FP8_DTYPES else ("none",):
            yield dict(dtype=dtype, routing=routing, probs=probs, scale=scale, pad=pad)
        for quantize in QUANTIZES[1:] if dtype in QUANTIZABLE_DTYPES else ():
            yield dict(dtype=dtype, routing=routing, probs=probs, scale="none", quantize=quantize, pad=pad)


# ---------------------------------------------------------------------------------------------
# Valid specs
# ---------------------------------------------------------------------------------------------

def test_builtin_defaults_fill_unset_axes():
    (v,) = parse_spec(spec_text(dict(dtype="bf16", routing="mask")), SPEC_PATH)
    assert v == Variant(dtype="bf16", routing="mask", probs=True, scale="none", pad=0, targets=("triton", "nki"))
    assert v.name == "probs_bf16_mask"


def test_defaults_table_then_variant_override():
    text = spec_text(
        dict(routing="index"),
        dict(routing="mask", probs=True, targets=["triton"]),
        defaults=dict(dtype="fp8_e4m3", probs=False, scale="mx32", pad=32, targets=["nki"]),
    )
    first, second = parse_spec(text, SPEC_PATH)
    assert first == Variant("fp8_e4m3", "index", False, "mx32", 32, ("nki",))
    assert second == Variant("fp8_e4m3", "mask", True, "mx32", 32, ("triton",))


def test_targets_are_normalised_to_a_fixed_order():
    (v,) = parse_spec(spec_text(dict(dtype="bf16", routing="mask", targets=["nki", "triton"])), SPEC_PATH)
    assert v.targets == TARGETS
    assert v.axes()["targets"] == list(TARGETS)


def test_canonical_name_key_is_accepted():
    (v,) = parse_spec(spec_text(dict(name="pad128_fp8e4m3_block128_mask", dtype="fp8_e4m3", routing="mask",
                                     probs=False, scale="block128", pad=128)), SPEC_PATH)
    assert v.name == "pad128_fp8e4m3_block128_mask"


def test_the_repository_spec_loads():
    variants = load_spec(Path(__file__).resolve().parent.parent / "variants.toml")
    assert variants and len({v.name for v in variants}) == len(variants)


def test_axes_is_the_normalised_entry():
    v = Variant("fp8_e5m2", "index", True, "block128", 16, ("triton",))
    assert v.axes() == {"name": "probs_pad16_fp8e5m2_block128_index", "dtype": "fp8_e5m2", "routing": "index",
                        "probs": True, "scale": "block128", "pad": 16, "targets": ["triton"], "quantize": "none",
                        "expert_mlp": False}


@pytest.mark.parametrize("pad", GOOD_PADS)
def test_every_good_pad_is_accepted(pad):
    (v,) = parse_spec(spec_text(dict(dtype="bf16", routing="index", pad=pad)), SPEC_PATH)
    assert v.pad == pad


# ---------------------------------------------------------------------------------------------
# Unknown keys and tables
# ---------------------------------------------------------------------------------------------

def test_unknown_key_in_a_variant():
    msg = spec_error(spec_text(dict(dtype="bf16", routing="mask"), dict(dtype="bf16", routing="index", dtyp="x")))
    assert_names(msg, "variant #2", "dtyp")
    assert "unknown key" in msg and "dtype" in msg  # lists the allowed keys


def test_unknown_key_in_a_named_variant_names_it():
    msg = spec_error(spec_text(dict(name="bf16_index", dtype="bf16", routing="index", probs=False, colour="red")))
    assert_names(msg, "variant #1 ('bf16_index')", "colour")


def test_unknown_key_in_defaults():
    msg = spec_error(spec_text(dict(dtype="bf16", routing="mask"), defaults=dict(pads=16)))
    assert_names(msg, "[defaults]", "pads")
    assert "unknown key" in msg


def test_name_is_not_a_default():
    msg = spec_error(spec_text(dict(dtype="bf16", routing="mask"), defaults=dict(name="probs_bf16_mask")))
    assert_names(msg, "[defaults]", "name")


@pytest.mark.parametrize("extra", ["\n[kernels]\nfoo = 1\n", "\n[[variants]]\ndtype = \"bf16\"\n"])
def test_unknown_top_level_table(extra):
    key = "kernels" if "kernels" in extra else "variants"
    msg = spec_error(spec_text(dict(dtype="bf16", routing="mask"), extra=extra))
    assert_names(msg, "top level", key)
    assert "unknown table" in msg


def test_unknown_top_level_key():
    msg = spec_error('dtype = "bf16"\n' + spec_text(dict(dtype="bf16", routing="mask")))
    assert_names(msg, "top level", "dtype")


def test_defaults_must_be_a_table():
    msg = spec_error("[[defaults]]\npad = 0\n\n" + spec_text(dict(dtype="bf16", routing="mask")))
    assert_names(msg, "top level", "defaults")


# ---------------------------------------------------------------------------------------------
# Missing and bad values
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["dtype", "routing"])
def test_missing_required_axis(missing):
    entry = dict(dtype="bf16", routing="mask")
    del entry[missing]
    msg = spec_error(spec_text(dict(dtype="fp16", routing="index"), entry))
    assert_names(msg, "variant #2", missing)
    assert "missing" in msg


@pytest.mark.parametrize("key, value", [
    ("dtype", "bfloat16"), ("dtype", "fp8"), ("dtype", 16), ("dtype", ["bf16"]), ("dtype", "BF16"),
    ("routing", "topk"), ("routing", True), ("routing", ""),
    ("scale", "block64"), ("scale", "None"), ("scale", 128),
])
def test_bad_choice_values(key, value):
    entry = dict(dtype="fp8_e4m3", routing="mask")
    entry[key] = value
    msg = spec_error(spec_text(entry))
    assert_names(msg, "variant #1", key)
    assert "expected one of" in msg and repr(value) in msg


def test_bad_value_from_defaults_is_reported_for_the_variant():
    msg = spec_error(spec_text(dict(routing="mask"), defaults=dict(dtype="int8")))
    assert_names(msg, "variant #1", "dtype")
    assert "'int8'" in msg


@pytest.mark.parametrize("value", [1, 0, "true", "yes", [True]])
def test_probs_must_be_a_bool(value):
    msg = spec_error(spec_text(dict(dtype="bf16", routing="mask", probs=value)))
    assert_names(msg, "variant #1", "probs")
    assert "true or false" in msg


@pytest.mark.parametrize("pad", [3, 6, 96, 100, -4, -1, MAX_PAD * 2, 1024, True, False, 16.0, "16", 1])
def test_bad_pad(pad):
    msg = spec_error(spec_text(dict(dtype="bf16", routing="mask", pad=pad)))
    assert_names(msg, "variant #1", "pad")
    if pad == 1 and not isinstance(pad, bool):
        assert "write 0" in msg
    else:
        assert f"power of two <= {MAX_PAD}" in msg


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("scale", ["block128", "mx32"])
def test_scale_needs_an_fp8_dtype(dtype, scale):
    msg = spec_error(spec_text(dict(dtype=dtype, routing="mask", scale=scale)))
    assert_names(msg, "variant #1", "scale")
    assert "fp8" in msg and repr(dtype) in msg


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("quantize", ["block128", "mx32"])
def test_quantize_needs_a_dtype_to_quantise_from(dtype, quantize):
    msg = spec_error(spec_text(dict(dtype=dtype, routing="index", quantize=quantize)))
    assert_names(msg, "variant #1", "quantize")
    assert "bf16" in msg and repr(dtype) in msg


def test_quantize_computes_the_scales_it_cannot_also_move_them():
    msg = spec_error(spec_text(dict(dtype="bf16", routing="index", quantize="mx32", scale="mx32")))
    assert_names(msg, "variant #1", "quantize")
    assert "scale = \"none\"" in msg


@pytest.mark.parametrize("value", ["block64", "fp8", True, "None"])
def test_quantize_values(value):
    assert_names(spec_error(spec_text(dict(dtype="bf16", routing="index", quantize=value))), "variant #1", "quantize")


def test_rowwise_on_both_targets():
    (v,) = parse_spec(spec_text(dict(dtype="bf16", routing="index", quantize="rowwise")), SPEC_PATH)
    assert v.name == "probs_bf16_to_fp8e4m3_rowwise_index" and v.scale_columns(7168) == 1
    assert v.targets == ("triton", "nki")


def test_rowwise_expert_mlp_is_the_triton_modules():
    """The FP8 expert MLP is an extra of a rowwise variant's Triton module: with both targets the NKI module
    is the plain quantising permutation; without the Triton target the spec refuses the option."""
    (v,) = parse_spec(spec_text(dict(dtype="bf16", routing="index", quantize="rowwise", pad=16, expert_mlp=True)),
                      SPEC_PATH)
    assert v.expert_mlp and v.targets == ("triton", "nki")
    msg = spec_error(spec_text(dict(dtype="bf16", routing="index", quantize="rowwise", targets=["nki"],
                                    expert_mlp=True)))
    assert_names(msg, "variant #1", "expert_mlp")
    assert "the expert MLP is a Triton module's; add \"triton\" to targets" in msg, msg


@pytest.mark.parametrize("targets, words", [
    ([], "non-empty list"),
    ("triton", "non-empty list"),
    (["cuda"], "expected one of"),
    (["triton", "rocm"], "expected one of"),
    ([1], "expected one of"),
    (["triton", "triton"], "twice"),
    (["nki", "triton", "nki"], "twice"),
])
def test_bad_targets(targets, words):
    msg = spec_error(spec_text(dict(dtype="bf16", routing="mask", targets=targets)))
    assert_names(msg, "variant #1", "targets")
    assert words in msg


def test_bad_targets_in_defaults():
    msg = spec_error(spec_text(dict(dtype="bf16", routing="mask"), defaults=dict(targets=[])))
    assert_names(msg, "variant #1", "targets")


# ---------------------------------------------------------------------------------------------
# Names and duplicates
# ---------------------------------------------------------------------------------------------

def test_duplicate_variants():
    text = spec_text(dict(dtype="bf16", routing="mask"), dict(dtype="fp16", routing="mask"),
                     dict(dtype="bf16", routing="mask", probs=True, pad=0))
    msg = spec_error(text)
    assert "variant #3 (probs_bf16_mask)" in msg and "duplicates variant #1" in msg


def test_duplicate_variants_with_different_targets():
    # One name, one file per target: two entries may not share axes even if their targets differ.
    text = spec_text(dict(dtype="bf16", routing="mask", targets=["triton"]),
                     dict(dtype="bf16", routing="mask", targets=["nki"]))
    msg = spec_error(text)
    assert "variant #2 (probs_bf16_mask)" in msg and "duplicates variant #1" in msg


def test_duplicate_through_defaults():
    text = spec_text(dict(dtype="bf16", routing="mask"), dict(dtype="bf16", routing="mask", probs=False),
                     defaults=dict(probs=False))
    msg = spec_error(text)
    assert "variant #2 (bf16_mask)" in msg and "duplicates variant #1" in msg


@pytest.mark.parametrize("given", [
    "bf16_mask",  # probs is on by default
    "probs_bf16_index",
    "probs_mask_bf16",
    "mask_bf16_probs",
    "probs_bf16_mask_v2",
])
def test_non_canonical_name(given):
    msg = spec_error(spec_text(dict(name=given, dtype="bf16", routing="mask")))
    assert_names(msg, f"variant #1 ({given!r})", "name")
    assert "non-canonical" in msg and "'probs_bf16_mask'" in msg


@pytest.mark.parametrize("given", [
    "../x", "../../etc/passwd", "a-b", "import os", "x; import os", "probs_bf16_mask\nimport os",
    'probs_bf16_mask"; import os; "', "Probs_bf16_mask", "_probs_bf16_mask", "1bf16", "", "probs.bf16",
    "/tmp/probs_bf16_mask", "probs_bf16_mask ",
])
def test_unsafe_name(given):
    msg = spec_error(spec_text(dict(name=given, dtype="bf16", routing="mask")))
    assert_names(msg, "variant #1", "name")
    assert "not a safe identifier" in msg


@pytest.mark.parametrize("given", [3, True, ["probs_bf16_mask"]])
def test_name_must_be_a_string(given):
    msg = spec_error(spec_text(dict(name=given, dtype="bf16", routing="mask")))
    assert_names(msg, "variant #1", "name")


# ---------------------------------------------------------------------------------------------
# Files that are not specs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "[[variant]]\ndtype = bf16\n",  # unquoted string
    "[[variant]\ndtype = \"bf16\"\n",
    "[[variant]]\ndtype = \"bf16\nrouting = \"mask\"\n",
    "[[variant]]\ndtype: \"bf16\"\n",
])
def test_invalid_toml(text):
    msg = spec_error(text)
    assert "not valid TOML" in msg
    assert "line" in msg  # tomllib says where


def test_duplicate_toml_keys():
    msg = spec_error('[[variant]]\ndtype = "bf16"\nrouting = "mask"\ndtype = "fp16"\n')
    assert "not valid TOML" in msg


def test_duplicate_defaults_table():
    msg = spec_error('[defaults]\npad = 0\n[defaults]\npad = 16\n[[variant]]\ndtype = "bf16"\nrouting = "mask"\n')
    assert "not valid TOML" in msg


@pytest.mark.parametrize("text", ["", "# nothing yet\n", "[defaults]\ndtype = \"bf16\"\n", "variant = []\n",
                                  "variant = 3\n"])
def test_no_variants(text):
    msg = spec_error(text)
    assert_names(msg, "top level", "variant")
    assert "at least one [[variant]]" in msg


def test_variant_entry_not_a_table():
    msg = spec_error("variant = [1]\n")
    assert "variant #1" in msg and "expected a table" in msg


def test_load_spec_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value) and "cannot read spec" in str(info.value)


def test_load_spec_names_the_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(spec_text(dict(dtype="bf16", routing="mask", pad=3)))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: variant #1, key 'pad'")


# ---------------------------------------------------------------------------------------------
# Naming
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("axes, name", [
    (dict(dtype="fp8_e4m3", routing="mask", probs=True, scale="block128", pad=128), "probs_pad128_fp8e4m3_block128_mask"),
    (dict(dtype="bf16", routing="index", probs=False, scale="none", pad=0), "bf16_index"),
    (dict(dtype="bf16", routing="mask", probs=True, scale="none", pad=0), "probs_bf16_mask"),
    (dict(dtype="fp16", routing="index", probs=False, scale="none", pad=64), "pad64_fp16_index"),
    (dict(dtype="fp8_e5m2", routing="index", probs=False, scale="mx32", pad=0), "fp8e5m2_mx32_index"),
    (dict(dtype="fp32", routing="mask", probs=True, scale="none", pad=2), "probs_pad2_fp32_mask"),
    (dict(dtype="bf16", routing="index", probs=True, scale="none", quantize="block128", pad=0),
     "probs_bf16_to_fp8e4m3_block128_index"),
    (dict(dtype="bf16", routing="mask", probs=False, scale="none", quantize="mx32", pad=32),
     "pad32_bf16_to_fp8e4m3_mx32_mask"),
])
def test_canonical_name_examples(axes, name):
    assert variant_name(Variant(targets=TARGETS, **axes)) == name


def test_targets_are_not_part_of_the_name():
    a = Variant("bf16", "mask", True, "none", 0, ("triton",))
    b = Variant("bf16", "mask", True, "none", 0, ("triton", "nki"))
    assert a.name == b.name


def test_whole_matrix_names_are_distinct_canonical_identifiers():
    matrix = list(valid_matrix())
    assert len(matrix) == 3 * 2 * 2 * 3 * len(GOOD_PADS) + 3 * len(QUANTIZES[1:]) * 2 * 2 * len(GOOD_PADS)
    names = {}
    for axes in matrix:
        name = variant_name(Variant(**{"targets": TARGETS, **axes}))
        assert name.isidentifier() and not keyword.iskeyword(name), name
        assert name == name.lower() and not name.startswith("_"), name
        m = CANONICAL.match(name)
        assert m, name
        # The rule can be read back: the name alone recovers every axis.
        assert bool(m["probs"]) == axes["probs"]
        assert int(m["pad"] or 0) == axes["pad"]
        assert m["dtype"] == axes["dtype"].replace("_", "")
        assert (m["scale"] or "none") == axes["scale"]
        assert (m["quantize"] or "none") == axes.get("quantize", "none")
        assert m["routing"] == axes["routing"]
        assert name not in names, f"{name} from both {names.get(name)} and {axes}"
        names[name] = axes


def test_whole_matrix_as_one_spec():
    """All valid combinations in one file: accepted, no duplicates, and each name= key matches."""
    entries = [dict(name=variant_name(Variant(**{"targets": TARGETS, **axes})), **axes) for axes in valid_matrix()]
    variants = parse_spec(spec_text(*entries), SPEC_PATH)
    assert [v.name for v in variants] == [e["name"] for e in entries]
    assert len({v.name for v in variants}) == len(variants)


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

def test_expert_mlp_option_is_not_in_the_name():
    (v,) = parse_spec(spec_text(dict(dtype="bf16", routing="index", expert_mlp=True)), SPEC_PATH)
    assert v.expert_mlp and v.name == "probs_bf16_index"
    (w,) = parse_spec(spec_text(dict(dtype="bf16", routing="index")), SPEC_PATH)
    assert not w.expert_mlp and w.name == v.name


def test_expert_mlp_in_defaults():
    variants = parse_spec(spec_text(dict(dtype="bf16", routing="index"), dict(dtype="bf16", routing="mask",
                                                                               expert_mlp=False),
                                    defaults=dict(expert_mlp=True)), SPEC_PATH)
    assert [v.expert_mlp for v in variants] == [True, False]


@pytest.mark.parametrize("entry, words", [
    (dict(dtype="fp16", routing="index", expert_mlp=True), "takes bf16"),
    (dict(dtype="fp8_e4m3", routing="index", expert_mlp=True), "takes bf16"),
    (dict(dtype="bf16", routing="index", quantize="mx32", expert_mlp=True), "quantised"),
    (dict(dtype="bf16", routing="index", expert_mlp="yes"), "expected true or false"),
    (dict(dtype="bf16", routing="index", targets=["nki"], expert_mlp=True), "Triton module"),
])
def test_expert_mlp_bad_values(entry, words):
    msg = spec_error(spec_text(entry))
    assert_names(msg, "variant #1", "expert_mlp")
    assert words in msg, msg


def test_two_entries_differing_only_in_options_are_one_variant():
    msg = spec_error(spec_text(dict(dtype="bf16", routing="index"), dict(dtype="bf16", routing="index",
                                                                          expert_mlp=True)))
    assert "duplicates variant #1" in msg
