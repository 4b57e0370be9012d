"""The Pallas kernels: a backend-neutral core, the Triton and Mosaic GPU backends,
and the custom_vjp that runs a plan's kernels."""

from typing import Any

import jax
import jax.numpy as jnp


def next_power_of_2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def int32_indices() -> Any:
    """The context every kernel is traced in: x64 off, since the kernels' index
    arithmetic mixes int32 values with Python ints, which jax_enable_x64 makes int64."""
    return jax.enable_x64(False)


def padded_head_dim(head_dim: int) -> int:
    """Head dims are padded to a power of two (at least 16) for the kernels."""
    return max(16, next_power_of_2(head_dim))


def mosaic_head_dim(head_dim: int) -> int:
    """The padding where only Mosaic kernels run: whole wgmma tiles, multiples of 16 from
    33 to 112 (48, 80, 112), 128 from 113 and multiples of 32 above (160, 192, 224);
    powers of two up to 32. At 112 the columns padded to 128 cost the forward 13-30%
    (docs/decisions.md)."""
    if head_dim <= 32 or 112 < head_dim <= 128:
        return padded_head_dim(head_dim)
    step = 16 if head_dim <= 112 else 32
    return -(-head_dim // step) * step


def pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    """x padded with `value` at the end of `axis` to `size` (x itself at that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def cast_varying_like(results: Any, operands: Any) -> Any:
    """results typed as varying over the manual mesh axes their operands vary over: a
    Mosaic GPU kernel's results come back typed invariant inside jax.shard_map."""
    axes = set().union(*(jax.typeof(x).mat.varying for x in jax.tree.leaves(operands)))

    def cast(x):
        missing = tuple(sorted(axes - set(jax.typeof(x).mat.varying)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, results)


def varying_like(out_type: Any, operands: Any) -> Any:
    """out_type's ShapeDtypeStructs varying over the manual mesh axes their operands
    vary over: inside jax.shard_map a pallas_call's results must say so."""
    mats = [jax.typeof(x).mat for x in jax.tree.leaves(operands)]
    if not mats:
        return out_type
    widest = max(mats, key=lambda mat: len(mat.varying))
    return jax.tree.map(
        lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=widest), out_type)
