"""Every seed engine learns, and a control that is otherwise identical does not.

The task: the shipped shapes model, whose pipeline works in pixel space (no autoencoder), so an
image's mean brightness is a linear function of what the network outputs; the brightness reward;
two prompts, groups of 8, 4 steps without guidance, a learning rate of 1e-3, 6 iterations (ENGINES sets
others for some engines). The measure: the mean brightness of fresh ODE samples of the two prompts on
held-out seeds (6 each, seeds the training never draws), after training minus before.

The control (run with FLOWRL_CONTROLS=1) is the same run with each reward swapped with that of
another sample of its group as it is scored, or within each group of the store as it opens
(run_checks.permute_rewards_within_groups): the updates keep their size and noise, but not their
link to the images. Each engine's threshold sits at least 3 standard errors of its control's
spread above the control's mean and under every engine seed (CALIBRATION below).
"""

from __future__ import annotations

import os

import pytest
import torch

from flowrl.config import load_config
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.train.images import ode_images
from flowrl.train.loop import Trainer
from run_checks import permute_rewards_within_groups

PROMPTS = ["two blue squares", "a blue circle above a red square"]
HELD_OUT_SEEDS = list(range(70_000, 70_006))  # training seeds come from sample_seed(), far from these
COMMON = ["trainer.iterations=6", "trainer.lr=1e-3", "trainer.lr_schedule=constant", "trainer.ema=false", "trainer.max_minutes=0",
          "trainer.budget_fill=false",  # the 6 iterations the calibrations ran, not the default preset's filled budget
          "data.prompts_per_iteration=2", "data.group_size=8", "sampling.batch_size=16", "sampling.num_steps=4",
          "sampling.eval_num_steps=4", "model.guidance_scale=1", "model.compile=none", "run.cpu_processes=1", "run.progress=false",
          "run.tracker=none", "run.sample_every=0", "run.checkpoint_every=0",
          # the default preset's KL and DGPO beta before it took its tuned recipe: the calibrations below ran with these
          "trainer.kl_beta=0.02", "objective.dgpo.beta=100"]
LONGER = ["sampling.num_steps=6", "sampling.eval_num_steps=6", "trainer.iterations=8"]
GRPO = ["objective.kind=grpo", "sampling.sampler=flow_grpo", "sampling.noise_level=0.7", "objective.grpo.clip_range=0.2",
        "trainer.kl_beta=0"]
ENGINES = {  # on top of the default preset (DGPO on ODE rollouts)
    "dgpo": ["trainer.iterations=4"],  # its 6 gained +0.069 to +0.080
    "nft": ["objective.kind=nft", "trainer.iterations=4"],  # its 6 gained +0.043 to +0.056
    # GRPO steps once per sampling batch: batches of 4 give the flat engines 4 optimizer steps per iteration. Flat
    # Flow-GRPO on every step gained nothing in 8 iterations (-0.022 and -0.000, gradient norms about 0.04 against
    # 0.003 for the first three steps alone, which gained +0.080): the quiet last steps' log-prob gradients, the
    # largest and mostly noise, steer Adam's per-weight steps. So it trains the first half of its steps here, for
    # 10 iterations (at 6, seed 1 gained +0.018, within its control's spread)
    "flow_grpo": [*GRPO, "sampling.batch_size=4", "sampling.window.strategy=fixed", "sampling.window.start=0",
                  "sampling.window.size=2", "trainer.iterations=10"],
    # MixGRPO's window and BranchGRPO's splits want a longer chain: 6 steps, 8 iterations (on 4 steps and 6 iterations
    # they gained +0.008 and +0.039 against their controls' +0.018 and +0.029, seed 0)
    # MixGRPO with its reference's shared initial noise per group (sampling.initial_noise per_group), 12 iterations at half
    # the learning rate, the window moving every 3: the same run with each chain's own noise does not separate (below)
    "mixgrpo": [*GRPO, *LONGER, "sampling.batch_size=4", "sampling.window.strategy=progressive", "sampling.window.size=2",
                "sampling.window.shift_every=3", "sampling.initial_noise=per_group", "trainer.iterations=12", "trainer.lr=5e-4"],
    # BranchGRPO at half the learning rate for 12 iterations (at 8 and 12 at the full rate the controls' drift matched its gain),
    # with the reference code's tree (rollout.tree's defaults: split noise x4, the last step's clean prediction scored,
    # the edges shuffled across steps, an optimizer step every 12)
    "branchgrpo": [*GRPO, *LONGER, "rollout.kind=tree", "rollout.tree.split_steps=[0,1,2]", "rollout.tree.branching=[2]",
                   "rollout.tree.between=sde", "sampling.window.strategy=all", "trainer.iterations=12", "trainer.lr=5e-4"],
    "g2rpo": [*GRPO, "rollout.kind=granular", "rollout.granular.branch_steps=[0,1]", "rollout.granular.granularities=[1,2]",
              "data.group_size=4", "sampling.window.strategy=all"],
    # the pairings (issue 85): DGPO on a tree's leaves, DanceGRPO's SDE and the reference tree as in the arena's tree_dgpo
    # (8 leaves per prompt); 8 iterations at 1.5x the rate: a tree's group learns slower per iteration than a flat ODE group (below)
    "tree_dgpo": ["rollout.kind=tree", "sampling.sampler=dance_grpo", "sampling.noise_level=0.3", "rollout.tree.split_steps=[0,1,2]",
                  "rollout.tree.branching=[2]", "sampling.window.strategy=all", "trainer.iterations=8", "trainer.lr=1.5e-3"],
    # the pairing that led Arena III's first seeds: DGPO on Sol-RL's best-worst selection (16 fp8 candidates, 8 kept)
    "two_stage_dgpo": ["rollout.kind=two_stage", "rollout.two_stage.candidates=16", "rollout.two_stage.explore_precision=fp8",
                       "rollout.two_stage.fidelity_every=0", "trainer.iterations=4"],
    "sol_rl": ["objective.kind=nft", "rollout.kind=two_stage", "rollout.two_stage.candidates=16",
               "rollout.two_stage.explore_precision=fp8", "trainer.iterations=4"],  # its 6 gained +0.060 to +0.069
    # the objectives of issue 64, each with its arena cell's settings on the task's 4 steps
    "awm": ["objective.kind=awm", "advantage.std=global", "advantage.clip=5.0", "trainer.iterations=4"],  # its 6: +0.033 to +0.046
    "dpo": ["objective.kind=dpo", "sampling.sampler=flow_grpo", "sampling.noise_level=0.7", "trainer.kl_beta=0",
            "trainer.iterations=12"],  # its pairs come from the base model's samples: at 6, seed 0 gained +0.009
    # UniRL's mask threshold (1e-5; Flow-Factory's 1e-6, the default, gained +0.002 at 6 iterations): after the first
    # of the 4 steps an iteration takes, the mask holds most transitions, so 16 iterations
    "flow_dppo": [*GRPO, "sampling.sampler=cps", "objective.grpo.trust_region=divergence_mask", "sampling.batch_size=4",
                  "sampling.window.strategy=scattered", "sampling.window.size=2", "sampling.window.choices=[0,1,2]",
                  "objective.grpo.divergence_threshold=1e-5", "trainer.iterations=16"],
    # 16 iterations: the window's random start (0 or 1) made 6 and 12 a lottery (the calibration below)
    "flow_grpo_fast": [*GRPO, "sampling.sampler=cps", "sampling.cps_logprob=reference", "sampling.noise_level=0.8",
                       "sampling.batch_size=4", "sampling.window.strategy=random",
                       "sampling.window.size=2", "sampling.window.choices=[0,1]", "trainer.iterations=16"],
    # from a store of the base model's groups, built first; its iterations are cheap (no sampling): 48 of them, with
    # each sample's errors averaged rather than summed (the paper's sums swing the implicit rewards; below)
    "gdro": ["objective.kind=gdro", "rollout.kind=offline", "objective.gdro.error_reduction=mean", "trainer.iterations=48"],
}
# CALIBRATION: held-out brightness gains over trainer seeds 0-3, engine / control (2026-11-29, the 2-core Intel Xeon
# family 6 model 167, commit 59a4a58 plus this file; the control's mean and standard error in brackets):
#   dgpo        +0.059 +0.049 +0.040 +0.057 / -0.005 +0.016 -0.006 -0.010  (-0.001, 0.006; 4 iterations, commit bb2a233)
#   nft         +0.028 +0.032 +0.026 +0.026 / +0.010 +0.001 -0.009 -0.014  (-0.003, 0.005; 4 iterations, 2026-12-06, commit
#               246b16a, the same box, for the suite's time); at 6 (2026-11-29): +0.050 +0.056 +0.043 +0.044 /
#               +0.007 +0.008 -0.017 -0.020
#   g2rpo       +0.068 +0.084 +0.080 +0.080 / +0.015 -0.056 -0.043 -0.021  (-0.026, 0.016)
#   sol_rl      +0.038 +0.044 +0.036 +0.038 / +0.002 -0.006 -0.018 +0.006  (-0.004, 0.005; 4 iterations, commit bb2a233)
#   flow_grpo   +0.083 +0.087 +0.092 +0.098 / +0.004 +0.015 +0.045 +0.008  (+0.018, 0.009; 10 iterations, commit f10ba5f)
#               At the arena's guidance 4 (Flow-GRPO's reference trains with CFG, 4.5; 2026-12-05, issue 90's code, the box
#               shared with other runs): +0.069 +0.055 +0.058 +0.094 / -0.049 -0.042 +0.103 +0.050: a control seed drifts
#               past every engine seed, so the test keeps guidance 1, where the engine separates; the arena's task shows no
#               gradient signal at guidance 4 or 1 (docs/arena.md, "Where the SDE gradient's signal is")
#   awm         +0.020 +0.031 +0.021 +0.026 / -0.003 +0.001 +0.004 -0.009  (-0.002, 0.003; 4 iterations, 2026-12-06, commit
#               246b16a, the same box); at 6 (commit bb2a233): +0.038 +0.046 +0.033 +0.043 / -0.004 +0.002 +0.001 -0.007
#   dpo         +0.039 +0.064 +0.025 +0.016 / +0.002 -0.021 +0.007 -0.006  (-0.005, 0.006; 12 iterations, commit bb2a233)
#   flow_grpo_fast  +0.092 +0.070 +0.101 +0.089 / +0.030 -0.021 +0.029 -0.019  (+0.005, 0.014; 16 iterations, commit
#               25808b7); at 12: +0.088 -0.000 +0.080 +0.099 / +0.043 -0.003 +0.005 -0.013, at 6: +0.046 -0.007 +0.016 +0.094
#               2026-11-30 (commit 3c7bc34), to pay for more tests: at 10, +0.081 +0.006 +0.068 +0.099 / +0.022 +0.007
#               +0.012 -0.015 (seed 1's window); 8 at lr 2e-3, +0.052 +0.059 +0.075 +0.098 / -0.096 +0.065 +0.063 -0.079
#               2026-11-30 (commit 5fb22e1), groups of 4 (half the samples): +0.044 +0.009 +0.049 +0.077 / +0.044
#               +0.014 -0.104 +0.005: not separated
#   flow_dppo   +0.021 +0.030 +0.039 +0.023 / -0.002 -0.002 -0.006 -0.003  (-0.003, 0.001; 16 iterations, threshold 1e-5,
#               commit 25808b7); at 12: +0.018 +0.008 +0.027 +0.014 / -0.011 +0.007 -0.007 -0.004; seed 0 at the
#               default's 1e-6: +0.002 / -0.002 at 6 iterations, +0.015 / -0.006 at 12
#               2026-11-30 (commit 3c7bc34), 8 iterations: at threshold 1e-4, +0.009 +0.025 +0.033 -0.000 / -0.004
#               +0.004 -0.015 +0.002; at lr 2e-3, +0.015 +0.006 +0.001 -0.002 / -0.007 +0.012 -0.018 -0.002: not separated
#               2026-11-30 (commit 5fb22e1), 16 iterations in groups of 4: +0.021 +0.029 +0.006 +0.012 / +0.010 +0.012
#               -0.018 -0.002: not separated
#   branchgrpo  +0.091 +0.093 +0.084 +0.082 / -0.004 +0.001 +0.016 -0.019  (-0.002, 0.007; 12 iterations at lr 5e-4, the
#               reference code's tree defaults, 2026-12-06, commit 246b16a, the same box). At 16 (2026-12-05,
#               issue 90's code): +0.101 +0.096 +0.097 +0.094 / -0.001 -0.015 +0.015 -0.005. Before them (flowrl's tree: the
#               split's own transition, the noisy leaf scored, one optimizer step per step and sampling batch):
#               +0.100 +0.103 +0.089 +0.102 / +0.025 +0.020 -0.019 -0.030  (-0.001, 0.014; 16 iterations at lr 5e-4,
#               2026-11-30, commit a33c374). The drift of a control grows with the square root of the steps, the
#               signal with the steps; at lr 1e-3 it did not separate:
#               8 iterations  +0.095 +0.065 -0.020 +0.098 / +0.010 -0.030 +0.016 -0.103  (seed 2 does not learn)
#               12 iterations +0.102 +0.092 +0.092 +0.067 / +0.015 -0.020 +0.018 -0.129, seeds 4-7 +0.068 +0.061
#               +0.044 +0.034  (+0.011, 0.021 over 8 seeds: 3 SE above it is +0.075, over the weakest engine seed)
#               8 iterations, between=ode  +0.086 +0.093 +0.100 +0.066 / +0.056 +0.050 -0.014 -0.037, prune_depths=[3]
#               +0.073 +0.081 +0.095 +0.044 / +0.055 +0.046 -0.018 -0.035: the controls' seeds 0 and 1 drift +0.05
#               to +0.08 however the tree trains
#   gdro        +0.041 +0.062 +0.058 +0.058 / +0.016 +0.033 +0.026 +0.020  (+0.024, 0.004; 48 iterations, mean errors,
#               2026-11-30, commit a33c374: the threshold, 3.5 SE above the control's mean, lies between its highest
#               seed and the engine's lowest). What came before: at 24 iterations with the paper's summed errors,
#               -0.003 +0.002 -0.003 +0.010 / +0.008 -0.001 -0.002 +0.005 (no gain): a group's brightness spans
#               0.05-0.08 (std 0.02-0.03) around 0.90, so at the paper's tau (0.05) the brightest sample's soft target
#               is 2.6-5x the darkest's; the paper's beta on summed errors (6 x 3,072) makes the implicit rewards
#               swing by tens to hundreds between iterations (listwise loss 40-300, log 8 at the start) with fresh
#               sigmas and noise. At tau 0.001 from a store of 8 groups per prompt, seed 0 gained +0.010 (beta 0.3)
#               and +0.012 (beta 6). With the errors averaged at 24 iterations: +0.063 +0.076 +0.071 +0.055 /
#               -0.025 +0.013 +0.055 +0.025 (+0.017, 0.016: mean + 3 SE +0.066): learning, not yet clear of its control
#               2026-11-30 (commit 5fb22e1), 48 iterations from a store of groups of 4 (27 s a run against 37 s):
#               +0.025 +0.040 +0.019 +0.050 / +0.007 -0.038 -0.028 +0.025: not separated
#               2026-12-06 (the 2-core AMD EPYC family 25 model 17; seeds 0-3 at 48 reproduced the engine's gains above to
#               the digit), to pay for the suite's time: 32 iterations at lr 1.5e-3, +0.048 +0.069 +0.070 +0.066 / -0.010
#               +0.031 +0.039 +0.019 (+0.020, 0.011: 3.5 SE above it is +0.057, over the weakest engine seed): not separated
#   mixgrpo     +0.103 +0.103 +0.098 +0.103 / -0.001 -0.010 -0.015 -0.008  (-0.009, 0.003; 12 iterations at lr 5e-4, the
#               window moving every 3, the group's initial noise shared as MixGRPO's reference does, 2026-12-05, the
#               same box, issue 90's code). The same settings with each chain's own initial noise: +0.030 +0.035 +0.016
#               +0.089 / -0.015 +0.020 +0.006 +0.005, not separated. What came before, each chain's own noise:
#               +0.057 +0.055 +0.094 +0.094 / -0.023 +0.047 +0.007 +0.049  (+0.020, 0.017: 3 SE above it is +0.071)
#               12 iterations: +0.056 +0.073 +0.096 +0.096 / -0.065 +0.043 +0.011 +0.057  (+0.012, 0.028): the control
#               drifts as far as the engine learns
#               2026-11-30 (same box, the flowrl code of commit c2f216d), 8 iterations, window shift every 4:
#               +0.096 +0.090 +0.053 +0.102 / +0.018 +0.060 +0.002 -0.025  (+0.014, 0.018: mean + 3 SE +0.067);
#               10 iterations +0.094 +0.094 +0.051 +0.100 / +0.014 +0.081 +0.013 -0.019  (+0.022, 0.021: +0.085);
#               16 iterations at lr 5e-4 (commit a33c374) +0.095 +0.049 +0.018 +0.094 / -0.095 +0.041 -0.011 -0.016
#               2026-11-30 (commit 5fb22e1), 8 iterations, shift every 4, with Flow-GRPO's KL (0.04): +0.073 +0.036 +0.029
#               +0.098 / -0.003 +0.057 +0.002 -0.020: the control's seed 1 drifts +0.04 to +0.08 in every setting tried
# Each threshold is at least 3.5 standard errors above its control's mean (DPO's: 3.2), above every
# control seed and under every engine seed.
#   tree_dgpo   +0.023 +0.070 +0.060 +0.047 / -0.015 -0.017 -0.011 -0.011  (-0.013, 0.0015; 8 iterations at lr 1.5e-3,
#               2026-12-06, commit 246b16a, the same box, for the suite's time). At 12 iterations
#               and lr 1e-3 (2026-12-05): +0.034 +0.052 +0.057 +0.047 / -0.019 +0.008 -0.006 -0.004. At lr 1e-3, fewer:
#               at 4 +0.008 +0.022 +0.020 +0.024 / -0.013 +0.007 -0.002 -0.000, at 8
#               +0.014 +0.042 +0.041 +0.030 / -0.022 +0.001 -0.015 -0.004; at 6 with split_noise_scale 1 (the split's own
#               transition) +0.027 +0.024 +0.015 +0.027 / -0.004 +0.002 +0.004 +0.016; at 6 between=ode is the SDE run bit
#               for bit (the last step's noise never reaches the clean prediction the leaf is scored and trained on)
#   two_stage_dgpo  +0.069 +0.073 +0.051 +0.076 / +0.020 -0.027 +0.000 -0.014  (-0.005, 0.010; 4 iterations, 16 fp8 candidates,
#               2026-12-05, issue 85's code, the same box): per iteration above flat DGPO's (its high-contrast groups)
THRESHOLDS = {"dgpo": 0.03, "tree_dgpo": 0.01, "two_stage_dgpo": 0.035, "nft": 0.02, "g2rpo": 0.04, "sol_rl": 0.02, "flow_grpo": 0.06, "awm": 0.012,
              "dpo": 0.015, "flow_grpo_fast": 0.06, "flow_dppo": 0.015, "branchgrpo": 0.05, "gdro": 0.037, "mixgrpo": 0.05}


def learning_config(engine: str, store=None, seed: int = 0):
    """The default preset with the task's settings and `engine`'s, the brightness reward alone."""
    task = [f"data.prompts=[{', '.join(PROMPTS)}]", "data.prompt_file=null", "reward.weights={brightness: 1.0}",
            "reward.channel_weights={}", "reward.judge=null", f"trainer.seed={seed}"]
    return load_config(None, [*COMMON, *task, *ENGINES[engine], *([f"data.offline={store}"] if store else [])])


def base_store(tmp_path, seed: int = 0) -> str:
    """GDRO's group store: the base model's groups of the two prompts (the task's ODE steps), with their brightness."""
    from flowrl.models import load_policy
    from flowrl.offline.build import build_store
    from flowrl.train.rollouts.common import training_spec
    from rewards import MultiReward

    cfg, out = learning_config("dgpo", seed=seed), tmp_path / "store"
    policy = load_policy(cfg.model)
    build_store(policy, MultiReward.from_config(cfg.reward), PROMPTS, out, training_spec(cfg, 0, policy), cfg.data.group_size,
                cfg.trainer.seed, cfg.sampling.batch_size, {"model": cfg.model.path}, progress=False)
    return str(out)


def held_out_brightness(trainer) -> float:
    prompts = [p for p in PROMPTS for _ in HELD_OUT_SEEDS]
    seeds = HELD_OUT_SEEDS * len(PROMPTS)
    s = trainer.cfg.sampling
    return ode_images(trainer.policy, prompts, seeds, shifted_sigmas(s.eval_num_steps, s.shift), len(prompts)).mean().item()


_BEFORE: dict[str, float] = {}  # the untrained policy's held-out brightness per model and eval grid: the base model's


def brightness_gain(engine: str, tmp_path, seed: int = 0) -> float:
    """Held-out brightness after training minus before (`seed`: trainer.seed, for the calibration). Before training
    the adapter is zero, so "before" is the base model's, measured once per model and eval grid in a process."""
    store = base_store(tmp_path, seed) if engine == "gdro" else None
    trainer = Trainer(learning_config(engine, store, seed), run_dir=tmp_path / "run")
    s = trainer.cfg.sampling
    key = repr((trainer.cfg.model, s.eval_num_steps, s.shift))
    if key not in _BEFORE:
        _BEFORE[key] = held_out_brightness(trainer)
    trainer.train()
    return held_out_brightness(trainer) - _BEFORE[key]


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["engine", pytest.param("control", marks=pytest.mark.skipif(
    not os.environ.get("FLOWRL_CONTROLS"), reason="the controls run on request (FLOWRL_CONTROLS=1): they show the threshold can fail"))])
@pytest.mark.parametrize("engine", [e if e in THRESHOLDS else pytest.param(e, marks=pytest.mark.skip(
    reason="not yet separated from its control at a suite-sized budget (the calibration above)")) for e in ENGINES])
def test_every_engine_raises_held_out_brightness_and_its_control_does_not(tmp_path, monkeypatch, engine, arm):
    if arm == "control":
        permute_rewards_within_groups(monkeypatch)
    torch.manual_seed(0)
    gain = brightness_gain(engine, tmp_path)
    assert (gain > THRESHOLDS[engine]) == (arm == "engine"), (engine, arm, gain)
