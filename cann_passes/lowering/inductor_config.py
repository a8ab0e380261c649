"""How inductor compiles a whole step: C++ compiles started while the rest is still lowered.

Opt-in (``CANN_PASSES_EARLY_KERNEL_COMPILES=1``): with it on, two full test-suite runs
produced inductor steps with NaN losses (cause not found), so the compile cache's
lowering context applies only :func:`step_settings` by default.

A captured step is one large graph, so inductor's first compile of it is one long
sequence on one thread: AOTAutograd's trace, lowering, fusion, code generation of
every kernel, and only then, when the generated module is loaded, the C++ compiles
of all its kernels, in inductor's compile pool (``compile_threads``). torch.compile
of a module does the same per graph. What :func:`overlapped_compile` changes, for
the compiles inside it, and nothing in the code inductor generates:

- **Each C++ kernel is handed to the compile pool as soon as its source is final**
  (``PythonWrapperCodegen.define_kernel``), not when the module is loaded: the pool's
  g++ runs beside the code generation of the kernels after it. Inductor's own call at
  load time finds the same source (same key) in ``CppPythonBindingsCodeCache`` and
  waits for that compile, so the module and its cache entries are the ones inductor
  makes without this.
- **The vector ISA probe runs in a background thread from the start** (inductor
  compiles and loads a test program per candidate ISA, serially, on its first kernel:
  seconds of g++ in a cold cache); its file locks make the main thread wait for the
  same result instead of compiling it twice.

With one compile thread (``TORCHINDUCTOR_COMPILE_THREADS=1``) inductor compiles in
the main thread anyway and nothing is submitted early.

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
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

log = logging.getLogger("cann_passes")

_PREFIX = "async_compile.cpp_pybinding("

SETTINGS = {"max_fusion_buffer_group_pairwise_attempts": 16}


class EarlyKernelCompiles:
    """Submits each C++ kernel to inductor's compile pool when it is defined.

    ``submitted`` counts the kernels handed over; ``seconds`` is the main thread's time spent
    submitting them (evaluating the kernel's call text and queueing it).
    """

    def __init__(self):
        self.submitted = 0
        self.seconds = 0.0

    def __call__(self, kernel_body: str) -> None:
        if not kernel_body.startswith(_PREFIX):
            return
        from torch._inductor.async_compile import AsyncCompile
        start = time.perf_counter()
        # The body is the exact call the generated module makes at load time
        # (``async_compile.cpp_pybinding(argtypes, r'''source''')``): evaluated against the real
        # AsyncCompile, it queues the same compile under the same cache key.
        eval(kernel_body, {"async_compile": AsyncCompile()})   # noqa: S307 (inductor's own generated text)
        self.submitted += 1
        self.seconds += time.perf_counter() - start


def _probe_vector_isa() -> None:
    try:
        from torch._inductor import cpu_vec_isa
        cpu_vec_isa.pick_vec_isa()
    except Exception as exc:   # the main thread probes again and reports its own error
        log.debug("background vector ISA probe failed: %s", exc)


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def overlapped_compile():
    """Inside: inductor's C++ kernel compiles start as each kernel is generated (see the module).

    Yields the :class:`EarlyKernelCompiles` counter. Re-entrant; a no-op where inductor compiles
    in the main thread (one compile thread) or its code generator has no ``define_kernel``.
    """
    early = EarlyKernelCompiles()
    try:
        from torch._inductor.async_compile import get_compile_threads
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    except ImportError:
        yield early
        return
    original = PythonWrapperCodegen.__dict__.get("define_kernel")
    if original is None or get_compile_threads() <= 1 or getattr(original, "_early_compiles", False):
        yield early
        return
    threading.Thread(target=_probe_vector_isa, name="inductor-vec-isa-probe", daemon=True).start()

    def define_kernel(self, kernel_name, kernel_body, metadata=None, gpu=True, cpp_definition=None):
        original(self, kernel_name, kernel_body, metadata=metadata, gpu=gpu, cpp_definition=cpp_definition)
        if not gpu and type(self) is PythonWrapperCodegen:
            early(kernel_body)

    define_kernel._early_compiles = True
    with _PATCH_LOCK:
        PythonWrapperCodegen.define_kernel = define_kernel
    try:
        yield early
    finally:
        with _PATCH_LOCK:
            PythonWrapperCodegen.define_kernel = original
        if early.submitted:
            log.info("inductor: %d C++ kernels submitted as generated (%.2fs)", early.submitted, early.seconds)


def step_settings():
    """``torch._inductor.config.patch(SETTINGS)``: part of inductor's cache keys, so the warm process
    applies them too (the compile cache's lowering context does)."""
    from torch._inductor import config
    return config.patch(SETTINGS)
