"""The ZeRO paper's model-state table (Psi = 7.5B, N = 64 ranks, Adam K = 12) from the simulator.

    python bench/planner_zero_table.py [--ranks 64]

A GPT of d_model 4096 and 36 layers (7.4B parameters) is built on meta, captured at 2 and 3
layers with fake tensors, compiled for rank 0 of a fake 64-rank mesh for each ZeRO stage (bf16
autocast, Adam), and its per-rank bytes are continued linearly to 36 layers
(``cann_passes.simulate.simulate_extrapolated``; the columns the simulator does not split out are
read from the same compiled programs and continued the same way).

The paper's columns (Rajbhandari et al. 2020, Sec. 5 and Table 1): fp16 parameters 2 Psi (whole
at stages 0-2), fp16 gradients 2 Psi (whole at 0-1, a shard at 2-3), K = 12 bytes of fp32 master
weight and Adam moments (a shard from stage 1).

The program's columns, per rank, each term at its largest during the step (the paper's model-state
accounting; the terms need not peak together, the simulator's peak is what is live at once):
- "16-bit p": the bf16 weights the step holds whole. With the fp32 parameters whole (the default,
  ``master=whole``) these are the casts autocast keeps from forward for backward; with
  ``zero_master: sharded`` (``optimizer_shard{master=sharded}``) they are the copies gathered once per step from each rank's
  cast shard (a weight that is read in fp32 somewhere, such as the tied embedding / lm_head and
  the norms, is gathered in fp32 and counted here at 4 bytes). At stage 3 the gathers are per
  bucket and short-lived: nothing is held whole.
- "grads": fp32 gradients (autocast casts each weight's gradient back to fp32 where backward
  makes it, and they are reduced in fp32). At stages 0-1 all of them live whole when backward
  ends (stage 1 reduce-scatters after backward: checked here from the graph), at 2-3 only this
  rank's shard (plus the bucket in flight, at most ``bucket_mb``, not counted).
- "K": fp32 parameters (the master) + Adam's two fp32 moments.

The per-term differences printed under the table sum exactly to each row's difference.
"""
from __future__ import annotations

import argparse

from cann_passes import Plan
from cann_passes.compile import compile_program
from cann_passes.simulate import GB, extrapolate, mesh_for
from graph_ir.analysis.memory import state_bytes
from graph_ir.meta import ORIGIN_PASS, Region, nbytes, region_of
from tools.plan_cli import EXTRAPOLATE_FROM, Captures, ModelSpec, _gpt

K = 12
ROWS = [(0, "whole"), (1, "whole"), (1, "sharded"), (2, "whole"), (2, "sharded"), (3, "sharded")]


def paper(stage: int, psi: float, n: int) -> tuple[float, float, float]:
    """Table 1's per-rank bytes by column: fp16 parameters, fp16 gradients, optimizer (K)."""
    return {0: (2 * psi, 2 * psi, K * psi), 1: (2 * psi, 2 * psi, K * psi / n),
            2: (2 * psi, 2 * psi / n, K * psi / n), 3: (2 * psi / n, 2 * psi / n, K * psi / n)}[stage]


def plan_for(stage: int, master: str, n: int) -> Plan:
    return Plan(dp=n, zero_stage=stage, precision="bf16", verify="off",
                **({"zero_master": master} if stage in (1, 2) else {}))


def _held_whole(graph, stage: int) -> tuple[int, bool]:
    """(bytes of parameters gathered whole for forward and backward, every reduce-scatter after backward)."""
    nodes = list(graph.graph.nodes)
    end = max(i for i, n in enumerate(nodes) if region_of(n) == Region.BACKWARD and ORIGIN_PASS not in n.meta)
    after = all(i > end for i, n in enumerate(nodes) if "reduce_scatter" in str(n.target))
    gathered = 0
    if stage < 3:
        gathered = sum(nbytes(n.meta["val"]) for n in nodes
                       if "all_gather" in str(n.target) and region_of(n) == Region.FORWARD)
    return gathered, after


def program_columns(caps: Captures, plan: Plan, stage: int, sim_memory: dict, whole_grads: float) -> dict:
    figures = {}
    for depth in EXTRAPOLATE_FROM:
        program = compile_program(caps.get(1, depth), plan.replace(dump_dir=None), mesh_for(plan, 0))
        (graph,) = program.graphs.values()
        gathered, after = _held_whole(graph, stage)
        figures[depth] = {"gathered": gathered, "rs_after_backward": float(after)}
        master = graph.attrs.get("zero", {}).get("master", "whole")
    (la, a), (lb, b) = sorted(figures.items())
    ext = extrapolate(a, b, la, lb, caps.spec.layers)
    if stage == 1 and ext["rs_after_backward"] != 1.0:
        raise SystemExit("stage 1 reduce-scatters during backward: its gradients are not whole at the peak")
    low = ext["gathered"] if master == "sharded" else sim_memory["param_copies"]
    grads = whole_grads if stage <= 1 else sim_memory["grads"]
    return {"low": low, "master": sim_memory["params"], "grads": grads, "moments": sim_memory["optimizer_state"],
            "where": master}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()
    spec = ModelSpec("gpt-7.5b", _gpt(n_layer=36), 36, 128, 32)
    caps = Captures(spec, spec.seq)
    psi = caps.model_state(1)["params"] / 4          # fp32 master parameters, 4 bytes each
    sb = {d: state_bytes(caps.get(1, d)).grads for d in EXTRAPOLATE_FROM}
    (la, ga), (lb, gb) = sorted(sb.items())
    whole_grads = extrapolate(ga, gb, la, lb, spec.layers)           # every fp32 gradient, whole
    n = args.ranks
    print(f"GPT d_model 4096, 36 layers: Psi = {psi / 1e9:.2f}B; {caps.method}; N = {n}; GB = 1e9 bytes")
    print("per rank, each term at its largest in the step; program: 16-bit p (bf16 weights held whole) | "
          "grads (fp32) | K = fp32 params + Adam moments")
    print(f"{'stage':<7}{'fp32 params':<13}{'16-bit p':>9}{'grads':>8}{'K':>8}{'total':>8}  |"
          f"{'paper p':>8}{'g':>7}{'K':>7}{'total':>7}  |{'ratio':>6}{'sim peak':>9}")
    notes = []
    for stage, master in ROWS:
        plan = plan_for(stage, master, n)
        sim = caps.simulate(plan, 1, "ascend_910b", 64 * GB)
        m = sim.memory
        c = program_columns(caps, plan, stage, m, whole_grads)
        k = c["master"] + c["moments"]
        total = c["low"] + c["grads"] + k
        p16, g16, pk = paper(stage, psi, n)
        ref = p16 + g16 + pk
        where = "-" if stage == 0 else c["where"]
        print(f"{stage:<7}{where:<13}{c['low'] / GB:>9.2f}{c['grads'] / GB:>8.2f}{k / GB:>8.2f}{total / GB:>8.2f}  |"
              f"{p16 / GB:>8.2f}{g16 / GB:>7.2f}{pk / GB:>7.2f}{ref / GB:>7.2f}  |{total / ref:>6.2f}"
              f"{sim.peak_bytes / GB:>9.2f}")
        notes.append((stage, where, c["low"] - p16, c["grads"] - g16, k - pk, total - ref))
    print("\nper-term difference to the paper, GB (16-bit p + grads + K = row total - paper total):")
    for stage, where, dp_, dg, dk, dt in notes:
        why = []
        if abs(dp_) > 0.005 * GB:
            why.append(f"16-bit p {dp_ / GB:+.2f}" + (" (weights read in fp32, the tied embedding / lm_head "
                                                     "and norms, gathered at 4 bytes)" if dp_ > 0 else
                                                     " (nothing held whole: stage 3 gathers per bucket)"))
        if abs(dg) > 0.005 * GB:
            why.append(f"grads {dg / GB:+.2f} (fp32 gradients, 4 bytes where the paper has 2)")
        if abs(dk) > 0.005 * GB:
            why.append(f"K {dk / GB:+.2f}" + (" (the fp32 parameters whole on every rank: the master is not "
                                              "sharded)" if where == "whole" else " (shard padding)"))
        print(f"  stage {stage} {where:<8} {dt / GB:+6.2f} = " + ("; ".join(why) or "none"))
    print("sim peak: the simulator's per-rank peak, what is live at once (activations of one 128-token row "
          "included; below the column total where the whole gradients and 16-bit weights do not coincide).")


if __name__ == "__main__":
    main()
