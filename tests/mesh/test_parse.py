import pytest
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import EscaleTypeError, MeshError, create_mesh, parse_mesh_from_string
from flax_escale import mesh as fem
from flax_escale.mesh import parse_mesh_shape

NAMES = ("dp", "fsdp", "ep", "tp", "sp")


@pytest.mark.parametrize(
    ("text", "names", "expected"),
    [
        ("dp:2,tp:4", ("dp", "tp"), ((2, 4), ("dp", "tp"))),
        ("tp:4,dp:2", ("dp", "tp"), ((4, 2), ("tp", "dp"))),
        (" dp : 2 , tp: -1 ", ("dp", "tp"), ((2, -1), ("dp", "tp"))),
        ("2,4", ("data", "model"), ((2, 4), ("data", "model"))),
        ("1, -1, 1, 2, 1", NAMES, ((1, -1, 1, 2, 1), NAMES)),
    ],
)
def test_parse_mesh_shape(text, names, expected):
    assert parse_mesh_shape(text, names) == expected


def test_named_form_orders_mesh_axes_as_the_string():
    mesh = parse_mesh_from_string("tp:2,sp:1,fsdp:-1,ep:1,dp:1", NAMES)
    assert mesh.axis_names == ("tp", "sp", "fsdp", "ep", "dp")
    assert dict(mesh.shape) == {"tp": 2, "sp": 1, "fsdp": 4, "ep": 1, "dp": 1}


def test_positional_form_gives_the_same_mesh_as_create_mesh():
    assert parse_mesh_from_string("1,-1,1,2,1", NAMES) is create_mesh((1, -1, 1, 2, 1))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tp:2,fsdp:4", (1, 4, 1, 2, 1)),
        ("fsdp:-1", (1, -1, 1, 1, 1)),
        ("sp:1,tp:2,ep:1,fsdp:2,dp:2", (2, 2, 1, 2, 1)),  # every axis named: still NAMES' order
        ("2,2,1,2,1", (2, 2, 1, 2, 1)),
    ],
)
def test_partial_strings_give_absent_axes_size_one_in_the_order_of_names(text, expected):
    assert parse_mesh_shape(text, NAMES, partial=True) == (expected, NAMES)
    mesh = parse_mesh_from_string(text, NAMES, partial=True)
    assert mesh is create_mesh(expected)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tp:2,mp:4", r"unknown axis name 'mp' in token 'mp:4'; the axis names are \('dp', 'fsdp'"),
        ("tp:2,tp:4", r"axis name 'tp' is repeated in token 'tp:4'"),
        ("1,8", r"gives 2 sizes but there are 5 axis names"),  # positional: every size
        ("tp:2,8", r"token '8' is not of the form 'name:size'"),
    ],
)
def test_partial_strings_are_checked_as_strictly_otherwise(text, match):
    with pytest.raises(MeshError, match=match):
        parse_mesh_shape(text, NAMES, partial=True)


def test_partial_must_be_a_bool():
    with pytest.raises(EscaleTypeError, match=r"partial must be True or False, got str 'yes'"):
        parse_mesh_shape("tp:2", NAMES, partial="yes")


def test_mesh_kwargs_are_passed_on():
    mesh = parse_mesh_from_string("2,4", ("dp", "tp"), axis_types="explicit")
    assert [t.name for t in mesh.axis_types] == ["Explicit", "Explicit"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("dp:2,model:4", r"unknown axis name 'model' in token 'model:4'"),
        ("dp:8", r"does not give a size for axis names \('tp',\)"),
        ("dp:2,dp:4", r"axis name 'dp' is repeated in token 'dp:4'"),
        ("2,2,2", r"gives 3 sizes but there are 2 axis names"),
        ("dp:two,tp:4", r"size 'two' in token 'dp:two' is not an integer"),
        ("2,x", r"size 'x' in token 'x' is not an integer"),
        ("dp:2.5,tp:4", r"size '2.5' in token 'dp:2.5' is not an integer"),
        ("dp:2,4", r"token '4' is not of the form 'name:size'"),
        ("dp:2:3,tp:4", r"token 'dp:2:3' is not of the form 'name:size'"),
        (":2,tp:4", r"token ':2' is not of the form 'name:size'"),
        ("dp:2,,tp:4", r"token '' is not of the form 'name:size'"),
        ("", r"mesh string '' is empty; write 'name:size,...' such as 'dp:2,tp:4'"),
        ("dp:,tp:8", r"size '' in token 'dp:' is not an integer"),
    ],
)
def test_bad_strings_quote_the_offending_token(text, match):
    with pytest.raises(MeshError, match=match):
        parse_mesh_from_string(text, ("dp", "tp"))


# Each case in both modes: partial only lets named axes be left out, it checks nothing less.
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("dp:-1,fsdp:-1,ep:1,tp:2,sp:1", r"gives 2 sizes of -1; only one axis can take"),
        ("-1,-1,1,2,1", r"'-1,-1,1,2,1' gives 2 sizes of -1"),
        ("dp:1,fsdp:-2,ep:1,tp:1,sp:1", r"size -2 in token 'fsdp:-2' is not a positive integer"),
        ("1,-2,1,1,1", r"size -2 in token '-2' is not a positive integer"),
        (
            "dp:1,fsdp:0,ep:1,tp:1,sp:1",
            r"size 0 in token 'fsdp:0' is not a positive integer.*"
            r"an unused axis has size 1.*'dp:2,tp:4'",
        ),
        ("0,8,1,1,1", r"size 0 in token '0' is not a positive integer"),
        (
            "fsdp=4",
            r"size 'fsdp=4' in token 'fsdp=4' is not an integer \(write fsdp:4, with a "
            r"colon\); write 'name:size,...'",
        ),
        (
            "dp:1,fsdp=4",
            r"token 'fsdp=4' is not of the form 'name:size' \(write fsdp:4, with a "
            r"colon\)",
        ),
    ],
    ids=["two -1 named", "two -1", "-2 named", "-2", "0 named", "0", "= form", "= form mixed"],
)
def test_sizes_are_checked_in_every_mode(text, match, partial):
    with pytest.raises(MeshError, match=match):
        parse_mesh_shape(text, NAMES, partial=partial)


@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("text", ["fsdp:4", "4,2"], ids=["named", "positional"])
def test_names_are_checked_to_be_distinct_in_every_mode(text, partial):
    with pytest.raises(
        MeshError, match=r"names \('fsdp', 'tp', 'fsdp'\) name the axes \['fsdp'\] "
    ):
        parse_mesh_shape(text, ("fsdp", "tp", "fsdp"), partial=partial)


def test_device_count_mismatch_comes_from_create_mesh():
    with pytest.raises(MeshError, match=r"multiply to 4, but the mesh has 8 devices"):
        parse_mesh_from_string("dp:2,tp:2", ("dp", "tp"))


CASES = [
    case(
        lambda: fe.parse_mesh_from_string("dp:8", "dp"),
        T,
        "names",
        "'dp'",
        r"\('dp',\)",
        id="parse_mesh-names-string",
    ),
    case(
        lambda: fe.parse_mesh_from_string(None, ["dp"]),
        T,
        "axis_dims",
        "None",
        "'dp:2,tp:4'",
        id="parse_mesh-none",
    ),
    case(
        lambda: fe.parse_mesh_from_string(8, ["dp"]),
        T,
        "axis_dims",
        "int 8",
        "'dp:2,tp:4'",
        id="parse_mesh-int",
    ),
    case(
        lambda: fe.parse_mesh_from_string("dp:8", None),
        T,
        "names",
        "None",
        r"\('dp', 'tp'\)",
        id="parse_mesh-names-none",
    ),
    case(
        lambda: fe.parse_mesh_from_string(b"dp:8", ["dp"]),
        T,
        "axis_dims",
        "bytes b'dp:8'",
        "'dp:2,tp:4'",
        id="parse_mesh-bytes",
    ),
    case(
        lambda: fem.parse_mesh_shape("dp:8", "dp"),
        T,
        "names",
        "'dp'",
        r"pass \('dp',\)",
        id="parse_mesh_shape-names-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
