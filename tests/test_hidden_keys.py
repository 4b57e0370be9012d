"""Keys the caller hid never change a result in the kernels, NaN and inf among them.

A NaN key and an inf value sit where the caller hid them (a masked column, another
segment, outside a window, causally future), inside tiles the kernels read: the
Triton kernels in the Pallas interpreter with 16-row tiles (a band's edge tiles and
the tiles inside it), the decode kernel, and the Mosaic GPU kernels in theirs (their
forward and dQ rows that a hidden key reached are recomputed by the Triton repair
kernels; the dK/dV kernel zeroes dS where P is 0). Hidden from every row, the
outputs, logsumexp and every gradient equal those of clean inputs (bit for bit, but
for the Mosaic rows the Triton kernels repaired: to bfloat16 rounding); hidden from
some rows, those rows keep their clean values and the rows that see the key are NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import (  # noqa: F401
    KERNEL_PRIMITIVES,
    SMALL_BLOCKS,
    host_primitives,
    no_mosaic_races,
)

import pallas_attn

pytestmark = pytest.mark.timeout(300)

MOSAIC = pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                dkv_backend="mosaic")


def _hiding(case: str, B: int, T: int, S: int) -> tuple[dict, int]:
    """(the call's arguments, the key they hide from every row, or from all rows but
    the last for "causal_last_row"; a tuple of keys where several are hidden)."""
    middle = S // 2 - 4  # inside a tile, away from its edges
    return {
        "mask": (dict(mask=jnp.ones((B, 1, T, S), bool).at[..., middle].set(False)), middle),
        # A key padding mask: one entry per key, read a key tile's row at a time.
        "mask_per_key": (dict(mask=jnp.ones((B, 1, 1, S), bool).at[..., middle].set(False)),
                         middle),
        # A mask per row hiding rows 20-59 from every key (those rows' tiles run with it,
        # the ones beside them too), the key visible to the other rows.
        "mask_per_row": (dict(mask=jnp.ones((B, 1, T, 1), bool).at[:, :, 20:60].set(False)),
                         middle),
        # The mask with a bias per row and its gradient under a soft cap (the dQ kernel's
        # row sums of dS, P dP and P times the cap's slope).
        "mask_and_bias_per_row": (
            dict(mask=jnp.ones((B, 1, T, S), bool).at[..., middle].set(False),
                 bias=jnp.linspace(-1.0, 1.0, B * T).reshape(B, 1, T, 1), logits_soft_cap=4.0),
            middle),
        # With a bias per key and its gradient (dS's column sums in the dK/dV kernel).
        "mask_and_bias_per_key": (
            dict(mask=jnp.ones((B, 1, 1, S), bool).at[..., middle].set(False),
                 bias=jnp.linspace(-1.0, 1.0, B * S).reshape(B, 1, 1, S)), middle),
        # Sorted ids: the rows' segment is keys [0, middle), whose tiles run whole.
        "segment": (dict(q_segment_ids=jnp.zeros((B, T), jnp.int32),
                         kv_segment_ids=jnp.zeros((B, S), jnp.int32).at[:, middle:].set(9)),
                    middle),
        # Unsorted ids: no tile runs whole.
        "segment_unsorted": (dict(q_segment_ids=jnp.zeros((B, T), jnp.int32),
                                  kv_segment_ids=jnp.zeros((B, S), jnp.int32).at[:, middle].set(9)),
                             middle),
        # Bottom-right, 10 keys back: the keys before S - T - 10 are hidden from every row;
        # the last of them shares a tile with keys that rows see.
        "window": (dict(local_window_size=(10, 0), causal_alignment="bottom_right"),
                   S - T - 11),
        # Top-left causal: a key past the last row, which padded rows would see.
        "causal_future": (dict(is_causal=True), T + 10),
        # Causal, a third of the rows valid: the key after them is hidden from every valid
        # row, while rows past the length would see it in whole tiles.
        "query_lengths": (dict(is_causal=True,
                               query_seq_lengths=jnp.full((B,), T // 3, jnp.int32)), T // 3 + 2),
        # Batch entry 0 has no query row; the others' keys end 30 early.
        "unseen_rows": (dict(query_seq_lengths=jnp.array([0] + [T] * (B - 1), jnp.int32),
                             key_value_seq_lengths=jnp.array([S] + [S - 30] * (B - 1),
                                                             jnp.int32)), S - 20),
        # Bottom-right causal: the last key is hidden from every row but the last.
        "causal_last_row": (dict(is_causal=True, causal_alignment="bottom_right"), S - 1),
        # The same with a bias per key: the last row's NaN dS reaches every key's dbias.
        "bias_per_key_causal_last_row": (
            dict(bias=jnp.linspace(-1.0, 1.0, B * S).reshape(B, 1, 1, S), is_causal=True,
                 causal_alignment="bottom_right"), S - 1),
        # Both at once: the masked key lies inside the causal band of most rows (tiles
        # that run without band masks), the last key is hidden from all rows but the last.
        "mask_causal_last_row": (dict(mask=jnp.ones((B, 1, T, S), bool).at[..., middle].set(False),
                                      is_causal=True, causal_alignment="bottom_right"),
                                 (S - 1, middle)),
    }[case]


def _results(ct, bias=None, **kwargs):
    """fn(q, k, v, poisoned) -> [out, lse, dq, dk, dv(, dbias)]: one jitted step for the
    clean and the dirty inputs (same shapes: traced and compiled once); the dirty ones
    hold NaN in the bias entries of the hidden keys too."""
    def loss(q, k, v, bias):
        out, lse = pallas_attn.dot_product_attention(q, k, v, bias, return_residual=True,
                                                     **kwargs)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(finite_lse), (out, lse)

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    step = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))

    def results(q, k, v, poisoned=()):
        """poisoned: the keys whose bias entries (a bias with its own keys) are NaN."""
        b = bias
        if b is not None and b.shape[-1] > 1 and len(poisoned):
            b = b.at[..., np.asarray(poisoned)].set(jnp.nan)
        (_, aux), grads = step(q, k, v, b)
        return [np.asarray(x, np.float32) for x in (*aux, *grads)]

    return results


def _assert_same(got: np.ndarray, want: np.ndarray, name: str, exact: bool) -> None:
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=name)
        return
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
    scale = np.abs(want[np.isfinite(want)]).max(initial=0.0)  # none: lse of rows that see none
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * scale, err_msg=name)


def _check(case: str, shapes: tuple, dtype, exact: bool = True, **kwargs) -> None:
    B, T, S, N, H = shapes
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype)
               for shape in ((B, T, N, H), (B, S, N, H), (B, S, N, H)))
    ct = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    hiding, key = _hiding(case, B, T, S)
    key = np.atleast_1d(key)
    results = _results(ct, **hiding, **kwargs)
    clean = results(q, k, v)
    dirty = results(q, k.at[:, key, 0].set(jnp.nan), v.at[:, key, 0].set(jnp.inf), key)
    names = ("out", "lse", "dq", "dk", "dv", "dbias")[:len(clean)]
    if case == "mask_per_row":
        # The rows the mask hides keep their results (nothing); every other row sees the
        # key and turns NaN (head 0, whose kv head holds it).
        hidden = ~np.asarray(hiding["mask"][0, 0, :, 0])
        for name, got, want in zip(names[:3], dirty, clean, strict=False):
            _assert_same(got[:, hidden], want[:, hidden], name, exact)
            assert np.isnan(got[:, ~hidden, 0]).all(), name
        return
    if not case.endswith("causal_last_row"):
        for name, got, want in zip(names, dirty, clean, strict=True):
            _assert_same(got, want, name, exact)
        return
    # Only the last row sees the key: the others keep their values, it turns NaN (head 0,
    # whose kv head holds the key).
    for name, got, want in zip(names[:3], dirty, clean, strict=False):
        _assert_same(got[:, :-1], want[:, :-1], name, exact)
        assert np.isnan(got[:, -1, 0]).all(), name
    if "dbias" in names:  # a sum over every row, the last one's NaN dS among them
        assert np.isnan(dirty[names.index("dbias")]).all()


@pytest.mark.parametrize("case", ["mask", "segment", "segment_unsorted", "window",
                                  "query_lengths", "unseen_rows", "causal_last_row",
                                  "bias_per_key_causal_last_row"])
def test_triton_kernels(case):
    """16-row tiles, T=32, S=48: the hidden key lies in a tile inside the band for the
    mask and segments (those tiles run without band masks) and in an edge tile for the
    window and causal masking."""
    _check(case, (1, 32, 48, 2, 16), jnp.float32, implementation="pallas", interpret=True,
           block_sizes=SMALL_BLOCKS)


@pytest.mark.parametrize("case", ["query_lengths", "unseen_rows", "mask_causal_last_row",
                                  "mask_and_bias_per_key", "bias_per_key_causal_last_row",
                                  "mask_and_bias_per_row", "segment", "mask_per_row"])
def test_mosaic_kernels(case):
    """The Mosaic forward, dQ and dK/dV kernels, T=100 (padded rows), S=128, head dim 64.
    A mask (with a bias per row and its gradient) or other segments hide a key from
    every row inside the tiles; the mask and
    bottom-right causal masking each hide a key in one run; a key padding
    mask hides one from every row, with a bias per key and its gradient, which a key
    only the last row sees turns NaN (dS's column sums in the dK/dV kernel). With no
    query row at all (unseen_rows, B=1), no key reaches the output, though nothing
    else hides it. A mask per row keeps the key from the rows it hides. (A causal key
    that only rows past the valid ones see: query_lengths here, at head dim 64; the
    padded rows' causal_future at head dim 176: test_mosaic_kernels_at_head_dim_192.)"""
    _check(case, (1, 100, 128, 1, 64), jnp.bfloat16, exact=False, implementation="pallas",
           interpret=True, block_sizes=MOSAIC)


@pytest.mark.parametrize("case", ["causal_future", "mask_causal_last_row"])
def test_mosaic_kernels_at_head_dim_192(case):
    """Head dim 176 pads to 192 where only Mosaic kernels run; the Triton repairs, whose
    tiles are powers of two, read those 192 columns in place as tiles of 256
    (`context.head_tile`) and write back 192. The mask:
    the wide dQ and dK/dV kernels (consumers sharing each tile), the dK/dV's mask tiles
    read from global memory."""
    plan = pallas_attn.explain(*(jnp.zeros((1, 100, 1, 176), jnp.bfloat16),) * 3, is_causal=True,
                               interpret=True, block_sizes=MOSAIC)
    assert plan.head_dims == (192, 192) and plan.forward.repair is not None
    _check(case, (1, 100, 128, 1, 176), jnp.bfloat16, exact=False, implementation="pallas",
           interpret=True, block_sizes=MOSAIC)


@pytest.mark.parametrize("case", ["window", "unseen_rows", "causal_last_row", "mask",
                                  "mask_and_bias_per_key", "mask_causal_last_row"])
def test_decode_kernel(case):
    """Three query rows against 200 keys (tiles of 64): the window's first tile and the
    causal band's last tile hide keys; a mask's tiles inside the band run uncleaned, then
    again cleaned where the hidden key reached their accumulator."""
    shapes = (2, 3, 200, 2, 16)
    plan = pallas_attn.explain(*(jnp.zeros(s) for s in ((2, 3, 2, 16), (2, 200, 2, 16),
                                                        (2, 200, 2, 16))),
                               interpret=True, **_hiding(case, 2, 3, 200)[0])
    assert plan.forward.backend == "decode"
    _check(case, shapes, jnp.float32, implementation="pallas", interpret=True)


def test_mosaic_repairs_in_runs_of_tiles():
    """T=300 at head dim 64 pads to 384 rows (items of 192): six repair tiles of 64, read
    in runs of two by three programs (`context.repair_marked_tiles`); the one row that
    sees the key lies in the third run."""
    _check("mask_causal_last_row", (1, 300, 128, 1, 64), jnp.bfloat16, exact=False,
           implementation="pallas", interpret=True, block_sizes=MOSAIC)


@pytest.mark.parametrize("bias_shape", [(2, 2, 100, 1), (2, 2, 100, 128), (1, 2, 100, 128)],
                         ids=["per_row", "full", "shared_by_batch"])
@pytest.mark.parametrize("dtype, blocks", [(jnp.bfloat16, MOSAIC), (jnp.float32, SMALL_BLOCKS)],
                         ids=["mosaic", "triton"])
def test_queries_past_their_length_change_no_result(dtype, blocks, bias_shape):
    """The queries, output cotangents and bias rows past each batch entry's query length
    hold NaN: every result equals that of clean inputs, those rows' gradients zero. A
    bias with its gradient under a soft cap (on the Mosaic route: per row, summed from
    the dQ kernel's row sums; shared by the batch entries, started by the dQ kernel),
    a window, key lengths, GQA."""
    B, T, S, N, K, H = 2, 100, 128, 2, 1, 64
    rng = np.random.default_rng(5)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
                   ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
    bias = jnp.asarray(rng.standard_normal(bias_shape), dtype)
    lengths = jnp.array([37, 90], jnp.int32)
    hidden = np.arange(T)[None, :] >= np.asarray(lengths)[:, None]  # [B, T]

    @jax.jit
    def results(q, ct, bias):
        def loss(q, k, v, bias):
            out, lse = pallas_attn.dot_product_attention(
                q, k, v, bias, query_seq_lengths=lengths,
                key_value_seq_lengths=jnp.array([128, 100], jnp.int32),
                local_window_size=(80, 80), logits_soft_cap=4.0, return_residual=True,
                implementation="pallas", interpret=True, block_sizes=blocks)
            lse = jnp.where(hidden[:, :, None], 0.0, lse)  # [B, T, N]
            return jnp.sum(out.astype(jnp.float32) * ct), (out, lse)
        (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            q, k, v, bias)
        return [x.astype(jnp.float32) for x in (*aux, *grads)]

    rows = jnp.asarray(hidden)[:, :, None, None]
    clean = results(q, ct, bias)
    seen = bias_shape[0] == 1  # shared by the batch entries: its rows up to 90 seen
    dirty_bias = jnp.where(jnp.swapaxes(rows[-1:] if seen else rows, 1, 2), jnp.nan, bias)
    dirty = results(jnp.where(rows, jnp.nan, q), jnp.where(rows, jnp.nan, ct), dirty_bias)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dbias"), dirty, clean,
                               strict=True):
        _assert_same(np.asarray(got), np.asarray(want), name, exact=blocks is SMALL_BLOCKS)
    dq, dbias = np.asarray(dirty[2]), np.asarray(dirty[5])
    assert not dq[hidden].any()
    assert not np.swapaxes(dbias, 1, 2)[hidden[-1:] if seen else hidden].any()


@pytest.mark.parametrize("head_dim", [48, 176])
def test_repairs_take_no_cond_outside_the_kernels(head_dim):
    """A causal fwd+bwd on the Mosaic kernels of an H100 at head dims padded to no power
    of two (48, 192): the repairs read the marks inside their kernels. A lax.cond on them
    around the kernels would make the host wait for its predicate on every call (the
    d160 and d192 causal forwards 17-19% slower)."""
    q = jnp.zeros((1, 256, 2, head_dim), jnp.bfloat16)
    h100 = pallas_attn.DeviceInfo.for_capability((9, 0))

    def loss(q, k, v):
        out = pallas_attn.dot_product_attention(q, k, v, is_causal=True,
                                                implementation="pallas")
        return jnp.sum(out.astype(jnp.float32))

    with pallas_attn.device.lowering_for(h100):
        plan = pallas_attn.explain(q, q, q, is_causal=True)
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q)
    hp = plan.head_dims[0]
    assert hp & (hp - 1) and plan.forward.repair is not None, plan
    assert all(getattr(plan, role).backend == "mosaic" for role in ("forward", "dq", "dkdv"))
    found = host_primitives(jaxpr.jaxpr)
    assert {"pallas_call", "mpmd_map"} <= found and "cond" not in found, sorted(found)


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)], ids=["sm90", "sm80"])
def test_no_host_conditional_outside_the_kernels_with_any_feature(capability):
    """fwd+bwd with each feature at head dim 112 (the Mosaic kernels at 112 columns on an
    H100, Triton's on an A100), a decode step and a paged one: no cond, while or scan
    around the kernels, whose predicate or trip count a GPU would read on the host."""
    B, T, N, K, H = 2, 512, 4, 2, 112
    q, kv = jnp.zeros((B, T, N, H), jnp.bfloat16), jnp.zeros((B, T, K, H), jnp.bfloat16)
    ids = jnp.repeat(jnp.arange(4), T // 4)[None].repeat(B, 0)
    lengths = jnp.array([300, T])
    features = {
        "plain": {}, "causal": dict(is_causal=True), "window": dict(local_window_size=(100, 0)),
        "mask": dict(mask=jnp.ones((B, 1, T, T), bool)),
        "segments": dict(q_segment_ids=ids, kv_segment_ids=ids),
        "lengths": dict(key_value_seq_lengths=lengths, query_seq_lengths=lengths),
        "bias": dict(bias=jnp.zeros((1, N, T, T), jnp.bfloat16)),
        "dropout": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
        "softcap_alibi_sinks": dict(logits_soft_cap=20.0, alibi_slopes=jnp.ones((N,)),
                                    sinks=jnp.zeros((N,))),
    }
    device = pallas_attn.DeviceInfo.for_capability(capability)
    steps = {}
    for name, kw in features.items():
        def loss(q, k, v, kw=kw):
            out = pallas_attn.dot_product_attention(q, k, v, implementation="pallas", **kw)
            return jnp.sum(out.astype(jnp.float32))
        steps[name] = (jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    steps["decode"] = (lambda q, k: pallas_attn.dot_product_attention(
        q, k, k, key_value_seq_lengths=lengths, implementation="pallas"), q[:, :1], kv)
    cache, table = jnp.zeros((16, 64, K, H), jnp.bfloat16), jnp.arange(16).reshape(B, 8)
    steps["paged"] = (lambda q, c: pallas_attn.paged_attention(
        q, c, c, table, lengths, implementation="pallas"), q[:, :7], cache)
    for name, (step, *args) in steps.items():
        with pallas_attn.device.lowering_for(device):
            found = host_primitives(jax.make_jaxpr(step)(*args).jaxpr)
        assert found & set(KERNEL_PRIMITIVES), (name, sorted(found))
        assert not found & {"cond", "while", "scan"}, (name, sorted(found))


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked", "pallas"])
def test_cotangents_past_the_query_lengths_change_no_gradient(implementation):
    """Rows past a query length see no key: their output is 0 whatever the inputs, so the
    queries and output cotangents there (NaN here) change no gradient, in every
    implementation, sinks' included (their lse is the sink: its cotangent counts)."""
    B, T, S, N, K, H = 2, 48, 40, 2, 1, 16
    rng = np.random.default_rng(11)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in
                   ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
    ct_lse = jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32)
    lengths = jnp.array([29, 48], jnp.int32)
    rows = (np.arange(T)[None, :] >= np.asarray(lengths)[:, None])[:, :, None, None]

    @jax.jit
    def gradients(q, ct):
        def attention(q, k, v, sinks):
            return pallas_attn.dot_product_attention(
                q, k, v, is_causal=True, query_seq_lengths=lengths, sinks=sinks,
                key_value_seq_lengths=jnp.array([40, 31], jnp.int32), return_residual=True,
                implementation=implementation, interpret=implementation == "pallas")
        _, vjp = jax.vjp(attention, q, k, v, jnp.array([0.5, -1.0]))
        return vjp((ct, ct_lse))

    clean = gradients(q, jnp.where(rows, 0.0, ct))
    dirty = gradients(jnp.where(rows, jnp.nan, q), jnp.where(rows, jnp.nan, ct))
    for got, want in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
