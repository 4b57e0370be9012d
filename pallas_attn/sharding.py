"""Running the kernels shard by shard under jax.jit.

A Pallas kernel is a custom call: met with sharded operands, jax.jit would gather
them onto every device. `per_shard` wraps a function of (static, *arrays) in
jax custom_partitioning with a rule that names each array dimension:

    b batch, n query heads, k key/value heads, t query positions, s key positions,
    h head dim, v value head dim, _ a dimension of its own (a broadcast one of
    size 1, say), never sharded.

Batch and head dimensions keep the caller's sharding and every device runs the
function on its own shard, with the static description localized to the shard's
shapes. Positions and head dims are replicated (a sequence-sharded input is
gathered; `pallas_attn.ring_attention` splits sequences instead). Key/value heads
are sharded like the query heads when their count divides evenly (each device
keeps whole kv groups); a single kv head (MQA) is replicated. A result that lacks a
sharded dimension (the gradient of a bias shared by the batch entries, of a kv
head shared by sharded query heads) is summed over the devices that hold its parts.
Under vmap the function runs unpartitioned (the vmapped kernels batch themselves).

Arrays whose types carry their sharding (a mesh with Explicit axes, jax.make_mesh's
default) get the same treatment: `explicit_mesh` finds the mesh, and the op runs
with those axes made Auto (`in_auto_axes`), where the rule above applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

# Dimensions that must be whole on every device.
_REPLICATED = ("t", "s", "h", "v")


def per_shard(fun: Callable[..., Any], labels: Callable[[Any], tuple[Any, Any]],
              localize: Callable[[Any, Any], Any],
              unpartitioned: Callable[[Any], bool] = lambda static: False
              ) -> Callable[..., Any]:
    """fun(static, *arrays) -> results, partitioned over batch and heads under jit.

    labels(static) -> (argument labels, result labels): pytrees mirroring the arrays
    and the results, one space-separated string of dimension names per array.
    localize(static, local arrays) -> the static description of one shard.
    unpartitioned(static): run fun as it is (code whose lowering has side effects,
    which a custom partitioning cannot hold).
    """
    partitioned = custom_partitioning(fun, static_argnums=(0,))

    def rule(static, mesh, value_types, result_types):
        del mesh, value_types, result_types
        arg_labels, result_labels = labels(static)
        fresh = iter(range(1 << 30))

        def factors(label: str) -> str:
            return " ".join(f"u{next(fresh)}" if d == "_" else d for d in label.split())

        operands = [factors(label) for label in jax.tree.leaves(arg_labels)]
        results = [factors(label) for label in jax.tree.leaves(result_labels)]
        # Shardy wants these in the order the factors first appear.
        order = list(dict.fromkeys(" ".join(operands + results).split()))
        rule = f"{', '.join(operands)} -> {', '.join(results)}"
        return rule, {"need_replication_factors": tuple(d for d in order if d in _REPLICATED)}

    def partition(static, mesh, arg_shapes, result_shape):
        arg_labels, result_labels = labels(static)
        axes = _choose_axes(mesh, arg_shapes, arg_labels)

        def sharding(label: str) -> NamedSharding:
            return NamedSharding(mesh, PartitionSpec(*(axes.get(d) for d in label.split())))

        def summed_over(label: str) -> tuple[str, ...]:
            held = {a for d in label.split() for a in (axes.get(d) or ())}
            # KV heads share the query heads' axes: each axis once.
            return tuple(dict.fromkeys(a for d in ("b", "n", "k") for a in (axes.get(d) or ())
                                       if a not in held))

        def lower(*arrays):
            results = fun(localize(static, arrays), *arrays)
            return jax.tree.map(
                lambda label, x: lax.psum(x, summed_over(label)) if summed_over(label) else x,
                result_labels, results)

        return (mesh, lower, jax.tree.map(sharding, result_labels),
                jax.tree.map(sharding, arg_labels))

    partitioned.def_partition(partition, sharding_rule=rule)

    def call(static, *arrays):
        if unpartitioned(static):
            return fun(static, *arrays)

        @custom_vmap
        def run(*arrays):
            return partitioned(static, *arrays)

        @run.def_vmap
        def _batched(axis_size, in_batched, *arrays):
            del axis_size
            in_axes = tuple(jax.tree.map(lambda b: 0 if b else None, in_batched))
            results = jax.vmap(lambda *a: fun(static, *a), in_axes=in_axes)(*arrays)
            return results, jax.tree.map(lambda _: True, results)

        return run(*arrays)

    return call


def _choose_axes(mesh, arg_shapes, arg_labels) -> dict[str, tuple[str, ...] | None]:
    """Mesh axes of the batch, query-head and kv-head dimensions, read off the first
    array holding each; kv heads follow the query heads (or stay whole, see the
    module doc)."""
    axes: dict[str, tuple[str, ...] | None] = {}
    sizes: dict[str, int] = {}
    for label, shape in zip(jax.tree.leaves(arg_labels), jax.tree.leaves(arg_shapes),
                            strict=True):
        spec = getattr(shape.sharding, "spec", None)
        for i, d in enumerate(label.split()):
            sizes.setdefault(d, shape.shape[i])
            if d in ("b", "n") and d not in axes:
                entry = spec[i] if spec is not None and i < len(spec) else None
                axes[d] = None if entry is None else (
                    (entry,) if isinstance(entry, str) else tuple(entry))
    heads = axes.get("n")
    if heads and "k" in sizes:
        ways = math.prod(mesh.shape[a] for a in heads)
        if sizes["k"] % ways == 0:
            axes["k"] = heads
        elif sizes["k"] != 1:  # kv groups would straddle devices: keep the heads whole
            axes["n"] = None
    return axes


def check_interpretable(interpret: bool) -> None:
    """ValueError for interpret=True under a context mesh with Explicit axes
    (jax.set_mesh): the Pallas interpreters' host programs fail to compile there (an
    unpartitioned Sharding custom call). Sharded arrays without set_mesh run."""
    if not interpret:
        return
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.explicit_axes:
        raise ValueError(
            f"interpret=True does not run under jax.set_mesh with Explicit axes "
            f"{mesh.explicit_axes}: the Pallas interpreters cannot compile their host "
            f"programs there; call it outside set_mesh (arrays sharded over Explicit axes "
            f"are fine) or with Auto axes")


def explicit_mesh(arrays: Any) -> Any:
    """The mesh of the first array whose type carries a sharding over Explicit axes."""
    for x in jax.tree.leaves(arrays):
        if not isinstance(x, jax.Array):
            continue
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if (mesh is not None and not mesh.empty and mesh.explicit_axes
                and any(entry is not None for entry in sharding.spec)):
            return mesh
    return None


def in_auto_axes(mesh: Any, fun: Callable[..., Any], query: jax.Array, arrays: Any,
                 with_lse: bool) -> Any:
    """fun(arrays) with the mesh's Explicit axes made Auto, its output (and lse)
    sharded like the query but for the head dim (and the lse's missing head dim)."""
    spec = tuple(jax.typeof(query).sharding.spec)
    spec = spec + (None,) * (query.ndim - len(spec))
    out = NamedSharding(mesh, PartitionSpec(*spec[:-1], None))
    lse = NamedSharding(mesh, PartitionSpec(*spec[:-1]))
    return jax.sharding.auto_axes(fun, axes=mesh.explicit_axes,
                                  out_sharding=(out, lse) if with_lse else out)(arrays)
