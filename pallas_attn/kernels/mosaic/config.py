"""What the Hopper (Mosaic GPU) kernels can run and what they allocate.

Pure functions, no Pallas imports: the routing table (dispatch.py) asks them
whether a problem is in scope and whether its buffers fit; the kernels build their
shared memory from the same scratch descriptions (`forward_scratch`, ...), so the
estimate and the allocation cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from pallas_attn.kernels import padded_head_dim
from pallas_attn.spec import AttentionSpec

# Query rows per consumer warpgroup (the wgmma M dimension).
ROWS_PER_CONSUMER = 64
# The forward's and dbias kernel's work items: 128 query rows, two consumers.
ITEM_ROWS = 128
CONSUMERS = ITEM_ROWS // ROWS_PER_CONSUMER
# The forward's key tiles a caller may ask for (`BlockSizes.block_k`); the routing
# table also takes 96 (`forward_block_k_options`).
FORWARD_BLOCK_K = (64, 128)
# Padded head dims above this take the forward's widest key tiles that fit (128, 96 or
# 64: `forward_block_k_options`) and the backward's wide kernels (`is_wide`).
WIDE_HEAD_DIM = 128
# The dK/dV kernel: steps of 64 query rows, units of 128 keys (64 per consumer); at
# head dim 256 units of 64 keys that both consumers share (`is_wide`).
DKV_TILES = (64, 128)
DKV_WIDE_TILES = (64, 64)
# The dQ kernel: block_q is the padding of the query rows, 64-key tiles; at head dim
# 256 items of 64 rows that both consumers share (`is_wide`).
DQ_TILES = (ITEM_ROWS, 64)
DQ_WIDE_TILES = (ROWS_PER_CONSUMER, 64)
DBIAS_BLOCK_K = (64, 128)

# The forward's three consumers: the most registers per thread their output accumulator,
# scores and P may hold (head dim 64 with 128-key tiles, 128 and 160 with 64-key tiles).
FORWARD_THREE_REGISTERS = 128

# A boolean mask as the kernels read it: one byte per entry (the bulk copies and
# register layouts take no 1-bit type).
MASK_DTYPE = "int8"

# Default slots (stages) per kernel ring (docs/decisions.md).
FORWARD_STAGES = 2
DKV_STAGES = 2
# One slot where two do not fit (a bias above head dim 128, a float32 bias at 128) measured
# faster than the Triton dK/dV kernel it replaces (docs/decisions.md).
DKV_STAGE_OPTIONS = (DKV_STAGES, 1)
DQ_STAGES = 2
DBIAS_STAGES = (2, 1)  # the first that fits

# Registers per thread after the warpgroups specialise: consumers hold the
# accumulator and the score tile, the producer only issues copies. With three
# consumers (the dQ kernel's) the four warpgroups share the 64K registers as
# 3 x 160 + 24.
_REGISTERS = {2: (232, 40), 3: (160, 24)}

# Pallas starts each shared-memory buffer at a multiple of this many bytes.
SMEM_ALIGNMENT = 1024

# Positions hashed at once for dropout, one per thread of a consumer warpgroup
# (`common.Dropout`'s table).
HASH_TABLE = 128

# The columns of the dK/dV kernel's tile of ones (dS^T times it gives dS's column sums,
# each column the same): few, to hold few accumulator registers.
ONES_COLUMNS = 16

# The forward, dQ and dK/dV kernels run every padded head dim from 16 to 256 (powers of
# two, `padded_head_dim`; where every role is a Mosaic kernel, whole tiles in between,
# `Plan.head_dims`); above 128 the dQ and dK/dV kernels' consumers share each tile
# (`is_wide`). The dbias kernel runs these only.
DBIAS_HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")


def is_wide(hp: int, hvp: int) -> bool:
    """Whether the backward kernels' two consumers share each tile (a padded head dim
    above 128): each computes S and dP for half of a tile's 64 keys and holds dK and dV
    (dQ) for half of the head dims, the two exchanging P and dS through shared memory.
    One consumer's accumulators over 160 to 256 dims would need every register it has."""
    return max(hp, hvp) > WIDE_HEAD_DIM


def dkv_keys_major(hp: int, hvp: int, has_bias: bool, has_alibi: bool,
                   has_mask: bool = False) -> bool:
    """Whether the dK/dV kernel computes its tiles keys by queries (S^T = K Q^T), so
    that P^T and dS^T feed dV's and dK's products from registers: at equal head dims up
    to 64 without a bias or mask tiles (read queries by keys) or ALiBi.
    Measured 6-7% faster at 64, 11-13% fwd+bwd at 32, and 2-5% slower at 128, 21% with
    ALiBi: the operands held in registers until their products finish crowd the larger
    accumulators (docs/decisions.md)."""
    return hp == hvp and hp <= 64 and not (has_bias or has_alibi or has_mask)


def forward_loads_q_early(spec: AttentionSpec) -> bool:
    """Whether a forward consumer loads its next item's Q right after the item's last
    Q K^T rather than after its last P V: d128 1.5-3% faster, not with a soft cap (4% slower
    there; docs/decisions.md)."""
    return spec.logits_soft_cap is None


def dkv_releases_early(spec: AttentionSpec) -> bool:
    """Whether the dK/dV kernel's consumers give each unit's K and V back after its last
    S and dP rather than after its last step: with segment ids, whose units are short
    (packed16 fwd+bwd 3% faster), not elsewhere (a test per step that long units pay
    for: plain d128 0.5-2% slower; a mask's ranges alone not measured; docs/decisions.md)."""
    return spec.has_segments


def operand_swizzle(hp: int, hvp: int) -> int:
    """The swizzle (bytes) of the backward kernels' wgmma tiles: where the consumers share
    each tile (`is_wide`), 64, or 32 where half the head dims is no multiple of 32 (160,
    224), so that half of a 64-key tile and half of the head dims are whole tiles; else
    the forward's (`forward_swizzle`)."""
    if is_wide(hp, hvp):
        return 64 if hp % 64 == 0 and hvp % 64 == 0 else 32
    return forward_swizzle(hp, hvp)


def forward_swizzle(*columns: int) -> int:
    """The swizzle (bytes) of the forward's wgmma tiles: rows of 64 16-bit columns, or of
    32 or 16 where the head dims (and the key tile, over which P V contracts) are not
    multiples of 64 (32, 96; 16, 80): the widest that makes them all whole tiles (both
    operands of a wgmma share it)."""
    return next(s for s in (128, 64, 32) if all(n % (s // 2) == 0 for n in columns))


def dkv_tiles(hp: int, hvp: int) -> tuple[int, int]:
    """(query rows per step, keys per unit) of the dK/dV kernel."""
    return DKV_WIDE_TILES if is_wide(hp, hvp) else DKV_TILES


def dq_tiles(hp: int, hvp: int) -> tuple[int, int]:
    """(query rows per item, keys per tile) of the dQ kernel."""
    return DQ_WIDE_TILES if is_wide(hp, hvp) else DQ_TILES


def consumer_registers(consumers: int) -> int:
    return _REGISTERS[consumers][0]


def producer_registers(consumers: int) -> int:
    return _REGISTERS[consumers][1]



# The operands each role's kernel reads besides q, k and v (the ranges are derived from
# the segment ids and the mask, core.segment_ranges and core.mask_ranges).
SEGMENTS = ("q_segment_ids", "kv_segment_ids", "key_ranges", "query_ranges")
LENGTHS = ("query_seq_lengths", "key_value_seq_lengths")
OPERANDS = {"forward": ("bias", "mask", "alibi_slopes", "sinks", *SEGMENTS, *LENGTHS,
                        "dropout_keys", "origin"),
            "dq": ("bias", "mask", "alibi_slopes", "sinks", *SEGMENTS, *LENGTHS, "dropout_keys",
                   "origin"),
            "dkdv": ("bias", "mask", "alibi_slopes", "sinks", *SEGMENTS, *LENGTHS,
                     "dropout_keys", "origin"),
            "dbias": ("bias", "alibi_slopes", "sinks")}
# What each role's kernel reads from global memory where it broadcasts along queries or
# keys (`per_key`, `per_row`; the dbias kernel none).
BROADCAST_READS = {"forward": ("bias", "mask"), "dq": ("bias", "mask"),
                   "dkdv": ("bias", "mask"), "dbias": ()}
_OPERAND_NAMES = {"bias": "a bias", "mask": "a mask", "alibi_slopes": "ALiBi slopes",
                  "sinks": "sinks",
                  "q_segment_ids": "segment ids", "query_seq_lengths": "sequence lengths",
                  "dropout_keys": "dropout", "origin": "an origin (ring attention's blocks)"}


def per_key(shape: tuple[int, ...]) -> bool:
    """Whether a bias or mask of this shape ([..., T or 1, S or 1]) has one entry per key
    that every query shares: the forward, dQ and dK/dV kernels read such a row per key
    tile (`common.KeyRows`), not in tiles."""
    return shape[-2] == 1 and shape[-1] > 1


def per_row(shape: tuple[int, ...]) -> bool:
    """Whether a bias or mask of this shape ([..., T or 1, 1]) is broadcast along keys:
    one entry per query row (or one for every row) that every key shares, read per
    consumer's rows (`common.RowEntries`), not in tiles."""
    return shape[-1] == 1


def bias_tiles_dtype(spec: AttentionSpec, bias_dtype: Any) -> Any:
    """The dtype of the bias tiles a kernel stages in shared memory, or None: no bias, or
    one per key or per row (read from global memory)."""
    if not spec.has_bias or per_key(spec.bias_shape) or per_row(spec.bias_shape):
        return None
    return bias_dtype


def mask_tiles(spec: AttentionSpec) -> bool:
    """Whether a kernel streams tiles of the mask through shared memory (not for a mask
    per key or per row, read from global memory)."""
    return spec.has_mask and not (per_key(spec.mask_shape) or per_row(spec.mask_shape))


def unsupported_scores(spec: AttentionSpec, present: tuple[str, ...], role: str) -> str:
    """Why the role's Mosaic kernel cannot compute these scores, or "" when it can."""
    if spec.has_dropout and "dropout_keys" not in OPERANDS[role]:
        return f"no dropout, got dropout_rate={spec.dropout_rate}"
    others = [name for name in present if name not in OPERANDS[role]]
    if others:
        takes = [_OPERAND_NAMES[name] for name in OPERANDS[role] if name in _OPERAND_NAMES]
        return (f"it takes no operand besides q, k, v, {', '.join(takes[:-1])} and "
                f"{takes[-1]}, got {', '.join(others)}")
    for name, shape in (("bias", spec.bias_shape if spec.has_bias else None),
                        ("mask", spec.mask_shape if spec.has_mask else None)):
        if shape is None or 1 not in shape[2:]:
            continue
        if name not in BROADCAST_READS[role]:
            return (f"the {name} needs its own entry per query and key, got a {name} of "
                    f"shape {shape} (broadcast along queries or keys)")
    return ""


def unsupported(dtype: str, spec: AttentionSpec, present: tuple[str, ...], head_dim: int,
                value_head_dim: int, role: str) -> str:
    """Why the role's Mosaic kernel cannot run a problem, or "" when it can."""
    if dtype not in DTYPES:
        return f"inputs must be bfloat16 or float16, got {dtype}"
    if why := unsupported_scores(spec, present, role):
        return why
    dims = (padded_head_dim(head_dim), padded_head_dim(value_head_dim))
    if role == "dbias" and not set(dims) <= set(DBIAS_HEAD_DIMS):
        return (f"head dims must pad to {DBIAS_HEAD_DIMS}, got {head_dim} and "
                f"{value_head_dim}")
    return ""


def fusable_dbias(bias_shape: tuple[int, ...], *, batch: int, num_heads: int,
                  bias_dtype: Any, dtype: Any) -> bool:
    """Whether the dK/dV kernel can write dbias: a bias with its own entry per head,
    query and key, shared by the batch entries or not, in the inputs' dtype (its dS
    tiles, staged in that dtype, are the dbias tiles); or a bias per key of any
    broadcast and dtype (`per_key`: dS's column sums, `key_sums`)."""
    Bb, Nb, Tb, Sb = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    if per_key((Bb, Nb, Tb, Sb)):
        return True
    return (Nb == num_heads and Bb in (1, batch) and Tb > 1 and Sb > 1
            and jnp.dtype(bias_dtype) == jnp.dtype(dtype))


def key_sums(spec: AttentionSpec) -> bool:
    """Whether the dK/dV kernel sums a bias's gradient per key (a bias per key: dS's
    column sums, by a product with a tile of ones, `dkv_scratch`), not in dS tiles."""
    return spec.has_bias and per_key(spec.bias_shape)


def sums_batch_tiles(spec: AttentionSpec, batch: int) -> bool:
    """Whether the dK/dV kernel adds several batch entries' dS tiles into one dbias tile:
    a bias shared by the batch entries with its own entry per query (in passes, or in
    no fixed order when not deterministic)."""
    return spec.has_bias and spec.bias_shape[0] == 1 and batch > 1 and not key_sums(spec)


# ----------------------------------------------------------------------- scratch
@dataclasses.dataclass(frozen=True)
class Buffer:
    """A shared-memory buffer: wgmma tiles of rows `swizzle` bytes wide, swizzled (the
    kernels use 128; 64 where a consumer writes half of a 64-column tile), or plain
    (swizzle 0)."""
    shape: tuple[int, ...]
    dtype: str
    swizzle: int = 128

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Barriers:
    """`count` barriers of `arrivals` arrivals each (8 bytes of shared memory apiece)."""
    count: int = 1
    arrivals: int = 1


@dataclasses.dataclass(frozen=True)
class Scratch:
    """A kernel's shared memory, in allocation order; an entry may be None (absent)."""
    buffers: tuple[tuple[str, Buffer | None], ...]
    barriers: tuple[tuple[str, Barriers | None], ...]

    @property
    def bytes(self) -> int:
        """As Pallas allocates them: each buffer from a multiple of SMEM_ALIGNMENT."""
        return (sum(-(-b.bytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
                    for _, b in self.buffers if b is not None)
                + 8 * sum(b.count for _, b in self.barriers if b is not None))


def _name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def _hash_tables(consumers: int, dropout: bool) -> Buffer | None:
    """Each consumer's table of dropout's hashes (`common.Dropout`), or None."""
    return Buffer((consumers, HASH_TABLE), "uint32", swizzle=0) if dropout else None


def with_hash_tables(scratch: Callable[[bool], Scratch], dropout: bool,
                     budget: int) -> Scratch:
    """A kernel's scratch, scratch(tables), with dropout's hash tables where they fit
    the budget beside the buffers the routing table chose, else without them (each
    consumer then hashes its tile's positions in registers, `common.Dropout`)."""
    if dropout and (tables := scratch(True)).bytes <= budget:
        return tables
    return scratch(False)


def forward_block_k_options(hp: int, hvp: int, key_operands: bool) -> tuple[int, ...]:
    """The forward's key tiles, first choice first (the routing table takes the first
    whose buffers fit): 128, then 64 (a float32 bias tile per consumer may not fit
    beside 128-key slots); above head dim 128 also 96 between them (4-13% faster
    forwards, docs/decisions.md "Wide head dims: the widest forward key tiles that
    fit"), except with key_operands: a bias, mask or segment ids, whose per-key rows
    and ids are read from arrays padded to the power-of-two tiles, which a 96-key tile
    would run past (the full tiles' copies would not: left out with them, unmeasured)."""
    if max(hp, hvp) <= WIDE_HEAD_DIM or key_operands:
        return (128, 64)
    return (128, 96, 64)


def forward_output_staging(hp: int, hvp: int, block_k: int, stages: int, dtype: Any,
                           bias_dtype: Any, budget: int, consumers: int = CONSUMERS,
                           has_mask: bool = False) -> str:
    """Where the forward stages its output tile: in P's buffer ("p") when the shapes
    agree, else in a buffer of its own ("o") where that fits the budget, else in Q's
    ("q", same shape: the next item's Q then loads after the output has left)."""
    if hvp == block_k:
        return "p"
    own = forward_scratch(hp, hvp, block_k, stages, dtype, bias_dtype, staging="o",
                          consumers=consumers, has_mask=has_mask)
    return "o" if own.bytes <= budget or hvp != hp else "q"


def forward_scratch(hp: int, hvp: int, block_k: int, stages: int, dtype: Any,
                    bias_dtype: Any = None, *, staging: str | None = None,
                    consumers: int = CONSUMERS, has_mask: bool = False,
                    dropout: bool = False, p_buffer: bool = False) -> Scratch:
    """The forward: per consumer its Q rows, output (with staging "o"; else staged in
    P's or Q's buffer, `forward_output_staging`; None: in P's where the shapes agree)
    and P where it stages the output or p_buffer asks for it (the interpreter's wgmma
    reads P from there; on the GPU it comes from registers, so the routing table counts
    no such buffer); the K/V ring, with a mask each consumer's mask rows (int8) per
    slot; with a bias each consumer's bias tile; with dropout each consumer's hash
    table. Barriers: Q per consumer, loaded (K: and the mask rows) and consumed per slot
    for K and V, two consumers' turns, the bias buffers'."""
    rows, c = ROWS_PER_CONSUMER, consumers
    dtype = _name(dtype)
    staging = staging or ("p" if hvp == block_k else "o")
    swizzle = forward_swizzle(hp, hvp, block_k)
    return Scratch(
        buffers=(("q", Buffer((c, rows, hp), dtype, swizzle)),
                 ("o", Buffer((c, rows, hvp), dtype, swizzle) if staging == "o" else None),
                 ("k", Buffer((stages, block_k, hp), dtype, swizzle)),
                 ("v", Buffer((stages, block_k, hvp), dtype, swizzle)),
                 ("p", Buffer((c, rows, block_k), dtype, swizzle)
                  if p_buffer or staging == "p" else None),
                 ("bias", None if bias_dtype is None
                  else Buffer((c, rows, block_k), _name(bias_dtype))),
                 ("mask", Buffer((stages, c, rows, block_k), MASK_DTYPE, swizzle=block_k)
                  if has_mask else None),
                 ("hashes", _hash_tables(c, dropout))),
        barriers=(("q_loaded", Barriers(c)),
                  ("k_loaded", Barriers(stages, 1 + (c if has_mask else 0))),
                  ("v_loaded", Barriers(stages)),
                  ("k_consumed", Barriers(stages, c)),
                  ("v_consumed", Barriers(stages, c)),
                  # The interpreter's turns (the GPU's are named barriers, common.Turns).
                  ("schedule", Barriers(2) if c == 2 else None),
                  ("bias_loaded", None if bias_dtype is None else Barriers(c))))


def dq_scratch(hp: int, hvp: int, block_k: int, stages: int, consumers: int, dtype: Any,
               bias_dtype: Any = None, dbias: bool = False, has_mask: bool = False,
               stats_rows: int | None = None, dropout: bool = False) -> Scratch:
    """The dQ kernel: per consumer its rows' Q, dO, stats_rows float32 row residuals
    (`common.row_residuals`: three, four with float16 dS's row scales; by default as
    many as float16 may need), dS and
    bias tile, or (`is_wide`) one item's rows, two dS tiles that both consumers fill and a
    bias tile of each consumer's keys; the K/V ring; with dbias (batch entry 0's tiles)
    a zeroed tile; with a mask each consumer's mask rows (int8; wide: of its keys) per
    slot; with dropout
    each consumer's hash table. Barriers: rows per consumer (wide: per item), loaded (K:
    and the mask rows) and consumed per slot for K and V, the turns of two consumers
    (wide: their exchange), the bias buffers'."""
    rows, c = ROWS_PER_CONSUMER, consumers
    split = is_wide(hp, hvp)
    if stats_rows is None:
        stats_rows = 4 if _name(dtype) == "float16" else 3
    swizzle = operand_swizzle(hp, hvp)
    owners = 1 if split else c  # the rows' buffers
    keys = block_k // c if split else block_k  # each consumer's keys of a tile
    dtype = _name(dtype)
    return Scratch(
        buffers=(("q", Buffer((owners, rows, hp), dtype, swizzle)),
                 ("do", Buffer((owners, rows, hvp), dtype, swizzle)),
                 ("stats", Buffer((owners, stats_rows, rows), "float32", swizzle=0)),
                 ("k", Buffer((stages, block_k, hp), dtype, swizzle)),
                 ("v", Buffer((stages, block_k, hvp), dtype, swizzle)),
                 ("ds", Buffer((2, rows, block_k) if split else (c, rows, block_k), dtype,
                               swizzle)),
                 ("bias", None if bias_dtype is None
                  else Buffer((c, rows, keys), _name(bias_dtype), swizzle)),
                 ("zeros", Buffer((rows, block_k), dtype, swizzle) if dbias else None),
                 ("mask", Buffer((stages, c, rows, keys), MASK_DTYPE, swizzle=keys)
                  if has_mask else None),
                 ("hashes", _hash_tables(c, dropout))),
        barriers=(("rows_loaded", Barriers(owners, 3)),  # Q, dO, residuals
                  ("k_loaded", Barriers(stages, 1 + (c if has_mask else 0))),
                  ("v_loaded", Barriers(stages)),
                  ("k_consumed", Barriers(stages, c)),
                  ("v_consumed", Barriers(stages, c)),
                  ("schedule", Barriers(1, 2) if c == 2 and not split else None),
                  ("exchange", Barriers(1, c) if split else None),
                  ("bias_loaded", None if bias_dtype is None else Barriers(c))))


def dkv_scratch(hp: int, hvp: int, stages: int, dtype: Any, bias_dtype: Any = None,
                zeros: bool = False, has_mask: bool = False, ones: bool = False,
                dropout: bool = False) -> Scratch:
    """The dK/dV kernel: per slot Q, dO, the three float32 row residuals and the bias
    tile and mask tile (int8; not wide) of each consumer; the K and V of each consumer's keys;
    per consumer P and two dS buffers, or (`is_wide`) two P and two dS tiles of the
    unit's keys that both consumers fill; the zeroed dbias tile; each consumer's tile of
    ones (dS's column sums, `key_sums`); with dropout each consumer's hash table.
    Barriers: loaded and consumed per slot, K/V's two, and the wide consumers'
    exchange."""
    rows, unit = dkv_tiles(hp, hvp)
    wide = is_wide(hp, hvp)
    c = CONSUMERS
    keys = unit // c  # each consumer's keys of S and dP
    swizzle = operand_swizzle(hp, hvp)
    dtype = _name(dtype)
    # Wide, no room is left for mask tiles: the consumers read theirs from global memory.
    has_mask = has_mask and not wide
    # Q, dO, residuals, bias and mask tiles
    copies = 3 + (c if bias_dtype is not None else 0) + (c if has_mask else 0)
    tiles = (rows, unit) if wide else (c, rows, keys)  # P and dS: shared or per consumer
    return Scratch(
        buffers=(("q", Buffer((stages, rows, hp), dtype, swizzle)),
                 ("do", Buffer((stages, rows, hvp), dtype, swizzle)),
                 ("stats", Buffer((stages, 3, rows), "float32", swizzle=0)),
                 ("bias", None if bias_dtype is None
                  else Buffer((stages, c, rows, keys), _name(bias_dtype), swizzle)),
                 ("mask", Buffer((stages, c, rows, keys), MASK_DTYPE, swizzle=keys)
                  if has_mask else None),
                 ("k", Buffer((c, keys, hp), dtype, swizzle)),
                 ("v", Buffer((c, keys, hvp), dtype, swizzle)),
                 ("p", Buffer((2, *tiles) if wide else tiles, dtype, swizzle)),
                 ("ds", Buffer((2, *tiles) if wide else (c, 2, rows, keys), dtype, swizzle)),
                 ("zeros", Buffer((rows, unit if wide else keys), dtype, swizzle)
                  if zeros else None),
                 # Columns by rows, as K's tiles (read transposed, in dS's swizzle); whole
                 # wgmma tiles of rows, as registers store them, of which the first
                 # ONES_COLUMNS are read.
                 ("ones", Buffer((c, rows, rows), dtype, swizzle) if ones else None),
                 ("hashes", _hash_tables(c, dropout))),
        barriers=(("step_loaded", Barriers(stages, copies)),
                  ("step_consumed", Barriers(stages, c)),
                  ("kv_loaded", Barriers(1, 2 * c)),  # K and V of each consumer
                  ("kv_consumed", Barriers(1, c)),
                  ("exchange", Barriers(1, c) if wide else None)))


def dbias_scratch(hp: int, hvp: int, block_k: int, stages: int, dtype: Any,
                  bias_dtype: Any) -> Scratch:
    """The dbias kernel: Q and K in `stages` slots, dO, V and the float32 row residuals
    in as many; each consumer's bias buffer. Barriers: loaded and consumed per slot of
    each ring, the bias buffers'."""
    rows, c = ROWS_PER_CONSUMER, CONSUMERS
    dtype = _name(dtype)
    return Scratch(
        buffers=(("q", Buffer((stages, c, rows, hp), dtype)),
                 ("k", Buffer((stages, block_k, hp), dtype)),
                 ("do", Buffer((stages, c, rows, hvp), dtype)),
                 ("v", Buffer((stages, block_k, hvp), dtype)),
                 ("stats", Buffer((stages, c, 3, rows), "float32", swizzle=0)),
                 ("bias", Buffer((c, rows, block_k), _name(bias_dtype)))),
        barriers=(("qk_loaded", Barriers(stages, c + 1)),  # Q halves, K
                  ("qk_consumed", Barriers(stages, c)),
                  ("dov_loaded", Barriers(stages, 2 * c + 1)),  # dO and residual halves, V
                  ("dov_consumed", Barriers(stages, c)),
                  ("bias_loaded", Barriers(c))))


def forward_consumers(hp: int, hvp: int, block_k: int, stages: int, dtype: Any, *,
                      bias_dtype: Any, budget: int, has_mask: bool = False) -> int:
    """Consumer warpgroups of the forward: 3 (items of 192 query rows, no turns) where a
    consumer's output accumulator and score tile fit its smaller share of the registers
    (`FORWARD_THREE_REGISTERS`), without a bias (its tile would not) and where the
    buffers fit; else 2 (items of 128 rows that take turns on the tensor cores)."""
    # Per thread: a 64-row float32 tile of N columns holds N / 2 registers, P N / 4.
    held = hvp // 2 + block_k // 2 + block_k // 4
    if bias_dtype is not None or held > FORWARD_THREE_REGISTERS:
        return 2
    staging = forward_output_staging(hp, hvp, block_k, stages, dtype, None, budget, 3,
                                     has_mask)
    three = forward_scratch(hp, hvp, block_k, stages, dtype, staging=staging, consumers=3,
                            has_mask=has_mask)
    return 3 if three.bytes <= budget else 2


def dq_consumers(hp: int, hvp: int, block_k: int, stages: int, dtype: Any, *,
                 bias_dtype: Any, has_window: bool, budget: int, has_mask: bool = False,
                 has_segments: bool = False) -> int:
    """Consumer warpgroups of the dQ kernel: 3 (work items of 192 query rows, no turns)
    without a bias or a local window where their buffers fit, else 2 (items of 128 rows
    that take turns on the tensor cores; `is_wide`: items of 64 rows that both share). With
    a bias three were slower (registers: each consumer also holds its bias tile), with a
    window too, with a mask above head dim 64 (docs/decisions.md, "Three dQ consumers",
    "A boolean mask in the Mosaic kernels"); with segment ids, items of 192 rows straddle
    documents of a power of two and stream both documents' keys."""
    if (bias_dtype is not None or has_window or is_wide(hp, hvp) or (has_mask and hp > 64)
            or has_segments):
        return 2
    three = dq_scratch(hp, hvp, block_k, stages, 3, dtype, has_mask=has_mask).bytes
    return 3 if three <= budget else 2
