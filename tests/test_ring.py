"""Ring attention (context parallelism) against dot_product_attention on the
gathered arrays: outputs, logsumexp and gradients, both layouts, every feature it
takes, four CPU devices (tests/conftest.py), the kernels in the Pallas interpreter.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from kernel_helpers import host_primitives

import pallas_attn

pytestmark = pytest.mark.timeout(300)

DEVICES = 4


def _mesh(devices=DEVICES):
    return jax.make_mesh((devices,), ("sp",), axis_types=(AxisType.Auto,))


# One jitted program (eagerly, the sampler compiles for every new shape on its own).
@functools.partial(jax.jit, static_argnames=("B", "T", "N", "K", "H", "Hv", "seed"))
def _inputs(B=2, T=64, N=4, K=2, H=16, Hv=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, K, Hv), jnp.float32)
    ct = jax.random.normal(ks[3], (B, T, N, Hv), jnp.float32)
    return q, k, v, ct


FEATURES = {
    # No causal mask and no window: every block visible, keys ahead of the queries too
    # (ALiBi's distance from either side).
    "softcap_alibi": lambda B, T: dict(logits_soft_cap=3.0, scale=0.5, alibi_slopes=jnp.array(
        [0.3, 0.1, 0.05, 0.2])),
    "causal_everything": lambda B, T: dict(
        is_causal=True, local_window_size=(40, 0), logits_soft_cap=20.0,
        alibi_slopes=jnp.linspace(0.02, 0.2, 4), dropout_rate=0.2,
        dropout_rng=jax.random.key(1), query_seq_lengths=jnp.array([T, T * 5 // 8][:B]),
        key_value_seq_lengths=jnp.array([T * 3 // 4 + 2, T][:B]),
        q_segment_ids=(jnp.arange(T)[None, :] // (T // 3) + jnp.arange(B)[:, None]) % 2),
}


def _ring_step(layout, implementation, options, devices=DEVICES):
    """value_and_grad of a loss of ring attention's output and logsumexp, with every
    sequence-split array in `layout` order and sharded over 'sp'."""
    mesh = _mesh(devices)
    segments = options.pop("q_segment_ids", None)
    seq = P(None, "sp")

    def loss(q, k, v, ct, segments):
        def inner(q, k, v, ct, segments):
            extra = {} if segments is None else {"q_segment_ids": segments}
            out, lse = pallas_attn.ring_attention(
                q, k, v, axis_name="sp", sequence_layout=layout,
                implementation=implementation, interpret=implementation == "pallas",
                return_residual=True, **extra, **options)
            finite = jnp.where(jnp.isinf(lse), 0.0, lse)
            local = jnp.sum(out * ct) + jnp.sum(finite * jnp.cos(finite))
            return jax.lax.psum(local, "sp"), (out, lse)

        # NOTE: the Pallas interpreter mixes varying and unvarying values inside a
        # kernel (JAX 0.11.2), so its runs leave shard_map's varying-axes check off.
        return jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 4 + (seq,),
                             out_specs=(P(), (seq, seq)),
                             check_vma=implementation != "pallas")(q, k, v, ct, segments)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)), segments


def _reference_step(options, segments):
    def loss(q, k, v, ct):
        extra = {} if segments is None else {"q_segment_ids": segments}
        out, lse = pallas_attn.dot_product_attention(
            q, k, v, implementation="xla", return_residual=True, **extra, **options)
        finite = jnp.where(jnp.isinf(lse), 0.0, lse)
        return jnp.sum(out * ct) + jnp.sum(finite * jnp.cos(finite)), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _check(layout, implementation, feature, devices=DEVICES, atol=3e-5, **shape):
    q, k, v, ct = _inputs(**shape)
    B, T = q.shape[:2]
    options = FEATURES[feature](B, T)
    ring, segments = _ring_step(layout, implementation, dict(options), devices)
    reference_options = dict(options)
    reference = _reference_step(reference_options, reference_options.pop("q_segment_ids", None))
    (_, (out_ref, lse_ref)), grads_ref = reference(q, k, v, ct)
    if layout == "zigzag":
        # Jitted: eagerly, every small operation in them would compile on its own.
        zig = jax.jit(lambda x: pallas_attn.zigzag(x, devices, 1))
        into = lambda x: None if x is None else zig(x)  # noqa: E731
        back = jax.jit(lambda x: pallas_attn.unzigzag(x, devices, 1))
    else:
        into = back = lambda x: x  # noqa: E731
    args = (into(q), into(k), into(v), into(ct), into(segments))
    # Compiled once, ahead of time: the program that runs is the one whose HLO
    # test_ring_hlo_sends_blocks_around_and_gathers_nothing reads (calling the jitted
    # step and lowering it again would trace, lower and compile it twice).
    ring = ring.lower(*args).compile()
    (_, (out, lse)), grads = ring(*args)
    np.testing.assert_allclose(back(out), out_ref, atol=atol, rtol=atol)
    np.testing.assert_array_equal(np.isinf(back(lse)), np.isinf(lse_ref))
    np.testing.assert_allclose(np.where(np.isinf(lse_ref), 0, back(lse)),
                               np.where(np.isinf(lse_ref), 0, lse_ref), atol=atol, rtol=atol)
    for got, want in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(back(got), want, atol=atol, rtol=atol)
    return ring


# Every feature in the zigzag layout (four blocks per step, two origins per device): all
# of them at once around four devices, under x64 with MQA and a separate value head dim
# (test_ring_hlo_sends_blocks_around_and_gathers_nothing), and around two on the kernels
# (test_ring_equals_the_op_kernels), the other set around two (causal alone: the forward
# in test_causally_hidden_blocks_are_never_read and the README snippet, with sinks in
# test_sinks.py); the contiguous layout with all of them at once.
LAYOUT_FEATURES = [("zigzag", feature) for feature in sorted(FEATURES)
                   if feature != "causal_everything"] + [
    ("contiguous", "causal_everything")]


@pytest.mark.parametrize("layout,feature", LAYOUT_FEATURES)
def test_ring_equals_the_op_xla_chunked(layout, feature):
    _check(layout, "xla_chunked", feature,
           devices=DEVICES if feature == "causal_everything" else 2)


def test_ring_equals_the_op_kernels():
    """The kernels (Triton, interpreted) as ring blocks; the contiguous layout's blocks
    are the xla_chunked test's."""
    _check("zigzag", "pallas", "causal_everything", devices=2, T=32)


def test_ring_hlo_sends_blocks_around_and_gathers_nothing():
    """Every feature at once around four devices in the zigzag layout equals the op, and
    the compiled step moves blocks around the ring and gathers nothing. Under
    jax_enable_x64 (Python ints become int64), which changes nothing in ring attention (its
    step's indices are the implementations'; the kernels under x64: test_parity.py); one
    key head for four query heads, value head dim 8."""
    with jax.enable_x64(True):
        hlo = _check("zigzag", "xla_chunked", "causal_everything", N=4, K=1, Hv=8).as_text()
    ops = set(re.findall(r"(all-gather|all-to-all|collective-permute|reduce-scatter)", hlo))
    assert ops == {"collective-permute"}


def test_ring_of_one_device_is_the_op():
    _check("contiguous", "xla_chunked", "causal_everything", devices=1)


@pytest.mark.parametrize("implementation", ["xla_chunked", "pallas"])
def test_causally_hidden_blocks_are_never_read(implementation):
    """NaN keys and values on the last device: every earlier query (which sees none of
    them causally) stays exact: xla_chunked skips their blocks, the kernels every tile
    of them."""
    mesh = _mesh()
    q, k, v, _ = _inputs()
    T = q.shape[1]
    tail = slice(T - T // DEVICES, T)
    k_bad = k.at[:, tail].set(jnp.nan)
    v_bad = v.at[:, tail].set(jnp.nan)
    seq = P(None, "sp")
    run = jax.jit(jax.shard_map(
        lambda q, k, v: pallas_attn.ring_attention(
            q, k, v, axis_name="sp", is_causal=True, implementation=implementation,
            interpret=implementation == "pallas"),
        mesh=mesh, in_specs=(seq,) * 3, out_specs=seq, check_vma=implementation != "pallas"))
    out = run(q, k_bad, v_bad)
    want = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla"))(q, k, v)
    head = slice(0, T - T // DEVICES)
    np.testing.assert_allclose(out[:, head], want[:, head], atol=3e-5, rtol=3e-5)
    assert np.isnan(np.asarray(out[:, tail])).all()


def test_zigzag_round_trip_and_placement():
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    z = pallas_attn.zigzag(x, 4, 1)
    np.testing.assert_array_equal(pallas_attn.unzigzag(z, 4, 1), x)
    # Device 0 holds chunks 0 and 7 (of 8 chunks of 2 positions).
    np.testing.assert_array_equal(z[0, :4, 0], x[0, [0, 1, 14, 15], 0])
    with pytest.raises(ValueError, match="2 \\* num_devices"):
        pallas_attn.zigzag(x, 3, 1)


def test_ring_errors_name_the_argument():
    mesh = _mesh(2)
    q, k, v, _ = _inputs(T=16)
    seq = P(None, "sp")

    def call(**kwargs):
        def inner(q, k, v):
            return pallas_attn.ring_attention(q, k, v, **kwargs)
        return jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)(q, k, v)

    with pytest.raises(ValueError, match="sequence_layout"):
        call(axis_name="sp", sequence_layout="striped")
    with pytest.raises(ValueError, match="implementation"):
        call(axis_name="sp", implementation="xla")
    with pytest.raises(ValueError, match="no such axis"):
        call(axis_name="cp")
    with pytest.raises(ValueError, match="one length"):
        jax.shard_map(lambda q, k, v: pallas_attn.ring_attention(q, k[:, :4], v[:, :4],
                                                                 axis_name="sp"),
                      mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)(q, k, v)
    with pytest.raises(ValueError, match="key_value_seq_lengths must lie in"):
        call(axis_name="sp", key_value_seq_lengths=jnp.array([40, 3]))
    with pytest.raises(ValueError,
                       match="block_sizes and interpret apply to implementation='pallas'"):
        call(axis_name="sp", implementation="xla_chunked",
             block_sizes=pallas_attn.BlockSizes(block_k=32))
    with pytest.raises(TypeError, match="axis_name must be a mesh axis name"):
        call(axis_name=0)
    with pytest.raises(ValueError, match="even slice length"):
        jax.shard_map(lambda q, k, v: pallas_attn.ring_attention(
            q[:, :7], k[:, :7], v[:, :7], axis_name="sp", sequence_layout="zigzag"),
            mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)(q, k, v)


def test_ring_refuses_to_differentiate_alibi_slopes():
    mesh = _mesh(2)
    q, k, v, _ = _inputs(T=16)
    seq = P(None, "sp")

    def loss(slopes):
        return jnp.sum(jax.shard_map(
            lambda q, k, v: pallas_attn.ring_attention(
                q, k, v, axis_name="sp", alibi_slopes=slopes, implementation="xla_chunked"),
            mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)(q, k, v))

    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        jax.grad(loss)(jnp.ones(4))


def test_readme_snippet_runs_and_equals_the_op(monkeypatch):
    """The README's multi-device snippet, run as written on two of the test's devices (it
    sizes its mesh and its sequence by jax.device_count(); around four devices and more
    steps: the tests above)."""
    import pathlib

    monkeypatch.setattr(jax, "device_count", lambda *args: 2)

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("<!-- multi-device-snippet -->")[1].split("<!-- /multi-device-snippet")[0]
    code = block.split("```python")[1].split("```")[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    want = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla"))(scope["q"], scope["k"], scope["v"])
    np.testing.assert_allclose(scope["out"], want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("origin,features,H", [
    ((150, 97), "causal_window_alibi_dropout_lengths", 64),
    ((96, 0), "soft_cap_segments_bottom_right", 64),
    ((150, 97), "causal_dropout_x64", 256),
])
def test_ring_blocks_run_on_the_mosaic_kernels(origin, features, H):
    """A block with an origin on the Mosaic forward, dQ and dK/dV kernels (interpreted),
    as ring attention runs it: the forward through the op's custom_vjp, the gradients
    from the whole softmax's out and lse (`vjp.gradients`). Output, logsumexp and
    gradients equal the reference's for the same block. Every position rule counts from
    the origin (not a multiple of a tile): the causal diagonal and the window cross the
    block, ALiBi takes the global distance, dropout the global positions' mask, the
    lengths are global. Head dim 64 without ALiBi runs the three-consumer forward (the dQ
    takes three without segment ids) and the keys-by-queries dK/dV; 256 the wide kernels,
    here under jax_enable_x64."""
    with jax.enable_x64(features.endswith("x64")):  # Python ints as int64 next to the origin
        _mosaic_block(origin, features, H)


def _mosaic_block(origin, features, H):
    from pallas_attn import dispatch
    from pallas_attn.kernels import vjp
    from pallas_attn.semantics import reference
    from pallas_attn.spec import normalize

    B, T, S, N, K = 1, 128, 128, 1, 1
    ks = jax.random.split(jax.random.key(sum(origin) + H), 5)
    q, k, v, ct = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
                   for key, shape in zip(ks, [(B, T, N, H), (B, S, K, H), (B, S, K, H),
                                              (B, T, N, H)], strict=False))
    ct_lse = jax.random.normal(ks[4], (B, N, T), jnp.float32)
    options = {
        "causal_window_alibi_dropout_lengths": dict(
            is_causal=True, local_window_size=(100, 0), alibi_slopes=jnp.array([0.3]),
            dropout_rate=0.2, dropout_rng=jax.random.key(2),
            query_seq_lengths=jnp.array([270]), key_value_seq_lengths=jnp.array([200])),
        "soft_cap_segments_bottom_right": dict(
            is_causal=True, causal_alignment="bottom_right", logits_soft_cap=5.0,
            q_segment_ids=jnp.arange(T)[None].repeat(B, 0) // 50,
            kv_segment_ids=jnp.arange(S)[None].repeat(B, 0) // 40),
        "causal_dropout_x64": dict(is_causal=True, dropout_rate=0.2,
                                   dropout_rng=jax.random.key(3)),
    }[features]
    spec, ops, _ = normalize(q, k, v, sequence_ways=3, **options)
    ops = ops._replace(origin=jnp.array(origin, jnp.int32))
    blocks = pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                    dkv_backend="mosaic")
    plan = dispatch.plan(dispatch.Call.of(spec, ops), block_sizes=blocks, interpret=True)
    assert (plan.forward.backend, plan.dq.backend, plan.dkdv.backend) == ("mosaic",) * 3
    if features.startswith("soft_cap"):
        # dQ: two consumers with segment ids (items of 128 rows).
        assert plan.forward.consumers == 3 and plan.dq.consumers == 2 and plan.dkdv.keys_major

    def reference_results(q, k, v):
        return reference.attention(spec, ops._replace(query=q, key=k, value=v))

    @jax.jit  # the reference as one program (eagerly, each operation compiles on its own)
    def reference_step(q, k, v, ct, ct_lse):
        (out, lse), pullback = jax.vjp(reference_results, q, k, v)
        d_lse = jnp.where(jnp.isinf(lse), 0.0, ct_lse)
        return [out, lse, *pullback((ct, d_lse))], d_lse

    expected, d_lse = reference_step(q, k, v, ct, ct_lse)
    out, lse = expected[:2]
    # Jitted, except under x64: the interpreter's threads would lower the kernels without it.
    compiled = (lambda f: f) if features.endswith("x64") else jax.jit
    out_k, lse_k = compiled(lambda ops: vjp.attention(spec, ops, plan))(ops)
    kernel = [out_k, lse_k, *compiled(lambda *a: vjp.gradients(spec, ops, plan, *a))(
        out, lse, ct, d_lse)]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), kernel, expected,
                               strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        scale = 3e-2 * max(1.0, float(np.abs(np.where(np.isinf(want), 0, want)).max()))
        np.testing.assert_allclose(got, want, atol=scale, rtol=3e-2, err_msg=name)
    assert np.isfinite(expected[1]).mean() > 0.5  # most rows see keys
    assert np.isinf(expected[1]).any() == features.startswith("causal_window")


def test_ring_blocks_on_the_mosaic_kernels_vary_over_the_ring_axis():
    """Planned for a Hopper GPU (traced here, not run), ring attention's blocks run the
    Mosaic kernels, whose results must be typed as varying over the ring's axis under
    shard_map's checks (else they do not merge with the ring's partial results). No
    lax.cond around them: the kernels skip the tiles the band hides, and a cond's
    predicate would be read on the host once per block and step."""
    from pallas_attn.device import DeviceInfo, lowering_for

    mesh = _mesh(2)
    seq = P(None, "sp")

    def loss(q, k, v):
        def inner(q, k, v):
            out = pallas_attn.ring_attention(q, k, v, axis_name="sp", is_causal=True,
                                             sequence_layout="zigzag")
            return jax.lax.psum(jnp.sum(out.astype(jnp.float32)), "sp")
        return jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 3, out_specs=P())(q, k, v)

    from pallas_attn import dispatch
    from pallas_attn.spec import normalize

    x = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
    block = jnp.zeros((1, 128, 4, 128), jnp.bfloat16)  # a zigzag block of one device
    spec, ops, _ = normalize(block, block, block, is_causal=True, sequence_ways=2)
    with lowering_for(DeviceInfo()):
        plan = dispatch.plan(dispatch.Call.of(
            spec, ops._replace(origin=jnp.array([384, 128], jnp.int32))))
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x)
    assert (plan.forward.backend, plan.dq.backend, plan.dkdv.backend) == ("mosaic",) * 3
    assert re.search(r"name=wg\b", str(jaxpr))  # the Mosaic kernels' warpgroups
    found = host_primitives(jaxpr.jaxpr)
    assert "mpmd_map" in found and "cond" not in found, sorted(found)


@pytest.mark.parametrize("layout,implementation", [("contiguous", "xla_chunked"),
                                                   ("zigzag", "pallas")])
def test_cotangents_past_the_query_lengths_change_no_gradient(layout, implementation):
    """Output cotangents past the (global) query lengths hold NaN: every gradient, the
    sinks' included, equals that of clean cotangents (those rows see no key)."""
    mesh = _mesh(2)
    q, k, v, ct = _inputs(B=2, T=64, N=2, K=1)
    lengths = jnp.array([40, 64])
    hidden = (jnp.arange(64)[None, :] >= lengths[:, None])[:, :, None, None]
    into = ((lambda x: pallas_attn.zigzag(x, 2, 1)) if layout == "zigzag" else
            (lambda x: x))
    seq = P(None, "sp")

    def attention(q, k, v, sinks):
        return jax.shard_map(
            lambda q, k, v: pallas_attn.ring_attention(
                q, k, v, axis_name="sp", sequence_layout=layout, is_causal=True,
                query_seq_lengths=lengths, sinks=sinks, implementation=implementation,
                interpret=implementation == "pallas"),
            mesh=mesh, in_specs=(seq,) * 3, out_specs=seq,
            check_vma=implementation != "pallas")(q, k, v)

    @jax.jit
    def gradients(ct):
        return jax.vjp(attention, into(q), into(k), into(v), jnp.array([0.5, -1.0]))[1](
            into(ct))

    clean = gradients(jnp.where(hidden, 0.0, ct))
    dirty = gradients(jnp.where(hidden, jnp.nan, ct))
    for got, want in zip(dirty, clean, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
