"""Procedural images with captions that describe them: shapes, colours, positions and counts.

Every image is drawn here with torch (no files, no downloads) from a seed, and its caption
says what was drawn: ``"two red circles top left"``. A scene is fully determined by its
seed, so the same ``(split, index)`` is the same picture on every machine and every run.
The train and held-out splits draw from disjoint seed ranges: held-out pictures are never
seen in training (their captions may be, with different pictures: sizes and exact places
jitter within the named region).

Captions use a fixed word vocabulary (:data:`WORDS`), so tokenization is a table lookup:
``encode_caption`` gives ``[bos, words..., eos, pad...]`` of a fixed length. ``EOS`` is the
largest id, so CLIP's "pool the argmax token" and "pool the eos token" agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {                     # name -> RGB in [0, 1]
    "red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.9, 0.1), "magenta": (0.9, 0.15, 0.85), "cyan": (0.1, 0.85, 0.9),
}
POSITIONS = {                   # name -> (row, column) centre of the region, as fractions
    "top left": (0.25, 0.25), "top right": (0.25, 0.75),
    "bottom left": (0.75, 0.25), "bottom right": (0.75, 0.75),
}
COUNTS = ("one", "two", "three")

PAD, BOS = 0, 1
_PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
_CONTENT = sorted({*SHAPES, *_PLURAL.values(), *COLOURS, *COUNTS, "top", "bottom", "left", "right"})
WORDS = ("<pad>", "<bos>", *_CONTENT, "<eos>")
EOS = len(WORDS) - 1
VOCAB_SIZE = len(WORDS)
CAPTION_LEN = 8                 # bos + count colour shape vertical horizontal + eos, padded
_ID = {w: i for i, w in enumerate(WORDS)}

# Disjoint seed ranges per split: held-out scenes are never drawn for training. torch's CPU
# generator (mt19937) keeps only the low 32 bits of a seed, so the ranges live below 2**32.
_SPLIT_BASE = {"train": 0, "heldout": 1 << 31}
_SPLIT_SIZE = 1 << 31


@dataclass(frozen=True)
class Scene:
    """What one picture shows; ``caption`` is the words for it."""

    shape: str
    colour: str
    position: str
    count: int

    @property
    def caption(self) -> str:
        noun = self.shape if self.count == 1 else _PLURAL[self.shape]
        return f"{COUNTS[self.count - 1]} {self.colour} {noun} {self.position}"

    @property
    def key(self) -> tuple:
        return (self.shape, self.colour, self.position, self.count)


def num_scenes() -> int:
    """How many distinct captions there are."""
    return len(SHAPES) * len(COLOURS) * len(POSITIONS) * len(COUNTS)


def encode_caption(caption: str, length: int = CAPTION_LEN) -> torch.Tensor:
    """``[bos, word ids..., eos, pad...]`` of ``length`` (int64); unknown words are an error."""
    words = caption.split()
    unknown = [w for w in words if w not in _ID]
    if unknown:
        raise ValueError(f"caption {caption!r}: words {unknown} are not in the vocabulary")
    ids = [BOS, *(_ID[w] for w in words), EOS]
    if len(ids) > length:
        raise ValueError(f"caption {caption!r} needs {len(ids)} tokens, more than length={length}")
    return torch.tensor(ids + [PAD] * (length - len(ids)), dtype=torch.long)


def decode_caption(ids: torch.Tensor) -> str:
    """The words of a token row, without bos/eos/pad."""
    return " ".join(WORDS[i] for i in ids.tolist() if i not in (PAD, BOS, EOS))


def _scene_generator(split: str, index: int) -> torch.Generator:
    if split not in _SPLIT_BASE:
        raise ValueError(f"split must be one of {tuple(_SPLIT_BASE)}, got {split!r}")
    if not 0 <= index < _SPLIT_SIZE:
        raise ValueError(f"index must be in 0..{_SPLIT_SIZE - 1}, got {index}")
    # An odd multiplier is a bijection mod 2**31: neighbouring indices get unrelated seeds.
    return torch.Generator().manual_seed(_SPLIT_BASE[split] + (index * 0x9E3779B1) % _SPLIT_SIZE)


def _choice(g: torch.Generator, options) -> int:
    return int(torch.randint(len(options), (), generator=g))


def sample_scene(g: torch.Generator) -> Scene:
    return Scene(SHAPES[_choice(g, SHAPES)], tuple(COLOURS)[_choice(g, COLOURS)],
                 tuple(POSITIONS)[_choice(g, POSITIONS)], 1 + _choice(g, COUNTS))


def _shape_mask(shape: str, yy: torch.Tensor, xx: torch.Tensor, cy: float, cx: float, r: float) -> torch.Tensor:
    dy, dx = yy - cy, xx - cx
    if shape == "circle":
        return dy * dy + dx * dx <= r * r
    if shape == "square":
        return (dy.abs() <= r * 0.85) & (dx.abs() <= r * 0.85)
    if shape == "triangle":   # apex up: inside when below the two slanted edges and above the base
        return (dy <= r * 0.8) & (dy >= -r) & (dx.abs() <= (dy + r) * 0.6)
    if shape == "cross":
        w = r * 0.35
        return ((dy.abs() <= w) & (dx.abs() <= r)) | ((dx.abs() <= w) & (dy.abs() <= r))
    raise ValueError(f"unknown shape {shape!r}")


def draw_scene(scene: Scene, g: torch.Generator, size: int = 32) -> torch.Tensor:
    """A (3, size, size) float image in [0, 1]: ``scene.count`` shapes inside its region.

    The objects sit side by side in the named quadrant with jittered size and place; a
    little background noise keeps pixels from being exactly constant.
    """
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32) + 0.5,
                            torch.arange(size, dtype=torch.float32) + 0.5, indexing="ij")
    image = 0.05 + 0.05 * torch.rand(3, size, size, generator=g)
    colour = torch.tensor(COLOURS[scene.colour]).view(3, 1, 1)
    row, col = POSITIONS[scene.position]
    quadrant = size / 2
    slot = quadrant / scene.count                   # objects side by side across the quadrant
    r = min(slot * 0.45, size * 0.13) * (0.85 + 0.15 * float(torch.rand((), generator=g)))
    left = (col - 0.25) * size                      # quadrant's left edge in pixels
    jitter = (torch.rand(2, generator=g) - 0.5) * size * 0.08
    cy = row * size + float(jitter[0])
    for k in range(scene.count):
        cx = left + slot * (k + 0.5) + float(jitter[1]) * (slot / quadrant)
        mask = _shape_mask(scene.shape, yy, xx, cy, cx, r)
        image = torch.where(mask, colour, image)
    return image


def make_pair(split: str, index: int, size: int = 32) -> tuple[torch.Tensor, Scene]:
    """The picture and scene of ``(split, index)``; the same on every call."""
    g = _scene_generator(split, index)
    scene = sample_scene(g)
    return draw_scene(scene, g, size), scene


def _normalize(images: torch.Tensor) -> torch.Tensor:
    return (images - 0.5) / 0.25      # roughly zero mean, unit variance: what encoders expect


def image_text_batch(split: str, start: int, batch_size: int, size: int = 32,
                     length: int = CAPTION_LEN) -> dict[str, torch.Tensor]:
    """``{"pixel_values": (B, 3, size, size), "input_ids": (B, length)}`` for indices start.. ."""
    pairs = [make_pair(split, start + i, size) for i in range(batch_size)]
    return {"pixel_values": _normalize(torch.stack([p[0] for p in pairs])),
            "input_ids": torch.stack([encode_caption(p[1].caption, length) for p in pairs])}


class ImageTextBatches:
    """Endless deterministic batches of the train split (or any split): each ``iter()`` restarts.

    Batch ``k`` holds scenes ``k*batch_size .. (k+1)*batch_size - 1`` of ``split``; pictures
    are drawn once and cached, so later epochs cost nothing.
    """

    def __init__(self, batch_size: int, *, split: str = "train", size: int = 32,
                 num_scenes: int | None = 4096, length: int = CAPTION_LEN) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.split, self.size, self.length = batch_size, split, size, length
        self.num_batches = None if num_scenes is None else max(1, num_scenes // batch_size)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    def batch(self, k: int) -> dict[str, torch.Tensor]:
        if self.num_batches is not None:
            k %= self.num_batches
        if k not in self._cache:
            self._cache[k] = image_text_batch(self.split, k * self.batch_size, self.batch_size,
                                              self.size, self.length)
        return self._cache[k]

    def first(self, n: int) -> list[dict[str, torch.Tensor]]:
        """Batches ``0 .. n-1``: what an ``iter()`` yields first."""
        return [self.batch(k) for k in range(n)]

    def __iter__(self):
        k = 0
        while True:
            yield self.batch(k)
            k += 1


def distinct_heldout(n: int, size: int = 32, length: int = CAPTION_LEN) -> dict[str, torch.Tensor]:
    """``n`` held-out pairs with pairwise different captions, for retrieval (chance = 1/n).

    Distinct captions make "the right caption" unambiguous: a retrieved caption is correct
    only if it is this picture's own.
    """
    if not 1 <= n <= num_scenes():
        raise ValueError(f"n must be in 1..{num_scenes()} (the number of distinct captions), got {n}")
    images, captions, seen, index = [], [], set(), 0
    while len(images) < n:
        image, scene = make_pair("heldout", index, size)
        index += 1
        if scene.key in seen:
            continue
        seen.add(scene.key)
        images.append(image)
        captions.append(encode_caption(scene.caption, length))
    return {"pixel_values": _normalize(torch.stack(images)), "input_ids": torch.stack(captions)}


def save_contact_sheet(path: str, n: int = 16, size: int = 64) -> None:
    """A grid of held-out pictures with their captions (matplotlib), to see what the models see."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(cols * 2.2, (n + cols - 1) // cols * 2.4))
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            image, scene = make_pair("heldout", i, size)
            ax.imshow(image.permute(1, 2, 0).numpy())
            ax.set_title(scene.caption, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    import sys
    out = sys.argv[1] if len(sys.argv) > 1 else "images.png"
    save_contact_sheet(out)
    print(f"wrote {out}")
