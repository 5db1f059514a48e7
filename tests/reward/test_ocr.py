"""The `ocr` reward (rewards/ocr.py): Flow-GRPO's score written out from its definition, and the
real engine (RapidOCR, PP-OCRv4 weights inside its wheel) reading text rendered with PIL."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from flowrl.errors import UserError
from rewards import MultiReward, available_rewards
from rewards.ocr import ocr_score, quoted_target


def levenshtein(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def reference_score(recognised: str, prompt: str) -> float:
    """Flow-GRPO's OcrScorer, written out: the first quoted span; spaces removed and lower case;
    0 when contained, else the edit distance capped at the target's length."""
    target = prompt.split('"')[1].replace(" ", "").lower()
    recognised = recognised.replace(" ", "").lower()
    dist = 0 if target in recognised else min(levenshtein(recognised, target), len(target))
    return 1 - dist / len(target)


@pytest.mark.parametrize("recognised, prompt", [
    ("OPEN", 'a sign that reads "OPEN"'),
    ("WEOPENNOW", 'a sign that reads "open"'),  # contained: distance 0
    ("Hel lo World!", 'a card "hello world!" and "x"'),  # spaces and case ignored, punctuation kept, the first span only
    ("OPFN", 'a sign "OPEN"'),
    ("a much longer unrelated line of text", 'a sign "OPEN"'),  # capped: 0, never negative
    ("", 'a sign "OPEN"'),
    ("CAFE", 'a sign "CAFÉ 24"'),
])
def test_the_score_is_flow_grpos(recognised, prompt):
    assert ocr_score(recognised, quoted_target(prompt)) == pytest.approx(reference_score(recognised, prompt), abs=1e-12)


def test_a_prompt_without_quoted_text_is_one_sentence():
    with pytest.raises(UserError, match="between double quotes"):
        quoted_target("a sign that reads OPEN")
    with pytest.raises(UserError, match="empty quoted text"):
        quoted_target('a sign that reads " "')


def rendered(word: str) -> torch.Tensor:
    image = Image.new("RGB", (320, 112), "white")
    ImageDraw.Draw(image).text((20, 20), word, fill="black", font=ImageFont.load_default(size=56))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div(255)


def test_the_engine_reads_rendered_text_back():
    assert "ocr" in available_rewards()
    reward = MultiReward({"ocr": 1.0})
    images = torch.stack([rendered("OPEN"), rendered("OPEN"), rendered("TAXI")])
    scores = reward(images, ['a sign that reads "OPEN"', 'a sign that reads "BAKERY"', 'a sign that reads "taxi"'])[:, 0]
    assert scores[0] >= 0.9 and scores[1] < 0.5 and scores[2] >= 0.9, scores
