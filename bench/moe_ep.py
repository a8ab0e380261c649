"""The MoE recipe's ladder rung: dense vs MoE at equal active parameters, ep=1 vs ep=2, 2 gloo ranks.

    python -m bench.moe_ep [--rounds 3] [--steps 4] [--train-steps 60]

Launches 2 local ranks (gloo, ``OMP_NUM_THREADS=1``), each running three rows of the MoE recipe
(``recipes/moe``: byte-level, seq 128, 8 rows per step globally, so 4 per rank, AdamW, fp32, the
eager backend) from the same initial weights on the same batches:

- ``dense dp2``: the dense model of the same active size (one SwiGLU expert as wide as two), the
  1.00x baseline;
- ``moe dp2 ep1``: Mixtral-shaped, 8 experts top-2, every rank holding every expert;
- ``moe dp2 ep2``: the same model with the experts split over the two ranks (4 each), tokens
  sent to their experts' rank and back by all-to-alls.

Rows run in interleaved rounds (every row ``--steps`` timed steps per round, the order rotating,
the same on both ranks); a row's step time is the median of its timed steps, its ratio the median
over rounds of (row / dense in the same round). Memory is what the rank holds between steps:
parameters (this rank's shards) and optimizer state, from the compiled step. Loss is the last
training loss after ``--train-steps`` steps of each row (all rows see the same batches).
Figures are rank 0's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ROWS = ("dense dp2", "moe dp2 ep1", "moe dp2 ep2")


def _row(name: str, world):
    from cann_passes import Plan, compile_for_npu
    from recipes.moe.model import active_parameters, build, moe_loss
    torch.manual_seed(0)
    model = build("dense" if name.startswith("dense") else "moe", max_position_embeddings=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    plan = Plan(backend="eager", dp=2, ep=2 if name.endswith("ep2") else 1)
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=moe_loss)
    return model, step, active_parameters(model)


def _held_bytes(step) -> int:
    shards = step.param_shards
    params = sum(t.numel() * t.element_size() for n, t in step.model.named_parameters() if n not in shards)
    return params + sum(t.numel() * t.element_size() for t in shards.values()) + step.optimizer_state_bytes()


def rank_main(args) -> None:
    from cann_passes import Plan
    from cann_passes.runtime.distributed import init_distributed, shard_batch
    from recipes.data import TextBatches, load_corpus, train_val_split
    torch.set_num_threads(1)
    with init_distributed(Plan(backend="eager", dp=2, ep=2)) as world:
        tokens, _ = train_val_split(load_corpus())
        batches = iter(TextBatches(tokens, 8, 128, seed=0))
        data = [next(batches) for _ in range(args.train_steps + args.rounds * args.steps + 2)]
        rows = {name: _row(name, world) for name in ROWS}
        times = {name: [] for name in ROWS}
        ratios = {name: [] for name in ROWS}
        done = {name: 0 for name in ROWS}
        losses = {}

        def run(name: str, n: int) -> list[float]:
            _, step, _ = rows[name]
            seconds = []
            for _ in range(n):
                batch = shard_batch(data[done[name]], world.dp_rank, 2)
                t0 = time.perf_counter()
                losses[name] = float(step(batch))
                seconds.append(time.perf_counter() - t0)
                done[name] += 1
            return seconds

        for name in ROWS:
            run(name, 2)                                   # compile and warm up
        for r in range(args.rounds):
            order = ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]
            medians = {name: statistics.median(run(name, args.steps)) for name in order}
            for name in ROWS:
                times[name].append(medians[name])
                ratios[name].append(medians[name] / medians[ROWS[0]])
        for name in ROWS:
            run(name, args.train_steps + args.rounds * args.steps + 2 - done[name])
        if world.rank == 0:
            print(f"{'row':<14} {'step ms':>8} {'x dense':>8} {'tokens/s':>9} {'held MB':>8} "
                  f"{'active':>7} {'loss@' + str(len(data)):>9}")
            for name in ROWS:
                ms = statistics.median(times[name]) * 1e3
                _, step, active = rows[name]
                print(f"{name:<14} {ms:8.1f} {statistics.median(ratios[name]):7.2f}x {8 * 128 / ms * 1e3:9.0f} "
                      f"{_held_bytes(step) / 1e6:8.2f} {active / 1e6:6.2f}M {losses[name]:9.4f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.moe_ep", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per row per round")
    p.add_argument("--train-steps", type=int, default=60, help="further steps before the loss is read")
    args = p.parse_args(argv)
    if "RANK" in os.environ:
        return rank_main(args)
    from cann_passes.runtime.distributed import launch_local, rank_failures
    results = launch_local(["-m", "bench.moe_ep", *(argv if argv is not None else sys.argv[1:])], 2,
                           env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=str(REPO), timeout_s=3600)
    failures = rank_failures(results)
    sys.stdout.write(results[0].stdout or "")
    if failures:
        raise SystemExit(failures)


if __name__ == "__main__":
    main()
