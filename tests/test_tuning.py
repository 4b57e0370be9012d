"""Tile choice: DeviceInfo, BlockSizes validation, shared-memory fit, the autotune cache."""

import dataclasses
import functools
import json
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn
from pallas_attn import autotune, tuning
from pallas_attn.tuning import BlockSizes, DeviceInfo

# Opt-in shared memory per block: sm86/sm89 (99 KB), sm80 (163 KB), sm90 (227 KB).
DEVICES = {
    "sm86": DeviceInfo((8, 6), 84, 101376),
    "sm89": DeviceInfo((8, 9), 128, 101376),
    "sm80": DeviceInfo((8, 0), 108, 166912),
    "sm90": DeviceInfo((9, 0), 132, 232448),
}
HEAD_DIMS = (32, 40, 64, 80, 96, 128, 160, 192, 256)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
FEATURES = ({}, {"bias_dtype": jnp.bfloat16, "has_bias": True}, {"has_mask": True},
            {"bias_dtype": jnp.float32, "has_mask": True, "has_bias": True})


def _area(b: BlockSizes) -> tuple[int, ...]:
    return (b.block_q * b.block_k, b.block_q_dkv * b.block_k_dkv, b.block_q_dq * b.block_k_dq,
            b.block_q_dbias * b.block_k_dbias)


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PALLAS_ATTN_CACHE_DIR", str(tmp_path / "cache"))


def test_device_info_by_hand_and_table():
    d = DeviceInfo(compute_capability=(9, 0), num_multiprocessors=132,
                   max_shared_memory_per_block=232448)
    assert d == DEVICES["sm90"] and hash(d) == hash(DEVICES["sm90"])
    assert DeviceInfo.for_capability((8, 0)).max_shared_memory_per_block == 166912
    assert DeviceInfo.for_capability((8, 6)).max_shared_memory_per_block == 101376
    assert isinstance(DeviceInfo.current(), DeviceInfo)  # CPU: the default description
    assert DeviceInfo.current() is DeviceInfo.current()  # read once, cached


@pytest.mark.parametrize("bad", [dict(compute_capability="9.0"),
                                 dict(num_multiprocessors=0),
                                 dict(max_shared_memory_per_block=-1)])
def test_device_info_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        DeviceInfo(**bad)


@pytest.mark.parametrize("field,value", [("block_q", 24), ("block_k", 8), ("block_q_dq", 0),
                                         ("num_warps", 3), ("num_stages", 0),
                                         ("num_stages_dq", 9), ("num_warps_dkv", 32),
                                         ("block_k_dbias", 48), ("num_warps_dbias", 3),
                                         ("num_stages_dbias", 0)])
def test_block_sizes_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"BlockSizes.{field}"):
        BlockSizes(**{field: value})


def test_block_sizes_hashable_and_frozen():
    b = BlockSizes()
    assert hash(b) == hash(BlockSizes())
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.block_q = 64


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_chosen_tiles_fit_every_device(device, dtype):
    info = DEVICES[device]
    for head_dim in HEAD_DIMS:
        for features in FEATURES:
            b = pallas_attn.choose_block_sizes(head_dim, dtype, q_len=4096, kv_len=4096,
                                               device=info, **features)
            smem = {k: v for k, v in features.items() if k in ("bias_dtype", "has_mask")}
            est = tuning.shared_memory_estimate(b, head_dim, head_dim, dtype, **smem)
            assert max(est.values()) <= info.max_shared_memory_per_block, (head_dim, est)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_more_shared_memory_never_gives_smaller_tiles(dtype):
    order = ["sm86", "sm80", "sm90"]
    for head_dim in HEAD_DIMS:
        for features in FEATURES:
            areas = [_area(pallas_attn.choose_block_sizes(
                head_dim, dtype, q_len=4096, kv_len=4096, device=DEVICES[d], **features))
                for d in order]
            for small, large in zip(areas, areas[1:], strict=False):
                assert all(s <= l_ for s, l_ in zip(small, large, strict=True)), (
                    head_dim, features, areas)


def test_tiles_are_clamped_to_short_sequences():
    b = pallas_attn.choose_block_sizes(64, jnp.bfloat16, q_len=5, kv_len=20,
                                       device=DEVICES["sm90"])
    assert max(b.block_q, b.block_q_dkv, b.block_q_dq, b.block_q_dbias) == 16
    assert max(b.block_k, b.block_k_dkv, b.block_k_dq, b.block_k_dbias) <= 32


def test_choose_block_sizes_is_pure_and_validates():
    a = pallas_attn.choose_block_sizes(128, jnp.bfloat16, q_len=1000, kv_len=3000,
                                       device=DEVICES["sm80"])
    b = pallas_attn.choose_block_sizes(128, jnp.bfloat16, q_len=1000, kv_len=3000,
                                       device=DEVICES["sm80"])
    assert a == b
    with pytest.raises(ValueError, match="head_dim"):
        pallas_attn.choose_block_sizes(300, q_len=16, kv_len=16)
    with pytest.raises(ValueError, match="q_len"):
        pallas_attn.choose_block_sizes(64, q_len=0, kv_len=16)
    with pytest.raises(ValueError, match="kv_len"):
        pallas_attn.choose_block_sizes(64, q_len=16, kv_len=2.5)
    with pytest.raises(ValueError, match="value_head_dim"):
        pallas_attn.choose_block_sizes(64, q_len=16, kv_len=16, value_head_dim=512)


def test_oversized_override_is_rejected_before_compiling():
    huge = BlockSizes(block_q=256, block_k=256, num_stages=8)
    with pytest.raises(ValueError, match=r"forward kernel.*232448"):
        tuning.check_fits(huge, 256, 256, jnp.bfloat16, DEVICES["sm90"])


def test_explicit_override_is_honoured(monkeypatch):
    seen = {}
    from pallas_attn.kernels import attention as kernel_attention

    real = kernel_attention.prepare

    def spy(spec, ops, blocks, interpret):
        seen["blocks"] = blocks
        return real(spec, ops, blocks, interpret)

    monkeypatch.setattr(kernel_attention, "prepare", spy)
    q = jax.random.normal(jax.random.key(0), (1, 20, 2, 16))
    override = BlockSizes(16, 32, 32, 16, 16, 32, num_warps=2, num_stages=1)
    pallas_attn.dot_product_attention(q, q, q, implementation="pallas", interpret=True,
                                      block_sizes=override)
    assert seen["blocks"] == override


def test_cache_round_trip_and_lookup():
    device = DEVICES["sm90"]
    tuned = BlockSizes(64, 32, 32, 64, 64, 32, num_warps=8, num_stages=2)
    features = {"is_causal": True}
    key = autotune.entry_key(jnp.bfloat16, 128, 128, 4096, 4096, features)
    path = autotune.store(device, key, tuned)
    assert json.loads(path.read_text())["entries"][key]["block_q"] == 64
    got = pallas_attn.choose_block_sizes(128, jnp.bfloat16, q_len=4000, kv_len=4096,
                                         device=device, is_causal=True)
    assert got == tuned  # 4000 falls in the 4096 bucket
    other = pallas_attn.choose_block_sizes(128, jnp.bfloat16, q_len=4096, kv_len=4096,
                                           device=device, is_causal=False)
    assert other != tuned  # a different feature set does not use the entry


def test_corrupt_or_stale_cache_is_ignored_with_a_warning():
    device = DEVICES["sm80"]
    path = autotune.cache_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring pallas_attn tile cache"):
        b = pallas_attn.choose_block_sizes(64, q_len=512, kv_len=512, device=device)
    assert isinstance(b, BlockSizes)
    path.write_text(json.dumps({"version": autotune.CACHE_VERSION, "jax": "0.0.1",
                                "entries": {}}))
    with pytest.warns(UserWarning, match="tuned with jax 0.0.1"):
        pallas_attn.choose_block_sizes(64, q_len=512, kv_len=512, device=device)
    key = autotune.entry_key(jnp.bfloat16, 64, 64, 512, 512, {})
    path.write_text(json.dumps({"version": autotune.CACHE_VERSION, "jax": jax.__version__,
                                "entries": {key: {"block_q": 24}}}))
    with pytest.warns(UserWarning, match="stale"):
        b = pallas_attn.choose_block_sizes(64, q_len=512, kv_len=512, device=device)
    assert b.block_q != 24
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path.unlink()
        pallas_attn.choose_block_sizes(64, q_len=512, kv_len=512, device=device)


def test_dbias_estimate_matches_the_measured_requests():
    """Shared memory Triton requested on an H100 (d128, bf16), from RESOURCE_EXHAUSTED
    messages: the estimate may be at most 512 bytes over, never under."""
    measured = {(128, 64, 8, 3): 294912, (128, 64, 4, 3): 295424, (128, 32, 8, 3): 245760,
                (128, 32, 4, 3): 246272, (128, 128, 8, 2): 262144, (128, 128, 4, 2): 262656}
    for entry, request in measured.items():
        b = tuning.with_kernel(BlockSizes(), "dbias", entry)
        estimate = tuning.shared_memory_estimate(b, 128, 128, jnp.bfloat16,
                                                 bias_dtype=jnp.bfloat16)["dbias"]
        assert request <= estimate <= request + 512, (entry, estimate, request)


def test_bias_dropout_and_soft_cap_problems_get_their_measured_tiles_on_an_h100():
    b = pallas_attn.choose_block_sizes(128, jnp.bfloat16, q_len=4096, kv_len=4096,
                                       device=DEVICES["sm90"], bias_dtype=jnp.bfloat16,
                                       has_bias=True)
    assert b.tiles("forward") == (128, 64, 8, 4)  # 8 warps: the 4-warp one spills
    assert b.tiles("dq") == (128, 64, 8, 3)  # no longer shrunk to fit dbias's needs
    assert b.tiles("dbias") == (64, 128, 8, 2)
    plain = pallas_attn.choose_block_sizes(128, jnp.bfloat16, q_len=4096, kv_len=4096,
                                           device=DEVICES["sm90"])
    assert plain.tiles("forward") == (128, 64, 4, 3)
    for feature in ("has_dropout", "has_soft_cap"):  # extra per-score work, like a bias
        b = pallas_attn.choose_block_sizes(128, jnp.bfloat16, q_len=4096, kv_len=4096,
                                           device=DEVICES["sm90"], **{feature: True})
        assert b.tiles("forward") == (128, 64, 8, 4), feature


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
def test_resolve_fuse_dbias(bias_shape, batch, kv_heads, kv_len, expected):
    blocks = tuning.with_kernel(BlockSizes(), "dkdv", (64, 128, 4, 2))
    resolve = functools.partial(tuning.resolve_fuse_dbias, bias_shape=bias_shape, batch=batch,
                                num_heads=16, num_kv_heads=kv_heads, kv_len=kv_len,
                                device=DEVICES["sm90"])
    got = resolve(blocks)
    assert got.fuse_dbias is expected
    assert dataclasses.replace(got, fuse_dbias=None) == blocks
    fusable = tuning.fusable_dbias(bias_shape, batch=batch, num_heads=16)
    for choice in (False, True) if fusable else (False,):  # an explicit choice is kept
        assert resolve(dataclasses.replace(blocks, fuse_dbias=choice)).fuse_dbias is choice
    if not fusable:
        with pytest.raises(ValueError, match="fuse_dbias=True needs a bias with its own"):
            resolve(dataclasses.replace(blocks, fuse_dbias=True))


def test_sweep_entries_respect_the_budget():
    entries = autotune.sweep_entries("dkdv", 256, 256, jnp.bfloat16, 101376, 4096, 4096)
    assert entries
    for entry in entries:
        b = tuning.with_kernel(BlockSizes(), "dkdv", entry)
        assert tuning.shared_memory_estimate(b, 256, 256, jnp.bfloat16)["dkdv"] <= 101376


def test_tune_picks_the_fastest_and_reports_failures():
    calls = []

    def make_step(candidate):
        calls.append(candidate)
        if candidate == "broken":
            raise RuntimeError("Shared memory size limit exceeded")
        return lambda: np.sin(np.arange(1000 * candidate))

    best, results = autotune.tune(make_step, [3, "broken", 1, 2])
    assert best == 1
    assert any(err for _, _, err in results if err.startswith("RuntimeError"))
    assert calls == [3, "broken", 1, 2]


# ----------------------------------------------------------------- the Mosaic forward
MOSAIC_SCORES = {"mosaic_scores": True}


@pytest.mark.parametrize("head_dim,value_head_dim", [(128, 128), (80, 128), (96, 72)])
@pytest.mark.parametrize("band", [{}, {"is_causal": True}, {"has_window": True}],
                         ids=["full", "causal", "window"])
def test_hopper_mosaic_scores_at_head_dim_128_get_the_mosaic_forward(head_dim, value_head_dim,
                                                                    band):
    for dtype in (jnp.bfloat16, jnp.float16):
        b = pallas_attn.choose_block_sizes(head_dim, dtype, q_len=4096, kv_len=4096,
                                           value_head_dim=value_head_dim,
                                           device=DEVICES["sm90"], **band, **MOSAIC_SCORES)
        assert (b.forward_backend, b.block_q, b.block_k, b.num_stages) == ("mosaic", 128,
                                                                          128, 2)
        triton = pallas_attn.choose_block_sizes(head_dim, dtype, q_len=4096, kv_len=4096,
                                                value_head_dim=value_head_dim,
                                                device=DEVICES["sm90"], **band)
        # Only the forward, dK/dV and dQ change (the Mosaic kernels' fixed tiles);
        # the other backward tiles are the Triton heuristic's.
        assert (b.dkv_backend, b.block_q_dkv, b.block_k_dkv, b.num_stages_dkv) == (
            "mosaic", 64, 128, 2)
        assert (b.dq_backend, b.block_q_dq, b.block_k_dq, b.num_stages_dq) == (
            "mosaic", 128, 64, 2)
        assert dataclasses.replace(
            b, forward_backend="triton", block_q=triton.block_q, block_k=triton.block_k,
            num_stages=triton.num_stages, num_warps=triton.num_warps, dkv_backend="triton",
            dq_backend="triton",
            **{f: getattr(triton, f) for f in ("block_q_dkv", "block_k_dkv",
                                              "num_stages_dkv", "block_q_dq", "block_k_dq",
                                              "num_stages_dq")}) == triton
        est = tuning.shared_memory_estimate(b, head_dim, value_head_dim, dtype)
        assert est["forward"] <= DEVICES["sm90"].max_shared_memory_per_block


@pytest.mark.parametrize("case", [
    dict(device="sm80"), dict(dtype=jnp.float32), dict(head_dim=64), dict(head_dim=256),
    dict(value_head_dim=64), dict(mosaic_scores=False),
    dict(q_len=100),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_the_triton_forward_stays_where_mosaic_was_not_measured_faster(case):
    case = dict(case)
    args = dict(head_dim=case.pop("head_dim", 128), dtype=case.pop("dtype", jnp.bfloat16),
                q_len=case.pop("q_len", 4096), kv_len=4096,
                value_head_dim=case.pop("value_head_dim", None),
                device=DEVICES[case.pop("device", "sm90")])
    b = pallas_attn.choose_block_sizes(**args, **{**MOSAIC_SCORES, **case})
    assert b.forward_backend == "triton"


def test_mosaic_forward_replaces_tuned_forward_tiles_and_keeps_the_rest():
    device = DEVICES["sm90"]
    tuned = BlockSizes(64, 32, 32, 64, 64, 32, num_warps=8, num_stages=2)
    key = autotune.entry_key(jnp.bfloat16, 128, 128, 4096, 4096, MOSAIC_SCORES)
    autotune.store(device, key, tuned)
    got = pallas_attn.choose_block_sizes(128, jnp.bfloat16, q_len=4096, kv_len=4096,
                                         device=device, **MOSAIC_SCORES)
    assert got == dataclasses.replace(tuned, forward_backend="mosaic", block_q=128,
                                      block_k=128, num_stages=2, dkv_backend="mosaic",
                                      block_q_dkv=64, block_k_dkv=128, num_stages_dkv=2,
                                      dq_backend="mosaic", block_q_dq=128, block_k_dq=64)


def test_mosaic_tiles_are_not_clamped():
    b = BlockSizes(128, 128, num_stages=2, forward_backend="mosaic").clamp(20, 30)
    assert (b.block_q, b.block_k) == (128, 128) and b.block_q_dkv == 32


def test_mosaic_scores_reach_the_choice_on_a_gpu_only(monkeypatch):
    """resolve_block_sizes marks the scores the Mosaic forward computes (a full bias
    included); the interpreter never auto-picks Mosaic, and a float32 bias does not
    fit its shared memory."""
    from pallas_attn.kernels import attention as kernel_attention
    from pallas_attn.spec import normalize

    seen = []
    real = tuning.choose_block_sizes

    def spy(*args, **kwargs):
        seen.append(kwargs["mosaic_scores"])
        return real(*args, **kwargs)

    monkeypatch.setattr(tuning, "choose_block_sizes", spy)
    monkeypatch.setattr(tuning.DeviceInfo, "current", staticmethod(lambda: DEVICES["sm90"]))
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    cases = [  # (kwargs, interpret, marked, runs the Mosaic forward)
        ({}, False, True, True),
        ({}, True, False, False),
        ({"logits_soft_cap": 3.0}, False, True, True),
        ({"bias": jnp.zeros((1, 2, 256, 256), jnp.bfloat16)}, False, True, True),
        ({"bias": jnp.zeros((1, 2, 256, 256), jnp.float32)}, False, True, False),
        ({"bias": jnp.zeros((1, 2, 1, 256), jnp.bfloat16)}, False, False, False),
        ({"dropout_rate": 0.1, "dropout_rng": jax.random.key(1)}, False, False, False),
    ]
    for kwargs, interpret, marked, mosaic in cases:
        spec, ops, _ = normalize(q, q, q, kwargs.pop("bias", None), **kwargs)
        blocks = kernel_attention.resolve_block_sizes(spec, ops, None, interpret)
        assert (seen[-1], blocks.forward_backend == "mosaic") == (marked, mosaic), kwargs


def test_persistent_programs(monkeypatch):
    monkeypatch.setattr(tuning.DeviceInfo, "current", staticmethod(lambda: DEVICES["sm90"]))
    assert tuning.persistent_programs(2048, interpret=False) == 132
    assert tuning.persistent_programs(40, interpret=False) == 40
    assert tuning.persistent_programs(5, interpret=True) == 2
    assert tuning.persistent_programs(1, interpret=True) == 1


def test_oversized_mosaic_override_is_rejected_before_compiling():
    """Three 128-key slots at head dim 128 need more than an H100's 227 KB."""
    mosaic = BlockSizes(128, 128, num_stages=3, forward_backend="mosaic")
    with pytest.raises(ValueError, match=r"forward kernel.*232448"):
        tuning.check_fits(mosaic, 128, 128, jnp.bfloat16, DEVICES["sm90"])
    tuning.check_fits(dataclasses.replace(mosaic, num_stages=2), 128, 128, jnp.bfloat16,
                      DEVICES["sm90"])


def test_float32_bias_on_the_mosaic_forward_needs_64_key_tiles():
    """A float32 bias tile per consumer overflows 128-key tiles (2 slots), not 64-key
    ones; a 16-bit bias fits either. The estimate adds the consumers' bias buffers
    (block_q * block_k * itemsize) and their two 8-byte barriers."""
    mosaic = BlockSizes(128, 128, num_stages=2, forward_backend="mosaic")
    plain = tuning.shared_memory_estimate(mosaic, 128, 128, jnp.float16)["forward"]
    for bias_dtype in (jnp.float16, jnp.float32):
        est = tuning.shared_memory_estimate(mosaic, 128, 128, jnp.float16,
                                            bias_dtype=bias_dtype)["forward"]
        assert est == plain + 128 * 128 * jnp.dtype(bias_dtype).itemsize + 16
    with pytest.raises(ValueError, match=r"262248 bytes .* in the forward kernel.*232448"):
        tuning.check_fits(mosaic, 128, 128, jnp.float16, DEVICES["sm90"],
                          bias_dtype=jnp.float32)
    for block_sizes, bias_dtype in ((mosaic, jnp.bfloat16),
                                    (dataclasses.replace(mosaic, block_k=64), jnp.float32)):
        tuning.check_fits(block_sizes, 128, 128, jnp.float16, DEVICES["sm90"],
                          bias_dtype=bias_dtype)


def test_time_call_queues_fast_calls_in_batches_and_runs_slow_calls_alone():
    calls = []

    def fast():
        calls.append(None)
        return jnp.zeros(())

    autotune.time_call(fast, warmup=2, samples=5)
    # 2 warm-up calls, 1 sizing call, then 5 batches of the 100-call cap.
    assert len(calls) == 3 + 5 * 100

    calls.clear()

    def slow():
        calls.append(None)
        time.sleep(0.2)
        return jnp.zeros(())

    seconds = autotune.time_call(slow, min_seconds=0.3, warmup=1)
    assert len(calls) == 2 + 3  # one call per sample, at least 3 samples
    assert seconds >= 0.2


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_seconds=0.0), "min_seconds"), (dict(min_seconds="1"), "min_seconds"),
    (dict(samples=0), "samples"), (dict(samples=2.5), "samples"),
    (dict(warmup=-1), "warmup"),
])
def test_time_call_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        autotune.time_call(lambda: jnp.zeros(()), **kwargs)
    with pytest.raises(TypeError, match="fn"):
        autotune.time_call(None)


def test_kernel_runner_runs_each_kernel_alone_and_the_backends_agree():
    """`autotune.kernel_runner` (behind `tune` and benchmarks/kernel_times.py), in the
    interpreter on a small problem with a batch-shared bias, ALiBi and a soft cap: each
    kernel of each backend runs alone, and the Mosaic kernels' outputs agree with the
    Triton ones (dK/dV's dbias with the separate dbias kernel's)."""
    heuristic, runner = autotune.kernel_runner(
        batch=2, q_len=128, kv_len=128, heads=2, kv_heads=2, head_dim=128, bias=True,
        alibi=True, soft_cap=20.0, interpret=True)
    assert heuristic.forward_backend == "triton"  # no Hopper here
    mosaic = dataclasses.replace(
        heuristic, forward_backend="mosaic", block_q=tuning.MOSAIC_BLOCK_Q, block_k=128,
        num_stages=2, dkv_backend="mosaic", block_q_dkv=tuning.MOSAIC_DKV_TILES[0],
        block_k_dkv=tuning.MOSAIC_DKV_TILES[1], num_stages_dkv=2, dq_backend="mosaic",
        block_q_dq=tuning.MOSAIC_DQ_TILES[0], block_k_dq=tuning.MOSAIC_DQ_TILES[1],
        num_stages_dq=2, dbias_backend="mosaic", block_q_dbias=tuning.MOSAIC_BLOCK_Q,
        block_k_dbias=64, num_stages_dbias=2)

    def run(kernel, blocks):
        return [np.asarray(x, np.float32)
                for x in jax.tree.leaves(jax.block_until_ready(runner(kernel, blocks)()))]

    def assert_agree(actual, expected, what):
        scale = float(np.max(np.abs(expected)))
        assert scale > 0 and np.all(np.isfinite(actual)), what
        np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-2 * scale, err_msg=what)

    # The forward's row residuals differ by design (a soft cap's fixed row reference
    # in the Mosaic forward), so only its output is compared.
    assert_agree(run("forward", mosaic)[0], run("forward", heuristic)[0], "forward")
    dk, dv = run("dkdv", heuristic)
    for name, got, want in zip(("dk", "dv"), run("dkdv", mosaic), (dk, dv), strict=True):
        assert_agree(got, want, name)
    assert_agree(run("dq", mosaic)[0], run("dq", heuristic)[0], "dq")
    (dbias,) = run("dbias", heuristic)
    assert dbias.shape == (1, 2, 128, 128)
    assert_agree(run("dbias", mosaic)[0], dbias, "dbias (Mosaic dbias kernel)")
    fused = run("dkdv_dbias", mosaic)
    for name, got, want in zip(("dk", "dv", "dbias"), fused, (dk, dv, dbias), strict=True):
        assert_agree(got, want, f"{name} (Mosaic dK/dV writing dbias)")
    with pytest.raises(ValueError, match="cannot write the dbias"):
        runner("dkdv_dbias", heuristic)  # Triton's dK/dV writes dbias per batch entry only
    with pytest.raises(ValueError, match="dq_dkdv: a bias needs the shared memory"):
        runner("dq_dkdv", mosaic)
    with pytest.raises(ValueError, match="dq_dkdv: .*got blocks.dkv_backend='triton'"):
        runner("dq_dkdv", heuristic)


def test_kernel_runner_runs_the_dkdv_kernel_computing_dq():
    """The "dq_dkdv" kernel (mosaic_dkv.dq_dkdv, interpreted): dK and dV those of the
    Mosaic dK/dV kernel, dQ close to the Mosaic dQ kernel's."""
    heuristic, runner = autotune.kernel_runner(
        batch=1, q_len=128, kv_len=128, heads=1, kv_heads=1, head_dim=128, soft_cap=20.0,
        interpret=True)
    mosaic = dataclasses.replace(
        heuristic, dkv_backend="mosaic", block_q_dkv=tuning.MOSAIC_DKV_TILES[0],
        block_k_dkv=tuning.MOSAIC_DKV_TILES[1], num_stages_dkv=2, dq_backend="mosaic",
        block_q_dq=tuning.MOSAIC_DQ_TILES[0], block_k_dq=tuning.MOSAIC_DQ_TILES[1],
        num_stages_dq=2)
    dq, dk, dv = (np.asarray(x, np.float32) for x in runner("dq_dkdv", mosaic)())
    for got, want in zip((dk, dv), runner("dkdv", mosaic)()[:2], strict=True):
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))
    want = np.asarray(runner("dq", mosaic)(), np.float32)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(dq, want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_kernel_runner_rejects_a_non_bool_interpret():
    with pytest.raises(TypeError, match="interpret must be a bool, got 'yes'"):
        autotune.kernel_runner(batch=1, q_len=128, kv_len=128, heads=1, kv_heads=1,
                               head_dim=64, interpret="yes")
