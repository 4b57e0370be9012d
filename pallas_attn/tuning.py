"""Tile choice: the device's resources, block sizes, and the heuristic that picks them.

The one place for tile decisions. Kernels receive a validated `BlockSizes` and
never consult the architecture themselves.

* `DeviceInfo`: compute capability, SM count and opt-in shared memory per block,
  read once from the CUDA driver (a table by compute capability as fallback).
* `BlockSizes`: frozen, hashable, validated tiles and launch parameters.
* `shared_memory_estimate()`: bytes each kernel allocates, from the same tile shapes
  the kernels use.
* `choose_block_sizes()`: a pure function of (head dims, dtype, lengths, device):
  a ladder of candidates per head-dim bucket, the first that fits wins.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Opt-in shared memory per block by compute capability, used when the driver
# cannot be asked (CUDA programming guide, "Technical Specifications").
_SHARED_MEMORY_BY_CAPABILITY = {
    (7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912,
    (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376,
}
_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What tile choice needs to know about a GPU.

    Construct it by hand to plan for a device you are not on, e.g.
    DeviceInfo(compute_capability=(8, 6), num_multiprocessors=84,
    max_shared_memory_per_block=101376).
    """

    compute_capability: tuple[int, int] = (9, 0)
    num_multiprocessors: int = 132
    max_shared_memory_per_block: int = 232448

    def __post_init__(self):
        cc = self.compute_capability
        if not (isinstance(cc, tuple) and len(cc) == 2 and all(isinstance(c, int) for c in cc)):
            raise ValueError(f"compute_capability must be a (major, minor) pair, got {cc!r}")
        for name in ("num_multiprocessors", "max_shared_memory_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @staticmethod
    def for_capability(compute_capability: tuple[int, int],
                       num_multiprocessors: int = 108) -> DeviceInfo:
        """A device described by the table of opt-in shared memory per capability."""
        smem = _SHARED_MEMORY_BY_CAPABILITY.get(tuple(compute_capability), 101376)
        return DeviceInfo(tuple(compute_capability), num_multiprocessors, smem)

    @staticmethod
    def current() -> DeviceInfo:
        """The first local device, read once and cached (H100 defaults off-GPU)."""
        return _current_device_info()


def _driver_attribute(device_ordinal: int, attribute: int) -> int | None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0) != 0:
            return None
        device = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(device), device_ordinal) != 0:
            return None
        value = ctypes.c_int()
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0:
            return None
        return value.value
    except (OSError, AttributeError):
        return None


@functools.cache
def _current_device_info() -> DeviceInfo:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return DeviceInfo()
    cc_text = str(getattr(device, "compute_capability", "9.0"))
    major, minor = (int(part) for part in cc_text.split(".")[:2])
    fallback = DeviceInfo.for_capability((major, minor))
    ordinal = int(getattr(device, "local_hardware_id", 0) or 0)
    smem = _driver_attribute(ordinal, _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    sms = getattr(device, "core_count", None) or _driver_attribute(
        ordinal, _CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    return DeviceInfo((major, minor), int(sms or fallback.num_multiprocessors),
                      int(smem or fallback.max_shared_memory_per_block))


def _is_tile(x: Any) -> bool:
    return isinstance(x, int) and x >= 16 and x & (x - 1) == 0


_KERNELS = ("forward", "dkdv", "dq", "dbias")
FORWARD_BACKENDS = ("triton", "mosaic")
DBIAS_BACKENDS = FORWARD_BACKENDS
DKV_BACKENDS = FORWARD_BACKENDS
DQ_BACKENDS = FORWARD_BACKENDS
# The Mosaic forward: work items of 128 query rows, 64 per consumer warpgroup.
MOSAIC_BLOCK_Q = 128
MOSAIC_BLOCK_K = (64, 128)
# The Mosaic dK/dV kernel: steps of 64 query rows, units of 128 keys (64 per consumer).
MOSAIC_DKV_TILES = (64, 128)
# The Mosaic dQ kernel: key tiles of 64 (128-key tiles spill and ran 14% slower plain,
# BENCHMARKS.md session 18); block_q_dq is the padding of the query rows. Its work items
# hold three consumer warpgroups of 64 query rows or two that take turns on the tensor
# cores (`mosaic_dq_consumers`).
MOSAIC_DQ_TILES = (MOSAIC_BLOCK_Q, 64)
# Query rows per consumer warpgroup of the Mosaic kernels (the wgmma M dimension).
MOSAIC_ROWS_PER_CONSUMER = 64


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles and launch parameters of the kernels: forward, dK/dV, dQ and dbias.

    Every tile is a power of two and at least 16 (Triton needs power-of-two blocks;
    16 is the smallest tensor-core operand). Results do not depend on the tiles.
    The dbias fields matter only when a bias is differentiated; its tiles are tiles
    of the bias (query rows x keys).

    fuse_dbias: True: the dK/dV kernel writes dbias from the dS tiles it computes
    anyway (the Triton one only for a bias with its own entry per batch entry, head
    and key, `fusable_dbias`; the Mosaic one also for a bias shared by the batch
    entries, `mosaic_fusable_dbias`; else ValueError); False: a separate dbias kernel
    recomputes dS (deterministic, where the Mosaic dK/dV kernel's batch sum is not);
    None (default): decided by `resolve_fuse_dbias` for the problem and device.

    forward_backend: "triton" (every GPU from sm80 and every feature) or "mosaic",
    the warp-specialised Hopper forward (kernels/mosaic_fwd.py: sm90, 16-bit
    inputs, padded head dims 64 or 128, no operand besides q, k, v, a bias and ALiBi
    slopes, no dropout; block_q must be its 128 rows per work item, block_k 64 or
    128, num_stages >= 2 shared-memory slots; num_warps does not apply).

    dbias_backend: "triton" or "mosaic", the warp-specialised Hopper dbias kernel
    (kernels/mosaic_dbias.py: for a bias broadcast over batch entries or heads, in
    the Mosaic forward's scope; block_q_dbias must be its 128 rows per work item,
    block_k_dbias 64 or 128, num_stages_dbias its Q/K slots; num_warps_dbias does
    not apply). It runs only where the dK/dV kernel does not write dbias itself
    (fuse_dbias).

    dkv_backend: "triton" or "mosaic", the warp-specialised Hopper dK/dV kernel
    (kernels/mosaic_dkv.py: in the Mosaic forward's scope; block_q_dkv and
    block_k_dkv must be its (64, 128), num_stages_dkv its Q/dO slots, one slot runs
    but slowly; num_warps_dkv does not apply). With fuse_dbias it writes dbias for
    a bias of shape [B, N, T, S] or [1, N, T, S] in the inputs' dtype, adding the
    batch entries' dS tiles with reduce-add bulk copies in no fixed order (with the
    Mosaic dQ kernel, to the batch entry 0 tiles that kernel stores).

    dq_backend: "triton" or "mosaic", the warp-specialised Hopper dQ kernel
    (kernels/mosaic_dq.py: in the Mosaic forward's scope; block_q_dq and block_k_dq
    must be its (128, 64), num_stages_dq its K/V slots, at least 2; num_warps_dq
    does not apply). The heuristic picks it where it picks the Mosaic forward
    (`prefers_mosaic_dq`).
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 64
    num_warps: int = 4
    num_stages: int = 3
    num_warps_dkv: int = 8
    num_stages_dkv: int = 2
    num_warps_dq: int = 8
    num_stages_dq: int = 2
    block_q_dbias: int = 64
    block_k_dbias: int = 128
    num_warps_dbias: int = 8
    num_stages_dbias: int = 2
    fuse_dbias: bool | None = None
    forward_backend: str = "triton"
    dbias_backend: str = "triton"
    dkv_backend: str = "triton"
    dq_backend: str = "triton"

    def __post_init__(self):
        for field in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq",
                      "block_k_dq", "block_q_dbias", "block_k_dbias"):
            value = getattr(self, field)
            if not _is_tile(value):
                raise ValueError(f"BlockSizes.{field} must be a power of two >= 16, got {value!r}")
        for field in ("num_warps", "num_warps_dkv", "num_warps_dq", "num_warps_dbias"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value not in (
                    1, 2, 4, 8, 16):
                raise ValueError(f"BlockSizes.{field} must be 1, 2, 4, 8 or 16, got {value!r}")
        for field in ("num_stages", "num_stages_dkv", "num_stages_dq", "num_stages_dbias"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 8:
                raise ValueError(f"BlockSizes.{field} must be an int in [1, 8], got {value!r}")
        if self.fuse_dbias is not None and not isinstance(self.fuse_dbias, bool):
            raise ValueError(
                f"BlockSizes.fuse_dbias must be True, False or None, got {self.fuse_dbias!r}")
        for field, backends in (("forward_backend", FORWARD_BACKENDS),
                                ("dbias_backend", DBIAS_BACKENDS),
                                ("dkv_backend", DKV_BACKENDS),
                                ("dq_backend", DQ_BACKENDS)):
            if getattr(self, field) not in backends:
                raise ValueError(f"BlockSizes.{field} must be one of {backends}, "
                                 f"got {getattr(self, field)!r}")
        if self.forward_backend == "mosaic" and (
                self.block_q != MOSAIC_BLOCK_Q or self.block_k not in MOSAIC_BLOCK_K
                or self.num_stages < 2):
            raise ValueError(
                f"BlockSizes.forward_backend='mosaic' needs block_q={MOSAIC_BLOCK_Q}, block_k "
                f"in {MOSAIC_BLOCK_K} and num_stages >= 2, got block_q={self.block_q}, "
                f"block_k={self.block_k}, num_stages={self.num_stages}")
        if self.dbias_backend == "mosaic" and (
                self.block_q_dbias != MOSAIC_BLOCK_Q or self.block_k_dbias not in MOSAIC_BLOCK_K):
            raise ValueError(
                f"BlockSizes.dbias_backend='mosaic' needs block_q_dbias={MOSAIC_BLOCK_Q} and "
                f"block_k_dbias in {MOSAIC_BLOCK_K}, got block_q_dbias={self.block_q_dbias}, "
                f"block_k_dbias={self.block_k_dbias}")
        if self.dkv_backend == "mosaic" and (
                (self.block_q_dkv, self.block_k_dkv) != MOSAIC_DKV_TILES):
            raise ValueError(
                f"BlockSizes.dkv_backend='mosaic' needs (block_q_dkv, block_k_dkv) = "
                f"{MOSAIC_DKV_TILES}, got ({self.block_q_dkv}, {self.block_k_dkv})")
        if self.dq_backend == "mosaic" and (
                (self.block_q_dq, self.block_k_dq) != MOSAIC_DQ_TILES
                or self.num_stages_dq < 2):
            raise ValueError(
                f"BlockSizes.dq_backend='mosaic' needs (block_q_dq, block_k_dq) = "
                f"{MOSAIC_DQ_TILES} and num_stages_dq >= 2, got ({self.block_q_dq}, "
                f"{self.block_k_dq}) and num_stages_dq={self.num_stages_dq}")

    def clamp(self, q_len: int, kv_len: int) -> BlockSizes:
        """Shrinks tiles that are longer than the (power-of-two rounded) sequences."""
        q_cap = max(16, _next_power_of_2(q_len))
        k_cap = max(16, _next_power_of_2(kv_len))
        # The Mosaic forward's tiles are fixed by its warpgroups; short sequences are
        # padded up to them instead.
        mosaic = self.forward_backend == "mosaic"
        mosaic_dbias = self.dbias_backend == "mosaic"
        mosaic_dkv = self.dkv_backend == "mosaic"
        mosaic_dq = self.dq_backend == "mosaic"
        return dataclasses.replace(
            self,
            block_q=self.block_q if mosaic else min(self.block_q, q_cap),
            block_k=self.block_k if mosaic else min(self.block_k, k_cap),
            block_q_dkv=self.block_q_dkv if mosaic_dkv else min(self.block_q_dkv, q_cap),
            block_k_dkv=self.block_k_dkv if mosaic_dkv else min(self.block_k_dkv, k_cap),
            block_q_dq=self.block_q_dq if mosaic_dq else min(self.block_q_dq, q_cap),
            block_k_dq=self.block_k_dq if mosaic_dq else min(self.block_k_dq, k_cap),
            block_q_dbias=self.block_q_dbias if mosaic_dbias else min(self.block_q_dbias, q_cap),
            block_k_dbias=self.block_k_dbias if mosaic_dbias else min(self.block_k_dbias, k_cap))

    def tiles(self, kernel: str) -> tuple[int, int, int, int]:
        """(block_q, block_k, warps, stages) of one kernel."""
        return tuple(getattr(self, f) for f in _FIELDS[kernel])


def _next_power_of_2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def padded_head_dim(head_dim: int) -> int:
    """Head dims are padded to a power of two (at least 16) for the kernels."""
    return max(16, _next_power_of_2(head_dim))


def fusable_dbias(bias_shape: tuple[int, ...], *, batch: int, num_heads: int) -> bool:
    """Whether the dK/dV kernel can write dbias: each dbias element must belong to one
    dK/dV program, so the bias varies along keys, and over batch entries and heads
    (where there are several). A per-key bias (one row) is summed in registers."""
    Bb, Nb, _, Sb = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    return Sb > 1 and (Bb > 1 or batch == 1) and (Nb > 1 or num_heads == 1)


def mosaic_fusable_dbias(bias_shape: tuple[int, ...], *, batch: int, num_heads: int,
                         bias_dtype: Any, dtype: Any) -> bool:
    """Whether the Mosaic dK/dV kernel can write dbias: a bias with its own entry per
    head, query and key, shared by the batch entries or not, in the inputs' dtype
    (its dS tiles, staged in that dtype, are the dbias tiles)."""
    Bb, Nb, Tb, Sb = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    return (Nb == num_heads and Bb in (1, batch) and Tb > 1 and Sb > 1
            and jnp.dtype(bias_dtype) == jnp.dtype(dtype))


def check_fuse_dbias(block_sizes: BlockSizes, bias_shape: tuple[int, ...] | None, *,
                     batch: int, num_heads: int, bias_dtype: Any = None,
                     dtype: Any = None) -> None:
    """ValueError if block_sizes asks for a fused dbias that this bias cannot have."""
    if block_sizes.fuse_dbias is not True or bias_shape is None:
        return
    if block_sizes.dkv_backend == "mosaic":
        if not mosaic_fusable_dbias(bias_shape, batch=batch, num_heads=num_heads,
                                    bias_dtype=bias_dtype, dtype=dtype):
            raise ValueError(
                f"BlockSizes.fuse_dbias=True with dkv_backend='mosaic' needs a bias of shape "
                f"({batch} or 1, {num_heads}, T, S) in the inputs' dtype {jnp.dtype(dtype)}; "
                f"this bias has shape {tuple(bias_shape)} and dtype {jnp.dtype(bias_dtype)}: "
                f"use fuse_dbias=None or False")
    elif not fusable_dbias(bias_shape, batch=batch, num_heads=num_heads):
        raise ValueError(
            f"BlockSizes.fuse_dbias=True needs a bias with its own entry for every batch "
            f"entry, head and key ({batch}, {num_heads}, T or 1, S); this bias has shape "
            f"{tuple(bias_shape)}: use fuse_dbias=None or False")


def resolve_fuse_dbias(block_sizes: BlockSizes, bias_shape: tuple[int, int, int, int], *,
                       batch: int, num_heads: int, num_kv_heads: int, kv_len: int,
                       device: DeviceInfo, bias_dtype: Any = None,
                       dtype: Any = None) -> BlockSizes:
    """block_sizes with fuse_dbias decided (True or False) for a bias of bias_shape.

    Automatic (None): with the Mosaic dK/dV kernel, fused wherever
    `mosaic_fusable_dbias` allows (BENCHMARKS.md, session 10: at d128, [1, N, T, S],
    2.74 ms against 4.73 for the Triton dK/dV and the Mosaic dbias kernels; faster
    since session 13, where the batch entries' programs run at once). With the
    Triton one, fused where `fusable_dbias` allows and its grid has at least one
    program per multiprocessor; else the separate dbias kernel. (Summing a broadcast
    bias's dS inside the Triton dK/dV kernel was measured slower end to end than the
    dbias kernel, BENCHMARKS.md: 1.7x with a batch loop per program through float32
    partial sums, 1.6x with programs chained by atomic counters.)
    """
    check_fuse_dbias(block_sizes, bias_shape, batch=batch, num_heads=num_heads,
                     bias_dtype=bias_dtype, dtype=dtype)
    if block_sizes.fuse_dbias is not None:
        return block_sizes
    if block_sizes.dkv_backend == "mosaic":
        return dataclasses.replace(block_sizes, fuse_dbias=mosaic_fusable_dbias(
            bias_shape, batch=batch, num_heads=num_heads, bias_dtype=bias_dtype, dtype=dtype))
    programs = ceil_div(kv_len, block_sizes.block_k_dkv) * batch * num_kv_heads
    fused = (fusable_dbias(bias_shape, batch=batch, num_heads=num_heads)
             and programs >= device.num_multiprocessors)
    return dataclasses.replace(block_sizes, fuse_dbias=fused)


def _mosaic_dq_bytes(b: BlockSizes, hd: int, hv: int, dtype: Any, bias_dtype: Any,
                     consumers: int) -> int:
    """Shared memory of the Mosaic dQ kernel with this many consumers: per consumer
    its rows' Q, dO, dS, three float32 row residuals and bias tile (its own buffer,
    not multi-buffered); the K/V ring; with a bias the dbias zero tile (one
    consumer's dS tile, `mosaic_dq.dq_and_dbias`); 8-byte barriers (rows and bias
    per consumer, loaded and consumed per slot for K and V, the turns of two)."""
    size = np.dtype(jnp.dtype(dtype)).itemsize
    bias_size = 0 if bias_dtype is None else np.dtype(jnp.dtype(bias_dtype)).itemsize
    rows, bk = consumers * MOSAIC_ROWS_PER_CONSUMER, b.block_k_dq
    return (rows * ((hd + hv) * size + bk * (size + bias_size) + 3 * 4)
            + b.num_stages_dq * bk * (hd + hv) * size
            + (MOSAIC_ROWS_PER_CONSUMER * bk * size if bias_dtype is not None else 0)
            + 8 * (4 * b.num_stages_dq + consumers * (2 if bias_dtype is not None else 1)
                   + (consumers == 2)))


def mosaic_dq_consumers(block_sizes: BlockSizes, head_dim: int, value_head_dim: int | None,
                        dtype: Any, *, bias_dtype: Any = None, has_window: bool = False,
                        device: DeviceInfo | None = None) -> int:
    """Consumer warpgroups of the Mosaic dQ kernel: 3 (work items of 192 query rows, no
    turns) without a bias or a local window where their buffers fit in the device's
    shared memory, else 2 (items of 128 rows that take turns on the tensor cores).

    A third consumer keeps the tensor cores busy while two compute their scores'
    exponentials and soft-cap tanh: forward+backward 4% faster plain and 6% with a soft
    cap at T = S = 4096, d128. With a bias it was 28% slower (probably registers: each
    consumer also holds its bias tile, on a smaller budget), with a window of 512 at
    T = S = 8192 3% slower (BENCHMARKS.md, session 19)."""
    if bias_dtype is not None or has_window:
        return 2
    device = device or DeviceInfo.current()
    hd, hv = padded_head_dim(head_dim), padded_head_dim(value_head_dim or head_dim)
    three = _mosaic_dq_bytes(block_sizes, hd, hv, dtype, bias_dtype, 3)
    return 3 if three <= device.max_shared_memory_per_block else 2


def shared_memory_estimate(block_sizes: BlockSizes, head_dim: int, value_head_dim: int | None,
                           dtype: Any, *, bias_dtype: Any = None,
                           has_mask: bool = False) -> dict[str, int]:
    """Bytes of shared memory each kernel needs, from the tiles the kernels allocate.

    Keys: "forward", "dkdv", "dq", and "dbias" when a bias is present (bias_dtype).

    Counts what Triton stages through shared memory: tiles loaded inside the loop
    are multi-buffered num_stages deep (K, V in the forward and dQ kernels; Q, dO
    and the bias/mask tiles in the dK/dV kernel), tiles loaded once stay resident,
    and the [block_q, block_k] operand of a second matrix product (P or dS) is
    staged once.
    """
    b = block_sizes
    hd = padded_head_dim(head_dim)
    hv = padded_head_dim(value_head_dim or head_dim)
    size = np.dtype(jnp.dtype(dtype)).itemsize
    extra = (np.dtype(jnp.dtype(bias_dtype)).itemsize if bias_dtype is not None else 0) + (
        1 if has_mask else 0)

    def tile_inputs(block_q: int, block_k: int, stages: int) -> int:
        return stages * block_q * block_k * extra

    if b.forward_backend == "mosaic":
        # Q, the output (staged in P's buffer when hv == block_k), the K/V ring, P of
        # both consumers and the 8-byte barriers (Q per consumer, loaded and consumed
        # per slot for K and V, the consumers' turns); with a bias, each consumer's
        # bias tile and its barrier. (A mask is outside this forward's scope.)
        bias_size, bias_barriers = (0, 0) if bias_dtype is None else (
            np.dtype(jnp.dtype(bias_dtype)).itemsize, 2)
        forward = (b.block_q * (hd + (hv if hv != b.block_k else 0)) * size
                   + b.num_stages * b.block_k * (hd + hv) * size
                   + b.block_q * b.block_k * (size + bias_size)
                   + 8 * (4 * b.num_stages + 3 + bias_barriers))
    else:
        forward = (b.block_q * hd * size + b.num_stages * b.block_k * (hd + hv) * size
                   + tile_inputs(b.block_q, b.block_k, b.num_stages))
    if b.dkv_backend == "mosaic":
        # Per slot Q, dO, the three float32 row residuals and the bias tile; K and V of
        # the unit; P and two dS buffers per consumer; with a bias the dbias zero tile
        # (half a step tile); 8-byte barriers (loaded and consumed per slot, K/V's two).
        bq, bk, stages = b.block_q_dkv, b.block_k_dkv, b.num_stages_dkv
        dkdv = (stages * (bq * (hd + hv) * size + 3 * bq * 4 + bq * bk * extra)
                + bk * (hd + hv) * size + 3 * bq * bk * size
                + (bq * bk // 2 * size if bias_dtype is not None else 0)
                + 8 * (2 * stages + 2))
    else:
        dkdv = (b.block_k_dkv * (hd + hv) * size
                + b.num_stages_dkv * b.block_q_dkv * (hd + hv) * size
                + 2 * b.block_q_dkv * b.block_k_dkv * size
                + tile_inputs(b.block_q_dkv, b.block_k_dkv, b.num_stages_dkv))
    if b.dq_backend == "mosaic":
        # Without a window (not an argument here): with one the kernel runs two
        # consumers, so this is an upper bound.
        dq = _mosaic_dq_bytes(b, hd, hv, dtype, bias_dtype,
                              mosaic_dq_consumers(b, head_dim, value_head_dim, dtype,
                                                  bias_dtype=bias_dtype))
    else:
        dq = (b.block_q_dq * (hd + hv) * size
              + b.num_stages_dq * b.block_k_dq * (hd + hv) * size
              + b.block_q_dq * b.block_k_dq * size
              + tile_inputs(b.block_q_dq, b.block_k_dq, b.num_stages_dq))
    estimate = {"forward": forward, "dkdv": dkdv, "dq": dq}
    if bias_dtype is not None:
        bias_size = np.dtype(jnp.dtype(bias_dtype)).itemsize
        if b.dbias_backend == "mosaic":
            # Q and K in num_stages_dbias slots, dO, V and the three float32 row
            # residuals in as many; each consumer's bias buffer; 8-byte barriers
            # (loaded and consumed per slot of each ring, the bias buffers').
            bq, bk, stages = b.block_q_dbias, b.block_k_dbias, b.num_stages_dbias
            estimate["dbias"] = (stages * (bq + bk) * (hd + hv) * size + stages * 3 * bq * 4
                                 + bq * bk * bias_size + 8 * (4 * stages + 2))
        else:
            # The Triton dbias kernel loads Q, dO, K and V all inside its loop, so every
            # one of them is multi-buffered; the bias tile is not staged. Measured on an
            # H100 at head dim 128, bf16: exactly stages * (block_q + block_k) * 512
            # bytes for (128, 64, 3), (128, 32, 3) and (128, 128, 2), plus 512 with 4
            # warps.
            estimate["dbias"] = (b.num_stages_dbias * (b.block_q_dbias + b.block_k_dbias)
                                 * (hd + hv) * size + 512)
    return estimate


def check_fits(block_sizes: BlockSizes, head_dim: int, value_head_dim: int, dtype: Any,
               device: DeviceInfo, **features: Any) -> None:
    """ValueError naming the kernel, its estimate and the budget if a tile set cannot fit."""
    budget = device.max_shared_memory_per_block
    for kernel, need in shared_memory_estimate(block_sizes, head_dim, value_head_dim,
                                               dtype, **features).items():
        if need > budget:
            raise ValueError(
                f"block_sizes {block_sizes} need about {need} bytes of shared memory in the "
                f"{kernel} kernel (head dims {head_dim}/{value_head_dim}, {jnp.dtype(dtype)}), "
                f"over the device's {budget} bytes per block; choose smaller tiles or fewer stages")


def _fits(candidate: BlockSizes, kernel: str, head_dim: int, value_head_dim: int, dtype: Any,
          budget: int, **features: Any) -> bool:
    estimate = shared_memory_estimate(candidate, head_dim, value_head_dim, dtype, **features)
    return estimate.get(kernel, 0) <= budget  # no dbias entry without a bias


# Per-kernel candidate ladders, best first, per padded head dim (the widest of H, Hv).
# forward: (block_q, block_k, warps, stages); dkdv: (block_q_dkv, block_k_dkv, warps,
# stages); dq and dbias likewise. The first entry of each that fits the device's
# shared memory wins, independently per kernel.
_LADDERS: dict[int, dict[str, tuple[tuple[int, int, int, int], ...]]] = {
    16: {"forward": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2)),
         "dkdv": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2)),
         "dq": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2))},
    32: {"forward": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2)),
         "dkdv": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2)),
         "dq": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2))},
    # Head dims 64, 128, 256: the winners of `python -m pallas_attn tune` on an H100
    # (BENCHMARKS.md), then smaller fallbacks for devices with less shared memory.
    64: {"forward": ((64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2)),
         "dkdv": ((64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 1)),
         "dq": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1))},
    128: {"forward": ((128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)),
          "dkdv": ((64, 64, 4, 2), (64, 64, 4, 1), (32, 64, 4, 1), (32, 32, 4, 1)),
          "dq": ((128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2),
                 (32, 32, 4, 1)),
          "dbias": ((64, 128, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1))},
    256: {"forward": ((128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2),
                      (32, 32, 4, 1), (16, 16, 4, 1)),
          "dkdv": ((64, 64, 8, 2), (32, 64, 8, 3), (32, 64, 8, 2), (32, 32, 4, 1),
                   (16, 16, 4, 1)),
          "dq": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1))},
}
_FIELDS = {"forward": ("block_q", "block_k", "num_warps", "num_stages"),
           "dkdv": ("block_q_dkv", "block_k_dkv", "num_warps_dkv", "num_stages_dkv"),
           "dq": ("block_q_dq", "block_k_dq", "num_warps_dq", "num_stages_dq"),
           "dbias": ("block_q_dbias", "block_k_dbias", "num_warps_dbias", "num_stages_dbias")}


# Causal problems, and problems with extra per-score work (bias, dropout, soft cap),
# where timings preferred other rungs (BENCHMARKS.md): (width, kernel). The extra
# work raises register pressure and the 4-warp forward suffers: at d128 on an H100,
# bias 2.45 -> 1.73 ms, dropout 2.29 -> 2.12 ms, soft cap 1.78 -> 1.70 ms with 8 warps.
_EIGHT_WARP_FORWARD = ((128, 64, 8, 4), (128, 64, 8, 3), (128, 64, 4, 2), (64, 64, 4, 2),
                       (64, 32, 4, 2))
_CAUSAL_LADDERS: dict[tuple[int, str], tuple[tuple[int, int, int, int], ...]] = {
    (128, "forward"): _EIGHT_WARP_FORWARD,
}
_HEAVY_SCORE_LADDERS: dict[tuple[int, str], tuple[tuple[int, int, int, int], ...]] = {
    (128, "forward"): _EIGHT_WARP_FORWARD,
}
# Every ladder ends with these rungs, which fit any supported device and head dim.
_SMALLEST = ((32, 32, 4, 1), (16, 16, 4, 1))


def ladder(kernel: str, head_dim: int, value_head_dim: int | None = None,
           is_causal: bool = False, heavy_scores: bool = False
           ) -> tuple[tuple[int, int, int, int], ...]:
    """Candidates of one kernel, best first; heavy_scores: a bias, dropout or soft cap."""
    width = min(max(padded_head_dim(max(head_dim, value_head_dim or head_dim)), 16), 256)
    # NOTE: dbias has its own swept ladder only at head dim 128; elsewhere it starts
    # from the dQ kernel's, which reads the same four tiles per step.
    entries = _LADDERS[width].get(kernel) or _LADDERS[width]["dq"]
    if is_causal:
        entries = _CAUSAL_LADDERS.get((width, kernel), entries)
    if heavy_scores:
        entries = _HEAVY_SCORE_LADDERS.get((width, kernel), entries)
    return entries + tuple(e for e in _SMALLEST if e not in entries)


def with_kernel(base: BlockSizes, kernel: str, entry: tuple[int, ...]) -> BlockSizes:
    """base with one kernel's (block_q, block_k, warps, stages) replaced."""
    return dataclasses.replace(base, **dict(zip(_FIELDS[kernel], entry, strict=True)))


def choose_block_sizes(head_dim: int, dtype: Any = jnp.bfloat16, *, q_len: int, kv_len: int,
                       value_head_dim: int | None = None, device: DeviceInfo | None = None,
                       **features: Any) -> BlockSizes:
    """Tiles for one problem: the first ladder entry whose shared memory fits.

    Pure function of its arguments (device=None means the current device).
    features (is_causal, has_bias, has_dropout, ...) select autotuned entries
    when a matching cache entry exists and pick the ladders; mosaic_scores (with
    the device, dtype and head dims) selects the Mosaic forward, which replaces
    the Triton forward's tiles, tuned or not (`prefers_mosaic_forward`); the Mosaic
    dK/dV kernel (`prefers_mosaic_dkv`) and with a bias the Mosaic dbias kernel
    (`prefers_mosaic_dbias`) and the Mosaic dQ kernel (`prefers_mosaic_dq`) likewise.
    """
    if not isinstance(head_dim, int) or not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be an int in [1, 256], got {head_dim!r}")
    if value_head_dim is not None and not (isinstance(value_head_dim, int)
                                           and 1 <= value_head_dim <= 256):
        raise ValueError(f"value_head_dim must be an int in [1, 256], got {value_head_dim!r}")
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    device = DeviceInfo.current() if device is None else device
    value_head_dim = value_head_dim or head_dim
    from pallas_attn import autotune

    budget = device.max_shared_memory_per_block
    smem_features = {"bias_dtype": features.get("bias_dtype"),
                     "has_mask": bool(features.get("has_mask"))}
    tuned = autotune.lookup(device, dtype, head_dim, value_head_dim, q_len, kv_len, features)
    chosen = BlockSizes() if tuned is None else tuned.clamp(q_len, kv_len)
    for kernel in _KERNELS if tuned is None else ():
        heavy = (features.get("bias_dtype") is not None or bool(features.get("has_dropout"))
                 or bool(features.get("has_soft_cap")))
        entries = ladder(kernel, head_dim, value_head_dim, bool(features.get("is_causal")),
                         heavy)
        for entry in entries:
            candidate = with_kernel(chosen, kernel, entry).clamp(q_len, kv_len)
            if _fits(candidate, kernel, head_dim, value_head_dim, dtype, budget,
                     **smem_features):
                chosen = with_kernel(chosen, kernel, entry)
                break
        else:
            raise ValueError(
                f"no tile size of the {kernel} kernel fits {budget} bytes of shared memory "
                f"(head dims {head_dim}/{value_head_dim}, {jnp.dtype(dtype)}); pass block_sizes")
    chosen = chosen.clamp(q_len, kv_len)
    if prefers_mosaic_forward(device, dtype, head_dim, value_head_dim, q_len, features):
        mosaic = dataclasses.replace(chosen, forward_backend="mosaic", **_MOSAIC_FORWARD)
        if _fits(mosaic, "forward", head_dim, value_head_dim, dtype, budget, **smem_features):
            chosen = mosaic
    if prefers_mosaic_dkv(device, dtype, head_dim, value_head_dim, q_len, features):
        mosaic = dataclasses.replace(chosen, dkv_backend="mosaic", **_MOSAIC_DKV)
        if _fits(mosaic, "dkdv", head_dim, value_head_dim, dtype, budget, **smem_features):
            chosen = mosaic
    if prefers_mosaic_dq(device, dtype, head_dim, value_head_dim, q_len, features):
        mosaic = dataclasses.replace(chosen, dq_backend="mosaic", **_MOSAIC_DQ)
        if _fits(mosaic, "dq", head_dim, value_head_dim, dtype, budget, **smem_features):
            chosen = mosaic
    if prefers_mosaic_dbias(device, dtype, head_dim, value_head_dim, q_len, features):
        for stages in (2, 1):
            mosaic = dataclasses.replace(chosen, dbias_backend="mosaic",
                                         block_q_dbias=MOSAIC_BLOCK_Q, block_k_dbias=64,
                                         num_stages_dbias=stages)
            if _fits(mosaic, "dbias", head_dim, value_head_dim, dtype, budget, **smem_features):
                chosen = mosaic
                break
    return chosen


# The Mosaic forward's tiles at head dim 128 (BENCHMARKS.md, session 5: block_k 128
# with 2 slots ran 403 TFLOP/s on an H100, block_k 64 with 2 or 3 slots 355-364).
_MOSAIC_FORWARD = dict(block_q=MOSAIC_BLOCK_Q, block_k=128, num_stages=2)
# The Mosaic dK/dV kernel's slots (BENCHMARKS.md, session 10: one slot took 2.95 ms
# against 2.00 at d128 without a bias; three gained nothing at d64).
_MOSAIC_DKV = dict(block_q_dkv=MOSAIC_DKV_TILES[0], block_k_dkv=MOSAIC_DKV_TILES[1],
                   num_stages_dkv=2)

# The Mosaic dQ kernel's tiles and K/V slots (BENCHMARKS.md, session 11: three
# slots ran within 3% of two).
_MOSAIC_DQ = dict(block_q_dq=MOSAIC_DQ_TILES[0], block_k_dq=MOSAIC_DQ_TILES[1],
                  num_stages_dq=2)


def persistent_programs(work_items: int, interpret: bool) -> int:
    """Programs of a persistent kernel: one per multiprocessor (two in the
    interpreter, so that programs loop over several items), at most one per item."""
    slots = 2 if interpret else DeviceInfo.current().num_multiprocessors
    return max(1, min(work_items, slots))


def prefers_mosaic_forward(device: DeviceInfo, dtype: Any, head_dim: int,
                           value_head_dim: int, q_len: int, features: dict[str, Any]) -> bool:
    """Whether the heuristic runs the Mosaic (Hopper) forward instead of Triton's.

    Where it was measured faster (BENCHMARKS.md, session 5): an sm90 device, 16-bit
    inputs, head dims padding to 128, at least one program of query rows, and scores
    the Mosaic forward computes (features["mosaic_scores"]: no dropout and no operand
    besides q, k, v and a bias with its own entry per query and key; a soft cap,
    causal masking and windows are covered). At head dim 64 the Triton forward was
    faster. A float32 bias fails the shared-memory check and keeps Triton's.
    """
    return (_in_mosaic_scope(device, dtype, q_len, features)
            and padded_head_dim(head_dim) == 128 == padded_head_dim(value_head_dim))


def _in_mosaic_scope(device: DeviceInfo, dtype: Any, q_len: int,
                     features: dict[str, Any]) -> bool:
    """What both Mosaic kernels need: sm90, 16-bit inputs, at least one 128-row item
    and scores they compute (features["mosaic_scores"])."""
    return (device.compute_capability == (9, 0)
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and q_len >= MOSAIC_BLOCK_Q and bool(features.get("mosaic_scores")))


def prefers_mosaic_dq(device: DeviceInfo, dtype: Any, head_dim: int, value_head_dim: int,
                      q_len: int, features: dict[str, Any]) -> bool:
    """Whether the heuristic runs the Mosaic (Hopper) dQ kernel instead of Triton's:
    where it runs the Mosaic forward (`prefers_mosaic_forward`: head dims padding to
    128). Measured on an H100 (BENCHMARKS.md, session 12, B=4, N=16, T=S=4096, d128,
    kernel times inside the jitted forward+backward): soft cap 1.57 ms against 1.80,
    [1, N, T, S] bias 1.65 against 1.74, plain 1.41 against 1.47. At d64 Triton's was
    faster (1.09 against 0.88 ms alone, session 11)."""
    return prefers_mosaic_forward(device, dtype, head_dim, value_head_dim, q_len, features)


def prefers_mosaic_dkv(device: DeviceInfo, dtype: Any, head_dim: int, value_head_dim: int,
                       q_len: int, features: dict[str, Any]) -> bool:
    """Whether the heuristic runs the Mosaic (Hopper) dK/dV kernel instead of Triton's:
    an sm90 device, 16-bit inputs, head dims padding to 64 or 128, at least one item of
    query rows and scores the Mosaic kernels compute (features["mosaic_scores"]).
    Measured on an H100 (BENCHMARKS.md, session 10, B=4, N=16, T=S=4096): without a
    bias 2.00 ms against 2.25 at d128 and 1.18 against 1.42 at d64, causal 1.19
    against 1.27 and 0.68 against 0.74; with a [1, N, T, S] bias and its gradient
    2.74 against 4.73 (Triton dK/dV and Mosaic dbias kernels). Two slots; where they
    leave no room (a float32 bias at d128) the Triton kernel runs."""
    return (_in_mosaic_scope(device, dtype, q_len, features)
            and {padded_head_dim(head_dim), padded_head_dim(value_head_dim)} <= {64, 128})


def prefers_mosaic_dbias(device: DeviceInfo, dtype: Any, head_dim: int, value_head_dim: int,
                         q_len: int, features: dict[str, Any]) -> bool:
    """Whether the heuristic runs the Mosaic (Hopper) dbias kernel instead of Triton's,
    where a separate dbias kernel runs at all (a bias broadcast over batch entries or
    heads, `resolve_fuse_dbias`): an sm90 device, 16-bit inputs, head dims padding to
    64 or 128, at least one item of query rows, a bias, and scores the Mosaic kernels
    compute (features["mosaic_scores"]). Measured on an H100 (BENCHMARKS.md, session
    9): 1.76 ms against 2.37 at d128, 1.27 against 1.37 at d64. Its tiles are
    (128, 64) with two slots per ring, one where a float32 bias leaves no room."""
    return (features.get("bias_dtype") is not None
            and _in_mosaic_scope(device, dtype, q_len, features)
            and {padded_head_dim(head_dim), padded_head_dim(value_head_dim)} <= {64, 128})


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


