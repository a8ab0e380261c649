"""One rank of context-parallel runs: ``python tests/context_parallel/cp_worker.py OUT MESH SCENARIO...``.

``MESH`` is ``cp=2``, ``cp=3``, ``dp=2,cp=2``, ``tp=2,cp=2`` or ``cp=2,pp=2`` (the rest of the world, if any, is
dp; with pp, two microbatches per step, as the 1F1B schedule needs). A
scenario is ``model:optimizer[:option...]``: a ``tests.zoo`` model trained 10 steps with
``compile_for_npu`` on the plan's mesh; every cp rank of a data-parallel rank is fed that rank's
rows of the global batch, whole (the graph cuts its part of the sequence). Options: ``pad``
(right-padded rows: the loss' count of tokens differs between the sequence chunks), ``clip``
(gradient clipping at 1.0), ``mb2`` (two microbatches accumulated per step), ``full`` (full
recompute: K and V gathered again in backward), ``ring`` (``cp_attention="ring"``), ``rescale``
(the attention scale halved after step 5: the guards recompile), ``zero1`` /
``zero2`` / ``zero3`` (ZeRO over dp), ``inductor`` (the backend; eager otherwise). Rank 0 writes the losses, the parameters as ``model.state_dict()``
gives them (under pp gathered from the stage owning each), the graph's collectives and the number of
pipeline stages to OUT/<scenario>.<mesh>.pt.
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


def batches(entry, options) -> list:
    """The scenario's batches: ``pad``: right-padded rows; ``nomask``: no attention_mask (transformers
    then builds its causal mask from the sequence length alone)."""
    made = [entry.make_batch(1000 + i, pad="pad" in options) for i in range(STEPS)]
    if "nomask" in options:
        for batch in made:
            del batch["attention_mask"]
    return made


def rescale(entry, i: int) -> None:
    """Halfway through, every attention's softmax scale halved (a value the trace read from the
    model: the step's guards see it change and compile again, as eager reads it anew)."""
    if i == STEPS // 2:
        for layer in entry.model.model.layers:
            layer.self_attn.scaling *= 0.5


def mesh_of(text: str, world: int) -> dict[str, int]:
    sizes = {k: int(v) for k, v in (part.split("=") for part in text.split(","))}
    model = sizes.get("cp", 1) * sizes.get("tp", 1) * sizes.get("pp", 1)
    sizes.setdefault("dp", world // model)
    return sizes


def main(out: str, mesh: str, *scenarios: str):
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime.distributed import init_distributed, shard_batch
    from graph_ir.meta import GraphAttr
    sizes = mesh_of(mesh, int(os.environ["WORLD_SIZE"]))
    staged = 2 if sizes.get("pp", 1) > 1 else 1
    with init_distributed(Plan(backend="eager", microbatches=staged, **sizes)) as world:
        for scenario in scenarios:
            name, opt, *options = scenario.split(":")
            entry, optimizer = make(name, opt)
            plan = Plan(backend="inductor" if "inductor" in options else "eager",
                        verify=verify_level(scenarios, scenario),
                        grad_clip_norm=1.0 if "clip" in options else None,
                        microbatches=2 if "mb2" in options else staged,
                        recompute="full" if "full" in options else "none",
                        cp_attention="ring" if "ring" in options else "gather",
                        zero_stage=next((int(o[4:]) for o in options if o.startswith("zero")), 0), **sizes)
            step = compile_for_npu(entry.model, plan, optimizer=optimizer, loss_fn=entry.loss_fn)
            dp = sizes["dp"]
            losses = []
            for i, b in enumerate(batches(entry, options)):
                if "rescale" in options:
                    rescale(entry, i)
                losses.append(float(step(shard_batch(b, world.dp_rank, dp))))
            state = entry.model.state_dict()
            params = {n: state[n].detach().clone() for n, _ in entry.model.named_parameters()}
            graph = step.last.graph
            pipeline = step.last.program.attrs.get(GraphAttr.PIPELINE_PARALLEL) or {"stages": 1}
            if world.rank == 0:
                torch.save({"losses": losses, "params": params,
                            "collectives": {f"{r}.{c}": n for (r, c), n in count_collectives(graph).items()},
                            "attrs": graph.attrs.get("context_parallel"), "stages": pipeline["stages"],
                            "masked_attention": sum("flash_attention" in str(n.target) and
                                                    n.kwargs.get("attn_mask") is not None for n in graph.graph.nodes),
                            "recompiles": list(step.recompile_reasons)},
                           os.path.join(out, f"{scenario}.{mesh}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
