"""One feature suite, written once, run against every implementation and kernel backend.

Backends:
  xla          the reference (implementation="xla"): every case's yardstick, a backend
               of its own in the tests below test_feature
  xla_chunked  the blockwise jnp path
  triton       the Pallas kernels with every role on Triton's (the Pallas interpreter)
  mosaic       every role on the Hopper (Mosaic GPU) kernels, in JAX's Mosaic GPU
               interpreter (NaN-poisoned buffers, race detector on), on MOSAIC_CASES.
               Where the routing table refuses a role, the case is skipped with the
               table's reason: the skips are the backend's gaps.

Every case: random inputs and random cotangents for the output and the logsumexp,
compared with an independent float64 NumPy computation (FlashAttention's rule: at most
twice the error of the same-dtype reference plus a floor) and with the reference in the
same dtype; rows that see no key must give output 0, logsumexp -inf and dq 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import (  # no_mosaic_races: an autouse fixture
    DTYPES,
    SMALL_BLOCKS,
    assert_empty_rows,
    assert_fa_rule,
    assert_results_close,
    empty_rows,
    keep_mask,
    make_inputs,
    make_runner,
    no_mosaic_races,  # noqa: F401
    oracle,
    random_bias,
    run,
    to_numpy,
)

import pallas_attn

pytestmark = pytest.mark.timeout(300)

BACKENDS = ("xla", "xla_chunked", "triton", "mosaic")
TRITON = SMALL_BLOCKS
MOSAIC = pallas_attn.BlockSizes(forward_backend="mosaic", dkv_backend="mosaic",
                                dq_backend="mosaic", dbias_backend="mosaic")

# name: (dtype, shapes for make_inputs, bias shape as (Bb, Nb, Tb?, Sb?) or None, kwargs);
# array keyword arguments are built from their shapes by _arrays.
CASES = {
    "plain_ragged": ("bfloat16", dict(B=2, T=130, S=150, N=2), None, {}),
    "causal_gqa": ("bfloat16", dict(B=1, T=140, S=140, N=4, K=2), None,
                   dict(is_causal=True)),
    "bottom_right_T>S_empty_rows": ("bfloat16", dict(B=1, T=150, S=100, N=2), None,
                                    dict(is_causal=True, causal_alignment="bottom_right")),
    "window_Hv128": ("bfloat16", dict(B=1, T=200, S=220, N=2, Hv=128), None,
                     dict(local_window_size=(40, 10))),
    "soft_cap_alibi": ("float16", dict(B=2, T=130, S=130, N=2), None,
                       dict(logits_soft_cap=5.0, alibi=True, is_causal=True)),
    "bias_shared_by_batch": ("bfloat16", dict(B=2, T=130, S=140, N=2), (1, 2), {}),
    "bias_shared_by_heads": ("bfloat16", dict(B=2, T=100, S=140, N=2, H=128), (2, 1),
                             dict(is_causal=True)),
    "bias_per_key": ("bfloat16", dict(B=2, T=130, S=140, N=2), (2, 2, 1), {}),
    "mask_dropout_bias_per_row": ("bfloat16", dict(B=2, T=100, S=140, N=2), (2, 2, 100, 1),
                                  dict(mask=True, dropout_rate=0.2)),
    "segments_lengths": ("bfloat16", dict(B=2, T=130, S=130, N=2), None,
                         dict(segments=True, lengths=True)),
}


def _arrays(seed: int, shapes: dict, kwargs: dict) -> tuple[dict, dict]:
    """(static keyword arguments, array keyword arguments) of a case."""
    static, arrays = dict(kwargs), {}
    B, T, S, N = shapes["B"], shapes["T"], shapes["S"], shapes["N"]
    rng = np.random.default_rng(seed)
    if static.pop("alibi", False):
        arrays["alibi_slopes"] = jnp.asarray(rng.uniform(0.02, 0.5, N), jnp.float32)
    if static.pop("mask", False):
        arrays["mask"] = jnp.asarray(rng.random((B, 1, T, S)) < 0.8)
    if static.pop("segments", False):
        arrays["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (B, T))), jnp.int32)
    if static.pop("lengths", False):
        arrays["query_seq_lengths"] = jnp.asarray([T - 7, T // 2], jnp.int32)[:B]
        arrays["key_value_seq_lengths"] = jnp.asarray([S, S // 3], jnp.int32)[:B]
    if static.get("dropout_rate"):
        arrays["dropout_rng"] = jax.random.key(seed)
    return static, arrays


def _block_sizes(backend: str):
    return {"triton": TRITON, "mosaic": MOSAIC}.get(backend)


# The cases the Mosaic backend runs: every feature is in its kernels' own suites
# (test_mosaic_*.py); here these run the public call with every role on Mosaic at once.
# Every case's routing is test_every_backend_runs_somewhere's.
MOSAIC_CASES = ("bias_shared_by_heads", "mask_dropout_bias_per_row")


# The cases the blockwise path runs here: test_chunked.py checks its scores, biases, GQA,
# MQA, windows, segment ids and lengths and everything at once against the reference.
CHUNKED_CASES = ("bottom_right_T>S_empty_rows", "mask_dropout_bias_per_row")


# The cases the Triton kernels leave to test_kernels.py's bfloat16 and float16 cases
# against the float64 oracle (test_low_precision_flash_attention_rule: causal in bfloat16,
# causal GQA in float16; GQA in bfloat16: test_kernel_features.py's fused dbias case): no
# feature but the causal mask and the head groups. Every other case runs them.
TRITON_ELSEWHERE = ("plain_ragged", "causal_gqa")


# The reference ("xla") is each case's own yardstick: its checks are test_reference.py's.
@pytest.mark.parametrize("case,backend", [
    (case, backend) for case in CASES for backend in BACKENDS
    if backend != "xla" and (backend != "mosaic" or case in MOSAIC_CASES)
    and (backend != "xla_chunked" or case in CHUNKED_CASES)
    and (backend != "triton" or case not in TRITON_ELSEWHERE)])
def test_feature(case, backend):
    dtype_name, shapes, bias_shape, kwargs = CASES[case]
    dtype = DTYPES[dtype_name]
    shapes = dict(dict(H=64), **shapes)
    seed = sum(map(ord, case))
    inputs = make_inputs(seed, dtype=dtype, **shapes)
    static, arrays = _arrays(seed, shapes, kwargs)
    bias = None
    if bias_shape is not None:
        dims = (*bias_shape, *(shapes["T"], shapes["S"])[len(bias_shape) - 2:])
        bias = random_bias(seed + 1, dims, dtype)
    block_sizes = _block_sizes(backend)
    if backend == "mosaic":
        try:
            pallas_attn.explain(inputs["q"], inputs["k"], inputs["v"], bias, interpret=True,
                                block_sizes=block_sizes, **arrays, **static)
        except ValueError as e:
            pytest.skip(f"the routing table: {e}")
    impl = "pallas" if block_sizes is not None else backend
    extra = {} if block_sizes is None else dict(block_sizes=block_sizes)
    got = run(impl, inputs, bias=bias, arrays=arrays, **extra, **static)
    reference = run("xla", inputs, bias=bias, arrays=arrays, **static)
    keep = None
    if static.get("dropout_rate"):
        keep = keep_mask(arrays["dropout_rng"], batch=shapes["B"], num_heads=shapes["N"],
                         q_len=shapes["T"], kv_len=shapes["S"], rate=static["dropout_rate"])
    exact = oracle(inputs, bias=bias, arrays=arrays, keep=keep, **static)
    if bias is not None:
        assert got["dbias"].shape == bias.shape
    assert_fa_rule(got, reference, exact, dtype, label=f"{backend}: ")
    assert_results_close(got, reference, dtype, label=f"{backend} vs reference: ")
    assert_empty_rows(got, empty_rows(exact))
    if case == "bottom_right_T>S_empty_rows":
        assert empty_rows(exact).sum() > 0


def test_every_backend_runs_somewhere():
    """The suite is no list of skips: the Mosaic backend covers most cases."""
    covered = []
    for case, (dtype_name, shapes, bias_shape, kwargs) in CASES.items():
        shapes = dict(dict(H=64), **shapes)
        inputs = make_inputs(0, dtype=DTYPES[dtype_name], **shapes)
        static, arrays = _arrays(0, shapes, kwargs)
        bias = None if bias_shape is None else jnp.zeros(
            (*bias_shape, *(shapes["T"], shapes["S"])[len(bias_shape) - 2:]), jnp.bfloat16)
        try:
            pallas_attn.explain(inputs["q"], inputs["k"], inputs["v"], bias, interpret=True,
                                block_sizes=MOSAIC, **arrays, **static)
            covered.append(case)
        except ValueError:
            pass
    assert len(covered) >= 7, covered


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_visible_key_shows_in_every_row_that_sees_it(backend):
    """A diverging run must show its NaN: one NaN in key 3 of batch entry 0 makes every
    row of that entry NaN (output and logsumexp), never an empty row's 0 and -inf;
    batch entry 1 is untouched."""
    inputs = make_inputs(11, dtype=jnp.bfloat16, B=2, T=130, S=140, N=2, H=64)
    k = inputs["k"].at[0, 3, 0, 5].set(jnp.nan)
    block_sizes = _block_sizes(backend)
    impl = "pallas" if block_sizes is not None else backend
    out, lse = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, implementation=impl, block_sizes=block_sizes, interpret=impl == "pallas",
        return_residual=True))(inputs["q"], k, inputs["v"])
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert np.isnan(out[0, :, 0]).all() and np.isnan(lse[0, :, 0]).all()
    assert np.isfinite(out[1]).all() and np.isfinite(lse[1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_past_the_lengths_never_reaches_a_result(backend):
    """Keys and values past key_value_seq_lengths and queries past query_seq_lengths
    hold NaN (unwritten cache memory): the output, logsumexp and every gradient equal
    those of clean inputs, bit for bit where nothing is hidden. The Mosaic kernels
    (16-bit inputs) read whole tiles: the positions past the lengths are zeroed
    before them, dO's too. (The Mosaic forward ahead of the Triton backward kernels:
    each kernel is checked here, the forward in the mosaic case, the backward kernels in
    the triton case.)"""
    shapes = dict(B=2, T=100, S=140, N=1, H=64)
    dtype = jnp.bfloat16 if backend.startswith("mosaic") else jnp.float32
    inputs = make_inputs(12, dtype=dtype, **shapes)
    arrays = {"query_seq_lengths": jnp.array([70, 100], jnp.int32),
              "key_value_seq_lengths": jnp.array([140, 61], jnp.int32)}
    dirty = dict(inputs)
    dirty["q"] = inputs["q"].at[0, 70:].set(jnp.nan)
    dirty["k"] = inputs["k"].at[1, 61:].set(jnp.nan)
    dirty["v"] = inputs["v"].at[1, 61:].set(jnp.inf)
    block_sizes = _block_sizes(backend)
    impl = "pallas" if block_sizes is not None else backend
    extra = {} if block_sizes is None else dict(block_sizes=block_sizes)
    step = make_runner(impl, is_causal=True, **extra)  # one program for both inputs

    def results(x):
        return to_numpy(step(x["q"], x["k"], x["v"], x["ct"], x["ct_lse"], arrays=arrays))

    got, clean = results(dirty), results(inputs)
    for name in got:
        np.testing.assert_allclose(got[name], clean[name], atol=1e-6, rtol=1e-6,
                                   err_msg=f"{backend} {name}")
