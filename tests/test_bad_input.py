"""Unusual-but-legitimate usage and bad input: the compiled step behaves exactly like eager
PyTorch, or refuses clearly and loses nothing.

Every case asserts one exact outcome:

- **equal**: losses, parameters and optimizer state equal eager PyTorch's from the same initial
  weights (fp32, 1e-5), step for step;
- **refused**: an error of one of the project's types (or eager's own, with eager's message) that
  names the field or op and the rule, on one line; and after the failed step the model's
  parameters and the optimizer's state are exactly what they were before (no half-updated state).

Cases whose fix is not in the project yet are ``xfail(strict=True)`` with what they need: they
fail loudly the day the fix lands, so that the mark is removed.

Everything here is tiny (the recipe MLP, a 2-layer GPT, a 2-layer transformers GPT-2) and runs on
the eager backend.
"""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cann_passes import Pipeline, PipelineError, Plan, PlanError, backend, compile_for_npu
from cann_passes.lowering import BackendUnavailable
from graph_ir.capture import CaptureError
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
from recipes.models.mlp import MLP, mlp_loss

NAN, INF = float("nan"), float("inf")
EAGER = Plan(backend="eager")


# -- helpers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_weights():
    torch.manual_seed(0)
    return MLP([12, 32, 32, 5]).state_dict()


@pytest.fixture
def mlp(mlp_weights):
    """A fresh tiny MLP with the module's fixed initial weights."""
    def make():
        model = MLP([12, 32, 32, 5])
        model.load_state_dict(mlp_weights)
        return model
    return make


def batches(n: int, rows: int = 8, features: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, features, generator=g), torch.randint(0, 5, (rows,), generator=g))
            for _ in range(n)]


def adam(model, **kw):
    return torch.optim.Adam(model.parameters(), lr=1e-2, **kw)


def eager_step(model, optimizer, loss_fn, batch) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    return loss.item()


def snapshot(model, optimizer) -> dict:
    """Parameters, buffers and optimizer state, cloned: what a failed step must leave alone."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "state": {names.get(id(p), "?"): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for p, s in optimizer.state.items() if s},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def assert_close_tree(a, b, what: str, atol: float = 1e-5):
    assert type(a) is type(b) or (torch.is_tensor(a) and torch.is_tensor(b)), f"{what}: {type(a)} vs {type(b)}"
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), f"{what}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_close_tree(a[k], b[k], f"{what}.{k}", atol)
    elif isinstance(a, list):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_tree(x, y, f"{what}[{i}]", atol)
    elif torch.is_tensor(a):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        torch.testing.assert_close(a, b, atol=atol, rtol=atol, equal_nan=True, msg=what)
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), f"{what}: {a} vs {b}"


def assert_unchanged(model, optimizer, before: dict):
    """Bitwise: a refused step changes nothing, and creates no optimizer state either."""
    assert_close_tree(snapshot(model, optimizer), before, "after the failed step", atol=0.0)


def assert_same_training(model, optimizer, ref_model, ref_optimizer):
    assert_close_tree(snapshot(model, optimizer), snapshot(ref_model, ref_optimizer), "compiled vs eager")


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text.strip() and "\n" not in text.strip(), f"not one line: {text!r}"
    assert "Traceback" not in text
    return text


def refused(step, batch, types, *needles, model=None, optimizer=None):
    """``step(batch)`` raises one of ``types`` on one line naming every needle; nothing changed."""
    model = model if model is not None else step.model
    optimizer = optimizer if optimizer is not None else step.optimizer
    before = snapshot(model, optimizer)
    with pytest.raises(types) as info:
        step(batch)
    text = one_line(info.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"
    assert_unchanged(model, optimizer, before)
    return info.value


def eager_error(model, optimizer, loss_fn, batch) -> BaseException:
    with pytest.raises(Exception) as info:
        eager_step(copy.deepcopy(model), copy.deepcopy(optimizer) if False else
                   type(optimizer)(copy.deepcopy(model).parameters(), **optimizer.defaults), loss_fn, batch)
    return info.value


def twins(make_model, make_optimizer=adam):
    model = make_model()
    ref = copy.deepcopy(model)
    return model, make_optimizer(model), ref, make_optimizer(ref)


# -- plan fields: refused when the plan is made, naming the field and what it depends on ---------

FIELD_RULES = [
    # fields that cannot apply without another field's value
    ({"recompute_every_n": 2}, "recompute_every_n", ["every_n_layers", "recompute = 'none'"]),
    ({"recompute": "full", "recompute_every_n": 2}, "recompute_every_n", ["recompute = 'full'"]),
    ({"loss_scale_init": 1024.0}, "loss_scale_init", ["loss scaling", "precision = 'fp32'"]),
    ({"loss_scale_growth_interval": 10}, "loss_scale_growth_interval", ["precision = 'fp32'"]),
    ({"precision": "bf16", "loss_scale_init": 1024.0}, "loss_scale_init", ["loss_scale = 'auto'", "bf16"]),
    ({"precision": "fp16", "loss_scale": "none", "loss_scale_init": 8.0}, "loss_scale_init",
     ["loss_scale = 'none'"]),
    ({"precision": "fp16", "loss_scale": "static", "loss_scale_growth_interval": 10},
     "loss_scale_growth_interval", ["'dynamic'", "loss_scale = 'static'"]),
    ({"loss_scale": "dynamic"}, "loss_scale", ["precision = 'fp32'"]),
    ({"backend": "eager", "torchair": {"mode": "ge"}}, "torchair", ["backend = 'eager'"]),
    ({"backend": "inductor", "torchair": {"single_stream": True}}, "torchair", ["backend = 'inductor'"]),
    ({"microbatches": 2, "accumulate_target": 16}, "microbatches", ["accumulate_target"]),
    ({"recompute_bans": ["attn"]}, "recompute_bans", ["recompute = 'none'"]),
    ({"autocast_overrides": {"lm_head": "fp32"}}, "autocast_overrides", ["precision = 'fp32'"]),
    ({"bucket_mb": 10}, "bucket_mb", ["dp = 1"]),
    ({"allreduce_algo": "ring"}, "allreduce_algo", ["dp = 1"]),
    ({"pipeline_schedule": "gpipe"}, "pipeline_schedule", ["pp > 1"]),
    ({"recompute_budget": 0.5}, "recompute_budget", ["recompute = 'none'"]),
    # pipeline text decides the passes: the fields that shape the pipeline must agree with it
    ({"pipeline": "cleanup,cleanup", "precision": "bf16"}, "precision", ["autocast", "pipeline text"]),
    ({"pipeline": "cleanup,autocast{dtype=fp16}", "precision": "bf16"}, "precision", ["dtype=fp16"]),
    ({"pipeline": "cleanup", "recompute": "full"}, "recompute", ["recompute", "ignored"]),
    ({"pipeline": "cleanup,recompute{policy=budget,budget=0.5}", "recompute": "budget",
      "recompute_budget": 0.25}, "recompute_budget", ["budget=0.5"]),
    ({"pipeline": "cleanup,recompute{policy=every_n_layers}", "recompute": "every_n_layers",
      "recompute_every_n": 2}, "recompute_every_n", ["every_n=1"]),
    ({"pipeline": "cleanup", "extra_passes": ["cleanup{cse=false}"]}, "extra_passes", ["cleanup{cse=false}"]),
    ({"pipeline": "cleanup", "microbatches": 2}, "microbatches", ["grad_accumulation"]),
    ({"pipeline": "cleanup,grad_accumulation{microbatches=2}"}, "pipeline", ["microbatches = 1"]),
    ({"pipeline": "cleanup", "autocast_overrides": {"lm_head": "fp32"}}, "autocast_overrides", ["autocast"]),
    ({"pipeline": "cleanup,autocast{dtype=fp16},loss_scale{mode=static}", "precision": "fp16",
      "loss_scale": "none"}, "loss_scale", ["'none'", "loss_scale"]),
    ({"pipeline": "cleanup,autocast{dtype=fp16}", "precision": "fp16", "loss_scale_init": 8.0},
     "loss_scale_init", ["loss_scale"]),
    ({"pipeline": "cleanup", "dp": 2}, "dp", ["data_parallel"]),
    ({"pipeline": "cleanup,data_parallel", "dp": 2, "zero_stage": 1}, "zero_stage", ["optimizer_shard"]),
    # booleans and floats are not integers
    ({"zero_stage": 1.0, "dp": 2}, "zero_stage", ["integer"]),
    ({"zero_stage": True, "dp": 2}, "zero_stage", ["integer"]),
    ({"dp": 2.0}, "dp", ["integer"]),
    ({"dp": True}, "dp", ["integer"]),
    ({"microbatches": 2.5}, "microbatches", ["integer"]),
    ({"recompute": "every_n_layers", "recompute_every_n": True}, "recompute_every_n", ["integer"]),
    ({"accumulate_target": 8.0}, "accumulate_target", ["integer"]),
    ({"precision": "fp16", "loss_scale_growth_interval": 10.0}, "loss_scale_growth_interval", ["integer"]),
    # NaN and infinity are not numbers here
    ({"recompute": "budget", "recompute_budget": NAN}, "recompute_budget", ["fraction"]),
    ({"recompute": "budget", "recompute_budget": INF}, "recompute_budget", ["fraction"]),
    ({"recompute": "budget", "recompute_budget": -0.1}, "recompute_budget", ["fraction"]),
    ({"recompute": "budget", "recompute_budget": True}, "recompute_budget", ["fraction"]),
    ({"recompute": "budget", "recompute_budget": 1.5}, "recompute_budget", ["whole byte count"]),
    ({"dp": 2, "bucket_mb": NAN}, "bucket_mb", ["finite"]),
    ({"dp": 2, "bucket_mb": INF}, "bucket_mb", ["finite"]),
    ({"precision": "fp16", "loss_scale_init": NAN}, "loss_scale_init", ["finite"]),
    ({"precision": "fp16", "loss_scale_init": 0.0}, "loss_scale_init", ["positive"]),
    # enum fields given booleans (YAML 1.1 reads on/off/yes/no as booleans)
    ({"verify": True}, "verify", ["boolean", "quote"]),
    ({"precision": False}, "precision", ["boolean"]),
    ({"backend": True}, "backend", ["boolean"]),
    # malformed containers and texts
    ({"recompute": "full", "recompute_bans": [1]}, "recompute_bans", ["strings"]),
    ({"pipeline": ""}, "pipeline", ["non-empty"]),
    ({"pipeline": ["cleanup"]}, "pipeline", ["pipeline text"]),
    ({"precision": "bf16", "autocast_overrides": {"lm_head": "fp8"}}, "autocast_overrides.lm_head", ["fp32"]),
    ({"dump_dir": ""}, "dump_dir", ["directory"]),
]


@pytest.mark.parametrize("fields, name, needles", FIELD_RULES,
                         ids=[",".join(f"{k}={v!r}"[:40] for k, v in c[0].items()) for c in FIELD_RULES])
def test_plan_field_that_cannot_apply_or_is_malformed_is_refused(fields, name, needles):
    with pytest.raises(PlanError) as info:
        Plan(**fields)
    assert info.value.field == name
    text = one_line(info.value)
    assert text.startswith(f"plan field '{name}' = ")
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"


@pytest.mark.parametrize("fields, expect", [
    ({"verify": False}, {"verify": "off"}),                     # YAML `verify: off`
    ({"recompute": False}, {"recompute": "none"}),
    ({"precision": "fp16", "loss_scale": False}, {"loss_scale": "none"}),
    ({"precision": "fp16", "loss_scale_init": 1024.0, "loss_scale_growth_interval": 10}, {}),
    ({"recompute": "every_n_layers", "recompute_every_n": 2}, {}),
    ({"recompute": "budget", "recompute_budget": 2e6}, {}),     # a whole byte count
    ({"backend": "torchair", "torchair": {"mode": "ge"}}, {}),
    ({"pipeline": "cleanup,autocast,cleanup", "precision": "bf16"}, {}),   # autocast's dtype is bf16
    ({"pipeline": "cleanup,grad_accumulation{microbatches=2}", "microbatches": 2}, {}),
])
def test_plan_fields_that_apply_are_accepted(fields, expect):
    plan = Plan(**fields)
    for key, value in expect.items():
        assert getattr(plan, key) == value


def test_numpy_integers_are_integers_and_stored_as_int():
    np = pytest.importorskip("numpy")
    plan = Plan(microbatches=np.int64(2))
    assert plan.microbatches == 2 and type(plan.microbatches) is int


def test_a_pipeline_built_from_a_plan_agrees_with_that_plan():
    """The offline GE check runs the torchair pipeline as text with the plan's own fields."""
    from cann_passes.pipeline import build_pipeline
    from tools.lower_check import torchair_plan
    plan = Plan(precision="fp16", loss_scale_init=1024.0, loss_scale_growth_interval=10, recompute="budget",
                recompute_budget=0.25, microbatches=2, extra_passes=["cleanup{cse=false}"],
                torchair={"mode": "ge"})
    as_text = torchair_plan(plan)
    assert as_text.pipeline == str(build_pipeline(plan, "torchair")) and as_text.backend == "eager"


# -- plan files --------------------------------------------------------------------------------

@pytest.mark.parametrize("name, text, needles", [
    ("empty.yaml", "", ["is empty", "{}"]),
    ("null.yaml", "null\n", ["is empty"]),
    ("comments.yaml", "# nothing here yet\n", ["is empty"]),
    ("list.yaml", "- precision: bf16\n", ["mapping"]),
    ("typo.yaml", "precison: bf16\n", ["'precison'", "did you mean 'precision'"]),
    ("zero.yaml", "dp: 2\nzero_stage: yes\n", ["'zero_stage' = True", "integer"]),
    ("nan.yaml", "recompute: budget\nrecompute_budget: .nan\n", ["recompute_budget", "fraction"]),
    ("float_int.yaml", "dp: 2.0\n", ["'dp' = 2.0", "integer"]),
    ("backend_on.yaml", "backend: on\n", ["'backend' = True", "YAML"]),
    ("twice.yaml", "precision: bf16\nprecision: fp16\n", ["'precision' is given twice"]),
    ("twice.json", '{"dp": 2, "dp": 4}', ["'dp' is given twice"]),
    ("bad.json", "{precision: bf16", ["is not valid JSON"]),
    ("intkey.yaml", "1: 2\n", ["field names are strings"]),
])
def test_a_bad_plan_file_is_refused_naming_the_rule(tmp_path, name, text, needles):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    message = one_line(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


@pytest.mark.parametrize("name, text, expect", [
    ("default.yaml", "{}\n", Plan()),
    ("default.json", "{}", Plan()),
    ("off.yaml", "verify: off\nbackend: eager\n", Plan(verify="off", backend="eager")),
    ("none.yaml", "recompute: no\n", Plan(recompute="none")),
])
def test_explicit_plan_files_load(tmp_path, name, text, expect):
    path = tmp_path / name
    path.write_text(text)
    assert Plan.load(path) == expect


def test_a_missing_or_unreadable_plan_file_is_a_plan_error(tmp_path):
    for path in (tmp_path / "missing.yaml", tmp_path):
        with pytest.raises(PlanError, match="cannot be read") as info:
            Plan.load(path)
        assert info.value.field == "<file>" and str(path) in one_line(info.value)


# -- entry points --------------------------------------------------------------------------------

@pytest.mark.parametrize("plan", [False, True, 0, 3, 1.5, ["cleanup"]])
def test_compile_for_npu_refuses_a_plan_that_is_not_a_plan_without_reading_stdin(mlp, plan):
    model = mlp()
    with pytest.raises(TypeError, match=r"compile_for_npu: plan must be a Plan, a dict of plan fields, "
                                        r"or the path of a YAML/JSON plan file, got "):
        compile_for_npu(model, plan, optimizer=adam(model), loss_fn=mlp_loss)


def test_the_optimizer_given_as_the_plan_says_the_arguments_are_keywords(mlp):
    model = mlp()
    with pytest.raises(TypeError, match="keyword-only arguments: 'optimizer' and 'loss_fn'"):
        compile_for_npu(model, adam(model))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"got a value of type Adam \(optimizer= and loss_fn= are keyword arguments\)"):
        compile_for_npu(model, adam(model), optimizer=adam(model), loss_fn=mlp_loss)


def test_torch_compile_backend_refuses_a_plan_that_is_not_a_plan():
    with pytest.raises(TypeError, match="cann_passes.backend: plan must be"):
        backend(False)


@pytest.mark.parametrize("plan, name, needle", [
    ({"precison": "bf16"}, "precison", "did you mean 'precision'"),
    ({"torchair": {"mode": "ge"}}, "torchair", "no NPU"),      # backend auto picks eager/inductor here
    ("/nonexistent/plan.yaml", "<file>", "cannot be read"),
])
def test_compile_for_npu_names_the_plan_field(mlp, plan, name, needle):
    model = mlp()
    with pytest.raises(PlanError) as info:
        compile_for_npu(model, plan, optimizer=adam(model), loss_fn=mlp_loss)
    assert info.value.field == name and needle in one_line(info.value)


@pytest.mark.parametrize("args, error, needle", [
    (lambda m: ("not a model", EAGER, adam(m), mlp_loss), TypeError, "model must be a torch.nn.Module"),
    (lambda m: (m, EAGER, None, mlp_loss), TypeError, "optimizer must be a torch.optim.Optimizer"),
    (lambda m: (m, EAGER, adam(m), 3), TypeError, "loss_fn must be callable"),
    (lambda m: (m, EAGER, torch.optim.RMSprop(m.parameters()), mlp_loss), Exception, "RMSprop"),
    (lambda m: (m, Plan(backend="torchair"), adam(m), mlp_loss), BackendUnavailable, "torch_npu"),
    (lambda m: (m, Plan(backend="eager", dp=2), adam(m), mlp_loss), RuntimeError, "init_distributed"),
], ids=["model", "optimizer", "loss_fn", "rmsprop", "torchair", "dp_without_groups"])
def test_compile_for_npu_refuses_what_it_cannot_compile(mlp, args, error, needle):
    model, plan, optimizer, loss_fn = args(mlp())
    with pytest.raises(error) as info:
        compile_for_npu(model, plan, optimizer=optimizer, loss_fn=loss_fn)
    assert needle in one_line(info.value)
