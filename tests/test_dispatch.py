"""The routing table (dispatch.py): the plan per role, tiles, overrides, explain.

The table is pinned here: which backend runs each role for representative problems
on each device, the Mosaic kernels' fixed tiles and consumer counts, where dbias is
fused, and that every chosen tile set fits the device's shared memory.
"""

import ast
import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import pallas_attn
from pallas_attn import dispatch
from pallas_attn.device import DeviceInfo
from pallas_attn.kernels.mosaic import config as mosaic
from pallas_attn.kernels.triton import config as triton
from pallas_attn.plan import BlockSizes, Route
from pallas_attn.spec import AttentionSpec

pytestmark = pytest.mark.timeout(120)

# Opt-in shared memory per block: sm86/sm89 (99 KB), sm80 (163 KB), sm90 (227 KB).
DEVICES = {
    "sm86": DeviceInfo((8, 6), 84, 101376),
    "sm89": DeviceInfo((8, 9), 128, 101376),
    "sm80": DeviceInfo((8, 0), 108, 166912),
    "sm90": DeviceInfo((9, 0), 132, 232448),
}
H100 = DEVICES["sm90"]
HEAD_DIMS = (32, 40, 64, 80, 96, 128, 160, 192, 256)
DTYPES = ("float32", "bfloat16", "float16")
FEATURES = (dict(), dict(bias_shape=(1, 16, 4096, 4096)), dict(mask_shape=(4, 1, 4096, 4096)),
            dict(bias_shape=(1, 16, 4096, 4096), bias_dtype="float32",
                 mask_shape=(4, 1, 4096, 4096)))
TRITON_ONLY = BlockSizes(forward_backend="triton", dkv_backend="triton", dq_backend="triton",
                         dbias_backend="triton")


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PALLAS_ATTN_CACHE_DIR", str(tmp_path / "cache"))


def call(head_dim: int = 128, dtype: str = "bfloat16", *, value_head_dim: int | None = None,
         q_len: int = 4096, kv_len: int = 4096, batch: int = 4, heads: int = 16,
         kv_heads: int = 16, bias_dtype: str | None = None, present: tuple = (),
         **spec_fields) -> dispatch.Call:
    """A Call without arrays: spec fields (bias_shape, mask_shape, is_causal, ...)."""
    spec = AttentionSpec(scale=head_dim ** -0.5, **spec_fields)
    names = set(present) | {name for name, on in (
        ("bias", spec.has_bias), ("mask", spec.has_mask), ("alibi_slopes", spec.has_alibi),
        ("dropout_keys", spec.has_dropout)) if on}
    if spec.has_bias and bias_dtype is None:
        bias_dtype = dtype
    order = ("bias", "mask", "alibi_slopes", "q_segment_ids", "kv_segment_ids",
             "query_seq_lengths", "key_value_seq_lengths", "dropout_keys")
    return dispatch.Call(spec, batch, q_len, kv_len, heads, kv_heads, head_dim,
                         value_head_dim or head_dim, dtype, bias_dtype,
                         tuple(n for n in order if n in names))


def backends(plan: pallas_attn.Plan) -> tuple:
    dbias = None if plan.dbias is None else (
        f"{plan.dbias.backend}-fused" if plan.dbias.fused
        else f"{plan.dbias.backend}-in-dq" if plan.dbias.in_dq else plan.dbias.backend)
    return plan.forward.backend, plan.dq.backend, plan.dkdv.backend, dbias


# ------------------------------------------------------------------ the pinned table
# (call, device, (forward, dQ, dK/dV, dbias)): the measured-faster rules of dispatch.py.
TABLE = {
    "d128": (call(), "sm90", ("mosaic", "mosaic", "mosaic", None)),
    "d128_causal": (call(is_causal=True), "sm90", ("mosaic", "mosaic", "mosaic", None)),
    "d80_Hv128": (call(80, value_head_dim=128), "sm90", ("mosaic", "mosaic", "mosaic", None)),
    "d96_Hv72_window": (call(96, value_head_dim=72, local_window=(256, 256)), "sm90",
                        ("mosaic", "mosaic", "mosaic", None)),
    "d128_float16_soft_cap_alibi": (call(dtype="float16", logits_soft_cap=30.0,
                                         has_alibi=True), "sm90",
                                    ("mosaic", "mosaic", "mosaic", None)),
    "d64": (call(64), "sm90", ("mosaic", "mosaic", "mosaic", None)),
    "d128_Hv64": (call(128, value_head_dim=64), "sm90", ("mosaic", "mosaic", "mosaic", None)),
    # d256: the Mosaic forward (64-key tiles) and the wide Mosaic dQ and dK/dV kernels
    # (consumers sharing each item and unit), dK/dV with one slot where a bias leaves no
    # room for two; a float32 bias leaves the dQ kernel no room.
    "d256": (call(256), "sm90", ("mosaic", "mosaic", "mosaic", None)),
    "d256_causal_bias": (call(256, is_causal=True, bias_shape=(1, 16, 4096, 4096)), "sm90",
                         ("mosaic", "mosaic", "mosaic", "mosaic-fused")),
    "d256_bias_float32": (call(256, bias_shape=(1, 16, 4096, 4096), bias_dtype="float32"),
                          "sm90", ("mosaic", "triton", "mosaic", "triton")),
    "d32": (call(32), "sm90", ("mosaic", "mosaic", "mosaic", None)),
    "float32": (call(dtype="float32"), "sm90", ("triton", "triton", "triton", None)),
    "short": (call(q_len=100), "sm90", ("triton", "triton", "triton", None)),
    "sm80": (call(), "sm80", ("triton", "triton", "triton", None)),
    "sm89": (call(), "sm89", ("triton", "triton", "triton", None)),
    # A bias per head (shared by the batch entries or not) in the inputs' dtype: its
    # gradient is written by the Mosaic dK/dV kernel.
    "bias_shared": (call(bias_shape=(1, 16, 4096, 4096)), "sm90",
                    ("mosaic", "mosaic", "mosaic", "mosaic-fused")),
    # A batch-shared bias whose in-turn passes (8 key units x 8 heads) leave SMs idle:
    # the separate Mosaic dbias kernel; deterministic=False keeps the fused sum.
    "bias_shared_narrow_passes": (call(bias_shape=(1, 8, 1024, 1024), batch=32, heads=8,
                                       kv_heads=8, q_len=1024, kv_len=1024), "sm90",
                                  ("mosaic", "mosaic", "mosaic", "mosaic")),
    "bias_per_batch": (call(bias_shape=(4, 16, 4096, 4096)), "sm90",
                       ("mosaic", "mosaic", "mosaic", "mosaic-fused")),
    "bias_shared_by_heads": (call(bias_shape=(1, 1, 4096, 4096)), "sm90",
                             ("mosaic", "mosaic", "mosaic", "mosaic")),
    "bias_d64_shared_by_heads": (call(64, bias_shape=(4, 1, 4096, 4096)), "sm90",
                                 ("mosaic", "mosaic", "mosaic", "mosaic")),
    # A float32 bias leaves no room next to two 128-key slots (the forward takes 64-key
    # ones) or two dK/dV slots (it takes one); the separate Mosaic dbias kernel fits one.
    "bias_float32": (call(bias_shape=(1, 16, 4096, 4096), bias_dtype="float32"), "sm90",
                     ("mosaic", "mosaic", "mosaic", "mosaic")),
    # A bias per key: every Mosaic kernel reads it per key tile; its gradient (the column
    # sums of dS) is the Mosaic dK/dV kernel's, whatever its broadcast and dtype.
    "bias_per_key": (call(bias_shape=(4, 16, 1, 4096)), "sm90",
                     ("mosaic", "mosaic", "mosaic", "mosaic-fused")),
    "bias_per_key_shared_float32": (call(bias_shape=(1, 1, 1, 4096), bias_dtype="float32"),
                                    "sm90", ("mosaic", "mosaic", "mosaic", "mosaic-fused")),
    # A bias broadcast along keys: the Mosaic kernels read each consumer's rows; its
    # gradient (dS's row sums) is the Triton dbias kernel's.
    "bias_per_query": (call(bias_shape=(1, 1, 4096, 1)), "sm90",
                       ("mosaic", "mosaic", "mosaic", "mosaic-in-dq")),
    "bias_one_entry_per_head": (call(bias_shape=(4, 16, 1, 1)), "sm90",
                                ("mosaic", "mosaic", "mosaic", "mosaic-in-dq")),
    # A boolean mask with its own entry per query and key: the Mosaic kernels (int8
    # tiles); one broadcast along queries (a key padding mask) too (a row per key tile);
    # at d256 the wide backward kernels too (the dK/dV's read from global memory).
    "mask": (call(mask_shape=(4, 1, 4096, 4096)), "sm90", ("mosaic", "mosaic", "mosaic", None)),
    "mask_per_key": (call(mask_shape=(4, 1, 1, 4096)), "sm90",
                     ("mosaic", "mosaic", "mosaic", None)),
    "mask_per_query": (call(mask_shape=(4, 1, 4096, 1)), "sm90",
                       ("mosaic", "mosaic", "mosaic", None)),
    "mask_d256": (call(256, mask_shape=(4, 1, 4096, 4096)), "sm90",
                  ("mosaic", "mosaic", "mosaic", None)),
    # Segment ids: the Mosaic forward; of the backward, the Mosaic dK/dV measured faster
    # without causal masking, the Mosaic dQ with it, each next to the other's Triton kernel.
    "segments": (call(has_segments=True, present=("q_segment_ids", "kv_segment_ids")), "sm90",
                 ("mosaic", "triton", "mosaic", None)),
    "segments_causal": (call(has_segments=True, is_causal=True,
                             present=("q_segment_ids", "kv_segment_ids")), "sm90",
                        ("mosaic", "mosaic", "triton", None)),
    "lengths": (call(has_kv_lengths=True, present=("key_value_seq_lengths",)), "sm90",
                ("mosaic", "mosaic", "mosaic", None)),
    # A prefill chunk against a long cache: the pass that zeroes past the lengths would
    # cost more than the Mosaic kernels save (dispatch.MOSAIC_LENGTHS_MIN_ROWS).
    "lengths_prefill_chunk": (call(q_len=256, kv_len=65536, heads=32, kv_heads=8,
                                   has_kv_lengths=True, present=("key_value_seq_lengths",)),
                              "sm90", ("triton", "triton", "triton", None)),
    "dropout": (call(dropout_rate=0.1), "sm90", ("mosaic", "mosaic", "mosaic", None)),
    # The separate Mosaic dbias kernel takes no dropout.
    "dropout_bias_shared_by_heads": (call(dropout_rate=0.1, bias_shape=(1, 1, 4096, 4096)),
                                     "sm90", ("mosaic", "mosaic", "mosaic", "triton")),
    "bias_sm80_per_batch": (call(bias_shape=(4, 16, 4096, 4096)), "sm80",
                            ("triton", "triton", "triton", "triton-fused")),
    # Fewer dK/dV programs (2 key tiles x 4 x 4) than SMs: the separate dbias kernel.
    "bias_sm80_small_grid": (call(bias_shape=(4, 16, 256, 256), q_len=256, kv_len=256,
                                  kv_heads=4), "sm80",
                             ("triton", "triton", "triton", "triton")),
}


@pytest.mark.parametrize("name", TABLE)
def test_the_routing_table(name):
    c, device, expected = TABLE[name]
    plan = dispatch.plan(c, device=DEVICES[device])
    assert backends(plan) == expected
    for role in ("forward", "dq", "dkdv"):
        route = plan.route(role)
        if route.backend == "mosaic":
            assert not route.declined
        else:
            assert [b for b, _ in route.declined] == ["mosaic"], role


def test_mosaic_routes_have_their_fixed_tiles_and_consumers():
    plan = dispatch.plan(call(), device=H100)
    assert plan.forward == Route("mosaic", 128, 128, 0, 2, 2, early_q=True)
    assert plan.dkdv == Route("mosaic", 64, 128, 0, 2, 2)
    assert plan.dq == Route("mosaic", 128, 64, 0, 2, 3)
    biased = dispatch.plan(call(bias_shape=(1, 1, 4096, 4096)), device=H100)
    assert biased.dq.consumers == 2  # a bias: two consumers taking turns
    assert biased.dbias == Route("mosaic", 128, 64, 0, 2, 2,
                                 declined=biased.dbias.declined)
    assert dispatch.plan(call(local_window=(64, 64)), device=H100).dq.consumers == 2
    # The wide dK/dV stages no mask tiles, so two slots still fit beside a mask.
    assert dispatch.plan(TABLE["mask_d256"][0], device=H100).dkdv.num_stages == 2
    # Segment ids: items of 128 rows, which documents of a power of two fill whole.
    packed = dispatch.plan(call(has_segments=True,
                                present=("q_segment_ids", "kv_segment_ids")), device=H100,
                           block_sizes=pallas_attn.BlockSizes(dq_backend="mosaic"))
    assert packed.dq.backend == "mosaic" and packed.dq.consumers == 2
    f32 = dispatch.plan(call(bias_shape=(1, 1, 4096, 4096), bias_dtype="float32"), device=H100)
    assert (f32.dbias.backend, f32.dbias.num_stages) == ("mosaic", 1)
    assert plan.programs == 132 and plan.programs_for(40) == 40 and plan.programs_for(0) == 1


def test_the_mosaic_schedules_are_the_routes_and_explain_names_them():
    """The forward loads the next item's Q early except under a soft cap or where its
    output is staged in Q's buffer (d256); the dK/dV kernel gives K and V back early with
    segment ids only; `explain` says so."""
    plain = dispatch.plan(call(), device=H100)
    assert plain.forward.early_q and not plain.dkdv.early_release
    assert not dispatch.plan(call(logits_soft_cap=30.0), device=H100).forward.early_q
    assert not dispatch.plan(call(256), device=H100).forward.early_q
    packed = dispatch.plan(call(has_segments=True, present=("q_segment_ids", "kv_segment_ids")),
                           device=H100)
    assert packed.dkdv.backend == "mosaic" and packed.dkdv.early_release
    text = str(packed)
    assert "next Q loaded after the last Q K^T" in text
    assert "K/V given back after the last S and dP" in text


def test_the_interpreter_runs_triton_unless_block_sizes_name_mosaic():
    plan = dispatch.plan(call(), interpret=True)
    assert backends(plan) == ("triton",) * 3 + (None,) and plan.programs == 2
    assert "interpreter" in plan.forward.declined[0][1]
    forced = dispatch.plan(call(), interpret=True, block_sizes=BlockSizes(
        forward_backend="mosaic", dq_backend="mosaic"))
    assert backends(forced) == ("mosaic", "mosaic", "triton", None)


def test_the_mosaic_dkv_kernel_runs_keys_by_queries_where_it_measured_faster():
    """Head dims up to 64 without a bias or ALiBi; not at 128, nor with a bias or ALiBi."""
    assert dispatch.plan(call(64), device=H100).dkdv.keys_major
    assert dispatch.plan(call(32), device=H100).dkdv.keys_major
    assert "keys by queries" in dispatch.plan(call(64), device=H100).dkdv.describe()
    for c in (call(), call(64, has_alibi=True), call(64, bias_shape=(1, 16, 4096, 4096)),
              call(256)):
        assert not dispatch.plan(c, device=H100).dkdv.keys_major


def test_reasons_name_what_refuses():
    reasons = {name: dict(dispatch.plan(c, device=DEVICES[d]).forward.declined).get("mosaic")
               for name, (c, d, _) in TABLE.items()}
    assert "sm90" in reasons["sm80"] and "this one is sm80" in reasons["sm80"]
    segments_dq = dict(dispatch.plan(TABLE["segments"][0], device=H100).dq.declined)
    assert "measured faster" in segments_dq["mosaic"]
    shared = call(32, bias_shape=(1, 1, 4096, 4096))  # its gradient: the dbias kernel's
    dbias_reasons = dict(dispatch.plan(shared, device=H100).dbias.declined)
    assert "head dims must pad to (64, 128), got 32 and 32" in dbias_reasons["mosaic"]
    dq_reasons = dict(dispatch.plan(TABLE["d256_bias_float32"][0], device=H100).dq.declined)
    assert "232448" in dq_reasons["mosaic"]  # a float32 bias tile leaves no room
    assert "bfloat16 or float16" in reasons["float32"]
    # A bias per row next to segment ids: dQ stays Mosaic for its row sums, unless the
    # caller names Triton's dQ, which leaves the dbias kernel.
    segments = dict(has_segments=True, present=("q_segment_ids", "kv_segment_ids"))
    routed = dispatch.plan(call(bias_shape=(1, 1, 4096, 1), **segments), device=H100)
    assert routed.dq.backend == "mosaic" and routed.dbias.in_dq
    per_query = dispatch.plan(call(bias_shape=(1, 1, 4096, 1), **segments), device=H100,
                              block_sizes=pallas_attn.BlockSizes(dq_backend="triton")).dbias
    assert per_query.backend == "triton"
    assert "the Mosaic dQ kernel's row sums, and dQ runs on Triton" in dict(
        per_query.declined)["mosaic"]
    dbias = dict(dispatch.plan(TABLE["dropout_bias_shared_by_heads"][0], device=H100)
                 .dbias.declined)
    assert "no dropout" in dbias["mosaic"]
    assert "fewer query rows (100)" in reasons["short"]
    f32 = dispatch.plan(TABLE["bias_float32"][0], device=H100)
    assert f32.forward.block_k == 64  # 128-key slots would not fit
    assert f32.dkdv.num_stages == 1  # two slots would not fit
    assert dispatch.plan(call(bias_shape=(1, 16, 4096, 4096)), device=H100).forward.block_k == 128


@pytest.mark.parametrize("name", ["d64", "bias_per_key", "bias_shared_by_heads"])
def test_the_triton_routes_are_the_ladders_first_fitting_rung(name):
    c, device, _ = TABLE[name]
    plan = dispatch.plan(c, device=DEVICES[device], block_sizes=TRITON_ONLY)
    heavy = c.spec.has_bias or c.spec.has_dropout or c.spec.logits_soft_cap is not None
    for role in ("forward", "dq", "dkdv", *(("dbias",) if plan.dbias and not plan.dbias.fused
                                             else ())):
        route = plan.route(role)
        assert route.backend == "triton"
        assert (route.block_q, route.block_k, route.num_warps, route.num_stages) == triton.ladder(
            role, c.head_dim, c.value_head_dim, c.spec.is_causal, heavy)[0]


# ------------------------------------------------------------------ shared memory
def _need(plan: pallas_attn.Plan, c: dispatch.Call, role: str) -> int:
    route = plan.route(role)
    hp, hvp = plan.head_dims  # the Mosaic kernels' (whole tiles, or powers of two)
    if route.backend in ("triton", "decode"):
        return triton.shared_memory(role, (route.block_q, route.block_k, route.num_warps,
                                           route.num_stages), c.head_dim, c.value_head_dim,
                                    c.dtype, bias_dtype=c.bias_dtype, has_mask=c.spec.has_mask,
                                    cleaned=triton.cleaned_tiles(
                                        role, c.spec.hides_keys, c.spec.has_q_lengths,
                                        c.spec.has_kv_lengths, c.kv_len, route.block_k))
    if role == "forward":
        staging = mosaic.forward_output_staging(hp, hvp, route.block_k, route.num_stages,
                                                c.dtype,
                                                mosaic.bias_tiles_dtype(c.spec, c.bias_dtype),
                                                plan.device.max_shared_memory_per_block,
                                                route.consumers, mosaic.mask_tiles(c.spec))
        return mosaic.forward_scratch(hp, hvp, route.block_k, route.num_stages, c.dtype,
                                      mosaic.bias_tiles_dtype(c.spec, c.bias_dtype),
                                      staging=staging, consumers=route.consumers,
                                      has_mask=mosaic.mask_tiles(c.spec)).bytes
    if role == "dkdv":
        bias_dtype = mosaic.bias_tiles_dtype(c.spec, c.bias_dtype)
        return mosaic.dkv_scratch(hp, hvp, route.num_stages, c.dtype, bias_dtype,
                                  zeros=bias_dtype is not None, has_mask=mosaic.mask_tiles(c.spec),
                                  ones=mosaic.key_sums(c.spec)).bytes
    if role == "dq":
        bias_dtype = mosaic.bias_tiles_dtype(c.spec, c.bias_dtype)
        return mosaic.dq_scratch(hp, hvp, route.block_k, route.num_stages, route.consumers,
                                 c.dtype, bias_dtype, dbias=bias_dtype is not None,
                                 has_mask=mosaic.mask_tiles(c.spec)).bytes
    return mosaic.dbias_scratch(hp, hvp, route.block_k, route.num_stages, c.dtype,
                                c.bias_dtype).bytes


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chosen_tiles_fit_every_device(device, dtype):
    info = DEVICES[device]
    for head_dim in HEAD_DIMS:
        for features in FEATURES:
            c = call(head_dim, dtype, **features)
            plan = dispatch.plan(c, device=info)
            for role in ("forward", "dq", "dkdv", "dbias"):
                if plan.route(role) is None or plan.route(role).fused:
                    continue
                assert _need(plan, c, role) <= info.max_shared_memory_per_block, (
                    head_dim, features, role)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_decode_routes_fit_with_a_bias_and_a_mask(device):
    """A decode step's bias and mask tiles sit beside K and V in the decode kernel's
    shared memory: its stages are chosen with them counted, and where even one stage
    does not fit (head dims past 128 with a bias or mask tile on 100 KB), the forward
    kernel runs the call, the reason named; forced, the decode kernel's tiles raise."""
    info = DEVICES[device]
    decode = dict(q_len=8, heads=64, kv_heads=8)  # 64 rows per kv group: the largest tile
    for head_dim in HEAD_DIMS:
        for features in (dict(), dict(bias_shape=(1, 64, 8, 4096), bias_dtype="float32"),
                         dict(mask_shape=(4, 64, 8, 4096)),
                         dict(bias_shape=(4, 64, 8, 4096), mask_shape=(4, 1, 1, 4096))):
            c = call(head_dim, **decode, **features)
            plan = dispatch.plan(c, device=info)
            if plan.forward.backend != "decode":
                assert head_dim > 128 and features and info.max_shared_memory_per_block < 2 ** 17, (
                    head_dim, features)
                assert any(b == "decode" and "shared memory" in why
                           for b, why in plan.forward.declined)
                with pytest.raises(ValueError, match="bytes of shared memory"):
                    dispatch.plan(c, device=info,
                                  block_sizes=BlockSizes(forward_backend="decode"))
                continue
            assert _need(plan, c, "forward") <= info.max_shared_memory_per_block, (
                head_dim, features)


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_shared_memory_never_gives_smaller_triton_tiles(dtype):
    order = ["sm86", "sm80", "sm90"]
    for head_dim in HEAD_DIMS:
        for features in FEATURES:
            plans = [dispatch.plan(call(head_dim, dtype, **features), device=DEVICES[d],
                                   block_sizes=TRITON_ONLY) for d in order]
            areas = [[r.block_q * r.block_k for r in (p.forward, p.dq, p.dkdv)]
                     for p in plans]
            for small, large in zip(areas, areas[1:], strict=False):
                assert all(s <= l_ for s, l_ in zip(small, large, strict=True)), (
                    head_dim, features, areas)


def test_the_dbias_estimate_matches_the_measured_requests():
    """Shared memory Triton requested on an H100 (d128, bf16), from RESOURCE_EXHAUSTED
    messages: the estimate may be at most 512 bytes over, never under."""
    measured = {(128, 64, 8, 3): 294912, (128, 64, 4, 3): 295424, (128, 32, 8, 3): 245760,
                (128, 32, 4, 3): 246272, (128, 128, 8, 2): 262144, (128, 128, 4, 2): 262656}
    for tiles, request in measured.items():
        estimate = triton.shared_memory("dbias", tiles, 128, 128, "bfloat16",
                                        bias_dtype="bfloat16")
        assert request <= estimate <= request + 512, (tiles, estimate, request)


def test_the_dq_estimate_covers_the_measured_requests():
    """Shared memory the Triton dQ kernel requested on an H100 (bf16, 4 warps), from
    RESOURCE_EXHAUSTED messages: in masked tiles K with its hidden and non-finite entries
    zeroed is staged apart for dS K, block_k * head_dim * 2 bytes more. The estimate is
    never under (the 64 x 64 d256 masked tiles once failed to launch)."""
    measured = {  # (head dim, tiles, feature): bytes requested
        (256, (64, 64, 4, 2), "mask"): 233472,
        (256, (128, 64, 4, 2), "mask"): 303104, (256, (128, 64, 4, 2), "causal"): 294912,
        (256, (128, 64, 4, 2), "segments"): 295168, (256, (128, 64, 4, 2), None): 262144,
        (256, (64, 128, 4, 2), "mask"): 401408, (256, (64, 128, 4, 2), "causal"): 393216,
        (256, (64, 64, 4, 3), "segments"): 295936, (128, (128, 128, 4, 3), "causal"): 294912,
        (128, (128, 128, 4, 4), "mask"): 409600, (128, (128, 128, 4, 4), "segments"): 362496,
    }
    for (head_dim, tiles, feature), request in measured.items():
        spec = {"mask": dict(mask_shape=(1, 1, 8, 8)), "causal": dict(is_causal=True),
                "segments": dict(has_segments=True), None: {}}[feature]
        cleaned = triton.cleaned_tiles("dq", AttentionSpec(1.0, **spec).hides_keys, False,
                                       False, 512, tiles[1])  # measured at T = S = 512
        estimate = triton.shared_memory("dq", tiles, head_dim, head_dim, "bfloat16",
                                        has_mask=feature == "mask", cleaned=cleaned)
        assert estimate >= request, (head_dim, tiles, feature, estimate, request)


def test_the_dkdv_estimate_covers_the_measured_requests():
    """Shared memory the Triton dK/dV kernel requested on an H200 (bf16, T = 1000, S =
    1100), from RESOURCE_EXHAUSTED messages, with and without query lengths (which stage
    Q and dO apart in the tiles the length crosses). The estimate is never under (the
    64 x 64 d256 tiles with query lengths once failed to launch)."""
    measured = {  # (head dim, tiles, query lengths): bytes requested
        (256, (64, 64, 8, 2), True): 263168, (256, (32, 64, 8, 3), True): 262912,
        (256, (64, 128, 8, 2), False): 279296, (256, (64, 128, 8, 2), True): 328448,
        (256, (128, 64, 8, 2), False): 346112, (256, (128, 64, 8, 2), True): 460800,
        (256, (64, 64, 4, 3), False): 272384, (256, (64, 64, 4, 3), True): 329728,
        (128, (128, 128, 8, 2), True): 264192, (128, (128, 64, 8, 3), False): 248832,
        (128, (128, 64, 8, 3), True): 297984, (128, (128, 128, 4, 3), False): 297984,
        (128, (128, 128, 4, 3), True): 330752,
    }
    for (head_dim, tiles, lengths), request in measured.items():
        cleaned = triton.cleaned_tiles("dkdv", False, lengths, False, 1100, tiles[1])
        estimate = triton.shared_memory("dkdv", tiles, head_dim, head_dim, "bfloat16",
                                        cleaned=cleaned)
        assert estimate >= request, (head_dim, tiles, lengths, estimate, request)


def test_mosaic_scratch_sizes():
    """The Mosaic kernels' shared memory, from the buffers they allocate: three dQ
    consumers' Q, dO and dS and the K/V ring at d128 are 188416 bytes before the row
    residuals and barriers; a float32 bias tile per forward consumer overflows 128-key
    tiles with two slots, not 64-key ones."""
    budget = H100.max_shared_memory_per_block
    three = mosaic.dq_scratch(128, 128, 64, 2, 3, "bfloat16").bytes
    assert 188416 < three <= budget
    assert mosaic.dq_scratch(128, 128, 64, 4, 3, "bfloat16").bytes > budget
    assert mosaic.dq_consumers(128, 128, 64, 4, "bfloat16", bias_dtype=None, has_window=False,
                               budget=budget) == 2
    assert mosaic.dq_consumers(128, 128, 64, 3, "bfloat16", bias_dtype=None, has_window=False,
                               budget=budget) == 3
    plain = mosaic.forward_scratch(128, 128, 128, 2, "float16").bytes
    for bias_dtype in ("float16", "float32"):
        with_bias = mosaic.forward_scratch(128, 128, 128, 2, "float16", bias_dtype).bytes
        assert with_bias == plain + 128 * 128 * jnp.dtype(bias_dtype).itemsize + 16
    assert mosaic.forward_scratch(128, 128, 128, 2, "float16", "float32").bytes == 262256
    assert mosaic.forward_scratch(128, 128, 64, 2, "float16", "float32").bytes <= budget
    assert mosaic.forward_scratch(128, 128, 128, 3, "bfloat16").bytes > budget
    # d256: 64-key tiles; the output has no room of its own and is staged in Q's buffer,
    # which leaves room for a bias tile per consumer, a float32 one included (P comes
    # from registers: no buffer of its own on the GPU).
    for bias_dtype in (None, "bfloat16", "float32"):
        assert mosaic.forward_output_staging(256, 256, 64, 2, "bfloat16", bias_dtype,
                                             budget) == "q"
    assert mosaic.forward_output_staging(128, 128, 128, 2, "bfloat16", None, budget) == "p"
    assert mosaic.forward_output_staging(128, 64, 128, 2, "bfloat16", None, budget) == "o"
    assert mosaic.forward_scratch(256, 256, 64, 2, "bfloat16", "bfloat16",
                                  staging="q").bytes <= budget
    assert mosaic.forward_scratch(256, 256, 64, 2, "bfloat16", "float32",
                                  staging="q").bytes <= budget
    assert mosaic.forward_scratch(256, 256, 64, 2, "bfloat16", "float32", staging="q",
                                  p_buffer=True).bytes > budget
    # Dropout's hash tables, 512 bytes per consumer, where they fit beside the buffers:
    # with the d128 dK/dV kernel's two slots, not with the d256 one's, whose buffers
    # each start at a multiple of 1024 bytes as Pallas allocates them.
    def dkv(hp, tables):
        return mosaic.dkv_scratch(hp, hp, 2, "bfloat16", dropout=tables)

    assert dkv(128, True).bytes == dkv(128, False).bytes + 1024
    assert dkv(256, False).bytes <= budget < dkv(256, True).bytes
    for hp in (128, 256):
        for dropout in (False, True):
            chosen = mosaic.with_hash_tables(lambda t, hp=hp: dkv(hp, t), dropout, budget)
            assert chosen == dkv(hp, dropout and hp == 128)


@pytest.mark.parametrize("hp,hvp,block_k,bias_dtype,consumers", [
    (64, 64, 128, None, 3), (64, 64, 64, None, 3), (128, 128, 64, None, 3),
    (64, 64, 128, "bfloat16", 2), (128, 128, 128, None, 2), (256, 256, 64, None, 2),
    (128, 64, 128, None, 3), (128, 128, 64, "float32", 2)])
def test_three_forward_consumers_where_their_registers_suffice(hp, hvp, block_k, bias_dtype,
                                                              consumers):
    """Three forward consumers (items of 192 rows) hold at most 128 registers per thread
    of output accumulator, scores and P, and no bias tile; two otherwise."""
    budget = H100.max_shared_memory_per_block
    assert mosaic.forward_consumers(hp, hvp, block_k, 2, "bfloat16", bias_dtype=bias_dtype,
                                    budget=budget) == consumers
    # Their buffers: a third consumer's Q rows and output rows (in a buffer of their own
    # or in P's; one more Q barrier, not the two turns' barriers of the interpreter's
    # turns).
    if consumers == 3:
        two, three = (mosaic.forward_scratch(hp, hvp, block_k, 2, "bfloat16", consumers=c)
                      for c in (2, 3))
        assert three.bytes - two.bytes == 64 * (hp + hvp) * 2 - 8


@pytest.mark.parametrize("head_dim,value_head_dim,features,block_k", [
    (160, 160, {}, 128), (192, 192, {}, 96), (192, 128, {"is_causal": True}, 96),
    (224, 224, {}, 96), (256, 256, {}, 64), (128, 128, {}, 128),
    (192, 192, {"bias_shape": (1, 16, 4096, 1)}, 64),
    (192, 192, {"mask_shape": (4, 1, 4096, 4096)}, 64),
    (192, 192, {"has_segments": True, "present": ("q_segment_ids", "kv_segment_ids")}, 64),
    (160, 128, {}, 128)])
def test_the_forward_takes_the_widest_key_tiles_that_fit(head_dim, value_head_dim, features,
                                                        block_k):
    """Above head dim 128 the forward's key tiles are the widest of 128, 96 and 64 whose
    buffers fit (P's buffer only where it stages the output: on the GPU P V takes P from
    registers); 96 not with operands read per key tile (a bias, mask or segment ids),
    and the keys pad to the power-of-two tiles, which a 96-key tile may run past."""
    c = call(head_dim, value_head_dim=value_head_dim, **features)
    plan = dispatch.plan(c, device=H100)
    assert plan.forward.backend == "mosaic" and plan.forward.block_k == block_k
    assert _need(plan, c, "forward") <= H100.max_shared_memory_per_block
    hp, hvp = plan.head_dims
    gpu = dict(mosaic.forward_scratch(hp, hvp, block_k, 2, "bfloat16").buffers)
    assert (gpu["p"] is None) == (hvp != block_k)  # P's buffer: only to stage the output
    if block_k == 96:
        assert {b.swizzle for b in gpu.values() if b is not None} == {64}


def test_the_plan_shows_the_forward_consumers():
    q = jnp.zeros((1, 1024, 2, 64), jnp.bfloat16)
    with pallas_attn.device.lowering_for(pallas_attn.DeviceInfo()):
        plan = pallas_attn.explain(q, q, q, implementation="pallas")
        assert plan.forward.consumers == 3 and "3 consumer warpgroups" in str(plan)
        wide = jnp.zeros((1, 1024, 2, 128), jnp.bfloat16)
        assert pallas_attn.explain(wide, wide, wide, implementation="pallas").forward.consumers == 2


# ------------------------------------------------------------------ overrides
@pytest.mark.parametrize("field,value", [("block_q", 24), ("block_k", 8), ("block_q_dq", 0),
                                         ("num_warps", 3), ("num_stages", 0),
                                         ("num_stages_dq", 9), ("num_warps_dkv", 32),
                                         ("block_k_dbias", 48), ("num_warps_dbias", 3),
                                         ("num_stages_dbias", 0), ("block_q", True),
                                         ("dq_backend", "cuda"), ("fuse_dbias", 1)])
def test_block_sizes_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"BlockSizes.{field}"):
        BlockSizes(**{field: value})


def test_block_sizes_are_hashable_frozen_overrides():
    b = BlockSizes()
    assert hash(b) == hash(BlockSizes()) and b.tiles("dq") == (None,) * 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.block_q = 64


def test_overridden_fields_are_kept_and_the_rest_chosen():
    overrides = BlockSizes(block_q=32, num_stages_dq=1, dkv_backend="triton")
    plan = dispatch.plan(call(), device=H100, block_sizes=overrides)
    rung = triton.ladder("forward", 128)[0]
    assert plan.forward.backend == "triton"  # Mosaic runs block_q 128 only
    assert (plan.forward.block_q, plan.forward.block_k) == (32, rung[1])
    assert "block_sizes gives block_q=32" in plan.forward.declined[0][1]
    assert plan.dq.backend == "triton" and plan.dq.num_stages == 1
    assert plan.dkdv.backend == "triton" and not plan.dkdv.declined


def test_tiles_are_clamped_to_short_sequences():
    plan = dispatch.plan(call(64, q_len=5, kv_len=20), device=H100,
                         block_sizes=BlockSizes(block_q=128, block_k=128))
    assert max(r.block_q for r in (plan.forward, plan.dq, plan.dkdv)) == 16
    assert max(r.block_k for r in (plan.forward, plan.dq, plan.dkdv)) <= 32


def test_oversized_overrides_are_rejected_before_compiling():
    with pytest.raises(ValueError, match=r"forward kernel.*232448"):
        dispatch.plan(call(256), device=H100,
                      block_sizes=BlockSizes(block_q=256, block_k=256, num_stages=8))
    # The interpreter has no shared-memory limit.
    dispatch.plan(call(256), interpret=True,
                  block_sizes=BlockSizes(block_q=256, block_k=256, num_stages=8))
    with pytest.raises(ValueError, match=r"forward_backend='mosaic'.*over the device's 232448"):
        dispatch.plan(call(), device=H100,
                      block_sizes=BlockSizes(forward_backend="mosaic", block_k=128,
                                             num_stages=3))
    # Without block_k, three slots of 64 keys fit where three of 128 do not.
    three = dispatch.plan(call(), device=H100,
                          block_sizes=BlockSizes(forward_backend="mosaic", num_stages=3))
    assert (three.forward.block_k, three.forward.num_stages) == (64, 3)


def test_narrow_in_turn_passes_take_the_dbias_kernel_unless_any_order():
    narrow = TABLE["bias_shared_narrow_passes"][0]
    why = dict(dispatch.plan(narrow, device=H100).dbias.declined)["fused"]
    assert "32 batch entries, each pass has 64 dK/dV work items" in why
    any_order = dispatch.plan(narrow, device=H100, block_sizes=BlockSizes(deterministic=False))
    assert (any_order.dbias.fused, any_order.dbias.any_order) == (True, True)
    forced = dispatch.plan(narrow, device=H100, block_sizes=BlockSizes(fuse_dbias=True))
    assert (forced.dbias.fused, forced.dbias.any_order) == (True, False)
    # Per-batch biases take no passes; one batch entry is one pass; a batch-shared bias
    # per key is summed per batch entry and head (column sums), in no passes either.
    for other in (call(bias_shape=(32, 8, 1024, 1024), batch=32, heads=8, kv_heads=8,
                       q_len=1024, kv_len=1024),
                  call(bias_shape=(1, 8, 1024, 1024), batch=1, heads=8, kv_heads=8,
                       q_len=1024, kv_len=1024),
                  call(bias_shape=(1, 8, 1, 1024), batch=32, heads=8, kv_heads=8,
                       q_len=1024, kv_len=1024)):
        assert dispatch.plan(other, device=H100).dbias.fused
        free = dispatch.plan(other, device=H100, block_sizes=BlockSizes(deterministic=False))
        assert not free.dbias.any_order


@pytest.mark.parametrize("bias_shape,batch,kv_heads,kv_len,expected", [
    ((4, 16, 4096, 4096), 4, 16, 4096, True),   # 32 key tiles x 4 x 16: 2048 programs
    ((4, 16, 4096, 4096), 4, 8, 4096, True),    # GQA: each program owns 2 heads' tiles
    ((4, 16, 1, 4096), 4, 16, 4096, True),      # per-key bias: a sum over rows, in registers
    ((1, 16, 4096, 4096), 1, 16, 4096, True),   # batch 1: nothing to sum
    ((1, 16, 4096, 4096), 4, 16, 4096, False),  # sums over the batch: the dbias kernel
    ((4, 1, 4096, 4096), 4, 16, 4096, False),   # sums over heads
    ((1, 16, 4096, 1), 1, 16, 4096, False),     # sums along keys
    ((4, 16, 256, 256), 4, 4, 256, False),      # 2 key tiles x 4 x 4: 32 programs
])
def test_triton_fused_dbias(bias_shape, batch, kv_heads, kv_len, expected):
    base = dict(bias_shape=bias_shape, batch=batch, kv_heads=kv_heads, kv_len=kv_len,
                q_len=kv_len)
    plan = dispatch.plan(call(**base), device=H100,
                         block_sizes=dataclasses.replace(TRITON_ONLY, block_k_dkv=128))
    assert plan.dbias.fused is expected
    fusable = triton.fusable_dbias(bias_shape, batch=batch, num_heads=16)
    for choice in (False, True) if fusable else (False,):  # an explicit choice is kept
        forced = dispatch.plan(call(**base), device=H100, block_sizes=dataclasses.replace(
            TRITON_ONLY, fuse_dbias=choice))
        assert forced.dbias.fused is choice
    if not fusable:
        with pytest.raises(ValueError, match="fuse_dbias=True needs a bias with its own"):
            dispatch.plan(call(**base), device=H100,
                          block_sizes=dataclasses.replace(TRITON_ONLY, fuse_dbias=True))


def test_the_wide_backward_kernels_routes():
    """Head dim 256 (or a value head dim of 256): the dQ and dK/dV kernels' consumers
    share each tile, 64 x 64 tiles; dK/dV takes two slots, one where a bias leaves no room
    for two; tiles, slots or a bias that do not fit are refused naming the field."""
    budget = H100.max_shared_memory_per_block
    for c in (call(256), call(64, value_head_dim=256), call(192, value_head_dim=64)):
        plan = dispatch.plan(c, device=H100)
        assert (plan.dkdv.backend, plan.dkdv.block_q, plan.dkdv.block_k,
                plan.dkdv.num_stages) == ("mosaic", 64, 64, 2)
        assert (plan.dq.backend, plan.dq.block_q, plan.dq.block_k, plan.dq.consumers) == (
            "mosaic", 64, 64, 2)
    assert mosaic.dkv_scratch(256, 256, 2, "bfloat16").bytes <= budget
    assert mosaic.dkv_scratch(256, 256, 2, "bfloat16", "bfloat16").bytes > budget
    biased = dispatch.plan(call(256, bias_shape=(4, 16, 4096, 4096)), device=H100)
    assert (biased.dkdv.backend, biased.dkdv.num_stages, biased.dbias.fused) == (
        "mosaic", 1, True)
    with pytest.raises(ValueError, match=r"dkv_backend='mosaic' does not cover this call: it "
                                         r"runs \(block_q_dkv, block_k_dkv\) = \(64, 64\)"):
        dispatch.plan(call(256), device=H100,
                      block_sizes=BlockSizes(block_k_dkv=32, dkv_backend="mosaic"))
    with pytest.raises(ValueError, match=r"dq_backend='mosaic' does not cover this call: it "
                                         r"runs \(block_q_dq, block_k_dq\) = \(64, 64\)"):
        dispatch.plan(call(256), device=H100,
                      block_sizes=BlockSizes(block_q_dq=32, dq_backend="mosaic"))
    with pytest.raises(ValueError, match="dkv_backend='mosaic' does not cover this call: its "
                                         "buffers need 2"):
        dispatch.plan(call(256, bias_shape=(4, 16, 4096, 4096)), device=H100,
                      block_sizes=BlockSizes(num_stages_dkv=2, dkv_backend="mosaic"))


@pytest.mark.parametrize("role,field", [("forward", "forward_backend"),
                                        ("dq", "dq_backend"), ("dkdv", "dkv_backend"),
                                        ("dbias", "dbias_backend")])
def test_mosaic_needs_hopper_even_where_the_role_does_not_run(role, field):
    with pytest.raises(ValueError, match=f"{field}='mosaic' does not cover this call: needs "
                                         "an sm90"):
        dispatch.plan(call(), device=DEVICES["sm80"],
                      block_sizes=BlockSizes(**{field: "mosaic"}))


# ------------------------------------------------------------------ the tile cache
def test_cached_tiles_are_used_for_the_triton_routes():
    from pallas_attn.tuning import cache

    tuned = BlockSizes(64, 32, 32, 64, 64, 32, 8, 2, 4, 1, 4, 2)
    key = cache.entry_key("bfloat16", 128, 128, 4096, 4096, {"is_causal": True})
    cache.store(H100, key, tuned)
    plan = dispatch.plan(call(q_len=4000, is_causal=True), device=H100, block_sizes=TRITON_ONLY)
    assert (plan.forward.block_q, plan.forward.block_k, plan.forward.num_warps,
            plan.forward.num_stages) == (64, 32, 8, 2)  # 4000 falls in the 4096 bucket
    assert (plan.dkdv.block_q, plan.dkdv.block_k) == (32, 64)
    other = dispatch.plan(call(), device=H100, block_sizes=TRITON_ONLY)
    assert other.forward.block_q != 64  # a different feature set does not use the entry
    # On Hopper the Mosaic kernels still take their roles.
    assert backends(dispatch.plan(call(is_causal=True), device=H100))[:3] == ("mosaic",) * 3


def test_cached_tiles_that_do_not_fit_the_call_fall_back_to_the_ladder():
    """The cache keys no mask: 64 x 64 dQ tiles tuned at d256 without one would need
    more than the H100's shared memory with it (its tiles and K's cleaned copy)."""
    from pallas_attn.tuning import cache

    tuned = BlockSizes(64, 64, 64, 64, 64, 64, 4, 2, 8, 2, 4, 2)
    cache.store(H100, cache.entry_key("bfloat16", 256, 256, 4096, 4096, {}), tuned)
    plain = dispatch.plan(call(256), device=H100, block_sizes=TRITON_ONLY)
    assert (plain.dq.block_q, plain.dq.block_k, plain.dq.num_stages) == (64, 64, 2)
    c = call(256, mask_shape=(4, 1, 4096, 4096))
    masked = dispatch.plan(c, device=H100, block_sizes=TRITON_ONLY)
    assert (masked.dq.block_q, masked.dq.block_k) != (64, 64)
    assert _need(masked, c, "dq") <= H100.max_shared_memory_per_block


# ------------------------------------------------------------------ explain
def _arrays(T=256, H=128, dtype=jnp.bfloat16):
    q = jnp.zeros((2, T, 4, H), dtype)
    return q, q, q


def test_explain_takes_arrays_or_shapes_and_a_device():
    q, k, v = _arrays(T=1024)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
    a = pallas_attn.explain(q, k, v, is_causal=True, alibi_slopes=jnp.ones(4), device=H100)
    b = pallas_attn.explain(*shapes, is_causal=True, alibi_slopes=slopes, device=H100)
    assert a == b and a.implementation == "pallas"
    # Static arguments as JAX scalars, as jax.nn's callers write them.
    c = pallas_attn.explain(q, k, v, is_causal=jnp.bool_(True), scale=1 / jnp.sqrt(128.0),
                            alibi_slopes=slopes, device=H100)
    assert c == a
    lines = str(a).splitlines()
    assert lines[0] == "problem: B=2 T=1024 S=1024 N=4 H=128 bfloat16, causal, alibi_slopes"
    assert lines[1].startswith("implementation: pallas")
    assert [line.split()[:2] for line in lines[2:]] == [
        ["forward", "mosaic"], ["dQ", "mosaic"], ["dK/dV", "mosaic"]]


def test_short_causal_problems_run_the_triton_backward():
    """Causal at head dims 97-128 below 1024 query rows per kv head: the Triton dQ and dK/dV
    (measured faster there); not from 1024 rows, with GQA groups that reach them, at head
    dim 64, bottom-right with S > T (rows see the earlier keys), with a bias, or where
    block_sizes names the Mosaic kernels."""
    def plan(T=512, N=4, K=4, H=128, S=None, Hv=None, **kw):
        q = jax.ShapeDtypeStruct((2, T, N, H), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((2, S or T, K, H), jnp.bfloat16)
        v = jax.ShapeDtypeStruct((2, S or T, K, Hv or H), jnp.bfloat16)
        return pallas_attn.explain(q, k, v, is_causal=kw.pop("is_causal", True),
                                   device=H100, **kw)

    # A ring attention block (its origin given): most blocks are whole.
    ring_block = dispatch.plan(dispatch.Call(AttentionSpec(scale=0.1, is_causal=True), 2, 512,
                                             512, 4, 4, 128, 128, "bfloat16", None,
                                             ("origin",)), device=H100)
    short = plan()
    assert (short.forward.backend, short.dq.backend, short.dkdv.backend) == (
        "mosaic", "triton", "triton")
    assert "causal with 512 query rows per kv head (under 1024)" in str(short)
    # Top-left with more keys: no row sees past key 512, as above; so bottom-right with
    # fewer keys; head dims 97-128 too (112 would run the Mosaic kernels at 112 columns).
    for same in (plan(S=4096), plan(S=256, causal_alignment="bottom_right"), plan(H=112),
                 plan(H=104, Hv=128)):
        assert (same.dq.backend, same.dkdv.backend) == ("triton", "triton"), same
    for other in (plan(T=1024), plan(N=8, K=4), plan(H=64), plan(H=64, Hv=128),
                  plan(is_causal=False),
                  plan(S=4096, causal_alignment="bottom_right"),
                  ring_block,
                  plan(bias=jax.ShapeDtypeStruct((1, 4, 512, 512), jnp.bfloat16)),
                  plan(mask=jax.ShapeDtypeStruct((2, 1, 512, 512), jnp.bool_)),
                  plan(q_segment_ids=jax.ShapeDtypeStruct((2, 512), jnp.int32),
                       kv_segment_ids=jax.ShapeDtypeStruct((2, 512), jnp.int32)),
                  plan(block_sizes=pallas_attn.BlockSizes(dq_backend="mosaic",
                                                          dkv_backend="mosaic"))):
        # (Causal segment ids keep their own rule: the Triton dK/dV beside the Mosaic dQ.)
        assert other.dq.backend == "mosaic" and "under 1024" not in str(other), other


def test_explain_names_every_role_and_the_reasons():
    q, k, v = _arrays(H=64)
    bias = jnp.zeros((1, 1, 256, 256), jnp.bfloat16)
    text = str(pallas_attn.explain(q, k, v, bias, device=DEVICES["sm80"]))
    roles = [line.split()[0] for line in text.splitlines()[2:] if not line.startswith(" ")]
    assert roles == ["forward", "dQ", "dK/dV", "dbias"]
    assert "not mosaic: needs an sm90 (Hopper) GPU, this one is sm80" in text
    assert "not fused:" in text


def test_the_repair_of_marked_rows_is_a_route_of_the_plan():
    """Where keys can be hidden, the Mosaic forward and dQ carry the Triton kernel that
    recomputes the rows they mark, and with a mask or ids the Mosaic dK/dV too; the plan
    (and so `explain`) says so, nowhere else."""
    q, k, v = _arrays(T=1024)
    plain = pallas_attn.explain(q, k, v, device=H100)
    assert plain.forward.backend == "mosaic" and plain.forward.repair is None
    assert "recomputed" not in str(plain)
    causal = pallas_attn.explain(q, k, v, is_causal=True, device=H100)
    for role in ("forward", "dq"):
        route = causal.route(role)
        assert route.backend == "mosaic", role
        assert route.repair == Route("triton", *triton.REPAIR_TILES), role
    assert causal.dkdv.repair is None
    assert str(causal).count("marked rows recomputed by triton 64x32, 4 warps, 1 stages") == 2
    # A mask or ids reach the Mosaic dK/dV's scores alone: it marks keys for the repair too.
    B, T = q.shape[:2]
    for hiding in (dict(mask=jnp.ones((B, 1, T, T), bool)),
                   dict(q_segment_ids=jnp.zeros((B, T), jnp.int32))):
        plan = pallas_attn.explain(q, k, v, device=H100, **hiding)
        assert plan.dkdv.backend == "mosaic" and plan.dkdv.repair == Route(
            "triton", *triton.REPAIR_TILES), hiding
        assert "marked keys recomputed by triton" in str(plan), hiding
    # Where dS is also the bias's gradient the dK/dV marks nothing; the dbias it writes
    # has no repair of its own.
    N = q.shape[2]
    biased = pallas_attn.explain(q, k, v, device=H100, mask=jnp.ones((B, 1, T, T), bool),
                                 bias=jnp.zeros((1, N, T, T), q.dtype))
    assert biased.dbias.fused and biased.dbias.repair is None
    assert "marked keys (unless the bias takes a gradient) recomputed" in str(biased)
    dbias_line = [line for line in str(biased).splitlines() if line.startswith("dbias")]
    assert dbias_line and "recomputed" not in dbias_line[0]
    triton_only = pallas_attn.explain(q, k, v, is_causal=True, device=H100,
                                      block_sizes=TRITON_ONLY)
    assert triton_only.forward.repair is None and triton_only.dq.repair is None


def test_explain_on_this_machine_plans_the_reference():
    q, k, v = _arrays()
    plan = pallas_attn.explain(q, k, v)
    assert backends(plan) == ("xla",) * 3 + (None,)
    assert "no NVIDIA GPU" in str(plan)
    long = jax.ShapeDtypeStruct((1, 4096, 1, 64), jnp.float32)
    assert pallas_attn.explain(long, long, long).implementation == "xla_chunked"
    assert pallas_attn.explain(q, k, v, interpret=True).forward.backend == "triton"


def test_explain_validates_like_the_op():
    q, k, v = _arrays()
    with pytest.raises(TypeError, match="device must be a pallas_attn.DeviceInfo"):
        pallas_attn.explain(q, k, v, device="sm90")
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        pallas_attn.explain(q, k, v, implementation="cuda")
    with pytest.raises(ValueError, match="query heads"):
        pallas_attn.explain(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(TypeError, match="block_sizes must be a pallas_attn.BlockSizes"):
        pallas_attn.explain(q, k, v, block_sizes={"block_q": 64})
    # return_residual changes no kernel: the same plan, and checked as the op checks it.
    assert str(pallas_attn.explain(q, k, v, return_residual=True)) == str(
        pallas_attn.explain(q, k, v))
    with pytest.raises(TypeError, match="return_residual must be a bool"):
        pallas_attn.explain(q, k, v, return_residual="yes")


def test_the_cli_explains_a_problem():
    out = subprocess.run(
        [sys.executable, "-m", "pallas_attn", "explain", "--head-dim", "64", "--causal",
         "--capability", "9.0", "--bias", "1,1"],
        capture_output=True, text=True, check=True, timeout=100).stdout
    lines = out.splitlines()
    assert any(line.startswith("dK/dV   mosaic") for line in lines), out
    assert any(line.startswith("forward mosaic") for line in lines), out
    assert any(line.startswith("dbias   mosaic") for line in lines), out


def test_the_readme_support_matrix_is_the_routing_table():
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    start, end = "<!-- support-matrix -->\n", "<!-- /support-matrix -->"
    assert start in readme and end in readme
    table = readme.split(start)[1].split(end)[0].strip()
    assert table == dispatch.support_matrix(), (
        "README.md's support matrix is stale: paste pallas_attn.dispatch.support_matrix()")


# ------------------------------------------------------------------ the layout
def _package_modules() -> dict[str, pathlib.Path]:
    root = pathlib.Path(pallas_attn.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package modules a module imports (at any depth of its code)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join(name.split(".")[:-node.level] + [node.module])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in modules and m != name}


def test_the_package_has_no_import_cycles():
    modules = _package_modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph[node]:
            if nxt == "pallas_attn" or nxt in stack[:1]:
                continue  # the package root only re-exports
            if state.get(nxt) == "open":
                raise AssertionError(f"import cycle: {' -> '.join([*stack, nxt])}")
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name != "pallas_attn" and name not in state:
            visit(name, [name])


def test_every_module_imports_on_its_own():
    """Each module first, with no other module of the package imported before it (one
    fresh interpreter; the package is dropped from sys.modules between imports)."""
    names = sorted(_package_modules())
    script = (
        "import importlib, sys\n"
        "failed = {}\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] == 'pallas_attn']:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed[name] = repr(e)\n"
        "print(failed)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=100)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "{}", result.stdout
