"""The Plan: one typed, validated description of how to compile a training step.

Every field is checked when the plan is made; an invalid value raises
:class:`PlanError` naming the field and the rule. Fields for capabilities
that need a pass which is not registered accept only their default and
otherwise raise ``NotImplementedError`` naming the capability, so a plan never
silently ignores what it asks for.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE_POLICIES = ("none", "full", "selective", "every_n_layers", "budget")
BACKENDS = ("auto", "eager", "inductor", "torchair")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")
VERIFY_LEVELS = ("off", "shallow", "deep")
LOSS_SCALES = ("auto", "none", "static", "dynamic", "adaptive")
DEVICE_PROFILES = ("auto", "cpu", "ascend_910b", "ascend_a3", "a100", "h100", "h200")
ALLREDUCE_ALGOS = ("auto", "ring", "tree")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class PlanError(ValueError):
    """A plan field breaks a rule; the message names the field and the rule."""

    def __init__(self, field_name: str, rule: str, value: Any = None):
        self.field = field_name
        super().__init__(f"plan field '{field_name}' = {value!r}: {rule}")


@dataclass(frozen=True)
class Plan:
    precision: str = "fp32"
    loss_scale: str = "auto"                   # auto: dynamic for fp16, none otherwise
    loss_scale_init: float = 65536.0
    loss_scale_growth_interval: int = 2000
    autocast_overrides: dict = field(default_factory=dict)  # op name or module path -> fp32/bf16/fp16
    grad_reduce_dtype: str = "fp32"            # dtype gradients are reduced in across ranks
    recompute: str = "none"
    recompute_budget: float | None = None      # fraction (<= 1.0) or bytes (> 1) of saved activations
    recompute_every_n: int = 1
    recompute_bans: tuple[str, ...] = ()       # op names or module paths never recomputed
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    microbatches: int = 1
    accumulate_target: int | None = None       # dynamic accumulation: samples per optimizer step
    pipeline_schedule: str = "1f1b"
    allreduce_algo: str = "auto"
    bucket_mb: float = 25.0
    backend: str = "auto"
    device_profile: str = "auto"
    pipeline: str | None = None               # full pipeline text; overrides the one built from fields
    extra_passes: tuple[str, ...] = ()         # pipeline text appended before lowering passes
    dump_dir: str | None = None
    verify: str = "shallow"
    torchair: dict = field(default_factory=dict)  # CompilerConfig options, see lowering/torchair_config

    def __post_init__(self):
        for name in ("extra_passes", "recompute_bans"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise PlanError(name, "must be a list of strings", value)
            object.__setattr__(self, name, tuple(value))
        for name in ("autocast_overrides", "torchair"):
            if not isinstance(getattr(self, name), dict):
                raise PlanError(name, "must be a mapping", getattr(self, name))
            object.__setattr__(self, name, dict(getattr(self, name)))
        self._check_values()
        self._check_capabilities()
        self._check_pipelines()

    # -- validation -------------------------------------------------------------------------
    def _one_of(self, name: str, choices: tuple) -> None:
        value = getattr(self, name)
        if value not in choices:
            raise PlanError(name, f"must be one of {', '.join(map(repr, choices))}", value)

    def _check_pipelines(self) -> None:
        """Pipeline texts parse now, not at the first step after a capture."""
        from .pass_manager import Pipeline, PipelineError
        for name, texts in (("pipeline", [self.pipeline] if self.pipeline else []),
                            ("extra_passes", self.extra_passes)):
            for text in texts:
                try:
                    Pipeline.parse(text)
                except PipelineError as exc:
                    raise PlanError(name, str(exc), text) from None

    def _positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(name, "must be an integer >= 1", value)

    def _check_values(self) -> None:
        for name, choices in (("precision", PRECISIONS), ("recompute", RECOMPUTE_POLICIES),
                              ("backend", BACKENDS), ("pipeline_schedule", PIPELINE_SCHEDULES),
                              ("verify", VERIFY_LEVELS), ("allreduce_algo", ALLREDUCE_ALGOS),
                              ("loss_scale", LOSS_SCALES), ("device_profile", DEVICE_PROFILES),
                              ("grad_reduce_dtype", ("fp32", "bf16"))):
            self._one_of(name, choices)
        for name in ("dp", "tp", "pp", "microbatches", "recompute_every_n", "loss_scale_growth_interval"):
            self._positive_int(name)
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError("zero_stage", "must be 0, 1, 2 or 3", self.zero_stage)
        if self.zero_stage and self.dp == 1:
            raise PlanError("zero_stage", "ZeRO shards over data-parallel ranks and needs dp > 1",
                            self.zero_stage)
        if not (_is_number(self.loss_scale_init) and 0 < self.loss_scale_init < float("inf")):
            raise PlanError("loss_scale_init", "must be a positive number", self.loss_scale_init)
        if self.loss_scale not in ("auto", "none") and self.precision == "fp32":
            raise PlanError("loss_scale", "applies only to precision bf16 or fp16", self.loss_scale)
        for key, value in self.autocast_overrides.items():
            if value not in PRECISIONS:
                raise PlanError(f"autocast_overrides.{key}", f"must be one of {PRECISIONS}", value)
        if self.accumulate_target is not None and (not isinstance(self.accumulate_target, int)
                                                   or isinstance(self.accumulate_target, bool)
                                                   or self.accumulate_target < 1):
            raise PlanError("accumulate_target", "must be a positive integer (samples per step)",
                            self.accumulate_target)
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise PlanError("dump_dir", "must be a directory path", self.dump_dir)
        if not (_is_number(self.bucket_mb) and self.bucket_mb > 0):
            raise PlanError("bucket_mb", "must be a positive number of MiB", self.bucket_mb)
        budget = self.recompute_budget
        if budget is not None and (not _is_number(budget) or budget < 0):
            raise PlanError("recompute_budget", "must be a fraction in [0, 1] or a byte count > 1",
                            budget)
        if self.recompute == "budget" and budget is None:
            raise PlanError("recompute_budget", "is required when recompute is 'budget'", budget)
        if self.recompute != "budget" and budget is not None:
            raise PlanError("recompute_budget", "only applies when recompute is 'budget'", budget)
        from .lowering.torchair_config import config_assignments
        try:
            config_assignments(self.torchair)
        except ValueError as exc:
            raise PlanError("torchair", str(exc), self.torchair) from None
        if not all(isinstance(p, str) and p.strip() for p in self.extra_passes):
            raise PlanError("extra_passes", "must be a list of non-empty pipeline texts",
                            self.extra_passes)

    def _check_capabilities(self) -> None:
        from .pass_manager import is_registered

        needs = [("precision", self.precision != "fp32", "autocast", "mixed precision"),
                 ("recompute", self.recompute != "none", "recompute", "recompute selection"),
                 ("dp", self.dp > 1, "data_parallel", "data parallelism"),
                 ("zero_stage", self.zero_stage > 0, "optimizer_shard", "ZeRO optimizer sharding"),
                 ("microbatches", self.microbatches > 1, "grad_accumulation", "gradient accumulation"),
                 ("accumulate_target", self.accumulate_target is not None, "grad_accumulation",
                  "dynamic gradient accumulation"),
                 ("tp", self.tp > 1, "tensor_parallel", "tensor parallelism"),
                 ("pp", self.pp > 1, "pipeline_parallel", "pipeline parallelism")]
        for field_name, asked, pass_name, capability in needs:
            if asked and not is_registered(pass_name):
                raise NotImplementedError(
                    f"plan field '{field_name}' = {getattr(self, field_name)!r} asks for {capability}, "
                    f"which is not built yet (no '{pass_name}' pass is registered)")
        if self.grad_reduce_dtype != "fp32":
            raise NotImplementedError(
                f"plan field 'grad_reduce_dtype' = {self.grad_reduce_dtype!r} asks for gradient "
                "reduction in low precision, which is not built yet (gradients are reduced in fp32)")
        if self.pipeline_schedule != "1f1b" and self.pp == 1:
            raise PlanError("pipeline_schedule", "only applies when pp > 1", self.pipeline_schedule)

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict):
            raise PlanError("<plan>", "a plan must be a mapping of field names to values", data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(unknown[0], f"is not a plan field; fields are: {', '.join(sorted(known))}",
                            data[unknown[0]])
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """A plan from a .yaml/.yml or .json file."""
        text = open(path, encoding="utf-8").read()
        try:
            data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise PlanError("<file>", f"{path} is not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: "
                            f"{exc}") from None
        return cls.from_dict(data or {})

    @property
    def effective_loss_scale(self) -> str:
        if self.loss_scale == "auto":
            return "dynamic" if self.precision == "fp16" else "none"
        return self.loss_scale

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)
