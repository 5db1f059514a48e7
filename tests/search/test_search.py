"""Inference-time search: the core rules on hand-built trees and weights, and the methods on a
Gaussian mixture whose reward-tilted target is known in closed form."""

import math
from types import SimpleNamespace

import pytest
import torch

from flowrl.core.search import (Ledger, SearchTree, effective_sample_size, log_potential, progressive_width,
                                resample_indices, soft_value)
from flowrl.search.dts import dts
from flowrl.search.particles import best_of_n, smc
from flowrl.search.run import run_search
from flowrl.search.dts import branch_steps
from flowrl.search.mixture import MixtureProblem, wasserstein_1d

SIGMAS = torch.linspace(1, 0, 11)  # 10 steps
LAM = 2.0


def mixture(prompts: int) -> MixtureProblem:
    # 80 % of the base mass on the left mode; the tilt exp(2 x) moves 97 % of it to the right one
    return MixtureProblem([0.8, 0.2], [[-1.0], [1.5]], [0.3, 0.3], [1.0], SIGMAS, num_prompts=prompts)


def search_cfg(**kw):
    base = dict(sampler="flow_grpo", noise_level=0.7, lam=LAM, potential="max", resample="adaptive", resample_every=2,
                resampling="systematic", final="best", branch_every=2, width_c=2.0, width_alpha=0.8, uct_c=1.0,
                backup="soft", in_flight=4)
    base.update(kw)
    return SimpleNamespace(**base)


# ---- core ----------------------------------------------------------------------------------------
def test_root_value_of_a_hand_built_tree_is_the_soft_backup_of_its_leaves():
    tree = SearchTree(leaf_depth=2, lam=LAM)
    a, b = tree.add(0), tree.add(0)
    leaves = {tree.add(a): 0.3, tree.add(a): 1.0, tree.add(b): -0.5}
    for leaf, r in leaves.items():
        tree.backup(leaf, r)
    soft = lambda vs: math.log(sum(math.exp(LAM * v) for v in vs) / len(vs)) / LAM  # noqa: E731
    assert tree.value[a] == pytest.approx(soft([0.3, 1.0]), abs=1e-12)
    assert tree.value[b] == pytest.approx(-0.5, abs=1e-12)
    assert tree.value[0] == pytest.approx(soft([soft([0.3, 1.0]), -0.5]), abs=1e-12)
    # the limits: lam = 0 is the mean (the base model's value), max backup the maximum
    v = torch.tensor([0.3, 1.0, -0.5], dtype=torch.float64)
    assert float(soft_value(v, 0.0)) == pytest.approx(0.8 / 3)
    assert float(soft_value(v, LAM, "max")) == 1.0
    assert float(soft_value(v, 1e4)) == pytest.approx(1.0, abs=1e-3)


def test_progressive_widening_and_selection_rules():
    assert [progressive_width(n, 2.0, 0.8) for n in (1, 4, 32)] == [2, 7, 32]
    assert [progressive_width(n, 1.0, 0.5) for n in (1, 2, 5, 16)] == [1, 2, 3, 4]
    # alpha 0 makes every width 1: the root is full and descends, by UCT with no bonus, to its best child
    tree = SearchTree(leaf_depth=3, lam=LAM, width_c=1.0, width_alpha=0.0, selection="uct", uct_c=0.0)
    good, bad = tree.add(0), tree.add(0)
    tree.value[good], tree.value[bad] = 1.0, -1.0
    assert tree.select(torch.Generator().manual_seed(0)) == good  # width 1 everywhere: good has no child yet
    assert tree.pending[good] == 1 and tree.visits[0] == 1 and tree.visits[good] == 2
    tree.cancel(good)
    assert tree.pending[good] == 0 and tree.visits[0] == 0 and tree.visits[good] == 1


def test_drawing_from_a_tree_follows_the_tilted_values():
    tree = SearchTree(leaf_depth=1, lam=1.0)
    lo, hi = tree.add(0), tree.add(0)
    tree.backup(lo, 0.0)
    tree.backup(hi, math.log(3.0))  # exp(lam v) = 3: drawn three times as often
    g = torch.Generator().manual_seed(0)
    draws = [tree.draw(g) for _ in range(4000)]
    assert draws.count(hi) / len(draws) == pytest.approx(0.75, abs=0.03)
    uniform = [tree.draw(g, lam=0.0) for _ in range(4000)]
    assert uniform.count(hi) / len(uniform) == pytest.approx(0.5, abs=0.03)
    assert tree.best_leaf() == hi


def test_resampling_and_effective_sample_size():
    g = torch.Generator().manual_seed(0)
    one_hot = torch.tensor([-1e9, -1e9, 0.0, -1e9], dtype=torch.float64)
    for method in ("systematic", "multinomial"):
        assert resample_indices(one_hot, method, g).tolist() == [2, 2, 2, 2]
    assert float(effective_sample_size(torch.zeros(8))) == pytest.approx(8.0)
    assert float(effective_sample_size(one_hot)) == pytest.approx(1.0)
    # systematic resampling keeps each particle floor(k w) or ceil(k w) times
    w = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    counts = torch.bincount(resample_indices(w.log(), "systematic", g), minlength=4).tolist()
    assert counts == [2, 1, 0, 1] or counts == [2, 1, 1, 0]
    r, prev = torch.tensor([0.2, 0.9]), torch.tensor([0.5, 0.1])
    assert log_potential("max", 2.0, r, prev).tolist() == pytest.approx([1.0, 1.8])
    assert log_potential("diff", 2.0, r, prev).tolist() == pytest.approx([-0.6, 1.6])
    assert log_potential("add", 2.0, r, None).tolist() == pytest.approx([0.4, 1.8])


def test_ledger_refuses_to_overspend():
    ledger = Ledger(budget=10)
    ledger.charge(nfe=10, decodes=3, reward_calls=3)
    assert not ledger.affords(1)
    with pytest.raises(RuntimeError, match="overspent"):
        ledger.charge(nfe=1)


# ---- methods on the Gaussian mixture -----------------------------------------------------------------
@pytest.mark.parametrize("method", ["bon", "smc", "dts", "dts_star"])
def test_no_method_exceeds_its_budget(method):
    problem = mixture(prompts=3)
    budgets = [10, 35, 64]  # not multiples of T = 10
    result = run_search(method, problem, [0, 1, 2], budgets, search_cfg())
    assert result.budgets == budgets
    for budget, ledgers in zip(budgets, result.ledgers):
        for ledger in ledgers:
            assert ledger["nfe"] <= budget
            assert ledger["decodes"] >= 1 and ledger["reward_calls"] == ledger["decodes"]
    # the ledgers count exactly the rows that went through the network
    spent = sum(ledgers[0]["nfe"] for ledgers in result.ledgers) if method == "smc" else sum(lg["nfe"] for lg in result.ledgers[-1])
    assert problem.calls == (spent if method != "smc" else sum(lg["nfe"] for ledgers in result.ledgers for lg in ledgers))
    with pytest.raises(ValueError, match="less than one sample"):
        run_search(method, mixture(1), [0], [9], search_cfg())


def test_smc_with_flat_potentials_is_best_of_n():
    """lam = 0: every potential is 1, the effective sample size stays k, no particle is ever
    resampled, and the best of the k particles is best-of-N's pick from the same seeds."""
    seeds = [3, 4, 5]
    bon = best_of_n(mixture(3), seeds, [80])
    flat = smc(mixture(3), seeds, 80, lam=0.0, resample="adaptive")
    assert torch.equal(flat.latents[0], bon.latents[0]) and torch.equal(flat.rewards[0], bon.rewards[0])
    assert flat.ledgers[0][0]["resamples"] == 0
    steered = smc(mixture(3), seeds, 80, lam=LAM, resample="every")
    assert steered.ledgers[0][0]["resamples"] > 0
    assert not torch.equal(steered.latents[0], bon.latents[0])


def test_dts_samples_approach_the_tilted_target_as_the_budget_grows():
    prompts = 150  # independent trees, one draw each
    problem = mixture(prompts)
    target = problem.sample_tilted(LAM, prompts, torch.Generator().manual_seed(0))
    result = dts(problem, list(range(prompts)), [10, 40, 160], lam=LAM, branch_every=2, in_flight=4)
    distances = [wasserstein_1d(x[:, 0], target) for x in result.latents]
    assert distances[0] > 1.5  # one sample is the base model: mostly the left mode
    assert distances[0] > distances[1] > distances[2]
    assert distances[2] < 0.6


def test_dts_at_lambda_zero_samples_the_base_model():
    prompts = 150
    problem = mixture(prompts)
    g = torch.Generator().manual_seed(1)
    base, target = problem.sample_tilted(0.0, prompts, g), problem.sample_tilted(LAM, prompts, g)
    result = dts(problem, list(range(prompts)), [160], lam=0.0, branch_every=2, in_flight=4)
    drawn = result.latents[0][:, 0]
    assert wasserstein_1d(drawn, base) < 0.25
    assert wasserstein_1d(drawn, target) > 1.5


def test_a_one_sample_budget_is_the_flat_sample_of_the_seed_for_every_method():
    firsts = [run_search(m, mixture(2), [7, 8], [10], search_cfg()).latents[0] for m in ("bon", "smc", "dts", "dts_star")]
    for other in firsts[1:]:
        assert torch.equal(other, firsts[0])


def test_dts_star_finds_higher_rewards_than_its_first_sample_and_reuses_states():
    problem = mixture(20)
    result = dts(problem, list(range(20)), [10, 200], star=True, width_c=1.0, width_alpha=0.5)
    assert float(result.rewards[1].mean()) > float(result.rewards[0].mean()) + 0.5
    # expansions below the root cost less than a whole sample: more finished samples than budget / T
    assert sum(lg["samples"] for lg in result.ledgers[1]) > 20 * 200 // 10


def test_branch_steps_stop_before_the_last_step():
    assert branch_steps(10, 2) == [0, 2, 4, 6, 8]
    assert branch_steps(10, 1) == list(range(9))
    with pytest.raises(ValueError):
        branch_steps(10, 0)


# ---- the CLI -------------------------------------------------------------------------------------------
def test_sample_with_search_writes_images_rewards_and_the_ledger(tmp_path, capsys):
    import json

    from PIL import Image

    from flowrl.cli import main

    out = tmp_path / "found.png"
    argv = ["sample", "--config", "default", "--prompt", "a red circle above a blue square", "--prompt", "a green triangle",
            "-n", "2", "--search", "dts_star", "--budget", "25", "--reward", "shapes_quality", "--out", str(out), "search.num_steps=5"]
    assert main(argv) == 0
    assert Image.open(out).size[0] > 2 * 32
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["search"]["method"] == "dts_star" and report["searched_reward"] == "shapes_quality"
    assert [im["prompt"] for im in report["images"]] == ["a red circle above a blue square"] * 2 + ["a green triangle"] * 2
    assert all(im["ledger"]["nfe"] <= 25 and 0 <= im["reward"] <= 1 for im in report["images"])
    assert report["total"]["nfe"] == sum(im["ledger"]["nfe"] for im in report["images"])
    assert "network evaluations" in capsys.readouterr().out


def test_eval_with_search_prints_the_held_out_table(capsys):
    from flowrl.cli import main

    argv = ["eval", "--config", "default", "--per-category", "1", "--search", "bon", "--budget", "10", "--reward", "shapes_quality",
            "search.num_steps=5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "bon search on shapes_quality" in out and "10 network evaluations" in out and "overall" in out
    assert "background impurity" in out and "patch energy" in out  # the searched images' artefact measures
    # the default preset names a judge (reward.judge, GDRO's), but eval scores with it only when --judge asks;
    # a bare --judge is the config's, and the override after it stays an override
    assert not any(line.startswith(("judge", "corrected")) for line in out.splitlines())
    assert main([*argv[:-1], "--judge", "search.num_steps=5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("judge ") for line in lines) and any(line.startswith("corrected shapes/strict ") for line in lines)
    assert any(line.startswith("judge = the mean of shapes_clean, which") for line in lines)


@pytest.mark.parametrize("argv, fragment", [
    (["sample", "--config", "default", "--prompt", "x", "--budget", "20"], "add --search"),
    (["sample", "--config", "default", "--prompt", "x", "--search", "dts", "--budget", "3"], "search.budget must be at least one sample"),
    (["sample", "--config", "default", "--prompt", "x", "--search", "smc", "search.sampler=ode"], "search.sampler=ode"),
    (["sample", "--config", "default", "--prompt", "x", "--search", "bon", "--reward", "nope"], "search.reward must be one of"),
    (["sample", "--config", "default", "--prompt", "x", "--search", "beam"], "invalid choice: 'beam'"),
])
def test_search_arguments_are_checked(capsys, argv, fragment):
    from flowrl.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and fragment in err, err


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_search_runs_on_tiny_sd3_and_flux_pipelines(kind, tmp_path):
    """The same search through the real diffusers pipelines (model.path to a saved directory)."""
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.models.tiny import build_tiny_flux, build_tiny_sd3
    from flowrl.search.policy import search_policy

    path = (build_tiny_sd3 if kind == "sd3" else build_tiny_flux)(tmp_path / "pipe")
    cfg = load_config("tiny_jpeg", [f"model.kind={kind}", f"model.path={path}", "search.method=smc", "search.budget=8",
                                    "search.resample=every", "model.height=32", "model.width=32"])
    policy = load_policy(cfg.model)
    result, problem = search_policy(cfg, policy, ["a red circle", "a blue square"], [0, 1])
    assert [lg["nfe"] for lg in result.ledgers[0]] == [8, 8]  # 2 particles x 4 steps
    assert result.ledgers[0][0]["resamples"] > 0
    images = problem.images(result.latents[0])
    assert images.shape[:2] == (2, 3) and bool(torch.isfinite(images).all())


@pytest.mark.parametrize("method", ["smc", "dts", "dts_star"])
def test_a_prompt_is_searched_the_same_alone_or_with_others(method):
    """Each prompt's random draws come from its own seed, so batching prompts together changes
    nothing but the speed (the mixture's velocity is exact row by row)."""
    cfg = search_cfg(resample="every")
    alone = run_search(method, mixture(1), [4], [60], cfg)
    together = run_search(method, mixture(3), [9, 4, 7], [60], cfg)
    assert torch.equal(alone.latents[0][0], together.latents[0][1])
    assert alone.ledgers[0][0] == together.ledgers[0][1]
