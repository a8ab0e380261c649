"""What a node does besides computing its value: the one place passes and lowerings ask.

Three facts decide what a rewrite may do with a node, and each is defined here once:

- **random draws** (:func:`draws_random`): the op reads and advances the random generator
  (torch tags it ``nondeterministic_seeded``: dropout masks, ``rand``, SDPA with dropout).
  Two draws are two draws, so they are never merged (CSE), recomputed from scratch (the
  backward would see another mask), copied into two graphs, or run in place over a buffer
  another op still reads. SDPA's kernels carry the tag because they *can* apply dropout;
  given ``dropout_p=0`` they draw nothing, and are treated as pure.
- **communication** (:func:`communicates`): a functional collective or the ``wait_tensor``
  that completes it (:mod:`graph_ir.analysis.collectives` knows which collective and how
  much it moves). Two collectives are two communications (ZeRO-3 gathers a parameter again
  for backward on purpose), and every rank must issue the same ones in the same order, so
  they are never merged, copied or dropped on one rank only, and nothing cuts a graph
  between a collective and its wait.
- what follows: :func:`may_merge` (CSE), :func:`may_duplicate` (recompute, copying a value
  into several stage graphs).
"""
from __future__ import annotations

import torch
import torch.fx

from .collectives import is_collective, is_communication_op

__all__ = ["communicates", "draws_random", "is_collective", "may_duplicate", "may_merge", "random_op"]


def random_op(target) -> bool:
    """An op that may draw random numbers (by torch's tag), whatever its arguments."""
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def _draws_nothing(node: torch.fx.Node) -> bool:
    """A seeded op given ``dropout_p=0``: it draws nothing and recomputes bitwise."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    names = [a.name for a in schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", schema.arguments[i].default_value)
    return isinstance(p, (int, float)) and p == 0


def draws_random(node: torch.fx.Node) -> bool:
    """The node draws random numbers here (see the module docstring)."""
    return node.op == "call_function" and random_op(node.target) and not _draws_nothing(node)


def communicates(node: torch.fx.Node) -> bool:
    """A functional collective or its ``wait_tensor``."""
    return is_communication_op(node)


def regathers(node: torch.fx.Node) -> bool:
    """An all-gather or the wait of one: rebuilding it re-runs the same exact collective (every rank
    runs the same graph, so the copies meet in the same order), as Megatron's recompute re-gathers
    context- and sequence-parallel activations instead of saving them whole."""
    from .collectives import collective_kind, collective_of
    return communicates(node) and collective_kind(collective_of(node)) == "all_gather"


def may_merge(node: torch.fx.Node) -> bool:
    """Two nodes with this op and the same inputs may become one (CSE): neither a draw, a
    communication, nor an in-place view. Impurity (FX's ``is_impure``) is the caller's check."""
    if node.op != "call_function" or communicates(node) or draws_random(node):
        return False
    return torch.Tag.inplace_view not in getattr(node.target, "tags", ())


def may_duplicate(node: torch.fx.Node) -> bool:
    """The node's value may be computed again elsewhere (recompute, a copy per stage graph)."""
    return node.op == "call_function" and not communicates(node) and not draws_random(node) \
        and not node.is_impure()
