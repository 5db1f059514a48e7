"""What the shapes scripts' --smoke modes share (tests/e2e/test_scripts.py runs them): a tiny
randomly initialised shapes pipeline, and the overrides that shrink the default preset onto it.
Nothing here runs by itself.

A smoke run is the script's own code path on the tiniest workload (one iteration of two prompts
x two samples, three steps, a two-block transformer): it checks that the script runs, and measures
nothing.
"""

from __future__ import annotations

from pathlib import Path


def tiny_shapes_model(directory: str | Path) -> Path:
    """A two-block shapes pipeline (random weights, the shapes world's vocabulary, pixel space like
    builtin:shapes), saved to `directory`; its path. Built in well under a second."""
    from flowrl.models.shapes import build_shapes_pipeline, save_shapes_pipeline
    from rewards.shapes_world import all_prompts

    words = sorted({w for p in all_prompts() for w in p.split()})
    pipe = build_shapes_pipeline(words, num_layers=2, heads=2, head_dim=8, text_hidden=16, text_layers=1)
    return save_shapes_pipeline(pipe, Path(directory))


def shapes_overrides(model_dir: str | Path) -> list[str]:
    """Dot-list overrides of the default preset (DGPO on the shapes model) for one tiny iteration on
    `model_dir`, eager and in one process."""
    return [f"model.path={model_dir}", "model.compile=none", "run.cpu_processes=1", "trainer.budget_minutes=0",
            "trainer.iterations=1", "data.prompts_per_iteration=2", "data.group_size=2", "sampling.batch_size=4",
            "sampling.num_steps=3", "sampling.eval_num_steps=2", "objective.dgpo.timesteps=2", "objective.dgpo.grid_points=3",
            "lora.rank=2", "lora.alpha=2", "run.sample_every=0", "run.tracker=none", "run.progress=false"]
