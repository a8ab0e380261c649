"""Inductor options for compiling a whole training step as one graph.

:data:`SETTINGS` (applied by :func:`step_settings`) are inductor options for a whole-step
graph, each kept only where it leaves the generated code of the recipe GPT byte-identical
(so its step time cannot change) and cuts compile time:

- ``max_fusion_buffer_group_pairwise_attempts`` 64 -> 16: inductor pairs up, as fusion
  candidates, nodes that read a common buffer, each with the next N of that buffer's readers.
  In a whole step every parameter's update reads the same 0-dim hyperparameter inputs (lr,
  betas, eps, weight decay), so those groups hold every update and nearly all of the
  pairs; a shared 0-dim read is below inductor's own fusion threshold
  (``score_fusion_memory_threshold``), so they are tried and refused, each after a loop
  reordering attempt. 6-layer d256 GPT + AdamW: 33,716 -> 15,447 ``can_fuse`` calls,
  fusion 10.6 -> 8.2 s of CPU, the same output code.

Starting each C++ kernel's compile as soon as inductor generates it (instead of when the
generated module loads) cut a quiet cold compile from 1.25x to 0.76x torch.compile + compiled
optimizer, but full test-suite runs with it on produced inductor steps with NaN losses and the
cause was not found, so it is not done: the kernels' C++ is compiled when the generated module
loads, as under torch.compile, but in a few translation units instead of one per kernel
(:mod:`cann_passes.lowering.cpp_kernel_batches`).
"""
from __future__ import annotations

SETTINGS = {"max_fusion_buffer_group_pairwise_attempts": 16}


def step_settings():
    """``torch._inductor.config.patch(SETTINGS)``: part of inductor's cache keys, so the warm process
    applies them too (the compile cache's lowering context does)."""
    from torch._inductor import config
    return config.patch(SETTINGS)
