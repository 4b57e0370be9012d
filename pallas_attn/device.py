"""The GPU a plan is made for: compute capability, multiprocessors, shared memory.

The one module that asks the device anything. The routing table (dispatch.py)
reads a `DeviceInfo` once per call and hands kernels what they need (tiles,
consumer warpgroups, the number of persistent programs); kernels never ask.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import functools
from collections.abc import Iterator

import jax

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
    """What planning needs to know about a GPU.

    Construct it by hand to plan for a device you are not on, e.g.
    DeviceInfo(compute_capability=(8, 6), num_multiprocessors=84,
    max_shared_memory_per_block=101376). The defaults describe an H100 SXM.
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
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @staticmethod
    def for_capability(compute_capability: tuple[int, int],
                       num_multiprocessors: int = 108) -> DeviceInfo:
        """A device described by the table of opt-in shared memory per capability."""
        smem = _SHARED_MEMORY_BY_CAPABILITY.get(tuple(compute_capability), 101376)
        return DeviceInfo(tuple(compute_capability), num_multiprocessors, smem)

    @staticmethod
    def current() -> DeviceInfo:
        """The GPU being lowered for (`lowering_for`), else the first local device, read
        once and cached (H100 defaults off-GPU)."""
        return _LOWERING_FOR.get() or _current_device_info()

    @property
    def is_hopper(self) -> bool:
        """sm90: the warp-specialised Mosaic GPU kernels' architecture."""
        return self.compute_capability == (9, 0)

    def describe(self) -> str:
        major, minor = self.compute_capability
        return (f"sm{major}{minor}, {self.num_multiprocessors} SMs, "
                f"{self.max_shared_memory_per_block} bytes of shared memory per block")


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


_LOWERING_FOR: contextvars.ContextVar[DeviceInfo | None] = contextvars.ContextVar(
    "pallas_attn_lowering_for", default=None)


@contextlib.contextmanager
def lowering_for(device: DeviceInfo) -> Iterator[None]:
    """Plans calls traced inside for this GPU, on a machine without it: for ahead-of-time
    lowering, e.g. `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`."""
    if not isinstance(device, DeviceInfo):
        raise TypeError(f"lowering_for takes a pallas_attn.DeviceInfo, got {device!r}")
    token = _LOWERING_FOR.set(device)
    try:
        yield
    finally:
        _LOWERING_FOR.reset(token)


def on_nvidia_gpu() -> bool:
    """Whether kernels are planned for an NVIDIA GPU: the default JAX device is one, or
    a `lowering_for` block names one."""
    if _LOWERING_FOR.get() is not None:
        return True
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and "nvidia" in device.device_kind.lower()
