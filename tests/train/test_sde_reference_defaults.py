"""The SDE engines' defaults against their references' code (docs/algorithms.md section 2): the KL's
normalisation, the trained steps and the advantage's std. Each expectation is written out here from
the reference's formula, not computed with flowrl's functions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from flowrl.config import load_config
from flowrl.train.loop import Trainer
from flowrl.train.rollouts.common import training_spec

FAST = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
        "run.checkpoint_every=0", "trainer.iterations=1"]


def _flow_grpo_reference_kl(x, v, v_ref, sigma, sigma_next, a, sigma_max):
    """Flow-GRPO's train_sd3.py: the Flow-SDE means of the policy and of the adapter-disabled network, and
    mean over C, H, W of (mu - mu_ref)^2 / (2 std_dev_t^2), std_dev_t = a sqrt(sigma / (1 - sigma)) without
    sqrt(-dt) (at sigma = 1 the denominator takes the grid's second sigma)."""
    dt = sigma_next - sigma
    s = a * math.sqrt(sigma / (1 - (sigma if sigma < 1 else sigma_max)))

    def mean(vel):
        return x * (1 + s**2 / (2 * sigma) * dt) + vel * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt

    return ((mean(v) - mean(v_ref)) ** 2).mean(dim=(1, 2, 3)) / (2 * s**2)


@pytest.mark.parametrize("form", ["reference", "exact"])
def test_the_grpo_kl_is_flow_grpos_code_by_default_and_the_exact_kl_by_name(tiny_sd3_dir, policy, form):
    from flowrl.sampling.rollout import SamplerSpec
    from flowrl.train.experience import TransitionBatch
    from flowrl.train.objectives.grpo import GRPO
    from flowrl.train.rollouts.common import step_kl

    overrides = [f"model.path={tiny_sd3_dir}", "lora.rank=4", "lora.alpha=8", "sampling.num_steps=10", "trainer.kl_beta=0.04",
                 "sampling.sampler=flow_grpo", "objective.grpo.clip_range=1e-4"]
    cfg = load_config("tiny_jpeg", overrides + ([] if form == "reference" else ["objective.grpo.kl_form=exact"]))
    obj = GRPO.__new__(GRPO)
    obj.ctx = SimpleNamespace(cfg=cfg, policy=policy, params=policy.named_trainable_parameters(),
                              accelerator=SimpleNamespace(device=torch.device("cpu")))
    obj.gardo = None
    sigmas = torch.tensor([1.0, 0.9, 0.7, 0.4, 0.0])
    spec = SamplerSpec(sigmas, torch.ones(4, dtype=torch.bool), "flow_grpo", 0.7)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, *policy.latent_shape(), generator=g)
    cond = policy.encode(["a red circle"] * 4)
    for step in (0, 2):  # sigma = 1 (the sigma_max stand-in) and an inner step
        sigma, sigma_next = float(sigmas[step]), float(sigmas[step + 1])
        with torch.no_grad():
            x_next = spec.step(step, x, policy.velocity(x, sigma, cond), noise=torch.randn(x.shape, generator=g)).next_x

        def evaluate():
            return spec.step(step, x, policy.velocity(x, sigma, cond), x_next=x_next)

        with torch.no_grad():
            behaviour = evaluate()
        mb = TransitionBatch(evaluate, behaviour.log_prob, torch.zeros(4), step_kl("mean"), dt=sigma - sigma_next,
                             kl_scale=spec.reference_kl_scale(step), step=step)
        _, _, kl = obj.micro_batch_loss(mb)
        with torch.no_grad():
            v = policy.velocity(x, sigma, cond)
            with policy.reference():
                v_ref = policy.velocity(x, sigma, cond)
        reference = _flow_grpo_reference_kl(x, v, v_ref, sigma, sigma_next, 0.7, 0.9).mean()
        expected = reference if form == "reference" else reference / (sigma - sigma_next)  # exact: the variance has s^2 |dt|
        assert float(kl.detach()) > 0
        torch.testing.assert_close(kl.detach(), expected, rtol=1e-4, atol=0)


def test_the_kl_form_is_checked(tiny_sd3_dir):
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="objective.grpo.kl_form"):
        load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "objective.grpo.kl_form=sqrt"])


def test_flow_grpos_reference_kl_scale_is_dt_on_its_sde_and_one_elsewhere():
    from flowrl.sampling.steps import reference_kl_scale

    assert reference_kl_scale("flow_grpo", 0.7, 0.4) == pytest.approx(0.3)
    assert reference_kl_scale("cps", 0.7, 0.4) == 1.0  # Flow-GRPO's CPS step returns the transition's own std
    assert reference_kl_scale("dance_grpo", 0.7, 0.4) == 1.0  # DanceGRPO and BranchGRPO have no KL: the exact form


def test_the_last_step_is_sampled_with_noise_but_not_trained_as_flow_grpos_timestep_fraction(tmp_path, tiny_sd3_dir):
    # train_sd3.py: num_train_timesteps = int(num_steps x timestep_fraction), the steps taken in order from 0;
    # timestep_fraction 0.99 at 10 steps trains 9, at 6 steps 5
    for steps, trained in ((10, 9), (6, 5), (4, 3)):
        cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", f"sampling.num_steps={steps}"])
        spec = training_spec(cfg, 0, SimpleNamespace(sigmas=lambda n, schedule, shift: torch.linspace(1, 0, n + 1)))
        assert spec.trained_steps() == list(range(trained))
        assert bool(spec.sde_steps[-1]) and spec.is_stochastic(steps - 1)  # the last step still samples with noise
    trainer = Trainer(load_config("tiny_jpeg", [*FAST, f"model.path={tiny_sd3_dir}"]), run_dir=tmp_path / "r")
    experience, _ = trainer.next_experience()
    assert sorted({mb.step for group in experience.transitions for mb in group}) == [0, 1, 2]
    # on the Flow-SDE each transition's reference KL scale is its step's sigma - sigma_next
    sigmas = training_spec(trainer.cfg, 0, trainer.policy).sigmas
    for mb in (mb for group in experience.transitions for mb in group):
        assert mb.kl_scale == pytest.approx(float(sigmas[mb.step] - sigmas[mb.step + 1]))


def test_every_step_is_trained_with_the_full_fraction(tmp_path, tiny_sd3_dir):
    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "sampling.num_steps=10", "sampling.window.trained_fraction=1.0"])
    spec = training_spec(cfg, 0, SimpleNamespace(sigmas=lambda n, schedule, shift: torch.linspace(1, 0, n + 1)))
    assert spec.trained_steps() == list(range(10))


def test_a_fraction_that_trains_nothing_is_refused(tiny_sd3_dir):
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="sampling.window.trained_fraction"):
        load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "sampling.num_steps=4", "sampling.window.trained_fraction=0.2"])


@pytest.mark.parametrize("noise", ["per_sample", "per_group"])
def test_a_group_shares_its_initial_noise_only_when_asked(tmp_path, tiny_sd3_dir, noise):
    # Flow-GRPO's same_latent / DanceGRPO's init_same_noise: every chain of a prompt's group starts from one noise,
    # and the SDE steps' noise still differs between them
    from flowrl.sampling.noise import INITIAL, seeded_noise

    trainer = Trainer(load_config("tiny_jpeg", [*FAST, f"model.path={tiny_sd3_dir}", f"sampling.initial_noise={noise}"]),
                      run_dir=tmp_path / "r")
    batch = trainer.rollout.sample(0)
    traj = batch.stages[0].traj
    starts, ids = traj.latents[:, 0], traj.prompt_ids
    for p in ids.unique():
        rows = (ids == p).nonzero().squeeze(1)
        first = int(rows[0])
        assert torch.equal(starts[first], seeded_noise([int(traj.seeds[first])], INITIAL, starts.shape[1:])[0])
        same = [torch.equal(starts[int(r)], starts[first]) for r in rows[1:]]
        assert all(same) if noise == "per_group" else not any(same)
        assert not any(torch.equal(traj.latents[int(r), 1], traj.latents[first, 1]) for r in rows[1:])
    assert not torch.equal(starts[ids == ids[0]][0], starts[ids != ids[0]][0])  # groups still differ


def test_a_shared_initial_noise_needs_flat_rollouts(tiny_sd3_dir):
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="sampling.initial_noise"):
        load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "sampling.initial_noise=per_group", "rollout.kind=tree",
                                  "rollout.tree.split_steps=[0]", "rollout.tree.branching=[8]"])


def test_tree_edges_carry_their_steps_reference_kl_scale(tmp_path, tiny_sd3_dir):
    # a tree on Flow-GRPO's SDE: edges trained step by step carry their step's sigma - sigma_next; shuffled edges one per row,
    # and the objective scales each kept row's KL by its own
    from flowrl.train.objectives.grpo import GRPO

    tree = [*FAST, f"model.path={tiny_sd3_dir}", "rollout.kind=tree", "rollout.tree.split_steps=[0,1]", "rollout.tree.branching=[2]",
            "sampling.sampler=flow_grpo", "rollout.tree.prune_depths=[]"]
    trainer = Trainer(load_config("tiny_jpeg", [*tree, "rollout.tree.edge_order=by_step"]), run_dir=tmp_path / "a")
    sigmas = training_spec(trainer.cfg, 0, trainer.policy).sigmas
    experience, _ = trainer.next_experience()
    for mb in (mb for group in experience.transitions for mb in group):
        assert mb.kl_scale == pytest.approx(float(sigmas[mb.step] - sigmas[mb.step + 1]))
    shuffled = Trainer(load_config("tiny_jpeg", tree), run_dir=tmp_path / "b")
    experience, _ = shuffled.next_experience()
    scales = torch.cat([mb.kl_scale for group in experience.transitions for mb in group])
    steps = sigmas[:-1] - sigmas[1:]
    assert all(bool(torch.isclose(steps, s).any()) for s in scales) and len(set(scales.tolist())) > 1
    mb = experience.transitions[0][0]
    keep = torch.tensor([True, False] * (len(mb.kl_scale) // 2) + [True] * (len(mb.kl_scale) % 2))
    rows = torch.ones(int(keep.sum()))
    torch.testing.assert_close(GRPO.kl_rows(shuffled.objective, mb._replace(kl=lambda o, r, k: rows), None, None, keep),
                               mb.kl_scale[keep])
