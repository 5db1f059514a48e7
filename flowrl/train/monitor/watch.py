"""The monitor inside the image trainer (docs/monitor.md; `tr` is flowrl/train/loop.py's Trainer).

At the start: ODE samples of the base model (the adapter disabled, policy.reference()) on the monitor's
fixed prompts and seeds, measured once. Every monitor.every iterations: the same prompts and seeds with
the policy (EMA weights where the run keeps them), scored by the gold rewards and measured the same way,
into the metrics row (heldout/CHANNEL, monitor/STAT, monitor/diversity) and a sheet beside the sample
grids; the rules (rules.py) then act: warn, stop, or roll back to the `best` checkpoint, the one with
the best first gold channel so far."""

from __future__ import annotations

import contextlib
import time

import torch
from tqdm.auto import tqdm

from flowrl.core.seeds import sample_seed
from flowrl.errors import ConfigError
from flowrl.runtime.checkpoint import BEST, best_checkpoint, load_checkpoint, point_to
from flowrl.runtime.processes import rank0
from flowrl.train.images import ode_images, save_grid
from flowrl.train.monitor.image_stats import (SHAPES_STATISTICS, group_diversity, image_statistics, middle_frames,
                                              pixel_features)
from flowrl.train.monitor.rules import Evaluation, Firing, check_rules
from flowrl.train.monitor.validate import gold_reward
from flowrl.train.prompts import load_prompts, read_prompt_file
from flowrl.train.trainer_state import restore_trainer
from rewards import MultiReward
from rewards.shapes import prompt_category

MONITOR_SEEDS = -2  # the `iteration` of the monitor's seeds in sample_seed (-1: the sample grids')


def monitor_prompts(cfg) -> list[str]:
    """monitor.prompts, else monitor.prompt_file, else data.eval_prompts, else the training prompts: at most
    monitor.num_prompts of them at an even stride (a category-ordered set keeps its categories)."""
    m = cfg.monitor
    prompts = (list(m.prompts) or (read_prompt_file(m.prompt_file, "monitor.prompt_file") if m.prompt_file else [])
               or list(cfg.data.eval_prompts) or load_prompts(cfg.data))
    return prompts[:: max(1, len(prompts) // m.num_prompts)][: m.num_prompts]


def held_out_prompts(cfg) -> list[str]:
    """The monitor's prompts where it is on (none where off): model.text_encoders cached encodes them with the run's."""
    return monitor_prompts(cfg) if cfg.monitor.enabled else []


class Monitor:
    """What the monitor holds between evaluations; its state goes into every checkpoint."""

    def __init__(self, cfg, rewards: dict | None = None, encoders=()):
        self.options = m = cfg.monitor
        prompts = monitor_prompts(cfg)
        self.prompts = [p for p in prompts for _ in range(m.seeds)]  # each prompt's seeds side by side: its group
        self.groups = torch.arange(len(prompts)).repeat_interleave(m.seeds)
        # the shapes world's artefact measures assume its scenes (a white background, flat palette colours): they
        # are measured where every monitor prompt is one of its prompts, whatever the run trains on
        self.shapes_world = bool(prompts) and all(prompt_category(p) != "other" for p in prompts)
        unmeasured = [name for name in m.drift if name in SHAPES_STATISTICS and not self.shapes_world]
        if unmeasured:
            other = next((p for p in prompts if prompt_category(p) == "other"), None)
            raise ConfigError(f"monitor.drift names {', '.join(unmeasured)}, which the monitor measures only when all its prompts "
                              f"are shapes-world prompts; " + (f"'{other}' is not one" if other else "it has no prompts"))
        self.seeds = [sample_seed(cfg.trainer.seed, MONITOR_SEEDS, j) for j in range(len(self.prompts))]
        names = list(dict.fromkeys(gold_reward(c) for c in m.gold))
        self.gold = MultiReward({n: 1.0 for n in names}, cfg.reward.batch_size, rewards=rewards,
                                options={k: v for k, v in cfg.reward.options.items() if k in names},
                                frame_stride=cfg.reward.frame_stride) if names else None
        # a reward's own image encoder where one offers it (`image_features(images) -> [N, D]`), else pixels
        self.encoder = next((f.image_features for f in encoders if callable(getattr(f, "image_features", None))), None)
        self.base: dict | None = None  # {"stats", "diversity", "gold"}: the base model's, measured once
        self.evaluations: list[Evaluation] = []
        self.best: tuple[int, float] | None = None  # (iteration, first gold channel) of the `best` checkpoint
        self.best_pending = False  # this iteration's checkpoint becomes `best`
        self.fired: list[tuple[str, str, int]] = []  # (rule, action taken, iteration)
        self.rollbacks = 0

    def due(self, iteration: int) -> bool:
        return iteration % self.options.every == 0

    def measure(self, images: torch.Tensor, patch: int | None = None) -> dict:
        """Gold channels, image statistics and the raw within-group diversity of the monitor's images; `patch`:
        the policy's token side in pixels (`pixel_patch`), for patch_energy."""
        gold = {}
        if self.gold is not None:
            scores = self.gold(images, self.prompts)
            means = dict(zip(self.gold.channel_names, scores.mean(0).tolist()))
            gold = {c: means[c] for c in self.options.gold}
        features, metric = ((self.encoder(middle_frames(images)).float().cpu(), "cosine") if self.encoder is not None
                            else (pixel_features(images), "rms"))
        stats = image_statistics(images, patch=patch, shapes_world=self.shapes_world)
        return {"gold": gold, "stats": stats, "diversity": group_diversity(features, self.groups, metric)}

    def summary(self) -> list[str]:
        """For the closing line: each rule that fired, its action and the iterations it fired at."""
        said: dict[tuple[str, str], list[int]] = {}
        for rule, action, it in self.fired:
            said.setdefault((rule, action), []).append(it)
        out = [f"monitor: {rule} ({action}) at iteration{'s' if len(its) > 1 else ''} {', '.join(map(str, its))}"
               for (rule, action), its in said.items()]
        if self.best is not None:
            out.append(f"best {self.options.gold[0]} {self.best[1]:.4g} at iteration {self.best[0]} (--checkpoint best)")
        return out

    def state_dict(self) -> dict:
        return {"base": self.base, "best": self.best, "fired": self.fired, "rollbacks": self.rollbacks,
                "evaluations": [vars(e) for e in self.evaluations]}

    def load_state_dict(self, state: dict) -> None:
        self.base, self.fired, self.rollbacks = state["base"], [tuple(f) for f in state["fired"]], state["rollbacks"]
        self.best = tuple(state["best"]) if state["best"] is not None else None
        self.evaluations = [Evaluation(**e) for e in state["evaluations"]]


# ---- the trainer's side ------------------------------------------------------------------------
def draw(tr, reference: bool = False) -> torch.Tensor | None:
    """The monitor's ODE images on rank 0 (None elsewhere; under fsdp2 every process gathers the weights):
    the base network's with `reference`, else the policy's with its EMA weights swapped in."""
    mon, main = tr.monitor, tr.accelerator.is_main_process
    if not (main or tr.layout.sharded):
        return None
    weights = tr.ema.swapped_in(tr.params) if tr.ema is not None and not reference else contextlib.nullcontext()
    with weights, tr.layout.gathered(), torch.no_grad():
        if not main:
            return None
        with tr.policy.reference() if reference else contextlib.nullcontext():
            s = tr.cfg.sampling
            return ode_images(tr.policy, mon.prompts, mon.seeds, tr.policy.sigmas(s.eval_num_steps, s.schedule, s.shift),
                              s.batch_size, desc="monitor")


def measured(tr, name: str, reference: bool = False) -> dict:
    """Draw, measure and keep a sheet of the monitor's images (RUN/samples/NAME.png); every process gets rank 0's numbers."""
    images = draw(tr, reference)
    out = None
    if images is not None:
        out = tr.monitor.measure(images, patch=getattr(tr.policy, "pixel_patch", None))
        save_grid(images, tr.run.samples / f"{name}.png", columns=tr.monitor.options.seeds * 2, captions=tr.monitor.prompts)
    return rank0(out)


def monitor_start(tr) -> None:
    """The base model's measurements, once per run (a resume has them from its checkpoint). Without a
    reference network (full fine-tuning at kl_beta 0) the policy at iteration 0 is the base model."""
    mon = tr.monitor
    if mon.base is not None:
        return
    can_reference = tr.policy.has_lora or getattr(tr.policy, "_reference_net", None) is not None
    mon.base = measured(tr, "monitor_base", reference=can_reference)


def train_reward_since(rows: list[dict], iteration: int) -> float | None:
    """The mean training reward (reward_mean) of the rows of iterations >= `iteration`."""
    values = [r["reward_mean"] for r in rows if r.get("iteration", -1) >= iteration and "reward_mean" in r]
    return sum(values) / len(values) if values else None


def monitor_evaluate(tr, row: dict) -> dict:
    """One evaluation after iteration tr.iteration: the metrics row's monitor columns; the rules' actions taken."""
    t0 = time.perf_counter()
    mon = tr.monitor
    m = measured(tr, f"monitor_{tr.iteration:06d}")
    since = mon.evaluations[-1].iteration if mon.evaluations else 0
    base_div = mon.base["diversity"]
    ratio = m["diversity"] / base_div if base_div and base_div > 0 else None
    ev = Evaluation(tr.iteration, train_reward_since([*tr.history, row], since), m["gold"], m["stats"], ratio)
    mon.evaluations.append(ev)
    out = {f"heldout/{c}": v for c, v in ev.gold.items()}
    out.update({f"monitor/{k}": v for k, v in ev.stats.items()})
    if ratio is not None:  # None: the base's groups had no spread to compare with (one seed, or identical images)
        out["monitor/diversity"] = ratio
    if ev.gold:
        first = ev.gold[mon.options.gold[0]]
        if mon.best is None or first > mon.best[1]:
            mon.best, mon.best_pending = (tr.iteration, first), True
    firings = check_rules(mon.evaluations, mon.base["stats"], mon.options)
    act_all(tr, firings)
    out["monitor/fired"] = len(firings)
    out["time_monitor"] = time.perf_counter() - t0
    return out


def act_all(tr, firings: list[Firing]) -> None:
    """Each firing's action, in order; the rules that ask for a rollback at one evaluation share one (a second
    restore of the same checkpoint would change nothing but spend another of monitor.max_rollbacks)."""
    rolled_back = False
    for f in firings:
        rolled_back = act(tr, f, rolled_back) or rolled_back


def act(tr, firing: Firing, rolled_back: bool = False) -> bool:
    """warn: a line; stop: the loop ends after this iteration's checkpoint; rollback: the `best` checkpoint's
    weights, optimizer, EMA and objective state, or a stop once monitor.max_rollbacks are spent. `rolled_back`:
    this evaluation has rolled back already, so a rollback is recorded and not done again. Whether it rolled back."""
    mon, action = tr.monitor, firing.action
    if action == "rollback" and mon.best_pending:
        action = "warn"  # this very evaluation is the best: nothing better to return to
    elif action == "rollback" and not rolled_back and mon.rollbacks >= mon.options.max_rollbacks:
        action = "stop"
    mon.fired.append((firing.rule, action, tr.iteration))
    if tr.accelerator.is_main_process:
        tqdm.write(f"flowrl monitor, iteration {tr.iteration}: {firing.message} -> {action}"
                   + (" (the one already done)" if action == "rollback" and rolled_back else ""))
    if action == "stop":
        tr.stop_reason = f"monitor: {firing.rule}"
    elif action == "rollback" and not rolled_back:
        rollback(tr)
        return True
    return False


def rollback(tr) -> None:
    """Restore the `best` checkpoint exactly (flowrl/train/trainer_state.py); the iteration counter, the
    allocator and the monitor's record go on. The gold rule starts counting again from the best evaluation."""
    mon = tr.monitor
    ckpt = best_checkpoint(tr.run.checkpoints)
    restore_trainer(tr, ckpt, load_checkpoint(ckpt))
    mon.rollbacks += 1
    mon.evaluations = [e for e in mon.evaluations if e.iteration == mon.best[0]]


def monitor_saved(tr, path) -> None:
    """After a checkpoint: point `best` at it where this iteration's evaluation was the best so far."""
    if tr.monitor.best_pending and path is not None:
        point_to(tr.run.checkpoints, BEST, path.name)
    tr.monitor.best_pending = False
