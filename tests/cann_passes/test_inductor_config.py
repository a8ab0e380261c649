"""Overlapped inductor compiles: each C++ kernel is submitted to the compile pool when it is generated,
the module inductor loads afterwards finds those compiles, and nothing is built twice."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes.lowering.base import cxx_compiler_available
from cann_passes.lowering.inductor_config import overlapped_compile

pytestmark = pytest.mark.skipif(not cxx_compiler_available()[0], reason="inductor needs a C++ compiler")


def _step(x, w):
    # Pointwise work on both sides of a matmul (an extern call): two C++ kernels at least.
    h = torch.tanh(x * 2 + 1) @ w
    return (h.relu() * 3).sum(0)


def test_kernels_compile_as_generated_once_each_and_the_module_loads_those(monkeypatch):
    from torch._inductor import config, cpp_builder
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import fresh_cache

    built, sources, lock = [], [], threading.Lock()
    build, cpp_pybinding = cpp_builder.CppBuilder.build, AsyncCompile.cpp_pybinding

    def counting_build(self):
        build(self)
        with lock:
            built.append(self.get_target_file_path())

    def recording_cpp_pybinding(self, argtypes, source_code):
        sources.append(source_code)
        return cpp_pybinding(self, argtypes, source_code)
    monkeypatch.setattr(cpp_builder.CppBuilder, "build", counting_build)
    monkeypatch.setattr(AsyncCompile, "cpp_pybinding", recording_cpp_pybinding)
    define_kernel = PythonWrapperCodegen.define_kernel
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    gm = make_fx(_step)(x, w)
    # Scalar kernels (no vector ISA probe: a few g++ runs fewer), compiled afresh.
    with config.patch({"compile_threads": 2, "fx_graph_cache": False, "cpp.vec_isa_ok": False}), fresh_cache():
        with overlapped_compile() as early:
            run = compile_fx(gm, [x, w])
        out = run(x, w)
    assert PythonWrapperCodegen.define_kernel is define_kernel    # the hook is gone afterwards
    assert early.submitted >= 2
    submitted, loaded = sources[:early.submitted], sources[early.submitted:]
    # The module's own calls, at load, ask for exactly the sources already submitted ...
    assert sorted(loaded) == sorted(submitted)
    # ... and find them compiled or compiling: no C++ file is built twice.
    assert len(built) == len(set(built)), sorted(built)
    torch.testing.assert_close(out if isinstance(out, torch.Tensor) else out[0], _step(x, w))


def test_a_single_compile_thread_submits_nothing_early():
    from torch._inductor import config
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    define_kernel = PythonWrapperCodegen.define_kernel
    with config.patch(compile_threads=1), overlapped_compile() as early:
        assert PythonWrapperCodegen.define_kernel is define_kernel
    assert early.submitted == 0


def test_the_step_settings_apply_inside_and_are_restored():
    from torch._inductor import config
    from cann_passes.lowering.inductor_config import SETTINGS, step_settings
    before = {k: getattr(config, k) for k in SETTINGS}
    with step_settings():
        assert {k: getattr(config, k) for k in SETTINGS} == SETTINGS
    assert {k: getattr(config, k) for k in SETTINGS} == before
