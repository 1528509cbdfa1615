import re

import pytest
from flax import nnx

from flax_escale import EscaleError, EscaleTypeError, create_mesh, init_sharded, sharded_module
from flax_escale import _regex as user_patterns
from flax_escale._frontend import AxesPatterns
from flax_escale._regex import UserPattern

HM = ("hidden_state", "mlp_intermediate")
MH = ("mlp_intermediate", "hidden_state")


def test_compile_keeps_owner_and_entries_in_order():
    p = AxesPatterns.compile("MLP", {"wi/kernel": HM, "kernel": MH, "bias": ["mlp_intermediate"]})
    assert p.owner == "MLP"
    assert p.patterns == ("wi/kernel", "kernel", "bias")
    assert [(pattern, names) for pattern, _, names in p.entries] == [
        ("wi/kernel", HM),
        ("kernel", MH),
        ("bias", ("mlp_intermediate",)),
    ]
    assert all(isinstance(compiled, UserPattern) for _, compiled, _ in p.entries)


def test_names_are_stored_as_tuples_with_none_kept():
    p = AxesPatterns.compile("M", {"kernel": ["hidden_state", None]})
    assert p.entries[0][2] == ("hidden_state", None)
    assert isinstance(p.entries[0][2], tuple)
    assert p.match("kernel") == ("kernel", ("hidden_state", None))


@pytest.mark.parametrize("mapping", [None, {}])
def test_compile_none_or_empty_is_empty(mapping):
    p = AxesPatterns.compile("M", mapping)
    assert p.owner == "M"
    assert p.entries == ()
    assert p.patterns == ()
    assert p.match("kernel") is None


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("kernel", "kernel", True),
        ("kernel", "wi/kernel", True),
        ("kernel", "block/wi/kernel", True),
        ("kernel", "xkernel", False),
        ("kernel", "wi/xkernel", False),
        ("kernel", "kernel/x", False),
        ("kernel", "kernels", False),
        ("wi/kernel", "wi/kernel", True),
        ("wi/kernel", "block/wi/kernel", True),
        ("wi/kernel", "xwi/kernel", False),
        ("wi/kernel", "block/xwi/kernel", False),
        ("wi/kernel", "kernel", False),
        ("wi/kernel", "wi/bias", False),
        ("i/kernel", "wi/kernel", False),
        ("w[io]/kernel", "wi/kernel", True),
        ("w[io]/kernel", "block/wo/kernel", True),
        ("w[io]/kernel", "wx/kernel", False),
        (r"layer_\d+/kernel", "layer_0/kernel", True),
        (r"layer_\d+/kernel", "stack/layer_12/kernel", True),
        (r"layer_\d+/kernel", "layer_x/kernel", False),
        (r"layer_\d+/kernel", "xlayer_1/kernel", False),
        ("kernel|bias", "dense/bias", True),
        ("kernel|bias", "dense/scale", False),
        ("(query|key)/kernel", "attn/key/kernel", True),
        ("(query|key)/kernel", "attn/value/kernel", False),
    ],
)
def test_matches_whole_trailing_components(pattern, path, matches):
    p = AxesPatterns.compile("M", {pattern: ("a",)})
    expected = (pattern, ("a",)) if matches else None
    assert p.match(path) == expected


def test_first_match_wins_in_declaration_order():
    specific_first = AxesPatterns.compile("M", {"wi/kernel": HM, "kernel": MH})
    assert specific_first.match("wi/kernel") == ("wi/kernel", HM)
    assert specific_first.match("wo/kernel") == ("kernel", MH)

    general_first = AxesPatterns.compile("M", {"kernel": MH, "wi/kernel": HM})
    assert general_first.match("wi/kernel") == ("kernel", MH)
    assert general_first.match("block/wi/kernel") == ("kernel", MH)


def test_then_puts_own_entries_before_fallback():
    child = AxesPatterns.compile("Child", {"wi/kernel": HM, "bias": ("mlp_intermediate",)})
    parent = AxesPatterns.compile("Parent", {"kernel": MH, "wi/kernel": ("x", "y")})
    combined = child.then(parent)
    assert combined.owner == "Child"
    assert combined.patterns == ("wi/kernel", "bias", "kernel", "wi/kernel")
    assert combined.entries == child.entries + parent.entries
    assert combined.match("wi/kernel") == ("wi/kernel", HM)
    assert combined.match("wo/kernel") == ("kernel", MH)
    assert combined.match("wo/bias") == ("bias", ("mlp_intermediate",))
    # Neither operand changes.
    assert child.patterns == ("wi/kernel", "bias")
    assert parent.patterns == ("kernel", "wi/kernel")

    reversed_order = parent.then(child)
    assert reversed_order.owner == "Parent"
    assert reversed_order.match("wi/kernel") == ("kernel", MH)


def test_then_with_empty_fallback_or_empty_self():
    p = AxesPatterns.compile("M", {"kernel": MH})
    empty = AxesPatterns.compile("E", None)
    assert p.then(empty).entries == p.entries
    assert empty.then(p).patterns == ("kernel",)
    assert empty.then(p).owner == "E"


def test_match_array_checks_rank():
    p = AxesPatterns.compile("MLP", {"kernel": MH})
    assert p.match_array("wi/kernel", (4, 8), shown_path="x", stack_hint="h") == ("kernel", MH)
    assert p.match_array("wi/bias", (8,), shown_path="x", stack_hint="h") is None
    with pytest.raises(EscaleError) as info:
        p.match_array(
            "wi/kernel", (2, 4, 8), shown_path="params/wi/kernel", stack_hint="stacked layers"
        )
    message = str(info.value)
    assert message.startswith("MLP: parameter 'params/wi/kernel' of shape (2, 4, 8) matches")
    assert "pattern 'kernel'" in message
    assert "name 2 dimensions instead of 3" in message
    assert message.endswith("(stacked layers).")


@pytest.mark.parametrize(
    "mapping",
    [
        [("kernel", HM)],
        "kernel",
        ("kernel", HM),
        42,
    ],
)
def test_non_mapping_is_a_type_error(mapping):
    with pytest.raises(
        EscaleTypeError, match=r"MLP: logical_axes must map parameter-path patterns"
    ):
        AxesPatterns.compile("MLP", mapping)


def test_non_mapping_is_also_a_builtin_type_error():
    with pytest.raises(TypeError):
        AxesPatterns.compile("MLP", [("kernel", HM)])


@pytest.mark.parametrize("pattern", [1, None, ("wi", "kernel")])
def test_non_string_pattern(pattern):
    with pytest.raises(EscaleTypeError, match=r"MLP: pattern .* must be a string"):
        AxesPatterns.compile("MLP", {"kernel": HM, pattern: HM})


@pytest.mark.parametrize(
    "names",
    [
        "hidden_state",
        "",
        ("hidden_state", 3),
        ["hidden_state", ("fsdp", "tp")],
        None,
        7,
    ],
)
def test_bad_names(names):
    with pytest.raises(
        EscaleTypeError, match=r"MLP: the logical axes of pattern 'kernel' must be a tuple"
    ):
        AxesPatterns.compile("MLP", {"kernel": names})


def test_names_as_plain_string_quotes_the_value():
    with pytest.raises(EscaleTypeError, match=r"got 'hidden_state'\.$"):
        AxesPatterns.compile("MLP", {"kernel": "hidden_state"})


@pytest.mark.parametrize("pattern", ["ker(nel", "w[io/kernel", "*kernel", "kernel)"])
def test_invalid_regex(pattern):
    with pytest.raises(EscaleError) as info:
        AxesPatterns.compile("MyModule", {"bias": ("a",), pattern: HM})
    message = str(info.value)
    assert message.startswith(f"MyModule: pattern {pattern!r} is not a valid regular expression")
    assert not isinstance(info.value, EscaleTypeError)


def test_inline_flags_are_a_valid_pattern():
    assert re.compile("(?i)kernel").fullmatch("KERNEL")
    p = AxesPatterns.compile("M", {"(?i)kernel": ("a",)})
    assert p.match("wi/KERNEL") == ("(?i)kernel", ("a",))


def test_invalid_regex_position_refers_to_the_pattern():
    with pytest.raises(re.error) as expected:
        re.compile("ker(nel")
    assert expected.value.pos == 3
    with pytest.raises(EscaleError, match=r"at position 3\b"):
        AxesPatterns.compile("M", {"ker(nel": ("a",)})


# --- a pattern that backtracks past the bound is an error, on every front end's surface --------

SLOW, LONG = "(a|aa)+", "a" * 200 + "b"


def test_a_pattern_past_the_bound_is_an_error_naming_owner_pattern_path_and_bound(monkeypatch):
    monkeypatch.setattr(user_patterns, "MATCH_SECONDS", 0.05)
    p = AxesPatterns.compile("MLP", {SLOW: HM})
    said = re.escape(f"MLP: the pattern {SLOW!r} took over 0.05 s against '{'a' * 200}b")
    with pytest.raises(EscaleError, match=said):
        p.match(f"{LONG}/kernel")
    with pytest.raises(EscaleError, match=said):
        p.match_array(f"{LONG}/kernel", (4, 4), shown_path="x", stack_hint="")


class _Wide(nnx.Module):
    def __init__(self, rngs):
        setattr(self, LONG, nnx.Linear(8, 8, rngs=rngs))


@pytest.mark.parametrize("surface", ["sharded_module", "overrides"])
def test_nnx_patterns_past_the_bound_are_an_error(monkeypatch, surface):
    monkeypatch.setattr(user_patterns, "MATCH_SECONDS", 0.05)
    mesh = create_mesh((1, 8, 1, 1, 1))
    declared, kwargs = _Wide, {"overrides": {SLOW: (None, None)}}
    if surface == "sharded_module":
        declared = sharded_module({SLOW: (None, None)})(type("SlowWide", (_Wide,), {}))
        kwargs = {}
    with pytest.raises(EscaleError, match=re.escape(f"the pattern {SLOW!r} took over 0.05 s")):
        init_sharded(declared, mesh, 0, **kwargs)
