"""Per-rank activation memory of one GPT-3 175B layer under tensor (and sequence) parallelism.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), give the bytes one transformer layer keeps for backward, in 16-bit activations
with 1-byte dropout masks:

    no parallelism      s*b*h * (34 + 5*a*s/h)
    tensor parallel     s*b*h * (10 + 24/t + 5*a*s/(h*t))
    TP + sequence par.  s*b*h/t * (34 + 5*a*s/h)

This bench captures the whole training step of the recipe GPT at GPT-3 width (h 12288,
96 heads, s 2048, dropout 0.1, explicit attention) on fake tensors, runs
``autocast{bf16}``, ``tensor_parallel`` for rank 0 of a fake tp mesh and
``recompute{policy=none}`` (every activation kept, dropout masks as bool), and counts
the forward buffers of ``layers.0`` that backward reads, weights excepted
(``graph_ir.analysis.memory``) — the graph's own accounting, side by side with the
formula. Weights cast to bf16 are saved too but are not activations; the causal mask
(s x s booleans, shared by the batch) is counted although the formula leaves it out.

Dropout masks are drawn whole on every rank (so they are the single-process masks,
bit for bit) and cut to the rank's shard where they are applied; the cut is marked as
the rank's piece of the draw (``graph_ir.placement.RANDOM_PIECE``) and the recompute
pass keeps that piece as bool, not the whole draw: the "masks" columns show that part
against the formula's 1-byte masks, and "rest/formula" compares everything else.

    .venv/bin/python -m bench.tp_activation_memory [--tp 1 2 4 8] [--batch 1]
"""
from __future__ import annotations

import argparse
import time

import torch

from cann_passes.pass_manager import PassContext, PassManager, Pipeline
from graph_ir import capture_train_step
from graph_ir.analysis.memory import saved_activations
from graph_ir.meta import MODULE_PATH
from recipes.models.gpt import GPT, gpt3_175b_layer, gpt_loss


class FakeTP:
    def __init__(self, size: int):
        self.tp = size

    def size(self, axis):
        return self.tp

    def local_rank(self, axis):
        return 0

    def group_name(self, axis):
        return "fake:tp"


def korthikanti(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool) -> float:
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def _weights(graph) -> set:
    """Nodes computed from parameters alone (weights cast to bf16): saved, but not activations."""
    weights = {n for n, s in zip(graph.placeholders(), graph.signature.inputs) if s.kind == "param"}
    for node in graph.graph.nodes:
        if node.all_input_nodes and all(a in weights for a in node.all_input_nodes):
            weights.add(node)
    return weights


def _random(graph) -> set:
    """Nodes computed from a random draw alone (dropout masks and their bool/bit forms)."""
    drawn = set()
    for node in graph.graph.nodes:
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()) or (
                node.all_input_nodes and all(a in drawn for a in node.all_input_nodes)):
            drawn.add(node)
    return drawn


def layer_bytes(graph, prefix: str = "layers.0") -> tuple[int, int]:
    """Bytes of the layer's forward activations that backward reads, and of those the dropout masks."""
    saved = saved_activations(graph.graph)
    by_name = {n.name: n for n in graph.graph.nodes}
    weights, masks = _weights(graph), _random(graph)
    total = mask_bytes = 0
    for name, size in saved.items():
        node = by_name[name]
        path = node.meta.get(MODULE_PATH, "")
        if node not in weights and (path == prefix or path.startswith(prefix + ".")):
            total += size
            mask_bytes += size if node in masks else 0
    return total, mask_bytes


def capture(batch: int, **overrides):
    cfg = gpt3_175b_layer(**overrides)
    with torch.device("meta"):
        model = GPT(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.zeros(batch, cfg.seq_len, dtype=torch.long, device="meta")
    graph, _ = capture_train_step(model, optimizer, gpt_loss, (idx, idx))
    return cfg, graph


def mask_formula(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool) -> float:
    """The formula's 1-byte dropout masks: a*s*s*b/t in attention, 2*s*b*h (/t with SP) after it."""
    return a * s * s * b / t + 2 * s * b * h / (t if sequence_parallel else 1)


def measure(graph, t: int, sequence_parallel: bool) -> tuple[int, int]:
    steps = ["cleanup", "autocast{dtype=bf16,policy=cuda}"]
    if t > 1:
        steps.append(f"tensor_parallel{{sequence_parallel={str(sequence_parallel).lower()}}}")
    ctx = PassContext(mesh=FakeTP(t))
    # recompute{policy=none} keeps every activation with dropout masks as bool, as the formula counts
    out = PassManager(Pipeline.of(*steps, "recompute{policy=none}", "cleanup"), verify_level="off").run(
        graph.copy(), ctx)
    return layer_bytes(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    cfg, graph = capture(args.batch)
    s, b, h, a = cfg.seq_len, args.batch, cfg.d_model, cfg.n_head
    print(f"GPT-3 175B layer: s={s} b={b} h={h} a={a}, bf16 activations, dropout {cfg.dropout} "
          f"(captured in {time.perf_counter() - start:.1f}s)")
    print(f"{'plan':<6} {'t':>3} {'graph MiB':>10} {'formula MiB':>12} {'graph/formula':>14} "
          f"{'masks MiB':>10} {'masks formula':>14} {'rest/formula':>13}")
    for t in args.tp:
        for sp in ((False, True) if t > 1 else (False,)):
            got, masks = measure(graph, t, sp)
            want = korthikanti(s, b, h, a, t, sp)
            mask_want = mask_formula(s, b, h, a, t, sp)
            label = "TP+SP" if sp else ("TP" if t > 1 else "none")
            print(f"{label:<6} {t:>3} {got / 2**20:>10.1f} {want / 2**20:>12.1f} {got / want:>14.3f} "
                  f"{masks / 2**20:>10.1f} {mask_want / 2**20:>14.1f} {(got - masks) / (want - mask_want):>13.3f}")


if __name__ == "__main__":
    main()
