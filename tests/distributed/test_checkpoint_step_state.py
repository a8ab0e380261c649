"""A DCP checkpoint carries fp16 dynamic loss scaling's state: a resumed run is the uninterrupted one.

A transformers LLaMA (built from its config, 2 layers) trains under fp16 with dynamic loss
scaling from a scale large enough that some steps overflow (skipped) and the scale backs off
and grows. Training 6 steps uninterrupted and training 3, saving with
``cann_passes.runtime.checkpoint.save``, building a fresh model and compiled step, loading and
training 3 more give bitwise the same losses, skip pattern, scale and growth tracker after every
step, and final parameters: in one process, on 2 gloo ranks with dp = 2 and ZeRO-1, and on
2 gloo ranks as a 2-stage pipeline (GPipe; each rank compares the parameters of its own stage,
the only ones it updates and saves). At the save point the scale and the tracker are not their
initial values, and a checkpoint without them (as written before step state was saved) loads
with a warning naming them and resumes differently: the comparison can fail.
Loading a checkpoint with loss-scale state into a step without loss scaling names the entries
it ignores.

This file is also the per-rank program: ``python tests/distributed/test_checkpoint_step_state.py OUTDIR MODE``
(MODE ``dp`` or ``pp``).
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from test_distributed import RANK_ENV, REPO, assert_all_ok  # noqa: E402

from cann_passes import Plan, compile_for_npu  # noqa: E402
from cann_passes.runtime import checkpoint  # noqa: E402
from tests.gloo_scenarios import PRELOAD  # noqa: E402
from tests import zoo  # noqa: E402

# In one process, from 2**21 with growth every 2 clean steps, steps 0, 1, 4, 5 overflow; after
# step 2 the scale is 2**19 and the tracker 1 (neither is its initial value). At dp=2 (2 rows a
# rank), from 2**20, steps 0, 1, 4, 5 overflow and step 2 leaves 2**18 and 1. The pipeline's
# microbatches of one row scale each row's own loss (larger gradients): from 2**15 step 4
# overflows, and step 2 leaves 2**16 and 1.
INIT, GROW, STEPS, SAVE_AFTER = 2.0 ** 21, 2, 6, 3
RANK_INIT = {"dp": 2.0 ** 20, "pp": 2.0 ** 15}
SCALE, TRACKER, FOUND_INF = "loss_scale:scale", "loss_scale:growth_tracker", "loss_scale:found_inf"


def fp16_plan(init: float = INIT, **fields) -> Plan:
    return Plan(backend="eager", precision="fp16", loss_scale_init=init, loss_scale_growth_interval=GROW, **fields)


def build(plan: Plan):
    entry = zoo.build("llama", layers=2, seed=0)
    optimizer = torch.optim.AdamW(entry.model.parameters(), lr=1e-3, weight_decay=0.01)
    return entry, compile_for_npu(entry.model, plan, optimizer=optimizer, loss_fn=entry.loss_fn)


def batch(i: int, rank: int = 0, size: int = 1):
    """Step ``i``'s global batch (4 rows, some right-padded), or data-parallel rank ``rank``'s rows of it."""
    from cann_passes.runtime.distributed import shard_batch
    whole = zoo.causal_lm_batch(1000 + i)
    return shard_batch(whole, rank, size) if size > 1 else whole


def train(step, steps: range, rank: int = 0, size: int = 1) -> list[tuple]:
    """Per step: (loss, skipped, scale after it, growth tracker after it)."""
    out = []
    for i in steps:
        loss = step(batch(i, rank, size))
        state = step.step_state.values
        out.append((None if loss is None else float(loss), bool(step.metrics[FOUND_INF]),
                    float(state[SCALE]), float(state[TRACKER])))
    return out


def params(model, names=None) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {n: state[n].detach().clone() for n, _ in model.named_parameters() if names is None or n in names}


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: parameter {name} differs by " \
                                              f"{(got[name].float() - value.float()).abs().max().item():.3e}"


def check_resumed(result: dict, what: str, init: float = INIT) -> None:
    full, resumed = result["uninterrupted"], result["resumed"]
    assert len(full) == STEPS and len(resumed) == STEPS - SAVE_AFTER, what
    saved_at = full[SAVE_AFTER - 1]
    assert (saved_at[2], saved_at[3]) != (init, 0.0), f"{what}: the save point's scale state is the initial one"
    skips = [s[1] for s in full]
    assert any(skips[SAVE_AFTER:]) and not all(skips[:SAVE_AFTER]), f"{what}: skips {skips}"
    assert resumed == full[SAVE_AFTER:], f"{what}: resumed {resumed} != uninterrupted {full[SAVE_AFTER:]}"
    assert_bitwise(result["resumed_params"], result["params"], what)


# -- one process -------------------------------------------------------------------------------------

def test_dynamic_loss_scale_state_is_persistent_and_accumulation_state_is_not():
    entry, step = build(fp16_plan(microbatches=2))
    step(batch(0))
    declared = {}
    for graph in step.last.program.graphs.values():
        declared.update(graph.attrs.get("step_state", {}))
    assert any(n.startswith("grad_accumulation:") for n in declared)
    assert set(checkpoint.persistent_step_state(step)) == {SCALE, TRACKER}
    _, static = build(Plan(backend="eager", precision="fp16", loss_scale="static", loss_scale_init=INIT))
    static(batch(0))
    assert checkpoint.persistent_step_state(static) == {}   # a static scale is the plan's constant


def test_resumed_fp16_training_is_bitwise_the_uninterrupted_run(tmp_path):
    entry, step = build(fp16_plan())
    full = train(step, range(SAVE_AFTER))
    checkpoint.save(step, tmp_path / "ckpt")
    full += train(step, range(SAVE_AFTER, STEPS))
    again_entry, again = build(fp16_plan())
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkpoint.CheckpointWarning)
        notes = checkpoint.load(again, tmp_path / "ckpt", batch(0))
    assert notes == []
    assert float(again.step_state.values[SCALE]) == full[SAVE_AFTER - 1][2]
    resumed = train(again, range(SAVE_AFTER, STEPS))
    check_resumed({"uninterrupted": full, "resumed": resumed, "params": params(entry.model),
                   "resumed_params": params(again_entry.model)}, "one process")
    # The optimizer state resumes too (Adam's step counts only the steps that were not skipped).
    for p, q in zip(entry.model.parameters(), again_entry.model.parameters()):
        for key, value in step.optimizer.state[p].items():
            assert torch.equal(again.optimizer.state[q][key], value), key


def test_a_checkpoint_without_step_state_loads_with_the_initial_scale_and_a_warning(tmp_path):
    import torch.distributed.checkpoint as dcp
    entry, step = build(fp16_plan())
    full = train(step, range(SAVE_AFTER))
    # What save wrote before step state was stored: the same entries without step_state/*.
    old = {k: v for k, v in checkpoint.state_dict(step).items() if not k.startswith(checkpoint.STEP_STATE_PREFIX)}
    dcp.save(old, checkpoint_id=str(tmp_path / "old"))
    full += train(step, range(SAVE_AFTER, STEPS))
    again_entry, again = build(fp16_plan())
    with pytest.warns(checkpoint.CheckpointWarning, match="loss_scale:growth_tracker.*loss_scale:scale") as caught:
        notes = checkpoint.load(again, tmp_path / "old", batch(0))
    ours = [str(w.message) for w in caught if w.category is checkpoint.CheckpointWarning]
    assert ours == notes and len(notes) == 1 and "initial value" in notes[0]
    assert float(again.step_state.values[SCALE]) == INIT and float(again.step_state.values[TRACKER]) == 0.0
    assert again.steps_run == SAVE_AFTER
    resumed = train(again, range(SAVE_AFTER, STEPS))
    # Restarting from the initial scale skips steps the uninterrupted run did not: what the stored
    # state prevents (and why the bitwise comparison above can fail).
    assert [s[1:] for s in resumed] != [s[1:] for s in full[SAVE_AFTER:]]


def test_loss_scale_state_loaded_into_a_step_without_loss_scaling_is_named_and_ignored(tmp_path):
    entry, step = build(fp16_plan())
    train(step, range(2))
    checkpoint.save(step, tmp_path / "ckpt")
    plain_entry, plain = build(Plan(backend="eager"))
    with pytest.warns(checkpoint.CheckpointWarning, match=r"step_state/loss_scale:growth_tracker.*"
                                                          r"step_state/loss_scale:scale.*ignored"):
        notes = checkpoint.load(plain, tmp_path / "ckpt", batch(0))
    assert len(notes) == 1
    assert SCALE not in plain.step_state.values
    assert_bitwise(params(plain_entry.model), params(entry.model), "fp32 step loaded from an fp16 checkpoint")


def test_saving_between_the_microbatches_of_an_optimizer_step_says_what_is_not_saved(tmp_path):
    entry, step = build(Plan(backend="eager", accumulate_target=8))
    step(batch(0))
    assert not bool(step.metrics["applied"])
    with pytest.warns(checkpoint.CheckpointWarning, match="1 microbatch.*not saved"):
        checkpoint.save(step, tmp_path / "ckpt")
    step(batch(1))
    assert bool(step.metrics["applied"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkpoint.CheckpointWarning)
        checkpoint.save(step, tmp_path / "after")


# -- gloo ranks ----------------------------------------------------------------------------------------

def rank_main(out: str, mode: str) -> None:
    from cann_passes.runtime.distributed import init_distributed
    from graph_ir.meta import GraphAttr
    fields = dict(dp=2, zero_stage=1) if mode == "dp" else dict(pp=2, microbatches=4, pipeline_schedule="gpipe")
    plan = fp16_plan(RANK_INIT[mode], **fields)
    with init_distributed(plan) as world:
        rank, size = (world.dp_rank, world.dp_size) if mode == "dp" else (0, 1)
        entry, step = build(plan)
        full = train(step, range(SAVE_AFTER), rank, size)
        checkpoint.save(step, Path(out) / "ckpt")
        full += train(step, range(SAVE_AFTER, STEPS), rank, size)
        again_entry, again = build(plan)
        notes = checkpoint.load(again, Path(out) / "ckpt", batch(0, rank, size))
        resumed = train(again, range(SAVE_AFTER, STEPS), rank, size)
        held = None
        if mode == "pp":   # a rank updates only its own stages' parameters
            info = step.last.program.attrs[GraphAttr.PIPELINE_PARALLEL]
            mine = {s for s, r in enumerate(info["stage_to_rank"]) if r == step.mesh.local_rank("pp")}
            held = {n for n, s in info["param_stage"].items() if s in mine}
        result = {"uninterrupted": full, "resumed": resumed, "notes": notes,
                  "params": params(entry.model, held), "resumed_params": params(again_entry.model, held)}
        torch.save(result, Path(out) / f"rank{world.rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dp", "pp"])
def test_resumed_fp16_training_on_two_gloo_ranks_is_bitwise_the_uninterrupted_run(mode, tmp_path):
    from cann_passes.runtime.distributed import launch_local
    assert_all_ok(launch_local([__file__, str(tmp_path), mode], 2, env=RANK_ENV, timeout_s=600, cwd=str(REPO), preload=PRELOAD))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["notes"] == [], f"{mode} rank {rank}: {result['notes']}"
        check_resumed(result, f"{mode} rank {rank}", RANK_INIT[mode])
    # Every rank scales and skips alike.
    assert [s[1:] for s in results[0]["uninterrupted"]] == [s[1:] for s in results[1]["uninterrupted"]]
    if mode == "pp":
        assert results[0]["params"] and results[1]["params"]
        assert not set(results[0]["params"]) & set(results[1]["params"])


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
