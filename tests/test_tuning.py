"""The tile cache and autotuning: cache files, the timer, sweeps, one kernel at a time."""

import dataclasses
import json
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import dispatch
from pallas_attn.device import DeviceInfo
from pallas_attn.kernels.mosaic import config as mosaic_config
from pallas_attn.kernels.triton import config as triton_config
from pallas_attn.plan import BlockSizes, Route
from pallas_attn.spec import AttentionSpec
from pallas_attn.tuning import autotune, cache

pytestmark = pytest.mark.timeout(300)

SM80 = DeviceInfo((8, 0), 108, 166912)


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PALLAS_ATTN_CACHE_DIR", str(tmp_path / "cache"))


def _plan(device=SM80):
    call = dispatch.Call(AttentionSpec(scale=0.125), 4, 512, 512, 16, 16, 64, 64, "bfloat16")
    return dispatch.plan(call, device=device)


def test_cache_round_trip():
    tuned = BlockSizes(64, 32, 32, 64, 64, 32, 8, 2, 4, 1, 4, 2)
    key = cache.entry_key(jnp.bfloat16, 128, 128, 4096, 4096, {"is_causal": True})
    path = cache.store(SM80, key, tuned)
    data = json.loads(path.read_text())
    assert data["version"] == cache.CACHE_VERSION and data["entries"][key]["block_q"] == 64
    assert cache.lookup(SM80, "bfloat16", 128, 128, 4000, 4096, {"is_causal": True}) == tuned
    assert cache.lookup(SM80, "bfloat16", 128, 128, 4096, 4096, {}) is None


def test_corrupt_or_stale_cache_is_ignored_with_a_warning():
    path = cache.cache_path(SM80)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring pallas_attn tile cache"):
        plan = _plan()
    assert plan.forward.backend == "triton"
    path.write_text(json.dumps({"version": cache.CACHE_VERSION, "jax": "0.0.1",
                                "entries": {}}))
    with pytest.warns(UserWarning, match="tuned with jax 0.0.1"):
        _plan()
    path.write_text(json.dumps({"version": 2, "jax": jax.__version__, "entries": {}}))
    with pytest.warns(UserWarning, match="version 2"):
        _plan()
    key = cache.entry_key(jnp.bfloat16, 64, 64, 512, 512, {})
    path.write_text(json.dumps({"version": cache.CACHE_VERSION, "jax": jax.__version__,
                                "entries": {key: {"block_q": 24}}}))
    with pytest.warns(UserWarning, match="stale"):
        plan = _plan()
    assert plan.forward.block_q != 24
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path.unlink()
        _plan()


def test_sweep_entries_respect_the_budget():
    entries = autotune.sweep_entries("dkdv", 256, 256, jnp.bfloat16, 101376, 4096, 4096)
    assert entries
    for entry in entries:
        assert triton_config.shared_memory("dkdv", entry, 256, 256, "bfloat16") <= 101376


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


def test_tiles_block_sizes_hold_each_roles_tiles():
    b = autotune.tiles_block_sizes({"forward": (64, 32, 4, 2), "dq": (128, 64, 8, 3)})
    assert b.tiles("forward") == (64, 32, 4, 2) and b.tiles("dq") == (128, 64, 8, 3)
    assert b.tiles("dkdv") == (None,) * 4 and b.forward_backend is None


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
    plan, runner = autotune.kernel_runner(
        batch=2, q_len=128, kv_len=128, heads=1, kv_heads=1, head_dim=128, bias=True,
        alibi=True, soft_cap=20.0, interpret=True)
    assert plan.forward.backend == "triton"  # the interpreter's choice
    mosaic = {"forward": Route("mosaic", 128, 128, 0, 2, 2),
              "dkdv": Route("mosaic", *mosaic_config.DKV_TILES, 0, 2, 2),
              "dq": Route("mosaic", *mosaic_config.DQ_TILES, 0, 2, 2),
              "dbias": Route("mosaic", 128, 64, 0, 2, 2)}

    def run(kernel, route):
        return [np.asarray(x, np.float32)
                for x in jax.tree.leaves(jax.block_until_ready(runner(kernel, route)()))]

    def assert_agree(actual, expected, what):
        scale = float(np.max(np.abs(expected)))
        assert scale > 0 and np.all(np.isfinite(actual)), what
        np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-2 * scale, err_msg=what)

    for name, got, want in zip(("out", "row_max", "log2_sum"), run("forward", mosaic["forward"]),
                               run("forward", plan.forward), strict=True):
        assert_agree(got, want, f"forward {name}")
    dk, dv = run("dkdv", plan.dkdv)
    for name, got, want in zip(("dk", "dv"), run("dkdv", mosaic["dkdv"]), (dk, dv),
                               strict=True):
        assert_agree(got, want, name)
    assert_agree(run("dq", mosaic["dq"])[0], run("dq", plan.dq)[0], "dq")
    (dbias,) = run("dbias", plan.dbias)
    assert dbias.shape == (1, 1, 128, 128)
    assert_agree(run("dbias", mosaic["dbias"])[0], dbias, "dbias (Mosaic dbias kernel)")
    fused = run("dkdv_dbias", mosaic["dkdv"])
    for name, got, want in zip(("dk", "dv", "dbias"), fused, (dk, dv, dbias), strict=True):
        assert_agree(got, want, f"{name} (Mosaic dK/dV writing dbias)")
    with pytest.raises(ValueError, match="cannot write the dbias"):
        runner("dkdv_dbias", plan.dkdv)  # Triton's dK/dV writes dbias per batch entry only
    with pytest.raises(ValueError, match="unknown kernel 'dq_dkdv'"):
        runner("dq_dkdv", mosaic["dkdv"])
    with pytest.raises(ValueError, match="no kernel of its own"):
        runner("dbias", dataclasses.replace(mosaic["dq"], in_dq=True))


def test_kernel_runner_rejects_bad_arguments():
    with pytest.raises(TypeError, match="interpret must be a bool, got 'yes'"):
        autotune.kernel_runner(batch=1, q_len=128, kv_len=128, heads=1, kv_heads=1,
                               head_dim=64, interpret="yes")
    with pytest.raises(TypeError, match="mask must be a bool, got 1"):
        autotune.kernel_runner(batch=1, q_len=128, kv_len=128, heads=1, kv_heads=1,
                               head_dim=64, mask=1)
    with pytest.raises(ValueError, match="multiples of 128, got 100/128"):
        autotune.kernel_runner(batch=1, q_len=100, kv_len=128, heads=1, kv_heads=1,
                               head_dim=64, interpret=True)
