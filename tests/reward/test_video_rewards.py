"""Rewards on videos [N, 3, F, H, W]: an image reward scores every frame_stride-th frame with the
video's prompt and averages per video; a reward registered with video=True gets the videos; a bad
frame drops its whole video."""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import UserError
from rewards import MultiReward
from rewards.simple import brightness, jpeg_kilobytes
from rewards.video import strided_frames, temporal_consistency


def _videos(n=3, frames=5, seed=0):
    return torch.rand(n, 3, frames, 16, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_an_image_reward_scores_the_mean_of_the_strided_frames(stride):
    videos = _videos()
    scores = MultiReward({"brightness": 1.0, "jpeg_compressibility": 1.0}, batch_size=2, frame_stride=stride)(videos, ["a", "b", "c"])
    picked = list(range(0, 5, stride))
    by_hand = torch.stack([videos[:, :, t].mean(dim=(1, 2, 3)) for t in picked], 1).mean(1)
    jpeg = -torch.stack([jpeg_kilobytes(videos[:, :, t]) for t in picked], 1).mean(1)
    assert torch.allclose(scores[:, 0], by_hand, atol=1e-6) and torch.allclose(scores[:, 1], jpeg, atol=1e-5)
    assert strided_frames(videos, stride).shape == (3, len(picked), 3, 16, 16)


def test_frames_carry_their_videos_prompt():
    seen = []

    def prompt_length(images, prompts, metadata=None):
        seen.extend(prompts)
        return torch.tensor([float(len(p)) for p in prompts])

    scores = MultiReward({"len": 1.0}, rewards={"len": prompt_length})(_videos(2, frames=3), ["ab", "abcd"])
    assert seen == ["ab"] * 3 + ["abcd"] * 3 and scores[:, 0].tolist() == [2.0, 4.0]


def test_temporal_consistency_gets_the_videos():
    still = _videos(1)[:, :, :1].expand(1, 3, 5, 16, 16)
    moving = _videos(1, seed=1)
    scores = MultiReward({"temporal_consistency": 1.0})(torch.cat([still, moving]), ["a", "b"])
    assert scores[0, 0] == 1.0 and scores[1, 0] < 0.8
    assert torch.allclose(temporal_consistency(moving), 1 - (moving[:, :, 1:] - moving[:, :, :-1]).abs().mean(dim=(1, 2, 3, 4)))
    with pytest.raises(UserError, match="reward 'temporal_consistency' scores videos"):
        MultiReward({"temporal_consistency": 1.0})(torch.rand(2, 3, 16, 16), ["a", "b"])


def test_a_bad_frame_drops_its_video():
    def nan_on_dark(images, prompts, metadata=None):
        b = brightness(images)
        return torch.where(b < 0.3, torch.tensor(float("nan")), b)

    videos = torch.full((2, 3, 3, 8, 8), 0.6)
    videos[1, :, 2] = 0.1  # the last frame of the second video is dark
    scores, valid = MultiReward({"b": 1.0}, rewards={"b": nan_on_dark}, on_invalid="drop").score_with_mask(videos, ["a", "b"])
    assert valid.tolist() == [True, False] and scores[1, 0] == 0.0 and torch.allclose(scores[0, 0], torch.tensor(0.6))
