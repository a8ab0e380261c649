"""ZeRO-3 under pipeline parallelism: per pipeline rank, model-state bytes against the ZeRO paper.

    .venv/bin/python -m bench.zero3_pp_memory [--dp 2 4 8] [--pp 2] [--layers 8] [--width 1024]

A GPT of ``--layers`` blocks at width ``--width`` (built on meta, fp32 AdamW, untied head) is
compiled for ``Plan(dp=N, pp=P, zero_stage=3, microbatches=P)`` by its own pipeline
(``pipeline_split`` after ``optimizer_shard``) for rank 0 of a fake mesh at every pipeline
coordinate, and each pipeline rank's parameters, gradients and optimizer state are read from its
stage programs (``cann_passes.simulate.simulate_stage_programs``: graph inputs, shards counted as
shards, padding included). Beside them, the ZeRO paper's stage-3 model state (Rajbhandari et al.,
2020, P_os+g+p) for the parameters ``Psi_r`` that rank holds, in fp32 AdamW's bytes (K = 8 for the
two Adam moments; parameters and gradients 4 bytes each):

    parameters 4 Psi_r / N    gradients 4 Psi_r / N    optimizer state 8 Psi_r / N

``Psi_r`` is counted from the plan's own split (``pipeline_split``'s parameter homes: the
cost-balanced cut moves with dp and ZeRO). Under pp the gradients are
accumulated over the microbatches whole and reduce-scattered once per step, so the gradient term
holds the stage's whole accumulator: printed as measured, with its ratio to the paper's sharded
figure (N x), next to the sharded terms (1.00x up to the shards' padding).
"""
from __future__ import annotations

import argparse
import time

import torch

from cann_passes import Plan
from cann_passes.cost_model import get_profile
from cann_passes.compile import compile_program
from cann_passes.simulate import simulate_stage_programs
from graph_ir import capture_train_step
from graph_ir.mesh import MeshDesc
from graph_ir.pipeline_info import pipeline_split_of
from graph_ir.signature import InputKind
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny

TERMS = ("params", "grads", "optimizer_state")
FORMULA = {"params": 4, "grads": 4, "optimizer_state": 8}   # bytes per parameter, divided by N
GB = 1e9


def capture(layers: int, width: int, rows: int, seq: int):
    cfg = gpt_tiny(n_layer=layers, d_model=width, n_head=max(1, width // 128), vocab_size=32000, seq_len=seq,
                   tie_weights=False, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(rows, seq, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    psi = sum(p.numel() for p in model.parameters())
    return capture_train_step(model, opt, gpt_loss, (idx, idx))[0], psi


def per_rank(captured, plan: Plan, rows: int, seq: int) -> list[dict]:
    sim = simulate_stage_programs(captured, plan, profile=get_profile("ascend_910b"),
                                  tokens_per_microbatch=rows * seq)
    return sim.stages


def parameters_per_rank(captured, plan: Plan) -> list[int]:
    """Psi_r: the elements of the parameters whose home stage is on pipeline rank r."""
    split = pipeline_split_of(compile_program(captured, plan, MeshDesc.fake(dp=plan.dp, pp=plan.pp)))
    numel = {s.name: n.meta["val"].numel() for s, n in zip(captured.signature.inputs, captured.placeholders())
             if s.kind == InputKind.PARAM}
    out = [0] * plan.pp
    for name, stage in split.param_stage.items():
        out[split.stage_to_rank[stage]] += numel[name]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args(argv)
    rows = args.pp   # one row per microbatch
    t0 = time.perf_counter()
    captured, psi = capture(args.layers, args.width, rows, args.seq)
    base = Plan(precision="fp32", pp=args.pp, microbatches=args.pp, backend="eager", verify="off")
    print(f"GPT {args.layers} layers x width {args.width}: Psi = {psi / 1e6:.1f}M parameters, fp32 AdamW, "
          f"pp = {args.pp}, ZeRO-3 over dp (captured and compiled on meta in {time.perf_counter() - t0:.0f}s)")
    print(f"{'dp':>3} {'pp rank':>8} {'Psi_r M':>8}  " + "  ".join(f"{t + ' GB':>22}" for t in TERMS))
    for n in args.dp:
        plan = base.replace(dp=n, zero_stage=3)
        for r, (got, psi_r) in enumerate(zip(per_rank(captured, plan, rows, args.seq),
                                             parameters_per_rank(captured, plan), strict=True)):
            cells = []
            for term in TERMS:
                want = FORMULA[term] * psi_r / n
                have = got["memory"][term]
                cells.append(f"{have / GB:>7.3f} vs {want / GB:>6.3f} {have / want:>5.2f}x")
            print(f"{n:>3} {r:>8} {psi_r / 1e6:>8.1f}  " + "  ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
