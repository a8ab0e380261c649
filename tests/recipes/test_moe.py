"""The MoE recipe: its compiled step is eager PyTorch's, every plan does what it says, the command
trains, and at the recipe's size the mixture of experts beats the dense model of the same active
size on the shipped text."""
from __future__ import annotations

import json

import pytest
import torch

from recipes.data import TextBatches, load_corpus, train_val_split
from recipes.moe.model import active_parameters, build, moe_loss
from tests.recipes._helpers import assert_plan_does_what_it_says, capture, compiled_losses_match_eager, plan_files

PLANS = plan_files("moe")
TINY = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, max_position_embeddings=32)


def _batches(n, rows=4, seq=16):
    tokens, _ = train_val_split(load_corpus())
    it = iter(TextBatches(tokens, rows, seq, seed=0))
    return [next(it) for _ in range(n)]


def test_the_dense_twin_has_the_moe_models_active_size():
    moe, dense = build("moe"), build("dense")
    assert abs(active_parameters(moe) - active_parameters(dense)) / active_parameters(dense) < 0.02
    assert sum(p.numel() for p in moe.parameters()) > 2.5 * sum(p.numel() for p in dense.parameters())


def test_compiled_fp32_step_matches_eager_pytorch():
    torch.manual_seed(0)
    compiled_losses_match_eager([build("moe", **TINY)], moe_loss, _batches(3))


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    return capture(build("moe", **TINY), moe_loss, _batches(1)[0])


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_every_plan_compiles_and_does_what_it_says(captured, path):
    assert_plan_does_what_it_says(captured, path)


def test_moe_beats_the_dense_model_of_the_same_active_size(tmp_path):
    """The recipe's defaults (8 rows of 128 bytes, 200 steps, AdamW 3e-3): validation loss of the
    8-expert top-2 model against the dense one (one expert twice as wide, always chosen). At this
    size the margin is small and depends on the tokens per step: with 64-byte rows the dense model
    wins (docs/recipes.md)."""
    from recipes.moe.train import main
    runs = {m: main(["--model", m, "--out", str(tmp_path / m)]) for m in ("moe", "dense")}
    assert (tmp_path / "moe" / "loss.png").stat().st_size > 0
    assert json.loads((tmp_path / "moe" / "metrics.json").read_text())["losses"] == runs["moe"]["losses"]
    moe, dense = (runs[m]["val_loss_after"] for m in ("moe", "dense"))
    assert moe < dense - 0.03, (moe, dense)
