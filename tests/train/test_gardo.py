"""objective.grpo.regularizer gardo (flowrl/train/objectives/gardo.py) in the trainer: its checks, an
iteration's gate and advantages from the experience, the KL on gated transitions only, the reference
reset copying the adapter exactly, and its state through a checkpoint's tensors. The math itself is
tested against the spec's numbers in tests/core/test_gardo_math.py."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import ConfigError

FAST = ["sampling.num_steps=3", "sampling.eval_num_steps=2", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=2", "lora.alpha=4", "run.sample_every=0",
        "run.checkpoint_every=0"]
GARDO = ["objective.grpo.regularizer=gardo", "reward.weights={jpeg_compressibility: 1.0, brightness: 0.0}",
         "objective.grpo.gardo_auxiliary=[brightness]", "trainer.kl_beta=0.04"]


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
    seen = []
    prepare, kl = gardo.prepare, gardo.kl

    def recording_prepare(experience):
        before = {n: p.detach().clone() for n, p in trainer.params.items()}
        groups, stats = prepare(experience)
        seen.append({"before": before, "reference": {n: t.clone() for n, t in gardo.reference.shadow.items()},
                     "gate": gardo.gate.clone(), "experience": experience, "groups": groups, "stats": stats, "kls": []})
        return groups, stats

    def recording_kl(mb, rows, keep):  # rows: the kept transitions' KL in objective.grpo.kl_form
        value = kl(mb, rows, keep)
        seen[-1]["kls"].append((mb, rows.detach(), value.detach()))
        return value

    gardo.prepare, gardo.kl = recording_prepare, recording_kl
    try:
        history = trainer.train()
    finally:
        AcceleratorState._reset_state()
    return trainer, history, seen


def test_gardo_gates_by_rank_disagreement_and_logs_its_columns(gardo_run):
    from flowrl.core.gardo import uncertainty, uncertainty_gate

    trainer, history, seen = gardo_run
    assert [row["gardo_reset"] for row in history] == [0.0, 0.0, 1.0]
    assert all(0 < row["gardo_kappa"] <= 0.5 and 0 <= row["gardo_gated"] <= 1 for row in history)
    first = seen[0]
    e = first["experience"]
    u = uncertainty(e.reward_totals, e.rewards[:, [1]], "paper")  # channels: jpeg_compressibility, brightness
    assert torch.equal(first["gate"], uncertainty_gate(u, 0.5))
    assert first["gate"].any() and not first["gate"].all()


def test_gardo_advantages_replace_the_estimators_and_the_kl_counts_gated_rows_only(gardo_run):
    from flowrl.core.gardo import diversity_aware_advantages, nearest_neighbour_novelty
    from flowrl.train.monitor.image_stats import pixel_features

    trainer, _, seen = gardo_run
    first = seen[0]
    e = first["experience"]
    images = trainer.policy.decode(torch.cat([sb.x0 for sb in e.samples]))
    order = torch.cat([sb.index for sb in e.samples])
    feats = torch.zeros(len(e.valid), pixel_features(images).shape[1])
    feats[order] = pixel_features(images)
    expected = diversity_aware_advantages(e.reward_totals, e.prompt_ids, nearest_neighbour_novelty(feats, e.prompt_ids))
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
