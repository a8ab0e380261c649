"""The ZeRO paper's model-state table (Psi = 7.5B, N = 64 ranks, Adam K = 12) from the simulator.

    python bench/planner_zero_table.py [--ranks 64]

A GPT of d_model 4096 and 36 layers (7.4B parameters) is built on meta,
captured at 2 and 3 layers with fake tensors, compiled for rank 0 of a fake
64-rank mesh for each ZeRO stage (bf16 autocast, Adam), and its per-rank
parameter, gradient and optimizer-state bytes are continued linearly to 36
layers (``cann_passes.simulate.simulate_extrapolated``). Beside them the
paper's figures (Rajbhandari et al. 2020, Table 1): stage 0 (2+2+K)Psi,
stage 1 2Psi+2Psi+K Psi/N, stage 2 2Psi+(2+K)Psi/N, stage 3 (2+2+K)Psi/N.
Stages 0 and 3 match the paper term for term in total. The graph keeps the
fp32 master parameters as its parameters (4 bytes each, where the paper counts
a bf16 copy, 2, plus the fp32 master inside K) and already reduce-scatters the
fp32 gradient at stage 1, so each rank holds only a gradient shard: stage 1's
total equals the paper's by a different split (4 Psi of fp32 parameters where
the paper has 2 Psi bf16 parameters + 2 Psi bf16 gradients), and stage 2
saves nothing over stage 1 here (ratio 1.89 against the paper's 16.5 GB, whose
bf16 parameter copy is 2 Psi): the program's stage 2 is not the paper's.
"""
from __future__ import annotations

import argparse

from cann_passes import Plan
from cann_passes.simulate import GB
from tools.plan_cli import Captures, ModelSpec, _gpt

K = 12


def paper(stage: int, psi: float, n: int) -> float:
    return {0: (2 + 2 + K) * psi, 1: 4 * psi + K * psi / n, 2: 2 * psi + (2 + K) * psi / n,
            3: (2 + 2 + K) * psi / n}[stage]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()
    spec = ModelSpec("gpt-7.5b", _gpt(n_layer=36), 36, 128, 32)
    caps = Captures(spec, spec.seq)
    psi = caps.model_state(1)["params"] / 4          # fp32 master parameters, 4 bytes each
    print(f"GPT d_model 4096, 36 layers: Psi = {psi / 1e9:.2f}B; {caps.method}; N = {args.ranks}")
    print(f"{'stage':>5}{'params GB':>11}{'grads GB':>10}{'optim GB':>10}{'total GB':>10}{'paper GB':>10}{'ratio':>7}")
    for stage in (0, 1, 2, 3):
        plan = Plan(dp=args.ranks, zero_stage=stage, precision="bf16", verify="off")
        sim = caps.simulate(plan, 1, "ascend_910b", 64 * GB)
        m = sim.memory
        total = m["params"] + m["grads"] + m["optimizer_state"]
        ref = paper(stage, psi, args.ranks)
        print(f"{stage:>5}{m['params'] / GB:>11.2f}{m['grads'] / GB:>10.2f}{m['optimizer_state'] / GB:>10.2f}"
              f"{total / GB:>10.2f}{ref / GB:>10.2f}{total / ref:>7.2f}")


if __name__ == "__main__":
    main()
