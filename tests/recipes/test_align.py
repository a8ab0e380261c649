"""The ALIGN recipe: it learns (held-out retrieval well above chance), the compiled step is eager
PyTorch's (BatchNorm statistics included), every plan in recipes/align/plans compiles and does
what it says, bf16 lowers to GE, and transformers' AlignModel compiles and trains."""
from __future__ import annotations

import copy

import pytest
import torch

from cann_passes import Plan
from recipes.align import ALIGN, RECIPE, align_base, align_loss, align_tiny, evaluate, hf_align, hf_align_loss
from tests.recipes._helpers import (assert_plan_does_what_it_says, bf16_lowers_to_ge, capture,
                                    max_difference_from_eager, plan_files, sgd, train_compiled)
from recipes.data.images import PAD, image_text_batch


def test_align_base_has_efficientnet_b7_and_bert_base_sized_towers():
    with torch.device("meta"):
        model = ALIGN(align_base())
    vision = sum(p.numel() for p in model.vision.parameters())
    text = sum(p.numel() for p in model.text.parameters())
    assert 60e6 < vision < 70e6, vision          # EfficientNet-B7: 66M
    assert 105e6 < text < 115e6, text            # BERT-base without the pooler / type embeddings


def test_text_encoder_ignores_padding():
    torch.manual_seed(0)
    model = ALIGN(align_tiny()).eval()
    ids = image_text_batch("train", 0, 2)["input_ids"]
    assert (ids == PAD).any()
    # Another token id at padded positions (still marked as padding: the mask is taken from the
    # original ids) must not reach [CLS]; the model reads the mask from the ids, so compare the
    # encoder with padding against the same caption cut to its real length.
    length = int((ids[0] != PAD).sum())
    torch.testing.assert_close(model.text(ids[:1])[0], model.text(ids[:1, :length])[0], atol=1e-5, rtol=1e-5)


def test_compiled_step_matches_eager_pytorch_fp32_with_batchnorm_statistics():
    torch.manual_seed(0)
    model = ALIGN(align_tiny())
    reference = copy.deepcopy(model)
    # SGD: Adam would turn 1e-8 rounding in near-zero gradients into lr-sized steps (see checks).
    loss_diff, param_diff = max_difference_from_eager(model, align_loss,
                                                      [image_text_batch("train", 8 * i, 8) for i in range(3)],
                                                      reference=reference, optimizer=sgd)
    assert loss_diff <= 1e-5 and param_diff <= 1e-5, (loss_diff, param_diff)
    stats = dict(reference.named_buffers())
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, stats[name], atol=1e-5, rtol=1e-5, msg=name)


def test_training_gives_heldout_retrieval_well_above_chance():
    torch.manual_seed(0)
    model = ALIGN(align_tiny())
    losses = train_compiled(model, align_loss, Plan(backend="eager"), steps=40, batch_size=32, lr=3e-3)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    acc = evaluate(model)            # 64 held-out pairs with distinct captions: chance 1/64
    assert acc["image_to_text"] >= 6 / 64 and acc["text_to_image"] >= 6 / 64, acc


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = ALIGN(align_tiny())
    return capture(model, align_loss, image_text_batch("train", 0, 8))


@pytest.mark.parametrize("path", plan_files(RECIPE.plans_dir), ids=lambda p: p.stem)
def test_every_plan_compiles_and_does_what_it_says(captured, path):
    assert_plan_does_what_it_says(captured, path)


def test_bf16_final_graph_lowers_to_ge_with_no_unsupported_op(tmp_path, torchair):
    torch.manual_seed(0)
    ops = bf16_lowers_to_ge(ALIGN(align_tiny()), align_loss, image_text_batch("train", 0, 4),
                            RECIPE.plans_dir, tmp_path)
    assert ops.get("Conv2D", 0) + ops.get("DepthwiseConv2D", 0) >= 5 and ops["Cast"] > 0, ops


def test_transformers_align_model_trains_through_the_recipe():
    torch.manual_seed(0)
    model = hf_align(dropout=False)     # dropout draws differ between eager and compiled
    assert model.temperature.dim() == 0          # ALIGN's own 0-dim temperature, as shipped
    loss_diff, param_diff = max_difference_from_eager(model, hf_align_loss,
                                                      [image_text_batch("train", 8 * i, 8) for i in range(2)],
                                                      optimizer=sgd)
    assert loss_diff <= 1e-5 and param_diff <= 1e-5, (loss_diff, param_diff)
