"""The config's search section (`flowrl sample --search`, `flowrl eval --search`; docs/search.md), and the
methods' names. No torch here: the CLI's parser lists the methods without loading it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


SEARCH_METHOD_NAMES = ("bon", "smc", "dts", "dts_star")  # flowrl.search.run.SEARCH_METHODS, named without importing torch


@dataclass
class SearchConfig:
    """Inference-time search (`flowrl sample --search`, `flowrl eval --search`; docs/search.md): samples of
    the model tilted by exp(lam x reward), found without training. Every method stops at `budget`."""

    method: str = "bon"  # bon (best-of-N) | smc (FK steering) | dts (tree sampling) | dts_star (tree search, greedy)
    budget: int = 0  # network evaluations per prompt, one per sample per step; 0: four samples' worth (4 x num_steps)
    reward: str = ""  # the searched reward, a registered name; "": reward.weights (their weighted channel sum)
    num_steps: int = 0  # denoising steps of one sample; 0: sampling.num_steps
    sampler: str = "flow_grpo"  # the proposal p_theta(x' | x): an SDE of sampling.sampler's list (ode: bon only)
    noise_level: float = 0.7
    lam: float = 10.0  # the tilt: weights and values are exp(lam x reward); 0 samples the base model
    potential: str = "max"  # smc: max | add | diff | rt (docs/algorithms.md section 11)
    resample: str = "every"  # smc: every (after each potential) | adaptive (when the effective sample size < k / 2)
    resample_every: int = 2  # steps between potentials (each scores the particles' predicted x0)
    resampling: str = "systematic"  # systematic | multinomial
    final: str = "best"  # smc: best (the highest-reward particle) | sample (one drawn by the final weights)
    # dts, dts_star: a branch level every `branch_every` steps; a node may have ceil(width_c x visits^width_alpha) children
    branch_every: int = 2
    width_c: float = 1.0
    width_alpha: float = 0.5
    uct_c: float = 0.1  # dts_star: the UCT exploration weight, in reward units
    backup: str = "soft"  # soft ((1/lam) log mean exp(lam v)) | max
    in_flight: int = 2  # iterations per tree rolled out together (prompts searched together share batches too)

    RANGES: ClassVar[dict] = {"budget": ">= 0", "num_steps": ">= 0", "noise_level": "> 0", "lam": ">= 0", "resample_every": ">= 1",
                              "branch_every": ">= 1", "width_c": "> 0", "width_alpha": ">= 0", "uct_c": ">= 0", "in_flight": ">= 1"}
