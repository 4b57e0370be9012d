"""The Hopper (Mosaic GPU) dQ kernel in the Mosaic GPU interpreter.

The interpreter simulates the kernel's three warpgroups, the consumers' turns,
barriers, bulk copies and wgmma on CPU, fills the output with NaN before the
kernel runs (a tile the kernel never writes shows up as NaN) and runs its race
detector. Two persistent programs loop over several items, with bands that skip
leading key tiles, consumers whose bands differ and rows that see no key.

The kernel is checked two ways: alone, against the Triton dQ kernel (Pallas
interpreter) on the same row residuals, over its whole padded output; and through
dot_product_attention, against the float64 oracle, with every gradient.
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
    assert_empty_rows,
    assert_needs_hopper,
    check_kernel_gradients,
    empty_rows,
    kernel_backward,
    make_inputs,
    no_mosaic_races,  # noqa: F401
    random_mask,
    run,
)

import pallas_attn
from pallas_attn.kernels import mosaic_head_dim, padded_head_dim, vjp
from pallas_attn.kernels.core import Problem, logit_scores
from pallas_attn.kernels.mosaic import dq as mosaic_dq
from pallas_attn.kernels.mosaic.common import lengths_of, mask_of, segments_of
from pallas_attn.kernels.triton import dbias as triton_dbias
from pallas_attn.kernels.triton import dq as triton_dq

# Small Triton tiles around the Mosaic dQ kernel's (128, 64) tiles.
MOSAIC_DQ = pallas_attn.BlockSizes(32, 32, 32, 32, 128, 64, block_q_dbias=32,
                                   block_k_dbias=32, num_stages_dq=2, dq_backend="mosaic")

WIDE = dict(block_q_dq=64)  # the wide kernel's (64, 64) tiles at a head dim of 256

# (id, shapes, bias shape as (Bb, Nb) or None, kwargs, tiles)
CASES = [
    # A boolean mask (int8 tiles per consumer): one per head with a per-batch bias and a
    # soft cap at d128 (two consumers, turns), Hv 64, under bottom-right causal masking
    # with T > S; one per batch entry hiding whole rows under bottom-right causal masking
    # with ragged sequence lengths (one batch entry with no query, one whose keys end
    # inside the first tile; three consumers).
    ("mask_per_head_per_batch_bias_soft_cap_bottom_right_T>S_H128_Hv64",
     dict(B=2, T=200, S=100, N=2, H=128, Hv=64), (2, 2),
     dict(mask=random_mask(9, (1, 2, 200, 100), hidden_rows=(170,)), logits_soft_cap=5.0,
          is_causal=True, causal_alignment="bottom_right"), {}),
    ("mask_per_batch_lengths_causal_bottom_right_T>S_empty_rows", dict(B=3, T=200, S=150, N=1),
     None,
     dict(is_causal=True, causal_alignment="bottom_right",
          mask=random_mask(8, (3, 1, 200, 150), hidden_rows=(3, 130)),
          query_seq_lengths=np.array([200, 0, 77]), key_value_seq_lengths=np.array([5, 150, 99])),
     {}),
    # Dropout: per (batch entry, head) masks under causal GQA with ALiBi slopes per batch
    # entry and head (three consumers); one shared mask with a bias under a soft cap and
    # a window, three slots (two consumers).
    ("causal_gqa_alibi_per_batch_dropout", dict(B=2, T=250, S=150, N=2, K=1), None,
     dict(is_causal=True, alibi_slopes=jnp.array([[0.5, 0.125], [0.03, 0.7]]),
          dropout_rate=0.2, dropout_rng=jax.random.key(3)), {}),
    ("dropout_shared_bias_soft_cap_window_3_slots", dict(B=1, T=140, S=260, N=2), (1, 2),
     dict(logits_soft_cap=5.0, local_window_size=(90, 30), dropout_rate=0.3,
          dropout_rng=jax.random.key(4), broadcast_dropout=True), dict(num_stages_dq=3)),
    # Packed documents (each consumer's key tiles narrow to its rows' documents) with
    # three consumers, the first item starting before row 0; a per-batch mask on top
    # (tiles inside the band but not seen whole compare ids and read the mask).
    ("segments_packed_causal_mask", dict(B=2, T=200, S=200, N=2), None,
     dict(is_causal=True, q_segment_ids=np.repeat(np.arange(5), 40)[None].repeat(2, 0),
          mask=random_mask(6, (2, 1, 200, 200), hidden_rows=(3, 130))), {}),
    # Head dim 192 (Hv 64), the wide kernel: items of 64 rows that both consumers share
    # (`config.is_wide`), each with half of every tile's keys and half of dQ's columns;
    # with packed documents, lengths, dropout and ALiBi. (Head dim 256 with a bias tile
    # of each consumer's keys: test_gradients_with_the_mosaic_dq_against_reference_and_
    # float64's wide_H256_with_mosaic_dkv_shared_bias.)
    # Head dim 256 with a mask per head: each consumer's keys of the tile's mask land in
    # the ring with K; bottom-right causal, T > S, rows hidden whole.
    ("wide_H256_mask_per_head_bottom_right_T>S_empty_rows",
     dict(B=2, T=200, S=150, N=2, H=256), None,
     dict(is_causal=True, causal_alignment="bottom_right",
          mask=random_mask(5, (1, 2, 200, 150), hidden_rows=(120,))), WIDE),
    ("wide_H192_Hv64_features", dict(B=2, T=250, S=250, N=2, H=192, Hv=64), None,
     dict(is_causal=True, q_segment_ids=np.repeat(np.arange(5), 50)[None].repeat(2, 0),
          key_value_seq_lengths=np.array([180, 250]), dropout_rate=0.2,
          dropout_rng=jax.random.key(5), alibi_slopes=jnp.array([0.3, 0.05])), WIDE),
]


def _kernel_outputs(dtype: str, shapes: dict, bias_shape: tuple | None, kwargs: dict,
                    blocks: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """(Mosaic dq, Triton dq) over the padded arrays, from the Triton forward's
    residuals and a random dO, and the caller's T."""
    x = kernel_backward(dtype, shapes, bias_shape, kwargs,
                        dataclasses.replace(MOSAIC_DQ, **blocks))
    mosaic, marks = mosaic_dq.dq(
        x.problem, x.q, x.k, x.v, x.do, x.stats, x.operands.get("bias"),
        x.operands.get("alibi_slopes"), segments_of(x.operands, "key_ranges"),
        lengths_of(x.operands), x.operands.get("dropout_keys"), mask_of(x.operands))
    triton = triton_dq.dq(*x.triton(block_q_dq=32, block_k_dq=32, dq_backend="triton"))
    assert mosaic.shape == x.q.shape and mosaic.dtype == x.q.dtype
    # Where keys can be hidden, every row is marked, and none holds NaN (finite inputs).
    assert (marks is None) == (x.problem.plan.dq.repair is None)
    if marks is not None:
        assert marks.shape[:2] == (x.q.shape[0], x.q.shape[2]) and marks.shape[3] == x.q.shape[1]
        assert not np.isnan(np.asarray(marks)).any()
    return np.asarray(mosaic, np.float32), np.asarray(triton, np.float32), x.T


@pytest.mark.parametrize("dtype,shapes,bias_shape,kwargs,blocks", alternate_dtypes(CASES))
def test_mosaic_dq_matches_the_triton_dq_kernel(dtype, shapes, bias_shape, kwargs, blocks):
    mosaic, triton, T = _kernel_outputs(dtype, shapes, bias_shape, kwargs, blocks)
    # Every element of the padded output is written (the interpreter poisons it with
    # NaN), the padding included.
    assert not np.isnan(mosaic).any()
    mosaic, triton = mosaic[:, :T], triton[:, :T]
    assert np.abs(triton).max() > 0.1
    # Both sum float32 products over the same keys in other tiles, then round once.
    tol = 2 * float(jnp.finfo(DTYPES[dtype]).eps) * np.abs(triton).max()
    np.testing.assert_allclose(mosaic, triton, rtol=0, atol=tol)
    if kwargs.get("causal_alignment") == "bottom_right":
        # Rows that see no key (T > S, bottom-right causal) have zero gradient.
        S = shapes["S"]
        assert np.all(mosaic[:, : T - S] == 0.0)


@pytest.mark.parametrize("shapes,kwargs", [
    (dict(B=2, T=200, S=150, N=2, K=1),
     dict(is_causal=True, causal_alignment="bottom_right",
          alibi_slopes=jnp.array([[0.5, 0.125], [0.03, 0.7]]))),
], ids=["causal_gqa_alibi_per_batch_bottom_right_T>S_empty_rows"])
def test_dq_and_dbias_stores_batch_entry_0s_dbias(shapes, kwargs):
    """dq_and_dbias: the same dq as dq, and a dbias of the shared bias's shape that
    matches the Triton dbias kernel's for batch entry 0 alone, with every tile written
    (the interpreter poisons it with NaN): dS inside each item's band (tiles outside a
    consumer's own rows' band run masked), zeros outside it (the producer)."""
    x = kernel_backward("bfloat16", shapes, (1, shapes["N"]), kwargs, MOSAIC_DQ)
    bias, slopes = x.operands["bias"], x.operands.get("alibi_slopes")
    args = (x.problem, x.q, x.k, x.v, x.do, x.stats, bias, slopes)
    dq_with, dbias, _ = mosaic_dq.dq_and_dbias(*args)
    np.testing.assert_array_equal(np.asarray(dq_with, np.float32),
                                  np.asarray(mosaic_dq.dq(*args)[0], np.float32))
    dbias = np.asarray(dbias, np.float32)
    assert dbias.shape == bias.shape and not np.isnan(dbias).any()
    T, S = x.T, x.S
    assert np.all(dbias[..., :T, S:] == 0.0)  # padded keys
    expected = np.asarray(triton_dbias.dbias(
        *x.first_entry().triton(block_q_dbias=32, block_k_dbias=32), bias), np.float32)
    dbias, expected = dbias[..., :T, :S], expected[..., :T, :S]
    assert np.abs(expected).max() > 0.1
    if kwargs.get("is_causal"):
        assert np.sum(dbias == 0.0) > dbias.size // 4  # the zeros outside the band
    tol = 2 * float(jnp.finfo(jnp.bfloat16).eps) * np.abs(expected).max()
    np.testing.assert_allclose(dbias, expected, rtol=0, atol=tol)


def test_dq_and_dbias_needs_a_batch_shared_bias():
    x = kernel_backward("bfloat16", dict(B=2, T=64, S=128, N=2), (2, 2), {}, MOSAIC_DQ)
    bias = x.operands["bias"]
    with pytest.raises(AssertionError, match="cannot write the dbias of a bfloat16 bias "
                                             r"of shape \(2, 2,"):
        mosaic_dq.dq_and_dbias(x.problem, x.q, x.k, x.v, x.do, x.stats, bias)


def test_logit_scores_takes_a_row_shift_only_in_log2_units():
    """The backward's row reference folds into the scores only without a bias or cap."""
    x = kernel_backward("bfloat16", dict(B=1, T=16, S=16, N=1), None,
                        dict(logits_soft_cap=5.0), MOSAIC_DQ)
    tile = jnp.ones((16, 16), jnp.float32)
    with pytest.raises(AssertionError, match="row_shift needs log2 units"):
        logit_scores(x.problem, tile, None, None, row_shift=tile)
    plain = dataclasses.replace(x.problem, spec=dataclasses.replace(x.problem.spec,
                                                                    logits_soft_cap=None))
    shifted, _ = logit_scores(plain, tile, None, None, row_shift=tile)
    np.testing.assert_allclose(shifted, logit_scores(plain, tile, None, None)[0] - 1.0)


# The Mosaic dQ and dK/dV kernels together: a batch-shared bias's dbias starts as the
# dQ kernel's batch entry 0 (`mosaic_dq.dq_and_dbias`).
MOSAIC_DQ_DKV = dataclasses.replace(MOSAIC_DQ, block_q_dkv=64, block_k_dkv=128,
                                    dkv_backend="mosaic")
MOSAIC_DQ_DKV_WIDE = dataclasses.replace(MOSAIC_DQ_DKV, block_k_dkv=64, **WIDE)
# Every role on a Mosaic kernel: head dims pad to multiples of 32 above 128
# (`Plan.head_dims`).
MOSAIC_ALL_WIDE = dataclasses.replace(MOSAIC_DQ_DKV_WIDE, block_q=128, block_k=64,
                                      forward_backend="mosaic")
MOSAIC_ALL = dataclasses.replace(MOSAIC_DQ_DKV, block_q=128, block_k=128,
                                 forward_backend="mosaic")


@pytest.mark.parametrize("shapes,bias_shape,kwargs,blocks", [
    (dict(B=2, T=200, S=100, N=2, K=1, H=80, Hv=64), (1, 2),
     dict(is_causal=True, causal_alignment="bottom_right", logits_soft_cap=8.0,
          alibi_slopes=jnp.array([0.2, 0.04])), MOSAIC_DQ),
    (dict(B=3, T=150, S=200, N=2, H=64), (1, 2),
     dict(local_window_size=(60, 20), alibi_slopes=jnp.array([0.2, 0.04])), MOSAIC_DQ_DKV),
    (dict(B=2, T=100, S=200, N=2, K=1, H=256), (1, 2),
     dict(is_causal=True, logits_soft_cap=8.0), MOSAIC_DQ_DKV_WIDE),
    (dict(B=2, T=100, S=150, N=2, K=1, H=160, Hv=136), (1, 2),
     dict(is_causal=True, logits_soft_cap=8.0), MOSAIC_ALL_WIDE),
    (dict(B=2, T=100, S=150, N=2, K=1, H=8, Hv=24), (1, 2),
     dict(is_causal=True, logits_soft_cap=8.0), MOSAIC_ALL),
    (dict(B=2, T=100, S=150, N=2, K=1, H=112, Hv=104), (1, 2),
     dict(is_causal=True, logits_soft_cap=8.0), MOSAIC_ALL),
    # A bias and a mask per key (rows read per key tile; dbias from the Triton dK/dV
    # kernel), GQA, bottom-right causal T > S (rows that see no key).
    (dict(B=2, T=150, S=120, N=4, K=2, H=64), (2, 4, 1, 120),
     dict(is_causal=True, causal_alignment="bottom_right",
          mask=random_mask(6, (2, 1, 1, 120))), MOSAIC_DQ),
    # A bias with one entry per head and a mask per row (the consumer's rows read from
    # global memory), sinks (so the bias's gradient is not zero), causal GQA.
    (dict(B=2, T=150, S=120, N=4, K=2, H=64), (1, 4, 1, 1),
     dict(is_causal=True, sinks=jnp.array([0.5, -1.0, 2.0, 0.0]),
          mask=random_mask(8, (2, 1, 150, 1))), MOSAIC_DQ),
    # A bias per row, its gradient summed from the dQ kernel's row sums: under a soft cap
    # (P dP summed apart), causal GQA; one shared by the batch entries at head dim 256
    # (each wide consumer's keys summed apart) with a window. (With dropout and a mask:
    # test_features.py's mask_dropout_bias_per_row.)
    (dict(B=2, T=150, S=120, N=4, K=2, H=64), (2, 4, 150, 1),
     dict(is_causal=True, logits_soft_cap=6.0), MOSAIC_DQ),
    (dict(B=2, T=100, S=150, N=2, K=1, H=256), (1, 2, 100, 1),
     dict(local_window_size=(40, 30)), MOSAIC_DQ_DKV_WIDE),
    # With ragged segment ids (tiles that compare ids, rows narrowed to their segment).
    (dict(B=2, T=150, S=150, N=2, H=64), (2, 1, 150, 1),
     dict(q_segment_ids=np.repeat(np.arange(4), [20, 50, 47, 33])[None].repeat(2, 0)),
     MOSAIC_DQ),
], ids=["shared_bias_soft_cap_alibi_mqa_bottom_right_empty_rows_H80_Hv64",
        "with_mosaic_dkv_shared_bias_window_alibi",
        "wide_H256_with_mosaic_dkv_shared_bias", "all_mosaic_H160_Hv136_padded_to_160",
        "all_mosaic_H8_Hv24_padded_to_16_32", "all_mosaic_H112_Hv104_padded_to_112",
        "bias_and_mask_per_key_bottom_right_gqa",
        "bias_one_entry_mask_per_row_sinks_gqa", "bias_per_row_soft_cap_gqa",
        "wide_H256_bias_per_row_window", "bias_per_row_segments"])
def test_gradients_with_the_mosaic_dq_against_reference_and_float64(shapes, bias_shape,
                                                                    kwargs, blocks,
                                                                    monkeypatch):
    calls, row_calls = [], []
    chained, rows = mosaic_dq.dq_and_dbias, mosaic_dq.dq_and_score_rows
    monkeypatch.setattr(mosaic_dq, "dq_and_dbias",
                        lambda *a: calls.append(1) or chained(*a))
    monkeypatch.setattr(mosaic_dq, "dq_and_score_rows",
                        lambda *a: row_calls.append(1) or rows(*a))
    padded = []
    prepare = vjp.prepare
    monkeypatch.setattr(vjp, "prepare",
                        lambda *a: (lambda r: padded.append(r[1].shape[3]) or r)(prepare(*a)))
    kernel, exact = check_kernel_gradients(jnp.bfloat16, shapes, bias_shape, kwargs, blocks)
    assert_empty_rows(kernel, empty_rows(exact))
    every_role = blocks in (MOSAIC_ALL_WIDE, MOSAIC_ALL)
    assert set(padded) == {(mosaic_head_dim if every_role else padded_head_dim)(shapes["H"])}
    # The dbias chain runs exactly where both kernels are Mosaic and the bias has its own
    # keys; the row sums exactly where it is broadcast along them.
    along_keys = len(bias_shape) == 4 and bias_shape[3] == 1
    assert len(calls) == (blocks is not MOSAIC_DQ and not along_keys)
    assert len(row_calls) == along_keys


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=jnp.float32), "dq_backend='mosaic'.*bfloat16 or float16"),
])
def test_unsupported_problems_name_the_reason(kwargs, match):
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    inputs = make_inputs(1, B=2, T=16, S=16, N=2, H=kwargs.pop("H", 64), dtype=dtype)
    if "mask" in kwargs:
        kwargs["mask"] = jnp.ones(kwargs["mask"], bool)
    with pytest.raises(ValueError, match=match):
        pallas_attn.dot_product_attention(inputs["q"], inputs["k"], inputs["v"],
                                          interpret=True, block_sizes=MOSAIC_DQ, **kwargs)


@pytest.mark.parametrize("fields,match", [
    (dict(block_q_dq=64), r"\(block_q_dq, block_k_dq\) = \(128, 64\)"),
    (dict(block_k_dq=128), r"\(block_q_dq, block_k_dq\) = \(128, 64\)"),
    (dict(num_stages_dq=1), "num_stages_dq >= 2"),
])
def test_the_routing_table_checks_the_mosaic_dq_tiles(fields, match):
    inputs = make_inputs(1, B=1, T=16, S=16, N=1, H=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=f"dq_backend='mosaic' does not cover.*{match}"):
        pallas_attn.explain(inputs["q"], inputs["k"], inputs["v"], interpret=True,
                            block_sizes=dataclasses.replace(MOSAIC_DQ, **fields))


def test_mosaic_dq_needs_a_hopper_gpu():
    assert_needs_hopper(MOSAIC_DQ, "dq_backend='mosaic' does not cover this call: needs an sm90")


def test_the_kernel_cases_run_both_consumer_counts():
    """The interpreter cases cover three consumers (with a first item that starts
    before row 0: 192 does not divide the padded length) and two (with turns)."""
    counts = set()
    for _, shapes, bias_shape, kwargs, blocks in CASES:
        q_pad = -(-shapes["T"] // 128) * 128
        inputs = make_inputs(1, dtype=jnp.bfloat16, **dict(dict(H=64), **shapes))
        bias = (None if bias_shape is None
                else jnp.zeros((*bias_shape, shapes["T"], shapes["S"]), jnp.bfloat16))
        plan = pallas_attn.explain(inputs["q"], inputs["k"], inputs["v"], bias, interpret=True,
                                   block_sizes=dataclasses.replace(MOSAIC_DQ, **blocks),
                                   **kwargs)
        counts.add(plan.dq.consumers)
        assert plan.dq.consumers == 2 or q_pad % 192 != 0
        assert plan.dq.consumers == 2 or blocks is not WIDE
    assert counts == {2, 3}


@pytest.mark.parametrize("blocks", [
    pallas_attn.BlockSizes(32, 32, 32, 32, 32, 32, block_q_dbias=32, block_k_dbias=32),
    dataclasses.replace(MOSAIC_DQ_DKV, forward_backend="mosaic", block_q=128, block_k=64,
                        num_stages=2),
], ids=["triton", "mosaic"])
def test_alibi_float_positions_match_the_integer_fallback(blocks, monkeypatch):
    """ALiBi positions as float32 (`Problem.exact_float_positions`, every length below
    2**24) and as integers (the fallback above) are the same exact distances: the
    forward and every gradient agree to a bfloat16 rounding (two programs: not compared
    bitwise), in the Triton kernels and in the Mosaic forward, dK/dV and dQ (with an
    offset: bottom-right causal, T > S)."""
    inputs = make_inputs(61, B=1, T=120, S=100, N=1, H=64, dtype=jnp.bfloat16)
    kwargs = dict(block_sizes=blocks, arrays={"alibi_slopes": jnp.array([0.3])},
                  is_causal=True, causal_alignment="bottom_right")
    as_floats = run("pallas", inputs, **kwargs)
    monkeypatch.setattr(Problem, "exact_float_positions", property(lambda self: False))
    as_integers = run("pallas", inputs, **kwargs)
    assert np.isfinite(as_floats["dq"]).all() and np.abs(as_floats["dk"]).max() > 0
    for name, x in as_floats.items():
        scale = max(1.0, float(np.abs(x[np.isfinite(x)]).max()))
        np.testing.assert_allclose(as_integers[name], x, rtol=0, atol=2 ** -8 * scale,
                                   err_msg=name)
