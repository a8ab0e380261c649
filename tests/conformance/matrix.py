"""The conformance matrix: every model users bring × every plan feature, against eager PyTorch.

One cell trains ``STEPS`` steps of a zoo model (tests/zoo.py) with one plan on
the eager backend and checks it against its reference, all from the same
initial weights and real (padded) batches:

- fp32, microbatches 2, grad_clip_norm 1.0: eager PyTorch (gradient
  accumulation as users write it; ``clip_grad_norm_``) to 1e-5 (losses
  relative, parameters absolute);
- bf16, fp16: eager ``torch.autocast`` within 2e-2 at every step (relative
  loss), master weights staying fp32;
- selective, full, every_n_layers, budget 0.3: bitwise equal to the compiled
  step without recompute; ``selective`` must save fewer activation bytes.

``ModelRuns(name, backend="inductor")`` runs the same cells through inductor
(``INDUCTOR_MODELS`` × ``INDUCTOR_PLANS``: GPT-2, LLaMA, BERT × fp32, bf16,
selective); there a recompute cell is held to eager PyTorch at 1e-5 instead of
bitwise to the step without recompute (inductor compiles the two graphs into
different kernels).

A cell is ``ok`` (with a ratio: saved bytes against no recompute, or the
largest relative loss gap to autocast), ``FAIL`` (with what differs) or
``refused`` (with the one-line reason the project gave). References and the
no-recompute compiled run are computed once per model and shared by its cells.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from tests.zoo import build, eager_steps

MODELS = ("gpt", "gpt2", "llama", "mistral", "bert", "t5", "vit", "clip", "mixtral", "qwen2_moe", "olmoe",
          "gpt_neox", "gemma", "opt", "bloom", "falcon", "roberta", "bart", "swin", "resnet", "whisper")
MODEL_TITLES = {"gpt": "recipe GPT", "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM", "bert": "BertForMaskedLM",
                "t5": "T5ForConditionalGeneration", "vit": "ViTForImageClassification", "clip": "CLIPModel",
                "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "olmoe": "OlmoeForCausalLM", "gpt_neox": "GPTNeoXForCausalLM", "gemma": "GemmaForCausalLM",
                "opt": "OPTForCausalLM", "bloom": "BloomForCausalLM", "falcon": "FalconForCausalLM",
                "roberta": "RobertaForMaskedLM", "bart": "BartForConditionalGeneration",
                "swin": "SwinForImageClassification", "resnet": "ResNetForImageClassification",
                "whisper": "WhisperForConditionalGeneration"}
# Cells refused by design, with the words the refusal must say: selective recompute keeps the
# attention core's inputs and recomputes the rest, and a convolutional network has none.
EXPECTED_REFUSALS = {("resnet", "selective"): "found no attention core"}
PLANS = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "selective": {"recompute": "selective"},
    "full": {"recompute": "full"},
    "every_n_layers": {"recompute": "every_n_layers"},
    "budget 0.3": {"recompute": "budget", "recompute_budget": 0.3},
    "microbatches 2": {"microbatches": 2},
    "grad_clip 1.0": {"grad_clip_norm": 1.0},
}
RECOMPUTE = ("selective", "full", "every_n_layers", "budget 0.3")
STEPS, FP32_TOL, LOW_PRECISION_TOL = 3, 1e-5, 2e-2
# The inductor matrix: the same cells and tolerances. fp32 holds 1e-5 there too: on CPU
# inductor keeps fp32 accumulation, and its fused kernels reorder sums only within a
# reduction, well inside 1e-5 on a tiny model over 3 steps.
INDUCTOR_MODELS, INDUCTOR_PLANS = ("gpt2", "llama", "bert"), ("fp32", "bf16", "selective")


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


@dataclass
class Cell:
    model: str
    plan: str
    status: str          # "ok", "FAIL" or "refused"
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.status} {self.detail}".strip()


@dataclass
class Run:
    losses: list[float]
    params: dict[str, torch.Tensor]
    saved_bytes: int | None = None
    step: object = None


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class ModelRuns:
    """One model's initial weights, batches, references and compiled runs (each made once)."""

    def __init__(self, name: str, layers: int = 2, backend: str = "eager"):
        self.name, self.backend = name, backend
        self.entry = build(name, layers=layers)
        self.initial = copy.deepcopy(self.entry.model)
        self.batches = [self.entry.make_batch(1000 + i) for i in range(STEPS)]

    def fresh(self):
        return copy.deepcopy(self.initial)

    @functools.lru_cache(maxsize=None)
    def eager(self, autocast: torch.dtype | None = None, microbatches: int = 1,
              clip_norm: float | None = None) -> Run:
        model = self.fresh()
        losses = eager_steps(model, self.entry.loss_fn, _optimizer(model.parameters()), self.batches,
                             autocast=autocast, clip_norm=clip_norm, microbatches=microbatches)
        return Run(losses, _params(model))

    @functools.lru_cache(maxsize=None)
    def compiled(self, plan_name: str) -> Run:
        from cann_passes import Plan, compile_for_npu
        model = self.fresh()
        plan = Plan(backend=self.backend, **PLANS[plan_name])
        step = compile_for_npu(model, plan, optimizer=_optimizer(model.parameters()), loss_fn=self.entry.loss_fn)
        losses = [float(step(b)) for b in self.batches]
        return Run(losses, _params(model), step.last.memory.saved_bytes, step)


def _fp32_gap(got: Run, want: Run) -> str | None:
    for i, (a, b) in enumerate(zip(got.losses, want.losses, strict=True)):
        if not abs(a - b) <= FP32_TOL * max(1.0, abs(b)):
            return f"step {i} loss {a:.7g} vs eager {b:.7g}"
    for name, want_p in want.params.items():
        err = (got.params[name] - want_p).abs().max().item()
        if not err <= FP32_TOL:
            return f"{name} differs from eager by {err:.1e}"
    return None


def _bitwise_gap(got: Run, want: Run) -> str | None:
    if got.losses != want.losses:
        i = next(i for i, (a, b) in enumerate(zip(got.losses, want.losses)) if a != b)
        return f"step {i} loss {got.losses[i]!r} vs no-recompute {want.losses[i]!r}"
    for name, want_p in want.params.items():
        if not torch.equal(got.params[name], want_p):
            return f"{name} differs from the no-recompute step"
    return None


def _refusal(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:160]}"


def run_cell(runs: ModelRuns, plan_name: str) -> Cell:
    name = runs.name
    try:
        got = runs.compiled(plan_name)
    except Exception as exc:  # the matrix reports a refusal; the test decides whether it may refuse
        return Cell(name, plan_name, "refused", _refusal(exc))
    options = PLANS[plan_name]
    if "precision" in options:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[options["precision"]]
        want = runs.eager(autocast=dtype)
        masters = [n for n, p in got.params.items() if p.dtype != torch.float32]
        if masters:
            return Cell(name, plan_name, "FAIL", f"master weights not fp32: {masters[:2]}")
        gaps = [abs(a - b) / max(1e-6, abs(b)) for a, b in zip(got.losses, want.losses, strict=True)]
        if not all(g <= LOW_PRECISION_TOL for g in gaps):
            return Cell(name, plan_name, "FAIL", f"loss gap to autocast {max(gaps):.1e}")
        return Cell(name, plan_name, "ok", f"Δ{max(gaps):.0e}")
    if plan_name in RECOMPUTE:
        base = runs.compiled("fp32")
        # Bitwise is the eager backend's claim; inductor generates other kernels for a graph
        # with recomputed copies (BERT's embedding gradient moves in its last bits), so there
        # the cell is held to eager PyTorch at the fp32 tolerance instead.
        gap = _bitwise_gap(got, base) if runs.backend == "eager" else _fp32_gap(got, runs.eager())
        if gap:
            return Cell(name, plan_name, "FAIL", gap)
        ratio = got.saved_bytes / base.saved_bytes if base.saved_bytes else 1.0
        if plan_name == "selective" and not got.saved_bytes < base.saved_bytes:
            return Cell(name, plan_name, "FAIL", f"saved bytes unchanged ({got.saved_bytes})")
        return Cell(name, plan_name, "ok", f"{ratio:.2f}")
    want = runs.eager(microbatches=options.get("microbatches", 1), clip_norm=options.get("grad_clip_norm"))
    gap = _fp32_gap(got, want)
    return Cell(name, plan_name, "FAIL", gap) if gap else Cell(name, plan_name, "ok")


def full_recompute_ratio(name: str, layers: int = 4) -> float:
    """Saved bytes of ``full`` recompute over no recompute, on a ``layers``-layer model."""
    runs = ModelRuns(name, layers=layers)
    runs.batches = runs.batches[:1]
    return runs.compiled("full").saved_bytes / runs.compiled("fp32").saved_bytes


def format_matrix(cells: dict[tuple[str, str], Cell], models=MODELS, plans=tuple(PLANS)) -> str:
    """A Markdown table: model × plan -> ok / ratio / FAIL or refused with the reason."""
    rows = ["| model | " + " | ".join(plans) + " |", "|---" * (len(plans) + 1) + "|"]
    notes = []
    for m in models:
        row = []
        for p in plans:
            cell = cells.get((m, p))
            if cell is None:
                row.append("")
            elif cell.status == "ok":
                row.append(str(cell))
            else:
                notes.append(f"- {MODEL_TITLES[m]} × {p}: {cell.status}: {cell.detail}")
                row.append(f"{cell.status} [{len(notes)}]")
        rows.append(f"| {MODEL_TITLES[m]} | " + " | ".join(row) + " |")
    return "\n".join(rows + ([""] + [f"[{i + 1}] {n[2:]}" for i, n in enumerate(notes)] if notes else []))
