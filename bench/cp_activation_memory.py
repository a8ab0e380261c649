"""Per-rank activation memory of one LLaMA-7B-wide layer at a 32k sequence under context parallelism.

All-gather context parallelism keeps ``1/cp`` of every activation a layer saves for backward
(each rank holds its ``seq / cp`` tokens), and exchanges K and V whole: before attention each
rank holds the gathered K and V of the layer, ``2 * s * b * h`` 16-bit values, which backward
gathers again rather than keeping them. So per rank, for one layer:

    saved for backward    A(s) / cp          (A(s): the single-rank layer's saved activations)
    K/V exchange          2 * s * b * h * 2 bytes, live from the gather to the attention kernel

This bench captures the whole training step of the recipe GPT at LLaMA-7B width (h 4096,
32 heads, SDPA with ``is_causal``, dropout 0) at s = 32768 on meta tensors, runs
``autocast{bf16}``, ``context_parallel`` for rank 0 of a fake cp mesh and
``recompute{policy=none}`` (every activation kept), and counts the forward buffers of
``layers.0`` that backward reads, weights excepted (``graph_ir.analysis.memory``), side by
side with ``A(s) / cp`` from the cp = 1 graph; and the bytes of the layer's all-gathers (the
exchange) against the formula. SDPA is captured on meta as CPU's fused flash kernel (as the
CPU capture and the device run it: ``graph_ir.meta_attention``), which keeps only the output
and its log-sum-exp, no ``a * s * s`` probabilities.

    .venv/bin/python -m bench.cp_activation_memory [--cp 1 2 4 8] [--seq 32768] [--batch 1]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.tp_activation_memory import layer_bytes
from cann_passes.pass_manager import PassContext, PassManager, Pipeline
from graph_ir import capture_train_step
from graph_ir.mesh import MeshDesc
from graph_ir.meta import MODULE_PATH
from recipes.models.gpt import GPT, gpt3_175b_layer, gpt_loss


def capture(batch: int, seq: int):
    cfg = gpt3_175b_layer(d_model=4096, n_head=32, seq_len=seq, dropout=0.0, attention="sdpa")
    with torch.device("meta"):
        model = GPT(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    graph, _ = capture_train_step(model, optimizer, gpt_loss, (idx, idx))
    return cfg, graph


def gathered_bytes(graph, prefix: str = "layers.0") -> int:
    """Bytes the layer's forward all-gathers produce (K and V, whole)."""
    total = 0
    for node in graph.graph.nodes:
        path = node.meta.get(MODULE_PATH, "")
        if node.target is torch.ops._c10d_functional.all_gather_into_tensor.default and str(
                node.meta.get("region")) in ("forward", "Region.FORWARD") and (
                path == prefix or path.startswith(prefix + ".")):
            val = node.meta["val"]
            total += val.numel() * val.element_size()
    return total


def measure(graph, cp: int):
    steps = ["cleanup", "autocast{dtype=bf16,policy=cuda}"] + (["context_parallel"] if cp > 1 else [])
    ctx = PassContext(mesh=MeshDesc.fake(cp=cp))
    out = PassManager(Pipeline.of(*steps, "recompute{policy=none}", "cleanup"), verify_level="off").run(
        graph.copy(), ctx)
    return layer_bytes(out)[0], gathered_bytes(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    cfg, graph = capture(args.batch, args.seq)
    s, b, h = args.seq, args.batch, cfg.d_model
    print(f"LLaMA-7B-wide layer: s={s} b={b} h={h} a={cfg.n_head}, bf16 activations "
          f"(captured in {time.perf_counter() - start:.1f}s)")
    whole, _ = measure(graph, 1)
    print(f"{'cp':>3} {'saved MiB':>10} {'A(s)/cp MiB':>12} {'ratio':>7} {'K/V gathered MiB':>17} "
          f"{'2sbh*2 MiB':>11} {'ratio':>7}")
    for cp in args.cp:
        got, gathered = (whole, 0) if cp == 1 else measure(graph, cp)
        kv = 2 * s * b * h * 2 if cp > 1 else 0
        print(f"{cp:>3} {got / 2**20:>10.1f} {whole / cp / 2**20:>12.1f} {got / (whole / cp):>7.3f} "
              f"{gathered / 2**20:>17.1f} {kv / 2**20:>11.1f} {(gathered / kv if kv else 0):>7.3f}")


if __name__ == "__main__":
    main()
