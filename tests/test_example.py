"""examples/train_lm.py runs end to end (tiny, on CPU) with both attention choices."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("train_lm", None)


def test_tiny_flags(train_lm):
    cfg, args = train_lm.parse_args(["--tiny", "--attention", "flax", "--kv-heads", "1"])
    assert (cfg.attention, cfg.kv_heads, cfg.steps) == ("flax", 1, train_lm.TINY["steps"])
    assert cfg.d_model == train_lm.TINY["d_model"] and not args.compare


def test_stdlib_data_is_bytes(train_lm):
    tokens = train_lm.stdlib_source_bytes(50_000)
    assert tokens.dtype == np.uint8 and len(tokens) == 50_000
    assert b"def " in tokens.tobytes()
    batch = next(train_lm.batches(tokens, 2, 16, seed=0))
    assert batch.shape == (2, 17) and batch.dtype == np.int32


def test_tiny_compare_trains_both_attentions_and_writes_png(train_lm, tmp_path, capsys):
    """Both arms train, evaluate and sample through their KV caches, in bfloat16 (the
    Flax arm's cache follows the computation dtype; float32 is the same code)."""
    dtype = "bfloat16"
    out = tmp_path / "curves" / "loss.png"
    steps = 6
    results = train_lm.main(["--tiny", "--compare", "--steps", str(steps), "--layers", "1",
                             "--sample-tokens", "4", "--no-progress", "--out", str(out),
                             "--dtype", dtype])
    assert set(results) == {"pallas_attn", "flax"}
    for result in results.values():
        losses = np.asarray(result["losses"])
        assert losses.shape == (steps,) and np.isfinite(losses).all()
        assert np.isfinite(result["val_loss"])
        assert len(result["sample"]) > 4  # prompt + sampled bytes through the KV cache
    # Same seed, same weights, same batches: the curves agree.
    np.testing.assert_allclose(results["pallas_attn"]["losses"], results["flax"]["losses"],
                               atol=1e-4 if dtype == "float32" else 2e-2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "max |loss(pallas_attn) - loss(flax)|" in printed
