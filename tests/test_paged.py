"""paged_attention and paged_cache_update against dot_product_attention on the
gathered cache: random page orders, ragged lengths, page sizes 16 / 64 / 256, one and
seven new tokens, GQA, the features it takes; every implementation (the decode kernel
in the Pallas interpreter). Hidden slots holding NaN change nothing, a visible NaN
shows, and bad or empty input gets a clear error or an empty result."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn

pytestmark = pytest.mark.timeout(300)

IMPLEMENTATIONS = ("pallas", "xla", "xla_chunked")


# One jitted program (eagerly, the sampler compiles for every new shape on its own).
@functools.partial(jax.jit, static_argnames=("shape", "seed"))
def _normal_pair(shape, seed):
    ks = jax.random.split(jax.random.key(seed), 2)
    return tuple(jax.random.normal(key, shape, jnp.float32) for key in ks)


def _cache(page_size, pages_per_seq, B, K, H, seed=0, spare=3, Hv=None):
    """Caches of B * pages_per_seq + spare pages, each sequence's pages in random order."""
    rng = np.random.default_rng(seed)
    P = B * pages_per_seq + spare
    k_cache, v_cache = _normal_pair((P, page_size, K, H), seed)
    if Hv is not None:
        v_cache = _normal_pair((P, page_size, K, Hv), seed + 1)[0]
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
    # Head dims no power of two (K 24, V 40): the pages read in place, their tiles'
    # head dims past the cache's as zeros.
    "spec5_p80_straddling_tiles_H24_Hv40": dict(page_size=80, pages=3, B=2, T=5, N=4, K=2,
                                                lengths=(240, 100), dims=(24, 40)),
    "spec7_p64_window_softcap": dict(page_size=64, pages=3, B=2, T=7, N=4, K=1,
                                     lengths=(190, 70),
                                     kw=dict(local_window_size=50, logits_soft_cap=9.0)),
    # Chunked prefill: 40 tokens x 4 query heads per kv head, three tiles of 64 rows
    # (each reading the keys its tokens see), a sequence shorter than the chunk.
    "prefill40_p64_row_tiles_gqa": dict(page_size=64, pages=4, B=2, T=40, N=8, K=2,
                                        lengths=(250, 30)),
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
            or (implementation == "xla_chunked") == case.startswith("spec5")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_equals_the_op_on_the_gathered_cache(case):
    c = CASES[case]
    kw = c.get("kw", {})
    H, Hv = c.get("dims", (32, 32))
    k_cache, v_cache, table = _cache(c["page_size"], c["pages"], c["B"], c["K"], H, Hv=Hv)
    q = jax.random.normal(jax.random.key(5), (c["B"], c["T"], c["N"], H))
    lengths = jnp.array(c["lengths"], jnp.int32)
    want_out, want_lse = _expected(q, k_cache, v_cache, table, lengths, **kw)
    for implementation in _implementations(case):
        out, lse = _paged(implementation, q, k_cache, v_cache, table, lengths, **kw)
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
    with pytest.raises(ValueError, match="interpret applies to implementation='pallas'"):
        pallas_attn.paged_attention(q, k_cache, v_cache, table, lengths, implementation="xla",
                                    interpret=True)
    with pytest.raises(ValueError, match="query, key_cache and value_cache must share one "
                                         "dtype, got bfloat16, float32, float32"):
        pallas_attn.paged_attention(q.astype(jnp.bfloat16), k_cache, v_cache, table, lengths)
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
    wide = jnp.zeros((8, 16, 1, 272))  # a head dim past the kernel's
    with pytest.raises(ValueError, match="takes head dims up to 256, got query/key 272; "
                                         "use implementation='xla'"):
        pallas_attn.paged_attention(jnp.zeros((*q.shape[:3], 272)), wide, wide, table,
                                    jnp.array([20, 5]), implementation="pallas", interpret=True)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda q: jnp.sum(pallas_attn.paged_attention(
            q, k_cache, v_cache, table, lengths)))(q)


def _numpy_paged(q, k_cache, v_cache, table, lengths, window=None, sinks=None, slopes=None):
    """float64 paged attention written out key by key: query t of sequence b at position
    lengths[b] - T + t sees the keys j <= its position (and inside the window); a key it
    sees whose key or value is not finite makes its row NaN; hidden keys are never read."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    B, T, N, H = q.shape
    page_size, K, Hv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    out, lse = np.zeros((B, T, N, Hv)), np.full((B, T, N), -np.inf)
    for b in range(B):
        L = int(lengths[b])
        for t in range(T):
            pos = L - T + t
            keys = [j for j in range(L) if j <= pos
                    and (window is None or pos - window[0] <= j <= pos + window[1])]
            for n in range(N):
                kk = np.stack([k_cache[table[b, j // page_size], j % page_size, n // (N // K)]
                               for j in keys]) if keys else np.zeros((0, H))
                vv = np.stack([v_cache[table[b, j // page_size], j % page_size, n // (N // K)]
                               for j in keys]) if keys else np.zeros((0, Hv))
                s = kk @ q[b, t, n] / np.sqrt(H)
                if slopes is not None:
                    s = s - float(slopes[n]) * np.abs(pos - np.asarray(keys, np.float64))
                s = np.where(np.isfinite(kk).all(1) & np.isfinite(vv).all(1), s, np.nan)
                terms = np.append(s, [] if sinks is None else [float(sinks[n])])
                if not terms.size:
                    continue
                m = terms.max()
                e = np.exp(s - m)
                total = np.exp(terms - m).sum()
                out[b, t, n] = (e[:, None] * np.where(np.isfinite(vv), vv, 0)).sum(0) / total
                if np.isnan(m):
                    out[b, t, n] = np.nan
                lse[b, t, n] = m + np.log(total)
    return out, lse


def _random_cache(B, pages, page_size, K, H, seed=0, spare=2):
    rng = np.random.default_rng(seed)
    P = B * pages + spare
    k_cache = rng.standard_normal((P, page_size, K, H)).astype(np.float32)
    v_cache = rng.standard_normal((P, page_size, K, H)).astype(np.float32)
    table = rng.permutation(P)[:B * pages].reshape(B, pages).astype(np.int32)
    return k_cache, v_cache, table


def _assert_matches(got, want, atol=2e-5):
    for g, w, name in zip(got, want, ("out", "lse"), strict=True):
        g = np.asarray(g, np.float64)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{name}: NaN rows")
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=f"{name}: -inf")
        keep = np.isfinite(w)
        np.testing.assert_allclose(g[keep], w[keep], atol=atol, rtol=atol, err_msg=name)


def _paged(implementation, *args, eager=False, **kw):
    """paged_attention, under jax.jit unless eager (op by op, every small operation
    compiles on its own; eager calls of every implementation: test_empty_batch_or_tokens_
    give_empty_results, test_paged_errors_name_the_argument, test_sinks.py)."""
    def paged(*args):
        return pallas_attn.paged_attention(
            *args, implementation=implementation, interpret=implementation == "pallas",
            return_residual=True, **kw)

    return (paged if eager else jax.jit(paged))(*(jnp.asarray(x) for x in args))


# Rules 1, 2 and 4 on a paged cache, against a float64 computation key by key.
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_hidden_nan_pages_and_future_tokens_never_change_a_result(implementation):
    """Seven new tokens, pages of 16, GQA. NaN keys and inf values in every slot past each
    sequence's length (the last page's tail and the table's unused pages), NaN in the
    newest token (seen only by the last row), NaN in a key outside a window: each row
    equals the float64 result that never reads a hidden key (rule 2), and a NaN that a row
    sees makes that row NaN (rule 1)."""
    k_cache, v_cache, table = _random_cache(2, 6, 16, 2, 16)
    q = np.random.default_rng(1).standard_normal((2, 7, 4, 16)).astype(np.float32)
    lengths = np.array([37, 5], np.int32)
    for b in range(2):
        for j in range(lengths[b], 6 * 16):
            k_cache[table[b, j // 16], j % 16] = np.nan
            v_cache[table[b, j // 16], j % 16] = np.inf
    newest = k_cache.copy()
    newest[table[0, 36 // 16], 36 % 16, 0] = np.nan  # sequence 0's last token, kv head 0
    windowed = k_cache.copy()
    windowed[table[0, 10 // 16], 10 % 16] = np.nan  # outside every row's 8-key window
    for kc, kw in ((newest, {}), (windowed, {"local_window_size": (8, 0)})):
        want = _numpy_paged(q, kc, v_cache, table, lengths,
                            window=kw.get("local_window_size"))
        got = _paged(implementation, q, kc, v_cache, table, lengths, **kw)
        _assert_matches(got, want)
    assert np.isnan(_numpy_paged(q, newest, v_cache, table, lengths)[0][0, -1, :2]).all()


@pytest.mark.parametrize("implementation", ["pallas", "xla"])  # xla_chunked: test_features
def test_nan_in_a_visible_query_sink_or_slope_shows(implementation):
    """Rule 1 on a paged cache: a NaN query row, sink or ALiBi slope turns exactly the
    rows that use it NaN; sequences shorter than T keep their empty rows."""
    k_cache, v_cache, table = _random_cache(2, 3, 16, 1, 16, seed=2)
    q = np.random.default_rng(3).standard_normal((2, 3, 2, 16)).astype(np.float32)
    lengths = np.array([40, 2], np.int32)
    q_nan = q.copy()
    q_nan[0, 1, 1] = np.nan
    sinks = np.array([np.nan, 0.5], np.float32)
    slopes = np.array([0.1, np.nan], np.float32)
    cases = ((q_nan, {}), (q, {"sinks": sinks}), (q, {"alibi_slopes": slopes}))
    for query, kw in cases:
        want = _numpy_paged(query, k_cache, v_cache, table, lengths, sinks=kw.get("sinks"),
                            slopes=kw.get("alibi_slopes"))
        assert np.isnan(want[0]).any()
        _assert_matches(_paged(implementation, query, k_cache, v_cache, table, lengths, **kw),
                        want)


@pytest.mark.parametrize("page_size,pages", [(64, 8), (16, 32)])
def test_paged_kernel_with_keys_split_over_programs(monkeypatch, page_size, pages):
    """One sequence of one kv head: the decode kernel splits the 512-key cache over
    several programs (test_paged's cases all run one); with sinks and a window, and an
    empty sequence with NaN everywhere in its pages (every split empty: output 0,
    logsumexp the sink)."""
    from pallas_attn.kernels.triton import decode

    splits = []
    forward = decode.forward

    def spy(problem, *args):
        splits.append(problem.plan.forward.splits)
        return forward(problem, *args)

    monkeypatch.setattr(decode, "forward", spy)
    k_cache, v_cache, table = _random_cache(1, pages, page_size, 1, 16, seed=4)
    q = np.random.default_rng(5).standard_normal((1, 2, 4, 16)).astype(np.float32)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    for lengths, kw in ((np.array([450], np.int32), {"sinks": sinks}),
                        (np.array([300], np.int32), {"local_window_size": (70, 0)})):
        want = _numpy_paged(q, k_cache, v_cache, table, lengths,
                            window=kw.get("local_window_size"), sinks=kw.get("sinks"))
        _assert_matches(_paged("pallas", q, k_cache, v_cache, table, lengths, **kw), want)
    poisoned = np.full_like(k_cache, np.nan)
    out, lse = _paged("pallas", q, poisoned, poisoned, table, np.array([0], np.int32),
                      sinks=sinks)
    assert (np.asarray(out) == 0).all()
    np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(sinks, (1, 2, 4)))
    assert min(splits) > 1, splits


def test_row_tiles_with_keys_split_over_programs(monkeypatch):
    """More query rows than one tile (20 tokens x 4 heads: two tiles of 64 rows) with the
    keys split over programs: each split of each tile writes its own rows' partial
    results, merged per row; with sinks, under a window, against float64."""
    from pallas_attn import dispatch

    monkeypatch.setattr(dispatch, "DECODE_PROGRAMS_PER_SM", 8)
    k_cache, v_cache, table = _random_cache(1, 8, 64, 1, 16, seed=6)
    q = np.random.default_rng(7).standard_normal((1, 20, 4, 16)).astype(np.float32)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    lengths = np.array([500], np.int32)
    problem = {}
    from pallas_attn.kernels.triton import decode
    forward = decode.forward

    def spy(p, *args):
        problem["plan"] = p.plan
        return forward(p, *args)

    monkeypatch.setattr(decode, "forward", spy)
    want = _numpy_paged(q, k_cache, v_cache, table, lengths, window=(300, 0), sinks=sinks)
    got = _paged("pallas", q, k_cache, v_cache, table, lengths, sinks=sinks,
                 local_window_size=(300, 0))
    _assert_matches(got, want)
    route = problem["plan"].forward
    assert route.block_q == 64 and route.splits > 1, route


def test_float16_large_logits_stay_finite():
    """Rule 4: float16 queries and keys of size ~50 (logits ~1e4 after the scale, products
    far past float16's 65504 before it) give the float32 reference's results."""
    k_cache, v_cache, table = _random_cache(1, 4, 16, 1, 64, seed=6)
    rng = np.random.default_rng(7)
    q = (rng.standard_normal((1, 1, 2, 64)) * 50).astype(np.float16)
    k16 = (k_cache * 50).astype(np.float16)
    v16 = v_cache.astype(np.float16)
    want = _numpy_paged(q, k16, v16, table, np.array([60]))
    for implementation in ("pallas", "xla"):
        got = _paged(implementation, q, k16, v16, table, np.array([60], np.int32))
        assert np.isfinite(np.asarray(got[0], np.float32)).all(), implementation
        np.testing.assert_allclose(np.asarray(got[0], np.float64), want[0], atol=2e-3,
                                   err_msg=implementation)


# Bad or empty input.
def test_page_numbers_and_lengths_past_int32_raise():
    """64-bit page numbers and lengths are range-checked before any conversion to int32,
    which would wrap 2**32 + 3 to page 3 and a length of 2**32 + 20 to 20."""
    k_cache, v_cache, table = _random_cache(2, 2, 16, 1, 16)
    q = jnp.ones((2, 1, 2, 16))
    lengths = np.array([20, 5], np.int32)
    wide_table = table.astype(np.int64)
    wide_table[0, 1] = 2**32 + 3
    wide_lengths = np.array([2**32 + 20, 5], np.int64)
    with pytest.raises(ValueError, match="page_table must lie in"):
        pallas_attn.paged_attention(q, k_cache, v_cache, wide_table, lengths)
    with pytest.raises(ValueError, match="cache_lengths must lie in"):
        pallas_attn.paged_attention(q, k_cache, v_cache, table, wide_lengths)
    new = jnp.ones((2, 1, 1, 16))
    with pytest.raises(ValueError, match="page_table must lie in"):
        pallas_attn.paged_cache_update(k_cache, v_cache, new, new, wide_table, lengths)
    with pytest.raises(ValueError, match="key_value_seq_lengths must lie in"):
        pallas_attn.dot_product_attention(
            q[:1], jnp.ones((1, 40, 1, 16)), jnp.ones((1, 40, 1, 16)),
            key_value_seq_lengths=np.array([2**32 + 5], np.int64))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("empty", ["batch", "tokens"])
def test_empty_batch_or_tokens_give_empty_results(implementation, empty):
    """As dot_product_attention: no sequence or no new token gives empty results."""
    k_cache, v_cache, table = _random_cache(2, 2, 16, 1, 16)
    q = jnp.ones((2, 1, 2, 16))
    lengths = np.array([20, 5], np.int32)
    if empty == "batch":
        q, table, lengths = q[:0], table[:0], lengths[:0]
    else:
        q = q[:, :0]
    out, lse = _paged(implementation, q, k_cache, v_cache, table, lengths, eager=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]


def test_empty_pages_or_tables_name_the_argument():
    empty = jnp.zeros((4, 0, 1, 16))
    with pytest.raises(ValueError, match="key_cache's pages must hold at least one token, "
                                         "got page_size 0"):
        pallas_attn.paged_attention(jnp.ones((1, 1, 2, 16)), empty, empty,
                                    jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32),
                                    implementation="xla")
    cache = jnp.zeros((4, 16, 1, 16))
    with pytest.raises(ValueError, match="page_table must name at least one page per sequence"):
        pallas_attn.paged_attention(jnp.ones((1, 1, 2, 16)), cache, cache,
                                    jnp.zeros((1, 0), jnp.int32), jnp.zeros((1,), jnp.int32))


def test_the_default_falls_back_for_head_dims_past_the_kernels():
    """Left to choose, paged_attention runs the reference where the decode kernel cannot
    take the head dim: past the kernels' 256."""
    rng = np.random.default_rng(8)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 512)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((2, 16, 1, 512)), jnp.float32)
    table, lengths = jnp.array([[1]], jnp.int32), jnp.array([3], jnp.int32)
    got = jax.jit(lambda *args: pallas_attn.paged_attention(*args, interpret=True))(
        q, cache, cache, table, lengths)
    want = _paged("xla", q, cache, cache, table, lengths)[0]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_default_takes_the_blockwise_path_for_long_chunks():
    """Off the kernel (no GPU here), paged_attention runs the blockwise path where T x
    capacity reaches 2**20, so a long chunk builds no T x S scores, and the reference
    below it; the interpreter runs the kernel."""
    from pallas_attn import dispatch

    assert dispatch.paged_implementation(None, False, "", 1, 4096) == "xla"
    assert dispatch.paged_implementation(None, False, "", 256, 4096) == "xla_chunked"
    assert dispatch.paged_implementation(None, True, "", 256, 4096) == "pallas"
    assert dispatch.paged_implementation("xla", True, "", 256, 4096) == "xla"
    k_cache, v_cache, table = (jnp.asarray(x) for x in _random_cache(1, 16, 256, 1, 16, seed=9))
    q = jnp.asarray(np.random.default_rng(9).standard_normal((1, 256, 2, 16)), jnp.float32)
    lengths = jnp.array([3000], jnp.int32)
    got = _paged(None, q, k_cache, v_cache, table, lengths)
    _assert_matches(got, [np.asarray(x, np.float64)
                          for x in _paged("xla", q, k_cache, v_cache, table, lengths)],
                    atol=1e-4)


def test_cache_update_takes_floating_new_tokens_only():
    k_cache, v_cache, table = (jnp.asarray(x) for x in _random_cache(2, 2, 16, 1, 16))
    new = jnp.ones((2, 1, 1, 16))
    with pytest.raises(TypeError, match="new_keys must have a floating dtype, got int32"):
        pallas_attn.paged_cache_update(k_cache, v_cache, new.astype(jnp.int32), new, table,
                                       np.array([20, 5], np.int32))


def test_cache_update_takes_numpy_caches():
    """As paged_attention does."""
    k_cache, v_cache, table = _random_cache(2, 2, 16, 1, 16)
    new = jnp.ones((2, 1, 1, 16))
    lengths = np.array([20, 5], np.int32)
    want = pallas_attn.paged_cache_update(jnp.asarray(k_cache), jnp.asarray(v_cache), new, new,
                                          table, lengths)
    got = pallas_attn.paged_cache_update(k_cache, v_cache, new, new, table, lengths)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
