"""The shapes editing world (rewards/shapes_edit_world.py) and its verifier reward `shapes_edit`
(rewards/shapes_edit.py): grammar and split, paired rendering, the verifier on perfect, unedited and
wrong edits, the dataset on disk through data.edits' reader, and the registered reward."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from flowrl.train.edit_data import read_edits
from rewards import MultiReward
from rewards.shapes import verify
from rewards.shapes_edit import edit_breakdown, edit_type_of, score_edits, verify_edit
from rewards.shapes_edit_world import (
    EDIT_TYPES, EditError, all_edits, draw, edit_layouts, edit_prompts, edit_set, edit_split, layout, parse_edit,
    render_edit, write_edit_set,
)
from rewards.shapes_world import COLORS, parse_prompt, render


def _tensors(images):
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255


def _edit(instruction, source_prompt):
    return next(e for e in all_edits() if e.instruction == instruction and e.source_prompt == source_prompt)


def test_grammar_five_types_parse_back_and_a_disjoint_split():
    edits = all_edits()
    assert {e.edit_type for e in edits} == set(EDIT_TYPES) and len({e.key for e in edits}) == len(edits)
    for e in edits[::37]:  # the instruction alone names the edit, and the target is the source changed so
        spec = parse_edit(e.instruction)
        assert spec.edit_type == e.edit_type and parse_edit(f"{e.instruction} [source: row 3: a.png]") == spec
        assert parse_prompt(e.target_prompt) == e.target and e.target != e.source
    train, held = edit_split("train"), edit_split("heldout")
    assert not {e.key for e in train} & {e.key for e in held} and len(train) + len(held) == len(edits)
    for t in EDIT_TYPES:
        assert 0.1 < len(edit_split("heldout", t)) / len(all_edits(t)) < 0.3
    rows = edit_set(3, "heldout", 32, seed=4)
    assert [r["edit_type"] for r in rows] == [t for t in EDIT_TYPES for _ in range(3)]
    assert {(r["source_prompt"], r["instruction"]) for r in rows} <= {(e.source_prompt, e.instruction) for e in held}
    again = edit_set(3, "heldout", 32, seed=4)
    assert all((a["source"] == b["source"]).all() and (a["reference"] == b["reference"]).all() for a, b in zip(rows, again))
    e = _edit("move the red circle to the left of the blue square", "a red circle above a blue square")
    assert (e.target.relation, e.target_prompt) == ("left of", "a red circle to the left of a blue square")
    assert parse_edit("Make it  THREE red circles").count == 3
    for bad in ("make the red circle red", "make it two red circle", "make it one red circles", "paint it black",
                "move the red circle above the red circle"):
        with pytest.raises(EditError, match=r"^instruction '.*' is not in the shapes edit grammar"):
            parse_edit(bad)


def test_layouts_are_the_renderers_and_targets_change_only_the_edit():
    for p in ("a red circle", "four blue triangles", "a green square below an orange circle"):
        assert (draw(layout(p, np.random.default_rng(5))) == render(p, np.random.default_rng(5))).all()
    e = _edit("make the blue square yellow", "a red circle and a blue square")
    source, target = edit_layouts(e, np.random.default_rng(0))
    assert [(p.color, p.box) for p in target] == [(p.color.replace("blue", "yellow"), p.box) for p in source]


def test_perfect_edits_pass_and_unedited_sources_fail_for_every_type():
    rows = [r for size in (32, 64) for r in edit_set(20, "heldout", size, seed=size)]
    for size in (32, 64):
        part = [r for r in rows if r["source"].shape[0] == size]
        prompts = [r["instruction"] for r in part]
        sources, references = _tensors([r["source"] for r in part]), _tensors([r["reference"] for r in part])
        perfect, unedited = score_edits(references, prompts, sources), score_edits(sources, prompts, sources)
        assert perfect.tolist() == [[1.0, 1.0]] * len(part)
        assert unedited[:, 0].tolist() == [0.0] * len(part) and (unedited[:, 1] < 1).all()
    # every target is a faithful render of its target scene for the shapes reward too
    assert all(verify(r["target_prompt"], r["reference"]).strict == 1 for r in rows)


def _verdict(instruction, source_prompt, change=None, seed=0):
    """verify_edit of the edit's source against its perfect target, altered by `change` (layout -> layout)."""
    source, target = edit_layouts(_edit(instruction, source_prompt), np.random.default_rng(seed))
    return verify_edit(instruction, draw(source), draw(change(target) if change else target))


def _recolour_other(name, colour):  # the perfect target, with another object recoloured too
    return lambda target: [replace(p, color=colour) if f"{p.color} {p.shape}" == name else p for p in target]


@pytest.mark.parametrize("instruction, source_prompt, other", [
    ("make the red circle blue", "a red circle to the left of a green square", "green square"),
    ("add a green square", "a red circle", "red circle"),
    ("remove the red circle", "a red circle and a blue triangle", "blue triangle"),
    ("move the red circle below the blue square", "a red circle to the left of a blue square", "blue square"),
    ("make it two red circles", "three red circles", None),
])
def test_an_edit_that_also_changes_another_object_fails_strict_but_earns_partial(instruction, source_prompt, other):
    assert _verdict(instruction, source_prompt).strict == 1
    if other is None:  # count: one of the circles left also moved down a little
        def change(target):
            y, x, s = target[0].box
            return [replace(target[0], box=(y + 1 + round(0.1 * 32), x, s))] + target[1:]
    else:
        change = _recolour_other(other, "purple")
    v = _verdict(instruction, source_prompt, change)
    failed = [k for k, ok in v.checks.items() if not ok]
    assert v.strict == 0 and 0.5 <= v.partial < 1 and failed and all(k.startswith("keep: ") for k in failed), v.checks


def test_wrong_edits_score_zero():
    wrong_colour = _verdict("make the red circle blue", "a red circle and a green square", _recolour_other("blue circle", "orange"))
    assert wrong_colour.strict == 0 and not wrong_colour.checks["change: the red circle is now blue"]
    assert 0 < wrong_colour.partial < 1
    # a perfect edit judged against another instruction of the same source: it did the wrong thing
    for done, asked, source_prompt in [
        ("move the red circle below the blue square", "move the red circle to the right of the blue square", "a red circle to the left of a blue square"),
        ("make it three red circles", "make it four red circles", "two red circles"),
        ("make it one red circle", "make it three red circles", "two red circles"),
        ("add a green square", "add a green circle", "a red circle"),
        ("remove the red circle", "remove the blue triangle", "a red circle and a blue triangle"),
    ]:
        source, target = render_edit(_edit(done, source_prompt), np.random.default_rng(1))
        assert verify_edit(done, source, target).strict == 1
        v = verify_edit(asked, source, target)
        assert v.strict == 0 and v.partial < 1, (asked, v.checks)
    # a move that lands right but leaves the object where it was is no move; one that shifts the other object neither
    moved = _verdict("move the red circle below the blue square", "a red circle to the left of a blue square",
                     lambda t: [replace(p, box=(p.box[0] + 4, *p.box[1:])) if p.color == "blue" else p for p in t])
    assert moved.strict == 0
    # where the source lacks what the instruction names (an analysis that misses a blurred object), doing
    # nothing must not pass: nothing to remove, or already the asked count
    blank, two = np.full((32, 32, 3), 255, np.uint8), render("two red circles", np.random.default_rng(0))
    assert verify_edit("remove the red circle", blank, blank).strict == 0
    assert verify_edit("make it two red circles", two, two).strict == 0


def test_dataset_on_disk_round_trips_through_the_edit_reader(tmp_path):
    path = write_edit_set(tmp_path / "edits", 2, "train", 32, seed=3)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [sorted(r) for r in lines[:1]] == [["edit_type", "instruction", "reference", "source", "source_prompt", "target_prompt"]]
    edits, rows = read_edits(str(path)), edit_set(2, "train", 32, seed=3)
    assert [e.instruction for e in edits] == [r["instruction"] for r in rows] and [r["edit_type"] for r in lines] == [r["edit_type"] for r in rows]
    for e, r in zip(edits, rows):
        assert (e.image() * 255).round().byte().permute(1, 2, 0).numpy().tolist() == r["source"].tolist()
        assert (e.reference_image() * 255).round().byte().permute(1, 2, 0).numpy().tolist() == r["reference"].tolist()
    scores = MultiReward({"shapes_edit": 1.0})(torch.stack([e.reference_image() for e in edits]), edits)
    assert scores[:, :2].tolist() == [[1.0, 1.0]] * len(edits)


def test_registered_reward_scores_edit_prompts_with_tensor_sources_and_breaks_down_by_type():
    rows = edit_set(2, "heldout", 64, seed=9)
    prompts = edit_prompts(rows)
    reward = MultiReward({"shapes_edit": 1.0})
    assert reward.channel_names[:2] == ["shapes_edit/strict", "shapes_edit/partial"]
    references = torch.stack([p.reference_image() for p in prompts])
    perfect = reward(references, prompts)
    unedited = reward(torch.stack([p.image() for p in prompts]), prompts)
    assert perfect[:, 0].tolist() == [1.0] * 10 and unedited[:, 0].tolist() == [0.0] * 10
    table = reward.breakdown(prompts, perfect)
    assert list(table) == [*EDIT_TYPES, "overall"] and table["overall"] == {"n": 10, "strict": 1.0, "partial": 1.0}
    assert reward.buckets(prompts) == [t for t in EDIT_TYPES for _ in range(2)] and edit_type_of("a red circle") == "other"
    assert edit_breakdown(prompts, unedited)["overall"]["strict"] == 0.0
    half = torch.nn.functional.interpolate(references, size=(32, 32), mode="bilinear", antialias=True)
    assert reward(half, prompts)[:, 0].mean() >= 0.9  # the sources, resized to the samples' 32 px, still compare
    with pytest.raises(EditError, match="not in the shapes edit grammar"):
        score_edits(references[:1], ["paint it black"], references[:1])
