"""Capture, compilation and lowering run with room on CPython's frame stack, whatever their caller's depth.

CPython 3.11+ keeps a thread's Python frames in chunks of 16 KiB that it maps when a frame does not
fit and unmaps when the first frame of a chunk returns. Tracing calls and returns through the same
few dozen frames once per op; where a chunk boundary falls inside that stretch, every op maps and
unmaps a chunk and faults its pages in again. Where the boundary falls depends only on how deep the
caller is: measured on a 7B-shaped 8-layer GPT, capture took 0.37-0.61 s (page faults 0-35k)
depending on how many frames sat above the call, periodically with each 16 KiB of caller frames,
and ``python -m`` adds enough of them to land a 32-layer capture on a slow spot. Inductor's
lowering of a 2-layer GPT (its caches off, its kernels built) took 2.9-4.6 s (6k-270k faults)
the same way.

So the call goes through a trampoline whose frame reserves 256 KiB of value stack it never uses:
CPython gives it a chunk of its own, twice that size (chunk sizes are powers of two), and every frame
the call makes fits in the rest of that chunk, which lives as long as the call. The reserved slots
are never written, so their pages are never touched; the chunk is unmapped once, when the call
returns. Other Pythons (and CPython before 3.11, whose frames are heap objects) call straight through.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

# Just over half of a power of two, so the chunk is the next power (512 KiB) with half of it free.
_RESERVED_SLOTS = 256 * 1024 // 8 + 64
_CHUNKED_FRAMES = sys.implementation.name == "cpython" and sys.version_info >= (3, 11)


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


_roomy_call = types.FunctionType(
    _call.__code__.replace(co_stacksize=_call.__code__.co_stacksize + _RESERVED_SLOTS),
    globals(), "_call") if _CHUNKED_FRAMES else _call


def with_stack_room(fn: F) -> F:
    """``fn`` called through the trampoline (see the module's docstring)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _roomy_call(fn, args, kwargs)
    return wrapper  # type: ignore[return-value]
