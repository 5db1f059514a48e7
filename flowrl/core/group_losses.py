"""Group losses on implicit rewards (docs/algorithms.md section 10): a sample's implicit reward
`s` is how much more the trained policy likes it than the reference does (for a flow,
`s = -beta * (err_theta - err_ref)` with flow-matching errors; for text, `beta * (log pi_theta -
log pi_ref)`). These losses see only `s` (or the raw gap `delta`), rewards and group ids: no
images, no tokens.

- GDRO (arXiv 2601.02036): a listwise loss between the reward's soft ranking of the group,
  softmax(r / tau), and the model's, softmax(s): top-1 (one cross-entropy) or Plackett-Luce
  (one cross-entropy per position of the reward order).
- DGPO (arXiv 2510.08425): the group's positive and negative halves, weighted by |A|, as one
  Bradley-Terry comparison: -log sigmoid(-(beta / G) sum_i A_i delta_i), or, as the authors' code
  back-propagates it, its direction at 1/beta the size (`dgpo_weighted_error_loss`).
"""

from __future__ import annotations

import torch

from flowrl.core.advantages import groups_of

LISTWISE_FORMS = ("top1", "plackett_luce")


def listwise_group_loss(s: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor, tau: float,
                        form: str = "top1", tie_keys: torch.Tensor | None = None) -> torch.Tensor:
    """GDRO's listwise loss per group [G] (groups in sorted id order).

    top1: H(q, softmax(s)) - the part that does not depend on s, i.e.
      logsumexp_j s_j - sum_j q_j s_j,  q = softmax(r / tau) over the group.
    plackett_luce: items sorted by r descending (ties by `tie_keys` ascending, then by position:
      a stable order with a seeded tie-break when the caller draws the keys), and for each
      position i < k the top-1 loss of the remaining items i..k:
      sum_i [ logsumexp_{m>=i} s_m - sum_{j>=i} q_i(j) s_j ],  q_i = softmax(r / tau) over i..k.
    Both are invariant to a constant added to every s of a group, and at s = 0 the top-1 loss is
    log k. With k = 2 and tau -> 0 either is -log sigmoid(s_w - s_l): Diffusion-DPO's loss when
    s = -beta * delta."""
    if form not in LISTWISE_FORMS:
        raise ValueError(f"form must be one of {LISTWISE_FORMS}, got {form!r}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    g = groups_of(group_ids)
    r = rewards.to(s.dtype)
    keys = torch.zeros_like(r) if tie_keys is None else tie_keys.to(s.dtype)
    losses = []
    for k in range(g.ids.numel()):
        idx = (g.inverse == k).nonzero().squeeze(1)
        s_k, r_k = s[idx], r[idx] / tau
        if form == "top1":
            losses.append(torch.logsumexp(s_k, 0) - (torch.softmax(r_k, 0) * s_k).sum())
            continue
        # stable sort by key, then by -r: equal rewards keep key order, equal keys their position
        by_key = torch.sort(keys[idx], stable=True).indices
        order = by_key[torch.sort(-r_k[by_key], stable=True).indices]
        s_k, r_k = s_k[order], r_k[order]
        n = len(idx)
        remaining = torch.arange(n)[None, :] >= torch.arange(n - 1)[:, None]  # [n-1, n]: row i holds items i..n
        neg_inf = torch.finfo(s.dtype).min
        q = torch.softmax(torch.where(remaining, r_k[None, :], torch.full_like(r_k[None, :], neg_inf)), 1)
        lse = torch.logsumexp(torch.where(remaining, s_k[None, :], torch.full_like(s_k[None, :], neg_inf)), 1)
        losses.append((lse - (q * torch.where(remaining, s_k[None, :], torch.zeros_like(s_k[None, :]))).sum(1)).sum())
    return torch.stack(losses)


def dgpo_group_loss(delta: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor, beta: float,
                    group_sizes: torch.Tensor | None = None) -> torch.Tensor:
    """DGPO's loss per group [G] (groups in sorted id order): -log sigmoid(-(beta / G) sum_i A_i delta_i),
    delta_i the sample's implicit-reward gap (err_theta - err_ref for a flow: lower error than the
    reference on a better-than-group sample lowers the loss). Because a group's advantages sum to
    0, a constant added to every delta of the group (the partition function) cancels: the positive
    side sum_{A>0} |A| and the negative side sum_{A<=0} |A| weigh the same. The gradient is
    sigmoid((beta / G) sum A delta) * (beta / G) * sum_i A_i grad delta_i: groups the model already
    orders well are down-weighted. `group_sizes` [G] gives each group's G when `delta` holds only
    part of it (default: the count present)."""
    g = groups_of(group_ids)
    sizes = g.counts.to(delta.dtype) if group_sizes is None else group_sizes.to(delta.dtype)
    total = torch.zeros(g.ids.numel(), dtype=delta.dtype, device=delta.device)
    total = total.index_add(0, g.inverse, advantages.to(delta.dtype) * delta)
    return -torch.nn.functional.logsigmoid(-(beta / sizes) * total)


def dgpo_group_weights(delta: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor, beta: float,
                       group_sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Each sample's detached group weight [b], sigmoid((beta / G) sum_{j in its group} A_j delta_j):
    the factor by which -log sigmoid(-(beta / G) sum A delta) scales its group's gradient."""
    g = groups_of(group_ids)
    sizes = g.counts.to(delta.dtype) if group_sizes is None else group_sizes.to(delta.dtype)
    total = torch.zeros(g.ids.numel(), dtype=delta.dtype, device=delta.device)
    total = total.index_add(0, g.inverse, advantages.to(delta.dtype) * delta.detach())
    return torch.sigmoid((beta / sizes) * total)[g.inverse].detach()


def dgpo_weighted_error_loss(err: torch.Tensor, delta: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor,
                             beta: float, group_sizes: torch.Tensor | None = None) -> torch.Tensor:
    """DGPO's loss per sample [b] as its reference code writes it (Luo-Yihong/DGPO,
    `compute_group_dgpo_loss_allreduce`): w_i A_i err_i with w_i = sigmoid((beta / G) sum_j A_j delta_j)
    detached over sample i's group and err_i the trained policy's flow-matching error (a mean over
    dimensions). Averaged over the samples, its gradient is that of the groups' mean
    -log sigmoid(-(beta / G) sum A delta) (`dgpo_group_loss`) divided by beta: the same direction,
    and the size that the code's KL weight and gradient clip were set against."""
    return dgpo_group_weights(delta, advantages, group_ids, beta, group_sizes) * advantages.to(err.dtype) * err


def group_best(rewards: torch.Tensor, group_ids: torch.Tensor, tie_keys: torch.Tensor | None = None) -> torch.Tensor:
    """[G] the index of each group's highest reward (groups in sorted id order); among tied
    rewards the lowest `tie_keys` value, then the lowest position."""
    g = groups_of(group_ids)
    keys = torch.zeros_like(rewards, dtype=torch.float64) if tie_keys is None else tie_keys.double()
    best = []
    for k in range(g.ids.numel()):
        idx = (g.inverse == k).nonzero().squeeze(1)
        top = idx[rewards[idx] == rewards[idx].max()]
        best.append(top[torch.argmin(keys[top])])  # argmin returns the first of equal keys
    return torch.stack(best)
