"""The producer process of `run.async_rollouts` for images (flowrl/runtime/producers.py holds
the protocol): the policy built as the trainer builds it, its own reward and allocator, and the
rollout's `sample`, which returns tensors only. The trainer sends the weights its objective
samples with (`Objective.behaviour_weights`) after every update, and builds the Experience of
each batch on its own policy (`Rollout.experience`), so the transitions' re-evaluations and the
objective's forwards happen in the trainer, against the behaviour log-probs the producer stored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flowrl.models import load_policy
from flowrl.schema import Config
from flowrl.train.parts import TrainContext
from flowrl.train.monitor.watch import held_out_prompts
from flowrl.train.prompts import load_prompts, prompt_set
from flowrl.train.registry import add_adapter, objective_class, rollout_class
from rewards import AsyncRewardRunner, MultiReward


class ImageCollector:
    """What `RolloutProducer` asks of a collector: the tensors the trainer's updates change, a batch
    per iteration, its allocator and the allocator's state after it."""

    def __init__(self, policy, rollout, allocator):
        self.policy, self.rollout, self.allocator = policy, rollout, allocator

    def weights(self) -> dict[str, torch.Tensor]:
        return self.policy.named_trainable_parameters()

    def collect(self, iteration: int) -> Any:
        self.policy.transformer.eval()
        return self.rollout.sample(iteration)

    def state(self) -> dict:
        return self.allocator.state_dict()


def image_producer(cfg: Config, allocator_state: dict, rewards: dict | None = None, device: str = "") -> ImageCollector:
    """Runs in the producer process: one process of its own, no progress bars, the trainer's
    allocator state, on `device` when given (run.producer_devices); its trainable weights then
    arrive from the trainer."""
    from flowrl.devices import pick_device
    from flowrl.sampling.precision import autocast_precision
    from flowrl.runtime.processes import plain_accelerator

    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, progress=False))
    if device:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=device))
    cpu = pick_device(cfg.model.device).type == "cpu"
    acc = plain_accelerator(cpu, "the image producer runs as one process",
                            mixed_precision=autocast_precision(cfg.trainer.mixed_precision, cpu))
    prompts = load_prompts(cfg.data)
    policy = load_policy(cfg.model, device=acc.device, prompts=prompt_set(cfg.data, prompts, held_out_prompts(cfg)))  # model.text_encoders cached: the trainer's file
    if cfg.lora.enabled:
        add_adapter(policy, cfg)
    else:
        policy.enable_full_finetune()
    policy.net = acc.prepare_model(policy.transformer)  # trainer.mixed_precision's autocast, as the trainer's forwards
    policy.compile(cfg.model.compile, cfg.sampling.batch_size)
    d = cfg.data
    allocator = cfg.allocator.build(len(prompts), d.prompts_per_iteration, d.group_size, cfg.trainer.seed)
    allocator.load_state_dict(allocator_state)
    reward_fn = MultiReward.from_config(cfg.reward, rewards=rewards)
    ctx = TrainContext(cfg=cfg, accelerator=acc, policy=policy, params=policy.named_trainable_parameters(), prompts=prompts,
                       reward_fn=reward_fn, reward_runner=AsyncRewardRunner(reward_fn, max_workers=reward_fn.concurrency), allocator=allocator, optimizer_step=None,
                       optimizer=None, objective_needs=objective_class(cfg.objective.kind).needs, plan=None)
    return ImageCollector(policy, rollout_class(cfg.rollout.kind)(ctx), allocator)
