"""One rank of ``test_pp4_gloo``: ``python tests/pipeline/pp4_worker.py OUTDIR MODEL PP CONFIG...``.

``pp_worker``'s models, batches and CONFIG syntax (``[model/]schedule:optimizer[:option...]``), on a
pp-only mesh; besides the losses, this rank's stages' parameters (a tied weight on each stage
holding it), the last step's events and, with loss scaling, the (overflow, scale) of every step, it
keeps the schedule the compiled program runs, the pipeline subgroups it names and, for ``dynamic``,
the choice with every candidate's simulated figures.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).parent))

import pp_worker  # noqa: E402

from cann_passes import Plan, compile_for_npu  # noqa: E402
from cann_passes.runtime.distributed import init_distributed  # noqa: E402
from graph_ir.meta import GraphAttr  # noqa: E402


def main(out: str, model_name: str, pp: int, configs: list[str]) -> None:
    results = {}
    with init_distributed(Plan(backend="eager", pp=pp, microbatches=max(4, pp))) as world:
        for config in configs:
            name, what = pp_worker.parse_config(config, model_name)
            plan = pp_worker.plan_for(what, pp, 1, 1)
            model, opt = pp_worker.make_model(name, what.split(":")[1])
            step = compile_for_npu(model, plan, optimizer=opt, loss_fn=pp_worker.loss_fn(name))
            losses, scaling = [], []
            for i in range(pp_worker.steps_for(plan)):
                losses.append(float(step(pp_worker.global_batch(name, i))))
                if plan.effective_loss_scale != "none":
                    scaling.append((bool(step.metrics["loss_scale:found_inf"]),
                                    float(step.step_state.values["loss_scale:scale"])))
            info = step.last.program.attrs[GraphAttr.PIPELINE_PARALLEL]
            mine = {s for s, r in enumerate(info["stage_to_rank"]) if r == world.rank}
            params = {n: p.detach().clone() for n, p in model.named_parameters()
                      if set(pp_worker._stages_of(info, n)) & mine}
            events = [(e.rank, e.stage, e.microbatch, e.kind, e.start_s, e.end_s)
                      for e in step.pipeline_timeline().events]
            state = model.state_dict()   # every rank: the whole trained model (a collective over pp)
            every = {n: state[n].detach().clone() for n, _ in model.named_parameters()}
            results[config] = {"losses": losses, "params": params, "every": every, "events": events,
                               "stages": info["stages"],
                               "schedule": info["schedule"], "dynamic": info.get("dynamic"),
                               "stage_seconds": info["stage_seconds"], "shared": info.get("shared_params", {}),
                               "subgroups": info.get("pp_subgroups", {}), "scaling": scaling}
    torch.save(results, Path(out) / f"rank{world.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
