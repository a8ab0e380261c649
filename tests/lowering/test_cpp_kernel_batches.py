"""Inductor's C++ kernels compiled in batches: one translation unit per compile worker, bitwise the
same step as kernel-by-kernel compiles, and a batch that does not compile falls back to them."""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from cann_passes.lowering import cpp_kernel_batches
from cann_passes.lowering.cpp_kernel_batches import batchable, batched, deal, translation_unit

PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>\n"


def _kernel(body: str, helper: str = "") -> str:
    return PREFIX + helper + 'extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)\n{\n' \
        + body + "\n}\n"


def test_dealing_balances_source_sizes_over_the_workers_largest_first():
    assert deal([10, 40, 30, 20], 2) == [[0, 1], [2, 3]]      # 10+40 and 30+20
    assert deal([5], 4) == [[0]]
    assert deal([3, 3, 3], 1) == [[0, 1, 2]]


def test_only_sources_with_one_c_kernel_and_no_other_directives_are_batched():
    assert batchable(_kernel("out_ptr0[0] = in_ptr0[0];"))
    assert not batchable(PREFIX + "#define N 4\n" + _kernel("out_ptr0[0] = N;"))
    assert not batchable(_kernel("") + _kernel(""))
    assert not batchable(PREFIX + 'extern "C" void other(float* out_ptr0) {}\n')


def test_a_translation_unit_hoists_includes_and_gives_each_kernel_a_namespace_and_an_entry():
    unit = translation_unit([(["const float*", "float*", "const int64_t"], _kernel("out_ptr0[0] = 1;")),
                             (["const float*", "float*", "const int64_t"], _kernel("out_ptr0[0] = 2;"))])
    assert unit.count(PREFIX.strip()) == 1 and unit.index(PREFIX.strip()) == 0
    indented = translation_unit([(["float*"], "  " + _kernel("out_ptr0[0] = 1;"))])
    assert indented.index(PREFIX.strip()) == 0 and indented.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    assert 'extern "C"  void  kernel' not in unit
    assert "namespace cann_kernel_0" in unit and "namespace cann_kernel_1" in unit
    assert 'kernel(parse_arg<float*>(args, 0), parse_arg<float*>(args, 1), parse_arg<int64_t>(args, 2));' in unit
    assert '{"k1", cann_kernel_1::entry, METH_VARARGS, ""}' in unit


def _compile_and_run(sources, units_seen):
    """Define ``sources`` on one AsyncCompile as a generated module does, wait, and call each."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    if get_compile_threads() <= 1:
        pytest.skip("inductor compiles synchronously with one compile thread: nothing is batched")
    original = CppPythonBindingsCodeCache.load_async.__func__

    def counting(cls, main_code, *args, **kwargs):
        units_seen.append(main_code.count("::entry, METH_VARARGS"))
        return original(cls, main_code, *args, **kwargs)
    with batched(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(CppPythonBindingsCodeCache, "load_async", classmethod(counting))
        compile_ = AsyncCompile()
        scope = {f"k{i}": compile_.cpp_pybinding(["const float*", "float*", "const int64_t"], s)
                 for i, s in enumerate(sources)}
        compile_.wait(scope)
    outs = []
    for name in sorted(scope):
        x, out = torch.tensor([3.0]), torch.zeros(1)
        scope[name](x, out, 5)
        outs.append(out.item())
    return outs


@pytest.mark.slow
def test_kernels_of_one_module_compile_as_one_unit_per_worker_and_compute_what_they_say():
    units: list[int] = []
    # unique constants: a fresh source, so the code cache has nothing compiled for it yet
    salt = torch.randint(0, 10**6, ()).item()
    sources = [_kernel(f"out_ptr0[0] = in_ptr0[0] * {i} + ks0 + {salt} * 0;") for i in range(4)]
    assert _compile_and_run(sources, units) == [3.0 * i + 5 for i in range(4)]
    from torch._inductor.async_compile import get_compile_threads
    assert sum(units) == 4 and len(units) == min(4, get_compile_threads())


@pytest.mark.slow
def test_a_batch_that_does_not_compile_as_one_unit_compiles_kernel_by_kernel(caplog):
    # Each kernel defines the same C function: fine in a library of its own, a redefinition in one unit.
    helper = 'extern "C" int cann_test_helper_{salt}() {{ return {value}; }}\n'
    salt = torch.randint(0, 10**6, ()).item()
    sources = [_kernel("out_ptr0[0] = in_ptr0[0] + cann_test_helper_%d();" % salt,
                       helper.format(salt=salt, value=v)) for v in (10, 20)]
    units: list[int] = []
    with caplog.at_level(logging.WARNING, logger=cpp_kernel_batches.__name__), \
            _one_unit():
        outs = _compile_and_run(sources, units)
    assert outs == [13.0, 23.0]
    assert units[0] == 2 and "compiling them one by one" in caplog.text


@contextlib.contextmanager
def _one_unit():
    """Both kernels dealt into one unit whatever the number of compile workers."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpp_kernel_batches, "deal", lambda sizes, units: [list(range(len(sizes)))])
        yield


@pytest.mark.slow
def test_inductor_step_of_transformers_llama_is_bitwise_the_same_with_and_without_batches(monkeypatch):
    # One intra-op thread: with two, inductor's embedding backward adds rows atomically in an order
    # the threads decide, so two runs of the same kernels differ in the last bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _bitwise_with_and_without_batches(monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _bitwise_with_and_without_batches(monkeypatch):
    from cann_passes import Plan
    from tests.zoo import compare
    compiled_units: list[int] = []
    original = cpp_kernel_batches._Batch._compile

    def counting(self, kernels):
        compiled_units.append(len(kernels))
        return original(self, kernels)
    monkeypatch.setattr(cpp_kernel_batches._Batch, "_compile", counting)
    plan = Plan(backend="inductor", compile_cache="off")
    with_batches = compare("llama", plan, steps=2, layers=1)
    assert compiled_units and sum(compiled_units) > 4      # the step's kernels went through batches
    monkeypatch.setattr(cpp_kernel_batches, "batched", contextlib.nullcontext)
    compiled_units.clear()
    without = compare("llama", plan, steps=2, layers=1)
    assert not compiled_units
    assert with_batches.compiled_losses == without.compiled_losses
    for name, value in with_batches.compiled_params.items():
        assert torch.equal(value, without.compiled_params[name]), name
    assert with_batches.max_param_diff() < 1e-5
