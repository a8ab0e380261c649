"""plan.background_lowering: the first steps run on the eager lowering of the program while the
backend's lowering compiles in a child process; once it has exited, the parent lowers from the caches
it filled and its runners take over between two steps. Steps before and after the switch match eager
PyTorch; a lowering that fails is a warning and the step stays eager.

The child is held by an event here (a stand-in process object), and the parent's lowering is eager's,
so which steps ran before the switch is decided by the test, not by timing; the child's own work runs
in-process once, and one test runs real inductor in a real child."""
from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from cann_passes import Plan, PlanError, compile_for_npu
from cann_passes.lowering.eager import EagerLowering
from cann_passes.lowering.inductor import InductorLowering
from cann_passes import background_lowering
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


class HeldChild:
    """Stands in for the lowering process: running until ``release`` is set, then exited with
    ``returncode`` (and, failing, the error line a child writes)."""

    def __init__(self, directory: str, release: threading.Event, returncode: int = 0, error: str = ""):
        self.directory, self.release, self.code, self.error = directory, release, returncode, error
        self.returncode = None

    def poll(self):
        if self.release.is_set() and self.returncode is None:
            if self.error:
                with open(os.path.join(self.directory, background_lowering.ERROR), "w") as f:
                    f.write(self.error)
            self.returncode = self.code
        return self.returncode

    def wait(self):
        assert self.release.wait(60), "the test never released the background lowering"
        return self.poll()


def _eager_for_inductor(monkeypatch, lowered: list):
    def compile(self, graph, example_inputs, plan):
        lowered.append(list(example_inputs))
        return EagerLowering().compile(graph, example_inputs, plan)
    monkeypatch.setattr(InductorLowering, "compile", compile)


@pytest.fixture
def held_inductor(monkeypatch):
    """The child held until the test sets the event; the parent's lowering eager's."""
    release, lowered = threading.Event(), []
    monkeypatch.setattr(background_lowering, "start_child", lambda directory: HeldChild(directory, release))
    _eager_for_inductor(monkeypatch, lowered)
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
    assert not os.path.exists(background._dir)          # the child's request goes once it has exited
    got += [float(step(b)) for b in BATCHES[3:]]
    assert background.switched_at == 3 and step.last.runners["step"] is not eager_runner
    assert background.runners["step"] is step.last.runners["step"]
    assert background.warmed_up     # inductor's compiler imported while the child ran, not by the take-over
    # lowered from tensors of the inputs' layout, never the parameters the steps update
    live = {p.data_ptr() for p in model.parameters()} | {t.data_ptr() for s in step.optimizer.state.values()
                                                         for t in s.values() if isinstance(t, torch.Tensor)}
    examples = [t for inputs in lowered for t in inputs if isinstance(t, torch.Tensor) and t.numel()]
    assert examples and not {t.data_ptr() for t in examples} & live
    assert "steps 1-3 ran on the eager lowering" in step.summary()
    assert got == pytest.approx(want, rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_warm_up_that_fails_leaves_the_import_to_the_take_over(held_inductor, monkeypatch):
    release, lowered = held_inductor

    def fails():
        raise ImportError("no inductor here")
    monkeypatch.setattr(InductorLowering, "warm_up", staticmethod(fails))
    step, _ = _in_the_background(mlp_step())
    for b in BATCHES[:2]:
        step(b)
    background = step.last.background
    release.set()
    background.wait()
    step(BATCHES[2])
    assert background.switched_at == 2 and background.error is None and not background.warmed_up


@pytest.mark.parametrize("where", ["child", "parent"])
def test_a_failed_background_lowering_warns_and_the_step_stays_on_eager(monkeypatch, where):
    release = threading.Event()
    release.set()
    if where == "child":
        monkeypatch.setattr(background_lowering, "start_child", lambda directory: HeldChild(
            directory, release, returncode=1, error="RuntimeError: the C++ compiler is missing"))
    else:       # the child exits 0, the parent's lowering from the caches fails
        def fail(self, graph, example_inputs, plan):
            raise RuntimeError("the C++ compiler is missing")
        monkeypatch.setattr(background_lowering, "start_child", lambda directory: HeldChild(directory, release))
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
    # a failed child's error (and log) stay for the user, its request does not; a child that
    # succeeded leaves nothing
    directory = step.last.background._dir
    if where == "child":
        assert os.listdir(directory) == [background_lowering.ERROR]
        shutil.rmtree(directory)
    else:
        assert not os.path.exists(directory)


def test_a_recompile_does_not_wait_for_the_lowering_in_the_background(held_inductor, monkeypatch):
    # the child has its own interpreter, so a capture beside it cannot take its trace's state
    # (transformers' image classifiers set config.problem_type in their first forward, so their
    # second step recompiles while the first lowering is in flight)
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
    first = step.last.background
    step(mlp_batch(9, rows=4))             # another batch shape: a second capture
    assert captures == [0, 0] and not first.done()     # the second began with the first still lowering
    release.set()
    step.wait_for_lowering()
    step(mlp_batch(9, rows=4))
    step(BATCHES[1])
    assert first.switched_at is not None and step.last.background.switched_at is not None


def test_the_child_lowers_every_graph_of_the_request_from_the_inputs_layouts(tmp_path, monkeypatch):
    # the child's own work, run here: the program's graphs and the inputs' layouts read back from
    # the request, each graph lowered once, from fresh tensors of the same layout
    lowered = []
    _eager_for_inductor(monkeypatch, lowered)
    tiny = mlp_step()
    model, opt = tiny.fresh()
    step = compile_for_npu(model, Plan(backend="eager"), optimizer=opt, loss_fn=tiny.loss_fn)
    step.compile(BATCHES[0])
    graphs = step.last.program.graphs
    examples = {name: step._inputs(graph, BATCHES[0]) for name, graph in graphs.items()}
    background_lowering.write_request(str(tmp_path), "inductor", graphs, background_lowering.layouts(examples),
                                      step.plan)
    background_lowering.lower_request(str(tmp_path))
    assert len(lowered) == len(graphs) == 1
    want = [(tuple(t.shape), t.stride(), t.dtype) for t in examples["step"] if isinstance(t, torch.Tensor)]
    got = [(tuple(t.shape), t.stride(), t.dtype) for t in lowered[0] if isinstance(t, torch.Tensor)]
    live = {t.data_ptr() for t in examples["step"] if isinstance(t, torch.Tensor)}
    assert got == want and not {t.data_ptr() for t in lowered[0] if isinstance(t, torch.Tensor) and t.numel()} & live


def test_with_inductors_caches_off_the_step_is_lowered_before_it_first_runs(monkeypatch):
    # the take-over would compile all over again on the training thread: refused with a warning
    from torch._inductor import config as inductor_config
    lowered = []
    _eager_for_inductor(monkeypatch, lowered)
    monkeypatch.setattr(background_lowering, "start_child", lambda directory: pytest.fail("a child was started"))
    step, model = _in_the_background(mlp_step())
    with inductor_config.patch(fx_graph_cache=False), pytest.warns(RuntimeWarning, match=r"background_lowering needs inductor's on-disk caches.*FX graph cache "
                                            r"\(torch._inductor.config.fx_graph_cache\) is off, so the step is lowered "
                                            "before it first runs"):
        step(BATCHES[0])
    assert step.last.background is None and len(lowered) == 1


def test_a_child_that_cannot_start_is_a_warning_and_the_step_is_lowered_before_it_first_runs(monkeypatch):
    lowered = []
    _eager_for_inductor(monkeypatch, lowered)

    def cannot(directory):
        raise OSError("Resource temporarily unavailable")
    monkeypatch.setattr(background_lowering, "start_child", cannot)
    tiny = mlp_step()
    want, _ = _eager_losses(tiny)
    step, model = _in_the_background(tiny)
    with pytest.warns(RuntimeWarning, match=r"background lowering could not start \(OSError: Resource "
                                            r"temporarily unavailable\); the step is lowered before it first runs"):
        got = [float(step(BATCHES[0]))]
    got += [float(step(b)) for b in BATCHES[1:]]
    assert step.last.background is None and len(lowered) == 1
    assert got == pytest.approx(want, rel=1e-6)


def test_the_field_is_a_boolean():
    with pytest.raises(PlanError, match="background_lowering.*must be true or false"):
        Plan(background_lowering="yes")
    assert Plan(background_lowering=True, pp=2, microbatches=2).background_lowering   # (tests/pipeline)


@pytest.mark.slow
def test_real_inductor_takes_over_and_matches_eager():
    pytest.importorskip("torch._inductor")
    tiny = mlp_step(sgd)
    want, ref = _eager_losses(tiny)
    step, model = _in_the_background(tiny)
    got = [float(step(BATCHES[0]))]
    # nothing of the lowering runs in this process: torch.compile works while the child compiles
    doubled = torch.compile(lambda x: x * 2, backend="eager")
    assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))
    assert "compiling in the background (a child process)" in step.summary()
    step.wait_for_lowering()
    got += [float(step(b)) for b in BATCHES[1:]]
    assert step.last.background.error is None and step.last.background.switched_at == 1
    assert step.last.runners["step"] is step.last.background.runners["step"]
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
    # An orphaned child would go on using a core after the run; its kernels are for the next run.
    # The stand-in child sleeps, then marks that it finished: the parent exits 0 only after it.
    import subprocess
    import sys

    from tests.gloo_scenarios import REPO, RANK_ENV
    done = tmp_path / "lowered"
    script = f"""
import subprocess, sys
from cann_passes import Plan, compile_for_npu
from cann_passes import background_lowering
from tests.passes._tiny import mlp_batch, mlp_step

background_lowering.start_child = lambda directory: subprocess.Popen(
    [sys.executable, "-c", "import time, pathlib; time.sleep(1.0); pathlib.Path({str(done)!r}).write_text('done')"])
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
