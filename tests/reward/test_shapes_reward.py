"""The shapes world and its verifiable reward: grammar, splits, renderer, and the verifier on
rendered images, hand-made failures and noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rewards import MultiReward, available_rewards
from rewards.shapes import analyse, analyse_batch, category_table, quality_batch, score_batch, verify
from rewards.shapes_world import (
    BACKGROUND, CATEGORIES, COLORS, ObjectSpec, PromptError, Scene, all_prompts, category_of, eval_set,
    parse_prompt, prompt_split, render, sample_prompts, shape_mask,
)


def _batch(prompts, seed=0, size=32):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.stack([render(p, rng, size) for p in prompts])).permute(0, 3, 1, 2).float() / 255


@pytest.mark.parametrize("prompt, category, objects, relation", [
    ("a red circle", "single", [(1, "red", "circle")], None),
    ("An Orange  square ", "single", [(1, "orange", "square")], None),
    ("three blue triangles", "counting", [(3, "blue", "triangle")], None),
    ("a red circle and an orange square", "two_objects", [(1, "red", "circle"), (1, "orange", "square")], None),
    ("a green square to the left of a red circle", "position", [(1, "green", "square"), (1, "red", "circle")], "left of"),
    ("a green square to the right of a red circle", "position", [(1, "green", "square"), (1, "red", "circle")], "right of"),
    ("a yellow triangle above a purple square", "position", [(1, "yellow", "triangle"), (1, "purple", "square")], "above"),
    ("a yellow triangle below a purple square", "position", [(1, "yellow", "triangle"), (1, "purple", "square")], "below"),
])
def test_parse_every_form(prompt, category, objects, relation):
    scene = parse_prompt(prompt)
    assert scene.category == category and scene.relation == relation
    assert [(o.count, o.color, o.shape) for o in scene.objects] == objects


@pytest.mark.parametrize("bad", ["a red", "five red circles", "a pink circle", "a red circle near a blue square",
                                 "a red circle and a red circle", ""])
def test_unparseable_prompts_get_one_sentence(bad):
    with pytest.raises(PromptError) as info:
        parse_prompt(bad)
    assert f"'{bad}'" in str(info.value) and "\n" not in str(info.value)


def test_grammar_and_fixed_splits():
    palette = [np.array(c) for c in (BACKGROUND, *COLORS.values())]
    assert min(np.linalg.norm(a - b) for i, a in enumerate(palette) for b in palette[i + 1 :]) >= 100
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) and len(COLORS) >= 6
    assert {category_of(p) for p in prompts} == set(CATEGORIES)
    train, held = prompt_split("train"), prompt_split("heldout")
    assert not set(train) & set(held) and sorted(train + held) == prompts
    for c in CATEGORIES:
        assert len(prompt_split("heldout", c)) >= 3 and prompt_split("heldout", c) == prompt_split("heldout", c)
    ev = eval_set(10)
    assert len(ev) == 40 and set(ev) <= set(held) and all(category_of(p) == c for p, c in zip(ev, np.repeat(CATEGORIES, 10)))
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    assert sample_prompts(50, rng_a) == sample_prompts(50, rng_b)


def test_renderer_places_every_object_and_the_verifier_agrees():
    four = [p for p in all_prompts("counting") if p.startswith("four")]
    prompts = four + sample_prompts(500 - len(four), np.random.default_rng(1))
    images = _batch(prompts, seed=1)
    scores = score_batch(images, prompts)
    assert scores.shape == (500, 2) and scores.dtype == torch.float32
    assert scores[:, 0].mean() >= 0.98
    found = analyse_batch((images.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy())
    for p, objects in zip(prompts, found):  # every object placed and found, "four ..." included
        assert len(objects) == sum(o.count for o in parse_prompt(p).objects), p
    big = sample_prompts(60, np.random.default_rng(2))
    assert score_batch(_batch(big, seed=2, size=64), big)[:, 0].mean() >= 0.98


def test_noise_scores_near_zero():
    prompts = sample_prompts(300, np.random.default_rng(4))
    scores = score_batch(torch.rand(300, 3, 32, 32, generator=torch.Generator().manual_seed(0)), prompts)
    assert scores[:, 0].mean() < 0.02 and torch.isfinite(scores).all()


def _render_scene(objects, seed=0):
    """Place chosen objects at chosen boxes: (colour, shape, y, x, size)."""
    img = np.empty((32, 32, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    for color, shape, y, x, s in objects:
        img[y : y + s, x : x + s][shape_mask(shape, s)] = COLORS[color]
    return img


def test_hand_made_failures():
    three = _render_scene([("red", "circle", 2, 2, 8), ("red", "circle", 2, 20, 8), ("red", "circle", 20, 10, 8)])
    assert verify("three red circles", three).strict == 1
    v = verify("two red circles", three)  # wrong count
    assert v.strict == 0 and 0 < v.partial < 1 and not v.checks["red circle: count 2"]
    assert verify("three blue circles", three).strict == 0  # wrong colour
    assert verify("three red squares", three).partial < 0.5  # wrong shape: colour present, nothing else
    above = _render_scene([("red", "circle", 2, 12, 9), ("blue", "square", 20, 12, 9)])
    assert verify("a red circle above a blue square", above).strict == 1
    swapped = verify("a red circle below a blue square", above)
    assert swapped.strict == 0 and swapped.partial == pytest.approx(7 / 8)  # only the relation fails
    assert [k for k, ok in swapped.checks.items() if not ok] == ["below"]
    extra = _render_scene([("red", "circle", 2, 2, 8), ("green", "triangle", 20, 20, 9)])
    v = verify("a red circle", extra)
    assert v.strict == 0 and v.checks == {"red circle: colour present": True, "red circle: present": True,
                                          "red circle: count 1": True, "no extra objects": False}
    shapes = _render_scene([("purple", "square", 2, 2, 9), ("orange", "triangle", 2, 18, 9), ("green", "circle", 18, 8, 9)])
    assert sorted((o.color, o.shape) for o in analyse(shapes)) == [("green", "circle"), ("orange", "triangle"), ("purple", "square")]


def _quality(prompt, image):
    return quality_batch(torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255, [prompt]).item()


def test_quality_is_one_on_renders_and_grades_failures():
    prompts = sample_prompts(200, np.random.default_rng(7))
    assert quality_batch(_batch(prompts, seed=7), prompts).min() == 1.0  # every render: a perfect match
    noise = torch.rand(200, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert quality_batch(noise, prompts).mean() < 0.05
    three = _render_scene([("red", "circle", 2, 2, 8), ("red", "circle", 2, 20, 8), ("red", "circle", 20, 10, 8)])
    assert _quality("two red circles", three) == pytest.approx(2 / 3)  # two paired (IoU 1), one extra
    assert _quality("four red circles", three) == pytest.approx(3 / 4)  # one missing
    assert _quality("three blue circles", three) == 0.0  # no object of the colour
    square_iou = _quality("three red squares", three)  # right count, wrong shape: the circles' overlap with a square
    assert 0.6 < square_iou < 0.9 and square_iou == pytest.approx(shape_mask("circle", 8).mean())
    above = _render_scene([("red", "circle", 2, 12, 9), ("blue", "square", 20, 12, 9)])
    assert _quality("a red circle above a blue square", above) == 1.0
    assert _quality("a red circle below a blue square", above) == pytest.approx(2 / 3)  # the relation fails
    # graded where strict is flat: a square with a bite taken out scores between a square and nothing
    square = _render_scene([("green", "square", 8, 8, 12)])
    bitten = square.copy()
    bitten[8:12, 8:12] = BACKGROUND
    assert verify("a green square", bitten).strict == 1 and 0.85 < _quality("a green square", bitten) < 1.0
    ragged = square.copy()  # a hollow square: no template fits, strict and partial see a blob
    ragged[10:18, 10:18] = BACKGROUND
    assert verify("a green square", ragged).strict == 0 and 0 < _quality("a green square", ragged) < _quality("a green square", bitten)


def test_score_batch_deterministic_and_category_table():
    prompts = sample_prompts(40, np.random.default_rng(5))
    images = _batch(prompts, seed=5)
    assert torch.equal(score_batch(images, prompts), score_batch(images, prompts))
    table = category_table(["a red circle", "a blue square", "two red circles"], [1.0, 0.0, 1.0], [1.0, 0.5, 1.0])
    assert table["single"] == {"n": 2, "strict": 0.5, "partial": 0.75}
    assert table["counting"] == {"n": 1, "strict": 1.0, "partial": 1.0}
    assert table["overall"]["strict"] == pytest.approx(0.75) and table["overall"]["n"] == 3  # mean over categories


def test_registered_reward_channels():
    assert "shapes" in available_rewards()
    prompts = ["a red circle", "two blue squares", "a red circle above a blue square"]
    reward = MultiReward({"shapes": 1.0}, channel_weights={"shapes/partial": 0.5})
    scores = reward(_batch(prompts), prompts)
    assert reward.channel_names == ["shapes/strict", "shapes/partial"] and scores.shape == (3, 2)
    assert torch.equal(reward.channel_weights, torch.tensor([1.0, 0.5]))
    from flowrl.errors import UserError

    both = MultiReward({"shapes": 1.0, "shapes_quality": 0.5})
    assert both.channel_names == ["shapes/strict", "shapes/partial", "shapes_quality"] and both(_batch(prompts), prompts).shape == (3, 3)
    with pytest.raises(UserError, match="channel_weights names shapes/nope"):
        MultiReward({"shapes": 1.0}, channel_weights={"shapes/nope": 1.0})


def test_analyse_accepts_every_layout_and_ignores_specks():
    img = _render_scene([("red", "circle", 2, 2, 9), ("blue", "triangle", 18, 18, 10)])
    want = [(d.color, d.shape, d.box, d.area) for d in analyse(img)]
    assert want == [("red", "circle", (2, 2, 11, 11), 69), ("blue", "triangle", (18, 18, 28, 28), 60)]
    chw = img.transpose(2, 0, 1).astype(np.float32) / 255
    for layout in (chw, torch.from_numpy(chw), torch.from_numpy(img.transpose(2, 0, 1).copy())):
        assert [(d.color, d.shape, d.box, d.area) for d in analyse(layout)] == want
    speck = img.copy()
    speck[np.arange(26, 31), np.arange(2, 7)] = COLORS["yellow"]  # 5 px diagonal, no shape: a halo, not an object
    speck[2:5, 28:29] = COLORS["green"]  # 3 px: below the minimum area
    assert verify("a red circle and a blue triangle", speck).strict == 1
    blob = img.copy()
    blob[24:30, 2:4] = COLORS["yellow"]  # 12 px, a thin bar that fits no template: an extra object
    blob[24:26, 4:8] = COLORS["yellow"]
    assert [(d.color, d.shape) for d in analyse(blob)][-1] == ("yellow", None)
    assert not verify("a red circle and a blue triangle", blob).checks["no extra objects"]


def test_category_table_format_keeps_long_model_names():
    from flowrl.train.evaluate import format_category_table

    table = category_table(["a red circle", "two red circles"], [1.0, 0.0], [1.0, 0.5])
    text = format_category_table({"base": table, "trained (iter_000276)": table})
    head, *rows = text.splitlines()
    assert "trained (iter_000276) strict" in head and len(rows) == 3
    assert all(len(r) == len(head) for r in rows)  # columns line up under their names
