"""The blockwise CPU path (implementation="xla_chunked") against the reference.

* Every feature, forward (out, lse) and backward (dq, dk, dv, dbias for several
  bias broadcast shapes, d alibi_slopes), equal to `reference.attention` in float32
  to ~1e-5, with ragged lengths, T != S, fully masked rows, combinations and
  dropout (the same keep mask bit for bit). Inputs and cotangents (for out and
  for lse) are random; tiles are tiny so every case runs many tiles and padding.
* Results independent of the tile sizes; jit / vmap / grad; the public API.
* Memory: at T = S = 32768 (B = N = 1, H = 64) the compiled forward + backward needs
  far less than one T x S float32 matrix (4 GiB) of scratch, and a causal forward +
  backward runs in a fresh process within a few hundred MiB of resident memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn
from pallas_attn.semantics import chunked, reference
from pallas_attn.spec import normalize

TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=2e-5, atol=2e-5)
SMALL = dict(block_q=16, block_k=16)


def make_inputs(seed, *, B=2, T=37, S=45, N=4, K=2, H=16, Hv=None, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    Hv = H if Hv is None else Hv

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    return dict(q=normal(B, T, N, H).astype(dtype), k=normal(B, S, K, H).astype(dtype),
                v=normal(B, S, K, Hv).astype(dtype), d_out=normal(B, T, N, Hv).astype(dtype),
                d_lse=normal(B, N, T), rng=rng)


def _forward(impl, kwargs, blocks):
    """(q, k, v, bias, slopes) -> (out, lse); blocks: block_q / block_k / chunk overrides."""
    def forward(q, k, v, bias, slopes):
        spec, ops, _ = normalize(q, k, v, bias, alibi_slopes=slopes, **kwargs)
        if impl == "reference":
            return reference.attention(spec, ops)
        return chunked.attention(spec, ops, **blocks)
    return forward


def _vjp(forward, x, bias, slopes):
    """Forward + VJP with random cotangents on out and lse."""
    (out, lse), vjp = jax.vjp(forward, x["q"], x["k"], x["v"], bias, slopes)
    dq, dk, dv, dbias, dslopes = vjp((x["d_out"], x["d_lse"]))
    result = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=dbias, dslopes=dslopes)
    return {name: value for name, value in result.items() if value is not None}


def run(impl, x, bias=None, slopes=None, blocks=None, **kwargs):
    """One jitted forward + VJP: dict(out, lse, dq, dk, dv[, dbias][, dslopes])."""
    forward = _forward(impl, kwargs, blocks or {})
    arrays = {name: x[name] for name in ("q", "k", "v", "d_out", "d_lse")}
    return jax.jit(lambda arrays, bias, slopes: _vjp(forward, arrays, bias, slopes))(
        arrays, bias, slopes)


def assert_matches(got, want, fwd_tol=TOL, grad_tol=GRAD_TOL, case=""):
    assert got.keys() == want.keys(), case
    for name in want:
        g, w = np.asarray(got[name], np.float32), np.asarray(want[name], np.float32)
        assert not np.isnan(g).any(), f"{case}: {name} has NaN"
        tol = fwd_tol if name in ("out", "lse") else grad_tol
        scale = max(1.0, float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0)))
        np.testing.assert_allclose(g, w, rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   err_msg=f"{case}: {name}")


def _prepare(seed, shapes=None, bias_shape=None, alibi=False, blocks=SMALL,
             neg_inf_bias=False, **kwargs):
    x = make_inputs(seed, **(shapes or {}))
    B, T, N, _ = x["q"].shape
    S = x["k"].shape[1]
    bias = slopes = None
    if bias_shape is not None:
        bias = x["rng"].standard_normal(bias_shape(B, N, T, S))
        if neg_inf_bias:  # an additive mask: scattered -inf, and whole rows of -inf
            bias[x["rng"].random(bias.shape) < 0.3] = -np.inf
            bias[..., 5:9, :] = -np.inf
        bias = jnp.asarray(bias, jnp.float32)
    if alibi:
        slopes = jnp.asarray(x["rng"].uniform(0.05, 0.5, (N,)), jnp.float32)
    arrays = {name: x[name] for name in ("q", "k", "v", "d_out", "d_lse")}
    return arrays, bias, slopes, kwargs, blocks


def compare_cases(cases, seed=0):
    """Reference vs chunked for every case; returns the chunked results by case name.

    A case: kwargs of `normalize` plus shapes=, bias_shape=, alibi=, blocks=. All cases
    go into one jitted program.
    """
    prepared = {name: _prepare(seed + i, **case) for i, (name, case) in enumerate(cases.items())}

    @jax.jit
    def go(inputs):
        return {name: {impl: _vjp(_forward(impl, prepared[name][3],
                                           prepared[name][4] if impl == "chunked" else {}),
                                  *args)
                       for impl in ("reference", "chunked")}
                for name, args in inputs.items()}

    results = go({name: p[:3] for name, p in prepared.items()})
    for name, result in results.items():
        assert_matches(result["chunked"], result["reference"], case=name)
    return {name: result["chunked"] for name, result in results.items()}


FULL_BIAS = lambda B, N, T, S: (B, N, T, S)

MASKING = {
    "plain_one_head_per_chunk": dict(blocks=dict(SMALL, chunk=(1, 1))),
    "causal": dict(is_causal=True),
    "causal_bottom_right": dict(is_causal=True, causal_alignment="bottom_right",
                                blocks=dict(SMALL, chunk=(1, 1))),
    # T > S bottom-right: the first T - S query rows see no key at all.
    "causal_bottom_right_t_gt_s": dict(is_causal=True, causal_alignment="bottom_right",
                                       shapes=dict(T=53, S=29)),
    "window_scale": dict(local_window_size=(7, 3), scale=0.37),
    "window_int_causal_bottom_right": dict(local_window_size=5, is_causal=True,
                                           causal_alignment="bottom_right"),
    "segments_lengths": dict(
        q_segment_ids=np.repeat(np.arange(4), 10)[None, :37].repeat(2, 0),
        kv_segment_ids=np.repeat(np.arange(5), 9)[None, :45].repeat(2, 0),
        query_seq_lengths=np.array([30, 0]), key_value_seq_lengths=np.array([17, 45]),
        blocks=dict(SMALL, chunk=(1, 2))),
    "mask_full": dict(mask=np.random.default_rng(1).random((2, 4, 37, 45)) > 0.3,
                      blocks=dict(SMALL, chunk=(1, 1))),
    "mask_broadcast": dict(mask=np.random.default_rng(2).random((2, 1, 1, 45)) > 0.5),
}

MODIFIERS_AND_SHAPES = {
    "alibi": dict(alibi=True, is_causal=True, causal_alignment="bottom_right",
                  blocks=dict(SMALL, chunk=(1, 1))),
    "alibi_soft_cap_mha": dict(alibi=True, logits_soft_cap=3.0, shapes=dict(N=4, K=4)),
    "neg_inf_bias": dict(bias_shape=FULL_BIAS, neg_inf_bias=True, is_causal=True),
    "neg_inf_bias_soft_cap": dict(bias_shape=lambda B, N, T, S: (1, N, T, S),
                                  neg_inf_bias=True, logits_soft_cap=2.5),
    "mqa_value_head_dim": dict(shapes=dict(N=3, K=1, H=8, Hv=24)),
    "t_lt_s_ragged": dict(shapes=dict(T=5, S=83), is_causal=True,
                          causal_alignment="bottom_right"),
    "single_query": dict(shapes=dict(B=1, T=1, S=33)),
}

BIAS_SHAPES = {
    "full": FULL_BIAS,
    "no_batch": lambda B, N, T, S: (1, N, T, S),
    "key_padding": lambda B, N, T, S: (B, 1, 1, S),
    "per_query": lambda B, N, T, S: (1, 1, T, 1),
    "per_head": lambda B, N, T, S: (1, N, 1, 1),
    "rows_and_cols": lambda B, N, T, S: (B, 1, T, S),
}


def test_masking_features_match_reference():
    compare_cases(MASKING)


def test_score_modifiers_and_shapes_match_reference():
    got = compare_cases(MODIFIERS_AND_SHAPES, seed=100)
    for name in ("alibi", "alibi_soft_cap_mha"):
        assert np.abs(np.asarray(got[name]["dslopes"])).max() > 0


def test_bias_gradient_broadcast_shapes():
    """Each bias shape with chunks of one (b, kv head) pair: the gradient of a broadcast
    bias is summed across chunks (one chunk of everything: the neg_inf_bias cases)."""
    compare_cases({name: dict(bias_shape=shape, is_causal=True,
                              blocks=dict(SMALL, chunk=(1, 1)))
                   for name, shape in BIAS_SHAPES.items()}, seed=200)


def test_everything_at_once_and_dropout():
    """GQA, Hv != H, ragged T != S, bias, mask, bottom-right causal, window, ALiBi,
    soft cap, segments, both lengths, dropout; rows with no visible key included."""
    B, T, S = 2, 41, 67
    rng = np.random.default_rng(7)
    everything = dict(
        shapes=dict(B=B, T=T, S=S, N=6, K=2, H=16, Hv=8),
        bias_shape=lambda B, N, T, S: (B, 1, T, S), alibi=True,
        mask=rng.random((1, 6, T, S)) > 0.2, is_causal=True, causal_alignment="bottom_right",
        local_window_size=(20, 3), logits_soft_cap=2.0,
        q_segment_ids=np.sort(rng.integers(0, 3, (B, T)), axis=1),
        kv_segment_ids=np.sort(rng.integers(0, 3, (B, S)), axis=1),
        query_seq_lengths=np.array([T, 25]), key_value_seq_lengths=np.array([50, S]),
        dropout_rate=0.25, dropout_rng=jax.random.key(5),
        blocks=dict(block_q=8, block_k=16, chunk=(1, 1)))
    dropout = dict(bias_shape=FULL_BIAS, dropout_rate=0.3, dropout_rng=jax.random.key(11),
                   is_causal=True, blocks=dict(SMALL, chunk=(1, 1)))
    got = compare_cases({"everything": everything, "dropout": dropout,
                         "broadcast_dropout": dict(dropout, broadcast_dropout=True)}, seed=300)
    assert np.isneginf(np.asarray(got["everything"]["lse"])).any()


def test_dropout_mask_is_the_reference_mask():
    """With v = identity rows, out[b, i, n, j] = p[b,n,i,j] * keep / (1 - rate)."""
    B, T, S, N = 2, 24, 40, 2
    rate, key = 0.4, jax.random.key(3)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, N, 8)), jnp.float32)
    k = jnp.asarray(np.random.default_rng(1).standard_normal((B, S, N, 8)), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(S)[None, :, None, :], (B, S, N, S))
    out = jax.jit(lambda q, k, v, key: pallas_attn.dot_product_attention(
        q, k, v, implementation="xla_chunked", dropout_rate=rate, dropout_rng=key))(q, k, v, key)
    keep = pallas_attn.dropout_keep_mask(key, batch=B, num_heads=N, q_len=T, kv_len=S,
                                         rate=rate)
    np.testing.assert_array_equal(np.asarray(out).transpose(0, 2, 1, 3) > 0, np.asarray(keep))


def test_fully_masked_rows_give_zero_and_zero_gradients():
    x = make_inputs(4, B=1, T=20, S=30, N=2, K=2)
    mask = np.ones((1, 1, 20, 30), bool)
    mask[..., 3:9, :] = False
    got = run("chunked", x, mask=jnp.asarray(mask), blocks=dict(block_q=8, block_k=8))
    assert np.all(np.asarray(got["out"])[:, 3:9] == 0)
    assert np.all(np.isneginf(np.asarray(got["lse"])[:, :, 3:9]))
    assert np.all(np.asarray(got["dq"])[:, 3:9] == 0)
    for name, value in got.items():
        assert not np.isnan(np.asarray(value)).any(), name
    # Nothing visible anywhere: every gradient is exactly zero.
    got = run("chunked", x, key_value_seq_lengths=jnp.zeros((1,), jnp.int32))
    assert np.all(np.asarray(got["out"]) == 0)
    for name in ("dq", "dk", "dv"):
        assert np.all(np.asarray(got[name]) == 0), name


def test_lse_only_and_out_only_cotangents():
    """A cotangent on only one of (out, lse): the other arrives as a symbolic zero."""
    x = make_inputs(5)

    def grad(impl, which):
        def f(q, k, v):
            spec, ops, _ = normalize(q, k, v, is_causal=True, causal_alignment="bottom_right")
            out, lse = (reference.attention(spec, ops) if impl == "reference"
                        else chunked.attention(spec, ops, **SMALL))
            if which == "lse":
                return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * x["d_lse"])
            return jnp.sum(out * x["d_out"])
        return jax.grad(f, argnums=(0, 1, 2))(x["q"], x["k"], x["v"])

    results = jax.jit(lambda: {(impl, which): grad(impl, which) for impl in
                               ("reference", "chunked") for which in ("lse", "out")})()
    for which in ("lse", "out"):
        for g, w in zip(results["chunked", which], results["reference", which], strict=True):
            np.testing.assert_allclose(g, w, **GRAD_TOL, err_msg=which)


def test_tile_sizes_do_not_change_results():
    """Ragged tiles, tiles longer than the sequence and the default tiles agree closely,
    dropout included (its mask depends on global indices only)."""
    x = make_inputs(2)
    arrays = {name: x[name] for name in ("q", "k", "v", "d_out", "d_lse")}
    bias = jnp.asarray(x["rng"].standard_normal((2, 4, 37, 45)), jnp.float32)
    kwargs = dict(is_causal=True, local_window_size=(9, 2), dropout_rate=0.2,
                  dropout_rng=jax.random.key(1))
    tiles = [dict(block_q=8, block_k=24), dict(block_q=64, block_k=8, chunk=(1, 1)),
             dict(chunk=(1, 2))]

    @jax.jit
    def go(arrays, bias):
        want = _vjp(_forward("reference", kwargs, {}), arrays, bias, None)
        return want, [_vjp(_forward("chunked", kwargs, blocks), arrays, bias, None)
                      for blocks in tiles]

    want, results = go(arrays, bias)
    assert_matches(results[0], want)
    for blocks, got in zip(tiles[1:], results[1:], strict=True):
        assert_matches(got, results[0], fwd_tol=dict(rtol=2e-6, atol=2e-6),
                       grad_tol=dict(rtol=5e-6, atol=5e-6), case=str(blocks))


def test_bfloat16_matches_reference():
    x = make_inputs(6, dtype=jnp.bfloat16)
    want = run("reference", x, is_causal=True)
    got = run("chunked", x, is_causal=True, blocks=SMALL)
    assert got["out"].dtype == jnp.bfloat16 and got["dq"].dtype == jnp.bfloat16
    assert got["lse"].dtype == jnp.float32
    assert_matches(got, want, fwd_tol=dict(rtol=1e-2, atol=1e-2),
                   grad_tol=dict(rtol=2e-2, atol=2e-2))


def test_vmap_jit_grad():
    x = make_inputs(8, B=1, T=33, S=40, N=2, K=1)
    lengths = jnp.array([[20], [40], [7]], jnp.int32)  # vmapped (batched loop bounds)
    qs = jnp.stack([x["q"], 2 * x["q"], -x["q"]])
    d_out = jnp.stack([x["d_out"], x["d_out"] ** 2, -x["d_out"]])

    def loss(impl):
        def f(q, k, v, length, d_out):
            out = pallas_attn.dot_product_attention(
                q, k, v, implementation=impl, is_causal=True, key_value_seq_lengths=length)
            return jnp.sum(out * d_out)
        grad = jax.grad(f, argnums=(0, 1, 2))
        return jax.jit(jax.vmap(grad, in_axes=(0, None, None, 0, 0)))

    want = loss("xla")(qs, x["k"], x["v"], lengths, d_out)
    got = loss("xla_chunked")(qs, x["k"], x["v"], lengths, d_out)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **GRAD_TOL)


def test_public_api_unbatched_and_residual():
    x = make_inputs(9, B=1, T=300, S=700, N=2, K=2, H=8)
    q, k, v = x["q"][0], x["k"][0], x["v"][0]
    want, got = (jax.jit(lambda q, k, v, impl=impl: pallas_attn.dot_product_attention(
        q, k, v, implementation=impl, is_causal=True, return_residual=True))(q, k, v)
        for impl in ("xla", "xla_chunked"))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, **TOL)


def test_choose_tiles_and_chunk():
    assert chunked.choose_tiles(100, 100) == (32, 100)
    assert chunked.choose_tiles(500, 800) == (64, 512)
    assert chunked.choose_tiles(4096, 4096) == (256, 512)
    assert chunked.choose_tiles(4096, 4096, group=8) == (32, 512)
    assert chunked.choose_tiles(4096, 4096, group=128) == (8, 512)
    assert chunked.choose_chunk(8, 16, 256 * 512) == (1, 1)
    assert chunked.choose_chunk(4, 8, 64 * 512) == (1, 4)
    assert chunked.choose_chunk(4, 2, 32 * 32) == (4, 2)
    x = make_inputs(0)
    spec, ops, _ = normalize(x["q"], x["k"], x["v"])
    for bad in ((2, 1), (3, 2), (1, 0)):
        with pytest.raises(ValueError, match="chunk"):
            chunked.attention(spec, ops, chunk=bad)
    with pytest.raises(ValueError, match="block_q"):
        chunked.attention(spec, ops, block_q=-4)


@pytest.mark.parametrize("q_len,kv_len,kwargs,expected", [
    (768, 1024, dict(is_causal=True), "xla"), (1024, 1024, dict(is_causal=True), "xla_chunked"),
    (1024, 1024, dict(local_window_size=64), "xla_chunked"), (2048, 2048, {}, "xla"),
    (4096, 2048, {}, "xla_chunked"), (32, 32768, dict(is_causal=True), "xla_chunked")])
def test_the_cpu_default_is_blockwise_for_long_sequences(q_len, kv_len, kwargs, expected):
    """From T * S = 2**20 with blocks to skip (causal, a window), 2**23 without."""
    q = jax.ShapeDtypeStruct((1, q_len, 1, 16), jnp.float32)
    k = jax.ShapeDtypeStruct((1, kv_len, 1, 16), jnp.float32)
    assert pallas_attn.explain(q, k, k, **kwargs).implementation == expected


# --------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------


def _fwd_bwd(impl, T, **kwargs):
    def loss(q, k, v, d_out):
        out = pallas_attn.dot_product_attention(q, k, v, implementation=impl, **kwargs)
        return jnp.sum(out * d_out)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def test_compiled_memory_at_32k_is_far_below_one_t_by_s_matrix():
    T, H = 32768, 64
    shape = jax.ShapeDtypeStruct((1, T, 1, H), jnp.float32)
    t_by_s = T * T * 4  # 4 GiB
    compiled = _fwd_bwd("xla_chunked", T).lower(shape, shape, shape, shape).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 512 * 2**20, temp  # measured: 48.5 MiB
    assert temp < t_by_s / 32, temp
    # The reference at a quarter of the length already needs T x S matrices.
    small = jax.ShapeDtypeStruct((1, 8192, 1, H), jnp.float32)
    ref = _fwd_bwd("xla", 8192).lower(small, small, small, small).compile()
    assert ref.memory_analysis().temp_size_in_bytes >= 8192 * 8192 * 4


_RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    import pallas_attn

    def rss_kib(field):
        # NOTE: VmHWM (peak) / VmRSS (now), not ru_maxrss: a child's ru_maxrss starts at
        # its parent's RSS at fork time (Linux carries it across exec): pytest's.
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field))

    T = int(sys.argv[1])
    def loss(q, k, v, d_out):
        out = pallas_attn.dot_product_attention(q, k, v, implementation="xla_chunked",
                                                is_causal=True)
        return jnp.sum(out * d_out)
    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (1, T, 1, 64)) for key in keys)
    compiled = f.lower(q, k, v, d_out).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready((q, k, v, d_out))
    before = rss_kib("VmRSS")
    grads = jax.block_until_ready(compiled(q, k, v, d_out))
    after = rss_kib("VmHWM")
    finite = all(bool(jnp.isfinite(g).all()) for g in grads)
    print(json.dumps(dict(before_kib=before, after_kib=after, finite=finite, temp=temp)))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_runs_16k_forward_backward_in_little_memory():
    """T = S = 16384 causal forward + backward (a T x S float32 matrix is 1 GiB) in a
    fresh process: its peak resident memory (VmHWM) exceeds the resident memory before
    the call (runtime, inputs, compiled program) by < 256 MiB."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, "16384"], capture_output=True,
                          text=True, cwd=root, env=env, timeout=300, check=True)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["finite"]
    growth_mib = (report["after_kib"] - report["before_kib"]) / 1024
    assert growth_mib < 256, report  # measured: ~90 MiB
    assert report["after_kib"] / 1024 < 1024, report  # measured: ~470 MiB
    assert report["temp"] < 512 * 2**20, report
