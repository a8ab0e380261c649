"""The ZeRO paper's model-state table (Psi = 7.5B, N = 64 ranks, Adam K = 12) from the simulator.

    python bench/planner_zero_table.py [--ranks 64]

A GPT of d_model 4096 and 36 layers (7.4B parameters) is built on meta, captured at 2 and 3
layers with fake tensors, compiled for rank 0 of a fake 64-rank mesh for each ZeRO stage (bf16
autocast, Adam), and its per-rank bytes are continued linearly to 36 layers
(``cann_passes.simulate.simulate_extrapolated``).

What DeepSpeed's stages keep per rank (Rajbhandari et al. 2020, Sec. 5 and Table 1; DeepSpeed's
``stage_1_and_2.py``: stage 1 keeps the whole fp16 gradient until the end of backward and reduces
it into each rank's partition, stage 2 reduces it bucket by bucket into the partition as backward
runs, ``stage3.py`` also partitions the fp16 parameters): fp16 parameters 2 Psi (whole at stages
0-2), fp16 gradients 2 Psi (whole at 0-1, a shard at 2-3), K = 12 bytes of fp32 master weight and
Adam moments (a shard from stage 1).

What the program keeps (read from the compiled graphs): fp32 parameters, which are also the
master weights (4 Psi); fp32 gradients (4 Psi, or a shard); Adam's two fp32 moments (8 Psi, or a
shard); and, saved from forward for backward, the bf16 cast of each weight ("bf16 copies", the
paper's fp16 parameters, 2 Psi; freed after backward, so not state between steps). Mapped to the
paper's columns: fp16 params = bf16 copies, gradients = fp32 gradients, optimizer (K) = fp32
parameters + moments. The model state that lives between steps (fp32 params + grads + moments)
matches the paper's total at stages 0, 1 and 3 (stage 1 by a different split: the program
already reduce-scatters gradients at stage 1, as DeepSpeed's stage 2 does, but keeps the fp32
parameters whole where the paper has fp16 parameters + fp16 gradients whole and the master
sharded). Stage 2 is really different: the program's stage 2 is its stage 1, the fp32
parameters (the master) stay whole on every rank, where DeepSpeed keeps only the 16-bit copy
whole and shards the master. That difference is the program's (``optimizer_shard``), not
the simulator's accounting.
"""
from __future__ import annotations

import argparse

from cann_passes import Plan
from cann_passes.simulate import GB
from tools.plan_cli import Captures, ModelSpec, _gpt

K = 12


def paper(stage: int, psi: float, n: int) -> dict[str, float]:
    """Table 1's per-rank bytes by column: fp16 parameters, fp16 gradients, optimizer (K)."""
    return {0: (2 * psi, 2 * psi, K * psi), 1: (2 * psi, 2 * psi, K * psi / n),
            2: (2 * psi, 2 * psi / n, K * psi / n), 3: (2 * psi / n, 2 * psi / n, K * psi / n)}[stage]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()
    spec = ModelSpec("gpt-7.5b", _gpt(n_layer=36), 36, 128, 32)
    caps = Captures(spec, spec.seq)
    psi = caps.model_state(1)["params"] / 4          # fp32 master parameters, 4 bytes each
    n = args.ranks
    print(f"GPT d_model 4096, 36 layers: Psi = {psi / 1e9:.2f}B; {caps.method}; N = {n}")
    print("per rank, GB; program columns: fp32 params | bf16 copies kept for backward | fp32 grads | Adam moments")
    print(f"{'stage':>5}{'fp32 p':>8}{'bf16 cp':>8}{'grads':>7}{'moments':>8}  |{'paper fp16 p':>13}{'fp16 g':>8}"
          f"{'K':>7}  |{'state':>7}{'paper':>7}{'ratio':>7}{'+copies':>9}{'ratio':>7}")
    for stage in (0, 1, 2, 3):
        plan = Plan(dp=n, zero_stage=stage, precision="bf16", verify="off")
        m = caps.simulate(plan, 1, "ascend_910b", 64 * GB).memory
        p16, g16, k = paper(stage, psi, n)
        state = m["params"] + m["grads"] + m["optimizer_state"]
        ref = p16 + g16 + k
        with_copies = state + m["param_copies"]
        print(f"{stage:>5}{m['params'] / GB:>8.2f}{m['param_copies'] / GB:>8.2f}{m['grads'] / GB:>7.2f}"
              f"{m['optimizer_state'] / GB:>8.2f}  |{p16 / GB:>13.2f}{g16 / GB:>8.2f}{k / GB:>7.2f}  |"
              f"{state / GB:>7.2f}{ref / GB:>7.2f}{state / ref:>7.2f}{with_copies / GB:>9.2f}{with_copies / ref:>7.2f}")
    print("state = what lives between steps (fp32 params + grads + moments); +copies adds the bf16 weight casts "
          "held from forward to backward (at the peak, not between steps)")


if __name__ == "__main__":
    main()
