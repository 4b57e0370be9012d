"""Tiles of the Triton kernels: candidate ladders and their shared memory.

Pure functions, no Pallas imports. A tile is (block_q, block_k, num_warps,
num_stages); the routing table (dispatch.py) takes the first rung of a role's
ladder that fits the device's shared memory (after the tile cache and the
caller's overrides).

Triton decides what it stages through shared memory, so the estimate is a model
of its pipelining, checked against the compiler's requests on an H100: tiles
loaded inside the loop are multi-buffered num_stages deep (K, V in the forward
and dQ kernels; Q and dO and the bias/mask tiles in the dK/dV kernel), tiles
loaded once stay resident, and the [block_q, block_k] operand of a second matrix
product (P or dS) is staged once.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from pallas_attn.kernels import next_power_of_2, padded_head_dim

Tiles = tuple[int, int, int, int]  # (block_q, block_k, num_warps, num_stages)

# Per-role candidate ladders, best first, per padded head dim (the widest of H, Hv).
# Head dims 64, 128, 256: the winners of `python -m pallas_attn tune` on an H100,
# then smaller fallbacks for devices with less shared memory.
_LADDERS: dict[int, dict[str, tuple[Tiles, ...]]] = {
    16: {"forward": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2)),
         "dkdv": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2)),
         "dq": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2))},
    32: {"forward": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2)),
         "dkdv": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2)),
         "dq": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2))},
    64: {"forward": ((64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2)),
         "dkdv": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 1)),
         "dq": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1))},
    128: {"forward": ((128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)),
          "dkdv": ((64, 64, 4, 2), (64, 64, 4, 1), (32, 64, 4, 1), (32, 32, 4, 1)),
          "dq": ((128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2),
                 (32, 32, 4, 1)),
          "dbias": ((64, 128, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1))},
    256: {"forward": ((128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2),
                      (32, 32, 4, 1), (16, 16, 4, 1)),
          "dkdv": ((64, 64, 8, 2), (32, 64, 8, 3), (32, 64, 8, 2), (32, 32, 4, 1),
                   (16, 16, 4, 1)),
          "dq": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1))},
}
# Causal problems, and problems with extra per-score work (a bias, dropout, a soft
# cap), run the forward at head dim 128 with eight warps: the extra work raises
# register pressure and the 4-warp forward suffers (docs/decisions.md, "Eight-warp
# Triton forward").
_EIGHT_WARP_FORWARD = ((128, 64, 8, 4), (128, 64, 8, 3), (128, 64, 4, 2), (64, 64, 4, 2),
                       (64, 32, 4, 2))
_CAUSAL_LADDERS: dict[tuple[int, str], tuple[Tiles, ...]] = {
    (128, "forward"): _EIGHT_WARP_FORWARD,
}
_HEAVY_SCORE_LADDERS: dict[tuple[int, str], tuple[Tiles, ...]] = {
    (128, "forward"): _EIGHT_WARP_FORWARD,
}
# Every ladder ends with these rungs, which fit any supported device and head dim.
_SMALLEST = ((32, 32, 4, 1), (16, 16, 4, 1))

WARPS = (1, 2, 4, 8, 16)

# The tiles of the kernels that repair the rows of a Mosaic forward or dQ that a hidden
# non-finite key reached (block_q, block_k, warps, stages): they run where a NaN shows,
# which is rare, so they are chosen to fit every head dim, not to be fast.
REPAIR_TILES = (64, 32, 4, 1)

# The optional operands the decode kernel reads (decode.py); the routing table sends
# a call with any other (segments, dropout, an origin) to the forward.
DECODE_OPERANDS = ("bias", "mask", "alibi_slopes", "query_seq_lengths", "key_value_seq_lengths",
                   "sinks")



def ladder(role: str, head_dim: int, value_head_dim: int | None = None,
           is_causal: bool = False, heavy_scores: bool = False) -> tuple[Tiles, ...]:
    """Candidates of one role, best first; heavy_scores: a bias, dropout or soft cap."""
    width = min(max(padded_head_dim(max(head_dim, value_head_dim or head_dim)), 16), 256)
    # NOTE: dbias has its own swept ladder only at head dim 128; elsewhere it starts
    # from the dQ kernel's, which reads the same four tiles per step.
    entries = _LADDERS[width].get(role) or _LADDERS[width]["dq"]
    if is_causal:
        entries = _CAUSAL_LADDERS.get((width, role), entries)
    if heavy_scores:
        entries = _HEAVY_SCORE_LADDERS.get((width, role), entries)
    return entries + tuple(e for e in _SMALLEST if e not in entries)



def clamp(tiles: Tiles, q_len: int, kv_len: int) -> Tiles:
    """Tiles no longer than the (power-of-two rounded) sequences."""
    block_q, block_k, warps, stages = tiles
    return (min(block_q, max(16, next_power_of_2(q_len))),
            min(block_k, max(16, next_power_of_2(kv_len))), warps, stages)


def shared_memory(role: str, tiles: Tiles, head_dim: int, value_head_dim: int, dtype: Any,
                  *, bias_dtype: Any = None, has_mask: bool = False,
                  cleaned: bool = False) -> int:
    """Bytes of shared memory Triton stages for one role's kernel with these tiles;
    cleaned: whether it stages cleaned copies of tiles it loads (`cleaned_tiles`)."""
    block_q, block_k, _, stages = tiles
    hd, hv = padded_head_dim(head_dim), padded_head_dim(value_head_dim)
    size = jnp.dtype(dtype).itemsize
    extra = (jnp.dtype(bias_dtype).itemsize if bias_dtype is not None else 0) + (
        1 if has_mask else 0)
    score_inputs = stages * block_q * block_k * extra
    if role == "forward":
        return block_q * hd * size + stages * block_k * (hd + hv) * size + score_inputs
    if role == "dkdv":
        # Q and dO zeroed past the query length are staged apart and pipelined otherwise:
        # counted once per stage, which covers every H200 request measured (decisions.md).
        cleaned_rows = stages * block_q * (hd + hv) * size if cleaned else 0
        return (block_k * (hd + hv) * size + stages * block_q * (hd + hv) * size
                + 2 * block_q * block_k * size + score_inputs + cleaned_rows)
    if role == "dq":
        # In masked tiles K with its hidden and non-finite entries zeroed is staged apart
        # from the loaded K for dS K (H100: exactly block_k * hd * size more).
        cleaned_keys = block_k * hd * size if cleaned else 0
        return (block_q * (hd + hv) * size + stages * block_k * (hd + hv) * size
                + block_q * block_k * size + score_inputs + cleaned_keys)
    if role == "dbias":
        # Q, dO, K and V are all loaded inside the loop, so every one is multi-buffered;
        # the bias tile is not staged. Measured on an H100 at head dim 128, bf16:
        # exactly stages * (block_q + block_k) * 512 bytes for (128, 64, 3), (128, 32, 3)
        # and (128, 128, 2), plus 512 with 4 warps.
        return stages * (block_q + block_k) * (hd + hv) * size + 512
    raise ValueError(f"unknown role {role!r}")


def masked_key_tiles(hides_keys: bool, has_kv_lengths: bool, kv_len: int,
                     block_k: int) -> bool:
    """Whether a kernel looping key tiles of block_k runs some with masked=True: a band
    edge, a mask or segment ids (AttentionSpec.hides_keys), a key length, a ragged last
    tile."""
    return hides_keys or has_kv_lengths or kv_len % block_k != 0


def cleaned_tiles(role: str, hides_keys: bool, has_q_lengths: bool, has_kv_lengths: bool,
                  kv_len: int, block_k: int) -> bool:
    """Whether a role's kernel stages cleaned copies of tiles apart from the loaded ones:
    the dQ kernel K in its masked key tiles, the dK/dV kernel Q and dO in the query
    tiles a query length crosses."""
    if role == "dq":
        return masked_key_tiles(hides_keys, has_kv_lengths, kv_len, block_k)
    return role == "dkdv" and has_q_lengths


def fusable_dbias(bias_shape: tuple[int, ...], *, batch: int, num_heads: int) -> bool:
    """Whether the dK/dV kernel can write dbias: each dbias element must belong to one
    dK/dV program, so the bias varies along keys, and over batch entries and heads
    (where there are several). A per-key bias (one row) is summed in registers."""
    Bb, Nb, _, Sb = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    return Sb > 1 and (Bb > 1 or batch == 1) and (Nb > 1 or num_heads == 1)
