"""The artefact measures (docs/monitor.md, "Artefact measures"): background impurity and fill nonuniformity
(rewards/shapes.py) and patch energy (flowrl/train/monitor/image_stats.py), each on the shapes world's own
renderings, clean, under a period-4 grid of 3, 6 and 12 RGB units and under speckle, and on cases computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowrl.train.monitor import image_stats as st
from rewards import available_rewards, get_reward
from rewards.shapes import background_impurity_batch, fill_nonuniformity_batch
from rewards.shapes_world import BACKGROUND, COLORS, render

SIDE = 32
PATCH = 4  # the shapes model's transformer patch, in pixels (pixel space)
SCENES = ["a red circle", "a blue square and a yellow triangle", "three green circles",
          "a purple triangle to the left of an orange square"]  # single, two objects, counting, position


def _clean() -> np.ndarray:
    """uint8 [4, 32, 32, 3]: one rendering per scene, the world's own renderer."""
    return np.stack([render(p, np.random.default_rng(i), SIDE) for i, p in enumerate(SCENES)])


def _grid(images: np.ndarray, units: int) -> np.ndarray:
    """Rows and columns with index % 4 == 0 darker by `units` in every channel, clipped to [0, 255]."""
    line = np.arange(SIDE) % PATCH == 0
    x = images.astype(np.int32)
    x[:, line[:, None] | line[None, :]] -= units
    return np.clip(x, 0, 255).astype(np.uint8)


def _speckle(images: np.ndarray, units: int = 12, seed: int = 0) -> np.ndarray:
    """Seeded uniform integer noise in [-units, units] on every channel of every pixel (fills and background)."""
    noise = np.random.default_rng(seed).integers(-units, units + 1, size=images.shape)
    return np.clip(images.astype(np.int32) + noise, 0, 255).astype(np.uint8)


def _tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255


@pytest.fixture(scope="module")
def variants() -> dict[str, torch.Tensor]:
    clean = _clean()
    return {"clean": _tensor(clean), "grid3": _tensor(_grid(clean, 3)), "grid6": _tensor(_grid(clean, 6)),
            "grid12": _tensor(_grid(clean, 12)), "speckled": _tensor(_speckle(clean))}


# ---- the damage, ranked --------------------------------------------------------------------------------
@pytest.mark.parametrize("measure", [background_impurity_batch, fill_nonuniformity_batch])
def test_the_shapes_measures_rank_every_scene_clean_below_each_grid_and_speckle(variants, measure):
    v = {name: measure(x) for name, x in variants.items()}
    assert torch.equal(v["clean"], torch.zeros(len(SCENES)))  # the renderer draws flat colours on pure white
    assert (v["clean"] < v["grid3"]).all() and (v["grid3"] < v["grid6"]).all() and (v["grid6"] < v["grid12"]).all()
    assert (v["clean"] < v["speckled"]).all()


def test_a_grid_adds_its_share_of_lines_times_its_depth():
    # 7 of every 16 pixels lie on a line; an on-line background pixel is sqrt(3) a from white
    line = np.arange(SIDE) % PATCH == 0
    on = (line[:, None] | line[None, :]).mean()
    white = np.full((1, SIDE, SIDE, 3), 255, np.uint8)
    assert background_impurity_batch(_tensor(_grid(white, 6))).item() == pytest.approx(on * 6 * math.sqrt(3), rel=1e-6)


def test_patch_energy_ranks_the_grids_and_does_not_see_speckle(variants):
    e = {name: st.patch_energies(x, PATCH) for name, x in variants.items()}
    means = {name: v.mean().item() for name, v in e.items()}
    assert means["clean"] < means["grid3"] < means["grid6"] < means["grid12"]
    assert (e["clean"] < e["grid6"]).all() and (e["grid6"] < e["grid12"]).all()
    # speckle is not periodic: in expectation it pulls the share towards white noise's 15 / 1023 with the
    # weight of its power in the image's, 0.3-0.5 % on these scenes (a shift of ~4e-5); what is left is the cross terms' scatter
    assert (e["speckled"] - e["clean"]).abs().max() < 1e-3
    assert means["grid12"] - means["clean"] > 5e-3


# ---- computed by hand ----------------------------------------------------------------------------------
def test_a_background_tinted_by_ten_units_in_one_channel_is_ten_impure_around_a_flat_object():
    image = np.full((1, SIDE, SIDE, 3), BACKGROUND, np.uint8)
    image[..., 2] = 245  # (255, 255, 245): 10 from white, labelled background
    image[0, 8:16, 8:16] = COLORS["red"]
    x = _tensor(image)
    assert background_impurity_batch(x).item() == 10.0
    assert fill_nonuniformity_batch(x).item() == 0.0
    assert background_impurity_batch(_tensor(np.full((2, SIDE, SIDE, 3), 255, np.uint8))).tolist() == [0.0, 0.0]
    assert math.isnan(background_impurity_batch(_tensor(np.full((1, SIDE, SIDE, 3), COLORS["red"], np.uint8))).item())


def test_a_two_colour_fill_spreads_half_its_difference_and_the_image_averages_its_objects():
    image = np.full((1, SIDE, SIDE, 3), 255, np.uint8)
    image[0, 2:10, 2:10] = COLORS["red"]  # flat: 0
    blue = np.array(COLORS["blue"])
    checker = (np.add.outer(np.arange(8), np.arange(8)) % 2).astype(bool)
    square = np.broadcast_to(blue, (8, 8, 3)).copy()
    square[checker] = blue + (0, 0, 20)  # half the pixels 20 units bluer, still labelled blue
    image[0, 16:24, 16:24] = square
    # each pixel is 10 from the mean colour blue + (0, 0, 10): the blue square 10, the red one 0, the image 5
    assert fill_nonuniformity_batch(_tensor(image)).item() == pytest.approx(5.0, abs=1e-5)
    assert fill_nonuniformity_batch(_tensor(image[:, 12:, 12:])).item() == pytest.approx(10.0, abs=1e-5)
    assert math.isnan(fill_nonuniformity_batch(_tensor(np.full((1, SIDE, SIDE, 3), 255, np.uint8))).item())


def _flat(side: int = SIDE, value: float = 0.6) -> torch.Tensor:
    return torch.full((1, 3, side, side), value, dtype=torch.float64)


def test_patch_energy_is_one_for_a_pure_patch_grid_and_zero_off_its_lattice():
    line = torch.arange(SIDE) % PATCH == 0
    grid = _flat()
    grid[..., line[:, None] | line[None, :]] -= 0.1
    assert st.patch_energy(grid, PATCH) == pytest.approx(1.0, abs=1e-12)
    x = torch.arange(SIDE, dtype=torch.float64)
    off = _flat() + 0.2 * torch.cos(2 * math.pi * 3 * x / SIDE)  # 3 cycles per 32 px: not a multiple of 32 / 4
    assert st.patch_energy(off, PATCH) == pytest.approx(0.0, abs=1e-12)
    on = _flat() + 0.2 * torch.cos(2 * math.pi * 8 * x / SIDE)[:, None]  # period 4 down the rows
    assert st.patch_energy(on, PATCH) == pytest.approx(1.0, abs=1e-12)
    assert st.patch_energy(_flat(), PATCH) == 0.0  # no AC power at all


def test_patch_energy_of_white_noise_is_its_lattice_share_of_the_bins():
    noise = 0.5 + 0.1 * torch.randn(400, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert st.patch_energy(noise, PATCH) == pytest.approx((PATCH**2 - 1) / (SIDE * SIDE - 1), abs=1e-3)


def test_patch_energy_reads_whole_tokens_where_the_side_is_no_multiple_of_the_patch():
    side = 30  # 7 whole tokens of 4: the top-left 28 x 28
    line = torch.arange(side) % PATCH == 0
    grid = _flat(side)
    grid[..., line[:, None] | line[None, :]] -= 0.1
    assert st.patch_energy(grid, PATCH) == pytest.approx(1.0, abs=1e-12)
    for bad in (0, 2.5, side + 1):
        with pytest.raises(ValueError, match="patch must be a whole number of pixels"):
            st.patch_energy(grid, bad)


# ---- where they are used -------------------------------------------------------------------------------
def test_the_judges_are_registered_lower_is_cleaner_and_finite(variants):
    images = torch.cat([variants["grid6"], torch.ones(1, 3, SIDE, SIDE)])  # the last: white, no object
    prompts = SCENES + ["a red circle"]
    for name, measure in (("shapes_background_impurity", background_impurity_batch),
                          ("shapes_fill_nonuniformity", fill_nonuniformity_batch)):
        assert name in available_rewards()
        spec = get_reward(name)
        assert "lower is cleaner" in spec.description and spec.channels == (name,)
        scores = spec.factory()(images, prompts)
        assert torch.isfinite(scores).all()
        expected = torch.nan_to_num(measure(images), nan=0.0)
        assert torch.equal(scores, expected)
    assert get_reward("shapes_fill_nonuniformity").factory()(images, prompts)[-1] == 0  # no object: no uneven fill


def test_image_statistics_add_the_artefact_measures_when_asked(variants):
    from flowrl.train.monitor.validate import DRIFT_STATISTICS

    x = variants["grid6"]
    plain = st.image_statistics(x)
    assert not set(st.ARTEFACT_STATISTICS) & set(plain)
    full = st.image_statistics(x, patch=PATCH, shapes_world=True)
    assert full["patch_energy"] == pytest.approx(st.patch_energy(x, PATCH))
    assert full["background_impurity"] == pytest.approx(background_impurity_batch(x).double().mean().item())
    assert full["fill_nonuniformity"] == pytest.approx(fill_nonuniformity_batch(x).double().mean().item())
    assert "fill_nonuniformity" not in st.image_statistics(torch.ones(2, 3, SIDE, SIDE), shapes_world=True)  # no object
    assert set(st.ARTEFACT_STATISTICS) <= set(DRIFT_STATISTICS)


def test_eval_measures_the_artefacts_of_shapes_world_prompts_only(variants):
    from flowrl.train.evaluate import EvalResult, artefact_means

    x = variants["grid12"]
    means = artefact_means(x, SCENES, PATCH)
    assert list(means) == ["background impurity", "fill nonuniformity", "patch energy"]
    assert means["patch energy"] == pytest.approx(st.patch_energy(x, PATCH))
    assert means["background impurity"] == pytest.approx(background_impurity_batch(x).double().mean().item())
    assert "patch energy" not in artefact_means(x, SCENES)  # no patch given
    assert artefact_means(x, SCENES[:3] + ["a photo of a cat"], PATCH) is None
    result = EvalResult(SCENES, torch.zeros(4, 1), ["r"], torch.ones(1), artefacts=means)
    assert result.means()["patch energy"] == means["patch energy"]


def test_eval_prints_the_artefact_rows_beside_the_base_with_their_legend(variants, tmp_path, monkeypatch, capsys):
    import flowrl.cli as cli
    from flowrl.train.evaluate import EvalResult, artefact_means

    def result(images):
        return EvalResult(SCENES, torch.zeros(4, 1), ["shapes_quality"], torch.ones(1), artefacts=artefact_means(images, SCENES, PATCH))

    # the scoring stubbed (no model): the run's images gridded, the base's clean
    monkeypatch.setattr(cli, "_evaluate", lambda args, prompts, source, with_base: (
        result(variants["grid12"]), result(variants["clean"]) if with_base else None, "run", "prompts"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(SCENES) + "\n")
    assert cli.main(["eval", "--run", str(tmp_path), "--prompts", str(prompts)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {" ".join(line.split()[:2]): line.split()[2:] for line in lines}
    for name in ("background impurity", "fill nonuniformity", "patch energy"):
        base, run, change = (float(v) for v in rows[name])
        assert base < run and change == pytest.approx(run - base, abs=2e-4), name
    assert any(line.startswith("artefacts, lower is cleaner") for line in lines)
    assert cli.main(["eval", "--run", str(tmp_path), "--prompts", str(prompts), "--no-base"]) == 0
    assert any(line.startswith("patch energy ") for line in capsys.readouterr().out.splitlines())
