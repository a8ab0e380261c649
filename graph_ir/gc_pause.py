"""Python's cyclic garbage collector paused around capture and compilation.

Tracing a step allocates containers (fake tensors, nodes, their metadata, pytree specs) faster
than anything else a training script does, and they stay alive: each generation-2 collection walks
all of them again and finds nothing to free. Paused, capture and the pass pipeline of a 32-layer
7B-shaped step take 10-20% less time (``bench.capture_scaling``). The collector resumes when the
outermost paused region ends (cycles made inside it are collected then), and a caller that had
paused it itself finds it paused afterwards.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """``with gc_paused():`` or ``@gc_paused()``: no cyclic collection inside; nests."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
