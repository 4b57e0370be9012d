"""The Hopper (Mosaic GPU) dbias kernel in the Mosaic GPU interpreter.

The interpreter simulates the kernel's three warpgroups, barriers, bulk copies and
wgmma on CPU, fills the output with NaN before the kernel runs (a tile the kernel
never writes shows up as NaN) and runs its race detector. Two persistent programs
loop over several items, some of them outside the causal/window band (zeros,
nothing streamed) and some crossed by it.

The kernel is checked two ways: alone, against the Triton dbias kernel (Pallas
interpreter) on the same row residuals, over its whole padded output; and through
dot_product_attention, against the float64 oracle, with every other gradient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import (  # no_mosaic_races: an autouse fixture
    DTYPES,
    alternate_dtypes,
    assert_needs_hopper,
    check_kernel_gradients,
    kernel_backward,
    make_inputs,
    no_mosaic_races,  # noqa: F401
)

import pallas_attn
from pallas_attn.kernels.mosaic import dbias as mosaic_dbias
from pallas_attn.kernels.triton import dbias as triton_dbias

# Small Triton tiles around the Mosaic dbias kernel's 128-row items.
MOSAIC_DBIAS = pallas_attn.BlockSizes(32, 32, 32, 32, 32, 32, block_q_dbias=128,
                                      block_k_dbias=64, num_stages_dbias=2,
                                      dbias_backend="mosaic", fuse_dbias=False)

# (id, shapes, bias shape as (Bb, Nb), kwargs, tiles)
CASES = [
    # A batch-shared bias over ragged lengths without causal masking (a soft cap far
    # above the logits: the running row maximum).
    ("batch_shared_ragged_soft_cap_running_max_H80_Hv64", dict(B=2, T=150, S=120, N=2, H=80,
                                                               Hv=64), (1, 2),
     dict(logits_soft_cap=100.0, scale=0.3), {}),
    ("causal_bottom_right_T>S_skipped_items", dict(B=2, T=200, S=100, N=2), (1, 2),
     dict(is_causal=True, causal_alignment="bottom_right"), {}),
    # ALiBi: each member's own slope (per batch entry and head), with a soft cap, over a
    # window (GQA, one slot).
    ("head_shared_gqa_window_alibi_soft_cap_one_slot", dict(B=2, T=140, S=260, N=2, K=1),
     (2, 1), dict(local_window_size=(40, 10), alibi_slopes=jnp.array([[0.5, 0.05],
                                                                       [0.02, 0.3]]),
                  logits_soft_cap=5.0), dict(num_stages_dbias=1)),
    ("shared_by_all_soft_cap_block_k128_H128", dict(B=2, T=128, S=256, N=2, H=128), (1, 1),
     dict(logits_soft_cap=5.0, is_causal=True), dict(block_k_dbias=128)),
]


def _kernel_outputs(dtype: str, bias_dtype: str, shapes: dict, bias_shape: tuple,
                    kwargs: dict, blocks: dict) -> tuple[np.ndarray, np.ndarray, tuple]:
    """(Mosaic dbias, Triton dbias) over the padded bias, from the Triton forward's
    residuals and a random dO, and the caller's (T, S)."""
    x = kernel_backward(dtype, shapes, bias_shape, kwargs,
                        dataclasses.replace(MOSAIC_DBIAS, **blocks), bias_dtype=bias_dtype)
    bias = x.operands["bias"]
    mosaic = mosaic_dbias.dbias(x.problem, x.q, x.k, x.v, x.do, x.stats, bias,
                                x.operands.get("alibi_slopes"))
    triton = triton_dbias.dbias(*x.triton(block_q_dbias=32, block_k_dbias=32,
                                        dbias_backend="triton"), bias)
    assert mosaic.dtype == bias.dtype and mosaic.shape == bias.shape
    return np.asarray(mosaic, np.float32), np.asarray(triton, np.float32), (x.T, x.S)


@pytest.mark.parametrize("dtype,bias_dtype,shapes,bias_shape,kwargs,blocks",
                         alternate_dtypes(CASES, (("bfloat16", "bfloat16"),
                                                  ("float16", "float32"))))
def test_mosaic_dbias_matches_the_triton_dbias_kernel(dtype, bias_dtype, shapes, bias_shape,
                                                      kwargs, blocks):
    mosaic, triton, (T, S) = _kernel_outputs(dtype, bias_dtype, shapes, bias_shape, kwargs,
                                             blocks)
    # Every element of the padded output is written (the interpreter poisons it with
    # NaN), the padding included.
    assert not np.isnan(mosaic).any()
    mosaic, triton = mosaic[..., :T, :S], triton[..., :T, :S]
    assert np.abs(triton).max() > 0.1
    # Both sum float32 dS over the same members; they differ by float32 rounding of
    # products taken over other tiles (1e-5 of the largest entry), and then by a
    # step of the bias's dtype.
    eps = max(2 * float(jnp.finfo(DTYPES[bias_dtype]).eps), 1e-5)
    tol = eps * np.abs(triton).max()
    np.testing.assert_allclose(mosaic, triton, rtol=0, atol=tol)
    if kwargs.get("is_causal") and kwargs.get("causal_alignment") == "bottom_right":
        # Rows that see no key (T > S, bottom-right causal) have zero gradient.
        assert np.all(mosaic[..., : T - S, :] == 0.0)


@pytest.mark.parametrize("dtype,shapes,bias_shape,kwargs", alternate_dtypes([
    ("batch_shared_causal_mqa", dict(B=2, T=150, S=140, N=2, K=1, H=64), (1, 2),
     dict(is_causal=True)),
    ("head_shared_window_soft_cap_H48", dict(B=2, T=130, S=200, N=2, H=48), (2, 1),
     dict(logits_soft_cap=8.0, local_window_size=(60, 20))),
]))
def test_gradients_with_the_mosaic_dbias_against_reference_and_float64(dtype, shapes,
                                                                       bias_shape, kwargs):
    check_kernel_gradients(DTYPES[dtype], shapes, bias_shape, kwargs, MOSAIC_DBIAS)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mask=True), "no operand besides q, k, v, a bias, ALiBi slopes and sinks, got mask"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "no dropout"),
    (dict(dtype=jnp.float32), "bfloat16 or float16"),
    (dict(bias=(1, 1, 1, 16)), "broadcast along queries or keys"),
])
def test_unsupported_problems_name_the_reason(kwargs, match):
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    inputs = make_inputs(1, B=2, T=16, S=16, N=1, H=64, dtype=dtype)
    bias = jnp.zeros(kwargs.pop("bias", (1, 1, 16, 16)), dtype)
    if kwargs.pop("mask", False):
        kwargs["mask"] = jnp.ones((1, 1, 16, 16), bool)
    with pytest.raises(ValueError, match=f"dbias_backend='mosaic'.*{match}"):
        pallas_attn.dot_product_attention(inputs["q"], inputs["k"], inputs["v"], bias,
                                          interpret=True, block_sizes=MOSAIC_DBIAS, **kwargs)


def test_a_bias_without_the_mosaic_dbias_kernel_runs():
    """Without a bias, or with a per-batch bias whose dbias the dK/dV kernel writes,
    dbias_backend='mosaic' has nothing to do and is no error."""
    inputs = make_inputs(2, B=2, T=16, S=16, N=1, H=64, dtype=jnp.bfloat16)
    out = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, interpret=True, block_sizes=MOSAIC_DBIAS))(inputs["q"], inputs["k"], inputs["v"])
    blocks = dataclasses.replace(MOSAIC_DBIAS, fuse_dbias=True)
    bias = jnp.zeros((2, 1, 16, 16), jnp.float32)
    dbias = jax.jit(jax.grad(lambda b: pallas_attn.dot_product_attention(
        inputs["q"], inputs["k"], inputs["v"], b, interpret=True, block_sizes=blocks,
        mask=jnp.ones((1, 1, 16, 16), bool)).astype(jnp.float32).sum()))(bias)
    assert out.shape == inputs["q"].shape and dbias.shape == bias.shape


@pytest.mark.parametrize("fields,match", [
    (dict(block_q_dbias=64), "block_q_dbias=128"),
    (dict(block_k_dbias=32), "block_k_dbias in"),
])
def test_the_routing_table_checks_the_mosaic_dbias_tiles(fields, match):
    inputs = make_inputs(1, B=1, T=16, S=16, N=2, H=64, dtype=jnp.bfloat16)
    bias = jnp.zeros((1, 1, 16, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"dbias_backend='mosaic' does not cover.*{match}"):
        pallas_attn.explain(inputs["q"], inputs["k"], inputs["v"], bias, interpret=True,
                            block_sizes=dataclasses.replace(MOSAIC_DBIAS, **fields))


def test_mosaic_dbias_needs_a_hopper_gpu():
    assert_needs_hopper(MOSAIC_DBIAS, "dbias_backend='mosaic'.*needs an sm90")
