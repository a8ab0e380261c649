"""JSON round trip and runnable/readable printing of a training graph."""
from __future__ import annotations

import json
import subprocess
import sys

import torch

from graph_ir import capture_train_step, gather_inputs
from graph_ir.printer import format_graph, to_python_module
from graph_ir.serialize import from_json, to_json
from graph_ir.verifier import verify
from tests.conftest import gpt_batches, make_optimizer, tiny_gpt


def _gpt_graph():
    model, loss_fn = tiny_gpt()
    opt = make_optimizer("adamw", model.parameters())
    batch = gpt_batches(1)[0]
    tg, layout = capture_train_step(model, opt, loss_fn, batch)
    return tg, gather_inputs(model, opt, layout, batch)


def test_json_round_trip_rebuilds_a_graph_that_computes_the_same_step():
    tg, inputs = _gpt_graph()
    data = json.loads(json.dumps(to_json(tg)))
    assert len(data["nodes"]) == tg.num_nodes()
    loaded = from_json(data)
    verify(loaded, deep=True)
    assert loaded.signature == tg.signature
    for a, b in zip(loaded.gm(*inputs), tg.gm(*inputs)):
        assert torch.equal(a, b)


def test_readable_print_shows_shape_region_and_module_on_each_line():
    tg, _ = _gpt_graph()
    text = format_graph(tg)
    line = next(l for l in text.splitlines() if "aten.addmm" in l and "layers.0.attn.qkv" in l)
    assert "# f32[64, 96] fwd layers.0.attn.qkv" in line
    assert "wte.weight:exp_avg" in text


def test_python_dump_runs_standalone_and_prints_the_loss(tmp_path):
    tg, inputs = _gpt_graph()
    (tmp_path / "step.py").write_text(to_python_module(tg))
    torch.save({f"{s.kind}:{s.name}": t for s, t in zip(tg.signature.inputs, inputs)},
               tmp_path / "inputs.pt")
    out = subprocess.run([sys.executable, str(tmp_path / "step.py")], capture_output=True, text=True,
                         check=True).stdout
    assert float(out.split()[-1]) == tg.gm(*inputs)[0].item()
