"""Train a small byte-level decoder-only transformer with pallas_attn in flax.nnx.

The text is the Python standard library's own source code, read at run time from
the directory of ``os.__file__``: present on every machine, nothing downloaded and
nothing copied into this repository. Tokens are bytes (vocabulary 256).

    python examples/train_lm.py --tiny                    # a few CPU steps, seconds
    python examples/train_lm.py --tiny --compare          # pallas_attn vs Flax, one plot
    python examples/train_lm.py --steps 2000 --out loss.png   # on a GPU: the Pallas kernels

``--attention pallas_attn`` builds each layer's attention as
``pallas_attn.flax.MultiHeadAttention`` (fused, causal, GQA, KV-cache decoding);
``--attention flax`` uses ``flax.nnx.MultiHeadAttention`` with Flax's default attention.
The two have identical parameters, so from one ``--seed`` both start from the same
weights and see the same batches: their loss curves should agree closely (attention
dropout excepted, whose random streams differ). On an NVIDIA GPU pallas_attn picks its
Pallas kernels by itself; elsewhere it runs its jnp reference.
To use the fused op inside Flax's own layer instead, pass
``attention_fn=pallas_attn.flax.attention_fn`` to ``nnx.MultiHeadAttention``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import pallas_attn
import pallas_attn.flax

VOCAB = 256
ATTENTIONS = ("pallas_attn", "flax")


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and training configuration (see the CLI flags)."""

    attention: str = "pallas_attn"
    steps: int = 1000
    batch_size: int = 32
    seq_len: int = 256
    layers: int = 4
    d_model: int = 256
    heads: int = 8
    kv_heads: int = 2
    dropout: float = 0.0
    lr: float = 1e-3
    dtype: str = "float32"
    max_bytes: int = 8_000_000
    sample_tokens: int = 200
    seed: int = 0


TINY = dict(steps=20, batch_size=4, seq_len=64, layers=2, d_model=64, heads=4, kv_heads=2,
            lr=3e-3, max_bytes=300_000, sample_tokens=24)


# --------------------------------------------------------------------------- data

def stdlib_source_bytes(max_bytes: int) -> np.ndarray:
    """The standard library's .py files (sorted, concatenated) as uint8 tokens [n]."""
    root = Path(os.path.dirname(os.__file__))
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 10_000:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return np.frombuffer(b"\n".join(chunks)[:max_bytes], dtype=np.uint8)


def split(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Train / validation split at one point (no file is in both... mostly)."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def batches(tokens: np.ndarray, batch_size: int, seq_len: int,
            seed: int) -> Iterator[np.ndarray]:
    """Endless random windows: int32 [batch_size, seq_len + 1] (inputs and next bytes)."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        yield tokens[starts[:, None] + offsets].astype(np.int32)


# -------------------------------------------------------------------------- model

def make_attention(cfg: Config, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
    """The attention layer: pallas_attn's fused layer or Flax's, with equal parameters."""
    common = dict(num_heads=cfg.heads, in_features=cfg.d_model, num_kv_heads=cfg.kv_heads,
                  dropout_rate=cfg.dropout, deterministic=False, dtype=dtype, rngs=rngs)
    if cfg.attention == "pallas_attn":
        return pallas_attn.flax.MultiHeadAttention(**common, is_causal=True)
    return nnx.MultiHeadAttention(**common, decode=False)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: Config, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = make_attention(cfg, dtype, rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(cfg.d_model, 4 * cfg.d_model, dtype=dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * cfg.d_model, cfg.d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, decode: bool = False) -> jax.Array:
        h = self.attn_norm(x)
        if isinstance(self.attn, pallas_attn.flax.MultiHeadAttention):
            h = self.attn(h, decode=decode)  # causal by construction
        else:
            h = self.attn(h, is_causal=not decode, decode=decode)
        x = x + h
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class TransformerLM(nnx.Module):
    """Byte-level decoder-only transformer: tokens [B, T] -> logits [B, T, 256] (float32)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.max_len = cfg.seq_len
        self.embed = nnx.Embed(VOCAB, cfg.d_model, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, dtype, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.unembed = nnx.Linear(cfg.d_model, VOCAB, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 decode: bool = False) -> jax.Array:
        if positions is None:
            positions = jnp.arange(tokens.shape[-1])
        x = self.embed(tokens) + self.pos_embed(positions)
        for block in self.blocks:
            x = block(x, decode=decode)
        return self.unembed(self.norm(x)).astype(jnp.float32)

    def init_cache(self, batch_size: int) -> None:
        """An empty KV cache of max_len positions in every attention layer."""
        for block in self.blocks:
            if isinstance(block.attn, pallas_attn.flax.MultiHeadAttention):
                block.attn.init_cache(batch_size, self.max_len)
            else:  # Flax's layer: its cache in the computation dtype, as its keys are
                block.attn.init_cache((batch_size, self.max_len, block.attn.in_features),
                                      dtype=block.attn.dtype or jnp.float32)


# ----------------------------------------------------------------------- training

def loss_fn(model: TransformerLM, batch: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy of batch [B, T + 1]."""
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@nnx.jit
def train_step(model: TransformerLM, optimizer: nnx.Optimizer, batch: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_step(model: TransformerLM, batch: jax.Array) -> jax.Array:
    return loss_fn(model, batch)


@nnx.jit
def decode_step(model: TransformerLM, token: jax.Array, position: jax.Array) -> jax.Array:
    """Feeds one token [B, 1] at position through the KV cache: next-byte logits [B, 256]."""
    return model(token, positions=position[None], decode=True)[:, -1]


def generate(model: TransformerLM, prompt: bytes, new_tokens: int, seed: int) -> bytes:
    """Samples new_tokens bytes after prompt with the KV cache (temperature 0.8)."""
    model.eval()
    model.init_cache(batch_size=1)
    tokens = list(prompt[: model.max_len - new_tokens])
    key = jax.random.key(seed)
    logits = None
    for i, t in enumerate(tokens):  # prompt, one token at a time (works for both layers)
        logits = decode_step(model, jnp.array([[t]], jnp.int32), jnp.array(i))
    for i in range(len(tokens), len(tokens) + new_tokens):
        key, sub = jax.random.split(key)
        t = int(jax.random.categorical(sub, logits[0] / 0.8))
        tokens.append(t)
        if i + 1 < model.max_len:
            logits = decode_step(model, jnp.array([[t]], jnp.int32), jnp.array(i))
    model.train()
    return bytes(tokens)


def train(cfg: Config, train_tokens: np.ndarray, val_tokens: np.ndarray,
          progress: bool = True) -> dict:
    """Trains one model; returns its per-step losses, validation loss and a sample."""
    model = TransformerLM(cfg, rngs=nnx.Rngs(cfg.seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup_steps=max(1, min(100, cfg.steps // 10)), decay_steps=cfg.steps)
    optimizer = nnx.Optimizer(
        model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98)),
        wrt=nnx.Param)
    data = batches(train_tokens, cfg.batch_size, cfg.seq_len, cfg.seed)
    losses: list[float] = []
    tokens_per_step = cfg.batch_size * cfg.seq_len
    start = None
    bar = tqdm(range(cfg.steps), desc=cfg.attention, disable=not progress, dynamic_ncols=True)
    for step in bar:
        loss = float(train_step(model, optimizer, jnp.asarray(next(data))))
        losses.append(loss)
        if step == 0:
            start = time.perf_counter()  # the first step includes compilation
            continue
        rate = step * tokens_per_step / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}")
    bar.close()

    model.eval()
    val = batches(val_tokens, cfg.batch_size, cfg.seq_len, cfg.seed + 1)
    val_loss = float(np.mean([eval_step(model, jnp.asarray(next(val))) for _ in range(4)]))
    model.train()
    sample = b""
    if cfg.sample_tokens > 0:
        prompt = bytes(val_tokens[: cfg.seq_len // 2])
        sample = generate(model, prompt, min(cfg.sample_tokens, cfg.seq_len // 2), cfg.seed)
    return dict(losses=losses, val_loss=val_loss, sample=sample)


def plot_losses(curves: dict[str, Sequence[float]], path: str, title: str) -> None:
    """One loss-vs-step line per attention choice, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, losses), style in zip(curves.items(), ("-", "--"), strict=False):
        ax.plot(np.arange(1, len(losses) + 1), losses, style, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=ATTENTIONS, default="pallas_attn")
    p.add_argument("--compare", action="store_true",
                   help="train with both attentions from the same seed; plot both curves")
    p.add_argument("--tiny", action="store_true", help="a tiny CPU configuration (seconds)")
    for name, kind in (("steps", int), ("batch-size", int), ("seq-len", int), ("layers", int),
                       ("d-model", int), ("heads", int), ("kv-heads", int), ("seed", int),
                       ("dropout", float), ("lr", float), ("max-bytes", int),
                       ("sample-tokens", int)):
        p.add_argument(f"--{name}", type=kind, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="computation dtype (parameters stay float32)")
    p.add_argument("--out", default="train_lm_loss.png", help="PNG path for the loss curve")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    values = dataclasses.asdict(Config())
    if args.tiny:
        values.update(TINY)
    for field in values:
        given = getattr(args, field, None)
        if given is not None:
            values[field] = given
    values["attention"] = args.attention
    cfg = Config(**values)
    if cfg.heads % cfg.kv_heads or cfg.d_model % cfg.heads:
        p.error("--heads must divide --d-model and be a multiple of --kv-heads")
    return cfg, args


def main(argv: Sequence[str] | None = None) -> dict[str, dict]:
    """Runs the CLI; returns {attention: train()'s result} (for tests)."""
    cfg, args = parse_args(argv)
    device = jax.devices()[0]
    kernels = "Pallas kernels" if pallas_attn.device.on_nvidia_gpu() else "jnp reference"
    print(f"device: {device.device_kind} ({device.platform}); pallas_attn runs its {kernels}")
    tokens = stdlib_source_bytes(cfg.max_bytes)
    train_tokens, val_tokens = split(tokens)
    print(f"data: {len(tokens):,} bytes of Python stdlib source from "
          f"{os.path.dirname(os.__file__)}")
    kinds = ATTENTIONS if args.compare else (cfg.attention,)
    results = {}
    for kind in kinds:
        run_cfg = dataclasses.replace(cfg, attention=kind)
        result = train(run_cfg, train_tokens, val_tokens, progress=not args.no_progress)
        results[kind] = result
        print(f"{kind}: final train loss {result['losses'][-1]:.4f}, "
              f"validation loss {result['val_loss']:.4f}")
        if result["sample"]:
            text = result["sample"].decode("utf-8", errors="replace")
            print(f"{kind} sample (prompt + generated):\n{text}\n")
    if args.compare:
        first = min(cfg.steps, 50)
        diff = np.max(np.abs(np.subtract(results["pallas_attn"]["losses"][:first],
                                         results["flax"]["losses"][:first])))
        print(f"max |loss(pallas_attn) - loss(flax)| over the first {first} steps: {diff:.3g}")
    title = (f"byte LM on stdlib source: {cfg.layers} layers, d={cfg.d_model}, "
             f"heads {cfg.heads}/{cfg.kv_heads}, seq {cfg.seq_len}, batch {cfg.batch_size}, "
             f"{cfg.dtype}, {device.platform}")
    plot_losses({k: r["losses"] for k, r in results.items()}, args.out, title)
    print(f"loss curve: {args.out}")
    return results


if __name__ == "__main__":
    main()
