"""Rank 0's program of a 64-rank ZeRO-3 plan for a 7B-shaped GPT, compiled in one process.

    python bench/program_7b.py [--layers 32] [--dp 64] [--stage 3] [--budget 0.25]

The 32-layer, d_model 4096, seq 2048 GPT (``recipes.models.gpt.gpt_7b``) is
built on the meta device and captured with fake tensors (nothing is
allocated); ``compile_program`` runs the plan dp=64 + ZeRO-3 + bf16 +
recompute budget for rank 0 of a fake mesh (``MeshDesc.fake(dp=64)``: no
process group exists). The program's graph then reports, per rank, the bytes
of its parameter, gradient and optimizer-state values and of the activations
backward keeps, read from the graph (shards count as shards, padding included).

Next to it, the ZeRO paper's model-state figure (2 + 2 + K) Psi / N with
K = 12 for mixed-precision Adam. The graph spells the same 16 bytes per
parameter differently: the fp32 master parameter shard (4), the fp32
gradient shard (4, gradients are cast back to fp32 once per parameter before
the reduce-scatter) and Adam's two fp32 moments (8), where the paper counts
bf16 parameters (2) and gradients (2) plus fp32 master, momentum and variance
(12). The bf16 working copy of each parameter exists only while its bucket is
gathered. The figure compared is model state + activations against the
formula + the same measured activations, and the model-state bytes alone.
"""
from __future__ import annotations

import argparse
import time

import torch

from cann_passes import Plan
from cann_passes.compile import compile_program
from graph_ir import capture_train_step
from graph_ir.mesh import MeshDesc
from recipes.models.gpt import GPT, gpt_7b, gpt_loss

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dp", type=int, default=64)
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--budget", type=float, default=0.25, help="recompute budget (fraction of saved bytes)")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()

    cfg = gpt_7b(n_layer=args.layers)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(1, cfg.seq_len, dtype=torch.long)
        batch = (idx, torch.zeros_like(idx))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    captured, _ = capture_train_step(model, optimizer, gpt_loss, batch)
    t1 = time.perf_counter()
    plan = Plan(dp=args.dp, zero_stage=args.stage, precision="bf16", recompute="budget",
                recompute_budget=args.budget, backend="eager", verify="shallow")
    program = compile_program(captured, plan, MeshDesc.fake(dp=args.dp, rank=args.rank))
    t2 = time.perf_counter()

    psi = sum(p.numel() for p in model.parameters())
    got = program.state_bytes()["step"]
    k = 12
    formula = (2 + 2 + k) * psi / args.dp
    print(f"GPT {args.layers} layers, d_model {cfg.d_model}, seq {cfg.seq_len}: Psi = {psi / 1e9:.3f}B parameters; "
          f"captured {captured.num_nodes()} nodes in {t1 - t0:.1f}s")
    print(f"plan dp={args.dp} ZeRO-{args.stage} bf16 recompute budget {args.budget}: rank {args.rank}'s program "
          f"compiled in {t2 - t1:.1f}s, no process group")
    print(program)
    print("passes: " + ", ".join(f"{r.spec} {r.seconds:.1f}s" for r in program.records))
    print(f"\nper-rank bytes read from the graph (GiB)      {'graph':>10}{'Psi-model':>11}")
    model_ref = {"params": 4 * psi / args.dp if args.stage == 3 else 4 * psi,
                 "grads": 4 * psi / args.dp if args.stage >= 2 else 4 * psi,
                 "optimizer_state": 8 * psi / args.dp}
    for label, key in (("parameters (fp32 master shard)", "params"), ("gradients (fp32 shard)", "grads"),
                       ("optimizer state (Adam moments, step)", "optimizer_state")):
        print(f"  {label:<44}{getattr(got, key) / GIB:>10.4f}{model_ref[key] / GIB:>11.4f}")
    print(f"  {'activations kept for backward':<44}{got.activations / GIB:>10.4f}{'':>11}")
    if args.stage != 3:
        print("(the paper's stage 1/2 figures count bf16 parameters and gradients, which this graph keeps in "
              "fp32: compare the Psi-model column)")
        return
    total = got.model_state + got.activations
    expected = formula + got.activations
    print(f"\nmodel state, graph vs (2+2+K)Psi/N (K=12){'':>3}{got.model_state / GIB:>10.4f}{formula / GIB:>11.4f}"
          f"   ratio {got.model_state / formula:.5f}")
    print(f"model state + activations vs formula + act.{'':>1}{total / GIB:>10.4f}{expected / GIB:>11.4f}"
          f"   ratio {total / expected:.5f}  ({'within' if abs(total / expected - 1) <= 0.01 else 'OUTSIDE'} 1%)")


if __name__ == "__main__":
    main()
