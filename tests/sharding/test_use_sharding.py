"""Tests of ``use_sharding`` (``flax_escale/sharding/_use_sharding.py``): the mesh and rules of a
block, per thread, as Flax and JAX see them; the mistakes it refuses.
"""

import contextlib
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints
from support.mistakes import MISTAKE, T, case, enter, mesh5, mesh_dp_tp, raises_a_library_error

import flax_escale as fe
from flax_escale import (
    EscaleError,
    NoMeshError,
    PartitionAxis,
    ShardingCorrectionWarning,
    ShardingResolutionError,
    constrain,
    create_mesh,
    logical_to_mesh_axes,
    use_sharding,
    with_sharding_constraint,
)
from flax_escale.mesh import current_mesh
from flax_escale.resolve import as_logical_rules

AXIS_TYPES = ["auto", "explicit"]
RULES = [("batch", ("fsdp", "dp")), ("hidden_state", "tp"), ("mlp_intermediate", ["fsdp", "sp"])]


def _mesh(axis_types="auto"):
    return create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)


def _current_rules():
    return tuple(nn.get_logical_axis_rules())


def test_sets_mesh_and_rules_and_yields_frozen_rules(devices):
    mesh = _mesh()
    with use_sharding(mesh, RULES) as rules:
        assert rules == (
            ("batch", ("fsdp", "dp")),
            ("hidden_state", "tp"),
            ("mlp_intermediate", ("fsdp", "sp")),
        )
        assert rules == as_logical_rules(RULES)
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
        assert _current_rules() == rules


def test_default_rules_are_partition_axis_rules(devices):
    mesh = _mesh()
    with use_sharding(mesh) as rules:
        assert rules == PartitionAxis().logical_axis_rules()
        assert _current_rules() == rules
        assert nn.logical_to_mesh_axes(("batch", "hidden_state")) == P(("fsdp", "dp"), "tp")


def test_partition_axis_is_translated(devices):
    mesh = _mesh()
    paxis = PartitionAxis(hidden_state_axis="fsdp", mlp_intermediate_axis="tp")
    with use_sharding(mesh, paxis) as rules:
        assert rules == as_logical_rules(paxis)
        assert rules == paxis.logical_axis_rules()
        assert ("hidden_state", "fsdp") in rules
        assert _current_rules() == rules
        assert logical_to_mesh_axes(("hidden_state", "mlp_intermediate")) == P("fsdp", "tp")


def test_defaults_to_the_rules_already_set(devices):
    mesh = _mesh()
    outer = (("hidden_state", "sp"),)
    with nn.logical_axis_rules(outer), use_sharding(mesh) as rules:
        assert rules == outer
        assert _current_rules() == outer


def test_restores_mesh_and_rules_on_exit(devices):
    mesh = _mesh()
    before_mesh = jax.sharding.get_abstract_mesh()
    before_rules = _current_rules()
    with use_sharding(mesh, RULES):
        pass
    assert jax.sharding.get_abstract_mesh() == before_mesh
    assert _current_rules() == before_rules
    assert jax.sharding.get_abstract_mesh() != mesh.abstract_mesh


def test_restores_on_exception(devices):
    mesh = _mesh()
    before_mesh = jax.sharding.get_abstract_mesh()
    before_rules = _current_rules()
    with pytest.raises(RuntimeError, match="boom"), use_sharding(mesh, RULES):
        raise RuntimeError("boom")
    assert jax.sharding.get_abstract_mesh() == before_mesh
    assert _current_rules() == before_rules


def test_nested_contexts_restore_the_outer_one(devices):
    outer_mesh = _mesh()
    inner_mesh = create_mesh((2, 4), ("dp", "tp"))
    inner_rules = (("hidden_state", "tp"),)
    with use_sharding(outer_mesh, RULES) as outer_rules:
        with use_sharding(inner_mesh, inner_rules):
            assert jax.sharding.get_abstract_mesh() == inner_mesh.abstract_mesh
            assert _current_rules() == inner_rules
        assert jax.sharding.get_abstract_mesh() == outer_mesh.abstract_mesh
        assert _current_rules() == outer_rules


def test_axes_the_mesh_lacks_go_to_none_for_flax(devices):
    mesh = create_mesh((2, 4), ("dp", "tp"))
    rules = [("batch", ("fsdp", "dp")), ("embed", "tp"), ("heads", "sp"), ("kv", None)]
    with contextlib.ExitStack() as stack:
        with pytest.warns(
            ShardingCorrectionWarning,
            match=r"the rules \[\('batch', \('fsdp', 'dp'\)\), \('heads', 'sp'\)\] name mesh "
            r"axes \['fsdp', 'sp'\] that the mesh \{'dp': 2, 'tp': 4\} lacks",
        ):
            frozen = stack.enter_context(use_sharding(mesh, rules))
        assert frozen == (("batch", ("fsdp", "dp")), ("embed", "tp"), ("heads", "sp"), ("kv", None))
        assert _current_rules() == (("batch", None), ("embed", "tp"), ("heads", None), ("kv", None))
        # Flax's own resolution no longer names axes the mesh lacks.
        assert nn.logical_to_mesh_axes(("batch", "heads", "embed")) == P(None, None, "tp")


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_constrain_under_jit(devices, axis_types):
    mesh = _mesh(axis_types)
    x = jnp.arange(32.0).reshape(8, 4)

    def f(x):
        return constrain(x * 2, ("batch", "hidden_state"))

    with use_sharding(mesh):
        jitted = jax.jit(f)
        y = jitted(x)
        text = jitted.lower(x).as_text()
    # Explicit axes put open constraints ([{}, {}]) of their own in the program: look for ours,
    # in which size-1 Explicit axes (dp) are left out.
    ours = '[{"fsdp"}, {"tp"}]' if axis_types == "explicit" else '[{"fsdp", "dp"}, {"tp"}]'
    assert (ours, "8x4xf32") in sharding_constraints(text)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", "tp")), 2)
    assert y.addressable_shards[0].data.shape == (2, 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_constrain_under_jit_uses_the_given_rules(devices, axis_types):
    mesh = _mesh(axis_types)
    x = jnp.ones((8, 4))

    @jax.jit
    def f(x):
        return constrain(x + 1, ("hidden_state", "mlp_intermediate"))

    with use_sharding(mesh, [("hidden_state", "tp"), ("mlp_intermediate", "fsdp")]):
        y = f(x)
        text = f.lower(x).as_text()
    assert ('[{"tp"}, {"fsdp"}]', "8x4xf32") in sharding_constraints(text)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("tp", "fsdp")), 2)
    assert y.addressable_shards[0].data.shape == (4, 1)


def test_explicit_mesh_puts_sharding_in_the_type(devices):
    mesh = _mesh("explicit")
    assert all(t == AxisType.Explicit for t in mesh.axis_types)
    x = jnp.ones((8, 4))
    seen = {}

    @jax.jit
    def f(x):
        y = constrain(x * 3, ("batch", "hidden_state"))
        seen["spec"] = jax.typeof(y).sharding.spec
        return y

    with use_sharding(mesh):
        y = f(x)
    # dp has size 1: in a type it would count as a split (a reduction over it is refused).
    assert seen["spec"] == P("fsdp", "tp")
    assert y.sharding.spec == P("fsdp", "tp")
    np.testing.assert_array_equal(np.asarray(y), np.full((8, 4), 3.0))


def test_without_use_sharding_constrain_does_nothing(devices):
    x = jnp.ones((8, 4))
    f = jax.jit(lambda x: constrain(x * 2, ("batch", "hidden_state")))
    assert "sharding_constraint" not in f.lower(x).as_text()
    y = f(x)
    assert y.addressable_shards[0].data.shape == (8, 4)


def test_flax_with_logical_constraint_takes_effect_on_auto_mesh(devices):
    mesh = _mesh("auto")
    x = jnp.arange(32.0).reshape(8, 4)

    @jax.jit
    def f(x):
        return nn.with_logical_constraint(x * 2, ("batch", "hidden_state"))

    with use_sharding(mesh):
        y = f(x)
        text = f.lower(x).as_text()
    assert sharding_constraints(text) == [('[{"fsdp", "dp"}, {"tp"}]', "8x4xf32")]
    assert y.addressable_shards[0].data.shape == (2, 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_flax_with_logical_constraint_on_a_mesh_lacking_axes(devices):
    # Default rules name fsdp and sp, which this mesh lacks: Flax must not fail on them.
    mesh = create_mesh((2, 4), ("dp", "tp"))
    x = jnp.ones((8, 8))

    @jax.jit
    def f(x):
        return nn.with_logical_constraint(x, ("batch", "hidden_state"))

    with contextlib.ExitStack() as stack:
        with pytest.warns(ShardingCorrectionWarning, match=r"mesh axes \['ep', 'fsdp', 'sp'\]"):
            stack.enter_context(use_sharding(mesh))
        y = f(x)
    assert y.addressable_shards[0].data.shape == (8, 2)
    with pytest.raises(ShardingResolutionError, match=r"lacks.*strict=True"):
        use_sharding(mesh, strict=True).__enter__()


def test_flax_module_inside(devices):
    mesh = _mesh("auto")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, use_bias=False)(x)
            return nn.with_logical_constraint(x, ("batch", "mlp_intermediate"))

    x = jnp.ones((8, 4))
    model = Block()
    variables = model.init(jax.random.key(0), x)
    with use_sharding(mesh):
        y = jax.jit(model.apply)(variables, x)
    assert y.shape == (8, 16)
    assert y.addressable_shards[0].data.shape == (2, 8)
    expected = np.asarray(x) @ np.asarray(variables["params"]["Dense_0"]["kernel"])
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-6)


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_a_function_jitted_once_follows_the_rules_in_force_at_each_call(devices, axis_types):
    mesh = _mesh(axis_types)
    training = [("batch", "fsdp"), ("hidden_state", "tp")]
    decoding = [("batch", None), ("hidden_state", "fsdp")]
    step = jax.jit(lambda x: constrain(x, ("batch", "hidden_state")))
    x = jnp.ones((8, 4))
    specs = []
    for rules in (training, decoding, training):
        with use_sharding(mesh, rules):
            specs.append(step(x).sharding.spec)
    assert specs == [P("fsdp", "tp"), P(None, "fsdp"), P("fsdp", "tp")]


def test_one_context_object_can_be_entered_again(devices):
    mesh = _mesh()
    context = use_sharding(mesh, RULES)
    with context as outer:
        with context as inner:
            assert inner == outer == as_logical_rules(RULES)
        assert nn.get_logical_axis_rules() != ()
    with context:
        assert jax.sharding.get_abstract_mesh().shape == mesh.shape
    assert nn.get_logical_axis_rules() == ()


@pytest.mark.parametrize("jitted", [False, True], ids=["placed", "in jit"])
def test_an_unconstrained_dimension_gives_up_the_axis_another_dimension_takes(devices, jitted):
    # On Explicit axes UNCONSTRAINED keeps the array's axes; the fsdp the spec moves to the
    # second dimension cannot stay on the first, which is said (nothing left to a compiler).
    mesh = create_mesh((1, 8, 1, 1, 1), axis_types="explicit")
    x = jax.device_put(
        np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("fsdp"))
    )

    def move(a, strict=False):
        return with_sharding_constraint(a, P(P.UNCONSTRAINED, "fsdp"), strict=strict)

    with use_sharding(mesh):
        with pytest.warns(
            ShardingCorrectionWarning,
            match=r"(?s)mesh axes P\(UNCONSTRAINED, 'fsdp'\) with shape \(8, 8\) on mesh .* "
            r"corrected to P\(None, 'fsdp'\):\n  - dimension 0: it is "
            r"PartitionSpec\.UNCONSTRAINED, which on (Explicit mesh axes|an array placed "
            r"outside jax\.jit) keeps the array's "
            r"axes there \('fsdp'\): nothing is left to the compiler; but the spec gives "
            r"\('fsdp',\) to another dimension",
        ):
            y = (jax.jit(move) if jitted else move)(x)
        with pytest.raises(ShardingResolutionError, match=r"(?s)UNCONSTRAINED.*strict=True"):
            (jax.jit(move, static_argnums=1) if jitted else move)(x, True)
    assert y.sharding.spec == P(None, "fsdp")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("jitted", [False, True], ids=["placed", "in jit"])
def test_constrain_with_an_unconstrained_dimension_that_loses_its_axis_says_so(devices, jitted):
    mesh = create_mesh((1, 4, 1, 2, 1), axis_types="explicit")
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, P("tp")))

    def move(a):
        return constrain(a, (P.UNCONSTRAINED, "hidden_state"))  # hidden_state -> tp

    with (
        use_sharding(mesh),
        pytest.warns(
            ShardingCorrectionWarning,
            match=r"(?s)logical axes \(UNCONSTRAINED, 'hidden_state'\).*dimension 0 "
            r"\(UNCONSTRAINED\): it is PartitionSpec\.UNCONSTRAINED.*gives \('tp',\) to another",
        ),
    ):
        y = (jax.jit(move) if jitted else move)(x)
    assert y.sharding.spec == P(None, "tp")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_an_unconstrained_dimension_that_keeps_its_axes_is_not_a_correction(devices, axis_types):
    mesh = create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("tp")))
    with use_sharding(mesh):  # filterwarnings=error: a warning fails
        y = jax.jit(lambda a: with_sharding_constraint(a, P(P.UNCONSTRAINED, "fsdp")))(x)
    if axis_types == "explicit":
        assert y.sharding.spec == P("tp", "fsdp")  # the first dimension keeps its tp
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


# --- threads: the context is per thread, as JAX's and Flax's are ------------------------------


def _run_threads(*targets):
    """Runs each target in its own thread; the exceptions they raised, by thread index."""
    failures = {}

    def guarded(index, target):
        try:
            target()
        except BaseException as error:  # reported to the test, not lost
            failures[index] = error

    threads = [
        threading.Thread(target=guarded, args=(i, t), name=f"worker-{i}")
        for i, t in enumerate(targets)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a thread did not finish (a barrier left waiting)"
    return failures


def test_one_object_entered_by_two_threads_keeps_each_threads_own_context(devices):
    shared = _mesh()
    outer = {0: create_mesh((1, 2, 1, 4, 1)), 1: create_mesh((1, 8, 1, 1, 1))}
    context = use_sharding(shared, RULES)
    both_inside, first_left, seen = threading.Barrier(2), threading.Barrier(2), {}

    def thread(index):
        with jax.set_mesh(outer[index]):
            context.__enter__()
            both_inside.wait()  # both threads inside the one object
            seen[index, "inside"] = (current_mesh(), _current_rules())
            if index == 0:  # thread 0 leaves first, while thread 1 is still inside
                context.__exit__(None, None, None)
                seen[0, "left"] = (current_mesh(), _current_rules())
                first_left.wait()
            else:
                first_left.wait()
                seen[1, "still inside"] = (current_mesh(), _current_rules())
                context.__exit__(None, None, None)
                seen[1, "left"] = (current_mesh(), _current_rules())

    assert _run_threads(lambda: thread(0), lambda: thread(1)) == {}
    rules = as_logical_rules(RULES)
    assert seen[0, "inside"] == seen[1, "inside"] == seen[1, "still inside"] == (shared, rules)
    assert seen[0, "left"] == (outer[0], ())
    assert seen[1, "left"] == (outer[1], ())


def test_a_thread_started_inside_use_sharding_has_no_mesh_and_constraints_say_so(devices):
    mesh, x = _mesh(), jnp.ones((8, 4))
    found = {}

    def step():
        with pytest.raises(NoMeshError, match=r"The context is per thread"):
            current_mesh()
        with pytest.warns(
            ShardingCorrectionWarning,
            match=r"constrain: no mesh is set in this thread \('worker-0'\), so the constraint "
            r"does nothing, while use_sharding is open in thread 'MainThread' on the mesh "
            r"\{'dp': 1, 'fsdp': 4, 'ep': 1, 'tp': 2, 'sp': 1\}\. The mesh and the rules are "
            r"set per thread .* Enter use_sharding\(mesh, rules\) in this thread too, or pass "
            r"mesh=",
        ):
            found["constrain"] = jax.jit(lambda x: constrain(x, ("batch", "hidden_state")))(x)
        with pytest.warns(ShardingCorrectionWarning, match=r"with_sharding_constraint: no mesh"):
            found["wsc"] = with_sharding_constraint(x, P("fsdp"))
        with pytest.raises(ShardingResolutionError, match=r"no mesh is set in this thread.*strict"):
            constrain(x, ("batch", "hidden_state"), strict=True)

    with use_sharding(mesh):
        assert _run_threads(step) == {}
    assert found["constrain"].sharding.is_fully_replicated
    assert found["wsc"].sharding.is_fully_replicated
    # With use_sharding open nowhere, no mesh means a single device, as in Flax: no warning.
    assert _run_threads(lambda: constrain(x, ("batch", "hidden_state"))) == {}


def test_a_thread_entering_the_same_object_gets_the_mesh_and_rules(devices):
    mesh, x = _mesh("explicit"), jnp.arange(32.0).reshape(8, 4)
    context = use_sharding(mesh, RULES)
    worker_inside, main_checked, found = threading.Barrier(2), threading.Barrier(2), {}

    def step():
        with context:
            worker_inside.wait()
            main_checked.wait()  # the main thread checked its own entry meanwhile
            found["y"] = jax.jit(lambda x: constrain(x * 2, ("batch", "hidden_state")))(x)

    with context:
        thread = threading.Thread(target=lambda: _run_threads(step) or found.setdefault("ok", 1))
        thread.start()
        worker_inside.wait()
        found["main"] = (current_mesh(), _current_rules())
        main_checked.wait()
        thread.join(timeout=120)
        found["main after"] = (current_mesh(), _current_rules())
    assert found["ok"] == 1
    assert found["main"] == found["main after"] == (mesh, as_logical_rules(RULES))
    assert found["y"].sharding.spec == P("fsdp", "tp")
    np.testing.assert_array_equal(np.asarray(found["y"]), np.asarray(x) * 2)
    with pytest.raises(NoMeshError):
        current_mesh()


def test_exiting_in_a_thread_that_did_not_enter_is_refused(devices):
    context = use_sharding(_mesh())
    with context:
        failures = _run_threads(lambda: context.__exit__(None, None, None))
        assert current_mesh().shape == _mesh().shape  # the main thread's entry is untouched
    assert isinstance(failures[0], EscaleError)
    assert "use_sharding: this context is not entered in this thread ('worker-0')" in str(
        failures[0]
    )


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: enter(fe.use_sharding(mesh_dp_tp(), "batch")),
        T,
        "rules",
        "'batch'",
        r"pairs",
        id="use_sharding-rules-string",
    ),
    # --- a wrong type where a mesh is expected ---------------------------------------------
    case(
        lambda: enter(fe.use_sharding(None)),
        T,
        "mesh",
        "None",
        r"create_mesh\(",
        id="use_sharding-none",
    ),
    case(
        lambda: enter(fe.use_sharding("dp:8")),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="use_sharding-string",
    ),
    case(
        lambda: enter(fe.use_sharding({"dp": 2, "tp": 4})),
        T,
        "mesh",
        "dict",
        r"create_mesh\(",
        id="use_sharding-dict",
    ),
    # --- malformed rules, named where they enter -------------------------------------------
    case(
        lambda: enter(fe.use_sharding(mesh_dp_tp(), [("batch", ("dp", 3))])),
        T,
        "rules",
        "('batch', ('dp', 3))",
        "a name",
        id="use_sharding-rule-tuple-with-int",
    ),
    # --- the sharding layer: transfers, trees of specs, constraints, optimizer state -------
    case(
        lambda: enter(fe.use_sharding(mesh5(), strict="yes")),
        T,
        "strict",
        "'yes'",
        "True or False",
        id="use_sharding-strict-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


def test_constraints_inside_use_sharding_are_told_about_absent_axes(devices):
    mesh = fe.create_mesh((2, 4), ("dp", "tp"))
    x = jnp.ones((8, 8))
    # Given explicitly, the rule naming fsdp (absent) is corrected with a warning...
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"mesh axis 'fsdp' is not in the mesh"):
        direct = fe.constrain(x, ("batch", "hidden_state"), mesh=mesh)
    # ...and inside use_sharding the same spec comes with the warning on entering.
    context = fe.use_sharding(mesh)
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"name mesh axes \['ep', 'fsdp', 'sp'\]"):
        context.__enter__()
    try:
        inside = fe.constrain(x, ("batch", "hidden_state"))
    finally:
        context.__exit__(None, None, None)
    assert direct.sharding.spec == inside.sharding.spec == P(None, "tp")
