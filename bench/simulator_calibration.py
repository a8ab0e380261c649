"""Predicted vs measured on this CPU: step time and peak memory of the small GPT under several plans.

    python bench/simulator_calibration.py [--rounds 3] [--steps 5]

The small GPT (``recipes.models.gpt.gpt_small_cpu``: 4 layers, d_model 128, seq 128, 0.84M
parameters, fp32, AdamW) is run for real with the eager backend on gloo (1, 2 and 4 local
processes, one thread each) under dp, ZeRO-1/3, full recompute and 4 microbatches, and each plan is
simulated for rank 0 on the calibrated ``cpu`` profile (:mod:`cann_passes.simulate`).

Calibration (never fitted to the plans' step times): gloo's all-reduce latency and bandwidth,
timed between two processes at 4 KiB and 4 MiB (alpha-beta fit), once; and in every launch, by
rank 0 right before and right after its timed steps, after one compiling step (the other ranks
doing the same at the same time, so ranks that share a core measure the share they get), in this
thread's CPU time, medians, on the ranks' one thread: the matmul rate at the model's projection
shapes and the bandwidth of an elementwise op on an activation-sized tensor (the roofline's
rates), the cost of one launched aten op and of one view op from Python (what the eager
backend's generated code pays per node), and the op table: every distinct op signature (op,
argument layouts and values) of the launch's own graphs timed alone on random inputs rotated out
of the core's caches (``cann_passes.cost_model.calibrate``). Single ops, never a step: the step
is the simulator's composition of them. Each launch is predicted with what it measured: the
machine's load changes from minute to minute, and a profile measured once would compare plans
run under different loads. The ``roof`` column is the same prediction without the op table.

Measured: per step, the process's CPU time (what the step takes on a core of its own: on this
machine, shared with other work, a process gets a fraction of a core and wall time is mostly
waiting; wall time is printed beside), the median over ``--steps`` timed steps after 3 warm-up
steps, per launch. Time blocked in gloo is not CPU time: the small GPT's all-reduce is a few ms of
a step of hundreds. The plans are launched in turn, ``--rounds`` times (interleaved, so load from
other processes falls on every plan alike), and the median over rounds is reported. Peak memory: every tensor
the rank holds before the step (a walk over live tensors: model, optimizer state, shards, batch)
plus the peak of the bytes allocated and not yet freed during one more step, tracked op by op
(a dispatch mode; frees by storage finalizers; an output on an input's storage, such as the
runtime's detach of each parameter, allocates nothing). The load average is printed at the start
and over the run: timings are noisy, see the spread column.

Measured (3 rounds of 5 steps, load average 19.5 median, 32.7 max, on 2 cores): step time -4%
dp1, -8% full recompute, -26% 4 microbatches, +1% dp2, -9% ZeRO-1, -13% ZeRO-3, -18% ZeRO-2 on 4
ranks (the roofline alone: -24% to -41%); peak memory 0% for every plan but ZeRO-3 (-6%). The
goals (25% time, 10% memory) hold for 6 of the 7 plans. What the op table still misses: the
runtime's binding of inputs and write-back of outputs per graph run (about 1 ms, five runs a step
with 4 microbatches), and what ops lose to each other in a step (cache and memory-bandwidth
contention, more so the more ranks share the cores).
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
    """Peak of bytes allocated by ops and not yet freed, op by op (frees via tensor finalizers).
    An output on the storage of one of the op's inputs allocates nothing: a view of a tensor that
    existed before the step (the runtime detaches each parameter to bind it) is not new memory."""

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
        inputs = set()
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                try:
                    inputs.add(t.untyped_storage().data_ptr())
                except Exception:
                    pass
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or id(t) in self.tracked:
                continue
            try:
                ptr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            except Exception:
                continue
            if not ptr or (ptr in inputs and ptr not in self.refs):
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
    times, cpu_times = [], []

    def run(world):
        rank, size = (world.dp_rank, world.dp_size) if world else (0, 1)
        step = compile_for_npu(model, plan, optimizer=opt, loss_fn=loss_fn)
        if world:
            torch.distributed.barrier()
        step(shard_batch(_batch(0, ROWS * plan.dp), rank, size))   # compiles: the graphs to calibrate on
        graphs = [g.graph for g in step.graphs]
        if world:
            torch.distributed.barrier()
        before = machine_rates(graphs)
        for i in range(2 + steps):
            batch = shard_batch(_batch(i, ROWS * plan.dp), rank, size)
            if world:
                torch.distributed.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(batch)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        after = machine_rates(graphs)
        batch = shard_batch(_batch(99, ROWS * plan.dp), rank, size)
        gc.collect()
        resident = resident_tensor_bytes()
        with LiveBytes() as live:
            step(batch)
        if rank == 0:
            rates = {k: (before[k] + after[k]) / 2 for k in before if k != "op_seconds"}
            rates["op_seconds"] = {k: (v + after["op_seconds"].get(k, v)) / 2 for k, v in before["op_seconds"].items()}
            Path(out).write_text(json.dumps({"step_s": statistics.median(cpu_times[2:]),
                                             "wall_s": statistics.median(times[2:]), "resident": resident,
                                             "live_peak": live.peak, "rates": rates}))

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

def _median(fn, repeats: int = 7) -> float:
    # this thread's CPU time, median: what the timed steps are compared by
    from cann_passes.cost_model.profiles import thread_time_median
    return thread_time_median(fn, repeats)


def machine_rates(graphs=()) -> dict:
    """This process's rates now (about 1 s): matmul FLOP/s over the small GPT's projection shapes
    and bytes/s of an elementwise op on an activation-sized tensor (the roofline's rates, for what
    the op table lacks), seconds per launched op and per view op of the eager backend's kind
    (chains of tiny aten calls), and the op table: every op signature of ``graphs`` timed alone
    (``cost_model.calibrate.measure_ops``)."""
    from cann_passes.cost_model.calibrate import measure_ops
    from cann_passes.cost_model.profiles import launch_costs
    shapes = [(ROWS * SEQ, 128, 384), (ROWS * SEQ, 128, 512), (ROWS * SEQ, 512, 128), (ROWS * SEQ, 128, 128)]
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds += _median(lambda: torch.mm(a, b))
        flops += 2 * m * k * n
    x = torch.randn(ROWS * SEQ, 512)
    y = torch.empty_like(x)
    add = _median(lambda: torch.add(x, x, out=y))
    per_op, per_view = launch_costs()
    return {"matmul_flops": flops / seconds, "bandwidth": 12 * x.numel() / add, "op_overhead": per_op,
            "view_overhead": per_view, "op_seconds": measure_ops(graphs)}


def profile_from(base, rates: dict, op_table: bool = True):
    """The cpu profile with the rates one worker measured around its timed steps (and its op table)."""
    mm, bw = rates["matmul_flops"], rates["bandwidth"]
    return dataclasses.replace(base, matrix_flops={k: mm for k in base.matrix_flops},
                               vector_flops={k: bw / 12 for k in base.vector_flops},
                               memory_bandwidth=bw, op_overhead=rates["op_overhead"],
                               view_overhead=rates["view_overhead"],
                               op_seconds=dict(rates["op_seconds"]) if op_table else {})

def _launch(args: list[str], n: int, tries: int = 3) -> None:
    """Run the ranks; a launch that fails is retried (the working tree is shared and edited meanwhile)."""
    from cann_passes.runtime.distributed import launch_local
    for attempt in range(tries):
        results = launch_local([__file__, *args], n, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                               timeout_s=900, cwd=str(REPO))
        bad = [(rank, r) for rank, r in enumerate(results) if r.returncode != 0]
        if not bad:
            return
        if attempt + 1 < tries:
            print(f"launch {args[:2]} failed (rank {bad[0][0]}), retrying in 30 s", file=sys.stderr)
            time.sleep(30)
    rank, r = bad[0]
    raise RuntimeError(f"{args[:2]} rank {rank} exited {r.returncode}:\n{r.stderr[-3000:]}")


def calibrated_profile(tmp: str):
    """The cpu profile with gloo's measured all-reduce latency and bandwidth (the rest per launch)."""
    torch.set_num_threads(1)
    from cann_passes.cost_model import cpu_profile
    base = cpu_profile()
    out = os.path.join(tmp, "gloo.json")
    _launch(["--gloo", out], 2)
    t = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    (n1, t1), (n2, t2) = sorted(t.items())
    # ring all-reduce on 2 ranks: 2 alpha + n / B
    bandwidth = (n2 - n1) / max(t2 - t1, 1e-9)
    alpha = max(1e-6, (t1 - n1 / bandwidth) / 2)
    prof = dataclasses.replace(base, intra_node_latency=alpha, intra_node_bandwidth=bandwidth)
    return prof, {"gloo_alpha_us": alpha * 1e6, "gloo_bandwidth_GBps": bandwidth / 1e9}


class Predictor:
    """Simulates a plan for rank 0 (one capture per microbatch shape, reused)."""

    def __init__(self):
        self.captures = {}

    def __call__(self, name: str, profile):
        from cann_passes import Plan
        from cann_passes.simulate import simulate
        from graph_ir import capture_train_step
        plan = Plan(backend="eager", verify="off", **PLANS[name])
        rows = ROWS // plan.microbatches
        if rows not in self.captures:
            model, opt, loss_fn = _model()
            self.captures[rows] = capture_train_step(model, opt, loss_fn, _batch(0, rows))[0]
        return simulate(self.captures[rows], plan, profile=profile, tokens_per_microbatch=rows * SEQ)


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
    predict = Predictor()
    loads = [os.getloadavg()[0]]
    print(f"load average (1 min) at start {loads[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        profile, cal = calibrated_profile(tmp)
        print("calibrated: " + ", ".join(f"{k} {v:.3g}" for k, v in cal.items())
              + "; per launch, around its timed steps: matmul and elementwise rates, per-op and per-view "
                "cost, and every op signature of its graphs timed alone")
        rows: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names:
                out = os.path.join(tmp, f"{name}.{r}.json")
                _launch(["--worker", name, str(args.steps), out], PLANS[name].get("dp", 1))
                got = json.loads(Path(out).read_text())
                sim = predict(name, profile_from(profile, got["rates"]))
                roof = predict(name, profile_from(profile, got["rates"], op_table=False))
                got.update(pred_s=sim.step_seconds, pred_peak=sim.peak_bytes, roof_s=roof.step_seconds,
                           signatures=len(got["rates"]["op_seconds"]))
                rows[name].append(got)
                loads.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{'plan':<20}{'ranks':>6}{'GFLOP/s':>8}{'ops':>5}{'roof ms':>9}{'err':>6}{'pred ms':>9}{'cpu ms':>9}"
          f"{'spread':>8}{'time err':>9}{'wall ms':>9}{'pred MB':>9}{'meas MB':>9}{'mem err':>8}")
    terr, merr = [], []
    for name in names:
        got = rows[name]
        step = statistics.median(x["step_s"] for x in got)
        pred = statistics.median(x["pred_s"] for x in got)
        roof = statistics.median(x["roof_s"] for x in got)
        re = statistics.median(x["roof_s"] / x["step_s"] - 1 for x in got)
        spread = (max(x["step_s"] for x in got) - min(x["step_s"] for x in got)) / step
        te = statistics.median(x["pred_s"] / x["step_s"] - 1 for x in got)
        peak = statistics.median(x["resident"] + x["live_peak"] for x in got)
        pred_peak = statistics.median(x["pred_peak"] for x in got)
        me = pred_peak / peak - 1
        terr.append(abs(te))
        merr.append(abs(me))
        gflops = statistics.median(x["rates"]["matmul_flops"] for x in got) / 1e9
        wall = statistics.median(x["wall_s"] for x in got)
        ops = statistics.median(x["signatures"] for x in got)
        print(f"{name:<20}{PLANS[name].get('dp', 1):>6}{gflops:>8.1f}{ops:>5.0f}{roof * 1e3:>9.1f}{re:>+6.0%}"
              f"{pred * 1e3:>9.1f}{step * 1e3:>9.1f}{spread:>8.0%}{te:>+9.0%}{wall * 1e3:>9.1f}"
              f"{pred_peak / 1e6:>9.2f}{peak / 1e6:>9.2f}{me:>+8.0%}")
    print(f"step time: median |error| {statistics.median(terr):.0%}, max {max(terr):.0%} (goal 25%); "
          f"peak memory: median |error| {statistics.median(merr):.0%}, max {max(merr):.0%} (goal 10%); "
          f"{args.rounds} interleaved rounds of {args.steps} steps on a machine shared with other work "
          "(time error per launch against the rates that launch measured, median over rounds)")
    print(f"roof: the roofline alone (class rates, per-op and per-view cost, no op table); pred: with the "
          f"op table (ops: signatures timed). Load average (1 min) over the run: median "
          f"{statistics.median(loads):.1f}, max {max(loads):.1f}, on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
