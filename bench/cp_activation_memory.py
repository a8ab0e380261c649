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
exchange) against the formula; then, per rank, the query-key pairs the causal attention computes
with the balanced chunks (rank r holds chunks r and 2cp - 1 - r) and with contiguous ones
(``balance=false``); and with ring attention (``attention=ring``) the saved bytes and the
largest K block a rank holds at once. SDPA is captured on meta as CPU's fused flash kernel (as the
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


def _compiled(graph, cp: int, rank: int = 0, balance: bool = True, attention: str = "gather"):
    steps = ["cleanup", "autocast{dtype=bf16,policy=cuda}"] + (
        [f"context_parallel{{balance={str(balance).lower()},attention={attention}}}"] if cp > 1 else [])
    ctx = PassContext(mesh=MeshDesc.fake(cp=cp, rank=rank))
    return PassManager(Pipeline.of(*steps, "recompute{policy=none}", "cleanup"), verify_level="off").run(
        graph.copy(), ctx)


def measure(graph, cp: int):
    out = _compiled(graph, cp)
    return layer_bytes(out)[0], gathered_bytes(out)


def largest_exchange(graph, target) -> int:
    """Bytes of the largest value one forward exchange of ``target`` gives a rank (a whole K, or
    one ring step's block of K)."""
    return max((n.meta["val"].numel() * n.meta["val"].element_size() for n in graph.graph.nodes
                if n.target is target and str(n.meta.get("region")) == "forward"), default=0)


def ring_measure(graph, cp: int):
    """(saved bytes, largest K or V block received) with ``attention=ring``."""
    out = _compiled(graph, cp, attention="ring")
    return layer_bytes(out)[0], largest_exchange(out, torch.ops._c10d_functional.all_to_all_single.default)


def attention_pairs(graph) -> int:
    """Query-key pairs the forward attention kernels compute (their work, per head and batch row)."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    return sum(n.args[0].meta["val"].shape[2] * n.args[1].meta["val"].shape[2]
               for n in graph.graph.nodes if n.target is kernel)


def attention_balance(graph, cp: int) -> dict[bool, list[int]]:
    """Per rank, the attention's query-key pairs, with the balanced chunks and with contiguous ones."""
    return {balance: [attention_pairs(_compiled(graph, cp, rank, balance)) for rank in range(cp)]
            for balance in (True, False)}


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

    def table(title: str, column: str, formula: str, rows) -> None:
        """cp, saved bytes against A(s)/cp, and an exchanged size against its formula."""
        print(title)
        print(f"{'cp':>3} {'saved MiB':>10} {'A(s)/cp MiB':>12} {'ratio':>7} {column:>17} {formula:>11} {'ratio':>7}")
        for cp, got, moved, want in rows:
            print(f"{cp:>3} {got / 2**20:>10.1f} {whole / cp / 2**20:>12.1f} {got / (whole / cp):>7.3f} "
                  f"{moved / 2**20:>17.1f} {want / 2**20:>11.1f} {(moved / want if want else 0):>7.3f}")

    table("all-gather attention", "K/V gathered MiB", "2sbh*2 MiB",
          [(cp, *((whole, 0) if cp == 1 else measure(graph, cp)), 2 * s * b * h * 2 if cp > 1 else 0)
           for cp in args.cp])
    # ring attention: the same saved bytes; K and V held a ring step's block at a time
    table(f"\nring attention: the largest K (or V) a rank holds at once (gather: the whole s*b*h*2 = "
          f"{s * b * h * 2 / 2**20:.0f} MiB)", "K block MiB", "s/cp*b*h*2",
          [(cp, *ring_measure(graph, cp), s // cp * b * h * 2) for cp in args.cp if cp > 1])
    # is_causal: each chunk attends to the keys up to its end; causal pairs s(s+1)/2 of s^2
    print(f"\nattention query-key pairs per rank (is_causal), as a share of the whole s^2 / cp; "
          f"causal alone is {(s + 1) / (2 * s):.3f}")
    print(f"{'cp':>3} {'balanced min':>13} {'max':>7} {'max/mean':>9} {'contiguous min':>15} {'max':>7} {'max/mean':>9}")
    for cp in args.cp:
        if cp == 1:
            continue
        work = attention_balance(graph, cp)
        row = []
        for balance in (True, False):
            shares = [w / (s * s / cp) for w in work[balance]]
            row += [min(shares), max(shares), max(shares) / (sum(shares) / cp)]
        print(f"{cp:>3} {row[0]:>13.3f} {row[1]:>7.3f} {row[2]:>9.3f} {row[3]:>15.3f} {row[4]:>7.3f} {row[5]:>9.3f}")


if __name__ == "__main__":
    main()
