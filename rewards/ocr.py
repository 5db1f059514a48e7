"""`ocr`: Flow-GRPO's OCR reward (its `flow_grpo/ocr.py`), read with RapidOCR's PP-OCRv4 models
(the PaddleOCR family Flow-GRPO uses, as ONNX weights inside the `rapidocr-onnxruntime` wheel:
nothing to download; extra `ocr`).

The target is the prompt's text between its first pair of double quotes. The recognised text is
every line the engine reads with a confidence above 0, in its detection order, joined with no
separator. Both lose their spaces (' ' only) and are lower-cased; punctuation stays. The
distance is 0 when the target appears inside the recognised text, else their Levenshtein
distance capped at the target's length; the reward is 1 - distance / len(target), in [0, 1].
An engine failure scores 0, as there. The reference passes the RGB array as it is (the
engine's convention is BGR; black text on a light background reads the same either way), and
does not classify line angles; both are kept.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from flowrl.errors import UserError
from rewards.registry import register
from rewards.simple import to_uint8

log = logging.getLogger(__name__)


def quoted_target(prompt: str) -> str:
    """The text to render: the first span between double quotes."""
    parts = prompt.split('"')
    if len(parts) < 3:
        raise UserError(f"the ocr reward needs the text to render between double quotes in each prompt; got {prompt!r}")
    if not parts[1].replace(" ", ""):
        raise UserError(f"the ocr reward found an empty quoted text in {prompt!r}")
    return parts[1]


def normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def ocr_score(recognised: str, target: str) -> float:
    """1 - min(Levenshtein(recognised, target), len(target)) / len(target), 1 when the target is
    inside the recognised text (both normalised)."""
    from rapidfuzz.distance import Levenshtein

    recognised, target = normalise(recognised), normalise(target)
    distance = 0 if target in recognised else min(Levenshtein.distance(recognised, target), len(target))
    return 1.0 - distance / len(target)


@register("ocr", "Flow-GRPO's OCR reward: 1 - normalised edit distance between the prompt's quoted text and "
          "RapidOCR's reading (PP-OCRv4, extra ocr; option min_confidence)")
class OCRReward:
    def __init__(self, min_confidence: float = 0.0):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError:
            raise UserError("the ocr reward needs RapidOCR: pip install 'flowrl[ocr]' (rapidocr-onnxruntime, rapidfuzz)") from None
        self.engine = RapidOCR()
        self.min_confidence = float(min_confidence)

    def read(self, pixels) -> str:
        """The recognised lines of one uint8 [H, W, 3] image, joined with no separator."""
        result, _ = self.engine(pixels, use_cls=False)
        return "".join(text for _, text, confidence in (result or []) if float(confidence) > self.min_confidence)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> torch.Tensor:
        targets = [quoted_target(p) for p in prompts]  # a prompt without quotes is a mistake, before any reading
        scores = []
        for pixels, target in zip(to_uint8(images), targets):
            try:
                recognised = self.read(pixels)
            except Exception as exc:  # the reference scores an engine failure 0
                log.warning("ocr: the engine failed on an image (%s); scored 0", type(exc).__name__)
                scores.append(0.0)
                continue
            scores.append(ocr_score(recognised, target))
        return torch.tensor(scores, dtype=torch.float32)

