"""The functional collectives on gloo side by side: what each costs on one buffer, 2 local ranks.

    python -m bench.gloo_collectives [--elements 3257856] [--rounds 15]

Both ranks time, on a float32 buffer of ``--elements`` (the default is every gradient of
``bench.step_time_dp``'s 4-layer GPT), each issued and waited at once:

- ``all_reduce_``: the in-place all-reduce (a DP bucket on the eager backend);
- ``all_reduce``: the functional one (a copy of the buffer first);
- ``reduce_scatter``: ``reduce_scatter_tensor`` (a ZeRO bucket before
  ``gloo_reduce_scatter_as_all_reduce``);
- ``all_reduce + own chunk``: what that pass runs instead (all-reduce in place, copy of this
  rank's half);
- ``all_gather``: ``all_gather_into_tensor`` of half the buffer into the whole (ZeRO's updated
  shards).

Rows are interleaved within each round after a barrier; the table is rank 0's medians over rounds,
each beside the in-place all-reduce's.
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


def rank_main(args) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    c10d = torch.ops._c10d_functional
    name, rank, n = dist.group.WORLD.group_name, dist.get_rank(), args.elements - args.elements % 2
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    rows = {
        "all_reduce_": lambda: c10d.wait_tensor(c10d.all_reduce_(x.clone(), "sum", name)),
        "all_reduce": lambda: c10d.wait_tensor(c10d.all_reduce(x, "sum", name)),
        "reduce_scatter": lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", 2, name)),
        "all_reduce + own chunk": lambda: c10d.wait_tensor(c10d.all_reduce_(x.clone(), "sum", name))
        [rank * n // 2:(rank + 1) * n // 2].clone(),
        "all_gather": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(x[: n // 2], 2, name)),
    }
    # The clone of the in-place rows is outside the collective in the step (the bucket is built
    # there anyway): time it apart and take it off.
    times: dict[str, list[float]] = {k: [] for k in rows}
    copies = []
    for r in range(args.rounds + 1):
        for label, fn in rows.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if r:
                times[label].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        x.clone()
        copies.append(time.perf_counter() - t0)
    copy = statistics.median(copies)
    if rank == 0:
        base = statistics.median(times["all_reduce_"]) - copy
        print(f"{n} float32 elements ({n * 4 / 2**20:.1f} MiB), 2 gloo ranks, {args.rounds} rounds, medians; "
              f"torch {torch.__version__}")
        print(f"{'collective':>24} {'ms':>8} {'vs all_reduce_':>15}")
        for label, ts in times.items():
            t = statistics.median(ts) - (copy if label in ("all_reduce_", "all_reduce + own chunk") else 0.0)
            print(f"{label:>24} {t * 1e3:8.2f} {t / base:14.2f}x")
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=3257856)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    if "RANK" in os.environ:
        return rank_main(args)
    from cann_passes.runtime.distributed import launch_local, rank_failures
    results = launch_local(["-m", "bench.gloo_collectives", *(argv if argv is not None else sys.argv[1:])], 2,
                           env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=str(REPO), timeout_s=600)
    sys.stdout.write(results[0].stdout or "")
    if rank_failures(results):
        raise SystemExit(rank_failures(results))

if __name__ == "__main__":
    main()
