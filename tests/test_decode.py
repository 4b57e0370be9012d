"""The decode kernel (kernels/triton/decode.py) in the Pallas interpreter: a few query
rows (decoding, speculative decoding, chunked prefill) against a longer key cache.

Against the reference: outputs, logsumexp and the gradients of a call whose forward
ran the decode kernel; every feature it takes, GQA/MQA/MHA, keys split over several
programs, empty rows, NaN rows. And the routing: which calls it takes, which it
leaves to the forward kernel, and the errors of a forced choice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn

pytestmark = pytest.mark.timeout(300)


# One jitted program (eagerly, the sampler compiles for every new shape on its own).
@functools.partial(jax.jit, static_argnames=("B", "T", "S", "N", "K", "H", "Hv", "dtype", "seed"))
def _inputs(B, T, S, N, K, H=64, Hv=None, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, S, K, Hv or H), jnp.float32).astype(dtype)
    ct = jax.random.normal(ks[3], (B, T, N, Hv or H), jnp.float32)
    return q, k, v, ct


def _both(q, k, v, ct, **kw):
    """(value, grads) of the pallas call (decode-routed) and of the reference."""
    def run(impl):
        def loss(q, k, v):
            out, lse = pallas_attn.dot_product_attention(
                q, k, v, implementation=impl, interpret=impl == "pallas",
                return_residual=True, **kw)
            finite = jnp.where(jnp.isinf(lse), 0.0, lse)
            return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(finite), (out, lse)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return run("pallas"), run("xla")


# (MQA with two tokens under bottom-right causal masking, with sinks and three splits:
# test_splits_merged_in_chunks_with_a_partial_last_chunk.)
CASES = {
    # A query length of 0 with sinks: that row keeps the +inf row reference (no dq).
    "decode_lengths_gqa_sinks": (dict(B=3, T=1, S=300, N=8, K=2),
                                 lambda B: dict(key_value_seq_lengths=jnp.array([300, 77, 1]),
                                                query_seq_lengths=jnp.array([1, 0, 1]),
                                                sinks=jnp.linspace(-1.0, 2.0, 8))),
    # Head dims no power of two (24, 80) and 260 keys: the cache read in place, its
    # tiles past them as zeros (the backward pads it).
    "mha_softcap_alibi_H24_Hv80": (dict(B=1, T=3, S=260, N=2, K=2, H=24, Hv=80),
                          lambda B: dict(is_causal=True, causal_alignment="bottom_right",
                                         logits_soft_cap=7.0,
                                         alibi_slopes=jnp.array([0.05, 0.3]))),
    # Flax's cached decoding: a mask per key ([B, 1, 1, S]) and a bias per head, the keys
    # split over programs.
    "mask_per_key_bias_per_head_splits": (
        dict(B=1, T=1, S=1000, N=4, K=1),
        lambda B: dict(mask=jax.random.bernoulli(jax.random.key(5), 0.6, (B, 1, 1, 1000)),
                       bias=jax.random.normal(jax.random.key(6), (1, 4, 1, 1000)))),
    # A speculative step: a mask and a bias per token and head, gathered row by row,
    # under bottom-right causal masking; one row masked whole.
    "tokens_mask_bias_per_row": (
        dict(B=2, T=3, S=200, N=4, K=2),
        lambda B: dict(is_causal=True, causal_alignment="bottom_right",
                       mask=jax.random.bernoulli(jax.random.key(7), 0.5, (B, 4, 3, 200))
                       .at[1, 2, 0].set(False),
                       bias=jax.random.normal(jax.random.key(8), (1, 4, 3, 200)),
                       key_value_seq_lengths=jnp.array([200, 150]))),
    # A bias broadcast along the keys and a mask shared by the batch entries.
    "bias_per_row_mask_per_head": (
        dict(B=2, T=2, S=130, N=4, K=2),
        lambda B: dict(bias=jax.random.normal(jax.random.key(9), (B, 4, 2, 1)),
                       mask=jax.random.bernoulli(jax.random.key(10), 0.7, (1, 4, 1, 130)))),
    "chunk_window_qlengths": (dict(B=2, T=7, S=333, N=8, K=8, Hv=32),
                              lambda B: dict(local_window_size=(60, 0), is_causal=True,
                                             causal_alignment="bottom_right",
                                             query_seq_lengths=jnp.array([7, 4]),
                                             key_value_seq_lengths=jnp.array([333, 140]))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_matches_the_reference(case):
    shapes, features = CASES[case]
    q, k, v, ct = _inputs(**shapes)
    kw = features(shapes["B"])
    plan = pallas_attn.explain(q, k, v, interpret=True, **kw)
    assert plan.forward.backend == "decode"
    ((_, (out, lse)), grads), ((_, (out_ref, lse_ref)), grads_ref) = _both(q, k, v, ct, **kw)
    np.testing.assert_allclose(out, out_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse),
                               np.where(np.isinf(lse_ref), 0, lse_ref), atol=2e-5, rtol=2e-5)
    for got, want in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_keys_split_over_programs_in_bfloat16():
    """One sequence, one kv head: the keys spread over four programs, merged by their
    logsumexp; bf16 within the reference's own rounding."""
    q, k, v, ct = _inputs(B=1, T=1, S=1000, N=4, K=1, H=128, dtype=jnp.bfloat16)
    plan = pallas_attn.explain(q, k, v, interpret=True)
    assert plan.forward.splits == 4
    out = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, interpret=True))(q, k, v)
    want = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, implementation="xla"))(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=1e-2, rtol=1e-2)


def test_rows_without_keys_and_nan_rows():
    """Length 0: output 0, logsumexp -inf; a NaN key the row sees: NaN, not a zero."""
    q, k, v, _ = _inputs(B=3, T=1, S=150, N=4, K=2)
    k = k.at[2, 5, 1, 0].set(jnp.nan)
    out, lse = jax.jit(lambda q, k, v, lengths: pallas_attn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, interpret=True, return_residual=True))(
        q, k, v, jnp.array([150, 0, 150]))
    assert (np.asarray(out[1]) == 0).all() and np.isneginf(np.asarray(lse[1])).all()
    assert np.isnan(np.asarray(out[2, :, 2:])).all() and np.isnan(np.asarray(lse[2, :, 2:])).all()
    assert np.isfinite(np.asarray(out[2, :, :2])).all() and np.isfinite(np.asarray(out[0])).all()


@pytest.mark.parametrize("padding", ["left", "right"])
def test_keys_a_mask_hides_never_reach_a_result(padding):
    """NaN keys and values where a per-key mask hides them (left padding in a batch of
    cached sequences; right: Flax's cache slots past the current position, the kernel
    reading only the tiles up to it, and an entry whose mask shows no key): the results
    equal those of clean inputs, bit for bit."""
    q, k, v, _ = _inputs(B=2, T=1, S=700, N=4, K=1)
    keys = jnp.arange(700)[None, None, None, :]
    # 321 keys: the last visible one alone in its 64-key tile.
    mask = (keys >= jnp.array([0, 333])[:, None, None, None] if padding == "left"
            else keys < jnp.array([0, 321])[:, None, None, None])
    hidden = ~mask[:, 0, 0, :, None, None]
    run = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, mask=mask, interpret=True, return_residual=True))
    assert pallas_attn.explain(q, k, v, mask=mask, interpret=True).forward.splits > 1
    clean = run(q, k, v)
    poisoned = run(q, jnp.where(hidden, jnp.nan, k), jnp.where(hidden, jnp.inf, v))
    for got, want in zip(poisoned, clean, strict=True):
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_array_equal(got, want)
    want = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, mask=mask, implementation="xla", return_residual=True))(q, k, v)
    for got, ref in zip(clean, want, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cap", [None, 5.0])
def test_visible_non_finite_keys_under_a_mask(cap):
    """A mask's tiles run uncleaned first: an inf or -inf in a visible key's K (a soft
    cap would squash its score to a finite one) or an inf in its V still makes NaN rows
    where the reference does, and hidden ones (other kv heads' programs) change nothing."""
    q, k, v, _ = _inputs(B=3, T=1, S=700, N=4, K=2)
    mask = jnp.arange(700)[None, None, None, :] != jnp.array([5, 9, 11])[:, None, None, None]
    k = k.at[0, 300, 1, 3].set(jnp.inf).at[1, 650, 0, 0].set(-jnp.inf).at[1, 9, 1].set(jnp.nan)
    v = v.at[2, 100, 0, 7].set(jnp.inf).at[2, 11, 1].set(jnp.inf)
    kw = dict(mask=mask, logits_soft_cap=cap)
    assert pallas_attn.explain(q, k, v, interpret=True, **kw).forward.backend == "decode"
    got = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, interpret=True, **kw))(q, k, v)
    want = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, implementation="xla", **kw))(q, k, v)
    nan = np.isnan(np.asarray(want))
    assert nan[0, :, 2:].all() and nan[1, :, :2].all() and nan[2, :, :2].all()
    np.testing.assert_array_equal(np.isnan(np.asarray(got)), nan)
    np.testing.assert_allclose(np.asarray(got)[~nan], np.asarray(want)[~nan], atol=1e-5)


def test_a_program_whose_rows_differ_on_a_non_finite_key():
    """One program's rows (the four query heads of a kv head) under a mask per head: the
    heads shown a key whose V holds an inf turn NaN, the heads it is hidden from keep
    their values, beside a NaN key hidden from all (the rerun, cleaned, sorts them)."""
    q, k, v, _ = _inputs(B=1, T=1, S=200, N=4, K=1)
    mask = jnp.ones((1, 4, 1, 200), bool).at[:, 2:, :, 70].set(False).at[..., 130].set(False)
    v = v.at[0, 70, 0, 5].set(jnp.inf)
    k = k.at[0, 130, 0, 2].set(jnp.nan)
    assert pallas_attn.explain(q, k, v, mask=mask, interpret=True).forward.backend == "decode"
    got = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, mask=mask, interpret=True, return_residual=True))(q, k, v)
    want = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, mask=mask, implementation="xla", return_residual=True))(q, k, v)
    out, lse = (np.asarray(x) for x in got)
    assert np.isnan(out[0, 0, :2]).all() and np.isnan(lse[0, 0, :2]).all()
    for got_x, want_x in zip(got, want, strict=True):
        got_x, want_x = np.asarray(got_x), np.asarray(want_x)
        np.testing.assert_array_equal(np.isnan(got_x), np.isnan(want_x))
        seen = ~np.isnan(want_x)
        np.testing.assert_allclose(got_x[seen], want_x[seen], atol=1e-5)


def test_mask_keys():
    """The keys between the first and the last that a mask shows any row of an entry."""
    from pallas_attn.kernels.triton.decode import mask_keys
    mask = np.zeros((3, 2, 2, 40), bool)
    mask[1, 0, 1, 5] = mask[1, 1, 0, 17] = True
    mask[2] = True
    np.testing.assert_array_equal(mask_keys(jnp.asarray(mask)), [[0, 0], [5, 18], [0, 40]])
    np.testing.assert_array_equal(mask_keys(jnp.asarray(mask[1:2], jnp.int8)), [[5, 18]])


def test_routing_of_few_query_rows():
    q, k, v, _ = _inputs(B=2, T=1, S=64, N=8, K=2)
    dropout = dict(dropout_rate=0.1, dropout_rng=jax.random.key(1))
    plan = pallas_attn.explain(q, k, v, interpret=True, **dropout)
    assert plan.forward.backend == "triton"
    assert any(backend == "decode" and "dropout" in why
               for backend, why in plan.forward.declined)
    bias, mask = jnp.zeros((2, 8, 1, 64)), jnp.ones((2, 1, 1, 64), bool)
    assert pallas_attn.explain(q, k, v, bias, mask, interpret=True).forward.backend == "decode"
    many = _inputs(B=1, T=32, S=64, N=8, K=2)
    assert pallas_attn.explain(*many[:3], interpret=True).forward.backend == "triton"
    forced = pallas_attn.BlockSizes(forward_backend="decode", block_k=32, num_stages=2)
    plan = pallas_attn.explain(q, k, v, interpret=True, block_sizes=forced)
    assert (plan.forward.block_k, plan.forward.num_stages) == (32, 2)
    with pytest.raises(ValueError, match="forward_backend='decode' does not cover"):
        pallas_attn.explain(q, k, v, interpret=True, block_sizes=forced, **dropout)
    with pytest.raises(ValueError, match="block_q does not apply"):
        pallas_attn.explain(q, k, v, interpret=True, block_sizes=pallas_attn.BlockSizes(
            forward_backend="decode", block_q=16))
    tuned = pallas_attn.explain(q, k, v, interpret=True,
                                block_sizes=pallas_attn.BlockSizes(block_q=16))
    assert tuned.forward.backend == "triton" and tuned.forward.block_q == 16
    with pytest.raises(ValueError, match="dkv_backend must be None or one of"):
        pallas_attn.BlockSizes(dkv_backend="decode")
    triton = pallas_attn.BlockSizes(forward_backend="triton")
    assert pallas_attn.explain(q, k, v, interpret=True,
                               block_sizes=triton).forward.backend == "triton"


def test_splits_merged_in_chunks_with_a_partial_last_chunk(monkeypatch):
    """Three splits merged two at a time (the last chunk half empty), with sinks and
    two tokens of four query heads per kv head, the second past the query length: the
    merge kernel's chunks, its masked slots, its rows' tokens and heads, and a row past
    the length (+inf row reference despite the sink: no dq from the lse cotangent)."""
    from pallas_attn.kernels.triton import decode
    monkeypatch.setattr(decode, "COMBINE_CHUNK", 2)
    q, k, v, ct = _inputs(B=1, T=2, S=400, N=4, K=1, seed=3)
    kw = dict(is_causal=True, causal_alignment="bottom_right", query_seq_lengths=jnp.array([1]),
              sinks=jnp.array([0.5, -1.0, 2.0, 0.0]))
    plan = pallas_attn.explain(q, k, v, interpret=True, **kw)
    assert (plan.forward.backend, plan.forward.splits) == ("decode", 3)
    ((_, (out, lse)), grads), ((_, (out_ref, lse_ref)), grads_ref) = _both(q, k, v, ct, **kw)
    np.testing.assert_allclose(out, out_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, lse_ref, atol=2e-5, rtol=2e-5)
    for got, want in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside its equations."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_a_decode_step_reads_the_cache_in_place():
    """No copy of the cache per decode step: head dims no power of two and a length no
    multiple of the key tile leave K and V as stored (the kernel masks its loads)."""
    q, k, v, _ = _inputs(B=2, T=1, S=260, N=4, K=2, H=24, Hv=80)
    call = functools.partial(pallas_attn.dot_product_attention, implementation="pallas",
                             interpret=True)
    assert pallas_attn.explain(q, k, v, interpret=True).forward.backend == "decode"
    jaxpr = jax.make_jaxpr(call)(q, k, v).jaxpr
    copies = [eqn for eqn in _equations(jaxpr)
              if any(np.prod(out.aval.shape) >= k.size for out in eqn.outvars)
              and eqn.primitive.name not in ("pallas_call", "custom_vjp_call", "pjit", "jit")]
    assert not copies, [eqn.primitive.name for eqn in copies]
