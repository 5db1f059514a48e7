"""The rules of inference-time search, on tensors only (docs/algorithms.md section 11).

The target of every method is the reward-tilted model, pi*(x0) proportional to
p_theta(x0) exp(lambda r(x0)). This module holds what does not care whether a state is an image
latent or a token prefix:

- the compute ledger every method charges and stops at (`Ledger`);
- SMC / Feynman-Kac steering's potentials, effective sample size and resampling (Singhal et
  al., arXiv 2501.06848);
- Diffusion Tree Sampling's tree (Jain et al., arXiv 2506.20701): progressive widening, soft
  value backup, Boltzmann (DTS) or UCT (DTS*) selection, and drawing from a built tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

POTENTIALS = ("max", "add", "diff", "rt")
RESAMPLINGS = ("systematic", "multinomial")
SELECTIONS = ("boltzmann", "uct")
BACKUPS = ("soft", "max")


# ---- the ledger ---------------------------------------------------------------------------------
@dataclass
class Ledger:
    """What a search spent: network evaluations (rows through the network, so a batch of 8 is 8),
    decodes and reward calls (rows scored). `budget` caps the network evaluations; a method asks
    `affords` before it spends, so it never passes the budget."""

    budget: int
    nfe: int = 0
    decodes: int = 0
    reward_calls: int = 0
    marks: list = field(default_factory=list)  # (label, nfe) checkpoints a method recorded on the way

    def affords(self, nfe: int) -> bool:
        return self.nfe + nfe <= self.budget

    def charge(self, nfe: int = 0, decodes: int = 0, reward_calls: int = 0) -> None:
        if self.nfe + nfe > self.budget:
            raise RuntimeError(f"search overspent its budget: {self.nfe} + {nfe} > {self.budget} network evaluations")
        self.nfe += nfe
        self.decodes += decodes
        self.reward_calls += reward_calls

    def as_dict(self) -> dict:
        return {"budget_nfe": self.budget, "nfe": self.nfe, "decodes": self.decodes, "reward_calls": self.reward_calls}


# ---- SMC / Feynman-Kac steering -----------------------------------------------------------------
def log_potential(kind: str, lam: float, reward: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
    """log G_t of FK steering for the particles' intermediate rewards `reward` [k] (of the predicted
    x0) given `history` [k], the statistic of their lineage's earlier rewards (max: their running
    maximum, add: their sum, diff: the last one; None before the first potential step)."""
    if kind == "rt" or history is None:
        return lam * reward
    if kind == "max":
        return lam * torch.maximum(reward, history)
    if kind == "add":
        return lam * (reward + history)
    if kind == "diff":
        return lam * (reward - history)
    raise ValueError(f"potential must be one of {POTENTIALS}, got {kind!r}")


def update_history(kind: str, reward: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
    """The lineage statistic `log_potential` reads at the next potential step."""
    if history is None or kind in ("diff", "rt"):
        return reward.clone()
    return torch.maximum(reward, history) if kind == "max" else reward + history


def effective_sample_size(log_weights: torch.Tensor) -> torch.Tensor:
    """(sum w)^2 / sum w^2 of the normalised weights: k for equal weights, 1 for a single one."""
    w = torch.softmax(log_weights.double(), dim=-1)
    return 1.0 / (w**2).sum(-1)


def resample_indices(log_weights: torch.Tensor, method: str, generator: torch.Generator) -> torch.Tensor:
    """k ancestor indices drawn in proportion to exp(log_weights) [k]. Systematic resampling uses
    one uniform for all k draws (lower variance); multinomial draws them independently."""
    k = log_weights.numel()
    w = torch.softmax(log_weights.double().cpu(), dim=0)
    if method == "multinomial":
        return torch.multinomial(w, k, replacement=True, generator=generator)
    if method == "systematic":
        u = (torch.rand((), generator=generator, dtype=torch.float64) + torch.arange(k, dtype=torch.float64)) / k
        cdf = torch.cumsum(w, 0)
        cdf[-1] = 1.0  # rounding must not leave the last particle unreachable
        return torch.searchsorted(cdf, u, right=True).clamp_max(k - 1)
    raise ValueError(f"resampling must be one of {RESAMPLINGS}, got {method!r}")


# ---- Diffusion Tree Sampling ----------------------------------------------------------------------
def soft_value(values: torch.Tensor, lam: float, backup: str = "soft") -> torch.Tensor:
    """The value of a node from its children's values [..., n]: (1/lam) log mean exp(lam v), the
    soft Bellman backup of DTS (uniform over children, which p_theta drew). lam = 0 gives the
    mean (the base model's value), backup='max' or lam = inf the maximum."""
    if backup == "max" or math.isinf(lam):
        return values.amax(-1)
    if backup != "soft":
        raise ValueError(f"backup must be one of {BACKUPS}, got {backup!r}")
    if lam == 0:
        return values.mean(-1)
    return (torch.logsumexp(lam * values.double(), -1) - math.log(values.shape[-1])).to(values.dtype) / lam


def progressive_width(visits: int, c: float, alpha: float) -> int:
    """How many children a node with `visits` rollouts through it may have: ceil(C N^alpha)."""
    return max(1, math.ceil(c * max(visits, 1) ** alpha - 1e-9))  # 2 x 32^0.8 is 32, not 32.000000000000004


class SearchTree:
    """The topology, visit counts and values of a DTS tree; node 0 is the root (before the initial
    noise). The states themselves live with the caller, keyed by node id. `depth` counts branch
    levels; a node at `leaf_depth` is a finished sample whose value is its reward."""

    def __init__(self, leaf_depth: int, lam: float, backup: str = "soft", width_c: float = 2.0, width_alpha: float = 0.8,
                 selection: str = "boltzmann", uct_c: float = 1.0):
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        self.leaf_depth, self.lam, self.backup_rule = leaf_depth, lam, backup
        self.width_c, self.width_alpha, self.selection, self.uct_c = width_c, width_alpha, selection, uct_c
        self.parent, self.depth, self.children = [-1], [0], [[]]
        self.visits, self.value = [0], [float("nan")]
        self.pending = [0]  # children being expanded by rollouts in flight, counted against the width

    def __len__(self) -> int:
        return len(self.parent)

    def add(self, parent: int) -> int:
        """A new node under `parent`, with the visit of the rollout that adds it (its value comes
        with that rollout's backup)."""
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.children.append([])
        self.visits.append(1)
        self.value.append(float("nan"))
        self.pending.append(0)
        self.children[parent].append(len(self.parent) - 1)
        return len(self.parent) - 1

    def leaves(self) -> list[int]:
        return [n for n in range(len(self.parent)) if self.depth[n] == self.leaf_depth]

    def path(self, node: int) -> list[int]:
        """The nodes from the root down to `node`."""
        out = [node]
        while self.parent[out[-1]] >= 0:
            out.append(self.parent[out[-1]])
        return out[::-1]

    def _choose_child(self, node: int, generator: torch.Generator) -> int:
        kids = self.children[node]
        values = torch.tensor([self.value[c] for c in kids], dtype=torch.float64)
        if self.selection == "boltzmann":  # DTS: a child in proportion to exp(lam v)
            return kids[int(torch.multinomial(torch.softmax(self.lam * values, 0), 1, generator=generator))]
        visits = torch.tensor([self.visits[c] for c in kids], dtype=torch.float64)  # DTS*: UCT, greedy
        bonus = self.uct_c * torch.sqrt(math.log(max(self.visits[node], 1)) / visits.clamp_min(1))
        return kids[int(torch.argmax(values + bonus))]

    def select(self, generator: torch.Generator) -> int:
        """The node to expand a new child from: descend from the root while a node holds all the
        children its visits allow (progressive widening), choosing among them by the selection
        rule. Every node on the way gets a visit now (a virtual visit that the rollout makes
        real), so the next selection of a batch in flight sees it and goes elsewhere."""
        node = 0
        while True:
            self.visits[node] += 1
            width = progressive_width(self.visits[node], self.width_c, self.width_alpha)
            kids = self.children[node]
            if len(kids) + self.pending[node] < width or not kids:
                break
            child = self._choose_child(node, generator)
            if self.depth[child] == self.leaf_depth:
                break  # a finished sample has nothing to expand: a new sibling instead
            node = child
        self.pending[node] += 1
        return node

    def cancel(self, node: int) -> None:
        """Undo a `select` that ended at `node` and will not be rolled out (the budget ran out)."""
        for n in self.path(node):
            self.visits[n] -= 1
        self.pending[node] -= 1

    def finish_expansion(self, node: int) -> None:
        """The rollout that `select` started at `node` has added its child."""
        self.pending[node] -= 1

    def backup(self, leaf: int, reward: float) -> None:
        """Set a finished sample's value to its reward and recompute each ancestor's value from
        its children's (soft backup)."""
        self.value[leaf] = float(reward)
        node = leaf
        while node >= 0:
            if node != leaf:
                kids = [c for c in self.children[node] if not math.isnan(self.value[c])]
                self.value[node] = float(soft_value(torch.tensor([self.value[c] for c in kids], dtype=torch.float64),
                                                    self.lam, self.backup_rule))
            node = self.parent[node]

    def draw(self, generator: torch.Generator, lam: float | None = None) -> int:
        """A finished sample drawn from the built tree with no network call: from the root, a
        child in proportion to exp(lam v) among those with a value, down to a leaf. lam = 0 picks
        uniformly, which samples the base model's empirical distribution."""
        lam = self.lam if lam is None else lam
        node = 0
        while self.depth[node] != self.leaf_depth:
            kids = [c for c in self.children[node] if not math.isnan(self.value[c])]
            if not kids:
                raise ValueError("the tree has no finished sample under this node yet")
            values = torch.tensor([self.value[c] for c in kids], dtype=torch.float64)
            node = kids[int(torch.multinomial(torch.softmax(lam * values, 0), 1, generator=generator))]
        return node

    def best_leaf(self) -> int:
        """The finished sample with the highest reward (DTS*'s answer)."""
        leaves = [n for n in self.leaves() if not math.isnan(self.value[n])]
        if not leaves:
            raise ValueError("the tree has no finished sample yet")
        return max(leaves, key=lambda n: self.value[n])
