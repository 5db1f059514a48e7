"""Rewards on videos [N, 3, F, H, W] in [0, 1] (the samples of model.kind wan).

Any image reward scores a video through its frames: every `reward.frame_stride`-th frame from the
first is scored as an image with the video's prompt, and the video's score is the mean over those
frames (`MultiReward` does this for every reward not registered with `video=True`). A reward
registered with `video=True` gets the videos themselves, such as `temporal_consistency` below."""

from __future__ import annotations

import torch

from rewards.registry import register


def strided_frames(videos: torch.Tensor, stride: int) -> torch.Tensor:
    """Videos [N, 3, F, H, W] -> frames [N, F', 3, H, W]: frames 0, stride, 2 stride, ... of each video."""
    if videos.dim() != 5:
        raise ValueError(f"videos must be [N, 3, F, H, W]; got shape {tuple(videos.shape)}")
    return videos[:, :, ::stride].transpose(1, 2)


@register("temporal_consistency", "1 minus the mean absolute change between consecutive frames of a video, in [0, 1] "
          "(1: a still video; pair it with a reward on content)", video=True)
def temporal_consistency(videos, prompts=None, metadata=None):
    """1 - mean over pixels and consecutive frame pairs of |x_{t+1} - x_t|: flicker and jumps score low."""
    if videos.dim() != 5:
        raise ValueError(f"temporal_consistency scores videos [N, 3, F, H, W]; got shape {tuple(videos.shape)}")
    if videos.shape[2] < 2:
        return torch.ones(videos.shape[0])
    x = videos.detach().float()
    return (1.0 - (x[:, :, 1:] - x[:, :, :-1]).abs().mean(dim=(1, 2, 3, 4))).cpu()
