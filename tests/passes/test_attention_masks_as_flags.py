"""attention_masks_as_flags: a mask made from no input becomes is_causal or goes, decided by its values."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from cann_passes import Plan, compile_for_npu
from cann_passes.passes.attention_masks_as_flags import attention_masks_as_flags, pattern
from graph_ir import capture_train_step
from tests import zoo

aten = torch.ops.aten
FLASH = (aten._scaled_dot_product_flash_attention_for_cpu.default,
         aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
B, S, H, D = 2, 6, 2, 8


def _grid():
    i = torch.arange(S)
    return i[:, None], i[None, :]


MASKS = {
    # transformers' spelling: a float mask of 0 and -inf from two aranges, expanded over the batch
    "float_causal": lambda x: torch.where((_grid()[1] <= _grid()[0]).expand(x.shape[0], 1, S, S),
                                          torch.tensor(0.0), torch.tensor(float("-inf"))),
    "bool_causal": lambda x: torch.ones(S, S, dtype=torch.bool).tril(),
    "lowest_causal": lambda x: torch.zeros(S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1),
                                                             torch.finfo(torch.float32).min),
    "all_visible": lambda x: torch.zeros(x.shape[0], 1, S, S),
    # an expand that adds the batch dim, then an unsqueeze that reads the dims it added
    "expanded_then_unsqueezed": lambda x: (_grid()[1] <= _grid()[0]).expand(x.shape[0], S, S).unsqueeze(1),
    "sliding_window": lambda x: (_grid()[1] <= _grid()[0]) & (_grid()[0] - _grid()[1] < 3),
    "one_key_ahead": lambda x: torch.ones(S, S, dtype=torch.bool).tril(1),
    "half_weighted": lambda x: torch.zeros(S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -0.5),
    "from_the_batch": lambda x: (x[:, :, :1] > 0).unsqueeze(1).expand(-1, 1, S, S),
}
OUTCOME = {"float_causal": "causal", "bool_causal": "causal", "lowest_causal": "causal",
           "expanded_then_unsqueezed": "causal",
           "all_visible": "dropped", "sliding_window": "kept_other", "one_key_ahead": "kept_other",
           "half_weighted": "kept_other", "from_the_batch": "kept_not_constant"}


class Attention(torch.nn.Module):
    def __init__(self, mask: str):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D)
        self.mask = mask

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], S, 3, H, D).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=MASKS[self.mask](x))
        return out.transpose(1, 2).reshape(x.shape[0], S, H * D)


def _loss(model, x):
    return model(x).pow(2).mean()


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, S, H * D, generator=g) for _ in range(2)]


def _stats(step):
    return next(r.stats for r in step.last.records if r.name == "attention_masks_as_flags")


@pytest.mark.parametrize("mask", list(MASKS))
def test_each_mask_is_decided_by_its_values_and_the_step_matches_eager(mask):
    torch.manual_seed(0)
    model = Attention(mask)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = compile_for_npu(model, Plan(backend="eager", verify="deep"),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_loss)
    for x in _batches():
        ref_opt.zero_grad()
        expected = _loss(ref, x)
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(step(x), expected.detach(), rtol=1e-6, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    stats = _stats(step)
    assert stats[OUTCOME[mask]] == 2 and sum(stats.values()) == 2      # the forward and its backward
    attention = [n for n in step.last.graph.graph.nodes if n.target in FLASH]
    assert len(attention) == 2
    masked = [n for n in attention if n.kwargs.get("attn_mask") is not None]
    causal = [n for n in attention if n.args[4 if n.target is FLASH[0] else 7:][:1] == (True,)]
    assert (len(masked), len(causal)) == {"causal": (0, 2), "dropped": (0, 0)}.get(OUTCOME[mask], (2, 0))


def test_a_mask_larger_than_max_elements_is_not_evaluated():
    model = Attention("float_causal")
    graph, _ = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batches()[0])
    assert attention_masks_as_flags(graph.graph, max_elements=S * S - 1)["kept_too_large"] == 2
    # the batch's expand is not evaluated: S x S elements are enough for a [B, 1, S, S] mask
    assert attention_masks_as_flags(graph.graph, max_elements=S * S)["causal"] == 2


@pytest.mark.parametrize("mask, outcome", [
    ("float_causal", "causal"), ("sliding_window", "kept_other"),     # pointwise: a block of rows at a time
    ("bool_causal", "kept_too_large"), ("all_visible", "kept_too_large")])  # a factory's value made whole
def test_a_mask_larger_than_a_block_is_checked_a_block_of_rows_at_a_time(mask, outcome, monkeypatch):
    from cann_passes.passes import attention_masks_as_flags as module
    model = Attention(mask)
    graph, _ = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batches()[0])
    made = []
    block = module._block
    monkeypatch.setattr(module, "_OUTCOME_OF", {})
    monkeypatch.setattr(module, "_BLOCK", 2 * S)                 # two query rows at a time
    monkeypatch.setattr(module, "_WHOLE", 2 * S)
    monkeypatch.setattr(module, "_block", lambda *a: made.append(a[2:4]) or block(*a))
    assert attention_masks_as_flags(graph.graph)[outcome] == 2
    if outcome == "causal":
        assert {(0, 2), (2, 4), (4, 6)} <= set(made)             # every block was looked at
    elif outcome == "kept_other":
        assert (0, 2) in made and (4, 6) not in made             # the first block that differs ends it


def test_the_outcome_is_remembered_for_the_same_mask_in_another_copy_of_the_graph(monkeypatch):
    from cann_passes.passes import attention_masks_as_flags as module
    model = Attention("float_causal")
    graph, _ = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batches()[0])
    monkeypatch.setattr(module, "_OUTCOME_OF", {})
    checked = []
    values = module._values
    monkeypatch.setattr(module, "_values", lambda nodes: checked.append(len(nodes)) or values(nodes))
    copies = [graph.copy() for _ in range(2)]
    assert [attention_masks_as_flags(c.graph)["causal"] for c in copies] == [2, 2]
    assert len(checked) == 1
    assert not [n for c in copies for n in c.graph.nodes if n.kwargs.get("attn_mask") is not None]


def test_pattern_reads_broadcasting_values():
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    assert pattern(causal, torch.Size([B, H, S, S])) == "causal"
    assert pattern(causal[None, None], torch.Size([B, H, S, S])) == "causal"
    assert pattern(causal, torch.Size([B, H, S, S + 1])) is None             # does not broadcast
    assert pattern(torch.ones(S, S + 2, dtype=torch.bool).tril(), torch.Size([1, 1, S, S + 2])) == "causal"
    assert pattern(torch.zeros(1, S), torch.Size([B, H, S, S])) == "none"
    assert pattern(torch.ones(S, S, dtype=torch.int64).tril(), torch.Size([B, H, S, S])) is None


@pytest.mark.parametrize("name, outcome, config", [("llama", "causal", {}), ("bert", "dropped", {}),
                                                  ("mistral", "kept_other", {"sliding_window": 4})])
def test_transformers_models_without_a_padding_mask_match_eager(name, outcome, config):
    """Without an attention_mask, LLaMA's causal mask and BERT's all-visible one are made from the
    sequence alone; eager transformers then calls SDPA with is_causal (or no mask), and so does the
    step. Mistral's sliding window (4 keys of 12) is not causal: its mask stays."""
    entry = zoo.build(name, layers=2, seed=0, **config)
    batches = [entry.make_batch(1000 + i, pad=False) for i in range(3)]
    for batch in batches:
        del batch["attention_mask"]
    run = zoo.compare(entry, Plan(backend="eager", verify="deep"), batches=batches)
    assert max(abs(a - b) for a, b in zip(run.eager_losses, run.compiled_losses)) <= 1e-5
    assert run.max_param_diff() <= 1e-5
    stats = _stats(run.step)
    assert stats[outcome] == 4 and sum(stats.values()) == 4              # 2 layers, forward and backward
    masked = [n for n in run.step.last.graph.graph.nodes if n.kwargs.get("attn_mask") is not None]
    assert len(masked) == (4 if outcome == "kept_other" else 0)


def test_a_padding_mask_keeps_the_mask():
    entry = zoo.build("llama", layers=1, seed=0)
    batch = entry.make_batch(0, pad=True)
    graph, _ = capture_train_step(entry.model, torch.optim.SGD(entry.model.parameters(), lr=0.1),
                                  entry.loss_fn, batch)
    assert attention_masks_as_flags(graph.graph) == {"causal": 0, "dropped": 0, "kept_not_constant": 2,
                                                     "kept_too_large": 0, "kept_other": 0}


def test_a_step_captured_on_meta_is_checked_on_cpu():
    """The planner captures on meta, where tensors have no values: the mask's ops run again on CPU."""
    from tools.plan_cli import MODELS
    with torch.device("meta"):
        model, loss_fn, batch = MODELS["llama-tiny"].build(2, 32, 1)
    graph, _ = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, batch)
    assert attention_masks_as_flags(graph.graph)["causal"] == 2
