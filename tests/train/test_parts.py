"""Registered parts: a toy objective of a few lines trains through `flowrl train objective.kind=<toy>`
and a toy rollout with no online prompts or rewards trains too, with no edit to the loop; the
config checks a rollout against an objective from their declarations."""

from __future__ import annotations

import json
import sys
import math

import pytest
import torch

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.sampling.noise import FORWARD_NOISING, seeded_noise
from flowrl.sampling.steps import flow_matching_target, forward_noise
from flowrl.train.experience import SAMPLES, TRANSITIONS, Experience, SampleBatch
from flowrl.train.parts import OBJECTIVES, ROLLOUTS, Objective, Rollout, register_objective, register_rollout
from run_checks import trainable

FAST = ["sampling.num_steps=3", "sampling.eval_num_steps=3", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
        "trainer.kl_beta=0", "sampling.sampler=ode"]


class AdvantageWeightedFlowMatching(Objective):
    """A toy: flow matching at sigma 0.5 on the clean samples, each weighted by its advantage."""

    name = "toy_awfm"
    needs = SAMPLES

    def update(self, experience: Experience) -> dict:
        policy, acc = self.ctx.policy, self.ctx.accelerator
        losses = []
        for batch in experience.samples:
            x0 = batch.x0.to(acc.device)
            eps = seeded_noise(batch.seeds.tolist(), FORWARD_NOISING, x0.shape[1:], acc.device)
            v = policy.velocity(forward_noise(x0, eps, 0.5), 0.5, policy.encode(batch.prompts))
            weight = experience.advantages_at(batch.index).to(acc.device)
            loss = (weight * ((v - flow_matching_target(x0, eps)) ** 2).mean(dim=tuple(range(1, v.ndim)))).mean()
            acc.backward(loss)
            self.ctx.optimizer_step()
            losses.append(loss.item())
        return {"toy_loss": sum(losses) / len(losses)}


class StoredPairs(Rollout):
    """A toy offline source: two samples of the base model drawn once, the first preferred; no
    online prompts, no reward."""

    name = "toy_stored"
    needs_prompts = False
    needs_rewards = False

    @classmethod
    def provides(cls, cfg) -> set[str]:
        return {SAMPLES}

    def __init__(self, ctx):
        super().__init__(ctx)
        with torch.no_grad():
            noise = seeded_noise([1, 2], FORWARD_NOISING, ctx.policy.latent_shape())
            self.x0 = noise.clamp(-1, 1)

    def collect(self, iteration: int) -> Experience:
        return Experience(iteration, torch.zeros(2, 0), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool),
                          torch.tensor([1.0, -1.0]), "float32",
                          samples=[SampleBatch(self.x0, ["", ""], torch.tensor([1, 2]), torch.arange(2))])


@pytest.fixture
def toy_parts():
    register_objective(AdvantageWeightedFlowMatching)
    register_rollout(StoredPairs)
    yield
    OBJECTIVES.unregister(AdvantageWeightedFlowMatching.name)
    ROLLOUTS.unregister(StoredPairs.name)


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_registered_toy_objective_trains_through_the_cli(tmp_path, tiny_sd3_dir, toy_parts):
    run = tmp_path / "run"
    args = [*FAST, f"model.path={tiny_sd3_dir}", "objective.kind=toy_awfm", "trainer.iterations=2", "--run-dir", str(run)]
    assert main(["train", "tiny_jpeg", *args]) == 0
    got = rows(run)
    assert [r["iteration"] for r in got] == [0, 1]
    assert all(math.isfinite(r["toy_loss"]) and r["samples"] == 8 and "reward_mean" in r for r in got)
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)  # the adapter moved


def test_a_rollout_without_prompts_or_rewards_loads_and_trains(tmp_path, tiny_sd3_dir, toy_parts):
    config = tmp_path / "offline.yaml"
    config.write_text("data:\n  prompts: []\nreward:\n  weights: {}\n")
    run = tmp_path / "run"
    overrides = [f"model.path={tiny_sd3_dir}", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8",
                 "trainer.kl_beta=0", "trainer.iterations=2", "trainer.lr=1e-2"]
    with pytest.raises(ConfigError, match="^data.prompts is empty"):  # the flat rollout needs an online prompt source
        load_config(config, overrides)
    assert main(["train", str(config), *overrides, "rollout.kind=toy_stored", "objective.kind=toy_awfm", "--run-dir", str(run)]) == 0
    got = rows(run)
    assert len(got) == 2 and "reward_mean" not in got[0] and math.isfinite(got[1]["toy_loss"])
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)


def test_compatibility_comes_from_the_declarations(toy_parts):
    # grpo needs transitions; an ODE sampler gives none; the sentence names the objectives that fit
    with pytest.raises(ConfigError) as err:
        load_config("tiny_jpeg", ["sampling.sampler=ode"])
    msg = str(err.value)
    assert msg.startswith("objective.kind 'grpo' trains on transitions with behaviour log-probs, which rollout.kind 'flat' "
                          "does not provide with sampling.sampler 'ode'")
    samples = OBJECTIVES.where(lambda o: o.needs == SAMPLES)  # the built-in clean-sample objectives and the toy
    assert "toy_awfm" in samples and "grpo" not in samples and msg.endswith(f"objective.kind may be {', '.join(samples)} with it")
    with pytest.raises(ConfigError, match="^objective.kind 'toy_awfm' trains on clean samples.*objective.kind may be grpo with it$"):
        load_config("tiny_jpeg", ["rollout.kind=granular", "rollout.granular.branch_steps=[0,1]", "objective.kind=toy_awfm"])
    assert TRANSITIONS in ROLLOUTS["flat"].provides(load_config("tiny_jpeg"))
    with pytest.raises(ConfigError, match=f"^objective.kind must be one of {', '.join(OBJECTIVES.names())}; got 'kto'$"):
        load_config("tiny_jpeg", ["objective.kind=kto"])


# A user's own objective with two options, in a module outside the package, named by the config's
# `plugins`: its options become objective.toy_scaled, typed, checked by its validate and described by
# its comments in `flowrl config show`.
PLUGIN = '''
from dataclasses import dataclass

from flowrl.errors import check_range
from flowrl.sampling.noise import FORWARD_NOISING, seeded_noise
from flowrl.sampling.steps import flow_matching_target, forward_noise
from flowrl.train.experience import SAMPLES
from flowrl.train.parts import Objective, register_objective


@dataclass
class ScaledFlowMatchingOptions:
    sigma: float = 0.5  # the one training sigma
    weight: float = 1.0  # times the advantage-weighted flow-matching loss


@register_objective
class ScaledFlowMatching(Objective):
    name = "toy_scaled"
    options = ScaledFlowMatchingOptions
    needs = SAMPLES

    @classmethod
    def validate(cls, cfg):
        o = cfg.objective.toy_scaled
        check_range("objective.toy_scaled.sigma", o.sigma, "(0, 1)")
        check_range("objective.toy_scaled.weight", o.weight, "> 0")

    def update(self, experience):
        o, policy, acc = self.ctx.cfg.objective.toy_scaled, self.ctx.policy, self.ctx.accelerator
        for batch in experience.samples:
            x0 = batch.x0.to(acc.device)
            eps = seeded_noise(batch.seeds.tolist(), FORWARD_NOISING, x0.shape[1:], acc.device)
            v = policy.velocity(forward_noise(x0, eps, o.sigma), o.sigma, policy.encode(batch.prompts))
            a = experience.advantages_at(batch.index).to(acc.device)
            loss = o.weight * (a * ((v - flow_matching_target(x0, eps)) ** 2).mean(dim=tuple(range(1, v.ndim)))).mean()
            acc.backward(loss)
            self.ctx.optimizer_step()
        return {"toy_sigma": o.sigma, "toy_weight": o.weight}
'''


def write_plugin_config(tmp_path, monkeypatch, model_dir, module: str, source: str, sections: str):
    """A user's module `module` (its `source`) importable from tmp_path/plugins, and a config that names it in
    `plugins` on the tiny model `model_dir` with two prompts and the YAML `sections`: the config's path."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    config = tmp_path / "mine.yaml"
    config.write_text(f"plugins: [{module}]\nmodel:\n  path: {model_dir}\ndata:\n  prompts: [a red circle, a blue square]\n"
                      + sections)
    return config


@pytest.fixture
def plugin_config(tmp_path, monkeypatch, tiny_sd3_dir):
    yield write_plugin_config(tmp_path, monkeypatch, tiny_sd3_dir, "my_flowrl_parts", PLUGIN,
                              "reward:\n  weights: {brightness: 1.0}\nobjective:\n  kind: toy_scaled\n  toy_scaled:\n"
                              "    sigma: 0.3\n    weight: 2.0\n")
    OBJECTIVES.unregister("toy_scaled")
    sys.modules.pop("my_flowrl_parts", None)


def test_an_objective_from_outside_the_package_brings_its_options(plugin_config, tmp_path, capsys):
    cfg = load_config(plugin_config, FAST)
    assert (cfg.objective.kind, cfg.objective.toy_scaled.sigma, cfg.objective.toy_scaled.weight) == ("toy_scaled", 0.3, 2.0)
    assert cfg.objective.grpo.clip_range > 0  # the built-in sections stay beside it
    with pytest.raises(ConfigError, match=r"^objective.toy_scaled.sigma must be in \(0, 1\); got 1.5$"):
        load_config(plugin_config, [*FAST, "objective.toy_scaled.sigma=1.5"])
    with pytest.raises(ConfigError, match="objective.toy_scaled.sigmaa"):
        load_config(plugin_config, [*FAST, "objective.toy_scaled.sigmaa=0.2"])
    with pytest.raises(ConfigError, match="^plugins\\[0\\] 'not_a_module_here' does not import"):
        load_config(plugin_config, [*FAST, "plugins=[not_a_module_here]"])
    assert main(["config", "show", str(plugin_config), *FAST]) == 0
    shown = capsys.readouterr().out
    assert "  toy_scaled:\n    sigma: 0.3  # the one training sigma\n    weight: 2.0  # times the advantage-weighted" in shown
    run = tmp_path / "run"
    assert main(["train", str(plugin_config), *FAST, "trainer.iterations=2", "--run-dir", str(run)]) == 0
    got = rows(run)
    assert [(r["toy_sigma"], r["toy_weight"]) for r in got] == [(0.3, 2.0)] * 2
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)  # the adapter moved
    assert "plugins:\n- my_flowrl_parts" in (run / "config.yaml").read_text()  # a resume imports it again


def test_a_registry_imports_a_lazy_entry_on_first_use_and_names_the_choices():
    from flowrl.registry import Registry

    reg = Registry("thing.kind")
    reg.register_lazy("noise", "flowrl.sampling.noise:seeded_noise")  # a module path, imported when first looked up
    reg.register(lambda: None, name="plain")
    assert reg.names() == ("noise", "plain") and "noise" in reg
    assert reg.get("noise") is seeded_noise
    with pytest.raises(ConfigError, match="^thing.kind must be one of noise, plain; got 'nois'$"):
        reg.get("nois")
    reg.unregister("plain")
    assert reg.names() == ("noise",)


# A user's allocator and reward, each with an option, in one file: the whole of what adding them takes.
TOY_ALLOCATOR_AND_REWARD = '''
from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.core.allocation import ALLOCATORS, Allocator, largest_remainder
from rewards import register


@dataclass
class FirstHeavyOptions:
    share: float = 0.5  # the share of the budget the iteration's first prompt gets

    RANGES: ClassVar[dict] = {"share": "(0, 1)"}


@ALLOCATORS.register
class FirstHeavy(Allocator):
    """The iteration's first prompt gets `share` of the rollouts, the others split the rest."""

    name = "first_heavy"
    options = FirstHeavyOptions

    def first_stage(self, iteration):
        self.iteration = iteration
        prompts = self.choose_prompts(iteration)
        rest = (1 - self.opts.share) / max(1, len(prompts) - 1)
        weights = torch.tensor([self.opts.share] + [rest] * (len(prompts) - 1))
        counts = self.counts_for(prompts, largest_remainder(weights, self.budget, self.min_group))
        self.spent = int(counts.sum())
        return counts


@register("channel_mean", "the mean of one colour channel", factory=True)  # its keywords are its options
def channel_mean(channel: int = 1):
    return lambda images, prompts: images[:, channel].mean(dim=(1, 2))
'''


@pytest.fixture
def toy_allocator_config(tmp_path, monkeypatch, tiny_sd3_dir):
    yield write_plugin_config(tmp_path, monkeypatch, tiny_sd3_dir, "my_allocator_and_reward", TOY_ALLOCATOR_AND_REWARD,
                              "reward:\n  weights: {channel_mean: 1.0}\n  options:\n    channel_mean: {channel: 2}\n"
                              "allocator:\n  kind: first_heavy\n  first_heavy:\n    share: 0.75\nobjective:\n  kind: nft\n")
    from flowrl.core.allocation import ALLOCATORS
    from rewards import REWARDS

    ALLOCATORS.unregister("first_heavy")
    REWARDS.unregister("channel_mean")
    sys.modules.pop("my_allocator_and_reward", None)


def test_an_allocator_and_a_reward_from_outside_the_package_bring_their_options(toy_allocator_config, tmp_path, capsys):
    cfg = load_config(toy_allocator_config, FAST)
    assert (cfg.allocator.kind, cfg.allocator.first_heavy.share) == ("first_heavy", 0.75)
    with pytest.raises(ConfigError, match=r"^allocator.first_heavy.share must be in \(0, 1\); got 1.5$"):
        load_config(toy_allocator_config, [*FAST, "allocator.first_heavy.share=1.5"])
    with pytest.raises(ConfigError, match="reward.options.channel_mean"):
        load_config(toy_allocator_config, [*FAST, "reward.options.channel_mean={colour: 2}"])
    assert main(["config", "show", str(toy_allocator_config), *FAST]) == 0
    assert "  first_heavy:\n    share: 0.75  # the share of the budget the iteration's first prompt gets" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", str(toy_allocator_config), *FAST, "trainer.iterations=2", "--run-dir", str(run)]) == 0
    got = rows(run)
    # 2 prompts x 4 rollouts: min_group 2 each, the other 4 split 3:1 (share 0.75); the reward is the blue channel's mean
    assert [r["group_size_histogram"] for r in got] == [{"3": 1, "5": 1}] * 2
    assert all(0 < r["reward/channel_mean"] < 1 for r in got)
