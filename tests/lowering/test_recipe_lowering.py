"""The GPT recipe's final graphs, per plan, lower to GE with zero unsupported ops after npu_legalize."""
from __future__ import annotations

import json
from pathlib import Path

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
    assert entry["ok"] and entry["source"].endswith("_plan_buffers.json")
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
    ctx = PassContext(mesh=_OneRankMesh(gloo_group))
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
    assert main([str(tmp_path), "--as-dumped"]) == 1
    data = json.loads((tmp_path / "ge" / "report.json").read_text())
    found = {(u["target"], u["module_path"]) for u in data["unsupported"]}
    assert ("aten._scaled_dot_product_flash_attention_for_cpu.default", "layers.0.attn") in found
    assert "unsupported: _scaled_dot_product_flash_attention_for_cpu" in capsys.readouterr().out
    # By default the dump is lowered as the torchair backend compiles it: npu_legalize first.
    assert main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "ge" / "report.json").read_text())["legalized"]


# -- every recipe x every plan of its plans/ directory, in bf16 ---------------------------------

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FAMILIES = ("gpt", "llama", "bert", "clip", "align", "flamingo")


def _recipe_cases():
    """{recipe: (model builder, loss, one batch)}: the recipes' test-sized models. BERT keeps
    BERT-large's dropout 0.1, so selective recompute replays dropout from its bit-packed mask
    (integer shifts and ands, which npu_legalize rewrites for GE)."""
    from recipes.align import ALIGN, align_loss, align_tiny
    from recipes.bert import BertForMaskedLM, bert_tiny, mlm_loss
    from recipes.clip import CLIP, clip_loss, clip_tiny
    from recipes.data.images import image_text_batch
    from recipes.data.mlm import MaskedLMBatches
    from recipes.flamingo import Flamingo, flamingo_loss, flamingo_tiny
    from recipes.llama import LlamaForCausalLM, llama_loss, llama_tiny

    text = lambda: next(iter(TextBatches(load_corpus(), 4, 16)))
    images = lambda: image_text_batch("train", 0, 4)
    return {
        "gpt": (lambda: GPT(gpt_tiny()), gpt_loss, text),
        "llama": (lambda: LlamaForCausalLM(llama_tiny()), llama_loss, text),
        "bert": (lambda: BertForMaskedLM(bert_tiny(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
                 mlm_loss, lambda: next(iter(MaskedLMBatches(load_corpus(), 4, 16)))),
        "clip": (lambda: CLIP(clip_tiny()), clip_loss, images),
        "align": (lambda: ALIGN(align_tiny()), align_loss, images),
        "flamingo": (lambda: Flamingo(flamingo_tiny()), flamingo_loss, images),
    }


def _in_bf16(path: Path) -> Plan:
    return Plan.load(path).replace(precision="bf16", dump_dir=None, verify="shallow")


def _recipe_plans() -> list[tuple[str, list[Path]]]:
    """Per recipe, its plan files grouped by what they are in bf16 (fp32, fp16 and bf16 files
    are one bf16 plan); the plain-bf16 group is left to tests/recipes (each recipe's bf16 test)."""
    cases = []
    for recipe in FAMILIES:
        files = sorted((RECIPES / "plans").glob("gpt_*.yaml")) if recipe == "gpt" else \
            sorted((RECIPES / recipe / "plans").glob("*.yaml"))
        groups: dict[str, list[Path]] = {}
        for path in files:
            groups.setdefault(repr(_in_bf16(path)), []).append(path)
        cases += [(recipe, paths) for paths in groups.values() if _technique(_in_bf16(paths[0]))]
    return cases


def _technique(plan: Plan) -> bool:
    """Whether the plan does more than bf16 (recompute, data parallelism, microbatches)."""
    return plan.recompute != "none" or plan.dp > 1 or plan.microbatches > 1


RECIPE_PLANS = _recipe_plans()


@pytest.fixture(scope="module")
def recipe_captures():
    """One captured step per recipe, shared by its plans."""
    from tests.recipes._helpers import capture
    cases, captured = _recipe_cases(), {}

    def get(recipe):
        if recipe not in captured:
            build, loss_fn, batch = cases[recipe]
            torch.manual_seed(0)
            captured[recipe] = capture(build(), loss_fn, batch())
        return captured[recipe]
    return get


def test_every_recipe_has_its_technique_plans_here():
    covered = {(r, p.stem) for r, paths in RECIPE_PLANS for p in paths}
    for recipe in ("llama", "bert", "clip", "align", "flamingo"):
        stems = {s for r, s in covered if r == recipe}
        assert any("recompute" in s for s in stems) and any("zero" in s for s in stems), (recipe, stems)
        assert any("accum" in s for s in stems), (recipe, stems)
    assert ("gpt", "gpt_dp2_zero1") in covered


@pytest.mark.slow
@pytest.mark.parametrize("recipe,paths", RECIPE_PLANS,
                         ids=[f"{r}-{'+'.join(p.stem for p in paths)}" for r, paths in RECIPE_PLANS])
def test_every_recipe_plan_lowers_in_bf16_with_no_unsupported_op(tmp_path, recipe_captures, recipe, paths):
    """The plan file in bf16, compiled with the torchair pipeline (rank 0 of a fake mesh for
    dp > 1): every final graph lowers to GE with zero unsupported ops and bf16 tensors."""
    from cann_passes import compile_program
    from cann_passes.lowering.ge_offline import lower_graph_to_files
    from graph_ir.mesh import MeshDesc

    plan = _in_bf16(paths[0])
    program = compile_program(recipe_captures(recipe), plan, MeshDesc.fake(dp=plan.dp), backend="torchair")
    assert "npu_legalize" in [r.name for r in program.records]
    assert set(program.graphs) == ({"grad", "apply"} if plan.microbatches > 1 else {"step"})
    histogram: dict[str, int] = {}
    for name, graph in program.graphs.items():
        report = lower_graph_to_files(graph.gm, name, tmp_path)
        assert report.unsupported == [] and report.ok, report.summary()
        for op, n in report.op_histogram.items():
            histogram[op] = histogram.get(op, 0) + n
        if name != "apply":          # the apply graph of fp32 master weights may hold no bf16 value
            assert "DT_BF16" in (tmp_path / f"{name}.ge.txt").read_text(), name
    if plan.dp > 1:      # ZeRO-1: gradients reduce-scattered, updated parameters all-gathered
        assert histogram.get("HcomReduceScatter", 0) >= 1 and histogram.get("HcomAllGather", 0) >= 1, histogram
    if recipe == "bert" and plan.recompute != "none":
        assert histogram.get("FloorDiv", 0) >= 2 and histogram.get("BitwiseAnd", 0) >= 2, histogram   # masks unpacked
