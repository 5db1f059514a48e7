"""Editing under RL, end to end on the tiny FLUX.1 Kontext pipeline: an edit dataset's sources reach the
family through every rollout kind that draws groups (flat SDE groups for GRPO, a tree's leaves for DGPO),
a reward function that asks for `sources` trains through flowrl.api and sees each sample's own source,
and `flowrl sample --image` draws a grid whose rows open with the source."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl import api
from flowrl.cli import main
from run_checks import run_metrics, trainable

COLOURS = {"red": (255, 0, 0), "blue": (0, 0, 255)}
TINY = ["model.kind=flux_kontext", "model.height=64", "model.width=64",
        "model.max_sequence_length=16", "sampling.num_steps=3", "sampling.eval_num_steps=3", "sampling.batch_size=4",
        "data.prompts_per_iteration=2", "data.group_size=4", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
        "run.tracker=none", "run.progress=false", "trainer.iterations=1", "trainer.kl_beta=0", "lora.acts_at=all"]
ROLLOUTS = {
    "flat_grpo": ["rollout.kind=flat", "objective.kind=grpo", "sampling.sampler=flow_grpo"],
    "tree_dgpo": ["rollout.kind=tree", "objective.kind=dgpo", "sampling.sampler=dance_grpo", "rollout.tree.split_steps=[0]",
                  "rollout.tree.branching=[4]", "sampling.window.strategy=all", "objective.dgpo.timesteps=2"],
}


@pytest.fixture
def tiny(tiny_flux_kontext_dir):
    """TINY on the session's tiny Kontext pipeline (built once per worker, shared with the family's tests)."""
    return [*TINY, f"model.path={tiny_flux_kontext_dir}"]


@pytest.fixture
def edits(tmp_path):
    for name, colour in COLOURS.items():
        Image.fromarray(np.full((64, 64, 3), colour, np.uint8)).save(tmp_path / f"{name}.png")
    path = tmp_path / "edits.jsonl"
    path.write_text("\n".join(json.dumps({"instruction": "keep the colour", "source": f"{n}.png"}) for n in COLOURS) + "\n")
    return path


@pytest.mark.parametrize("pairing", list(ROLLOUTS))
def test_an_edit_dataset_trains_through_the_rollouts_and_a_sources_reward_sees_each_samples_source(edits, tiny, tmp_path, pairing):
    seen = []

    def keeps_source(images, prompts, sources):  # minus the distance to the sample's own source
        seen.append({p.source_name: s.mean(dim=(1, 2)).tolist() for p, s in zip(prompts, sources)})
        return -(images - sources).abs().mean(dim=(1, 2, 3))

    grids = ["run.sample_every=1"] if pairing == "flat_grpo" else []
    run = api.train("tiny_jpeg", *tiny, *ROLLOUTS[pairing], *grids, f"data.edits={edits}", reward={"keeps_source": keeps_source},
                    run_dir=tmp_path / "run")
    rows = run_metrics(run.path)
    assert len(rows) == 1 and all(np.isfinite(r["reward_mean"]) for r in rows)
    # each prompt's reward saw its own source: the red edit's source is red, the blue one's blue
    assert {name: [round(c, 3) for c in means] for batch in seen for name, means in batch.items()} == {
        "row 1: red.png": [1.0, 0.0, 0.0], "row 2: blue.png": [0.0, 0.0, 1.0]}
    assert any(w.abs().sum() > 0 for k, w in trainable(run.path, 1).items() if "lora_B" in k)  # the adapter moved
    if pairing == "flat_grpo":  # its sample grid: each edit's source, then its two samples; both edits in a row
        from flowrl.train.images import save_grid

        grid = Image.open(run.path / "samples" / "iter_000001.png")
        six = Image.open(save_grid(torch.zeros(6, 3, 64, 64), tmp_path / "six.png", columns=6, captions=["x"] * 6))
        assert grid.width == six.width  # one row of 6 tiles, not the 4 of samples alone
        first_column = {grid.getpixel((six.width // 12, y))[:3] for y in range(grid.height)}
        assert (255, 0, 0) in first_column or (0, 0, 255) in first_column  # the first tile is a source, flat red or blue


def test_sample_with_an_image_draws_rows_that_open_with_the_source(edits, tiny, tmp_path, capsys):
    out = tmp_path / "grid.png"
    overrides = [o for o in tiny if not o.startswith(("trainer.", "run."))]
    assert main(["sample", "--config", "tiny_jpeg", *overrides, "--image", str(edits.parent / "red.png"),
                 "--prompt", "make it blue", "-n", "2", "--out", str(out)]) == 0
    assert out.is_file() and "wrote" in capsys.readouterr().out
    assert main(["sample", "--config", "tiny_jpeg", *overrides, "--image", str(tmp_path / "gone.png"), "--prompt", "x",
                 "--out", str(tmp_path / "no.png")]) == 2
    assert "the source image" in capsys.readouterr().err and not (tmp_path / "no.png").exists()


def test_check_passes_on_an_edit_config_and_eval_on_an_edit_set_prints_a_table_per_edit_type(edits, tiny, tmp_path, capsys):
    from rewards.shapes_edit_world import EDIT_TYPES, write_edit_set

    overrides = [o for o in tiny if not o.startswith(("trainer.", "run."))]
    assert main(["check", "tiny_jpeg", *overrides, f"data.edits={edits}"]) == 0
    out = capsys.readouterr().out
    assert "(b) ODE = FluxKontextPipeline.__call__  pass" in out and "(c) LoRA step replayed in diffusers     pass" in out
    edit_set = write_edit_set(tmp_path / "set", n_per_type=1, size=64)
    assert main(["eval", "--config", "tiny_jpeg", *overrides, "reward.weights={shapes_edit: 1.0}", "--edits", str(edit_set)]) == 0
    out = capsys.readouterr().out
    assert f"on {len(EDIT_TYPES)} prompts x 1 images ({edit_set})" in out
    assert all(edit_type in out for edit_type in EDIT_TYPES)  # the per-edit-type table
    assert main(["eval", "--config", "tiny_jpeg", *overrides, "--edits", str(tmp_path / "none.jsonl")]) == 2
    assert "--edits" in capsys.readouterr().err
    assert main(["train", "tiny_jpeg", *tiny, f"data.edits={edits}", "data.eval_prompts=[a red circle]"]) == 2
    assert "data.eval_prompts are plain prompts, which model.kind flux_kontext cannot draw" in capsys.readouterr().err


def test_a_group_store_of_edits_trains_with_the_sources_of_the_edits_it_was_built_from(edits, tiny, tmp_path, capsys):
    from flowrl.offline.store import GroupStore

    store, light = tmp_path / "store", [o for o in tiny if not o.startswith("trainer.")]
    common = [*light, "sampling.sampler=ode", "objective.kind=gdro", "reward.weights={brightness: 1.0}"]
    assert main(["offline", "build", "tiny_jpeg", *common, f"data.edits={edits}", "-o", str(store)]) == 0
    stored = GroupStore.open(store)
    assert [g.prompt for g in stored.groups] == ["keep the colour [source: row 1: red.png]", "keep the colour [source: row 2: blue.png]"]
    assert stored.index["source"]["edits"] == str(edits)
    train = ["train", "tiny_jpeg", *common, "rollout.kind=offline", f"data.offline={store}", "trainer.iterations=1",
             "objective.gdro.timesteps=1", "trainer.kl_beta=0"]
    # the GDRO step encodes each stored prompt: an editing family refuses a prompt without its source
    assert main([*train, f"data.edits={edits}", "--run-dir", str(tmp_path / "run")]) == 0
    assert run_metrics(tmp_path / "run")[0]["sampled"] == 0
    assert any(w.abs().sum() > 0 for k, w in trainable(tmp_path / "run", 1).items() if "lora_B" in k)
    capsys.readouterr()
    assert main([*train, "--run-dir", str(tmp_path / "no-edits")]) == 2  # the store's sources come from data.edits
    assert "give data.edits, the edits the store was built from" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"instruction": "paint it", "source": str(edits.parent / "red.png")}) + "\n")
    assert main([*train, f"data.edits={other}", "--run-dir", str(tmp_path / "other")]) == 2
    assert "2 of the group store" in capsys.readouterr().err
