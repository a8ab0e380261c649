"""The CLIP recipe: it learns (held-out retrieval well above chance), the compiled step is eager
PyTorch's, every plan in recipes/clip/plans compiles and does what it says, bf16 lowers to GE,
and transformers' CLIPModel trains through the same recipe."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan
from recipes.clip import CLIP, RECIPE, clip_loss, clip_tiny, clip_vit_l14, evaluate, hf_clip_loss
from recipes.clip.hf import hf_clip_tiny
from tests.recipes._helpers import (assert_plan_does_what_it_says, bf16_lowers_to_ge, capture,
                                    max_difference_from_eager, plan_files, train_compiled)
from recipes.data.images import EOS, image_text_batch


def test_vit_l14_has_openai_clips_parameter_count():
    with torch.device("meta"):
        model = CLIP(clip_vit_l14())
    assert sum(p.numel() for p in model.parameters()) == 427_616_513


def test_text_tower_pools_the_first_end_of_text_token():
    torch.manual_seed(0)
    model = CLIP(clip_tiny()).eval()
    ids = image_text_batch("train", 0, 2)["input_ids"]
    changed = ids.clone()
    changed[:, -1] = EOS              # a second eos in the padding: after the first one, causal: unread
    torch.testing.assert_close(model.text(ids), model.text(changed))


def test_compiled_step_matches_eager_pytorch_fp32():
    torch.manual_seed(0)
    loss_diff, param_diff = max_difference_from_eager(CLIP(clip_tiny()), clip_loss,
                                                      [image_text_batch("train", 8 * i, 8) for i in range(3)])
    assert loss_diff <= 1e-5 and param_diff <= 1e-5, (loss_diff, param_diff)


def test_training_gives_heldout_retrieval_well_above_chance():
    torch.manual_seed(0)
    model = CLIP(clip_tiny())
    losses = train_compiled(model, clip_loss, Plan(backend="eager"), steps=40, batch_size=32, lr=3e-3)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    acc = evaluate(model)            # 64 held-out pairs with distinct captions: chance 1/64
    assert acc["image_to_text"] >= 6 / 64 and acc["text_to_image"] >= 6 / 64, acc


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = CLIP(clip_tiny())
    return capture(model, clip_loss, image_text_batch("train", 0, 8))


@pytest.mark.parametrize("path", plan_files(RECIPE.plans_dir), ids=lambda p: p.stem)
def test_every_plan_compiles_and_does_what_it_says(captured, path):
    assert_plan_does_what_it_says(captured, path)


def test_bf16_final_graph_lowers_to_ge_with_no_unsupported_op(tmp_path, torchair):
    torch.manual_seed(0)
    ops = bf16_lowers_to_ge(CLIP(clip_tiny()), clip_loss, image_text_batch("train", 0, 4), RECIPE.plans_dir, tmp_path)
    assert ops.get("Conv2D", 0) >= 1 and ops["LayerNormV4"] >= 2 * 4 + 3 and ops["Cast"] > 0, ops


def test_transformers_clip_model_trains_through_the_recipe():
    torch.manual_seed(0)
    model = hf_clip_tiny()
    assert model.logit_scale.dim() == 0          # CLIP's own 0-dim scale, as shipped
    batches = [image_text_batch("train", 8 * i, 8) for i in range(2)]
    loss_diff, param_diff = max_difference_from_eager(model, hf_clip_loss, batches)
    assert loss_diff <= 1e-5 and param_diff <= 1e-5, (loss_diff, param_diff)
    assert model.logit_scale.dtype == torch.float32 and model.logit_scale.dim() == 0
