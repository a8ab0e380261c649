"""Plan validation: every bad value names its field and rule; unbuilt capabilities say so."""
from __future__ import annotations

import json
import re

import pytest

from cann_passes import Plan, PlanError
from cann_passes.lowering import BackendUnavailable, resolve_backend
from cann_passes.pass_manager import is_registered
from cann_passes.pass_pipeline import build_pipeline


@pytest.mark.parametrize("fields, name, rule", [
    ({"dp": 0}, "dp", "integer >= 1"),
    ({"precision": "fp8"}, "precision", "must be one of"),
    ({"backend": "tpu"}, "backend", "must be one of"),
    ({"zero_stage": 4}, "zero_stage", "0, 1, 2 or 3"),
    ({"recompute": "budget"}, "recompute_budget", "required"),
    ({"recompute_budget": 0.5}, "recompute_budget", "only applies"),
    ({"bucket_mb": -1}, "bucket_mb", "positive"),
    ({"torchair": {"mode": "fast"}}, "torchair", "not one of"),
    ({"extra_passes": [""]}, "extra_passes", "non-empty"),
])
def test_invalid_field_raises_naming_field_and_rule(fields, name, rule):
    with pytest.raises(PlanError, match=rule) as info:
        Plan(**fields)
    assert info.value.field == name


def test_zero_needs_data_parallelism():
    with pytest.raises(PlanError, match="needs dp > 1"):
        Plan(zero_stage=1)


def test_unknown_field_in_a_file_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"precison": "bf16"}))
    with pytest.raises(PlanError, match="'precison'.*is not a plan field"):
        Plan.load(path)


def test_yaml_plan_loads(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("backend: eager\nverify: deep\nextra_passes: ['cleanup{cse=false}']\n")
    plan = Plan.load(path)
    assert plan.backend == "eager" and plan.extra_passes == ("cleanup{cse=false}",)


@pytest.mark.parametrize("fields, pass_name", [({"pp": 2, "microbatches": 2}, "pipeline_split"),
                                               ({"tp": 2}, "tensor_parallel"),
                                               ({"dp": 2, "zero_stage": 1}, "optimizer_shard")])
def test_capability_not_built_raises_not_implemented_naming_it(fields, pass_name, monkeypatch):
    # A build without the pass (a user's trimmed registry) must refuse the field, not ignore it.
    import cann_passes.pass_manager as pass_manager
    registered = pass_manager.is_registered
    monkeypatch.setattr(pass_manager, "is_registered", lambda name: name != pass_name and registered(name))
    with pytest.raises(NotImplementedError, match=pass_name):
        Plan(**fields)
    monkeypatch.undo()
    assert registered(pass_name)
    Plan(**fields)


@pytest.mark.parametrize("fields", [{"precision": "bf16"}, {"dp": 2, "zero_stage": 3},
                                    {"recompute": "selective"}, {"microbatches": 4}])
def test_built_capabilities_are_accepted(fields):
    Plan(**fields)


def test_default_pipeline_is_cleanup_and_the_plan_pipeline_overrides_it():
    assert str(build_pipeline(Plan(), "eager")) == "cleanup,attention_masks_as_flags,cleanup"
    bf16 = str(build_pipeline(Plan(precision="bf16", recompute="selective"), "eager"))
    assert bf16.startswith("cleanup,attention_masks_as_flags,autocast{") and ",recompute{" in bf16
    assert str(build_pipeline(Plan(pipeline="cleanup{cse=false}"), "eager")) == "cleanup{cse=false}"


def test_auto_backend_without_npu_picks_inductor_or_eager_and_torchair_explains():
    assert resolve_backend("auto") in ("inductor", "eager")
    with pytest.raises(BackendUnavailable, match="torch_npu"):
        resolve_backend("torchair")


@pytest.mark.parametrize("fields, name", [
    ({"extra_passes": "cleanup"}, "extra_passes"),          # a string is not a list of passes
    ({"recompute_bans": "attn"}, "recompute_bans"),
    ({"autocast_overrides": ["lm_head"]}, "autocast_overrides"),
    ({"torchair": [1]}, "torchair"),
    ({"pipeline": "cleanup,autocst"}, "pipeline"),         # parsed when the plan is made
    ({"extra_passes": ["cleanup{nope=1}"]}, "extra_passes"),
    ({"accumulate_target": True}, "accumulate_target"),
    ({"loss_scale_init": float("inf"), "precision": "fp16"}, "loss_scale_init"),
    ({"dump_dir": 3}, "dump_dir"),
])
def test_malformed_values_are_refused_when_the_plan_is_made(fields, name):
    with pytest.raises(PlanError) as info:
        Plan(**fields)
    assert info.value.field == name


def test_a_plan_file_that_does_not_parse_is_named(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{precision: bf16")
    with pytest.raises(PlanError, match="plan.json is not valid JSON"):
        Plan.load(path)


def test_low_precision_gradient_reduction_needs_data_parallel_ranks():
    with pytest.raises(PlanError, match="grad_reduce_dtype.*dp = 1"):
        Plan(grad_reduce_dtype="bf16")
    with pytest.raises(PlanError, match="grad_reduce_dtype"):
        Plan(dp=2, grad_reduce_dtype="fp16")
    from cann_passes.pass_pipeline import build_pipeline
    for zero, pass_name in ((0, "data_parallel"), (2, "optimizer_shard")):
        text = str(build_pipeline(Plan(dp=2, zero_stage=zero, grad_reduce_dtype="bf16", backend="eager"), "eager"))
        assert re.search(pass_name + r"\{[^}]*reduce_dtype=bf16", text), text


# -- pipeline parallelism: schedules, virtual stages, split ------------------------------------

@pytest.fixture
def pipeline_pass_registered(monkeypatch):
    """The plan's rules for pp > 1, whether or not the pipeline_split pass is built yet."""
    import cann_passes.pass_manager as pm
    real = pm.is_registered
    monkeypatch.setattr(pm, "is_registered", lambda name: name == "pipeline_split" or real(name))


@pytest.mark.parametrize("fields", [
    {"pp": 2, "microbatches": 2},
    {"pp": 4, "microbatches": 4, "pipeline_schedule": "gpipe"},
    {"pp": 2, "microbatches": 1, "pipeline_schedule": "gpipe"},
    {"pp": 2, "microbatches": 4, "pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2},
    {"pp": 4, "microbatches": 3, "pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2},
    {"pp": 2, "microbatches": 4, "pipeline_schedule": "zb1p"},
    {"pp": 2, "microbatches": 4, "pipeline_schedule": "zb1p", "pipeline_virtual_stages": 2,
     "pipeline_split": [1, 2, 2, 1]},
    {"pp": 2, "microbatches": 4, "pipeline_schedule": "dynamic", "pipeline_virtual_stages": 2},
    {"pp": 2, "microbatches": 4, "pipeline_split": [3, 1]},
])
def test_pipeline_plans_that_apply_are_accepted(pipeline_pass_registered, fields):
    plan = Plan(**fields)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_dualpipev_implies_two_stages_per_rank(pipeline_pass_registered):
    plan = Plan(pp=2, microbatches=4, pipeline_schedule="dualpipev")
    assert plan.pipeline_virtual_stages == 2
    assert Plan(pp=2, microbatches=4, pipeline_schedule="dualpipev", pipeline_split=[1, 1, 1, 1]).pipeline_split \
        == (1, 1, 1, 1)
    with pytest.raises(PlanError, match="4 stages .*got 2") as info:
        Plan(pp=2, microbatches=4, pipeline_schedule="dualpipev", pipeline_split=[2, 2])
    assert info.value.field == "pipeline_split"


@pytest.mark.parametrize("fields, name, rule", [
    ({"pp": 4, "microbatches": 2}, "microbatches", "1f1b needs microbatches >= pp"),
    ({"pp": 2, "microbatches": 4, "pipeline_schedule": "interleaved_1f1b"}, "pipeline_virtual_stages",
     "at least 2 stages per rank"),
    ({"pp": 2, "microbatches": 4, "pipeline_schedule": "gpipe", "pipeline_virtual_stages": 2},
     "pipeline_virtual_stages", "one stage per rank"),
    ({"pp": 2, "microbatches": 5, "pipeline_schedule": "zb1p", "pipeline_virtual_stages": 2}, "microbatches",
     "multiple of the number of rounds"),
    ({"pp": 2, "microbatches": 4, "pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2,
      "pipeline_split": [1, 1]}, "pipeline_split", "4 stages"),
    ({"pp": 2, "microbatches": 2, "pipeline_split": [1.0, 1]}, "pipeline_split", "whole layer counts"),
])
def test_bad_pipeline_plans_are_refused_by_field_before_the_capability_check(fields, name, rule):
    with pytest.raises(PlanError, match=rule) as info:
        Plan(**fields)
    assert info.value.field == name


def test_pipeline_text_with_pp_needs_the_pipeline_split_pass(pipeline_pass_registered):
    with pytest.raises(PlanError, match="pipeline_split") as info:
        Plan(pp=2, microbatches=2, pipeline="cleanup,grad_accumulation{microbatches=2}")
    assert info.value.field == "pp"


def test_dynamic_accumulation_composes_with_pipeline_stages_but_not_with_static_microbatches():
    from cann_passes.pass_pipeline import build_pipeline
    text = str(build_pipeline(Plan(pp=2, microbatches=2, accumulate_target=16), "eager"))
    assert "grad_accumulation{microbatches=2,target=16}" in text and "pipeline_split{" in text
    with pytest.raises(PlanError, match="microbatches.*cannot be combined with accumulate_target"):
        Plan(microbatches=2, accumulate_target=16)
