"""The procedural image-caption data: deterministic, split apart, captions that say what is drawn."""
from __future__ import annotations

import pytest
import torch

from recipes.data.images import (COLOURS, EOS, PAD, Scene, decode_caption, distinct_heldout, encode_caption,
                                 image_text_batch, make_pair, num_scenes)


def test_the_same_index_is_the_same_picture_every_time():
    a, sa = make_pair("train", 17)
    b, sb = make_pair("train", 17)
    assert sa == sb and torch.equal(a, b)


def test_train_and_heldout_splits_differ():
    train = [make_pair("train", i, 8)[0] for i in range(20)]
    held = [make_pair("heldout", i, 8)[0] for i in range(20)]
    assert not any(torch.equal(t, h) for t in train for h in held)


def test_picture_shows_its_colour_in_its_quadrant():
    image, scene = make_pair("heldout", 3, 32)
    colour = torch.tensor(COLOURS[scene.colour]).view(3, 1, 1)
    painted = (image - colour).abs().amax(dim=0) < 1e-6
    rows, cols = painted.nonzero(as_tuple=True)
    assert len(rows) > 10
    top, left = scene.position.split()
    assert (rows.float().mean() < 16) == (top == "top") and (cols.float().mean() < 16) == (left == "left")


def test_caption_round_trips_and_is_padded_after_eos():
    ids = encode_caption(Scene("cross", "red", "top left", 2).caption)
    assert decode_caption(ids) == "two red crosses top left"
    assert ids.tolist()[6:] == [EOS, PAD] and ids.max().item() == EOS


def test_unknown_words_are_refused_by_name():
    with pytest.raises(ValueError, match="purple"):
        encode_caption("one purple circle top left")


def test_heldout_retrieval_set_has_distinct_captions():
    batch = distinct_heldout(64)
    assert len({tuple(r) for r in batch["input_ids"].tolist()}) == 64
    with pytest.raises(ValueError, match="n must be"):
        distinct_heldout(num_scenes() + 1)
    assert image_text_batch("train", 0, 4)["pixel_values"].shape == (4, 3, 32, 32)
