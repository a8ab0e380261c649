"""recompute on models users bring: blocks and attention cores found from the graph, not our spelling.

One tiny model per behaviour: SDPA attention (LLaMA), two stacks with cross-attention (T5),
blocks held as named attributes and in ``nn.Sequential`` (custom modules), and the errors and
warnings when a policy has nothing to act on.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cann_passes import Plan
from cann_passes.pass_manager import PassContext, PassFailure, PassManager
from graph_ir import capture_train_step
from graph_ir.analysis import memory_profile
from graph_ir.analysis.structure import attention_cores, find_blocks
from tests.zoo import build


def _captured(name: str, layers: int = 2, **config):
    entry = build(name, layers=layers, **config)
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1)
    tg, _ = capture_train_step(entry.model, opt, entry.loss_fn, entry.make_batch(0))
    return tg, entry


def _recompute(tg, policy: str, every_n: int = 1):
    manager = PassManager(f"cleanup,recompute{{policy={policy},every_n={every_n}}},cleanup",
                          verify_level="deep")
    out = manager.run(tg.copy(), PassContext())
    return memory_profile(out.graph).saved_bytes, next(r.stats for r in manager.records if r.name == "recompute")


@pytest.fixture(scope="module")
def llama4():
    return _captured("llama", layers=4)[0]


class TestStructure:
    def test_llama_blocks_and_sdpa_cores(self, llama4):
        structure = find_blocks(llama4.graph)
        assert structure.stacks == {"model.layers": [f"model.layers.{i}" for i in range(4)]}
        cores = attention_cores(llama4.graph)
        assert len(cores) == 4
        assert all(any("scaled_dot_product" in str(n.target) for n in core) for core in cores)

    def test_t5_has_two_stacks_and_self_and_cross_attention(self):
        tg, entry = _captured("t5")
        assert set(find_blocks(tg.graph).stacks) == set(entry.block_prefixes)
        assert len(attention_cores(tg.graph)) == 6   # encoder self x2, decoder self x2 and cross x2

    def test_vit_stack_is_found_under_the_name_transformers_gives_it(self):
        tg, entry = _captured("vit")
        assert entry.block_prefixes == ("vit.layers",)   # transformers 5: ViTModel.layers, no .encoder
        assert find_blocks(tg.graph).stacks == {"vit.layers": ["vit.layers.0", "vit.layers.1"]}

    def test_plan_globs_replace_detection(self, llama4):
        structure = find_blocks(llama4.graph, ("model.layers.[02]",))
        assert structure.blocks == ["model.layers.0", "model.layers.2"] and structure.source == "plan"


class TestPolicies:
    def test_full_keeps_at_most_ten_percent_and_every_n_less_on_a_4_layer_llama(self, llama4):
        none, _ = _recompute(llama4, "none")
        selective, sel_ctx = _recompute(llama4, "selective")
        full, full_ctx = _recompute(llama4, "full")
        every2, _ = _recompute(llama4, "every_n_layers", every_n=2)
        print(f"\nLLaMA 4 layers saved bytes: none {none}, selective {selective}, full {full}, "
              f"every_n_layers(2) {every2}")
        assert selective < none
        assert full <= 0.10 * none
        assert every2 < full
        assert full_ctx["blocks"] == {"model.layers": 4}
        assert sel_ctx["attention_cores"] == 4


# -- blocks the recipe does not spell ``layers.N`` -------------------------------------------------

class _Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(x)))


class _NamedBlocks(nn.Module):
    """Blocks as named attributes, and a Sequential pair beside them."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(32, d)
        self.first, self.second = _Block(d), _Block(d)
        self.tail = nn.Sequential(_Block(d), _Block(d))
        self.head = nn.Linear(d, 32)

    def forward(self, ids):
        return self.head(self.tail(self.second(self.first(self.embed(ids)))))


class _NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


def _custom(model, batch, loss_fn):
    return capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, batch)[0]


def _lm_loss(model, ids):
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


class TestCustomModels:
    def test_named_and_sequential_blocks_are_found_and_checkpointed(self):
        torch.manual_seed(0)
        tg = _custom(_NamedBlocks(), torch.randint(0, 32, (2, 8)), _lm_loss)
        structure = find_blocks(tg.graph)
        assert structure.stacks == {"": ["first", "second"], "tail": ["tail.0", "tail.1"]}
        none, _ = _recompute(tg, "none")
        full, _ = _recompute(tg, "full")
        assert full < 0.25 * none

    def test_full_without_blocks_is_refused_with_the_rule_and_the_plan_field(self):
        tg = _custom(_NoBlocks(), torch.randn(4, 8), lambda m, x: m(x).square().mean())
        with pytest.raises(PassFailure, match="option 'blocks'.*no repeated transformer blocks.*'blocks'"):
            _recompute(tg, "full")
        with pytest.raises(PassFailure, match="option 'attention_ops'.*no attention core.*'attention_ops'"):
            _recompute(tg, "selective")


def test_recomputed_sdpa_steps_are_bitwise_equal_to_the_step_without_recompute():
    from tests.zoo import compare
    base = compare("llama", Plan(backend="eager"), steps=2)
    for policy in ("selective", "full"):
        run = compare("llama", Plan(backend="eager", recompute=policy), steps=2)
        assert run.compiled_losses == base.compiled_losses, policy
        assert all(torch.equal(run.compiled_params[k], base.compiled_params[k]) for k in base.compiled_params)
        assert run.step.last.memory.saved_bytes < base.step.last.memory.saved_bytes


def test_the_folded_solver_recomputes_an_opt_stack_bitwise_and_needs_three_identical_blocks():
    from tests.zoo import compare
    base = compare("opt", Plan(backend="eager"), steps=2, layers=4)
    folded = "cleanup,recompute{policy=budget,budget=0.3,solver=folded},cleanup"
    run = compare("opt", Plan(backend="eager", recompute="budget", recompute_budget=0.3, pipeline=folded),
                  steps=2, layers=4)
    stats = next(r.stats for r in run.step.last.records if r.name == "recompute")
    assert stats["solver"] == "folded" and stats["recomputed_nodes"] > 0
    assert run.step.last.memory.saved_bytes < base.step.last.memory.saved_bytes
    assert run.compiled_losses == base.compiled_losses
    assert all(torch.equal(run.compiled_params[k], base.compiled_params[k]) for k in base.compiled_params)
    tg, _ = _captured("opt", layers=2)
    with pytest.raises(PassFailure, match=r"solver.*3 identical blocks"):
        PassManager(folded).run(tg.copy(), PassContext())


@pytest.mark.parametrize("name", ["opt", "whisper"])
def test_the_solver_prices_recomputation_as_the_rewriter_runs_it(name):
    # The rewriter recomputes a value once per block whose backward needs it; at a tight budget
    # a block's recomputation reaching into the block before is rebuilt by every later block.
    # What the solver says an answer costs is what the recomputed nodes the pass added cost.
    tg, _ = _captured(name, layers=4)
    for budget in (0.1, 0.25, 0.5):
        manager = PassManager(f"cleanup,recompute{{budget={budget}}},cleanup")
        manager.run(tg.copy(), PassContext())
        stats = next(r.stats for r in manager.records if r.name == "recompute")
        assert stats["recomputed_nodes"] > 0
        assert stats["solver_recompute_time_s"] == pytest.approx(stats["recompute_time_s"], rel=1e-9), budget
        assert all(isinstance(note, str) for note in stats["solver_notes"])
