"""pallas_attn: differentiable fused attention for JAX (Pallas GPU kernels)."""

from pallas_attn.api import dot_product_attention, explain
from pallas_attn.device import DeviceInfo
from pallas_attn.paged import paged_attention, paged_cache_update
from pallas_attn.plan import BlockSizes, Plan, Route
from pallas_attn.ring import ring_attention, unzigzag, zigzag
from pallas_attn.semantics.dropout import dropout_keep_mask
from pallas_attn.spec import AttentionSpec

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec",
    "BlockSizes",
    "DeviceInfo",
    "Plan",
    "Route",
    "__version__",
    "dot_product_attention",
    "dropout_keep_mask",
    "explain",
    "paged_attention",
    "paged_cache_update",
    "ring_attention",
    "unzigzag",
    "zigzag",
]
