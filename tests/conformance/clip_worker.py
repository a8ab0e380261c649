"""One rank of the gradient-clipping runs: ``python tests/conformance/clip_worker.py OUTDIR STRATEGIES``.

Launched as torchrun would (cann_passes.runtime.distributed.launch_local), like
tests/distributed/worker.py; each rank writes OUTDIR/clip.rank<R>.pt.
"""
from __future__ import annotations

import os
import sys

import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.runtime.distributed import init_distributed, shard_batch
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny

STEPS, GLOBAL_BATCH, SEQ, MAX_NORM = 4, 8, 16, 0.5
STRATEGIES = {"dp": 0, "zero1": 1, "zero3": 3}


def global_batch(i: int):
    g = torch.Generator().manual_seed(2000 + i)
    idx = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def make_model():
    torch.manual_seed(0)
    model = GPT(gpt_tiny(bias=False))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def main(out: str, strategies: str):
    base = Plan(backend="eager", verify="deep", dp=int(os.environ["WORLD_SIZE"]), bucket_mb=0.02,
                grad_clip_norm=MAX_NORM)
    with init_distributed(base) as world:
        result = {}
        for name in strategies.split(","):
            plan = base.replace(zero_stage=STRATEGIES[name])
            model, opt = make_model()
            step = compile_for_npu(model, plan, optimizer=opt, loss_fn=gpt_loss)
            losses, norms = [], []
            for i in range(STEPS):
                losses.append(float(step(shard_batch(global_batch(i), world.dp_rank, world.dp_size))))
                norms.append(float(step.metrics["grad_clip:grad_norm"]))
            step.sync_model()
            result[name] = {"losses": losses, "norms": norms,
                            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        torch.save(result, f"{out}/clip.rank{world.rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
