"""rollout.kind offline: groups read from a group store (data.offline, built by `flowrl offline
build`), no sampler call. Each iteration takes data.prompts_per_iteration groups in a seeded
order that visits every group once per pass over the store; processes split them by whole
groups. Rewards are the stored channels weighted by reward.weights / reward.channel_weights
(channels the config does not name weigh 0); advantages are normalised per group as online.
A store of edits keeps each group's prompt as its text ("instruction [source: name]"); an editing run
takes the edits themselves, sources included, from its data.edits, which must hold every stored prompt.
"""

from __future__ import annotations

import torch

from flowrl.core.seeds import sample_seed
from flowrl.errors import ConfigError, UserError
from flowrl.offline.store import GroupStore
from flowrl.runtime.shards import ProcessShard
from flowrl.train.experience import SAMPLES, Experience, SampleBatch
from flowrl.train.parts import Rollout, register_rollout
from flowrl.train.rollouts.common import group_advantages
from rewards.multi import weights_for_channels

STORE_ORDER = 999_941  # the `index` key of the store's visiting order (an epoch's permutation)


def stored_edits(cfg, prompts: list[str]) -> dict[str, str]:
    """The stored prompts' edits (EditPrompts, their sources included) from the run's data.edits, by text;
    one sentence for a run without data.edits or a stored prompt it does not hold."""
    from flowrl.train.prompts import load_prompts

    if not cfg.data.edits:
        raise UserError(f"model.kind {cfg.model.kind} edits source images, which the group store data.offline "
                        f"'{cfg.data.offline}' does not keep; give data.edits, the edits the store was built from")
    edits = {str(p): p for p in load_prompts(cfg.data)}
    missing = [p for p in dict.fromkeys(prompts) if p not in edits]
    if missing:
        raise UserError(f"{len(missing)} of the group store '{cfg.data.offline}''s prompts are not edits of data.edits "
                        f"'{cfg.data.edits}' (the first: '{missing[0]}'); give the data.edits the store was built from")
    return edits


@register_rollout
class OfflineRollout(Rollout):
    name = "offline"
    needs_prompts = False
    needs_rewards = False

    @classmethod
    def provides(cls, cfg) -> set[str]:
        return {SAMPLES}

    @classmethod
    def validate(cls, cfg) -> None:
        if not cfg.data.offline:
            raise ConfigError("rollout.kind offline needs data.offline, a group store directory (build one with "
                              "`flowrl offline build CONFIG -o DIR`)")

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.cfg
        self.store = GroupStore.open(cfg.data.offline)
        missing = sorted(set(cfg.reward.weights) - {c.split("/")[0] for c in self.store.channel_names})
        if missing:
            raise UserError(f"reward.weights names {', '.join(missing)}, which the group store data.offline '{cfg.data.offline}' "
                            f"did not score; its channels: {', '.join(self.store.channel_names)}")
        self.weights = weights_for_channels(self.store.channel_names, cfg.reward.weights, cfg.reward.channel_weights)
        if len(self.store) < cfg.data.prompts_per_iteration:
            raise UserError(f"data.prompts_per_iteration ({cfg.data.prompts_per_iteration}) exceeds the {len(self.store)} groups "
                            f"of the group store '{cfg.data.offline}'")
        self._orders: dict[int, list[int]] = {}
        self.prompt_of = stored_edits(cfg, [g.prompt for g in self.store.groups]) if ctx.policy.edits else {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(sample_seed(self.ctx.cfg.trainer.seed, epoch, STORE_ORDER))
            self._orders = {epoch: torch.randperm(len(self.store), generator=gen).tolist()}
        return self._orders[epoch]

    def groups_of(self, iteration: int) -> list[int]:
        """The store's groups trained at `iteration`: the next slice of the current pass's order."""
        p, n = self.ctx.cfg.data.prompts_per_iteration, len(self.store)
        return [self._order(k // n)[k % n] for k in range(iteration * p, (iteration + 1) * p)]

    def collect(self, iteration: int) -> Experience:
        ctx, acc = self.ctx, self.ctx.accelerator
        chosen = self.groups_of(iteration)
        groups = [self.store.groups[j] for j in chosen]
        sizes = torch.tensor([g.size for g in groups])
        starts = torch.cumsum(sizes, 0) - sizes
        rewards = torch.tensor([row for g in groups for row in g.rewards], dtype=torch.float32)
        valid = torch.tensor([v for g in groups for v in g.valid])
        prompt_ids = torch.repeat_interleave(torch.tensor(chosen), sizes)  # a group's id: its index in the store
        advantages, _, adv_metrics = group_advantages(ctx.cfg, rewards, prompt_ids, valid, self.weights, iteration)
        shard = ProcessShard(len(chosen), acc.num_processes, acc.process_index)
        samples = []
        for position, j in zip(shard.positions.tolist(), shard.take(chosen)):
            g = self.store.groups[j]
            x0 = self.store.x0([j])
            if self.store.data == "images":
                x0 = ctx.policy.encode_images(x0).cpu()
            real = position < len(chosen)
            index = starts[position] + torch.arange(g.size) if real else torch.full((g.size,), len(valid))
            samples.append(SampleBatch(x0, [self.prompt_of.get(g.prompt, g.prompt)] * g.size, torch.tensor(g.seeds), index))
        metrics = {**adv_metrics, "sampled": 0, "store_reward_mean": (rewards[valid] @ self.weights).mean().item(),
                   "store_pass": iteration * len(chosen) // len(self.store)}
        return Experience(iteration, rewards, prompt_ids, valid, advantages, "float32", samples=samples, metrics=metrics,
                          reward_totals=rewards @ self.weights)
