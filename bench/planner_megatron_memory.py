"""Per-rank memory of Megatron's plans from the simulator beside the papers' formulas.

    python bench/planner_megatron_memory.py [--profile a100]

GPT-3 175B on 1,024 devices (tp 8 with sequence parallelism, pp 8 or 16, selective
recomputation, microbatch 1, seq 2048, 1F1B) and LLaMA-2-70B on 64 (tp 8, pp 8, seq 4096):
each model is built on meta at its real width and captured with fake tensors at 3 layers; the
plan's pp = 1 program (tp, dp, recompute, bf16) is compiled for rank 0 of a fake mesh, its
per-block figures are composed into pipeline stages at the real depth and the schedule is
replayed (``cann_passes.simulate.simulate_pipeline``). Composing stages from a 3-layer program is
exact for the per-layer terms (the blocks are identical), so nothing here is scaled but the
depth. Beside each simulated first-stage figure: the formula (``cann_passes.reports.
megatron_memory``: 18 bytes per parameter, Korthikanti's 34 s b h / t per layer held L times
under 1F1B; for LLaMA the same count for its block) and the ratio.

Measured (a100 profile; memory does not depend on it): GPT-3 175B within 5% on every term at
tp 8 x pp 8 and tp 8 x pp 16 (activations 0.95: the model has no dropout, Korthikanti's 34
counts two dropout masks, 32 without). LLaMA-2-70B (tp 8 x pp 8): model state 0.997, state +
activations 1.04, activations 1.11 (was 1.98 while tensor_parallel gathered the K and V
weights and laid K and V out as sequence shards over all kv heads, and selective recompute kept
K and V repeated per query head). Per layer the program keeps 44.75 s b h / t bytes against the
count's 40.5: each decomposed RMSNorm keeps its input, its normalized value (the weight's
gradient reads it) and its output, 3 bf16 tensors where the fused kernel Megatron counts keeps
2 (+4), and K leaves RoPE in fp32 (+0.25); the difference is the program's, and this bench
shows it.
"""
from __future__ import annotations

import argparse
import time

from cann_passes import Plan
from cann_passes.reports.megatron_memory import GPT3_175B, LLAMA2_70B, PLANS, formula
from cann_passes.simulate import GB, simulate
from tools.plan_cli import MODELS, Captures

SHAPES = {"gpt3-175b": GPT3_175B, "llama-70b": LLAMA2_70B}


def compare(sim, shape, mplan) -> list[tuple[str, float, float]]:
    m = sim.memory
    want = formula(shape, mplan)
    state = m["params"] + m["param_copies"] + m["grads"] + m["optimizer_state"]
    return [("model state", state, want["model_state"]), ("activations", m["activations"], want["activations"]),
            ("state + activations", state + m["activations"], want["total"])]


def run(name: str, profile: str, depth: int = 3) -> list[tuple]:
    spec, shape = MODELS[name], SHAPES[name]
    caps = Captures(spec, shape.seq)
    t0 = time.perf_counter()
    captured = caps.get(1, depth)
    rows = []
    for mplan in PLANS[name]:
        plan = Plan(dp=mplan.dp, tp=mplan.tp, sequence_parallel=True, recompute="selective", precision="bf16",
                    microbatches=2 * mplan.pp, verify="off")
        sim = simulate(captured, plan, profile=profile, tokens_per_microbatch=shape.seq, pp=mplan.pp,
                       schedule="1f1b", layers=shape.layers)
        rows.append((mplan, sim, compare(sim, shape, mplan)))
    print(f"{name}: {shape.layers} layers, hidden {shape.hidden}, seq {shape.seq}; captured at {depth} layers "
          f"({time.perf_counter() - t0:.0f}s with compiles)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="a100")
    parser.add_argument("--models", default="gpt3-175b,llama-70b")
    args = parser.parse_args()
    worst = 0.0
    for name in args.models.split(","):
        for mplan, sim, terms in run(name, args.profile):
            print(f"  plan tp={mplan.tp} pp={mplan.pp} dp={mplan.dp} ({mplan.dp * mplan.tp * mplan.pp} devices), "
                  f"microbatch 1, {2 * mplan.pp} microbatches, 1F1B; source: {mplan.source}")
            print(f"  simulated first-stage rank: params {sim.memory['params'] / GB:.2f} GB fp32, bf16 copies "
                  f"{sim.memory['param_copies'] / GB:.2f}, grads {sim.memory['grads'] / GB:.2f}, optimizer "
                  f"{sim.memory['optimizer_state'] / GB:.2f}, activations {sim.memory['activations'] / GB:.2f}, "
                  f"workspace {sim.memory['workspace'] / GB:.2f} (not in the formulas); bubble "
                  f"{sim.bubble_fraction:.1%}")
            print(f"    {'term':<22}{'simulated GB':>14}{'formula GB':>12}{'ratio':>8}")
            for term, got, want in terms:
                print(f"    {term:<22}{got / GB:>14.2f}{want / GB:>12.2f}{got / want:>8.3f}")
                worst = max(worst, abs(got / want - 1))
    print(f"largest deviation from the formulas: {worst:.1%} (acceptance: within 10%)")


if __name__ == "__main__":
    main()
