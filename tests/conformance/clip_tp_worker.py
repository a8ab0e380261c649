"""One rank of a tensor-parallel run with global grad-norm clipping:
``python tests/conformance/clip_tp_worker.py OUT MODEL MAX_NORM [sp]``.

compile_for_npu(Plan(tp=world, grad_clip_norm=MAX_NORM)) trains STEPS steps on the zoo model's
batches; rank 0 writes the losses, the clip metric and the full parameters (``model.state_dict()``
gathers the shards) to OUT/MODEL.pt.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import zoo  # noqa: E402

STEPS = 5


def make(name: str):
    entry = zoo.build(name, layers=2, seed=0)
    return entry, torch.optim.SGD(entry.model.parameters(), lr=0.1, momentum=0.9)


def batches(entry):
    return [entry.make_batch(1000 + i) for i in range(STEPS)]


def main(out: str, name: str, max_norm: str, *flags: str):
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime.distributed import init_distributed
    world_size = int(os.environ["WORLD_SIZE"])
    sp = "sp" in flags
    plan = Plan(backend="eager", tp=world_size, grad_clip_norm=float(max_norm), verify="deep",
                sequence_parallel=sp, vocab_parallel_loss=sp)
    with init_distributed(plan) as world:
        entry, optimizer = make(name)
        step = compile_for_npu(entry.model, plan, optimizer=optimizer, loss_fn=entry.loss_fn)
        losses, norms = [], []
        for batch in batches(entry):
            losses.append(float(step(batch)))
            norms.append(float(step.metrics["grad_clip:grad_norm"]))
        state = entry.model.state_dict()
        params = {n: state[n].detach().clone() for n, _ in entry.model.named_parameters()}
        if world.rank == 0:
            torch.save({"losses": losses, "norms": norms, "params": params},
                       os.path.join(out, f"{name}{'.sp' if sp else ''}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
