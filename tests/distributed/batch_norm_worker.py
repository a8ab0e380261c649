"""One rank of ``test_batch_norm_ddp.py``: ``python batch_norm_worker.py OUT PLAN...``.

Each PLAN (``dp``, ``zero1``, ``zero3``, ``mb2``, ``sync``, ``sync_zero3``, ``sync_inductor`` on 2 ranks; ``pp``, ``pp_zero1``,
``pp_sync`` on 4 ranks: dp=2 x pp=2, 1F1B over two microbatches) trains transformers' ResNet (BatchNorm) 4 steps on this rank's
rows with ``compile_for_npu`` and the same model under torch DDP over this rank's data-parallel
group (its default ``broadcast_buffers``: rank 0's buffers before every forward), and writes this
rank's largest difference per state-dict entry to OUT/<plan>.rank<r>.pt. Plans on 4 ranks and on
2 are not mixed in one launch.
"""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cann_passes import Plan, compile_for_npu  # noqa: E402
from cann_passes.runtime.distributed import init_distributed, shard_batch  # noqa: E402
from tests import zoo  # noqa: E402

STEPS = 4


def batch(i: int):
    """8 distinct rows, so that each rank's batch statistics differ."""
    a, b = zoo.image_batch(1000 + i), zoo.image_batch(2000 + i)
    return {k: torch.cat([a[k], b[k]]) for k in a}


def run(out: str, world, name: str) -> None:
    fields = FIELDS[name]
    plan = Plan(**{"backend": "eager", "dp": 2, "verify": "deep", **fields})
    entry = zoo.build("resnet", layers=1, seed=0)
    ref = copy.deepcopy(entry.model)
    if "sync" in name:
        return run_synchronised(out, world, name, plan, entry, ref)
    ddp = torch.nn.parallel.DistributedDataParallel(ref, process_group=world.group("dp"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1, momentum=0.9)
    step = compile_for_npu(entry.model, plan, optimizer=opt, loss_fn=entry.loss_fn)
    chunks = fields.get("microbatches", 1)
    for i in range(STEPS):
        mine = shard_batch(batch(i), world.dp_rank, 2)
        step(mine)
        ref_opt.zero_grad()
        for c in range(chunks):   # DDP's accumulation: no_sync until the last microbatch
            part = shard_batch(mine, c, chunks)
            with ddp.no_sync() if c < chunks - 1 else torch.enable_grad():
                (entry.loss_fn(ddp, part) / chunks).backward()
        ref_opt.step()
    ours, theirs = entry.model.state_dict(), ref.state_dict()
    diff = {k: (ours[k].double() - theirs[k].double()).abs().max().item() for k in theirs}
    torch.save(diff, os.path.join(out, f"{name}.rank{world.rank}.pt"))


def run_synchronised(out: str, world, name: str, plan, entry, ref) -> None:
    """sync_batch_norm: the statistics over both ranks' rows, so training is the single-process
    step on the global batch (torch's SyncBatchNorm runs on accelerators only: the reference is
    the plain model in one process). With microbatches, microbatch c's statistics are over chunk c
    of both ranks' rows: the reference's microbatch c is those rows together."""
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1, momentum=0.9)
    step = compile_for_npu(entry.model, plan, optimizer=opt, loss_fn=entry.loss_fn)
    chunks = plan.microbatches
    for i in range(STEPS):
        step(shard_batch(batch(i), world.dp_rank, 2))
        ref_opt.zero_grad()
        ranks = [shard_batch(batch(i), r, 2) for r in range(2)]
        for c in range(chunks):
            parts = [shard_batch(rows, c, chunks) for rows in ranks]
            together = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
            (entry.loss_fn(ref, together) / chunks).backward()
        ref_opt.step()
    ours, theirs = entry.model.state_dict(), ref.state_dict()
    diff = {k: (ours[k].double() - theirs[k].double()).abs().max().item() for k in theirs}
    torch.save(diff, os.path.join(out, f"{name}.rank{world.rank}.pt"))


FIELDS = {"sync": dict(sync_batch_norm=True), "sync_zero3": dict(sync_batch_norm=True, zero_stage=3),
          "sync_inductor": dict(sync_batch_norm=True, backend="inductor", verify="shallow"),
          "dp": {}, "zero1": dict(zero_stage=1), "zero3": dict(zero_stage=3), "mb2": dict(microbatches=2),
          "pp": dict(pp=2, microbatches=2), "pp_zero1": dict(pp=2, microbatches=2, zero_stage=1),
          "pp_sync": dict(pp=2, microbatches=2, sync_batch_norm=True)}


def main(out: str, *names: str) -> None:
    pp = 2 if names[0].startswith("pp") else 1
    with init_distributed(Plan(backend="eager", dp=2, pp=pp, microbatches=pp)) as world:
        for name in names:
            run(out, world, name)


if __name__ == "__main__":
    main(*sys.argv[1:])
