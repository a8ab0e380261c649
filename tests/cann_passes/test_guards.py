"""Guards: every Python value the trace read and baked into the graph (a module attribute, a value
the loss or a forward takes from a global or a closure) is checked at every call; a change compiles
anew, says why, and the step equals eager PyTorch with the new value, in this process and through the
persistent compile cache in another."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from tests.eager_reference import eager_steps

REPO = Path(__file__).resolve().parents[2]
SMOOTHING = 0.0


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)
        self.extra = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.0)
        self.temperature = 1.0           # a float read in forward
        self.use_extra = False           # a flag that picks a code path
        self.offset = torch.zeros(3)     # a plain tensor attribute, not a buffer

    def forward(self, x):
        if self.use_extra:
            x = self.extra(x)
        return self.drop(self.fc(x)) / self.temperature + self.offset


def _global_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1], label_smoothing=SMOOTHING)


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


class _Twins:
    """A compiled step and its eager twin, stepped on the same batches."""

    def __init__(self, loss_fn):
        torch.manual_seed(0)
        self.model = _Model()
        self.reference = copy.deepcopy(self.model)
        self.loss_fn = loss_fn
        self.optimizer = torch.optim.SGD(self.reference.parameters(), lr=0.1)
        self.step = compile_for_npu(self.model, Plan(backend="eager", compile_cache="off"),
                                    optimizer=torch.optim.SGD(self.model.parameters(), lr=0.1), loss_fn=loss_fn)

    def both(self, batch):
        got = self.step(batch).item()
        want = eager_steps(self.reference, self.optimizer, self.loss_fn, [batch]).losses[0]
        assert got == want
        assert all(torch.equal(p, q) for p, q in zip(self.model.parameters(), self.reference.parameters()))

    def set(self, name, value):
        setattr(self.model, name, value)
        setattr(self.reference, name, copy.deepcopy(value))


@pytest.mark.parametrize("change, reason", [
    (lambda t: t.set("temperature", 2.0), "attribute temperature of the model changed (now 2.0)"),
    (lambda t: t.set("use_extra", True), "attribute use_extra of the model changed (now True)"),
    (lambda t: t.set("offset", torch.full((3,), 0.5)), "attribute offset of the model changed"),
    (lambda t: (t.model.offset.add_(0.5), t.reference.offset.add_(0.5)), "attribute offset of the model changed"),
    (lambda t: (setattr(t.model.drop, "p", 0.0 + 1e-30), setattr(t.reference.drop, "p", 1e-30)),
     "attribute drop.p of the model changed"),
], ids=["float", "branch-flag", "tensor-replaced", "tensor-in-place", "dropout-p"])
def test_a_module_attribute_the_trace_read_recompiles_with_its_reason_when_it_changes(change, reason):
    twins = _Twins(_global_loss)
    a, b, c = _batches(3)
    twins.both(a)
    change(twins)
    twins.both(b)
    twins.both(c)
    assert len(twins.step._compiled) == 2 and len(twins.step.recompile_reasons) == 1
    assert twins.step.recompile_reasons[0].startswith(reason)
    assert "recompiled: " + twins.step.recompile_reasons[0] in twins.step.summary()


def test_a_global_the_loss_reads_recompiles_when_it_changes():
    global SMOOTHING
    twins = _Twins(_global_loss)
    a, b = _batches(2)
    twins.both(a)
    try:
        SMOOTHING = 0.1
        twins.both(b)
    finally:
        SMOOTHING = 0.0
    assert twins.step.recompile_reasons == ["global 'SMOOTHING' of loss_fn changed (now 0.1)"]


def test_class_weights_from_a_closure_recompile_when_replaced_or_changed_in_place():
    weights = torch.ones(3)

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1], weight=weights)

    twins = _Twins(loss_fn)
    a, b, c = _batches(3)
    twins.both(a)
    weights.mul_(torch.tensor([1.0, 2.0, 0.5]))
    twins.both(b)
    weights = torch.tensor([0.3, 1.0, 3.0])     # the closure cell now holds another tensor
    twins.both(c)
    assert len(twins.step._compiled) == 3
    assert all("closure 'weights' of loss_fn changed" in r for r in twins.step.recompile_reasons)


def test_values_that_do_not_change_cost_no_recompile():
    twins = _Twins(_global_loss)
    for batch in _batches(3):
        twins.both(batch)
    assert len(twins.step._compiled) == 1 and twins.step.recompile_reasons == []
    assert len(twins.step.last.guards) >= 4


_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {repo!r})
import cann_passes.compile_cache as cc
cc._STARTED = float("inf")
from cann_passes import Plan, compile_for_npu
SMOOTHING = float(sys.argv[2])
WEIGHTS = torch.tensor([float(w) for w in sys.argv[3].split(",")])
def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1], weight=WEIGHTS,
                                             label_smoothing=SMOOTHING)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
model[1].approximate = sys.argv[4]
step = compile_for_npu(model, Plan(backend="eager", compile_cache=sys.argv[1]),
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn)
g = torch.Generator().manual_seed(3)
batch = (torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g))
loss = step(batch).item()
torch.manual_seed(0)
ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(sys.argv[4]), torch.nn.Linear(16, 3))
want = loss_fn(ref, batch).item()
print(json.dumps({{"hit": step.last.program.attrs.get("compile_cache") == "hit", "loss": loss, "want": want,
                  "cache": step.last.cache}}))
"""


def test_the_persistent_cache_serves_a_second_process_only_the_graph_of_its_own_values(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT.format(repo=str(REPO)))
    cache = str(tmp_path / "cache")

    def run(smoothing, weights, approximate):
        done = subprocess.run([sys.executable, str(script), cache, smoothing, weights, approximate],
                              capture_output=True, text=True, cwd=REPO, timeout=600,
                              env=dict(os.environ, CANN_PASSES_DUMP=""))
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run("0.0", "1,1,1", "none")
    assert not first["hit"] and first["cache"].startswith("stored")
    assert run("0.0", "1,1,1", "none")["hit"]
    for args in (("0.2", "1,1,1", "none"), ("0.0", "1,2,3", "none"), ("0.0", "1,1,1", "tanh")):
        other = run(*args)
        assert not other["hit"], args
        assert other["loss"] == pytest.approx(other["want"], abs=1e-6), args


def test_a_transformers_llama_follows_an_attention_scaling_changed_after_step_one_as_eager_does():
    from tests.zoo import build, causal_lm_batch
    entry = build("llama", layers=1)
    model, reference = entry.model, copy.deepcopy(entry.model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = compile_for_npu(model, Plan(backend="eager", compile_cache="off"),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=entry.loss_fn)
    batches = [causal_lm_batch(i) for i in range(2)]
    assert step(batches[0]).item() == eager_steps(reference, ref_optimizer, entry.loss_fn, batches[:1]).losses[0]
    for m in (model, reference):
        m.model.layers[0].self_attn.scaling *= 0.5
    assert step(batches[1]).item() == eager_steps(reference, ref_optimizer, entry.loss_fn, batches[1:]).losses[0]
    assert step.recompile_reasons[0].startswith("attribute model.layers.0.self_attn.scaling of the model changed")


HELPER_WEIGHT = 1.0
METHOD_SHIFT = 0.0


def _weighted(logits, targets):
    return HELPER_WEIGHT * torch.nn.functional.cross_entropy(logits, targets)


def _helper_loss(model, batch):
    return _weighted(model(batch[0]), batch[1])     # HELPER_WEIGHT is read only in the helper


class _Config:
    def __init__(self):
        self.scale = 1.0
        self.modes = ("plain",)


class _ConfiguredModel(_Model):
    def __init__(self):
        super().__init__()
        self.config = _Config()

    def _shift(self, x):
        return x + METHOD_SHIFT                        # a global read only in a method forward calls

    def forward(self, x):
        out = super().forward(x) * self.config.scale
        if "doubled" in self.config.modes:
            out = out * 2
        return self._shift(out)


def test_a_global_read_only_in_a_helper_the_loss_calls_recompiles_when_it_changes():
    global HELPER_WEIGHT
    twins = _Twins(_helper_loss)
    a, b = _batches(2)
    twins.both(a)
    try:
        HELPER_WEIGHT = 0.5
        twins.both(b)
    finally:
        HELPER_WEIGHT = 1.0
    assert twins.step.recompile_reasons == ["global '_weighted.HELPER_WEIGHT' of loss_fn changed (now 0.5)"]


@pytest.mark.parametrize("change, reason", [
    (lambda m: setattr(m.config, "scale", 0.5), "attribute config.scale of the model changed (now 0.5)"),
    (lambda m: setattr(m.config, "modes", ("plain", "doubled")), "attribute config.modes of the model changed"),
    (lambda m: globals().__setitem__("METHOD_SHIFT", 0.25), "global '_shift.METHOD_SHIFT' of forward of"),
], ids=["config-float-in-place", "config-tuple-in-place", "global-in-a-method"])
def test_an_object_attribute_or_a_methods_global_recompiles_when_edited_in_place(change, reason):
    torch.manual_seed(0)
    model = _ConfiguredModel()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = compile_for_npu(model, Plan(backend="eager", compile_cache="off"),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_global_loss)
    a, b = _batches(2)
    try:
        assert step(a).item() == eager_steps(reference, optimizer, _global_loss, [a]).losses[0]
        change(model)
        change(reference)
        assert step(b).item() == eager_steps(reference, optimizer, _global_loss, [b]).losses[0]
    finally:
        globals()["METHOD_SHIFT"] = 0.0
    assert len(step.recompile_reasons) == 1 and step.recompile_reasons[0].startswith(reason), step.recompile_reasons
    assert type(model.config) is _Config      # the recording class is gone after capture


def test_a_transformers_config_switched_to_another_attention_implementation_recompiles():
    from tests.zoo import build, causal_lm_batch
    entry = build("llama", layers=1)
    model, reference = entry.model, copy.deepcopy(entry.model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = compile_for_npu(model, Plan(backend="eager", compile_cache="off"),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=entry.loss_fn)
    batches = [causal_lm_batch(i) for i in range(2)]
    step(batches[0])
    eager_steps(reference, ref_optimizer, entry.loss_fn, batches[:1])
    implementation = model.config._attn_implementation
    other = "eager" if implementation != "eager" else "sdpa"
    for m in (model, reference):
        m.set_attn_implementation(other)
    got = step(batches[1]).item()
    want = eager_steps(reference, ref_optimizer, entry.loss_fn, batches[1:]).losses[0]
    assert got == pytest.approx(want, rel=1e-6)
    assert len(step.recompile_reasons) == 1 and "_attn_implementation" in step.recompile_reasons[0], \
        step.recompile_reasons
