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


# -- what cannot be one graph is refused at capture, on one line naming the source ------------------

class _BranchOnData(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        if x.sum() > 0:  # branch-line
            x = x * 2
        return self.fc(x)


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        import torch.utils.checkpoint
        return torch.utils.checkpoint.checkpoint(self.fc, x, use_reentrant=False)


def _item_loss(model, batch):
    loss = tiny_mlp()[1](model, batch)
    return loss * 2 if loss.item() > 1 else loss  # item-line


def _line(fn, marker):
    import inspect
    lines, first = inspect.getsourcelines(fn)
    return f"test_capture.py:{first + next(i for i, t in enumerate(lines) if marker in t)}"


_XY = (torch.randn(8, 12), torch.randint(0, 5, (8,)))


def _capture_with(model, loss_fn, batch=_XY):
    return capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, batch)


class _IndexByItem(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        return self.fc(x[x.argmax(dim=0)[0].item()] + x)  # index-line


@pytest.mark.parametrize("model, loss_fn, line", [
    (_BranchOnData, tiny_mlp()[1], _line(_BranchOnData.forward, "branch-line")),
    (lambda: tiny_mlp()[0], _item_loss, _line(_item_loss, "item-line")),
    (_IndexByItem, tiny_mlp()[1], _line(_IndexByItem.forward, "index-line")),
], ids=["if_on_tensor", "item_in_loss", "item_as_index"])
def test_data_dependent_control_flow_is_refused_naming_the_line(model, loss_fn, line):
    with pytest.raises(CaptureError) as info:
        _capture_with(model(), loss_fn)
    text = str(info.value)
    assert "\n" not in text and "data-dependent" in text and line in text and "torch.where" in text


def test_torch_utils_checkpoint_is_refused_pointing_at_the_plans_recompute():
    with pytest.raises(CaptureError, match="torch.utils.checkpoint.*plan's recompute"):
        _capture_with(_Checkpointed(), tiny_mlp()[1])


@pytest.mark.parametrize("loss_fn", [
    lambda m, b: tiny_mlp()[1](m, b).detach(),
    lambda m, b: (m(b[0]).argmax(-1) == b[1]).float().mean(),
], ids=["detached", "argmax"])
def test_a_loss_without_autograd_history_raises_eagers_error(loss_fn):
    with pytest.raises(RuntimeError) as info:
        _capture_with(tiny_mlp()[0], loss_fn)
    assert str(info.value) == "element 0 of tensors does not require grad and does not have a grad_fn"


def test_a_batch_that_does_not_fit_the_model_is_one_line_naming_it():
    with pytest.raises(CaptureError) as info:
        _capture_with(tiny_mlp()[0], tiny_mlp()[1], (torch.randn(8, 13), _XY[1]))
    assert "\n" not in str(info.value) and "batch[0]: (8, 13)" in str(info.value)


def test_a_batch_on_meta_is_refused_naming_the_leaf():
    with pytest.raises(CaptureError, match=r"batch\[0\] of shape \(8, 12\) is on device meta"):
        _capture_with(tiny_mlp()[0], tiny_mlp()[1], (_XY[0].to("meta"), _XY[1].to("meta")))


class _MaskedMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(12, 5)

    def forward(self, x):
        out = self.lin(x)
        return out[out > 0]    # mask-line


def _mask_loss(model, batch):
    out = model(batch[0])
    return out[batch[1] > 2].sum()    # loss-mask-line


def _sum_loss(model, batch):
    return model(batch[0]).sum()


@pytest.mark.parametrize("model, loss_fn, line", [
    (_MaskedMean, _sum_loss, _line(_MaskedMean.forward, "mask-line")),
    (lambda: tiny_mlp()[0], _mask_loss, _line(_mask_loss, "loss-mask-line")),
], ids=["in_forward", "in_loss_fn"])
def test_boolean_mask_indexing_is_refused_naming_the_line_and_its_code(model, loss_fn, line):
    with pytest.raises(CaptureError) as info:
        _capture_with(model(), loss_fn)
    text = str(info.value)
    assert "\n" not in text and "data-dependent shape" in text and line in text and "[" in text, text


def test_electras_boolean_mask_in_its_loss_is_refused_naming_transformers_line():
    from transformers import ElectraConfig, ElectraForPreTraining
    from tests.zoo import mlm_batch
    cfg = ElectraConfig(vocab_size=96, embedding_size=16, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    batch = mlm_batch(0)
    batch["labels"] = (batch["labels"] > 0).long()
    with pytest.raises(CaptureError, match=r"data-dependent shape at modeling_electra.py:\d+ \(`active_logits = "):
        _capture_with(ElectraForPreTraining(cfg), lambda m, b: m(**b).loss, batch)


class _NoisyWithGenerator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(12, 5)
        self.g = torch.Generator().manual_seed(3)

    def forward(self, x):
        return self.lin(x + torch.randn(x.shape, generator=self.g))    # generator-line


def test_a_generator_object_in_forward_is_refused_on_one_line_and_its_state_is_untouched():
    model = _NoisyWithGenerator()
    before = model.g.get_state()
    with pytest.raises(CaptureError) as info:
        _capture_with(model, tiny_mlp()[1])
    text = str(info.value)
    assert "\n" not in text and "torch.Generator" in text and \
        _line(_NoisyWithGenerator.forward, "generator-line") in text and "torch.manual_seed" in text
    assert torch.equal(model.g.get_state(), before)


def test_backward_is_captured_with_eagers_own_kernels_and_trains_bitwise_like_eager():
    # Eager's backward runs without building a graph of itself, and some derivatives are spelled
    # differently when it does (SiLU, group norm, RMSNorm: an "infinitely differentiable" form of
    # several ops). The step's backward is traced as eager runs it: the same kernels, bitwise.
    from cann_passes import Plan
    from tests.zoo import compare

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.norm, self.down = torch.nn.Linear(8, 32), torch.nn.GroupNorm(4, 32), torch.nn.Linear(32, 1)
            self.drop = torch.nn.Dropout(0.25)

        def forward(self, x):
            return self.down(self.drop(torch.nn.functional.silu(self.norm(self.up(x)))))

    torch.manual_seed(0)
    model = Block()
    tg, _ = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).square().mean(), torch.randn(16, 8))
    backward = {n.target for n in tg.graph.nodes if n.op == "call_function" and n.meta[REGION] == "backward"}
    aten = torch.ops.aten
    assert {aten.silu_backward.default, aten.native_group_norm_backward.default} <= backward
    assert aten.sigmoid.default not in backward
    run = compare("phi3", Plan(backend="eager"), steps=2, layers=1)   # SiLU in a fused gate-up MLP
    assert run.max_param_diff() == 0 and run.compiled_losses == run.eager_losses
