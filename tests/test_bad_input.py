"""Unusual-but-legitimate usage and bad input: the compiled step behaves exactly like eager
PyTorch, or refuses clearly and loses nothing.

Every case asserts one exact outcome:

- **equal**: losses, parameters and optimizer state equal eager PyTorch's from the same initial
  weights (fp32, 1e-5), step for step;
- **refused**: an error of one of the project's types (or eager's own, with eager's message) that
  names the field or op and the rule, on one line; and after the failed step the model's
  parameters and the optimizer's state are exactly what they were before (no half-updated state).

Everything here is tiny (the recipe MLP, a 2-layer GPT, a 2-layer transformers GPT-2) and runs on
the eager backend.
"""
from __future__ import annotations

import copy
import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cann_passes import Plan, PlanError, backend, compile_for_npu
from cann_passes.lowering import BackendUnavailable
from graph_ir.capture import CaptureError
from graph_ir.optimizers import UnsupportedOptimizer
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
from recipes.models.mlp import MLP, mlp_loss
from tests.eager_reference import eager_steps

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
    """One step of the eager reference (tests/eager_reference.py); its loss."""
    return eager_steps(model, optimizer, loss_fn, [batch]).losses[0]


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
    """Bitwise: a refused step changes no parameter, buffer, hyperparameter or optimizer state."""
    after = snapshot(model, optimizer)
    assert_close_tree(after, before, "after the failed step", atol=0.0)


def assert_same_training(model, optimizer, ref_model, ref_optimizer):
    assert_close_tree(snapshot(model, optimizer), snapshot(ref_model, ref_optimizer), "compiled vs eager")


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text.strip() and "\n" not in text.strip(), f"not one line: {text!r}"
    assert "Traceback" not in text
    return text


class _LoggedTracebacks(logging.Handler):
    """Log records that carry a traceback: what a user sees printed besides the error itself."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.exc_info or "Traceback (most recent call last)" in record.getMessage():
            self.records.append(record)

    def __enter__(self):
        # torch's artifact loggers (torch._subclasses.fake_tensor, ...) print with their own
        # handlers and do not propagate: listen on every logger that does not.
        self.loggers = [logging.getLogger()] + [
            lg for lg in logging.Logger.manager.loggerDict.values()
            if isinstance(lg, logging.Logger) and not lg.propagate]
        for lg in self.loggers:
            lg.addHandler(self)
        return self

    def __exit__(self, *exc):
        for lg in self.loggers:
            lg.removeHandler(self)


def refused(step, batch, types, *needles, model=None, optimizer=None):
    """``step(batch)`` raises one of ``types`` on one line naming every needle, logs no traceback
    on the way, and changes nothing."""
    model = model if model is not None else step.model
    optimizer = optimizer if optimizer is not None else step.optimizer
    before = snapshot(model, optimizer)
    with _LoggedTracebacks() as logged, pytest.raises(types) as info:
        step(batch)
    assert not logged.records, f"logged a traceback: {logged.records[0].name}: {logged.records[0].getMessage()}"
    text = one_line(info.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"
    assert_unchanged(model, optimizer, before)
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
    ({"pipeline_virtual_stages": 2}, "pipeline_virtual_stages", ["pp > 1"]),
    ({"pipeline_split": [2]}, "pipeline_split", ["pp > 1"]),
    # pipeline schedules: each one's own requirements (torch's), by field
    ({"pp": 2, "microbatches": 1}, "microbatches", ["1f1b", "microbatches >= pp"]),
    ({"pp": 2, "microbatches": 4, "pipeline_schedule": "interleaved_1f1b"}, "pipeline_virtual_stages",
     ["at least 2 stages per rank"]),
    ({"pp": 2, "microbatches": 4, "pipeline_virtual_stages": 2}, "pipeline_virtual_stages", ["one stage per rank"]),
    ({"pp": 2, "microbatches": 4, "pipeline_schedule": "dualpipev", "pipeline_virtual_stages": 3},
     "pipeline_virtual_stages", ["exactly 2 stages per rank"]),
    ({"pp": 2, "microbatches": 3, "pipeline_schedule": "dualpipev"}, "microbatches", ["2*pp = 4"]),
    ({"pp": 4, "microbatches": 9, "pipeline_schedule": "zb1p"}, "microbatches", ["multiple of the number of rounds"]),
    ({"pp": 2, "microbatches": 4, "pipeline_split": [2, 2, 2]}, "pipeline_split", ["2 stages", "got 3"]),
    ({"pp": 2, "microbatches": 4, "pipeline_schedule": "dynamic", "pipeline_split": [2, 2]}, "pipeline_split",
     ["'dynamic'"]),
    ({"pp": 2, "microbatches": 2, "pipeline_split": [1, 0]}, "pipeline_split", ["layer counts >= 1"]),
    ({"pp": 2, "microbatches": 2, "pipeline_split": "layers"}, "pipeline_split", ["'cost'"]),
    ({"pp": 2, "pipeline_schedule": "zero_bubble"}, "pipeline_schedule", ["must be one of"]),
    ({"pp": 2, "microbatches": 2, "pipeline_virtual_stages": True}, "pipeline_virtual_stages", ["integer"]),
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
    ({"dp": "2"}, "dp", ["integer"]),                       # a quoted number in a file
    ({"precision": "BF16"}, "precision", ["must be one of 'fp32', 'bf16', 'fp16'"]),
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
    from cann_passes.pass_pipeline import build_pipeline
    from tools.lower_check import torchair_plan
    plan = Plan(precision="fp16", loss_scale_init=1024.0, loss_scale_growth_interval=10, recompute="budget",
                recompute_budget=0.25, microbatches=2, extra_passes=["cleanup{cse=false}"],
                torchair={"mode": "ge"})
    as_text = torchair_plan(plan)
    assert as_text.pipeline == str(build_pipeline(plan, "torchair")) and as_text.backend == "eager"


def test_a_plan_written_as_json_reads_back_equal():
    """A plan written as JSON (a dump's plan, a recipe's config) reads back as the same plan."""
    plan = Plan(precision="bf16", pipeline='cleanup,autocast{overrides="lm_head=fp32"},recompute{policy=full,bans=attn},'
                                          'grad_accumulation{microbatches=2}',
                recompute="full", recompute_bans=["attn"], autocast_overrides={"lm_head": "fp32"},
                microbatches=2, verify=False)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    with pytest.raises(PlanError, match="'microbatches' = 2: needs the pass 'grad_accumulation'"):
        plan.replace(pipeline='cleanup,autocast{overrides="lm_head=fp32"},recompute{policy=full,bans=attn}')


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
    (lambda m: (m, EAGER, torch.optim.Rprop(m.parameters()), mlp_loss), UnsupportedOptimizer, "Rprop"),
    (lambda m: (m, Plan(backend="torchair"), adam(m), mlp_loss), BackendUnavailable, "torch_npu"),
    (lambda m: (m, Plan(backend="eager", dp=2), adam(m), mlp_loss), RuntimeError, "init_distributed"),
], ids=["model", "optimizer", "loss_fn", "rprop", "torchair", "dp_without_groups"])
def test_compile_for_npu_refuses_what_it_cannot_compile(mlp, args, error, needle):
    model, plan, optimizer, loss_fn = args(mlp())
    with pytest.raises(error) as info:
        compile_for_npu(model, plan, optimizer=optimizer, loss_fn=loss_fn)
    assert needle in one_line(info.value)


# -- the step: unusual but legitimate usage is exactly eager -------------------------------------

def train_both(model, optimizer, ref, ref_optimizer, loss_fn, batch_list, plan=EAGER, between=None):
    """Compiled and eager training side by side; ``between(i, model, optimizer)`` runs on both
    before step ``i``. Returns the step, after checking losses and all state step for step."""
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=loss_fn)
    for i, batch in enumerate(batch_list):
        if between is not None:
            between(i, model, optimizer)
            between(i, ref, ref_optimizer)
        loss = step(batch)
        ref_loss = eager_step(ref, ref_optimizer, loss_fn, batch)
        assert_close_tree(float(loss), ref_loss, f"loss of step {i}")
        assert_same_training(model, optimizer, ref, ref_optimizer)
    return step


def compilations(step) -> int:
    return len(step._compiled)




def test_freezing_a_layer_after_the_first_step_stops_its_training(mlp):
    def freeze(i, model, _):
        if i == 1:
            model.fc1.weight.requires_grad_(False)
    train_both(*twins(mlp), mlp_loss, batches(3), between=freeze)


def test_unfreezing_a_layer_after_the_first_step_starts_its_training(mlp):
    def unfreeze(i, model, _):
        model.fc1.weight.requires_grad_(i >= 1)
    train_both(*twins(mlp), mlp_loss, batches(3), between=unfreeze)


class _NormNet(nn.Module):
    """BatchNorm (batch statistics in train, running statistics in eval) and a module that reads
    ``self.training`` in Python, as transformers' and timm's code does."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Linear(16, 5)

    def forward(self, x):
        h = self.bn(self.fc1(x))
        return self.fc2(F.gelu(h) * (0.5 if self.training else 1.0))


def _norm_net():
    torch.manual_seed(3)
    return _NormNet()


def test_model_eval_after_the_first_step_switches_to_eval_behaviour():
    def mode(i, model, _):
        model.train(i == 0)
    train_both(*twins(_norm_net), mlp_loss, batches(3), between=mode)


def test_model_train_after_eval_steps_switches_back():
    def mode(i, model, _):
        model.train(i >= 2)
    train_both(*twins(_norm_net), mlp_loss, batches(3), between=mode)


def test_a_batch_that_requires_grad_leaks_no_autograd_history(mlp):
    data = [(x.clone().requires_grad_(), y) for x, y in batches(3)]
    model, optimizer, ref, ref_optimizer = twins(mlp)
    train_both(model, optimizer, ref, ref_optimizer, mlp_loss, data)
    for state in optimizer.state.values():
        for value in state.values():
            assert not value.requires_grad and value.grad_fn is None
    copy.deepcopy(optimizer.state_dict())


def test_optimizer_load_state_dict_of_an_empty_state_after_compiling_restarts_like_eager(mlp):
    def reset(i, _, optimizer):
        if i == 1:
            optimizer.load_state_dict({"state": {}, "param_groups": optimizer.state_dict()["param_groups"]})
    train_both(*twins(mlp), mlp_loss, batches(3), between=reset)


def test_an_lr_scheduler_takes_effect_without_recompiling(mlp):
    model, optimizer, ref, ref_optimizer = twins(mlp)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (optimizer, ref_optimizer)]

    def schedule(i, _, opt):
        if i:
            schedulers[opt is ref_optimizer].step()
    step = train_both(model, optimizer, ref, ref_optimizer, mlp_loss, batches(4), between=schedule)
    assert compilations(step) == 1


def test_changing_weight_decay_between_steps_is_applied(mlp):
    def decay(i, _, optimizer):
        optimizer.param_groups[0]["weight_decay"] = 0.1 * i
    step = train_both(*twins(mlp), mlp_loss, batches(3), between=decay)
    assert compilations(step) == 2     # zero and non-zero weight decay; 0.1 -> 0.2 is an input


def test_a_new_batch_shape_compiles_once_more(mlp):
    data = [batches(1, rows=8)[0], batches(1, rows=4, seed=2)[0], batches(1, rows=8, seed=3)[0]]
    step = train_both(*twins(mlp), mlp_loss, data)
    assert compilations(step) == 2


def test_a_dict_batch_and_then_a_tuple_batch(mlp):
    def loss_fn(model, batch):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        return F.cross_entropy(model(x), y)
    (x0, y0), (x1, y1) = batches(2)
    train_both(*twins(mlp), loss_fn, [{"x": x0, "y": y0}, (x1, y1)])


def test_a_tensor_learning_rate_and_a_one_element_loss(mlp):
    def tensor_lr(model):
        return torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2))

    def loss_fn(model, batch):
        return mlp_loss(model, batch).reshape(1)
    train_both(*twins(mlp, tensor_lr), loss_fn, batches(2))


def test_a_non_contiguous_batch(mlp):
    x = torch.randn(12, 8).t()
    assert not x.is_contiguous()
    train_both(*twins(mlp), mlp_loss, [(x, torch.arange(8) % 5)])


def test_a_nan_in_the_batch_poisons_parameters_exactly_like_eager(mlp):
    (x, y), = batches(1)
    x[0, 3] = NAN
    train_both(*twins(mlp), mlp_loss, [(x, y)])


def test_an_empty_batch_matches_eager(mlp):
    train_both(*twins(mlp), mlp_loss, [(torch.randn(0, 12), torch.zeros(0, dtype=torch.long))])


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.body, self.unused = MLP([12, 16, 5]), nn.Linear(3, 3)

    def forward(self, x):
        return self.body(x)


def test_a_parameter_without_gradient_is_left_alone_like_eager():
    train_both(*twins(_WithUnused), mlp_loss, batches(2))


def test_param_groups_with_their_own_lr_and_weight_decay(mlp):
    def groups(model):
        return torch.optim.AdamW([{"params": model.fc1.parameters(), "lr": 1e-3, "weight_decay": 0.0},
                                  {"params": [p for n, p in model.named_parameters() if not n.startswith("fc1")]}],
                                 lr=1e-2, weight_decay=0.1)
    train_both(*twins(mlp, groups), mlp_loss, batches(2))


def test_a_param_group_added_after_compiling_trains_from_then_on(mlp):
    def head_later(model):
        return torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("fc3")],
                               lr=0.05, momentum=0.9)

    def add_head(i, model, optimizer):
        if i == 1:
            optimizer.add_param_group({"params": model.fc3.parameters(), "lr": 0.01})
    train_both(*twins(mlp, head_later), mlp_loss, batches(3), between=add_head)


def test_gpt_with_its_embedding_frozen_after_a_step():
    def make():
        torch.manual_seed(0)
        return GPT(gpt_tiny(n_layer=1))

    def freeze(i, model, _):
        model.wpe.weight.requires_grad_(i == 0)
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 256, (2, 3, 9), generator=g)
    data = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in idx]
    train_both(*twins(make), gpt_loss, data, between=freeze)


# -- the step: what eager refuses, or what cannot be one graph, is refused and changes nothing ----

EAGER_GRAD_ERROR = "element 0 of tensors does not require grad and does not have a grad_fn"


def compiled(model, loss_fn, plan=EAGER, optimizer=None):
    return compile_for_npu(model, plan, optimizer=optimizer or adam(model), loss_fn=loss_fn)


def eager_message(model, loss_fn, batch) -> tuple[type, str]:
    """The exception eager PyTorch raises for this step, on a copy of the model."""
    ref = copy.deepcopy(model)
    with pytest.raises(Exception) as info:
        eager_step(ref, adam(ref), loss_fn, batch)
    return type(info.value), str(info.value)


def _detached(model, batch):
    return mlp_loss(model, batch).detach()


def _under_no_grad(model, batch):
    with torch.no_grad():
        return mlp_loss(model, batch)


def _accuracy(model, batch):
    return (model(batch[0]).argmax(-1) == batch[1]).float().mean()


@pytest.mark.parametrize("loss_fn", [_detached, _under_no_grad, _accuracy], ids=["detached", "no_grad", "argmax"])
def test_a_loss_that_does_not_require_grad_raises_eagers_error(mlp, loss_fn):
    model = mlp()
    batch = batches(1)[0]
    kind, message = eager_message(model, loss_fn, batch)
    assert kind is RuntimeError and message == EAGER_GRAD_ERROR
    refused(compiled(model, loss_fn), batch, RuntimeError, EAGER_GRAD_ERROR)


def _item_in_loss(model, batch):
    loss = mlp_loss(model, batch)
    return loss * 2.0 if loss.item() > 1.0 else loss   # the data-dependent line


class _BranchOnData(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        if x.sum() > 0:                                   # the data-dependent line
            x = x * 2
        return self.fc(x)


def _line_of(fn, marker: str = "the data-dependent line") -> str:
    import inspect
    lines, first = inspect.getsourcelines(fn)
    return f"test_bad_input.py:{first + next(i for i, t in enumerate(lines) if marker in t)}"


def test_item_in_the_loss_is_refused_at_capture_naming_the_line(mlp):
    error = refused(compiled(mlp(), _item_in_loss), batches(1)[0], CaptureError, _line_of(_item_in_loss))
    assert "data-dependent" in str(error).lower()


def test_python_if_on_tensor_data_in_forward_is_refused_at_capture_naming_the_line():
    error = refused(compiled(_BranchOnData(), mlp_loss), batches(1)[0], CaptureError,
                    _line_of(_BranchOnData.forward))
    assert "data-dependent" in str(error).lower()


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.body = MLP([12, 16, 5])

    def forward(self, x):
        import torch.utils.checkpoint
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


def test_torch_utils_checkpoint_in_the_model_is_refused_pointing_at_plan_recompute():
    refused(compiled(_Checkpointed(), mlp_loss), batches(1)[0], CaptureError, "checkpoint", "recompute")


def test_a_batch_whose_feature_size_does_not_fit_is_named(mlp):
    x, y = batches(1, features=13)[0]
    refused(compiled(mlp(), mlp_loss), (x, y), (CaptureError, RuntimeError), "batch[0]", "(8, 13)")


def test_a_batch_on_meta_is_named(mlp):
    x, y = batches(1)[0]
    refused(compiled(mlp(), mlp_loss), (x.to("meta"), y.to("meta")), (CaptureError, RuntimeError),
            "batch[0]", "meta")


def test_a_float64_batch_raises_eagers_own_dtype_error(mlp):
    model = mlp()
    x, y = batches(1)[0]
    kind, message = eager_message(model, mlp_loss, (x.double(), y))
    refused(compiled(model, mlp_loss), (x.double(), y), kind, message)


def test_a_class_index_out_of_range_raises_eagers_own_error(mlp):
    model = mlp()
    x, y = batches(1)[0]
    kind, message = eager_message(model, mlp_loss, (x, y + 10))
    refused(compiled(model, mlp_loss), (x, y + 10), kind, message)


def test_int32_class_indices_raise_eagers_own_error(mlp):
    model = mlp()
    x, y = batches(1)[0]
    kind, message = eager_message(model, mlp_loss, (x, y.int()))
    refused(compiled(model, mlp_loss), (x, y.int()), kind, message)


def test_asking_what_was_compiled_before_compiling_says_so(mlp):
    step = compiled(mlp(), mlp_loss)
    with pytest.raises(RuntimeError, match="nothing compiled yet"):
        step.last


def test_batch_norm_on_a_single_row_raises_eagers_own_error():
    model = _norm_net()
    x, y = batches(1, rows=1)[0]
    kind, message = eager_message(model, mlp_loss, (x, y))
    refused(compiled(model, mlp_loss), (x, y), kind, message)


def test_an_error_in_the_users_loss_fn_is_the_users_error(mlp):
    def loss_fn(model, batch):
        x, y, weights = batch                          # the batch has two items: ValueError
        return mlp_loss(model, (x, y)) * weights
    model = mlp()
    kind, message = eager_message(model, loss_fn, batches(1)[0])
    refused(compiled(model, loss_fn), batches(1)[0], kind, message)


@pytest.mark.parametrize("loss_fn, needle", [
    (lambda m, b: m(b[0]), "scalar"),
    (lambda m, b: 1.5, "scalar"),
    (lambda m, b: (mlp_loss(m, b), 0), "scalar"),
], ids=["logits", "float", "tuple"])
def test_a_loss_fn_that_returns_no_scalar_is_refused(mlp, loss_fn, needle):
    refused(compiled(mlp(), loss_fn), batches(1)[0], CaptureError, "loss_fn", needle)


def test_a_batch_leaf_that_is_not_a_tensor_is_named(mlp):
    def loss_fn(model, batch):
        return mlp_loss(model, batch[:2]) * batch[2]
    x, y = batches(1)[0]
    refused(compiled(mlp(), loss_fn), (x, y, 2), CaptureError, "batch[2]", "tensor")


def test_an_optimizer_over_tensors_the_model_does_not_own_is_refused(mlp):
    model = mlp()
    stranger = nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD(list(model.parameters()) + [stranger], lr=0.1)
    refused(compiled(model, mlp_loss, optimizer=optimizer), batches(1)[0], CaptureError,
            "not a parameter of the model")


def test_a_model_with_every_parameter_frozen_is_refused(mlp):
    model = mlp()
    model.requires_grad_(False)
    refused(compiled(model, mlp_loss), batches(1)[0], CaptureError, "no trainable parameter")


def test_microbatches_that_do_not_divide_the_batch_are_named(mlp):
    error = refused(compiled(mlp(), mlp_loss, Plan(backend="eager", microbatches=3)), batches(1)[0],
                    ValueError, "plan field 'microbatches' = 3", "multiple of microbatches")
    assert isinstance(error, ValueError)


def test_a_failed_step_after_good_ones_keeps_the_last_good_state(mlp):
    model = mlp()
    step = compiled(model, mlp_loss)
    for batch in batches(2):
        step(batch)
    x, y = batches(1, seed=9)[0]
    refused(step, (x, y + 10), IndexError, "out of bounds")
    ref_kind, _ = eager_message(model, mlp_loss, (x, y + 10))
    assert ref_kind is IndexError


def test_checkpoint_load_of_a_missing_path_is_an_ordinary_error_naming_it(mlp, tmp_path):
    from cann_passes.runtime import checkpoint
    model = mlp()
    step = compiled(model, mlp_loss)
    step(batches(1)[0])
    before = snapshot(model, step.optimizer)
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(Exception) as info:
        checkpoint.load(step, missing, batches(1)[0])
    assert str(missing) in one_line(info.value)
    assert_unchanged(model, step.optimizer, before)


@pytest.mark.parametrize("when", ["capture", "run"])
def test_a_failed_first_step_creates_no_optimizer_state(mlp, when):
    model = mlp()
    x, y = batches(1)[0]
    if when == "capture":
        step, batch, error = compiled(model, _item_in_loss), (x, y), CaptureError
    else:
        step, batch, error = compiled(model, mlp_loss), (x, y + 10), IndexError
    with pytest.raises(error):
        step(batch)
    assert not any(step.optimizer.state.values())


# -- schedulers that cycle more than the learning rate ---------------------------------------------

def _cycling(kind: str):
    """(optimizer factory, scheduler factory) for a scheduler that cycles momentum/betas."""
    if kind == "onecycle_adam":
        return (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=30))
    return (lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9),
            lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=5,
                                                        cycle_momentum=True, base_momentum=0.8,
                                                        max_momentum=0.95))


@pytest.mark.parametrize("kind", ["onecycle_adam", "cyclic_sgd_momentum"])
def test_a_scheduler_cycling_momentum_compiles_once_in_30_steps_and_equals_eager(mlp, kind):
    make_optimizer, make_scheduler = _cycling(kind)
    model, optimizer, ref, ref_optimizer = twins(mlp, make_optimizer)
    scheduler, ref_scheduler = make_scheduler(optimizer), make_scheduler(ref_optimizer)
    key = "betas" if kind == "onecycle_adam" else "momentum"
    seen = {str(optimizer.param_groups[0][key])}
    step = compile_for_npu(model, EAGER, optimizer=optimizer, loss_fn=mlp_loss)
    for i, batch in enumerate(batches(30, rows=4)):
        loss = step(batch)
        ref_loss = eager_step(ref, ref_optimizer, mlp_loss, batch)
        assert_close_tree(float(loss), ref_loss, f"loss of step {i}")
        scheduler.step()
        ref_scheduler.step()
        seen.add(str(optimizer.param_groups[0][key]))
    assert len(seen) >= 5, f"the scheduler did not cycle {key}"
    assert_same_training(model, optimizer, ref, ref_optimizer)
    assert compilations(step) == 1


# -- command-line tools: bad input is one line on stderr and exit status 2 -------------------------

def _cli(main, argv, capsys) -> str:
    """Run a tool's main() as its console script does; return stderr, checked to be one line."""
    try:
        status = main(argv)
    except SystemExit as exc:          # argparse usage errors
        status = exc.code
    captured = capsys.readouterr()
    assert status == 2, f"exit status {status}; stderr {captured.err!r}"
    assert "Traceback" not in captured.err + captured.out
    lines = [line for line in captured.err.splitlines() if line.strip()]
    return lines[-1] if lines and lines[0].startswith("usage:") else one_line(captured.err)


@pytest.fixture
def not_a_directory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    return str(blocker / "out")            # cannot be made: its parent is a file


@pytest.fixture
def plan_file(tmp_path):
    def write(text: str, name: str = "plan.yaml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)
    return write


LOWER_CHECK_CASES = [
    (lambda d, p: ["run", "recipes.models.gpt:gpt_tiny", "--plan", "/nonexistent/plan.yaml", "--out", d],
     ["plan file '/nonexistent/plan.yaml'", "cannot be read"]),
    (lambda d, p: ["run", "recipes.models.gpt:gpt_tiny", "--plan", p(""), "--out", d], ["is empty"]),
    (lambda d, p: ["run", "recipes.models.gpt:gpt_tiny", "--plan", p("dp: 0\n"), "--out", d], ["'dp' = 0"]),
    (lambda d, p: ["run", "recipes.models.gpt:gpt_tiny", "--plan", p("verify: on\n"), "--out", d],
     ["'verify' = True", "YAML"]),
    (lambda d, p: ["run", "no_such_module:factory", "--out", d], ["No module named 'no_such_module'"]),
    (lambda d, p: ["run", "recipes.models.gpt:no_such_factory", "--out", d], ["no_such_factory"]),
    (lambda d, p: ["demo", "--out", "NOT_A_DIRECTORY"], ["Not a directory"]),
    (lambda d, p: ["no_such_module:graph", "--out", d], ["No module named 'no_such_module'"]),
    (lambda d, p: ["run"], ["the following arguments are required"]),
]


@pytest.mark.parametrize("argv, needles", LOWER_CHECK_CASES,
                         ids=["missing_plan", "empty_plan", "bad_field", "yaml_boolean", "unknown_module",
                              "unknown_factory", "unwritable_out", "unknown_graph_module", "no_target"])
def test_lower_check_exits_2_with_one_line(capsys, tmp_path, not_a_directory, plan_file, argv, needles):
    from tools.lower_check import main
    args = [not_a_directory if a == "NOT_A_DIRECTORY" else a for a in argv(str(tmp_path / "out"), plan_file)]
    line = _cli(main, args, capsys)
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"


def test_lower_check_run_with_an_unwritable_out_exits_2_with_one_line(capsys, not_a_directory):
    from tools.lower_check import main
    line = _cli(main, ["run", "recipes.models.gpt:gpt_tiny", "--seq-len", "8", "--batch-size", "2",
                       "--out", not_a_directory], capsys)
    assert "Not a directory" in line and not_a_directory in line


GRAPH_DUMP_CASES = [
    (lambda d, p: ["run", "mlp", "--plan", "/nonexistent/plan.yaml", "--out", d], ["cannot be read"]),
    (lambda d, p: ["run", "mlp", "--plan", p("null\n"), "--out", d], ["is empty"]),
    (lambda d, p: ["run", "mlp", "--plan", p("zero_stage: 1.0\ndp: 2\n"), "--out", d], ["'zero_stage' = 1.0"]),
    (lambda d, p: ["run", "mlp", "--plan", p("precision: bf16\n"), "--pipeline", "cleanup", "--out", d],
     ["'precision' = 'bf16'", "autocast"]),
    (lambda d, p: ["run", "mlp", "--pipeline", "cleanup,no_such_pass", "--out", d], ["no_such_pass"]),
    (lambda d, p: ["run", "no_such_recipe", "--out", d], ["unknown target 'no_such_recipe'"]),
    (lambda d, p: ["run", p("import no_such_module\n", "model.py"), "--out", d],
     ["No module named 'no_such_module'"]),
    (lambda d, p: ["run", "mlp", "--no-svg", "--out", "NOT_A_DIRECTORY"], ["Not a directory"]),
    (lambda d, p: ["show", d], ["not a dump directory"]),
    (lambda d, p: ["replay", d], ["not a reproducer"]),
    (lambda d, p: ["run", "mlp"], ["--out"]),
]


@pytest.mark.parametrize("argv, needles", GRAPH_DUMP_CASES,
                         ids=["missing_plan", "null_plan", "float_zero_stage", "pipeline_and_precision",
                              "unknown_pass", "unknown_recipe", "model_file_import_error", "unwritable_out",
                              "show_not_a_dump", "replay_not_a_reproducer", "no_out"])
def test_graph_dump_exits_2_with_one_line(capsys, tmp_path, not_a_directory, plan_file, argv, needles):
    from tools.graph_dump.cli import main
    args = [not_a_directory if a == "NOT_A_DIRECTORY" else a for a in argv(str(tmp_path / "out"), plan_file)]
    line = _cli(main, args, capsys)
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"


# -- models users bring (transformers, built from configs) -----------------------------------------

@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(7)
    weights = transformers.GPT2LMHeadModel(config).state_dict()

    def make():
        model = transformers.GPT2LMHeadModel(config)
        model.load_state_dict(weights)
        return model
    return make


def _gpt2_batches(n: int):
    g = torch.Generator().manual_seed(8)
    return [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 64, (n, 2, 8), generator=g)]


def _gpt2_loss(model, batch):
    return model(**batch).loss


def test_transformers_gpt2_with_a_block_frozen_after_the_first_step(gpt2):
    def freeze(i, model, _):
        model.transformer.h[0].requires_grad_(i == 0)
    train_both(*twins(gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)), _gpt2_loss,
               _gpt2_batches(2), between=freeze)


def test_transformers_gpt2_with_a_detached_loss_raises_eagers_error(gpt2):
    model = gpt2()

    def loss_fn(model, batch):
        return model(**batch).loss.detach()
    kind, message = eager_message(model, loss_fn, _gpt2_batches(1)[0])
    refused(compiled(model, loss_fn), _gpt2_batches(1)[0], kind, message)


@pytest.mark.parametrize("module, argv", [
    ("tools.lower_check", ["run", "recipes.models.gpt:gpt_tiny", "--plan", "/nonexistent/plan.yaml", "--out", "OUT"]),
    ("tools.graph_dump", ["run", "mlp", "--plan", "/nonexistent/plan.yaml", "--out", "OUT"]),
])
def test_a_tool_process_prints_one_line_and_exits_2(tmp_path, module, argv):
    """As a user runs it: a real process, so logging and warnings count too."""
    import subprocess
    import sys
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot be read" in lines[0], done.stderr
