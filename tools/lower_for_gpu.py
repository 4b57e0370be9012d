"""Lower the kernels for an sm90 GPU on a machine without one (catches lowering errors).

Patches Pallas's GPU-info query so the Triton lowering (jaxpr -> Triton IR) runs
on CPU; the Mosaic GPU lowering of the Hopper forward needs no patch. Compilation
to machine code still happens only on a GPU.
Usage: python tools/lower_for_gpu.py ["is_causal=True, ..."]
"""

import sys
import traceback

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import gpu_info, pallas_call_registration

import pallas_attn

_FAKE = gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90", compute_capability=90)
gpu_info.get_gpu_info = lambda: _FAKE
pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: _FAKE


def lowered_text(B=2, T=256, S=256, N=4, K=4, H=64, Hv=None, dtype=jnp.bfloat16,
                 **kw) -> str:
    """The StableHLO text of the op's forward and gradients lowered for sm90 (the Mosaic
    GPU kernels' modules inside it)."""
    q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
    k = jax.ShapeDtypeStruct((B, S, K, H), dtype)
    v = jax.ShapeDtypeStruct((B, S, K, Hv or H), dtype)

    bias = kw.pop("bias", None)

    def f(q, k, v, bias):
        def loss(q, k, v, bias):
            out = pallas_attn.dot_product_attention(q, k, v, bias, implementation="pallas", **kw)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2) if bias is None else (0, 1, 2, 3))(q, k, v, bias)

    with pallas_attn.device.lowering_for(pallas_attn.DeviceInfo()):
        return jax.jit(f).trace(q, k, v, bias).lower(lowering_platforms=("cuda",)).as_text()


def lower(**kw) -> bool:
    try:
        lowered_text(**kw)
        print("OK", kw)
        return True
    except Exception:  # noqa: BLE001
        traceback.print_exc(limit=-15)
        print("FAIL", kw)
        return False


if __name__ == "__main__":
    sys.exit(0 if lower(**eval(f"dict({sys.argv[1] if len(sys.argv) > 1 else ''})")) else 1)
