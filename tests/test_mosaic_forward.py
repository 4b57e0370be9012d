"""The Hopper (Mosaic GPU) forward kernel in the Mosaic GPU interpreter.

The interpreter simulates the kernel's three warpgroups, its barriers, the bulk
copies and wgmma on CPU, fills every buffer it allocates, outputs included, with
NaN (a tile the kernel never writes shows up as NaN), and runs its race detector.
It launches two persistent programs (tuning.persistent_programs), so programs loop
over several items, some rounds with an item for only one of them. The backward is the
Triton kernels' (Pallas interpreter), fed with this forward's row residuals, so
the gradients check that those residuals mean what the Triton forward's mean.

Shapes are small but span several 128-row programs and key tiles, with ragged
tails, rows that see no key, windows that skip leading key tiles (consumers that
release slots they never read) and warpgroups whose bands differ.
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
    assert_fa_rule,
    assert_needs_hopper,
    assert_results_close,
    empty_rows,
    keep_mask,
    make_inputs,
    no_mosaic_races,  # noqa: F401
    oracle,
    pallas_and_reference,
    plan_for,
    random_bias,
    random_mask,
    with_routes,
)

import pallas_attn
from pallas_attn.kernels import vjp
from pallas_attn.kernels.mosaic import fwd as mosaic_fwd
from pallas_attn.kernels.triton import fwd as triton_fwd
from pallas_attn.plan import Route
from pallas_attn.spec import normalize

# Mosaic forward (128 query rows per program); small Triton backward tiles.
MOSAIC = pallas_attn.BlockSizes(128, 64, 32, 32, 32, 32, block_q_dbias=32, block_k_dbias=32,
                                num_stages=2, forward_backend="mosaic")

CASES = [
    ("causal_window_bottom_right_T<S", dict(B=2, T=100, S=260, N=1, H=48),
     dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(70, 0)),
     dict(num_stages=3)),
    ("causal_gqa_H80_Hv128_block_k128_3_slots", dict(B=1, T=256, S=256, N=4, K=2, H=80,
                                                    Hv=128),
     dict(is_causal=True), dict(block_k=128, num_stages=3)),
    # A boolean mask per head with a bias and a soft cap at d128 (two consumers, 64-key
    # tiles), an explicit scale; Hv 64: the output in a buffer of its own.
    ("mask_per_head_bias_soft_cap_scale_H128_Hv64_separate_output_buffer",
     dict(B=1, T=140, S=200, N=2, H=128, Hv=64),
     dict(mask=random_mask(9, (1, 2, 140, 200), hidden_rows=(70,)),
          bias=((1, 2, 140, 200), None), logits_soft_cap=5.0, scale=0.1), {}),
    # A bias and a mask per key (rows read per key tile, no tiles staged: three
    # consumers at d64), causal GQA, batch entry 1 hiding every key past 120.
    ("bias_and_mask_per_key_causal_gqa", dict(B=2, T=150, S=200, N=4, K=2, H=64),
     dict(is_causal=True, bias=((2, 4, 1, 200), None),
          mask=random_mask(4, (2, 1, 1, 200)) & (np.arange(200) < [[[[200]]], [[[120]]]])),
     dict(block_k=128)),
    # A bias and a mask broadcast along keys (each consumer's rows read from global
    # memory, no tiles staged: three consumers at d64, the first item before row 0),
    # GQA, rows the mask hides whole; then one entry per head and per batch entry
    # (batch entry 1 hidden whole) under causal masking.
    ("bias_and_mask_per_row_gqa", dict(B=2, T=150, S=200, N=4, K=2, H=64),
     dict(bias=((2, 4, 150, 1), None), mask=random_mask(5, (2, 1, 150, 1))),
     dict(block_k=128)),
    ("bias_per_head_mask_per_batch_one_entry_causal", dict(B=2, T=150, S=140, N=2, H=128),
     dict(is_causal=True, bias=((1, 2, 1, 1), None),
          mask=np.array([True, False]).reshape(2, 1, 1, 1)), {}),
    # Head dims 16 and 32 (32- and 64-byte swizzled tiles), three consumers, 128-key
    # tiles, a mask and a soft cap, MQA.
    ("H16_Hv32_mask_soft_cap_three_consumers", dict(B=1, T=150, S=200, N=2, K=1, H=16,
                                                    Hv=32),
     dict(mask=random_mask(3, (1, 1, 150, 200)), logits_soft_cap=5.0), dict(block_k=128)),
    # Head dim 256: 64-key tiles, the output staged in Q's buffer (its own would not fit);
    # bottom-right causal with T > S (rows that see no key).
    ("H256_causal_output_staged_in_q", dict(B=1, T=260, S=200, N=2, H=200, Hv=256),
     dict(is_causal=True, causal_alignment="bottom_right"), {}),
    # Unsorted segment ids of their own for queries and keys (nothing skipped, every tile
    # compared), T < S with a bias.
    ("segments_unsorted_bias_T<S", dict(B=1, T=140, S=260, N=2, H=64),
     dict(q_segment_ids=np.random.default_rng(1).integers(0, 3, (1, 140)),
          kv_segment_ids=np.random.default_rng(2).integers(0, 3, (1, 260)),
          bias=((1, 2, 140, 260), None)), dict(block_k=128)),
    # A bias (natural-unit scores, loaded into registers per key tile) in float32 with
    # rows of extreme biases: far below zero, -inf everywhere (no visible key) or every
    # third key. (One per batch entry, shared by the heads, under causal masking:
    # test_features.py's bias_shared_by_heads on the Mosaic backend; one per head in the
    # inputs' dtype with a soft cap on top: the cases above and below.)
    ("bias_extreme_rows", dict(B=1, T=140, S=150, N=2, H=64),
     dict(bias=((1, 2, 140, 150), "extreme")), {}),
    # ALiBi (an iota term with the head's slope, read from global memory per item):
    # slopes per head with a bias and a soft cap over a window (natural units, then the
    # cap); slopes per batch entry and head (log2-unit scores) under causal GQA, with
    # dropout (per (batch entry, head) masks) and ragged lengths.
    ("alibi_bias_soft_cap_window", dict(B=1, T=140, S=260, N=2, H=64),
     dict(alibi_slopes=jnp.array([0.3, 0.05]), bias=((1, 2, 140, 260), None),
          logits_soft_cap=5.0, local_window_size=(90, 30)), dict(block_k=128)),
    ("alibi_per_batch_dropout_causal_gqa_lengths", dict(B=2, T=200, S=150, N=2, K=1, H=64),
     dict(is_causal=True, alibi_slopes=jnp.array([[0.5, 0.125], [0.03, 0.7]]),
          dropout_rate=0.2, dropout_rng=jax.random.key(3),
          key_value_seq_lengths=np.array([150, 90])), {}),
    # Sequence lengths: ragged per batch entry (one of them past the padded tiles'
    # first key tile, one row of queries whose length is 0), causal bottom-right; with
    # a boolean mask (int8 tiles streamed per consumer), one per batch entry, hiding
    # whole rows (three consumers, a head's first item before row 0).
    ("lengths_mask_per_batch_causal_bottom_right_empty_rows", dict(B=3, T=200, S=260, N=2,
                                                                    H=64),
     dict(is_causal=True, causal_alignment="bottom_right",
          query_seq_lengths=np.array([200, 70, 0]), key_value_seq_lengths=np.array([5, 260, 131]),
          mask=random_mask(8, (3, 1, 200, 260), hidden_rows=(3, 130))),
     {}),
    # Three consumers (head dim 64, no bias: items of 192 rows): T = 200 pads to 256, so
    # each head's first item starts at row -128 and two of its consumers only release
    # the ring's slots; with sorted segments of their own for queries and keys (the idle
    # consumers' bands), dropout, ALiBi and a small soft cap under bottom-right causal
    # masking; two batch entries, so that the programs' items cross from one to the next.
    ("three_consumers_first_item_before_row_0_segments_dropout_alibi_soft_cap",
     dict(B=2, T=200, S=230, N=2, H=64),
     dict(is_causal=True, causal_alignment="bottom_right", dropout_rate=0.2,
          logits_soft_cap=5.0,
          dropout_rng=jax.random.key(6), alibi_slopes=jnp.array([0.3, 0.05]),
          q_segment_ids=np.repeat(np.arange(4), 50)[None].repeat(2, 0),
          kv_segment_ids=np.concatenate([np.repeat(np.arange(4), 50),
                                         np.full(30, 3)])[None].repeat(2, 0)),
     {}),
    # Dropout with one mask shared by every head, a bias, a soft cap and packed documents
    # (sorted, one array for queries and keys: the item's and each consumer's key tiles
    # narrow to their documents) under a boolean mask (tiles not seen whole compare ids
    # and read the mask).
    ("dropout_shared_bias_soft_cap_segments_mask", dict(B=1, T=260, S=260, N=2, H=64),
     dict(dropout_rate=0.3, dropout_rng=jax.random.key(4), broadcast_dropout=True,
          bias=((1, 2, 260, 260), None), logits_soft_cap=5.0,
          q_segment_ids=np.repeat(np.arange(4), 65)[None],
          mask=random_mask(7, (1, 1, 260, 260))), dict(block_k=128)),
    # Head dim 192 with values of 128: 96-key tiles (the routing table's where every
    # role is a Mosaic kernel, swizzled in rows of 32 columns), the last one past the
    # keys' padding (256), whose keys only the scores' bound hides (no causal mask);
    # dropout's hashes over 96 keys, GQA.
    ("H192_Hv128_96_key_tiles_past_the_padding", dict(B=2, T=140, S=256, N=4, K=2, H=192,
                                                      Hv=128),
     dict(dropout_rate=0.2, dropout_rng=jax.random.key(8)),
     dict(block_k=None, block_q_dkv=None, block_k_dkv=None, block_q_dq=None,
          block_k_dq=None, dq_backend="mosaic", dkv_backend="mosaic")),
]


def _with_bias(kwargs: dict, dtype: str) -> dict:
    """kwargs with a random bias array in place of its (shape, dtype) description:
    dtype None is the inputs' dtype; "extreme" is float32 with rows 3 and 70 near
    -1e4, row 5 at -inf and every third key of row 9 at -inf."""
    if "bias" not in kwargs:
        return kwargs
    shape, bias_dtype = kwargs["bias"]
    bias = np.asarray(random_bias(7, shape), np.float32) * 2.0
    if bias_dtype == "extreme":
        bias[..., [3, 70], :] -= 1e4
        bias[..., 5, :] = -np.inf
        bias[..., 9, ::3] = -np.inf
        bias_dtype = "float32"
    return dict(kwargs, bias=jnp.asarray(bias, DTYPES[bias_dtype or dtype]))


def _with_keep_mask(kwargs: dict, shapes: dict) -> dict:
    """The oracle's kwargs: dropout's rng replaced by the keep mask it draws."""
    if "dropout_rng" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    keep = keep_mask(
        kwargs.pop("dropout_rng"), batch=shapes["B"], num_heads=shapes["N"],
        q_len=shapes["T"], kv_len=shapes["S"], rate=kwargs["dropout_rate"],
        broadcast_batch_heads=kwargs.get("broadcast_dropout", False))
    return dict(kwargs, keep=keep)


@pytest.mark.parametrize("dtype,shapes,kwargs,blocks", alternate_dtypes(CASES))
def test_mosaic_forward_against_reference_and_float64(dtype, shapes, kwargs, blocks):
    inputs = make_inputs(sum(shapes.values()), dtype=DTYPES[dtype], **shapes)
    kwargs = _with_bias(kwargs, dtype)
    block_sizes = dataclasses.replace(MOSAIC, **blocks)
    dtypes = {}
    # The forward's outputs alone: its residuals feed the backward in
    # test_gradients_through_the_mosaic_forward_match_the_triton_forward and every
    # all-Mosaic gradient test.
    kernel, reference = pallas_and_reference(inputs, dtypes=dtypes, block_sizes=block_sizes,
                                             grads=False, **kwargs)
    exact = oracle(inputs, **_with_keep_mask(kwargs, shapes))
    assert dtypes["out"] == DTYPES[dtype] and dtypes["lse"] == jnp.float32
    assert_fa_rule(kernel, reference, exact, DTYPES[dtype])
    assert_results_close(kernel, reference, DTYPES[dtype], label="vs reference: ")
    assert_empty_rows(kernel, empty_rows(exact))
    if kwargs.get("causal_alignment") == "bottom_right" and shapes["T"] > shapes["S"]:
        assert empty_rows(exact).sum() > 0


def test_head_dim_64_cases_run_three_consumers():
    """The cases above at head dim 64 without a bias tile (none, or one per key) run the
    three-consumer forward."""
    for _, shapes, kwargs, blocks in CASES:
        bias_tiles = "bias" in kwargs and 1 not in kwargs["bias"][0][2:]
        if shapes.get("H") != 64 or shapes.get("Hv", 64) != 64 or bias_tiles:
            continue
        inputs = make_inputs(0, dtype=jnp.bfloat16, **shapes)
        plan = pallas_attn.explain(inputs["q"], inputs["k"], inputs["v"], interpret=True,
                                   block_sizes=dataclasses.replace(MOSAIC, **blocks))
        assert plan.forward.consumers == 3, (shapes, plan.forward)


def test_the_head_dim_192_case_runs_96_key_tiles_past_the_padding():
    name, shapes, kwargs, blocks = next(c for c in CASES if c[0].startswith("H192_Hv128"))
    problem, *_ = _padded_call(shapes, kwargs, dataclasses.replace(MOSAIC, **blocks))
    assert problem.plan.head_dims == (192, 128)
    assert problem.plan.forward.block_k == 96 and problem.kv_pad == 256


def _padded_call(shapes: dict, kwargs: dict, blocks: pallas_attn.BlockSizes):
    inputs = make_inputs(5, dtype=jnp.bfloat16, **shapes)
    spec, ops, _ = normalize(inputs["q"], inputs["k"], inputs["v"], **kwargs)
    problem, q, k, v, _, _ = vjp.prepare(spec, ops, plan_for(spec, ops, blocks))
    return problem, q, k, v


def test_every_output_element_and_residual_is_written():
    """Whole padded outputs, padded rows included: no NaN left from the interpreter's
    poisoned buffers, and the same outputs and residuals as the Triton forward.
    Three causal query tiles, the first with no visible key at all."""
    problem, q, k, v = _padded_call(dict(B=1, T=300, S=90, N=2, K=1, H=64),
                                    dict(is_causal=True, causal_alignment="bottom_right"),
                                    MOSAIC)
    assert (problem.q_pad, problem.kv_pad) == (384, 128)
    out, (row_max, log2_sum) = jax.jit(lambda q, k, v: mosaic_fwd.forward(problem, q, k, v, {}))(
        q, k, v)
    triton = with_routes(problem, forward=Route("triton", 32, 32, 4, 2))
    ref_out, (ref_max, ref_sum) = jax.jit(
        lambda q, k, v: triton_fwd.forward(triton, q, k, v, {}))(q, k, v)
    for name, x in (("out", out), ("row_max", row_max), ("log2_sum", log2_sum)):
        assert not np.isnan(np.asarray(x, np.float32)).any(), f"unwritten {name}"
    # Rows past the length and rows that see no key: reference +inf, log2 sum 0.
    np.testing.assert_array_equal(np.isinf(row_max), np.isinf(ref_max))
    assert np.isinf(row_max[:, :, 300:]).all() and np.all(log2_sum[:, :, 300:] == 0)
    finite = np.isfinite(ref_max)
    lse = np.asarray(problem.logsumexp(row_max, log2_sum))
    ref_lse = np.asarray(problem.logsumexp(ref_max, ref_sum))
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               atol=2e-2)


def test_finfo_min_bias_rows_match_the_triton_forward():
    """Rows whose every logit is finfo.min (a bias hiding padding): a uniform softmax,
    as in the Triton forward (float32 rounding absorbs q.k there, so both are compared
    to each other rather than to float64), in the bias's natural units."""
    shapes = dict(B=1, T=140, S=150, N=2, H=64)
    bias = np.array(random_bias(9, (1, 2, 140, 150)), np.float32)
    bias[:, :, [2, 77, 139], :] = np.finfo(np.float32).min
    inputs = make_inputs(6, dtype=jnp.bfloat16, **shapes)
    spec, ops, _ = normalize(inputs["q"], inputs["k"], inputs["v"], jnp.asarray(bias))
    problem, q, k, v, differentiable, _ = vjp.prepare(spec, ops, plan_for(spec, ops, MOSAIC))
    out, (row_max, log2_sum) = jax.jit(lambda q, k, v, b: mosaic_fwd.forward(
        problem, q, k, v, {"bias": b}))(q, k, v, differentiable["bias"])
    triton = with_routes(problem, forward=Route("triton", 32, 32, 4, 2))
    ref_out, (ref_max, ref_sum) = jax.jit(lambda q, k, v, b: triton_fwd.forward(
        triton, q, k, v, {"bias": b}))(q, k, v, differentiable["bias"])
    np.testing.assert_allclose(np.asarray(row_max)[:, :, :140], np.asarray(ref_max)[:, :, :140],
                               rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(log2_sum)[:, :, :140],
                               np.asarray(ref_sum)[:, :, :140], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float32)[:, :140],
                               np.asarray(ref_out, np.float32)[:, :140], atol=2e-2)
    uniform = np.asarray(inputs["v"], np.float32)[0].mean(0)  # [N, H]
    np.testing.assert_allclose(np.asarray(out, np.float32)[0, 77], uniform, atol=2e-2)


def test_gradients_through_the_mosaic_forward_match_the_triton_forward():
    """Same residual contract: gradients through the Mosaic forward equal those through
    the Triton forward up to the forwards' rounding of out (used in delta)."""
    inputs = make_inputs(3, B=1, T=128, S=128, N=2, H=64, dtype=jnp.float16)

    def grads(block_sizes):
        def loss(q, k, v):
            out = pallas_attn.dot_product_attention(q, k, v, is_causal=True, interpret=True,
                                                    block_sizes=block_sizes)
            return jnp.sum(out.astype(jnp.float32) * inputs["ct"].astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(inputs["q"], inputs["k"], inputs["v"])

    mosaic = grads(MOSAIC)
    triton = grads(dataclasses.replace(MOSAIC, forward_backend="triton", block_q=64))
    for a, b in zip(mosaic, triton, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=4e-3, rtol=4e-3)


# ----------------------------------------------------------------- what it refuses
@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=jnp.float32), "bfloat16 or float16"),
])
def test_unsupported_problems_name_the_reason(kwargs, match):
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    H = kwargs.pop("H", 64)
    inputs = make_inputs(1, B=1, T=16, S=16, N=1, H=H, dtype=dtype)
    bias_shape = kwargs.pop("bias", None)
    bias = None if bias_shape is None else jnp.zeros(bias_shape, dtype)
    if "mask" in kwargs:
        kwargs["mask"] = jnp.ones(kwargs["mask"], bool)
    with pytest.raises(ValueError, match=f"forward_backend='mosaic'.*{match}"):
        pallas_attn.dot_product_attention(inputs["q"], inputs["k"], inputs["v"], bias,
                                          interpret=True, block_sizes=MOSAIC, **kwargs)


@pytest.mark.parametrize("fields,match", [
    (dict(block_q=64), "block_q=128"),
    (dict(block_k=32), "block_k in"),
    (dict(num_stages=1), "num_stages >= 2"),
])
def test_the_routing_table_checks_the_mosaic_forward_tiles(fields, match):
    inputs = make_inputs(1, B=1, T=16, S=16, N=1, H=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=f"forward_backend='mosaic' does not cover.*{match}"):
        pallas_attn.explain(inputs["q"], inputs["k"], inputs["v"], interpret=True,
                            block_sizes=dataclasses.replace(MOSAIC, **fields))


def test_block_sizes_validate_the_backend_names():
    with pytest.raises(ValueError, match="forward_backend must be None or one of"):
        pallas_attn.BlockSizes(forward_backend="cuda")


def test_mosaic_needs_a_hopper_gpu():
    assert_needs_hopper(MOSAIC, "needs an sm90")


@pytest.mark.parametrize("tiles, heads, programs", [
    (256, 16, 132),  # B1 T32768 N16: heaviest-first round-robin was 1.5x out of balance
    (64, 16, 132), (32, 16, 132), (32, 64, 132), (33, 7, 132), (5, 3, 2), (1, 3, 2)])
def test_causal_items_run_once_each_in_balanced_mirror_pairs(tiles, heads, programs):
    """The Mosaic forward's and dQ kernel's causal walk: every (head, query tile) item
    exactly once, and no program's causal work (rank r sees tiles - r key tiles, plus a
    fixed cost per item) more than one pair above the mean."""
    from pallas_attn.kernels.mosaic.common import work_order, work_rounds
    rounds = work_rounds(tiles, heads, programs, paired=True)
    r, pid = (jnp.asarray(x, jnp.int32) for x in np.meshgrid(
        np.arange(rounds + 1), np.arange(programs), indexing="ij"))
    valid, rank, head = (np.asarray(x) for x in work_order(r, pid, tiles, heads, programs,
                                                           paired=True))
    assert not valid[rounds].any()
    valid, rank, head = valid[:rounds], rank[:rounds], head[:rounds]
    items = sorted(zip(head[valid].tolist(), rank[valid].tolist(), strict=True))
    assert items == [(h, t) for h in range(heads) for t in range(tiles)]
    work = np.where(valid, tiles - rank + 2, 0).sum(axis=0)
    assert work.max() - work.mean() <= tiles + 1 + 2 * 2
    if heads * tiles >= 8 * programs:
        assert work.max() / work.mean() < 1.04
