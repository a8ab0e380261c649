import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from recipes.models import (
    GPT,
    MLP,
    Block,
    count_parameters_analytic,
    gpt3_175b_layer,
    gpt_7b,
    gpt_loss,
    gpt_small_cpu,
    gpt_tiny,
    mlp_loss,
)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "cfg",
    [gpt_tiny(), gpt_tiny(tie_weights=False), gpt_tiny(bias=False), gpt_small_cpu()],
    ids=["tiny", "untied", "no_bias", "small_cpu"],
)
def test_param_count_matches_analytic(cfg):
    assert n_params(GPT(cfg)) == count_parameters_analytic(cfg)


@pytest.mark.parametrize("make_cfg", [gpt_7b, gpt3_175b_layer])
def test_param_count_large_on_meta(make_cfg):
    cfg = make_cfg()
    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert n_params(model) == count_parameters_analytic(cfg)


def test_7b_is_about_7b():
    assert 6.5e9 < count_parameters_analytic(gpt_7b()) < 7.0e9


def test_module_paths_are_stable():
    names = dict(GPT(gpt_tiny()).named_modules())
    for path in [
        "wte", "wpe", "drop", "ln_f", "lm_head",
        "layers.1.ln_1", "layers.1.attn.qkv", "layers.1.attn.proj",
        "layers.1.attn.attn_drop", "layers.1.attn.resid_drop", "layers.1.ln_2",
        "layers.1.mlp.fc1", "layers.1.mlp.act", "layers.1.mlp.fc2", "layers.1.mlp.drop",
    ]:
        assert path in names
    assert isinstance(names["layers.0"], Block)


def test_forward_shape():
    cfg = gpt_tiny()
    idx = torch.randint(cfg.vocab_size, (3, cfg.seq_len))
    assert GPT(cfg)(idx).shape == (3, cfg.seq_len, cfg.vocab_size)
    # Shorter sequences than seq_len are fine.
    assert GPT(cfg)(idx[:, :5]).shape == (3, 5, cfg.vocab_size)


def test_too_long_sequence_rejected():
    cfg = gpt_tiny()
    with pytest.raises(ValueError):
        GPT(cfg)(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_explicit_and_sdpa_attention_agree():
    torch.manual_seed(0)
    explicit = GPT(gpt_tiny(attention="explicit")).eval()
    sdpa = GPT(gpt_tiny(attention="sdpa")).eval()
    sdpa.load_state_dict(explicit.state_dict())
    idx = torch.randint(256, (2, 32))
    torch.testing.assert_close(explicit(idx), sdpa(idx), atol=1e-5, rtol=1e-5)


def test_attention_is_causal():
    model = GPT(gpt_tiny()).eval()
    idx = torch.randint(256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])


def test_untrained_loss_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    idx = torch.randint(256, (4, 32))
    loss = gpt_loss(model, (idx, torch.roll(idx, -1, dims=1)))
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_tied_weights_share_storage():
    model = GPT(gpt_tiny())
    assert model.lm_head.weight is model.wte.weight
    untied = GPT(gpt_tiny(tie_weights=False))
    assert untied.lm_head.weight is not untied.wte.weight


def test_residual_projections_use_scaled_init():
    torch.manual_seed(0)
    cfg = gpt_small_cpu()
    model = GPT(cfg)
    expected = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert model.layers[0].mlp.fc2.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert model.layers[0].mlp.fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(model.layers[0].attn.qkv.bias == 0)


def test_forward_traces_with_fake_make_fx():
    cfg = gpt_tiny()
    model = GPT(cfg)
    params = dict(model.named_parameters())  # tied lm_head.weight appears once
    idx = torch.randint(cfg.vocab_size, (2, cfg.seq_len))

    # Parameters are graph inputs (as in a compiler), so fake mode sees no real tensors.
    def forward(params, idx):
        return torch.func.functional_call(model, params, (idx,))

    graph = make_fx(forward, tracing_mode="fake")(params, idx)
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert any("softmax" in t for t in targets)
    # The traced graph computes the same thing as the module.
    torch.testing.assert_close(graph(params, idx), model(idx))


def test_mlp_model_and_loss():
    model = MLP((16, 32, 32, 4))
    assert [name for name, _ in model.named_children()] == ["fc1", "act1", "fc2", "act2", "fc3"]
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    assert model(x).shape == (8, 4)
    assert mlp_loss(model, (x, y)).dim() == 0


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_training_loss_traces_with_dropout(attention):
    model = GPT(gpt_tiny(attention=attention, dropout=0.1)).train()
    params = dict(model.named_parameters())
    idx = torch.randint(256, (2, 32))

    def loss(params, idx, targets):
        return gpt_loss(lambda x: torch.func.functional_call(model, params, (x,)), (idx, targets))

    graph = make_fx(loss, tracing_mode="fake")(params, idx, idx)
    assert graph(params, idx, idx).dim() == 0
