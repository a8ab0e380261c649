"""Pipeline stage balance and bubbles: the cost split beside the layer-count split, measured beside simulated.

Part 1 (one process, fake meshes): a GPT with embedding and a heavy head (vocab 4096) is split
into pp = 2 and 4 stages by the default plan's ``pipeline_split`` (cost model units: cuts
between and inside blocks, each priced by what it sends), by the same balancer restricted to
residual-only cuts, and by equal layer counts; printed: the estimated stage imbalance (max /
mean stage compute cost) of each, side by side, under the plan's default device profile
(``auto``: the CPU this runs on, measured) and the 910B's. On the 910B profile this small model
is bound by per-op overheads, so its head is not heavy and the layer split is already even.

Part 2 (gloo, local processes): the same plans run for real on CPU; from the last step's
per-action events the measured bubble fraction (idle / ranks x makespan), beside the
schedule simulator's bubble for the measured per-stage costs
(``schedules.simulate`` with ``stage_costs_from_timeline``) and the textbook formula.
CPU ranks share two cores with each other (and, here, with other work), so measured
bubbles are noisy; the simulated figure is what the same costs give without contention.

    python bench/pipeline_balance.py            # both parts
    python bench/pipeline_balance.py --no-run   # part 1 only
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cann_passes import Plan, compile_for_npu  # noqa: E402
from cann_passes.compile import compile_program  # noqa: E402
from graph_ir import capture_train_step  # noqa: E402
from graph_ir.mesh import MeshDesc  # noqa: E402
from graph_ir.meta import GraphAttr  # noqa: E402
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny  # noqa: E402

LAYERS, D_MODEL, HEADS, VOCAB, SEQ, ROWS = 16, 128, 4, 4096, 64, 8
MICROBATCHES = 8


# Part 2 runs a smaller GPT (4 layers, d_model 64, vocab 256): CPU ranks compile and run it in minutes.
RUN_MODEL = dict(n_layer=4, d_model=64, n_head=4, vocab_size=256, seq_len=SEQ)


def model(**cfg):
    torch.manual_seed(0)
    cfg = cfg or dict(n_layer=LAYERS, d_model=D_MODEL, n_head=HEADS, vocab_size=VOCAB, seq_len=SEQ)
    return GPT(gpt_tiny(tie_weights=False, bias=False, **cfg))


def batch(i: int, rows: int = ROWS, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(1000 + i)
    idx = torch.randint(0, vocab, (rows, SEQ), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


PROFILES = ("auto", "ascend_910b")    # the plan's default (this machine: the CPU) and the NPU's


def split_table() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    captured, _ = capture_train_step(m, opt, gpt_loss, batch(0, ROWS // MICROBATCHES))
    print(f"GPT {LAYERS} layers, d_model {D_MODEL}, vocab {VOCAB} (embedding + head), seq {SEQ}; "
          f"microbatch of {ROWS // MICROBATCHES} rows, {MICROBATCHES} microbatches, 1F1B")
    print("cost split: the default plan (pipeline_split: cost): every cut where at most 6x the residual "
          "stream crosses, each priced by its transfer time;\nresidual-only: the same balancer with cuts only "
          "where the residual stream alone crosses (cut_slack 1.5); layer split: equal layer counts")
    print(f"{'pp':>3} {'profile':>12} {'units':>6} {'cost split':>11} {'residual-only':>14} {'layer split':>12} "
          f"{'layer/cost':>11}   stage costs (cost split, ms), tensors sent per cut")
    for profile in PROFILES:
        for pp in (2, 4):
            common = dict(pp=pp, microbatches=MICROBATCHES, backend="eager", verify="off", device_profile=profile)
            mesh = MeshDesc.fake(pp=pp)
            info = {}
            for key, plan in (("cost", Plan(**common)),
                              ("layers", Plan(**common, pipeline_split=[LAYERS // pp] * pp)),
                              ("coarse", Plan(**common, pipeline=(
                                  f"cleanup,grad_accumulation{{microbatches={MICROBATCHES}}},"
                                  f"pipeline_split{{stages={pp},pp={pp},cut_slack=1.5}},cleanup")))):
                info[key] = compile_program(captured, plan, mesh).attrs[GraphAttr.PIPELINE_PARALLEL]
            cost = info["cost"]
            ms = ", ".join(f"{t * 1e3:.3f}" for t in cost["stage_seconds"])
            print(f"{pp:>3} {profile:>12} {cost['units']:>6} {cost['imbalance']:>11.4f} "
                  f"{info['coarse']['imbalance']:>14.4f} {info['layers']['imbalance']:>12.4f} "
                  f"{info['layers']['imbalance'] / cost['imbalance']:>11.3f}   {ms}; {cost['boundary_tensors'][1:]}")


def worker(out: str, pp: int, schedules: list[str]) -> None:
    from cann_passes.runtime.distributed import init_distributed
    results = {}
    with init_distributed(Plan(backend="eager", pp=pp, microbatches=MICROBATCHES)) as world:
        for name in schedules:
            m = model(**RUN_MODEL)
            plan = Plan(backend="eager", pp=pp, microbatches=MICROBATCHES, pipeline_schedule=name, verify="off")
            step = compile_for_npu(m, plan, optimizer=torch.optim.SGD(m.parameters(), lr=0.01), loss_fn=gpt_loss)
            for i in range(3):   # the first step also compiles; the last one is measured
                step(batch(i, vocab=RUN_MODEL["vocab_size"]))
            results[name] = [(e.rank, e.stage, e.microbatch, e.kind, e.start_s, e.end_s)
                             for e in step.pipeline_timeline().events]
    torch.save(results, Path(out) / f"rank{world.rank}.pt")


def bubble_table(schedules: list[str]) -> None:
    import tempfile

    from cann_passes.runtime.distributed import launch_local
    from cann_passes.schedules import (bubble_fraction_formula, simulate, stage_costs_from_timeline,
                                       timeline_from_events)
    print(f"\nGPT {RUN_MODEL}; measured on CPU (gloo, {MICROBATCHES} microbatches, last of 3 steps) beside "
          "simulated with the measured stage costs and the formula")
    print(f"{'pp':>3} {'schedule':>9} {'measured':>9} {'simulated':>10} {'formula':>8}")
    for pp in (2, 4):
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            results = launch_local([__file__, "--worker", out, str(pp), *schedules], pp,
                                   env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])}, timeout_s=1200)
            for rank, r in enumerate(results):
                if r.returncode != 0:
                    raise SystemExit(f"rank {rank} failed:\n{r.stderr[-3000:]}")
            ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(pp)]
        for name in schedules:
            measured = timeline_from_events([e for r in ranks for e in r[name]], name=name)
            simulated = simulate(name, pp, MICROBATCHES, stage_costs_from_timeline(measured))
            formula = bubble_fraction_formula(name, pp, MICROBATCHES)
            print(f"{pp:>3} {name:>9} {measured.bubble_fraction:>9.3f} {simulated.bubble_fraction:>10.3f} "
                  f"{formula:>8.3f}")
        print(f"    (pp={pp}: {time.perf_counter() - t0:.0f} s with compilation)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="only the split table (no processes)")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    args = parser.parse_args()
    split_table()
    if not args.no_run:
        bubble_table(args.schedules.split(","))


if __name__ == "__main__":
    main()
