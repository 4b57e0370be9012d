"""Shared helpers for the Pallas-kernel tests (run in the Pallas interpreter on CPU).

* `make_inputs`: random q, k, v and random cotangents for out and lse.
* `run`: one jitted forward + VJP of `pallas_attn.dot_product_attention` for one
  implementation, returning out, lse and the gradients of q, k, v (and bias).
* `numpy_attention`: an independent float64 NumPy oracle for every feature,
  forward and hand-derived backward, used as the high-precision reference.
* `TOLERANCES` and the comparison helpers (one table keyed by dtype, plus
  FlashAttention's "at most twice the error of the same-dtype reference" rule).
* `host_primitives`: a jaxpr's primitives outside the kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn
from pallas_attn import dispatch
from pallas_attn.kernels import vjp
from pallas_attn.kernels.mosaic.common import row_residuals
from pallas_attn.kernels.triton import fwd as triton_fwd
from pallas_attn.kernels.triton.context import backward_inputs
from pallas_attn.plan import BACKEND_FIELDS, TILE_FIELDS, Route
from pallas_attn.spec import normalize

# The smallest legal tiles: many tiles even for tiny problems, so the tile loops,
# the edge masking and the padding are all exercised.
SMALL_BLOCKS = pallas_attn.BlockSizes(16, 16, 16, 16, 16, 16, block_q_dbias=16,
                                      block_k_dbias=16)
# Alternatives for the tile-independence checks (forward / dK-dV / dQ / dbias tiles differ).
OTHER_BLOCKS = (
    pallas_attn.BlockSizes(32, 16, 16, 32, 32, 16, block_q_dbias=16, block_k_dbias=32),
    pallas_attn.BlockSizes(16, 32, 32, 16, 16, 32, block_q_dbias=32, block_k_dbias=16),
)

# Tolerances, relative to the magnitude of the expected array (atol = tol * max(1, scale)).
# "ref": kernel vs the library reference in the same dtype (and vs float64).
# "fa_floor": the additive floor of FlashAttention's 2x rule, relative to scale.
TOLERANCES = {
    "float32": {"out": 1e-5, "lse": 1e-5, "grad": 2e-5, "fa_floor": 1e-5},
    "bfloat16": {"out": 3e-2, "lse": 1e-4, "grad": 6e-2, "fa_floor": 1e-2},
    "float16": {"out": 4e-3, "lse": 1e-4, "grad": 8e-3, "fa_floor": 1.5e-3},
}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}



def alternate_dtypes(cases: list, dtypes: tuple = ("bfloat16", "float16")) -> list:
    """One pytest.param per case (id, *values), the dtypes (or dtype tuples) taking turns:
    every case runs once and every dtype is covered, at half the cost of crossing them."""
    params = []
    for i, (name, *values) in enumerate(cases):
        dtype = dtypes[i % len(dtypes)]
        dtype = dtype if isinstance(dtype, tuple) else (dtype,)
        params.append(pytest.param(*dtype, *values, id=f"{name}-{'-'.join(dtype)}"))
    return params


def dtype_name(x: Any) -> str:
    return jnp.dtype(x).name


# --------------------------------------------------------------------------- inputs
def make_inputs(seed: int, *, B: int | None = 2, T: int = 17, S: int = 23, N: int = 2,
                K: int | None = None, H: int = 16, Hv: int | None = None,
                dtype: Any = jnp.float32, scale_inputs: float = 1.0) -> dict[str, jax.Array]:
    """Random q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv], ct [B,T,N,Hv], ct_lse [B,T,N].

    B=None gives unbatched [T, N, H] inputs. Cotangents are random normal (float32
    for lse; out's cotangent in the input dtype).
    """
    rng = np.random.default_rng(seed)
    K = N if K is None else K
    Hv = H if Hv is None else Hv
    lead = () if B is None else (B,)

    def normal(*shape):
        return rng.standard_normal(lead + shape).astype(np.float32)

    return {
        "q": jnp.asarray(normal(T, N, H) * scale_inputs, dtype),
        "k": jnp.asarray(normal(S, K, H) * scale_inputs, dtype),
        "v": jnp.asarray(normal(S, K, Hv), dtype),
        "ct": jnp.asarray(normal(T, N, Hv), dtype),
        "ct_lse": jnp.asarray(normal(T, N), jnp.float32),
    }


def keep_mask(rng: jax.Array, **kwargs: Any) -> np.ndarray:
    """pallas_attn.dropout_keep_mask(rng, **kwargs) as one jitted program (eagerly, each
    of its operations would compile on its own), as a NumPy array."""
    return np.asarray(jax.jit(lambda rng: pallas_attn.dropout_keep_mask(rng, **kwargs))(rng))


def random_bias(seed: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# --------------------------------------------------------------------------- running
def _finite(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, 0.0)


def make_runner(implementation: str, *, with_bias: bool = False, bias_grad: bool = True,
                lse_grad: bool = True, block_sizes: Any = SMALL_BLOCKS, grads: bool = True,
                **static: Any):
    """A jitted fn(q, k, v, ct, ct_lse, bias, arrays) -> dict of out, lse and gradients
    (out and lse alone where grads is False: a forward kernel's own tests).

    The loss is sum(out * ct) + sum(lse * ct_lse) (lse of empty rows, -inf, left out),
    so every gradient is a VJP with random cotangents. `arrays` holds the other
    array arguments (mask, segment ids, lengths, alibi slopes, dropout_rng), which
    are not differentiated. `static` are the remaining keyword arguments.

    One jitted call: the Mosaic GPU interpreter's warpgroups run next to the calling
    program only because tests/conftest.py gives XLA:CPU's pool more threads than a
    kernel has warpgroups (PJRT_NPROC).
    """
    extra = {}
    if implementation == "pallas":
        extra = {"interpret": True, "block_sizes": block_sizes}

    def attention(q, k, v, bias, arrays):
        return pallas_attn.dot_product_attention(
            q, k, v, bias, implementation=implementation, return_residual=True,
            **arrays, **static, **extra)

    def loss(q, k, v, bias, ct, ct_lse, arrays):
        out, lse = attention(q, k, v, bias, arrays)
        total = jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))
        if lse_grad:
            total = total + jnp.sum(_finite(lse) * ct_lse)
        return total, (out, lse)

    argnums = (0, 1, 2, 3) if (with_bias and bias_grad) else (0, 1, 2)

    def forward(q, k, v, ct, ct_lse, bias, arrays):
        if with_bias and not bias_grad:
            bias = jax.lax.stop_gradient(bias)
        wrt, rest = (q, k, v, bias)[:len(argnums)], (q, k, v, bias)[len(argnums):]
        _, pullback, (out, lse) = jax.vjp(
            lambda *wrt: loss(*wrt, *rest, ct, ct_lse, arrays), *wrt, has_aux=True)
        return out, lse, pullback

    def backward(pullback):
        return pullback(jnp.ones((), jnp.float32))

    @jax.jit
    def fused(*args):
        if not grads:
            q, k, v, _, _, bias, arrays = args
            return (*attention(q, k, v, bias, arrays), ())
        out, lse, pullback = forward(*args)
        return out, lse, backward(pullback)

    def fn(q, k, v, ct, ct_lse, bias=None, arrays=None):
        args = (q, k, v, ct, ct_lse, bias, {} if arrays is None else arrays)
        out, lse, pulled = fused(*args)
        result = {"out": out, "lse": lse}
        result.update(zip(("dq", "dk", "dv", "dbias")[:len(pulled)], pulled, strict=True))
        return result

    return fn


def run(implementation: str, inputs: dict, *, bias: jax.Array | None = None,
        arrays: dict | None = None, dtypes: dict | None = None,
        **kwargs: Any) -> dict[str, np.ndarray]:
    """One forward + VJP; returns NumPy arrays (float64 copies of the results).

    dtypes: if given, filled with the dtype of each result as the kernel returned it.
    """
    fn = make_runner(implementation, with_bias=bias is not None, **kwargs)
    result = fn(inputs["q"], inputs["k"], inputs["v"], inputs["ct"], inputs["ct_lse"],
                bias, arrays)
    if dtypes is not None:
        dtypes.update({name: jnp.dtype(x.dtype) for name, x in result.items()})
    return to_numpy(result)


def to_numpy(result: dict) -> dict[str, np.ndarray]:
    # On the host: an eager conversion would compile a program per shape.
    return {name: np.asarray(x).astype(np.float64) for name, x in result.items()}


def pallas_and_reference(inputs: dict, dtypes: dict | None = None,
                         **kwargs: Any) -> tuple[dict, dict]:
    """(kernel results, same-dtype reference results) for the same call."""
    block_sizes = kwargs.pop("block_sizes", SMALL_BLOCKS)
    kernel = run("pallas", inputs, block_sizes=block_sizes, dtypes=dtypes, **kwargs)
    reference = run("xla", inputs, **kwargs)
    return kernel, reference


# --------------------------------------------------------------------------- oracle
def _broadcast_4d(x: Any, full: tuple[int, ...]) -> np.ndarray:
    x = np.asarray(x)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    return np.broadcast_to(x, full)


def _reduce_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sums a [B, N, T, S] array over the axes that `shape` broadcasts along."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(a for a in range(4) if shape4[a] == 1 and x.shape[a] != 1)
    return np.sum(x, axis=axes, keepdims=True).reshape(shape)


def numpy_attention(q, k, v, ct=None, ct_lse=None, *, bias=None, mask=None, scale=None,
                    is_causal=False, causal_alignment="top_left", local_window_size=None,
                    alibi_slopes=None, logits_soft_cap=None, q_segment_ids=None,
                    kv_segment_ids=None, query_seq_lengths=None, key_value_seq_lengths=None,
                    keep=None, dropout_rate=0.0, sinks=None) -> dict[str, np.ndarray]:
    """Float64 attention and its VJP, written from the semantics in DESIGN.md.

    Independent of pallas_attn (only NumPy). keep: the [B, N, T, S] dropout keep mask.
    Returns out [B,T,N,Hv], lse [B,T,N] and, given ct, dq, dk, dv (and dbias with bias,
    dsinks with sinks).
    Unbatched [T, N, H] inputs are accepted and the results are unbatched likewise.
    """
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batched = q.ndim == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    g = N // K
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    kh = np.arange(N) // g
    kq = k[:, :, kh, :]  # [B, S, N, H]
    vq = v[:, :, kh, :]
    x = scale * np.einsum("btnh,bsnh->bnts", q, kq)
    full = (B, N, T, S)
    if bias is not None:
        x = x + _broadcast_4d(np.asarray(bias).astype(np.float64), full)
    off = S - T if causal_alignment == "bottom_right" else 0
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, np.float64)
        slopes = np.broadcast_to(slopes.reshape((1,) * (2 - slopes.ndim) + slopes.shape), (B, N))
        x = x - slopes[:, :, None, None] * np.abs(i + off - j)[None, None]
    z = x
    if logits_soft_cap is not None:
        c = logits_soft_cap
        z = c * np.tanh(x / c)
    vis = np.ones(full, bool)
    if mask is not None:
        vis &= _broadcast_4d(mask, full)
    if is_causal:
        vis &= (j <= i + off)[None, None]
    if local_window_size is not None:
        left, right = ((local_window_size, local_window_size)
                       if np.isscalar(local_window_size) else local_window_size)
        vis &= ((j >= i + off - left) & (j <= i + off + right))[None, None]
    if q_segment_ids is not None:
        qs = np.asarray(q_segment_ids).reshape(B, T)
        ks = qs if kv_segment_ids is None else np.asarray(kv_segment_ids).reshape(B, S)
        vis &= (qs[:, None, :, None] == ks[:, None, None, :])
    if query_seq_lengths is not None:
        vis &= (i[None, None] < np.asarray(query_seq_lengths)[:, None, None, None])
    if key_value_seq_lengths is not None:
        vis &= (j[None, None] < np.asarray(key_value_seq_lengths)[:, None, None, None])
    vis &= z > -np.inf  # an additive -inf hides a key (exp(-inf) = 0)
    any_visible = vis.any(-1, keepdims=True)
    zm = np.where(vis, z, -np.inf)
    row_max = np.where(any_visible, zm.max(-1, keepdims=True, initial=-np.inf), 0.0)
    sink = None
    if sinks is not None:  # one more logit per row, with no value
        sink = np.asarray(sinks, np.float64)[None, :, None, None]
        row_max = np.where(any_visible, np.maximum(row_max, sink), sink)
    e = np.exp(np.where(vis, z - row_max, -np.inf))
    total = e.sum(-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - row_max)
    p = e / np.where(total > 0, total, 1.0)
    lse = np.where(total > 0, row_max + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    factor = np.ones(full)
    if keep is not None and dropout_rate > 0:
        factor = np.asarray(keep, np.float64) / (1.0 - dropout_rate)
    pd = p * factor
    out = np.einsum("bnts,bsnh->btnh", pd, vq)
    result = {"out": out, "lse": np.swapaxes(lse[..., 0], 1, 2)}
    if ct is not None:
        do = np.asarray(ct).astype(np.float64).reshape(out.shape)
        dlse = np.zeros((B, N, T, 1))
        if ct_lse is not None:
            dlse = np.swapaxes(np.asarray(ct_lse, np.float64).reshape(B, T, N), 1, 2)[..., None]
        dpd = np.einsum("btnh,bsnh->bnts", do, vq)
        dp = dpd * factor
        dz = p * (dp - np.sum(p * dp, -1, keepdims=True)) + p * np.where(total > 0, dlse, 0.0)
        if sink is not None:  # d lse / d sink = exp(sink - lse); out moves against it
            p_sink = np.exp(sink - lse)
            dsink = p_sink * (dlse - np.sum(p * dp, -1, keepdims=True))
            result["dsinks"] = dsink.sum(axis=(0, 2, 3))
        dx = dz
        if logits_soft_cap is not None:
            dx = dz * (1.0 - np.tanh(x / logits_soft_cap) ** 2)
        dx = np.where(vis, dx, 0.0)
        dqn = scale * np.einsum("bnts,bsnh->btnh", dx, kq)
        dkn = scale * np.einsum("bnts,btnh->bsnh", dx, q)
        dvn = np.einsum("bnts,btnh->bsnh", pd, do)
        result["dq"] = dqn
        result["dk"] = dkn.reshape(B, S, K, g, H).sum(3)
        result["dv"] = dvn.reshape(B, S, K, g, -1).sum(3)
        if bias is not None:
            result["dbias"] = _reduce_to(dx, np.shape(bias))
    if not batched:
        result = {name: (x if name == "dbias" else x[0]) for name, x in result.items()}
    return result


def oracle(inputs: dict, *, bias=None, arrays: dict | None = None, lse_grad: bool = True,
           keep=None, **static: Any) -> dict[str, np.ndarray]:
    """numpy_attention with the same calling convention as `run`."""
    arrays = dict(arrays or {})
    rate = static.pop("dropout_rate", 0.0)
    arrays.pop("dropout_rng", None)
    for runner_only in ("broadcast_dropout", "bias_grad", "block_sizes"):
        static.pop(runner_only, None)
    return numpy_attention(
        inputs["q"], inputs["k"], inputs["v"], inputs["ct"],
        inputs["ct_lse"] if lse_grad else None, bias=bias, keep=keep, dropout_rate=rate,
        **{name: (None if x is None else np.asarray(x)) for name, x in arrays.items()},
        **static)


# --------------------------------------------------------------------------- checks
def scale_of(x: np.ndarray) -> float:
    finite = np.abs(x[np.isfinite(x)])
    return max(1.0, float(finite.max()) if finite.size else 1.0)


def max_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """Max |actual - expected| over finite entries; inf entries must match exactly."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    inf = ~np.isfinite(expected)
    np.testing.assert_array_equal(actual[inf], expected[inf])
    diff = np.abs(actual[~inf] - expected[~inf])
    return float(diff.max()) if diff.size else 0.0


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: Any, kind: str,
                 name: str = "", factor: float = 1.0) -> None:
    tol = TOLERANCES[dtype_name(dtype)][kind] * factor * scale_of(expected)
    assert not np.isnan(actual).any(), f"{name}: NaN in the result"
    err = max_error(actual, expected)
    assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


def kind_of(name: str) -> str:
    return {"out": "out", "lse": "lse"}.get(name, "grad")


def assert_results_close(actual: dict, expected: dict, dtype: Any, names=None,
                         factor: float = 1.0, label: str = "") -> None:
    names = [n for n in (names or actual) if n in expected]
    for name in names:
        assert_close(actual[name], expected[name], dtype, kind_of(name), f"{label}{name}",
                     factor)


def assert_fa_rule(kernel: dict, same_dtype_ref: dict, exact: dict, dtype: Any,
                   label: str = "") -> None:
    """FlashAttention's rule: err(kernel) <= 2 * err(same-dtype reference) + floor."""
    floor = TOLERANCES[dtype_name(dtype)]["fa_floor"]
    for name in kernel:
        if name not in exact:
            continue
        assert not np.isnan(kernel[name]).any(), f"{label}{name}: NaN"
        e_kernel = max_error(kernel[name], exact[name])
        e_ref = max_error(same_dtype_ref[name], exact[name])
        bound = 2 * e_ref + floor * scale_of(exact[name])
        assert e_kernel <= bound, (
            f"{label}{name}: kernel error {e_kernel:.3g} > 2 * reference error "
            f"{e_ref:.3g} + floor (bound {bound:.3g})")


def assert_no_nan(result: dict) -> None:
    for name, x in result.items():
        assert not np.isnan(x).any(), f"NaN in {name}"


def assert_empty_rows(result: dict, empty: np.ndarray) -> None:
    """Rows with no visible key: out exactly 0, lse -inf, dq exactly 0 (where the result
    has gradients), no NaN anywhere.

    empty: bool [B, T, N] (or [T, N]) marking the empty rows.
    """
    assert_no_nan(result)
    empty = np.asarray(empty, bool)
    assert np.all(result["out"][empty] == 0.0), "out of an empty row is not exactly 0"
    assert np.all(np.isneginf(result["lse"][empty])), "lse of an empty row is not -inf"
    assert np.all(np.isfinite(result["lse"][~empty])), "lse of a visible row is not finite"
    if "dq" in result:
        assert np.all(result["dq"][empty] == 0.0), "dq of an empty row is not exactly 0"


def assert_bitwise_equal(a: dict, b: dict) -> None:
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def empty_rows(exact: dict) -> np.ndarray:
    return np.isneginf(exact["lse"])


@pytest.fixture(autouse=True)
def no_mosaic_races():
    """Fails a test whose last Mosaic GPU kernel call made the interpreter's race
    detector see a race (the Mosaic kernels ask for the detector when interpreted).
    Autouse in the test modules that import it."""
    # NOTE: JAX exposes the detector's verdict only in this private module (0.11.2).
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    yield
    try:
        races = interpret_pallas_call.get_races()
    except AssertionError:  # no kernel has run in this process yet
        return
    assert not races.races_found, "the interpreter detected a data race"


def plan_for(spec: Any, ops: Any, block_sizes: Any, *, interpret: bool = True,
             device: Any = None) -> Any:
    """The plan dot_product_attention makes for normalized arguments."""
    return dispatch.plan(dispatch.Call.of(spec, ops), block_sizes=block_sizes,
                         interpret=interpret, device=device)


def with_routes(problem: Any, **routes: Route) -> Any:
    """The problem with some roles' routes replaced."""
    return dataclasses.replace(problem, plan=dataclasses.replace(problem.plan, **routes))


def assert_needs_hopper(block_sizes: Any, match: str) -> None:
    """The routing table rejects these Mosaic tiles on an sm80 device with a ValueError
    matching `match`."""
    inputs = make_inputs(1, B=1, T=16, S=16, N=1, H=64, dtype=jnp.bfloat16)
    ampere = pallas_attn.DeviceInfo.for_capability((8, 0))
    spec, ops, _ = normalize(inputs["q"], inputs["k"], inputs["v"])
    with pytest.raises(ValueError, match=match):
        plan_for(spec, ops, block_sizes, interpret=False, device=ampere)


@dataclasses.dataclass(frozen=True)
class KernelBackward:
    """What a backward kernel takes, for one small problem: the padded q, k, v and
    operands, the Triton forward's row residuals, a random dO and its delta, and the
    caller's (T, S)."""
    problem: Any
    q: jax.Array
    k: jax.Array
    v: jax.Array
    operands: dict
    row_stats: tuple
    do: jax.Array
    delta: jax.Array
    T: int
    S: int

    @property
    def stats(self) -> jax.Array:
        """The Mosaic backward kernels' stacked row residuals."""
        return row_residuals(self.row_stats, self.delta)

    def first_entry(self) -> KernelBackward:
        """The same problem cut to its batch entry 0 (a bias shared by the batch entries
        kept whole)."""
        def cut(x):
            return x[:1]

        operands = {name: x if name == "bias" and x.shape[0] == 1 else cut(x)
                    for name, x in self.operands.items()}
        return KernelBackward(dataclasses.replace(self.problem, batch=1), cut(self.q),
                              cut(self.k), cut(self.v), operands,
                              tuple(map(cut, self.row_stats)), cut(self.do), cut(self.delta),
                              self.T, self.S)

    def triton(self, **tiles: Any) -> tuple[Any, tuple[str, ...], list]:
        """(problem whose plan runs these roles' Triton kernels with these tiles, given by
        BlockSizes field names; names, inputs) for the Triton backward kernels."""
        plan = self.problem.plan
        routes = {}
        for role, fields in TILE_FIELDS.items():
            tiles.pop(BACKEND_FIELDS[role], None)
            given = {f: tiles.pop(f) for f in fields if f in tiles}
            if given:
                old = plan.route(role)
                base = (old.block_q, old.block_k, old.num_warps or 4, old.num_stages or 1)
                routes[role] = Route("triton", *(given.get(f, b) for f, b in zip(
                    fields, base, strict=True)))
        assert not tiles, f"not BlockSizes tile fields: {tiles}"
        problem = dataclasses.replace(self.problem, plan=dataclasses.replace(plan, **routes))
        names, inputs = backward_inputs(self.q, self.k, self.v, self.operands, self.row_stats,
                                        self.do, self.delta)
        return problem, names, inputs


def random_mask(seed: int, shape: tuple, hidden_rows: tuple = ()) -> np.ndarray:
    """A boolean mask hiding about 30% of the entries, and every key of hidden_rows."""
    mask = np.random.default_rng(seed).random(shape) > 0.3
    mask[..., list(hidden_rows), :] = False
    return mask


def kernel_backward(dtype: str, shapes: dict, bias_shape: tuple | None, kwargs: dict,
                    block_sizes: Any, bias_dtype: str | None = None) -> KernelBackward:
    """A `KernelBackward` in dtype for shapes (make_inputs' arguments, head dim 64
    unless given), a random bias [*bias_shape, T, S] (in bias_dtype, default dtype) or
    none, the api's keyword arguments and these tiles (interpreted)."""

    shapes = dict(dict(H=64), **shapes)
    inputs = make_inputs(sum(shapes.values()), dtype=DTYPES[dtype], **shapes)
    T, S = shapes["T"], shapes["S"]
    bias = (random_bias(3, (*bias_shape, T, S), DTYPES[bias_dtype or dtype])
            if bias_shape is not None else None)
    spec, ops, _ = normalize(inputs["q"], inputs["k"], inputs["v"], bias, **kwargs)
    plan = plan_for(spec, ops, block_sizes)
    problems = []

    # One jitted program (the padding, the Triton forward, dO and delta): op by op, every
    # small operation would compile on its own. The problem depends on shapes alone.
    # One array for query and key segment ids (self-attention) stays one inside.
    same_ids = ops.kv_segment_ids is not None and ops.kv_segment_ids is ops.q_segment_ids

    @jax.jit
    def arrays(ops):
        if same_ids:
            ops = ops._replace(kv_segment_ids=ops.q_segment_ids)
        problem, q, k, v, differentiable, optional = vjp.prepare(spec, ops, plan)
        problems.append(problem)
        operands = {**optional, **differentiable}
        forward = problem.plan.forward
        # The Triton forward takes power-of-two tiles (the Mosaic forward's 96 gives 32).
        block_k = forward.block_k & -forward.block_k
        triton_problem = dataclasses.replace(problem, plan=dataclasses.replace(
            problem.plan, forward=Route("triton", forward.block_q, block_k, 4, 2)))
        out, row_stats = triton_fwd.forward(triton_problem, q, k, v, operands)
        do = jax.random.normal(jax.random.key(11), out.shape, out.dtype)
        delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), out.astype(jnp.float32))
        return q, k, v, operands, row_stats, do, delta

    q, k, v, operands, row_stats, do, delta = arrays(
        ops._replace(kv_segment_ids=None) if same_ids else ops)
    return KernelBackward(problems[0], q, k, v, operands, row_stats, do, delta, T, S)


def check_kernel_gradients(dtype: Any, shapes: dict, bias_shape: tuple | None, kwargs: dict,
                           block_sizes: Any) -> tuple[dict, dict]:
    """The forward and backward (`make_runner`) with these tiles, on random inputs
    (make_inputs' `shapes`, in dtype) and a random bias [*bias_shape, T, S] (bias_shape
    of four dims: that shape) or none: every result, dbias included, within
    FlashAttention's rule of the float64 oracle and close to the reference in the same
    dtype. Returns (the kernel's results, the oracle's)."""
    inputs = make_inputs(sum(shapes.values()), dtype=dtype, **shapes)
    if bias_shape is not None and len(bias_shape) == 2:
        bias_shape = (*bias_shape, shapes["T"], shapes["S"])
    bias = random_bias(5, bias_shape, dtype) if bias_shape is not None else None
    kernel, reference = pallas_and_reference(inputs, block_sizes=block_sizes,
                                             bias=bias, **kwargs)
    exact = oracle(inputs, bias=bias, **kwargs)
    if bias is not None:
        assert "dbias" in kernel and kernel["dbias"].shape == bias.shape
    assert_fa_rule(kernel, reference, exact, dtype)
    assert_results_close(kernel, reference, dtype, label="vs reference: ")
    return kernel, exact


# How the kernels appear in a jaxpr: Triton's pallas_call, the Mosaic GPU kernels' map.
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map", "core_map")


def host_primitives(jaxpr, found: set[str] | None = None) -> set[str]:
    """The primitives of a jaxpr and its sub-jaxprs outside the Pallas kernels (a `cond`
    among them makes a GPU wait for its predicate on the host)."""
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        if eqn.primitive.name in KERNEL_PRIMITIVES:
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            host_primitives(sub, found)
    return found
