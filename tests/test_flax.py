"""pallas_attn.flax against Flax's own attention: outputs, parameter gradients, decoding."""

from __future__ import annotations

import functools
import inspect
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pallas_attn
import pallas_attn.flax as paf

B, T, F, HEADS = 2, 8, 32, 4
TOL = dict(atol=2e-5, rtol=2e-5)


def _normal(seed: int, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    # numpy, not jax.random: compiling threefry for every new shape dominates test time
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _assert_trees_close(a, b, **tol) -> None:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   **(tol or TOL))


def _nnx_out_and_grads(model: nnx.Module, call, ct_seed: int = 99):
    """Output of call(model) and d/dparams of sum(out * ct) for a random cotangent ct."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(p):
        return call(nnx.merge(graphdef, p, rest))

    shape = jax.eval_shape(f, params)
    ct = _normal(ct_seed, shape.shape, shape.dtype)

    @jax.jit  # one compilation instead of many eager dispatches
    def out_and_grads(p):
        out, vjp = jax.vjp(f, p)
        return out, vjp(ct)[0]

    return out_and_grads(params)


def _nnx_pair(**kwargs):
    """Flax's nnx.MultiHeadAttention, default attention and ours, with equal weights."""
    common = dict(num_heads=HEADS, in_features=F, decode=False)
    common.update(kwargs)
    ref = nnx.MultiHeadAttention(**common, rngs=nnx.Rngs(0))
    fused = nnx.MultiHeadAttention(**common, attention_fn=paf.attention_fn, rngs=nnx.Rngs(0))
    return ref, fused


def _padding_mask(kv_len: int = T):
    kv_valid = jnp.array([[1] * kv_len, [1] * (kv_len - 3) + [0] * 3], jnp.int32)
    return nn.make_attention_mask(jnp.ones((B, T), jnp.int32), kv_valid)  # float32 [B,1,T,S]


NNX_CASES = {
    # (an unmasked and a padding-only case: see the cross-attention and linen tests)
    "make_causal_mask": (dict(), dict(mask=nnx.make_causal_mask(jnp.ones((B, T))))),
    "is_causal": (dict(), dict(is_causal=True)),
    "bool_mask_per_head": (dict(), dict(
        mask=jnp.asarray(np.random.default_rng(3).random((B, HEADS, T, T)) < 0.7)
        .at[..., 0].set(True))),
    "gqa_causal_padding": (dict(num_kv_heads=2),
                           dict(mask=_padding_mask() * nnx.make_causal_mask(jnp.ones((B, T))))),
}


@pytest.mark.parametrize("case", list(NNX_CASES))
def test_nnx_multi_head_attention_matches_flax(case):
    ctor, call_kwargs = NNX_CASES[case]
    ref, fused = _nnx_pair(**ctor)
    x = _normal(1, (B, T, F))
    out_ref, g_ref = _nnx_out_and_grads(ref, lambda m: m(x, **call_kwargs))
    out, g = _nnx_out_and_grads(fused, lambda m: m(x, **call_kwargs))
    _assert_trees_close(out, out_ref)
    _assert_trees_close(g, g_ref)


def test_nnx_cross_attention_matches_flax():
    ref, fused = _nnx_pair(in_kv_features=16)
    xq, xkv = _normal(1, (B, T, F)), _normal(2, (B, 12, 16))
    mask = nn.make_attention_mask(jnp.ones((B, T)), jnp.ones((B, 12)).at[1, 9:].set(0))
    out_ref, g_ref = _nnx_out_and_grads(ref, lambda m: m(xq, xkv, mask=mask))
    out, g = _nnx_out_and_grads(fused, lambda m: m(xq, xkv, mask=mask))
    _assert_trees_close(out, out_ref)
    _assert_trees_close(g, g_ref)


LINEN_MASKS = {
    "none": None,
    "make_causal_mask": nn.make_causal_mask(jnp.ones((B, T))),
    "padding_mask": _padding_mask(),
}


@pytest.mark.parametrize("case", list(LINEN_MASKS))
def test_linen_multi_head_dot_product_attention_matches_flax(case):
    mask = LINEN_MASKS[case]
    x = _normal(1, (B, T, F))
    ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    fused = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=paf.attention_fn)
    params = ref.init(jax.random.key(0), x)["params"]

    ct = _normal(99, (B, T, F))

    @functools.partial(jax.jit, static_argnums=0)
    def out_and_grads(module):
        out, vjp = jax.vjp(lambda p: module.apply({"params": p}, x, mask=mask), params)
        return out, vjp(ct)[0]

    out_ref, g_ref = out_and_grads(ref)
    out, g = out_and_grads(fused)
    _assert_trees_close(out, out_ref)
    _assert_trees_close(g, g_ref)


def test_linen_passes_every_keyword_to_attention_fn():
    """linen filters kwargs by attention_fn's signature: ours must name all of them."""
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return paf.attention_fn(*args, **kwargs)

    spy.__signature__ = inspect.signature(paf.attention_fn)
    x = _normal(1, (B, T, F))
    module = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=spy,
                                             force_fp32_for_softmax=True)
    module.init(jax.random.key(0), x)
    assert set(seen) == {"mask", "dropout_rng", "dropout_rate", "broadcast_dropout",
                         "deterministic", "dtype", "precision", "force_fp32_for_softmax",
                         "qk_attn_weights_einsum", "attn_weights_value_einsum"}
    assert seen["force_fp32_for_softmax"] is True


def test_attention_fn_fully_masked_query_rows_are_zero():
    """Padded query rows see no key: 0 here (Flax: mean of value); other rows agree."""
    q, k, v = (_normal(i, (B, T, HEADS, 16)) for i in range(3))
    q_valid = jnp.ones((B, T)).at[1, 5:].set(0)
    kv_valid = jnp.ones((B, T)).at[1, 6:].set(0)
    mask = nnx.make_attention_mask(q_valid, kv_valid)
    rows = q_valid.astype(bool)[:, :, None, None]
    ct = _normal(99, (B, T, HEADS, 16)) * rows  # a loss that ignores the padded rows

    @functools.partial(jax.jit, static_argnums=0)
    def out_and_grads(fn):
        out, vjp = jax.vjp(lambda *a: fn(*a, mask=mask), q, k, v)
        return out, vjp(ct)

    out, grads = out_and_grads(paf.attention_fn)
    out_ref, grads_ref = out_and_grads(nnx.dot_product_attention)
    np.testing.assert_allclose(jnp.where(rows, out, 0), jnp.where(rows, out_ref, 0), **TOL)
    assert not jnp.any(jnp.where(rows, 0, out))
    _assert_trees_close(grads, grads_ref)


def test_attention_fn_batch_dims_bias_and_dtype():
    q = _normal(0, (2, 3, T, HEADS, 16))  # two batch dims
    k, v = _normal(1, (2, 3, 10, HEADS, 16)), _normal(2, (2, 3, 10, HEADS, 16))
    bias = _normal(3, (1, 3, 1, T, 10))
    mask = jnp.ones((2, 1, 1, T, 10), bool).at[0, ..., 7:].set(False)
    full = (2, 3, HEADS, T, 10)  # Flax's own function needs bias / mask full-size

    @jax.jit
    def both(q, k, v, bias, mask):
        return [
            (paf.attention_fn(q, k, v, bias, mask),  # broadcast over the batch dims
             nnx.dot_product_attention(q, k, v, jnp.broadcast_to(bias, full),
                                       jnp.broadcast_to(mask, full))),
            # No batch dim at all.
            (paf.attention_fn(q[0, 0], k[0, 0], v[0, 0], is_causal=True),
             nnx.dot_product_attention(q[0, 0], k[0, 0], v[0, 0], is_causal=True)),
            # dtype casts the inputs, as Flax's promote_dtype does.
            (paf.attention_fn(q, k, v, dtype=jnp.bfloat16),
             nnx.dot_product_attention(q, k, v, dtype=jnp.bfloat16)),
        ]

    (out, expected), (out3, expected3), (half, half_ref) = both(q, k, v, bias, mask)
    np.testing.assert_allclose(out, expected, **TOL)
    np.testing.assert_allclose(out3, expected3, **TOL)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(jnp.float32), half_ref.astype(jnp.float32),
                               atol=2e-2, rtol=2e-2)


def test_attention_fn_forwards_pallas_only_options_and_rejects_unknown():
    q, k, v = (_normal(i, (B, T, HEADS, 16)) for i in range(3))
    fn = functools.partial(paf.attention_fn, logits_soft_cap=5.0, local_window_size=(3, 0))
    expected = pallas_attn.dot_product_attention(q, k, v, logits_soft_cap=5.0,
                                                 local_window_size=(3, 0))
    np.testing.assert_allclose(fn(q, k, v), expected, **TOL)
    with pytest.raises(TypeError, match="unexpected keyword"):
        paf.attention_fn(q, k, v, return_residual=True)
    with pytest.raises(TypeError, match="rope"):
        paf.attention_fn(q, k, v, input_positions=jnp.arange(T))
    with pytest.raises(ValueError, match="dropout_rng"):
        paf.attention_fn(q, k, v, dropout_rate=0.1, deterministic=False)


def test_rope_matches_flax_dot_product_attention_with_rope():
    rope = nnx.RoPE(embedding_size=F // HEADS, max_seq_len=64)
    common = dict(num_heads=HEADS, in_features=F, decode=False)
    ref = nnx.MultiHeadAttention(**common, rngs=nnx.Rngs(0), attention_fn=functools.partial(
        nnx.dot_product_attention_with_rope, rope=rope))
    fused = nnx.MultiHeadAttention(**common, rngs=nnx.Rngs(0), attention_fn=functools.partial(
        paf.attention_fn, rope=rope))
    x = _normal(1, (B, T, F))

    @nnx.jit  # one program (eagerly, each small operation would compile on its own)
    def outputs(ref, fused):
        # Explicit positions ([T] or [B, T]); flax 0.12.12's own function fails on both.
        return (ref(x, is_causal=True), fused(x, is_causal=True),
                fused(x, is_causal=True, input_positions=jnp.arange(T)),
                fused(x, is_causal=True, input_positions=jnp.arange(3, 3 + T)),
                fused(x, is_causal=True,
                      input_positions=jnp.broadcast_to(jnp.arange(3, 3 + T), (B, T))))

    expected, got, positioned, shifted, per_batch = outputs(ref, fused)
    _assert_trees_close(got, expected)
    _assert_trees_close(positioned, expected)
    _assert_trees_close(per_batch, shifted)


def _gqa_reference(module: paf.MultiHeadAttention, x: jax.Array) -> jax.Array:
    """Explicit GQA: project, repeat each key/value head, causal softmax, project out."""
    def proj(layer):
        return jnp.einsum("btf,fnd->btnd", x, layer.kernel[...],
                          precision="highest") + layer.bias[...]
    q = proj(module.query)
    group = module.num_heads // module.num_kv_heads
    k = jnp.repeat(proj(module.key), group, axis=2)
    v = jnp.repeat(proj(module.value), group, axis=2)
    logits = jnp.einsum("btnd,bsnd->bnts", q, k, precision="highest") / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    p = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    o = jnp.einsum("bnts,bsnd->btnd", p, v, precision="highest")
    return jnp.einsum("btnd,ndf->btf", o, module.out.kernel[...],
                      precision="highest") + module.out.bias[...]


def test_gqa_module_matches_reference_and_flax():
    layer = paf.MultiHeadAttention(8, F, num_kv_heads=2, is_causal=True, rngs=nnx.Rngs(0))
    assert layer.key.kernel.shape == (F, 2, F // 8)
    x = _normal(1, (B, T, F))
    out, g = _nnx_out_and_grads(layer, lambda m: m(x))
    out_ref, g_ref = _nnx_out_and_grads(layer, lambda m: _gqa_reference(m, x))
    _assert_trees_close(out, out_ref)
    _assert_trees_close(g, g_ref)
    # Same parameters (names, shapes, values) as nnx.MultiHeadAttention from the same rngs.
    flax_layer = nnx.MultiHeadAttention(8, F, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))
    _assert_trees_close(nnx.state(layer, nnx.Param), nnx.state(flax_layer, nnx.Param), atol=0)
    _assert_trees_close(out, flax_layer(x, is_causal=True))


def test_module_padding_by_lengths_matches_mask():
    layer = paf.MultiHeadAttention(4, F, num_kv_heads=1, rngs=nnx.Rngs(0))
    x = _normal(1, (B, T, F))
    lengths = jnp.array([T, 5])
    mask = (jnp.arange(T)[None, :] < lengths[:, None])[:, None, None, :]
    both = nnx.jit(lambda m: (m(x, key_value_seq_lengths=lengths), m(x, mask=mask)))
    _assert_trees_close(*both(layer))


class _TinyLM(nnx.Module):
    def __init__(self, attention: str, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, F, rngs=rngs)
        if attention == "fused_layer":
            self.attn = paf.MultiHeadAttention(HEADS, F, num_kv_heads=2, is_causal=True,
                                               rngs=rngs)
        else:
            self.attn = nnx.MultiHeadAttention(HEADS, F, num_kv_heads=2, decode=False,
                                               attention_fn=paf.attention_fn, rngs=rngs)
        self.head = nnx.Linear(F, 64, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        if isinstance(self.attn, paf.MultiHeadAttention):
            h = h + self.attn(h)
        else:
            h = h + self.attn(h, is_causal=True)
        return self.head(h)


def test_jitted_training_step_decreases_loss():
    # (the fused layer trains in tests/test_example.py)
    model = _TinyLM("attention_fn", rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (4, 17)), jnp.int32)

    @nnx.jit
    def step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, tokens)) for _ in range(15)]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0]


def test_decode_with_cache_matches_full_causal_forward():
    layer = paf.MultiHeadAttention(4, F, num_kv_heads=2, is_causal=True, rngs=nnx.Rngs(0))
    x = _normal(1, (B, 12, F))
    full = nnx.jit(lambda m, x: m(x))(layer, x)
    decode = nnx.jit(lambda m, t: m(t, decode=True))
    # Token by token.
    layer.init_cache(B, 12)
    steps = [decode(layer, x[:, i:i + 1]) for i in range(12)]
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, **TOL)
    # A prompt chunk, single tokens and another chunk.
    layer.init_cache(B, 16)  # longer than needed: unwritten slots must stay invisible
    pieces = [decode(layer, x[:, :5])] + [decode(layer, x[:, i:i + 1]) for i in range(5, 9)]
    pieces.append(decode(layer, x[:, 9:]))
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, **TOL)
    assert int(layer.cache_index[...]) == 12
    with pytest.raises(ValueError, match="KV cache holds"):  # checked when not traced
        layer(x[:, :5], decode=True)


def test_decode_under_x64():
    """jax_enable_x64 (Python ints become int64) changes nothing in cached decoding."""
    layer = paf.MultiHeadAttention(4, F, num_kv_heads=2, is_causal=True, rngs=nnx.Rngs(0))
    x = _normal(1, (B, 6, F))
    full = layer(x)
    with jax.enable_x64(True):
        layer.init_cache(B, 8)
        pieces = [layer(x[:, :3], decode=True)] + [layer(x[:, i:i + 1], decode=True)
                                                   for i in range(3, 6)]
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, **TOL)


def test_decode_matches_flax_decode():
    """Our cache and nnx.MultiHeadAttention's decode mode agree token by token."""
    ours = paf.MultiHeadAttention(4, F, num_kv_heads=2, rngs=nnx.Rngs(0))
    flax_layer, flax_fused = (
        nnx.MultiHeadAttention(4, F, num_kv_heads=2, decode=True, rngs=nnx.Rngs(0), **kw)
        for kw in (dict(), dict(attention_fn=paf.attention_fn)))
    ours.init_cache(B, 6)
    flax_layer.init_cache((B, 6, F))
    flax_fused.init_cache((B, 6, F))  # Flax's decode mask [B, 1, 1, 6] through attention_fn
    x = _normal(1, (B, 6, F))
    for i in range(6):
        expected = flax_layer(x[:, i:i + 1])
        np.testing.assert_allclose(ours(x[:, i:i + 1], decode=True), expected, **TOL)
        np.testing.assert_allclose(flax_fused(x[:, i:i + 1]), expected, **TOL)


def test_fallback_warns_once_and_returns_flax_result():
    paf.reset_fallback_warnings()
    ref, fused = _nnx_pair(num_kv_heads=2)
    x = _normal(1, (B, T, F))
    mask = nnx.make_causal_mask(jnp.ones((B, T)))

    def sowing(model):
        return nnx.capture(model, nnx.Intermediate)(x, mask=mask, sow_weights=True)

    with pytest.warns(paf.FlaxFallbackWarning, match="attention weights"):
        out, weights = sowing(fused)
    out_ref, weights_ref = sowing(ref)
    np.testing.assert_allclose(out, out_ref, **TOL)
    _assert_trees_close(weights, weights_ref)  # the sowed [B, N, T, S] attention weights
    assert jax.tree.leaves(weights)[0].shape == (B, HEADS, T, T)
    with warnings.catch_warnings():
        warnings.simplefilter("error", paf.FlaxFallbackWarning)  # once per reason
        sowing(fused)
        fused(x, mask=mask)  # and the fused path never warns

    # linen: sow into 'intermediates' through linen's own function.
    paf.reset_fallback_warnings()
    module = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=paf.attention_fn)
    variables = module.init(jax.random.key(0), x)
    with pytest.warns(paf.FlaxFallbackWarning):
        out, state = module.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    ref_module = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    out_ref, state_ref = ref_module.apply(variables, x, sow_weights=True,
                                          mutable=["intermediates"])
    np.testing.assert_allclose(out, out_ref, **TOL)
    _assert_trees_close(state, state_ref)


def test_fallback_for_custom_einsums_and_unhonourable_options():
    paf.reset_fallback_warnings()
    q, k, v = (_normal(i, (B, T, HEADS, 16)) for i in range(3))
    einsums = dict(qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum)
    with pytest.warns(paf.FlaxFallbackWarning, match="custom einsums"):
        out = paf.attention_fn(q, k, v, **einsums)
    np.testing.assert_allclose(out, nn.dot_product_attention(q, k, v, **einsums), **TOL)
    with pytest.raises(ValueError, match="cannot honour"):
        paf.attention_fn(q, k, v, logits_soft_cap=5.0, **einsums)


def test_dropout_runs_and_is_deterministic_for_a_fixed_rng():
    ref, fused = _nnx_pair(dropout_rate=0.3)
    x = _normal(1, (B, T, F))
    a = fused(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    b = fused(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    c = fused(x, deterministic=False, rngs=nnx.Rngs(dropout=8))
    clean = fused(x, deterministic=True)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, clean)
    np.testing.assert_allclose(clean, ref(x, deterministic=True), **TOL)
    # The dropout mask, read back through the value projection, keeps about 70%.
    q, k, v = _normal(0, (1, 64, 1, 8)), _normal(1, (1, 64, 1, 8)), jnp.eye(64)[None, :, None]
    p = paf.attention_fn(q, k, v, dropout_rng=jax.random.key(3), dropout_rate=0.3)
    assert 0.6 < float(jnp.mean(p != 0)) < 0.8
    # Gradients flow through the dropout path.
    _, grads = _nnx_out_and_grads(fused, lambda m: m(x, deterministic=False,
                                                     rngs=nnx.Rngs(dropout=7)))
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    # Our layer: same rng, same result; eval() turns dropout off.
    layer = paf.MultiHeadAttention(4, F, dropout_rate=0.3, deterministic=False,
                                   rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(layer(x, rngs=nnx.Rngs(dropout=1)),
                                  layer(x, rngs=nnx.Rngs(dropout=1)))
    layer.eval()
    np.testing.assert_array_equal(layer(x), layer(x, deterministic=True))
    # linen with a dropout rng stream.
    module = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.3,
                                             attention_fn=paf.attention_fn)
    variables = module.init(jax.random.key(0), x, deterministic=True)
    run = functools.partial(module.apply, variables, x, deterministic=False)
    np.testing.assert_array_equal(run(rngs={"dropout": jax.random.key(5)}),
                                  run(rngs={"dropout": jax.random.key(5)}))


def test_pallas_interpreter_inside_nnx_module():
    """The kernels (Pallas interpreter) through attention_fn: same as Flax, GQA + causal."""
    fn = functools.partial(paf.attention_fn, implementation="pallas", interpret=True)
    common = dict(num_heads=4, in_features=16, num_kv_heads=2, decode=False)
    ref = nnx.MultiHeadAttention(**common, rngs=nnx.Rngs(0))
    fused = nnx.MultiHeadAttention(**common, attention_fn=fn, rngs=nnx.Rngs(0))
    x = _normal(1, (1, 8, 16))
    out_ref, g_ref = _nnx_out_and_grads(ref, lambda m: m(x, is_causal=True))
    out, g = _nnx_out_and_grads(fused, lambda m: m(x, is_causal=True))
    _assert_trees_close(out, out_ref, atol=1e-5, rtol=1e-4)
    _assert_trees_close(g, g_ref, atol=1e-5, rtol=1e-4)


def test_flax_decoding_through_attention_fn_runs_the_decode_kernel(monkeypatch):
    """nnx.MultiHeadAttention's own cached decoding hands attention_fn a mask per key
    ([B, 1, 1, max_length]): the decode kernel (Pallas interpreter) takes it and every
    step equals Flax's own attention."""
    from pallas_attn.kernels.triton import decode

    calls = []
    kernel = decode.forward
    monkeypatch.setattr(decode, "forward", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    fn = functools.partial(paf.attention_fn, implementation="pallas", interpret=True)
    flax_layer, fused = (nnx.MultiHeadAttention(4, F, num_kv_heads=2, decode=True,
                                                rngs=nnx.Rngs(0), **kw)
                         for kw in (dict(), dict(attention_fn=fn)))
    for layer in (flax_layer, fused):
        layer.init_cache((B, 5, F))
    x = _normal(2, (B, 5, F))
    for i in range(5):
        np.testing.assert_allclose(fused(x[:, i:i + 1]), flax_layer(x[:, i:i + 1]),
                                   atol=1e-5, rtol=1e-4)
    assert len(calls) == 5


def test_the_adapter_without_flax_names_the_missing_package():
    import subprocess
    import sys

    code = ("import sys\nsys.modules['flax'] = None\ntry:\n    import pallas_attn.flax\n"
            "except ImportError as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100, check=True).stdout
    assert out.startswith("ImportError pallas_attn.flax needs flax"), out


@pytest.mark.parametrize("page_size", [None, 16])
def test_decoding_contiguous_and_paged_caches_equal_the_causal_forward(page_size):
    """Prefill 5 tokens, then decode 3 one by one (under nnx.jit), through a contiguous
    or a paged cache: each step equals the full causal forward's row. The cache takes
    the dtype of the keys the layer computes (float32 from float32 inputs), not the
    bfloat16 of its parameters."""
    from flax import nnx

    layer = pallas_attn.flax.MultiHeadAttention(4, 32, num_kv_heads=2, is_causal=True,
                                                sinks=True, param_dtype=jnp.bfloat16,
                                                rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 8, 32), jnp.float32)
    full = nnx.jit(lambda m, x: m(x))(layer, x)
    layer.init_cache(batch_size=2, max_length=40, page_size=page_size)
    step = nnx.jit(lambda layer, x: layer(x, decode=True))
    parts = [step(layer, x[:, :5])] + [step(layer, x[:, t:t + 1]) for t in range(5, 8)]
    assert layer.cached_key[...].dtype == layer.key(x).dtype == jnp.float32
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1).astype(jnp.float32),
                               full.astype(jnp.float32), atol=3e-2, rtol=3e-2)
    if page_size:
        with pytest.raises(ValueError, match="paged cache takes no mask"):
            layer(x[:, :1], decode=True, mask=jnp.ones((1, 1, 1, 40), bool))
        with pytest.raises(ValueError, match="page_size must be at least 1, got 0"):
            layer.init_cache(batch_size=2, max_length=40, page_size=0)


# Decoding's edges and the layer's arguments.


def _gqa_layer(**kwargs):
    kwargs = dict(num_kv_heads=2, is_causal=True) | kwargs
    return paf.MultiHeadAttention(HEADS, 16, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("page_size", [4])  # contiguous: test_example.py's bfloat16 run
def test_decoding_with_bfloat16_compute_keeps_a_bfloat16_cache(page_size):
    """dtype=bfloat16 (GQA, sinks): the paged cache is bfloat16 and decoding (a chunk,
    then single tokens) equals the full causal forward."""
    layer = _gqa_layer(sinks=True, dtype=jnp.bfloat16, implementation="xla")
    layer.sinks[...] = jnp.array([0.5, -1.0, 2.0, 0.0])
    x = _normal(1, (B, 6, 16))
    full = nnx.jit(lambda m, x: m(x))(layer, x)
    layer.init_cache(B, 8, page_size=page_size)
    step = nnx.jit(lambda m, t: m(t, decode=True))  # eager: test_decode_matches_flax_decode
    parts = [step(layer, x[:, :3])] + [step(layer, x[:, t:t + 1]) for t in range(3, 6)]
    assert layer.cached_key[...].dtype == layer.cached_value[...].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(jnp.concatenate(parts, 1), np.float32),
                               np.asarray(full, np.float32), atol=2e-2, rtol=2e-2)


def test_decoding_keeps_an_explicit_cache_dtype():
    layer = _gqa_layer(dtype=jnp.bfloat16, implementation="xla")
    x = _normal(1, (B, 3, 16))
    full = nnx.jit(lambda m, x: m(x))(layer, x)
    layer.init_cache(B, 4, dtype=jnp.float32)
    step = nnx.jit(lambda m, t: m(t, decode=True))
    parts = [step(layer, x[:, t:t + 1]) for t in range(3)]
    assert layer.cached_key[...].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(jnp.concatenate(parts, 1), np.float32),
                               np.asarray(full, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_size", [None, 2])
def test_decoding_past_the_cache_raises_eagerly_and_gives_nan_under_jit(page_size):
    """Eager: a ValueError. Under nnx.jit (no concrete index to check): NaN, for that
    call and every later one, never a finite answer computed without the new keys."""
    x = _normal(1, (B, 5, 16))
    layer = _gqa_layer(implementation="xla")
    layer.init_cache(B, 4, page_size=page_size)
    for t in range(4):
        layer(x[:, t:t + 1], decode=True)
    with pytest.raises(ValueError, match="KV cache holds 4 tokens"):
        layer(x[:, 4:5], decode=True)
    layer.init_cache(B, 4, page_size=page_size)
    step = nnx.jit(lambda m, t: m(t, decode=True))
    for t in range(4):
        assert np.isfinite(np.asarray(step(layer, x[:, t:t + 1]))).all()
    assert np.isnan(np.asarray(step(layer, x[:, 4:5]))).all()
    assert np.isnan(np.asarray(step(layer, x[:, 4:5]))).all()


@pytest.mark.parametrize("case", ["contiguous_bad_mask", "paged_wrong_batch"])
def test_a_decode_call_that_raises_leaves_the_cache_as_it_was(case):
    """Nothing is written and the index does not move, so the next call decodes at the
    right position."""
    layer = _gqa_layer(implementation="xla")
    x = _normal(1, (B, 2, 16))
    full = layer(x)
    if case == "contiguous_bad_mask":
        layer.init_cache(B, 4)
        bad, match = dict(inputs_q=x[:, :1], mask=jnp.ones((B, 3, 1, 4), bool)), "mask"
    else:
        layer.init_cache(B, 4, page_size=2)
        bad, match = dict(inputs_q=x[:1, :1]), "decode inputs have batch 1"
    keys = np.asarray(layer.cached_key[...])
    with pytest.raises(ValueError, match=match):
        layer(decode=True, **bad)
    assert int(layer.cache_index[...]) == 0
    np.testing.assert_array_equal(np.asarray(layer.cached_key[...]), keys)
    np.testing.assert_allclose(layer(x[:, :1], decode=True), full[:, :1], atol=1e-5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_rate=-0.5), ValueError, r"dropout_rate must be in \[0, 1\), got -0.5"),
    (dict(dropout_rate=1.0), ValueError, r"dropout_rate must be in \[0, 1\), got 1.0"),
    (dict(dropout_rate="0.1"), TypeError, "dropout_rate must be a Python float"),
    (dict(sinks="no"), TypeError, "sinks must be a bool, got 'no'"),
    (dict(decode="no"), TypeError, "decode must be a bool, got 'no'"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool, got 1"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads must be at least 1, got 0"),
    (dict(num_kv_heads=2.0), TypeError, "num_kv_heads must be a Python int, got 2.0"),
], ids=["negative_dropout", "dropout_one", "dropout_string", "sinks_string",
        "decode_string", "is_causal_int", "zero_kv_heads", "float_kv_heads"])
def test_the_layer_names_a_bad_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        _gqa_layer(**kwargs)
    with pytest.raises(ValueError, match="num_heads must be at least 1, got 0"):
        paf.MultiHeadAttention(0, 16, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="deterministic must be a bool, got 'no'"):
        _gqa_layer()(_normal(0, (B, 2, 16)), deterministic="no")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(batch_size=B, max_length=8.0), TypeError, "max_length must be a Python int"),
    (dict(batch_size=0, max_length=8), ValueError, "batch_size must be at least 1, got 0"),
    (dict(batch_size=B, max_length=8, page_size=True), TypeError,
     "page_size must be a Python int, got True"),
], ids=["float_max_length", "zero_batch", "bool_page_size"])
def test_init_cache_names_a_bad_size(kwargs, error, match):
    with pytest.raises(error, match=match):
        _gqa_layer().init_cache(**kwargs)
    _gqa_layer().init_cache(np.int64(2), np.int32(8), page_size=np.int64(4))  # NumPy ints


def test_attention_fn_checks_is_causal_as_the_op_does():
    q = _normal(0, (1, 4, 2, 8))
    with pytest.raises(TypeError, match="is_causal must be a bool, got 'no'"):
        paf.attention_fn(q, q, q, is_causal="no")
    np.testing.assert_array_equal(paf.attention_fn(q, q, q, is_causal=np.bool_(True)),
                                  paf.attention_fn(q, q, q, is_causal=True))
