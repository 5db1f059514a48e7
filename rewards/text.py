"""Text rewards: plain functions of (prompts, completions, **columns) -> [n] scores, where
`columns` are the prompt dataset's columns for each completion (the ground truth among them).
Registered by name in a Registry as every part is; `TextReward` combines several with weights and
checks what they return (docs/text.md).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

import torch

from flowrl.errors import UserError
from flowrl.registry import Registry

TEXT_REWARDS = Registry("reward.weights", "Text rewards")  # the text config's reward.weights choose among these


@dataclass(frozen=True)
class TextRewardSpec:
    name: str
    description: str
    fn: Callable  # (prompts, completions, **columns, **options) -> [n] scores


def register_text(name: str, description: str):
    """Decorator: `fn(prompts, completions, **columns) -> list[float] | Tensor [n]`. Keyword
    arguments after the columns are its options (reward.options.NAME)."""

    def wrap(fn):
        TEXT_REWARDS.register(TextRewardSpec(name, description, fn))
        return fn

    return wrap


def available_text_rewards() -> list[str]:
    return list(TEXT_REWARDS.names())


_NUMBER = r"-?[\d,]*\.?\d+"


def extract_number(text: str) -> str | None:
    """The final answer of a completion: GSM8K's `#### N`, else the last `\\boxed{N}`, as a plain
    number string (commas dropped); None where there is neither."""
    found = re.findall(r"####\s*(" + _NUMBER + ")", text) or re.findall(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}", text)
    return found[-1].replace(",", "") if found else None


def _same_number(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return float(a) == float(str(b).replace(",", ""))
    except ValueError:
        return False


@register_text("exact_match", "1 where the completion, stripped, equals the `answer` column")
def exact_match(prompts, completions, answer, **_):
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


@register_text("numeric", "1 where the final number (GSM8K's #### N or \\boxed{N}) equals the `answer` column's")
def numeric(prompts, completions, answer, **_):
    return [float(_same_number(extract_number(c), extract_number(str(a)) or str(a))) for c, a in zip(completions, answer)]


@register_text("format", "1 where the whole completion matches the regular expression `pattern` (default: digits only)")
def format_check(prompts, completions, pattern: str = r"\d+", **_):
    rx = re.compile(pattern, re.DOTALL)
    return [float(rx.fullmatch(c.strip()) is not None) for c in completions]


def _options_of(fn) -> set[str]:
    params = list(inspect.signature(fn).parameters.values())[2:]
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is not p.empty}


class TextReward:
    """Weighted text rewards: `__call__` returns rewards [n, K] (one channel per name) and a
    validity mask [n]; a reward that returns the wrong count, or a non-number, is a user error
    naming it; NaN marks a sample invalid (on_invalid drop) or stops the run (error)."""

    def __init__(self, weights: dict[str, float], options: dict[str, dict] | None = None, on_invalid: str = "error"):
        unknown = [n for n in weights if n not in TEXT_REWARDS]
        if unknown:
            raise UserError(f"reward.weights names unknown text reward '{unknown[0]}'; available: {', '.join(available_text_rewards())}")
        if not weights:
            raise UserError("reward.weights is empty; name at least one text reward, for example exact_match: 1.0")
        self.names = list(weights)
        self.weights = torch.tensor([float(weights[n]) for n in self.names])
        self.options = {n: dict((options or {}).get(n, {})) for n in self.names}
        for n, opts in self.options.items():
            bad = set(opts) - _options_of(TEXT_REWARDS.get(n).fn)
            if bad:
                raise UserError(f"reward.options.{n} has no option '{sorted(bad)[0]}'; it takes: "
                                f"{', '.join(sorted(_options_of(TEXT_REWARDS.get(n).fn))) or 'none'}")
        self.on_invalid = on_invalid

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(completions)
        channels = []
        for name in self.names:
            fn = TEXT_REWARDS.get(name).fn
            try:
                out = fn(prompts, completions, **columns, **self.options[name])
            except TypeError as exc:
                raise UserError(f"text reward '{name}' could not be called with the dataset's columns "
                                f"({', '.join(columns) or 'none'}): {exc}") from None
            try:
                values = torch.as_tensor(out, dtype=torch.float32).reshape(-1)
            except (TypeError, ValueError, RuntimeError):
                raise UserError(f"text reward '{name}' returned {type(out).__name__}, not a list of numbers") from None
            if values.numel() != n:
                raise UserError(f"text reward '{name}' returned {values.numel()} scores for {n} completions")
            channels.append(values)
        rewards = torch.stack(channels, 1)
        valid = torch.isfinite(rewards).all(1)
        if not bool(valid.all()) and self.on_invalid == "error":
            bad = self.names[int((~torch.isfinite(rewards)).any(0).nonzero()[0])]
            raise UserError(f"text reward '{bad}' returned NaN or inf for {int((~valid).sum())} of {n} completions; "
                            "set reward.on_invalid=drop to train on the rest")
        return torch.nan_to_num(rewards, nan=0.0, posinf=0.0, neginf=0.0), valid

    def total(self, rewards: torch.Tensor) -> torch.Tensor:
        return rewards @ self.weights
