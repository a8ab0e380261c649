"""The pipeline a plan compiles with: every built-in pass, in order, in one place.

    cleanup                      dead code, duplicate pure ops
    attention_masks_as_flags     constant attention masks    (always; a mask made from no input that is
                                                              causal becomes is_causal, one that hides
                                                              nothing goes)
    autocast{dtype,policy}       mixed precision             (plan.precision != fp32)
    loss_scale{mode,...}         fp16 loss scaling           (plan.effective_loss_scale != none; when
                                                              accumulating, after grad_accumulation:
                                                              it checks the accumulated gradients)
    tensor_parallel{...}         Megatron tensor parallelism (plan.tp > 1)
    context_parallel             the sequence split over cp  (plan.cp > 1; after tensor_parallel:
                                                              it re-traces tp's per-rank graph)
    expert_parallel              experts split over ep       (plan.ep > 1; rows sent to their experts'
                                                              ranks and back by all-to-alls)
    sync_batch_norm              BatchNorm over the dp batch (plan.sync_batch_norm; statistics and their
                                                              gradients' sums all-reduced over dp)
    recompute{policy,budget}     activation recompute        (plan.recompute != none)
    recompute_pointwise          fusible pointwise values    (backend inductor; computed again
                                                              inside backward's kernels, not kept)
    grad_accumulation{...}       accumulate over microbatches (plan.microbatches > 1 or accumulate_target)
    data_parallel{...}           gradient all-reduce         (plan.dp > 1; in bf16 with
                                                              plan.grad_reduce_dtype)
    optimizer_shard{stage,...}   ZeRO                        (plan.zero_stage > 0)
    grad_clip{max_norm}          global grad-norm clipping   (plan.grad_clip_norm set; after every
                                                              pass that changes what the update reads)
    fuse_optimizer{kernel}       the update as _foreach_* ops (plan.optimizer_kernel: auto is foreach
                                                              except on eager; pp = 1; after every pass
                                                              that writes the update)
    <plan.extra_passes>          the user's own passes
    npu_legalize                 Ascend converter coverage   (backend torchair)
    cleanup
    split_grad_apply             grad / apply graphs         (accumulating plans, pp = 1)
    pipeline_split{stages,...}   pipeline stage graphs       (plan.pp > 1)
    spell_out_alpha              inductor's addmm pattern    (backend inductor)
    linear_on_onednn{choose}     CPU matmuls on oneDNN       (plan.matmul_kernel: auto is measured on
                                                              inductor, none on eager; float32 CPU)

With pp > 1 the plan's ``microbatches`` are the pipeline's: ``grad_accumulation``
gives every parameter its accumulator and ``pipeline_split`` (not
``split_grad_apply``) cuts the accumulating step into stages, whose backward
graphs add each microbatch's gradient and whose apply graphs update once per
step; the runtime's accumulation loop does not run. Gradients are
all-reduced (or reduce-scattered) one parameter at a time, so every
collective lands in the stage that owns its gradient.

What composes with pp > 1 on the (pp, dp, tp) mesh: static microbatches, dp,
ZeRO-1/2/3 (ZeRO-3: each stage gathers its parameters' shards where it reads them, every
microbatch; the accumulated gradients are reduce-scattered once per step), tp (the stage
graphs keep each rank's tp collectives), weights tied
across stages (their parts all-reduced over the pp group, or over a group of
just the pipeline ranks holding them; two holders on one rank, as DualPipeV's
first and last stage, update once there; under ZeRO-3 each holder gathers its
own shard), global grad-norm clipping (also with
ZeRO-1/2 and tp) and fp16 loss scaling (each stage checks its own gradients,
the flags combined over the pp group; see ``pipeline_split``), and dynamic
accumulation (``accumulate_target``: each call runs the plan's microbatches through
the pipeline, the accumulators carry over calls, and the update runs once the
samples of every data-parallel rank reach the target); clipping and loss scaling
also with several stages per rank (each rank sums its stages' terms).

``fuse_optimizer`` runs only at pp = 1: ``pipeline_split`` cuts the graph per stage after
it, and a multi-tensor op over two stages' parameters would not split (the stage graphs'
updates stay per parameter). ``foreach`` is bitwise the unfused step (on CPU each foreach op
runs the per-tensor op per element); ``auto`` (the default) picks it for inductor and torchair
and leaves the eager backend's update per tensor, where ``reuse_dead_operands`` writes
parameters and state in place (it marks per-tensor pointwise ops, not ``_foreach_*``). A user's
``torch.optim`` optimizer with ``fused=True`` is refused at capture (``graph_ir.optimizers``),
so the default does not follow the optimizer's own flag; ``fused`` itself is refused by the
pass (torch's fused Adam kernels take the hyperparameters as compile-time floats).

A plan's ``pipeline`` field replaces all of this with its own text.

This is the only reader of the Plan on the way to the passes: every choice a pass
makes is one of its options here, so the pipeline text alone reproduces a run.
:data:`PLAN_FIELD_OF` says which plan field set each option, so that the compile
driver can name the user's field when a pass refuses an option.
"""
from __future__ import annotations

from .pass_manager import Pipeline, is_registered, spec
from .plan import Plan, PlanError

# With pp > 1 each gradient is its own bucket (any positive size below one gradient's bytes): a
# bucket spanning two stages' gradients would be a collective no stage could run alone.
ONE_BUCKET_PER_GRADIENT_MB = 1e-9

# (pass, option) -> the plan field build_pipeline sets it from.
PLAN_FIELD_OF: dict[tuple[str, str], str] = {
    ("autocast", "dtype"): "precision", ("autocast", "overrides"): "autocast_overrides",
    ("loss_scale", "mode"): "loss_scale", ("loss_scale", "init"): "loss_scale_init",
    ("loss_scale", "growth_interval"): "loss_scale_growth_interval",
    ("tensor_parallel", "extra_rules"): "tp_rules", ("tensor_parallel", "sequence_parallel"): "sequence_parallel",
    ("tensor_parallel", "vocab_parallel_loss"): "vocab_parallel_loss",
    ("recompute", "policy"): "recompute", ("recompute", "budget"): "recompute_budget",
    ("recompute", "every_n"): "recompute_every_n", ("recompute", "profile"): "device_profile",
    ("recompute", "bans"): "recompute_bans", ("recompute", "blocks"): "model_blocks",
    ("recompute", "attention_ops"): "attention_ops",
    ("grad_accumulation", "microbatches"): "microbatches", ("grad_accumulation", "target"): "accumulate_target",
    ("data_parallel", "bucket_mb"): "bucket_mb", ("data_parallel", "algo"): "allreduce_algo",
    ("data_parallel", "reduce_dtype"): "grad_reduce_dtype", ("optimizer_shard", "reduce_dtype"): "grad_reduce_dtype",
    ("optimizer_shard", "stage"): "zero_stage", ("optimizer_shard", "bucket_mb"): "bucket_mb",
    ("optimizer_shard", "master"): "zero_master",
    ("grad_clip", "max_norm"): "grad_clip_norm", ("fuse_optimizer", "kernel"): "optimizer_kernel",
    ("linear_on_onednn", "choose"): "matmul_kernel",
    ("pipeline_split", "stages"): "pp", ("pipeline_split", "pp"): "pp",
    ("pipeline_split", "schedule"): "pipeline_schedule", ("pipeline_split", "layers"): "pipeline_split",
    ("pipeline_split", "profile"): "device_profile",
}


def plan_field_of(plan: Plan, pass_name: str, option: str) -> str | None:
    """The plan field that set ``pass_name``'s ``option`` in ``build_pipeline(plan)``; None for
    a plan with its own pipeline text (the text set it) or an option no field sets."""
    if plan.pipeline:
        return None
    field = PLAN_FIELD_OF.get((pass_name, option))
    if field == "pp" and option == "stages" and plan.pipeline_virtual_stages > 1:
        return "pipeline_virtual_stages"
    return field


def build_pipeline(plan: Plan, backend: str, *, optimizer_fused: bool = False) -> Pipeline:
    """The plan's pass pipeline for ``backend``. ``optimizer_fused``: the captured optimizer runs
    torch's fused kernel (``AdamW(fused=True)``), which ``auto`` then picks too."""
    if plan.pipeline:
        return Pipeline.parse(plan.pipeline)
    if plan.pp > 1:
        _check_pipeline_plan(plan)
    steps: list = ["cleanup", "attention_masks_as_flags"]
    if plan.precision != "fp32":
        overrides = tuple(f"{k}={v}" for k, v in plan.autocast_overrides.items())
        steps.append(spec("autocast", dtype=plan.precision, policy="npu" if backend == "torchair" else "cuda",
                          **({"overrides": overrides} if overrides else {})))
    accumulating = plan.microbatches > 1 or plan.accumulate_target is not None or plan.pp > 1
    loss_scale = (f"loss_scale{{mode={plan.effective_loss_scale},init={plan.loss_scale_init},"
                  f"growth_interval={plan.loss_scale_growth_interval}}}"
                  if plan.effective_loss_scale != "none" else None)
    if loss_scale and not accumulating:
        steps.append(loss_scale)
    if plan.tp > 1:
        steps.append(str(spec("tensor_parallel", extra_rules=";".join(f"{k}={v}" for k, v in plan.tp_rules.items()),
                              sequence_parallel=plan.sequence_parallel,
                              vocab_parallel_loss=plan.vocab_parallel_loss)))
    if plan.cp > 1:
        # With dp (one stage) the gradients' parts over cp are summed by data_parallel's buckets
        # over dp and cp at once, or by ZeRO after its reduce-scatter over dp (a 1/dp shard over
        # cp), rather than all-reduced whole over cp first.
        options = {"attention": plan.cp_attention} if plan.cp_attention != "gather" else {}
        if plan.dp > 1 and plan.pp == 1 and plan.ep == 1:
            options["gradients"] = "partial"
        steps.append(str(spec("context_parallel", **options)) if options else "context_parallel")
    if plan.ep > 1:
        steps.append("expert_parallel")
    if plan.sync_batch_norm:
        steps.append("sync_batch_norm")
    if plan.recompute != "none":
        steps.append(recompute_spec(plan))
    if backend == "inductor":
        steps.append("recompute_pointwise")
    if accumulating:
        # Under ep an expert's gradient sums every group rank's loss: the samples weight the seed.
        weight = ",weight=seed" if plan.ep > 1 and plan.accumulate_target is not None else ""
        steps.append(f"grad_accumulation{{microbatches={plan.microbatches},"
                     f"target={plan.accumulate_target or 0}{weight}}}")
        if loss_scale:   # unscale and check the accumulated gradients, once per optimizer step
            steps.append(loss_scale)
    bucket_mb = ONE_BUCKET_PER_GRADIENT_MB if plan.pp > 1 else plan.bucket_mb
    reduce_dtype = f",reduce_dtype={plan.grad_reduce_dtype}" if plan.grad_reduce_dtype != "fp32" else ""
    if plan.dp > 1 and plan.zero_stage == 0:
        steps.append(f"data_parallel{{bucket_mb={bucket_mb},algo={plan.allreduce_algo}{reduce_dtype}}}")
    if plan.zero_stage:
        master = ",master=sharded" if getattr(plan, "zero_master", "whole") == "sharded" else ""
        steps.append(f"optimizer_shard{{stage={plan.zero_stage},bucket_mb={bucket_mb}{master}{reduce_dtype}}}")
    if plan.grad_clip_norm is not None:
        steps.append(f"grad_clip{{max_norm={float(plan.grad_clip_norm)!r}}}")
    kernel = optimizer_kernel(plan, backend, optimizer_fused=optimizer_fused)
    if kernel != "none" and plan.pp == 1:
        steps.append(str(spec("fuse_optimizer", kernel=kernel)))
    steps.extend(plan.extra_passes)
    if backend == "torchair" and is_registered("npu_legalize"):
        steps.append("npu_legalize")
    steps.append("cleanup")
    if plan.pp > 1:
        steps.append(str(pipeline_split_spec(plan)))
    elif plan.microbatches > 1 or plan.accumulate_target is not None:
        steps.append("split_grad_apply")
    if backend == "inductor":
        steps.append("spell_out_alpha")
    choose = matmul_choice(plan, backend)
    if choose != "none":
        steps.append(str(spec("linear_on_onednn", choose=choose)))
    return Pipeline.of(*steps)


def matmul_choice(plan: Plan, backend: str) -> str:
    """``plan.matmul_kernel`` as linear_on_onednn's ``choose`` option, ``none`` for no pass: ``auto``
    measures on inductor (whose fusions already round otherwise than eager) and leaves the eager
    backend on ATen's kernels, bitwise eager PyTorch."""
    if plan.matmul_kernel == "onednn" and backend in ("eager", "inductor"):
        return "always"
    if plan.matmul_kernel == "auto" and backend == "inductor":
        return "measured"
    return "none"


def optimizer_kernel(plan: Plan, backend: str, *, optimizer_fused: bool = False) -> str:
    """``plan.optimizer_kernel`` with ``auto`` resolved per backend (the fuse_optimizer option).
    An optimizer made with ``fused=True`` gets torch's fused kernel on eager and inductor, so that
    the step updates bitwise as it does eagerly. Otherwise:

    - eager: none. Its per-tensor updates are written in place (``reuse_dead_operands``) and are
      bitwise the default single-tensor ``torch.optim``, which the fused kernel rounds otherwise;
    - inductor: torch's fused Adam kernel where the optimizer is Adam/AdamW, foreach otherwise:
      inductor calls it instead of generating and compiling the update's code;
    - torchair: foreach (GE's Foreach* operators; the fused kernel has no GE converter)."""
    if plan.optimizer_kernel != "auto":
        return plan.optimizer_kernel
    if optimizer_fused and backend in ("eager", "inductor"):
        return "fused"
    return {"eager": "none", "inductor": "fused_or_foreach"}.get(backend, "foreach")


def recompute_spec(plan: Plan):
    options = {"policy": plan.recompute, "every_n": plan.recompute_every_n}
    if plan.recompute_budget is not None:
        options["budget"] = plan.recompute_budget
    for option, field in (("bans", "recompute_bans"), ("blocks", "model_blocks"), ("attention_ops", "attention_ops")):
        if getattr(plan, field):
            options[option] = tuple(getattr(plan, field))
    if plan.device_profile != "auto":
        options["profile"] = plan.device_profile
    return spec("recompute", **options)


def pipeline_stages(plan: Plan) -> int:
    from .schedules import stages_per_rank
    return plan.pp * stages_per_rank(plan.pipeline_schedule, plan.pipeline_virtual_stages)


def pipeline_split_spec(plan: Plan):
    layers = "" if plan.pipeline_split == "cost" else ";".join(str(c) for c in plan.pipeline_split)
    return spec("pipeline_split", stages=pipeline_stages(plan), pp=plan.pp, schedule=plan.pipeline_schedule,
                layers=layers, profile=plan.device_profile)


def _check_pipeline_plan(plan: Plan) -> None:
    """What a pipelined plan must have resolved before its pipeline is built, refused by field."""
    if plan.pipeline_schedule == "dynamic":
        raise PlanError("pipeline_schedule", "'dynamic' is resolved to a schedule by the planning layer "
                                             "(cann_passes.planning.resolve_plan) before the pipeline is "
                                             "built", plan.pipeline_schedule)
