"""One rank of a pipeline test run: ``python tests/pipeline/pp_worker.py OUTDIR MODEL PP DP CONFIG...``.

Each CONFIG is ``schedule:optimizer[:v]`` (``1f1b:sgd``, ``interleaved_1f1b:adamw:2``); all run in
this process one after the other under one process group, each from the same initial weights.
Each rank writes OUTDIR/rank<R>.pt: per config the losses, the parameters of the stages this rank
holds, and the measured per-action events of the last step.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cann_passes import Plan, compile_for_npu  # noqa: E402
from cann_passes.runtime.distributed import init_distributed, shard_batch  # noqa: E402
from graph_ir.meta import GraphAttr  # noqa: E402
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny  # noqa: E402

STEPS, GLOBAL_BATCH, SEQ = 10, 8, 16
MODELS = {"gpt4": dict(n_layer=4), "heavy_head": dict(n_layer=4, vocab_size=2048)}


def global_batch(i: int, vocab: int = 256):
    g = torch.Generator().manual_seed(1000 + i)
    idx = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def make_model(name: str, optimizer: str):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(tie_weights=False, bias=False, **MODELS[name]))
    if optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def microbatches_for(schedule: str, pp: int) -> int:
    return 2 * pp if schedule == "dualpipev" else max(4, pp)


def main(out: str, model_name: str, pp: int, dp: int, configs: list[str]) -> None:
    results = {}
    with init_distributed(Plan(backend="eager", pp=pp, dp=dp, microbatches=max(4, pp))) as world:
        vocab = MODELS[model_name].get("vocab_size", 256)
        for config in configs:
            schedule, optimizer, *rest = config.split(":")
            v = int(rest[0]) if rest else 1
            plan = Plan(backend="eager", pp=pp, dp=dp, microbatches=microbatches_for(schedule, pp),
                        pipeline_schedule=schedule, pipeline_virtual_stages=v)
            model, opt = make_model(model_name, optimizer)
            step = compile_for_npu(model, plan, optimizer=opt, loss_fn=gpt_loss)
            losses = [float(step(shard_batch(global_batch(i, vocab), world.dp_rank, world.dp_size)))
                      for i in range(STEPS)]
            info = step.last.program.attrs[GraphAttr.PIPELINE_PARALLEL]
            pp_rank = step.mesh.local_rank("pp")
            mine = {s for s, r in enumerate(info["stage_to_rank"]) if r == pp_rank}
            params = {n: p.detach().clone() for n, p in model.named_parameters() if info["param_stage"][n] in mine}
            events = [(e.rank, e.stage, e.microbatch, e.kind, e.start_s, e.end_s)
                      for e in step.pipeline_timeline().events]
            results[config] = {"losses": losses, "params": params, "events": events,
                               "stage_seconds": info["stage_seconds"], "stages": info["stages"]}
    torch.save(results, Path(out) / f"rank{world.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
