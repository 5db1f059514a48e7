"""flowrl.api, the CLI as Python functions: README.md's quickstart runs exactly as written and its
lambda is what the run trains on and evaluates with; a reward function's bad output stops the run
with one sentence naming it; rewards of a module outside flowrl join a config through `plugins`
or a module of the `flowrl.parts` entry point group."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import flowrl.registry
import rewards.registry
from flowrl import api
from flowrl.cli import main
from flowrl.errors import ConfigError, UserError
from rewards import MultiReward
from run_checks import run_metrics, trainable

README = Path(__file__).resolve().parents[2] / "README.md"
TINY = ["model.path=builtin:tiny-sd3", "sampling.num_steps=2", "sampling.eval_num_steps=2", "sampling.batch_size=4",
        "data.group_size=2", "lora.rank=4", "lora.alpha=8", "run.sample_every=0", "run.tracker=none", "run.progress=false"]
PROMPTS = ["a red circle", "two blue squares"]  # both drawn in every iteration of 2 prompts


@pytest.fixture(scope="module", autouse=True)
def _registry_restored():
    """The functions these tests register leave the reward registry as it was."""
    registered, functions = dict(rewards.registry.REWARDS._parts), dict(api._FUNCTIONS)
    yield
    rewards.registry.REWARDS._parts.clear()
    rewards.registry.REWARDS._parts.update(registered)
    api._FUNCTIONS.clear()
    api._FUNCTIONS.update(functions)


def quickstart_code() -> str:
    text = README.read_text()
    block = re.search(r"<!-- api-quickstart -->\n```python\n(.*?)```\n<!-- /api-quickstart -->", text, re.S)
    assert block, "README.md has no ```python block between <!-- api-quickstart --> markers"
    return block[1]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """README's quickstart, executed as written in a fresh folder: its names, and the folder."""
    folder = tmp_path_factory.mktemp("quickstart")
    names: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        exec(compile(quickstart_code(), str(README), "exec"), names)
    return names, folder


def redness(images: torch.Tensor) -> torch.Tensor:
    return images[:, 0].mean(dim=(1, 2))


@pytest.mark.slow  # README's quickstart trains the shapes model
@pytest.mark.xdist_group("quickstart")  # one worker trains the quickstart for both
def test_readme_quickstart_trains_the_shapes_lora_on_its_lambda(quickstart):
    names, folder = quickstart
    run = names["run"]
    rows = run.metrics
    assert len(rows) == 3 and run.path.parent == folder / "runs"  # the default preset's run.output_dir
    assert all(r["reward/custom"] == pytest.approx(r["reward_mean"]) and 0 <= r["reward_mean"] <= 1 for r in rows)
    assert run.config.run.cpu_processes == 1  # trained in the notebook's process, not the preset's two
    lora = load_file(str(folder / run.path / "checkpoints" / "iter_000003" / "trainable.safetensors"))
    assert any(w.abs().sum() > 0 for k, w in lora.items() if "lora_B" in k)  # moved off the adapter's zero init
    assert names["images"].shape == (4, 3, 32, 32) and 0 <= names["images"].min() and names["images"].max() <= 1
    assert (folder / "redness-lora" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow  # README's quickstart trains the shapes model
@pytest.mark.xdist_group("quickstart")  # one worker trains the quickstart for both
def test_evaluate_scores_a_run_with_its_lambda_and_sample_draws_its_checkpoint(quickstart):
    names, folder = quickstart
    run = names["run"]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        image = run.sample(["a red circle"], n=1)  # seed 0, as evaluate's first image
        means = run.evaluate(["a red circle"]).means()
        base = api.sample(["a red circle"], config="default")
    assert means["custom"] == pytest.approx(redness(image).item(), abs=1e-6)
    assert not torch.allclose(image, base)  # the run's adapter, not the base model


@pytest.mark.slow  # README's quickstart trains the shapes model
@pytest.mark.xdist_group("quickstart")  # the worker that trained the quickstart for the two above
def test_a_run_of_another_process_says_how_to_give_its_function_again(quickstart, monkeypatch):
    names, folder = quickstart
    monkeypatch.chdir(folder)
    path = names["run"].path
    monkeypatch.delitem(rewards.registry.REWARDS._parts, "custom")  # as in a new process
    monkeypatch.delitem(api._FUNCTIONS, "custom")
    with pytest.raises(ConfigError, match=r"trained with the reward 'custom'.*api\.Run\('.*', reward=\{'custom': fn\}\)"):
        api.Run(path).sample(["a red circle"])
    assert api.Run(path, reward={"custom": lambda images, prompts: redness(images)}).config.reward.weights == {"custom": 1.0}


@pytest.mark.xdist_group("quickstart")
def test_the_quickstart_group_reaches_xdists_scheduler_under_loadgroup(request):
    """make test's --dist loadgroup sends a group's tests to one worker only when the group is in the test's id
    (tests/conftest.py names it where pytest-xdist's own naming does not reach pytest 9.2)."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("only under --dist loadgroup (make test)")
    assert request.node.nodeid.endswith("@quickstart")


def test_a_function_rewards_scores_are_the_runs_reward_and_it_trains_in_one_process(tmp_path, capsys):
    # every prompt scores its length: both prompts each iteration, 12 and 16 characters
    run = api.train("tiny_jpeg", *TINY, reward=lambda images, prompts: [float(len(p)) for p in prompts],
                    trainer={"iterations": 2}, data={"prompts": PROMPTS}, run={"cpu_processes": 2}, run_dir=tmp_path / "run")
    assert [r["reward_mean"] for r in run_metrics(run.path)] == [14.0, 14.0]
    assert "training in this process (run.cpu_processes 2" in capsys.readouterr().err
    assert "cpu_processes: 1" in (run.path / "config.yaml").read_text()


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    length = lambda images, prompts: [float(len(p)) for p in prompts]  # noqa: E731
    settings = dict(reward=length, data={"prompts": PROMPTS}, trainer={"lr_schedule": "constant"})
    whole = api.train("tiny_jpeg", *TINY, "trainer.iterations=4", **settings, run_dir=tmp_path / "whole")
    part = api.train("tiny_jpeg", *TINY, "trainer.iterations=2", "run.checkpoint_every=1", **settings, run_dir=tmp_path / "part")
    assert part.resume(trainer={"iterations": 4}) is part
    assert len(part.metrics) == 4 and run_metrics(part.path)[:2] == run_metrics(whole.path)[:2]
    for key, w in trainable(whole.path, 4).items():
        assert torch.equal(trainable(part.path, 4)[key], w), key
    with pytest.raises(UserError, match=r"trainer\.iterations"):
        part.resume(trainer={"iterations": -1})


@pytest.mark.parametrize("reward, sentence", [
    (lambda images, prompts: [0.0] * (len(images) - 1), r"reward 'short' returned shape \(1, 1\) for 2 images; it must return \[2\]"),
    (lambda images, prompts: torch.tensor([0.0, float("nan")]), r"reward 'short' returned NaN or inf for 1 of 2 images"),
])
def test_a_reward_function_with_bad_output_stops_the_run_with_one_sentence(tmp_path, reward, sentence):
    with pytest.raises(UserError, match=sentence) as stopped:
        api.train("tiny_jpeg", *TINY, reward={"short": reward}, trainer={"iterations": 2}, data={"prompts": PROMPTS},
                  sampling={"batch_size": 2}, run_dir=tmp_path / "run")
    assert "\n" not in str(stopped.value) and stopped.value.__cause__ is None and stopped.value.__suppress_context__
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before any update


def test_function_rewards_are_refused_where_they_cannot_reach_and_where_names_clash():
    with pytest.raises(ConfigError, match="run.async_rollouts samples in a producer process, which the reward function 'custom'"):
        api.train("tiny_jpeg", *TINY, "run.async_rollouts=true", reward=lambda images, prompts: images.mean((1, 2, 3)))
    with pytest.raises(ConfigError, match="reward function 'brightness' has the name of a registered reward"):
        api.config(reward={"brightness": lambda images, prompts: images.mean((1, 2, 3))})
    with pytest.raises(UserError, match=r"reward 'custom' must take \(images, prompts\) or \(images, prompts, metadata\)"):
        api.config(reward=lambda images: images.mean((1, 2, 3)))
    with pytest.raises(UserError, match="'qwen25_05b_gsm8k_1gpu' is a text config .* use the flowrl command"):
        api.train("qwen25_05b_gsm8k_1gpu")


def test_config_takes_sections_dot_lists_a_config_and_a_reward_mapping():
    cfg = api.config("default", "trainer.seed=3", trainer={"lr": 1e-4}, data={"eval_prompts": ["a: b", "c"]})
    assert (cfg.trainer.seed, cfg.trainer.lr, cfg.data.eval_prompts) == (3, 1e-4, ["a: b", "c"])
    again = api.config(cfg, model={"compile": "none"})
    assert (again.trainer.lr, again.model.compile, cfg.model.compile) == (1e-4, "none", "blocks")
    mixed = api.config(reward={"shapes": 1.0, "red": (lambda images, prompts: redness(images), 0.5)})
    # the preset's channel weight stays with the reward kept; shapes_quality's weight goes
    assert (mixed.reward.weights, mixed.reward.channel_weights) == ({"shapes": 1.0, "red": 0.5}, {"shapes/partial": 0.5})
    with pytest.raises(ConfigError, match="trainer.lr must be a finite number; got nan"):
        api.config(trainer={"lr": float("nan")})


def _write_module(folder: Path, name: str, code: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(code))


def test_a_reward_of_a_module_named_in_plugins_trains_through_the_cli(tmp_path, monkeypatch):
    _write_module(tmp_path, "my_rewards", """
        from rewards import register

        @register("prompt_length", "the prompt's length in characters")
        def prompt_length(images, prompts):
            return [float(len(p)) for p in prompts]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mine.yaml").write_text("plugins: [my_rewards]\nreward:\n  weights: {prompt_length: 1.0}\n")
    overrides = [*TINY, "trainer.iterations=1", f"data.prompts={PROMPTS}"]
    assert main(["train", str(tmp_path / "mine.yaml"), *overrides, "--run-dir", str(tmp_path / "run")]) == 0
    assert [r["reward/prompt_length"] for r in run_metrics(tmp_path / "run")] == [14.0]


def test_an_installed_packages_flowrl_parts_entry_point_registers_a_reward(tmp_path, monkeypatch, capsys):
    _write_module(tmp_path, "ep_rewards", '''
        from rewards import register

        @register("darkness", "one minus the mean pixel")
        def darkness(images, prompts):
            return 1 - images.mean(dim=(1, 2, 3))
    ''')
    info = tmp_path / "ep_rewards-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-rewards\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flowrl.parts]\nrewards = ep_rewards\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(flowrl.registry, "_ENTRY_POINTS_LOADED", [])
    cfg = api.config("tiny_jpeg", "reward.weights={darkness: 1.0}")
    scores = MultiReward.from_config(cfg.reward)(torch.full((2, 3, 4, 4), 0.25), PROMPTS)
    assert scores[:, 0].tolist() == [0.75, 0.75]
    assert main(["rewards"]) == 0
    assert re.search(r"^darkness +one minus the mean pixel$", capsys.readouterr().out, re.M)
