"""Top-k routing: the chosen experts, their weights, ties, and the load-balancing loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_escale as fe
from flax_escale.moe import Routing, route_top_k


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _random_logits(shape, seed=0) -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32) * 3


@pytest.mark.parametrize("top_k", [1, 2, 3, 8])
def test_weights_are_the_renormalized_probabilities_of_the_top_k(top_k):
    logits = _random_logits((4, 16, 8))
    routing = route_top_k(jnp.asarray(logits), top_k)
    assert isinstance(routing, Routing)
    assert routing.experts.shape == routing.weights.shape == (4, 16, top_k)
    assert routing.experts.dtype == jnp.int32
    assert routing.weights.dtype == jnp.float32
    assert routing.aux_loss.shape == ()
    weights = np.asarray(routing.weights)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-6)
    # Most probable first: the weights never increase along the choices.
    assert (np.diff(weights, axis=-1) <= 0).all()
    # Each weight is the softmax probability of its expert over the chosen ones' sum.
    probs = _softmax(logits.astype(np.float64))
    chosen = np.take_along_axis(probs, np.asarray(routing.experts), axis=-1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_the_experts_are_the_top_k_logits(top_k):
    logits = _random_logits((64, 8), seed=1)
    routing = route_top_k(jnp.asarray(logits), top_k)
    want = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    np.testing.assert_array_equal(np.asarray(routing.experts), want)
    # No chosen expert has a lower logit than one left out.
    experts = np.asarray(routing.experts)
    for row, chosen in zip(logits, experts, strict=True):
        left_out = np.setdiff1d(np.arange(8), chosen)
        assert row[chosen].min() >= row[left_out].max()


def test_ties_go_to_the_lower_expert_index():
    logits = jnp.array(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [2.0, 1.0, 2.0, 1.0, 2.0],
        ]
    )
    assert route_top_k(logits, 1).experts.tolist() == [[1], [0], [0]]
    assert route_top_k(logits, 2).experts.tolist() == [[1, 2], [0, 1], [0, 2]]
    assert route_top_k(logits, 3).experts.tolist() == [[1, 2, 4], [0, 1, 2], [0, 2, 4]]
    tied = route_top_k(logits, 3)
    np.testing.assert_allclose(np.asarray(tied.weights[1]), [1 / 3] * 3, rtol=1e-6)
    # The same under jit.
    jitted = jax.jit(route_top_k, static_argnums=1)(logits, 3)
    assert jitted.experts.tolist() == tied.experts.tolist()


def _one_hot_logits(experts: np.ndarray, num_experts: int) -> jnp.ndarray:
    """Logits whose softmax is exactly 1/k on each token's ``experts`` (k per token) and 0 off."""
    mask = np.zeros((len(experts), num_experts), bool)
    np.put_along_axis(mask, experts, True, axis=-1)
    return jnp.where(jnp.asarray(mask), 0.0, -jnp.inf)


@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_is_one_for_perfectly_balanced_routing(num_experts, top_k):
    tokens = 4 * num_experts
    # Token t goes to experts t, t+1, ... (mod E): every expert receives the same share of
    # assignments, and its mean probability is exactly 1/E.
    experts = (np.arange(tokens)[:, None] + np.arange(top_k)[None, :]) % num_experts
    routing = route_top_k(_one_hot_logits(experts, num_experts), top_k)
    # Each token's two experts tie: they come in index order.
    np.testing.assert_array_equal(np.asarray(routing.experts), np.sort(experts, axis=-1))
    assert float(routing.aux_loss) == 1.0


@pytest.mark.parametrize("num_experts", [4, 8])
def test_aux_loss_is_num_experts_when_every_token_goes_to_one_expert(num_experts):
    experts = np.full((24, 1), 2)
    routing = route_top_k(_one_hot_logits(experts, num_experts), 1)
    assert routing.experts.tolist() == [[2]] * 24
    assert float(routing.aux_loss) == float(num_experts)


def test_aux_loss_on_random_logits_is_the_formula():
    logits = _random_logits((2, 32, 8), seed=2)
    routing = route_top_k(jnp.asarray(logits), 2)
    probs = _softmax(logits.astype(np.float64)).reshape(-1, 8)
    chosen = np.argsort(-logits, axis=-1, kind="stable")[..., :2].reshape(-1)
    share = np.bincount(chosen, minlength=8) / chosen.size
    want = 8 * np.sum(share * probs.mean(axis=0))
    assert 1.0 <= want <= 8.0
    np.testing.assert_allclose(float(routing.aux_loss), want, rtol=1e-5)


@pytest.mark.parametrize(
    ("top_k", "shown", "error"),
    [
        (0, "0", fe.EscaleError),
        (5, "5", fe.EscaleError),
        (-1, "-1", fe.EscaleError),
        (True, "True", fe.EscaleTypeError),
        (2.0, "2.0", fe.EscaleTypeError),
        ("2", "'2'", fe.EscaleTypeError),
        (None, "None", fe.EscaleTypeError),
    ],
)
def test_top_k_must_be_an_int_from_one_to_the_number_of_experts(top_k, shown, error):
    with pytest.raises(
        error,
        match=(
            r"route_top_k: top_k must be an int from 1 to the number of experts \(4, the last "
            rf"dimension of logits \(3, 4\)\), got {shown}\."
        ),
    ):
        route_top_k(jnp.zeros((3, 4)), top_k)


def test_a_numpy_int_top_k_is_an_int():
    logits = jnp.asarray(_random_logits((6, 4)))
    assert (
        route_top_k(logits, np.int64(2)).experts.tolist() == route_top_k(logits, 2).experts.tolist()
    )


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (0, 0, 8)])
def test_aux_loss_of_no_tokens_is_zero_with_finite_gradients(shape):
    # The shares and mean probabilities of no tokens are 0 / 0: the loss was NaN.
    logits = jnp.zeros(shape)
    routing = route_top_k(logits, 2)
    assert routing.experts.shape == routing.weights.shape == (*shape[:-1], 2)
    assert routing.aux_loss.dtype == jnp.float32
    assert float(routing.aux_loss) == 0.0
    grad = jax.grad(lambda logits: route_top_k(logits, 2).aux_loss)(logits)
    assert grad.shape == shape
    # Through a router kernel, the gradient of the loss is a zero kernel, not NaN.
    kernel_grad = jax.grad(lambda w: route_top_k(jnp.zeros((*shape[:-1], 3)) @ w, 2).aux_loss)(
        jnp.ones((3, 8))
    )
    np.testing.assert_array_equal(np.asarray(kernel_grad), np.zeros((3, 8)))


@pytest.mark.parametrize(
    ("logits", "error", "match"),
    [
        (
            [[0.0, 1.0]],
            fe.EscaleTypeError,
            r"route_top_k: logits must be an array \(\.\.\., num_experts\), got list "
            r"\[\[0\.0, 1\.0\]\]; pass jnp\.asarray\(logits\)\.",
        ),
        (None, fe.EscaleTypeError, r"route_top_k: logits must be an array .*got None"),
        (
            jnp.float32(1.0),
            fe.EscaleError,
            r"route_top_k: logits must have a last dimension of one logit per expert, got the "
            r"scalar .*; pass \(\.\.\., num_experts\) logits\.",
        ),
    ],
)
def test_logits_must_be_an_array_with_a_dimension_of_experts(logits, error, match):
    with pytest.raises(error, match=match):
        route_top_k(logits, 1)
