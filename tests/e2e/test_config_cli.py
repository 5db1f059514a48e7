"""Config loading and the CLI's handling of user mistakes: exit 2, one sentence, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError


def test_default_preset_loads_and_overrides_apply():
    cfg = load_config("tiny_jpeg", ["trainer.lr=1e-5", "sampling.window.strategy=fixed", "sampling.window.size=2"])
    assert cfg.trainer.lr == 1e-5 and cfg.sampling.window.size == 2


def test_mapping_override_replaces():
    cfg = load_config("tiny_jpeg", ["reward.weights={brightness: 2.0}"])
    assert cfg.reward.weights == {"brightness": 2.0}


BAD = [
    (["trainer.lrr=1"], "trainer.lrr"),
    (["trainer.lr=abc"], "trainer.lr"),
    (["data.group_size=1"], "data.group_size"),
    (["sampling.window.strategy=fixed", "sampling.window.size=4", "sampling.window.start=7"], "sampling.window.start"),
    (["sampling.window.strategy=fixed", "sampling.window.size=20"], "sampling.window.size"),
    (["model.path=./no/such/pipeline"], "model.path"),
    (["model.path=builtin:nope"], "model.path"),
    (["sampling.sampler=euler"], "sampling.sampler"),
    (["reward.weights={no_such_reward: 1.0}"], "no_such_reward"),
    (["advantage.kind=ppo"], "advantage.kind"),
    (["allocator.kind=greedy"], "allocator.kind"),
    (["allocator.min_group=1"], "allocator.min_group"),
    (["allocator.kind=reinforce_ada"], "allocator.kind reinforce_ada trains on a subset"),  # text only
    (["allocator.prompt_gdro.ema=1"], "allocator.prompt_gdro.ema"),
    (["selection.kind=top"], "selection.kind"),
    (["model.height=60"], "model.height"),
    (["run.distributed=zero3"], "run.distributed"),
    (["run.distributed=fsdp2", "objective.kind=nft", "trainer.kl_beta=0"], "run.distributed"),
    (["objective.kind=kto"], "objective.kind"),
    (["sampling.sampler=ode"], "sampling.sampler"),  # grpo needs log-probs
    (["objective.kind=nft", "trainer.kl_beta=0", "objective.nft.old_policy=current", "trainer.inner_epochs=2"], "trainer.inner_epochs"),
    (["objective.kind=nft", "trainer.kl_beta=0", "objective.nft.timesteps=-1"], "objective.nft.timesteps"),
    (["objective.kind=nft", "sampling.num_steps=4", "objective.nft.timesteps=5"], "objective.nft.timesteps"),
    (["objective.kind=nft", "objective.nft.sigma_draw=uniform"], "objective.nft.sigma_draw"),
    (["objective.kind=dgpo", "objective.dgpo.loss_form=dpo"], "objective.dgpo.loss_form"),
    (["objective.kind=dgpo", "objective.dgpo.sigma_draw=uniform"], "objective.dgpo.sigma_draw"),
    (["objective.kind=dgpo", "sampling.num_steps=4", "objective.dgpo.grid_points=5"], "objective.dgpo.grid_points"),
    (["objective.kind=dgpo", "sampling.num_steps=3"], "objective.dgpo.timesteps"),
    (["objective.kind=dgpo", "objective.dgpo.clip_old=sampling"], "objective.dgpo.sample_with_old_after"),
    (["objective.kind=gdro", "objective.gdro.error_reduction=max"], "objective.gdro.error_reduction"),
    (["objective.kind=nft", "objective.nft.sigma_shift=0"], "objective.nft.sigma_shift"),
    (["objective.kind=nft", "objective.nft.guidance_scale=0.5"], "objective.nft.guidance_scale"),
    (["objective.kind=nft", "objective.nft.r_scale=minmax"], "objective.nft.r_scale"),
    (["trainer.lr_schedule=step"], "trainer.lr_schedule"),
    (["objective.kind=nft", "trainer.kl_beta=0", "objective.nft.old_policy=ema"], "objective.nft.old_policy"),
    (["objective.kind=nft", "trainer.kl_beta=0", "objective.nft.old_policy=sampling", "objective.nft.old_decay=1.0"], "objective.nft.old_decay"),
    (["objective.kind=grpo", "objective.grpo.ratio_norm=true", "sampling.sampler=flow_grpo", "rollout.kind=tree",
      "rollout.tree.split_steps=[0, 1]", "data.group_size=4", "trainer.kl_beta=0"], "objective.grpo.ratio_norm"),
    (["model.quantize=fp4"], "model.quantize"),
    (["model.quantize=nf4", "lora.enabled=false"], "model.quantize"),
    (["model.attention_backend=flash_attn"], "model.attention_backend"),
    (["lora.sigma_range=[0.9]"], "lora.sigma_range"),
    (["lora.sigma_range=[0.9, 0.5]"], "lora.sigma_range"),
    (["lora.sigma_range=[0.5, 1.0]"], "lora.sigma_range"),  # window 'all': every step is trained
    (["lora.sigma_range=[0.5, 1.0]", "sampling.window.strategy=fixed", "sampling.window.size=2",
      "sampling.window.start=2"], "lora.sigma_range"),  # trained steps at sigma <= 0.5
]


def test_nft_accepts_the_ode_sampler_and_any_sigma_range():
    # nft trains on clean samples: no log-probs, and it draws its sigmas inside the adapter's range
    cfg = load_config("tiny_jpeg", ["objective.kind=nft", "trainer.kl_beta=0", "sampling.sampler=ode", "lora.sigma_range=[0.5, 1.0]"])
    assert cfg.objective.kind == "nft" and cfg.sampling.sampler == "ode"
    # with an old policy fixed through the iteration, several passes over its samples are sound
    cfg = load_config("tiny_jpeg", ["objective.kind=nft", "trainer.kl_beta=0", "sampling.sampler=ode",
                                    "objective.nft.old_policy=sampling", "trainer.inner_epochs=2"])
    assert cfg.trainer.inner_epochs == 2


def test_mixed_precision_no_survives_yaml_reading_it_as_false(tmp_path):
    # accelerate's word for off is `no`, which YAML 1.1 reads as the boolean false
    assert load_config("tiny_jpeg", ["trainer.mixed_precision=no"]).trainer.mixed_precision == "no"
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("data:\n  prompts: [a cat]\ntrainer:\n  mixed_precision: no\n")
    assert load_config(cfg_file, validate_paths=False).trainer.mixed_precision == "no"
    with pytest.raises(ConfigError, match="trainer.mixed_precision must be one of no, bf16, fp16, auto; got 'fp8'"):
        load_config("tiny_jpeg", ["trainer.mixed_precision=fp8"])


def test_acts_at_trained_gates_the_adapter_to_the_sigmas_dgpo_trains(tmp_path):
    # the default preset: DGPO trains its 10-step grid's first 5 sigmas (1.0-0.6): the gate is the midpoint below them
    cfg = load_config(None)
    assert cfg.lora.acts_at == "trained" and cfg.lora.sigma_range == [0.55, 1.0]
    # 20 steps: the first 10 of 1, 0.95, ..., 0.05 are trained, 0.55 is, 0.5 is not
    assert load_config(None, ["sampling.num_steps=20"]).lora.sigma_range == [0.525, 1.0]
    # every sigma trained (4 steps, grid_points at least timesteps 4), or trained by the anchor, or by an objective that
    # draws over all of (0, 1]: the adapter acts everywhere
    for overrides in (["sampling.num_steps=4"], ["objective.dgpo.anchor_beta=1"], ["objective.kind=nft"],
                      ["objective.kind=nft", "lora.enabled=false"], ["lora.acts_at=all"]):
        assert load_config(None, overrides).lora.sigma_range == [0.0, 1.0], overrides
    assert load_config(None, ["objective.dgpo.sigma_draw=stratified"]).lora.sigma_range == [0.5, 1.0]
    # a run directory's config holds the range it resolved, and loads again
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml())
    assert load_config(saved).lora.sigma_range == [0.55, 1.0]
    with pytest.raises(ConfigError, match=r"^lora\.acts_at trained sets lora\.sigma_range from the objective's trained sigmas "
                                          r"\(\[0\.55, 1\.0\]\); leave lora\.sigma_range at \[0\.0, 1\.0\] or set lora\.acts_at all"):
        load_config(None, ["lora.sigma_range=[0.7, 1.0]"])
    with pytest.raises(ConfigError, match=r"^lora\.acts_at must be one of all, trained; got 'some'"):
        load_config(None, ["lora.acts_at=some"])
    # a pipeline's own grid is known once the model loads (tests/models/test_models.py): not here, and no range by hand
    assert load_config(None, ["sampling.schedule=pipeline"]).lora.sigma_range == [0.0, 1.0]
    with pytest.raises(ConfigError, match=r"^lora\.acts_at trained sets lora\.sigma_range from the objective's trained "
                                          r"sigmas once the model loads; leave lora\.sigma_range at \[0\.0, 1\.0\]"):
        load_config(None, ["sampling.schedule=pipeline", "lora.sigma_range=[0.7, 1.0]"])


def test_sigma_range_holding_the_window_is_accepted():
    cfg = load_config("tiny_jpeg", ["lora.sigma_range=[0.5, 1.0]", "sampling.window.strategy=fixed", "sampling.window.size=2"])
    assert cfg.lora.sigma_range == [0.5, 1.0]


@pytest.mark.parametrize("overrides,key", BAD)
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_jpeg", overrides)
    message = str(info.value)
    assert key in message and "\n" not in message


def test_unknown_key_in_yaml_file(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("trainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="trainer.learning_rate"):
        load_config(f)


def test_a_yaml_file_rewritten_in_place_is_read_again_and_a_load_leaves_the_next_untouched(tmp_path):
    # read_yaml parses a file once per text and shares the mapping: a rewrite of the same size within the filesystem's
    # clock tick must still be seen, and an override must not reach the next load of the same file
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  prompts: [a cat]\ntrainer:\n  lr: 0.001\nreward:\n  weights: {jpeg_incompressibility: 1.0}\n")
    assert load_config(f, ["trainer.lr=0.5", "reward.weights={brightness: 1.0}"]).trainer.lr == 0.5
    again = load_config(f)
    assert again.trainer.lr == 0.001 and again.reward.weights == {"jpeg_incompressibility": 1.0}
    f.write_text(f.read_text().replace("0.001", "0.002"))
    assert load_config(f).trainer.lr == 0.002


def test_a_mistyped_key_or_preset_gets_the_closest_name():
    with pytest.raises(ConfigError, match=r"^unknown config key 'trainer.lrr' in the command line \(did you mean 'trainer.lr'\?\); "):
        load_config("tiny_jpeg", ["trainer.lrr=1"])
    with pytest.raises(ConfigError, match=r"^unknown config key 'trainr' in the command line \(did you mean 'trainer'\?\); "):
        load_config("tiny_jpeg", ["trainr.lr=1"])
    with pytest.raises(ConfigError, match=r"^config 'defualt' is neither a YAML file nor a preset \(did you mean 'default'\?\); "):
        load_config("defualt")
    with pytest.raises(ConfigError) as far:  # nothing close: no guess
        load_config("tiny_jpeg", ["trainer.zzzzzz=1"])
    assert "did you mean" not in str(far.value)


@pytest.mark.parametrize("argv", [
    ["train", "trainer.lrr=1"],
    ["train", "data.group_size=1"],
    ["train", "model.path=/no/such/dir"],
    ["train", "no_such_preset"],
    ["train", "--resume", "/no/such/run"],
    ["eval", "--config", "default", "--prompts", "/no/such/prompts.txt"],
])
def test_cli_exits_2_with_one_sentence(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowrl: error: ") and "\n" not in err and "Traceback" not in err


def test_cli_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "train", "data.group_size=1"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "data.group_size" in proc.stderr


def test_rewards_command_lists_the_registry(capsys):
    assert main(["rewards"]) == 0
    out = capsys.readouterr().out
    assert "jpeg_compressibility" in out and "brightness" in out


@pytest.mark.parametrize("old, new", [("trainer.objective=nft", "objective.kind"), ("trainer.nft_timesteps=3", "objective.nft.timesteps"),
                                      ("trainer.clip_range=0.1", "objective.grpo.clip_range")])
def test_moved_keys_are_refused_with_their_new_name(tmp_path, old, new, capsys):
    with pytest.raises(ConfigError, match=f"^config key '{old.split('=')[0]}' in the command line has moved to '{new}'; rename it$"):
        load_config("tiny_jpeg", [old])
    key, value = old.split("=")
    section, name = key.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    assert main(["train", str(path)]) == 2
    assert f"has moved to '{new}'" in capsys.readouterr().err


def test_a_run_directorys_config_from_before_a_key_retired_still_loads(tmp_path):
    """A run's config.yaml holds every key: the retired ones at their last defaults load (flowrl eval --run, --resume);
    a value a user set is refused with the key's new home."""
    run_config = tmp_path / "config.yaml"
    text = load_config("tiny_jpeg").to_yaml().replace("run:\n", "run:\n  producer_port: 0\n  producer_wait_minutes: 10.0\n", 1)
    run_config.write_text(text)
    assert load_config(run_config).run.cluster == "local"
    run_config.write_text(text.replace("producer_port: 0", "producer_port: 29600"))
    with pytest.raises(ConfigError, match="^config key 'run.producer_port' in .* has moved to 'run.ray.address'; rename it$"):
        load_config(run_config)


def test_config_show_describes_the_keys_asked_for(capsys):
    # the descriptions are the schema's field comments (flowrl/config_help.py)
    assert main(["config", "show", "model.quantize", "model.attention_backend"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model:" and len(lines) == 3
    assert lines[1].startswith("  quantize: none  # the frozen transformer in 4 or 8 bits under LoRA (QLoRA")
    assert lines[2].startswith("  attention_backend: null  # diffusers' attention kernel for the transformer")
    assert main(["config", "show", "tiny_jpeg", "model.quantize_text_encoders", "model.quantize_text_encoders=nf4"]) == 0
    assert "  quantize_text_encoders: nf4  # the text encoders, likewise: none | nf4 | int8" in capsys.readouterr().out
    assert main(["config", "show", "model.quantise"]) == 2
    assert "'model.quantise' is no key of this config" in capsys.readouterr().err


def test_a_config_read_back_from_its_yaml_keeps_its_reward_mappings_as_written():
    # a producer process or machine gets the config as YAML; the mappings a preset replaces must not merge
    # into the schema's defaults on the way (the default's weights once came back with jpeg_compressibility)
    import pickle

    from flowrl.config import load_config

    cfg = load_config(None, ["reward.weights={brightness: 1.0}", "reward.channel_weights={}"])
    back = pickle.loads(pickle.dumps(cfg))
    assert dict(back.reward.weights) == {"brightness": 1.0} and back.reward == cfg.reward
