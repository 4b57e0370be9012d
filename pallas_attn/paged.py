"""Paged KV cache (inference): new tokens attend to a cache stored in pages.

A cache of P pages of `page_size` tokens (key_cache [P, page_size, K, H],
value_cache [P, page_size, K, Hv]) holds every sequence's keys and values in the
pages its row of the page table names, in any order. Sequence b holds
cache_lengths[b] tokens, its T new ones included (their K/V already written, by
`paged_cache_update`); its query t sits at position cache_lengths[b] - T + t and sees
the cached keys at positions up to its own (and inside the window, if given). The
result equals dot_product_attention on the gathered cache with that mask.

On an NVIDIA GPU the decode kernel reads the pages in place (a key tile lies in one
page); elsewhere, or for more query rows than its tile holds, the reference runs on
the gathered cache, each sequence at its own positions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn import dispatch, sharding
from pallas_attn.plan import BlockSizes
from pallas_attn.spec import Operands, check_bool, check_concrete_range, normalize

IMPLEMENTATIONS = ("pallas", "xla", "xla_chunked")


def paged_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    page_table: jax.Array,
    cache_lengths: jax.Array,
    *,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    alibi_slopes: jax.Array | None = None,
    sinks: jax.Array | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of T new tokens per sequence against a paged KV cache (forward only).

    Args:
      query: [B, T, N, H], the new tokens' queries.
      key_cache: [P, page_size, K, H]; value_cache: [P, page_size, K, Hv].
      page_table: int [B, pages_per_seq]: the pages of each sequence, in order.
      cache_lengths: int [B]: tokens cached per sequence, the T new ones included.
      scale, logits_soft_cap, local_window_size, alibi_slopes, sinks: as in
        dot_product_attention (ALiBi and the window count cache positions).
      return_residual: also return the logsumexp [B, T, N].
      implementation: None (the decode kernel on an NVIDIA GPU where it applies;
        elsewhere the blockwise path from T x capacity >= 2**20, below it the
        reference), "pallas", "xla" or "xla_chunked".
      interpret: run the kernel in the Pallas interpreter.

    Returns out [B, T, N, Hv] (and the logsumexp). A query whose position is below 0
    (a sequence shorter than T) sees no key: output 0, logsumexp -inf.

    Out-of-range page numbers or lengths beyond the page table raise a ValueError when
    they are concrete; under jit they are the caller's contract (the kernel reads
    whatever page the table names). Not differentiable.
    """
    return_residual = check_bool("return_residual", return_residual)
    interpret = check_bool("interpret", interpret)
    sharding.check_interpretable(interpret)
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if interpret and implementation not in (None, "pallas"):
        raise ValueError(f"interpret applies to implementation='pallas' (or None), got "
                         f"{implementation!r}")
    q_shape, k_shape, v_shape = (tuple(np.shape(x)) for x in (query, key_cache, value_cache))
    if len(q_shape) != 4:
        raise ValueError(f"query must be [B, T, N, H], got shape {q_shape}")
    _check_caches(k_shape, v_shape)
    B, T, N, H = q_shape
    P, page_size, K, Hk = k_shape
    if Hk != H:
        raise ValueError(f"key_cache's head dim {Hk} differs from query's {H}")
    dtypes = tuple(jnp.result_type(x) for x in (query, key_cache, value_cache))
    if len(set(dtypes)) > 1:
        raise ValueError(f"query, key_cache and value_cache must share one dtype, got "
                         f"{', '.join(map(str, dtypes))}")
    table, lengths = _table_and_lengths(page_table, cache_lengths, P, page_size)
    if table.shape[0] != B or lengths.shape != (B,):
        raise ValueError(f"page_table must be [B, pages_per_seq] and cache_lengths [B] with "
                         f"B = {B}, got {table.shape} and {lengths.shape}")
    capacity = table.shape[1] * page_size
    if B == 0 or T == 0:  # no query row: nothing to read
        out = jnp.zeros((B, T, N, v_shape[3]), query.dtype)
        lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
        return (out, lse) if return_residual else out
    # The spec and operands of the equivalent call on the gathered cache.
    gathered = jax.ShapeDtypeStruct((B, capacity, K, H), key_cache.dtype)
    gathered_v = jax.ShapeDtypeStruct((B, capacity, K, v_shape[3]), value_cache.dtype)
    normalized = {}

    def trace(q, k, v, lengths):
        normalized["spec"], _, _ = normalize(
            q, k, v, scale=scale, is_causal=True, logits_soft_cap=logits_soft_cap,
            local_window_size=local_window_size, alibi_slopes=alibi_slopes,
            key_value_seq_lengths=lengths, sinks=sinks)

    jax.eval_shape(trace, query, gathered, gathered_v, lengths)
    implementation = dispatch.paged_implementation(
        implementation, interpret, dispatch.paged_kernel_refusal(H, v_shape[3]), T, capacity)
    run = _kernel if implementation == "pallas" else _reference
    extra = {name: x for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks))
             if x is not None}
    out, lse = _forward_only(run, normalized["spec"], implementation, interpret, query,
                             key_cache, value_cache, table, lengths, extra)
    lse = jnp.swapaxes(lse, 1, 2)
    return (out, lse) if return_residual else out


def _forward_only(run, spec, implementation, interpret, q, k_cache, v_cache, table, lengths,
                  extra):
    @jax.custom_jvp
    def call(q, k_cache, v_cache, table, lengths, extra):
        return run(spec, implementation, interpret, q, k_cache, v_cache, table, lengths, extra)

    @call.defjvp
    def _no_derivative(primals, tangents):
        raise NotImplementedError("paged_attention is forward only (inference); train with "
                                  "dot_product_attention on contiguous keys and values")

    return call(q, k_cache, v_cache, table, lengths, extra)


def _reference(spec, implementation, interpret, q, k_cache, v_cache, table, lengths, extra):
    """Each sequence at its own positions (the origin), on its gathered pages."""
    from pallas_attn.semantics import chunked, reference

    B, T, N, _ = q.shape
    k = k_cache[table].reshape(B, -1, *k_cache.shape[2:])
    v = v_cache[table].reshape(B, -1, *v_cache.shape[2:])
    slopes = extra.get("alibi_slopes")
    slopes = None if slopes is None else jnp.broadcast_to(
        jnp.asarray(slopes, jnp.float32).reshape(-1, N), (B, N))
    sinks = extra.get("sinks")
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    attend = chunked.attention if implementation == "xla_chunked" else reference.attention

    def one(q, k, v, length, slope):
        ops = Operands(q[None], k[None], v[None], key_value_seq_lengths=length[None],
                       alibi_slopes=None if slope is None else slope[None],
                       origin=jnp.stack([length - T, 0]).astype(jnp.int32), sinks=sinks)
        out, lse = attend(spec, ops)
        return out[0], lse[0]

    return jax.vmap(one)(q, k, v, lengths, slopes)


def _kernel(spec, implementation, interpret, q, k_cache, v_cache, table, lengths, extra):
    """The decode kernel reading the pages in place."""
    from pallas_attn.kernels import pad_axis
    from pallas_attn.kernels.core import Problem
    from pallas_attn.kernels.triton import decode

    B, T, N, H = q.shape
    page_size, K, Hv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    if why := dispatch.paged_kernel_refusal(H, Hv):
        raise ValueError(f"{why}; use implementation='xla'")
    present = ("key_value_seq_lengths", *extra)
    call = dispatch.Call(spec, B, T, table.shape[1] * page_size, N, K, H, Hv,
                         jnp.dtype(q.dtype).name, present=present)
    plan = dispatch.plan(call, block_sizes=BlockSizes(forward_backend="decode"),
                         interpret=interpret)
    problem = Problem(spec=spec, batch=B, num_heads=N, num_kv_heads=K, q_len=T,
                      kv_len=call.kv_len, q_pad=T, kv_pad=call.kv_len, head_dim=H,
                      value_head_dim=Hv, dtype=call.dtype, plan=plan,
                      present=(*present, "page_table"), interpret=interpret)
    operands = {"key_value_seq_lengths": lengths, "page_table": table}
    if "alibi_slopes" in extra:
        operands["alibi_slopes"] = jnp.broadcast_to(
            jnp.asarray(extra["alibi_slopes"], jnp.float32).reshape(-1, N), (B, N))
    if "sinks" in extra:
        operands["sinks"] = jnp.asarray(extra["sinks"], jnp.float32)
    q = pad_axis(q, 3, plan.head_dims[0])  # the pages stay as stored
    out, row_stats = decode.forward(problem, q, k_cache, v_cache, operands)
    lse = problem.logsumexp(*row_stats)
    return out[..., :Hv], jnp.where(lse == jnp.inf, -jnp.inf, lse)


def paged_cache_update(key_cache: jax.Array, value_cache: jax.Array, new_keys: jax.Array,
                       new_values: jax.Array, page_table: jax.Array,
                       cache_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes T new tokens per sequence into their pages: (key_cache, value_cache).

    new_keys [B, T, K, H], new_values [B, T, K, Hv]; cache_lengths [B] counts the new
    tokens too (as paged_attention takes it), so token t of sequence b goes to position
    cache_lengths[b] - T + t. Tokens at negative positions are dropped.
    """
    k_shape, v_shape = tuple(np.shape(key_cache)), tuple(np.shape(value_cache))
    _check_caches(k_shape, v_shape)
    key_cache, value_cache = jnp.asarray(key_cache), jnp.asarray(value_cache)
    table, lengths = _table_and_lengths(page_table, cache_lengths, *k_shape[:2])
    B = table.shape[0]
    for name, x, dims, head_dim in (("new_keys", new_keys, "H", k_shape[3]),
                                    ("new_values", new_values, "Hv", v_shape[3])):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(f"{name} must have a floating dtype, got {jnp.result_type(x)}")
        shape = tuple(np.shape(x))
        if len(shape) != 4 or shape[0] != B or shape[2:] != (k_shape[2], head_dim):
            raise ValueError(f"{name} must be [B, T, K, {dims}] = [{B}, T, {k_shape[2]}, "
                             f"{head_dim}] (the page table's rows, the cache's heads and head "
                             f"dim), got shape {shape}")
    T = np.shape(new_keys)[1]
    if np.shape(new_values)[1] != T:
        raise ValueError(f"new_keys and new_values must hold the same tokens, got shapes "
                         f"{np.shape(new_keys)} and {np.shape(new_values)}")
    if lengths.shape != (B,):
        raise ValueError(f"cache_lengths must be [B] with B = {B} (the page table's rows), "
                         f"got shape {lengths.shape}")
    page_size = k_shape[1]
    positions = lengths[:, None] - T + jnp.arange(T)[None, :]
    keep = positions >= 0
    safe = jnp.where(keep, positions, 0)
    pages = jnp.take_along_axis(table, safe // page_size, axis=1)
    # Dropped tokens write out of bounds, where scatter's mode="drop" ignores them.
    pages = jnp.where(keep, pages, key_cache.shape[0])
    slots = safe % page_size
    key_cache = key_cache.at[pages, slots].set(new_keys.astype(key_cache.dtype), mode="drop")
    value_cache = value_cache.at[pages, slots].set(new_values.astype(value_cache.dtype),
                                                   mode="drop")
    return key_cache, value_cache


def _check_caches(k_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> None:
    if len(k_shape) != 4 or len(v_shape) != 4 or k_shape[:3] != v_shape[:3]:
        raise ValueError(f"key_cache and value_cache must be [P, page_size, K, H] and "
                         f"[P, page_size, K, Hv], got {k_shape} and {v_shape}")
    if k_shape[1] < 1:
        raise ValueError(f"key_cache's pages must hold at least one token, got page_size "
                         f"{k_shape[1]} (key_cache {k_shape})")


def _table_and_lengths(page_table: Any, cache_lengths: Any, pages: int, page_size: int
                       ) -> tuple[jax.Array, jax.Array]:
    """The page table and cache lengths as int32, their concrete values checked first
    (page numbers below `pages`, lengths up to the table's tokens): a wider integer
    converted first could wrap into range."""
    for name, x, ndim in (("page_table", page_table, 2), ("cache_lengths", cache_lengths, 1)):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {type(x).__name__} "
                            f"{getattr(x, 'dtype', '')}")
        if np.ndim(x) != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {np.shape(x)}")
    per_sequence = np.shape(page_table)[1]
    if per_sequence < 1:
        raise ValueError(f"page_table must name at least one page per sequence, got shape "
                         f"{np.shape(page_table)}")
    check_concrete_range("page_table", page_table, 0, pages - 1)
    check_concrete_range("cache_lengths", cache_lengths, 0, per_sequence * page_size)
    return jnp.asarray(page_table, jnp.int32), jnp.asarray(cache_lengths, jnp.int32)
