"""The Hopper (Mosaic GPU) dK/dV kernel in the Mosaic GPU interpreter.

The interpreter simulates the kernel's three warpgroups, barriers, bulk copies and
wgmma on CPU, fills the outputs with NaN before the kernel runs (a tile the kernel
never writes shows up as NaN) and runs its race detector. Two persistent programs
loop over several units, some of them outside the causal/window band (zeros,
nothing streamed) and some crossed by it.

The kernel is checked two ways: alone, against the Triton dK/dV and dbias kernels
(Pallas interpreter) on the same row residuals, over its whole padded outputs; and
through dot_product_attention, against the float64 oracle, with every gradient.
The bulk copies' reduce-add that sums a batch-shared bias's dS tiles on the GPU is
the one part the interpreter cannot run (it has no reduce-add copies); there the
kernel adds through registers. The GPU checks in BENCHMARKS.md cover that path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import (  # no_mosaic_races: an autouse fixture
    DTYPES,
    alternate_dtypes,
    assert_close,
    assert_needs_hopper,
    check_kernel_gradients,
    kernel_backward,
    make_inputs,
    no_mosaic_races,  # noqa: F401
    plan_for,
    random_mask,
)

import pallas_attn
from pallas_attn.kernels.mosaic import dkv as mosaic_dkv
from pallas_attn.kernels.mosaic.common import lengths_of, mask_of, segments_of
from pallas_attn.kernels.triton import dbias as triton_dbias
from pallas_attn.kernels.triton import dkdv as triton_dkdv
from pallas_attn.spec import normalize

# Small Triton tiles around the Mosaic dK/dV kernel's (64, 128) tiles.
MOSAIC_DKV = pallas_attn.BlockSizes(32, 32, 64, 128, 32, 32, block_q_dbias=32,
                                    block_k_dbias=32, num_stages_dkv=2,
                                    dkv_backend="mosaic")
TRITON_TILES = dict(block_q_dkv=32, block_k_dkv=32, dkv_backend="triton")
WIDE = dict(block_k_dkv=64)  # the wide kernel's (64, 64) tiles at a head dim of 256

# (id, shapes, bias shape as (Bb, Nb) or None, kwargs, tiles)
CASES = [
    # A batch-shared bias's gradient in three passes, with a boolean mask (int8 tiles per
    # step and consumer, queries by keys at d64 too), one per batch entry hiding whole rows
    # under causal GQA.
    ("batch_shared_bias_three_passes_mask_per_batch_causal_gqa_empty_rows",
     dict(B=3, T=140, S=200, N=4, K=2), (1, 4),
     dict(is_causal=True, mask=random_mask(8, (3, 1, 140, 200), hidden_rows=(3, 130))), {}),
    # One slot (num_stages_dkv=1).
    ("bottom_right_T>S_H128_no_grad_bias_one_slot", dict(B=2, T=200, S=100, N=2, H=128),
     (1, 2), dict(is_causal=True, causal_alignment="bottom_right"),
     dict(bias_grad=False, num_stages_dkv=1)),
    # A float32 bias at head dim 128: two slots do not fit beside its tiles, so the
    # routing table gives it one (its gradient is the separate dbias kernel's).
    ("float32_bias_H128_one_slot", dict(B=2, T=130, S=200, N=2, H=128), (1, 2),
     dict(is_causal=True), dict(bias_grad=False, num_stages_dkv=1, bias_dtype="float32")),
    # Packed documents (each unit's query tiles narrow to its keys' documents) with a
    # per-batch bias's gradient (tiles outside them zero) under causal masking, ragged;
    # a per-batch mask on top (tiles inside the band but not seen whole compare ids and
    # read the mask).
    # Dropout beside the fused dbias: dS stays the true one there (elsewhere dropout's
    # 1 / (1 - rate) scales dK and dV once, `common.tile_gradient`'s gain_later).
    ("segments_packed_causal_bias_mask_dropout", dict(B=2, T=200, S=200, N=2), (2, 2),
     dict(is_causal=True, q_segment_ids=np.repeat(np.arange(5), 40)[None].repeat(2, 0),
          mask=random_mask(8, (2, 1, 200, 200), hidden_rows=(3, 130)), dropout_rate=0.2,
          dropout_rng=jax.random.key(8)), {}),
    ("wide_Hv256_lengths_dropout_alibi", dict(B=2, T=130, S=200, N=2, H=64, Hv=256), None,
     dict(is_causal=True, query_seq_lengths=np.array([130, 70]),
          key_value_seq_lengths=np.array([150, 200]), dropout_rate=0.2,
          dropout_rng=jax.random.key(5), alibi_slopes=jnp.array([0.3, 0.05])), WIDE),
    # Head dim 64 without a bias or ALiBi: every tile computed keys by queries (S^T =
    # K Q^T, `config.dkv_keys_major`): windows, a soft cap, ragged lengths (a batch
    # entry with no key: its dK and dV zero) and dropout (per (batch entry, head) masks)
    # under GQA.
    ("keys_major_window_soft_cap_lengths_dropout_gqa", dict(B=3, T=150, S=200, N=4, K=2),
     None,
     dict(local_window_size=(40, 10), logits_soft_cap=5.0,
          query_seq_lengths=np.array([150, 30, 100]),
          key_value_seq_lengths=np.array([0, 200, 131]), dropout_rate=0.2,
          dropout_rng=jax.random.key(3)), {}),
    # Head dim 256: units of 64 keys that the consumers share (`config.is_wide`), each
    # with half of S, dP and the head dims; the whole dS tile copied as dbias.
    ("wide_H256_per_batch_bias_causal", dict(B=2, T=130, S=200, N=2, H=256), (2, 2),
     dict(is_causal=True), WIDE),
    # Head dim 256 without a bias: two slots leave no room for dropout's hash tables,
    # so each consumer hashes its positions in registers (`config.with_hash_tables`).
    ("wide_H256_dropout_hashed_in_registers", dict(B=2, T=130, S=200, N=2, H=256), None,
     dict(is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(7)), WIDE),
    # A mask per head and no bias: the mask reaches only the scores, every key is marked
    # for the repair (none with finite inputs), rows hidden whole, T != S.
    ("mask_per_head_no_bias_T!=S", dict(B=2, T=100, S=150, N=2), None,
     dict(mask=random_mask(3, (1, 2, 100, 150), hidden_rows=(7,))), {}),
    # Head dim 256 with a mask per batch entry: the consumers read their tiles of it from
    # global memory (two slots leave no room to stage them); rows hidden whole, GQA.
    ("wide_H256_mask_per_batch_causal_gqa_empty_rows",
     dict(B=2, T=130, S=200, N=4, K=2, H=256), None,
     dict(is_causal=True, mask=random_mask(4, (2, 1, 130, 200), hidden_rows=(3, 100))), WIDE),
    ("wide_H192_Hv64_gqa_window_soft_cap_shared_bias",
     dict(B=2, T=100, S=140, N=4, K=2, H=192, Hv=64), (1, 4),
     dict(local_window_size=(40, 10), logits_soft_cap=5.0), WIDE),
]


def _kernel_outputs(dtype: str, shapes: dict, bias_shape: tuple | None, kwargs: dict,
                    blocks: dict) -> tuple[dict, dict, tuple]:
    """(Mosaic, Triton) dk, dv and dbias over the padded arrays, from the Triton
    forward's residuals and a random dO, and the caller's (T, S)."""
    blocks = dict(blocks)
    bias_grad = blocks.pop("bias_grad", True) and bias_shape is not None
    bias_dtype = blocks.pop("bias_dtype", None)
    x = kernel_backward(dtype, shapes, bias_shape, kwargs,
                        dataclasses.replace(MOSAIC_DKV, **blocks), bias_dtype=bias_dtype)
    bias = x.operands.get("bias")
    *mosaic, marks = mosaic_dkv.dkdv(x.problem, x.q, x.k, x.v, x.do, x.stats, bias, bias_grad,
                                     x.operands.get("alibi_slopes"),
                                     segments=segments_of(x.operands, "query_ranges"),
                                     lengths=lengths_of(x.operands),
                                     dropout_keys=x.operands.get("dropout_keys"),
                                     mask=mask_of(x.operands))
    # With a mask or ids and no bias gradient, every key is marked, and none holds NaN
    # (finite inputs: the repair never runs).
    assert (marks is None) == (x.problem.plan.dkdv.repair is None or bias_grad)
    if marks is not None:
        assert marks.shape[:2] == (x.k.shape[0], x.k.shape[2]) and marks.shape[3] == x.k.shape[1]
        assert not np.isnan(np.asarray(marks)).any()
    triton_args = x.triton(**TRITON_TILES)
    triton = (*triton_dkdv.dkdv(*triton_args)[:2],
              triton_dbias.dbias(*triton_args, bias) if bias_grad else None)
    as_dict = (lambda xs: {name: np.asarray(x, np.float32)
                           for name, x in zip(("dk", "dv", "dbias"), xs, strict=True)
                           if x is not None})
    return as_dict(mosaic), as_dict(triton), (x.T, x.S)


@pytest.mark.parametrize("dtype,shapes,bias_shape,kwargs,blocks", alternate_dtypes(CASES))
def test_mosaic_dkv_matches_the_triton_kernels(dtype, shapes, bias_shape, kwargs, blocks):
    mosaic, triton, (T, S) = _kernel_outputs(dtype, shapes, bias_shape, kwargs, blocks)
    assert mosaic.keys() == triton.keys()
    eps = float(jnp.finfo(DTYPES[dtype]).eps)
    for name, x in mosaic.items():
        # Every element of the padded outputs is written (the interpreter poisons
        # them with NaN), the padding included.
        assert not np.isnan(x).any(), name
        ref = triton[name]
        if name == "dbias":
            x, ref = x[..., :T, :S], ref[..., :T, :S]
            # A batch-shared bias: each pass's addition rounds to the bias dtype.
            steps = shapes["B"] if bias_shape[0] == 1 else 1
        else:
            x, ref = x[:, :S], ref[:, :S]
            steps = 1
        assert np.abs(ref).max() > 0.1, name
        # Both sum float32 products over the same tiles in another order, then round
        # to the output dtype (once per pass for dbias).
        tol = (steps + 1) * eps * np.abs(ref).max()
        np.testing.assert_allclose(x, ref, rtol=0, atol=tol, err_msg=name)


@pytest.mark.parametrize("shapes,kwargs", [
    (dict(B=3, T=100, S=260, N=2, K=1), dict(is_causal=True, local_window_size=(40, 10),
                                            logits_soft_cap=5.0)),
], ids=["causal_three_entries_gqa_window_soft_cap"])
def test_mosaic_dkv_adds_the_other_entries_to_dbias_first(shapes, kwargs):
    """dbias_first (batch entry 0's dbias, here the Triton dbias kernel's): the kernel
    adds entries 1.. (two of them) to it, giving the whole batch's dbias, and the same
    dk and dv; under a causal window and a soft cap (GQA)."""
    x = kernel_backward("bfloat16", shapes, (1, shapes["N"]), kwargs, MOSAIC_DKV)
    bias = x.operands["bias"]
    tiles = dict(block_q_dbias=32, block_k_dbias=32)
    first = triton_dbias.dbias(*x.first_entry().triton(**tiles), bias)
    args = (x.problem, x.q, x.k, x.v, x.do, x.stats, bias, True,
            x.operands.get("alibi_slopes"))
    dk, dv, dbias, _ = mosaic_dkv.dkdv(*args, dbias_first=first)
    dk0, dv0, _, _ = mosaic_dkv.dkdv(*args)
    for a, b in ((dk, dk0), (dv, dv0)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    T, S = x.T, x.S
    expected = np.asarray(triton_dbias.dbias(*x.triton(**tiles), bias), np.float32)[..., :T, :S]
    dbias = np.asarray(dbias, np.float32)[..., :T, :S]
    tol = (shapes["B"] + 1) * float(jnp.finfo(jnp.bfloat16).eps) * np.abs(expected).max()
    np.testing.assert_allclose(dbias, expected, rtol=0, atol=tol)


@pytest.mark.parametrize("bias_shape,first_shape", [((2, 2), (2, 2)), ((1, 2), (1, 1))],
                         ids=["per_batch_bias", "wrong_shape"])
def test_dbias_first_only_starts_a_batch_shared_sum_of_its_shape(bias_shape, first_shape):
    x = kernel_backward("bfloat16", dict(B=2, T=64, S=128, N=2), bias_shape, {}, MOSAIC_DKV)
    bias = x.operands["bias"]
    first = jnp.zeros((*first_shape, *bias.shape[2:]), bias.dtype)
    with pytest.raises(AssertionError,
                       match="mosaic.dkv.dkdv takes dbias_first only for a bias shared by 2 batch"):
        mosaic_dkv.dkdv(x.problem, x.q, x.k, x.v, x.do, x.stats, bias, True,
                        dbias_first=first)


@pytest.mark.parametrize("shapes,bias_shape,kwargs", [
    (dict(B=2, T=70, S=200, N=2, H=48), (2, 2), dict(logits_soft_cap=8.0,
                                                     local_window_size=(60, 20))),
    (dict(B=1, T=100, S=130, N=2, H=80, Hv=64), None, {}),
    # A batch-shared bias under MQA, ALiBi and bottom-right causal masking, T > S: rows
    # that see no key.
    (dict(B=2, T=150, S=140, N=2, K=1, H=64), (1, 2),
     dict(alibi_slopes=jnp.array([0.2, 0.04]), is_causal=True,
          causal_alignment="bottom_right")),
    (dict(B=1, T=200, S=260, N=2, H=64), None,
     dict(q_segment_ids=np.repeat(np.arange(4), 50)[None],
          kv_segment_ids=np.repeat(np.arange(4), 65)[None])),
    (dict(B=2, T=200, S=260, N=2, K=1, H=256), (1, 2),
     dict(is_causal=True, q_segment_ids=np.repeat(np.arange(4), 50)[None].repeat(2, 0),
          kv_segment_ids=np.repeat(np.arange(4), 65)[None].repeat(2, 0))),
    # A mask per key and head (each consumer's keys read per step), keys by queries,
    # causal GQA, ragged.
    (dict(B=2, T=130, S=200, N=4, K=2, H=64), None,
     dict(is_causal=True, mask=random_mask(7, (2, 4, 1, 200)))),
    # Head dim 32 (64-byte swizzled tiles) keys by queries, causal with a soft cap, MQA.
    (dict(B=2, T=100, S=150, N=2, K=1, H=32), None,
     dict(is_causal=True, logits_soft_cap=8.0)),
    # A bias per key and head with a key padding mask (both read per step from global
    # memory): dbias from dS's column sums per head, causal GQA, ragged.
    (dict(B=2, T=130, S=200, N=4, K=2, H=64), (2, 4, 1, 200),
     dict(is_causal=True, mask=random_mask(9, (2, 1, 1, 200)))),
    # The wide kernel (units of 64 keys both consumers share) with a bias per key shared
    # by the batch entries and heads: the sums over both, under a window, MQA.
    (dict(B=2, T=100, S=140, N=2, K=1, H=256), (1, 1, 1, 140),
     dict(local_window_size=(40, 10))),
    # A bias and a mask broadcast along keys (the step's rows read from global memory;
    # dbias from the separate kernel), a soft cap (the bias's gradient is not zero),
    # causal GQA; a mask per row alone, keys by queries at head dim 32.
    (dict(B=2, T=130, S=200, N=4, K=2, H=64), (2, 4, 130, 1),
     dict(is_causal=True, logits_soft_cap=5.0, mask=random_mask(3, (2, 1, 130, 1)))),
    (dict(B=2, T=100, S=150, N=2, K=1, H=32), None,
     dict(is_causal=True, mask=random_mask(4, (2, 1, 100, 1)))),
], ids=["per_batch_window_soft_cap_H48", "no_bias_H80_Hv64",
        "alibi_batch_shared_bias_bottom_right_mqa", "packed_cross_attention",
        "wide_H256_packed_gqa_shared_bias", "mask_per_key_and_head_keys_major_gqa",
        "keys_major_H32_causal_soft_cap_mqa", "bias_per_key_and_head_padding_mask_gqa",
        "wide_H256_bias_per_key_shared_window_mqa", "bias_and_mask_per_row_soft_cap_gqa",
        "mask_per_row_keys_major_H32_mqa"])
def test_gradients_with_the_mosaic_dkv_against_reference_and_float64(shapes, bias_shape,
                                                                     kwargs):
    blocks = MOSAIC_DKV
    if max(shapes["H"], shapes.get("Hv", 0)) > 128:
        blocks = dataclasses.replace(MOSAIC_DKV, **WIDE)
    check_kernel_gradients(jnp.bfloat16, shapes, bias_shape, kwargs, blocks)


@pytest.mark.parametrize("blocks", [
    MOSAIC_DKV, dataclasses.replace(MOSAIC_DKV, block_q_dq=128, block_k_dq=64,
                                    dq_backend="mosaic")], ids=["zeros", "mosaic_dq_first"])
def test_batch_shared_dbias_under_vmap(blocks):
    """vmap over an extra leading axis: the buffer the batch sum goes into (zeros, or
    the Mosaic dQ kernel's batch entry 0) is a mutable operand of the kernel; every
    vmapped slice gets its own sum, as in the reference."""
    keys = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(keys[0], (2, 2, 64, 2, 64), jnp.bfloat16)
    k, v = (jax.random.normal(x, (2, 2, 128, 2, 64), jnp.bfloat16) for x in keys[1:3])
    bias = jax.random.normal(keys[3], (2, 1, 2, 64, 128), jnp.bfloat16)
    ct = jax.random.normal(keys[4], q.shape, jnp.float32)

    def grads(**kwargs):
        def loss(q, k, v, bias):
            out = jax.vmap(lambda *x: pallas_attn.dot_product_attention(
                *x, is_causal=True, **kwargs))(q, k, v, bias)
            return jnp.sum(out.astype(jnp.float32) * ct)
        return [np.asarray(g, np.float64)
                for g in jax.jit(jax.grad(loss, argnums=(1, 3)))(q, k, v, bias)]

    (dk, dbias), (ref_dk, ref_dbias) = (
        grads(implementation="pallas", interpret=True, block_sizes=blocks),
        grads(implementation="xla"))
    assert_close(dbias, ref_dbias, jnp.bfloat16, "grad", "dbias")
    assert_close(dk, ref_dk, jnp.bfloat16, "grad", "dk")


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=jnp.float32), "dkv_backend='mosaic'.*bfloat16 or float16"),
    (dict(bias=(2, 1, 16, 16), fuse_dbias=True), "fuse_dbias=True with the Mosaic dK/dV"),
    (dict(bias_dtype=jnp.float32, fuse_dbias=True), "Mosaic dK/dV kernel needs a bias"),
])
def test_unsupported_problems_name_the_reason(kwargs, match):
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    inputs = make_inputs(1, B=2, T=16, S=16, N=2, H=kwargs.pop("H", 64), dtype=dtype)
    bias = jnp.zeros(kwargs.pop("bias", (1, 2, 16, 16)), kwargs.pop("bias_dtype", dtype))
    blocks = dataclasses.replace(MOSAIC_DKV, fuse_dbias=kwargs.pop("fuse_dbias", None))
    if "mask" in kwargs:
        kwargs["mask"] = jnp.ones(kwargs["mask"], bool)
    with pytest.raises(ValueError, match=match):
        pallas_attn.dot_product_attention(inputs["q"], inputs["k"], inputs["v"], bias,
                                          interpret=True, block_sizes=blocks, **kwargs)


@pytest.mark.parametrize("bias_shape,bias_dtype,fused", [
    ((1, 2), jnp.bfloat16, True), ((2, 2), jnp.bfloat16, True),
    ((2, 1), jnp.bfloat16, False), ((1, 1), jnp.bfloat16, False),
    ((1, 2), jnp.float32, False),
])
def test_the_mosaic_dkv_kernel_writes_the_dbias_it_can(bias_shape, bias_dtype, fused):
    """fuse_dbias=None: the Mosaic dK/dV kernel writes dbias for a [B or 1, N, T, S]
    bias in the inputs' dtype; other biases get the separate dbias kernel."""
    inputs = make_inputs(1, B=2, T=16, S=16, N=2, H=64, dtype=jnp.bfloat16)
    spec, ops, _ = normalize(inputs["q"], inputs["k"], inputs["v"],
                             jnp.zeros((*bias_shape, 16, 16), bias_dtype))
    plan = plan_for(spec, ops, MOSAIC_DKV)
    assert plan.dbias.fused is fused
    # A batch-shared sum in no fixed order only when asked, and only where there is one.
    assert not plan.dbias.any_order
    free = plan_for(spec, ops, dataclasses.replace(MOSAIC_DKV, deterministic=False))
    assert free.dbias.any_order is (fused and bias_shape[0] == 1)
    assert ("no fixed order" in str(free)) is free.dbias.any_order


@pytest.mark.parametrize("fields,match", [
    (dict(block_q_dkv=32), r"\(block_q_dkv, block_k_dkv\) = \(64, 128\)"),
    (dict(block_k_dkv=64), r"\(block_q_dkv, block_k_dkv\) = \(64, 128\)"),
])
def test_the_routing_table_checks_the_mosaic_dkv_tiles(fields, match):
    inputs = make_inputs(1, B=1, T=16, S=16, N=1, H=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=f"dkv_backend='mosaic' does not cover.*{match}"):
        pallas_attn.explain(inputs["q"], inputs["k"], inputs["v"], interpret=True,
                            block_sizes=dataclasses.replace(MOSAIC_DKV, **fields))


def test_mosaic_dkv_needs_a_hopper_gpu():
    assert_needs_hopper(MOSAIC_DKV, "dkv_backend='mosaic' does not cover this call: needs an")
