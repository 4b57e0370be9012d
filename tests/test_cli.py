"""python -m pallas_attn: the CPU behaviour of bench/check/tune and bad arguments."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn.__main__ import _without_gpu_autotuning, main


def test_bench_on_cpu_runs_a_labelled_interpreter_check(capsys, tmp_path):
    out = tmp_path / "check.json"
    assert main(["bench", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "No GPU: checking the Pallas kernels in the Pallas interpreter" in text
    assert "3 passed, 0 failed" in text
    assert "2 x ref" in text and "bfloat16" in text and "float16" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 and all(r["ok"] for r in rows)
    # Top-left causal with T < S hides keys T.. from every row: run NaN, as every result
    # was clean; and one seen key NaN in every shape.
    assert set(rows[1]["poisoned"]["hidden"]) == {"out", "lse", "dq", "dk", "dv"}
    assert all(set(r["poisoned"]["visible"]) == {"out", "lse"} for r in rows)
    assert "hidden NaN keys: max error" in text


def test_check_runs_its_shapes_in_worker_processes(capsys, tmp_path, monkeypatch):
    """Two rounds of two workers each: the shape runs in two processes, bit-equal."""
    out = tmp_path / "check.json"
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after
    assert main(["check", "--jobs", "2", "--rounds", "2", "--match", "float32",
                 "--json", str(out)]) == 0
    # The workers inherit XLA's GPU autotuning off (`_without_gpu_autotuning`).
    assert "--xla_gpu_autotune_level=0" in os.environ["XLA_FLAGS"]
    text = capsys.readouterr().out
    assert "1 passed, 0 failed" in text and "worker 1: no shape" in text
    assert text.count("PASS B2 T40 S56 N4/2 H32 float32") == 2
    [row] = json.loads(out.read_text())["rows"]
    assert row["ok"] and row["differs_across"] == []
    assert set(row["digests"]) == {"out", "lse", "dq", "dk", "dv"}


def test_check_fails_results_that_differ_between_processes(capsys):
    """`check --rounds`: a shape whose results in another process differ in any bit
    fails, naming them; a shape missing from a round (its worker died) fails too."""
    from pallas_attn import bench

    def row(shape, dq="a", ok=True):
        return {"shape": shape, "dtype": "bfloat16", "ok": ok,
                "digests": {"out": "x", "dq": dq}}

    rounds = [[row("s1"), row("s2"), row("s3")], [row("s1"), row("s2", dq="b")],
              [row("s2"), row("s1")]]
    s1, s2, s3 = bench.across_processes(rounds)
    assert s1["ok"] and s1["differs_across"] == []
    assert not s2["ok"] and s2["differs_across"] == ["dq"]
    assert not s3["ok"] and s3["differs_across"] == ["dq", "out"]
    assert "FAIL s2 bfloat16: differs between processes: dq" in capsys.readouterr().out


def test_check_poisons_the_bias_entries_no_row_sees():
    """check's hidden run: NaN in every bias entry no member of it sees (causal, T=4 S=6:
    above the diagonal; keys 4 and 5 for a bias per key), none where each is seen."""
    from pallas_attn import bench

    rows, cols = np.arange(4)[:, None], np.arange(6)[None, :]
    visible = jnp.broadcast_to(jnp.asarray(cols <= rows), (2, 1, 1, 4, 6))  # [G, B, K, T, S]
    full = bench._hidden_bias(visible, jnp.ones((1, 2, 4, 6), jnp.bfloat16))
    assert full.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.isnan(np.asarray(full[0, 1], np.float32)), cols > rows)
    per_key = bench._hidden_bias(visible, jnp.ones((1, 1, 1, 6)))
    np.testing.assert_array_equal(np.isnan(per_key[0, 0, 0]), [False] * 4 + [True] * 2)
    assert bench._hidden_bias(visible, jnp.ones((1, 2, 4, 1))) is None
    assert bench._hidden_bias(visible, None) is None


def test_check_judges_a_float32_bias_gradient_by_the_16_bit_gradients():
    """A float32 bias with bfloat16 inputs: the reference's dbias is exact, so check's base
    for the kernel's is the same-dtype reference's dq and dk error, not 0."""
    from pallas_attn import bench

    shape = bench.Shape(1, 16, 16, 1, 1, 16, features=(("bias_float32", None),))
    [row] = bench.check([shape], interpret=True)
    assert row["ok"], row
    assert row["dbias"][1] == max(row["dq"][1], row["dk"][1]) > 0


def test_check_keeps_the_callers_autotuning_level(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
    _without_gpu_autotuning()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=4"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    _without_gpu_autotuning()
    assert os.environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=8 "
                                       "--xla_gpu_autotune_level=0")


def test_check_fails_results_that_differ_between_two_calls(monkeypatch, capsys):
    """check's second call of the kernel must give bitwise the same results."""
    from pallas_attn import bench

    outputs_and_grads, calls = bench._outputs_and_grads, []

    def drifting(attention, q, k, v, ct, kw):
        got = outputs_and_grads(attention, q, k, v, ct, kw)
        calls.append(None)
        return (*got[:2], got[2] * (1 + 1e-6 * (len(calls) == 2)), *got[3:])

    monkeypatch.setattr(bench, "_outputs_and_grads", drifting)
    [row] = bench.check(bench.check_shapes(on_device=False)[:1], interpret=True)
    assert not row["ok"] and row["differs"] == ["dq"]
    assert "differs between two calls: dq" in capsys.readouterr().out


@pytest.mark.parametrize("leak", ["hidden", "visible", "query"])
def test_check_fails_a_kernel_that_leaks_or_drops_a_nan(leak, monkeypatch, capsys):
    """A kernel whose results turn NaN wherever a key is NaN (a hidden key leaking), or
    wherever a query is NaN (one past its length leaking), or whose output drops a seen
    NaN key, fails check."""
    from pallas_attn import bench

    attention = bench.pallas_attn.dot_product_attention

    def faulty(q, k, v, *args, implementation=None, **kwargs):
        out, lse = attention(q, k, v, *args, implementation=implementation, **kwargs)
        if implementation != "pallas":
            return out, lse
        if leak == "visible":
            return jnp.nan_to_num(out), jnp.nan_to_num(lse)
        bad = jnp.isnan(q if leak == "query" else k).any()
        return jnp.where(bad, jnp.nan, out).astype(out.dtype), jnp.where(bad, jnp.nan, lse)

    monkeypatch.setattr(bench.pallas_attn, "dot_product_attention", faulty)
    features = (("qlengths", 10),) if leak == "query" else ()
    shape = bench.Shape(2, 24, 40, 2, 1, 32, True, features, dtype="bfloat16")
    [row] = bench.check([shape], interpret=True)
    assert not row["ok"]
    errors = row["poisoned"]["hidden" if leak == "query" else leak]
    assert not all(np.isfinite(e) and e < 1e-2 for e in errors.values()), errors
    assert "FAIL" in capsys.readouterr().out


def test_check_poisons_the_queries_past_their_lengths(capsys):
    """Queries and cotangents past the query lengths (ragged: 24 - 5 and 24 - 10) hold
    NaN in the hidden run; the kernels zero them, so every result stays exact."""
    from pallas_attn import bench

    shape = bench.Shape(2, 24, 40, 2, 1, 32, False, (("qlengths", 10),), dtype="float16")
    assert bench.make_inputs(shape)["kwargs"]["query_seq_lengths"].tolist() == [19, 14]
    [row] = bench.check([shape], interpret=True)
    assert row["ok"], capsys.readouterr().out
    assert row["poisoned"]["hidden"] is not None


def test_tune_needs_a_gpu(capsys):
    assert main(["tune", "--head-dim", "64"]) == 2
    assert "NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["bench", "--set", "nope"],
                                  ["tune", "--head-dim", "x"], ["bench", "--match", "("],
                                  ["bench", "--set", "features", "--match", "H999"],
                                  ["bench", "--impl", "cudnn", "flash"],
                                  ["check", "--match", "H999"], ["bench", "--plot", "x.png"],
                                  ["bench", "--quick"], ["bench", "--impl", "cudnn"],
                                  ["bench", "--set", "features"], ["explain", "--bias", "x"],
                                  ["explain", "--bias", "1,2,3"],
                                  ["explain", "--capability", "nine"],
                                  ["explain", "--window", "a,b"], ["explain", "--dtype", "f99"],
                                  ["explain", "--heads", "3", "--kv-heads", "2"],
                                  ["check", "--jobs", "0"], ["check", "--rounds", "0"],
                                  ["check", "--shard", "2/2"],
                                  ["check", "--random", "0"],
                                  ["check", "--shard", "x"], ["bench", "--set", "wide"],
                                  ["bench", "--set", "long"],
                                  ["bench", "--set", "wide", "--match", "H999"],
                                  ["bench", "--dtype", "float16"], ["bench", "--dtype", "f8"],
                                  ["bench", "--rounds", "0"], ["bench", "--rounds", "2"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_the_mosaic_gpu_peer_refuses_what_it_does_not_compute():
    """JAX's own Mosaic GPU kernel in the bench takes causal masking only: any other
    feature fails its row by name rather than being dropped."""
    import jax.numpy as jnp

    from pallas_attn import bench
    x = jnp.zeros((1, 128, 1, 64), jnp.float16)
    with pytest.raises(NotImplementedError, match="takes no bias, logits_soft_cap"):
        bench._jax_mosaic_gpu(x, x, x, is_causal=True, logits_soft_cap=5.0, bias=x)


def test_decode_rows_time_a_loop_of_chained_steps(monkeypatch):
    """The decode table's time per step: one jitted loop whose every step reads the last
    step's output (so none is hoisted or skipped), its time divided by the steps."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_attn import bench
    from pallas_attn.tuning import autotune
    timed = []
    monkeypatch.setattr(bench, "DECODE_STEPS", 3)
    monkeypatch.setattr(autotune, "time_call", lambda fn: timed.append(fn) or 0.6)
    seconds = bench.time_per_step(lambda q, k: q * k, jnp.ones((2, 4)), jnp.full((2, 4), 2.0))
    assert seconds == pytest.approx(0.2) and len(timed) == 1
    np.testing.assert_allclose(timed[0](), np.full((2, 4), 1.002 ** 3), rtol=1e-6)


def test_bench_rounds_keep_each_rows_best_with_the_implementations_taking_turns(monkeypatch):
    """`bench --rounds 2`: every implementation's forward and fwd+bwd are timed once per
    round, the implementations in turn within each round, and each row keeps its least
    time (the TFLOP/s from it); a failing peer fails its row once."""
    from pallas_attn import bench
    from pallas_attn.tuning import autotune

    def broken(q, k, v, **kw):
        raise NotImplementedError("no such shape")

    monkeypatch.setattr(bench, "implementations", lambda interpret: {
        "a": lambda q, k, v, **kw: q, "b": lambda q, k, v, **kw: q * 2, "c": broken})
    seconds = iter([3e-3, 8e-3, 2e-3, 9e-3, 1e-3, 7e-3, 4e-3, 5e-3])
    timed = []

    def time_call(fn):
        timed.append(fn.func)
        fn()
        return next(seconds)

    monkeypatch.setattr(autotune, "time_call", time_call)
    shape = bench.Shape(1, 16, 16, 1, 1, 16)
    rows = bench.benchmark([shape], rounds=2, log=lambda _: None)
    a, b, c = rows
    assert (a["fwd_ms"], a["fwdbwd_ms"]) == pytest.approx((1.0, 7.0))
    assert (b["fwd_ms"], b["fwdbwd_ms"]) == pytest.approx((2.0, 5.0))
    assert a["fwd_tflops"] == pytest.approx(shape.forward_flops() / 1e-3 / 1e12)
    assert "error" in c and "fwd_ms" not in c
    # a's and b's steps compiled once each: the same jitted functions in both rounds.
    assert len(timed) == 9 and timed[0] is timed[5] and timed[1] is timed[6]
    assert timed[3] is timed[8] and timed[0] is not timed[2]
    with pytest.raises(ValueError, match="rounds must be an int >= 1"):
        bench.benchmark([shape], rounds=0)


def test_the_wide_set_spans_the_issue_grid():
    """With the standard set: head dim 16 and every head dim from 32 to 256 in steps of 16
    or 32, lengths 512 to 32768, T != S both ways and GQA, causal and not."""
    from pallas_attn import bench

    wide = bench.wide_shapes()
    shapes = wide + bench.standard_shapes()
    assert {s.head_dim for s in shapes} == {16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224,
                                            256}
    assert {s.q_len for s in shapes} >= {512, 1024, 2048, 4096, 8192, 16384, 32768}
    assert any(s.q_len < s.kv_len for s in shapes) and any(s.q_len > s.kv_len for s in shapes)
    assert any(s.kv_heads < s.heads for s in shapes)
    assert {s.causal for s in wide} == {False, True}
    assert len({s.label for s in wide}) == len(wide)


def test_random_check_shapes_are_valid_calls_and_repeat_with_their_seed():
    """`check --random`: the same shapes for the same seed, features from every group
    among them, calls the library takes (traced, not run)."""
    import jax

    import pallas_attn
    from pallas_attn import bench

    shapes = bench.random_check_shapes(40, 7, on_device=False)
    assert shapes == bench.random_check_shapes(40, 7, on_device=False)
    assert shapes != bench.random_check_shapes(40, 8, on_device=False)
    for seed in range(700):  # every draw valid, 16 keys included (seed 601)
        for shape in bench.random_check_shapes(12, seed, on_device=False):
            window = dict(shape.features).get("window")
            assert window is None or 0 < window < shape.kv_len, (seed, shape)
    drawn = {name for shape in shapes for name, _ in shape.features}
    assert {"mask_per_row", "bias_per_key", "packed", "segments", "dropout"} <= drawn
    assert all("softcap" in dict(shape.features) for shape in shapes
               if "bias_per_row" in dict(shape.features))
    for shape in shapes[:6]:  # making inputs compiles: a few of them
        args = bench.make_inputs(shape)
        jax.eval_shape(lambda q, k, v, kw=args["kwargs"]: pallas_attn.dot_product_attention(
            q, k, v, implementation="pallas", interpret=True, **kw),
            args["query"], args["key"], args["value"])


def test_bench_reports_the_fwd_bwd_programs_memory():
    """`bench --set long`'s memory columns: the compiled fwd+bwd program's GiB hold at
    least its inputs (q, k, v, dO) and gradients, and its scratch is part of them."""
    from pallas_attn import bench

    shape = bench.Shape(1, 32, 32, 2, 2, 16, True)
    [row] = bench.benchmark([shape], interpret=True, memory=True, log=lambda _: None,
                            only=("pallas_attn",))
    assert "error" not in row, row
    tensors = 7 * 32 * 2 * 16 * 2 / 2**30  # q, k, v, dO in; dq, dk, dv out (bfloat16)
    assert row["fwdbwd_gib"] >= tensors and row["fwdbwd_scratch_gib"] > 0
    unmeasured = {k: v for k, v in row.items() if "gib" not in k}
    table = bench.format_table([row, unmeasured,
                                {"shape": shape.label, "impl": "other", "error": "x"}])
    assert "| fwd+bwd GiB | of it scratch GiB |" in table
    assert all(line.count("|") == 9 for line in table.splitlines())
    assert table.splitlines()[3].endswith("| - | - |")
    assert bench.format_table([{k: v for k, v in row.items() if "gib" not in k}]).count(
        "GiB") == 0
    assert [s.label for s in bench.long_shapes()][-1] == "B1 T131072 S131072 N16 H128"


def test_bench_shapes_take_a_value_head_dim():
    """The feature value_dim gives the values (and the cotangent) their own head dim; the
    label names it and the forward's FLOPs count both products at their own dims; `check`
    runs it against the reference."""
    from pallas_attn import bench

    shape = bench.Shape(1, 24, 40, 2, 1, 32, True, (("value_dim", 16),))
    args = bench.make_inputs(shape)
    assert args["value"].shape == (1, 40, 1, 16) and args["cotangent"].shape == (1, 24, 2, 16)
    assert args["key"].shape == (1, 40, 1, 32)
    assert shape.label == "B1 T24 S40 N2/1 H32 causal value_dim16"
    assert shape.forward_flops() == 2.0 * 2 * 24 * 40 * (32 + 16) / 2
    # The backward: dS and dP at 32 columns, dV, dK and dQ: three at 32, two at 16.
    assert shape.fwdbwd_flops() == 2.0 * 2 * 24 * 40 * (4 * 32 + 3 * 16) / 2
    plain = bench.Shape(1, 24, 40, 2, 1, 32)
    assert plain.value_head_dim == 32 and plain.forward_flops() == 4.0 * 2 * 24 * 40 * 32
    assert plain.fwdbwd_flops() == 3.5 * plain.forward_flops()
    [row] = bench.check([shape], interpret=True, log=lambda _: None)
    assert row["ok"], row
    assert "B4 T4096 S4096 N16 H192 causal value_dim128" in [s.label for s in bench.wide_shapes()]


def test_plot_draws_bench_results_with_their_device(tmp_path, capsys):
    """`plot` reads what `bench --json` wrote on the GPU machine and titles the chart with
    the device named there, leaving out rows of failed calls; a file without TFLOP/s rows
    is refused by name."""
    rows = [{"shape": "B4 T4096 S4096 N16 H128", "impl": impl, "fwd_tflops": fwd,
             "fwdbwd_tflops": both} for impl, fwd, both in (("pallas_attn", 569.0, 473.0),
                                                             ("cudnn", 605.0, None))]
    rows.append({"shape": "B4 T4096 S4096 N16 H128", "impl": "xla", "error": "out of memory"})
    results = tmp_path / "rows.json"
    results.write_text(json.dumps({"device": "device: NVIDIA H200, jax 0.11.2", "rows": rows}))
    out = tmp_path / "chart.png"
    assert main(["plot", str(results), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps({"device": "x", "rows": [{"shape": "B1", "impl": "cudnn",
                                                           "us": 9.2}]}))
    for bad in (decode, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as e:
            main(["plot", str(bad), str(out)])
        assert e.value.code == 2
        assert str(bad) in capsys.readouterr().err
    nowhere = tmp_path / "no" / "chart.png"
    with pytest.raises(SystemExit) as e:
        main(["plot", str(results), str(nowhere)])
    assert e.value.code == 2
    assert str(nowhere) in capsys.readouterr().err


def test_check_adds_the_kernels_rounding_of_delta_as_the_backward_does():
    """check's account of a gradient that misses the 2x rule: the reference's gradients
    with delta = rowsum(dO * O) taken from O rounded to bfloat16, against the attention
    backward written out in float64 with that delta."""
    import pallas_attn
    from pallas_attn import bench

    rng = np.random.default_rng(0)
    q, k, v, ct = (rng.standard_normal((1, 6, 1, 8)) for _ in range(4))
    ref = lambda *a, **kw: pallas_attn.dot_product_attention(*a, implementation="xla", **kw)
    got = bench._grads_with_rounded_delta(ref, *(jnp.asarray(x, jnp.float32) for x in
                                                 (q, k, v, ct)), {}, jnp.bfloat16)
    Q, K, V, dO = (x[0, :, 0].astype(np.float64) for x in (q, k, v, ct))
    scale = 8 ** -0.5
    s = Q @ K.T * scale
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    o = np.asarray(jnp.asarray(p @ V, jnp.float32).astype(jnp.bfloat16), np.float64)
    ds = p * (dO @ V.T - np.sum(dO * o, 1, keepdims=True))
    for x, want in zip(got, (ds @ K * scale, ds.T @ Q * scale, p.T @ dO), strict=True):
        np.testing.assert_allclose(np.asarray(x)[0, :, 0], want, rtol=1e-4, atol=1e-5)
