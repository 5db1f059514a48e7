"""An edit's prompt (flowrl/models/edit_prompt.py): a string that keys both the instruction and the
source, travels whole between processes, loads its source or names what is wrong with it, and is
refused by a family that generates from text alone."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.errors import UserError
from flowrl.models import load_policy
from flowrl.models.edit_prompt import EditPrompt, instruction_of, sources_of
from flowrl.schema import ModelConfig


def test_an_edit_keys_its_instruction_and_source_and_travels_whole(tmp_path):
    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    Image.fromarray(np.full((8, 8, 3), (255, 0, 0), np.uint8)).save(red)
    Image.fromarray(np.full((8, 8, 3), (0, 0, 255), np.uint8)).save(blue)
    a, b = EditPrompt("make it green", red), EditPrompt("make it green", blue)
    assert a != b and len({a, b}) == 2 and a == "make it green [source: red.png]"  # one instruction, two sources: two keys
    assert instruction_of(a) == "make it green" and instruction_of("a plain prompt") == "a plain prompt"
    back = pickle.loads(pickle.dumps(a))  # as it reaches a producer process
    assert isinstance(back, EditPrompt) and back == a and back.source == a.source
    image = back.image()
    assert image.shape == (3, 8, 8) and torch.allclose(image[:, 0, 0], torch.tensor([1.0, 0.0, 0.0]))
    assert [s.shape for s in sources_of([a, b])] == [(3, 8, 8)] * 2 and sources_of(["plain"]) is None


def test_bad_sources_and_instructions_are_one_sentence_each(tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(UserError, match=r"^the source image '.*missing.png' does not exist$"):
        EditPrompt("recolour", tmp_path / "missing.png").image()
    with pytest.raises(UserError, match=r"^the source image '.*notes.png' cannot be read as an image"):
        EditPrompt("recolour", tmp_path / "notes.png").image()
    with pytest.raises(UserError, match=r"must be RGB \[3, H, W\]; got shape \(1, 4, 4\)$"):
        EditPrompt("recolour", torch.rand(1, 4, 4), name="grey").image()
    with pytest.raises(UserError, match=r"must hold finite values in \[0, 1\]$"):
        EditPrompt("recolour", torch.full((3, 4, 4), 2.0), name="bright").image()
    with pytest.raises(UserError, match="needs an instruction"):
        EditPrompt("  ", torch.rand(3, 4, 4), name="x")
    with pytest.raises(UserError, match="needs a name"):
        EditPrompt("recolour", torch.rand(3, 4, 4))
    with pytest.raises(UserError, match="mixes edits and plain prompts"):
        sources_of([EditPrompt("recolour", torch.rand(3, 4, 4), name="x"), "a red circle"])


def test_a_text_to_image_family_refuses_an_edit(tiny_sd3_dir):
    policy = load_policy(ModelConfig(kind="sd3", path=tiny_sd3_dir, max_sequence_length=16), device="cpu")
    with pytest.raises(UserError, match="^model.kind sd3 generates from text alone, so it cannot edit a source image"):
        policy.encode([EditPrompt("make it red", torch.rand(3, 64, 64), name="square")])
    assert policy.encode(["a red circle"])  # plain prompts as before
