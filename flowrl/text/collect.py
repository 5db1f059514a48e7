"""One iteration's completions for the text trainer: the allocator's stages (sample, score, let
the allocator see the outcomes, repeat), the advantages, and each process's share of what the
loss trains on. The synchronous trainer collects in its own process before each update; with
run.async_rollouts a producer process builds its own collector (`build_text_collector`) and runs
ahead of the trainer (flowrl/train/async_rollouts.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.core.advantages import estimate_advantages
from flowrl.core.allocation import allocate_in_stages
from flowrl.errors import UserError
from flowrl.sampling.noise import sample_seed
from flowrl.text.config import TextConfig
from flowrl.text.data import PromptSet, load_prompt_set
from flowrl.text.generate import Generation, concat
from flowrl.text.policy import CausalLMPolicy, load_text_policy
from flowrl.train.experience import ProcessShard, gather_real
from flowrl.train.rollouts.common import successes
from rewards.text import TextReward


@dataclass
class TextExperience:
    """One iteration's completions: the whole batch's prompts, rewards and advantages (the same on
    every process), and this process's share of the completions themselves."""

    iteration: int
    prompt_ids: torch.Tensor  # [N] index into the prompt set, every sample drawn
    rewards: torch.Tensor  # [N, K]
    valid: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    lengths: torch.Tensor  # [N] completion tokens
    truncated: torch.Tensor  # [N] bool
    trained: torch.Tensor  # [N] bool: the samples the loss sees (the allocator's `keep`; all, but for reinforce_ada)
    degenerate: torch.Tensor  # [G] bool per prompt drawn (sorted ids `groups`): every valid reward equal
    groups: torch.Tensor  # [G]
    gen: Generation  # [n] this process's completions that train
    rows: torch.Tensor  # [n] each one's index among the N, -1 for a padding copy (the processes' shares are padded)

    @property
    def local_advantages(self) -> torch.Tensor:
        return torch.where(self.rows >= 0, self.advantages[self.rows.clamp(min=0)], torch.zeros(()))

    @property
    def local_valid(self) -> torch.Tensor:
        return (self.rows >= 0) & self.valid[self.rows.clamp(min=0)]


class TextCollector:
    """What collecting needs: the config, the accelerator (its processes split each stage), the
    prompts, the policy that samples, the reward and the allocator."""

    def __init__(self, cfg: TextConfig, accelerator, data: PromptSet, policy: CausalLMPolicy, reward: TextReward, allocator):
        self.cfg, self.accelerator, self.data, self.policy, self.reward, self.allocator = cfg, accelerator, data, policy, reward, allocator

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors the trainer's updates change (what a producer receives after each update)."""
        return self.policy.trainable_parameters()

    def state(self) -> dict:
        """What a checkpoint keeps of the collector: its allocator's state."""
        return self.allocator.state_dict()

    def collect(self, iteration: int) -> TextExperience:
        """The allocator's stages: sample, score, let it see the outcomes, repeat. Each process
        samples and scores its slice of a stage; the scores are gathered, so every process sees
        every outcome."""
        cfg, acc = self.cfg, self.accelerator
        ids_all, gens, local_rows, rewards, valid, lengths, truncated = [], [], [], [], [], [], []

        def sample_stage(ids: torch.Tensor, offset: int) -> torch.Tensor:
            m = len(ids)
            seeds = [sample_seed(cfg.trainer.seed, iteration, offset + j) for j in range(m)]
            shard = ProcessShard(m, acc.num_processes, acc.process_index)
            prompts, columns = self.data.take(shard.take(ids.tolist()))
            gen = self.policy.generate(prompts, shard.take(seeds), cfg.generation)
            r, ok = self.reward(prompts, gen.texts, columns)
            ids_all.append(ids), gens.append(gen)
            local_rows.append(torch.where(shard.positions < m, offset + shard.positions, -1))
            # every process's scores, validity, lengths and truncation, in one gather
            outcome = gather_real(acc, torch.cat([r, torch.stack([ok, gen.lengths, gen.truncated], 1).to(r.dtype)], 1), m)
            k = r.shape[1]
            rewards.append(outcome[:, :k]), valid.append(outcome[:, k].bool())
            lengths.append(outcome[:, k + 1].long()), truncated.append(outcome[:, k + 2].bool())
            return successes(cfg, self.reward.total(torch.cat(rewards)))

        allocate_in_stages(self.allocator, iteration, sample_stage)
        prompt_ids, rewards, valid = torch.cat(ids_all), torch.cat(rewards), torch.cat(valid)
        gen = concat(gens, self.policy.tokenizer.pad_token_id)
        if not bool(valid.any()):
            raise UserError(f"every reward of iteration {iteration} was invalid (NaN or inf); see reward.on_invalid")
        # the advantages' group statistics use every sample drawn, also those the loss leaves out
        out = estimate_advantages(cfg.advantage.kind, rewards[valid], prompt_ids[valid], self.reward.weights,
                                  std=cfg.advantage.std)
        advantages = torch.zeros(len(prompt_ids))
        advantages[valid] = out.advantages * out.mask
        won = successes(cfg, self.reward.total(rewards[valid]))
        trained = torch.zeros(len(prompt_ids), dtype=torch.bool)
        trained[valid] = self.allocator.keep(prompt_ids[valid], won)
        self.allocator.observe(prompt_ids[valid], won)
        gen, rows = trained_share(gen, torch.cat(local_rows), trained, acc)
        return TextExperience(iteration, prompt_ids, rewards, valid, advantages, torch.cat(lengths), torch.cat(truncated),
                              trained, out.degenerate, out.group_ids, gen, rows)


def trained_share(gen: Generation, rows: torch.Tensor, trained: torch.Tensor, acc) -> tuple[Generation, torch.Tensor]:
    """This process's completions that the loss trains on, and their rows among the N; padded
    with copies marked -1 to the largest share of any process (the processes' micro-batches must
    pair up for DDP)."""
    if bool(trained.all()):  # the same on every process: all skip the collective below, or none does
        return gen, rows
    mine = ((rows >= 0) & trained[rows.clamp(min=0)]).nonzero().squeeze(1)
    most = int(acc.reduce(torch.tensor(len(mine), device=acc.device), "max"))
    pad = max(most, 1) - len(mine)
    index = torch.cat([mine, torch.zeros(pad, dtype=torch.long)])
    return gen.select(index), torch.cat([rows[mine], torch.full((pad,), -1, dtype=torch.long)])


def build_text_collector(cfg: TextConfig, accelerator, allocator_state: dict | None = None, reference: bool = True) -> TextCollector:
    """The prompts, the policy as the trainer builds it, the reward and the allocator (in
    `allocator_state` when given). `reference`: keep the frozen copy a full fine-tune's KL needs
    (a producer, which never computes the KL, does without)."""
    data = load_prompt_set(cfg, cfg.data.split)
    policy = load_text_policy(cfg, device=accelerator.device, reference=reference)
    reward = TextReward(dict(cfg.reward.weights), dict(cfg.reward.options), cfg.reward.on_invalid)
    d = cfg.data
    allocator = cfg.allocator.build(len(data), d.prompts_per_iteration, d.group_size, cfg.trainer.seed)
    if allocator_state is not None:
        allocator.load_state_dict(allocator_state)
    return TextCollector(cfg, accelerator, data, policy, reward, allocator)


def producer_collector(cfg: TextConfig, allocator_state: dict) -> TextCollector:
    """What a producer process (run.async_rollouts) collects with: one process of its own, the
    trainer's allocator state; its trainable weights then arrive from the trainer."""
    from flowrl.devices import pick_device
    from flowrl.train.processes import plain_accelerator

    acc = plain_accelerator(pick_device(cfg.model.device).type == "cpu", "the text producer runs as one process", mixed_precision="no")
    return build_text_collector(cfg, acc, allocator_state, reference=False)
