"""One rank of expert-parallel runs: ``python tests/expert_parallel/ep_worker.py OUT MESH SCENARIO...``.

``MESH`` is ``dp=2,ep=2``, ``dp=4,ep=2``, ``dp=2,ep=2,pp=2`` or ``dp=2,ep=2,cp=2`` (dp counts every data-parallel rank;
ep of them split the experts; with pp, two microbatches per step, as the 1F1B schedule needs). A
scenario is ``model:optimizer[:option...]``: a ``tests.zoo`` mixture of experts trained 10 steps with ``compile_for_npu``, each data-parallel rank fed its rows of the global batch.
Options: ``clip`` (gradient clipping at 1.0), ``bf16`` (bf16 autocast), ``selective`` / ``full``
(recompute), ``zero1`` / ``zero2`` (ZeRO over dp, the experts' over edp), ``ckpt`` (save a
checkpoint after step 5 and go on), ``target`` (dynamic accumulation, ``accumulate_target`` =
TARGET: each call's global batch split unevenly over two ranks, ``uneven_rows(i)`` rows to rank 0,
so that an update sums two calls whose ranks' sizes differ). ``resume:model:optimizer`` resumes the ``ckpt`` run's checkpoint
on this mesh (its plan's ep, possibly 1) and trains the last 5 steps. Rank 0 writes the losses,
the parameters as ``model.state_dict()`` gives them (whole), the graph's collectives, the bytes
of expert parameters this rank holds (at pp = 1) and the number of pipeline stages to
OUT/<scenario>.<mesh>.pt.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cann_passes.passes.tensor_parallel import count_collectives  # noqa: E402
from tests.gloo_scenarios import make, verify_level  # noqa: E402,F401  (the tests' import too)

STEPS = 10


def batches(entry):
    return [entry.make_batch(1000 + i, pad=False) for i in range(STEPS)]


TARGET = 8


def uneven_rows(call: int) -> int:
    """Rank 0's rows of call ``call``'s 4-row global batch under ``target`` (rank 1 takes the rest)."""
    return 1 if call % 2 == 0 else 3


def uneven_shard(batch, rank: int, call: int):
    import torch.utils._pytree as pytree
    k = uneven_rows(call)
    return pytree.tree_map(lambda t: t[:k] if rank == 0 else t[k:], batch)


def mesh_of(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def ckpt_path(out: str, name: str, opt: str) -> str:
    return os.path.join(out, f"ckpt.{name}.{opt}")


def resume(out: str, world, sizes: dict, scenario: str) -> None:
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime import checkpoint
    from cann_passes.runtime.distributed import shard_batch
    _, name, opt = scenario.split(":")
    entry, optimizer = make(name, opt)
    with torch.no_grad():    # resumed values must come from the checkpoint, not the seed
        for p in entry.model.parameters():
            p.add_(1.0)
    step = compile_for_npu(entry.model, Plan(backend="eager", verify="deep", **sizes), optimizer=optimizer,
                           loss_fn=entry.loss_fn)
    data = batches(entry)
    checkpoint.load(step, ckpt_path(out, name, opt), shard_batch(data[5], world.dp_rank, sizes["dp"]))
    assert step.steps_run == 5, step.steps_run
    losses = [float(step(shard_batch(b, world.dp_rank, sizes["dp"]))) for b in data[5:]]
    state = entry.model.state_dict()
    if world.rank == 0:
        torch.save({"losses": losses, "params": {n: state[n].detach().clone() for n, _ in entry.model.named_parameters()}},
                   os.path.join(out, f"{scenario}.{','.join(f'{k}={v}' for k, v in sizes.items())}.pt"))


def main(out: str, mesh: str, *scenarios: str):
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime import checkpoint
    from cann_passes.runtime.distributed import init_distributed, shard_batch
    from graph_ir.meta import GraphAttr
    sizes = mesh_of(mesh)
    staged = 2 if sizes.get("pp", 1) > 1 else 1
    with init_distributed(Plan(backend="eager", microbatches=staged, **sizes)) as world:
        for scenario in scenarios:
            if scenario.startswith("resume:"):
                resume(out, world, sizes, scenario)
                continue
            name, opt, *options = scenario.split(":")
            entry, optimizer = make(name, opt)
            plan = Plan(backend="eager", verify=verify_level(scenarios, scenario),
                        grad_clip_norm=1.0 if "clip" in options else None,
                        precision="bf16" if "bf16" in options else "fp32",
                        microbatches=2 if "mb2" in options else staged,
                        zero_stage=next((int(o[4:]) for o in options if o.startswith("zero")), 0),
                        accumulate_target=TARGET if "target" in options else None,
                        recompute=next((o for o in options if o in ("selective", "full")), "none"), **sizes)
            step = compile_for_npu(entry.model, plan, optimizer=optimizer, loss_fn=entry.loss_fn)
            losses = []
            for i, batch in enumerate(batches(entry)):
                mine = (uneven_shard(batch, world.dp_rank, i) if "target" in options
                        else shard_batch(batch, world.dp_rank, sizes["dp"]))
                losses.append(float(step(mine)))
                if i == 4 and "ckpt" in options:
                    checkpoint.save(step, ckpt_path(out, name, opt))
            graph = step.last.graph
            pipeline = step.last.program.attrs.get(GraphAttr.PIPELINE_PARALLEL) or {"stages": 1}
            experts = graph.attrs.get("expert_parallel", {}).get("experts", {})
            held = sum(t.numel() * t.element_size() for n, t in step.param_shards.items() if n in experts)
            state = entry.model.state_dict()
            params = {n: state[n].detach().clone() for n, _ in entry.model.named_parameters()}
            if world.rank == 0:
                torch.save({"losses": losses, "params": params, "held_expert_bytes": held,
                            "collectives": {f"{r}.{c}": n for (r, c), n in count_collectives(graph).items()},
                            "attrs": graph.attrs.get("expert_parallel"), "stages": pipeline["stages"],
                            "history": list(step.accumulation.history) if "target" in options else None},
                           os.path.join(out, f"{scenario}.{mesh}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
