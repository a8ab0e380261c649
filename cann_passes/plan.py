"""The Plan: one typed, validated description of how to compile a training step.

Every field is checked when the plan is made; an invalid value raises
:class:`PlanError` naming the field and the rule. A field that cannot apply
given another field (``recompute_every_n`` without the ``every_n_layers``
policy, ``loss_scale_init`` without loss scaling, ``torchair`` options for
another backend) is refused naming both: a plan never accepts a value and then
ignores it. With ``pipeline`` text the text decides which passes run, so every
field that shapes the pipeline must agree with the text.

Fields for capabilities that need a pass which is not registered accept only
their default and otherwise raise ``NotImplementedError`` naming the
capability.

Types are strict: booleans and floats are not integers, NaN and infinity are
not numbers here. Files are read as YAML 1.1 (PyYAML), which turns unquoted
``off``/``no``/``false`` into ``False``: an enum field whose choices include
``off`` or ``none`` takes ``False`` as that choice; any other boolean for an
enum field is refused saying what YAML did.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE_POLICIES = ("none", "full", "selective", "every_n_layers", "budget")
BACKENDS = ("auto", "eager", "inductor", "torchair")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zb1p", "dualpipev", "dynamic")
VERIFY_LEVELS = ("off", "shallow", "deep")
LOSS_SCALES = ("auto", "none", "static", "dynamic", "adaptive")
DEVICE_PROFILES = ("auto", "cpu", "ascend_910b", "ascend_a3", "a100", "h100", "h200")
ALLREDUCE_ALGOS = ("auto", "ring", "tree")
TP_STYLES = ("column", "row", "vocab", "replicate")
OPTIMIZER_KERNELS = ("auto", "foreach", "fused", "none")
MATMUL_KERNELS = ("auto", "aten", "onednn")

_ENUMS = {"precision": PRECISIONS, "recompute": RECOMPUTE_POLICIES, "backend": BACKENDS,
          "pipeline_schedule": PIPELINE_SCHEDULES, "verify": VERIFY_LEVELS,
          "allreduce_algo": ALLREDUCE_ALGOS, "loss_scale": LOSS_SCALES,
          "device_profile": DEVICE_PROFILES, "grad_reduce_dtype": ("fp32", "bf16"),
          "zero_master": ("whole", "sharded"), "optimizer_kernel": OPTIMIZER_KERNELS,
          "matmul_kernel": MATMUL_KERNELS,
          "cp_attention": ("gather", "ring")}
_POSITIVE_INTS = ("dp", "ep", "cp", "tp", "pp", "microbatches", "recompute_every_n", "loss_scale_growth_interval",
                  "pipeline_virtual_stages")


def _is_number(value: Any) -> bool:
    """A finite real number; booleans are not numbers."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class PlanError(ValueError):
    """A plan field breaks a rule; the message names the field and the rule."""

    def __init__(self, field_name: str, rule: str, value: Any = None):
        self.field = field_name
        if field_name == "<file>":   # the file itself, not one of its fields
            super().__init__(f"plan file {value!r}: {rule}" if value is not None else f"plan file: {rule}")
        else:
            super().__init__(f"plan field '{field_name}' = {value!r}: {rule}")


@dataclass(frozen=True)
class Plan:
    precision: str = "fp32"
    loss_scale: str = "auto"                   # auto: dynamic for fp16, none otherwise
    loss_scale_init: float = 65536.0
    loss_scale_growth_interval: int = 2000
    autocast_overrides: dict = field(default_factory=dict)  # op name or module path -> fp32/bf16/fp16
    grad_reduce_dtype: str = "fp32"            # dtype gradients are reduced in across ranks
    sync_batch_norm: bool = False              # BatchNorm's batch statistics over the dp group (SyncBatchNorm)
    recompute: str = "none"
    recompute_budget: float | None = None      # fraction (<= 1.0) or bytes (> 1) of saved activations
    recompute_every_n: int = 1
    recompute_bans: tuple[str, ...] = ()       # op names or module paths never recomputed
    model_blocks: tuple[str, ...] = ()         # module-path globs of the repeated blocks, where detection needs help
    attention_ops: tuple[str, ...] = ()        # fused attention ops beyond SDPA's ("aten.my_attention")
    dp: int = 1
    ep: int = 1                                # expert parallel: the experts split over ep of the dp ranks
    cp: int = 1                                # context parallel: each sequence split over cp ranks
    cp_attention: str = "gather"               # cp: K/V all-gathered, or passed round the ring (no explicit mask)
    tp: int = 1
    tp_rules: dict = field(default_factory=dict)  # module-path pattern -> column|row|vocab|replicate[:parts]
    sequence_parallel: bool = False            # tp: norms/dropout on sequence shards (all-gather + reduce-scatter)
    vocab_parallel_loss: bool = False          # tp: cross-entropy on vocabulary-sharded logits
    pp: int = 1
    zero_stage: int = 0
    zero_master: str = "whole"                 # ZeRO-1/2: fp32 parameters whole, or sharded with the optimizer state
    microbatches: int = 1
    accumulate_target: int | None = None       # dynamic accumulation: samples per optimizer step
    grad_clip_norm: float | None = None        # clip the global gradient 2-norm to this (grad_clip pass)
    # The update as multi-tensor ops (fuse_optimizer, pp = 1): foreach (bitwise torch.optim's
    # foreach=True on CPU), fused (torch's fused Adam kernels: refused, see the pass), none;
    # auto: foreach on inductor and torchair, none on eager (whose in-place updates need per-tensor ops).
    optimizer_kernel: str = "auto"
    # float32 CPU matmuls (linear_on_onednn): aten (MKL), onednn, or auto: on inductor each where a
    # timing finds oneDNN faster, on eager aten (bitwise eager PyTorch); no effect off CPU.
    matmul_kernel: str = "auto"
    # Inductor's lowering in a child process while the first steps run on the eager lowering of the
    # same program; its runners take over between two steps (cann_passes.background_lowering).
    background_lowering: bool = False
    pipeline_schedule: str = "1f1b"            # cann_passes.schedules; dynamic = chosen by simulation
    pipeline_virtual_stages: int = 1           # stages per rank (interleaved_1f1b >= 2, zb1p any, dualpipev 2)
    pipeline_split: str | tuple = "cost"       # "cost" (the balancer) or layers per stage (pp * v counts)
    allreduce_algo: str = "auto"
    bucket_mb: float = 25.0
    backend: str = "auto"
    device_profile: str = "auto"
    pipeline: str | None = None               # full pipeline text; overrides the one built from fields
    extra_passes: tuple[str, ...] = ()         # pipeline text appended before lowering passes
    dump_dir: str | None = None
    # Compile cache directory, or "off"; None: $CANN_PASSES_COMPILE_CACHE, else ~/.cache (compile_cache.py).
    compile_cache: str | None = None
    verify: str = "shallow"
    torchair: dict = field(default_factory=dict)  # CompilerConfig options, see lowering/torchair_config

    def __post_init__(self):
        self._normalize()
        self._check_values()
        self._check_pipeline_parallel()
        self._check_capabilities()
        self._check_pipelines()
        self._check_dependencies()
        self._check_tensor_parallel()
        if self.pipeline is not None:
            self._check_against_pipeline_text()

    # -- validation -------------------------------------------------------------------------
    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _normalize(self) -> None:
        """Container and number types the rules below can rely on."""
        for name in ("extra_passes", "recompute_bans", "model_blocks", "attention_ops"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise PlanError(name, "must be a list of strings", value)
            if not all(isinstance(v, str) for v in value):
                raise PlanError(name, "must be a list of strings", value)
            self._set(name, tuple(value))
        for name in ("autocast_overrides", "torchair"):
            if not isinstance(getattr(self, name), dict):
                raise PlanError(name, "must be a mapping", getattr(self, name))
            self._set(name, dict(getattr(self, name)))
        for name, choices in _ENUMS.items():
            value = getattr(self, name)
            if isinstance(value, bool):
                off = next((c for c in ("off", "none") if c in choices), None)
                if value is False and off is not None:
                    self._set(name, off)       # YAML 1.1 reads `verify: off` as False
                    continue
                raise PlanError(name, f"must be one of {', '.join(map(repr, choices))}; a boolean is "
                                "none of them (YAML 1.1 reads unquoted on/off/yes/no/true/false as "
                                "booleans: quote the value)", value)
        for name in _POSITIVE_INTS + ("zero_stage", "accumulate_target"):
            value = getattr(self, name)
            if _is_int(value) and type(value) is not int:
                self._set(name, int(value))     # numpy and other integral types

    def _one_of(self, name: str, choices: tuple) -> None:
        value = getattr(self, name)
        if not isinstance(value, str) or value not in choices:
            raise PlanError(name, f"must be one of {', '.join(map(repr, choices))}", value)

    def _check_pipelines(self) -> None:
        """Pipeline texts parse now, not at the first step after a capture."""
        from .pass_manager import Pipeline, PipelineError
        if self.pipeline is not None and (not isinstance(self.pipeline, str) or not self.pipeline.strip()):
            raise PlanError("pipeline", "must be non-empty pipeline text such as 'cleanup,cleanup' "
                            "(or null for the pipeline built from the plan's fields)", self.pipeline)
        for name, texts in (("pipeline", [self.pipeline] if self.pipeline else []),
                            ("extra_passes", self.extra_passes)):
            for text in texts:
                try:
                    Pipeline.parse(text)
                except PipelineError as exc:
                    raise PlanError(name, str(exc), text) from None

    def _positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if not _is_int(value) or value < 1:
            raise PlanError(name, "must be an integer >= 1", value)

    def _check_values(self) -> None:
        for name, choices in _ENUMS.items():
            self._one_of(name, choices)
        for name in _POSITIVE_INTS:
            self._positive_int(name)
        if not _is_int(self.zero_stage) or self.zero_stage not in (0, 1, 2, 3):
            raise PlanError("zero_stage", "must be the integer 0, 1, 2 or 3", self.zero_stage)
        if self.zero_stage and self.dp == 1:
            raise PlanError("zero_stage", "ZeRO shards over data-parallel ranks and needs dp > 1",
                            self.zero_stage)
        if not (_is_number(self.loss_scale_init) and self.loss_scale_init > 0):
            raise PlanError("loss_scale_init", "must be a finite positive number", self.loss_scale_init)
        if self.loss_scale not in ("auto", "none") and self.precision == "fp32":
            raise PlanError("loss_scale", "applies only to precision bf16 or fp16 (precision = 'fp32')",
                            self.loss_scale)
        for key, value in self.autocast_overrides.items():
            if not isinstance(key, str) or not key:
                raise PlanError("autocast_overrides", "keys must be op names or module paths", key)
            if not isinstance(value, str) or value not in PRECISIONS:
                raise PlanError(f"autocast_overrides.{key}", f"must be one of {PRECISIONS}", value)
        if self.accumulate_target is not None and (not _is_int(self.accumulate_target)
                                                   or self.accumulate_target < 1):
            raise PlanError("accumulate_target", "must be a positive integer (samples per step)",
                            self.accumulate_target)
        if self.dump_dir is not None and (not isinstance(self.dump_dir, (str, os.PathLike))
                                          or not str(self.dump_dir).strip()):
            raise PlanError("dump_dir", "must be a directory path", self.dump_dir)
        if self.compile_cache is not None and (not isinstance(self.compile_cache, (str, os.PathLike))
                                               or not str(self.compile_cache).strip()):
            raise PlanError("compile_cache", "must be a directory path or 'off'", self.compile_cache)
        if not (_is_number(self.bucket_mb) and self.bucket_mb > 0):
            raise PlanError("bucket_mb", "must be a finite positive number of MiB", self.bucket_mb)
        if self.grad_clip_norm is not None and not (_is_number(self.grad_clip_norm) and self.grad_clip_norm > 0):
            raise PlanError("grad_clip_norm", "must be a finite number > 0 (or null for no clipping)",
                            self.grad_clip_norm)
        self._check_budget()
        from .lowering.torchair_config import config_assignments
        try:
            config_assignments(self.torchair)
        except ValueError as exc:
            raise PlanError("torchair", str(exc), self.torchair) from None
        if not all(p.strip() for p in self.extra_passes):
            raise PlanError("extra_passes", "must be a list of non-empty pipeline texts",
                            self.extra_passes)

    def _check_budget(self) -> None:
        budget = self.recompute_budget
        rule = "must be a fraction in [0, 1] of the saved activations or a whole byte count > 1"
        if budget is not None and (not _is_number(budget) or budget < 0
                                   or (budget > 1 and float(budget) != int(budget))):
            raise PlanError("recompute_budget", rule, budget)
        if self.recompute == "budget" and budget is None:
            raise PlanError("recompute_budget", "is required when recompute is 'budget'", budget)
        if self.recompute != "budget" and budget is not None:
            raise PlanError("recompute_budget",
                            f"only applies when recompute is 'budget' (recompute = {self.recompute!r})",
                            budget)

    def _check_capabilities(self) -> None:
        from .pass_manager import is_registered

        needs = [("precision", self.precision != "fp32", "autocast", "mixed precision"),
                 ("recompute", self.recompute != "none", "recompute", "recompute selection"),
                 ("dp", self.dp > 1, "data_parallel", "data parallelism"),
                 ("sync_batch_norm", self.sync_batch_norm, "sync_batch_norm", "synchronised batch norm"),
                 ("zero_stage", self.zero_stage > 0, "optimizer_shard", "ZeRO optimizer sharding"),
                 ("microbatches", self.microbatches > 1, "grad_accumulation", "gradient accumulation"),
                 ("accumulate_target", self.accumulate_target is not None, "grad_accumulation",
                  "dynamic gradient accumulation"),
                 ("tp", self.tp > 1, "tensor_parallel", "tensor parallelism"),
                 ("cp", self.cp > 1, "context_parallel", "context parallelism"),
                 ("ep", self.ep > 1, "expert_parallel", "expert parallelism"),
                 ("pp", self.pp > 1, "pipeline_split", "pipeline parallelism")]
        for field_name, asked, pass_name, capability in needs:
            if asked and not is_registered(pass_name):
                raise NotImplementedError(
                    f"plan field '{field_name}' = {getattr(self, field_name)!r} asks for {capability}, "
                    f"which is not built yet (no '{pass_name}' pass is registered)")
        if self.ep > 1:
            self._check_expert_parallel()
        if self.cp > 1 and self.sequence_parallel:
            raise PlanError("cp", "context parallelism with sequence_parallel: both split the sequence "
                                  "dimension; use one of them", self.cp)

    def _check_expert_parallel(self) -> None:
        """What expert parallelism composes with so far, refused by field."""
        if self.dp % self.ep:
            raise PlanError("ep", f"the expert-parallel ranks are data-parallel ranks (dp = edp x ep, as "
                                  f"Megatron's expert-data-parallel groups): ep must divide dp = {self.dp}",
                            self.ep)
        if self.backend in ("inductor", "torchair"):
            raise PlanError("ep", f"expert parallelism runs on the eager backend only (backend = "
                                  f"{self.backend!r}): the rows a rank receives depend on the routing, and "
                                  "the graph's static shapes carry only their balanced count", self.ep)

    def _check_pipeline_parallel(self) -> None:
        """The pipeline fields: each schedule's own requirements (torch's), refused by field.

        ``dualpipev`` runs exactly two stages per rank: ``pipeline_virtual_stages`` left at its
        default 1 becomes 2, any other value is refused. ``dynamic`` picks the schedule (and so
        the stage count) by simulation, so a layer-count split cannot be given with it.
        """
        from .schedules import ScheduleError, check
        split = self.pipeline_split
        if isinstance(split, (list, tuple)):
            if not split or not all(_is_int(c) and c >= 1 for c in split):
                raise PlanError("pipeline_split", "must be 'cost' or a list of whole layer counts >= 1, "
                                "one per stage", split)
            self._set("pipeline_split", tuple(int(c) for c in split))
        elif split != "cost":
            raise PlanError("pipeline_split", "must be 'cost' (split by the cost model) or a list of "
                            "layer counts, one per stage", split)
        if self.pp == 1:
            for name in ("pipeline_schedule", "pipeline_virtual_stages", "pipeline_split"):
                if self._changed(name):
                    raise PlanError(name, "only applies when pp > 1 (pp = 1)", getattr(self, name))
            return
        schedule, v = self.pipeline_schedule, self.pipeline_virtual_stages
        if schedule == "dualpipev" and v == 1:
            self._set("pipeline_virtual_stages", 2)
            v = 2
        if schedule == "dynamic":
            if isinstance(self.pipeline_split, tuple):
                raise PlanError("pipeline_split", "a layer-count split needs a fixed schedule: "
                                "pipeline_schedule = 'dynamic' chooses the number of stages", split)
            return
        fields = {"virtual_stages": "pipeline_virtual_stages", "microbatches": "microbatches",
                  "pp": "pp"}
        try:
            check(schedule, self.pp, self.microbatches, v)
        except ScheduleError as exc:
            name = fields[exc.field]
            raise PlanError(name, f"{exc} (pipeline_schedule = {schedule!r})", getattr(self, name)) from None
        if isinstance(self.pipeline_split, tuple):
            stages = self.pp * (2 if schedule == "dualpipev" else v)
            if len(self.pipeline_split) != stages:
                raise PlanError("pipeline_split", f"needs one layer count per stage: {stages} stages "
                                f"(pp = {self.pp} x {stages // self.pp} per rank under "
                                f"{schedule!r}), got {len(self.pipeline_split)}", self.pipeline_split)

    def _changed(self, name: str) -> bool:
        """Whether a field differs from its default: only such a field can be ignored."""
        f = next(f for f in dataclasses.fields(self) if f.name == name)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        return getattr(self, name) != default

    def _check_dependencies(self) -> None:
        """Fields that apply only together with another field's value, named together."""
        if self.microbatches > 1 and self.accumulate_target is not None and self.pp == 1:
            raise PlanError("microbatches", "cannot be combined with accumulate_target "
                            f"(= {self.accumulate_target}): static accumulation splits each batch into "
                            "microbatches, dynamic accumulation takes each batch as one; choose one",
                            self.microbatches)
        if self.torchair and self.backend not in ("torchair", "auto"):
            raise PlanError("torchair", "options apply only to backend 'torchair' "
                            f"(backend = {self.backend!r})", self.torchair)
        for name in ("bucket_mb", "allreduce_algo", "grad_reduce_dtype"):
            if self._changed(name) and self.dp == 1:
                raise PlanError(name, "applies only to gradient reduction across data-parallel ranks "
                                "(dp = 1)", getattr(self, name))
        if not isinstance(self.sync_batch_norm, bool):
            raise PlanError("sync_batch_norm", "must be true or false", self.sync_batch_norm)
        if self.sync_batch_norm and self.dp == 1:
            raise PlanError("sync_batch_norm", "takes BatchNorm's statistics over the data-parallel ranks "
                            "and needs dp > 1 (dp = 1)", True)
        if not isinstance(self.background_lowering, bool):
            raise PlanError("background_lowering", "must be true or false", self.background_lowering)
        if self._changed("zero_master") and self.zero_stage not in (1, 2):
            raise PlanError("zero_master", "applies only to zero_stage 1 or 2 (stage 3 always shards the "
                            f"parameters; zero_stage = {self.zero_stage})", self.zero_master)
        if self._changed("zero_master") and (self.microbatches > 1 or self.accumulate_target is not None
                                              or self.pp > 1):
            raise PlanError("zero_master", "'sharded' is not built with gradient accumulation or pp > 1 "
                            "(the whole parameters would be gathered once per microbatch)", self.zero_master)
        if self.pipeline is not None:
            return   # the text decides the passes: _check_against_pipeline_text
        if self.optimizer_kernel == "fused" and self.backend == "torchair":
            raise PlanError("optimizer_kernel", "'fused' (torch's fused Adam kernel as cann::fused_adam) has "
                            "no GE converter; on torchair use 'foreach', which lowers to GE's Foreach* ops",
                            self.optimizer_kernel)
        if self.matmul_kernel == "onednn" and self.backend == "torchair":
            raise PlanError("matmul_kernel", "'onednn' applies to CPU matmuls (the inductor and eager "
                            "backends); torchair's matmuls are GE's", self.matmul_kernel)
        if self.optimizer_kernel in ("foreach", "fused") and self.pp > 1:
            raise PlanError("optimizer_kernel", "applies only at pp = 1 (the pipeline stages' updates "
                            f"stay per parameter: a multi-tensor op would span stages; pp = {self.pp})",
                            self.optimizer_kernel)
        if self._changed("recompute_every_n") and self.recompute != "every_n_layers":
            raise PlanError("recompute_every_n", "only applies when recompute is 'every_n_layers' "
                            f"(recompute = {self.recompute!r})", self.recompute_every_n)
        if self.recompute_bans and self.recompute == "none":
            raise PlanError("recompute_bans", "only applies when recompute is not 'none' "
                            "(recompute = 'none')", self.recompute_bans)
        if self.autocast_overrides and self.precision == "fp32":
            raise PlanError("autocast_overrides", "only applies to precision bf16 or fp16 "
                            "(precision = 'fp32')", self.autocast_overrides)
        scaling = self.effective_loss_scale
        for name in ("loss_scale_init", "loss_scale_growth_interval"):
            if not self._changed(name):
                continue
            if scaling == "none":
                why = ("precision = 'fp32' has no loss scaling" if self.precision == "fp32" else
                       f"loss_scale = {self.loss_scale!r} means no loss scaling for precision "
                       f"{self.precision!r}")
                raise PlanError(name, f"applies only with loss scaling ({why})", getattr(self, name))
            if name == "loss_scale_growth_interval" and scaling != "dynamic":
                raise PlanError(name, f"applies only when loss_scale is 'dynamic' (loss_scale = "
                                f"{self.loss_scale!r}: {scaling})", getattr(self, name))

    def _check_tensor_parallel(self) -> None:
        """tp_rules' styles; the tensor-parallel fields apply only with tp > 1."""
        if not isinstance(self.tp_rules, dict):
            raise PlanError("tp_rules", "must be a mapping of module-path pattern to a style", self.tp_rules)
        for pattern, style in self.tp_rules.items():
            kind, _, parts = style.partition(":") if isinstance(style, str) else ("", "", "")
            if not isinstance(pattern, str) or not pattern.strip() or any(c in pattern for c in ';="'):
                raise PlanError("tp_rules", "keys must be module-path patterns (fnmatch, without ; = or \")",
                                pattern)
            if kind not in TP_STYLES or (parts and not (parts.isdigit() and int(parts) >= 1)):
                raise PlanError(f"tp_rules.{pattern}", f"must be one of {', '.join(TP_STYLES)}, optionally "
                                "with :parts for a fused projection (column:3 for q/k/v in one weight)", style)
        for name in ("sequence_parallel", "vocab_parallel_loss"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(name, "must be true or false", getattr(self, name))
        for name in ("tp_rules", "sequence_parallel", "vocab_parallel_loss"):
            if self._changed(name) and self.tp == 1:
                raise PlanError(name, "applies only to tensor parallelism (tp = 1)", getattr(self, name))

    def _check_against_pipeline_text(self) -> None:
        """With ``pipeline`` text, a field that shapes the pipeline must be what the text does."""
        from .pass_manager import Pipeline, get_pass
        passes = Pipeline.parse(self.pipeline).passes

        def find(pass_name: str):
            found = [p for p in passes if p.name == pass_name]
            if not found:
                return None
            defaults = {k: o.default for k, o in get_pass(pass_name).options.items()}
            return defaults | dict(found[0].options)

        def refuse(name: str, rule: str) -> None:
            raise PlanError(name, f"{rule} in the plan's pipeline text {self.pipeline!r}; with pipeline "
                            "text the text decides the passes, so this field would be ignored",
                            getattr(self, name))

        def agree(name: str, pass_name: str, option: str | None = None, value: Any = None) -> None:
            options = find(pass_name)
            if options is None:
                refuse(name, f"needs the pass '{pass_name}'")
            if option is not None and options[option] != value:
                refuse(name, f"disagrees with {pass_name}{{{option}={options[option]}}}")

        if self.precision != "fp32":
            agree("precision", "autocast", "dtype", self.precision)
        if self.autocast_overrides:
            agree("autocast_overrides", "autocast", "overrides",
                  tuple(f"{k}={v}" for k, v in self.autocast_overrides.items()))
        if self.loss_scale == "none" and find("loss_scale") is not None:
            refuse("loss_scale", "is 'none' but there is a 'loss_scale' pass")
        elif self.loss_scale not in ("auto", "none"):
            agree("loss_scale", "loss_scale", "mode", self.loss_scale)
        if self._changed("loss_scale_init"):
            agree("loss_scale_init", "loss_scale", "init", self.loss_scale_init)
        if self._changed("loss_scale_growth_interval"):
            agree("loss_scale_growth_interval", "loss_scale", "growth_interval",
                  self.loss_scale_growth_interval)
        if self.recompute != "none":
            agree("recompute", "recompute", "policy", self.recompute)
        if self.recompute_budget is not None:
            agree("recompute_budget", "recompute", "budget", self.recompute_budget)
        if self._changed("recompute_every_n"):
            agree("recompute_every_n", "recompute", "every_n", self.recompute_every_n)
        for name, option in (("recompute_bans", "bans"), ("model_blocks", "blocks"), ("attention_ops", "attention_ops")):
            if getattr(self, name):
                agree(name, "recompute", option, tuple(getattr(self, name)))
        if self._changed("device_profile"):
            for pass_name in ("recompute", "pipeline_split"):
                if find(pass_name) is not None:
                    agree("device_profile", pass_name, "profile", self.device_profile)
        texts = {str(p) for p in passes}
        for extra in self.extra_passes:
            if not {str(p) for p in Pipeline.parse(extra).passes} <= texts:
                refuse("extra_passes", f"{extra!r} is not")
        accumulation = find("grad_accumulation")
        if self.microbatches > 1:
            agree("microbatches", "grad_accumulation", "microbatches", self.microbatches)
        if self.accumulate_target is not None:
            agree("accumulate_target", "grad_accumulation", "target", self.accumulate_target)
        if accumulation is not None and self.microbatches == 1 and self.accumulate_target is None:
            raise PlanError("pipeline", "has a 'grad_accumulation' pass, which needs microbatches > 1 "
                            "or accumulate_target (microbatches = 1, accumulate_target = None)",
                            self.pipeline)
        if self.zero_stage:
            agree("zero_stage", "optimizer_shard", "stage", self.zero_stage)
        if self._changed("zero_master"):
            agree("zero_master", "optimizer_shard", "master", self.zero_master)
        elif self.dp > 1:
            agree("dp", "data_parallel")
        if self._changed("bucket_mb"):
            agree("bucket_mb", "optimizer_shard" if self.zero_stage else "data_parallel", "bucket_mb",
                  self.bucket_mb)
        if getattr(self, "grad_clip_norm", None) is not None:
            agree("grad_clip_norm", "grad_clip", "max_norm", self.grad_clip_norm)
        if self.optimizer_kernel == "none" and find("fuse_optimizer") is not None:
            refuse("optimizer_kernel", "is 'none' but there is a 'fuse_optimizer' pass")
        elif self.optimizer_kernel in ("foreach", "fused"):
            agree("optimizer_kernel", "fuse_optimizer", "kernel", self.optimizer_kernel)
        if self.matmul_kernel == "aten" and find("linear_on_onednn") is not None:
            refuse("matmul_kernel", "is 'aten' but there is a 'linear_on_onednn' pass")
        elif self.matmul_kernel == "onednn":
            agree("matmul_kernel", "linear_on_onednn", "choose", "always")
        if self.tp > 1:
            agree("tp", "tensor_parallel")
        if self.cp > 1:
            agree("cp", "context_parallel")
            if self.cp_attention != "gather":
                agree("cp_attention", "context_parallel", "attention", self.cp_attention)
        if self.ep > 1:
            agree("ep", "expert_parallel")
        if self.pp > 1:
            agree("pp", "pipeline_split")

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict):
            raise PlanError("<plan>", "a plan must be a mapping of field names to values", data)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if not isinstance(key, str):
                raise PlanError(str(key), "is not a plan field: field names are strings", data[key])
        unknown = sorted(set(data) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise PlanError(unknown[0], f"is not a plan field; {hint}fields are: {', '.join(sorted(known))}",
                            data[unknown[0]])
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """A plan from a .yaml/.yml or .json file; an empty file is an error, ``{}`` the default plan."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"Plan.load: path must be a file path, got {type(path).__name__} {path!r}")
        kind = "JSON" if str(path).endswith(".json") else "YAML"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanError("<file>", f"cannot be read: {exc.strerror or exc}", str(path)) from None
        try:
            data = (json.loads(text, object_pairs_hook=_unique_keys) if kind == "JSON"
                    else yaml.load(text, Loader=_UniqueKeyLoader))
        except (json.JSONDecodeError, yaml.YAMLError, _DuplicateKey) as exc:
            raise PlanError("<file>", f"{path} is not valid {kind}: {exc}") from None
        if data is None:
            raise PlanError("<file>", "is empty (or null): write {} for the default plan", str(path))
        return cls.from_dict(data)

    @property
    def effective_loss_scale(self) -> str:
        if self.loss_scale == "auto":
            return "dynamic" if self.precision == "fp16" else "none"
        return self.loss_scale

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"field {key!r} is given twice")
        out[key] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"field {key!r} is given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
