"""A prompt that edits a source image (issue 86: FLUX.1 Kontext, Qwen-Image-Edit).

An `EditPrompt` is a `str` whose text names both halves, "{instruction} [source: {name}]": the key
every cache, group and log uses, so two edits with one instruction on two images never share an
entry. It carries the instruction (what an editing family's text encoder reads) and its source
image (a path, or an image tensor [3, H, W] in [0, 1] with a name). Every rollout, objective and
producer hands prompts to `policy.encode` unchanged, so an edit's source reaches the family's
conditioning wherever its prompt goes, with nothing in the loop that knows about editing."""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.errors import UserError


class EditPrompt(str):
    instruction: str
    source: str | torch.Tensor
    source_name: str

    def __new__(cls, instruction: str, source: str | Path | torch.Tensor, name: str | None = None):
        if not isinstance(instruction, str) or not instruction.strip():
            raise UserError(f"an edit needs an instruction (a non-empty string); got {instruction!r}")
        if isinstance(source, torch.Tensor):
            if name is None:
                raise UserError("an edit whose source is an image tensor needs a name for it (EditPrompt(..., name=...))")
        elif isinstance(source, (str, Path)):
            source, name = str(source), name or Path(source).name
        else:
            raise UserError(f"an edit's source must be an image path or an image tensor [3, H, W]; got {type(source).__name__}")
        obj = super().__new__(cls, f"{instruction} [source: {name}]")
        obj.instruction, obj.source, obj.source_name = instruction, source, name
        return obj

    def __reduce__(self):  # travels to producer processes and Ray workers whole, not as its text
        return (EditPrompt, (self.instruction, self.source, self.source_name))

    def image(self) -> torch.Tensor:
        """The source as an image tensor [3, H, W] in [0, 1], fp32."""
        return load_source_image(self.source, self.source_name)


def load_source_image(source: str | torch.Tensor, name: str = "") -> torch.Tensor:
    """An image path or tensor as [3, H, W] fp32 in [0, 1]; one sentence naming it when it cannot be."""
    if isinstance(source, torch.Tensor):
        image = source
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise UserError(f"the source image '{source}' does not exist")
        try:
            from PIL import Image
            import numpy as np

            with Image.open(path) as im:
                array = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
        except Exception as exc:
            raise UserError(f"the source image '{source}' cannot be read as an image ({type(exc).__name__}: {exc})") from None
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
