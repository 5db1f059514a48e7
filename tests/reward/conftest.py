"""Fixtures of the reward tests: a tiny CLIP saved with save_pretrained like a hub checkpoint, loaded back
through the same `from_pretrained` code the real rewards use (test_rewards.py, test_preservation.py)."""

from __future__ import annotations

import string

import pytest
import torch


@pytest.fixture(scope="session")  # built once, shared by the files that load it
def tiny_clip_dir(tmp_path_factory) -> str:
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    letters = string.ascii_lowercase + string.digits
    pieces = ["<|startoftext|>", "<|endoftext|>", "!", "ab</w>"] + list(letters) + [c + "</w>" for c in letters]
    tokenizer = CLIPTokenizer(vocab={p: i for i, p in enumerate(pieces)}, merges=[("a", "b</w>")], pad_token="<|endoftext|>", model_max_length=77)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, **ids),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-clip") / "clip"
    CLIPModel(config).save_pretrained(path)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return str(path)
