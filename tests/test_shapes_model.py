"""The embedded shapes model: a pixel-space SD3 pipeline with a word-level tokenizer, loaded
through the same SD3 adapter as real SD3, and its deterministic, resumable pretraining."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from flowrl.config import LoraConfig, ModelConfig
from flowrl.models import load_policy
from flowrl.models.shapes import build_shapes_pipeline, save_shapes_pipeline, word_tokenizer
from rewards.shapes_world import all_prompts

ROOT = Path(__file__).resolve().parent.parent
WORDS = sorted({w for p in all_prompts() for w in p.split()})


def _pretrain_module():
    spec = importlib.util.spec_from_file_location("pretrain_shapes", ROOT / "scripts" / "pretrain_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_word_tokenizer_knows_every_word_of_the_grammar():
    tok = word_tokenizer(WORDS)
    ids = tok(all_prompts(), padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
    for prompt, row in zip(all_prompts(), ids):
        body = row[1 : 1 + len(prompt.split())]
        assert tok.unk_token_id not in body, prompt
        assert row[0] == tok.bos_token_id and row[len(prompt.split()) + 1] == tok.eos_token_id
    # CLIP pools at the first EOS; EOS being the largest id also satisfies its legacy argmax rule
    assert tok.eos_token_id == len(tok) - 1


@pytest.fixture(scope="module")
def tiny_shapes_dir(tmp_path_factory):
    pipe = build_shapes_pipeline(WORDS, num_layers=1, heads=2, head_dim=8, text_hidden=16, text_layers=1)
    return save_shapes_pipeline(pipe, tmp_path_factory.mktemp("shapes") / "pipe")


def test_pixel_space_pipeline_loads_through_the_sd3_adapter(tiny_shapes_dir):
    cfg = ModelConfig(kind="sd3", path=str(tiny_shapes_dir), height=32, width=32, guidance_scale=3.0,
                      max_sequence_length=0, device="cpu")
    policy = load_policy(cfg)
    assert policy.vae is None and policy.pipe.text_encoder_3 is None
    assert policy.latent_shape() == (3, 32, 32)
    x = torch.randn(2, 3, 32, 32)
    v = policy.velocity(x, 0.5, policy.encode(["a red circle", "two blue squares"]))
    assert v.shape == x.shape and torch.isfinite(v).all()
    # pixel space: the decoder is the affine map [-1, 1] -> [0, 1]
    images = policy.decode(torch.tensor([-1.0, 0.0, 1.0, 3.0]).view(1, 4, 1, 1).expand(1, 4, 2, 2)[:, :3])
    assert torch.equal(images[0, :, 0, 0], torch.tensor([0.0, 0.5, 1.0]))
    policy.add_lora(LoraConfig(rank=2, alpha=2, target_modules=["to_q", "to_v"]))
    assert policy.trainable_parameters()


def test_pretraining_is_deterministic_and_resumes_exactly(tmp_path):
    from safetensors.torch import load_file

    pretrain = _pretrain_module()
    common = ["--layers", "1", "--heads", "2", "--head-dim", "8", "--batch", "4", "--warmup", "2",
              "--checkpoint-every", "2", "--quiet"]
    assert pretrain.main(["--work", str(tmp_path / "straight"), "--steps", "4", *common]) == 0
    assert pretrain.main(["--work", str(tmp_path / "resumed"), "--steps", "2", *common]) == 0
    assert pretrain.main(["--work", str(tmp_path / "resumed"), "--steps", "4", *common]) == 0
    a = load_file(str(tmp_path / "straight/checkpoints/iter_000004/trainable.safetensors"))
    b = load_file(str(tmp_path / "resumed/checkpoints/iter_000004/trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ema = load_file(str(tmp_path / "straight/checkpoints/iter_000004/ema.safetensors"))
    assert any(not torch.equal(ema[k], a[k]) for k in a)  # the EMA is its own average, not a copy
    out = tmp_path / "export"
    assert pretrain.main(["--work", str(tmp_path / "straight"), "--export", str(out), *common]) == 0
    policy = load_policy(ModelConfig(kind="sd3", path=str(out), height=32, width=32, max_sequence_length=0, device="cpu"))
    exported = policy.transformer.state_dict()
    assert all(torch.equal(exported[k.removeprefix("transformer.")], ema[k]) for k in ema if k.startswith("transformer."))
