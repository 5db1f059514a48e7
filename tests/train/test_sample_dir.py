"""`flowrl sample --out-dir`: one PNG per image and samples.jsonl, resumable (flowrl/train/sample_dir.py)."""

import json

import numpy as np
from PIL import Image

from flowrl.cli import main


def manifest(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_out_dir_writes_each_image_with_its_row_and_a_second_call_samples_only_what_is_missing(tmp_path, capsys):
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.train.images import ode_images
    from rewards.simple import to_uint8

    prompts, out = tmp_path / "prompts.txt", tmp_path / "out"
    prompts.write_text("a red circle\n# a comment\na blue square\n")
    argv = ["sample", "--config", "default", "--prompts", str(prompts), "-n", "3", "--steps", "2", "--seed", "5",
            "--out-dir", str(out), "--reward", "shapes"]
    assert main(argv) == 0
    rows = manifest(out)
    assert [(r["index"], r["file"], r["prompt"], r["seed"]) for r in rows] == [
        (i, f"{i:06d}.png", p, 5 + j) for i, (p, j) in enumerate((p, j) for p in ("a red circle", "a blue square") for j in range(3))]
    assert all(r["steps"] == 2 and r["source"] == "base model builtin:shapes" for r in rows)
    assert all(set(r["rewards"]) == {"shapes/strict", "shapes/partial"} and 0 <= r["rewards"]["shapes/partial"] <= 1 for r in rows)
    assert "wrote 6 images" in capsys.readouterr().out

    # each file holds its image at the model's resolution, pixel for pixel the ODE sample of its prompt and seed
    cfg = load_config("default")
    policy = load_policy(cfg.model)
    images = ode_images(policy, [r["prompt"] for r in rows], [r["seed"] for r in rows], policy.sigmas(2, cfg.sampling.schedule,
                        cfg.sampling.shift), 16)
    expected = to_uint8(images)
    for r in rows:
        assert np.array_equal(np.asarray(Image.open(out / r["file"])), expected[r["index"]])

    # interrupted: the last PNG lost and the last row cut short; the same call writes only that image again
    before = np.asarray(Image.open(out / "000005.png"))
    (out / "000005.png").unlink()
    text = (out / "samples.jsonl").read_text()
    (out / "samples.jsonl").write_text(text[: len(text) - 20])
    assert main(argv) == 0
    assert "wrote 1 images" in capsys.readouterr().out and manifest(out)[:5] == rows[:5]
    assert [r["index"] for r in manifest(out)] == list(range(6))
    again = np.asarray(Image.open(out / "000005.png")).astype(int)
    assert np.abs(again - before.astype(int)).max() <= 1  # sampled alone now, in a batch of 6 before
    assert main(argv) == 0 and "wrote 0 images" in capsys.readouterr().out

    # another request is refused, not mixed in; --budget without --search is a mistake
    assert main([*argv[:-4], "--seed", "6", "--out-dir", str(out)]) == 2
    assert "holds samples of another request (image 0: its seed differs)" in capsys.readouterr().err
    assert main(["sample", "--config", "default", "--prompt", "x", "--budget", "8"]) == 2
    assert "add --search" in capsys.readouterr().err


def test_a_grid_is_named_after_its_source_never_overwritten_square_ish_and_scored(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["sample", "--config", "default", "--steps", "2", "-n", "1", *[a for p in ("a red circle", "two blue squares",
            "a green triangle", "a yellow square", "a purple circle") for a in ("--prompt", p)]]
    assert main([*argv, "--reward", "shapes"]) == 0
    assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["sample-default-2.png", "sample-default.png"]
    grid = Image.open(tmp_path / "sample-default.png")
    assert grid.size[0] < 2 * grid.size[1]  # 5 images in 3 columns and 2 rows, not a strip of 5
    assert "sample-default.png (5 images" in capsys.readouterr().out
