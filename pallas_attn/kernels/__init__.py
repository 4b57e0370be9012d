"""The Pallas kernels: a backend-neutral core, the Triton and Mosaic GPU backends,
and the custom_vjp that runs a plan's kernels."""


def next_power_of_2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def padded_head_dim(head_dim: int) -> int:
    """Head dims are padded to a power of two (at least 16) for the kernels."""
    return max(16, next_power_of_2(head_dim))
