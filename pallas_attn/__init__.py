"""pallas_attn: differentiable fused attention for JAX (Pallas GPU kernels)."""

from pallas_attn.api import dot_product_attention
from pallas_attn.dropout import dropout_keep_mask
from pallas_attn.spec import AttentionSpec
from pallas_attn.tuning import BlockSizes, DeviceInfo, choose_block_sizes

__all__ = [
    "AttentionSpec",
    "BlockSizes",
    "DeviceInfo",
    "choose_block_sizes",
    "dot_product_attention",
    "dropout_keep_mask",
]
