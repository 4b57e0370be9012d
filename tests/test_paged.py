"""paged_attention and paged_cache_update against dot_product_attention on the
gathered cache: random page orders, ragged lengths, page sizes 16 / 64 / 256, one and
seven new tokens, GQA, the features it takes; every implementation (the decode kernel
in the Pallas interpreter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn

pytestmark = pytest.mark.timeout(300)

IMPLEMENTATIONS = ("pallas", "xla", "xla_chunked")


def _cache(page_size, pages_per_seq, B, K, H, seed=0, spare=3):
    """Caches of B * pages_per_seq + spare pages, each sequence's pages in random order."""
    rng = np.random.default_rng(seed)
    P = B * pages_per_seq + spare
    ks = jax.random.split(jax.random.key(seed), 2)
    k_cache = jax.random.normal(ks[0], (P, page_size, K, H), jnp.float32)
    v_cache = jax.random.normal(ks[1], (P, page_size, K, H), jnp.float32)
    table = jnp.asarray(rng.permutation(P)[:B * pages_per_seq].reshape(B, pages_per_seq),
                        jnp.int32)
    return k_cache, v_cache, table


def _expected(q, k_cache, v_cache, table, lengths, **kw):
    """Per sequence: the op on its gathered keys [0, length), bottom-right causal (its
    queries are its last T positions)."""
    B, T = q.shape[:2]
    attend = jax.jit(lambda q, k, v, lengths=None: pallas_attn.dot_product_attention(
        q, k, v, is_causal=True, causal_alignment="bottom_right", implementation="xla",
        return_residual=True, key_value_seq_lengths=lengths, **kw))
    outs, lses = [], []
    for b in range(B):
        L = int(lengths[b])
        k = k_cache[table[b]].reshape(1, -1, *k_cache.shape[2:])[:, :L]
        v = v_cache[table[b]].reshape(1, -1, *v_cache.shape[2:])[:, :L]
        if L < T:  # rows at negative positions see nothing
            pad = T - L
            k = jnp.concatenate([jnp.zeros((1, pad, *k.shape[2:])), k], axis=1)
            v = jnp.concatenate([jnp.zeros((1, pad, *v.shape[2:])), v], axis=1)
        out, lse = attend(q[b:b + 1], k, v, None if L >= T else jnp.array([0]))
        if L < T:  # the op cannot shift positions below 0: mask those rows here
            hidden = jnp.arange(T) < T - L
            valid_out, valid_lse = (attend(q[b:b + 1, T - L:], k[:, pad:], v[:, pad:])
                                    if L else (None, None))
            out = jnp.zeros_like(out) if not L else out.at[:, T - L:].set(valid_out)
            lse = jnp.full_like(lse, -jnp.inf) if not L else lse.at[:, T - L:].set(valid_lse)
            assert hidden.any()
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs), jnp.concatenate(lses)


CASES = {
    # Pages smaller than the kernel's 64-key tile, or not a multiple of it, are gathered
    # into whole tiles row by row (capacities 144, 168 and 240: a last tile past the
    # table's last page).
    "decode_p16_gqa": dict(page_size=16, pages=9, B=3, T=1, N=8, K=2, lengths=(144, 17, 1)),
    "spec3_p24_mqa_softcap": dict(page_size=24, pages=7, B=2, T=3, N=4, K=1,
                                  lengths=(165, 50), kw=dict(logits_soft_cap=9.0)),
    "spec5_p80_straddling_tiles": dict(page_size=80, pages=3, B=2, T=5, N=4, K=2,
                                       lengths=(240, 100)),
    "spec7_p64_window_softcap": dict(page_size=64, pages=3, B=2, T=7, N=4, K=1,
                                     lengths=(190, 70),
                                     kw=dict(local_window_size=50, logits_soft_cap=9.0)),
    "p256_alibi_mha_short_sequence": dict(page_size=256, pages=2, B=2, T=7, N=2, K=2,
                                          lengths=(400, 3),
                                          kw=dict(alibi_slopes=jnp.array([0.02, 0.1]))),
}


# The jnp paths take the same gathered pages: the blockwise one on one case, the reference
# on the others (the decode kernel on all). One test per case: the expected results are
# computed once for its implementations.
def _implementations(case):
    return [implementation for implementation in IMPLEMENTATIONS
            if implementation == "pallas"
            or (implementation == "xla_chunked") == (case == "spec5_p80_straddling_tiles")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_equals_the_op_on_the_gathered_cache(case):
    c = CASES[case]
    kw = c.get("kw", {})
    k_cache, v_cache, table = _cache(c["page_size"], c["pages"], c["B"], c["K"], 32)
    q = jax.random.normal(jax.random.key(5), (c["B"], c["T"], c["N"], 32))
    lengths = jnp.array(c["lengths"], jnp.int32)
    want_out, want_lse = _expected(q, k_cache, v_cache, table, lengths, **kw)
    for implementation in _implementations(case):
        out, lse = pallas_attn.paged_attention(
            q, k_cache, v_cache, table, lengths, implementation=implementation,
            interpret=implementation == "pallas", return_residual=True, **kw)
        np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5, err_msg=implementation)
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse), err_msg=implementation)
        np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse),
                                   np.where(np.isinf(want_lse), 0, want_lse), atol=2e-5,
                                   rtol=2e-5, err_msg=implementation)


def test_cache_update_then_attention_equals_contiguous_decoding():
    """Prefill 37 tokens, then decode 2 steps through paged_cache_update, under jit; each
    step equals the op on the contiguous keys so far."""
    B, K, N, H, ps = 2, 2, 4, 32, 16
    P = 12
    k_cache = jnp.zeros((P, ps, K, H))
    v_cache = jnp.zeros((P, ps, K, H))
    table = jnp.array([[7, 2, 9, 4, 0], [1, 11, 3, 8, 5]], jnp.int32)
    ks = jax.random.split(jax.random.key(1), 3)
    keys = jax.random.normal(ks[0], (B, 39, K, H))
    values = jax.random.normal(ks[1], (B, 39, K, H))
    queries = jax.random.normal(ks[2], (B, 39, N, H))
    step = jax.jit(lambda kc, vc, q, k, v, length: (
        *pallas_attn.paged_cache_update(kc, vc, k, v, table, length),))
    attend = jax.jit(lambda q, kc, vc, length: pallas_attn.paged_attention(
        q, kc, vc, table, length, interpret=True))
    k_cache, v_cache = step(k_cache, v_cache, None, keys[:, :37], values[:, :37],
                            jnp.array([37, 37]))
    for t in (37, 38):
        length = jnp.array([t + 1, t + 1])
        k_cache, v_cache = step(k_cache, v_cache, None, keys[:, t:t + 1], values[:, t:t + 1],
                                length)
        got = attend(queries[:, t:t + 1], k_cache, v_cache, length)
        want = pallas_attn.dot_product_attention(
            queries[:, t:t + 1], keys[:, :t + 1], values[:, :t + 1], implementation="xla")
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_paged_errors_name_the_argument():
    k_cache, v_cache, table = _cache(16, 2, 2, 1, 32)
    q = jnp.zeros((2, 1, 2, 32))
    lengths = jnp.array([20, 5], jnp.int32)
    with pytest.raises(ValueError, match="page_table must lie in"):
        pallas_attn.paged_attention(q, k_cache, v_cache, table.at[0, 0].set(99), lengths)
    with pytest.raises(ValueError, match="cache_lengths must lie in"):
        pallas_attn.paged_attention(q, k_cache, v_cache, table, jnp.array([33, 1]))
    with pytest.raises(TypeError, match="page_table must be an integer array"):
        pallas_attn.paged_attention(q, k_cache, v_cache, table.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match="query must be"):
        pallas_attn.paged_attention(q[0], k_cache, v_cache, table, lengths)
    with pytest.raises(ValueError, match="key_cache and value_cache must be"):
        pallas_attn.paged_attention(q, k_cache, v_cache[:, :8], table, lengths)
    with pytest.raises(ValueError, match="key_cache's head dim 32 differs from query's 16"):
        pallas_attn.paged_attention(q[..., :16], k_cache, v_cache, table, lengths)
    with pytest.raises(ValueError, match="page_table must be \\[B, pages_per_seq\\]"):
        pallas_attn.paged_attention(q, k_cache, v_cache, table[:1], lengths)
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        pallas_attn.paged_attention(q, k_cache, v_cache, table, lengths, implementation="cudnn")
    with pytest.raises(ValueError, match="cache_lengths must lie in"):
        pallas_attn.paged_cache_update(k_cache, v_cache, k_cache[:2, :1], v_cache[:2, :1],
                                       table, jnp.array([99, 1]))
    # The cache update checks the new tokens against the table and the cache (a batch or
    # head of 1 would otherwise broadcast into every sequence's or head's slots).
    new = k_cache[:2, :1]  # [B, T=1, K, H]
    for name, bad in (("new_keys", new[:1]), ("new_keys", jnp.tile(new, (1, 1, 2, 1))),
                      ("new_keys", new[:, 0]), ("new_keys", new[..., :16]),
                      ("new_values", v_cache[:2, :1, :, :8])):
        keys, values = (bad, new) if name == "new_keys" else (new, bad)
        with pytest.raises(ValueError, match=f"{name} must be \\[B, T, K, H"):
            pallas_attn.paged_cache_update(k_cache, v_cache, keys, values, table, lengths)
    with pytest.raises(ValueError, match="new_keys and new_values must hold the same tokens"):
        pallas_attn.paged_cache_update(k_cache, v_cache, new, k_cache[:2, :2], table, lengths)
    with pytest.raises(ValueError, match="cache_lengths must be \\[B\\] with B = 2"):
        pallas_attn.paged_cache_update(k_cache, v_cache, new, new, table, lengths[:1])
    with pytest.raises(ValueError, match="key_cache and value_cache must be"):
        pallas_attn.paged_cache_update(k_cache, v_cache[:, :8], new, new, table, lengths)
    odd = jnp.zeros((8, 16, 1, 24))  # a head dim that is no power of two
    with pytest.raises(ValueError, match="needs power-of-two head dims >= 16, got query/key "
                                         "24; use implementation='xla'"):
        pallas_attn.paged_attention(q[..., :24], odd, odd, table, jnp.array([20, 5]),
                                    implementation="pallas", interpret=True)
    # Left to choose, it runs the reference where the kernel cannot.
    assert pallas_attn.paged_attention(q[..., :24], odd, odd, table, jnp.array([20, 5]),
                                       interpret=True).shape == q[..., :24].shape
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda q: jnp.sum(pallas_attn.paged_attention(
            q, k_cache, v_cache, table, lengths)))(q)
