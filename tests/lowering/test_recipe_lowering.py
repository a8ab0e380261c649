"""The GPT recipe's final graphs, per plan, lower to GE with zero unsupported ops after npu_legalize."""
from __future__ import annotations

import json

import pytest
import torch

from cann_passes import Plan
from cann_passes.lowering.ge_offline import write_ge_report
from cann_passes.pass_manager import PassContext, PassManager, is_registered
from graph_ir import capture_train_step
from recipes.data.text import TextBatches, load_corpus
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
from tools.lower_check import compile_recipe, main

GPT_TINY = "recipes.models.gpt:gpt_tiny"


pytestmark = pytest.mark.usefixtures("torchair")  # skips the module where torchair cannot be had


def _matmuls(h: dict) -> int:
    return sum(h.get(op, 0) for op in ("MatMul", "MatMulV2", "BatchMatMul", "BatchMatMulV2"))


def _assert_transformer_ops(h: dict, n_layer: int) -> None:
    assert _matmuls(h) >= 6 * n_layer  # qkv, proj, fc1, fc2 forward + their weight/input grads
    assert h.get("SoftmaxV2", 0) + h.get("FlashAttentionScore", 0) >= n_layer
    assert h["LayerNormV4"] == 2 * n_layer + 1 and h["LayerNormGradV3"] == 2 * n_layer + 1
    assert h["LogSoftmaxV2"] == 1 and h["NLLLoss"] == 1 and h["NLLLossGrad"] == 1
    assert h["GatherV2"] >= 2 and h["EmbeddingDenseGrad"] == 2  # wte, wpe
    assert h["NetOutput"] == 1


def _report(dump_dir) -> dict:
    return json.loads(open(write_ge_report(dump_dir)).read())


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_fp32_plan_lowers_completely(tmp_path, attention):
    step = compile_recipe(GPT_TINY, Plan(), tmp_path, attention=attention)
    assert "npu_legalize" in str(step.last.pipeline)
    data = _report(tmp_path)
    assert data["unsupported"] == [], data["unsupported"]
    entry = data["graphs"]["step"]
    assert entry["ok"] and entry["source"].endswith("_cleanup.json")
    _assert_transformer_ops(entry["op_histogram"], n_layer=2)
    text = (tmp_path / "ge" / "step.ge.txt").read_text()
    assert text.startswith('name: "step"') and 'type: "LayerNormV4"' in text


@pytest.mark.skipif(not is_registered("autocast"), reason="bf16 needs the 'autocast' pass, not registered")
def test_bf16_plan_lowers_completely(tmp_path):
    compile_recipe(GPT_TINY, Plan(precision="bf16"), tmp_path, attention="sdpa")
    data = _report(tmp_path)
    assert data["unsupported"] == [], data["unsupported"]
    h = data["graphs"]["step"]["op_histogram"]
    _assert_transformer_ops(h, n_layer=2)
    assert h["Cast"] > 0
    assert 'dtype: DT_BF16' in (tmp_path / "ge" / "step.ge.txt").read_text()


class _OneRankMesh:
    """ctx.mesh for a single process: every dimension is the 1-rank default group."""

    def __init__(self, group):
        self._name = group.group_name

    def group_name(self, dim):
        return self._name

    def size(self, dim):
        return 1

    def local_rank(self, dim):
        return 0


@pytest.mark.skipif(not is_registered("data_parallel"), reason="DP needs the 'data_parallel' pass, not registered")
def test_data_parallel_graph_lowers_with_hcom_all_reduce(tmp_path, gloo_group):
    from cann_passes.dump import DumpWriter

    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = next(iter(TextBatches(load_corpus(), 2, 16)))
    captured, _ = capture_train_step(model, opt, gpt_loss, batch)
    pipeline = "cleanup,data_parallel{bucket_mb=0.05},npu_legalize,cleanup"
    ctx = PassContext()
    ctx.mesh = _OneRankMesh(gloo_group)
    manager = PassManager(pipeline, verify_level="shallow", dump=DumpWriter(str(tmp_path), pipeline))
    manager.run(captured, ctx)
    buckets = next(r.stats["buckets"] for r in manager.records if r.name == "data_parallel")
    data = _report(tmp_path)
    assert data["unsupported"] == [], data["unsupported"]
    h = data["graphs"]["step"]["op_histogram"]
    _assert_transformer_ops(h, n_layer=2)
    assert buckets >= 2 and h["HcomAllReduce"] == buckets + 1  # gradient buckets + the loss average


def test_cli_run_and_dump_dir(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("precision: fp32\nverify: shallow\n")
    out = tmp_path / "dump"
    assert main(["run", GPT_TINY, "--plan", str(plan), "--out", str(out), "--attention", "sdpa",
                 "--batch-size", "2", "--seq-len", "16"]) == 0
    printed = capsys.readouterr().out
    assert "GE graph step" in printed and "SoftmaxV2" in printed
    assert (out / "ge" / "report.json").is_file() and (out / "pipeline.txt").read_text().count("npu_legalize") == 1
    (out / "ge" / "report.json").unlink()
    assert main([str(out)]) == 0  # the dump directory alone: reloads the last NNN_*.json
    assert json.loads((out / "ge" / "report.json").read_text())["ok"] is True


def test_unlegalized_dump_reports_op_and_module_path(tmp_path, capsys):
    compile_recipe(GPT_TINY, Plan(pipeline="cleanup"), tmp_path, attention="sdpa")
    assert main([str(tmp_path)]) == 1
    data = json.loads((tmp_path / "ge" / "report.json").read_text())
    found = {(u["target"], u["module_path"]) for u in data["unsupported"]}
    assert ("aten._scaled_dot_product_flash_attention_for_cpu.default", "layers.0.attn") in found
    assert "unsupported: _scaled_dot_product_flash_attention_for_cpu" in capsys.readouterr().out
