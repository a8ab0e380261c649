"""Capture + pipeline time of a GPT step as layers grow (d_model 4096, seq 2048, fake tensors).

    python -m bench.capture_scaling [--layers 4 8 16 32]

Time per node must stay flat as the graph grows: a pass manager or analysis
that is quadratic in graph size shows up here first.
"""
from __future__ import annotations

import argparse
import time

import torch

from cann_passes import PassContext, PassManager, Plan
from cann_passes.pipeline import build_pipeline
from graph_ir import capture_train_step
from recipes.models.gpt import GPT, gpt_7b, gpt_loss


def measure(n_layer: int) -> dict:
    cfg = gpt_7b(n_layer=n_layer)
    with torch.device("meta"):
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        idx = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    t0 = time.perf_counter()
    graph, _ = capture_train_step(model, opt, gpt_loss, (idx, idx))
    t1 = time.perf_counter()
    manager = PassManager(build_pipeline(Plan(), "eager"), verify_level="shallow")
    ctx = PassContext()
    graph = manager.run(graph, ctx)
    ctx.analyses.get("memory", graph)
    ctx.analyses.get("cost", graph)
    t2 = time.perf_counter()
    return {"layers": n_layer, "nodes": graph.num_nodes(), "capture_s": t1 - t0, "passes_s": t2 - t1}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    args = p.parse_args(argv)
    rows = [measure(n) for n in args.layers]
    base = (rows[0]["capture_s"] + rows[0]["passes_s"]) / rows[0]["nodes"]
    print(f"{'layers':>6} {'nodes':>7} {'capture s':>10} {'passes s':>9} {'ms/node':>8} {'vs first':>8}")
    for r in rows:
        per_node = (r["capture_s"] + r["passes_s"]) / r["nodes"]
        print(f"{r['layers']:>6} {r['nodes']:>7} {r['capture_s']:>10.2f} {r['passes_s']:>9.2f} "
              f"{per_node * 1e3:>8.3f} {per_node / base:>7.2f}x")
    return rows


if __name__ == "__main__":
    main()
