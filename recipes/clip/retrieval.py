"""Image <-> text retrieval accuracy on held-out pairs with pairwise distinct captions."""
from __future__ import annotations

from typing import Callable

import torch

from recipes.data.images import distinct_heldout

HELDOUT_PAIRS = 64          # chance is 1/64 either way


@torch.no_grad()
def retrieval_accuracy(model: torch.nn.Module, logits_fn: Callable, n: int = HELDOUT_PAIRS) -> dict[str, float]:
    """Top-1 accuracy of each held-out image finding its caption among ``n``, and back.

    ``logits_fn(model, batch)`` gives the (images, captions) similarity matrix. The model is
    put in eval mode for the measurement and back into the mode it was in.
    """
    batch = distinct_heldout(n)
    was_training = model.training
    model.eval()
    try:
        logits = logits_fn(model, batch).float()
    finally:
        model.train(was_training)
    target = torch.arange(n)
    return {"image_to_text": (logits.argmax(dim=1) == target).float().mean().item(),
            "text_to_image": (logits.argmax(dim=0) == target).float().mean().item()}


def tower_logits(model: torch.nn.Module, batch) -> torch.Tensor:
    """The (images, captions) similarity matrix of a recipe's two-tower model."""
    return model(batch["pixel_values"], batch["input_ids"])


def contrastive_recipe(name: str, *, recipe_model: Callable, hf_model: Callable, loss_fn: Callable,
                       hf_loss_fn: Callable, hf_logits: Callable, plans_dir):
    """The :class:`~recipes.clip.train.Recipe` of a two-tower contrastive family (CLIP, ALIGN):
    ``--model recipe`` or ``--model hf`` (transformers' model), judged by held-out retrieval."""
    from recipes.clip.train import Recipe

    def evaluate(model):
        return retrieval_accuracy(model, hf_logits if hasattr(model, "get_text_features") else tower_logits)

    return Recipe(name=name, models={"recipe": recipe_model, "hf": hf_model},
                  loss_fns={"recipe": loss_fn, "hf": hf_loss_fn}, evaluate=evaluate, plans_dir=plans_dir,
                  headline=f"image_to_text (chance {1 / HELDOUT_PAIRS:.3f})")
