"""The fine-tuning recipe's configuration: what to train, on what, and with which plan.

A YAML file (``recipes/finetune/configs/*.yaml``) or keyword arguments; every
field is checked when the config is made and a bad value names the field and
the rule. ``plan`` holds the compiler's :class:`cann_passes.Plan` fields
(precision, recompute, microbatches, dp, zero_stage, backend, ...): the recipe
passes them to ``Plan.from_dict`` unchanged, so a field the compiler does not
know is refused by the compiler with its own message.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

METHODS = ("full", "lora", "freeze")
MASK_MODES = ("2d", "4d")
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


class ConfigError(ValueError):
    def __init__(self, field_name: str, rule: str, value: Any = None):
        self.field = field_name
        super().__init__(f"finetune config field '{field_name}' = {value!r}: {rule}")


@dataclass(frozen=True)
class FinetuneConfig:
    model_dir: str = "out/finetune/llama-tiny"   # a save_pretrained directory; made (random init) if absent
    # the run directory: config.yaml, metrics.jsonl, checkpoints/, loss.png, and model/ (save_pretrained's)
    out: str = "out/finetune/llama-tiny-finetuned"
    method: str = "lora"                        # full | lora | freeze
    # LoRA (peft): targets are module names or peft's "all-linear" (every linear layer but the head).
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # method freeze: parameters whose name matches one of these fnmatch patterns are not trained.
    freeze: tuple[str, ...] = ("model.embed_tokens.*", "model.layers.0.*")
    base_dtype: str = "fp32"                    # dtype the (frozen) base weights are loaded in: fp32 | bf16
    data: str | None = None                     # JSONL of {"prompt", "response"}; None: the shipped pairs
    seq_len: int = 160
    batch_size: int = 8
    steps: int = 200
    schedule_steps: int | None = None           # the LR schedule's length; None: steps (see recipes/README.md)
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1                   # cosine decays to lr * min_lr_ratio
    attention_mask: str = "2d"                  # 2d: the padding mask as is; 4d: causal + padding, made here
    seed: int = 0
    eval_batches: int = 4
    cpu_threads: int | None = None              # torch intra-op threads on CPU; None: torch's default
    plan: dict = field(default_factory=lambda: {"backend": "eager"})

    def __post_init__(self):
        for name in ("lora_targets", "freeze"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(name, "must be a list of non-empty strings", value)
            object.__setattr__(self, name, tuple(value))
        if not isinstance(self.plan, dict):
            raise ConfigError("plan", "must be a mapping of plan fields", self.plan)
        object.__setattr__(self, "plan", dict(self.plan))
        self._check()

    def _check(self) -> None:
        for name, choices in (("method", METHODS), ("attention_mask", MASK_MODES),
                              ("base_dtype", ("fp32", "bf16"))):
            if getattr(self, name) not in choices:
                raise ConfigError(name, f"must be one of {', '.join(choices)}", getattr(self, name))
        for name in ("lora_r", "seq_len", "batch_size", "steps", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, "must be an integer >= 1", value)
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ConfigError("cpu_threads", "must be an integer >= 1 or null", self.cpu_threads)
        if self.schedule_steps is not None and (not isinstance(self.schedule_steps, int) or self.schedule_steps < 1):
            raise ConfigError("schedule_steps", "must be an integer >= 1 or null", self.schedule_steps)
        length = self.schedule_length
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps <= length:
            raise ConfigError("warmup_steps", f"must be an integer in [0, {self.schedule_name}={length}]",
                              self.warmup_steps)
        for name, low, high in (("lr", 0.0, None), ("lora_alpha", 0.0, None), ("weight_decay", -1e-12, None),
                                ("lora_dropout", -1e-12, 1.0), ("min_lr_ratio", -1e-12, 1.0 + 1e-12)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= low or (
                    high is not None and value >= high):
                bounds = f"> {max(low, 0)}" if high is None else f"in [{max(low, 0)}, {high:g})"
                raise ConfigError(name, f"must be a number {bounds}", value)
        if self.method == "freeze" and not self.freeze:
            raise ConfigError("freeze", "method 'freeze' needs at least one pattern", self.freeze)

    @property
    def schedule_length(self) -> int:
        return self.schedule_steps or self.steps

    @property
    def schedule_name(self) -> str:
        return "schedule_steps" if self.schedule_steps else "steps"

    @classmethod
    def from_dict(cls, data: dict) -> "FinetuneConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], f"is not a finetune config field; fields are: {', '.join(sorted(known))}",
                              data[unknown[0]])
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FinetuneConfig":
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as exc:
                raise ConfigError("<file>", f"{path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("<file>", f"{path} must hold a mapping of config fields", data)
        return cls.from_dict(data)

    def replace(self, **changes) -> "FinetuneConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
