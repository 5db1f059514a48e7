"""One iteration's completions for the text trainer: the allocator's stages (sample, score, let
the allocator see the outcomes, repeat), the advantages, and each process's share of what the
loss trains on. The synchronous trainer collects in its own process before each update; with
run.async_rollouts a producer process builds its own collector (`build_text_collector`) and runs
ahead of the trainer (flowrl/runtime/producers.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flowrl.core.advantages import estimate_advantages
from flowrl.core.allocation import allocate_in_stages, successes
from flowrl.core.seeds import sample_seed
from flowrl.errors import UserError
from flowrl.runtime.shards import ProcessShard, gather_real
from flowrl.text.config import TextConfig
from flowrl.text.data import PromptSet, load_prompt_set
from flowrl.text.generate import Generation, Partial, concat, continue_generation, partial_generation
from flowrl.text.policy import CausalLMPolicy, load_text_policy
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
    oldest_version: int | None = None  # partial rollouts: the weights' version of the batch's oldest token
    rollout_metrics: dict = field(default_factory=dict)  # what the collector adds to the metrics row

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
        self.version = 0  # the weights' version it samples with (a producer sets it before each batch)
        self.in_flight: list[tuple[int, list[Partial]]] = []  # partial rollouts: (prompt id, its group's rows), oldest first

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors the trainer's updates change (what a producer receives after each update)."""
        return self.policy.trainable_parameters()

    def state(self) -> dict:
        """What a checkpoint keeps of the collector: its allocator's state."""
        return self.allocator.state_dict()

    def collect(self, iteration: int) -> TextExperience:
        """The allocator's stages: sample, score, let it see the outcomes, repeat. Each process
        samples and scores its slice of a stage; the scores are gathered, so every process sees
        every outcome. With run.over_provision above 1: APRIL's partial rollouts instead."""
        if self.cfg.run.over_provision > 1:
            return self.collect_partial(iteration)
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
            return successes(self.reward.total(torch.cat(rewards)), cfg.allocator.success_threshold)

        allocate_in_stages(self.allocator, iteration, sample_stage)
        prompt_ids, rewards, valid = torch.cat(ids_all), torch.cat(rewards), torch.cat(valid)
        gen = concat(gens, self.policy.tokenizer.pad_token_id)
        # the advantages' group statistics use every sample drawn, also those the loss leaves out
        out, advantages, won = self.advantages(iteration, prompt_ids, rewards, valid)
        trained = torch.zeros(len(prompt_ids), dtype=torch.bool)
        trained[valid] = self.allocator.keep(prompt_ids[valid], won)
        self.allocator.observe(prompt_ids[valid], won)
        gen, rows = trained_share(gen, torch.cat(local_rows), trained, acc)
        return TextExperience(iteration, prompt_ids, rewards, valid, advantages, torch.cat(lengths), torch.cat(truncated),
                              trained, out.degenerate, out.group_ids, gen, rows)

    def advantages(self, iteration: int, prompt_ids: torch.Tensor, rewards: torch.Tensor, valid: torch.Tensor):
        """The estimator's output over the valid samples, the advantages of all [N] (0 where invalid)
        and the valid samples' successes."""
        if not bool(valid.any()):
            raise UserError(f"every reward of iteration {iteration} was invalid (NaN or inf); see reward.on_invalid")
        cfg = self.cfg
        out = estimate_advantages(cfg.advantage.kind, rewards[valid], prompt_ids[valid], self.reward.weights, std=cfg.advantage.std)
        advantages = torch.zeros(len(prompt_ids))
        advantages[valid] = out.advantages * out.mask
        return out, advantages, successes(self.reward.total(rewards[valid]), cfg.allocator.success_threshold)

    def collect_partial(self, iteration: int) -> TextExperience:
        """APRIL's active partial rollouts (arXiv 2509.18521): ceil(f x P) groups are in flight (f =
        run.over_provision, P = data.prompts_per_iteration); generation stops as soon as P groups
        have every completion finished, those P (the oldest first) are the batch, and the others
        stay in flight with their tokens, behaviour log-probs and generators, continued with the
        newer weights in the next round. One process (run.async_rollouts' producer), uniform
        allocator (validated)."""
        cfg, d = self.cfg, self.cfg.data
        stop, horizon = tuple(cfg.generation.stop), cfg.generation.max_new_tokens
        restarted, added = self._renew_in_flight(iteration)
        resumed = sum(1 for _, group in self.in_flight for r in group if r.tokens and not r.done(horizon))
        self._generate_until_enough()
        finished = {i for i, (_, group) in enumerate(self.in_flight) if all(r.done(horizon) for r in group)}
        finished = set(sorted(finished)[: d.prompts_per_iteration])  # the oldest first
        batch = [grp for i, grp in enumerate(self.in_flight) if i in finished]
        self.in_flight = [grp for i, grp in enumerate(self.in_flight) if i not in finished]
        prompt_ids = torch.tensor([pid for pid, group in batch for _ in group], dtype=torch.long)
        done_rows = [r for _, group in batch for r in group]
        gen = partial_generation(self.policy.tokenizer, done_rows, stop)
        prompts, columns = self.data.take(prompt_ids.tolist())
        rewards, valid = self.reward(prompts, gen.texts, columns)
        out, advantages, won = self.advantages(iteration, prompt_ids, rewards, valid)
        self.allocator.observe(prompt_ids[valid], won)
        n = len(prompt_ids)
        metrics = {"april/in_flight_groups": len(batch) + len(self.in_flight), "april/added_groups": added,
                   "april/carried_groups": len(self.in_flight), "april/resumed_rows": resumed, "april/restarted_rows": restarted,
                   "april/unfinished_rows": sum(1 for _, group in self.in_flight for r in group if not r.done(horizon))}
        return TextExperience(iteration, prompt_ids, rewards, valid, advantages, gen.lengths, gen.truncated,
                              torch.ones(n, dtype=torch.bool), out.degenerate, out.group_ids, gen, torch.arange(n),
                              oldest_version=min(r.version for r in done_rows), rollout_metrics=metrics)

    def _renew_in_flight(self, iteration: int) -> tuple[int, int]:
        """Before batch `iteration`: a completion whose first token is older than the batch may be
        (iteration - run.max_staleness) starts over, so the bound holds for every token; then new
        groups, drawn uniformly for this iteration, fill the flight up to ceil(f x P). Returns
        (completions restarted, groups added)."""
        cfg, d = self.cfg, self.cfg.data
        restarted = 0
        for _, group in self.in_flight:
            for r in group:
                if r.tokens and r.version < iteration - cfg.run.max_staleness:
                    r.restart(self.version)
                    restarted += 1
                elif not r.tokens:
                    r.version = self.version
        new = math.ceil(cfg.run.over_provision * d.prompts_per_iteration) - len(self.in_flight)
        if new <= 0:
            return restarted, 0
        gen = self.allocator.generator(iteration, salt=APRIL_SALT)  # not the allocator's own draw for the iteration
        pool = len(self.data)
        ids = torch.randperm(pool, generator=gen)[:new] if new <= pool else torch.randint(pool, (new,), generator=gen)
        prompts = self.policy.format(self.data.take(ids.tolist())[0])
        for j, (pid, prompt) in enumerate(zip(ids.tolist(), prompts)):
            seeds = [sample_seed(cfg.trainer.seed, iteration, j * d.group_size + k) for k in range(d.group_size)]
            self.in_flight.append((pid, [Partial(prompt, seed, version=self.version) for seed in seeds]))
        return restarted, new

    def _generate_until_enough(self) -> None:
        """Continue every unfinished completion in flight until P groups have all theirs finished."""
        g, per_iteration = self.cfg.generation, self.cfg.data.prompts_per_iteration
        pending, owner = [], []
        for i, (_, group) in enumerate(self.in_flight):
            for r in group:
                if not r.done(g.max_new_tokens):
                    pending.append(r)
                    owner.append(i)
        owner = torch.tensor(owner, dtype=torch.long)
        waiting = torch.bincount(owner, minlength=len(self.in_flight))

        def enough(done: torch.Tensor) -> bool:  # P groups with every completion finished
            left = waiting - torch.bincount(owner[done], minlength=len(self.in_flight))
            return int((left == 0).sum()) >= per_iteration

        if enough(torch.zeros(len(pending), dtype=torch.bool)):  # the last round may have finished enough already
            return
        was_training = self.policy.model.training
        self.policy.model.eval()
        try:
            continue_generation(self.policy.model, self.policy.tokenizer, pending, g.max_new_tokens, g.temperature, g.top_p,
                                tuple(g.stop), enough)
        finally:
            self.policy.model.train(was_training)


APRIL_SALT = 104_729  # the allocator generator's salt for the groups partial rollouts add


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


def producer_collector(cfg: TextConfig, allocator_state: dict, device: str = "") -> TextCollector:
    """What a producer process (run.async_rollouts) collects with: one process of its own, the
    trainer's allocator state, on `device` when given (run.producer_devices); its trainable
    weights then arrive from the trainer."""
    import dataclasses

    from flowrl.devices import pick_device
    from flowrl.runtime.processes import plain_accelerator

    if device:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=device))
    acc = plain_accelerator(pick_device(cfg.model.device).type == "cpu", "the text producer runs as one process", mixed_precision="no")
    return build_text_collector(cfg, acc, allocator_state, reference=False)
