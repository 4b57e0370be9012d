"""The backward's sums outside the attention kernels run in a kernel of their own on a
GPU (kernels/triton/rows.py), so no XLA reduction, whose order XLA picks by timing its
emitters, decides a gradient's rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn
from pallas_attn.device import DeviceInfo, lowering_for
from pallas_attn.kernels.triton import rows

pytestmark = pytest.mark.timeout(300)

SM90 = DeviceInfo((9, 0), 132, 232448)
SM80 = DeviceInfo((8, 0), 108, 166912)


@pytest.mark.parametrize("shape, dtype, product", [
    ((2, 37, 3, 40), jnp.bfloat16, True),  # ragged rows, a head dim of no power of two
    ((1, 5, 2, 600), jnp.float32, False),  # three steps along a row, the last ragged
    ((2, 64, 4, 128), jnp.float16, True),
])
def test_row_sums_kernel_against_float64(shape, dtype, product):
    kx, ky = jax.random.split(jax.random.key(sum(shape)))
    x = jax.random.normal(kx, shape, dtype) * 3
    y = jax.random.normal(ky, shape, dtype) if product else None
    got = np.asarray(rows.row_sums(x, y, interpret=True))
    x64 = np.asarray(x, np.float64)
    want = (x64 * np.asarray(y, np.float64) if product else x64).sum(-1).transpose(0, 2, 1)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(x64).max())


def test_row_sums_rejects_mismatched_operands():
    with pytest.raises(ValueError, match=r"y \(2, 3, 1, 8\) must match x \(2, 4, 1, 8\)"):
        rows.row_sums(jnp.zeros((2, 4, 1, 8)), jnp.zeros((2, 3, 1, 8)))


def _sums_outside_kernels(jaxpr, found):
    """The reductions that add (reduce_sum, dot_general) outside every kernel (a
    pallas_call; under shard_map a Mosaic kernel's body is an mpmd_map)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pallas_call", "mpmd_map"):
            continue
        if eqn.primitive.name in ("reduce_sum", "dot_general", "cumsum"):
            found.append((eqn.primitive.name, [v.aval.shape for v in eqn.invars]))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _sums_outside_kernels(sub.jaxpr, found)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _sums_outside_kernels(sub, found)
    return found


@pytest.mark.parametrize("device", [SM90, SM80], ids=["sm90", "sm80"])
@pytest.mark.parametrize("dtype, features", [
    # delta, and a bias per row summed over the batch (sm90: from the dQ kernel's rows)
    ("bfloat16", dict(bias=(1, 4, 40, 1), is_causal=True, logits_soft_cap=5.0)),
    ("bfloat16", dict(bias=(1, 1, 1, 1), is_causal=True)),
    # float16's dS scales (|dO| and |V| per row) and the sinks' gradient
    ("float16", dict(sinks=True)),
])
def test_gpu_backward_adds_only_in_kernels(device, dtype, features):
    """On a GPU plan every sum the backward takes is a kernel's: none is left to XLA."""
    B, T, S, N, K, H = 2, 40, 48, 4, 2, 32
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, T, N, H), dtype)
    k, v = (jax.random.normal(x, (B, S, K, H), dtype) for x in (kk, kv))
    cotangent = jax.random.normal(kc, (B, T, N, H), dtype)
    features = dict(features)
    bias = features.pop("bias", None)
    bias = None if bias is None else jnp.ones(bias, dtype)
    sinks = jnp.zeros((N,), jnp.float32) if features.pop("sinks", False) else None

    def attention(q, k, v, bias, sinks):
        return pallas_attn.dot_product_attention(q, k, v, bias=bias, sinks=sinks,
                                                 implementation="pallas", **features)

    def backward(q, k, v, bias, sinks):
        return jax.vjp(attention, q, k, v, bias, sinks)[1](cotangent)

    with lowering_for(device):
        jaxpr = jax.make_jaxpr(backward)(q, k, v, bias, sinks)
    assert _sums_outside_kernels(jaxpr.jaxpr, []) == []


def test_gpu_ring_backward_adds_only_in_kernels():
    """Ring attention with the kernels and sinks: the sinks' gradient and its delta are
    the rows kernel's too (each device's part; the ring's psum adds them)."""
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    B, T, N, K, H = 1, 256, 4, 2, 64
    kq, kk, kv, kc = jax.random.split(jax.random.key(1), 4)
    q, ct = (jax.random.normal(x, (B, T, N, H), jnp.bfloat16) for x in (kq, kc))
    k, v = (jax.random.normal(x, (B, T, K, H), jnp.bfloat16) for x in (kk, kv))
    seq, sinks = jax.sharding.PartitionSpec(None, "sp"), jnp.zeros((N,), jnp.float32)

    def backward(q, k, v, ct, sinks):
        def per_device(q, k, v, ct, sinks):
            def ring(q, k, v, sinks):
                return pallas_attn.ring_attention(q, k, v, axis_name="sp", is_causal=True,
                                                  sinks=sinks, implementation="pallas")
            return jax.vjp(ring, q, k, v, sinks)[1](ct)
        return jax.shard_map(per_device, mesh=mesh, in_specs=(seq,) * 4 + (jax.P(),),
                             out_specs=(seq,) * 3 + (jax.P(),))(q, k, v, ct, sinks)

    with lowering_for(SM90):
        jaxpr = jax.make_jaxpr(backward)(q, k, v, ct, sinks)
    assert _sums_outside_kernels(jaxpr.jaxpr, []) == []
