"""Numerics check and speed benchmark (`python -m pallas_attn check|bench`).

On an NVIDIA GPU: `check` runs the kernels against the reference at realistic
sizes; `bench` times forward and forward+backward next to jax.nn's cudnn and xla
implementations, in one process on the same inputs, and prints TFLOP/s counted
as FlashAttention does (forward 4*B*N*T*S*H, halved for causal; backward 2.5x
forward; with values of their own head dim each product at its dims). On a CPU both
run the kernels in the Pallas interpreter at small sizes against the reference,
clearly labelled as such.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_attn
from pallas_attn import spec as spec_lib
from pallas_attn.semantics import reference
from pallas_attn.tuning import autotune


def on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = False
    features: tuple[tuple[str, Any], ...] = ()
    dtype: str = "bfloat16"

    @property
    def label(self) -> str:
        # Rows of documents, pages and shown keys name their count / size: several per set.
        counted = ("packed", "paged", "mask_documents", "mask_prefix", "value_dim")
        extra = "".join(f" {k}{v}" if k in counted else f" {k}" for k, v in self.features)
        gqa = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return (f"B{self.batch} T{self.q_len} S{self.kv_len} N{self.heads}{gqa} "
                f"H{self.head_dim}{' causal' if self.causal else ''}{extra}")

    @property
    def value_head_dim(self) -> int:
        """The values' head dim: the feature value_dim, else head_dim."""
        return int(dict(self.features).get("value_dim", self.head_dim))

    def forward_flops(self) -> float:
        """2*B*N*T*S*(H + Hv) (4*B*N*T*S*H where they agree), halved for causal; a window
        counts only the keys in its band."""
        dims = self.head_dim + self.value_head_dim
        window = dict(self.features).get("window")
        if window is not None:
            keys = min(self.kv_len, window + 1 + (0 if self.causal else window))
            return 2.0 * self.batch * self.heads * self.q_len * keys * dims
        flops = 2.0 * self.batch * self.heads * self.q_len * self.kv_len * dims
        return flops / 2 if self.causal else flops

    def fwdbwd_flops(self) -> float:
        """The forward's and the backward's products: S, P V; S, dP, dV, dK, dQ (three at
        the queries' head dim, two at the values'): 3.5 x the forward where they agree."""
        h, hv = self.head_dim, self.value_head_dim
        return self.forward_flops() * (4 * h + 3 * hv) / (h + hv)


def make_inputs(shape: Shape, seed: int = 0) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(seed), 8)
    dtype = jnp.dtype(shape.dtype)
    B, T, S, N, K, H = (shape.batch, shape.q_len, shape.kv_len, shape.heads, shape.kv_heads,
                        shape.head_dim)
    Hv = shape.value_head_dim
    args = dict(
        query=jax.random.normal(keys[0], (B, T, N, H), dtype),
        key=jax.random.normal(keys[1], (B, S, K, H), dtype),
        value=jax.random.normal(keys[2], (B, S, K, Hv), dtype),
        cotangent=jax.random.normal(keys[3], (B, T, N, Hv), dtype),
        kwargs=dict(is_causal=shape.causal),
    )
    for name, value in shape.features:
        if name in ("bias", "bias_per_batch", "bias_float32"):  # [1 or B, N, T, S]
            rows = B if name == "bias_per_batch" else 1
            bias_dtype = jnp.float32 if name == "bias_float32" else dtype  # whatever q's
            args["kwargs"]["bias"] = jax.random.normal(keys[4], (rows, N, T, S), bias_dtype)
        elif name == "bias_per_key":  # [B, N, 1, S]
            args["kwargs"]["bias"] = jax.random.normal(keys[4], (B, N, 1, S), dtype)
        elif name == "mask_per_key":  # [B, 1, 1, S]: a key padding mask, 1/8 hidden
            args["kwargs"]["mask"] = jax.random.bernoulli(keys[6], 0.875, (B, 1, 1, S))
        elif name == "bias_per_row":  # [B, N, T, 1]: broadcast along keys
            args["kwargs"]["bias"] = jax.random.normal(keys[4], (B, N, T, 1), dtype)
        elif name == "mask_per_row":  # [B, 1, T, 1]: a query padding mask, 1/8 hidden
            args["kwargs"]["mask"] = jax.random.bernoulli(keys[6], 0.875, (B, 1, T, 1))
        elif name == "mask_prefix":  # [B, 1, 1, S]: the first `value` keys shown
            args["kwargs"]["mask"] = jnp.broadcast_to(jnp.arange(S) < int(value), (B, 1, 1, S))
        elif name == "bias_shared_by_heads":  # [B, 1, T, S]
            args["kwargs"]["bias"] = jax.random.normal(keys[4], (B, 1, T, S), dtype)
        elif name == "window":
            args["kwargs"]["local_window_size"] = (value, 0 if shape.causal else value)
        elif name == "alibi":
            args["kwargs"]["alibi_slopes"] = 2.0 ** (-8.0 * jnp.arange(1, N + 1) / N)
        elif name == "softcap":
            args["kwargs"]["logits_soft_cap"] = float(value)
        elif name == "dropout":
            args["kwargs"]["dropout_rate"] = float(value)
            args["kwargs"]["dropout_rng"] = keys[5]
        elif name == "mask":
            args["kwargs"]["mask"] = jax.random.bernoulli(keys[6], 0.9, (B, 1, T, S))
        elif name == "lengths":  # every sequence's keys valid up to kv_len - value
            args["kwargs"]["key_value_seq_lengths"] = jnp.full((B,), S - int(value), jnp.int32)
        elif name == "qlengths":  # batch entry b's queries valid up to q_len - value (b+1)/B
            args["kwargs"]["query_seq_lengths"] = jnp.array(
                [max(0, T - int(value) * (b + 1) // B) for b in range(B)], jnp.int32)
        elif name == "packed":  # `value` documents of equal length in every row
            ids = jnp.arange(T, dtype=jnp.int32) // (T // int(value))
            args["kwargs"]["q_segment_ids"] = jnp.broadcast_to(ids, (B, T))
        elif name == "mask_documents":  # `value` documents as a block-diagonal mask
            doc = jnp.arange(T) // (T // int(value))
            args["kwargs"]["mask"] = jnp.broadcast_to(doc[:, None] == doc[None, :],
                                                      (B, 1, T, S))
        elif name == "sinks":
            args["kwargs"]["sinks"] = jnp.linspace(-1.0, 2.0, N, dtype=jnp.float32)
        elif name in ("paged", "value_dim"):  # read by decode_benchmark; by the shapes above
            pass
        elif name == "causal_bottom_right":
            args["kwargs"]["is_causal"] = True
            args["kwargs"]["causal_alignment"] = "bottom_right"
        elif name == "segments":
            ids = jnp.cumsum(jax.random.bernoulli(keys[7], 4.0 / T, (B, T)), axis=1)
            args["kwargs"]["q_segment_ids"] = ids.astype(jnp.int32)
        else:
            raise ValueError(f"unknown benchmark feature {name!r}")
    return args


def _loss_and_grad(fn: Callable[..., jax.Array], args: dict[str, Any]):
    """jit(grad of sum(out * ct)) as a function of (q, k, v, bias, ct); the other arrays
    (a mask, segment ids, ...) are arguments of the compiled step too: nothing large is
    closed over."""
    kwargs = args["kwargs"]
    has_bias = "bias" in kwargs
    arrays = {x: y for x, y in kwargs.items() if isinstance(y, jax.Array) and x != "bias"}
    static = {x: y for x, y in kwargs.items() if x not in arrays and x != "bias"}

    def loss(q, k, v, bias, ct, arrays):
        out = fn(q, k, v, **arrays, **(dict(static, bias=bias) if has_bias else static))
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    argnums = (0, 1, 2, 3) if has_bias else (0, 1, 2)
    step = jax.jit(jax.grad(loss, argnums=argnums))
    return functools.partial(step, arrays=arrays)


def _memory_gib(step: functools.partial, *args: Any) -> tuple[float, float]:
    """(all, scratch) GiB of the compiled step: its arguments, outputs and temporaries,
    and the temporaries alone (what it allocates beyond what goes in and comes out)."""
    memory = step.func.lower(*args, **step.keywords).compile().memory_analysis()
    scratch = memory.temp_size_in_bytes
    return ((memory.argument_size_in_bytes + memory.output_size_in_bytes + scratch) / 2**30,
            scratch / 2**30)


IMPLEMENTATIONS = ("pallas_attn", "jax.nn cudnn", "jax.nn xla", "jax mgpu")


def _jax_mosaic_gpu(q, k, v, *, is_causal: bool = False, **unsupported):
    """JAX's own Pallas Mosaic GPU attention (sm90; `attention_mgpu`): float16 only, no
    feature but causal masking, no causal backward. It applies no softmax scale, so the
    scale is folded into q here (timed with it): without it the nearly one-hot softmax
    leaves P mostly zero and the tensor cores draw less power, faster by 3-7% on an H200
    (docs/decisions.md, "JAX's Mosaic GPU attention as a peer")."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    if unsupported:
        raise NotImplementedError(f"takes no {', '.join(sorted(unsupported))}")
    head_dim = q.shape[-1]
    # 64-key tiles at 256 (two slots of 128 do not fit); the backward's best of four
    # tilings at d128 (H200).
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128 if head_dim <= 128 else 64, max_concurrent_steps=2,
        causal=is_causal, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
        compute_wgs_bwd=2)
    return attention_mgpu.attention((q * head_dim ** -0.5).astype(q.dtype), k, v, config)


def implementations(interpret: bool) -> dict[str, Callable[..., jax.Array]]:
    impls: dict[str, Callable[..., jax.Array]] = {
        "pallas_attn": lambda q, k, v, **kw: pallas_attn.dot_product_attention(
            q, k, v, implementation="pallas", interpret=interpret, **kw)}
    if on_gpu():
        impls["jax.nn cudnn"] = lambda q, k, v, **kw: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn", **kw)
        impls["jax.nn xla"] = lambda q, k, v, **kw: jax.nn.dot_product_attention(
            q, k, v, implementation="xla", **kw)
        impls["jax mgpu"] = _jax_mosaic_gpu
    return impls


def benchmark(shapes: Sequence[Shape], *, interpret: bool = False,
              log: Callable[[str], None] = print, only: Sequence[str] | None = None,
              memory: bool = False, rounds: int = 1) -> list[dict[str, Any]]:
    """Rows of timings per shape and implementation (only: names of IMPLEMENTATIONS);
    memory: with the fwd+bwd program's memory (`_memory_gib`). rounds: each time is the
    best of that many, the implementations taking turns within every round of a shape
    (a time read right after another implementation's on a hot card can read a few
    percent slow: one round is what the tables ran before)."""
    _check_rounds(rounds)
    rows = []
    for shape in shapes:
        args = make_inputs(shape)
        q, k, v = args["query"], args["key"], args["value"]
        kwargs = args["kwargs"]
        arrays = {x: y for x, y in kwargs.items() if isinstance(y, jax.Array)}
        static = {x: y for x, y in kwargs.items() if x not in arrays}
        grad_args = (q, k, v, kwargs.get("bias"), args["cotangent"])
        runs = []
        for name, fn in implementations(interpret).items():
            if only is None or name in only:
                fwd = jax.jit(lambda q, k, v, arrays, fn=fn, static=static: fn(
                    q, k, v, **arrays, **static))
                runs.append(({"shape": shape.label, "impl": name}, fwd,
                             _loss_and_grad(fn, args)))
        for _ in range(rounds):
            for row, fwd, grad in runs:
                if "error" in row:
                    continue
                try:
                    _keep_best(row, "fwd_ms", autotune.time_call(
                        functools.partial(fwd, q, k, v, arrays)))
                    _keep_best(row, "fwdbwd_ms", autotune.time_call(
                        functools.partial(grad, *grad_args)))
                except Exception as e:  # noqa: BLE001 - peers may not support a shape
                    row["error"] = _error_text(e)
        for row, _, grad in runs:
            if "fwd_ms" in row:
                row["fwd_tflops"] = shape.forward_flops() / row["fwd_ms"] / 1e9
            if "fwdbwd_ms" in row:
                row["fwdbwd_tflops"] = shape.fwdbwd_flops() / row["fwdbwd_ms"] / 1e9
            if memory and "fwdbwd_ms" in row:
                try:
                    row["fwdbwd_gib"], row["fwdbwd_scratch_gib"] = _memory_gib(grad, *grad_args)
                except Exception as e:  # noqa: BLE001 - the timing stands without it
                    row["memory_error"] = _error_text(e)
            rows.append(row)
            log(json.dumps(row))
    return rows


def _error_text(e: Exception) -> str:
    """A failed row's note: the exception's type and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


def _check_rounds(rounds: int) -> None:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")


def _keep_best(row: dict[str, Any], key: str, seconds: float) -> None:
    """row[key] (milliseconds): the least of its rounds so far."""
    row[key] = min(row.get(key, float("inf")), seconds * 1e3)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of `benchmark`'s rows; with their memory where they measured it
    (the fwd+bwd program's GiB in all, and of scratch)."""
    memory = any("fwdbwd_gib" in row for row in rows)
    lines = ["| shape | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |"
             + (" fwd+bwd GiB | of it scratch GiB |" if memory else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if memory else "")]
    blank = " | |" if memory else ""
    for row in rows:
        if "error" in row and "fwd_ms" in row:  # the forward ran, its gradient failed
            lines.append(f"| {row['shape']} | {row['impl']} | {row['fwd_ms']:.3f} | "
                         f"{row['fwd_tflops']:.0f} | fails: {row['error']} | |{blank}")
            continue
        if "error" in row:
            lines.append(f"| {row['shape']} | {row['impl']} | fails: {row['error']} | | | |"
                         + blank)
            continue
        sizes = ("" if not memory else " - | - |" if "fwdbwd_gib" not in row else
                 f" {row['fwdbwd_gib']:.2f} | {row['fwdbwd_scratch_gib']:.3f} |")
        lines.append(
            f"| {row['shape']} | {row['impl']} | {row['fwd_ms']:.3f} | {row['fwd_tflops']:.0f} | "
            f"{row['fwdbwd_ms']:.3f} | {row['fwdbwd_tflops']:.0f} |{sizes}")
    return "\n".join(lines)


def relative_error(x: jax.Array, ref: jax.Array) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    finite = np.isfinite(ref)
    if not np.array_equal(finite, np.isfinite(x)):
        return math.inf
    x, ref = np.where(finite, x, 0.0), np.where(finite, ref, 0.0)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, jax.Array], tuple]:
    """(the array arguments, the other arguments as sorted items) of kwargs."""
    arrays = {x: y for x, y in kwargs.items() if isinstance(y, jax.Array)}
    return arrays, tuple(sorted((x, y) for x, y in kwargs.items() if x not in arrays))


@functools.lru_cache(maxsize=4)
def _program(fn: Callable[..., Any], static: tuple, grads: bool) -> Callable[..., Any]:
    """fn jitted with its arrays as arguments: [out, lse], with grads also the gradients of
    sum(out * ct) for q, k, v (and the bias), less sum(lse_ct * lse) where an lse
    cotangent is given. One compile serves every call of a shape: check's clean run, its
    second call and its run with hidden keys NaN."""
    def outputs(q, k, v, ct, arrays, lse_ct=None):
        rest = {x: y for x, y in arrays.items() if x != "bias"}

        def forward(q, k, v, bias):
            return fn(q, k, v, bias=bias, return_residual=True, **rest, **dict(static))

        def loss(q, k, v, bias):
            out, lse = forward(q, k, v, bias)
            total = jnp.sum(out.astype(jnp.float32) * ct)
            if lse_ct is not None:  # rows that see no key (lse -inf) take none
                total -= jnp.sum(lse_ct * jnp.where(jnp.isfinite(lse), lse, 0.0))
            return total, (out, lse)

        bias = arrays.get("bias")
        if not grads:
            return list(forward(q, k, v, bias))
        argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
        grad, (out, lse) = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)
        return [out, lse, *grad]

    return jax.jit(outputs)


def _outputs(fn: Callable[..., Any], q, k, v, kwargs: dict[str, Any]):
    """[out, lse] of one implementation, forward only."""
    arrays, static = _split(kwargs)
    return _program(fn, static, False)(q, k, v, None, arrays)


def _outputs_and_grads(fn: Callable[..., Any], q, k, v, ct, kwargs: dict[str, Any]):
    """[out, lse, dq, dk, dv(, dbias)] of sum(out * ct) for one implementation."""
    arrays, static = _split(kwargs)
    return _program(fn, static, True)(q, k, v, ct, arrays)


def _grads_with_rounded_delta(fn: Callable[..., Any], q, k, v, ct, kwargs: dict[str, Any],
                              dtype: Any) -> list[jax.Array]:
    """[dq, dk, dv(, dbias)] of sum(out * ct) by fn (the reference on float32 inputs) with
    the one rounding the kernels' backward adds to it: delta = rowsum(dO * O) taken from
    the output rounded to `dtype`. delta's error eps = rowsum(dO * (round(O) - O)) enters
    dS = P (dP - delta) as -eps P, the gradient of an lse cotangent -eps, so that is how it
    is added (docs/decisions.md, "delta from the rounded output")."""
    arrays, static = _split(kwargs)
    out, lse = _program(fn, static, False)(q, k, v, None, arrays)
    info = jnp.finfo(dtype)  # reduce_precision: a round trip through dtype XLA may elide
    out = out.astype(jnp.float32)
    rounded = jax.lax.reduce_precision(out, info.nexp, info.nmant) - out
    eps = jnp.where(jnp.isfinite(lse), jnp.sum(ct * rounded, -1), 0.0)
    return _program(fn, static, True)(q, k, v, ct, arrays, eps)[2:]


def _visibility(q, k, v, kwargs: dict[str, Any]) -> jax.Array | None:
    """[G, B, K, T, S] bool: whether query row t of head k * G + g sees key s (the
    reference's rules), or None where every row sees every key."""
    arrays, static = _split(kwargs)

    def visible_of(q, k, v, arrays):
        spec, ops, _ = spec_lib.normalize(q, k, v, **arrays, **dict(static))
        return reference.logits_and_visibility(spec, ops, None)[1]

    visible = jax.jit(visible_of)(q, k, v, arrays)  # the logits it drops are never computed
    if visible is None:
        return None
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    return jnp.broadcast_to(visible, (N // K, B, K, T, S))


def _hidden_bias(visible: jax.Array, bias: jax.Array | None) -> jax.Array | None:
    """The bias with NaN in every entry no member of it sees (visible: `_visibility`'s),
    or None without a bias or such an entry."""
    if bias is None or bias.ndim != 4:
        return None
    G, B, K, T, S = visible.shape
    seen = jnp.moveaxis(visible, 0, 2).reshape(B, K * G, T, S)  # head k * G + g
    shared = tuple(i for i, n in enumerate(bias.shape) if n == 1)
    hidden = ~jnp.any(seen, axis=shared, keepdims=True)
    if not bool(jnp.any(hidden)):
        return None
    return jnp.where(hidden, jnp.nan, bias).astype(bias.dtype)


def _poisoned_runs(kernel: Callable[..., Any], q, k, v, ct, kwargs: dict[str, Any],
                   exact: list, bases: dict[str, float], floor: float) -> dict[str, Any]:
    """The kernel on inputs holding NaN where the results must not depend on them, and
    where they must: {"hidden": errors of every result (clean float32 reference) with
    NaN in the keys and values no row sees, in the bias entries no row sees and in the
    queries and their cotangents past the query lengths, or None where there is none;
    "visible": errors of out and lse with one seen key NaN (its rows' out and lse NaN,
    every other row as clean); "ok"}. The same pass rule as the clean run."""
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    visible = _visibility(q, k, v, kwargs)
    result: dict[str, Any] = {"hidden": None, "visible": None, "ok": True}

    def judge(got, want, which):
        errors = {n: relative_error(x, e)
                  for n, x, e in zip(names[:len(got)], got, want[:len(got)], strict=True)}
        result["ok"] &= all(np.isfinite(err) and err <= 2 * bases[n] + floor
                            for n, err in errors.items())
        result[which] = errors

    if visible is not None:
        hidden = ~jnp.any(visible, axis=(0, 3))  # [B, K, S]: no row of the group sees it
        bias = _hidden_bias(visible, kwargs.get("bias"))
        lengths = kwargs.get("query_seq_lengths")
        past = (None if lengths is None else  # [B, T, 1, 1]: rows past their length
                (jnp.arange(q.shape[1])[None, :] >= lengths[:, None])[..., None, None])
        if bool(jnp.any(hidden)) or bias is not None or past is not None:
            at = jnp.swapaxes(hidden, 1, 2)[..., None]
            q_in, ct_in = (q, ct) if past is None else (
                jnp.where(past, jnp.nan, q).astype(q.dtype), jnp.where(past, jnp.nan, ct))
            judge(_outputs_and_grads(kernel, q_in, jnp.where(at, jnp.nan, k).astype(k.dtype),
                                     jnp.where(at, jnp.nan, v).astype(v.dtype), ct_in,
                                     kwargs if bias is None else {**kwargs, "bias": bias}),
                  exact, "hidden")
    # The key of batch entry 0 and kv head 0 that the most rows see, NaN: every row that
    # sees it has a NaN score, so a NaN output and lse (nothing may turn it into a zero).
    B, T, N, _ = q.shape
    G, S = N // k.shape[2], k.shape[1]
    seen = (jnp.ones((G, T, S), bool) if visible is None else visible[:, 0, 0])
    key = int(jnp.argmax(jnp.sum(seen, axis=(0, 1))))
    rows = jnp.zeros((B, T, N), bool).at[0, :, :G].set(seen[:, :, key].T)  # as lse
    out, lse = _outputs(kernel, q, k.at[0, key, 0].set(jnp.nan), v, kwargs)
    want_out = jnp.where(rows[..., None], jnp.nan, exact[0])
    want_lse = jnp.where(rows, jnp.nan, exact[1])
    judge([out, lse], [want_out, want_lse], "visible")
    return result


def _digest(x: Any) -> str:
    """A result's bits, hashed (64 bits of SHA-256)."""
    return hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:16]


def across_processes(rounds: list[list[dict[str, Any]]],
                     log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The first round's rows of check, each failing where a later round, run in other
    processes, gave other bits for one of its results (`differs_across`: their names)."""
    later = [{(r["shape"], r.get("dtype")): r.get("digests", {}) for r in rows}
             for rows in rounds[1:]]
    for row in rounds[0]:
        mine = row.get("digests", {})
        theirs = [digests.get((row["shape"], row.get("dtype")), {}) for digests in later]
        row["differs_across"] = sorted(
            {n for d in theirs for n in mine.keys() | d.keys() if d.get(n) != mine.get(n)})
        if row["differs_across"]:
            row["ok"] = False
            log(f"FAIL {row['shape']} {row.get('dtype')}: differs between processes: "
                f"{', '.join(row['differs_across'])}")
    return rounds[0]


def _describe_poisoned(poisoned: dict[str, Any]) -> str:
    """check's words for `_poisoned_runs`: the largest error of each poisoned run."""
    if "error" in poisoned:
        return f"; NaN inputs: {poisoned['error']}"
    words = [f"; {which}: max error {max(errors.values()):.1e}"
             for which, errors in (("hidden NaN keys", poisoned["hidden"]),
                                   ("a seen NaN key", poisoned["visible"])) if errors]
    return "".join(words)


def check(shapes: Sequence[Shape], *, interpret: bool = False,
          log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Kernel vs float32-upcast reference, next to the same-dtype reference's error.

    Passes when the kernel's error is at most 2x the same-dtype reference's error
    plus a floor (FlashAttention's rule), for the output, lse and every gradient; a
    second call gives bitwise the same results (the default is deterministic); NaN in
    the keys and values (and bias entries) no row sees changes no result, and a NaN key
    that rows see
    reaches exactly their outputs (`_poisoned_runs`).
    """
    def kernel(*a, **kw):
        return pallas_attn.dot_product_attention(*a, implementation="pallas",
                                                 interpret=interpret, **kw)

    def ref(*a, **kw):
        return pallas_attn.dot_product_attention(*a, implementation="xla", **kw)

    results = []
    for shape in shapes:
        args = make_inputs(shape, seed=1)
        q, k, v, kw = args["query"], args["key"], args["value"], args["kwargs"]
        ct = args["cotangent"].astype(jnp.float32)
        up = lambda x: x.astype(jnp.float32)
        up_kw = {x: (up(y) if x == "bias" else y) for x, y in kw.items()}
        names = ["out", "lse", "dq", "dk", "dv"] + (["dbias"] if "bias" in kw else [])
        row: dict[str, Any] = {"shape": shape.label, "dtype": shape.dtype, "ok": True}
        try:
            got = _outputs_and_grads(kernel, q, k, v, ct, kw)
            again = _outputs_and_grads(kernel, q, k, v, ct, kw)
            exact = _outputs_and_grads(ref, up(q), up(k), up(v), ct, up_kw)
            same = _outputs_and_grads(ref, q, k, v, ct, kw)
        except Exception as e:  # noqa: BLE001 - report every shape, failing ones included
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
            results.append(row)
            log(f"FAIL {shape.label} {shape.dtype}: {row['error']}")
            continue
        floor = 1e-5 if shape.dtype == "float32" else 1e-3
        for name, x, e, s in zip(names, got, exact, same, strict=True):
            err, base = relative_error(x, e), relative_error(s, e)
            if name == "dbias" and kw["bias"].dtype.itemsize > q.dtype.itemsize:
                # A float32 bias's dbias from the reference is exact (its dO and out are
                # never rounded), while dS from 16-bit inputs carries their rounding, as
                # dq and dk do: their base is its.
                base = max(base, row["dq"][1], row["dk"][1])
            row[name] = (err, base)
            row["ok"] &= bool(np.isfinite(err) and err <= 2 * base + floor)
        missed = [n for n in names[2:] if not row[n][0] <= 2 * row[n][1] + floor]
        explained = ""
        if missed and shape.dtype != "float32":  # how much of it delta's rounding is
            rounded = _grads_with_rounded_delta(ref, up(q), up(k), up(v), ct, up_kw, q.dtype)
            without = {n: relative_error(x - (r - e), e) for n, x, r, e in
                       zip(names[2:], got[2:], rounded, exact[2:], strict=True) if n in missed}
            row["without_delta_rounding"] = without
            explained = "; without delta's rounding: " + " ".join(
                f"{n} {err:.1e}" for n, err in without.items())
        # The results' bits: the second call must match them, and so must another
        # process (`check --rounds`).
        row["digests"] = {n: _digest(x) for n, x in zip(names, got, strict=True)}
        row["differs"] = [n for n, y in zip(names, again, strict=True)
                          if _digest(y) != row["digests"][n]]
        row["ok"] &= not row["differs"]
        try:
            poisoned = _poisoned_runs(kernel, q, k, v, ct, kw, exact,
                                      {n: row[n][1] for n in names}, floor)
        except Exception as e:  # noqa: BLE001 - report every shape, failing ones included
            poisoned = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
        row["poisoned"] = poisoned
        row["ok"] &= poisoned["ok"]
        results.append(row)
        differ = (f"; differs between two calls: {', '.join(row['differs'])}"
                  if row["differs"] else "")
        log(" ".join([f"{'PASS' if row['ok'] else 'FAIL'} {shape.label} {shape.dtype}:"] +
                     [f"{n} {row[n][0]:.1e} (ref {row[n][1]:.1e})" for n in names])
            + differ + explained + _describe_poisoned(poisoned))
    return results


def standard_shapes(quick: bool = False) -> list[Shape]:
    """The standard shapes: 16k or 32k tokens (T = S = 4096) at head dims 64, 128, 256."""
    shapes = []
    for head_dim, batch, heads in ((64, 8, 16), (128, 4, 16), (256, 4, 8)):
        if quick and head_dim != 128:
            continue
        for causal in (False, True):
            shapes.append(Shape(batch, 4096, 4096, heads, heads, head_dim, causal))
    return shapes


def feature_shapes() -> list[Shape]:
    """Issue targets: each feature's cost next to the plain d128 problem."""
    base = dict(batch=4, q_len=4096, kv_len=4096, heads=16, kv_heads=16, head_dim=128)
    return [
        Shape(**base),
        Shape(**base, features=(("bias", None),)),
        Shape(**base, features=(("bias_per_batch", None),)),
        Shape(**base, features=(("mask", None),)),
        Shape(**base, features=(("bias_per_key", None),)),  # [B, N, 1, S]
        Shape(**base, features=(("mask_per_key", None),)),  # [B, 1, 1, S], padding
        Shape(**base, features=(("bias_per_row", None),)),  # [B, N, T, 1]
        Shape(**base, features=(("mask_per_row", None),)),  # [B, 1, T, 1], query padding
        Shape(**base, features=(("alibi", None),)),
        Shape(**base, features=(("softcap", 30.0),)),
        Shape(**base, features=(("dropout", 0.1),)),
        Shape(**base, features=(("segments", None),)),
        Shape(**base, features=(("packed", 4),)),
        Shape(**base, features=(("packed", 16),)),
        Shape(**base, features=(("mask_documents", 4),)),  # packed 4 as a boolean mask
        Shape(**base, features=(("mask_documents", 16),)),
        Shape(**base, features=(("sinks", None),)),
        Shape(**base, features=(("lengths", 0),)),  # every key valid: the cost alone
        Shape(**dict(base, batch=2, q_len=8192, kv_len=8192)),
        Shape(**dict(base, batch=2, q_len=8192, kv_len=8192), features=(("window", 512),)),
        Shape(**dict(base, kv_heads=2)),
    ]


def wide_shapes() -> list[Shape]:
    """Issue targets beyond the standard set: head dims 16 and the multiples of 8 from 32 to
    256 (T = S = 4096, 16k tokens), values of 128 next to queries and keys of 192 (which
    jax.nn does not take: pallas_attn alone), lengths 512 to 32768 at d128 (32k tokens),
    T != S, and GQA; causal and not where jax.nn's cuDNN takes it (top-left alignment)."""
    shapes = []
    for head_dim in (16, 32, 48, 80, 96, 112, 160, 192, 224):
        heads = 16 if head_dim <= 128 else 8
        shapes += [Shape(4, 4096, 4096, heads, heads, head_dim, causal)
                   for causal in (False, True)]
    for length in (512, 1024, 2048, 8192, 16384, 32768):
        shapes += [Shape(32768 // length, length, length, 16, 16, 128, causal)
                   for causal in (False, True)]
    # Queries and keys of 192 with values of 128 (multi-head latent attention's heads).
    shapes += [Shape(4, 4096, 4096, 16, 16, 192, causal, (("value_dim", 128),))
               for causal in (False, True)]
    shapes += [Shape(4, 1024, 8192, 16, 16, 128), Shape(4, 8192, 1024, 16, 16, 128),
               Shape(2, 4096, 4096, 32, 8, 128), Shape(2, 4096, 4096, 32, 8, 128, True),
               Shape(4, 4096, 4096, 32, 4, 64), Shape(4, 4096, 4096, 16, 2, 256)]
    return shapes


def long_shapes() -> list[Shape]:
    """One sequence of 16k to 128k tokens, N16 d128, causal (131072 dense too): time and
    the fwd+bwd program's memory, which grows with T alone (no T x S buffer)."""
    shapes = [Shape(1, length, length, 16, 16, 128, True) for length in (16384, 32768, 65536,
                                                                        131072)]
    return [*shapes, Shape(1, 131072, 131072, 16, 16, 128)]


def decode_shapes() -> list[Shape]:
    """Decoding: one query token per sequence against a cache of S keys (lengths set),
    GQA 32/8 and MHA, head dims 64 to 256 (96: no power of two, contiguous and paged);
    a 4-token speculative step; a 40-token chunk of prefill against a paged cache
    (160 query rows per kv group: three tiles of rows); a mask per key, and one that
    shows the first quarter of the cache."""
    lengths = (("lengths", 0),)
    shapes = [Shape(batch, 1, kv_len, 32, 8, 128, features=lengths)
              for batch, kv_len in ((1, 4096), (1, 32768), (1, 131072), (8, 4096), (8, 32768),
                                    (8, 131072), (64, 4096), (64, 32768))]
    shapes += [Shape(8, 1, 32768, 32, 32, 128, features=lengths),
               Shape(1, 1, 131072, 32, 32, 128, features=lengths),
               Shape(8, 1, 32768, 32, 8, 64, features=lengths),
               Shape(8, 1, 32768, 16, 4, 256, features=lengths),
               Shape(8, 1, 32768, 32, 8, 96, features=lengths),
               Shape(8, 1, 32768, 32, 8, 96, features=(*lengths, ("paged", 64))),
               Shape(8, 4, 32768, 32, 8, 128,
                     features=(*lengths, ("causal_bottom_right", None)))]
    shapes += [Shape(8, 1, 32768, 32, 8, 128, features=(*lengths, ("paged", size)))
               for size in (16, 64, 256)]
    shapes.append(Shape(1, 1, 131072, 32, 8, 128, features=(*lengths, ("paged", 64))))
    shapes.append(Shape(8, 40, 32768, 32, 8, 128,
                        features=(*lengths, ("causal_bottom_right", None), ("paged", 64))))
    # Flax's cached decoding through attention_fn: a mask per key (1/8 of the keys hidden);
    # as Flax builds it, without lengths: the cache past the current position (a quarter).
    shapes.append(Shape(8, 1, 32768, 32, 8, 128, features=(*lengths, ("mask_per_key", None))))
    shapes.append(Shape(8, 1, 32768, 32, 8, 128, features=(("mask_prefix", 8192),)))
    return shapes


def _paged(args: dict[str, Any], page_size: int) -> tuple[Callable[..., jax.Array], tuple]:
    """(fn, operands) of paged_attention on the shape's K/V cut into pages stored in a
    shuffled order."""
    k, v = args["key"], args["value"]
    B, S, K, H = k.shape
    pages = B * S // page_size
    order = jax.random.permutation(jax.random.key(9), pages)
    k_cache = k.reshape(pages, page_size, K, H)[order]
    v_cache = v.reshape(pages, page_size, K, v.shape[-1])[order]
    table = jnp.argsort(order).reshape(B, S // page_size).astype(jnp.int32)
    lengths = args["kwargs"]["key_value_seq_lengths"]
    def fn(q, kc, vc, table, lengths):
        return pallas_attn.paged_attention(q, kc, vc, table, lengths)
    return fn, (args["query"], k_cache, v_cache, table, lengths)


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device elementwise copy (read + write 2 GiB)."""
    x = jnp.zeros((1 << 30,), jnp.bfloat16)
    f = jax.jit(lambda x: x + jnp.bfloat16(1))
    return 2 * x.nbytes / autotune.time_call(functools.partial(f, x))


DECODE_STEPS = 64


def time_per_step(fn: Callable[..., jax.Array], q: jax.Array, *rest: Any) -> float:
    """Seconds per call of fn(q, *rest) inside one jitted program of DECODE_STEPS calls,
    each step's query fed by the last step's output, as a decoding loop runs it: the
    device's time per step, without the host's dispatch of every call. The steps are
    unrolled: a device loop's per-iteration control (a few microseconds) would be
    counted against the small caches' calls."""
    def steps(q, *rest):
        def body(_, q):
            return q + (fn(q, *rest) * 1e-3).astype(q.dtype)
        return jax.lax.fori_loop(0, DECODE_STEPS, body, q, unroll=True)
    return autotune.time_call(functools.partial(jax.jit(steps), q, *rest)) / DECODE_STEPS


def decode_benchmark(shapes: Sequence[Shape], *, log: Callable[[str], None] = print,
                     only: Sequence[str] | None = None, rounds: int = 1
                     ) -> list[dict[str, Any]]:
    """Forward-only rows with the effective K/V read bandwidth: the bytes of the keys
    and values every sequence's length covers, over the time per step of a decoding
    loop (`time_per_step`); each the best of `rounds`, as in `benchmark`."""
    _check_rounds(rounds)
    rows = []
    for shape in shapes:
        args = make_inputs(shape)
        q, k, v, kwargs = args["query"], args["key"], args["value"], args["kwargs"]
        features = dict(shape.features)
        lengths = kwargs.get("key_value_seq_lengths")
        keys = shape.batch * shape.kv_len if lengths is None else int(jnp.sum(lengths))
        if "mask_prefix" in features:  # the keys the mask shows
            keys = shape.batch * int(features["mask_prefix"])
        kv_bytes = (keys * shape.kv_heads * (shape.head_dim + shape.value_head_dim)
                    * jnp.dtype(shape.dtype).itemsize)
        page_size = features.get("paged")
        runs = []
        if page_size is not None:
            fn, operands = _paged(args, page_size)
            runs.append(({"shape": shape.label, "impl": "pallas_attn paged"}, fn, operands))
        else:
            arrays = {x: y for x, y in kwargs.items() if isinstance(y, jax.Array)}
            static = {x: y for x, y in kwargs.items() if x not in arrays}
            for name, fn in implementations(False).items():
                if only is None or name in only:
                    runs.append(({"shape": shape.label, "impl": name},
                                 lambda q, k, v, arrays, fn=fn, static=static: fn(
                                     q, k, v, **arrays, **static), (q, k, v, arrays)))
        for _ in range(rounds):
            for row, fn, operands in runs:
                if "error" in row:
                    continue
                try:
                    _keep_best(row, "fwd_ms", time_per_step(fn, *operands))
                except Exception as e:  # noqa: BLE001 - peers may not support a shape
                    row["error"] = _error_text(e)
        for row, _, _ in runs:
            if "fwd_ms" in row:
                row["kv_tbps"] = kv_bytes / row["fwd_ms"] / 1e9
            rows.append(row)
            log(json.dumps(row))
    return rows


def format_decode_table(rows: list[dict[str, Any]], copy_tbps: float) -> str:
    lines = [f"Device-to-device copy: {copy_tbps:.2f} TB/s",
             "| shape | implementation | fwd ms | K/V TB/s | of copy |", "|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['shape']} | {row['impl']} | fails: {row['error']} | | |")
            continue
        lines.append(f"| {row['shape']} | {row['impl']} | {row['fwd_ms']:.3f} | "
                     f"{row['kv_tbps']:.2f} | {row['kv_tbps'] / copy_tbps:.0%} |")
    return "\n".join(lines)


def check_shapes(on_device: bool) -> list[Shape]:
    if not on_device:
        return [Shape(2, 40, 56, 4, 2, 32, False, dtype="float32"),
                Shape(1, 33, 45, 2, 2, 64, True, dtype="bfloat16"),
                Shape(1, 48, 40, 2, 1, 40, False, (("bias", None), ("softcap", 5.0)),
                      dtype="float16")]
    shapes = [
        Shape(2, 1024, 1024, 4, 4, 64, False, dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 128, True, dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 256, False, dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 128, False, dtype="float16"),
        Shape(2, 1024, 1024, 4, 4, 64, True, dtype="float32"),
        Shape(2, 1000, 1500, 8, 2, 80, True, dtype="bfloat16"),
        Shape(1, 777, 333, 4, 1, 192, False, dtype="bfloat16"),
        # The forward's 96-key tiles (head dims 192 and 224, no bias, mask or ids), the
        # last one past the keys' padding (1024): values of 128 with dropout's hashes over
        # 96 keys, causal, GQA; 224 plain in float16.
        Shape(2, 1000, 1000, 8, 2, 192, True, (("value_dim", 128), ("dropout", 0.1)),
              dtype="bfloat16"),
        Shape(1, 900, 1000, 4, 4, 224, False, dtype="float16"),
        # Where every role is a Mosaic kernel head dims pad to whole wgmma tiles (the
        # Triton repairs, causal, read them in place as power-of-two tiles): 160 and 224 as
        # they are (the wide backward's halves in 16-column tiles), 160 with a bias's
        # gradient, 112 and 48 as they are (16-column tiles); GQA, ragged.
        Shape(2, 1000, 1100, 8, 2, 160, True, (("bias", None),), dtype="bfloat16"),
        Shape(2, 1000, 1100, 8, 2, 224, True, (("softcap", 20.0),), dtype="float16"),
        Shape(2, 1000, 1100, 8, 2, 112, False, (("softcap", 20.0),), dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 48, True, dtype="float16"),
        # A bias and a mask per key in every Mosaic kernel (rows read from global memory
        # per key tile), the bias's gradient as dS's column sums in the dK/dV kernel;
        # causal, ragged, GQA; at head dim 256 the wide dK/dV kernel's, under a soft cap.
        Shape(2, 1000, 1100, 8, 2, 128, True, (("bias_per_key", None), ("mask_per_key", None)),
              dtype="bfloat16"),
        Shape(2, 1000, 1100, 4, 2, 256, False, (("bias_per_key", None), ("softcap", 20.0)),
              dtype="float16"),
        Shape(2, 1024, 1024, 4, 4, 64, False, (("mask_per_key", None), ("softcap", 20.0)),
              dtype="float16"),
        # A bias and a mask broadcast along keys (each consumer's rows read from global
        # memory), the bias's gradient from the Triton dbias kernel, under a soft cap (so
        # that it is not zero); causal, ragged, GQA; a mask per row alone at d64 (the
        # dK/dV keys by queries).
        Shape(2, 1000, 1100, 8, 2, 128, True, (("bias_per_row", None), ("mask_per_row", None),
                                               ("softcap", 20.0)), dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 64, False, (("mask_per_row", None),), dtype="float16"),
        # Head dims up to 32 in the Mosaic kernels: 64- and 32-byte swizzled tiles (32 and
        # 16 columns), causal with a soft cap, GQA, ragged; a bias's gradient at 16.
        Shape(2, 1000, 1100, 8, 2, 32, True, (("softcap", 20.0),), dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 16, False, (("bias", None),), dtype="float16"),
        # Head dim 256 in the Mosaic forward (64-key tiles, the output staged in Q's
        # buffer), with a bias tile per consumer and a soft cap, ragged, GQA.
        Shape(2, 1000, 1100, 4, 2, 256, True, (("bias", None), ("softcap", 20.0)),
              dtype="bfloat16"),
        # The wide Mosaic dK/dV kernel (head dim 256, consumers sharing each unit):
        # writing a per-batch bias's gradient with dropout under causal masking, and
        # with key lengths and a soft cap (GQA, ragged, float16).
        Shape(2, 1024, 1024, 4, 4, 256, True, (("bias_per_batch", None), ("dropout", 0.1)),
              dtype="bfloat16"),
        Shape(2, 1000, 1100, 8, 2, 256, False, (("lengths", 300), ("softcap", 20.0)),
              dtype="float16"),
        # A mask at head dim 256: the wide dQ's ring holds each consumer's keys of it, the
        # wide dK/dV's consumers read their tiles from global memory (causal, ragged, GQA).
        Shape(2, 1000, 1100, 8, 2, 256, True, (("mask", None),), dtype="bfloat16"),
        # A float32 bias next to bfloat16 inputs at d128: the Mosaic forward's 64-key tiles
        # (128-key slots leave no room), the Triton dK/dV, the separate dbias kernel.
        Shape(2, 1000, 1100, 8, 2, 128, True, (("bias_float32", None),), dtype="bfloat16"),
        # Four batch entries sharing a bias: three additions to its gradient, in turn.
        Shape(4, 1024, 1024, 4, 4, 128, True, (("bias", None), ("alibi", None),
                                                ("softcap", 20.0)), dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 64, False, (("dropout", 0.2), ("mask", None)),
              dtype="bfloat16"),
        # Key lengths in the Mosaic forward (keys past them zeroed before it), ragged.
        Shape(2, 1000, 1100, 4, 2, 128, True, (("lengths", 300),), dtype="bfloat16"),
        # Query lengths (the queries and their cotangents past them NaN in the hidden
        # run): with key lengths, causal, GQA, on the Mosaic kernels; with a bias's
        # gradient and dropout at d64; in the wide kernels at d256.
        Shape(2, 1000, 1100, 8, 2, 128, True, (("lengths", 300), ("qlengths", 400)),
              dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 64, False, (("qlengths", 300), ("bias", None),
                                               ("dropout", 0.1)), dtype="float16"),
        Shape(2, 1000, 1100, 4, 2, 256, True, (("qlengths", 500), ("softcap", 20.0)),
              dtype="bfloat16"),
        # Dropout in the Mosaic kernels: per-head masks under causal GQA, and with a
        # per-batch bias whose gradient the dK/dV kernel writes.
        Shape(2, 1000, 1100, 8, 2, 128, True, (("dropout", 0.2),), dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 128, False, (("bias_per_batch", None), ("dropout", 0.1)),
              dtype="float16"),
        # Packed documents in the Mosaic kernels (each tile narrowed to its documents),
        # and as a mask (tiles inside a document read no mask), causal and ragged.
        Shape(2, 1024, 1024, 8, 2, 128, True, (("packed", 4),), dtype="float16"),
        Shape(2, 1024, 1024, 8, 2, 128, False, (("mask_documents", 4),), dtype="bfloat16"),
        Shape(2, 1000, 1000, 4, 4, 64, True, (("mask_documents", 4),), dtype="float16"),
        Shape(2, 1024, 1024, 4, 4, 128, True, (("window", 256), ("segments", None)),
              dtype="bfloat16"),
        # Segment ids without causal masking: the Mosaic dK/dV kernel (keys by queries at
        # 64, the wide kernel at 256), ragged ids, GQA, with dropout and a soft cap.
        Shape(2, 1000, 1000, 8, 2, 64, False, (("segments", None),), dtype="float16"),
        Shape(2, 1024, 1024, 8, 2, 128, False, (("packed", 16), ("dropout", 0.1)),
              dtype="bfloat16"),
        Shape(2, 1024, 1024, 4, 4, 256, False, (("packed", 4), ("softcap", 20.0)),
              dtype="bfloat16"),
        # The Mosaic (Hopper) forward with a window (it skips leading key tiles), and
        # with a soft cap.
        Shape(2, 1024, 1024, 4, 4, 128, False, (("window", 256),), dtype="float16"),
        Shape(2, 1024, 1024, 4, 4, 128, True, (("softcap", 20.0),), dtype="bfloat16"),
        # dbias written by the dK/dV kernel (a bias per batch entry and head; causal, so
        # skipped tiles are zero-filled), and by the dbias kernel for a float32 bias.
        Shape(2, 1024, 1024, 16, 16, 128, True, (("bias_per_batch", None),),
              dtype="bfloat16"),
        Shape(2, 1024, 1024, 16, 16, 64, True, (("bias", None), ("dropout", 0.1)),
              dtype="float32"),
        # The Mosaic forward with a bias shared by the batch entries (each consumer
        # bulk-copies its bias tiles into shared memory) under a soft cap, ragged, GQA.
        Shape(2, 1000, 1100, 4, 2, 128, False, (("bias", None), ("softcap", 20.0)),
              dtype="bfloat16"),
        # A large cap: logits spread over +-50 before the running row maximum.
        Shape(2, 1024, 1024, 4, 4, 128, False, (("softcap", 50.0),), dtype="bfloat16"),
        # ALiBi alone in the Mosaic kernels (log2-unit scores), ragged, GQA, float16.
        Shape(2, 1000, 1100, 8, 2, 64, True, (("alibi", None),), dtype="float16"),
        # A bias shared by the heads: read by the Mosaic forward, dQ and dK/dV kernels,
        # its gradient from the Mosaic dbias kernel.
        Shape(2, 1024, 1024, 4, 4, 128, True, (("bias_shared_by_heads", None),),
              dtype="bfloat16"),
        Shape(2, 1000, 1100, 4, 2, 64, False, (("bias_shared_by_heads", None),
                                                ("softcap", 20.0)), dtype="float16"),
        # With packed documents its gradient comes from the Triton dbias kernel, which
        # runs only the tiles a member's rows can see (causal, GQA).
        Shape(2, 1024, 1024, 8, 2, 128, True, (("bias_shared_by_heads", None),
                                               ("packed", 4)), dtype="bfloat16"),
        # Attention sinks in the Mosaic forward (causal, d128) and in the Triton kernels
        # with lengths (rows past a query length keep lse = sink).
        Shape(2, 1024, 1024, 4, 4, 128, True, (("sinks", None),), dtype="bfloat16"),
        Shape(2, 1000, 1100, 8, 2, 64, False, (("sinks", None), ("softcap", 20.0),
                                                ("lengths", 300)), dtype="float16"),
        # The decode kernel: one token against ragged lengths with the keys split over
        # programs (GQA, bf16; at head dim 80 the cache read in place, its tiles' last
        # head dims and keys past 20000 as zeros); a 5-token bottom-right causal chunk
        # with a soft cap and ALiBi (float16, MQA).
        Shape(3, 1, 20000, 16, 4, 128, False, (("lengths", 1234),), dtype="bfloat16"),
        Shape(3, 1, 20000, 16, 4, 80, False, (("lengths", 1234),), dtype="bfloat16"),
        # A mask per key and a bias per head read by the decode kernel, row by row.
        Shape(3, 1, 20000, 16, 4, 128, False, (("mask_per_key", None), ("bias", None)),
              dtype="bfloat16"),
        Shape(2, 5, 3000, 8, 1, 64, False, (("causal_bottom_right", None), ("softcap", 20.0),
                                            ("alibi", None)), dtype="float16"),
    ]
    return shapes


# Random combinations for `check --random`: one of each group with probability 1/2, then
# each extra feature with probability 1/4 (its value drawn where it takes one).
_RANDOM_BIAS = ("bias", "bias_per_batch", "bias_per_key", "bias_per_row",
                "bias_shared_by_heads", "bias_float32")
_RANDOM_MASK = ("mask", "mask_per_key", "mask_per_row", "mask_documents")
_RANDOM_IDS = ("segments", "packed")
_RANDOM_HEAD_DIMS = (16, 24, 32, 40, 64, 80, 96, 112, 128, 160, 192, 256)


def random_check_shapes(count: int, seed: int, on_device: bool) -> list[Shape]:
    """count shapes drawn from every feature that combines (the same for the same seed):
    head dims 16 to 256, GQA and MQA, ragged T != S (S = T where a mask of documents or
    segment ids needs it), 16-bit inputs; realistic sizes on a GPU, small ones in the
    interpreter: combinations beyond the fixed shapes of `check_shapes`."""
    rng = random.Random(seed)
    low, high = (200, 1200) if on_device else (16, 80)
    shapes = []
    for _ in range(count):
        heads = rng.choice((2, 4, 8))
        kv_heads = rng.choice([k for k in (1, 2, heads) if heads % k == 0])
        q_len, kv_len = rng.randrange(low, high), rng.randrange(low, high)
        features: list[tuple[str, Any]] = []
        bias, mask, ids = (rng.choice(group) if rng.random() < 0.5 else None
                           for group in (_RANDOM_BIAS, _RANDOM_MASK, _RANDOM_IDS))
        if mask == "mask_documents" or ids is not None:
            kv_len = q_len  # documents of one sequence: self-attention
        causal = rng.random() < 0.4
        if not causal and rng.random() < 0.15:
            features.append(("causal_bottom_right", None))
        elif rng.random() < 0.25:
            # A window of at least 16 keys, under kv_len where there are more.
            features.append(("window", rng.randrange(min(16, kv_len - 1), kv_len)))
        documents = rng.choice((2, 3, 4)) if mask == "mask_documents" else None
        packed = rng.choice((2, 3, 4)) if ids == "packed" else None
        features += [(name, value) for name, value in ((bias, None), (mask, documents),
                                                       (ids, packed)) if name is not None]
        for name, value in (("alibi", None), ("softcap", 20.0), ("dropout", 0.1),
                            ("sinks", None), ("lengths", rng.randrange(1, kv_len // 2))):
            # A bias per row has a gradient of exactly zero without a soft cap or sinks
            # (softmax is shift-invariant per row): errors against it would be noise.
            cap = name == "softcap" and bias == "bias_per_row"
            if cap or rng.random() < 0.25:
                features.append((name, value))
                if name == "lengths" and value % 2:  # no draw of its own: seeds stay
                    features.append(("qlengths", value))
        shapes.append(Shape(rng.choice((1, 2)), q_len, kv_len, heads, kv_heads,
                            rng.choice(_RANDOM_HEAD_DIMS), causal, tuple(features),
                            dtype=rng.choice(("bfloat16", "float16"))))
    return shapes


def describe_device() -> str:
    device = jax.devices()[0]
    return f"device: {device.device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}"


def write_json(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"device": describe_device(), "rows": rows}, f, indent=1, default=str)


def plot(rows: list[dict[str, Any]], path: str, device: str) -> None:
    """Grouped bar chart of forward and forward+backward TFLOP/s per shape, titled with
    the device that ran them (rows that failed count 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(shapes)), 8), sharex=True)
    width = 0.8 / max(1, len(impls))
    for ax, metric in zip(axes, ("fwd_tflops", "fwdbwd_tflops"), strict=True):
        for i, impl in enumerate(impls):
            values = [next((r.get(metric) or 0.0 for r in rows
                            if r["shape"] == s and r["impl"] == impl), 0.0) for s in shapes]
            ax.bar(np.arange(len(shapes)) + i * width, values, width, label=impl)
        ax.set_ylabel(metric.replace("_tflops", "").replace("fwdbwd", "fwd+bwd") + " TFLOP/s")
        ax.legend()
    axes[-1].set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, shapes, rotation=30,
                        ha="right", fontsize=7)
    fig.suptitle(device)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
