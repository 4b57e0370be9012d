"""Pallas kernel features in the interpreter: bias (and dbias), masks, local windows,
ALiBi, soft cap, segment ids, sequence lengths, extreme logits and random combinations.

Each case is one jitted forward + VJP (random cotangents for out and lse) compared
with the library reference (implementation="xla") and with the float64 NumPy oracle
of tests/kernel_helpers.py, which implements the semantics independently.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import (
    DTYPES,
    SMALL_BLOCKS,
    TOLERANCES,
    assert_empty_rows,
    assert_fa_rule,
    assert_results_close,
    empty_rows,
    keep_mask,
    kernel_backward,
    make_inputs,
    make_runner,
    max_error,
    no_mosaic_races,  # noqa: F401
    oracle,
    pallas_and_reference,
    random_bias,
    run,
    scale_of,
    to_numpy,
)

import pallas_attn
from pallas_attn.kernels import core, vjp
from pallas_attn.kernels.triton import config as triton_config

PALLAS = {"implementation": "pallas", "interpret": True, "block_sizes": SMALL_BLOCKS}
F32 = jnp.float32


def check_against_reference_and_oracle(inputs, *, bias=None, arrays=None, dtype=F32,
                                       keep=None, **kwargs):
    """Kernel vs reference (same dtype) and vs the float64 oracle; empty rows exact."""
    kernel, reference = pallas_and_reference(inputs, bias=bias, arrays=arrays, **kwargs)
    exact = oracle(inputs, bias=bias, arrays=arrays, keep=keep, **kwargs)
    assert_results_close(kernel, reference, dtype, label="vs reference: ")
    if jnp.dtype(dtype) == jnp.float32:
        assert_results_close(kernel, exact, dtype, label="vs float64: ")
    else:
        assert_fa_rule(kernel, reference, exact, dtype)
    assert_empty_rows(kernel, empty_rows(exact))
    if bias is not None and "dbias" in kernel:
        assert kernel["dbias"].shape == np.shape(bias)
    return kernel, exact


# ------------------------------------------------------------------------------ bias
B, T, S, N, K = 2, 33, 23, 4, 2  # T > S: bottom_right causal leaves 10 empty rows
BIAS_CASES = [
    ((B, N, T, S), {}),
    ((1, N, T, S), dict(is_causal=True)),
    ((B, 1, T, S), dict(is_causal=True, causal_alignment="bottom_right")),
    ((B, N, 1, S), dict(is_causal=True)),
    ((1, 1, 1, S), dict(is_causal=True, causal_alignment="bottom_right")),
    ((1, N, T, 1), {}),
    # 2-D: leading dims broadcast, the same (1, 1, T, S) bias to the kernels; under a
    # causal window.
    ((T, S), dict(local_window_size=(4, 3), is_causal=True)),
]


# Every case through the separate dbias kernel; biases with an entry per batch entry and
# head also through the dK/dV kernel (fused; the others are refused: test_validation.py),
# but for the per-key one (B, N, 1, S), whose fused dbias test_fused_dbias_with_ragged_
# ranges checks in float32 against the reference and the dbias kernel.
BIAS_RUNS = [(shape, kwargs, fuse) for shape, kwargs in BIAS_CASES for fuse in (False, True)
             if not fuse or (triton_config.fusable_dbias(shape, batch=B, num_heads=N)
                             and shape[-2] > 1)]


@pytest.mark.parametrize("bias_shape,kwargs,fuse_dbias", BIAS_RUNS,
                         ids=["x".join(map(str, c[0])) + ("-fused" if c[2] else "")
                              for c in BIAS_RUNS])
def test_bias_broadcast_shapes_with_dbias(bias_shape, kwargs, fuse_dbias):
    """dbias from the separate dbias kernel and from the dK/dV kernel (fused)."""
    inputs = make_inputs(len(bias_shape) + sum(bias_shape), B=B, T=T, S=S, N=N, K=K, H=16)
    bias = random_bias(sum(bias_shape), bias_shape)
    blocks = dataclasses.replace(SMALL_BLOCKS, fuse_dbias=fuse_dbias)
    kernel, exact = check_against_reference_and_oracle(inputs, bias=bias, block_sizes=blocks,
                                                       **kwargs)
    assert np.abs(kernel["dbias"]).max() > 0
    if kwargs.get("causal_alignment") == "bottom_right" and bias_shape[-2] == T:
        # bias rows of queries that see no key get exactly zero gradient
        assert np.all(kernel["dbias"][..., : T - S, :] == 0.0)


FUSED = dataclasses.replace(SMALL_BLOCKS, fuse_dbias=True)


@pytest.mark.parametrize(("bias_shape", "dtype"), [((3, N, 40, 23), "bfloat16"),
                                                   ((3, N, 1, 23), "float32")],
                         ids=["BxNxTxS-bfloat16", "BxNx1xS-float32"])
def test_fused_dbias_with_ragged_ranges(bias_shape, dtype):
    """dbias written by the dK/dV kernel where programs skip query tiles: per-entry
    lengths (one entry sees nothing), a causal band, GQA and dropout. Skipped tiles
    must be written as zeros: the interpreter fills outputs with NaN."""
    inputs = make_inputs(81, B=3, T=40, S=23, N=N, K=K, H=16, dtype=DTYPES[dtype])
    bias = random_bias(82, bias_shape, DTYPES[dtype])
    arrays = {"query_seq_lengths": jnp.asarray([40, 17, 0], jnp.int32),
              "key_value_seq_lengths": jnp.asarray([9, 23, 23], jnp.int32),
              "dropout_rng": jax.random.key(83)}
    kwargs = dict(is_causal=True, causal_alignment="bottom_right", dropout_rate=0.25)
    fused, reference = pallas_and_reference(inputs, bias=bias, arrays=arrays,
                                            block_sizes=FUSED, **kwargs)
    unfused = run("pallas", inputs, bias=bias, arrays=arrays, block_sizes=SMALL_BLOCKS,
                  **kwargs)
    assert np.isfinite(fused["dbias"]).all() and np.abs(fused["dbias"]).max() > 0
    assert_results_close(fused, reference, DTYPES[dtype], label="fused vs reference: ")
    assert_results_close(fused, unfused, DTYPES[dtype], label="fused vs dbias kernel: ")
    assert np.all(fused["dbias"][2] == 0.0)  # entry 2 has no query
    if bias_shape[2] > 1:  # bottom_right, T - S = 17: rows 0..16 see no key
        assert np.all(fused["dbias"][..., :17, :] == 0.0)


def test_fused_dbias_is_deterministic():
    inputs = make_inputs(84, B=3, T=40, S=40, N=4, K=2, H=16)
    bias = random_bias(85, (3, 4, 40, 40))
    step = make_runner("pallas", with_bias=True, block_sizes=FUSED, is_causal=True)
    runs = [to_numpy(step(inputs["q"], inputs["k"], inputs["v"], inputs["ct"],
                          inputs["ct_lse"], bias)) for _ in range(2)]
    for name in runs[0]:
        np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)


def test_bias_without_gradient_still_gives_qkv_gradients():
    """A stop_gradient bias (only q, k, v differentiated); the bias in bfloat16."""
    inputs = make_inputs(22, B=B, T=T, S=S, N=N, K=K, H=16)
    bias = random_bias(22, (B, 1, T, S), jnp.bfloat16)
    kernel, _ = check_against_reference_and_oracle(inputs, bias=bias, bias_grad=False,
                                                   is_causal=True)
    assert "dbias" not in kernel


def test_minus_inf_bias_entries_act_as_a_mask():
    """-inf in an additive bias hides a key; a row of -inf is an empty row. No NaN, and
    dbias is exactly 0 at the -inf entries."""
    inputs = make_inputs(23, B=1, T=20, S=23, N=2, H=8)
    bias = np.array(random_bias(23, (1, 2, 20, 23)))
    bias[0, :, 4, :] = -np.inf
    bias[0, :, 7, ::2] = -np.inf
    kernel, exact = check_against_reference_and_oracle(inputs, bias=jnp.asarray(bias))
    assert empty_rows(exact)[0, 4].all() and not empty_rows(exact)[0, 7].any()
    assert np.all(kernel["dbias"][np.isneginf(bias)] == 0.0)


# ------------------------------------------------------------------------------ masks
MASK_SHAPES = [(B, N, T, S), (B, 1, 1, S), (1, N, T, 1), (T, S)]


@pytest.mark.parametrize("mask_shape", MASK_SHAPES,
                         ids=["x".join(map(str, s)) for s in MASK_SHAPES])
def test_boolean_mask_broadcast_shapes(mask_shape):
    rng = np.random.default_rng(sum(mask_shape))
    mask = rng.random(mask_shape) < 0.7
    # Some rows see nothing: row 3 everywhere, and with a per-row mask also row 11.
    if mask_shape[-2] == T:
        mask[..., 3, :] = False
    if mask_shape[-1] == 1:
        mask[..., 11, :] = False
    inputs = make_inputs(sum(mask_shape), B=B, T=T, S=S, N=N, K=K, H=16)
    _, exact = check_against_reference_and_oracle(inputs, arrays={"mask": jnp.asarray(mask)})
    if mask_shape[-2] == T:
        assert empty_rows(exact)[:, 3].all()


# ------------------------------------------------------------------------------ window
WINDOW_CASES = [
    ("left3_right5", dict(T=17, S=23), dict(local_window_size=(3, 5))),
    ("int4_bottom_right_T<S", dict(T=17, S=40), dict(local_window_size=4,
                                                      causal_alignment="bottom_right")),
    ("causal_bottom_right_T>S", dict(T=40, S=23),
     dict(local_window_size=(6, 2), is_causal=True, causal_alignment="bottom_right")),
    ("causal_bottom_right_T<S", dict(T=17, S=56),
     dict(local_window_size=(20, 0), is_causal=True, causal_alignment="bottom_right")),
]


@pytest.mark.parametrize("lengths,kwargs", [c[1:] for c in WINDOW_CASES],
                         ids=[c[0] for c in WINDOW_CASES])
def test_local_window(lengths, kwargs):
    inputs = make_inputs(31 + lengths["S"], B=1, N=2, H=16, **lengths)
    check_against_reference_and_oracle(inputs, **kwargs)


# ------------------------------------------------------------------------------ ALiBi, soft cap
def test_alibi_slopes_per_head():
    inputs = make_inputs(41, B=2, T=17, S=56, N=4, K=2, H=16)
    slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, 5) / 4), jnp.float32)
    check_against_reference_and_oracle(inputs, arrays={"alibi_slopes": slopes},
                                       is_causal=True, causal_alignment="bottom_right")


def test_alibi_slopes_per_batch_and_head_with_bias():
    inputs = make_inputs(42, B=2, T=40, S=23, N=2, H=16)
    slopes = jnp.asarray(np.random.default_rng(42).uniform(0.01, 0.5, (2, 2)), jnp.float32)
    check_against_reference_and_oracle(inputs, arrays={"alibi_slopes": slopes},
                                       bias=random_bias(42, (1, 2, 40, 23)),
                                       causal_alignment="bottom_right")


def test_alibi_slopes_gradient_raises_with_pallas():
    inputs = make_inputs(43, B=1, T=16, S=16, N=2, H=8)
    slopes = jnp.asarray([0.25, 0.5], jnp.float32)

    def loss(slopes):
        out = pallas_attn.dot_product_attention(inputs["q"], inputs["k"], inputs["v"],
                                                alibi_slopes=slopes, **PALLAS)
        return jnp.sum(out * inputs["ct"])

    with pytest.raises(NotImplementedError, match="stop_gradient"):
        jax.grad(loss)(slopes)


def test_logits_soft_cap():
    """With a bias the cap applies to scale * q.k + bias; without one the kernels fold
    the scale into the tanh's argument (two code paths; without a bias, a cap of 30 in
    every dtype: test_soft_cap_rows_far_below_the_cap)."""
    inputs = make_inputs(2, B=1, T=40, S=23, N=2, H=16)
    bias = random_bias(51, (1, 2, 1, 23))
    check_against_reference_and_oracle(inputs, bias=bias, logits_soft_cap=1.0,
                                       is_causal=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_soft_cap_rows_far_below_the_cap(dtype):
    """Rows whose every logit sits near -cap (about 2**-83 of the cap's bound): their
    softmax stays exact against the running row maximum in every dtype."""
    inputs = make_inputs(57, B=1, T=24, S=40, N=2, H=16)
    q, k = np.array(inputs["q"]), np.array(inputs["k"])
    q[:, :8, :, 0] = -12.0  # rows 0..7: logits about -0.25 * 12 * 12 = -36 before the cap
    k[..., 0] = 12.0 + k[..., 0]
    inputs = dict(inputs, q=jnp.asarray(q, DTYPES[dtype]), k=jnp.asarray(k, DTYPES[dtype]),
                  v=inputs["v"].astype(DTYPES[dtype]), ct=inputs["ct"].astype(DTYPES[dtype]))
    kernel, exact = check_against_reference_and_oracle(inputs, logits_soft_cap=30.0,
                                                       dtype=DTYPES[dtype])
    assert np.all(exact["lse"][0, :8] < -20.0)


# ------------------------------------------------------------------------------ segments, lengths
def test_segment_ids_packed_sequences_default_kv_ids():
    ids = np.repeat(np.arange(3), [13, 20, 7])[None].repeat(2, 0)
    ids[1] = np.repeat(np.arange(2), [29, 11])
    inputs = make_inputs(61, B=2, T=40, S=40, N=4, K=2, H=16)
    check_against_reference_and_oracle(inputs, arrays={"q_segment_ids": jnp.asarray(ids)},
                                       is_causal=True)


def test_segment_ids_explicit_kv_ids_with_unmatched_queries():
    q_ids = np.repeat(np.arange(3), [5, 7, 5])[None].repeat(2, 0)  # [2, 17]
    kv_ids = np.repeat(np.array([0, 1, 1]), [9, 6, 8])[None].repeat(2, 0)  # [2, 23]
    kv_ids[1] = np.repeat(np.array([0, 2, 2]), [3, 10, 10])
    inputs = make_inputs(62, B=2, T=17, S=23, N=2, H=16)
    _, exact = check_against_reference_and_oracle(
        inputs, arrays={"q_segment_ids": jnp.asarray(q_ids),
                        "kv_segment_ids": jnp.asarray(kv_ids)})
    assert empty_rows(exact)[0, 12:].all()  # segment 2 has no keys in batch entry 0


def test_query_and_key_value_seq_lengths_including_zero():
    inputs = make_inputs(63, B=3, T=40, S=23, N=2, H=16)
    arrays = {"query_seq_lengths": jnp.asarray([0, 31, 40], jnp.int32),
              "key_value_seq_lengths": jnp.asarray([23, 7, 0], jnp.int32)}
    kernel, exact = check_against_reference_and_oracle(
        inputs, arrays=arrays, is_causal=True, causal_alignment="bottom_right")
    assert empty_rows(exact)[0].all() and empty_rows(exact)[2].all()
    for name in ("dq", "dk", "dv"):
        assert np.all(kernel[name][0] == 0.0) and np.all(kernel[name][2] == 0.0)
    # keys past a batch entry's length get no gradient
    assert np.all(kernel["dk"][1, 7:] == 0.0) and np.all(kernel["dv"][1, 7:] == 0.0)


# ------------------------------------------------------------------------------ extreme logits
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_extreme_logits(dtype):
    """Logits of order 1e4; empty rows (bottom_right, T > S) stay exactly 0, no NaN.

    NOTE: at |logit| ~ 1e4 one float32 ulp of a log2-domain logit is ~1e-3, and the
    backward recomputes P = exp2(s - lse) from the stored lse, so float32 gradients
    carry a relative error of a few ulps of the logits (the reference normalises P
    exactly). The float32 bound is that, not the table's 5e-5.
    """
    inputs = make_inputs(71, B=2, T=40, S=24, N=2, H=16, scale_inputs=50.0,
                         dtype=DTYPES[dtype])
    kwargs = dict(is_causal=True, causal_alignment="bottom_right")
    kernel, reference = pallas_and_reference(inputs, **kwargs)
    exact = oracle(inputs, **kwargs)
    max_logit = float(np.abs(exact["lse"][np.isfinite(exact["lse"])]).max())
    assert max_logit > 5e3
    assert_empty_rows(kernel, empty_rows(exact))
    ulp_bound = 8 * max_logit * np.log2(np.e) * 2.0 ** -24
    for name in kernel:
        tol = max(TOLERANCES[dtype]["out" if name == "out" else "grad"], ulp_bound)
        if name == "lse":
            tol = 4 * 2.0 ** -24  # relative to the lse itself
        for label, expected in (("reference", reference), ("float64", exact)):
            err = max_error(kernel[name], expected[name])
            assert err <= tol * scale_of(expected[name]), f"{name} vs {label}: {err:.3g}"


def test_logits_near_1e10_give_finite_gradients():
    """|logits| ~ 1e10 (inputs ~ 1e5, scale 1): the backward recomputes each logit in
    another order than the forward, a float32 ulp (1024) off, so P = exp2(s - lse) could
    come out near 2^1024 (inf and NaN in dq, dk, dv where the reference is finite). P is
    never above 1 now: every gradient is finite. Not accurate at these magnitudes (README:
    the relative error of a recomputed P is about |logit| * 2^-24), so only the forward,
    computed in one pass, is compared."""
    inputs = make_inputs(3, B=1, T=20, S=28, N=2, H=16, scale_inputs=3e4)
    kwargs = dict(scale=1.0, is_causal=True, block_sizes=None)
    kernel = run("pallas", inputs, **kwargs)
    exact = oracle(inputs, scale=1.0, is_causal=True)
    assert np.abs(exact["lse"]).max() > 1e10
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(kernel[name]).all(), name
    assert max_error(kernel["out"], exact["out"]) <= 1e-6 * scale_of(exact["out"])
    assert max_error(kernel["lse"], exact["lse"]) <= 4 * 2.0 ** -24 * scale_of(exact["lse"])


# ------------------------------------------------------------------------------ float16 dS
MOSAIC_BACKWARD = pallas_attn.BlockSizes(dq_backend="mosaic", dkv_backend="mosaic")


@pytest.mark.parametrize("H, K, block_sizes", [
    pytest.param(16, 1, SMALL_BLOCKS, id="triton-gqa"),
    pytest.param(64, 1, MOSAIC_BACKWARD, id="mosaic-d64-gqa"),  # dK/dV keys by queries
    pytest.param(128, 2, MOSAIC_BACKWARD, id="mosaic-d128"),
    pytest.param(256, 2, MOSAIC_BACKWARD, id="mosaic-d256-wide"),
])
def test_float16_score_gradients_past_65504(H, K, block_sizes):
    """Small q, k (nearly uniform P) and values and dO near 1000: dS reaches a few 1e5,
    past float16's 65504, while every result is finite and of ordinary size. The kernels
    scale dS by powers of two before rounding it to float16 (kernels/core.py ds_scales):
    every result matches the float64 oracle and the reference."""
    rng = np.random.default_rng(H)
    B, T, S, N = 1, 40, 24, 2

    def normal(shape, size):
        return jnp.asarray(rng.standard_normal(shape) * size, jnp.float16)

    inputs = {"q": normal((B, T, N, H), 0.01), "k": normal((B, S, K, H), 0.01),
              "v": normal((B, S, K, H), 1000.0), "ct": normal((B, T, N, H), 1000.0),
              "ct_lse": jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32)}
    exact = oracle(inputs, bias=np.zeros((B, N, T, S)))  # its dbias is dS itself
    assert np.abs(exact.pop("dbias")).max() > 2 * 65504
    kernel, reference = pallas_and_reference(inputs, block_sizes=block_sizes)
    for name in kernel:
        assert np.isfinite(kernel[name]).all(), name
    assert_results_close(kernel, exact, "float16", label="vs float64: ")
    assert_results_close(kernel, reference, "float16", label="vs reference: ")


def test_ds_scales_bound_float16_ds_tightly():
    """The factors (of query rows, of key tiles) are powers of two at most 1 that keep the
    bound |dO_i| |V_j| + |delta_i| at most 2^15 and are no smaller than that needs; 1 for
    ordinary inputs; keys past the length and non-finite rows count nothing."""
    problem = kernel_backward("float16", dict(B=2, T=20, S=30, N=4, K=2), None, {},
                              SMALL_BLOCKS).problem
    rng = np.random.default_rng(0)
    size = np.exp(rng.uniform(-2, 9, (2, 1, 1, 1)))  # batch entry 1: ordinary sizes
    do = rng.standard_normal((2, 32, 4, 16)) * size * rng.uniform(0, 4, (2, 32, 4, 1))
    v = rng.standard_normal((2, 32, 2, 16)) * size * rng.uniform(0, 4, (2, 32, 2, 1))
    delta = rng.standard_normal((2, 4, 32)) * size[:, :, :, 0] ** 2
    lengths = jnp.array([30, 12])
    dirty_v = v.copy()
    dirty_v[1, 12:] = 6e4  # past batch entry 1's length
    dirty_v[0, 5, 1] = np.nan
    dirty_do = do.copy()
    dirty_do[0, 7, 3] = np.inf
    @jax.jit  # one program (eagerly, each small operation would compile on its own)
    def scales_of(do, v, delta, lengths):
        _, do_norms = vjp._row_sums(problem, do, jnp.zeros(do.shape), norms=True)
        v_norms = jnp.sqrt(vjp.fixed_sums(True, v, v))
        return core.ds_scales(problem, do_norms, v_norms, delta, (None, lengths), None)

    scales = scales_of(jnp.asarray(dirty_do, jnp.float16), jnp.asarray(dirty_v, jnp.float16),
                       jnp.asarray(delta, F32), lengths)
    rows, keys = (np.asarray(x, np.float64) for x in scales)
    np.testing.assert_array_equal(rows[:, :, 1], 2.0 ** rows[:, :, 0])
    np.testing.assert_array_equal(keys[:, :, 1], 1 / keys[:, :, 0])
    rows, keys = 2.0 ** -rows[:, :, 0], keys[:, :, 0]
    do_n = np.linalg.norm(np.asarray(jnp.asarray(dirty_do, jnp.float16), np.float64), axis=-1)
    v_n = np.linalg.norm(np.asarray(jnp.asarray(dirty_v, jnp.float16), np.float64), axis=-1)
    do_n, v_n = (np.where(np.isfinite(x), x, 0.0).transpose(0, 2, 1) for x in (do_n, v_n))
    v_n[0, :, 30:], v_n[1, :, 12:] = 0.0, 0.0
    row_bound = do_n * np.repeat(v_n.max(axis=2), 2, axis=1)[..., None] + np.abs(delta)
    by_group = (2, 2, 64)
    block = problem.plan.dkdv.block_k
    v_tiles = v_n.reshape(2, 2, 32 // block, block).max(axis=3)
    key_bound = (v_tiles * do_n.reshape(by_group).max(axis=2)[..., None]
                 + np.abs(delta).reshape(by_group).max(axis=2)[..., None])
    for factor, bound in ((rows, row_bound), (keys, key_bound)):
        assert np.all(factor <= 1) and np.all(np.log2(factor) == np.round(np.log2(factor)))
        assert np.all(bound * factor <= 2.0 ** 15 * (1 + 1e-6))
        assert np.all((factor == 1) | (bound * factor * 2 > 2.0 ** 15 * (1 - 1e-6)))
        assert np.all(factor[1] == 1) and np.any(factor[0] < 2.0 ** -4)


# ------------------------------------------------------------------------------ combinations
HEAD_LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 1)]
BIAS_PATTERNS = [(1, 1, 1, 1), (1, 0, 1, 1), (0, 1, 1, 1), (0, 0, 1, 1), (1, 1, 0, 1),
                 (0, 0, 0, 1), (0, 1, 1, 0), None]


def sample_combination(seed: int) -> dict:
    """A seeded random problem using every feature with some probability."""
    rng = np.random.default_rng(seed)
    coin = lambda p=0.5: bool(rng.random() < p)
    b = int(rng.integers(1, 3))
    t, s = (int(x) for x in rng.integers(1, 49, 2))
    n, k = HEAD_LAYOUTS[rng.integers(len(HEAD_LAYOUTS))]
    h = int(rng.choice([8, 16, 24, 40]))
    hv = h if coin() else int(rng.choice([8, 32]))
    dtype = "bfloat16" if seed % 4 == 3 else "float32"
    kwargs: dict = {}
    arrays: dict = {}
    if coin():
        kwargs["is_causal"] = True
    if coin():
        kwargs["causal_alignment"] = "bottom_right"
    if coin(0.4):
        kwargs["local_window_size"] = (int(rng.integers(0, 12)), int(rng.integers(0, 12)))
    if coin(0.4):
        kwargs["scale"] = float(rng.uniform(0.05, 0.5))
    if coin(0.4):
        kwargs["logits_soft_cap"] = float(rng.choice([2.0, 20.0]))
    if coin(0.4):
        arrays["alibi_slopes"] = jnp.asarray(rng.uniform(0.0, 0.3, (b, n) if coin() else (n,)),
                                             jnp.float32)
    if coin(0.4):
        arrays["mask"] = jnp.asarray(rng.random((b if coin() else 1, 1, t, s)) < 0.8)
    if coin(0.4):
        arrays["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1))
        arrays["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1))
    if coin(0.4):
        arrays["query_seq_lengths"] = jnp.asarray(rng.integers(0, t + 1, b), jnp.int32)
    if coin(0.4):
        arrays["key_value_seq_lengths"] = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
    if coin(0.3):
        kwargs["dropout_rate"] = float(rng.choice([0.1, 0.4]))
        kwargs["broadcast_dropout"] = coin(0.3)
        arrays["dropout_rng"] = jax.random.key(seed)
    pattern = BIAS_PATTERNS[rng.integers(len(BIAS_PATTERNS))]
    bias = None
    if pattern is not None:
        shape = tuple(full if keep else 1 for keep, full in zip(pattern, (b, n, t, s),
                                                                strict=True))
        bias = random_bias(seed, shape, DTYPES[dtype])
    shapes = dict(B=b, T=t, S=s, N=n, K=k, H=h, Hv=hv)
    return dict(shapes=shapes, dtype=dtype, kwargs=kwargs, arrays=arrays, bias=bias)


# Three seeds whose combinations use every feature (test_combinations_cover_every_feature).
COMBINATION_SEEDS = [101, 103, 106]


@pytest.mark.parametrize("seed", COMBINATION_SEEDS)
def test_random_feature_combinations(seed):
    combo = sample_combination(seed)
    dtype = DTYPES[combo["dtype"]]
    inputs = make_inputs(seed, dtype=dtype, **combo["shapes"])
    keep = None
    if combo["kwargs"].get("dropout_rate"):
        sh = combo["shapes"]
        keep = keep_mask(
            combo["arrays"]["dropout_rng"], batch=sh["B"], num_heads=sh["N"], q_len=sh["T"],
            kv_len=sh["S"], rate=combo["kwargs"]["dropout_rate"],
            broadcast_batch_heads=combo["kwargs"]["broadcast_dropout"])
    check_against_reference_and_oracle(inputs, bias=combo["bias"], arrays=combo["arrays"],
                                       dtype=dtype, keep=keep, **combo["kwargs"])


def test_combinations_cover_every_feature():
    """The sampled combinations together use every feature at least once."""
    used = set()
    for seed in COMBINATION_SEEDS:
        combo = sample_combination(seed)
        used |= set(combo["kwargs"]) | set(combo["arrays"])
        used |= {"bias"} if combo["bias"] is not None else set()
        used |= {combo["dtype"]}
        used |= {"gqa"} if combo["shapes"]["N"] > combo["shapes"]["K"] else set()
    features = {"is_causal", "causal_alignment", "local_window_size", "scale", "logits_soft_cap",
                "alibi_slopes", "mask", "q_segment_ids", "query_seq_lengths",
                "key_value_seq_lengths", "dropout_rate", "bias", "bfloat16", "gqa"}
    assert features <= used, features - used


# ------------------------------------------------------------------------------ regression
# A row whose every logit is at or below -1e30 (an additive bias of -1e30 or
# finfo(float32).min) once came out as an empty row (out 0, lse -inf): -1e30 doubled
# as the mask value. It is a proper softmax over its visible keys.
def test_huge_negative_bias_row_is_not_an_empty_row():
    inputs = make_inputs(81, B=1, T=16, S=16, N=1, H=8)
    bias = np.zeros((1, 1, 16, 16), np.float32)
    bias[0, 0, 5, :] = np.finfo(np.float32).min  # row 5: every key strongly penalised
    args = (inputs["q"], inputs["k"], inputs["v"], jnp.asarray(bias))
    out, lse = jax.jit(lambda q, k, v, b: pallas_attn.dot_product_attention(
        q, k, v, b, return_residual=True, **PALLAS))(*args)
    ref_out, ref_lse = jax.jit(lambda q, k, v, b: pallas_attn.dot_product_attention(
        q, k, v, b, return_residual=True, implementation="xla"))(*args)
    np.testing.assert_allclose(np.asarray(ref_out[0, 5, 0]),
                               np.asarray(inputs["v"][0, :, 0]).mean(0), rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)


# A row of one visible key outputs that key's value exactly under a soft cap: its weight
# must be exactly 1 (the running row maximum). With the cap's bound as every row's
# reference, P V took the weight rounded to bfloat16, the output came out an ulp off and
# delta = dO . O put about 9x the reference's error into dq. The Mosaic forward's case
# runs the Triton backward.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("forward_backend", ["triton", "mosaic"])
def test_soft_cap_rows_of_one_visible_key_output_its_value(forward_backend):
    T = 40 if forward_backend == "triton" else 130
    inputs = make_inputs(84, B=1, T=T, S=T, N=2, H=16 if forward_backend == "triton" else 64,
                         dtype=jnp.bfloat16)
    diagonal = np.eye(T, dtype=bool)
    diagonal[30:, :8] = True  # rows that see nine keys
    blocks = (SMALL_BLOCKS if forward_backend == "triton" else dataclasses.replace(
        SMALL_BLOCKS, block_q=128, block_k=64, num_stages=2, forward_backend="mosaic"))
    kernel, _ = check_against_reference_and_oracle(
        inputs, arrays=dict(mask=jnp.asarray(diagonal)), dtype=jnp.bfloat16,
        logits_soft_cap=20.0, block_sizes=blocks)
    np.testing.assert_array_equal(kernel["out"][0, :30],
                                  np.asarray(inputs["v"], np.float32)[0, :30])


# Rows whose every logit is hugely negative (a padding row hidden by a finite bias) keep
# exact gradients: the backward works from the row maximum and the log of the row sum,
# never from lse = max + ln(sum), which rounds to the max at this magnitude. The
# blockwise CPU path keeps the same two statistics.
@pytest.mark.parametrize("implementation", ["pallas", "xla_chunked"])
@pytest.mark.parametrize("row_bias", ["finfo_min", "minus_3e7_spread"])
def test_gradients_of_rows_with_hugely_negative_logits(row_bias, implementation):
    T = S = 16
    inputs = make_inputs(82, B=1, T=T, S=S, N=2, H=8)
    rng = np.random.default_rng(83)
    bias = rng.standard_normal((1, 2, T, S)).astype(np.float32)
    if row_bias == "finfo_min":
        bias[0, :, 5, :] = np.finfo(np.float32).min
    else:  # representable spread (ulp at 3e7 is 2) so the row is a real softmax
        bias[0, :, 5, :] = -3e7 + 16.0 * rng.standard_normal((2, S)).astype(np.float32)
    args = (inputs["q"], inputs["k"], inputs["v"], jnp.asarray(bias))

    def grads(implementation):
        def loss(q, k, v, b):
            out, lse = pallas_attn.dot_product_attention(
                q, k, v, b, return_residual=True, implementation=implementation,
                interpret=implementation == "pallas")
            return jnp.sum(out * inputs["ct"]) + jnp.sum(lse * inputs["ct_lse"])
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)

    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads(implementation), grads("xla"),
                               strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4,
                                   err_msg=name)


@pytest.mark.parametrize("bias_shape,kwargs", [
    ((2, 4, 100, 1), dict(logits_soft_cap=20.0, is_causal=True)),
    ((1, 4, 1, 1), dict(sinks=jnp.array([0.5, -1.0, 2.0, 0.0]), dropout_rate=0.2)),
], ids=["per_row_soft_cap_causal", "one_entry_per_head_sinks_dropout"])
def test_dbias_of_a_bias_broadcast_along_keys_does_not_round_delta(bias_shape, kwargs):
    """A bias broadcast along keys takes dS's row sums, which cancel to almost nothing
    (exactly zero without a cap or sinks): summed as dS = P (dP - delta) with delta
    from the rounded bfloat16 output they were off by a quarter of their size; the
    dbias kernel cancels with the delta of its own P and dP."""
    B, T, S, N, K, H = 2, 100, 110, 4, 2, 64
    rng = np.random.default_rng(0)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                   for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
    bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
    mask = jnp.asarray(rng.random((B, 1, T, 1)) > 0.125)
    if "dropout_rate" in kwargs:
        kwargs = dict(kwargs, dropout_rng=jax.random.key(2))

    def dbias(dtype, **options):
        def loss(bias):
            out = pallas_attn.dot_product_attention(
                q.astype(dtype), k.astype(dtype), v.astype(dtype), bias.astype(dtype),
                mask=mask, **kwargs, **options)
            return jnp.sum(out.astype(jnp.float32) * ct)
        return np.asarray(jax.jit(jax.grad(loss))(bias))

    expected = dbias(jnp.float32, implementation="xla")
    got = dbias(jnp.bfloat16, implementation="pallas", interpret=True,
                block_sizes=SMALL_BLOCKS)
    assert np.abs(expected).max() > 0.01
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-2 * np.abs(expected).max())
