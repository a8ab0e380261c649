"""plan.background_lowering: the first steps run on the eager lowering of the program while the
backend's lowering compiles in a thread; its runners take over between two steps. Steps before and
after the switch match eager PyTorch; a lowering that fails is a warning and the step stays eager.

The backend's compile is held by an event here (a stand-in that lowers through eager once
released), so which steps ran before the switch is decided by the test, not by timing; one test
runs real inductor."""
from __future__ import annotations

import threading

import pytest
import torch

from cann_passes import Plan, PlanError, compile_for_npu
from cann_passes.lowering.eager import EagerLowering
from cann_passes.lowering.inductor import InductorLowering
from tests.eager_reference import eager_steps
from tests.passes._tiny import mlp_batch, mlp_step, sgd

BATCHES = [mlp_batch(seed) for seed in range(1, 8)]


def _eager_losses(step):
    model, opt = step.fresh()
    return eager_steps(model, opt, step.loss_fn, BATCHES).losses, model


def _in_the_background(tiny):
    """The tiny step compiled for inductor with background lowering, and its model."""
    model, opt = tiny.fresh()
    return compile_for_npu(model, Plan(backend="inductor", background_lowering=True), optimizer=opt,
                           loss_fn=tiny.loss_fn), model


@pytest.fixture
def held_inductor(monkeypatch):
    """Inductor's lowering replaced by eager's, run only once the test sets the event."""
    release, lowered = threading.Event(), []

    def compile(self, graph, example_inputs, plan):
        assert release.wait(60), "the test never released the background lowering"
        lowered.append(list(example_inputs))
        return EagerLowering().compile(graph, example_inputs, plan)
    monkeypatch.setattr(InductorLowering, "compile", compile)
    return release, lowered


def test_steps_run_on_eager_until_the_backend_is_lowered_then_on_its_runners(held_inductor):
    release, lowered = held_inductor
    tiny = mlp_step()
    want, ref = _eager_losses(tiny)
    step, model = _in_the_background(tiny)
    got = [float(step(b)) for b in BATCHES[:3]]
    background = step.last.background
    assert background.switched_at is None and lowered == []       # still held: three steps ran on eager
    assert "compiling in the background" in step.summary()
    eager_runner = step.last.runners["step"]
    release.set()
    background.wait()
    got += [float(step(b)) for b in BATCHES[3:]]
    assert background.switched_at == 3 and step.last.runners["step"] is not eager_runner
    assert background.runners["step"] is step.last.runners["step"]
    # the thread lowered from tensors of the inputs' layout, never the parameters the steps update
    live = {p.data_ptr() for p in model.parameters()} | {t.data_ptr() for s in step.optimizer.state.values()
                                                         for t in s.values() if isinstance(t, torch.Tensor)}
    examples = [t for inputs in lowered for t in inputs if isinstance(t, torch.Tensor) and t.numel()]
    assert examples and not {t.data_ptr() for t in examples} & live
    assert "steps 1-3 ran on the eager lowering" in step.summary()
    assert got == pytest.approx(want, rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_failed_background_lowering_warns_and_the_step_stays_on_eager(monkeypatch):
    def fail(self, graph, example_inputs, plan):
        raise RuntimeError("the C++ compiler is missing")
    monkeypatch.setattr(InductorLowering, "compile", fail)
    tiny = mlp_step()
    want, ref = _eager_losses(tiny)
    step, model = _in_the_background(tiny)
    # the failure is reported between two steps: before the first (it failed at once) or the second
    with pytest.warns(RuntimeWarning, match="the inductor lowering failed in the background "
                                            r"\(RuntimeError: the C\+\+ compiler is missing\); the step keeps"):
        got = [float(step(BATCHES[0]))]
        step.last.background.wait()
        got.append(float(step(BATCHES[1])))
    got += [float(step(b)) for b in BATCHES[2:]]
    assert got == pytest.approx(want, rel=1e-6)
    assert "background lowering failed (RuntimeError); every step ran on the eager lowering" in step.summary()


def test_a_recompile_waits_for_the_lowering_in_the_background(held_inductor, monkeypatch):
    # torch's tracing keeps its node-annotation state per process: a capture beside a lowering
    # in flight would take the other trace's region tags (transformers' image classifiers set
    # config.problem_type in their first forward, so their second step recompiles)
    import cann_passes.step as step_module
    release, lowered = held_inductor
    captures = []
    real = step_module.capture_train_step

    def capture(*args, **kwargs):
        captures.append(len(lowered))
        return real(*args, **kwargs)
    monkeypatch.setattr(step_module, "capture_train_step", capture)
    tiny = mlp_step()
    step, model = _in_the_background(tiny)
    step(BATCHES[0])
    threading.Timer(0.5, release.set).start()
    step(mlp_batch(9, rows=4))             # another batch shape: a second capture
    assert captures == [0, 1]               # the second began once the first lowering was done
    # the second lowering must end while the stand-in is still patched in: after the teardown the
    # thread would run real inductor, whose tracing state is process-wide (the next test's
    # torch.compile would refuse to run, "FX to symbolically trace a dynamo-optimized function")
    step.last.background.wait()


def test_torch_compile_elsewhere_refuses_while_the_lowering_traces_and_runs_after_wait_for_lowering(monkeypatch):
    # torch's FX tracing state is process-wide: the lowering thread's trace is seen by the step's
    # thread, whose torch.compile calls refuse until the lowering ends
    from torch.fx.experimental.proxy_tensor import make_fx
    inside, release = threading.Event(), threading.Event()

    def compile(self, graph, example_inputs, plan):
        def traced(x):
            inside.set()
            assert release.wait(60), "the test never released the background lowering"
            return x + 1
        make_fx(traced)(torch.ones(2))
        return EagerLowering().compile(graph, example_inputs, plan)
    monkeypatch.setattr(InductorLowering, "compile", compile)
    tiny = mlp_step()
    step, model = _in_the_background(tiny)
    step(BATCHES[0])
    assert inside.wait(60)
    doubled = torch.compile(lambda x: x * 2, backend="eager")
    with pytest.raises(RuntimeError, match="FX to symbolically trace a dynamo-optimized function"):
        doubled(torch.ones(2))
    release.set()
    step.wait_for_lowering()
    assert step.last.background.done() and step.last.background.error is None
    assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))


def test_the_field_is_a_boolean_and_applies_only_without_pipeline_stages():
    with pytest.raises(PlanError, match="background_lowering.*must be true or false"):
        Plan(background_lowering="yes")
    with pytest.raises(PlanError, match="background_lowering.*applies only at pp = 1"):
        Plan(background_lowering=True, pp=2, microbatches=2)


@pytest.mark.slow
def test_real_inductor_takes_over_and_matches_eager():
    pytest.importorskip("torch._inductor")
    tiny = mlp_step(sgd)
    want, ref = _eager_losses(tiny)
    step, model = _in_the_background(tiny)
    got = [float(step(BATCHES[0]))]
    step.last.background.wait()
    got += [float(step(b)) for b in BATCHES[1:]]
    assert step.last.background.error is None and step.last.background.switched_at in (0, 1)
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_a_foreground_lowering_that_fails_is_named_with_the_backend_that_runs_the_graph(monkeypatch):
    import torch._inductor.compile_fx as inductor

    from cann_passes.lowering import LoweringFailed

    def fail(*args, **kwargs):
        raise KeyError("s36")
    monkeypatch.setattr(inductor, "compile_fx", fail)
    tiny = mlp_step()
    model, opt = tiny.fresh()
    step = compile_for_npu(model, Plan(backend="inductor"), optimizer=opt, loss_fn=tiny.loss_fn)
    with pytest.raises(LoweringFailed, match=r"inductor could not compile graph 'step' \(KeyError: 's36'\).*"
                                             r"backend 'eager' runs it") as info:
        step(BATCHES[0])
    assert isinstance(info.value.__cause__, KeyError)


def test_a_process_whose_steps_end_first_waits_for_the_lowering_and_exits_cleanly(tmp_path):
    # A daemon thread would be stopped by the interpreter's shutdown; inside inductor's C++ that
    # aborts the process (SIGABRT) after the last step. The stand-in lowering sleeps, then marks
    # that it finished: the process exits 0 only after it.
    import os
    import subprocess
    import sys

    from tests.gloo_scenarios import REPO, RANK_ENV
    done = tmp_path / "lowered"
    script = f"""
import time
from pathlib import Path
from cann_passes import Plan, compile_for_npu
from cann_passes.lowering.eager import EagerLowering
from cann_passes.lowering.inductor import InductorLowering
from tests.passes._tiny import mlp_batch, mlp_step

def compile(self, graph, example_inputs, plan):
    time.sleep(1.0)
    runner = EagerLowering().compile(graph, example_inputs, plan)
    Path({str(done)!r}).write_text("done")
    return runner
InductorLowering.compile = compile
tiny = mlp_step()
model, opt = tiny.fresh()
step = compile_for_npu(model, Plan(backend="inductor", background_lowering=True), optimizer=opt, loss_fn=tiny.loss_fn)
step(mlp_batch(1))
print(step.summary())
"""
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, **RANK_ENV},
                          cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the process waits for it at exit" in proc.stdout
    assert done.read_text() == "done"
