"""A failing pass leaves a reproducer that is the graph it was given and its one-pass pipeline text,
nothing else; replaying that directory alone fails the same way on the same graph."""
from __future__ import annotations

import os

import pytest
import torch

from cann_passes.pass_manager import Instrument, PassContext, PassFailure, PassManager
from graph_ir import capture_train_step
from graph_ir.mesh import MeshDesc
from graph_ir.meta import GraphAttr
from graph_ir.program import Program
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
from tests.conftest import mlp_batches, tiny_mlp
from tools.graph_dump.cli import replay


class _Given(Instrument):
    """The fingerprint of the graph each pass was given, before it ran."""

    def __init__(self):
        self.fingerprints = {}

    def before_pass(self, run):
        graph = run.given.main if isinstance(run.given, Program) else run.given
        self.fingerprints[run.spec.name] = graph.fingerprint()


def _gpt_step(layers: int = 2):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=layers))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return capture_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), gpt_loss,
                              (idx, torch.roll(idx, -1, dims=1)))[0]


def _mlp_step():
    model, loss_fn = tiny_mlp()
    return capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, mlp_batches(1)[0])[0]


def _fail(captured, text: str, mesh: MeshDesc, directory) -> tuple[PassFailure, str]:
    graph = captured.copy()
    graph.attrs[GraphAttr.MESH] = mesh.to_json()
    given = _Given()
    manager = PassManager(text, reproducer_dir=str(directory))
    manager.instruments.append(given)
    with pytest.raises(PassFailure) as info:
        manager.run_program(Program.of_step(graph, mesh), PassContext(mesh=mesh))
    return info.value, given.fingerprints[info.value.pass_name]


CASES = {
    "autocast": (_gpt_step, 'cleanup,autocast{dtype=bf16,overrides="no_such_module=fp32"}', MeshDesc.single(),
                 "no_such_module"),
    "recompute": (_mlp_step, "cleanup,recompute{policy=selective}", MeshDesc.single(), "no attention core"),
    "tensor_parallel": (_gpt_step, 'cleanup,tensor_parallel{extra_rules="*.no_such=column"}', MeshDesc.fake(tp=2),
                        r"matches no parameter"),
    "pipeline_split": (lambda: _gpt_step(layers=1), "cleanup,grad_accumulation{microbatches=8},"
                       "pipeline_split{stages=8,pp=8}", MeshDesc.fake(pp=8), "cuttable unit"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_replaying_a_reproducer_directory_alone_fails_the_same_way_on_the_same_graph(name, tmp_path):
    make, text, mesh, message = CASES[name]
    failure, fingerprint = _fail(make(), text, mesh, tmp_path)
    assert failure.pass_name == name and message in str(failure.__cause__)
    directory = failure.reproducer_dir
    # the graph and the pipeline text are the whole reproducer
    assert {f for f in os.listdir(directory) if not f.endswith(".constants.pt")} == \
        {"input.json", "input.py", "pipeline.txt", "pass.json"}
    with pytest.raises(PassFailure) as again:
        replay(directory, verify="shallow")
    assert again.value.pass_name == name
    assert str(again.value.__cause__) == str(failure.__cause__)
    # what the replay ran the pass on is the graph the pass was given in the pipeline
    from graph_ir.serialize import from_json
    import json
    with open(os.path.join(directory, "input.json"), encoding="utf-8") as f:
        loaded = from_json(json.load(f))
    assert loaded.fingerprint() == fingerprint


_USER_PASS = """
from cann_passes.pass_manager import register_pass


@register_pass("explode_here")
def explode(graph, ctx, *, why: str = "boom"):
    raise RuntimeError(f"explode_here: {why}")


if __name__ == "__main__":
    raise SystemExit("the script's own main must not run on replay")
"""


def test_replay_registers_a_users_pass_from_the_file_it_was_defined_in(tmp_path):
    import importlib.util

    from cann_passes.pass_manager import _REGISTRY
    source = tmp_path / "my_passes_script.py"
    source.write_text(_USER_PASS)
    spec = importlib.util.spec_from_file_location("user_script", source)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    _REGISTRY["explode_here"].fn.__module__ = "__main__"      # as if defined in a script the user ran
    try:
        failure, _ = _fail(_mlp_step(), "cleanup,explode_here{why=late}", MeshDesc.single(), tmp_path / "r")
        del _REGISTRY["explode_here"]      # a fresh process: the pass is not registered
        with pytest.raises(PassFailure) as again:
            replay(failure.reproducer_dir, verify="shallow")
        assert again.value.pass_name == "explode_here" and str(again.value.__cause__) == "explode_here: late"
    finally:
        _REGISTRY.pop("explode_here", None)
