"""The tile cache: the Triton tiles `python -m pallas_attn tune` measured fastest.

One small JSON file per device kind, in $PALLAS_ATTN_CACHE_DIR (default
~/.cache/pallas_attn). Entries are keyed by (dtype, head dims, sequence bucket,
feature set) and hold the tile fields of a BlockSizes; the routing table
(dispatch.py) consults them before its ladders. A corrupt or stale file is
ignored with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from pallas_attn.plan import BlockSizes

CACHE_VERSION = 3  # entries hold tile fields only; backends are the plan's
_FEATURES = ("is_causal", "has_bias", "has_dropout", "has_window")


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("PALLAS_ATTN_CACHE_DIR",
                                       pathlib.Path.home() / ".cache" / "pallas_attn"))


def _device_kind(device: Any) -> str:
    cc = "x".join(str(c) for c in device.compute_capability)
    return f"sm{cc}_smem{device.max_shared_memory_per_block}"


def cache_path(device: Any) -> pathlib.Path:
    return cache_dir() / f"tiles_{_device_kind(device)}.json"


def _bucket(length: int) -> int:
    """Sequence bucket: the next power of two (at least 128)."""
    return max(128, 1 << (int(length) - 1).bit_length())


def entry_key(dtype: Any, head_dim: int, value_head_dim: int, q_len: int, kv_len: int,
              features: dict[str, Any]) -> str:
    flags = ",".join(f for f in _FEATURES if features.get(f))
    return (f"{jnp.dtype(dtype).name}|h{head_dim}|hv{value_head_dim}|"
            f"t{_bucket(q_len)}|s{_bucket(kv_len)}|{flags or 'plain'}")


_loaded: dict[pathlib.Path, tuple[float, dict[str, Any]]] = {}


def _read(path: pathlib.Path) -> dict[str, Any]:
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return {}
    if path in _loaded and _loaded[path][0] == mtime:
        return _loaded[path][1]
    entries: dict[str, Any] = {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None}"
                             f" != {CACHE_VERSION}")
        if data.get("jax") != jax.__version__:
            raise ValueError(f"tuned with jax {data.get('jax')}, running {jax.__version__}")
        entries = dict(data["entries"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring pallas_attn tile cache {path}: {e}", stacklevel=3)
    _loaded[path] = (mtime, entries)
    return entries


def lookup(device: Any, dtype: Any, head_dim: int, value_head_dim: int, q_len: int,
           kv_len: int, features: dict[str, Any]):
    """The cached tiles (a BlockSizes) for this problem, or None."""
    entries = _read(cache_path(device))
    if not entries:
        return None
    raw = entries.get(entry_key(dtype, head_dim, value_head_dim, q_len, kv_len, features))
    if raw is None:
        return None
    try:
        return BlockSizes(**raw)
    except (TypeError, ValueError) as e:
        warnings.warn(f"ignoring stale pallas_attn tile cache entry {raw}: {e}", stacklevel=3)
        return None


def store(device: Any, key: str, block_sizes: Any) -> pathlib.Path:
    path = cache_path(device)
    entries = dict(_read(path))
    entries[key] = dataclasses.asdict(block_sizes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": CACHE_VERSION, "jax": jax.__version__,
                               "entries": entries}, indent=1, sort_keys=True))
    tmp.replace(path)
    _loaded.pop(path, None)
    return path
