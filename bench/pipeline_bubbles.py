"""Pipeline bubbles: torch's schedules simulated with the cost model, beside the papers' forms.

    python bench/pipeline_bubbles.py [--trace out/pipeline_zb1p_p4_m8.json] [--profile ascend_910b]
    python bench/pipeline_bubbles.py --measured out/events_1f1b.json [--measured ...]

1. For p in {2, 4, 8} ranks and m in {4, 8, 16} microbatches, each schedule's action
   lists (taken from torch.distributed.pipelining's own classes) replayed with equal stage
   costs (F = I = W = 1: the backward is twice the forward) and free transfers: the bubble
   fraction (idle / (ranks x makespan)) beside the closed form (GPipe / 1F1B
   (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZB1P (p-1)(F+B-2W), DualPipeV
   (p-1)(F&B+B-3W) on half stages, as fractions of the step) and their ratio. The forms
   are stated for m >= p (a multiple of p for interleaving); below that torch's flexible
   schedules leave more bubble than the form, and the table shows it.
2. The same schedules with a GPT-sized layer on a device profile: stage times from the
   roofline (6 * params * tokens FLOPs per layer split F : I : W = 1 : 1 : 1), activations
   sent between stages over the profile's link (alpha-beta), and the dynamic choice under a
   memory limit.
3. The ratio simulated / formula when F, I and W differ.
4. One Chrome trace (opens in Perfetto) of the schedule named by --trace.

5. With --measured: events a pipeline run recorded (``schedules.save_events``), their
   bubble beside the simulation of the same schedule with the measured mean stage costs.
6. With --run: runs every schedule on gloo (local processes, one intra-op thread each) at
   pp = 2 and pp = 4 on a small GPT (4 layers, d_model 64, vocab 256, seq 64, 8 microbatches),
   records the last of 3 steps' per-action events (``out/events_<schedule>_p<P>.json``) and
   prints table 5 for them: measured beside simulated beside the formula. CPU ranks share the
   machine's cores (and here other work), so measured bubbles carry that contention; the
   simulated figure is what the same mean costs give without it.

    python bench/pipeline_bubbles.py --run [--schedules gpipe,1f1b] [--pp 2,4]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cann_passes import schedules as S
from cann_passes.cost_model import get_profile
from cann_passes.schedules import StageCost

CANDIDATES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb1p", 1), ("zb1p", 2),
              ("dualpipev", 2))
EQUAL = StageCost(1.0, 1.0, 1.0)


def label(name: str, v: int) -> str:
    return name if v == 1 or name == "dualpipev" else f"{name} v={v}"


def formula_table() -> None:
    print("Bubble fraction, equal stage costs (F = I = W), free transfers: simulated vs closed form")
    print(f"{'schedule':<22}{'p':>3}{'m':>4}{'simulated':>11}{'formula':>10}{'sim/formula':>13}"
          f"{'peak in flight (stage 0)':>26}")
    for name, v in CANDIDATES:
        for p in (2, 4, 8):
            for m in (4, 8, 16):
                try:
                    tl = S.simulate(name, p, m, EQUAL, v)
                except S.ScheduleError as exc:
                    print(f"{label(name, v):<22}{p:>3}{m:>4}{'-':>11}{'-':>10}{'-':>13}   refused: "
                          f"{str(exc).split('(')[0].strip()}")
                    continue
                f = S.bubble_fraction_formula(name, p, m, v, EQUAL)
                print(f"{label(name, v):<22}{p:>3}{m:>4}{tl.bubble_fraction:>11.4f}{f:>10.4f}"
                      f"{tl.bubble_fraction / f:>13.3f}{tl.in_flight()[0]:>26}")
        print()


def cost_ratio_table() -> None:
    """How far each form holds when F, I and W differ (GPipe / 1F1B / interleaved: exactly)."""
    ratios = [StageCost(1.0, 1.0, 1.0), StageCost(1.0, 1.2, 0.8), StageCost(1.0, 1.5, 0.5),
              StageCost(1.0, 0.8, 1.2), StageCost(1.0, 2.0, 2.0)]
    print("Simulated / formula bubble when stage costs differ (p=4, m=16; free transfers)")
    print(f"{'F:I:W':<14}" + "".join(f"{label(n, v):>22}" for n, v in CANDIDATES))
    for c in ratios:
        cells = []
        for name, v in CANDIDATES:
            tl = S.simulate(name, 4, 16, c, v)
            cells.append(f"{tl.bubble_fraction / S.bubble_fraction_formula(name, 4, 16, v, c):>22.3f}")
        ratio = f"{c.forward_s:g}:{c.backward_input_s:g}:{c.backward_weight_s:g}"
        print(f"{ratio:<14}" + "".join(cells))
    print("(ZB1P / DualPipeV: torch's fixed orders meet the papers' forms at F = I = W; the papers'\n"
          " forms assume a schedule fitted to the costs)\n")


def layer_costs(profile_name: str, *, hidden: int, seq: int, micro_batch: int, layers: int, pp: int):
    """A GPT block's time on the profile's matrix unit (bf16), and the bytes a stage sends."""
    profile = get_profile(profile_name)
    import torch
    rate = profile.matrix_rate(torch.bfloat16)
    tokens = seq * micro_batch
    params = 12 * hidden * hidden
    flops_f = 2 * params * tokens + 4 * seq * seq * hidden * micro_batch     # matmuls + attention
    f = flops_f / rate
    per_stage = layers // pp
    send = tokens * hidden * 2                                               # bf16 activations
    return profile, StageCost(per_stage * f, per_stage * f, per_stage * f, send_bytes=send)


def profile_table(profile_name: str) -> None:
    hidden, seq, mb, layers, p, m = 4096, 4096, 1, 32, 4, 16
    profile, cost = layer_costs(profile_name, hidden=hidden, seq=seq, micro_batch=mb, layers=layers, pp=p)
    xfer = S.transfer_seconds(cost.send_bytes, profile, p)
    print(f"{profile.name}: GPT block d={hidden}, seq {seq}, microbatch {mb}, {layers} layers on p={p}, "
          f"m={m}: stage F = {cost.forward_s * 1e3:.2f} ms, activation {cost.send_bytes / 2**20:.0f} MiB, "
          f"transfer {xfer * 1e3:.3f} ms")
    act_per_stage = 34 * seq * mb * hidden * (layers // p)     # Korthikanti et al. 2022, bf16, no recompute
    static = 16 * 12 * hidden * hidden * (layers // p)         # bf16 weights+grads, fp32 Adam + master
    limit = 0.75 * profile.memory_capacity
    name, tl = S.choose_schedule(p, m, [cost] * p, link=profile, stage_activation_bytes=[act_per_stage] * p,
                                 stage_static_bytes=[static] * p, memory_limit=limit,
                                 candidates=CANDIDATES)
    print(f"dynamic schedule (memory limit {limit / 2**30:.1f} GiB per rank, activations "
          f"{act_per_stage / 2**30:.2f} GiB per microbatch per stage): {label(name, tl.extra['v'])}")
    print(tl.extra["table"])
    print()


def _imbalance(costs: list[StageCost], stages_of_rank: dict[int, list[int]]) -> float:
    """Max / mean over ranks of the measured compute per microbatch (F + I + W of the rank's stages):
    the formulas assume 1.0; above it the slowest rank sets the pace and the others wait."""
    per_rank = [sum(costs[s].forward_s + costs[s].backward_input_s + costs[s].backward_weight_s for s in stages)
                for stages in stages_of_rank.values()]
    return max(per_rank) / (sum(per_rank) / len(per_rank))


def measured_table(paths: list[str]) -> None:
    """Measured bubbles beside the simulation of the same schedule with the measured mean costs."""
    print("Measured bubble vs simulated (same schedule, mean measured stage costs, free transfers) vs formula "
          "(balanced stages);\nstage imbalance: max / mean measured compute per rank")
    print(f"{'schedule':<22}{'p':>3}{'m':>4}{'measured':>10}{'simulated':>11}{'formula':>10}"
          f"{'makespan meas/sim':>19}{'stage imbalance':>17}")
    for path in paths:
        measured = S.load_events(path)
        name, v = measured.name, measured.v
        costs = S.stage_costs_from_timeline(measured)
        sim = S.simulate(name, measured.pp, measured.microbatches, costs, v)
        mean = StageCost(*(sum(getattr(c, k) for c in costs) / len(costs)
                           for k in ("forward_s", "backward_input_s", "backward_weight_s")))
        f = S.bubble_fraction_formula(name, measured.pp, measured.microbatches, v, mean)
        print(f"{label(name, v):<22}{measured.pp:>3}{measured.microbatches:>4}{measured.bubble_fraction:>10.4f}"
              f"{sim.bubble_fraction:>11.4f}{f:>10.4f}{measured.makespan / sim.makespan:>19.3f}"
              f"{_imbalance(costs, S.rank_stages(name, measured.pp, v)):>17.3f}")
        trace = os.path.splitext(path)[0] + ".trace.json"
        print(f"  measured trace: {measured.to_chrome_trace(trace)}")


RUN_MODEL = dict(n_layer=4, d_model=64, n_head=4, vocab_size=256, seq_len=64)
RUN_ROWS, RUN_MICROBATCHES, RUN_STEPS = 8, 8, 3
RUN_SCHEDULES = "gpipe,1f1b,interleaved_1f1b,zb1p,dualpipev"


def run_worker(out: str, pp: int, schedules: list[str]) -> None:
    """One gloo rank: every schedule in turn on the same model; this rank's last-step events."""
    import torch

    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime.distributed import init_distributed
    from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
    results = {}
    with init_distributed(Plan(backend="eager", pp=pp, microbatches=RUN_MICROBATCHES)) as world:
        for name in schedules:
            torch.manual_seed(0)
            model = GPT(gpt_tiny(tie_weights=False, bias=False, **RUN_MODEL))
            v = 2 if name == "interleaved_1f1b" else 1
            plan = Plan(backend="eager", pp=pp, microbatches=RUN_MICROBATCHES, pipeline_schedule=name,
                        pipeline_virtual_stages=v, verify="off")
            step = compile_for_npu(model, plan, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                   loss_fn=gpt_loss)
            for i in range(RUN_STEPS):   # the first step also compiles; the last one is kept
                g = torch.Generator().manual_seed(1000 + i)
                idx = torch.randint(0, RUN_MODEL["vocab_size"], (RUN_ROWS, RUN_MODEL["seq_len"]), generator=g)
                step((idx, torch.roll(idx, -1, dims=1)))
            results[name] = [(e.rank, e.stage, e.microbatch, e.kind, e.start_s, e.end_s)
                             for e in step.pipeline_timeline().events]
    torch.save(results, Path(out) / f"rank{world.rank}.pt")


def run_measured(schedules: list[str], pps: list[int], out_dir: str = "out") -> list[str]:
    """Launch the ranks per pp, save each schedule's events as ``out/events_<schedule>_p<P>.json``."""
    import torch

    from cann_passes.runtime.distributed import launch_local
    repo = str(Path(__file__).resolve().parents[1])
    paths = []
    for pp in pps:
        with tempfile.TemporaryDirectory() as tmp:
            results = launch_local([__file__, "--worker", tmp, str(pp), *schedules], pp,
                                   env={"PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}, timeout_s=1800, cwd=repo)
            for rank, r in enumerate(results):
                if r.returncode != 0:
                    raise SystemExit(f"pp={pp} rank {rank} failed:\n{r.stderr[-3000:]}")
            ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(pp)]
        for name in schedules:
            tl = S.timeline_from_events([e for r in ranks for e in r[name]], name=name)
            tl.v = S.stages_per_rank(name, 2 if name == "interleaved_1f1b" else 1)
            paths.append(S.save_events(tl, os.path.join(out_dir, f"events_{name}_p{pp}.json")))
    return paths


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="out/pipeline_zb1p_p4_m8.json",
                    help="Chrome-trace path; the schedule, p and m are read from the name")
    ap.add_argument("--profile", default="ascend_910b")
    ap.add_argument("--measured", action="append", default=[],
                    help="events JSON of a measured run (schedules.save_events); repeatable")
    ap.add_argument("--run", action="store_true", help="run the schedules on gloo and print table 5 for them")
    ap.add_argument("--schedules", default=RUN_SCHEDULES, help="with --run: comma-separated schedules")
    ap.add_argument("--pp", default="2,4", help="with --run: comma-separated pipeline sizes")
    args = ap.parse_args()
    if args.run:
        args.measured += run_measured(args.schedules.split(","), [int(p) for p in args.pp.split(",")])
    if args.measured:
        print(f"GPT {RUN_MODEL}, {RUN_ROWS} rows, measured on this CPU (gloo)" if args.run else "")
        measured_table(args.measured)
        return
    formula_table()
    cost_ratio_table()
    profile_table(args.profile)
    base = os.path.basename(args.trace).removesuffix(".json").split("_")
    try:
        p = int(base[-2].removeprefix("p"))
        m = int(base[-1].removeprefix("m"))
        name = "_".join(base[1:-2])
    except (ValueError, IndexError):
        raise SystemExit(f"--trace {args.trace!r}: name it pipeline_<schedule>_p<P>_m<M>.json") from None
    v = 2 if name in ("interleaved_1f1b", "dualpipev") else 1
    tl = S.simulate(name, p, m, StageCost(1e-3, 1e-3, 1e-3), v)
    print(f"Chrome trace ({tl.summary()}): {tl.to_chrome_trace(args.trace)}")


if __name__ == "__main__":
    main()
