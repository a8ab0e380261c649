"""Inductor's intermediate buffers kept from one call of a lowered graph to its next.

Inductor's generated code allocates every intermediate with ``empty_strided_cpu`` and drops it when
done. In a process that runs the step and little else, glibc hands those pages back to the system
between steps (the heap top trimmed, large blocks unmapped) and the next step faults them in again,
inside whichever kernel writes them first. On a transformers LLaMA (6 layers, d256) that put ours'
matmuls 20 ms a step above the same matmuls in ``torch.compile``'s process (412 against 392 ms, the
same calls with the same shapes; level when glibc is told never to trim). Inductor's own memory
planning takes its pool afresh on every call, which faults more, not less. The eager backend holds
its buffers in planned slots (``plan_buffers``, ``held_buffers``); this is the same policy for
inductor: a lowered graph keeps the buffers its call allocated and dropped, and its next call takes
them back instead of allocating.

How: the Python modules inductor generates for our graphs (seen as ``compile_fx`` loads them) call
:func:`empty_strided` in place of torch's ``empty_strided_cpu``; while a :class:`HoldingRunner` runs,
that takes a buffer of the same size, strides and dtype from the runner's :class:`KeptBuffers` if
one is free, else allocates and keeps it. Free means nothing but the pool references it: no Python
name, no view (the storage's use count), no C++ holder (the tensor's use count); a buffer the graph
returns, a view of one, or one a collective still holds is therefore never handed out, and after each
call the pool lets go of every buffer that is still referenced (the caller owns it). So a graph holds
at most what its call allocated and dropped, for as long as the graph lives (a compiled step keeps
its graphs), as the eager backend's slots. Outside a :class:`HoldingRunner` (a module the same code
also serves for ``torch.compile``) the allocation is torch's own.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable

import torch

_allocate = torch._C._dynamo.guards._empty_strided_cpu
_storage_use_count = torch._C._storage_Use_Count
_active = threading.local()


class KeptBuffers:
    """The buffers one lowered graph's calls allocated and dropped, by (size, strides, dtype)."""

    def __init__(self):
        self._by_layout: dict[tuple, list[torch.Tensor]] = {}

    def take(self, size, stride, dtype) -> torch.Tensor:
        kept = self._by_layout.setdefault((size, stride, dtype), [])
        for i in range(len(kept)):
            if _free(kept, i):
                # To the back: those not yet taken in this call come first, so the first is free.
                t = kept.pop(i)
                kept.append(t)
                return t
        t = _allocate(size, stride, dtype)
        kept.append(t)
        return t

    def let_go_of_referenced(self) -> None:
        """After a call: keep only the buffers nothing else references (the call's dropped
        intermediates); what the graph returned, or anything still holds, is no longer ours."""
        for layout, kept in list(self._by_layout.items()):
            kept[:] = [kept[i] for i in range(len(kept)) if _free(kept, i)]
            if not kept:
                del self._by_layout[layout]

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for kept in self._by_layout.values() for t in kept)


def _python_references(kept: list, i: int) -> int:
    t = kept[i]
    return sys.getrefcount(t)


# What :func:`_python_references` reads for an object only a list holds (its list, ``t`` and
# getrefcount's argument), measured rather than assumed: interpreters count differently.
_ONLY_KEPT = _python_references([object()], 0)


def _free(kept: list, i: int) -> bool:
    """Whether ``kept[i]`` is referenced by nothing but ``kept``: no other Python reference (asked
    before the caller holds it), no other holder of the tensor (a C++ one), no other tensor on its
    storage (a view); the storage's count includes the temporary ``untyped_storage()``."""
    if _python_references(kept, i) > _ONLY_KEPT:
        return False
    t = kept[i]
    return t._use_count() == 1 and _storage_use_count(t.untyped_storage()._cdata) == 2


def empty_strided(size, stride, dtype, *rest) -> torch.Tensor:
    """``empty_strided_cpu`` for the modules of our lowered graphs (see the module's docstring)."""
    pool = getattr(_active, "pool", None)
    if pool is None or rest:
        return _allocate(size, stride, dtype, *rest)
    return pool.take(size, stride, dtype)


class HoldingRunner:
    """A lowered graph's runner whose generated code allocates from its own :class:`KeptBuffers`."""

    def __init__(self, run: Callable[..., Any]):
        self.run, self.kept = run, KeptBuffers()

    def __call__(self, *inputs):
        outer = getattr(_active, "pool", None)
        _active.pool = self.kept
        try:
            outputs = self.run(*inputs)
        finally:
            _active.pool = outer
        self.kept.let_go_of_referenced()
        return outputs


@contextlib.contextmanager
def allocating_from_kept_buffers():
    """While inductor compiles our graphs: every wrapper module it loads allocates through
    :func:`empty_strided` (a module loaded from inductor's caches included)."""
    from torch._inductor.codecache import PyCodeCache
    load = PyCodeCache.__dict__["load_by_key_path"]

    def loading(cls, *args, **kwargs):
        module = load.__func__(cls, *args, **kwargs)
        if getattr(module, "empty_strided_cpu", None) is _allocate:
            module.empty_strided_cpu = empty_strided
        return module
    PyCodeCache.load_by_key_path = classmethod(loading)
    try:
        yield
    finally:
        PyCodeCache.load_by_key_path = load
