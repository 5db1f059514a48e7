"""Image statistics that move when a model hacks its reward (docs/monitor.md): images in, numbers out.

Every function takes images [N, 3, H, W] (or videos [N, 3, F, H, W], whose frames count as images)
with values in [0, 1] and returns the mean over images of one number per image (patch_energy also takes the
model's token side in pixels; artefact_statistics returns the shapes world's two artefact measures). The definitions
are ours: UniRL PR #407 named brightness, dark-pixel fraction, edge density and colour entropy
without publishing their formulas (docs/monitor.md writes each one out)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DARK = 0.15  # luminance below this is a dark pixel (UniRL PR #407's threshold)
BRIGHT = 0.85  # and above this a bright one (its mirror image)
COLOUR_BINS = 4  # per channel: a 4 x 4 x 4 RGB cube, at most 6 bits of entropy
EDGE_THRESHOLD = 1.0  # Sobel magnitude on luminance: a step of 0.25 across the 3-pixel stencil
SOBEL_X = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
STATISTICS = ("brightness", "saturation", "dark_fraction", "bright_fraction", "colour_entropy", "edge_density")


def as_frames(images: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] as float; videos [N, 3, F, H, W] (flowrl's decode) flattened to their frames."""
    images = images.float()
    return images.transpose(1, 2).flatten(0, 1) if images.ndim == 5 else images


def luminance(images: torch.Tensor) -> torch.Tensor:
    """Y = 0.299 R + 0.587 G + 0.114 B (ITU-R BT.601), [N, H, W]."""
    r, g, b = images.unbind(1)
    return 0.299 * r + 0.587 * g + 0.114 * b


def brightness(images: torch.Tensor) -> float:
    return luminance(as_frames(images)).mean().item()


def saturation(images: torch.Tensor) -> float:
    """HSV saturation (max - min) / max per pixel, 0 where max is 0 (black), averaged."""
    x = as_frames(images)
    high, low = x.amax(1), x.amin(1)
    return torch.where(high > 0, (high - low) / high.clamp_min(1e-12), torch.zeros_like(high)).mean().item()


def dark_fraction(images: torch.Tensor) -> float:
    return (luminance(as_frames(images)) < DARK).float().mean().item()


def bright_fraction(images: torch.Tensor) -> float:
    return (luminance(as_frames(images)) > BRIGHT).float().mean().item()


def colour_entropy(images: torch.Tensor) -> float:
    """Shannon entropy in bits of each image's 4 x 4 x 4 RGB histogram (channel bin min(floor(4 c), 3)),
    averaged over images: 0 for one colour, 1 for two colours in equal parts, 6 at most."""
    x = as_frames(images).clamp(0, 1)
    bins = (x * COLOUR_BINS).floor().clamp(max=COLOUR_BINS - 1).long()
    cell = (bins[:, 0] * COLOUR_BINS + bins[:, 1]) * COLOUR_BINS + bins[:, 2]  # [N, H, W]
    counts = torch.stack([torch.bincount(c.flatten(), minlength=COLOUR_BINS ** 3) for c in cell]).float()
    p = counts / counts.sum(1, keepdim=True)
    return -(p * torch.log2(p.clamp_min(1e-30))).sum(1).mean().item()


def edge_density(images: torch.Tensor) -> float:
    """Fraction of interior pixels whose Sobel gradient magnitude on luminance exceeds EDGE_THRESHOLD
    (no padding: the (H - 2) x (W - 2) pixels with a full 3 x 3 neighbourhood). A vertical step from 0
    to 1 marks the two columns beside it: 2 / (W - 2)."""
    y = luminance(as_frames(images))[:, None]
    gx = F.conv2d(y, SOBEL_X[None, None].to(y))
    gy = F.conv2d(y, SOBEL_X.T[None, None].to(y))
    return ((gx ** 2 + gy ** 2).sqrt() > EDGE_THRESHOLD).float().mean().item()


def frame_change(videos: torch.Tensor) -> float:
    """Videos [N, 3, F, H, W]: mean absolute change of a pixel value from one frame to the next."""
    return (videos[:, :, 1:].float() - videos[:, :, :-1].float()).abs().mean().item()


def patch_energies(images: torch.Tensor, patch: int) -> torch.Tensor:
    """[N] float64: each image's `patch_energy` (videos: each frame's, [N F])."""
    y = luminance(as_frames(images)).double()
    h, w = y.shape[-2:]
    if int(patch) != patch or not 1 <= patch <= min(h, w):
        raise ValueError(f"patch_energy: patch must be a whole number of pixels from 1 to the image's side ({min(h, w)}); got {patch}")
    patch = int(patch)
    h, w = h - h % patch, w - w % patch
    y = y[..., :h, :w]  # the whole tokens (they start at the top-left pixel): the lattice is then exact
    y = y - y.mean((-2, -1), keepdim=True)
    power = torch.fft.fft2(y).abs() ** 2  # [N, h, w]
    power[:, 0, 0] = 0.0  # DC (0 up to rounding once the mean is taken out)
    on = power[:, :: h // patch, :: w // patch].sum((-2, -1))  # u, v multiples of h / patch, w / patch
    total = power.sum((-2, -1))
    return torch.where(total > 0, on / total.clamp_min(1e-300), torch.zeros_like(total))


def patch_energy(images: torch.Tensor, patch: int) -> float:
    """The share of the luminance spectrum's AC power that lies on the lattice of the transformer's
    patch, per image, averaged over images:

        P(u, v) = |FFT2(Y - mean Y)|^2 (u in 0..H-1, v in 0..W-1),
        patch_energy = sum_{(u, v) in L, (u, v) != (0, 0)} P(u, v) / sum_{(u, v) != (0, 0)} P(u, v),
        L = {(u, v): u a multiple of H / patch, v a multiple of W / patch},

    with Y the BT.601 luminance and `patch` the model's token side in image pixels (the policy's
    `pixel_patch`). Why the lattice: a pattern that repeats every `patch` pixels down and across,
    such as a seam or a bias at the same place in every token, is a sum of the harmonics of period
    `patch`, so all its power lies on the frequencies that are multiples of H / patch and W / patch,
    the patch^2 - 1 bins of L besides DC. White noise spreads its power evenly over the H W - 1 AC
    bins, so its expected share is (patch^2 - 1) / (H W - 1) (15 / 1023 = 0.0147 at 32x32 with
    patch 4); a pure period-`patch` pattern on a flat image scores 1; an image without AC power (a
    flat one) 0. Independent noise of AC power n added to an image of AC power T and share s moves the
    share, in expectation, to (T s + n s_noise) / (T + n), s_noise = (patch^2 - 1) / (H W - 1): towards
    the noise's share, from above or below, with a weight n / (T + n) that faint speckle on a scene of
    coloured shapes keeps near 0. So it ranks periodic grids, not speckle (the
    shapes world's fill_nonuniformity and background_impurity see speckle). Where H or W is not a
    multiple of `patch`, the measure reads the top-left crop of whole tokens (H - H % patch rows,
    W - W % patch columns: tokens start at the top-left pixel), where the lattice is exact."""
    return patch_energies(images, patch).mean().item()


def artefact_statistics(images: torch.Tensor) -> dict[str, float]:
    """The shapes world's artefact measures (rewards/shapes.py), each the nanmean over the images (frames)
    where it is defined: background_impurity (the verifier's background pixels' mean RGB distance from
    white, 0-255) and fill_nonuniformity (the mean RGB distance of an object's pixels from its mean colour).
    A measure defined on no image (no object anywhere) is left out."""
    from rewards.shapes import background_impurity_batch, fill_nonuniformity_batch

    frames = as_frames(images)
    out = {}
    for name, fn in (("background_impurity", background_impurity_batch), ("fill_nonuniformity", fill_nonuniformity_batch)):
        value = torch.nanmean(fn(frames).double()).item()
        if math.isfinite(value):
            out[name] = value
    return out


SHAPES_STATISTICS = ("background_impurity", "fill_nonuniformity")  # artefact_statistics: shapes-world prompts only
ARTEFACT_STATISTICS = ("patch_energy", *SHAPES_STATISTICS)


def image_statistics(images: torch.Tensor, patch: int | None = None, shapes_world: bool = False) -> dict[str, float]:
    """Every statistic by name; frame_change too for videos; patch_energy where `patch` (the model's token
    side in pixels) is given; background_impurity and fill_nonuniformity with `shapes_world` (images of
    the shapes world: a white background and flat palette colours, which those measures assume)."""
    out = {name: globals()[name](images) for name in STATISTICS}
    if images.ndim == 5 and images.shape[2] > 1:
        out["frame_change"] = frame_change(images)
    if patch:
        out["patch_energy"] = patch_energy(images, patch)
    if shapes_world:
        out.update(artefact_statistics(images))
    return out


def middle_frames(images: torch.Tensor) -> torch.Tensor:
    """Images as they are; videos [N, 3, F, H, W] by their middle frame [N, 3, H, W] (what an image encoder sees)."""
    return images[:, :, images.shape[2] // 2] if images.ndim == 5 else images


def pixel_features(images: torch.Tensor, side: int = 16) -> torch.Tensor:
    """Images area-averaged to side x side (a video: its middle frame), flattened: [N, 3 side^2], the
    feature space of diversity when no reward brings an image encoder."""
    return F.adaptive_avg_pool2d(middle_frames(images).float(), side).flatten(1)


def group_diversity(features: torch.Tensor, groups: torch.Tensor, metric: str = "rms") -> float:
    """Mean over groups of the mean distance between a group's members, all pairs a != b. rms: the root
    mean square difference of the features (pixels in [0, 1]: a distance in [0, 1]); cosine: 1 - cos."""
    per_group = []
    for g in groups.unique():
        f = features[groups == g].float()
        n = len(f)
        if n < 2:
            continue
        if metric == "cosine":
            f = F.normalize(f, dim=1)
            d = 1 - (f @ f.T).clamp(-1, 1)
        else:
            d = torch.cdist(f, f) / math.sqrt(f.shape[1])
        per_group.append(d.sum().item() / (n * (n - 1)))  # the zero diagonal adds nothing
    return sum(per_group) / len(per_group) if per_group else float("nan")
