"""Counter-based attention dropout shared by the kernels and the reference.

The keep decision for attention weight (b, n, i, j) is a pure function of the
seed and those four indices. A full 32-bit avalanche (MurmurHash3's finaliser)
makes one key per (b, n), one per query row of it, and one odd multiplier per
key position; each score then costs one 32-bit multiply of its row key by its
column multiplier and one compare of the product against the rate's threshold. Nothing depends on
tile sizes, so the forward kernel, the backward kernels and the reference
regenerate the same mask, and nothing T x S is ever stored.

Only uint32 multiply, xor and logical shifts are used, so the same code runs in
jnp, in the Pallas interpreter and in the Triton lowering.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Odd 32-bit constants (Weyl-sequence / MurmurHash3 multipliers).
_ROW_MULTIPLIER = 0x9E3779B1
_COL_MULTIPLIER = 0x85EBCA77
_HEAD_MULTIPLIER = 0x27D4EB2F
_MIX_1 = 0x85EBCA6B  # MurmurHash3's finaliser constants
_MIX_2 = 0xC2B2AE35
_KEEP_BITS = 24  # the keep test compares the top 24 bits of the hash


def _u32(x: Any) -> jax.Array:
    return jnp.asarray(x).astype(jnp.uint32)


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(_MIX_1)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(_MIX_2)
    return h ^ (h >> 16)


def seed_from_key(rng: Any) -> jax.Array:
    """The two uint32 seed words drawn from a jax PRNG key (typed or raw)."""
    try:
        return jax.random.bits(rng, (2,), jnp.uint32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"dropout_rng must be a jax PRNG key, got {rng!r}: {e}") from None


def keep_threshold(rate: float) -> int:
    """Integer threshold t: an entry is kept iff the top 24 bits of its hash are >= t."""
    return min(int(round(rate * (1 << _KEEP_BITS))), (1 << _KEEP_BITS) - 1)


def program_key(seed: jax.Array, batch_head: Any) -> jax.Array:
    """Per (batch, head) uint32 key; batch_head = b * N + n (0 when broadcast)."""
    h = _fmix32(_u32(seed[1]) ^ (_u32(batch_head) * jnp.uint32(_HEAD_MULTIPLIER)))
    return _fmix32(_u32(seed[0]) ^ h)


def program_keys(seed: jax.Array, batch: int, num_heads: int, broadcast: bool) -> jax.Array:
    """uint32 [B, N] keys of every (batch, head), or [1, 1] when one mask is shared.

    The kernels read their key from this array instead of hashing the seed: sharded
    over batch or heads, each shard then holds the keys of its global indices.
    """
    if broadcast:
        return program_key(seed, 0).reshape(1, 1)
    batch_head = jnp.arange(batch * num_heads, dtype=jnp.int32).reshape(batch, num_heads)
    return program_key(seed, batch_head)


def row_keys(key: jax.Array, rows: jax.Array) -> jax.Array:
    """Per query row uint32 keys, rows an int32 vector of query positions."""
    return _fmix32(key ^ (_u32(rows) * jnp.uint32(_ROW_MULTIPLIER)))


def col_multipliers(cols: jax.Array) -> jax.Array:
    """Per key position odd uint32 multipliers (seed-independent: the row keys carry
    the seed)."""
    return _fmix32(_u32(cols) * jnp.uint32(_COL_MULTIPLIER)) | jnp.uint32(1)


def keep(row_key: jax.Array, cols: jax.Array, rate: float) -> jax.Array:
    """Boolean keep decisions [rows, cols] from row keys [rows] and key positions [cols].

    The row key is uniform and the column multiplier odd, so each product is
    uniform (multiplying by an odd number permutes the 32-bit words), and a row's
    products differ from column to column. Two rows' masks are correlated only when
    their keys differ by a multiple of 2^24 or more (about one row pair in 2^24);
    measured: no row-pair, column-pair, neighbour or four-corner correlation beyond
    sampling noise. Two integer operations per score, the least a hash can cost.
    """
    if row_key.ndim != 1 or jnp.ndim(cols) != 1:
        raise ValueError(f"keep takes 1-D row keys and columns, got shapes {row_key.shape} "
                         f"and {jnp.shape(cols)}")
    return keep_words(row_key[:, None] * col_multipliers(cols)[None, :], rate)


def keep_words(h: jax.Array, rate: float) -> jax.Array:
    """Keep decisions from the hash words h (row key times column multiplier)."""
    # NOTE: one unsigned compare on the whole word, the same as comparing its top
    # _KEEP_BITS bits with the threshold.
    return h >= jnp.uint32(keep_threshold(rate) << (32 - _KEEP_BITS))


def keep_mask(keys: jax.Array, *, q_len: int, kv_len: int, rate: float,
              q_origin: Any = 0, kv_origin: Any = 0) -> jax.Array:
    """The [Bk, Nk, T, S] keep mask of program keys [Bk, Nk] (`program_keys`), for query
    and key positions starting at q_origin and kv_origin (reference and tests only)."""
    rows = q_origin + jnp.arange(q_len, dtype=jnp.int32)
    cols = kv_origin + jnp.arange(kv_len, dtype=jnp.int32)
    flat = jax.vmap(lambda key: keep(row_keys(key, rows), cols, rate))(keys.reshape(-1))
    return flat.reshape(*keys.shape, q_len, kv_len)


def dropout_keep_mask(
    rng: Any, *, batch: int, num_heads: int, q_len: int, kv_len: int, rate: float,
    broadcast_batch_heads: bool = False,
) -> jax.Array:
    """The boolean [B, N, T, S] keep mask that dot_product_attention applies for `rng`.

    For tests and debugging: the kernels never build it. Kept weights are scaled
    by 1 / (1 - rate). With broadcast_batch_heads=True every (b, n) shares one mask
    (Flax's broadcast_dropout).
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"rate must lie in [0, 1), got {rate}")
    for name, value in (("batch", batch), ("num_heads", num_heads), ("q_len", q_len),
                        ("kv_len", kv_len)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    keys = program_keys(seed_from_key(rng), batch, num_heads, broadcast_batch_heads)
    mask = keep_mask(keys, q_len=q_len, kv_len=kv_len, rate=rate)
    return jnp.broadcast_to(mask, (batch, num_heads, q_len, kv_len))
