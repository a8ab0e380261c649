"""Data-parallel step time and allocations: ours (eager backend) against torch DDP and FSDP2, 2 gloo ranks.

    python -m bench.step_time_dp [--rounds 5] [--steps 2] [--layers 4] [--rows ...]

Launches 2 local ranks (gloo, ``OMP_NUM_THREADS=1``, one intra-op thread), each
training the recipe GPT (d_model 256, 4 heads, seq 128, global batch 8, so 4
rows per rank) with AdamW from the same initial weights:

- ``ddp``: ``DistributedDataParallel`` and ``torch.optim.AdamW`` (the
  per-parameter loop, updating in place) -- the 1.00x baseline;
- ``ddp-fused``: the same with ``AdamW(fused=True)`` (torch's fused kernel);
- ``fsdp2``: ``fully_shard`` on every block and the root (parameters, gradients
  and optimizer state sharded, as ZeRO-3), the same AdamW on the DTensor shards;
- ``ours-dp``, ``ours-zero1``, ``ours-zero2``, ``ours-zero3``: the compiled
  whole step on the eager backend, parameters and state updated in place;
- ``...-fused``: the same plan with ``optimizer_kernel: fused`` (the AdamW update, or each
  ZeRO shard's, as torch's fused kernel, in place);
- ``...-sharded``: ZeRO-1/2 with ``zero_master: sharded`` (the fp32 parameters sharded with the
  state, each gathered whole before its first read in the next forward instead of after the update);
- ``...-tensor-scalars``: the same plan with the update's step-count arithmetic left as 0-dim
  tensor ops (``CANN_PASSES_HOST_SCALARS=0``: no ``scalars_on_host``);
- ``...-unplanned``: the same plan without the eager backend's buffer plan
  (``CANN_PASSES_BUFFER_PLAN=0``: no ``plan_buffers``, every intermediate allocated afresh each step);
- ``...-functional``: the same plan lowered with ``CANN_PASSES_INPLACE_UPDATES=0``
  (no input written, fresh parameters and state each step, stored by the
  runtime): what the DP and ZeRO steps did before they updated in place (then
  data parallelism wrote only the parameters after its last bucket's wait, and
  ZeRO-1/2 nothing).

Rows run in interleaved rounds (every row once per round, the order rotating,
the same on both ranks, which meet in each row's collectives); a row's time is
the median over its timed steps and its ratio the median over rounds of (row /
ddp in the same round), quartiles beside. Wall time is the figure that counts
(a step waits for its peer's collectives); CPU time is the process's (gloo's
threads included). Minor page faults per step come from ``/proc/self/stat``
around the timed steps; allocated bytes per step are the allocator's events
under ``torch.profiler(profile_memory=True)`` in one more step per row (every
allocation counted, frees not subtracted; "big" ones are >= 1 MiB, those glibc
serves with fresh mmap'ed pages once they exceed its mmap threshold). Every row
has run as many steps on the same batch by then, so the loss of that step
agrees across rows (to rounding). Figures are rank 0's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
ROWS = ("ddp", "ddp-fused", "fsdp2", "ours-dp", "ours-dp-functional", "ours-dp-fused", "ours-dp-tensor-scalars",
        "ours-dp-unplanned", "ours-zero1", "ours-zero1-tensor-scalars", "ours-zero1-unplanned",
        "ours-zero1-functional", "ours-zero1-fused", "ours-zero1-sharded", "ours-zero2", "ours-zero2-functional",
        "ours-zero2-sharded", "ours-zero3",
        "ours-zero3-functional", "ours-zero3-fused", "ours-zero3-unplanned")
STAGES = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
BIG = 1 << 20


@dataclass
class Row:
    name: str
    step: Callable[[object], object]
    compile_s: float = 0.0
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    cpu_ratios: list[float] = field(default_factory=list)
    round_wall: list[float] = field(default_factory=list)   # per round, median wall seconds
    round_cpu: list[float] = field(default_factory=list)
    alloc_bytes: int = 0
    big_allocs: int = 0
    last_loss: float = float("nan")   # after the same number of steps on every row: they train alike


def minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rpartition(")")[2].split()[7])   # field 10, minflt


@contextmanager
def env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def make_model(layers: int):
    from recipes.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, n_layer=layers, n_head=4, d_model=256, seq_len=128, dropout=0.0))


def global_batch(rows: int = 8, seq: int = 128):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (rows, seq + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def adamw(params, fused: bool = False):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **({"fused": True} if fused else {"foreach": False}))


def make_row(name: str, layers: int, world, batch) -> Row:
    from cann_passes import Plan, compile_for_npu
    from cann_passes.lowering.base import BUFFER_PLAN_ENV, HOST_SCALARS_ENV, INPLACE_UPDATES_ENV
    from recipes.models.gpt import gpt_loss
    model = make_model(layers)
    t0 = time.perf_counter()
    if name.startswith("ours-"):
        strategy = name.split("-")[1]
        plan = Plan(backend="eager", dp=world.dp_size, zero_stage=STAGES[strategy], compile_cache="off",
                    optimizer_kernel="fused" if name.endswith("-fused") else "auto",
                    **({"zero_master": "sharded"} if name.endswith("-sharded") else {}))
        step = compile_for_npu(model, plan, optimizer=adamw(model.parameters()), loss_fn=gpt_loss)
        with env(INPLACE_UPDATES_ENV, "0" if name.endswith("-functional") else None), \
                env(HOST_SCALARS_ENV, "0" if name.endswith("-tensor-scalars") else None), \
                env(BUFFER_PLAN_ENV, "0" if name.endswith("-unplanned") else None):
            step.compile(batch)
        step(batch)
        return Row(name, step, time.perf_counter() - t0)
    if name.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.layers:
            fully_shard(block)
        wrapped = fully_shard(model)
    opt = adamw(wrapped.parameters(), fused=name.endswith("-fused"))

    def run(b):
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(wrapped, b)
        loss.backward()
        opt.step()
        return loss

    run(batch)
    return Row(name, run, time.perf_counter() - t0)


def allocations(row: Row, batch) -> None:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = row.step(batch)
    if not row.name.startswith("ours-"):
        # torch's rows return this rank's loss; ours the global batch's mean
        import torch.distributed as dist
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    row.last_loss = float(loss)
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    row.alloc_bytes, row.big_allocs = sum(sizes), sum(s >= BIG for s in sizes)


def rank_main(args) -> None:
    from cann_passes import Plan
    from cann_passes.runtime.distributed import init_distributed, shard_batch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    with init_distributed(Plan(backend="eager", dp=2)) as world:
        batch = shard_batch(global_batch(), world.dp_rank, world.dp_size)
        rows = []
        for name in args.rows:
            rows.append(make_row(name, args.layers, world, batch))
            if world.rank == 0:
                print(f"  built {name:<22} in {rows[-1].compile_s:6.1f} s", flush=True)
        base = rows[0]
        for k in range(args.rounds):
            wall, cpu = {}, {}
            for row in rows[k % len(rows):] + rows[:k % len(rows)]:
                ts, cs = [], []
                for _ in range(args.steps):
                    f0, t0, c0 = minor_faults(), time.perf_counter(), time.process_time()
                    row.step(batch)
                    ts.append(time.perf_counter() - t0)
                    cs.append(time.process_time() - c0)
                    row.faults.append(minor_faults() - f0)
                row.wall += ts
                row.cpu += cs
                wall[row.name], cpu[row.name] = statistics.median(ts), statistics.median(cs)
            for row in rows:
                row.round_wall.append(wall[row.name])
                row.round_cpu.append(cpu[row.name])
                row.ratios.append(wall[row.name] / wall[base.name])
                row.cpu_ratios.append(cpu[row.name] / cpu[base.name])
        for row in rows:
            allocations(row, batch)
        if world.rank == 0:
            print(report(rows, args), flush=True)


def _spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{q[0]:.2f}-{q[2]:.2f}"


def report(rows: list[Row], args) -> str:
    lines = [f"GPT {args.layers}L d256 s128, global batch 8 on 2 gloo ranks, AdamW; {len(rows[0].wall)} steps per "
             f"row; ratios: median over {args.rounds} interleaved rounds of (row / {rows[0].name} in the same "
             "round), quartiles beside; rank 0",
             f"{'row':<22} {'wall ms':>8} {'vs ddp':>7} {'(quart.)':>10} | {'cpu ms':>7} {'vs ddp':>7} | "
             f"{'minflt/step':>11} | {'alloc MiB/step':>14} {'>=1MiB allocs':>13} | {'compile s':>9} | last loss"]
    for r in rows:
        lines.append(f"{r.name:<22} {statistics.median(r.wall) * 1e3:>8.1f} {statistics.median(r.ratios):>6.2f}x "
                     f"{_spread(r.ratios):>10} | {statistics.median(r.cpu) * 1e3:>7.1f} "
                     f"{statistics.median(r.cpu_ratios):>6.2f}x | {statistics.median(r.faults):>11.0f} | "
                     f"{r.alloc_bytes / 2**20:>14.1f} {r.big_allocs:>13d} | {r.compile_s:>9.1f} | {r.last_loss:.6f}")
    by = {r.name: r for r in rows}
    for row in rows:
        functional = by.get(f"{row.name}-functional")
        if functional is None:
            continue
        wall = [a / b for a, b in zip(row.round_wall, functional.round_wall)]
        cpu = [a / b for a, b in zip(row.round_cpu, functional.round_cpu)]
        lines.append(f"{row.name + ' / functional':<34} wall {statistics.median(wall):.2f}x ({_spread(wall)}), "
                     f"cpu {statistics.median(cpu):.2f}x ({_spread(cpu)}), allocated "
                     f"{row.alloc_bytes / max(functional.alloc_bytes, 1):.2f}x, minor faults "
                     f"{statistics.median(row.faults):.0f} vs {statistics.median(functional.faults):.0f} per step")
    load = os.getloadavg()
    lines.append(f"torch {torch.__version__}, 1 thread per rank; load average {load[0]:.1f} at the end "
                 f"({os.cpu_count()} CPUs)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="timed steps per row per round")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    args = p.parse_args(argv)
    if "ddp" in args.rows:
        args.rows.remove("ddp")
    args.rows.insert(0, "ddp")
    if "RANK" in os.environ:
        return rank_main(args)
    from cann_passes.runtime.distributed import launch_local
    argv = ["-m", "bench.step_time_dp", *(argv if argv is not None else sys.argv[1:])]
    env_ = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    results = launch_local(argv, 2, env=env_, cwd=str(REPO), timeout_s=3600)
    print(results[0].stdout, end="")
    for rank, r in enumerate(results):
        if r.returncode != 0:
            print(f"rank {rank} exited {r.returncode}:\n{r.stderr[-4000:]}", file=sys.stderr)
            raise SystemExit(1)


if __name__ == "__main__":
    main()
