"""The preservation rewards (rewards/preservation.py): `image_similarity` against the cosine computed by hand
from a tiny CLIP's image features, through MultiReward and the config; `pixel_preservation`'s share of kept
pixels outside the region an edit's reference changes. CPU, offline."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import UserError
from flowrl.models.edit_prompt import EditPrompt
from rewards import MultiReward
from rewards.hub import to_pil
from rewards.registry import at_size

PLAIN = r"^reward '{}' compares each sample with its source image, but the prompt 'a red circle' edits no source"


def _rand(n: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# ---- image_similarity ----------------------------------------------------------------------------


def test_image_similarity_is_the_cosine_of_the_clip_image_features(tiny_clip_dir):
    from transformers import CLIPModel, CLIPProcessor

    sources, samples = _rand(3, seed=1), _rand(3, seed=2)
    samples[0] = sources[0]  # the first edit left its source as it was
    edits = [EditPrompt("make it brighter", s, name=f"s{i}") for i, s in enumerate(sources)]
    reward = MultiReward({"image_similarity": 1.0}, options={"image_similarity": {"path": tiny_clip_dir, "device": "cpu"}})
    got = reward(samples, edits)[:, 0]

    model, processor = CLIPModel.from_pretrained(tiny_clip_dir), CLIPProcessor.from_pretrained(tiny_clip_dir)

    def embed(images):
        pixels = processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            out = model.get_image_features(pixel_values=pixels)
        out = getattr(out, "pooler_output", out)
        return out / out.norm(dim=-1, keepdim=True)

    by_hand = (embed(samples) * embed(sources)).sum(-1)
    assert got.tolist() == pytest.approx(by_hand.tolist(), abs=1e-5)
    assert got[0].item() == pytest.approx(1.0, abs=1e-5) and (got[1:] < 0.999).all()  # a changed image is not its source
    # each sample against its own source, not another's: swapping the sources changes the scores
    swapped = [EditPrompt("make it brighter", s, name=f"t{i}") for i, s in enumerate(sources.flip(0))]
    assert not torch.allclose(reward(samples, swapped)[:, 0], got, atol=1e-3)
    # the built reward lends its CLIP image encoder to the monitor and GARDO, as clip_score does
    assert reward.fns["image_similarity"].image_features(samples).shape == (3, 16)


def test_image_similarity_from_the_config_scores_edits_and_refuses_plain_prompts(tiny_clip_dir):
    cfg = load_config("tiny_jpeg", [
        "reward.weights={image_similarity: 1.0, pixel_preservation: 0.5}",
        f"reward.options.image_similarity.path={tiny_clip_dir}",
        "reward.options.image_similarity.device=cpu",
        "reward.options.pixel_preservation.tolerance=0.2",
    ])
    reward = MultiReward.from_config(cfg.reward)
    assert reward.channel_names == ["image_similarity", "pixel_preservation"]
    sources = _rand(2, size=48, seed=3)
    edits = [EditPrompt("keep it", s, name=f"s{i}") for i, s in enumerate(sources)]
    kept = torch.stack([at_size(s, (32, 32)) for s in sources])  # the sources at the samples' size: nothing changed
    assert torch.allclose(reward(kept, edits), torch.ones(2, 2), atol=1e-5)
    with pytest.raises(UserError, match=PLAIN.format("image_similarity")):
        reward(kept, ["a red circle", "a blue square"])


# ---- pixel_preservation ---------------------------------------------------------------------------

SIZE = 16
BLOCK = (slice(0, 4), slice(0, 4))  # the 4 x 4 corner the reference changes: 16 of 256 pixels


def _source() -> torch.Tensor:
    return torch.rand(3, SIZE, SIZE, generator=torch.Generator().manual_seed(0)) * 0.4  # dark: a change to 0.9 is >= 0.5


def _reference(source: torch.Tensor) -> torch.Tensor:
    reference = source.clone()
    reference[:, BLOCK[0], BLOCK[1]] = torch.tensor([0.9, 0.0, 0.0])[:, None, None]  # the corner made red
    return reference


def _changed_outside(image: torch.Tensor, pixels: int = 8) -> torch.Tensor:
    """`image` with its last row's first `pixels` pixels set to 0.9 in green: far from the block."""
    out = image.clone()
    out[1, -1, :pixels] = 0.9
    return out


def _score(samples, prompts, **options):
    return MultiReward({"pixel_preservation": 1.0}, options={"pixel_preservation": options})(torch.stack(samples), prompts)[:, 0]


def test_pixel_preservation_counts_only_what_the_reference_keeps():
    source = _source()
    reference = _reference(source)
    edit = EditPrompt("make the corner red", source, name="corner", reference=reference)
    inside = reference.clone()
    inside[2, BLOCK[0], BLOCK[1]] = 0.8  # the corner changed otherwise: still inside the region the edit may change
    samples = [source, reference, inside, _changed_outside(reference), _changed_outside(source)]
    got = _score(samples, [edit] * 5)
    # unchanged, the reference, another change inside the block: all kept; 8 pixels outside: 8 of the 240 to keep lost
    assert got.tolist() == pytest.approx([1.0, 1.0, 1.0, 1 - 8 / 240, 1 - 8 / 240])


def test_without_a_reference_every_pixel_counts_and_the_tolerance_decides_kept():
    source = _source()
    plain = EditPrompt("make the corner red", source, name="corner")
    with_reference = EditPrompt("make the corner red", source, name="corner", reference=_reference(source))
    edited = _changed_outside(_reference(source))  # the block (16 px) and 8 more
    got = _score([edited, edited], [plain, with_reference])  # one batch, each sample by its own prompt
    assert got.tolist() == pytest.approx([1 - 24 / 256, 1 - 8 / 240])
    faint = source + 0.05  # every pixel off by 0.05: kept at the default 0.1, changed at 0.01
    assert _score([faint], [plain]).tolist() == pytest.approx([1.0])
    assert _score([faint], [plain], tolerance=0.01).tolist() == pytest.approx([0.0])


def test_a_reference_that_changes_everything_leaves_nothing_to_keep_and_scores_one():
    source = _source()
    edit = EditPrompt("invert it", source, name="all", reference=1 - source)
    assert _score([torch.zeros(3, SIZE, SIZE)], [edit]).tolist() == [1.0]


def test_the_reference_is_resized_to_the_samples_size_as_the_source_is():
    source = _source()
    reference = _reference(source)
    edit = EditPrompt("make the corner red", source, name="corner", reference=reference)
    small = [at_size(source, (8, 8)), at_size(reference, (8, 8)), torch.ones(3, 8, 8)]
    got = _score(small, [edit] * 3)
    assert got.tolist() == [1.0, 1.0, 0.0]  # at 8 x 8; an all-white image keeps nothing of the dark source


@pytest.mark.parametrize("tolerance", [0, 1, 1.5, -0.1, True, "0.1"])
def test_a_bad_tolerance_is_one_sentence_naming_the_option(tolerance):
    with pytest.raises(UserError, match=r"^reward\.options\.pixel_preservation\.tolerance must be a number in \(0, 1\), "
                                        r"[^.]*; got "):
        MultiReward({"pixel_preservation": 1.0}, options={"pixel_preservation": {"tolerance": tolerance}})


def test_a_plain_prompt_gets_the_registrys_refusal():
    with pytest.raises(UserError, match=PLAIN.format("pixel_preservation")):
        _score([_source()], ["a red circle"])
