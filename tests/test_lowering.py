"""Lower every kernel for an sm90 GPU on CPU (jaxpr -> Triton IR, and Mosaic GPU IR for
the Hopper forward, dK/dV, dQ and dbias kernels).

The interpreters run the kernels' semantics; this catches what only the lowerings
reject (types, layouts, unsupported primitives) without a GPU. The final
compilation (shared memory, register allocation) still needs a GPU: see BUILD.md.
"""

import dataclasses
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest

import pallas_attn

_TOOL = pathlib.Path(__file__).parent.parent / "tools" / "lower_for_gpu.py"
_spec = importlib.util.spec_from_file_location("lower_for_gpu", _TOOL)
lower_for_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lower_for_gpu)

_MOSAIC = pallas_attn.BlockSizes(128, 128, num_stages=2, forward_backend="mosaic")
_MOSAIC_DBIAS = dict(block_q_dbias=128, block_k_dbias=64, num_stages_dbias=2,
                     dbias_backend="mosaic")
_MOSAIC_DKV = dict(block_q_dkv=64, block_k_dkv=128, num_stages_dkv=2, dkv_backend="mosaic")
_MOSAIC_DQ = dict(block_q_dq=128, block_k_dq=64, num_stages_dq=2, dq_backend="mosaic")

CASES = {
    "float32_mqa_h192": dict(T=100, S=70, N=4, K=1, H=192, dtype=jnp.float32),
    "lengths_segments_mask_dropout_broadcast": dict(
        query_seq_lengths=jnp.array([3, 4]), key_value_seq_lengths=jnp.array([100, 0]),
        q_segment_ids=jnp.zeros((2, 256), jnp.int32), mask=jnp.ones((2, 1, 256, 256), bool),
        dropout_rate=0.1, dropout_rng=jax.random.key(0), broadcast_dropout=True),
    "bias_heads_keys": dict(bias=jnp.ones((1, 4, 1, 256), jnp.float32), is_causal=True),
    "bias_queries": dict(bias=jnp.ones((1, 1, 256, 1), jnp.float32)),
    # dbias written by the dK/dV kernel: a bfloat16 bias per batch entry and head under
    # causal masking with dropout (on sm90 every role Mosaic, as for such a bias alone),
    # and a float32 per-key bias summed over rows (GQA).
    "bias_fused_per_batch": dict(bias=jnp.ones((2, 4, 256, 256), jnp.bfloat16),
                                 is_causal=True, dropout_rate=0.1,
                                 dropout_rng=jax.random.key(0),
                                 block_sizes=pallas_attn.BlockSizes(fuse_dbias=True)),
    "bias_fused_keys_gqa": dict(bias=jnp.ones((2, 4, 1, 256), jnp.float32), K=2,
                                key_value_seq_lengths=jnp.array([100, 256]),
                                block_sizes=pallas_attn.BlockSizes(fuse_dbias=True)),
    # With a bias: a float32 one per batch entry with float16 inputs and a boolean mask
    # per head (64-key tiles: the mask's int8 tiles in 64-byte rows; one bias per head
    # under a soft cap: mosaic_dq_bias_softcap_alibi's forward).
    "mosaic_float32_bias_float16_mask_block_k64": dict(
        dtype=jnp.float16, H=128, is_causal=True,
        bias=jnp.ones((2, 1, 256, 256), jnp.float32), mask=jnp.ones((1, 4, 256, 256), bool),
        block_sizes=dataclasses.replace(_MOSAIC, block_k=64)),
    # The Hopper dbias kernel: a float32 bias shared by every head and batch entry at d64
    # with float16 inputs, causal. (A head-shared bias under a soft cap, GQA, ragged:
    # mosaic_alibi_dbias_head_shared.)
    "mosaic_dbias_float32_bias_h64": dict(dtype=jnp.float16, is_causal=True,
                                          bias=jnp.ones((1, 1, 256, 256), jnp.float32),
                                          block_sizes=pallas_attn.BlockSizes(
                                              **dict(_MOSAIC_DBIAS, num_stages_dbias=1))),
    # The Hopper dK/dV kernel: storing a per-batch float16 bias's dbias under a causal
    # window (a batch-shared bias's sum: mosaic_dq_bias_softcap_alibi).
    "mosaic_dkv_per_batch_bias_window_float16": dict(
        dtype=jnp.float16, bias=jnp.ones((2, 4, 256, 256), jnp.float16), is_causal=True,
        local_window_size=(64, 32), block_sizes=pallas_attn.BlockSizes(**_MOSAIC_DKV)),
    # ALiBi in the Hopper kernels, per-batch slopes: a head-shared bias's dbias kernel
    # under a soft cap (GQA, ragged).
    "mosaic_alibi_dbias_head_shared": dict(
        T=200, S=300, K=2, alibi_slopes=jnp.ones((2, 4)), logits_soft_cap=20.0,
        bias=jnp.ones((2, 1, 200, 300), jnp.bfloat16),
        block_sizes=dataclasses.replace(_MOSAIC, **_MOSAIC_DBIAS)),
    # The Hopper dQ kernel: a batch-shared bias under a soft cap with ALiBi (GQA,
    # ragged, every other kernel Mosaic too: the dQ kernel stores batch entry 0's dbias
    # and the dK/dV kernel adds the others'; fused by request, since passes this narrow
    # would take the separate dbias kernel).
    "mosaic_dq_bias_softcap_alibi": dict(
        T=200, S=300, K=2, H=128, alibi_slopes=jnp.ones(4), logits_soft_cap=20.0,
        bias=jnp.ones((1, 4, 200, 300), jnp.bfloat16),
        block_sizes=dataclasses.replace(_MOSAIC, **_MOSAIC_DKV, **_MOSAIC_DQ,
                                        fuse_dbias=True)),
    # Segment ids, sequence lengths and dropout in every Mosaic role (GQA, causal under
    # a window): row and key ids read from global memory into the WGMMA layout's rows and
    # columns, chunk limits read as scalars; bands that stop at the key length; the keep
    # hash in uint32 on WGMMA tiles.
    "mosaic_segments_lengths_dropout_window_gqa": dict(
        T=256, S=384, N=8, K=2, H=128, is_causal=True, local_window_size=(100, 0),
        q_segment_ids=jnp.zeros((2, 256), jnp.int32),
        kv_segment_ids=jnp.zeros((2, 384), jnp.int32),
        query_seq_lengths=jnp.full((2,), 200, jnp.int32),
        key_value_seq_lengths=jnp.full((2,), 300, jnp.int32),
        dropout_rate=0.1, dropout_rng=jax.random.key(0),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    # A boolean mask in the Mosaic forward (int8 tiles per consumer): three consumers
    # at d64 with 128-key tiles (with a bias at d128 and 64-key tiles:
    # mosaic_float32_bias_float16_mask_block_k64).
    "mosaic_mask_three_consumers": dict(
        T=200, S=300, is_causal=True, mask=jnp.ones((2, 1, 200, 300), bool),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic")),
    # Head dim 256 on every Mosaic role. The forward with the default tiles: 64-key
    # tiles, the output staged in Q's buffer, P V accumulated in place; a bias tile per
    # consumer. The wide dQ and dK/dV kernels (64-byte swizzled tiles, consumers sharing
    # each item and unit): a batch-shared bias's dbias under a soft cap (GQA, ragged,
    # causal: the dQ kernel stores entry 0's, the dK/dV kernel adds the others', here
    # by concurrent programs in no fixed order); and H192/Hv64 with segments, lengths
    # and dropout under causal masking.
    "mosaic_all_h256_causal_shared_bias_softcap": dict(
        H=256, T=200, S=300, K=2, is_causal=True,
        bias=jnp.ones((1, 4, 200, 300), jnp.bfloat16), logits_soft_cap=20.0,
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic", deterministic=False)),
    "mosaic_backward_wide_h192_features": dict(
        T=256, S=384, N=8, K=2, H=192, Hv=64, is_causal=True, dropout_rate=0.1,
        dropout_rng=jax.random.key(0), q_segment_ids=jnp.zeros((2, 256), jnp.int32),
        kv_segment_ids=jnp.zeros((2, 384), jnp.int32),
        key_value_seq_lengths=jnp.full((2,), 300, jnp.int32),
        block_sizes=pallas_attn.BlockSizes(dq_backend="mosaic", dkv_backend="mosaic")),
    # float16 without a bias gradient: dS scaled by its row and key factors in the dQ and
    # dK/dV kernels, keys by queries at d64 (GQA, causal) and the wide kernels at d256.
    "mosaic_backward_float16_scaled_h64": dict(
        dtype=jnp.float16, T=200, S=300, N=8, K=2, is_causal=True,
        block_sizes=pallas_attn.BlockSizes(dq_backend="mosaic", dkv_backend="mosaic")),
    "mosaic_backward_float16_scaled_wide": dict(
        dtype=jnp.float16, H=256, T=200, S=300, K=2,
        block_sizes=pallas_attn.BlockSizes(dq_backend="mosaic", dkv_backend="mosaic")),
    # Every role on a Mosaic kernel at head dims 160 / 136: padded to 160 (not 256), the
    # forward's 64-byte tiles five wide, the wide backward's halves 80 columns in 32-byte
    # tiles; the Triton repairs read 160 columns as tiles of 256; a batch-shared bias's gradient,
    # causal, summed in turn (the default).
    "mosaic_all_h160": dict(
        H=160, Hv=136, T=200, S=300, K=2, is_causal=True,
        bias=jnp.ones((1, 4, 200, 300), jnp.bfloat16),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    # Head dim 192 with values of 128 on every Mosaic role: the forward's 96-key tiles
    # (64-byte swizzled rows: P V contracts over 96 keys), the last past the padding
    # (320), causal, with dropout's hashes over 96 keys.
    "mosaic_all_h192_hv128_96_key_tiles": dict(
        H=192, Hv=128, T=200, S=300, K=2, is_causal=True, dropout_rate=0.1,
        dropout_rng=jax.random.key(0),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    # Head dims 80 / 96 on every Mosaic role: 32-byte swizzled tiles (16 columns); a
    # batch-shared bias's gradient summed in no fixed order.
    "mosaic_all_h80_hv96": dict(
        H=80, Hv=96, T=200, S=300, K=2, is_causal=True,
        bias=jnp.ones((1, 4, 200, 300), jnp.bfloat16), logits_soft_cap=20.0,
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic", deterministic=False)),
    # Head dims 8 / 24 on every Mosaic role: padded to 16 and 32 (32- and 64-byte
    # swizzled tiles), causal with a soft cap.
    "mosaic_all_h8_hv24": dict(
        H=8, Hv=24, T=200, S=300, K=2, is_causal=True, logits_soft_cap=20.0,
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    # A bias and a mask per key in the Mosaic forward and dQ: rows read from global
    # memory per key tile (16-bit and int8 vectors along the keys).
    "mosaic_fwd_dq_bias_mask_per_key": dict(
        T=200, S=300, K=2, is_causal=True, bias=jnp.ones((2, 4, 1, 300), jnp.bfloat16),
        mask=jnp.ones((2, 1, 1, 300), bool),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic")),
    # A bias and a mask broadcast along keys in every Mosaic role: each consumer's rows
    # read from global memory (16-bit and int8 vectors along the rows; the dK/dV's keys
    # by queries at d32 with the mask alone), and one entry for every row (at d256, the
    # wide dQ's row sums); the bias's gradient from the dQ kernel's row sums (three under
    # a soft cap).
    "mosaic_all_bias_mask_per_row": dict(
        T=200, S=300, K=2, is_causal=True, logits_soft_cap=20.0,
        bias=jnp.ones((2, 4, 200, 1), jnp.bfloat16),
        mask=jnp.ones((2, 1, 200, 1), bool),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    "mosaic_all_h32_mask_per_row_keys_major": dict(
        H=32, T=200, S=300, K=2, mask=jnp.ones((2, 1, 200, 1), bool),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    "mosaic_all_bias_one_entry": dict(
        H=256, T=200, S=300, K=2, bias=jnp.ones((1, 4, 1, 1), jnp.bfloat16),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    # Head dim 32 (64-byte swizzled tiles) and a mask per key and head in every Mosaic
    # role, the dK/dV kernel keys by queries.
    "mosaic_all_h32_mask_per_key_keys_major": dict(
        H=32, T=200, S=300, K=2, is_causal=True, mask=jnp.ones((2, 4, 1, 300), bool),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    # A mask alone in every Mosaic role: its ranges without segment ids; a soft cap
    # (no bias), bottom-right causal.
    "mosaic_mask_ranges_softcap": dict(
        T=256, S=384, N=8, K=2, H=128, is_causal=True, causal_alignment="bottom_right",
        logits_soft_cap=20.0, mask=jnp.ones((2, 1, 256, 384), bool),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    # A mask at head dim 256 in every Mosaic role: the wide dQ's ring holds each
    # consumer's keys of the tile's mask, the wide dK/dV's consumers read theirs from
    # global memory; GQA, causal.
    "mosaic_all_h256_mask": dict(
        H=256, T=256, S=320, N=4, K=2, is_causal=True, mask=jnp.ones((2, 1, 256, 320), bool),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    # Dropout's hash tables beside the fullest buffers of head dim 128: a bias per batch
    # entry in every Mosaic role (the kernels' shared memory is what config counts).
    "mosaic_all_bias_per_batch_dropout": dict(
        H=128, bias=jnp.ones((2, 4, 256, 256), jnp.bfloat16), dropout_rate=0.1,
        dropout_rng=jax.random.key(0),
        block_sizes=pallas_attn.BlockSizes(forward_backend="mosaic", dq_backend="mosaic",
                                           dkv_backend="mosaic")),
    # The decode kernel: keys split over programs and merged by the merge kernel (sinks,
    # ALiBi, query lengths, bottom-right causal), and one split writing its results.
    "decode_splits_merged": dict(
        T=2, S=256, N=8, K=2, H=128, is_causal=True, causal_alignment="bottom_right",
        sinks=jnp.zeros(8), alibi_slopes=jnp.ones(8), query_seq_lengths=jnp.array([2, 1])),
    "decode_one_split": dict(T=1, S=128, N=8, K=2, H=64,
                             key_value_seq_lengths=jnp.array([100, 7])),
    # A bias gathered per token and head, a mask shared by a batch entry's rows.
    "decode_bias_rows_mask_per_key": dict(
        T=2, S=256, N=8, K=2, H=128, bias=jnp.ones((1, 8, 2, 256), jnp.bfloat16),
        mask=jnp.ones((2, 1, 1, 256), bool)),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_lower_for_sm90(case):
    assert lower_for_gpu.lower(**dict(CASES[case]))


def test_forward_turns_lower_to_named_barriers():
    """Two forward consumers (d128) take turns on named barriers shared by both
    warpgroups; three (d64, the plain problem with every default) take none."""
    two = lower_for_gpu.lowered_text(H=128)
    assert "bar.arrive $0, 256;" in two and "bar.sync $0, 256;" in two
    three = lower_for_gpu.lowered_text(H=64)
    assert "bar.arrive" not in three and "bar.sync $0, 256;" not in three
