"""Pipeline parallelism on gloo: our stage graphs on torch.distributed.pipelining's schedules.

Each launch starts the ranks once (``pp_worker.py``) and runs several plans one after
the other in them; every plan starts from the same initial weights and is compared with
plain eager PyTorch trained on the same global batches in this process: SGD (momentum)
parameters to 1e-5, AdamW losses to 1e-5, over ``pp_worker.STEPS`` (10) steps; each rank holds
and checks only its own stages' parameters. The eager reference is trained once per model and
optimizer. Ranks run one intra-op thread each, as torchrun starts them: several ranks share
the machine's cores, and more threads than cores only make the tiny ops wait on each other.
fp16 plans (loss scaling) are compared with the same plan compiled at pp = 1 in this process
(``_fp16_reference``), over ``pp_worker.FP16_STEPS`` (4) steps.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

from cann_passes import compile_for_npu
from cann_passes.runtime.distributed import launch_local, rank_failures
from cann_passes.schedules import timeline_from_events
from tests.gloo_scenarios import PRELOAD

sys.path.insert(0, str(Path(__file__).parent))
import pp_worker  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).parent / "pp_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_intra_op_thread")]  # the eager reference too


def _launch(tmp_path_factory, name: str, nprocs: int, model: str, pp: int, dp: int, configs: list[str],
            tp: int = 1):
    out = tmp_path_factory.mktemp(name)
    results = launch_local([WORKER, str(out), model, str(pp), str(dp), str(tp), *configs], nprocs,
                           env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, timeout_s=900, cwd=str(REPO), preload=PRELOAD)
    report = rank_failures(results)
    assert not report, report
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


@functools.cache
def _reference(model_name: str, optimizer: str, clip: float | None = None):
    model, opt = pp_worker.make_model(model_name, optimizer)
    loss_fn = pp_worker.loss_fn(model_name)
    losses, clipped = [], 0
    for i in range(pp_worker.STEPS):
        opt.zero_grad()
        loss = loss_fn(model, pp_worker.global_batch(model_name, i))
        loss.backward()
        if clip is not None:
            clipped += float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) > clip
        opt.step()
        losses.append(loss.item())
    assert clip is None or clipped >= pp_worker.STEPS // 2, "the clip norm must bind for the test to mean anything"
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def _fp16_reference(config: str, dp: int, pp: int):
    """Single-process fp16 training with the loss-scale pass: the same plan at pp = 1, with the
    microbatches of every (dp, pipeline) rank, so that each microbatch's backward (where fp16
    overflows) sees the rows it sees in the pipeline. Losses, parameters, (overflow, scale) per step."""
    model_name, what = pp_worker.parse_config(config, "")
    plan = pp_worker.plan_for(what, pp, dp, 1)
    plan = plan.replace(pp=1, dp=1, microbatches=plan.microbatches * dp, pipeline_schedule="1f1b",
                        pipeline_virtual_stages=1, verify="deep")
    model, opt = pp_worker.make_model(model_name, what.split(":")[1])
    step = compile_for_npu(model, plan, optimizer=opt, loss_fn=pp_worker.loss_fn(model_name))
    losses, scaling = [], []
    for i in range(pp_worker.steps_for(plan)):
        losses.append(float(step(pp_worker.global_batch(model_name, i))))
        scaling.append((bool(step.metrics["loss_scale:found_inf"]), float(step.step_state.values["loss_scale:scale"])))
    assert {skip for skip, _ in scaling} == {True, False}, f"{config}: the test needs skipped and applied steps"
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, scaling


def _check_fp16(ranks: list[dict], config: str, dp: int = 1, pp: int = 2):
    """Every rank: the reference's losses and (overflow, scale) trajectory; the parameters of its
    stages within 1e-5 (fp32 master weights; 5e-5 under AdamW, see below)."""
    ref_losses, ref_params, ref_scaling = _fp16_reference(config, dp, pp)
    for rank, result in enumerate(ranks):
        got = result[config]
        assert got["scaling"] == ref_scaling, f"{config} rank {rank}: (overflow, scale) per step"
        for i, (loss, want) in enumerate(zip(got["losses"], ref_losses, strict=True)):
            assert abs(loss - want) <= 1e-5 * abs(want), f"{config} rank {rank} step {i}: loss {loss} vs {want}"
        # AdamW divides each step by the gradient's own root mean square, so fp16-gradient rounding
        # (a stage boundary rounds where one process does not; clipping's sums of squares combine in
        # stage order) becomes a fraction of an lr-sized step: 5e-5 for it, 1e-5 for SGD
        tol = 5e-5 if ":adamw" in config else 1e-5
        for name, value in got["params"].items():
            err = (value - ref_params[name]).abs().max().item()
            assert err <= tol, f"{config} rank {rank}: parameter {name} differs by {err:.2e}"
    held = {name for result in ranks for name in result[config]["params"]}
    assert held == set(ref_params)


def _clip_of(config: str) -> float | None:
    what = pp_worker.parse_config(config, "")[1]
    return next((float(o.removeprefix("clip=")) for o in what.split(":")[2:] if o.startswith("clip=")), None)


def _check(ranks: list[dict], config: str, model_name: str, dp: int = 1, tp: int = 1):
    model_name, what = pp_worker.parse_config(config, model_name)
    optimizer = what.split(":")[1]
    ref_losses, ref_params = _reference(model_name, optimizer, _clip_of(config))
    for rank, result in enumerate(ranks):
        for i, (got, want) in enumerate(zip(result[config]["losses"], ref_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{config} rank {rank} step {i}: loss {got} vs {want}"
    # The (pp, dp, tp) mesh numbers ranks pp-major: ranks [k * dp * tp, (k + 1) * dp * tp) hold pipeline
    # rank k's stages; every one of them holds the same full parameters (tp shards gathered).
    per_pp = dp * tp
    params: dict = {}
    shared = set(ranks[0][config]["shared"])
    for k in range(len(ranks) // per_pp):
        group = ranks[k * per_pp:(k + 1) * per_pp]
        for replica in group[1:]:
            assert set(replica[config]["params"]) == set(group[0][config]["params"])
            for name, value in replica[config]["params"].items():
                assert torch.equal(value, group[0][config]["params"][name]), f"replicas differ at {name}"
        mine = group[0][config]["params"]
        for name, value in mine.items():
            if name in params:   # a weight tied across stages: every stage holding it applies the same update
                assert name in shared, f"{name} is held by two pipeline ranks"
                assert torch.equal(value, params[name]), f"the stages sharing {name} hold different values"
        params.update(mine)
    assert set(params) == set(ref_params)
    if optimizer == "sgd":
        for name, want in ref_params.items():
            err = (params[name] - want).abs().max().item()
            assert err <= 1e-5, f"{config}: parameter {name} differs by {err:.2e}"
        # and every rank's model.state_dict() is the whole trained model, not only its own stages
        for rank, result in enumerate(ranks):
            for name, want in ref_params.items():
                err = (result[config]["every"][name] - want).abs().max().item()
                assert err <= 1e-5, f"{config} rank {rank}: state_dict()[{name!r}] differs by {err:.2e}"


PP2 = ["gpipe:sgd", "1f1b:sgd", "interleaved_1f1b:sgd:2", "zb1p:sgd", "dualpipev:sgd", "1f1b:adamw"]

# One test per launch, one subtest per plan: under ``pytest -n`` a module fixture shared by several
# tests would be launched again in every worker that runs one of them.


def test_pp2_gpt_every_schedule_matches_single_process_training(tmp_path_factory, subtests):
    pp2 = _launch(tmp_path_factory, "pp2", 2, "gpt4", 2, 1, PP2)
    for config in PP2:
        with subtests.test(config=config):
            _check(pp2, config, "gpt4")
    for config, kinds in (("1f1b:sgd", "FB"), ("zb1p:sgd", "FIW"), ("interleaved_1f1b:sgd:2", "FB")):
        with subtests.test(timeline=config):
            # The measured timeline has every action once.
            events = [e for r in pp2 for e in r[config]["events"]]
            timeline = timeline_from_events(events)
            stages, m = pp2[0][config]["stages"], pp_worker.microbatches_for(config.split(":")[0], 2)
            for kind in kinds:
                got = sorted((e.stage, e.microbatch) for e in timeline.events if e.kind == kind)
                assert got == sorted((s, i) for s in range(stages) for i in range(m)), (config, kind)
            assert 0.0 < timeline.bubble_fraction < 1.0


def test_pp4_heavy_head_matches_single_process_training(tmp_path_factory, subtests):
    configs = ["1f1b:sgd", "zb1p:sgd"]
    pp4 = _launch(tmp_path_factory, "pp4", 4, "heavy_head", 4, 1, configs)
    for config in configs:
        with subtests.test(config=config):
            _check(pp4, config, "heavy_head")


# fp16 with dynamic loss scaling: the initial scale makes some steps overflow (skipped by every rank,
# the scale halved) and the growth interval of 2 makes the scale grow between them.
FP16 = "fp16:scale=524288:grow=2"


def test_dp2_x_pp2_matches_single_process_training(tmp_path_factory, subtests):
    # Global clipping over ZeRO-1 shards (the squared shard norms all-reduced over dp and pp); fp16 loss
    # scaling, the overflow flag combined over the stages and over dp.
    # ZeRO-3: each stage gathers its parameters' shards over dp where it reads them (every
    # microbatch), the accumulated gradients are reduce-scattered once per step, each shard updated.
    # GPT-2's embedding tied to its head under ZeRO-3: each stage holding it gathers its shard where
    # it reads it, the holders' gradients summed over the pipeline ranks, each shard updated (also
    # interleaved 1F1B, two stages per rank).
    configs = ["1f1b:sgd", "1f1b:adamw", "1f1b:sgd:clip=0.5:zero1", f"llama/1f1b:sgd:{FP16}", "1f1b:sgd:zero3",
               "llama/1f1b:sgd:clip=0.5:zero3", "gpt2/1f1b:adamw:clip=0.5:zero3", "gpt2/interleaved_1f1b:sgd:2:zero3"]
    ranks = _launch(tmp_path_factory, "dp2pp2", 4, "gpt4", 2, 2, configs)
    for config in configs:
        with subtests.test(config=config):
            if "fp16" in config:
                _check_fp16(ranks, config, dp=2)
            else:
                _check(ranks, config, "gpt4", dp=2)
            if config.endswith("zero3"):   # a rank keeps half of its own stages' parameters, padded
                for result in ranks:
                    own = sum(v.numel() for v in result[config]["params"].values())
                    assert own / 2 <= result[config]["shard_numel"] <= own / 2 + len(result[config]["params"])


def test_tp2_x_pp2_gpt_and_llama_match_single_process_training(tmp_path_factory, subtests):
    """A (pp=2, tp=2) mesh: every stage graph holds its tensor-parallel collectives, over its
    pipeline rank's tp group; the stages send their tp shards of the boundary values."""
    # Global clipping, the squared norms of tp shards summed over tp, then over pp; the last also in
    # fp16 with loss scaling (ZB1P: the seed is scaled in the last stage's input-gradient part), the
    # overflow flag combined over tp and over pp.
    configs = ["1f1b:sgd", "llama/zb1p:sgd", "llama/gpipe:adamw", "llama/1f1b:sgd:clip=0.5",
               f"llama/zb1p:sgd:clip=0.5:{FP16}"]
    ranks = _launch(tmp_path_factory, "tp2pp2", 4, "gpt4", 2, 1, configs, tp=2)
    for config in configs:
        with subtests.test(config=config):
            if "fp16" in config:
                _check_fp16(ranks, config)
            else:
                _check(ranks, config, "gpt4", tp=2)


@pytest.mark.skipif((os.cpu_count() or 1) < 8, reason="8 gloo ranks on fewer than 8 cores: run by hand, "
                    "python tests/pipeline/pp_worker.py under launch_local (see the test)")
def test_dp2_x_tp2_x_pp2_matches_single_process_training(tmp_path_factory):
    """The 3-D mesh, 8 ranks: pipeline ranks send over their (dp, tp) coordinate's pp group, tensor
    parallel collectives run over their tp group, gradients are all-reduced over dp."""
    ranks = _launch(tmp_path_factory, "dp2tp2pp2", 8, "gpt4", 2, 2, ["1f1b:sgd"], tp=2)
    _check(ranks, "1f1b:sgd", "gpt4", dp=2, tp=2)


def test_tied_weights_and_global_grad_clipping_across_stages_match_single_process_training(tmp_path_factory,
                                                                                         subtests):
    """GPT2LMHeadModel ties its embedding to the head, read by the first and the last stage: both hold it,
    each accumulates its part of the gradient, an all-reduce over the pipeline ranks sums the parts and
    both apply the same update. Global grad-norm clipping: each stage's squared norms are summed over
    the pipeline ranks, so every stage clips by the same coefficient (``clip_grad_norm_``'s); with
    several stages per rank (interleaved 1F1B, DualPipeV) each rank sums its stages' first. DualPipeV
    puts GPT-2's first and last stage on rank 0: the tie is summed there, without an all-reduce.
    Interleaved 1F1B puts them on ranks 0 and 1: with clipping, each rank's updating stage applies
    first and hands the summed tied gradient to its other stage's apply."""
    configs = ["gpt2/1f1b:sgd", "gpt2/gpipe:adamw", "1f1b:sgd:clip=0.5", "gpt2/zb1p:sgd:clip=0.5",
               "gpt2/interleaved_1f1b:sgd:2", f"llama/gpipe:sgd:{FP16}", f"gpt2/1f1b:adamw:{FP16}",
               # several stages per rank: each rank's stages combine their terms before the all-reduce
               "dualpipev:sgd:clip=0.5", f"gpt4/interleaved_1f1b:adamw:2:clip=0.5:{FP16}",
               # a weight tied within one rank, also with clipping and loss scaling (a stage holding the embedding
               # alone: its gradient, placed with the gradient it reads, is computed by the home stage)
               "gpt2/dualpipev:sgd", "gpt2/dualpipev:adamw:clip=0.5", f"gpt2/dualpipev:adamw:clip=0.5:{FP16}",
               # tied across ranks with several stages per rank: each rank's updating stage sums first
               "gpt2/interleaved_1f1b:adamw:2:clip=0.5", f"gpt2/interleaved_1f1b:sgd:2:clip=0.5:{FP16}",
               # Gemma: its embedding tied to the head (and scaled by sqrt(hidden) in the forward)
               "gemma/dualpipev:sgd:clip=0.5", "gemma/interleaved_1f1b:adamw:2:clip=0.5"]
    ranks = _launch(tmp_path_factory, "tied_clip", 2, "gpt4", 2, 1, configs)
    for config in configs:
        with subtests.test(config=config):
            if "fp16" in config:
                # fp16 loss scaling: each stage checks its gradients, the flags are combined over the
                # pipeline ranks, and every rank skips and updates its scale alike (GPT-2: tied too)
                _check_fp16(ranks, config)
            else:
                _check(ranks, config, "gpt4")
            tied = {"gpt2": "transformer.wte.weight", "gemma": "model.embed_tokens.weight"}.get(config.split("/")[0])
            if tied:   # interleaved, DualPipeV: 4 stages, the last on rank 1 / rank 0
                last = 3 if "interleaved" in config or "dualpipev" in config else 1
                assert ranks[0][config]["shared"] == {tied: [0, last]}


@pytest.mark.parametrize("pp,dp", [(2, 1), (1, 2)])
def test_gpt_neox_parallel_residual_trains_like_eager_under_pp_and_dp_with_clipping(tmp_path_factory, subtests,
                                                                                    pp, dp):
    """GPT-NeoX's parallel residual sums the attention and MLP outputs, so the two output biases'
    gradients are one and the same computation: each stays its own parameter's value through the
    accumulators (4 microbatches), the stage split, the gradient buckets and global clipping."""
    configs = ["gpt_neox/1f1b:sgd", "gpt_neox/1f1b:adamw:clip=0.5"]
    ranks = _launch(tmp_path_factory, f"neox_pp{pp}_dp{dp}", pp * dp, "gpt4", pp, dp, configs)
    for config in configs:
        with subtests.test(config=config):
            _check(ranks, config, "gpt4", dp=dp)


def _accumulated_reference(model_name: str, optimizer: str, calls_per_step: int):
    """Eager PyTorch accumulating ``calls_per_step`` consecutive global batches per update (equal rows,
    so each batch's mean loss weighs alike): every call's loss, and the parameters at the end."""
    model, opt = pp_worker.make_model(model_name, optimizer)
    loss_fn = pp_worker.loss_fn(model_name)
    losses = []
    for i in range(pp_worker.STEPS):
        if i % calls_per_step == 0:
            opt.zero_grad()
        loss = loss_fn(model, pp_worker.global_batch(model_name, i))
        (loss / calls_per_step).backward()
        losses.append(loss.item())
        if i % calls_per_step == calls_per_step - 1:
            opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_pp2_dynamic_accumulation_updates_once_the_target_is_reached(tmp_path_factory, subtests):
    """accumulate_target with pp = 2: each call runs its microbatches through the pipeline, the
    accumulators carry over calls, the update runs once the samples reach the target (16 = two
    global batches of 8 rows), scaled by all of them; also at dp = 2 (the count summed over dp)."""
    configs = ["1f1b:sgd:target=16", "1f1b:adamw:target=16"]
    for dp in (1, 2):
        ranks = _launch(tmp_path_factory, f"target_dp{dp}", 2 * dp, "gpt4", 2, dp, configs)
        for config in configs:
            with subtests.test(config=config, dp=dp):
                optimizer = config.split(":")[1]
                want_losses, want = _accumulated_reference("gpt4", optimizer, 2)
                for rank, result in enumerate(ranks):
                    got = result[config]["losses"]
                    assert got == pytest.approx(want_losses, rel=1e-5), f"{config} rank {rank}"
                    if optimizer == "sgd":
                        for name, value in result[config]["every"].items():
                            err = (value - want[name]).abs().max().item()
                            assert err <= 1e-5, f"{config} rank {rank}: {name} differs by {err:.2e}"


def test_pp2_on_encoder_decoders_windows_and_alibi_matches_single_process_training(tmp_path_factory, subtests):
    """Families the split had not met: BART and Whisper (the encoder's output crosses to the decoder's
    stage with the residual stream), Swin (shifted windows, patch merging between stages) and BLOOM
    (ALiBi biases built from the mask, read by every layer). (ResNet's BatchNorm normalises each
    microbatch by its own statistics, as eager accumulation does: the conformance matrix checks
    it against that; one full-batch step is another computation.)"""
    configs = ["bart/1f1b:sgd", "whisper/1f1b:sgd", "swin/1f1b:sgd", "bloom/1f1b:adamw"]
    ranks = _launch(tmp_path_factory, "new_families_pp2", 2, "gpt4", 2, 1, configs)
    for config in configs:
        with subtests.test(config=config):
            _check(ranks, config, "gpt4")


def test_pp2_on_inductor_lowers_each_ranks_own_stages_and_takes_over_from_the_background(tmp_path_factory, subtests):
    """Inductor specialises a stage graph on its inputs' strides: a value handed between stage graphs
    is compiled for, and given in, the layout it was traced with (a saved transposed weight). Each rank
    lowers only the graphs its schedule runs of its own stages. With background_lowering (two stages
    a rank) the first steps run on the
    eager lowering while a child process compiles; the schedule's stages then run inductor's runners."""
    # ZB1P with every matmul on oneDNN: its input- and weight-gradient graphs call cann.onednn_linear
    configs = ["1f1b:adamw:inductor", "zb1p:sgd:inductor:onednn", "interleaved_1f1b:sgd:2:inductor:background"]
    ranks = _launch(tmp_path_factory, "pp2_inductor", 2, "gpt4", 2, 1, configs)
    for config in configs:
        with subtests.test(config=config):
            _check(ranks, config, "gpt4")
            for rank, result in enumerate(ranks):
                got = result[config]["lowering"]
                own = [s for s, r in enumerate(result[config]["stage_to_rank"]) if r == rank]
                # what the schedule runs of them: 1F1B the backward whole, ZB1P in its two parts
                parts = {"1f1b": ("forward", "backward", "apply"), "interleaved_1f1b": ("forward", "backward", "apply"),
                         "zb1p": ("forward", "backward_input", "backward_weight", "apply")}[config.split(":")[0]]
                assert set(got["lowered"]) == {f"stage{s}.{p}" for s in own for p in parts}, (rank, got)
                if "onednn" in config:   # the others' choice is the timing's, which the machine decides
                    assert got["onednn"] > 0, (rank, got)
                if "background" in config:
                    assert got["error"] is None and got["switched_at"] == 2, (rank, got)
                    assert got["runs_background"]
                    # two stages on a rank: the take-over found every graph the child compiled in the
                    # caches (stable_cache_keys; before, their keys differed and it compiled them again)
                    assert got["take_over_hits"] == len(got["lowered"]), (rank, got)
