"""A prompt that edits a source image (issue 86: FLUX.1 Kontext, Qwen-Image-Edit).

An `EditPrompt` is a `str` whose text names both halves, "{instruction} [source: {name}]": the key
every cache, group and log uses, so two edits with one instruction on two images never share an
entry. It carries the instruction (what an editing family's text encoder reads), its source image
(a path, or with a name: an image file's bytes, a PIL image or a tensor [3, H, W] in [0, 1]) and
optionally a reference target (the same kinds) for rewards that compare. Every rollout, objective and
producer hands prompts to `policy.encode` unchanged, so an edit's source reaches the family's
conditioning wherever its prompt goes, with nothing in the loop that knows about editing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flowrl.errors import UserError


class EditPrompt(str):
    instruction: str
    source: Any  # a path (str), or an image file's bytes, a PIL image or a tensor [3, H, W]
    source_name: str
    reference: Any  # the target the edit should reach (the same kinds), or None

    def __new__(cls, instruction: str, source: Any, name: str | None = None, reference: Any = None):
        if not isinstance(instruction, str) or not instruction.strip():
            raise UserError(f"an edit needs an instruction (a non-empty string); got {instruction!r}")
        if isinstance(source, (str, Path)):
            source, name = str(source), name or Path(source).name
        elif not _is_image(source):
            raise UserError(f"an edit's source must be an image path, an image file's bytes, a PIL image or a tensor [3, H, W]; "
                            f"got {type(source).__name__}")
        elif name is None:
            raise UserError(f"an edit whose source is {type(source).__name__} needs a name for it (EditPrompt(..., name=...))")
        obj = super().__new__(cls, f"{instruction} [source: {name}]")
        obj.instruction, obj.source, obj.source_name, obj.reference = instruction, source, name, reference
        return obj

    def __reduce__(self):  # travels to producer processes and Ray workers whole, not as its text
        return (EditPrompt, (self.instruction, self.source, self.source_name, self.reference))

    def image(self) -> torch.Tensor:
        """The source as an image tensor [3, H, W] in [0, 1], fp32."""
        return load_source_image(self.source, self.source_name)

    def reference_image(self) -> torch.Tensor | None:
        """The reference target as an image tensor [3, H, W] in [0, 1], or None where the edit has none."""
        return None if self.reference is None else load_source_image(self.reference, f"{self.source_name}'s reference")


def _is_image(value: Any) -> bool:
    return isinstance(value, (bytes, torch.Tensor)) or type(value).__module__.startswith("PIL.")


def load_source_image(source: Any, name: str = "") -> torch.Tensor:
    """An image path, file bytes, PIL image or tensor as [3, H, W] fp32 in [0, 1]; one sentence naming it when it
    cannot be."""
    if isinstance(source, torch.Tensor):
        image = source
    else:
        import io

        import numpy as np
        from PIL import Image

        shown = name or source
        if isinstance(source, (str, Path)):
            if not Path(source).expanduser().is_file():
                raise UserError(f"the source image '{source}' does not exist")
            shown = source
        try:
            if isinstance(source, (str, Path, bytes)):
                with Image.open(io.BytesIO(source) if isinstance(source, bytes) else Path(source).expanduser()) as im:
                    array = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
            else:
                array = np.asarray(source.convert("RGB"), dtype=np.float32) / 255.0
        except Exception as exc:
            raise UserError(f"the source image '{shown}' cannot be read as an image ({type(exc).__name__}: {exc})") from None
        image = torch.from_numpy(array).permute(2, 0, 1).contiguous()
    if image.ndim != 3 or image.shape[0] != 3:
        raise UserError(f"the source image '{name or source}' must be RGB [3, H, W]; got shape {tuple(image.shape)}")
    image = image.float()
    if not torch.isfinite(image).all() or image.min() < 0 or image.max() > 1:
        raise UserError(f"the source image '{name or source}' must hold finite values in [0, 1]")
    return image


def instruction_of(prompt: str) -> str:
    """What a text encoder reads of `prompt`: an edit's instruction, else the prompt itself."""
    return prompt.instruction if isinstance(prompt, EditPrompt) else prompt


def sources_of(prompts: list[str]) -> list[torch.Tensor] | None:
    """The source images of `prompts` ([3, H, W] each), or None where no prompt is an edit; one sentence for a mix."""
    edits = [isinstance(p, EditPrompt) for p in prompts]
    if not any(edits):
        return None
    if not all(edits):
        plain = next(p for p, e in zip(prompts, edits) if not e)
        raise UserError(f"a batch mixes edits and plain prompts ('{plain}' has no source image); give every prompt a source")
    return [p.image() for p in prompts]
