"""The verifiable reward of the shapes world (GenEval-style, on `rewards.shapes_world` prompts).

An image is analysed, not judged by a model: every pixel goes to its nearest palette colour
(or to the background when it is far from all of them), each colour's connected components
are objects, and an object's shape is the ideal template (circle, square, triangle, drawn in
the component's square bounding box by the renderer's own `shape_mask`) that overlaps it best,
or none when no template overlaps well (a blob is no shape).

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
from typing import Sequence

import numpy as np
import torch
from scipy import ndimage

from rewards.registry import register
from rewards.shapes_world import BACKGROUND, CATEGORIES, COLORS, SHAPES, parse_prompt, shape_mask

_NAMES = list(COLORS)
_PALETTE = np.array([BACKGROUND, *COLORS.values()], dtype=np.float32)  # index 0: background
MAX_COLOR_DISTANCE = 90.0  # farther from every palette colour: background (blur, noise)
MIN_SHAPE_IOU = 0.6
# 8-connectivity: a triangle's apex or a blurred edge may touch its body only diagonally
_EIGHT = np.ones((3, 3), dtype=bool)


@dataclass
class Detected:
    color: str
    shape: str | None
    box: tuple[int, int, int, int]  # y0, x0, y1, x1 (end exclusive)
    centre: tuple[float, float]  # y, x
    area: int


@dataclass
class Verdict:
    strict: float
    partial: float
    category: str
    checks: dict[str, bool] = field(default_factory=dict)


def _as_uint8_hwc(image) -> np.ndarray:
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    image = np.asarray(image)
    if image.dtype != np.uint8:  # float [3, H, W] in [0, 1]
        image = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
        if image.shape[0] == 3 and image.shape[-1] != 3:
            image = image.transpose(1, 2, 0)
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"shapes reward: expected an RGB image [H, W, 3] or [3, H, W]; got shape {tuple(image.shape)}")
    return image


def _best_shape(component: np.ndarray) -> str | None:
    """The template with the best IoU in the component's square bounding box (the component
    centred in it), or None below MIN_SHAPE_IOU."""
    h, w = component.shape  # already cropped to its bounding box
    side = max(h, w)
    box = np.zeros((side, side), dtype=bool)
    oy, ox = (side - h) // 2, (side - w) // 2
    box[oy : oy + h, ox : ox + w] = component
    best, best_iou = None, MIN_SHAPE_IOU
    for shape in SHAPES:
        template = shape_mask(shape, side)
        iou = (box & template).sum() / (box | template).sum()
        if iou >= best_iou:
            best, best_iou = shape, iou
    return best


def analyse(image) -> list[Detected]:
    img = _as_uint8_hwc(image).astype(np.float32)
    h, w, _ = img.shape
    dist = np.linalg.norm(img[:, :, None, :] - _PALETTE[None, None], axis=-1)  # [H, W, 1 + C]
    label = dist.argmin(-1)
    label[dist.min(-1) > MAX_COLOR_DISTANCE] = 0
    min_area = max(4, round(4 * h * w / 1024))  # 4 px at 32x32
    found = []
    for ci, name in enumerate(_NAMES, start=1):
        mask = label == ci
        if not mask.any():
            continue
        components, n = ndimage.label(mask, structure=_EIGHT)
        for k, sl in enumerate(ndimage.find_objects(components), start=1):
            comp = components[sl] == k
            area = int(comp.sum())
            if area < min_area:
                continue
            ys, xs = np.nonzero(comp)
            found.append(Detected(
                name, _best_shape(comp), (sl[0].start, sl[1].start, sl[0].stop, sl[1].stop),
                (float(ys.mean() + sl[0].start + 0.5), float(xs.mean() + sl[1].start + 0.5)), area,
            ))
    return found


def _relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float], margin: float) -> bool:
    dy, dx = b[0] - a[0], b[1] - a[1]
    along = {"left of": dx, "right of": -dx, "above": dy, "below": -dy}[relation]
    return along >= margin


def verify(prompt: str, image) -> Verdict:
    scene = parse_prompt(prompt)
    img = _as_uint8_hwc(image)
    objects = analyse(img)
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
        margin = 1.5 * img.shape[0] / 32
        checks[f"{scene.relation}"] = bool(first and second) and _relation_holds(
            scene.relation, max(first, key=lambda o: o.area).centre, max(second, key=lambda o: o.area).centre, margin
        )
    passed = sum(checks.values())
    return Verdict(float(passed == len(checks)), passed / len(checks), scene.category, checks)


def score_batch(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> [N, 2] float32: (strict, partial)."""
    if len(prompts) != images.shape[0]:
        raise ValueError(f"shapes reward: {images.shape[0]} images but {len(prompts)} prompts")
    arr = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    out = [(v.strict, v.partial) for v in (verify(p, a) for p, a in zip(prompts, arr))]
    return torch.tensor(out, dtype=torch.float32).reshape(len(prompts), 2)


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


@register("shapes", "verifiable compositional reward of the shapes world: strict (all checks, GenEval-style) and partial (fraction of checks)",
          channels=("strict", "partial"))
def shapes(images, prompts, metadata=None):
    return score_batch(images, prompts)
