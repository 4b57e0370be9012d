"""Drop-in parity with jax.nn and errors from the library, not from inside JAX: static
arguments as NumPy or JAX scalars, empty batches and sequences, NumPy inputs, second
derivatives, implementation names and dtypes the kernels do not take."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn

pytestmark = pytest.mark.timeout(300)

IMPLS = {
    "xla": dict(implementation="xla"),
    "xla_chunked": dict(implementation="xla_chunked"),
    "pallas": dict(implementation="pallas", interpret=True),
}
impls = pytest.mark.parametrize("impl", IMPLS)


def _qkv(B=2, T=8, S=12, N=2, H=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype)
                 for shape in ((B, T, N, H), (B, S, N, H), (B, S, N, H)))


@impls
def test_static_arguments_may_be_numpy_or_jax_scalars(impl):
    """jax.nn's callers write scale=1 / jnp.sqrt(H) and is_causal=np.bool_(True)."""
    q, k, v = _qkv()
    want = pallas_attn.dot_product_attention(q, k, v, scale=0.25, is_causal=True,
                                             logits_soft_cap=5.0, **IMPLS[impl])
    for scale, causal, cap in ((1 / jnp.sqrt(16.0), jnp.bool_(True), jnp.float32(5.0)),
                               (np.float32(0.25), np.bool_(True), np.int64(5)),
                               (jnp.array(0.25), jnp.array(True), np.array(5.0))):
        got = pallas_attn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                logits_soft_cap=cap, **IMPLS[impl])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["scale", "is_causal", "logits_soft_cap", "dropout_rate"])
def test_a_traced_static_argument_is_named(name):
    q, k, v = _qkv()
    value = {"is_causal": True, "dropout_rate": 0.1}.get(name, 0.5)
    extra = {"dropout_rng": jax.random.key(0)} if name == "dropout_rate" else {}

    def call(x):
        return pallas_attn.dot_product_attention(q, k, v, **{name: x}, **extra)

    with pytest.raises(TypeError, match=f"{name} must be a static .* got a traced value"):
        jax.jit(call)(value)


@impls
@pytest.mark.parametrize("shape", [(0, 8, 12), (2, 0, 12), (2, 8, 0), (0, 0, 0)],
                         ids=["B0", "T0", "S0", "all0"])
def test_empty_batches_and_sequences(impl, shape):
    """B = 0 or T = 0: empty results. S = 0: every row sees no key (output 0, lse -inf)
    and every gradient is zero. The same in every implementation."""
    B, T, S = shape
    q, k, v = _qkv(B, T, S)
    bias = jnp.ones((1, 2, T, S), jnp.float32)
    out, lse = pallas_attn.dot_product_attention(q, k, v, bias, return_residual=True,
                                                 is_causal=True, **IMPLS[impl])
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (B, T, 2)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse))

    def loss(q, k, v, bias):
        return jnp.sum(pallas_attn.dot_product_attention(q, k, v, bias, **IMPLS[impl]) ** 2)

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, x in zip(grads, (q, k, v, bias), strict=True):
        assert g.shape == x.shape and np.all(np.asarray(g) == 0)


def test_numpy_inputs_run_every_implementation():
    q, k, v = (np.asarray(x) for x in _qkv(T=40, S=40))
    want = pallas_attn.dot_product_attention(q, k, v, implementation="xla")
    for impl in IMPLS:
        got = pallas_attn.dot_product_attention(q, k, v, **IMPLS[impl])
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["pallas", "xla_chunked"])
def test_second_derivatives_are_refused_by_name(impl):
    q, k, v = _qkv()

    def loss(q):
        return jnp.sum(pallas_attn.dot_product_attention(q, k, v, **IMPLS[impl]))

    assert jax.grad(loss)(q).shape == q.shape
    with pytest.raises(NotImplementedError,
                       match=f"implementation='{impl}' has no second derivative.*'xla'"):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q)))(q)
    hessian_diag = jax.grad(lambda q: jnp.sum(jax.grad(functools.partial(
        lambda q: jnp.sum(pallas_attn.dot_product_attention(q, k, v, implementation="xla")))
    )(q)))(q)
    assert np.isfinite(hessian_diag).all()  # the reference has them


@pytest.mark.parametrize("impl", ["pallas", "xla_chunked"])
def test_forward_mode_is_refused_by_name(impl):
    q, k, v = _qkv()

    def f(q):
        return pallas_attn.dot_product_attention(q, k, v, **IMPLS[impl])

    match = f"implementation='{impl}' has no forward-mode derivative.*implementation='xla'"
    for forward in (lambda: jax.jvp(f, (q,), (q,)), lambda: jax.jacfwd(f)(q)):
        with pytest.raises(TypeError, match=match):
            forward()
    # Under jax.jit JAX stages forward mode and refuses it when compiling, with its own
    # message.
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jit(lambda q: jax.jvp(f, (q,), (q,)))(q)


def test_forward_mode_names_the_automatic_choice():
    """On the CPU the default turns blockwise from some size on: the refusal says so."""
    q, k, v = _qkv(T=1024, S=1024)

    def f(q):
        return pallas_attn.dot_product_attention(q, k, v, is_causal=True)

    with pytest.raises(TypeError, match="implementation='xla_chunked' \\(chosen "
                                        "automatically: no NVIDIA GPU"):
        jax.jvp(f, (q,), (q,))


def test_cudnn_names_the_kernels_instead():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="implementation='cudnn' names jax.nn's cuDNN path.*"
                                         "implementation='pallas'"):
        pallas_attn.dot_product_attention(q, k, v, implementation="cudnn")


def test_float64_inputs_in_the_kernels_name_the_dtype():
    with jax.enable_x64(True):
        q, k, v = _qkv(dtype=jnp.float64)
        with pytest.raises(ValueError, match="kernels take bfloat16, float16, float32 inputs, "
                                             "got float64; use implementation='xla'"):
            pallas_attn.dot_product_attention(q, k, v, implementation="pallas", interpret=True)
        out = pallas_attn.dot_product_attention(q, k, v)  # the CPU default: the reference
        assert out.dtype == jnp.float64


def test_huge_overridden_tiles_are_clamped_to_the_sequences():
    """BlockSizes(block_q=2**20) in the interpreter: tiles no longer than the sequences
    (no allocation of 2**20 rows)."""
    q, k, v = _qkv()
    blocks = pallas_attn.BlockSizes(block_q=2**20, block_k=2**20, block_q_dq=2**20)
    plan = pallas_attn.explain(q, k, v, interpret=True, block_sizes=blocks)
    assert max(r.block_q for r in (plan.forward, plan.dq, plan.dkdv)) == 16
    got = pallas_attn.dot_product_attention(q, k, v, interpret=True, block_sizes=blocks)
    want = pallas_attn.dot_product_attention(q, k, v, implementation="xla")
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_the_version_is_public():
    assert isinstance(pallas_attn.__version__, str) and pallas_attn.__version__.count(".") == 2


@impls
def test_a_nan_in_a_visible_key_shows_in_the_rows_that_see_it(impl):
    """Causal: key 3 is NaN; rows 0-2 do not see it and keep their values, every row
    from 3 on gives NaN in its output and logsumexp (not 0 and -inf, the marks of a row
    that sees no key)."""
    q, k, v = _qkv(T=8, S=8)
    bad = k.at[:, 3, 0, 5].set(jnp.nan)
    clean_out, clean_lse = pallas_attn.dot_product_attention(
        q, k, v, is_causal=True, return_residual=True, **IMPLS[impl])
    out, lse = pallas_attn.dot_product_attention(q, bad, v, is_causal=True,
                                                 return_residual=True, **IMPLS[impl])
    np.testing.assert_array_equal(out[:, :3], clean_out[:, :3])
    np.testing.assert_array_equal(lse[:, :3], clean_lse[:, :3])
    assert np.isnan(np.asarray(out[:, 3:, 0])).all() and np.isnan(np.asarray(lse[:, 3:, 0])).all()
    assert np.isfinite(np.asarray(out[:, :, 1])).all()  # head 1 reads kv head 1


@pytest.mark.parametrize("impl", ["xla", "xla_chunked"])
@pytest.mark.parametrize("where", ["key_nan", "key_minus_inf", "value_inf"])
def test_a_nonfinite_key_that_every_row_sees_makes_every_row_nan(impl, where):
    """No masking: key 5 of kv head 0 holds a NaN key entry, a -inf key entry whose logit
    is -inf (positive queries), or an inf value: every row of heads 0 and 1 (kv head 0)
    gives NaN in every output column, its logsumexp and dq; kv head 1 stays finite."""
    q, k, v = _qkv(T=8, S=12)
    q = jnp.abs(q)
    k, v = {"key_nan": (k.at[:, 5, 0, 1].set(jnp.nan), v),
            "key_minus_inf": (k.at[:, 5, 0, 1].set(-jnp.inf), v),
            "value_inf": (k, v.at[:, 5, 0, 1].set(jnp.inf))}[where]

    def loss(q):
        out, lse = pallas_attn.dot_product_attention(q, k, v, return_residual=True,
                                                     **IMPLS[impl])
        return jnp.sum(out), (out, lse)

    (_, (out, lse)), dq = jax.value_and_grad(loss, has_aux=True)(q)
    group = q.shape[2] // k.shape[2]
    seen, other = slice(0, group), slice(group, None)
    for x in (out, lse, dq):
        assert np.isnan(np.asarray(x[:, :, seen])).all()
        assert np.isfinite(np.asarray(x[:, :, other])).all()


@pytest.mark.parametrize("impl", ["xla", "xla_chunked"])  # the kernels: test_hidden_keys.py
@pytest.mark.parametrize("hidden", ["mask", "causal_future", "other_segment", "window"])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_nonfinite_hidden_keys_never_change_a_result(impl, hidden, cap):
    """NaN keys and inf values at key 9, which the caller hid from every row (a masked
    column, a causally future key, a segment no query has, outside every window), and
    NaN in that column of a bias: the output, logsumexp and every gradient, the bias's
    included, equal those of clean inputs bit for bit (the hidden key's own dK, dV and
    dbias are 0 either way), with a soft cap too (whose derivative there meets the
    hidden entries' zero gradient)."""
    q, k, v = _qkv(T=8, S=12)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((2, 1, 8, 12)), jnp.float32)
    kwargs = {"mask": dict(mask=jnp.ones((2, 1, 8, 12), bool).at[..., 9].set(False)),
              "causal_future": dict(is_causal=True),
              "other_segment": dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32),
                                    kv_segment_ids=jnp.zeros((2, 12), jnp.int32).at[:, 9].set(2)),
              "window": dict(local_window_size=(2, 0))}[hidden]

    def results(k, v, bias):
        def loss(q, k, v, bias):
            out, lse = pallas_attn.dot_product_attention(
                q, k, v, bias, return_residual=True, logits_soft_cap=cap, **kwargs,
                **IMPLS[impl])
            return jnp.sum(out * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        (_, aux), grads = step(q, k, v, bias)
        return [np.asarray(x) for x in (*aux, *grads)]

    dirty = results(k.at[:, 9].set(jnp.nan), v.at[:, 9].set(jnp.inf),
                    bias.at[..., 9].set(jnp.nan))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dbias"), dirty,
                               results(k, v, bias), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_the_kernels_on_a_machine_without_a_gpu_say_what_to_do():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="implementation='pallas' runs the kernels on an NVIDIA "
                                         "GPU.*interpret=True.*lowering_for"):
        pallas_attn.dot_product_attention(q, k, v, implementation="pallas")
    with pytest.raises(TypeError, match="lowering_for takes a pallas_attn.DeviceInfo"):
        with pallas_attn.device.lowering_for("sm90"):
            pass
    # Inside lowering_for the plan is the GPU's: here, the Mosaic kernels of an H100.
    with pallas_attn.device.lowering_for(pallas_attn.DeviceInfo()):
        plan = pallas_attn.explain(*_qkv(T=256, S=256, H=128, dtype=jnp.bfloat16),
                                   implementation="pallas")
    assert plan.forward.backend == "mosaic" and plan.programs == 132


X64_FEATURES = dict(
    is_causal=True, causal_alignment="bottom_right", local_window_size=(20, 3),
    logits_soft_cap=8.0, query_seq_lengths=np.array([30, 21]),
    key_value_seq_lengths=np.array([40, 17]), dropout_rate=0.2, bias=True, segments=True)


@pytest.mark.parametrize("impl,features", [
    ("xla", X64_FEATURES), ("xla_chunked", X64_FEATURES), ("pallas", X64_FEATURES)])
def test_jax_enable_x64_changes_no_result(impl, features):
    """With jax_enable_x64 on (Python ints become int64) every implementation runs and
    gives what it gives with it off: outputs, lse and every gradient (the Mosaic kernels
    under x64: test_ring.py's blocks)."""
    B, T, S, N, K, H = 2, 30, 40, 4, 2, 16
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    ct = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    kwargs = dict(features)
    bias = None
    if kwargs.pop("bias", False):
        bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32)
    if kwargs.pop("segments", False):
        kwargs["q_segment_ids"] = np.repeat(np.arange(3), 10)[None].repeat(B, 0)
        kwargs["kv_segment_ids"] = np.repeat(np.arange(4), 10)[None].repeat(B, 0)
    if kwargs.get("dropout_rate"):
        kwargs["dropout_rng"] = jax.random.key(3)
    kwargs.update(IMPLS[impl])

    def run():
        def loss(q, k, v, bias):
            out, lse = pallas_attn.dot_product_attention(q, k, v, bias, return_residual=True,
                                                         **kwargs)
            return jnp.sum(out * ct), (out, lse)

        argnums = (0, 1, 2) + ((3,) if bias is not None else ())
        grads, (out, lse) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(
            q, k, v, bias)
        return [out, lse, *grads]

    want = run()
    with jax.enable_x64(True):
        got = run()
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=1e-6, atol=1e-6)


def test_float64_under_x64_in_the_jnp_paths():
    """float64 inputs (jax_enable_x64) run in 'xla' and 'xla_chunked' (accumulating in
    float32, as for every input dtype) and give float64 results."""
    with jax.enable_x64(True):
        q, k, v = _qkv(T=50, S=70, dtype=jnp.float64)
        ct = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float64)

        def grads(impl):
            def loss(q, k, v):
                out = pallas_attn.dot_product_attention(q, k, v, is_causal=True,
                                                        local_window_size=(9, 2),
                                                        implementation=impl)
                return jnp.sum(out * ct)
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

        for x, y in zip(grads("xla_chunked"), grads("xla"), strict=True):
            assert x.dtype == jnp.float64
            np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5)
