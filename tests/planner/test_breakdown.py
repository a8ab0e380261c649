"""The per-rank breakdown picture, the dump page's planner section, and pipelined plans in cann-plan."""
from __future__ import annotations

import json
import os

import pytest
import torch

from cann_passes import Plan
from cann_passes.planning import compile_planned
from cann_passes.reports.breakdown import plot_breakdown
from cann_passes.simulate import program_figures, simulate
from cann_passes.cost_model import get_profile
from graph_ir import capture_train_step
from graph_ir.mesh import MeshDesc
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
from tools import plan_cli
from tools.graph_dump.dumpdir import DumpDir
from tools.graph_dump.html import render

SPEC = plan_cli.MODELS["llama-tiny"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (2, 16))
    return capture_train_step(model, opt, gpt_loss, (idx, torch.roll(idx, -1, 1)))[0]


def _png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_breakdown_png_for_a_flat_and_a_pipelined_plan(tiny, tmp_path):
    flat = simulate(tiny, Plan(dp=2, zero_stage=1, verify="off"), profile="a100", tokens_per_microbatch=32)
    piped = simulate(tiny, Plan(dp=1, microbatches=4, verify="off"), profile="a100", tokens_per_microbatch=32, pp=2)
    for sim, name in ((flat, "flat.png"), (piped, "piped.png")):
        path = plot_breakdown(sim, str(tmp_path / name))
        assert _png(path) and os.path.getsize(path) > 5000
    # tied embeddings: the stage programs where pipeline_split compiles them, else the pp = 1 blocks
    assert piped.pipeline_path.startswith(("stage programs:", "analytic:")) and piped.pp == 2


def test_dump_writes_the_simulation_and_the_page_shows_its_largest_term(tiny, tmp_path):
    plan = Plan(dp=2, zero_stage=1, verify="off", device_profile="a100")
    program = compile_planned(tiny, plan, MeshDesc.fake(dp=2), dump_dir=str(tmp_path))
    with open(tmp_path / "simulation.json") as f:
        sim = json.load(f)
    want = program_figures(program, plan, get_profile("a100"))
    assert sim["memory"] == want["memory"] and sim["step_s"] == pytest.approx(want["step"])
    page = render(DumpDir(str(tmp_path)), {})
    largest = max(sim["memory"], key=sim["memory"].get)
    assert 'id="planner-section"' in page and f"{largest} (largest)" in page and "a100" in page


def test_cann_plan_searches_pipelined_plans_and_writes_the_picture(tmp_path):
    caps = plan_cli.Captures(SPEC, SPEC.seq)
    args = plan_cli.parse(["llama-tiny", "--devices", "4", "--global-batch", "8", "--no-progress", "--no-baseline",
                           "--zero", "0", "--recompute", "none", "--microbatches", "2", "--pp", "1,2",
                           "--breakdown", str(tmp_path / "b.png"), "--out", str(tmp_path / "best.yaml")])
    spec = plan_cli.check(args)
    lines = []
    assert plan_cli.run(args, spec, out=lines.append, captures=caps) == 0
    text = "\n".join(lines)
    assert "dp=2 tp=1 pp=2 zero=0" in text and "dp=4 tp=1 zero=0" in text
    assert _png(tmp_path / "b.png")
