"""SDPA captured on meta is the CPU fused kernel's op, priced with its FLOPs, kept as the fused
kernel's stand-in by npu_legalize (a meta graph is compiled and priced, never run)."""
from __future__ import annotations

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from cann_passes.pass_manager import PassContext
from cann_passes.passes.npu_legalize import npu_legalize_pass
from graph_ir import capture_train_step
from graph_ir.analysis.cost import node_cost
from tests import zoo

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _capture(device: str):
    entry = zoo.build("llama", layers=2)
    entry.model.to(device)
    batch = entry.make_batch(1)
    if device == "meta":
        batch = {k: torch.empty_like(v, device="meta") for k, v in batch.items()}
    optimizer = torch.optim.SGD(entry.model.parameters(), lr=0.1)
    # (no KV cache: transformers' cache makes a tensor in place on the model's device)
    return capture_train_step(entry.model, optimizer, lambda m, b: m(**b, use_cache=False).loss, batch)[0]


def _attention(graph):
    return [n for n in graph.graph.nodes if n.target in (FLASH, FLASH_BACKWARD)]


def test_meta_capture_records_the_fused_kernel_cpu_records_and_prices_its_flops():
    cpu, meta = _capture("cpu"), _capture("meta")
    assert [n.target for n in _attention(meta)] == [n.target for n in _attention(cpu)] == [FLASH] * 2 + [FLASH_BACKWARD] * 2
    # no seq x seq softmax on meta: the math form's scores are not in the graph
    assert not [n for n in meta.graph.nodes if n.target is torch.ops.aten._softmax.default]
    fwd, bwd = _attention(meta)[0], _attention(meta)[-1]
    q, k, v = (a.meta["val"].shape for a in fwd.args[:3])
    assert node_cost(fwd).flops == sdpa_flop_count(q, k, v) > 0 and node_cost(fwd).matmul
    assert node_cost(bwd).flops == sdpa_backward_flop_count(bwd.args[0].meta["val"].shape, q, k, v)


def test_npu_legalize_keeps_meta_attention_as_the_fused_kernel_and_decomposes_it_on_cpu():
    meta = npu_legalize_pass(_capture("meta"), PassContext())
    assert len(_attention(meta)) == 4
    cpu = npu_legalize_pass(_capture("cpu"), PassContext())
    assert not _attention(cpu)


def test_causal_attention_is_priced_by_the_tiles_it_computes_and_mfu_counts_every_score():
    from cann_passes.figures import model_flops
    from cann_passes.passes.attention_masks_as_flags import attention_masks_as_flags
    from graph_ir.analysis.cost import causal_tile_fraction
    from tools.plan_cli import MODELS
    assert causal_tile_fraction(128, 128) == 1.0                    # one tile: computed whole
    assert causal_tile_fraction(4096, 4096) == 33 / 64               # 32 x 32 tiles, 528 on or below the diagonal
    assert causal_tile_fraction(100, 300) == 1 / 3                   # no query sees past key 99
    assert causal_tile_fraction(300, 100) == 1.0
    seq = 1024
    with torch.device("meta"):
        model, loss_fn, batch = MODELS["llama-tiny"].build(1, seq, 1)
    graph, _ = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, batch)
    fwd = _attention(graph)[0]
    full = node_cost(fwd).flops
    assert full == sdpa_flop_count(*(a.meta["val"].shape for a in fwd.args[:3]))   # a mask: every score
    before = model_flops(graph)
    assert attention_masks_as_flags(graph.graph)["causal"] == 2
    fwd, bwd = _attention(graph)
    assert node_cost(fwd).flops == int(full * causal_tile_fraction(seq, seq)) == int(full * 36 / 64)
    assert node_cost(bwd).flops < sdpa_backward_flop_count(*(a.meta["val"].shape for a in bwd.args[:4]))
    assert model_flops(graph) == before
