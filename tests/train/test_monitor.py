"""The monitor (docs/monitor.md): each image statistic against its formula written out here on images built
for it, each rule firing on a synthetic history and silent on a clean one, the trainer's evaluations in the
metrics rows, rollback restoring the `best` weights exactly, and `--checkpoint best`."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.train.monitor import image_stats as st
from flowrl.train.monitor.rules import Evaluation, check_rules, diversity_collapse, gold_divergence, stat_drift
from flowrl.train.monitor.options import MonitorConfig

H = W = 10


def _image(r, g, b, n=1):
    return torch.tensor([r, g, b]).view(1, 3, 1, 1).expand(n, 3, H, W).clone()


def _half_black_half_white():
    x = torch.zeros(1, 3, H, W)
    x[..., W // 2:] = 1.0
    return x


# ---- the statistics ----------------------------------------------------------------------------------
def test_a_black_image_is_dark_without_edges_or_entropy():
    black = torch.zeros(2, 3, H, W)
    assert st.brightness(black) == 0 and st.saturation(black) == 0
    assert st.dark_fraction(black) == 1 and st.bright_fraction(black) == 0
    assert st.colour_entropy(black) == 0 and st.edge_density(black) == 0


def test_a_single_colour_has_its_luminance_and_hsv_saturation_and_no_entropy():
    r, g, b = 0.8, 0.4, 0.2
    x = _image(r, g, b)
    assert st.brightness(x) == pytest.approx(0.299 * r + 0.587 * g + 0.114 * b)
    assert st.saturation(x) == pytest.approx((0.8 - 0.2) / 0.8)
    assert st.colour_entropy(x) == 0 and st.edge_density(x) == 0
    assert st.dark_fraction(x) == 0 and st.bright_fraction(x) == 0  # Y = 0.5022
    assert st.saturation(_image(0.5, 0.5, 0.5)) == 0  # grey
    assert st.bright_fraction(_image(1.0, 1.0, 1.0)) == 1


def test_half_black_half_white_is_one_bit_with_the_two_sobel_columns_beside_the_step():
    x = _half_black_half_white()
    assert st.brightness(x) == pytest.approx(0.5)
    assert st.dark_fraction(x) == 0.5 and st.bright_fraction(x) == 0.5
    assert st.colour_entropy(x) == pytest.approx(1.0)
    # Sobel x on the interior: |Gx| = 4 on the columns W/2 - 1 and W/2 (either side of the step), 0 elsewhere
    assert st.edge_density(x) == pytest.approx(2 * (H - 2) / ((H - 2) * (W - 2)))
    assert st.edge_density(x * 0.2) == 0  # a step of 0.2: magnitude 0.8, under the threshold of 1


def test_noise_statistics_match_their_formulas_written_out():
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    assert st.brightness(x) == pytest.approx(y.mean().item(), rel=1e-6)
    assert st.dark_fraction(x) == pytest.approx((y < 0.15).float().mean().item())
    mx, mn = x.max(1).values, x.min(1).values
    assert st.saturation(x) == pytest.approx(((mx - mn) / mx).mean().item(), rel=1e-5)
    entropies = []
    for img in x:
        q = (img * 4).floor().clamp(max=3).long()
        cells = (q[0] * 16 + q[1] * 4 + q[2]).flatten().tolist()
        counts = [cells.count(c) for c in set(cells)]
        entropies.append(-sum(c / len(cells) * math.log2(c / len(cells)) for c in counts))
    assert st.colour_entropy(x) == pytest.approx(sum(entropies) / 3, rel=1e-5)
    assert 5.5 < st.colour_entropy(x) <= 6  # near-uniform over the 64 cells


def test_video_frames_count_as_images_and_frame_change_is_the_mean_step():
    video = torch.zeros(1, 3, 3, H, W)  # [N, 3, F, H, W]
    video[:, :, 1] = 0.5
    video[:, :, 2] = 1.0
    stats = st.image_statistics(video)
    assert stats["brightness"] == pytest.approx(0.5)
    assert stats["frame_change"] == pytest.approx(0.5)
    assert "frame_change" not in st.image_statistics(torch.zeros(1, 3, H, W))


def test_group_diversity_is_the_mean_pairwise_distance_within_groups():
    black, white = torch.zeros(1, 3, H, W), torch.ones(1, 3, H, W)
    features = st.pixel_features(torch.cat([black, white, black, black]), side=4)
    groups = torch.tensor([0, 0, 1, 1])
    # group 0: black vs white, RMS distance 1; group 1: identical images, 0
    assert st.group_diversity(features, groups) == pytest.approx(0.5)
    e = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    # cosine distances 0.4, 1.0, 0.2 over the three pairs
    assert st.group_diversity(e, torch.zeros(3), "cosine") == pytest.approx((0.4 + 1.0 + 0.2) / 3)


# ---- the rules ---------------------------------------------------------------------------------------
def _evals(train, gold, stats=None, diversity=None):
    return [Evaluation(10 * i, t, {"shapes/strict": g}, dict(stats or {}), diversity) for i, (t, g) in enumerate(zip(train, gold))]


def test_gold_divergence_needs_k_evaluations_in_a_row_of_training_up_and_gold_down():
    hacked = _evals([0.1, 0.2, 0.3, 0.4], [0.5, 0.4, 0.3, 0.2])
    assert gold_divergence(hacked, 3) == ["shapes/strict"]
    assert gold_divergence(hacked[:3], 3) == []  # two steps only
    assert gold_divergence(hacked, 3, min_drop=0.15) == []  # each drop is 0.1
    assert gold_divergence(_evals([0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]), 3) == []  # both rise: learning
    assert gold_divergence(_evals([0.1, 0.2, 0.3, 0.4], [0.5, 0.4, 0.45, 0.2]), 3) == []  # gold rose once
    assert gold_divergence(_evals([0.1, 0.2, 0.15, 0.4], [0.5, 0.4, 0.3, 0.2]), 3) == []  # training fell once


def test_stat_drift_and_diversity_collapse_fire_beyond_their_thresholds_only():
    base = {"brightness": 0.3, "colour_entropy": 4.0}
    assert stat_drift({"brightness": 0.1, "colour_entropy": 3.5}, base, {"brightness": 0.15, "colour_entropy": 1.0}) == \
        pytest.approx({"brightness": -0.2})
    assert stat_drift({"brightness": 0.4, "colour_entropy": 3.5}, base, {"brightness": 0.15, "colour_entropy": 1.0}) == {}
    assert diversity_collapse(0.3, 0.5) and not diversity_collapse(0.7, 0.5) and not diversity_collapse(None, 0.5)


def test_check_rules_names_each_rule_with_its_action_and_stays_silent_on_a_clean_history():
    options = MonitorConfig(on_gold_divergence="rollback", on_drift="warn", on_diversity="stop")
    base = {"brightness": 0.3, "dark_fraction": 0.4}
    hacked = _evals([0.1, 0.2, 0.3, 0.4], [0.5, 0.4, 0.3, 0.2], {"brightness": 0.05, "dark_fraction": 0.9}, 0.2)
    fired = {f.rule: f.action for f in check_rules(hacked, base, options)}
    assert fired == {"gold_divergence": "rollback", "stat_drift": "warn", "diversity_collapse": "stop"}
    clean = _evals([0.1, 0.2, 0.3, 0.4], [0.5, 0.55, 0.6, 0.62], {"brightness": 0.32, "dark_fraction": 0.38}, 0.9)
    assert check_rules(clean, base, options) == []


def test_rules_firing_together_share_one_rollback_and_a_spent_budget_stops(monkeypatch):
    import flowrl.train.monitor.watch as watch
    from flowrl.train.monitor.rules import Firing

    restored = []
    monkeypatch.setattr(watch, "rollback", lambda tr: (restored.append(tr.iteration), setattr(tr.monitor, "rollbacks",
                                                                                           tr.monitor.rollbacks + 1)))
    mon = SimpleNamespace(best_pending=False, rollbacks=0, fired=[], options=MonitorConfig(max_rollbacks=1))
    tr = SimpleNamespace(monitor=mon, iteration=15, accelerator=SimpleNamespace(is_main_process=False), stop_reason=None)
    both = [Firing("gold_divergence", "rollback", "gold fell"), Firing("stat_drift", "warn", "drifted"),
            Firing("diversity_collapse", "rollback", "collapsed")]
    watch.act_all(tr, both)
    assert restored == [15] and mon.rollbacks == 1 and tr.stop_reason is None  # one restore, one of the budget
    assert mon.fired == [("gold_divergence", "rollback", 15), ("stat_drift", "warn", 15), ("diversity_collapse", "rollback", 15)]
    tr.iteration = 25
    watch.act_all(tr, both)  # the budget of one is spent: the next evaluation's rollbacks stop the run
    assert restored == [15] and tr.stop_reason == "monitor: diversity_collapse"
    assert [a for _, a, it in mon.fired if it == 25] == ["stop", "warn", "stop"]


def test_the_monitor_section_is_validated():
    with pytest.raises(ConfigError, match="monitor.on_drift must be one of warn, stop, rollback"):
        load_config("tiny_jpeg", ["monitor.on_drift=explode"])
    with pytest.raises(ConfigError, match="monitor.gold 'shapes/loose' names no channel of reward 'shapes'"):
        load_config("tiny_jpeg", ["monitor.enabled=true", "monitor.gold=[shapes/loose]"])
    with pytest.raises(ConfigError, match="rollback restores the `best` checkpoint"):
        load_config("tiny_jpeg", ["monitor.enabled=true", "monitor.on_drift=rollback"])
    with pytest.raises(ConfigError, match="monitor.drift's statistics must be one of"):
        load_config("tiny_jpeg", ["monitor.drift={glow: 0.1}"])
    assert load_config("tiny_jpeg", ["monitor.enabled=true", "monitor.gold=[shapes/strict]"]).monitor.gold == ["shapes/strict"]


def test_the_shapes_artefact_measures_are_watched_on_shapes_world_prompts_only():
    from flowrl.train.monitor.watch import Monitor

    on = ["monitor.enabled=true", "monitor.drift={background_impurity: 2.0, patch_energy: 0.01}"]
    assert Monitor(load_config("tiny_jpeg", on + ["monitor.prompts=[a red circle, two blue squares]"])).shapes_world
    assert not Monitor(load_config("tiny_jpeg", ["monitor.enabled=true", "monitor.prompts=[a cat]"])).shapes_world
    with pytest.raises(ConfigError, match="monitor.drift names background_impurity.*'a yellow star above a cat' is not one"):
        Monitor(load_config("tiny_jpeg", on))  # its training prompts include one outside the shapes grammar


# ---- in the trainer ----------------------------------------------------------------------------------
FAST = ["sampling.num_steps=3", "sampling.eval_num_steps=2", "data.prompts_per_iteration=2", "data.group_size=2",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=2", "lora.alpha=4", "run.sample_every=0"]


class ScriptedGold:
    """A gold reward whose mean follows a script, one value per monitor evaluation (the base's first)."""

    channel_names = ["brightness"]

    def __init__(self, values):
        self.values = list(values)

    def __call__(self, images, prompts):
        return torch.full((len(images), 1), self.values.pop(0))


@pytest.fixture(scope="module")
def rolled_back_run(tiny_sd3_dir, tmp_path_factory):
    """Three iterations evaluated after each; every statistic drifts (a threshold of 1e-9) with action
    rollback; gold 0.9 after iteration 1 (the best), then 0.3 and 0.2: iterations 2 and 3 roll back to 1."""
    import flowrl.train.monitor.watch as watch
    from accelerate.state import AcceleratorState
    from flowrl.train.loop import Trainer

    AcceleratorState._reset_state()
    torch.set_num_threads(1)
    cfg = load_config("tiny_jpeg", FAST + [f"model.path={tiny_sd3_dir}", "trainer.iterations=3", "run.checkpoint_every=1",
                                           "monitor.enabled=true", "monitor.every=1", "monitor.gold=[brightness]",
                                           "monitor.num_prompts=2", "monitor.seeds=2", "monitor.on_drift=rollback",
                                           "monitor.drift={brightness: 1e-9}", "monitor.max_rollbacks=5"])
    run = tmp_path_factory.mktemp("monitor") / "run"
    trainer = Trainer(cfg, run_dir=run)
    trainer.monitor.gold = ScriptedGold([0.5, 0.9, 0.3, 0.2])
    before = []
    original = watch.rollback

    def recording(tr):
        before.append({n: p.detach().clone() for n, p in tr.params.items()})
        original(tr)

    watch.rollback = recording
    try:
        history = trainer.train()
    finally:
        watch.rollback = original
        AcceleratorState._reset_state()
    return SimpleNamespace(trainer=trainer, history=history, before=before, run=run)


def test_rollback_restores_the_best_weights_and_ema_exactly(rolled_back_run):
    from safetensors.torch import load_file

    r = rolled_back_run
    ckpts = r.run / "checkpoints"
    assert (ckpts / "best").read_text() == "iter_000001"
    best = load_file(str(ckpts / "iter_000001" / "trainable.safetensors"))
    best_ema = load_file(str(ckpts / "iter_000001" / "ema.safetensors"))
    assert len(r.before) == 2  # iterations 2 and 3; iteration 1's rollback was the best itself: a warning
    assert any(not torch.equal(r.before[0][n], best[n]) for n in best)  # iteration 2 had trained on
    for n, p in r.trainer.params.items():
        assert torch.equal(p.detach(), best[n]), n
    assert all(torch.equal(r.trainer.ema.shadow[n], best_ema[n]) for n in best_ema)
    last = load_file(str(ckpts / "iter_000003" / "trainable.safetensors"))
    assert all(torch.equal(last[n], best[n]) for n in best)
    assert r.trainer.monitor.rollbacks == 2


def test_the_evaluations_go_into_the_metrics_rows_sheets_and_the_closing_line(rolled_back_run):
    r = rolled_back_run
    rows = [json.loads(line) for line in (r.run / "metrics.jsonl").read_text().splitlines()]
    assert [row["heldout/brightness"] for row in rows] == pytest.approx([0.9, 0.3, 0.2])
    assert all(0 <= row["monitor/brightness"] <= 1 and "monitor/colour_entropy" in row and "time_monitor" in row for row in rows)
    # the tiny SD3's 16-pixel tokens (patch 2 on 8x latents); its two monitor prompts are shapes-world prompts
    assert all(0 <= row["monitor/patch_energy"] <= 1 and row["monitor/background_impurity"] >= 0 for row in rows)
    assert all("patch_energy" in e.stats for e in r.trainer.monitor.evaluations)
    assert all(math.isfinite(row["monitor/diversity"]) for row in rows)
    assert (r.run / "samples" / "monitor_base.png").is_file() and (r.run / "samples" / "monitor_000003.png").is_file()
    line = r.trainer.closing_line()
    assert "monitor: stat_drift (warn) at iteration 1" in line
    assert "monitor: stat_drift (rollback) at iterations 2, 3" in line
    assert "best brightness 0.9 at iteration 1 (--checkpoint best)" in line


def test_checkpoint_best_loads_the_best_checkpoint_and_bad_values_are_refused(rolled_back_run):
    from flowrl.cli import parse_args
    from flowrl.runs import load_run_policy
    from flowrl.errors import UserError

    _, _, ckpt = load_run_policy(rolled_back_run.run, (), "best")
    assert ckpt.name == "iter_000001"
    assert parse_args(["export", "--run", "x", "--checkpoint", "best", "-o", "y"]).checkpoint == "best"
    assert parse_args(["sample", "--run", "x", "--prompt", "a", "--checkpoint", "2"]).checkpoint == 2
    with pytest.raises(UserError, match="must be an iteration"):
        parse_args(["eval", "--run", "x", "--checkpoint", "bestest"])
    (rolled_back_run.run / "checkpoints" / "best").rename(rolled_back_run.run / "best.moved")
    try:
        with pytest.raises(UserError, match="keeps no best checkpoint"):
            load_run_policy(rolled_back_run.run, (), "best")
    finally:
        (rolled_back_run.run / "best.moved").rename(rolled_back_run.run / "checkpoints" / "best")


def test_the_gpu_image_presets_watch_and_the_cheap_ones_do_not():
    from pathlib import Path

    configs = Path(__file__).resolve().parents[2] / "configs"
    gpu = sorted(p.stem for p in configs.glob("*_[18]gpu.yaml") if not p.stem.startswith("qwen25"))  # qwen25: text presets
    assert len(gpu) >= 10
    assert all(load_config(name, validate_paths=False).monitor.enabled for name in gpu)
    assert not load_config("tiny_jpeg").monitor.enabled
    default = load_config(None, validate_paths=False).monitor
    assert not default.enabled and default.gold == ["shapes/strict"] and default.prompt_file == "builtin:shapes-heldout"
    # the schema's statistics thresholds kept, and two artefact measures added (docs/monitor.md)
    assert default.drift == {**MonitorConfig().drift, "background_impurity": 1.0, "fill_nonuniformity": 2.0}


def test_a_stop_ends_the_run_with_a_checkpoint_and_says_so(tiny_sd3_dir, tmp_path):
    from accelerate.state import AcceleratorState
    from flowrl.train.loop import Trainer

    AcceleratorState._reset_state()
    torch.set_num_threads(1)
    cfg = load_config("tiny_jpeg", FAST + [f"model.path={tiny_sd3_dir}", "trainer.iterations=4", "run.checkpoint_every=0",
                                           "monitor.enabled=true", "monitor.every=2", "monitor.num_prompts=1", "monitor.seeds=2",
                                           "monitor.on_drift=stop", "monitor.drift={brightness: 1e-9}"])
    try:
        trainer = Trainer(cfg, run_dir=tmp_path / "run")
        history = trainer.train()
    finally:
        AcceleratorState._reset_state()
    assert len(history) == 2 and trainer.stop_reason == "monitor: stat_drift"  # evaluated after iteration 2: stopped there
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "iter_000002"
    assert not (tmp_path / "run" / "checkpoints" / "best").exists()  # no gold: no best checkpoint
    assert "monitor: stat_drift (stop) at iteration 2" in trainer.closing_line()


def test_a_resumed_run_keeps_the_monitors_record(rolled_back_run):
    from accelerate.state import AcceleratorState
    from flowrl.runtime.run_dir import CONFIG_FILE
    from flowrl.train.loop import Trainer

    r = rolled_back_run
    AcceleratorState._reset_state()
    try:
        resumed = Trainer(load_config(r.run / CONFIG_FILE), run_dir=r.run, resume=True)
    finally:
        AcceleratorState._reset_state()
    before, after = r.trainer.monitor, resumed.monitor
    assert after.base == before.base and after.best == before.best and after.rollbacks == before.rollbacks == 2
    assert after.fired == before.fired and [vars(e) for e in after.evaluations] == [vars(e) for e in before.evaluations]
    assert resumed.closing_line().split("; run:")[0] == r.trainer.closing_line().split("; run:")[0]
