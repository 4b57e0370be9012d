"""Multi-device edges: a head-broadcast bias's gradient with heads split over devices,
ring attention's sink gradient with shard_map's varying-axes check on and off, the op
and ring attention inside a shard_map outside jax.jit, and ring / zigzag argument errors.

Eight CPU devices (tests/conftest.py); every result against the reference on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_attn

pytestmark = pytest.mark.timeout(300)

SEQ = P(None, "sp")


def _normal(shapes, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(key, shape, jnp.float32)
            for key, shape in zip(keys, shapes, strict=True)]


def _ring_mesh(devices: int):
    return jax.make_mesh((devices,), ("sp",), axis_types=(AxisType.Auto,))


def _reference_grads(loss_of, args, argnums):
    return jax.grad(loss_of("xla"), argnums=argnums)(*args)


def test_head_broadcast_bias_gradient_with_heads_split_over_devices():
    """A [B, 1, T, S] bias under GQA with batch and heads sharded: its gradient sums the
    heads' shards once (not once per query-head and kv-head label of the same axis)."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    heads = NamedSharding(mesh, P("data", None, "model"))
    q, k, v, ct, bias = _normal([(2, 32, 4, 16), (2, 32, 2, 16), (2, 32, 2, 16),
                                 (2, 32, 4, 16), (2, 1, 32, 32)], seed=1)

    def loss_of(impl):
        def loss(q, k, v, bias):
            out = pallas_attn.dot_product_attention(q, k, v, bias, is_causal=True,
                                                    implementation=impl,
                                                    interpret=impl == "pallas")
            return jnp.sum(out * ct)
        return loss

    sharded = [jax.device_put(x, heads) for x in (q, k, v)]
    got = jax.jit(jax.grad(loss_of("pallas"), argnums=(0, 1, 2, 3)))(*sharded, bias)
    want = _reference_grads(loss_of, (q, k, v, bias), (0, 1, 2, 3))
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("check_vma", [True, False])
def test_ring_sink_gradient_is_summed_once(check_vma):
    """d sinks (a replicated input) counts every device's rows once: summed around the
    ring where shard_map types the values, left to shard_map's transpose where not."""
    q, k, v, ct = _normal([(1, 32, 2, 16)] * 4, seed=2)
    sinks = jnp.array([0.5, -1.0])

    def ring_loss(sinks):
        f = lambda q, k, v, s: pallas_attn.ring_attention(  # noqa: E731
            q, k, v, axis_name="sp", sinks=s, is_causal=True, implementation="xla_chunked")
        out = jax.shard_map(f, mesh=_ring_mesh(4), in_specs=(SEQ,) * 3 + (P(),),
                            out_specs=SEQ, check_vma=check_vma)(q, k, v, sinks)
        return jnp.sum(out * ct)

    def reference_loss(sinks):
        out = pallas_attn.dot_product_attention(q, k, v, sinks=sinks, is_causal=True,
                                                implementation="xla")
        return jnp.sum(out * ct)

    np.testing.assert_allclose(jax.jit(jax.grad(ring_loss))(sinks),
                               jax.grad(reference_loss)(sinks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["ring", "xla_chunked"])
def test_inside_shard_map_without_jit(implementation):
    """shard_map run op by op (no jax.jit around it) takes the custom_vjps: forward and
    gradient equal the reference's (the kernels: a clear error)."""
    q, k, v, ct = _normal([(2, 32, 2, 16)] * 4, seed=3)
    mesh = _ring_mesh(2)
    if implementation == "ring":
        f = lambda q, k, v: pallas_attn.ring_attention(  # noqa: E731
            q, k, v, axis_name="sp", is_causal=True, implementation="xla_chunked")
        specs, check = SEQ, True
    else:
        f = lambda q, k, v: pallas_attn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation=implementation)
        specs, check = P("sp"), True
    mapped = jax.shard_map(f, mesh=mesh, in_specs=(specs,) * 3, out_specs=specs,
                           check_vma=check)

    def reference(q, k, v):
        return pallas_attn.dot_product_attention(q, k, v, is_causal=True,
                                                 implementation="xla")

    np.testing.assert_allclose(mapped(q, k, v), reference(q, k, v), atol=2e-5, rtol=2e-5)
    got = jax.grad(lambda q, k, v: jnp.sum(mapped(q, k, v) * ct), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(reference(q, k, v) * ct),
                    argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


def test_ring_and_zigzag_errors_name_the_argument():
    q = jnp.zeros((1, 16, 2, 16))

    def ring(**kw):
        f = lambda q: pallas_attn.ring_attention(q, q, q, axis_name="sp", **kw)  # noqa: E731
        return jax.jit(jax.shard_map(f, mesh=_ring_mesh(2), in_specs=(SEQ,), out_specs=SEQ,
                                     check_vma=False))(q)

    with pytest.raises(ValueError, match="block_sizes and interpret apply to .*'xla_chunked'"):
        ring(implementation="xla_chunked", interpret=True)
    x = jnp.arange(8.0)[None]
    np.testing.assert_array_equal(pallas_attn.zigzag(x, np.int64(2)),
                                  pallas_attn.zigzag(x, 2))
    with pytest.raises(TypeError, match="num_devices must be a Python int, got True"):
        pallas_attn.zigzag(x, True)
    with pytest.raises(ValueError, match="num_devices must be at least 1, got 0"):
        pallas_attn.unzigzag(x, 0)
    with pytest.raises(ValueError, match="axis must name one of the array's 2 axes, got 7"):
        pallas_attn.zigzag(x, 2, axis=7)


def test_the_kernels_inside_shard_map_without_jit_ask_for_jit():
    q = jnp.zeros((2, 32, 2, 16))
    # NOTE: the Pallas interpreter mixes varying and unvarying values in a kernel.
    mapped = jax.shard_map(
        lambda q: pallas_attn.dot_product_attention(q, q, q, implementation="pallas",
                                                    interpret=True),
        mesh=_ring_mesh(2), in_specs=(P("sp"),), out_specs=P("sp"), check_vma=False)
    with pytest.raises(ValueError, match="inside jax.shard_map needs the shard_map under "
                                         "jax.jit"):
        mapped(q)
    np.testing.assert_allclose(jax.jit(mapped)(q), 0.0)
