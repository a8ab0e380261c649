"""ZeRO per-rank memory and communication: the paper's model, and what the rewritten graphs do.

    python bench/zero_memory.py [--dp 8] [--model small|tiny]

1. Model-state memory per rank for a 7.5B-parameter model with Adam (K=12,
   fp16 parameters and gradients) on 64 data-parallel ranks, next to the
   ZeRO paper's figure (Rajbhandari et al., 2020, Figure 1).
2. A smaller GPT captured (fp32 AdamW) and rewritten by data_parallel and
   optimizer_shard for ``--dp`` ranks (no process group: the passes only name
   the group; a fake mesh description): per-rank parameter and optimizer-state bytes read from the
   graph inputs (padding included), gradient bytes live when backward ends,
   and the elements each rank's collectives move per step, as a ratio to Psi.
"""
from __future__ import annotations

import argparse

import torch

from cann_passes import PassContext, PassManager
from cann_passes.passes.optimizer_shard import zero_model_state_bytes
from graph_ir import capture_train_step
from graph_ir.analysis.collectives import collective_elements
from graph_ir.mesh import MeshDesc
from graph_ir.analysis import memory_profile
from graph_ir.meta import ORIGIN_PASS, Region, nbytes, region_of
from graph_ir.signature import InputKind
from recipes.models.gpt import GPT, gpt_loss, gpt_small_cpu, gpt_tiny

PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
NAMES = {0: "baseline (DP)", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}
PIPELINES = {0: "cleanup,data_parallel{{bucket_mb={b}}},cleanup",
             1: "cleanup,optimizer_shard{{stage=1,bucket_mb={b}}},cleanup",
             2: "cleanup,optimizer_shard{{stage=2,bucket_mb={b}}},cleanup",
             3: "cleanup,optimizer_shard{{stage=3,bucket_mb={b}}},cleanup"}


def paper_table() -> None:
    psi, dp = 7.5e9, 64
    print(f"Model-state memory per rank, Psi = 7.5B, K = 12, N_d = {dp} (GB = 1e9 bytes)")
    print(f"{'':<20}{'formula':>10}{'estimate GB':>13}{'paper GB':>10}{'ratio':>8}")
    formulas = {0: "(2+2+K)Psi", 1: "4Psi+KPsi/N", 2: "2Psi+(2+K)Psi/N", 3: "(2+2+K)Psi/N"}
    for stage in range(4):
        gb = zero_model_state_bytes(psi, dp, stage) / 1e9
        print(f"{NAMES[stage]:<20}{formulas[stage]:>16}{gb:>9.3f}{PAPER_GB[stage]:>10.1f}"
              f"{gb / PAPER_GB[stage]:>8.3f}   (rounded as the paper: {round(gb, 1)})")


def graph_table(model_name: str, dp: int, bucket_mb: float) -> None:
    cfg = {"small": gpt_small_cpu, "tiny": gpt_tiny}[model_name](bias=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.zeros(2, 64, dtype=torch.long), torch.zeros(2, 64, dtype=torch.long))
    captured, _ = capture_train_step(model, opt, gpt_loss, batch)
    psi = sum(p.numel() for p in model.parameters())
    print(f"\nGPT '{model_name}' ({psi:,} parameters, fp32 AdamW: K = 8), rewritten for dp = {dp}, "
          f"bucket_mb = {bucket_mb}; bytes per rank as multiples of Psi")
    print(f"{'':<20}{'params':>8}{'opt state':>10}{'grads@bwd end':>14}{'formula':>9}"
          f"{'all_reduce':>11}{'red_scat':>9}{'all_gath':>9}{'total comm':>11}")
    for stage in range(4):
        mesh = MeshDesc.fake(dp=dp, rank=dp - 1)   # the last rank holds the padding
        graph = PassManager(PIPELINES[stage].format(b=bucket_mb), verify_level="shallow").run(
            captured.copy(), PassContext(mesh=mesh))
        sig = graph.signature
        params = sum(nbytes(n.meta["val"]) for n, s in zip(graph.placeholders(), sig.inputs)
                     if s.kind == InputKind.PARAM)
        state = sum(nbytes(n.meta["val"]) for n, s in zip(graph.placeholders(), sig.inputs)
                    if s.kind == InputKind.OPT_STATE)
        profile = memory_profile(graph.graph)
        # The model's own last backward node, before any synchronization placed after it.
        last_bwd = max(i for i, n in enumerate(graph.graph.nodes)
                       if region_of(n) == Region.BACKWARD and ORIGIN_PASS not in n.meta)
        grads = profile.live_bytes[last_bwd]
        formula = zero_model_state_bytes(psi, dp, stage, k=8, param_bytes=4, grad_bytes=4)
        volume = collective_elements(graph.graph)
        print(f"{NAMES[stage]:<20}{params / psi:>8.3f}{state / psi:>10.3f}{grads / psi:>14.3f}"
              f"{formula / psi:>9.3f}{volume['all_reduce'] / psi:>11.3f}{volume['reduce_scatter'] / psi:>9.3f}"
              f"{volume['all_gather'] / psi:>9.3f}{sum(volume.values()) / psi:>11.3f}")
    print("Communication per step: paper 2 Psi (DP, ZeRO-1/2) and 3 Psi (ZeRO-3). The ZeRO-3 backward "
          "re-gathers only parameters that backward reads (not embeddings), so it moves a little "
          "less than 3 Psi; padding makes sharded volumes a little more than Psi.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--model", choices=("small", "tiny"), default="small")
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    args = parser.parse_args()
    paper_table()
    graph_table(args.model, args.dp, args.bucket_mb)


if __name__ == "__main__":
    main()
