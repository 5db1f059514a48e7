"""Name -> reward factory (`REWARDS`, a flowrl.registry.Registry like every other kind of part).
Factories are called lazily, so heavy models load only when used.

Rewards of other packages join as every part does: a module that calls `register` when imported,
named in a config's `plugins` list or declared by an installed package under the `flowrl.parts`
entry point group (flowrl/registry.py)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from flowrl.errors import UserError
from flowrl.registry import Registry, load_plugins


@dataclass(frozen=True)
class RewardSpec:
    name: str
    description: str
    factory: Callable[..., Callable]  # (**options) -> reward callable
    channels: tuple[str, ...] = ()  # channel names if the reward returns [N, K]; default (name,)
    # (prompts, this reward's scores [N, K]) -> {prompt kind: {column: mean}} with an "overall" row: a
    # breakdown that metrics rows and `flowrl eval` show (the shapes reward: GenEval's categories)
    breakdown: Callable[..., dict] | None = None
    bucket: Callable[[str], str] | None = None  # prompt -> its kind (the same kinds): where the rollouts went, per kind
    video: bool = False  # scores videos [N, 3, F, H, W] itself; otherwise a video is scored by its frames (rewards/video.py)

    def options(self) -> dict[str, object]:
        """The factory's keyword options and their defaults (`REQUIRED` where it has none)."""
        params = inspect.signature(self.factory).parameters.values()
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {p.name: (REQUIRED if p.default is inspect.Parameter.empty else p.default) for p in params if p.kind in kinds}


REQUIRED = object()  # marks a factory option without a default


REWARDS = Registry("reward.weights", "Rewards")


def register(name: str, description: str, channels: tuple[str, ...] = (), factory: bool = False,
             breakdown: Callable[..., dict] | None = None, bucket: Callable[[str], str] | None = None, video: bool = False):
    """Decorator: register a reward under `name`. A plain function is the reward itself, of
    `(images, prompts, metadata)` or `(images, prompts)` (`as_reward`); a class, or a function registered with factory=True, builds the reward when first used; its
    keyword arguments are the reward's options (reward.options.NAME in the config). `breakdown`
    (prompts, scores [N, K]) -> {prompt kind: {column: mean}} splits its scores by kind of prompt,
    `bucket` (prompt) -> kind names one prompt's kind; `video`: it scores videos [N, 3, F, H, W] itself
    (any other reward scores a video's frames)."""

    def wrap(obj):
        if factory or isinstance(obj, type):
            make = obj
        else:
            reward = as_reward(name, obj)
            make = lambda: reward  # noqa: E731
        REWARDS.register(RewardSpec(name, description, make, channels or (name,), breakdown, bucket, video))
        return obj

    return wrap


def as_reward(name: str, fn: Callable) -> Callable:
    """`fn` as a reward of the protocol's `(images, prompts, metadata)`: a function of `(images,
    prompts)` is called without the metadata, and one with a `sources` parameter gets the edits' source
    images beside the samples (`source_images`). One sentence for a function that takes neither."""
    try:
        signature = inspect.signature(fn, follow_wrapped=False)  # a reward wrapped here already takes the protocol's
    except (TypeError, ValueError):  # no signature to read (a builtin): taken at its word
        return fn
    if "sources" in signature.parameters:
        plain = signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "sources"])
        if not (_binds(plain, 3) or _binds(plain, 2)):
            raise UserError(f"reward '{name}' must take (images, prompts) or (images, prompts, metadata), and sources by name; "
                            f"it takes {signature}")
        with_metadata = _binds(plain, 3)

        @functools.wraps(fn)
        def with_sources(images, prompts, metadata=None):
            sources = source_images(name, prompts, images)
            return fn(images, prompts, metadata, sources=sources) if with_metadata else fn(images, prompts, sources=sources)

        return with_sources
    if _binds(signature, 3):
        return fn
    if not _binds(signature, 2):
        raise UserError(f"reward '{name}' must take (images, prompts) or (images, prompts, metadata); it takes {signature}")

    @functools.wraps(fn)
    def without_metadata(images, prompts, metadata=None):
        return fn(images, prompts)

    return without_metadata


def source_images(name: str, prompts, images):
    """The source image of each of `prompts` (EditPrompts), [N, 3, H, W] at the samples' size (`images`
    [N, 3, H, W], videos' frames likewise) and device: what a reward that compares an edit with its source
    reads. One sentence for a prompt without a source."""
    from flowrl.models.edit_prompt import EditPrompt, sources_of  # here: rewards import no model code unless an edit is scored

    missing = next((p for p in prompts if not isinstance(p, EditPrompt)), None)
    if missing is not None:
        raise UserError(f"reward '{name}' compares each sample with its source image, but the prompt '{missing}' edits no "
                        "source; give an editing family its edits (data.edits)")
    size = tuple(images.shape[-2:])
    return torch.stack([at_size(source, size) for source in sources_of(prompts)]).to(images.device)


def at_size(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """An image [3, h, w] resized to `size` (H, W) as `source_images` resizes sources (bilinear, antialiased), so a
    reward that reads an edit's reference too compares the two pixel for pixel."""
    import torch.nn.functional as F

    return F.interpolate(image[None], size=tuple(size), mode="bilinear", antialias=True, align_corners=False)[0]


def _binds(signature: inspect.Signature, positional: int) -> bool:
    try:
        signature.bind(*range(positional))
    except TypeError:
        return False
    return True


def available_rewards() -> list[str]:
    load_plugins()  # the installed packages' parts, rewards among them
    return list(REWARDS.names())


def describe_rewards() -> list[tuple[str, str]]:
    return [(n, REWARDS.get(n).description) for n in available_rewards()]


def get_reward(name: str) -> RewardSpec:
    if name not in REWARDS:
        load_plugins()
    if name not in REWARDS:
        raise UserError(f"unknown reward '{name}'; available: {', '.join(available_rewards())}")
    return REWARDS.get(name)
