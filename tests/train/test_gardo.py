"""objective.grpo.regularizer gardo (flowrl/train/objectives/gardo.py) in the trainer: its checks, an
iteration's gate and advantages from the experience, the KL on gated transitions only, the reference
reset copying the adapter exactly, and its state through a checkpoint's tensors; then the regularizer
alone on the worked numbers of GARDO's reference code (tinnerhrhe/GARDO scripts/train_sd3_grpo_gardo.py,
`PerPromptStatTracker.update` type 'gardo', `RiskCompensator`), the reset decided on the KL averaged over
processes. Every expectation is written out here, never computed with flowrl's GARDO functions."""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowrl.config import load_config
from flowrl.errors import ConfigError
from fake_processes import run_processes

FAST = ["sampling.num_steps=3", "sampling.eval_num_steps=2", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=2", "lora.alpha=4", "run.sample_every=0",
        "run.checkpoint_every=0"]
GARDO = ["objective.grpo.regularizer=gardo", "reward.weights={jpeg_compressibility: 1.0, brightness: 0.0}",
         "objective.grpo.gardo_auxiliary=[brightness]", "trainer.kl_beta=0.04"]


def descending_ranks(values: list[float]) -> list[int]:
    """The reference's ranks: a descending sort, rank 1 for the largest (ties in order of appearance)."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    ranks = [0] * len(values)
    for rank, i in enumerate(order, start=1):
        ranks[i] = rank
    return ranks


def gate_by_hand(main: list[float], auxiliary: list[list[float]], kappa: float, sign: str) -> list[bool]:
    """u = rank_main - mean rank_aux (the code's; the paper's reading negates it), the threshold the
    100 (1 - kappa) percentile (linear) of the u >= 0, the gate u > threshold."""
    aux_ranks = [descending_ranks(column) for column in auxiliary]
    u = [m - sum(r[i] for r in aux_ranks) / len(aux_ranks) for i, m in enumerate(descending_ranks(main))]
    u = [-x for x in u] if sign == "paper" else u
    nonneg = [x for x in u if x >= 0]
    if not nonneg:
        return [False] * len(u)
    threshold = float(np.percentile(nonneg, 100 * (1 - kappa)))
    return [x > threshold for x in u]


def advantages_by_hand(rewards: list[float], groups: list[int], features: torch.Tensor, clip: float) -> list[float]:
    """Per group: novelty n_a = min over b != a of 1 - clip(cos(e_a, e_b), -1, 1); w_a = n_a / mean n where
    r_a >= the group mean, else 1 (1 throughout when every n is 0); A_a = (r_a - mean r) w_a, no std;
    clamped to +-clip."""
    e = [f / f.norm() for f in features.double()]
    out = [0.0] * len(rewards)
    for g in sorted(set(groups)):
        members = [i for i, h in enumerate(groups) if h == g]
        mean_r = sum(rewards[i] for i in members) / len(members)
        novelty = {a: min(1 - float((e[a] @ e[b]).clamp(-1, 1)) for b in members if b != a) for a in members}
        mean_n = sum(novelty.values()) / len(members)
        for a in members:
            centred = rewards[a] - mean_r
            w = novelty[a] / mean_n if centred >= 0 and mean_n > 0 else 1.0
            out[a] = max(-clip, min(clip, centred * w))
    return out


def test_gardo_is_refused_without_what_it_needs():
    with pytest.raises(ConfigError, match="needs objective.grpo.gardo_auxiliary"):
        load_config("tiny_jpeg", ["objective.grpo.regularizer=gardo", "trainer.kl_beta=0.04"])
    with pytest.raises(ConfigError, match="'shapes' is not among the scored rewards"):
        load_config("tiny_jpeg", [*GARDO, "objective.grpo.gardo_auxiliary=[shapes]"])
    with pytest.raises(ConfigError, match="needs trainer.kl_beta > 0"):
        load_config("tiny_jpeg", [*GARDO, "trainer.kl_beta=0"])
    with pytest.raises(ConfigError, match="objective.grpo.gardo_gate_sign must be one of paper, reference_code"):
        load_config("tiny_jpeg", [*GARDO, "objective.grpo.gardo_gate_sign=sideways"])
    with pytest.raises(ConfigError, match="objective.grpo.regularizer must be one of kl, gardo"):
        load_config("tiny_jpeg", ["objective.grpo.regularizer=l2"])


@pytest.fixture(scope="module")
def gardo_run(tiny_sd3_dir, tmp_path_factory):
    """Three iterations with the reference reset after more than one iteration without one (so at the third),
    never by the KL (a threshold of 1e9)."""
    from accelerate.state import AcceleratorState
    from flowrl.train.loop import Trainer

    AcceleratorState._reset_state()
    torch.set_num_threads(1)
    cfg = load_config("tiny_jpeg", [*FAST, *GARDO, f"model.path={tiny_sd3_dir}", "trainer.iterations=3",
                                    "objective.grpo.gardo_reset_every=1", "objective.grpo.gardo_kappa=0.5",
                                    "objective.grpo.gardo_kl_threshold=1e9"])
    trainer = Trainer(cfg, run_dir=tmp_path_factory.mktemp("gardo") / "run")
    gardo = trainer.objective.gardo
    seen, features_seen = [], []
    prepare, kl, features = gardo.prepare, gardo.kl, gardo.features

    def recording_features(experience):
        out = features(experience)
        features_seen.append(out.clone())
        return out

    def recording_prepare(experience):
        before = {n: p.detach().clone() for n, p in trainer.params.items()}
        groups, stats = prepare(experience)
        seen.append({"before": before, "reference": {n: t.clone() for n, t in gardo.reference.shadow.items()},
                     "gate": gardo.gate.clone(), "experience": experience, "groups": groups, "stats": stats, "kls": [],
                     "features": features_seen[-1]})
        return groups, stats

    def recording_kl(mb, rows, keep):
        value = kl(mb, rows, keep)
        seen[-1]["kls"].append((mb, rows.detach(), value.detach()))
        return value

    gardo.prepare, gardo.kl, gardo.features = recording_prepare, recording_kl, recording_features
    try:
        history = trainer.train()
    finally:
        AcceleratorState._reset_state()
    return trainer, history, seen


def test_gardo_gates_by_rank_disagreement_and_logs_its_columns(gardo_run):
    trainer, history, seen = gardo_run
    assert [row["gardo_reset"] for row in history] == [0.0, 0.0, 1.0]
    assert all(0 < row["gardo_kappa"] <= 0.5 and 0 <= row["gardo_gated"] <= 1 for row in history)
    first = seen[0]
    e = first["experience"]
    assert bool(e.valid.all())
    # channels: jpeg_compressibility (trained), brightness (auxiliary); the first kappa is gardo_kappa
    expected = gate_by_hand(e.reward_totals.tolist(), [e.rewards[:, 1].tolist()], 0.5, "paper")
    assert first["gate"].tolist() == expected
    assert any(expected) and not all(expected)
    assert history[0]["gardo_gated"] == pytest.approx(sum(expected) / len(expected))


def test_gardo_advantages_replace_the_estimators_and_the_kl_counts_gated_rows_only(gardo_run):
    trainer, _, seen = gardo_run
    first = seen[0]
    e = first["experience"]
    # the feature space without an image encoder: each decoded sample area-averaged to 16 x 16 pixels, flattened
    images = trainer.policy.decode(torch.cat([sb.x0 for sb in e.samples]))
    order = torch.cat([sb.index for sb in e.samples])
    pooled = torch.zeros(len(e.valid), 3 * 16 * 16)
    pooled[order] = F.adaptive_avg_pool2d(images.float(), 16).flatten(1)
    assert torch.allclose(first["features"], pooled, atol=1e-6)
    expected = torch.tensor(advantages_by_hand(e.reward_totals.tolist(), e.prompt_ids.tolist(), first["features"],
                                               trainer.cfg.advantage.clip), dtype=torch.float32)
    for group in first["groups"]:
        for mb in group:
            assert torch.allclose(mb.advantages, expected[mb.index], atol=1e-6)
    for mb, rows, value in first["kls"]:
        gate = first["gate"][mb.index]
        want = rows[gate].mean() if gate.any() else torch.tensor(0.0)
        assert value.item() == pytest.approx(want.item(), abs=1e-9)


def test_the_reset_copies_the_adapter_exactly_and_the_state_round_trips(gardo_run):
    trainer, _, seen = gardo_run
    third = seen[2]  # reset at its start: the reference is the weights as the third iteration found them
    assert all(torch.equal(third["reference"][n], third["before"][n].float()) for n in third["before"])
    assert any(not torch.equal(seen[1]["reference"][n], third["reference"][n]) for n in third["reference"])
    gardo = trainer.objective.gardo
    state = trainer.objective.state_dict()
    kappa, history, since = gardo.kappa.kappa, list(gardo.kappa.history), gardo.since_reset
    gardo.kappa.kappa, gardo.kappa.history, gardo.since_reset = 0.3, [], 0
    gardo.reference.shadow = {n: torch.zeros_like(t) for n, t in gardo.reference.shadow.items()}
    trainer.objective.load_state_dict(state, "test")
    assert (gardo.kappa.kappa, gardo.kappa.history, gardo.since_reset) == (pytest.approx(kappa), pytest.approx(history), since)
    assert all(torch.equal(gardo.reference.shadow[n], third["reference"][n]) for n in third["reference"])


# ---- the regularizer alone, on the reference's worked numbers --------------------------------------------------


class Rows(NamedTuple):
    """A micro-batch as GardoRegularizer sees one: its rows' samples and advantages."""

    index: torch.Tensor
    advantages: torch.Tensor


ONE_PROCESS = SimpleNamespace(device=torch.device("cpu"), num_processes=1, reduce=lambda tensor, reduction="sum": tensor.clone())


def regularizer(accelerator=ONE_PROCESS, channels=("main", "aux"), auxiliary=("aux",), sign="reference_code", kappa=0.1,
                diversity=True):
    """GardoRegularizer over a one-weight 'adapter', with the reference's settings (kl_thres 3e-4, reset_freq 15)."""
    from flowrl.train.objectives.gardo import GardoRegularizer

    g = SimpleNamespace(gardo_kappa=kappa, gardo_auxiliary=list(auxiliary), gardo_gate_sign=sign, gardo_kl_threshold=3e-4,
                        gardo_reset_every=15, gardo_diversity=diversity)
    cfg = SimpleNamespace(objective=SimpleNamespace(grpo=g), advantage=SimpleNamespace(clip=5.0))
    return GardoRegularizer(SimpleNamespace(cfg=cfg, params={"w": torch.nn.Parameter(torch.zeros(2))}, accelerator=accelerator,
                                            reward_fn=SimpleNamespace(channel_names=list(channels))))


def experience(main: list[float], auxiliary: list[list[float]], groups: list[int] | None = None) -> SimpleNamespace:
    """An iteration's experience: the trained reward, the auxiliary channels' columns, one micro-batch of every sample."""
    n = len(main)
    rewards = torch.tensor([[m, *a] for m, a in zip(main, zip(*auxiliary))])
    return SimpleNamespace(valid=torch.ones(n, dtype=torch.bool), reward_totals=torch.tensor(main), rewards=rewards,
                           prompt_ids=torch.tensor(groups or [0] * n), transitions=[[Rows(torch.arange(n), torch.zeros(n))]])


def test_the_worked_group_gets_diversity_weights_0_3_1():
    reg = regularizer()
    reg.features = lambda _: torch.tensor([[1.0, 0.0], [0.6, 0.8], [1.0, 0.0]])
    groups, _ = reg.prepare(experience([1.0, 1.0, 0.0], [[0.5, 0.5, 0.5]]))
    # mean reward 2/3; nearest-neighbour cosine distances [0, 0.4, 0], their mean 0.1333: weights [0, 3, 1] (the
    # below-mean sample keeps 1); A = (r - 2/3) x w with no std division
    assert groups[0][0].advantages.tolist() == pytest.approx([0.0, 1.0, -0.6667], abs=1e-4)


def test_the_worked_ranks_gate_the_sample_the_main_reward_ranks_worst_at_kappa_0_1():
    exp = experience([3.0, 2.0, 1.0], [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    reg = regularizer(channels=("main", "aes", "ir"), auxiliary=("aes", "ir"), diversity=False)
    _, stats = reg.prepare(exp)
    # rank_main [1, 2, 3], rank_aux [3, 2, 1]: u = [-2, 0, 2]; the u >= 0 are {0, 2}, their 90th percentile 1.8
    assert reg.gate.tolist() == [False, False, True]
    assert stats["gardo_kappa"] == pytest.approx(0.1) and stats["gardo_gated"] == pytest.approx(1 / 3)
    paper = regularizer(channels=("main", "aes", "ir"), auxiliary=("aes", "ir"), sign="paper", diversity=False)
    paper.prepare(exp)  # the paper's reading: u = [2, 0, -2], the sample the main reward over-rates
    assert paper.gate.tolist() == [True, False, False]


def test_kappa_grows_shrinks_and_clips_with_the_mean_of_the_nonnegative_disagreements():
    reg = regularizer(channels=("main", "aes", "ir"), auxiliary=("aes", "ir"), diversity=False)

    def kappa_after(main, aux):
        return reg.prepare(experience(main, [aux, aux]))[1]["gardo_kappa"]

    assert kappa_after([3.0, 2.0, 1.0], [1.0, 2.0, 3.0]) == pytest.approx(0.1)  # u = [-2, 0, 2], mean 1: the first, kappa0
    assert kappa_after([4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.11)  # u = [-3, -1, 1, 3], 2 > 1: x 1.1
    assert reg.gate.tolist() == [False, False, False, True]  # the 89th percentile of {1, 3}: 2.78
    assert kappa_after([3.0, 2.0, 1.0], [3.0, 2.0, 1.0]) == pytest.approx(0.099)  # u = 0, mean 0 < min(1, 2): x 0.9
    assert kappa_after([3.0, 2.0, 1.0], [1.0, 2.0, 3.0]) == pytest.approx(0.099)  # mean 1, within [0, 2]: unchanged
    high = regularizer(channels=("main", "aes", "ir"), auxiliary=("aes", "ir"), kappa=0.19, diversity=False)
    high.prepare(experience([3.0, 2.0, 1.0], [[1.0, 2.0, 3.0]] * 2))
    assert high.prepare(experience([4.0, 3.0, 2.0, 1.0], [[1.0, 2.0, 3.0, 4.0]] * 2))[1]["gardo_kappa"] == pytest.approx(0.2)
    low = regularizer(channels=("main", "aes", "ir"), auxiliary=("aes", "ir"), kappa=0.021, diversity=False)
    low.prepare(experience([3.0, 2.0, 1.0], [[1.0, 2.0, 3.0]] * 2))
    assert low.prepare(experience([3.0, 2.0, 1.0], [[3.0, 2.0, 1.0]] * 2))[1]["gardo_kappa"] == pytest.approx(0.02)  # 0.0189


def test_the_kl_is_zero_when_no_row_is_gated_and_the_gated_rows_mean_otherwise():
    reg = regularizer()
    rows, mb = torch.tensor([1.0, 2.0, 4.0], requires_grad=True), Rows(torch.arange(3), torch.zeros(3))
    reg.gate = torch.zeros(3, dtype=torch.bool)
    zero = reg.kl(mb, rows, slice(None))
    assert zero.item() == 0.0 and zero.requires_grad  # the loss is then the policy term alone
    reg.gate = torch.tensor([False, True, True])
    assert reg.kl(mb, rows, slice(None)).item() == pytest.approx(3.0)


def test_the_reference_resets_after_a_step_whose_kl_passed_3e_4_and_copies_the_weights():
    reg, exp = regularizer(diversity=False), experience([3.0, 2.0, 1.0], [[1.0, 2.0, 3.0]])
    assert reg.prepare(exp)[1]["gardo_reset"] == 0.0
    reg.step_kls = [3e-4]  # not above the threshold
    reg.after_step()
    assert reg.prepare(exp)[1]["gardo_reset"] == 0.0
    with torch.no_grad():
        reg.ctx.params["w"].copy_(torch.tensor([0.5, -1.5]))
    reg.step_kls = [2e-4, 5e-4]  # the step's mean 3.5e-4
    reg.after_step()
    assert reg.prepare(exp)[1]["gardo_reset"] == 1.0
    assert torch.equal(reg.reference.shadow["w"], torch.tensor([0.5, -1.5]))
    assert reg.prepare(exp)[1]["gardo_reset"] == 0.0  # once


def test_the_reference_resets_after_more_than_15_iterations_without_one():
    reg, exp = regularizer(diversity=False), experience([3.0, 2.0, 1.0], [[1.0, 2.0, 3.0]])
    resets = [reg.prepare(exp)[1]["gardo_reset"] == 1.0 for _ in range(34)]
    # the reference, at the start of epoch e: reset when e - prev_epoch > reset_freq (15), prev_epoch the last reset's (0 at first)
    expected, prev_epoch = [], 0
    for epoch in range(34):
        expected.append(epoch - prev_epoch > 15)
        prev_epoch = epoch if expected[-1] else prev_epoch
    assert resets == expected
    assert [e for e, r in enumerate(resets) if r] == [16, 32]


@pytest.mark.parametrize("kls, reset", [
    (([4e-4], [1e-4]), False),  # one process above 3e-4, the mean over processes (2.5e-4) below: neither resets
    (([1e-4, 1e-4], [6e-4]), True),  # each process's step mean (1e-4, 6e-4), their mean 3.5e-4: both reset
    (([], [4e-4]), True),  # a process that computed no KL this step stays out of the mean
])
def test_the_reset_follows_the_steps_kl_averaged_over_processes(kls, reset):
    def one_process(accelerator):
        reg = regularizer(accelerator=accelerator, diversity=False)
        reg.step_kls = list(kls[accelerator.process_index])
        reg.after_step()
        return reg.kl_exceeded

    assert run_processes(2, one_process) == [reset, reset]
