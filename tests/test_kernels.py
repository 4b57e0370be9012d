"""Core Pallas kernels in the interpreter: forward, logsumexp and gradients.

Every check compares the kernel (implementation="pallas", interpret=True, tiles of
16) with the library reference (implementation="xla") in the same dtype and with
an independent float64 NumPy oracle (tests/kernel_helpers.py). One jitted forward
+ VJP per configuration; the loss is sum(out * ct) + sum(lse * ct_lse) with random
cotangents.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import (
    DTYPES,
    OTHER_BLOCKS,
    SMALL_BLOCKS,
    TOLERANCES,
    alternate_dtypes,
    assert_bitwise_equal,
    assert_close,
    assert_empty_rows,
    assert_fa_rule,
    assert_no_nan,
    assert_results_close,
    empty_rows,
    make_inputs,
    make_runner,
    max_error,
    oracle,
    pallas_and_reference,
    run,
    to_numpy,
)

import pallas_attn

PALLAS = {"implementation": "pallas", "interpret": True, "block_sizes": SMALL_BLOCKS}

# (id, shapes, attention keywords). Lengths are ragged on purpose (T, S not multiples
# of the 16-wide tiles), T > S and T < S, and bottom_right causal with T > S leaves
# the first T - S query rows with no key at all.
# (Neither causal nor masked, over several ragged tiles: test_kernel_features.py's
# bias, mask and window cases; with nothing at all, T1_S1 here.)
FLOAT32_CASES = [
    ("causal_top_left_T>S", dict(B=2, T=40, S=23, N=2, H=16),
     dict(is_causal=True, causal_alignment="top_left")),
    # Head dim 256 (the widest head dim, not padded).
    ("causal_bottom_right_T>S_empty_rows_head_dim_256", dict(B=2, T=40, S=23, N=2, H=256),
     dict(is_causal=True, causal_alignment="bottom_right")),
    ("T1_S56_bottom_right", dict(B=2, T=1, S=56, N=2, H=8),
     dict(is_causal=True, causal_alignment="bottom_right")),
    ("T1_S1", dict(B=1, T=1, S=1, N=1, H=8), {}),
    ("T23_S1_causal", dict(B=2, T=23, S=1, N=1, H=8), dict(is_causal=True)),
    ("gqa_N4_K2_Hv!=H_scale", dict(B=2, T=17, S=23, N=4, K=2, H=40, Hv=24),
     dict(scale=0.3, is_causal=True, causal_alignment="bottom_right")),
    # Head dims 80 / 96, padded inside.
    ("mqa_N4_K1_head_dim_80_96", dict(B=1, T=33, S=40, N=4, K=1, H=80, Hv=96),
     dict(is_causal=True)),
    # Causal forward programs take a query tile and its mirror: 5 query tiles (the
    # middle one alone) here, 2 (one pair) in gqa_N4_K2_Hv!=H_scale (bottom-right causal,
    # T < S) and T23_S1_causal.
    # No padding: T and S are multiples of the 16-wide tiles, T > S.
    ("causal_paired_odd_tiles_no_padding_T80_S48", dict(B=1, T=80, S=48, N=2, H=16),
     dict(is_causal=True)),
]


@pytest.mark.parametrize("shapes,kwargs", [c[1:] for c in FLOAT32_CASES],
                         ids=[c[0] for c in FLOAT32_CASES])
def test_forward_lse_and_gradients_float32(shapes, kwargs):
    inputs = make_inputs(sum(shapes.values()), **shapes)
    kernel, reference = pallas_and_reference(inputs, **kwargs)
    exact = oracle(inputs, **kwargs)
    B, T, N = shapes["B"], shapes["T"], shapes["N"]
    assert kernel["lse"].shape == (B, T, N)
    assert kernel["out"].shape == (B, T, N, shapes.get("Hv", shapes["H"]))
    assert_results_close(kernel, reference, jnp.float32, label="vs reference: ")
    assert_results_close(kernel, exact, jnp.float32, label="vs float64: ")
    # Every visible row was written (matches the oracle above); empty rows are exact.
    assert_empty_rows(kernel, empty_rows(exact))
    if kwargs.get("causal_alignment") == "bottom_right" and T > shapes["S"]:
        assert empty_rows(exact).sum() == B * N * (T - shapes["S"])
        assert np.all(kernel["dq"][:, : T - shapes["S"]] == 0.0)


def _tile_staircase(inputs: dict, step: float) -> dict:
    """Adds step * (key tile index - 1) along one direction of q and k, so each 16-key
    tile's logits sit about 0.25 * 8 * step above (step > 0) or below the previous's."""
    q, k = np.array(inputs["q"]), np.array(inputs["k"])
    q[..., 0] += 8.0
    k[..., 0] += step * (np.arange(k.shape[1]) // 16 - 1)[None, :, None]
    return dict(inputs, q=jnp.asarray(q), k=jnp.asarray(k))


@pytest.mark.parametrize("with_bias", [False, True], ids=["log2_units", "natural_units"])
@pytest.mark.parametrize("step", [30.0, -30.0], ids=["rising", "falling"])
def test_row_maxima_jumping_between_key_tiles(step, with_bias):
    """Key tiles whose logits sit about 87 log2 units above (rising: without the online
    rescale the third tile's probabilities would overflow float32) or below (falling:
    later tiles underflow against the first) the previous tile's."""
    inputs = _tile_staircase(make_inputs(91, B=1, T=20, S=48, N=2, H=16), step)
    bias = (jnp.asarray(np.random.default_rng(92).standard_normal((1, 2, 20, 48)), jnp.float32)
            if with_bias else None)
    kernel, reference = pallas_and_reference(inputs, bias=bias, bias_grad=False)
    exact = oracle(inputs, bias=bias)
    assert np.ptp(exact["lse"]) > 0 and np.abs(exact["lse"]).max() > 50
    assert_results_close(kernel, reference, jnp.float32, factor=4.0, label="vs reference: ")
    assert_results_close(kernel, exact, jnp.float32, factor=4.0, label="vs float64: ")


# Head dims 8, 40 (Hv 24), 80 (Hv 96) and 256 run forward and backward in FLOAT32_CASES.
HEAD_DIMS = [(80, 24), (96, 96), (160, 160), (192, 64)]


@pytest.mark.parametrize("head_dim,value_head_dim", HEAD_DIMS,
                         ids=[f"H{h}_Hv{hv}" for h, hv in HEAD_DIMS])
def test_forward_head_dims(head_dim, value_head_dim):
    """Head dims that are not powers of two are padded inside; forward output and lse."""
    inputs = make_inputs(head_dim, B=1, T=20, S=33, N=2, H=head_dim, Hv=value_head_dim)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    kwargs = dict(is_causal=True, causal_alignment="bottom_right", return_residual=True)
    out, lse = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, **kwargs, **PALLAS))(q, k, v)
    # The float64 oracle stands in for the reference here (they agree to 1e-6 in every
    # test that runs both); this keeps the head dims cheap.
    exact = oracle(inputs, is_causal=True, causal_alignment="bottom_right")
    assert out.shape == (1, 20, 2, value_head_dim) and lse.shape == (1, 20, 2)
    assert out.dtype == jnp.float32
    for actual, expected, kind in ((out, exact["out"], "out"), (lse, exact["lse"], "lse")):
        assert_close(np.asarray(actual, np.float64), expected, jnp.float32, kind, kind)


LOW_PRECISION_CASES = [
    ("causal", dict(B=2, T=33, S=47, N=2, H=64), dict(is_causal=True)),
    ("gqa_bottom_right", dict(B=1, T=40, S=23, N=4, K=2, H=40, Hv=24),
     dict(is_causal=True, causal_alignment="bottom_right", scale=0.2)),
]


@pytest.mark.parametrize("dtype,shapes,kwargs", alternate_dtypes(LOW_PRECISION_CASES))
def test_low_precision_flash_attention_rule(dtype, shapes, kwargs):
    """Kernel error vs float64 <= 2 x (same-dtype reference error) + floor; table tolerances.
    Each case in one 16-bit dtype (alternate_dtypes): causal in bfloat16, causal GQA in
    float16 (whose backward scales dS, core.ds_scales)."""
    inputs = make_inputs(7, dtype=DTYPES[dtype], **shapes)
    dtypes = {}
    kernel, reference = pallas_and_reference(inputs, dtypes=dtypes, **kwargs)
    exact = oracle(inputs, **kwargs)
    assert dtypes["out"] == DTYPES[dtype] and dtypes["lse"] == jnp.float32
    assert dtypes["dq"] == dtypes["dk"] == dtypes["dv"] == DTYPES[dtype]
    assert_fa_rule(kernel, reference, exact, DTYPES[dtype])
    assert_results_close(kernel, reference, DTYPES[dtype], label="vs reference: ")
    assert_empty_rows(kernel, empty_rows(exact))


def test_unbatched_tnh_inputs_and_return_residual_false():
    inputs = make_inputs(11, B=None, T=23, S=17, N=2, H=8, Hv=12)
    kwargs = dict(is_causal=True, causal_alignment="bottom_right")
    kernel = run("pallas", inputs, **kwargs)
    exact = oracle(inputs, **kwargs)
    assert kernel["out"].shape == (23, 2, 12) and kernel["lse"].shape == (23, 2)
    assert kernel["dq"].shape == (23, 2, 8) and kernel["dv"].shape == (17, 2, 12)
    assert_results_close(kernel, exact, jnp.float32, label="vs float64: ")
    assert_empty_rows(kernel, empty_rows(exact))
    # return_residual=False gives exactly the same output array.
    out = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, **kwargs, **PALLAS))(inputs["q"], inputs["k"], inputs["v"])
    np.testing.assert_array_equal(np.asarray(out), kernel["out"].astype(np.float32))


def test_gradient_of_lse_alone_and_of_out_alone():
    """Only lse in the loss (out's cotangent is a symbolic zero), then only out."""
    inputs = make_inputs(12, B=2, T=40, S=23, N=4, K=2, H=16)
    kwargs = dict(is_causal=True, causal_alignment="bottom_right")
    q, k, v, ct_lse = inputs["q"], inputs["k"], inputs["v"], inputs["ct_lse"]

    def lse_loss(implementation, extra):
        def loss(q, k, v):
            _, lse = pallas_attn.dot_product_attention(
                q, k, v, return_residual=True, implementation=implementation, **kwargs, **extra)
            return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * ct_lse)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    kernel = lse_loss("pallas", {"interpret": True, "block_sizes": SMALL_BLOCKS})
    zero_ct = dict(inputs, ct=jnp.zeros_like(inputs["ct"]))
    exact = oracle(zero_ct, **kwargs)
    for name, got in zip(("dq", "dk", "dv"), kernel, strict=True):
        assert_close(np.asarray(got, np.float64), exact[name], jnp.float32, "grad", name)
    np.testing.assert_array_equal(np.asarray(kernel[2]), 0.0)  # lse does not depend on v

    out_only = run("pallas", inputs, lse_grad=False, **kwargs)
    exact = oracle(inputs, lse_grad=False, **kwargs)
    assert_results_close(out_only, exact, jnp.float32, names=("out", "dq", "dk", "dv"))


def test_deterministic_across_runs_and_compilations():
    inputs = make_inputs(13, B=2, T=40, S=56, N=4, K=2, H=24, Hv=16)
    kwargs = dict(is_causal=True, causal_alignment="bottom_right")
    fn = make_runner("pallas", **kwargs)
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["ct"], inputs["ct_lse"])
    first = to_numpy(fn(*args))
    for _ in range(2):
        assert_bitwise_equal(first, to_numpy(fn(*args)))
    assert_no_nan(first)


def test_forward_does_not_depend_on_block_sizes():
    """Forward only here; test_kernel_dropout checks every kernel (dropout, dbias) too."""
    inputs = make_inputs(14, B=1, T=40, S=56, N=4, K=2, H=24, Hv=16)
    kwargs = dict(is_causal=True, causal_alignment="bottom_right", scale=0.37,
                  return_residual=True, implementation="pallas", interpret=True)
    args = (inputs["q"], inputs["k"], inputs["v"])

    def forward(blocks):
        out, lse = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
            q, k, v, block_sizes=blocks, **kwargs))(*args)
        return to_numpy({"out": out, "lse": lse})

    base = forward(SMALL_BLOCKS)
    for blocks in (*OTHER_BLOCKS, pallas_attn.BlockSizes(64, 32, 16, 16, 16, 16,
                                                         block_q_dbias=16, block_k_dbias=16)):
        other = forward(blocks)
        for name in base:
            err = max_error(other[name], base[name])
            bound = 4e-6 * max(1.0, np.abs(base[name][np.isfinite(base[name])]).max())
            assert err <= bound, f"{blocks}: {name} differs by {err:.3g}"


def test_vmap_over_extra_leading_axis_with_gradients():
    inputs = make_inputs(15, B=2, T=20, S=23, N=4, K=2, H=16)
    rng = np.random.default_rng(15)
    stack = lambda x: jnp.asarray(np.stack([np.asarray(x) * (1 + 0.5 * rng.standard_normal())
                                            for _ in range(3)]))
    q, k, v = stack(inputs["q"]), stack(inputs["k"]), stack(inputs["v"])
    ct = jnp.asarray(rng.standard_normal((3, *inputs["ct"].shape)), jnp.float32)

    def grads(implementation, extra):
        def loss(q, k, v):
            out = jax.vmap(lambda q, k, v: pallas_attn.dot_product_attention(
                q, k, v, is_causal=True, implementation=implementation, **extra))(q, k, v)
            return jnp.sum(out * ct), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (dq, dk, dv), out = grads("pallas", {"interpret": True, "block_sizes": SMALL_BLOCKS})
    (rdq, rdk, rdv), rout = grads("xla", {})
    assert out.shape == (3, 2, 20, 4, 16)
    for name, got, want in (("out", out, rout), ("dq", dq, rdq), ("dk", dk, rdk),
                            ("dv", dv, rdv)):
        assert_close(np.asarray(got, np.float64), np.asarray(want, np.float64), jnp.float32,
                     "out" if name == "out" else "grad", name)
    # Each vmapped slice equals the unbatched call on that slice.
    exact = oracle({"q": q[1], "k": k[1], "v": v[1], "ct": ct[1], "ct_lse": None},
                   is_causal=True, lse_grad=False)
    assert_close(np.asarray(out[1], np.float64), exact["out"], jnp.float32, "out", "slice")
    assert_close(np.asarray(dq[1], np.float64), exact["dq"], jnp.float32, "grad", "slice dq")


def test_checkpoint_inside_scan_over_layers():
    """Two 'layers' in lax.scan, attention under jax.checkpoint (remat), grads w.r.t. all."""
    inputs = make_inputs(16, B=1, T=20, S=17, N=2, K=1, H=8)
    q, k, v, ct = inputs["q"], inputs["k"], inputs["v"], inputs["ct"]
    weights = jnp.asarray([0.7, 1.3], jnp.float32)

    def grads(implementation, extra):
        def loss(q, k, v, weights):
            def layer(x, w):
                y = jax.checkpoint(lambda x: pallas_attn.dot_product_attention(
                    x, k, v, is_causal=True, causal_alignment="bottom_right",
                    implementation=implementation, **extra))(x)
                return jnp.tanh(y * w) + x, None
            y, _ = jax.lax.scan(layer, q, weights)
            return jnp.sum(y * ct)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, weights)

    value, kernel = grads("pallas", {"interpret": True, "block_sizes": SMALL_BLOCKS})
    ref_value, reference = grads("xla", {})
    assert_close(np.float64(value), np.float64(ref_value), jnp.float32, "out", "loss")
    for name, got, want in zip(("dq", "dk", "dv", "dweights"), kernel, reference, strict=True):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any()
        assert_close(got, np.asarray(want, np.float64), jnp.float32, "grad", name)


def test_tolerance_table_is_keyed_by_every_tested_dtype():
    assert set(TOLERANCES) == set(DTYPES)


@pytest.mark.parametrize("lo,hi,expected", [
    (10, 70, (0, 2)),  # [10, 70) covers tiles 0 and 1
    (64, 128, (1, 2)),
    (246, 246, (3, 3)),  # empty, starting inside tile 3
    (246, 100, (3, 3)),  # hi < lo: empty
    (-5, 0, (0, 0)),
])
def test_tile_span_of_an_empty_range_is_empty(lo, hi, expected):
    from pallas_attn.kernels.core import tile_span

    first, stop = tile_span(jnp.int32(lo), jnp.int32(hi), 64)
    assert (int(first), int(stop)) == expected


def test_query_tiles_of_keys_past_a_window_are_empty():
    """Keys 256..383 lie right of every query's window (T=100, window (40, 10)): no
    query tile is visited (a tile past the padded queries was before)."""
    from kernel_helpers import plan_for

    from pallas_attn.kernels import vjp
    from pallas_attn.kernels.core import TileRanges
    from pallas_attn.spec import normalize

    q = jnp.zeros((1, 100, 1, 64), jnp.bfloat16)
    k = jnp.zeros((1, 260, 1, 64), jnp.bfloat16)
    spec, ops, _ = normalize(q, k, k, local_window_size=(40, 10))
    problem, *_ = vjp.prepare(spec, ops, plan_for(spec, ops, pallas_attn.BlockSizes(
        32, 32, 64, 128)))
    first, stop, full_first, full_stop = (int(x) for x in TileRanges(
        problem, 0, 0).query_tiles(jnp.int32(256), jnp.int32(384), 64))
    assert first == stop == full_first == full_stop
