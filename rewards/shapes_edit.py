"""The verifiable reward of the shapes editing world (`rewards.shapes_edit_world`): did the edit do what
the instruction asks, and nothing else?

Both images are analysed as the shapes reward analyses one (`rewards.shapes.analyse_batch`: palette
colours, connected components, template shapes). The instruction is parsed (`parse_edit`); the source's
objects that the edit leaves alone must each reappear in the edited image with the same colour and
shape, the centre within POSITION_TOLERANCE of the side and the area within a factor AREA_TOLERANCE
(one "keep" check each, matched greedily by distance). The edited image's other objects must be the
change, per type (the "change" checks):

- recolour: an object of the new colour and the same shape where the named one was (centre and area
  as above);
- add: an object of the named colour and shape besides the kept ones (anywhere);
- remove: no object of the named colour and shape (and the source had one);
- move: the named object's centre moved by at least MIN_MOVE of the side, and the relation holds
  between it and the reference object (the relation's offset at least the shapes reward's margin and
  larger than the offset across it, so "above" is not also "left of");
- count: exactly the asked number of the named kind (and the source had some, another number); raising
  it keeps the old ones in place (keep checks), lowering it leaves only objects where old ones were (a
  keep check).

Finally one keep check: no object left over. `strict` is 1 when every check passes, `partial` half
the fraction of change checks plus half the fraction of keep checks.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from rewards.registry import register
from rewards.shapes import Detected, Verdict, _as_uint8_hwc, _relation_margin, analyse_batch
from rewards.shapes_edit_world import EDIT_TYPES, EditError, EditSpec, parse_edit
from rewards.simple import to_uint8

POSITION_TOLERANCE = 0.1  # of the side: 3.2 px at 32x32 (objects are >= 7 px and >= 2 px apart)
AREA_TOLERANCE = 1.6  # a kept object's area within this factor of its source's
MIN_MOVE = 0.15  # of the side: a move must carry the centre this far (the edit world moves it >= 0.25)


def _distance(a: Detected, b: Detected | tuple[float, float]) -> float:
    b = b.centre if isinstance(b, Detected) else b
    return float(np.hypot(a.centre[0] - b[0], a.centre[1] - b[1]))


def _same_place(a: Detected, b: Detected, tol: float) -> bool:
    return _distance(a, b) <= tol and 1 / AREA_TOLERANCE <= a.area / max(b.area, 1) <= AREA_TOLERANCE


def _kind(o: Detected) -> tuple[str, str | None]:
    return o.color, o.shape


def _match(old: list[Detected], new: list[Detected], tol: float) -> dict[int, int]:
    """old index -> new index: same colour and shape in the same place, greedily nearest first."""
    pairs = sorted((_distance(a, b), i, j) for i, a in enumerate(old) for j, b in enumerate(new)
                   if _kind(a) == _kind(b) and _same_place(a, b, tol))
    out: dict[int, int] = {}
    for _, i, j in pairs:
        if i not in out and j not in out.values():
            out[i] = j
    return out


def _relation(relation: str, a: tuple[float, float], b: tuple[float, float], margin: float) -> bool:
    dy, dx = b[0] - a[0], b[1] - a[1]
    along = {"left of": dx, "right of": -dx, "above": dy, "below": -dy}[relation]
    across = abs(dy) if relation in ("left of", "right of") else abs(dx)
    return along >= margin and along > across


def judge_edit(spec: EditSpec, source: list[Detected], edited: list[Detected], size: int) -> Verdict:
    """The checks of one edit on the analysed source and edited images (see the module docstring)."""
    tol = POSITION_TOLERANCE * size
    kind = (spec.color, spec.shape)
    named = [o for o in source if _kind(o) == kind]
    target = max(named, key=lambda o: o.area) if named else None  # the object a recolour or move acts on
    t, count_up = spec.edit_type, spec.edit_type == "count" and spec.count >= len(named)
    if t == "add" or count_up:
        kept = list(source)
    elif t in ("recolour", "move"):
        kept = [o for o in source if o is not target]
    else:  # remove, count down: the named kind is judged by the change
        kept = [o for o in source if _kind(o) != kind]
    matched = _match(kept, edited, tol)
    keep = {f"{_kind(o)[0]} {_kind(o)[1]} at ({o.centre[0]:.0f}, {o.centre[1]:.0f}) unchanged": i in matched
            for i, o in enumerate(kept)}
    free = [o for j, o in enumerate(edited) if j not in matched.values()]
    change: dict[str, bool] = {}
    used: list[Detected] = []  # free objects that the change accounts for
    if t == "recolour":
        there = [o for o in free if _kind(o) == (spec.new_color, spec.shape) and target is not None and _same_place(o, target, tol)]
        change[f"the {spec.color} {spec.shape} is now {spec.new_color}"] = bool(there)
        used += sorted(there, key=lambda o: _distance(o, target))[:1]
    elif t == "add":
        added = sorted((o for o in free if _kind(o) == kind), key=lambda o: -o.area)
        change[f"a {spec.color} {spec.shape} added"] = bool(added)
        used += added[:1]
    elif t == "remove":
        # and it was there: a source whose object the analysis misses (a blurred small triangle) must not let
        # the unedited image pass
        change[f"the {spec.color} {spec.shape} removed"] = bool(named) and not any(_kind(o) == kind for o in free)
    elif t == "move":
        moved = max((o for o in free if _kind(o) == kind), key=lambda o: o.area, default=None)
        others = [(o, matched.get(i)) for i, o in enumerate(kept) if _kind(o) == spec.other]
        anchor = (edited[others[0][1]] if others[0][1] is not None else others[0][0]) if others else None
        change[f"the {spec.color} {spec.shape} moved"] = moved is not None and target is not None and \
            _distance(moved, target) >= MIN_MOVE * size
        change[f"the {spec.color} {spec.shape} {spec.relation} the {spec.other[0]} {spec.other[1]}"] = \
            moved is not None and anchor is not None and _relation(spec.relation, moved.centre, anchor.centre, _relation_margin(size))
        used += [moved] if moved is not None else []
    else:  # count
        mine = [o for o in free if _kind(o) == kind]
        wanted = spec.count - len(named) if count_up else spec.count
        change[f"{spec.count} {spec.color} {spec.shape}{'s' if spec.count > 1 else ''}"] = len(named) not in (0, spec.count) and len(mine) == wanted
        used += mine
        if not count_up:  # the ones left are old ones, in place
            keep[f"the remaining {spec.color} {spec.shape}s in place"] = len(_match(named, mine, tol)) == len(mine)
    keep["no other object"] = all(any(o is u for u in used) for o in free)
    checks = {f"change: {k}": v for k, v in change.items()} | {f"keep: {k}": v for k, v in keep.items()}
    strict = float(all(checks.values()))
    partial = 0.5 * sum(change.values()) / len(change) + 0.5 * sum(keep.values()) / len(keep)
    return Verdict(strict, partial, t, checks)


def verify_edit(instruction, source_image, edited_image) -> Verdict:
    """One edit's checks: `instruction` an instruction, EditPrompt or Edit; the images uint8 [H, W, 3]
    or floats in [0, 1] as [3, H, W] or [H, W, 3] (numpy or torch), the same size."""
    spec = parse_edit(instruction)
    a, b = _as_uint8_hwc(source_image), _as_uint8_hwc(edited_image)
    if a.shape != b.shape:
        raise ValueError(f"shapes_edit: the source is {a.shape[:2]} but the edited image {b.shape[:2]}; give the same size")
    source, edited = analyse_batch(np.stack([a, b]))
    return judge_edit(spec, source, edited, b.shape[0])


def score_edits(images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] samples and their sources in [0, 1] -> [N, 2] float32: (strict, partial)."""
    if not (len(prompts) == images.shape[0] == sources.shape[0]):
        raise ValueError(f"shapes_edit reward: {images.shape[0]} images, {sources.shape[0]} sources and {len(prompts)} prompts")
    specs = [parse_edit(p) for p in prompts]  # a bad instruction fails before any analysis
    n = len(specs)
    objects = analyse_batch(np.concatenate([to_uint8(sources), to_uint8(images)]))
    verdicts = [judge_edit(s, objects[i], objects[n + i], images.shape[-2]) for i, s in enumerate(specs)]
    return torch.tensor([(v.strict, v.partial) for v in verdicts], dtype=torch.float32).reshape(n, 2)


def edit_type_of(prompt: str) -> str:
    """A prompt's edit type, "other" outside the edit grammar."""
    try:
        return parse_edit(prompt).edit_type
    except EditError:
        return "other"


def edit_breakdown(prompts: Sequence[str], scores) -> dict[str, dict[str, float]]:
    """Mean strict and partial per edit type, plus `overall`: the mean over the types present, each
    weighted equally (as the shapes reward weights GenEval's categories)."""
    kinds = [edit_type_of(p) for p in prompts]
    table = {}
    for t in [t for t in (*EDIT_TYPES, "other") if t in kinds]:
        rows = [i for i, k in enumerate(kinds) if k == t]
        table[t] = {"n": len(rows), "strict": float(scores[rows, 0].mean()), "partial": float(scores[rows, 1].mean())}
    table["overall"] = {"n": len(kinds), **{c: float(np.mean([r[c] for r in table.values()])) for c in ("strict", "partial")}}
    return table


# factory=True: the plain function would be wrapped for `sources` twice (by `register`, then again when a
# MultiReward builds it, the second wrapper passing sources= to the first); a factory's result is wrapped once
@register("shapes_edit", "verifiable reward of the shapes editing world: the instruction's change is present (recolour, add, "
          "remove, move, count) and every other object of the source kept; strict (all checks) and partial (half change, half "
          "kept); compares each sample with its source image",
          channels=("strict", "partial"), factory=True, breakdown=edit_breakdown, bucket=edit_type_of)
def shapes_edit():
    return _shapes_edit


def _shapes_edit(images, prompts, sources):
    return score_edits(images, prompts, sources)
