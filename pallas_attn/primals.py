"""Helpers for custom_vjp rules registered with symbolic_zeros=True.

With symbolic zeros, a forward rule receives each primal leaf wrapped as
jax.custom_derivatives.CustomVJPPrimal(value, perturbed); `perturbed` says whether
the caller differentiates it, which lets a rule skip work (the dbias kernel) or
refuse a gradient it cannot give (ALiBi slopes in the kernels).
"""

from __future__ import annotations

from typing import Any

import jax


def _is_primal(leaf: Any) -> bool:
    return hasattr(leaf, "perturbed")


def primal_values(tree: Any) -> Any:
    """The tree with every CustomVJPPrimal replaced by its value."""
    return jax.tree.map(lambda leaf: leaf.value, tree, is_leaf=_is_primal)


def is_perturbed(tree: Any) -> bool:
    """Whether any leaf of the tree is differentiated by the caller."""
    return any(leaf.perturbed for leaf in jax.tree.leaves(tree, is_leaf=_is_primal))
