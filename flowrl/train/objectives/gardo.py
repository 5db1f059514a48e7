"""objective.grpo.regularizer gardo: GARDO (He et al., arXiv 2512.24138; docs/monitor.md, "GARDO"; the math in
flowrl/core/gardo.py) inside the GRPO objective.

Each iteration, before the optimizer steps:
* the advantage becomes GARDO's diversity-aware one: the channel-weighted reward (the trained one; the
  auxiliary channels carry weight 0) centred in its group, no std division, an above-mean sample's
  scaled by its nearest-neighbour novelty over the group's mean novelty; novelty in the monitor's
  feature space (a reward's `image_features`, else 16 x 16 pixels of the decoded samples), where the
  reference used DINOv3 (objective.grpo.gardo_diversity false keeps advantage.kind's);
* the gate ranks every sample of the batch under the trained reward and each auxiliary channel and
  flags the top kappa share of the disagreement u >= 0 (gardo_gate_sign), kappa adapting (KappaController);
* the reference is reset to a copy of the adapter when an optimizer step's mean KL (averaged over the
  processes, as the reference's reduce) passed gardo_kl_threshold, or every gardo_reset_every iterations.
In the loss, trainer.kl_beta x the KL to that reference, averaged over the gated transitions only."""

from __future__ import annotations

import torch

from flowrl.core.gardo import (KappaController, diversity_aware_advantages, gated_kl, nearest_neighbour_novelty,
                               reference_reset_due, uncertainty, uncertainty_gate)
from flowrl.runtime.ema import EMA
from flowrl.train.experience import Experience, TransitionBatch, advantages_at
from flowrl.train.monitor.image_stats import middle_frames, pixel_features


def channel_columns(channel_names: list[str], wanted: list[str]) -> list[int]:
    """Each wanted channel's column: a channel name (shapes/strict) or a one-channel reward's name."""
    return [channel_names.index(w) for w in wanted]


class GardoRegularizer:
    def __init__(self, ctx):
        self.ctx, self.g = ctx, ctx.cfg.objective.grpo
        self.kappa = KappaController(kappa0=self.g.gardo_kappa, kappa=self.g.gardo_kappa)
        self.reference = EMA(ctx.params, 0.0)  # a copy of the adapter as it starts (zero: the base network)
        self.since_reset, self.kl_exceeded = 0, False
        self.gate = torch.zeros(0, dtype=torch.bool)
        self.step_kls: list[float] = []

    # ---- per iteration ----------------------------------------------------------------------
    def prepare(self, experience: Experience) -> tuple[list[list[TransitionBatch]], dict]:
        """The transitions with GARDO's advantages, the gate for this iteration, the reference reset
        when due; the metrics columns."""
        reset = reference_reset_due(self.kl_exceeded, self.since_reset, self.g.gardo_reset_every)
        if reset:
            self.reference = EMA(self.ctx.params, 0.0)
            self.since_reset, self.kl_exceeded = 0, False
        self.since_reset += 1
        valid, main = experience.valid, experience.reward_totals
        names = list(self.ctx.reward_fn.channel_names)
        aux = experience.rewards[:, channel_columns(names, list(self.g.gardo_auxiliary))]
        u = uncertainty(main[valid], aux[valid], self.g.gardo_gate_sign)
        nonneg = u[u >= 0]
        kappa = self.kappa.update(nonneg.mean().item() if len(nonneg) else 0.0)
        self.gate = torch.zeros(len(valid), dtype=torch.bool)
        self.gate[valid] = uncertainty_gate(u, kappa)
        groups = experience.transitions
        if self.g.gardo_diversity:
            advantages = torch.zeros(len(valid))
            novelty = nearest_neighbour_novelty(self.features(experience)[valid], experience.prompt_ids[valid])
            advantages[valid] = diversity_aware_advantages(main[valid], experience.prompt_ids[valid], novelty,
                                                           self.ctx.cfg.advantage.clip)
            groups = [[mb._replace(advantages=advantages_at(advantages, mb.index)) for mb in g] for g in groups]
        return groups, {"gardo_gated": self.gate.float().mean().item(), "gardo_kappa": kappa, "gardo_reset": float(reset)}

    @torch.no_grad()
    def features(self, experience: Experience) -> torch.Tensor:
        """[N, D] features of every real sample: this process's decoded, the others' summed in (each
        real sample lives on one process; padding copies point past N)."""
        ctx, n = self.ctx, len(experience.valid)
        encoder = next((f.image_features for f in ctx.reward_fn.fns.values() if callable(getattr(f, "image_features", None))), None)
        rows, feats = [], []
        for sb in experience.samples:
            real = sb.index < n
            if bool(real.any()):
                images = ctx.policy.decode(sb.x0[real.to(sb.x0.device)])
                feats.append((encoder(middle_frames(images)) if encoder is not None else pixel_features(images)).float().cpu())
                rows.append(sb.index[real])
        dim = feats[0].shape[1] if feats else 0
        dim = int(ctx.accelerator.reduce(torch.tensor(dim, device=ctx.accelerator.device), "max"))
        out = torch.zeros(n, dim)
        for r, f in zip(rows, feats):
            out[r] = f
        return ctx.accelerator.reduce(out.to(ctx.accelerator.device), "sum").cpu()

    # ---- per micro-batch and optimizer step ---------------------------------------------------
    @torch.no_grad()
    def reference_pass(self, mb: TransitionBatch):
        """The micro-batch under the GARDO reference, before the policy's forward (the swap writes into
        the weights, which a graph built earlier would see changed)."""
        with self.reference.swapped_in(self.ctx.params):
            return mb.evaluate()

    def kl(self, mb: TransitionBatch, rows: torch.Tensor, keep) -> torch.Tensor:
        """The KL over the gated rows of `rows` (the per-transition KL of the kept transitions, in
        objective.grpo.kl_form: GARDO's code uses Flow-GRPO's form)."""
        gate = advantages_at(self.gate.float(), mb.index).to(rows.device)[keep].bool()
        kl = gated_kl(rows, gate)
        self.step_kls.append(kl.item())
        return kl

    def after_step(self) -> None:
        """GARDO's reset trigger: this optimizer step's mean KL over its micro-batches, averaged over the
        processes before it meets the threshold (the reference logs accelerator.reduce(info, "mean") and
        compares that), so every process resets alike. A process that computed no KL this step (none of
        its transitions kept) stays out of the average."""
        acc = self.ctx.accelerator
        local = [sum(self.step_kls) / len(self.step_kls), 1.0] if self.step_kls else [0.0, 0.0]
        total, processes = acc.reduce(torch.tensor(local, dtype=torch.float64, device=acc.device), "sum").tolist()
        if processes > 0 and total / processes > self.g.gardo_kl_threshold:
            self.kl_exceeded = True
        self.step_kls = []

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        k = self.kappa
        history = torch.zeros(k.window)  # fixed length: safetensors holds no empty tensor of unknown size
        history[: len(k.history)] = torch.tensor(k.history)
        return {"gardo_reference": self.reference.shadow,
                "gardo_state": {"kappa": torch.tensor(k.kappa), "history": history, "history_len": torch.tensor(len(k.history)),
                                "since_reset": torch.tensor(self.since_reset), "kl_exceeded": torch.tensor(self.kl_exceeded)}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("gardo_reference") is None:
            return  # a checkpoint from before GARDO was on: start it afresh
        self.reference.shadow = {n: t.clone() for n, t in state["gardo_reference"].items()}
        s = state["gardo_state"]
        self.kappa.kappa, self.kappa.history = float(s["kappa"]), s["history"][: int(s["history_len"])].tolist()
        self.since_reset, self.kl_exceeded = int(s["since_reset"]), bool(s["kl_exceeded"])

