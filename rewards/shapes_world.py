"""The shapes world: a small procedural text-to-image task in the spirit of GenEval.

Prompts come from a finite grammar over colours, shapes, counts and two-object relations, in
four categories (GenEval's single object, two objects, counting and position). The renderer
draws crisp matching images on a uniform background; the verifier (`rewards.shapes`)
checks generated images against the parsed prompt with the same shape templates.
Everything here is numpy and deterministic given a numpy Generator.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

# RGB, pairwise >= 100 apart and >= 100 from the background, so that nearest-colour
# classification survives the blur of generated images
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 25, 30),
    "green": (30, 160, 60),
    "blue": (35, 75, 225),
    "yellow": (235, 225, 35),
    "purple": (140, 40, 170),
    "orange": (245, 125, 10),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
SHAPES = ("circle", "square", "triangle")
RELATIONS = ("left of", "right of", "above", "below")
CATEGORIES = ("single", "two_objects", "counting", "position")
COUNT_WORDS = {"two": 2, "three": 3, "four": 4}
_RELATION_WORDS = {"to the left of": "left of", "to the right of": "right of", "above": "above", "below": "below"}
HELDOUT_FRACTION = 0.2


class PromptError(ValueError):
    """A prompt outside the grammar."""


@dataclass(frozen=True)
class ObjectSpec:
    count: int
    color: str
    shape: str


@dataclass(frozen=True)
class Scene:
    objects: tuple[ObjectSpec, ...]
    relation: str | None  # the first object relative to the second (position prompts)
    category: str


# ---- grammar ----------------------------------------------------------------------------

def _article(color: str) -> str:
    return "an" if color[0] in "aeiou" else "a"


def _one(color: str, shape: str) -> str:
    return f"{_article(color)} {color} {shape}"


def prompt_of(scene: Scene) -> str:
    o = scene.objects
    if scene.category == "single":
        return _one(o[0].color, o[0].shape)
    if scene.category == "counting":
        word = {v: k for k, v in COUNT_WORDS.items()}[o[0].count]
        return f"{word} {o[0].color} {o[0].shape}s"
    if scene.category == "two_objects":
        return f"{_one(o[0].color, o[0].shape)} and {_one(o[1].color, o[1].shape)}"
    words = {v: k for k, v in _RELATION_WORDS.items()}[scene.relation]
    return f"{_one(o[0].color, o[0].shape)} {words} {_one(o[1].color, o[1].shape)}"


_COLOR = "|".join(COLORS)
_SHAPE = "|".join(SHAPES)
_OBJ = rf"(?:a|an) ({_COLOR}) ({_SHAPE})"
_FORMS = [
    ("single", re.compile(rf"^{_OBJ}$")),
    ("counting", re.compile(rf"^({'|'.join(COUNT_WORDS)}) ({_COLOR}) ({_SHAPE})s$")),
    ("two_objects", re.compile(rf"^{_OBJ} and {_OBJ}$")),
    ("position", re.compile(rf"^{_OBJ} ({'|'.join(_RELATION_WORDS)}) {_OBJ}$")),
]
_ACCEPTED = ("'a red circle', 'two|three|four red circles', 'a red circle and a blue square', "
             "'a red circle to the left of|to the right of|above|below a blue square' with colours "
             f"{', '.join(COLORS)} and shapes {', '.join(SHAPES)}")


def parse_prompt(prompt: str) -> Scene:
    text = " ".join(str(prompt).lower().split())
    for category, form in _FORMS:
        m = form.match(text)
        if not m:
            continue
        g = m.groups()
        if category == "single":
            return Scene((ObjectSpec(1, g[0], g[1]),), None, category)
        if category == "counting":
            return Scene((ObjectSpec(COUNT_WORDS[g[0]], g[1], g[2]),), None, category)
        first, second = ObjectSpec(1, g[0], g[1]), ObjectSpec(1, g[-2], g[-1])
        if (first.color, first.shape) == (second.color, second.shape):
            break  # "a red circle and a red circle" is a counting prompt in disguise
        relation = _RELATION_WORDS[g[2]] if category == "position" else None
        return Scene((first, second), relation, category)
    raise PromptError(f"prompt '{prompt}' is not in the shapes grammar; accepted forms: {_ACCEPTED}")


def category_of(prompt: str) -> str:
    return parse_prompt(prompt).category


@lru_cache(maxsize=None)
def _all_prompts() -> tuple[str, ...]:
    pairs = [(c, s) for c in COLORS for s in SHAPES]
    scenes = [Scene((ObjectSpec(1, c, s),), None, "single") for c, s in pairs]
    scenes += [Scene((ObjectSpec(n, c, s),), None, "counting") for n in COUNT_WORDS.values() for c, s in pairs]
    for i, a in enumerate(pairs):
        for j, b in enumerate(pairs):
            if i < j:
                scenes.append(Scene((ObjectSpec(1, *a), ObjectSpec(1, *b)), None, "two_objects"))
            if i != j:
                scenes += [Scene((ObjectSpec(1, *a), ObjectSpec(1, *b)), r, "position") for r in RELATIONS]
    return tuple(sorted(prompt_of(s) for s in scenes))


def all_prompts(category: str | None = None) -> list[str]:
    """The whole finite grammar, sorted (optionally one category)."""
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"category must be one of {', '.join(CATEGORIES)}; got '{category}'")
    return [p for p in _all_prompts() if category is None or category_of(p) == category]


def _held_out(prompt: str) -> bool:
    digest = int(hashlib.sha1(prompt.encode()).hexdigest()[:8], 16)
    return digest % 1000 < HELDOUT_FRACTION * 1000


def prompt_split(split: str, category: str | None = None) -> list[str]:
    """The fixed train / held-out split: a hash of each prompt decides (about 20% held out)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout; got '{split}'")
    return [p for p in all_prompts(category) if _held_out(p) == (split == "heldout")]


def category_probabilities(category_weights: Sequence[float]) -> np.ndarray:
    """One weight per entry of CATEGORIES -> the probability of drawing each; ValueError if the
    weights are not that many non-negative numbers with a positive sum."""
    w = np.asarray(category_weights, dtype=float)
    if w.shape != (len(CATEGORIES),) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"category_weights must be {len(CATEGORIES)} non-negative numbers (for "
                         f"{', '.join(CATEGORIES)}) with a positive sum; got {list(category_weights)}")
    return w / w.sum()


def sample_prompts(n: int, rng: np.random.Generator, split: str = "train",
                   category_weights: Sequence[float] | None = None) -> list[str]:
    """n prompts: a category (uniformly, or in proportion to `category_weights`, one weight per
    entry of CATEGORIES), then a prompt of the split uniformly within it."""
    pools = [prompt_split(split, c) for c in CATEGORIES]
    if category_weights is None:
        cats = rng.integers(0, len(pools), size=n)
    else:
        cats = rng.choice(len(pools), size=n, p=category_probabilities(category_weights))
    return [pools[c][int(rng.integers(0, len(pools[c])))] for c in cats]


def eval_set(n_per_category: int, split: str = "heldout") -> list[str]:
    """The split's prompts of each category cycled to n_per_category each (equal weight per
    category, as GenEval reports), in a fixed order."""
    out = []
    for c in CATEGORIES:
        pool = prompt_split(split, c)
        out += [pool[i % len(pool)] for i in range(n_per_category)]
    return out


# ---- rendering --------------------------------------------------------------------------

@lru_cache(maxsize=None)
def shape_mask(shape: str, size: int) -> np.ndarray:
    """The ideal filled shape in a size x size box: the renderer draws it, the verifier
    compares detected regions with it."""
    c = (np.arange(size) + 0.5) / size  # pixel centres in [0, 1]
    y, x = np.meshgrid(c, c, indexing="ij")
    if shape == "square":
        mask = np.ones((size, size), dtype=bool)
    elif shape == "circle":
        mask = (y - 0.5) ** 2 + (x - 0.5) ** 2 <= 0.25
    elif shape == "triangle":  # apex at the top centre, base along the bottom row
        mask = np.abs(x - 0.5) <= 0.5 * y + 0.5 / size
    else:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}; got '{shape}'")
    mask.setflags(write=False)
    return mask


def _relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float], margin: float) -> bool:
    """a, b: (y, x) centres. Offsets along the relation's axis must exceed `margin` and the
    other axis's offset, so the relation is unambiguous."""
    dy, dx = b[0] - a[0], b[1] - a[1]
    along = {"left of": dx, "right of": -dx, "above": dy, "below": -dy}[relation]
    across = abs(dy) if relation in ("left of", "right of") else abs(dx)
    return along >= margin and along > across


def _place(sizes: list[int], relation: str | None, rng: np.random.Generator, size: int, tries: int = 200):
    gap = 2
    for _ in range(tries):
        boxes = []
        for s in sizes:
            y, x = int(rng.integers(0, size - s + 1)), int(rng.integers(0, size - s + 1))
            if all(y + s + gap <= by or by + bs + gap <= y or x + s + gap <= bx or bx + bs + gap <= x for by, bx, bs in boxes):
                boxes.append((y, x, s))
            else:
                break
        if len(boxes) < len(sizes):
            continue
        if relation is not None:
            (ay, ax, as_), (by, bx, bs) = boxes
            centre_a, centre_b = (ay + as_ / 2, ax + as_ / 2), (by + bs / 2, bx + bs / 2)
            if not _relation_holds(relation, centre_a, centre_b, margin=size / 8):
                continue
        return boxes
    return None


def render(prompt: str | Scene, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """An image [size, size, 3] uint8 matching the prompt. Always succeeds (at the sizes the
    verifier reads, 32 and 64; sizes under 24 make objects too small to verify): when random
    placement keeps failing, the objects shrink until they fit."""
    scene = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    objects = [(o.color, o.shape) for o in scene.objects for _ in range(o.count)]
    lo, hi = size * 7 // 32, (size * 12 // 32 if len(objects) <= 2 else size * 9 // 32)
    sizes = [int(rng.integers(lo, hi + 1)) for _ in objects]
    floor = [min(3, s) for s in sizes]
    stuck = 0  # failed rounds at the smallest sizes: only an image far too small gets there
    while (boxes := _place(sizes, scene.relation, rng, size)) is None:
        stuck += sizes == floor
        if stuck > 20:
            raise ValueError(f"render: cannot fit the objects of '{prompt_of(scene)}' in a {size}x{size} image; use size >= 16")
        sizes = [max(f, s - 1) for f, s in zip(floor, sizes)]
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for (color, shape), (y, x, s) in zip(objects, boxes):
        image[y : y + s, x : x + s][shape_mask(shape, s)] = COLORS[color]
    return image
