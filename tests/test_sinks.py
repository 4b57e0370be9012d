"""Attention sinks (DESIGN.md, "Attention sinks"): one learnable logit per head in every
row's softmax, with no value. Every implementation and kernel backend against a float64
NumPy computation (kernel_helpers.numpy_attention) for the output, logsumexp and the
gradients of q, k, v and the sinks, with other features; finite differences
for d sinks; rows that see no key; ring attention, paged attention and the Flax layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from kernel_helpers import make_inputs, no_mosaic_races, numpy_attention  # noqa: F401

import pallas_attn

pytestmark = pytest.mark.timeout(300)

MOSAIC = pallas_attn.BlockSizes(forward_backend="mosaic", dkv_backend="mosaic",
                                dq_backend="mosaic")
BACKENDS = {
    "xla": dict(implementation="xla"),
    "xla_chunked": dict(implementation="xla_chunked"),
    "triton": dict(implementation="pallas", interpret=True,
                   block_sizes=pallas_attn.BlockSizes(forward_backend="triton")),
    "mosaic": dict(implementation="pallas", interpret=True, block_sizes=MOSAIC),
}
SINKS = np.array([1.5, -2.0, 0.3, 4.0], np.float32)

# Sinks with other features, on every backend (the sink's logit joins each row's softmax
# whatever else the row sees; GQA in decode and bottom_right_window_softcap_alibi_gqa).
CASES = {
    "causal_softcap_alibi": (dict(B=1, T=130, S=130, N=4, K=4, H=64),
                             dict(is_causal=True, logits_soft_cap=5.0,
                                  alibi_slopes=np.array([0.1, 0.02, 0.3, 0.05]))),
    "lengths_window_empty_rows": (dict(B=2, T=80, S=100, N=4, K=1, H=64),
                                  dict(local_window_size=(20, 5),
                                       query_seq_lengths=np.array([80, 31]),
                                       key_value_seq_lengths=np.array([100, 0]))),
    "decode": (dict(B=3, T=1, S=200, N=4, K=2, H=64),
               dict(key_value_seq_lengths=np.array([200, 50, 0]))),
    "bottom_right_window_softcap_alibi_gqa": (
        dict(B=2, T=24, S=40, N=4, K=2, H=64),
        dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(8, 0),
             logits_soft_cap=2.0, alibi_slopes=np.array([0.1, 0.3, 0.02, 0.5]),
             key_value_seq_lengths=np.array([40, 20]))),
}


def _run(backend, inputs, sinks, kwargs, dtype):
    options = BACKENDS[backend]
    arrays = {x: (jnp.asarray(y) if isinstance(y, np.ndarray) else y)
              for x, y in kwargs.items()}

    def loss(q, k, v, sinks):
        out, lse = pallas_attn.dot_product_attention(
            q, k, v, sinks=sinks, return_residual=True, **arrays, **options)
        finite = jnp.where(jnp.isinf(lse), 0.0, lse)
        total = jnp.sum(out.astype(jnp.float32) * inputs["ct"].astype(jnp.float32))
        return total + jnp.sum(finite * inputs["ct_lse"]), (out, lse)

    q, k, v = (inputs[x].astype(dtype) for x in ("q", "k", "v"))
    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, jnp.asarray(sinks))
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    return {name: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
            for name, x in zip(names, (out, lse, *grads), strict=True)}


# The decode case (one query row) is the decode kernel's: the jnp paths take its sinks,
# key lengths (one of 0) and GQA in lengths_window_empty_rows and
# bottom_right_window_softcap_alibi_gqa.
@pytest.mark.parametrize("case,backend", [
    (case, backend) for case in sorted(CASES) for backend in sorted(BACKENDS)
    if case != "decode" or backend in ("triton", "mosaic")])
def test_sinks_against_float64(case, backend):
    shapes, kwargs = CASES[case]
    dtype = jnp.float32 if backend in ("xla", "xla_chunked", "triton") else jnp.bfloat16
    if backend == "mosaic" and shapes["T"] < 128:
        pytest.skip("the Mosaic forward runs 128-row work items (the routing table)")
    inputs = make_inputs(sum(map(ord, case)), dtype=jnp.float32, **shapes)
    if case == "decode" and backend == "triton":
        assert pallas_attn.explain(inputs["q"], inputs["k"], inputs["v"], interpret=True,
                                   sinks=SINKS).forward.backend == "decode"
    got = _run(backend, inputs, SINKS, kwargs, dtype)
    rounded = {x: np.asarray(inputs[x].astype(dtype).astype(jnp.float32)) for x in "qkv"}
    exact = numpy_attention(rounded["q"], rounded["k"], rounded["v"], inputs["ct"],
                            inputs["ct_lse"], sinks=SINKS, **kwargs)
    tol = 2e-4 if dtype == jnp.float32 else 3e-2
    for name in ("out", "lse", "dq", "dk", "dv", "dsinks"):
        want, have = exact[name], got[name]
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(have, want, atol=tol * scale, rtol=tol,
                                   err_msg=f"{backend} {name}")
    # Rows that see no key: output 0, logsumexp = the head's sink, no gradient to q.
    empty = ~np.isfinite(numpy_attention(rounded["q"], rounded["k"], rounded["v"],
                                         **kwargs)["lse"])
    if empty.any():
        heads = np.broadcast_to(SINKS, empty.shape)
        assert (got["out"][empty] == 0).all()
        np.testing.assert_allclose(got["lse"][empty], heads[empty], rtol=1e-6)
        assert (got["dq"][empty] == 0).all()


def test_sink_gradient_by_finite_differences():
    inputs = make_inputs(3, dtype=jnp.float32, B=1, T=20, S=30, N=4, K=2, H=16)

    def loss(sinks):
        out, lse = pallas_attn.dot_product_attention(
            inputs["q"], inputs["k"], inputs["v"], sinks=sinks, is_causal=True,
            implementation="xla_chunked", return_residual=True)
        return jnp.sum(out * inputs["ct"]) + jnp.sum(lse * inputs["ct_lse"])

    loss = jax.jit(loss)  # one program each, not an eager dispatch per operation
    grad = jax.jit(jax.grad(loss))(jnp.asarray(SINKS))
    eps = 1e-2
    for n in range(4):
        step = jnp.zeros(4).at[n].set(eps)
        numeric = (loss(SINKS + step) - loss(SINKS - step)) / (2 * eps)
        np.testing.assert_allclose(grad[n], numeric, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("implementation", ["xla_chunked", "pallas"])
def test_ring_attention_with_sinks(implementation):
    """The sinks' gradient summed over each device's rows (with the kernels, by the
    rows kernel: `vjp.row_total`) and around the ring."""
    devices = 2
    mesh = jax.make_mesh((devices,), ("sp",), axis_types=(AxisType.Auto,))
    inputs = make_inputs(4, dtype=jnp.float32, B=1, T=64, S=64, N=4, K=2, H=16)
    seq = P(None, "sp")

    def ring_loss(q, k, v, sinks):
        def inner(q, k, v, ct, sinks):
            out = pallas_attn.ring_attention(q, k, v, axis_name="sp", is_causal=True,
                                             sinks=sinks, implementation=implementation,
                                             interpret=implementation == "pallas",
                                             sequence_layout="zigzag")
            return jax.lax.psum(jnp.sum(out * ct), "sp")
        z = lambda x: pallas_attn.zigzag(x, devices, 1)  # noqa: E731
        # The Pallas interpreter's slices take no varying-axes types (test_ring.py).
        return jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 4 + (P(),), out_specs=P(),
                             check_vma=implementation != "pallas")(
            z(q), z(k), z(v), z(inputs["ct"]), sinks)

    def op_loss(q, k, v, sinks):
        out = pallas_attn.dot_product_attention(q, k, v, is_causal=True, sinks=sinks,
                                                implementation="xla")
        return jnp.sum(out * inputs["ct"])

    args = (inputs["q"], inputs["k"], inputs["v"], jnp.asarray(SINKS))
    got = jax.jit(jax.value_and_grad(ring_loss, argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.value_and_grad(op_loss, argnums=(0, 1, 2, 3)))(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1][3:], want[1][3:], strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("implementation", ("pallas", "xla"))
def test_paged_attention_with_sinks(implementation):
    B, T, N, K, H, size = 2, 3, 4, 2, 32, 16
    ks = jax.random.split(jax.random.key(2), 3)
    k_cache = jax.random.normal(ks[0], (6, size, K, H))
    v_cache = jax.random.normal(ks[1], (6, size, K, H))
    table = jnp.array([[4, 1, 0], [2, 5, 3]], jnp.int32)
    lengths = jnp.array([40, 2], jnp.int32)
    q = jax.random.normal(ks[2], (B, T, N, H))
    out = pallas_attn.paged_attention(q, k_cache, v_cache, table, lengths, sinks=SINKS,
                                      implementation=implementation,
                                      interpret=implementation == "pallas")
    reference = jax.jit(lambda q, k, v, mask: pallas_attn.dot_product_attention(
        q, k, v, mask=mask, sinks=SINKS, implementation="xla"))
    for b in range(B):
        keys = k_cache[table[b]].reshape(1, -1, K, H)
        values = v_cache[table[b]].reshape(1, -1, K, H)
        L = int(lengths[b])
        rows = jnp.arange(T) + L - T  # query positions; negative ones see nothing
        mask = (jnp.arange(keys.shape[1])[None, :] <= rows[:, None])[None, None]
        want = reference(q[b:b + 1], keys, values, mask)
        np.testing.assert_allclose(out[b:b + 1], want, atol=2e-5, rtol=2e-5)


def test_flax_layer_learns_its_sinks():
    from flax import nnx

    import pallas_attn.flax as paf

    layer = paf.MultiHeadAttention(4, 32, num_kv_heads=2, is_causal=True, sinks=True,
                                   rngs=nnx.Rngs(0))
    assert paf.MultiHeadAttention(4, 32, rngs=nnx.Rngs(0)).sinks is None
    layer.sinks[...] = jnp.asarray(SINKS)
    x = jax.random.normal(jax.random.key(1), (2, 10, 32))
    # Jitted (eagerly, every small operation would compile on its own).
    grads = nnx.jit(nnx.grad(lambda layer: jnp.sum(layer(x) ** 2)))(layer)
    assert grads.sinks[...].shape == (4,) and np.all(np.asarray(grads.sinks[...]) != 0)

    @nnx.jit
    def outputs(layer):
        q, k, v = layer.query(x), layer.key(x), layer.value(x)
        return layer(x), layer.out(pallas_attn.dot_product_attention(
            q, k, v, is_causal=True, sinks=jnp.asarray(SINKS)))

    got, want = outputs(layer)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_sinks_must_be_one_per_head():
    q = jnp.zeros((1, 4, 4, 16))
    with pytest.raises(ValueError, match="sinks must have shape \\[N\\] = \\(4,\\)"):
        pallas_attn.dot_product_attention(q, q, q, sinks=jnp.zeros(3))
    with pytest.raises(TypeError, match="sinks"):
        pallas_attn.dot_product_attention(q, q, q, sinks=jnp.zeros(4, jnp.int32))
