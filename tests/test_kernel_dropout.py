"""Attention dropout in the Pallas kernels (interpreter on CPU).

The keep decision is a counter-based hash of (seed, b, n, i, j), so the kernels,
the reference and `pallas_attn.dropout_keep_mask` must agree exactly on the mask,
for every tiling, in the forward and in every backward kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import (
    OTHER_BLOCKS,
    SMALL_BLOCKS,
    assert_bitwise_equal,
    assert_close,
    assert_empty_rows,
    assert_results_close,
    empty_rows,
    make_inputs,
    make_runner,
    max_error,
    oracle,
    pallas_and_reference,
    random_bias,
    run,
    to_numpy,
)
from kernel_helpers import keep_mask as jitted_keep_mask

import pallas_attn

F32 = jnp.float32


def keep_mask(rng, shapes: dict, rate: float, broadcast: bool = False) -> np.ndarray:
    return jitted_keep_mask(rng, batch=shapes["B"], num_heads=shapes["N"], q_len=shapes["T"],
                            kv_len=shapes["S"], rate=rate, broadcast_batch_heads=broadcast)


# Masks per (batch entry, head) and one shared by all, each with a bias (its gradient
# through the dropped probabilities too), under GQA and bottom-right causal masking.
DROPOUT_CASES = [
    ("rate0.1_gqa_bias", 0.1, False, True),
    ("rate0.5_broadcast_bias", 0.5, True, True),
]


@pytest.mark.parametrize("rate,broadcast,with_bias", [c[1:] for c in DROPOUT_CASES],
                         ids=[c[0] for c in DROPOUT_CASES])
def test_dropout_matches_reference_and_manual_mask(rate, broadcast, with_bias):
    """Kernel out, lse and all gradients equal the reference with the same rng, and a
    float64 computation that applies pallas_attn.dropout_keep_mask by hand."""
    shapes = dict(B=2, T=40, S=23, N=4, K=2, H=16, Hv=8)
    inputs = make_inputs(int(rate * 10) + broadcast, **shapes)
    rng = jax.random.key(int(rate * 100))
    kwargs = dict(dropout_rate=rate, broadcast_dropout=broadcast, is_causal=True,
                  causal_alignment="bottom_right")
    bias = random_bias(5, (1, 4, 40, 23)) if with_bias else None
    arrays = {"dropout_rng": rng}
    kernel, reference = pallas_and_reference(inputs, bias=bias, arrays=arrays, **kwargs)
    keep = keep_mask(rng, shapes, rate, broadcast)
    exact = oracle(inputs, bias=bias, arrays=arrays, keep=keep, **kwargs)
    assert_results_close(kernel, reference, F32, label="vs reference: ")
    assert_results_close(kernel, exact, F32, label="vs float64 with the keep mask: ")
    assert_empty_rows(kernel, empty_rows(exact))
    # The mask matters: without it the output is far from the kernel's.
    undropped = oracle(inputs, bias=bias, arrays=arrays, **kwargs)
    assert max_error(kernel["out"], undropped["out"]) > 0.1
    if broadcast:
        assert (keep == keep[:1, :1]).all()
    else:
        assert not (keep[0, 0] == keep[1, 3]).all()


def test_same_rng_is_identical_and_different_rngs_differ():
    shapes = dict(B=1, T=20, S=23, N=2, K=1, H=16)
    inputs = make_inputs(91, **shapes)
    fn = make_runner("pallas", dropout_rate=0.3, is_causal=True)
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["ct"], inputs["ct_lse"], None)
    first = to_numpy(fn(*args, {"dropout_rng": jax.random.key(7)}))
    again = to_numpy(fn(*args, {"dropout_rng": jax.random.key(7)}))
    other = to_numpy(fn(*args, {"dropout_rng": jax.random.key(8)}))
    assert_bitwise_equal(first, again)
    np.testing.assert_array_equal(first["lse"], other["lse"])  # lse ignores dropout
    for name in ("out", "dq", "dk", "dv"):
        assert max_error(first[name], other[name]) > 1e-2, name


def test_rate_zero_is_bit_identical_to_no_dropout():
    """Forward and lse (rate 0.0 gives the very same static spec, hence the same VJP)."""
    inputs = make_inputs(92, B=2, T=17, S=23, N=2, H=8)
    kwargs = dict(is_causal=True, return_residual=True, implementation="pallas",
                  interpret=True, block_sizes=SMALL_BLOCKS)
    args = (inputs["q"], inputs["k"], inputs["v"])
    plain = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(q, k, v, **kwargs))(*args)
    zero = jax.jit(lambda q, k, v, key: pallas_attn.dot_product_attention(
        q, k, v, dropout_rate=0.0, dropout_rng=key, **kwargs))(*args, jax.random.key(3))
    for a, b in zip(plain, zero, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dropout_does_not_depend_on_block_sizes():
    """The mask is a function of (seed, b, n, i, j) only: every tiling, forward, dK/dV,
    dQ and dbias kernels, gives the same result to float32 rounding."""
    inputs = make_inputs(93, B=1, T=40, S=56, N=4, K=2, H=16)
    kwargs = dict(dropout_rate=0.4, is_causal=True, causal_alignment="bottom_right",
                  arrays={"dropout_rng": jax.random.key(11)},
                  bias=random_bias(93, (1, 4, 1, 56)))
    base = run("pallas", inputs, **kwargs)
    for blocks in OTHER_BLOCKS:
        other = run("pallas", inputs, block_sizes=blocks, **kwargs)
        for name in base:
            err = max_error(other[name], base[name])
            bound = 4e-6 * max(1.0, np.abs(base[name][np.isfinite(base[name])]).max())
            assert err <= bound, f"{blocks}: {name} differs by {err:.3g}"


def test_finite_differences_of_the_kernel_forward():
    """Central differences of the kernel's own forward along a random direction equal
    the directional derivative from the kernel's VJP: the backward kernels drop the
    same entries as the forward."""
    shapes = dict(B=1, T=12, S=10, N=2, K=1, H=8)
    inputs = make_inputs(94, **shapes)
    rng = np.random.default_rng(94)
    primals = (inputs["q"], inputs["k"], inputs["v"])
    direction = tuple(jnp.asarray(rng.standard_normal(x.shape), F32) for x in primals)
    ct = inputs["ct"]

    def loss(q, k, v, key):
        out = pallas_attn.dot_product_attention(
            q, k, v, dropout_rate=0.4, dropout_rng=key, implementation="pallas",
            interpret=True, block_sizes=SMALL_BLOCKS)
        return jnp.sum(out * ct)

    forward = jax.jit(loss)
    gradient = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    key = jax.random.key(5)

    def along(t):
        return float(forward(*(x + t * d for x, d in zip(primals, direction, strict=True)),
                             key))

    def central(h):
        return (along(h) - along(-h)) / (2 * h)

    h = 1e-2
    numeric = (4 * central(h / 2) - central(h)) / 3  # Richardson: O(h^4)
    directional = lambda g: sum(float(jnp.vdot(a, d)) for a, d in zip(g, direction,
                                                                       strict=True))
    analytic = directional(gradient(*primals, key))
    assert abs(numeric - analytic) <= 1e-3 * abs(analytic), (numeric, analytic)
    # Sensitivity: a backward with another mask misses by far more than the tolerance
    # above (at least 20 times; about 9% of the derivative for this draw).
    wrong = directional(gradient(*primals, jax.random.key(6)))
    assert abs(numeric - wrong) > 2e-2 * abs(analytic), (numeric, wrong)


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_keep_mask_fraction_and_independence(rate):
    batch, heads, length = 2, 4, 256
    mask = np.asarray(pallas_attn.dropout_keep_mask(
        jax.random.key(12), batch=batch, num_heads=heads, q_len=length, kv_len=length,
        rate=rate))
    assert mask.shape == (batch, heads, length, length) and mask.dtype == bool
    p = 1.0 - rate
    n_all, n_one = mask.size, length * length
    assert abs(mask.mean() - p) <= 5 * np.sqrt(p * (1 - p) / n_all)
    slices = mask.reshape(batch * heads, length, length)
    agree = p * p + (1 - p) * (1 - p)  # expected agreement of two independent masks
    sigma = np.sqrt(agree * (1 - agree) / n_one)
    for a in range(len(slices)):
        assert abs(slices[a].mean() - p) <= 5 * np.sqrt(p * (1 - p) / n_one)
        for b in range(a + 1, len(slices)):
            assert abs((slices[a] == slices[b]).mean() - agree) <= 5 * sigma, (a, b)
    # Neighbouring rows and columns are not correlated either.
    assert abs((mask[..., 1:, :] == mask[..., :-1, :]).mean() - agree) <= 5 * sigma
    assert abs((mask[..., :, 1:] == mask[..., :, :-1]).mean() - agree) <= 5 * sigma
    # Four corners of random rectangles (distinct rows, distinct columns): their xor is
    # odd as often as for independent bits. A hash keeping the xor structure of
    # row key ^ column key would fail here.
    sampler = np.random.default_rng(0)
    rows = sampler.choice(length, size=(4000, 2), replace=True)
    cols = sampler.choice(length, size=(4000, 2), replace=True)
    ok = (rows[:, 0] != rows[:, 1]) & (cols[:, 0] != cols[:, 1])
    (i, i2), (j, j2) = rows[ok].T, cols[ok].T
    corners = slices[:, i, j] ^ slices[:, i2, j] ^ slices[:, i, j2] ^ slices[:, i2, j2]
    odd = (1 - (1 - 2 * p) ** 4) / 2
    assert abs(corners.mean() - odd) <= 5 * np.sqrt(odd * (1 - odd) / corners.size)
    # broadcast_batch_heads=True: one mask shared by every (b, n), same keep fraction.
    shared = np.asarray(pallas_attn.dropout_keep_mask(
        jax.random.key(12), batch=batch, num_heads=heads, q_len=length, kv_len=length,
        rate=rate, broadcast_batch_heads=True))
    assert (shared == shared[:1, :1]).all()
    assert abs(shared[0, 0].mean() - p) <= 5 * np.sqrt(p * (1 - p) / n_one)
    # A raw (legacy uint32[2]) key and the typed key of the same seed give the same mask.
    raw = np.asarray(pallas_attn.dropout_keep_mask(
        jax.random.PRNGKey(12), batch=1, num_heads=1, q_len=length, kv_len=length, rate=rate))
    np.testing.assert_array_equal(raw[0, 0], mask[0, 0])
    # A different key gives a different, independent mask.
    other = np.asarray(pallas_attn.dropout_keep_mask(
        jax.random.key(13), batch=1, num_heads=1, q_len=length, kv_len=length, rate=rate))
    assert abs((other[0, 0] == mask[0, 0]).mean() - agree) <= 5 * sigma


def test_kernel_forward_equals_float64_with_manual_mask_low_precision_inputs():
    """bfloat16 inputs: the dropped output matches a float64 computation that applies
    dropout_keep_mask by hand (forward only; tolerance from the dtype table)."""
    shapes = dict(B=2, T=17, S=33, N=2, H=16)
    inputs = make_inputs(95, dtype=jnp.bfloat16, **shapes)
    rng = jax.random.key(21)
    out = jax.jit(lambda q, k, v, key: pallas_attn.dot_product_attention(
        q, k, v, dropout_rate=0.25, dropout_rng=key, is_causal=True, implementation="pallas",
        interpret=True, block_sizes=SMALL_BLOCKS))(inputs["q"], inputs["k"], inputs["v"], rng)
    exact = oracle(inputs, keep=keep_mask(rng, shapes, 0.25), dropout_rate=0.25,
                   is_causal=True)
    assert out.dtype == jnp.bfloat16
    assert_close(np.asarray(out.astype(F32), np.float64), exact["out"], jnp.bfloat16, "out",
                 "out")


def test_keep_mask_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rate"):
        pallas_attn.dropout_keep_mask(jax.random.key(0), batch=1, num_heads=1, q_len=4,
                                      kv_len=4, rate=1.0)
    with pytest.raises(ValueError, match="q_len"):
        pallas_attn.dropout_keep_mask(jax.random.key(0), batch=1, num_heads=1, q_len=0,
                                      kv_len=4, rate=0.1)
