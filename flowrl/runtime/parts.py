"""The protocol an objective follows under either trainer (the image trainer's objectives in
flowrl/train/objectives, the text trainer's in flowrl/text/objective.py): registered under the
name its config selects, its options a dataclass of its own, its checks in `validate`, and one
`update(experience) -> metrics` per iteration that takes the trainer's optimizer steps through
`ctx.optimizer_step()` (clip, the non-finite policy, step, zero). What an experience holds and
what `ctx` lends are each trainer's own; the runtime never looks inside them."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar


class Objective:
    name: ClassVar[str]
    options: ClassVar[type | None] = None  # a dataclass: the config section of the objective's own options
    # shared options whose default under this objective is its reference's, not the schema's ({"trainer.kl_beta":
    # 1e-4}): they sit under the preset and the command line, which still set them
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, ctx: Any):
        self.ctx = ctx

    @classmethod
    def validate(cls, cfg: Any) -> None:
        """Raise ConfigError (one sentence naming the key and what is allowed) for settings this
        objective cannot run with."""

    def behaviour_weights(self):
        """The weights rollouts sample with, as a context manager (default: the current ones)."""
        return contextlib.nullcontext()

    def update(self, experience: Any) -> dict:
        """Optimizer steps on one iteration's experience; returns the metrics row's columns."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Tensor files for the checkpoint ({file name: tensors}); restored by load_state_dict."""
        return {}

    def load_state_dict(self, state: dict, checkpoint: str) -> None:
        pass
