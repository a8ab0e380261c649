"""Capture of whole steps: structure, metadata, signature, and fake/meta capture at 7B scale."""
from __future__ import annotations

import resource

import pytest
import torch

from graph_ir import InputKind, OutputKind, Region, capture_train_step
from graph_ir.capture import CaptureError
from graph_ir.meta import MODULE_PATH, REGION
from recipes.models.gpt import GPT, count_parameters_analytic, gpt_7b, gpt_loss
from tests.conftest import gpt_batches, make_optimizer, tiny_gpt, tiny_mlp


def _capture(model_factory=tiny_gpt, opt="adamw", batch=None):
    model, loss_fn = model_factory()
    opt = make_optimizer(opt, model.parameters())
    batch = batch or gpt_batches(1)[0]
    return capture_train_step(model, opt, loss_fn, batch)


def test_every_node_has_a_region_value_and_module_path_key():
    tg, _ = _capture()
    for node in tg.graph.nodes:
        assert node.meta[REGION] in {r.value for r in Region}
        if node.op == "call_function":
            assert isinstance(node.meta[MODULE_PATH], str)
            assert "val" in node.meta


def test_regions_appear_in_step_order():
    tg, _ = _capture()
    order = {"forward": 0, "backward": 1, "optimizer": 2}
    seen = [order[n.meta[REGION]] for n in tg.compute_nodes()]
    assert seen == sorted(seen)
    assert {"forward", "backward", "optimizer"} <= {n.meta[REGION] for n in tg.compute_nodes()}


def test_forward_and_backward_nodes_carry_the_module_path_of_their_layer():
    tg, _ = _capture()
    mm_paths = {(n.meta[REGION], n.meta[MODULE_PATH]) for n in tg.compute_nodes()
                if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)}
    assert ("forward", "layers.0.attn.qkv") in mm_paths
    assert ("backward", "layers.1.mlp.fc2") in mm_paths
    assert ("forward", "lm_head") in mm_paths
    optimizer_paths = {n.meta[MODULE_PATH] for n in tg.compute_nodes(Region.OPTIMIZER)}
    assert "layers.0.mlp.fc1" in optimizer_paths


def test_signature_names_every_parameter_state_and_batch_leaf():
    tg, layout = _capture(opt="adam")
    sig = tg.signature
    params = [s.name for _, s in sig.inputs_of(InputKind.PARAM)]
    assert "wte.weight" in params and "lm_head.weight" not in params  # tied: captured once
    assert [s.name for _, s in sig.inputs_of(InputKind.BATCH)] == ["batch[0]", "batch[1]"]
    assert sig.outputs[0] == sig.outputs[sig.output_index(OutputKind.LOSS, "loss")]
    states = {s.name for _, s in sig.outputs_of(OutputKind.OPT_STATE)}
    assert {"wte.weight:step", "wte.weight:exp_avg", "wte.weight:exp_avg_sq"} <= states
    assert len(tg.placeholders()) == len(sig.inputs)


def test_sgd_without_momentum_has_no_optimizer_state():
    model, loss_fn = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg, _ = capture_train_step(model, opt, loss_fn, (torch.randn(2, 12), torch.tensor([0, 1])))
    assert not tg.signature.inputs_of(InputKind.OPT_STATE)


def test_unsupported_optimizer_is_refused_by_name():
    model, loss_fn = tiny_mlp()
    with pytest.raises(ValueError, match="Adadelta is not supported"):
        capture_train_step(model, torch.optim.Adadelta(model.parameters()), loss_fn,
                           (torch.randn(2, 12), torch.tensor([0, 1])))


def test_non_tensor_batch_leaf_is_refused_with_its_path():
    model, loss_fn = tiny_mlp()
    with pytest.raises(CaptureError, match=r"batch\[1\] is a str"):
        capture_train_step(model, make_optimizer("sgd", model.parameters()), loss_fn,
                           (torch.randn(2, 12), "labels"))


def test_loss_that_is_not_a_scalar_is_refused():
    model, _ = tiny_mlp()
    with pytest.raises(CaptureError, match="scalar"):
        capture_train_step(model, make_optimizer("sgd", model.parameters()),
                           lambda m, b: m(b[0]), (torch.randn(2, 12), torch.tensor([0, 1])))


def test_7b_gpt_is_captured_on_meta_tensors_without_allocating_it():
    cfg = gpt_7b()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.device("meta"):
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        idx = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    tg, _ = capture_train_step(model, opt, gpt_loss, (idx, idx))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == count_parameters_analytic(cfg) == 6_658_596_864
    captured = sum(n.meta["val"].numel() for n, s in zip(tg.placeholders(), tg.signature.inputs)
                   if s.kind == InputKind.PARAM)
    assert captured == n_params
    # The fp32 weights alone are 24.8 GiB; the whole capture must stay far below that.
    assert grown_mib < 2048, f"capture grew the process by {grown_mib:.0f} MiB"
    assert tg.num_nodes() > 10_000
