"""ImageReward: the converter's renames checked against BLIP's own ViT written out from the
original key names, the score's head and standardisation, the reference transform, and the
loading errors. A tiny checkpoint in ImageReward.pt's layout stands in for the real one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flowrl.errors import UserError
from rewards import available_rewards, get_reward
from rewards.imagereward import SCORE_MEAN, SCORE_STD, blip_pixels
from script_loader import load_script

WIDTH, TEXT_WIDTH, HEADS, PATCH, IMAGE, LAYERS = 128, 128, 2, 8, 16, 2
WORDS = ["a", "red", "cube", "blue", "ball", "cat", "on", "the", "mat", "two"]


def original_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under ImageReward.pt's names and shapes (BLIP ViT, BLIP's BERT with
    cross-attention in every layer, the 5-layer MLP), tiny sizes."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    def norm(prefix, width):
        return {f"{prefix}.weight": 1 + rand(width, scale=0.1), f"{prefix}.bias": rand(width, scale=0.1)}

    def linear(prefix, n_in, n_out):
        return {f"{prefix}.weight": rand(n_out, n_in, scale=1 / math.sqrt(n_in)), f"{prefix}.bias": rand(n_out, scale=0.1)}

    v, t = "blip.visual_encoder.", "blip.text_encoder."
    grid = IMAGE // PATCH
    state = {v + "cls_token": rand(1, 1, WIDTH), v + "pos_embed": rand(1, grid * grid + 1, WIDTH),
             v + "patch_embed.proj.weight": rand(WIDTH, 3, PATCH, PATCH, scale=0.05), v + "patch_embed.proj.bias": rand(WIDTH)}
    for i in range(LAYERS):
        b = f"{v}blocks.{i}."
        state |= norm(b + "norm1", WIDTH) | norm(b + "norm2", WIDTH) | linear(b + "attn.qkv", WIDTH, 3 * WIDTH)
        state |= linear(b + "attn.proj", WIDTH, WIDTH) | linear(b + "mlp.fc1", WIDTH, 4 * WIDTH) | linear(b + "mlp.fc2", 4 * WIDTH, WIDTH)
    state |= norm(v + "norm", WIDTH)
    vocab = len(tiny_vocab()) + 2  # BLIP adds [DEC] and [ENC]
    state |= {t + "embeddings.word_embeddings.weight": rand(vocab, TEXT_WIDTH), t + "embeddings.position_embeddings.weight": rand(40, TEXT_WIDTH),
              t + "embeddings.position_ids": torch.arange(40)[None]} | norm(t + "embeddings.LayerNorm", TEXT_WIDTH)
    for i in range(LAYERS):
        b = f"{t}encoder.layer.{i}."
        for attn, source in (("attention", TEXT_WIDTH), ("crossattention", WIDTH)):
            state |= linear(f"{b}{attn}.self.query", TEXT_WIDTH, TEXT_WIDTH) | linear(f"{b}{attn}.self.key", source, TEXT_WIDTH)
            state |= linear(f"{b}{attn}.self.value", source, TEXT_WIDTH) | linear(f"{b}{attn}.output.dense", TEXT_WIDTH, TEXT_WIDTH)
            state |= norm(f"{b}{attn}.output.LayerNorm", TEXT_WIDTH)
        state |= linear(b + "intermediate.dense", TEXT_WIDTH, 4 * TEXT_WIDTH) | linear(b + "output.dense", 4 * TEXT_WIDTH, TEXT_WIDTH)
        state |= norm(b + "output.LayerNorm", TEXT_WIDTH)
    widths = [TEXT_WIDTH, 1024, 128, 64, 16, 1]
    for index, (n_in, n_out) in zip((0, 2, 4, 6, 7), zip(widths, widths[1:])):
        state |= linear(f"mlp.layers.{index}", n_in, n_out)
    return state


def tiny_vocab() -> list[str]:
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS


def blip_vit_reference(state: dict[str, torch.Tensor], pixels: torch.Tensor) -> torch.Tensor:
    """BLIP's VisionTransformer.forward (timm blocks, LayerNorm eps 1e-6, exact GELU) from the
    original names: the check that the renames, the qkv layout and the eps are right."""
    p = "blip.visual_encoder."
    x = F.conv2d(pixels, state[p + "patch_embed.proj.weight"], state[p + "patch_embed.proj.bias"], stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([state[p + "cls_token"].expand(len(x), -1, -1), x], 1) + state[p + "pos_embed"]
    n, tokens, head = len(x), x.shape[1], WIDTH // HEADS

    def ln(h, name):
        return F.layer_norm(h, (WIDTH,), state[name + ".weight"], state[name + ".bias"], eps=1e-6)

    def lin(h, name):
        return F.linear(h, state[name + ".weight"], state[name + ".bias"])

    for i in range(LAYERS):
        b = f"{p}blocks.{i}."
        q, k, v = lin(ln(x, b + "norm1"), b + "attn.qkv").reshape(n, tokens, 3, HEADS, head).permute(2, 0, 3, 1, 4)
        attention = (q @ k.transpose(-2, -1) * head**-0.5).softmax(-1)
        x = x + lin((attention @ v).transpose(1, 2).reshape(n, tokens, WIDTH), b + "attn.proj")
        x = x + lin(F.gelu(lin(ln(x, b + "norm2"), b + "mlp.fc1")), b + "mlp.fc2")
    return ln(x, p + "norm")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import BertTokenizer

    root = tmp_path_factory.mktemp("imagereward")
    state = original_checkpoint()
    torch.save(state, root / "ImageReward.pt")  # the original file: a plain state dict
    out = load_script("convert_imagereward_checkpoint").convert(root / "ImageReward.pt", root / "converted")
    (root / "vocab.txt").write_text("\n".join(tiny_vocab()) + "\n")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(root / "tokenizer")
    return state, out, str(root / "tokenizer")


def test_imagereward_is_listed():
    assert "imagereward" in available_rewards()
    assert set(get_reward("imagereward").options()) == {"checkpoint", "tokenizer", "device", "dtype"}


def test_converted_vision_tower_matches_blip_vit(converted):
    state, out, tokenizer = converted
    scorer = get_reward("imagereward").factory(checkpoint=str(out), tokenizer=tokenizer, device="cpu")
    pixels = torch.randn(3, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    ours = scorer.model.visual_encoder(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(ours, blip_vit_reference(state, pixels), atol=1e-5, rtol=1e-5)


def test_score_is_the_standardised_mlp_of_the_cls_feature(converted):
    state, out, tokenizer = converted
    scorer = get_reward("imagereward").factory(checkpoint=str(out), tokenizer=tokenizer, device="cpu")
    images = torch.rand(2, 3, 24, 20, generator=torch.Generator().manual_seed(2))
    prompts = ["a red cube on the mat", "two blue ball"]
    scores = scorer(images, prompts)

    text = scorer.tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert text["input_ids"].shape == (2, 35) and (text["input_ids"][:, 0] == scorer.tokenizer.cls_token_id).all()
    image_embeds = blip_vit_reference(state, blip_pixels(images, IMAGE))
    cls = scorer.model.text_encoder(input_ids=text["input_ids"], attention_mask=text["attention_mask"],
                                    encoder_hidden_states=image_embeds).last_hidden_state[:, 0]
    h = cls
    for index in (0, 2, 4, 6, 7):  # ImageReward's MLP: Linear layers only, dropouts off at inference
        h = F.linear(h, state[f"mlp.layers.{index}.weight"], state[f"mlp.layers.{index}.bias"])
    torch.testing.assert_close(scores, (h.squeeze(-1) - SCORE_MEAN) / SCORE_STD, atol=1e-5, rtol=1e-5)
    assert scores.shape == (2,) and scores[0] != scores[1]
    # the prompt matters: the same image under another prompt scores differently
    assert scorer(images[:1], ["the cat"]) != scores[:1]


def test_transform_resizes_the_shorter_side_and_crops_the_centre():
    wide = torch.zeros(1, 3, 16, 64)
    wide[..., 16:48] = 1.0  # a white centre square between black bands
    pixels = blip_pixels(wide, 8)
    assert pixels.shape == (1, 3, 8, 8)
    white = (1.0 - torch.tensor([0.48145466, 0.4578275, 0.40821073])) / torch.tensor([0.26862954, 0.26130258, 0.27577711])
    torch.testing.assert_close(pixels[0, :, :, 1:-1], white[:, None, None].expand(3, 8, 6), atol=2e-2, rtol=0)
    tall = blip_pixels(torch.rand(2, 3, 30, 10), 8)
    assert tall.shape == (2, 3, 8, 8)


def test_missing_weights_name_the_converter(tmp_path):
    with pytest.raises(UserError, match=r"convert_imagereward_checkpoint.py ImageReward.pt`, or set reward.options.imagereward.checkpoint") as info:
        get_reward("imagereward").factory(checkpoint=str(tmp_path / "nowhere"), device="cpu")
    assert "\n" not in str(info.value)


def test_converter_refuses_another_checkpoint(tmp_path):
    torch.save({"state_dict": {"visual.proj": torch.zeros(2, 2)}}, tmp_path / "other.pt")
    with pytest.raises(UserError, match="not ImageReward's checkpoint"):
        load_script("convert_imagereward_checkpoint").convert(tmp_path / "other.pt", tmp_path / "out")
