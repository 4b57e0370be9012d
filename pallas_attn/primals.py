"""Helpers for the custom_vjp rules: which inputs the caller differentiates, and a
backward that refuses to be differentiated itself.

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


def first_order_only(tree: Any, what: str) -> Any:
    """The tree unchanged; differentiating through it (a custom_vjp's rules run under a
    second derivative) raises a NotImplementedError naming `what` and the alternative,
    instead of an error from deep inside JAX. Applied to the rules' inputs, ahead of
    anything that cannot be differentiated."""
    leaves, treedef = jax.tree.flatten(tree)

    @jax.custom_jvp
    def identity(*leaves):
        return leaves

    @identity.defjvp
    def refuse(primals, tangents):
        raise NotImplementedError(
            f"{what} has no second derivative (jax.grad of jax.grad, jax.hessian); "
            f"use implementation='xla', the reference, for higher-order derivatives")

    return jax.tree.unflatten(treedef, identity(*leaves))
