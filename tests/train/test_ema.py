"""The EMA of the trained weights against its formula written out here, shadow <- d shadow + (1 - d) params
(flowrl/runtime/ema.py): the class alone over several steps, and the image trainer's after a short run, where
the decay is the fixed trainer.ema_decay and the EMA moves once after every optimizer step taken
(RunManager.optimizer_step calls after_step; a skipped non-finite step does not)."""

from __future__ import annotations

import torch

from flowrl.config import load_config
from flowrl.runtime.checkpoint import latest_checkpoint, load_checkpoint
from flowrl.runtime.ema import EMA
from flowrl.train.loop import Trainer


def replay(start: dict[str, torch.Tensor], steps: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    """The formula in float64, one step per entry of `steps`."""
    shadow = {n: t.double() for n, t in start.items()}
    for params in steps:
        shadow = {n: decay * shadow[n] + (1 - decay) * params[n].double() for n in shadow}
    return shadow


def assert_matches(shadow: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert shadow.keys() == expected.keys()
    for n, s in shadow.items():  # the class keeps float32 and lerps: rounding only
        assert s.dtype == torch.float32, n
        gap = (s.double() - expected[n]).abs()
        assert bool((gap <= 1e-6 + 1e-5 * expected[n].abs()).all()), f"{n}: off the formula by up to {gap.max().item():.3g}"


def test_ema_class_follows_the_formula_step_by_step():
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.nn.Parameter(torch.randn(3, 4, generator=g)),
              "b": torch.nn.Parameter(torch.randn(5, generator=g).to(torch.bfloat16))}  # a bf16 weight: its shadow is float32
    start = {n: p.detach().clone() for n, p in params.items()}
    ema = EMA(params, 0.8)
    steps = []
    for _ in range(5):
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
        steps.append({n: p.detach().clone() for n, p in params.items()})
        ema.update(params)
    assert_matches(ema.shadow, replay(start, steps, 0.8))
    # a decay given to one update replaces the fixed one for that update only
    with torch.no_grad():
        params["a"].mul_(-2)
    ema.update(params, decay=0.3)
    expected = replay(replay(start, steps, 0.8), [{n: p.detach() for n, p in params.items()}], 0.3)
    assert_matches(ema.shadow, expected)
    # swapped_in lends the shadow to the weights and puts the weights back
    before = {n: p.detach().clone() for n, p in params.items()}
    with ema.swapped_in(params):
        assert all(torch.equal(p, ema.shadow[n].to(p.dtype)) for n, p in params.items())
    assert all(torch.equal(p, before[n]) for n, p in params.items())


def test_the_trainers_ema_is_the_formula_over_its_optimizer_steps(tmp_path, tiny_sd3_dir):
    decay = 0.7  # not the default 0.9: the trainer must use trainer.ema_decay
    cfg = load_config("tiny_jpeg", [
        f"model.path={tiny_sd3_dir}", "trainer.iterations=2", "data.prompts_per_iteration=1", "data.group_size=4",
        "sampling.batch_size=2", "sampling.num_steps=2", "run.tracker=none", "run.progress=false", "lora.rank=2",
        "lora.alpha=4", "run.sample_every=0", "run.checkpoint_every=0", f"trainer.ema_decay={decay}"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    start = {n: p.detach().clone() for n, p in trainer.params.items()}
    steps: list[dict[str, torch.Tensor]] = []  # the trained weights after each optimizer step
    after_step = trainer.after_step

    def record():
        steps.append({n: p.detach().clone() for n, p in trainer.params.items()})
        after_step()

    trainer.after_step = record
    history = trainer.train()
    assert len(steps) == sum(r["optimizer_steps"] for r in history) >= 4
    assert any(not torch.equal(steps[-1][n], start[n]) for n in start)  # the steps moved the weights
    expected = replay(start, steps, decay)
    assert_matches(trainer.ema.shadow, expected)
    # and the checkpoint the run ended with holds that EMA
    assert_matches(load_checkpoint(latest_checkpoint(trainer.run.checkpoints))["ema"], expected)
