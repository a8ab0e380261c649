"""Inductor's C++ kernels of one generated module compiled as a few translation units, not one each.

Inductor on CPU compiles every fused kernel of a module as its own shared library: one g++ run per
kernel, each of which first loads the precompiled ``cpp_prefix.h`` (about 150 MB, a large share of
a small kernel's compile time) before it compiles the kernel's few KB. A whole training step has 30-40
kernels, so most of its C++ time is that start-up, paid again per kernel. :func:`batched` gathers
the kernels a module defines and, when the module waits for them, compiles them as one translation
unit per compile worker (kernels dealt out by source size, largest first), each kernel in a
namespace of its own and the unit's Python module exposing one function per kernel.

The kernel code is inductor's, byte for byte, compiled with inductor's own flags and precompiled
header through its code cache (``CppPythonBindingsCodeCache``: same cache directory, same locking,
same hash-keyed reuse in a second process), so results are bitwise those of per-kernel compiles.
Only a kernel whose source has the shape this module knows (one ``extern "C" void kernel(``, only
``#include`` and ``#pragma`` directives) joins a batch; any other, and every kernel of a batch whose
compile fails, compiles on its own the way inductor does. With one compile thread inductor compiles
synchronously at definition and there is nothing to batch; this module then does nothing.
"""
from __future__ import annotations

import contextlib
import logging
import re
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

_KERNEL_DECL = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')

# The Python binding: inductor's own (``CppPythonBindingsCodeCache.suffix_template``) written for
# many entry points. A tensor argument arrives as the tensor object and is turned into its data
# pointer by the function whose address inductor's loader puts in the environment.
_BINDING_PRELUDE = r'''
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sstream>
#include <cstdlib>
#include <cerrno>

static void* (*_cann_tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T parse_arg(PyObject* args, size_t n) {
    static_assert(std::is_pointer_v<T>, "arg type must be pointer or long");
    return static_cast<T>(_cann_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t parse_arg<int64_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if(result == -1 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return result;
}
template <> inline uintptr_t parse_arg<uintptr_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if(result == reinterpret_cast<void*>(-1) && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return reinterpret_cast<uintptr_t>(result);
}
template <> inline float parse_arg<float>(PyObject* args, size_t n) {
    auto result = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if(result == -1.0 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected float arg");
    return static_cast<float>(result);
}
'''

_ENTRY = r'''
namespace cann_kernel_{index} {{
static PyObject* entry(PyObject* self, PyObject* args) {{
    try {{
        if(!PyTuple_CheckExact(args)) [[unlikely]]
            throw std::runtime_error("tuple args required");
        if(PyTuple_GET_SIZE(args) != {arg_len}) [[unlikely]]
            throw std::runtime_error("requires {arg_len} args");
        kernel({parse_args});
        Py_RETURN_NONE;
    }} catch(std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch(...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled error");
        return nullptr;
    }}
}}
}}
'''

_MODULE = r'''
static PyMethodDef cann_kernel_methods[] = {{
{methods}
    {{NULL, NULL, 0, NULL}}}};

static struct PyModuleDef cann_kernel_module =
    {{PyModuleDef_HEAD_INIT, "kernel", NULL, -1, cann_kernel_methods}};

PyMODINIT_FUNC PyInit_kernel(void) {{
    const char* str_addr = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if(!str_addr) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set");
        return nullptr;
    }}
    char* endptr = nullptr;
    errno = 0;
    uintptr_t addr = std::strtoull(str_addr, &endptr, 10);
    if(errno != 0 || endptr == str_addr || addr == 0) {{
        PyErr_SetString(PyExc_RuntimeError, "Failed to parse _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
        return nullptr;
    }}
    _cann_tensor_data_ptr = reinterpret_cast<decltype(_cann_tensor_data_ptr)>(addr);
    PyObject* module = PyModule_Create(&cann_kernel_module);
    #ifdef Py_GIL_DISABLED
        if (module != NULL) PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED);
    #endif
    return module;
}}
'''


def batchable(source: str) -> bool:
    """Whether a kernel's source has the one shape a batch knows how to take apart."""
    if len(_KERNEL_DECL.findall(source)) != 1:
        return False
    directives = (line.strip() for line in source.splitlines() if line.lstrip().startswith("#"))
    return all(d.startswith(("#include", "#pragma")) for d in directives)


def translation_unit(kernels: list[tuple[list[str], str]]) -> str:
    """One C++ source for ``kernels`` (``(argtypes, source)`` each, in inductor's form): their
    ``#include`` lines first, each kernel's code in namespace ``cann_kernel_<i>`` (``kernel`` there
    has C++ linkage, so the kernels' names do not collide), and a Python module ``kernel`` whose
    function ``k<i>`` calls kernel ``i``."""
    includes: list[str] = []
    bodies, entries, methods = [], [], []
    for index, (argtypes, source) in enumerate(kernels):
        body = []
        for line in source.splitlines():
            if line.lstrip().startswith("#include"):
                if line.strip() not in includes:
                    includes.append(line.strip())
            else:
                body.append(line)
        code = _KERNEL_DECL.sub("void kernel(", "\n".join(body), count=1)
        bodies.append(f"namespace cann_kernel_{index} {{\n{code}\n}}\n")
        parse_args = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(argtypes))
        entries.append(_ENTRY.format(index=index, arg_len=len(argtypes), parse_args=parse_args))
        methods.append(f'    {{"k{index}", cann_kernel_{index}::entry, METH_VARARGS, ""}},')
    return "\n".join(includes + bodies + [_BINDING_PRELUDE] + entries
                     + [_MODULE.format(methods="\n".join(methods))])


def deal(sizes: list[int], units: int) -> list[list[int]]:
    """Indices dealt into at most ``units`` groups of about equal total size (largest first, each to
    the lightest group): g++ time grows with source size, and the groups compile side by side."""
    groups: list[list[int]] = [[] for _ in range(max(1, min(units, len(sizes))))]
    loads = [0] * len(groups)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = loads.index(min(loads))
        groups[lightest].append(index)
        loads[lightest] += sizes[index]
    return [sorted(g) for g in groups if g]


class _Batch:
    """The kernels one generated module (one ``AsyncCompile``) has defined and not yet compiled."""

    def __init__(self, submit: Callable, units: int):
        self.submit, self.units = submit, units
        self.pending: list[tuple[int, list[str], str]] = []
        self.done: dict[int, Any] = {}
        self.lock = threading.Lock()

    def add(self, argtypes: list[str], source: str) -> int:
        with self.lock:
            index = len(self.done) + len(self.pending)
            self.pending.append((index, list(argtypes), source))
            return index

    def result(self, index: int):
        with self.lock:
            if index not in self.done:
                self._compile(self.pending)
                self.pending = []
            return self.done[index]

    def _compile(self, kernels: list[tuple[int, list[str], str]]) -> None:
        from torch._inductor.codecache import CppPythonBindingsCodeCache as cache
        groups = [[kernels[i] for i in group] for group in deal([len(k[2]) for k in kernels], self.units)]
        loads = [cache.load_async(translation_unit([(a, s) for _, a, s in group]), "cpu", submit_fn=self.submit)
                 for group in groups]
        for group, load in zip(groups, loads):
            try:
                module = load()
                for position, (index, _, _) in enumerate(group):
                    self.done[index] = getattr(module, f"k{position}")
            except Exception as error:  # noqa: BLE001 -- any failure: compile the way inductor does
                log.warning("a batch of %d C++ kernels did not compile as one unit (%s); "
                            "compiling them one by one", len(group), str(error).splitlines()[0][:200])
                for index, argtypes, source in group:
                    self.done[index] = cache.load_pybinding(argtypes, source)


_active = 0
_active_lock = threading.Lock()
_original: Callable | None = None


def _cpp_pybinding(self, argtypes, source_code):
    from torch._inductor.async_compile import get_compile_threads
    from torch._inductor.codecache import LambdaFuture
    threads = get_compile_threads()
    if threads <= 1 or not batchable(source_code):
        return _original(self, argtypes, source_code)
    batch = self.__dict__.get("_cann_kernel_batch")
    if batch is None:
        batch = self._cann_kernel_batch = _Batch(self.submit, threads)
    index = batch.add(argtypes, source_code)
    return LambdaFuture(lambda: batch.result(index))


@contextlib.contextmanager
def batched():
    """While active, C++ kernels that inductor's generated modules define are compiled in batches
    (see the module docstring). Reentrant; restores inductor's own ``cpp_pybinding`` on exit."""
    global _active, _original
    from torch._inductor.async_compile import AsyncCompile
    with _active_lock:
        if _active == 0:
            _original = AsyncCompile.cpp_pybinding
            AsyncCompile.cpp_pybinding = _cpp_pybinding
        _active += 1
    try:
        yield
    finally:
        with _active_lock:
            _active -= 1
            if _active == 0:
                AsyncCompile.cpp_pybinding = _original
