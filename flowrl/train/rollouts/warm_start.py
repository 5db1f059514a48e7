"""rollout.kind warm_start: a group store as the warm start of an online run (DGPO, AWM, any
clean-sample objective). The first `rollout.warm_start.store_iterations` iterations train on
groups read from the group store data.offline, exactly as rollout.kind offline gives them (no
sampler call, no allocator call); every later iteration is a flat online iteration, exactly as
rollout.kind flat gives it. The rollout holds one of each and hands every iteration to one of
them, by the iteration alone, so a run stopped in either phase resumes where it was.

Two things are translated from the store's terms into the online run's, so that one metrics row
reads the same in both phases: the store's reward channels are put in the online reward's order
(its training totals and advantages are unchanged), and a group's id (the store's group index
under rollout.kind offline) becomes the index of the group's prompt in the online prompt pool,
which the reward columns of the row look prompts up by. Every store group therefore needs a
prompt of its own in the pool (a store built from the run's prompts has one); the grouping of
the samples is unchanged. Each row says its phase (`warm_start_store`: 1 or 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flowrl.errors import ConfigError, UserError, check_positive
from flowrl.train.experience import Experience
from flowrl.train.parts import Rollout, register_rollout
from flowrl.train.rollouts.flat import FlatRollout
from flowrl.train.rollouts.offline import OfflineRollout


@dataclass
class WarmStartOptions:
    """A group store as the warm start of an online run (rollout.kind: warm_start; docs/offline.md).
    Iterations 0 .. store_iterations - 1 train on the groups of data.offline (rollout.kind offline:
    data.prompts_per_iteration groups each, in its seeded order, no sampling); every later one
    samples online (rollout.kind flat)."""

    # iterations trained from the store before sampling starts; 0: one pass over the store,
    # ceil(groups in the store / data.prompts_per_iteration); more than a pass goes round the store again
    store_iterations: int = 0


def store_iterations(cfg, store_groups: int) -> int:
    """The iterations of the store phase: the option, or (0) one pass over a store of `store_groups` groups."""
    n = cfg.rollout.warm_start.store_iterations
    return n if n > 0 else math.ceil(store_groups / cfg.data.prompts_per_iteration)


def pool_ids(prompts: list[str], pool: list[str], where: str) -> torch.Tensor:
    """For each store group (by its `prompts`), a pool index holding the same prompt, no index
    twice (a prompt the pool holds n times takes at most n groups), or one sentence."""
    free: dict[str, list[int]] = {}
    for i, p in enumerate(pool):
        free.setdefault(p, []).append(i)
    ids, orphans = [], []
    for p in prompts:
        if free.get(p):
            ids.append(free[p].pop(0))
        else:
            orphans.append(p)
    if orphans:
        raise UserError(f"rollout.kind warm_start trains each group of {where} under its prompt's index in the online prompt "
                        f"pool (data.prompts / data.prompt_file), but {len(orphans)} of its {len(prompts)} groups have no pool "
                        f"prompt of their own (the first: '{orphans[0]}'); build the store from the run's prompts, without "
                        "--num-prompts beyond them, or train on it with rollout.kind offline")
    return torch.tensor(ids, dtype=torch.long)


@register_rollout
class WarmStartRollout(Rollout):
    name = "warm_start"
    options = WarmStartOptions
    needs_prompts = True  # the online phase samples the pool
    needs_rewards = True  # and scores its samples
    shards = OfflineRollout.shards and FlatRollout.shards
    runs_ahead = False  # a producer would have to skip the store phase; run.async_rollouts is refused

    def __init__(self, ctx):
        super().__init__(ctx)
        self.offline = OfflineRollout(ctx)  # the store phase: never calls the sampler or the allocator
        store, where = self.offline.store, f"data.offline '{ctx.cfg.data.offline}'"
        self.store_iterations = store_iterations(ctx.cfg, len(store))
        # the store's reward channels, in the online reward's order (the metrics row weighs them with its weights)
        missing = [c for c in ctx.reward_fn.channel_names if c not in store.channel_names]
        if missing:
            raise UserError(f"rollout.kind warm_start logs the store phase under the online reward's channels, and {where} did "
                            f"not score {', '.join(missing)}; its channels: {', '.join(store.channel_names)}")
        self.columns = torch.tensor([store.channel_names.index(c) for c in ctx.reward_fn.channel_names], dtype=torch.long)
        self.pool_ids = pool_ids([g.prompt for g in store.groups], ctx.prompts, where)
        self.flat = FlatRollout(ctx)  # the online phase

    @classmethod
    def provides(cls, cfg) -> set[str]:
        return OfflineRollout.provides(cfg) & FlatRollout.provides(cfg)

    @classmethod
    def missing_reason(cls, cfg, data: str) -> str:
        if data in FlatRollout.provides(cfg):
            return "(its store phase trains on a group store's clean samples, which hold no transitions)"
        return FlatRollout.missing_reason(cfg, data)

    @classmethod
    def validate(cls, cfg) -> None:
        if not cfg.data.offline:
            raise ConfigError("rollout.kind warm_start needs data.offline, the group store of its first iterations (build one "
                              "with `flowrl offline build CONFIG -o DIR`)")
        check_positive("rollout.warm_start.store_iterations", cfg.rollout.warm_start.store_iterations, strict=False)
        OfflineRollout.validate(cfg)
        FlatRollout.validate(cfg)

    def in_store_phase(self, iteration: int) -> bool:
        return iteration < self.store_iterations

    def collect(self, iteration: int) -> Experience:
        if not self.in_store_phase(iteration):
            experience = self.flat.collect(iteration)
            experience.metrics["warm_start_store"] = 0
            return experience
        experience = self.offline.collect(iteration)
        # the same groups (store ids map one to one onto pool ids), named as the online phase names them
        experience.prompt_ids = self.pool_ids[experience.prompt_ids]
        experience.rewards = experience.rewards[:, self.columns]
        experience.metrics["warm_start_store"] = 1
        return experience

    def close(self) -> None:
        self.offline.close()
        self.flat.close()
