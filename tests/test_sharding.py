"""Sharding under jax.jit: batch- and head-sharded inputs run shard by shard.

Eight CPU devices (tests/conftest.py), a (data=4, model=2) mesh, the kernels in the
Pallas interpreter. Each case compares a jitted value-and-grad step on sharded
inputs with the same step on one device, and reads the compiled HLO: no collective
may touch the attention's operands, outputs or gradients (the scalar loss's
all-reduce aside), except the sums a shared bias or kv head needs.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_attn

pytestmark = pytest.mark.timeout(300)

IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas")
_COLLECTIVE = re.compile(
    r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
    r"(?:-start)?\(")


def _mesh(shape=(4, 2), names=("data", "model")):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _collectives(hlo: str) -> list[tuple[str, str]]:
    """(shape, collective) of every array a collective moves, scalars (the loss) aside;
    XLA may combine several into one tuple-shaped collective."""
    found = []
    for match in _COLLECTIVE.finditer(hlo):
        for shape in re.findall(r"[a-z0-9]+\[[0-9,]+\]", match.group(1)):
            found.append((shape, match.group(2)))
    return found


# One jitted program (eagerly, the sampler compiles for every new shape on its own).
@functools.partial(jax.jit, static_argnames=("B", "T", "N", "K", "H", "seed"))
def _inputs(B=4, T=32, N=4, K=2, H=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, K, H), jnp.float32)
    ct = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
    return q, k, v, ct


def _step(implementation: str, **kwargs):
    def loss(q, k, v, ct, extra):
        out, lse = pallas_attn.dot_product_attention(
            q, k, v, implementation=implementation, interpret=implementation == "pallas",
            return_residual=True, **extra, **kwargs)
        lse = jnp.where(jnp.isinf(lse), 0.0, lse)
        return jnp.sum(out * ct) + jnp.sum(lse * jnp.cos(lse)), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _compare(step, args, sharded_args, atol=2e-5):
    expected = step(*args)
    compiled = step.lower(*sharded_args).compile()
    got = compiled(*sharded_args)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=atol, rtol=atol)
    return compiled.as_text(), got


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _dropout_alibi() -> dict:
    return dict(dropout_rate=0.25, dropout_rng=jax.random.key(7),
                alibi_slopes=jax.lax.stop_gradient(jnp.linspace(0.1, 0.8, 4)))


FEATURES = {
    "plain": lambda B, T: {},
    "causal_window_softcap_sinks": lambda B, T: dict(
        is_causal=True, local_window_size=(9, 0), logits_soft_cap=5.0,
        sinks=jnp.array([0.5, -1.0, 2.0, 0.0])),
    "lengths_segments_dropout_alibi": lambda B, T: dict(
        query_seq_lengths=jnp.array([T, 20, 7, 0][:B], jnp.int32),
        key_value_seq_lengths=jnp.array([T, 30, 3, 12][:B], jnp.int32),
        q_segment_ids=(jnp.arange(T)[None, :] // 10 + jnp.arange(B)[:, None]) % 3,
        **_dropout_alibi()),
    "broadcast_dropout_mask": lambda B, T: dict(
        dropout_rate=0.5, dropout_rng=jax.random.key(3), broadcast_dropout=True,
        mask=jax.random.bernoulli(jax.random.key(5), 0.7, (B, 1, T, T))),
}


# The reference ("xla") is XLA's own partitioning of jnp code: the plain case alone. The
# other implementations run the feature sets only: plain's call with options on top
# (causal_window_softcap_sinks without a per-batch array, as plain).
@pytest.mark.parametrize(("feature", "implementation"), [
    (feature, implementation) for feature in sorted(FEATURES) for implementation in IMPLEMENTATIONS
    if (implementation == "xla") == (feature == "plain")])
def test_batch_and_head_sharding_runs_per_shard(implementation, feature):
    mesh = _mesh()
    q, k, v, ct = _inputs()
    B, T = q.shape[:2]
    options = FEATURES[feature](B, T)
    # Per-batch arrays are sharded like the batch (the step must not gather them).
    extra = {name: options.pop(name) for name in
             ("query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "mask")
             if name in options}
    step = _step(implementation, **options)
    layout = {"q": ("data", None, "model", None), "k": ("data", None, "model", None)}
    sharded = (_put(mesh, q, *layout["q"]), _put(mesh, k, *layout["k"]),
               _put(mesh, v, *layout["k"]), _put(mesh, ct, *layout["q"]),
               {name: _put(mesh, x, "data") for name, x in extra.items()})
    hlo, got = _compare(step, (q, k, v, ct, extra), sharded)
    assert _collectives(hlo) == []
    (_, (out, _)), (dq, dk, _) = got
    assert tuple(out.sharding.spec[:3]) == ("data", None, "model")
    assert tuple(dq.sharding.spec[:3]) == ("data", None, "model")
    assert tuple(dk.sharding.spec[:3]) == ("data", None, "model")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bias_shared_by_the_batch_sums_its_gradient(implementation):
    """A bias [1, N, T, S] under batch sharding: each device's dbias is a partial sum,
    so the one collective is the all-reduce of dbias."""
    mesh = _mesh()
    q, k, v, ct = _inputs()
    N, T = q.shape[2], q.shape[1]
    bias = jax.random.normal(jax.random.key(9), (1, N, T, T), jnp.float32)

    def loss(q, k, v, ct, bias):
        out = pallas_attn.dot_product_attention(
            q, k, v, bias, implementation=implementation,
            interpret=implementation == "pallas", is_causal=True)
        return jnp.sum(out * ct)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4)))
    spec = ("data", None, "model", None)
    sharded = (_put(mesh, q, *spec), _put(mesh, k, *spec), _put(mesh, v, *spec),
               _put(mesh, ct, *spec), _put(mesh, bias, None, "model"))
    hlo, _ = _compare(step, (q, k, v, ct, bias), sharded)
    collectives = _collectives(hlo)
    if implementation == "pallas":  # XLA may reduce the einsum paths' dbias its own way
        assert collectives and all(op == "all-reduce" for _, op in collectives)
        assert all(f"[1,{N // 2},{T},{T}]" in shape for shape, _ in collectives)


def test_float16_scaled_backward_runs_per_shard():
    """float16 values and cotangents large enough that the backward scales dS
    (kernels/core.py ds_scales, from |dO| per row, which the step passes in): batch and
    head sharded, each shard's scales are the whole call's, so the results agree (to
    float16 rounding: the first causal row's dS cancels to rounding noise) and nothing
    moves between devices."""
    mesh = _mesh()
    q, k, v, ct = (x.astype(jnp.float16) for x in _inputs())
    v, ct = v * 300, ct * 300
    step = _step("pallas", is_causal=True)
    spec = ("data", None, "model", None)
    sharded = tuple(_put(mesh, x, *spec) for x in (q, k, v, ct)) + ({},)
    expected = step(q, k, v, ct, {})
    compiled = step.lower(*sharded).compile()
    got = compiled(*sharded)  # run once: its gradients are checked twice below
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        e, g = np.asarray(e, np.float32), np.asarray(g, np.float32)
        finite = np.isfinite(e)  # the loss, summed in float16, overflows
        np.testing.assert_array_equal(np.isfinite(g), finite)
        if finite.any():
            scale = np.abs(e[finite]).max()
            np.testing.assert_allclose(g[finite], e[finite], atol=1e-2 * scale)
    assert not _collectives(compiled.as_text())
    # dS passes 65504 here: unscaled, dq and dk would hold inf where they are finite.
    reference = _step("xla", is_causal=True)(*(x.astype(jnp.float32) for x in (q, k, v, ct)),
                                             {})
    for name, r, g in zip(("dq", "dk"), reference[1][:2], got[1][:2], strict=True):
        small = np.abs(np.asarray(r)) < 6e4
        assert np.isfinite(np.asarray(g, np.float32)[small]).all(), name


def test_kv_groups_straddling_devices_keep_the_heads_whole():
    """Two kv heads over four head shards would split kv groups: the heads are
    gathered instead, and the result is still exact."""
    mesh = _mesh((2, 4))
    q, k, v, ct = _inputs(B=2, N=8, K=2)
    step = _step("pallas")
    spec = ("data", None, "model", None)
    sharded = (_put(mesh, q, *spec), _put(mesh, k, "data"), _put(mesh, v, "data"),
               _put(mesh, ct, *spec), {})
    _compare(step, (q, k, v, ct, {}), sharded)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sequence_sharded_inputs_are_gathered_and_exact(implementation):
    mesh = _mesh()
    q, k, v, ct = _inputs()
    step = _step(implementation, is_causal=True)
    spec = (None, "data", "model", None)
    sharded = (_put(mesh, q, *spec), _put(mesh, k, *spec), _put(mesh, v, *spec),
               _put(mesh, ct, *spec), {})
    _compare(step, (q, k, v, ct, {}), sharded)


def test_vmap_of_sharded_inputs():
    """Under vmap the kernels run unpartitioned (they batch themselves): exact."""
    mesh = _mesh()
    q, k, v, ct = _inputs()

    def loss(q, k, v):
        out = jax.vmap(lambda q, k, v: pallas_attn.dot_product_attention(
            q, k, v, implementation="pallas", interpret=True, is_causal=True))(q, k, v)
        return jnp.sum(out * ct)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    spec = ("data", None, "model", None)
    sharded = (_put(mesh, q, *spec), _put(mesh, k, *spec), _put(mesh, v, *spec))
    _compare(step, (q, k, v), sharded)


def test_flax_layer_with_logical_axis_rules_gathers_nothing():
    """pallas_attn.flax.MultiHeadAttention, its projections annotated with logical axis
    names and laid out by flax's logical axis rules (batch over 'data', heads over
    'model'): a jitted training step equals the unsharded one, and its HLO moves no
    array between devices but the all-reduces of the output projection (it sums over
    the sharded heads) and of the data-parallel gradients."""
    from flax import nnx

    import pallas_attn.flax as paf

    mesh = _mesh()
    names = {"query": ("embed", "heads", "kv"), "key": ("embed", "kv_heads", "kv"),
             "value": ("embed", "kv_heads", "kv"), "out": ("heads", "kv", "embed")}
    rules = (("batch", "data"), ("heads", "model"), ("kv_heads", "model"), ("embed", None),
             ("kv", None))

    def build():
        layer = paf.MultiHeadAttention(4, 32, num_kv_heads=2, is_causal=True,
                                       implementation="pallas", interpret=True,
                                       rngs=nnx.Rngs(0))
        for proj, axes in names.items():
            getattr(layer, proj).kernel.set_metadata(out_sharding=axes)
            getattr(layer, proj).bias.set_metadata(
                out_sharding=("embed",) if proj == "out" else axes[1:])
        return layer

    def step(layer, x, y):
        def loss(layer):
            return jnp.mean((layer(x) - y) ** 2)
        return nnx.value_and_grad(loss)(layer)

    x = jax.random.normal(jax.random.key(1), (4, 32, 32), jnp.float32)
    y = jax.random.normal(jax.random.key(2), (4, 32, 32), jnp.float32)
    expected = nnx.jit(step)(build(), x, y)

    layer = build()
    with nnx.logical_axis_rules(rules):
        shardings = nnx.get_named_sharding(nnx.state(layer), mesh)
    nnx.update(layer, jax.device_put(nnx.state(layer), shardings))
    xs, ys = (_put(mesh, a, "data") for a in (x, y))
    graph, state = nnx.split(layer)

    @jax.jit
    def pure(state, x, y):
        loss, grads = step(nnx.merge(graph, state), x, y)
        return loss, nnx.state(grads)

    compiled = pure.lower(state, xs, ys).compile()
    loss, grads = compiled(state, xs, ys)
    np.testing.assert_allclose(loss, expected[0], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(nnx.state(expected[1])),
                         strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert {op for _, op in _collectives(compiled.as_text())} <= {"all-reduce"}
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(shardings), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim)


def test_interpreter_under_an_explicit_context_mesh_names_the_problem():
    """jax.set_mesh with Explicit axes: the interpreters' host programs cannot compile
    there, so the call says so (sharded arrays alone run, the test below)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    q = jnp.zeros((2, 16, 2, 32), jnp.bfloat16)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="interpret=True does not run "
                                           "under jax.set_mesh with Explicit axes"):
        pallas_attn.dot_product_attention(q, q, q, implementation="pallas", interpret=True)


# Explicit axes are made Auto in front of every implementation (sharding.in_auto_axes):
# MQA's partial sums in each of them (one kv head read whole by every head shard, dK/dV
# summed over the devices: the all-reduce), kv heads sharded with the query heads in
# front of the reference (the same in_auto_axes for every implementation; the kernels'
# partitioning of kv heads sharded with the query heads, under dropout and ALiBi:
# test_batch_and_head_sharding_runs_per_shard[lengths_segments_dropout_alibi-pallas]).
@pytest.mark.parametrize("kv_heads,implementation",
                         [(1, implementation) for implementation in IMPLEMENTATIONS]
                         + [(2, "xla")],
                         ids=lambda x: str(x))
def test_explicit_sharding_in_types_runs_per_shard(implementation, kv_heads):
    """A mesh with Explicit axes (jax.make_mesh's default): the shardings live in the
    arrays' types and the rule runs through jax.shard_map; same numbers, no gather."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    q, k, v, ct = _inputs(K=kv_heads)
    options = dict(_dropout_alibi(), is_causal=True)
    step = _step(implementation, **options)
    spec = ("data", None, "model", None)
    kv_spec = spec if kv_heads > 1 else ("data",)
    sharded = (_put(mesh, q, *spec), _put(mesh, k, *kv_spec), _put(mesh, v, *kv_spec),
               _put(mesh, ct, *spec), {})
    hlo, got = _compare(step, (q, k, v, ct, {}), sharded)
    # MQA: dK/dV are partial sums over the head shards, summed by an all-reduce.
    assert {op for _, op in _collectives(hlo)} == ({"all-reduce"} if kv_heads == 1 else set())
    assert tuple(got[1][0].sharding.spec[:3]) == ("data", None, "model")
