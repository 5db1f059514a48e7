"""Rollout allocation: which prompts get how many rollouts under a fixed budget per iteration
(docs/algorithms.md section 7). Modality-free: prompts are indices into a pool, outcomes are
success flags (a continuous reward becomes a success through a threshold, set by the caller).

Protocol, one iteration:
    counts = alloc.first_stage(iteration)          # LongTensor [num_prompts], sum <= budget
    while (extra := alloc.next_stage(counts, successes, failures)).sum() > 0:
        ...sample extra, count outcomes...; counts += extra
    keep = alloc.keep(prompt_ids, success)          # which samples the loss trains on (default: all)
    alloc.observe(prompt_ids, success)              # per sample, updates the posteriors

The stages of one iteration spend exactly `budget` rollouts (`reinforce_ada`, which samples until
a prompt has signal, spends at most its budget: `exact_budget` False), and every prompt that is
sampled at all gets at least `min_group` rollouts (a group of one has no baseline).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, ClassVar

import torch

from flowrl.errors import ConfigError
from flowrl.registry import Registry

# allocator.kind -> the allocator class. A class registers under its `name`; its `options` dataclass (or None)
# is the config's allocator.<name> section and its constructor's keywords, with RANGES and CHOICES beside the
# fields; `validate(cfg)` checks what needs the rest of the config. A new allocator is a new registered class.
ALLOCATORS = Registry("allocator.kind", "Allocators")  # which prompts get how many rollouts


class PromptStats:
    """Per-prompt Beta posteriors over success probability, with two forgetting scales
    (VADE's two-scale prior decay, our reading): fast and slow decayed success/failure counts;
    the posterior uses their average on top of a Beta(prior_a, prior_b) prior, so it follows a
    changing policy quickly (fast) without forgetting everything (slow)."""

    def __init__(self, num_prompts: int, prior_a: float = 1.0, prior_b: float = 1.0, fast_decay: float = 0.5, slow_decay: float = 0.95):
        self.prior_a, self.prior_b = prior_a, prior_b
        self.fast_decay, self.slow_decay = fast_decay, slow_decay
        z = lambda: torch.zeros(num_prompts, dtype=torch.float64)  # noqa: E731
        self.s_fast, self.f_fast, self.s_slow, self.f_slow = z(), z(), z(), z()
        self.seen = torch.zeros(num_prompts, dtype=torch.long)

    def update(self, prompt_ids: torch.Tensor, success: torch.Tensor) -> None:
        """Decay the prompts that were sampled, then add their new outcomes."""
        n = self.s_fast.numel()
        s = torch.bincount(prompt_ids, weights=success.double(), minlength=n)
        f = torch.bincount(prompt_ids, weights=(~success).double(), minlength=n)
        touched = torch.bincount(prompt_ids, minlength=n) > 0
        for counts, new, decay in ((self.s_fast, s, self.fast_decay), (self.f_fast, f, self.fast_decay),
                                   (self.s_slow, s, self.slow_decay), (self.f_slow, f, self.slow_decay)):
            counts[touched] = counts[touched] * decay + new[touched]
        self.seen += touched.long()

    @property
    def alpha(self) -> torch.Tensor:
        return self.prior_a + 0.5 * (self.s_fast + self.s_slow)

    @property
    def beta(self) -> torch.Tensor:
        return self.prior_b + 0.5 * (self.f_fast + self.f_slow)

    def mean(self) -> torch.Tensor:
        return self.alpha / (self.alpha + self.beta)

    def thompson(self, generator: torch.Generator) -> torch.Tensor:
        """One draw p ~ Beta(alpha, beta) per prompt, from `generator` (Gamma ratio)."""
        a = _gamma(self.alpha, generator)
        b = _gamma(self.beta, generator)
        return a / (a + b)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"s_fast": self.s_fast, "f_fast": self.f_fast, "s_slow": self.s_slow, "f_slow": self.f_slow, "seen": self.seen}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            getattr(self, k).copy_(v)


def _gamma(shape: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # torch's _standard_gamma takes no generator; Marsaglia-Tsang with explicit draws keeps
    # every allocation reproducible from the seed
    boost = shape < 1
    d = torch.where(boost, shape + 1, shape) - 1.0 / 3
    c = 1.0 / torch.sqrt(9 * d)
    out = torch.empty_like(shape)
    todo = torch.ones_like(shape, dtype=torch.bool)
    while todo.any():
        x = torch.randn(shape.shape, generator=generator, dtype=shape.dtype)
        u = torch.rand(shape.shape, generator=generator, dtype=shape.dtype)
        v = (1 + c * x) ** 3
        ok = todo & (v > 0) & (torch.log(u.clamp_min(1e-300)) < 0.5 * x**2 + d - d * v + d * torch.log(v.clamp_min(1e-300)))
        out[ok] = (d * v)[ok]
        todo &= ~ok
    u = torch.rand(shape.shape, generator=generator, dtype=shape.dtype)
    return torch.where(boost, out * u.clamp_min(1e-300) ** (1.0 / shape), out)


def largest_remainder(weights: torch.Tensor, total: int, minimum: int = 0) -> torch.Tensor:
    """Integers >= `minimum` proportional to `weights` that sum exactly to `total`."""
    n = weights.numel()
    if total < minimum * n:
        raise ValueError(f"budget {total} cannot give {n} prompts at least {minimum} rollouts each")
    w = weights.double().clamp_min(0)
    w = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1.0 / n)
    free = total - minimum * n
    raw = w * free
    counts = raw.floor().long()
    rest = free - int(counts.sum())
    if rest:
        counts[torch.argsort(raw - counts, descending=True, stable=True)[:rest]] += 1
    return counts + minimum


@ALLOCATORS.register
class Allocator:
    """Base: uniform allocation. `budget` rollouts per iteration over `prompts_per_iteration`
    prompts drawn from a pool of `num_prompts`. `options`: the allocator's own keywords."""

    name: ClassVar[str] = "uniform"
    options: ClassVar[type | None] = None  # a dataclass: the allocator's own options (allocator.<name>)
    exact_budget: ClassVar[bool] = True  # the stages spend exactly `budget` (False: at most)
    keeps_all: ClassVar[bool] = True  # the loss trains on every sample drawn (False: `keep` chooses a subset)

    def __init__(self, num_prompts: int, budget: int, prompts_per_iteration: int, seed: int = 0, min_group: int = 2,
                 prior_a: float = 1.0, prior_b: float = 1.0, fast_decay: float = 0.5, slow_decay: float = 0.95, **options):
        if prompts_per_iteration * min_group > budget:
            raise ValueError(f"a budget of {budget} rollouts cannot give {prompts_per_iteration} prompts {min_group} rollouts each")
        if options and self.options is None:
            raise ValueError(f"allocator {self.name} takes no options; got {sorted(options)}")
        self.opts = self.options(**options) if self.options else None  # an unknown keyword: TypeError
        self.num_prompts, self.budget, self.per_iteration = num_prompts, budget, prompts_per_iteration
        self.seed, self.min_group = seed, min_group
        self.stats = PromptStats(num_prompts, prior_a, prior_b, fast_decay, slow_decay)
        self.iteration = 0
        self.spent = 0

    @classmethod
    def own_options(cls, kw: dict):
        """The allocator's options from the keywords `kw` that are among them (before `__init__` has run)."""
        names = {f.name for f in fields(cls.options)}
        return cls.options(**{k: v for k, v in kw.items() if k in names})

    @classmethod
    def validate(cls, cfg) -> None:
        """What the allocator's options need of the rest of the config (`cfg.data.group_size`, ...); its
        RANGES and CHOICES are checked with the config's."""

    def generator(self, iteration: int, salt: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + iteration * 7919 + salt)

    def choose_prompts(self, iteration: int) -> torch.Tensor:
        """Which prompts this iteration samples: uniformly without replacement (with, if the pool is small)."""
        g = self.generator(iteration)
        if self.per_iteration <= self.num_prompts:
            return torch.randperm(self.num_prompts, generator=g)[: self.per_iteration]
        return torch.randint(self.num_prompts, (self.per_iteration,), generator=g)

    def counts_for(self, prompts: torch.Tensor, per_prompt: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros(self.num_prompts, dtype=torch.long)
        counts.index_add_(0, prompts, per_prompt.long())
        return counts

    def first_stage(self, iteration: int) -> torch.Tensor:
        self.iteration, self.spent = iteration, 0
        prompts = self.choose_prompts(iteration)
        counts = self.counts_for(prompts, largest_remainder(torch.ones(len(prompts)), self.stage_budget(), self.min_group))
        self.spent = int(counts.sum())
        return counts

    def stage_budget(self) -> int:
        return self.budget

    def next_stage(self, counts: torch.Tensor, successes: torch.Tensor, failures: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.num_prompts, dtype=torch.long)

    def _take(self, extra: torch.Tensor) -> torch.Tensor:
        self.spent += int(extra.sum())
        return extra

    @property
    def remaining(self) -> int:
        return self.budget - self.spent

    def keep(self, prompt_ids: torch.Tensor, success: torch.Tensor) -> torch.Tensor:
        """Which of the iteration's samples (prompt ids [N] and successes [N], in stage order) the
        loss trains on: all of them, unless the allocator forms its own groups."""
        return torch.ones(len(prompt_ids), dtype=torch.bool)

    def observe(self, prompt_ids: torch.Tensor, success: torch.Tensor) -> None:
        self.stats.update(prompt_ids.long(), success.bool())

    def coverage(self) -> dict[str, float]:
        """How far over the pool the allocator has spread so far: `pool_covered`, the fraction of
        its prompts observed in at least one iteration, and `pool_revisits`, in how many iterations
        an observed prompt was on average. An allocator that keeps returning to a narrow set shows
        a small coverage and many revisits (what held-out accuracy may pay for)."""
        seen = self.stats.seen
        observed = seen > 0
        revisits = float(seen[observed].double().mean()) if bool(observed.any()) else 0.0
        return {"pool_covered": float(observed.double().mean()), "pool_revisits": revisits}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.stats.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.stats.load_state_dict(state)


@ALLOCATORS.register
class VADEAllocator(Allocator):
    """VADE (variance-aware dynamic sampling): Thompson-sample each prompt's success probability
    from its Beta posterior and sample the prompts whose draw is most informative, p (1 - p)
    (the Bernoulli variance: a group is degenerate with probability p^G + (1 - p)^G, smallest at
    p = 1/2). Unseen prompts have the Beta(1, 1) prior, so they are explored too."""

    name = "vade"

    def choose_prompts(self, iteration: int) -> torch.Tensor:
        p = self.stats.thompson(self.generator(iteration, salt=1))
        k = min(self.per_iteration, self.num_prompts)
        return torch.argsort(p * (1 - p), descending=True, stable=True)[:k]


@ALLOCATORS.register
class XRPOAllocator(Allocator):
    """XRPO-style allocation by expected uncertainty reduction: every chosen prompt gets
    `min_group` rollouts, then each further rollout goes to the prompt where one more sample
    shrinks the variance of its mean-reward estimate most, v / (n (n + 1)), with v the posterior
    predictive Bernoulli variance. (Our reading; XRPO's exact score is not in its abstract.)"""

    name = "xrpo"

    def first_stage(self, iteration: int) -> torch.Tensor:
        self.iteration, self.spent = iteration, 0
        prompts = self.choose_prompts(iteration)
        m = self.stats.mean()[prompts]
        v = (m * (1 - m)).clamp_min(1e-4)
        n = torch.full((len(prompts),), self.min_group, dtype=torch.long)
        for _ in range(self.budget - int(n.sum())):
            gain = v / (n * (n + 1)).double()
            n[int(torch.argmax(gain))] += 1
        counts = self.counts_for(prompts, n)
        self.spent = int(counts.sum())
        return counts


# DARS's schedules (the authors' ray_dars_trainer.py, resample_func1 / resample_func2): a prompt's
# total rollouts after its first group of 8, by its accuracy in that group: (at most this accuracy,
# total), the first row that holds; above 3/8 the first group is all
DARS_SCHEDULES = {
    "equal": ((0.0, 32), (1 / 8, 18), (2 / 8, 11), (3 / 8, 9)),  # equal treatment
    "hardness": ((0.0, 48), (1 / 8, 24), (2 / 8, 12), (3 / 8, 9)),  # hardness weighted
}
DARS_REFERENCE_GROUP = 8  # the reference's rollout.n, which the schedules' totals are written for


def dars_total(accuracy: float, group: int, schedule: str = "equal") -> int:
    """Rollouts in all for a prompt whose first `group` rollouts had `accuracy`: the reference's
    schedule, its totals scaled from groups of 8 to `group` (exactly the reference's at 8)."""
    for limit, total in DARS_SCHEDULES[schedule]:
        if accuracy <= limit + 1e-6:
            return max(group, round(total * group / DARS_REFERENCE_GROUP))
    return group


@dataclass
class DARSOptions:
    schedule: str = "equal"  # the authors' equal-treatment schedule | hardness (hardness weighted)

    CHOICES: ClassVar[dict] = {"schedule": ("equal", "hardness")}


@ALLOCATORS.register
class DARSAllocator(Allocator):
    """DARS as its authors run it (Yang et al., "Depth-Breadth Synergy in RLVR", arXiv 2508.13755;
    yangzhch6/DARS, ray_dars_trainer.py): the iteration's prompts (uniform) get a full group of
    n = budget / prompts_per_iteration (data.group_size); a second stage brings each prompt whose
    accuracy in it is at most 3/8 to the total its accuracy earns in `schedule` (equal
    treatment, at n = 8: 32, 18, 11, 9 rollouts for accuracy 0, 1/8, 2/8, 3/8; hardness weighted:
    48, 24, 12, 9); the loss trains only on the prompts whose combined accuracy lies strictly
    between 0 and 1 (`keep`: the reference drops the rest). The iteration spends between the
    budget and 4x (equal) or 6x (hardness) it: DARS buys depth on hard prompts with more
    rollouts, which at equal wall-clock means fewer iterations."""

    name = "dars"
    options = DARSOptions
    exact_budget = False
    keeps_all = False

    def __init__(self, num_prompts: int, budget: int, prompts_per_iteration: int, seed: int = 0, min_group: int = 2, **kw):
        if prompts_per_iteration * min_group > budget:  # the first groups: group_size each
            raise ValueError(f"a budget of {budget} rollouts cannot give {prompts_per_iteration} prompts {min_group} rollouts each")
        self.group = budget // prompts_per_iteration
        self.second_stage_done = False
        self.schedule = self.own_options(kw).schedule
        if self.schedule not in DARS_SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(DARS_SCHEDULES)}, got {self.schedule!r}")
        most = dars_total(0.0, self.group, self.schedule)
        super().__init__(num_prompts, prompts_per_iteration * most, prompts_per_iteration, seed, min_group, **kw)

    def first_stage(self, iteration: int) -> torch.Tensor:
        self.iteration, self.second_stage_done = iteration, False
        prompts = self.choose_prompts(iteration)
        counts = self.counts_for(prompts, torch.full((len(prompts),), self.group))
        self.spent = int(counts.sum())
        return counts

    def next_stage(self, counts, successes, failures):
        extra = torch.zeros(self.num_prompts, dtype=torch.long)
        if self.second_stage_done:  # one second stage only
            return extra
        self.second_stage_done = True
        for i in (counts > 0).nonzero().squeeze(1).tolist():
            n = int(counts[i])  # a group, or several where a small pool drew the prompt more than once
            extra[i] = dars_total(float(successes[i]) / n, self.group, self.schedule) * n // self.group - n
        return self._take(extra)

    def keep(self, prompt_ids: torch.Tensor, success: torch.Tensor) -> torch.Tensor:
        """The reference's filter after both stages: a prompt trains when its samples are neither
        all failures nor all successes (its accuracy strictly between 0 and upper_threshold 1)."""
        kept = torch.zeros(len(prompt_ids), dtype=torch.bool)
        for prompt in torch.unique(prompt_ids).tolist():
            rows = prompt_ids == prompt
            kept[rows] = bool(success[rows].any()) and not bool(success[rows].all())
        return kept


@dataclass
class DARSBudgetOptions:
    first_fraction: float = 0.5  # share of the budget spent in the first, uniform stage
    hard_accuracy: float = 0.5  # prompts below this success rate get top-ups...
    target_positives: int = 2  # ...until they have this many successes
    round_size: int = 4  # rollouts per top-up

    RANGES: ClassVar[dict] = {"first_fraction": "(0, 1]", "hard_accuracy": "(0, 1]", "target_positives": ">= 1", "round_size": ">= 1"}


@ALLOCATORS.register
class DARSBudgetAllocator(Allocator):
    """flowrl's fixed-budget variant of DARS (`dars_budget`; the authors' rule is `dars`): a first
    uniform stage spends `first_fraction` of the budget; later stages give `round_size` more
    rollouts to each prompt whose success rate is below `hard_accuracy` and which has fewer than
    `target_positives` successes, until the budget runs out. Budget left when no prompt is hard
    goes round-robin to all prompts. Every sample trains."""

    name = "dars_budget"
    options = DARSBudgetOptions

    def stage_budget(self) -> int:
        frac = self.opts.first_fraction
        first = max(self.per_iteration * self.min_group, int(round(frac * self.budget)))
        return min(first, self.budget)

    def next_stage(self, counts, successes, failures):
        left = self.remaining
        extra = torch.zeros(self.num_prompts, dtype=torch.long)
        if left <= 0:
            return extra
        sampled = counts > 0
        rate = successes.double() / counts.clamp_min(1).double()
        hard = sampled & (rate < self.opts.hard_accuracy) & (successes < self.opts.target_positives)
        targets = hard.nonzero().squeeze(1) if hard.any() else sampled.nonzero().squeeze(1)
        per = self.opts.round_size
        for i in targets.tolist():
            give = min(per, left)
            extra[i] += give
            left -= give
            if left == 0:
                break
        return self._take(extra)


@dataclass
class SuccessiveEliminationOptions:
    round_size: int = 4  # rollouts per active prompt and round
    cap: int = 0  # most rollouts per prompt (0: 2 x data.group_size)

    RANGES: ClassVar[dict] = {"round_size": ">= 1", "cap": ">= 0"}


@ALLOCATORS.register
class SuccessiveEliminationAllocator(VADEAllocator):
    """flowrl's fixed-budget variant of Reinforce-Ada's successive elimination (the authors' rule
    is `reinforce_ada`): sample every active prompt in rounds of
    `round_size`; a prompt leaves once it has signal (at least one success and one failure) or
    reaches `cap` rollouts. When no prompt is active and budget remains, fresh prompts join.
    Which prompts start and join is VADE's Thompson choice (our combination: Reinforce-Ada
    itself starts from uniformly drawn prompts, which wastes the cap on solved ones)."""

    name = "successive_elimination"
    options = SuccessiveEliminationOptions

    def _join_order(self, counts: torch.Tensor) -> list[int]:
        p = self.stats.thompson(self.generator(self.iteration, salt=1 + int(counts.sum())))
        return [i for i in torch.argsort(p * (1 - p), descending=True, stable=True).tolist() if counts[i] == 0]

    def stage_budget(self) -> int:
        return min(self.budget, self.per_iteration * max(self.min_group, self.opts.round_size))

    def next_stage(self, counts, successes, failures):
        left = self.remaining
        extra = torch.zeros(self.num_prompts, dtype=torch.long)
        if left <= 0:
            return extra
        cap = self.opts.cap or 2 * max(1, self.budget // self.per_iteration)  # budget / prompts: the group size
        per = max(self.min_group, self.opts.round_size)
        active = (counts > 0) & ~((successes > 0) & (failures > 0)) & (counts < cap)
        if active.any():
            for i in active.nonzero().squeeze(1).tolist():
                give = min(per, left, cap - int(counts[i]))
                extra[i], left = give, left - give
                if left == 0:
                    break
            return self._take(extra)
        # every prompt has signal or hit its cap: a fresh cohort joins if the budget affords four
        # rounds each; otherwise what is left goes to prompts that have signal (more samples keep
        # an informative group informative, while a half-sampled fresh prompt would be wasted)
        joining = self._join_order(counts)[: min(self.per_iteration, left // (4 * per))]
        for i in joining:
            extra[i], left = per, left - per
        if left and not joining:  # joiners keep the rest of the budget for their later rounds
            has_signal = ((counts > 0) & (successes > 0) & (failures > 0)).nonzero().squeeze(1).tolist()
            receivers = has_signal or (counts > 0).nonzero().squeeze(1).tolist()
            for j in range(left):
                extra[receivers[j % len(receivers)]] += 1
        return self._take(extra)


@dataclass
class ReinforceAdaOptions:
    round_size: int = 8  # rollouts per prompt and round (the reference's M)
    max_rounds: int = 4  # most rounds (R); a prompt trains on data.group_size of its samples
    exit: str = "balanced"  # a prompt stops at group_size/2 successes and failures | positive: one success

    RANGES: ClassVar[dict] = {"round_size": ">= 1", "max_rounds": ">= 1"}
    CHOICES: ClassVar[dict] = {"exit": ("balanced", "positive")}


@ALLOCATORS.register
class ReinforceAdaAllocator(Allocator):
    """Reinforce-Ada as its authors run it (Xiong et al., arXiv 2510.04996; their multi-round
    adaptive downsampling): the iteration's prompts are drawn uniformly and sampled in rounds of
    `round_size` (M, reference 8). After each round a prompt leaves once it can fill a
    balanced group of n = budget / prompts_per_iteration (data.group_size): at least n // 2
    successes and n - n // 2 failures (`exit` balanced), or one success (`exit`
    positive); the others go on for at most `max_rounds` (R, reference 4) rounds. The
    iteration spends at most prompts x M x R rollouts. Every prompt then trains on n of its
    samples (`keep`): the first n // 2 successes and first failures up to n, a shortfall filled
    from the other side. The baseline is meant to use every sample drawn (advantage.kind
    reinforce_ada); the loss sees only the kept ones."""

    name = "reinforce_ada"
    options = ReinforceAdaOptions
    exact_budget = False
    keeps_all = False

    @classmethod
    def validate(cls, cfg) -> None:
        o = cfg.allocator.reinforce_ada
        if o.round_size * o.max_rounds < cfg.data.group_size:
            raise ConfigError(f"allocator.reinforce_ada.max_rounds ({o.max_rounds}) rounds of allocator.reinforce_ada.round_size "
                              f"({o.round_size}) cannot fill a group of data.group_size ({cfg.data.group_size})")

    def __init__(self, num_prompts: int, budget: int, prompts_per_iteration: int, seed: int = 0, min_group: int = 2, **kw):
        if prompts_per_iteration * min_group > budget:  # the trained groups: group_size each
            raise ValueError(f"a budget of {budget} rollouts cannot give {prompts_per_iteration} prompts {min_group} rollouts each")
        self.group = budget // prompts_per_iteration
        opts = self.own_options(kw)
        self.round_size, self.max_rounds, self.exit_rule = opts.round_size, opts.max_rounds, opts.exit
        if self.exit_rule not in ("balanced", "positive"):
            raise ValueError(f"exit must be balanced or positive, got {self.exit_rule!r}")
        if self.round_size * self.max_rounds < self.group:
            raise ValueError(f"{self.max_rounds} rounds of {self.round_size} cannot fill groups of {self.group}")
        super().__init__(num_prompts, prompts_per_iteration * self.round_size * self.max_rounds, prompts_per_iteration,
                         seed, min(min_group, self.round_size), **kw)

    def first_stage(self, iteration: int) -> torch.Tensor:
        self.iteration = iteration
        prompts = self.choose_prompts(iteration)
        counts = self.counts_for(prompts, torch.full((len(prompts),), self.round_size))
        self.spent = int(counts.sum())
        return counts

    def has_signal(self, successes: torch.Tensor, failures: torch.Tensor) -> torch.Tensor:
        """The exit test after a round, on a prompt's samples so far."""
        if self.exit_rule == "positive":
            return successes >= 1
        return (successes >= self.group // 2) & (failures >= self.group - self.group // 2)

    def next_stage(self, counts, successes, failures):
        rounds = counts // self.round_size
        active = (counts > 0) & ~self.has_signal(successes, failures) & (rounds < self.max_rounds)
        return self._take(active.long() * self.round_size)

    def keep(self, prompt_ids: torch.Tensor, success: torch.Tensor) -> torch.Tensor:
        """The reference's balanced downsampling of each prompt's samples, in the order drawn."""
        n, half = self.group, self.group // 2
        kept = torch.zeros(len(prompt_ids), dtype=torch.bool)
        for prompt in torch.unique(prompt_ids).tolist():
            rows = (prompt_ids == prompt).nonzero().squeeze(1)
            pos, neg = rows[success[rows]], rows[~success[rows]]
            take_pos = min(half, len(pos))
            take_neg = min(n - take_pos, len(neg))
            take_pos += min(n - take_pos - take_neg, len(pos) - take_pos)  # too few failures: more successes
            kept[pos[:take_pos]] = True
            kept[neg[:take_neg]] = True
        return kept


@ALLOCATORS.register
class SqrtAllocator(Allocator):
    """Budget-neutral square-root allocation (Rollout-GDRO): n_i proportional to the square root
    of a variance proxy, here the posterior Bernoulli variance p (1 - p), total conserved."""

    name = "sqrt"

    def first_stage(self, iteration: int) -> torch.Tensor:
        self.iteration, self.spent = iteration, 0
        prompts = self.choose_prompts(iteration)
        m = self.stats.mean()[prompts]
        weights = (m * (1 - m)).clamp_min(1e-4).sqrt()
        counts = self.counts_for(prompts, largest_remainder(weights, self.budget, self.min_group))
        self.spent = int(counts.sum())
        return counts


@dataclass
class PromptGDROOptions:
    bins: int = 4  # pass@k difficulty bins (the unseen prompts form one more)
    window: int = 4  # a prompt's pass@k averages its last this many visits
    step: float = 1.0  # the adversary's multiplicative-weights step
    ema: float = 0.9  # decay of each bin's error average (the debiasing)
    uniform_mix: float = 0.1  # share of the uniform distribution mixed into the bin weights

    RANGES: ClassVar[dict] = {"bins": ">= 1", "window": ">= 1", "step": ">= 0", "ema": "[0, 1)", "uniform_mix": "(0, 1]"}


@ALLOCATORS.register
class PromptGDROAllocator(Allocator):
    """Prompt-GDRO, the data adversary of Multi-Adversary Group DRO (Panaganti et al., arXiv
    2601.19280). There is no public code; the abstract fixes the game and the sampler, the rest
    is flowrl's reading (its constants, the error as the loss, the unseen bin). A prompt's pass@k
    (1 when any of a visit's rollouts succeeded), averaged over its last `window` visits,
    puts it in one of `bins` equal-width difficulty bins, with a hysteresis margin so that a
    prompt near an edge does not flap; prompts never sampled form one more bin. The adversary
    keeps a distribution q over the bins: after each iteration a sampled bin's score is its
    error this iteration (its rollouts' failure rate) minus the EMA of its past errors (the
    debiasing that keeps a large easy bin from dominating), and q_b <- q_b exp(step s_b),
    renormalised, mixed with the uniform distribution (`uniform_mix`). Prompts are drawn
    without replacement with probability q_b / |D_b| (each bin's share is q_b); the budget is
    split evenly."""

    name = "prompt_gdro"
    options = PromptGDROOptions
    margin = 0.05  # hysteresis: a prompt leaves its bin once its pass@k is this far past an edge

    def __init__(self, num_prompts: int, budget: int, prompts_per_iteration: int, seed: int = 0, min_group: int = 2, **kw):
        super().__init__(num_prompts, budget, prompts_per_iteration, seed, min_group, **kw)
        o = self.opts
        self.num_bins, self.step, self.ema_decay, self.mix, self.window = o.bins, o.step, o.ema, o.uniform_mix, o.window
        if self.num_bins < 1 or self.window < 1 or not 0 <= self.mix <= 1:
            raise ValueError("bins and window must be >= 1 and uniform_mix in [0, 1]")
        unseen = self.num_bins
        self.passes = torch.zeros(num_prompts, self.window, dtype=torch.float64)  # the last visits' pass@k, a ring
        self.visits = torch.zeros(num_prompts, dtype=torch.long)
        self.bins = torch.full((num_prompts,), unseen, dtype=torch.long)
        self.q = torch.full((self.num_bins + 1,), 1.0 / (self.num_bins + 1), dtype=torch.float64)
        self.error_ema = torch.full((self.num_bins + 1,), float("nan"), dtype=torch.float64)  # nan: no history yet

    def prompt_weights(self) -> torch.Tensor:
        """Each prompt's probability of being drawn first: q of its bin over the bin's size."""
        sizes = torch.bincount(self.bins, minlength=self.num_bins + 1).double()
        w = self.q[self.bins] / sizes[self.bins]
        return w / w.sum()

    def choose_prompts(self, iteration: int) -> torch.Tensor:
        k, replace = self.per_iteration, self.per_iteration > self.num_prompts
        return torch.multinomial(self.prompt_weights(), k, replacement=replace, generator=self.generator(iteration, salt=2))

    def observe(self, prompt_ids: torch.Tensor, success: torch.Tensor) -> None:
        super().observe(prompt_ids, success)
        ids, won = prompt_ids.long(), success.bool()
        self.update_adversary(self.bins[ids], (~won).double())
        self.update_bins(ids, won)

    def update_adversary(self, sample_bins: torch.Tensor, errors: torch.Tensor) -> None:
        b = self.num_bins + 1
        count = torch.bincount(sample_bins, minlength=b)
        seen = count > 0
        error = torch.bincount(sample_bins, weights=errors, minlength=b) / count.clamp_min(1)
        history = seen & ~self.error_ema.isnan()
        score = torch.where(history, error - self.error_ema, torch.zeros_like(error))
        self.error_ema = torch.where(history, self.ema_decay * self.error_ema + (1 - self.ema_decay) * error,
                                     torch.where(seen, error, self.error_ema))
        q = self.q * torch.exp(self.step * score)
        self.q = (1 - self.mix) * q / q.sum() + self.mix / b

    def update_bins(self, ids: torch.Tensor, won: torch.Tensor) -> None:
        visited = torch.unique(ids)
        passed = torch.bincount(ids, weights=won.double(), minlength=self.num_prompts)[visited] > 0
        self.passes[visited, self.visits[visited] % self.window] = passed.double()
        self.visits[visited] += 1
        filled = self.visits[visited].clamp(max=self.window)
        estimate = self.passes[visited].sum(1) / filled
        target = (estimate * self.num_bins).long().clamp(max=self.num_bins - 1)
        current = self.bins[visited]
        width = 1.0 / self.num_bins
        inside = (estimate >= current * width - self.margin) & (estimate < (current + 1) * width + self.margin)
        self.bins[visited] = torch.where((current < self.num_bins) & inside, current, target)

    def state_dict(self) -> dict[str, torch.Tensor]:
        # a checkpoint holds finite numbers only: the no-history nan travels as a mask beside a 0
        history = ~self.error_ema.isnan()
        return {**super().state_dict(), "passes": self.passes, "visits": self.visits, "bins": self.bins, "q": self.q,
                "error_ema": torch.where(history, self.error_ema, torch.zeros_like(self.error_ema)), "error_history": history}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = ("passes", "visits", "bins", "q", "error_ema", "error_history")
        super().load_state_dict({k: v for k, v in state.items() if k not in own})
        for k in own[:-1]:
            setattr(self, k, state[k].clone())
        if "error_history" in state:
            self.error_ema = torch.where(state["error_history"], self.error_ema, torch.full_like(self.error_ema, float("nan")))


def make_allocator(kind: str, **kwargs) -> Allocator:
    """The allocator registered as `kind`, built with the shared keywords and its own options."""
    return ALLOCATORS.get(kind)(**kwargs)


def allocate_in_stages(alloc: Allocator, iteration: int,
                       sample_stage: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Drive one iteration's allocation stages, the one loop of the image and text rollouts: the
    allocator decides how many samples each prompt gets, `sample_stage(ids, offset)` draws and
    scores samples of the prompt ids [m] (the first being the iteration's sample `offset`) and
    returns whether each sample drawn so far in the iteration succeeded (bool [offset + m], every
    stage in order: a threshold set by the iteration's rewards so far may move), and the allocator
    sees per-prompt successes and failures before the next stage. Returns the total counts [n]
    and each stage's prompt ids."""
    n = alloc.num_prompts
    total = torch.zeros(n, dtype=torch.long)
    stages: list[torch.Tensor] = []
    extra = alloc.first_stage(iteration)
    while int(extra.sum()) > 0:
        ids = torch.repeat_interleave(torch.arange(n), extra)
        won = sample_stage(ids, int(total.sum()))
        total += extra
        stages.append(ids)
        successes = torch.bincount(torch.cat(stages), weights=won.double(), minlength=n).long()
        extra = alloc.next_stage(total, successes, total - successes)
    return total, stages


def spending_by_bucket(prompt_ids: torch.Tensor, groups: torch.Tensor, degenerate: torch.Tensor,
                       buckets: list) -> dict[str, float]:
    """Where an iteration's rollouts went, per difficulty bucket of the pool (`buckets[i]`: prompt
    i's bucket label): `rollouts/B`, the samples drawn of its prompts, and `zero_variance/B`, the
    fraction of its prompts (`groups` [G], with their `degenerate` flags [G]) whose rewards were
    all equal."""
    drawn = [buckets[i] for i in prompt_ids.tolist()]
    grouped = [buckets[i] for i in groups.tolist()]
    row: dict[str, float] = {}
    for b in sorted(set(grouped), key=str):
        row[f"rollouts/{b}"] = sum(x == b for x in drawn)
        dead = [d for d, x in zip(degenerate.tolist(), grouped) if x == b]
        row[f"zero_variance/{b}"] = sum(dead) / len(dead)
    return row


def run_stages(alloc: Allocator, iteration: int, outcome) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`allocate_in_stages` with `outcome(prompt_ids [m]) -> success [m] bool` standing in for
    sampling + reward (simulations, tests). Returns the total counts and each stage's prompt ids."""
    outcomes: list[torch.Tensor] = []

    def sample_stage(ids: torch.Tensor, offset: int) -> torch.Tensor:
        outcomes.append(outcome(ids))
        return torch.cat(outcomes)

    return allocate_in_stages(alloc, iteration, sample_stage)


def successes(total_rewards: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """Pass/fail for an allocator: above `threshold` (allocator.success_threshold), or above the
    mean of the iteration's rewards so far when there is none (continuous rewards)."""
    return total_rewards > (total_rewards.mean() if threshold is None else threshold)
