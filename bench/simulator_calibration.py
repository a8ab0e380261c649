"""Predicted vs measured on this CPU: step time and peak memory of the small GPT under several plans.

    python bench/simulator_calibration.py [--rounds 3] [--steps 5]

The small GPT (``recipes.models.gpt.gpt_small_cpu``: 4 layers, d_model 128, seq 128, 0.84M
parameters, fp32, AdamW) is run for real with the eager backend on gloo (1, 2 and 4 local
processes, one thread each) under dp, ZeRO-1/3, full recompute and 4 microbatches, and each plan is
simulated for rank 0 on the calibrated ``cpu`` profile (:mod:`cann_passes.simulate`).

Calibration (before any plan, never fitted to the plans): the ``cpu`` profile's microbenchmark
(matmul, elementwise, copy) with one thread; the eager backend's cost per launched op, timed on a
graph of 400 small ops against the roofline of the same ops; gloo's all-reduce latency and
bandwidth, timed between two processes at 4 KiB and 4 MiB (alpha-beta fit). Where more ranks run
than the machine has cores, each rank's rates are divided by ranks / cores (they share them).

Measured: the median over ``--steps`` timed steps after 2 warm-up steps, per launch; the plans are
launched in turn, ``--rounds`` times (interleaved, so load from other processes on the machine
falls on every plan alike), and the median over rounds is reported. Peak memory: every tensor
the rank holds before the step (a walk over live tensors: model, optimizer state, shards, batch)
plus the peak of the bytes allocated and not yet freed during one more step, tracked op by op
(a dispatch mode; frees by storage finalizers). The machine is shared with other work: timings
are noisy, see the spread column.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ROWS, SEQ = 8, 128
PLANS = {
    "dp1": dict(dp=1),
    "dp1-recompute-full": dict(dp=1, recompute="full"),
    "dp1-microbatches-4": dict(dp=1, microbatches=4),
    "dp2": dict(dp=2),
    "dp2-zero1": dict(dp=2, zero_stage=1),
    "dp2-zero3": dict(dp=2, zero_stage=3),
    "dp4-zero2": dict(dp=4, zero_stage=2),
}


def _model():
    from recipes.models.gpt import GPT, gpt_loss, gpt_small_cpu
    torch.manual_seed(0)
    model = GPT(gpt_small_cpu(bias=False))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), gpt_loss


def _batch(i: int, rows: int):
    g = torch.Generator().manual_seed(100 + i)
    idx = torch.randint(0, 256, (rows, SEQ), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


# -- measuring memory ------------------------------------------------------------------------------

def resident_tensor_bytes() -> int:
    """Bytes of every distinct storage held by a live tensor of this process."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != "cpu":
                continue     # fake tensors kept from capture hold no memory
            st = obj.untyped_storage()
            ptr = st.data_ptr()
        except Exception:
            continue
        if ptr and ptr not in seen:
            seen.add(ptr)
            total += st.nbytes()
    return total


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak of bytes allocated by ops and not yet freed, op by op (frees via tensor finalizers)."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, list] = {}     # storage ptr -> [tensor refcount, bytes]
        self.live = self.peak = 0
        self.tracked: set[int] = set()

    def _drop(self, ptr: int) -> None:
        entry = self.refs.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or id(t) in self.tracked:
                continue
            try:
                ptr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            except Exception:
                continue
            if not ptr:
                continue
            self.tracked.add(id(t))
            if ptr in self.refs:
                self.refs[ptr][0] += 1
            else:
                self.refs[ptr] = [1, size]
                self.live += size
                self.peak = max(self.peak, self.live)
            tid = id(t)
            weakref.finalize(t, self._finalized, ptr, tid)
        return out

    def _finalized(self, ptr: int, tid: int) -> None:
        self.tracked.discard(tid)
        self._drop(ptr)


# -- one rank --------------------------------------------------------------------------------------

def worker(plan_name: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime.distributed import init_distributed, shard_batch
    plan = Plan(backend="eager", verify="off", **PLANS[plan_name])
    model, opt, loss_fn = _model()
    times = []

    def run(world):
        rank, size = (world.dp_rank, world.dp_size) if world else (0, 1)
        step = compile_for_npu(model, plan, optimizer=opt, loss_fn=loss_fn)
        for i in range(2 + steps):
            batch = shard_batch(_batch(i, ROWS * plan.dp), rank, size)
            if world:
                torch.distributed.barrier()
            t0 = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - t0)
        batch = shard_batch(_batch(99, ROWS * plan.dp), rank, size)
        gc.collect()
        resident = resident_tensor_bytes()
        with LiveBytes() as live:
            step(batch)
        if rank == 0:
            Path(out).write_text(json.dumps({"step_s": statistics.median(times[2:]), "resident": resident,
                                             "live_peak": live.peak}))

    if plan.dp > 1:
        with init_distributed(plan) as world:
            run(world)
    else:
        run(None)


def gloo_worker(out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    res = {}
    for n in (1024, 1024 * 1024):
        x = torch.ones(n)
        for _ in range(3):
            dist.all_reduce(x)
        ts = []
        for _ in range(15):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ts.append(time.perf_counter() - t0)
        res[n * 4] = statistics.median(ts)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


# -- calibration -----------------------------------------------------------------------------------

def _launch(args: list[str], n: int, tries: int = 3) -> None:
    """Run the ranks; a launch that fails is retried (the working tree is shared and edited meanwhile)."""
    from cann_passes.runtime.distributed import launch_local
    for attempt in range(tries):
        results = launch_local([__file__, *args], n, env={"PYTHONPATH": str(REPO)}, timeout_s=900, cwd=str(REPO))
        bad = [(rank, r) for rank, r in enumerate(results) if r.returncode != 0]
        if not bad:
            return
        if attempt + 1 < tries:
            print(f"launch {args[:2]} failed (rank {bad[0][0]}), retrying in 30 s", file=sys.stderr)
            time.sleep(30)
    rank, r = bad[0]
    raise RuntimeError(f"{args[:2]} rank {rank} exited {r.returncode}:\n{r.stderr[-3000:]}")


def eager_op_overhead(profile) -> float:
    """Seconds per launched op of the eager backend beyond its roofline (400 small elementwise ops)."""
    from cann_passes.cost_model import node_time
    from graph_ir.analysis.cost import node_cost  # noqa: F401  (node_time reads it)

    def chain(x):
        for _ in range(400):
            x = x * 1.0001 + 0.0001
        return x
    gm = torch.fx.experimental.proxy_tensor.make_fx(chain)(torch.ones(256))
    x = torch.ones(256)
    for _ in range(3):
        gm(x)
    best = min(_timed(gm, x) for _ in range(7))
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    bare = dataclasses.replace(profile, op_overhead=0.0)
    roof = sum(node_time(n, bare) for n in ops)
    return max(0.0, (best - roof) / len(ops))


def _timed(fn, x) -> float:
    t0 = time.perf_counter()
    fn(x)
    return time.perf_counter() - t0


def calibrated_profile(tmp: str):
    torch.set_num_threads(1)
    from cann_passes.cost_model import cpu_profile
    base = cpu_profile()
    overhead = eager_op_overhead(base)
    out = os.path.join(tmp, "gloo.json")
    _launch(["--gloo", out], 2)
    t = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    (n1, t1), (n2, t2) = sorted(t.items())
    # ring all-reduce on 2 ranks: 2 alpha + n / B
    bandwidth = (n2 - n1) / max(t2 - t1, 1e-9)
    alpha = max(1e-6, (t1 - n1 / bandwidth) / 2)
    prof = dataclasses.replace(base, op_overhead=overhead, intra_node_latency=alpha,
                               intra_node_bandwidth=bandwidth)
    return prof, {"op_overhead_us": overhead * 1e6, "gloo_alpha_us": alpha * 1e6,
                  "gloo_bandwidth_GBps": bandwidth / 1e9, "matmul_GFLOPs": base.matrix_flops["fp32"] / 1e9,
                  "bandwidth_GBps": base.memory_bandwidth / 1e9}


def shared(profile, ranks: int):
    """A rank's share of the machine when more ranks run than there are cores."""
    cores = os.cpu_count() or 1
    f = min(1.0, cores / ranks)
    if f == 1.0:
        return profile
    return dataclasses.replace(profile, matrix_flops={k: v * f for k, v in profile.matrix_flops.items()},
                               vector_flops={k: v * f for k, v in profile.vector_flops.items()},
                               memory_bandwidth=profile.memory_bandwidth * f,
                               op_overhead=profile.op_overhead / f)


def predict(profile) -> dict[str, object]:
    from cann_passes import Plan
    from cann_passes.simulate import simulate
    from graph_ir import capture_train_step
    out = {}
    captures = {}
    for name, fields in PLANS.items():
        plan = Plan(backend="eager", verify="off", **fields)
        rows = ROWS // plan.microbatches
        if rows not in captures:
            model, opt, loss_fn = _model()
            captures[rows] = capture_train_step(model, opt, loss_fn, _batch(0, rows))[0]
        out[name] = simulate(captures[rows], plan, profile=shared(profile, plan.dp), tokens_per_microbatch=rows * SEQ)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plans", default=",".join(PLANS))
    parser.add_argument("--worker", nargs=3, metavar=("PLAN", "STEPS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--gloo", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), args.worker[2])
    if args.gloo:
        return gloo_worker(args.gloo)
    names = args.plans.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        profile, cal = calibrated_profile(tmp)
        print("calibrated cpu profile (1 thread per rank): " + ", ".join(f"{k} {v:.3g}" for k, v in cal.items()))
        sims = predict(profile)
        measured: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names:
                out = os.path.join(tmp, f"{name}.{r}.json")
                _launch(["--worker", name, str(args.steps), out], PLANS[name].get("dp", 1))
                measured[name].append(json.loads(Path(out).read_text()))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{'plan':<20}{'ranks':>6}{'pred ms':>9}{'meas ms':>9}{'spread':>8}{'time err':>9}"
          f"{'pred MB':>9}{'meas MB':>9}{'mem err':>8}")
    terr, merr = [], []
    for name in names:
        sim, rows = sims[name], measured[name]
        step = statistics.median(x["step_s"] for x in rows)
        spread = (max(x["step_s"] for x in rows) - min(x["step_s"] for x in rows)) / step
        peak = statistics.median(x["resident"] + x["live_peak"] for x in rows)
        te, me = sim.step_seconds / step - 1, sim.peak_bytes / peak - 1
        terr.append(abs(te))
        merr.append(abs(me))
        print(f"{name:<20}{PLANS[name].get('dp', 1):>6}{sim.step_seconds * 1e3:>9.1f}{step * 1e3:>9.1f}"
              f"{spread:>8.0%}{te:>+9.0%}{sim.peak_bytes / 1e6:>9.2f}{peak / 1e6:>9.2f}{me:>+8.0%}")
    print(f"step time: median |error| {statistics.median(terr):.0%}, max {max(terr):.0%} (goal 25%); "
          f"peak memory: median |error| {statistics.median(merr):.0%}, max {max(merr):.0%} (goal 10%); "
          f"{args.rounds} interleaved rounds of {args.steps} steps on a machine shared with other work")


if __name__ == "__main__":
    main()
