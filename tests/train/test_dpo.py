"""Online Diffusion-DPO (objective.kind dpo) against the reference's code, written out here
(yifan123/flow_grpo scripts/train_sd3_dpo.py: pair formation, the timestep draw, the loss; never
imported from flowrl), and whole iterations of it through the trainer."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.train.objectives.dpo import DPO, PairBatch, dpo_loss, group_pairs, training_grid, training_sigmas
from run_checks import assert_close_relative, assert_resume_repeats, lora_grads, run_metrics, trainable

FAST = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
        "objective.kind=dpo", "objective.dpo.timesteps=2"]


def _dpo(tiny_sd3_dir, policy, overrides=()):
    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "lora.rank=4", "lora.alpha=8", "objective.kind=dpo", *overrides])
    obj = DPO.__new__(DPO)  # the loss alone: no optimizer, no accelerator
    obj.ctx = SimpleNamespace(cfg=cfg, policy=policy, params=policy.named_trainable_parameters())
    obj.opts, obj.snapshot, obj.steps = cfg.objective.dpo, None, 0
    return obj


def test_the_loss_is_the_references_worked_value():
    loss, z = dpo_loss(torch.tensor([0.30]), torch.tensor([0.32]), torch.tensor([0.40]), torch.tensor([0.38]), 100.0)
    assert z.item() == pytest.approx(2.0, rel=1e-5)  # -50 x ((0.30 - 0.32) - (0.40 - 0.38))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-2.0)), rel=1e-5)  # 0.126928


def test_pairs_are_each_groups_first_best_and_first_worst():
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 3])
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.3, 0.3, 0.3, 0.2, 0.7, 0.5])
    # group 0: first max 1, first min 0; group 1 ties: members 1 and 0 (the reference's fallback); group 3: one sample
    assert group_pairs(rewards, groups, "reference") == [(1, 0), (5, 4), (8, 7)]
    assert group_pairs(rewards, groups, "skip") == [(1, 0), (8, 7)]


def test_the_timestep_draw_is_the_references_logit_normal_index_into_the_training_sigmas(tiny_sd3_dir, policy):
    obj = _dpo(tiny_sd3_dir, policy)
    s = obj.ctx.cfg.sampling
    grid = training_grid(policy, s.schedule, s.shift)
    # the reference's scheduler.sigmas at its 1000 training timesteps (shift from the pipeline's scheduler config)
    ref = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=policy.pipe.scheduler.config.shift).sigmas.double()
    assert torch.allclose(grid, ref, atol=1e-6)
    drawn = training_sigmas(grid, 5, "logit_normal", torch.Generator().manual_seed(7))
    u = torch.sigmoid(torch.randn(5, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
    assert torch.equal(drawn, grid[(u * 1000).long()])


def _reference_loss(policy, x0_w, x0_l, eps, sigma, prompts, beta):
    """train_sd3_dpo.py: winner and loser noised with the same eps and sigma, float32 errors as means
    over elements, the reference's errors under no_grad with the adapter disabled, then
    -log sigmoid(-(beta / 2) ((e_w - e_ref_w) - (e_l - e_ref_l))), the mean over pairs."""
    t = sigma.float().reshape(-1, 1, 1, 1)
    xw, xl = (1 - t) * x0_w + t * eps, (1 - t) * x0_l + t * eps
    cond = policy.encode(prompts)
    with policy.guidance(1.0):
        vw, vl = policy.velocity(xw, sigma, cond), policy.velocity(xl, sigma, cond)
        with torch.no_grad(), policy.reference():
            vw_ref, vl_ref = policy.velocity(xw, sigma, cond), policy.velocity(xl, sigma, cond)
    err = lambda v, x0: ((v.float() - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    model_diff = err(vw, x0_w) - err(vl, x0_l)
    ref_diff = err(vw_ref, x0_w) - err(vl_ref, x0_l)
    return -torch.nn.functional.logsigmoid(-0.5 * beta * (model_diff - ref_diff)).mean()


def test_dpo_loss_and_gradient_are_the_reference_codes(tiny_sd3_dir, policy):
    obj = _dpo(tiny_sd3_dir, policy)
    g = torch.Generator().manual_seed(3)
    x0_w, x0_l, eps = (torch.randn(2, *policy.latent_shape(), generator=g) for _ in range(3))
    sigma, prompts = torch.tensor([0.83, 0.41], dtype=torch.float64), ["a red circle", "two blue squares"]
    batch = PairBatch(torch.cat([x0_w, x0_l]), prompts * 2, torch.tensor([11, 12]), 1.0)
    with policy.guidance(1.0):
        err, err_ref = obj.pair_errors(batch, sigma, eps, policy.encode(batch.prompts))
    ours = dpo_loss(err[:2], err_ref[:2], err[2:], err_ref[2:], 100.0)[0].mean()
    ref = _reference_loss(policy, x0_w, x0_l, eps, sigma, prompts, 100.0)
    assert_close_relative(ours.detach(), ref.detach(), 1e-5)
    assert_close_relative(lora_grads(ours, policy), lora_grads(ref, policy), 1e-5)


def test_one_iteration_takes_one_step_from_log_2_and_samples_with_the_reference(tmp_path, tiny_sd3_dir):
    from flowrl.train.loop import Trainer

    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", *FAST, "trainer.iterations=2", "run.checkpoint_every=0",
                                    "trainer.lr=1e-2"])
    assert cfg.trainer.kl_beta == 0.0  # the objective's default: no KL beside DPO's own tie to the reference
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    first = {k: v.detach().clone() for k, v in trainer.params.items()}
    rows = trainer.train()
    # 2 groups: 2 pairs in one batch of sampling.batch_size / 2 pairs, 2 repetitions, one step over them
    assert [(r["optimizer_steps"], r["trained_transitions"], r["trained_pairs"]) for r in rows] == [(1, 2, 2)] * 2
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference at the start: z = 0
    assert rows[1]["loss"] != pytest.approx(math.log(2), abs=1e-6)
    assert any(not torch.equal(first[k], v) for k, v in trainer.params.items())
    # sampler reference, never refreshed: the rollouts sample with the initial adapter (the base) all along
    assert all(torch.equal(first[k], v) for k, v in trainer.objective.snapshot.shadow.items())


def test_the_refreshed_reference_is_the_policy_after_its_steps_and_resumes_exactly(tmp_path, tiny_sd3_dir):
    common = [f"model.path={tiny_sd3_dir}", *FAST, "run.checkpoint_every=2", "trainer.lr=1e-2", "objective.dpo.reference_refresh=3"]
    straight = tmp_path / "straight"
    assert main(["train", "tiny_jpeg", *common, "trainer.iterations=4", "--run-dir", str(straight)]) == 0

    def reference(i: int) -> dict[str, torch.Tensor]:
        return load_file(str(straight / "checkpoints" / f"iter_{i:06d}" / "dpo_reference.safetensors"))

    assert int(reference(2).pop("__steps__")) == 2 and int(reference(4).pop("__steps__")) == 4
    weights2, weights4 = trainable(straight, 2), trainable(straight, 4)
    ref4 = reference(4)
    assert all(torch.count_nonzero(v) == 0 for k, v in reference(2).items() if "lora_B" in k)  # not yet refreshed: the base
    assert any(not torch.equal(ref4[k], weights4[k]) for k in weights4)  # refreshed after step 3, not after step 4
    assert any(torch.count_nonzero(v) > 0 for k, v in ref4.items() if "lora_B" in k)
    assert any(not torch.equal(weights2[k], weights4[k]) for k in weights4)
    assert_resume_repeats(["tiny_jpeg", *common], straight, tmp_path / "stopped")
    assert run_metrics(straight)[3]["loss"] != run_metrics(straight)[2]["loss"]


class ConstantVelocity:
    """A stand-in policy whose velocity is one trainable tensor w at every x and sigma (the reference's: 0).
    Each pair's errors then depend on its samples and its noise (keyed by its seed) alone, not on which
    sigmas a batch layout happens to draw, so layouts can be compared loss for loss."""

    def __init__(self, w: torch.Tensor):
        self.w = torch.nn.Parameter(w.clone())
        self.transformer, self.net, self.at_reference = torch.nn.Module(), None, False

    def encode(self, prompts):
        return None

    @contextlib.contextmanager
    def guidance(self, scale):
        yield

    @contextlib.contextmanager
    def reference(self):
        self.at_reference = True
        try:
            yield
        finally:
            self.at_reference = False

    def velocity(self, x, sigma, cond):
        return torch.zeros_like(x) if self.at_reference else self.w.expand_as(x)


def _dpo_update(accelerator, batches: list[PairBatch], w0: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """One DPO update over `batches` on this (fake) process: its logged stats and the gradient it brought
    to the one optimizer step."""
    from flowrl.train.objectives.implicit import padded_rounds

    cfg = load_config("tiny_jpeg", ["objective.kind=dpo", "objective.dpo.timesteps=2"])
    policy, grads = ConstantVelocity(w0), []

    def optimizer_step():
        grads.append(policy.w.grad.clone())
        policy.w.grad = None
        return 0.0

    obj = DPO.__new__(DPO)
    obj.ctx = SimpleNamespace(cfg=cfg, policy=policy, params={"w": policy.w}, accelerator=accelerator, progress=False,
                              optimizer_step=optimizer_step, optimizer=SimpleNamespace(param_groups=[{"lr": 1.0}]))
    obj.opts, obj.snapshot, obj.steps = cfg.objective.dpo, None, 0
    filler = batches[0]._replace(weight=0.0) if batches else None
    obj.pair_batches = lambda experience: padded_rounds(batches, accelerator, filler)
    stats = obj.update(SimpleNamespace(iteration=0))
    assert len(grads) == 1
    return stats, grads[0]


def test_padding_rounds_count_in_no_divisor_so_two_processes_take_the_one_process_step(monkeypatch):
    from flowrl.train.objectives import dpo as dpo_module
    from fake_processes import run_processes

    monkeypatch.setattr(dpo_module, "training_grid", lambda *_: torch.linspace(1.0, 1e-3, 1000, dtype=torch.float64))
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(5, 2, 4, 2, 2, generator=g)  # 5 pairs: [winner, loser] each
    w0 = 0.3 * torch.randn(4, 2, 2, generator=g)

    def pairs(js: list[int]) -> PairBatch:
        rows = torch.cat([x0[js, 0], x0[js, 1]])
        return PairBatch(rows, ["a red circle"] * len(rows), torch.tensor([100 + j for j in js]), 1.0)

    # one process: pair batches of 2, 2 and 1 pairs, one step over 5 pairs x 2 repetitions
    one_stats, one_grad = run_processes(1, lambda acc: _dpo_update(acc, [pairs([0, 1]), pairs([2, 3]), pairs([4])], w0))[0]
    # two processes: the second repeats its batch at weight 0 to run as many forwards as the first
    layout = [[pairs([0, 1]), pairs([4])], [pairs([2, 3])]]
    two = run_processes(2, lambda acc: _dpo_update(acc, layout[acc.process_index], w0))
    ddp_grad = (two[0][1] + two[1][1]) / 2  # DDP averages the processes' gradients
    assert torch.allclose(ddp_grad, one_grad, rtol=1e-5, atol=1e-7)
    for stats, _ in two:  # logged over every process's real pairs, as on one process
        assert stats["loss"] == pytest.approx(one_stats["loss"], rel=1e-6)
        assert (stats["trained_pairs"], stats["trained_transitions"]) == (one_stats["trained_pairs"], one_stats["trained_transitions"])
    assert (one_stats["trained_pairs"], one_stats["trained_transitions"]) == (5, 3 * 2)  # 3 real pair batches x 2 repetitions


def test_bad_dpo_settings_are_one_sentence(tiny_sd3_dir):
    base = [f"model.path={tiny_sd3_dir}", "objective.kind=dpo"]
    with pytest.raises(ConfigError, match="^objective.dpo.sampler must be one of"):
        load_config("tiny_jpeg", [*base, "objective.dpo.sampler=both"])
    with pytest.raises(ConfigError, match="^objective.dpo.beta must be a finite number > 0"):
        load_config("tiny_jpeg", [*base, "objective.dpo.beta=0"])
    with pytest.raises(ConfigError, match=r"^objective.kind dpo draws its training sigmas over all of \(0, 1\]"):
        load_config("tiny_jpeg", [*base, "lora.sigma_range=[0.5, 1.0]"])
    with pytest.raises(ConfigError, match=r"^objective.kind dpo adds no KL term .*; got 0.01$"):  # never silently ignored
        load_config("tiny_jpeg", [*base, "trainer.kl_beta=0.01"])
    with pytest.raises(ConfigError, match="^objective.kind dpo needs lora.enabled=true"):
        load_config("tiny_jpeg", [*base, "lora.enabled=false"])


def test_sampler_reference_draws_base_samples_and_sampler_policy_the_trained_ones(tmp_path, tiny_sd3_dir):
    common = [f"model.path={tiny_sd3_dir}", *FAST, "run.checkpoint_every=0", "trainer.iterations=2"]

    def rewards(name: str, *overrides: str) -> list[float]:
        assert main(["train", "tiny_jpeg", *common, *overrides, "--run-dir", str(tmp_path / name)]) == 0
        return [r["reward_mean"] for r in run_metrics(tmp_path / name)]

    base = rewards("base", "trainer.lr=1e-30")  # no update that reaches a sample
    assert rewards("reference", "trainer.lr=1e-2") == base  # Flow-GRPO's: the rollouts never see the update
    policy = rewards("policy", "trainer.lr=1e-2", "objective.dpo.sampler=policy")
    assert policy[0] == base[0] and policy[1] != base[1]  # Flow-Factory's: the second iteration samples the trained policy
