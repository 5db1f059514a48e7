"""reward_curve.png: each channel raw and faint under its trailing mean, held-out evaluations as
points where the run made them, and a short run drawn as points (flowrl/runtime/run_dir.py)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
from matplotlib.axes import Axes  # noqa: E402

from flowrl.runtime.run_dir import RunDir, trailing_mean  # noqa: E402


def _drawn(monkeypatch):
    calls = []
    plot = Axes.plot

    def recording(self, *args, **kwargs):
        calls.append((args, kwargs))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording)
    return calls


def test_the_top_panel_smooths_each_channel_over_its_faint_raw_line_and_marks_held_out_points(tmp_path, monkeypatch):
    calls = _drawn(monkeypatch)
    rows = [{"iteration": i, "reward_mean": float(i % 3), "reward/a": float(i), **({"heldout/strict": 0.5} if i in (9, 19) else {})}
            for i in range(40)]
    assert RunDir(tmp_path).plot_reward_curve(rows) == tmp_path / "reward_curve.png"
    raw, smooth = calls[0], calls[1]
    assert raw[1]["alpha"] < 0.5 and list(raw[0][1]) == [float(i % 3) for i in range(40)]
    assert smooth[0][1] == trailing_mean([float(i % 3) for i in range(40)], 8) and smooth[1]["label"].endswith("mean of 8 iterations")
    held = [c for c in calls if c[1].get("label") == "heldout/strict (held-out)"]
    assert len(held) == 1 and list(held[0][0][0]) == [9, 19] and held[0][1]["ls"] == "none"


def test_a_short_run_is_drawn_as_points_without_smoothing(tmp_path, monkeypatch):
    calls = _drawn(monkeypatch)
    rows = [{"iteration": i, "reward_mean": 1.0 + i} for i in range(3)]
    RunDir(tmp_path).plot_reward_curve(rows)
    assert all(c[1]["marker"] == "o" for c in calls[:2]) and calls[1][1]["label"] == "reward (weighted sum)"
    assert calls[1][0][1] == [1.0, 2.0, 3.0]  # a window of 1: the raw values
