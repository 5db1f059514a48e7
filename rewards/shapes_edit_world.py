"""The shapes editing world (issue 86 item 4): instructions that edit a rendered shapes-world scene.

Five edit types, each a (source scene, instruction, target scene) triple over the shapes world's
grammar (`rewards.shapes_world`), the target always a scene of that grammar too:

- recolour  "make the red circle blue"                     single / two objects / position scenes
- add       "add a green square"                           a single object -> two objects
- remove    "remove the blue triangle"                     two objects / position -> a single object
- move      "move the red circle to the left of the blue square"   position -> position (another relation)
- count     "make it three red circles" ("make it one red circle")  single / counting -> another count

The instruction alone names the edit (`parse_edit`), since a reward sees only the prompt and the two
images. Images come in pairs from one layout: the source is exactly `shapes_world.render` of the
source scene with the same generator, and the target redraws that layout with only the asked change
(untouched objects keep their pixels; added or moved objects go where they keep the renderer's gaps).
Pairs (source prompt, instruction) split into train and held-out by the shapes world's hash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from rewards.shapes_world import (
    _RELATION_WORDS, BACKGROUND, COLORS, COUNT_WORDS, HELDOUT_FRACTION, RELATIONS, SHAPES, ObjectSpec, PromptError,
    Scene, _held_out, _place, all_prompts, parse_prompt, prompt_of, shape_mask,
)

EDIT_TYPES = ("recolour", "add", "remove", "move", "count")
NUMBERS = {"one": 1, **COUNT_WORDS}
_WORD_OF = {v: k for k, v in NUMBERS.items()}
_WORDS_OF_RELATION = {v: k for k, v in _RELATION_WORDS.items()}  # "left of" -> "to the left of"
_INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
MOVE_PLACEMENT = 0.25  # a moved object's centre travels at least this fraction of the side (the verifier asks less)
__all__ = ["EDIT_TYPES", "HELDOUT_FRACTION", "Edit", "EditError", "EditSpec", "Placed", "all_edits", "draw", "edit_set",
           "edit_layouts", "edit_prompts", "edit_split", "layout", "parse_edit", "render_edit", "write_edit_set"]


class EditError(PromptError):
    """An instruction outside the edit grammar."""


@dataclass(frozen=True)
class EditSpec:
    """What an instruction asks, read from its text alone."""
    edit_type: str
    color: str  # the object the edit names (recolour, add, remove, move, count)
    shape: str
    new_color: str | None = None  # recolour
    count: int | None = None  # count: the number wanted
    relation: str | None = None  # move: where the object goes, relative to `other`
    other: tuple[str, str] | None = None  # move: (colour, shape) of the reference object


@dataclass(frozen=True)
class Edit:
    edit_type: str
    source: Scene
    target: Scene
    instruction: str

    @property
    def source_prompt(self) -> str:
        return prompt_of(self.source)

    @property
    def target_prompt(self) -> str:
        return prompt_of(self.target)

    @property
    def key(self) -> str:  # what the split hashes: one (source, instruction) pair
        return f"{self.source_prompt} -> {self.instruction}"


# ---- grammar ----------------------------------------------------------------------------

def _a(color: str) -> str:
    return "an" if color[0] in "aeiou" else "a"


def _obj(o: ObjectSpec | tuple[str, str]) -> str:
    color, shape = (o.color, o.shape) if isinstance(o, ObjectSpec) else o
    return f"{color} {shape}"


def _scene(objects: list[ObjectSpec], relation: str | None = None) -> Scene:
    if relation is not None:
        return Scene(tuple(objects), relation, "position")
    if len(objects) == 2:
        return Scene(tuple(objects), None, "two_objects")
    return Scene(tuple(objects), None, "single" if objects[0].count == 1 else "counting")


def _edits_of(source: Scene) -> list[Edit]:
    out: list[Edit] = []
    objs = list(source.objects)
    kinds = {(o.color, o.shape) for o in objs}
    if source.category != "counting":
        for i, o in enumerate(objs):  # recolour, to a kind the scene does not hold (kinds stay distinct)
            for c in COLORS:
                if c != o.color and (c, o.shape) not in kinds:
                    new = objs[:i] + [ObjectSpec(1, c, o.shape)] + objs[i + 1 :]
                    out.append(Edit("recolour", source, _scene(new, source.relation), f"make the {_obj(o)} {c}"))
    if source.category == "single":
        o = objs[0]
        for c in COLORS:
            for s in SHAPES:
                if (c, s) != (o.color, o.shape):
                    out.append(Edit("add", source, _scene([o, ObjectSpec(1, c, s)]), f"add {_a(c)} {c} {s}"))
    if len(objs) == 2:
        for i, o in enumerate(objs):
            out.append(Edit("remove", source, _scene([objs[1 - i]]), f"remove the {_obj(o)}"))
    if source.category == "position":
        for i, o in enumerate(objs):
            other = objs[1 - i]
            now = source.relation if i == 0 else _INVERSE[source.relation]
            for r in RELATIONS:
                if r != now:
                    out.append(Edit("move", source, _scene([o, other], r),
                                    f"move the {_obj(o)} {_WORDS_OF_RELATION[r]} the {_obj(other)}"))
    if source.category in ("single", "counting"):
        o = objs[0]
        for n in NUMBERS.values():
            if n != o.count:
                noun = f"{_obj(o)}{'s' if n > 1 else ''}"
                out.append(Edit("count", source, _scene([ObjectSpec(n, o.color, o.shape)]), f"make it {_WORD_OF[n]} {noun}"))
    return out


@lru_cache(maxsize=None)
def _all_edits() -> tuple[Edit, ...]:
    edits = [e for p in all_prompts() for e in _edits_of(parse_prompt(p))]
    return tuple(sorted(edits, key=lambda e: (EDIT_TYPES.index(e.edit_type), e.key)))


def all_edits(edit_type: str | None = None) -> list[Edit]:
    """Every edit of the grammar, in a fixed order (optionally one type)."""
    if edit_type is not None and edit_type not in EDIT_TYPES:
        raise ValueError(f"edit_type must be one of {', '.join(EDIT_TYPES)}; got '{edit_type}'")
    return [e for e in _all_edits() if edit_type is None or e.edit_type == edit_type]


def edit_split(split: str, edit_type: str | None = None) -> list[Edit]:
    """The fixed train / held-out split of (source prompt, instruction) pairs, hashed as shapes_world
    splits prompts (about HELDOUT_FRACTION held out)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout; got '{split}'")
    return [e for e in all_edits(edit_type) if _held_out(e.key) == (split == "heldout")]


_C, _S = "|".join(COLORS), "|".join(SHAPES)
_REL = "|".join(_RELATION_WORDS)
_FORMS = [
    ("recolour", re.compile(rf"^make the ({_C}) ({_S}) ({_C})$")),
    ("add", re.compile(rf"^add (?:a|an) ({_C}) ({_S})$")),
    ("remove", re.compile(rf"^remove the ({_C}) ({_S})$")),
    ("move", re.compile(rf"^move the ({_C}) ({_S}) ({_REL}) the ({_C}) ({_S})$")),
    ("count", re.compile(rf"^make it ({'|'.join(NUMBERS)}) ({_C}) ({_S})(s?)$")),
]
_SOURCE_SUFFIX = re.compile(r"\s*\[source: .*\]$", re.S)  # an EditPrompt's text: "{instruction} [source: {name}]"
_ACCEPTED = ("'make the red circle blue', 'add a red circle', 'remove the red circle', 'move the red circle to the left of|"
             "to the right of|above|below the blue square', 'make it one red circle|two|three|four red circles'")


def parse_edit(instruction) -> EditSpec:
    """An instruction (or an EditPrompt, its text or an Edit) -> what it asks; EditError outside the grammar."""
    if isinstance(instruction, Edit):
        instruction = instruction.instruction
    text = getattr(instruction, "instruction", None) or _SOURCE_SUFFIX.sub("", str(instruction))
    text = " ".join(text.lower().split())
    for kind, form in _FORMS:
        m = form.match(text)
        if not m:
            continue
        g = m.groups()
        if kind == "recolour" and g[0] != g[2]:
            return EditSpec(kind, g[0], g[1], new_color=g[2])
        if kind in ("add", "remove"):
            return EditSpec(kind, g[0], g[1])
        if kind == "move" and (g[0], g[1]) != (g[3], g[4]):
            return EditSpec(kind, g[0], g[1], relation=_RELATION_WORDS[g[2]], other=(g[3], g[4]))
        if kind == "count" and (NUMBERS[g[0]] > 1) == (g[3] == "s"):
            return EditSpec(kind, g[1], g[2], count=NUMBERS[g[0]])
        break
    raise EditError(f"instruction '{text}' is not in the shapes edit grammar; accepted forms: {_ACCEPTED}")


# ---- rendering ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Placed:
    color: str
    shape: str
    box: tuple[int, int, int]  # y, x, side


def layout(scene: Scene | str, rng: np.random.Generator, size: int = 32) -> list[Placed]:
    """Where `shapes_world.render(scene, rng, size)` puts each object: the same draws from the same
    generator, so that `draw(layout(...))` is that render pixel for pixel (a test holds them equal)."""
    scene = parse_prompt(scene) if isinstance(scene, str) else scene
    objects = [(o.color, o.shape) for o in scene.objects for _ in range(o.count)]
    sizes = [int(rng.integers(*_side_range(len(objects), size))) for _ in objects]
    floor = [min(3, s) for s in sizes]
    stuck = 0
    while (boxes := _place(sizes, scene.relation, rng, size)) is None:
        stuck += sizes == floor
        if stuck > 20:
            raise ValueError(f"layout: cannot fit the objects of '{prompt_of(scene)}' in a {size}x{size} image; use size >= 16")
        sizes = [max(f, s - 1) for f, s in zip(floor, sizes)]
    return [Placed(c, s, tuple(b)) for (c, s), b in zip(objects, boxes)]


def _side_range(n_objects: int, size: int) -> tuple[int, int]:  # the renderer's object sides, [lo, hi + 1)
    return size * 7 // 32, (size * 12 // 32 if n_objects <= 2 else size * 9 // 32) + 1


def draw(placed: list[Placed], size: int = 32) -> np.ndarray:
    """The objects on the background, as the renderer paints them: uint8 [size, size, 3]."""
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for p in placed:
        y, x, s = p.box
        image[y : y + s, x : x + s][shape_mask(p.shape, s)] = COLORS[p.color]
    return image


def _centroid(shape: str, side: int) -> tuple[float, float]:
    """The mean pixel centre (y, x) of a shape drawn in a side x side box, from the box's corner."""
    ys, xs = np.nonzero(shape_mask(shape, side))
    return float(ys.mean() + 0.5), float(xs.mean() + 0.5)


def _free_box(others: list[Placed], side: int, size: int, rng: np.random.Generator, accept=None):
    """A box of `side`, uniformly among those at least the renderer's 2 px from every other box (and
    passing `accept`, vectorised over the boxes' (y, x) corners), or None where there is none: every position is
    tried, so a rare admissible spot is still found."""
    gap = 2
    y, x = (a.ravel() for a in np.meshgrid(np.arange(size - side + 1), np.arange(size - side + 1), indexing="ij"))
    ok = np.ones(len(y), dtype=bool)
    for by, bx, bs in (o.box for o in others):
        ok &= (y + side + gap <= by) | (by + bs + gap <= y) | (x + side + gap <= bx) | (bx + bs + gap <= x)
    if accept is not None:
        ok &= accept(y, x)
    choices = np.flatnonzero(ok)
    if len(choices) == 0:
        return None
    i = int(choices[rng.integers(len(choices))])
    return (int(y[i]), int(x[i]), side)


def _add(placed: list[Placed], new: list[tuple[str, str]], total: int, size: int, rng: np.random.Generator):
    """`placed` plus the `new` objects in free space (sides as the renderer draws for `total` objects,
    shrinking to its smallest before giving up), or None."""
    lo, hi = _side_range(total, size)
    out = list(placed)
    for color, shape in new:
        side = int(rng.integers(lo, hi))
        while (box := _free_box(out, side, size, rng)) is None:
            if side <= lo:
                return None
            side -= 1
        out.append(Placed(color, shape, box))
    return out


def _apply(edit: Edit, placed: list[Placed], rng: np.random.Generator, size: int) -> list[Placed] | None:
    """The target layout: the source layout with only the edit's change, or None where it cannot be drawn."""
    spec = parse_edit(edit.instruction)
    kind = (spec.color, spec.shape)
    named = [i for i, p in enumerate(placed) if (p.color, p.shape) == kind]
    if spec.edit_type == "recolour":
        return [Placed(spec.new_color, p.shape, p.box) if i in named else p for i, p in enumerate(placed)]
    if spec.edit_type == "remove":
        return [p for i, p in enumerate(placed) if i not in named]
    if spec.edit_type == "add":
        return _add(placed, [kind], len(placed) + 1, size, rng)
    if spec.edit_type == "count":
        if spec.count > len(named):
            return _add(placed, [kind] * (spec.count - len(named)), spec.count, size, rng)
        drop = set(rng.choice(named, size=len(named) - spec.count, replace=False).tolist())
        return [p for i, p in enumerate(placed) if i not in drop]
    # move: the other object stays; the named one (same side) goes to a free spot where the relation holds
    # with the renderer's margin, far enough from where it was that the verifier's smaller threshold is clear
    (i,) = named
    rest = [p for j, p in enumerate(placed) if j != i]
    anchor = next(p for p in rest if (p.color, p.shape) == spec.other)
    old = np.add(placed[i].box[:2], _centroid(spec.shape, placed[i].box[2]))
    # centres as the verifier reads them, the mean of the shape's pixels (a triangle's lies below its box's
    # centre); the relation's offset must beat the offset across it by 1 px (at 32) so that it reads one way
    side = placed[i].box[2]
    oy, ox = _centroid(spec.shape, side)
    ay, ax = np.add(anchor.box[:2], _centroid(anchor.shape, anchor.box[2]))

    def accept(y, x):  # over arrays of box corners
        cy, cx = y + oy, x + ox
        dy, dx = ay - cy, ax - cx
        along = {"left of": dx, "right of": -dx, "above": dy, "below": -dy}[spec.relation]
        across = np.abs(dy) if spec.relation in ("left of", "right of") else np.abs(dx)
        far = np.hypot(cy - old[0], cx - old[1]) >= MOVE_PLACEMENT * size
        return far & (along >= size / 8) & (along >= across + size / 32)

    box = _free_box(rest, placed[i].box[2], size, rng, accept)
    return None if box is None else placed[:i] + [Placed(placed[i].color, placed[i].shape, box)] + placed[i + 1 :]


def edit_layouts(edit: Edit, rng: np.random.Generator, size: int = 32) -> tuple[list[Placed], list[Placed]]:
    """(source, target) layouts: the source is `shapes_world.render(edit.source, rng, size)`'s (for the
    generator's state on entry, when that layout admits the edit; otherwise a later one's)."""
    for _ in range(1000):  # a move to the opposite side needs room beside the other object: ~4% of layouts at 32
        placed = layout(edit.source, rng, size)
        target = _apply(edit, placed, rng, size)
        if target is not None:
            return placed, target
    raise ValueError(f"edit_layouts: cannot draw '{edit.instruction}' on '{edit.source_prompt}' at {size}x{size}; use size >= 32")


def render_edit(edit: Edit, rng: np.random.Generator, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) uint8 [size, size, 3], drawn from `edit_layouts`."""
    source, target = edit_layouts(edit, rng, size)
    return draw(source, size), draw(target, size)


def edit_prompts(rows: list[dict], name: str = "shapes edit"):
    """`edit_set` rows as EditPrompts (flowrl.models.edit_prompt) whose sources and references are
    tensors [3, H, W] in [0, 1], each named `name` and its row (a prompt's text is its instruction and
    name: two sets that share a name would share the prompts' cached encodings)."""
    import torch

    from flowrl.models.edit_prompt import EditPrompt  # here: the rewards package imports no model code

    def tensor(image):
        return torch.from_numpy(image).permute(2, 0, 1).float() / 255

    return [EditPrompt(r["instruction"], tensor(r["source"]), name=f"{name} {i}", reference=tensor(r["reference"]))
            for i, r in enumerate(rows)]


# ---- datasets -----------------------------------------------------------------------------

def edit_set(n_per_type: int, split: str = "heldout", size: int = 32, seed: int = 0) -> list[dict]:
    """n_per_type edits of each type from the split (distinct while the split has that many), each a row
    {"instruction", "edit_type", "source_prompt", "target_prompt", "source", "reference"} with the two
    images as uint8 [size, size, 3]; deterministic in `seed`."""
    if n_per_type < 1:
        raise ValueError(f"edit_set: n_per_type must be at least 1; got {n_per_type}")
    rng = np.random.default_rng(seed)
    rows = []
    for kind in EDIT_TYPES:
        pool = edit_split(split, kind)
        order = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-n_per_type // len(pool)))])[:n_per_type]
        for i in order:
            edit = pool[int(i)]
            source, target = render_edit(edit, rng, size)
            rows.append({"instruction": edit.instruction, "edit_type": kind, "source_prompt": edit.source_prompt,
                         "target_prompt": edit.target_prompt, "source": source, "reference": target})
    return rows


def write_edit_set(folder, n_per_type: int, split: str = "heldout", size: int = 32, seed: int = 0,
                   reference: bool = True) -> Path:
    """`edit_set` on disk as `data.edits` reads it (flowrl.train.edit_data.read_edits): PNGs under
    folder/sources (and folder/references) and folder/edits.jsonl with rows {"instruction", "source",
    "reference", "edit_type", "source_prompt", "target_prompt"} (paths relative to the folder; the
    reader ignores the extra columns). Returns the JSONL's path."""
    from PIL import Image

    folder = Path(folder)
    (folder / "sources").mkdir(parents=True, exist_ok=True)
    if reference:
        (folder / "references").mkdir(exist_ok=True)
    lines = []
    for i, row in enumerate(edit_set(n_per_type, split, size, seed)):
        name = f"{i:05d}_{row['edit_type']}.png"
        Image.fromarray(row["source"]).save(folder / "sources" / name)
        out = {"instruction": row["instruction"], "source": f"sources/{name}"}
        if reference:
            Image.fromarray(row["reference"]).save(folder / "references" / name)
            out["reference"] = f"references/{name}"
        out.update({k: row[k] for k in ("edit_type", "source_prompt", "target_prompt")})
        lines.append(json.dumps(out))
    path = folder / "edits.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
