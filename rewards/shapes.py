"""The verifiable reward of the shapes world (GenEval-style, on `rewards.shapes_world` prompts).

An image is analysed, not judged by a model: every pixel goes to its nearest palette colour
(or to the background when it is far from all of them), each colour's connected components
are objects, and an object's shape is the ideal template (circle, square, triangle, drawn in
the component's square bounding box by the renderer's own `shape_mask`) that overlaps it best,
or none when no template overlaps well (a blob is no shape). Components under 4 px (at 32x32,
scaled with the image area) are noise, and so are shapeless ones under twice that (blur halos);
a shapeless blob larger than that is still an object (an extra one, since no prompt asks for
it). Relation margin: 1.5 px at 32x32, scaled with the height; the relation compares the
centres of the largest object of each kind. A batch is analysed at once (`analyse_batch`:
vectorised colour assignment, one labelling call per chunk).

Checks for a prompt, one per line:
- for each object of the prompt: its colour is present; an object of its colour and shape is
  present; the number of objects of that colour and shape is exactly the requested count;
- no object that the prompt does not ask for;
- position prompts: the relation holds between the two objects' centres.
`strict` is 1 when every check passes (GenEval's all-or-nothing), `partial` the fraction
that pass.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
from scipy import ndimage

from rewards.registry import register
from rewards.shapes_world import BACKGROUND, CATEGORIES, COLORS, SHAPES, Scene, parse_prompt, shape_mask
from rewards.simple import to_uint8

_NAMES = list(COLORS)
_PALETTE = np.array([BACKGROUND, *COLORS.values()], dtype=np.int32)  # index 0: background
MAX_COLOR_DISTANCE = 90.0  # farther from every palette colour: background (blur, noise)
MIN_SHAPE_IOU = 0.6
# components below min_area are ignored; shapeless ones (no template fits) below
# SPECK_FACTOR * min_area too: at 32x32 the blurred edge of an orange object on white is a
# few px within reach of yellow, and such halos must not count as extra objects. A shapeless
# blob of object size still counts (as an extra object).
SPECK_FACTOR = 2
CHUNK = 256  # images analysed together (bounds the memory of the distance and label arrays)
# 8-connectivity within an image, none across images or colours (the planes of the stacked
# [image x colour, H, W] masks): a triangle's apex or a blurred edge may touch its body only
# diagonally, and the renderer's >= 2 px gaps keep separate objects apart either way
_EIGHT = np.zeros((3, 3, 3), dtype=bool)
_EIGHT[1] = True


@dataclass
class Detected:
    color: str
    shape: str | None
    box: tuple[int, int, int, int]  # y0, x0, y1, x1 (end exclusive)
    centre: tuple[float, float]  # y, x
    area: int
    ious: tuple[float, ...]  # overlap with each template of SHAPES, in its bounding box


@dataclass
class Verdict:
    strict: float
    partial: float
    category: str
    checks: dict[str, bool] = field(default_factory=dict)


def _as_uint8_hwc(image) -> np.ndarray:
    """uint8 [H, W, 3] from uint8 [H, W, 3], or float in [0, 1] / uint8 as [3, H, W] or [H, W, 3]
    (numpy or torch)."""
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    image = np.asarray(image)
    if image.dtype != np.uint8:  # floats in [0, 1]
        image = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
    if image.ndim == 3 and image.shape[0] == 3 and image.shape[-1] != 3:
        image = image.transpose(1, 2, 0)
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"shapes reward: expected an RGB image [H, W, 3] or [3, H, W]; got shape {tuple(image.shape)}")
    return image


def _palette_labels(images: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W, 3] -> [N, H, W] index of the nearest palette colour (0: background, also
    for pixels farther than MAX_COLOR_DISTANCE from every colour). Exact integer arithmetic."""
    x = images.astype(np.int32)
    dist = np.zeros(images.shape[:3] + (len(_PALETTE),), dtype=np.int32)  # squared distances
    for c in range(3):
        dist += (x[..., c, None] - _PALETTE[:, c]) ** 2
    label = dist.argmin(-1).astype(np.uint8)
    label[dist.min(-1) > MAX_COLOR_DISTANCE**2] = 0
    return label


@lru_cache(maxsize=None)
def _templates(side: int) -> tuple[np.ndarray, np.ndarray]:
    """The shape templates of a side x side box, stacked [S, side, side], and their areas."""
    stack = np.stack([shape_mask(s, side) for s in SHAPES])
    return stack, stack.sum(axis=(1, 2))


def _best_shape(component: np.ndarray, min_side: int = 3) -> tuple[str | None, tuple[float, ...]]:
    """(the template with the best IoU in the component's square bounding box (the component
    centred in it), or None below MIN_SHAPE_IOU or in a box smaller than min_side (where the
    templates are all alike); the IoU with each template). Ties go to the later shape in SHAPES."""
    h, w = component.shape  # already cropped to its bounding box
    side = max(h, w)
    if side < min_side:
        return None, (0.0,) * len(SHAPES)
    box = np.zeros((side, side), dtype=bool)
    oy, ox = (side - h) // 2, (side - w) // 2
    box[oy : oy + h, ox : ox + w] = component
    templates, areas = _templates(side)
    inter = (templates & box).sum(axis=(1, 2))
    iou = inter / (areas + int(component.sum()) - inter)
    best = len(SHAPES) - 1 - int(np.argmax(iou[::-1]))
    return (SHAPES[best] if iou[best] >= MIN_SHAPE_IOU else None), tuple(float(v) for v in iou)


def _chunk_objects(images: np.ndarray) -> list[tuple]:
    """The verifier's objects of a chunk uint8 [N, H, W, 3], in the order `analyse` reports them:
    (image index, colour index into _NAMES, (ys, xs) slices of the bounding box, the component's
    boolean mask in that box, area, shape, ious). `_analyse_chunk` and `fill_nonuniformity_batch`
    share it, so the artefact measure reads exactly the objects the verifier counts."""
    n, h, w, _ = images.shape
    k = len(_NAMES)
    label = _palette_labels(images)
    masks = label[:, None] == np.arange(1, k + 1, dtype=np.uint8)[None, :, None, None]  # [N, K, H, W]
    components, count = ndimage.label(masks.reshape(n * k, h, w), structure=_EIGHT)
    if count == 0:
        return []
    areas = np.bincount(components.ravel(), minlength=count + 1)
    min_area = max(4, round(4 * h * w / 1024))  # 4 px at 32x32: smaller specks are noise
    min_side = max(3, round(3 * max(h, w) / 32))  # a 2x2 box has no shape
    keep = np.flatnonzero(areas >= min_area)
    keep = keep[keep > 0]
    if len(keep) == 0:
        return []
    # renumber the kept components 1..m (the rest to 0) so that find_objects, which builds a
    # slice per label, skips the many specks of a noisy image
    renumber = np.zeros(count + 1, dtype=np.int32)
    renumber[keep] = np.arange(1, len(keep) + 1, dtype=np.int32)
    components = renumber[components]
    out = []
    for j, (plane, ys, xs) in enumerate(ndimage.find_objects(components)):
        comp = components[plane.start, ys, xs] == j + 1
        area = int(areas[keep[j]])
        shape, ious = _best_shape(comp, min_side)
        if shape is None and area < SPECK_FACTOR * min_area:
            continue  # a shapeless speck: blur halo or noise, not an object
        image, color = divmod(plane.start, k)
        out.append((image, color, (ys, xs), comp, area, shape, ious))
    return out


def _analyse_chunk(images: np.ndarray) -> list[list[Detected]]:
    found: list[list[Detected]] = [[] for _ in range(images.shape[0])]
    for image, color, (ys, xs), comp, area, shape, ious in _chunk_objects(images):
        cy, cx = np.nonzero(comp)
        found[image].append(Detected(
            _NAMES[color], shape, (ys.start, xs.start, ys.stop, xs.stop),
            (float(cy.mean() + ys.start + 0.5), float(cx.mean() + xs.start + 0.5)), area, ious,
        ))
    return found


def analyse_batch(images: np.ndarray) -> list[list[Detected]]:
    """uint8 [N, H, W, 3] -> the objects of each image (see `analyse`)."""
    images = np.asarray(images, dtype=np.uint8)
    out: list[list[Detected]] = []
    for i in range(0, len(images), CHUNK):
        out += _analyse_chunk(images[i : i + CHUNK])
    return out


def analyse(image) -> list[Detected]:
    """The objects of one image: the connected components (8-connectivity) of each palette
    colour of at least 4 px (at 32x32, scaled with the area), in colour order, each with the
    template shape that fits its bounding box best (None for a blob)."""
    return analyse_batch(_as_uint8_hwc(image)[None])[0]


def _relation_margin(height: int) -> float:
    return 1.5 * height / 32  # 1.5 px at 32x32


def _relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float], margin: float) -> bool:
    dy, dx = b[0] - a[0], b[1] - a[1]
    along = {"left of": dx, "right of": -dx, "above": dy, "below": -dy}[relation]
    return along >= margin


@lru_cache(maxsize=4096)
def _scene(prompt: str) -> Scene:
    return parse_prompt(prompt)  # PromptError (not cached) for a prompt outside the grammar


def _judge(scene: Scene, objects: list[Detected], height: int) -> Verdict:
    kinds = Counter((o.color, o.shape) for o in objects)
    colors = Counter(o.color for o in objects)
    checks: dict[str, bool] = {}
    for o in scene.objects:
        key = f"{o.color} {o.shape}"
        checks[f"{key}: colour present"] = colors[o.color] > 0
        checks[f"{key}: present"] = kinds[(o.color, o.shape)] > 0
        checks[f"{key}: count {o.count}"] = kinds[(o.color, o.shape)] == o.count
    wanted = {(o.color, o.shape) for o in scene.objects}
    checks["no extra objects"] = all(k in wanted for k in kinds)
    if scene.relation is not None:
        a, b = scene.objects
        first = [o for o in objects if (o.color, o.shape) == (a.color, a.shape)]
        second = [o for o in objects if (o.color, o.shape) == (b.color, b.shape)]
        checks[f"{scene.relation}"] = bool(first and second) and _relation_holds(
            scene.relation, max(first, key=lambda o: o.area).centre, max(second, key=lambda o: o.area).centre,
            _relation_margin(height),
        )
    passed = sum(checks.values())
    return Verdict(float(passed == len(checks)), passed / len(checks), scene.category, checks)


def verify(prompt: str, image) -> Verdict:
    """The checks of `prompt` on one image (see the module docstring); PromptError for a prompt
    outside the grammar."""
    scene = _scene(prompt)
    img = _as_uint8_hwc(image)
    return _judge(scene, analyse_batch(img[None])[0], img.shape[0])


def _scenes_and_pixels(images: torch.Tensor, prompts: Sequence[str], reward: str) -> tuple[list[Scene], np.ndarray]:
    """Parsed prompts (a bad prompt fails before any analysis) and uint8 [N, H, W, 3] pixels."""
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{reward} reward: {images.shape[0]} images but {len(prompts)} prompts")
    scenes = [_scene(p) for p in prompts]
    return scenes, to_uint8(images)


def score_batch(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> [N, 2] float32: (strict, partial)."""
    scenes, arr = _scenes_and_pixels(images, prompts, "shapes")
    verdicts = [_judge(s, objs, arr.shape[1]) for s, objs in zip(scenes, analyse_batch(arr))]
    return torch.tensor([(v.strict, v.partial) for v in verdicts], dtype=torch.float32).reshape(len(prompts), 2)


def _quality(scene: Scene, objects: list[Detected], height: int) -> float:
    """A graded version of the checks in [0, 1], 1 only for a perfect match: every requested
    object is paired with a distinct detected object of its colour (greedily, the pairs with
    the best overlap with the requested template first) and earns that overlap (IoU); a
    relation that holds between the paired objects earns 1; the sum is divided by the
    number of requested objects, plus 1 for a relation, plus every detected object left unpaired.
    Unlike strict (0 or 1) and partial (a few discrete levels), it rewards a ragged square
    for getting squarer, which gives GRPO a signal inside groups that strict leaves tied."""
    want = {o: SHAPES.index(o.shape) for o in scene.objects}
    pairs = sorted(((objects[i].ious[want[o]], n, i) for n, o in enumerate(scene.objects)
                    for i in range(len(objects)) if objects[i].color == o.color), reverse=True)
    left = [o.count for o in scene.objects]
    paired: list[list[int]] = [[] for _ in scene.objects]
    used, total = set(), 0.0
    for iou, n, i in pairs:
        if left[n] and i not in used:
            left[n] -= 1
            used.add(i)
            paired[n].append(i)
            total += iou
    units = sum(o.count for o in scene.objects) + len(objects) - len(used)
    if scene.relation is not None:
        units += 1
        if paired[0] and paired[1]:
            total += _relation_holds(scene.relation, objects[paired[0][0]].centre, objects[paired[1][0]].centre,
                                     _relation_margin(height))
    return total / units


def quality_batch(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> [N] float32: the graded match (`_quality`)."""
    scenes, arr = _scenes_and_pixels(images, prompts, "shapes_quality")
    return torch.tensor([_quality(s, objs, arr.shape[1]) for s, objs in zip(scenes, analyse_batch(arr))], dtype=torch.float32)


CLEAN_DISTANCE = 40.0  # RGB units: a pixel this close to a palette colour or the background is clean


def cleanliness_batch(images: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> [N] float32: the fraction of pixels within CLEAN_DISTANCE of the
    background or a palette colour. The renderer draws only such pixels (its blurred edges aside),
    while shapes and shapes_quality accept anything within MAX_COLOR_DISTANCE: a judge of
    artefacts (off-palette tints, noise, smears) that the trained rewards do not see."""
    arr = np.stack([_as_uint8_hwc(im) for im in images]).astype(np.int32)
    dist = np.full(arr.shape[:3], np.iinfo(np.int32).max, dtype=np.int64)
    for colour in _PALETTE:
        dist = np.minimum(dist, ((arr - colour) ** 2).sum(-1))
    return torch.from_numpy((dist <= CLEAN_DISTANCE**2).reshape(len(arr), -1).mean(1).astype(np.float32))


# ---- artefact measures: how far images stray from the renderer's flat colours (lower is cleaner) -----
# A trained model can keep every pixel within MAX_COLOR_DISTANCE (and within CLEAN_DISTANCE) of the
# palette while its backgrounds carry a faint grid and its fills turn speckled: shapes, shapes_quality
# and shapes_clean all stay blind to that. These measure it in RGB units (0-255) on the uint8 pixels the
# verifier reads; the renderer's own images score 0 on both.

def background_impurity_batch(images: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> [N] float32: the mean over the pixels the verifier labels background
    (label 0 of `_palette_labels`: nearest to BACKGROUND, or farther than MAX_COLOR_DISTANCE from every
    colour) of their Euclidean RGB distance from BACKGROUND,

        impurity = (1 / |B|) sum_{p in B} || x_p - BACKGROUND ||_2,   x_p in 0-255 units,

    0 for a pure background; NaN for an image without a background pixel (callers average with nanmean)."""
    arr = to_uint8(images)
    out = np.full(len(arr), np.nan)
    for i in range(0, len(arr), CHUNK):
        chunk = arr[i : i + CHUNK]
        background = _palette_labels(chunk) == 0  # [n, H, W]
        dist = np.sqrt(((chunk.astype(np.float64) - np.array(BACKGROUND, dtype=np.float64)) ** 2).sum(-1))
        count = background.reshape(len(chunk), -1).sum(1)
        total = (dist * background).reshape(len(chunk), -1).sum(1)
        out[i : i + len(chunk)] = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return torch.from_numpy(out.astype(np.float32))


def fill_nonuniformity_batch(images: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> [N] float32: for each object the verifier detects (`analyse`: a
    connected component of one palette label of at least the verifier's min_area, less its shapeless
    specks), the mean Euclidean RGB distance of its pixels from the object's mean colour, averaged
    over the image's objects O:

        nonuniformity = (1 / |O|) sum_{o in O} (1 / |o|) sum_{p in o} || x_p - mean_{q in o} x_q ||_2,

    in 0-255 units; 0 for flat fills; NaN for an image without objects (callers average with nanmean).
    Only the pixels the verifier gives the object's colour count: a pixel pushed beyond
    MAX_COLOR_DISTANCE leaves the object (and counts as background, in `background_impurity_batch`)."""
    arr = to_uint8(images)
    out = np.full(len(arr), np.nan)
    for i in range(0, len(arr), CHUNK):
        chunk = arr[i : i + CHUNK]
        spreads: list[list[float]] = [[] for _ in chunk]
        for image, _, (ys, xs), comp, _, _, _ in _chunk_objects(chunk):
            pixels = chunk[image, ys, xs][comp].astype(np.float64)  # [area, 3]
            spreads[image].append(float(np.sqrt(((pixels - pixels.mean(0)) ** 2).sum(-1)).mean()))
        for j, s in enumerate(spreads):
            if s:
                out[i + j] = float(np.mean(s))
    return torch.from_numpy(out.astype(np.float32))


def category_table(prompts: Sequence[str], strict: Sequence[float], partial: Sequence[float] | None = None) -> dict[str, dict[str, float]]:
    """Mean strict (and partial) per category, plus `overall`: the mean over the categories
    present, each weighted equally, as GenEval reports it."""
    rows: dict[str, dict[str, list[float]]] = {}
    for i, p in enumerate(prompts):
        cat = parse_prompt(p).category
        r = rows.setdefault(cat, {"strict": [], "partial": []})
        r["strict"].append(float(strict[i]))
        if partial is not None:
            r["partial"].append(float(partial[i]))
    table = {}
    for cat in [c for c in CATEGORIES if c in rows]:
        r = rows[cat]
        table[cat] = {"n": len(r["strict"]), "strict": float(np.mean(r["strict"]))}
        if partial is not None:
            table[cat]["partial"] = float(np.mean(r["partial"]))
    overall = {"n": sum(t["n"] for t in table.values()), "strict": float(np.mean([t["strict"] for t in table.values()]))}
    if partial is not None:
        overall["partial"] = float(np.mean([t["partial"] for t in table.values()]))
    table["overall"] = overall
    return table


def category_breakdown(prompts: Sequence[str], scores) -> dict[str, dict[str, float]]:
    """The shapes reward's breakdown: `category_table` of its strict and partial channels [N, 2]."""
    return category_table(prompts, scores[:, 0].tolist(), scores[:, 1].tolist())


def prompt_category(prompt: str) -> str:
    """A prompt's GenEval category, "other" outside the shapes grammar."""
    try:
        return parse_prompt(prompt).category
    except ValueError:
        return "other"


@register("shapes", "verifiable compositional reward of the shapes world: strict (all checks, GenEval-style) and partial (fraction of checks)",
          channels=("strict", "partial"), breakdown=category_breakdown, bucket=prompt_category)
def shapes(images, prompts, metadata=None):
    return score_batch(images, prompts)


@register("shapes_quality", "graded shapes-world match in [0, 1]: template overlap of each requested object and the relation, "
          "diluted by extra objects (a dense companion of shapes/strict for GRPO)")
def shapes_quality(images, prompts, metadata=None):
    return quality_batch(images, prompts)


@register("shapes_clean", "fraction of pixels within 40 RGB units of the shapes palette or background: an artefact judge that "
          "shapes and shapes_quality do not see (for the corrected score of `flowrl eval`)")
def shapes_clean(images, prompts, metadata=None):
    return cleanliness_batch(images)


# The registry has no direction flag: these two score artefacts, lower is cleaner. Train on them, if at all, with a
# negative weight; as reward.judge they would read backwards (the corrected score takes higher as better, and
# reward.judge_range must rise). `flowrl eval` prints both beside the base for shapes-world prompts anyway.
@register("shapes_background_impurity", "artefact measure, lower is cleaner (0: the renderer's pure white): the mean RGB "
          "distance (0-255) from the background colour of the pixels the shapes verifier labels background (a faint grid, "
          "tint or noise on the background, which shapes and shapes_clean do not see)")
def shapes_background_impurity(images, prompts, metadata=None):
    return torch.nan_to_num(background_impurity_batch(images), nan=0.0)  # no background pixel: nothing impure


@register("shapes_fill_nonuniformity", "artefact measure, lower is cleaner (0: the renderer's flat fills): the mean RGB "
          "distance (0-255) of a detected object's pixels from its mean colour, averaged over the image's objects (0 "
          "without objects); speckled or gridded fills, which shapes and shapes_clean do not see")
def shapes_fill_nonuniformity(images, prompts, metadata=None):
    return torch.nan_to_num(fill_nonuniformity_batch(images), nan=0.0)  # no object: no fill to be uneven
