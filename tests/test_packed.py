"""Packed sequences: the kernels skip the tiles outside each tile's segments
(kernels/core.segment_ranges). The keys of one packed document are NaN: the other
documents must stay exact in the output and every gradient, which holds only if the
kernels never read the poisoned tiles (a masked NaN still poisons P V and dS K).
Unsorted segment ids skip nothing and stay exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import make_inputs

import pallas_attn

pytestmark = pytest.mark.timeout(300)

BLOCKS = pallas_attn.BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32,
                                block_q_dq=32, block_k_dq=32)


def _grads(q, k, v, ct, segments, implementation, **kw):
    def loss(q, k, v):
        out = pallas_attn.dot_product_attention(
            q, k, v, q_segment_ids=segments, implementation=implementation,
            **(dict(interpret=True, block_sizes=BLOCKS) if implementation == "pallas" else {}),
            **kw)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


# Without a causal mask (with a bias shared by the heads, its gradient included):
# test_the_dbias_kernel_never_reads_a_poisoned_document[segments].
@pytest.mark.parametrize("kw", [dict(is_causal=True)], ids=["causal"])
def test_poisoned_document_is_never_read(kw):
    inputs = make_inputs(7, dtype=jnp.float32, B=2, T=256, S=256, N=2, K=1, H=32)
    q, k, v, ct = inputs["q"], inputs["k"], inputs["v"], inputs["ct"]
    segments = jnp.repeat(jnp.arange(4), 64)[None].repeat(2, 0).astype(jnp.int32)
    poisoned = slice(192, 256)  # document 3 of batch entry 0
    k_bad = k.at[0, poisoned].set(jnp.nan)
    v_bad = v.at[0, poisoned].set(jnp.nan)
    out, (dq, dk, dv) = _grads(q, k_bad, v_bad, ct, segments, "pallas", **kw)
    want, (dq_w, dk_w, dv_w) = _grads(q, k, v, ct, segments, "xla", **kw)
    clean = slice(0, 192)
    for got, ref in ((out, want), (dq, dq_w), (dk, dk_w), (dv, dv_w)):
        np.testing.assert_allclose(got[0, clean], ref[0, clean], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(got[1], ref[1], atol=2e-5, rtol=2e-5)
    assert np.isnan(np.asarray(out[0, poisoned])).all()


MOSAIC = pallas_attn.BlockSizes(block_q=128, block_k=64, block_q_dkv=64, block_k_dkv=128,
                                block_q_dq=128, block_k_dq=64, forward_backend="mosaic",
                                dq_backend="mosaic", dkv_backend="mosaic")


def test_the_mosaic_kernels_never_read_a_poisoned_document():
    """The Hopper kernels in the Mosaic GPU interpreter: in batch entry 0 documents of 64
    tokens, so a forward or dQ item (128 rows) holds two and each consumer narrows to its
    own; in entry 1 documents of 140, 52 and 64, so a consumer's band holds tiles inside
    its document (which compare no ids) and one shared with the next (which must). With
    NaN in the last document's keys and values (keys 192-255 in both entries), every
    other document is finite and equals the reference's. No causal mask: only the
    documents' ranges keep the kernels out of the poisoned tiles (causal packed documents
    on these kernels: test_mosaic_dq.py, test_mosaic_dkv.py and the causal document mask
    below)."""
    inputs = make_inputs(9, dtype=jnp.bfloat16, B=2, T=256, S=256, N=1, K=1, H=64)
    q, k, v, ct = inputs["q"], inputs["k"], inputs["v"], inputs["ct"]
    ids = [np.repeat(np.arange(len(lengths)), lengths)
           for lengths in ((64, 64, 64, 64), (140, 52, 64))]
    segments = jnp.asarray(np.stack(ids), jnp.int32)
    poisoned = slice(192, 256)

    def run(k, v):
        def loss(q, k, v):
            out = pallas_attn.dot_product_attention(
                q, k, v, q_segment_ids=segments, implementation="pallas", interpret=True,
                block_sizes=MOSAIC)
            return jnp.sum(out.astype(jnp.float32) * ct), out

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, out), grads = step(q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    bad = run(k.at[:, poisoned].set(jnp.nan), v.at[:, poisoned].set(jnp.nan))
    assert np.isnan(bad[0][:, poisoned]).all()
    out, grads = _grads(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                        ct, segments, "xla")
    for got, want in zip(bad, (out, *grads), strict=True):
        want = np.asarray(want, np.float32)
        scale = 2e-2 * max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got[:, :192], want[:, :192], atol=scale, rtol=2e-2)


@pytest.mark.parametrize(("blocks", "causal", "length"),
                         [(BLOCKS, False, 64), (BLOCKS, True, 64), (MOSAIC, True, 64)],
                         ids=["triton-documents", "triton-causal_documents",
                              "mosaic-causal_documents"])
def test_a_document_mask_never_reads_a_poisoned_document(blocks, causal, length):
    """The same documents as a boolean mask [B, 1, T, S] (block-diagonal, or causal
    within each document): the kernels skip the tiles outside each row's first-to-last
    visible key (core.mask_ranges), so NaN keys and values of a document no other row
    sees never reach the others; a kernel reading those tiles would turn them NaN. (The
    tiles a row sees whole run without the mask: test_whole_tiles_read_no_mask, in every
    Mosaic role.)"""
    inputs = make_inputs(11, dtype=jnp.bfloat16, B=2, T=256, S=256, N=1, K=1, H=64)
    q, k, v, ct = inputs["q"], inputs["k"], inputs["v"], inputs["ct"]
    doc = jnp.arange(256) // length
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask = mask & jnp.tri(256, dtype=bool)
    mask = jnp.broadcast_to(mask, (2, 1, 256, 256))
    poisoned = slice(256 - length, 256)

    def run(impl, k, v):
        def loss(q, k, v):
            out = pallas_attn.dot_product_attention(
                q, k, v, mask=mask, implementation=impl,
                **(dict(interpret=True, block_sizes=blocks) if impl == "pallas" else {}))
            return jnp.sum(out.astype(jnp.float32) * ct), out

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, out), grads = step(q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    bad = run("pallas", k.at[0, poisoned].set(jnp.nan), v.at[0, poisoned].set(jnp.nan))
    assert np.isnan(bad[0][0, poisoned]).all()
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = [np.asarray(x, np.float32) for x in _masked_reference(*f32, ct, mask)]
    for got, ref in zip(bad, want, strict=True):
        scale = 2e-2 * max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(got[0, :256 - length], ref[0, :256 - length], atol=scale,
                                   rtol=2e-2)
        np.testing.assert_allclose(got[1], ref[1], atol=scale, rtol=2e-2)


DBIAS_BLOCKS = pallas_attn.BlockSizes(block_q=32, block_k=32, block_q_dkv=32,
                                      block_k_dkv=32, block_q_dq=32, block_k_dq=32,
                                      block_q_dbias=32, block_k_dbias=32, fuse_dbias=False)


@pytest.mark.parametrize(("blocks", "argnums"), [(BLOCKS, (0,)), (MOSAIC, (0, 1, 2))],
                         ids=["triton", "mosaic"])
def test_whole_tiles_read_no_mask(blocks, argnums, monkeypatch):
    """Tiles inside what a row sees whole (core.mask_ranges' second half) run without the
    mask: told that every row sees every key whole, the kernels ignore the mask's hidden
    entries, and the forward and the gradients give the unmasked result (dK/dV only on
    Mosaic: the Triton dK/dV kernel reads the mask everywhere, measured faster). A
    kernel that read the mask there would hide the entries."""
    from pallas_attn.kernels import core, vjp

    def whole(mask, batch, q_len, kv_len, q_pad, kv_pad):
        key, query = core.mask_ranges(mask, batch, q_len, kv_len, q_pad, kv_pad)
        everything = lambda r, n, m: r.at[:, 2].set(0).at[:, 3, :m].set(n)  # noqa: E731
        return everything(key, kv_len, q_len), everything(query, q_len, kv_len)

    monkeypatch.setattr(vjp, "mask_ranges", whole)
    inputs = make_inputs(13, dtype=jnp.bfloat16, B=1, T=256, S=256, N=1, K=1, H=64)
    q, k, v, ct = inputs["q"], inputs["k"], inputs["v"], inputs["ct"]
    mask = (jnp.arange(256)[None, :] % 7 != 3)[None, None] | jnp.eye(256, dtype=bool)

    def run(mask, **kw):
        def loss(q, k, v):
            out = pallas_attn.dot_product_attention(q, k, v, mask=mask, **kw)
            return jnp.sum(out.astype(jnp.float32) * ct), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    got = run(mask, implementation="pallas", interpret=True, block_sizes=blocks)
    want = run(None, implementation="xla")
    for g, w in zip(got, want, strict=True):
        scale = 2e-2 * max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, atol=scale, rtol=2e-2)


@pytest.mark.parametrize(("hide", "causal"), [("segments", False), ("mask", True)],
                         ids=["segments", "mask-causal_ragged"])
def test_the_dbias_kernel_never_reads_a_poisoned_document(hide, causal):
    """A bias shared by the heads, its gradient from the Triton dbias kernel: documents of
    64 given as segment ids or as a mask, NaN keys and values in the last document of
    batch entry 0. Every other document's output and gradients, the bias's included,
    equal the reference's: the kernel skips the tiles no row of a member sees (causal
    ragged: T = 200, query lengths 180 and 150, NaN in the bias's rows past them)."""
    T = 200 if causal else 256
    inputs = make_inputs(14, dtype=jnp.float32, B=2, T=T, S=T, N=2, K=1, H=32)
    q, k, v, ct = inputs["q"], inputs["k"], inputs["v"], inputs["ct"]
    doc = jnp.arange(T) // 64
    segments = jnp.broadcast_to(doc, (2, T)).astype(jnp.int32)
    kw = dict(is_causal=causal)
    if hide == "segments":
        kw.update(q_segment_ids=segments)
    else:
        kw.update(mask=jnp.broadcast_to(doc[:, None] == doc[None, :], (2, 1, T, T)))
    lengths = jnp.array([180, 150], jnp.int32) if causal else None
    bias = jax.random.normal(jax.random.key(4), (2, 1, T, T), jnp.float32)
    if causal:  # the bias's rows past the query lengths are hidden too
        bias = bias.at[0, :, 180:].set(jnp.nan).at[1, :, 150:].set(jnp.nan)
    poisoned = slice(192, T)

    def run(k, v, implementation):
        def loss(q, k, v, bias):
            out = pallas_attn.dot_product_attention(
                q, k, v, bias=bias, query_seq_lengths=lengths, implementation=implementation,
                **(dict(interpret=True, block_sizes=DBIAS_BLOCKS)
                   if implementation == "pallas" else {}), **kw)
            return jnp.sum(out * ct), out

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        (_, out), grads = step(q, k, v, bias)
        return [np.asarray(x) for x in (out, *grads)]

    plan = pallas_attn.explain(q, k, v, bias=bias, interpret=True, block_sizes=DBIAS_BLOCKS,
                               query_seq_lengths=lengths, **kw)
    assert plan.dbias.backend == "triton" and not plan.dbias.fused
    bad = run(k.at[0, poisoned].set(jnp.nan), v.at[0, poisoned].set(jnp.nan), "pallas")
    want = run(k, v, "xla")
    for got, ref in zip(bad[:4], want[:4], strict=True):  # out, dq, dk, dv
        np.testing.assert_allclose(got[0, :192], ref[0, :192], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(got[1], ref[1], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(bad[4][0, :, :192], want[4][0, :, :192], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(bad[4][1], want[4][1], atol=2e-5, rtol=2e-5)


def test_segments_and_a_mask_skip_what_either_hides():
    """Segment ids and a mask together: the kernels take the intersection of their
    ranges. Two documents by ids; the mask lets each row see up to 64 keys past itself,
    into the next document for the first one's last rows. NaN keys at the start of the
    second document (visible to its own rows) never reach the first document's."""
    inputs = make_inputs(12, dtype=jnp.float32, B=1, T=256, S=256, N=2, K=1, H=32)
    q, k, v, ct = inputs["q"], inputs["k"], inputs["v"], inputs["ct"]
    segments = jnp.repeat(jnp.arange(2), 128)[None].astype(jnp.int32)
    pos = jnp.arange(256)
    mask = (pos[None, :] <= pos[:, None] + 64)[None, None]
    poisoned = slice(128, 192)
    bad, bad_grads = _grads(q, k.at[0, poisoned].set(jnp.nan), v.at[0, poisoned].set(jnp.nan),
                            ct, segments, "pallas", mask=mask)
    want, want_grads = _grads(q, k, v, ct, segments, "xla", mask=mask)
    for got, ref in zip((bad, *bad_grads), (want, *want_grads), strict=True):
        np.testing.assert_allclose(got[0, :128], ref[0, :128], atol=2e-5, rtol=2e-5)
    assert np.isnan(np.asarray(bad[0, 128:])).all()


def _masked_reference(q, k, v, ct, mask):
    def loss(q, k, v):
        out = pallas_attn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return (out, *grads)


def _jit(fn, *arrays):
    """fn(*arrays) as one jitted program (eagerly, every small operation in it would
    compile on its own); fn is a fresh closure, traced with the module's constants as
    they are now."""
    return jax.jit(fn)(*arrays)


def test_mask_ranges_bound_every_visible_entry(monkeypatch):
    """core.mask_ranges against the mask itself, in chunks of keys: each row's range
    runs from its first chunk holding a visible key (in any head) to its last, each
    key's over the groups of CHUNK rows that see a key of its chunk; empty
    [n, 0) for rows and keys that see nothing and for padding; broadcast dims too."""
    from pallas_attn.kernels import core

    CHUNK = 4  # noqa: N806 - several chunks in 11 keys
    monkeypatch.setattr(core, "MASK_RANGE_CHUNK", CHUNK)
    rng = np.random.default_rng(3)
    mask = rng.random((2, 3, 9, 11)) < 0.08
    mask[1, :, 4] = False
    keys, queries = (np.asarray(x) for x in _jit(lambda m: core.mask_ranges(m, 2, 9, 11, 12, 16),
                                                  jnp.asarray(mask)))
    seen = mask.any(axis=1)
    for b in range(2):
        for i in range(12):  # each row: its first chunk with a visible key to its last
            cols = np.flatnonzero(seen[b, i]) if i < 9 else []
            want = ([cols[0] // CHUNK * CHUNK, min(11, (cols[-1] // CHUNK + 1) * CHUNK)]
                    if len(cols) else [11, 0])
            np.testing.assert_array_equal(keys[b, :2, i], want)
        for j in range(16):  # each key: the rows that see a key of its chunk
            chunk = slice(j // CHUNK * CHUNK, j // CHUNK * CHUNK + CHUNK)
            rows = np.flatnonzero(seen[b, :, chunk].any(axis=1)) if j < 11 else []
            want = ([rows[0] // CHUNK * CHUNK, min(9, (rows[-1] // CHUNK + 1) * CHUNK)]
                    if len(rows) else [9, 0])
            np.testing.assert_array_equal(queries[b, :2, j], want)
    keys, queries = _jit(lambda m: core.mask_ranges(m, 2, 9, 11, 12, 16),
                         jnp.ones((1, 1, 1, 11), bool))
    np.testing.assert_array_equal(keys[:, :, :9], np.broadcast_to([[0], [11]] * 2, (2, 4, 9)))
    np.testing.assert_array_equal(queries[:, :, :11], np.broadcast_to([[0], [9]] * 2, (2, 4, 11)))
    rows = jnp.array([True, False, True, True, False, False, False, False, False])
    keys, queries = _jit(lambda m: core.mask_ranges(m, 2, 9, 11, 12, 16),
                         rows[None, None, :, None])
    np.testing.assert_array_equal(keys[0, :, :5], [[0, 11, 0, 0, 11], [11, 0, 11, 11, 0]] * 2)
    np.testing.assert_array_equal(queries[1, :2, :11], np.broadcast_to([[0], [4]], (2, 11)))
    np.testing.assert_array_equal(queries[1, 2:, :11], np.broadcast_to([[9], [0]], (2, 11)))


def _first_run(full: np.ndarray) -> tuple[int, int] | None:
    """The first run [start, stop) of True in a 1-d array, or None."""
    if not full.any():
        return None
    start = int(np.argmax(full))
    rest = np.flatnonzero(~full[start:])
    return start, start + int(rest[0]) if len(rest) else len(full)


def test_mask_ranges_whole_runs(monkeypatch):
    """The second half of core.mask_ranges: each row's first run of key chunks that it
    sees whole in every head, each key's first run of row groups that see its chunk
    whole (padding counted visible, stops clipped to the lengths); every entry
    inside is visible, so the kernels read no mask there."""
    from pallas_attn.kernels import core

    CHUNK = 4  # noqa: N806 - several chunks in the lengths below
    monkeypatch.setattr(core, "MASK_RANGE_CHUNK", CHUNK)
    T, S = 22, 19  # noqa: N806
    rows, cols = np.arange(T)[:, None], np.arange(S)[None, :]
    docs = np.minimum(rows // 8, 2) == np.minimum(cols // 8, 2)  # documents of 8
    mask = np.stack([np.stack([docs, docs & (cols <= rows)]),  # heads: documents, causal
                     np.stack([docs, docs])])
    mask[1, :, 3, 1] = False  # a hole: row 3 sees chunk 0 whole no more
    mask[1, 0, 17, :] = True  # one head only: nothing whole gained
    keys, queries = (np.asarray(x) for x in _jit(
        lambda m: core.mask_ranges(m, 2, T, S, 24, 20), jnp.asarray(mask)))
    every = mask.all(axis=1)
    padded = np.pad(every, ((0, 0), (0, 24 - T), (0, 20 - S)), constant_values=True)
    for b in range(2):
        for i in range(24):
            run = _first_run(padded[b, i].reshape(-1, CHUNK).all(axis=1)) if i < T else None
            want = [run[0] * CHUNK, min(S, run[1] * CHUNK)] if run else [S, 0]
            np.testing.assert_array_equal(keys[b, 2:, i], want, err_msg=f"row {b} {i}")
            assert i >= T or every[b, i, want[0]:want[1]].all()
        groups = padded[b].reshape(-1, CHUNK, 5, CHUNK).all(axis=(1, 3))  # [row group, chunk]
        for j in range(20):
            run = _first_run(groups[:, j // CHUNK]) if j < S else None
            want = [run[0] * CHUNK, min(T, run[1] * CHUNK)] if run else [T, 0]
            np.testing.assert_array_equal(queries[b, 2:, j], want, err_msg=f"key {b} {j}")
            if j < S:
                assert every[b, want[0]:want[1], j].all()
    # Documents of 8 over chunks of 4: rows see their document's chunks whole (row 3
    # past its hole); causal rows only the chunks before their own.
    np.testing.assert_array_equal(keys[1, 2:, [0, 3, 9, 20]], [[0, 8], [4, 8], [8, 16], [16, 19]])
    np.testing.assert_array_equal(keys[0, 2:, [8, 12, 21]], [[19, 0], [8, 12], [16, 19]])


def test_unsorted_and_ragged_segments_stay_exact():
    inputs = make_inputs(8, dtype=jnp.float32, B=2, T=100, S=100, N=2, K=2, H=32)
    rng = np.random.default_rng(0)
    segments = jnp.asarray(np.stack([np.sort(rng.integers(0, 5, 100)),
                                     rng.integers(0, 3, 100)]), jnp.int32)
    got = _grads(inputs["q"], inputs["k"], inputs["v"], inputs["ct"], segments, "pallas",
                 is_causal=True)
    want = _grads(inputs["q"], inputs["k"], inputs["v"], inputs["ct"], segments, "xla",
                  is_causal=True)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


def test_segment_ranges():
    from pallas_attn.kernels.core import segment_ranges

    q = jnp.array([[0, 0, 1, 1, 2, 9], [1, 0, 1, 0, 0, 0]], jnp.int32)
    kv = jnp.array([[0, 1, 1, 1, 2, 2, 0, 0], [0, 0, 1, 1, 2, 2, 0, 0]], jnp.int32)
    keys, queries = _jit(lambda q, kv: segment_ranges(q, kv, q_len=5, kv_len=6), q, kv)
    # Entry 0: keys sorted over the first 6; query row 5 is padding (empty range).
    np.testing.assert_array_equal(keys[0], [[0, 0, 1, 1, 4, 6], [1, 1, 4, 4, 6, 0]] * 2)
    # Entry 1: sorted keys; its queries are unsorted, so every key keeps all rows (a stop
    # past the rows: the range is not exact).
    np.testing.assert_array_equal(keys[1], [[2, 0, 2, 0, 0, 6], [4, 2, 4, 2, 2, 0]] * 2)
    # Whole ranges only where exact: empty for every key of entry 1.
    np.testing.assert_array_equal(queries[1][:, :6], [[0] * 6, [6] * 6, [0] * 6, [0] * 6])
    np.testing.assert_array_equal(queries[1][:, 6:], [[5, 5], [0, 0]] * 2)


def test_runs_and_searches_agree():
    """Self-attention ids (one array) take the runs path; the same ids as two arrays
    take the binary searches; both give the same ranges, sorted or not."""
    from pallas_attn.kernels.core import segment_ranges

    rng = np.random.default_rng(1)
    ids = jnp.asarray(np.stack([np.sort(rng.integers(0, 6, 40)), rng.integers(0, 3, 40)]),
                      jnp.int32)
    padded = jnp.pad(ids, ((0, 0), (0, 8)))
    same = _jit(lambda ids: segment_ranges(ids, ids, 40, 40, same=True), padded)
    searched = _jit(lambda ids: segment_ranges(ids, ids + 0, 40, 40, same=False), padded)
    for a, b in zip(same, searched, strict=True):
        np.testing.assert_array_equal(a, b)
