"""Losses that stay correct when the samples come from older weights (asynchronous rollouts;
docs/algorithms.md section 13, "Off-policy corrections"). Three log-probs per token [N, T]:

- behaviour: what the sampler's weights gave when the token was drawn (stored with the sample);
- proximal: the weights at the start of this training step, before any of its updates;
- current: the live policy, with gradient.

`decoupled_policy_loss` is AReaL's decoupled PPO (Fu et al., arXiv 2505.24298; its
`ppo_actor_loss_fn`): the clip acts on current / proximal, and the detached behaviour weight
proximal / behaviour corrects for the staleness. With fresh samples (proximal = behaviour) it is
`token_policy_loss` exactly. The behaviour weight can be left as it is, truncated at a cap (TIS:
Yao et al.; verl's `tis_imp_ratio_cap`, slime's `--use-tis`, TRL's `*_truncate`) or used as a
rejection mask (AReaL's `rejection_sampling`, TRL's `*_mask`): tokens whose weight passes the cap
carry no loss, while the reduction still counts them.

`m2po_mask` is M2PO's second-moment trust region (Zheng et al., arXiv 2510.01161, as AReaL ports
it): the tokens with the largest squared log-ratio between behaviour and proximal are masked, one
at a time, until the mean over the rest is below tau (0.04); `m2po_policy_loss` is the paper's
objective over the kept tokens, with no clip.

Modality-free: the rows could be any sequences of stochastic steps with their log-probs.
"""

from __future__ import annotations

import torch

from flowrl.core.token_losses import TokenPolicyLoss, aggregate

OFF_POLICY_LOSSES = ("decoupled", "m2po")  # AReaL's decoupled PPO, or M2PO's second-moment mask
WEIGHT_MODES = ("none", "truncate", "mask")  # the behaviour weight: as it is, capped (TIS), or a rejection mask
WEIGHT_LEVELS = ("token", "sequence")  # sequence: the geometric mean of the sequence's token weights, on each token


def behaviour_weights(prox_log_prob: torch.Tensor, behav_log_prob: torch.Tensor, mask: torch.Tensor, mode: str = "none",
                      cap: float | None = None, level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """(w [N, T] detached, keep [N, T] bool): w = exp(proximal - behaviour) on the masked tokens
    (per sequence: exp of the mean over its tokens), non-finite log-ratios taken as 0 (AReaL's
    rule); `truncate` caps w at `cap`, `mask` keeps only the tokens with w <= cap."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"behaviour weight mode must be one of {', '.join(WEIGHT_MODES)}; got '{mode}'")
    if level not in WEIGHT_LEVELS:
        raise ValueError(f"behaviour weight level must be one of {', '.join(WEIGHT_LEVELS)}; got '{level}'")
    if mode != "none" and not (cap is not None and cap > 0):
        raise ValueError(f"behaviour weight mode '{mode}' needs a cap > 0; got {cap}")
    m = mask.bool()
    delta = (prox_log_prob - behav_log_prob).detach()
    delta = torch.where(torch.isfinite(delta) & m, delta, torch.zeros_like(delta))
    if level == "sequence":
        seq = delta.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        delta = seq.expand_as(delta)
    w = torch.exp(delta)
    keep = m.clone()
    if mode == "truncate":
        w = torch.clamp(w, max=cap)
    elif mode == "mask":
        keep = keep & (w <= cap)
    return w, keep


def behaviour_weight_stats(prox_log_prob: torch.Tensor, behav_log_prob: torch.Tensor, mask: torch.Tensor, cap: float) -> dict:
    """The behaviour weights' effective sample size over the masked entries as a fraction of them,
    (sum w)^2 / (n sum w^2) (1 when nothing is stale), and the fraction of weights past `cap`."""
    w, _ = behaviour_weights(prox_log_prob, behav_log_prob, mask)
    w = w[mask.bool()].double()
    if w.numel() == 0:
        return {}
    return {"off_policy/ess": float(w.sum() ** 2 / (w.numel() * w.square().sum())),
            "off_policy/over_cap_fraction": float((w > cap).double().mean())}


def decoupled_policy_loss(log_prob: torch.Tensor, prox_log_prob: torch.Tensor, behav_log_prob: torch.Tensor,
                          advantages: torch.Tensor, mask: torch.Tensor, clip_low: float = 0.2, clip_high: float | None = None,
                          aggregation: str = "token_mean", norm_length: int | None = None, weight_mode: str = "none",
                          weight_cap: float | None = None, weight_level: str = "token") -> TokenPolicyLoss:
    """Decoupled PPO: per token w max(-A u, -A clip(u, 1 - eps_low, 1 + eps_high)), u = exp(logp -
    logp_prox), w = behaviour_weights(...) (detached); tokens the weight rejects add 0 while the
    aggregation keeps counting them (AReaL divides by the mask before rejection)."""
    clip_high = clip_low if clip_high is None else clip_high
    w, keep = behaviour_weights(prox_log_prob, behav_log_prob, mask, weight_mode, weight_cap, weight_level)
    m = mask.to(log_prob.dtype)
    u = torch.exp((log_prob - prox_log_prob.detach()) * m)
    adv = advantages.to(log_prob.dtype).unsqueeze(1)
    unclipped, clipped = -adv * u, -adv * torch.clamp(u, 1.0 - clip_low, 1.0 + clip_high)
    per_token = w * torch.maximum(unclipped, clipped) * keep.to(log_prob.dtype)
    taken = (clipped > unclipped) & keep
    loss = aggregate(per_token, mask, aggregation, norm_length)
    return TokenPolicyLoss(loss, u.detach(), (taken & (u < 1)).detach(), (taken & (u > 1)).detach())


def m2po_mask(prox_log_prob: torch.Tensor, behav_log_prob: torch.Tensor, mask: torch.Tensor, tau: float = 0.04) -> torch.Tensor:
    """M2PO's kept tokens [N, T] bool: over the masked tokens, d = (behaviour - proximal)^2; the
    largest are dropped one at a time until the mean of the rest is below tau. When no count does
    it, all but the smallest are dropped (AReaL's rule)."""
    m = mask.bool()
    d2 = (behav_log_prob - prox_log_prob).detach().square()
    values = d2[m]
    if values.numel() == 0:
        return m.clone()
    order = torch.argsort(values, descending=True)
    ranked = values[order]
    # suffix_mean[k]: the mean of the values left after dropping the k largest
    suffix_sum = torch.flip(torch.cumsum(torch.flip(ranked, [0]), 0), [0])
    suffix_mean = suffix_sum / torch.arange(len(ranked), 0, -1, dtype=ranked.dtype, device=ranked.device)
    below = torch.nonzero(suffix_mean < tau)
    drop = int(below[0]) if len(below) else len(ranked) - 1
    kept_values = torch.ones_like(values, dtype=torch.bool)
    kept_values[order[:drop]] = False
    keep = torch.zeros_like(m)
    keep[m] = kept_values
    return keep


def m2po_policy_loss(log_prob: torch.Tensor, behav_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     keep: torch.Tensor) -> TokenPolicyLoss:
    """M2PO's objective: -(1 / sum of completion lengths) sum_i sum_t M r A with r = exp(logp -
    logp_behav) and M = `keep` (m2po_mask); no clip, the mask is the trust region."""
    m = mask.to(log_prob.dtype)
    r = torch.exp((log_prob - behav_log_prob.detach()) * m)
    per_token = -advantages.to(log_prob.dtype).unsqueeze(1) * r * keep.to(log_prob.dtype)
    none = torch.zeros_like(mask, dtype=torch.bool)
    return TokenPolicyLoss(aggregate(per_token, mask, "token_mean"), r.detach(), none, none)
