"""Typed config tree: dataclasses, loaded from YAML with dot-list overrides (OmegaConf).

`load_config(path, overrides)` returns a validated `Config`; any unknown key, wrong type or
impossible value raises `ConfigError` with one sentence naming the key and what is allowed.
"""

from __future__ import annotations

import math
import os
import re
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from flowrl.core.advantages import ADVANTAGE_KINDS
from flowrl.core.allocation import ALLOCATOR_KINDS
from flowrl.core.selection import SELECTION_KINDS
from flowrl.devices import DTYPES
from flowrl.errors import ConfigError, check_choice, check_range
from flowrl.presets import CONFIG_DIR, DEFAULT_PRESET, preset_names
from flowrl.models.base import BUILTIN_MODELS, BUILTIN_PREFIX, SCHEDULES, resolve_schedule
from flowrl.models.compile import COMPILE_MODES
from flowrl.sampling.precision import HIGH_PRECISION_LAYERS
from flowrl.sampling.schedules import WINDOW_ENDS, WINDOW_STRATEGIES, shifted_sigmas
from flowrl.sampling.steps import CPS_LOGPROBS, LOGPROB_REDUCTIONS, SAMPLERS
from flowrl.train.sharding import DISTRIBUTED

MODEL_KINDS = ("sd3", "flux")
TRACKERS = ("tensorboard", "wandb", "none")
MIXED_PRECISION = ("no", "bf16", "fp16", "auto")
LR_SCHEDULES = ("constant", "cosine", "linear")
REPLACED_MAPPINGS = ("reward.weights", "reward.channel_weights")
# keys that moved: the old name is refused with a sentence naming the new one
MOVED_KEYS = {"trainer.objective": "objective.kind", "trainer.clip_range": "objective.grpo.clip_range",
              "trainer.clip_range_high": "objective.grpo.clip_range_high",
              **{f"trainer.nft_{k}": f"objective.nft.{k}" for k in ("timesteps", "beta", "sigma_shift", "old_policy", "old_decay",
                                                                   "old_decay_rate", "adaptive_weight", "negatives", "r_scale",
                                                                   "guidance_scale")}}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class ModelConfig:
    kind: str = "sd3"
    path: str = "builtin:tiny-sd3"  # hub id, local pipeline directory, or builtin:NAME
    dtype: str = "fp32"
    height: int = 64
    width: int = 64
    guidance_scale: float = 4.5  # SD3: classifier-free guidance; FLUX.1-dev: guidance embedding
    max_sequence_length: int = 128
    gradient_checkpointing: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # torch.compile of the transformer, for rollouts and training forwards: none (eager) | blocks (each
    # transformer block compiled, regional compilation) | full (the whole transformer). Compiled forwards
    # run on exactly sampling.batch_size rows, a short batch padded, so nothing recompiles after warm-up
    compile: str = "none"


@dataclass
class LoraConfig:
    enabled: bool = True
    rank: int = 32
    alpha: int = 64
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    # [low, high]: the adapter acts only where low < sigma <= high, the base network elsewhere. With an
    # SDE window, updates driven by the window's steps then cannot change the untrained steps
    # (BENCHMARKS.md, "collateral damage"); [0, 1]: everywhere
    sigma_range: list[float] = field(default_factory=lambda: [0.0, 1.0])


@dataclass
class WindowConfig:
    """The SDE window (docs/algorithms.md section 1): only its steps are stochastic and trained.
    progressive is MixGRPO's sliding window; the defaults are its reference's (size 4, a shift of
    one step every 25 iterations, roll back at the end)."""

    strategy: str = "all"  # all | fixed | random | progressive
    size: int = 4  # steps in the window (MixGRPO: 4)
    start: int = 0  # fixed: the first step; progressive: where the window starts and rolls back to
    shift_every: int = 25  # progressive: iterations per shift (MixGRPO: 25, MixGRPO-Flash: 20)
    stride: int = 1  # progressive: steps per shift (MixGRPO: 1; 0 freezes the window, MixGRPO-Flash*)
    # progressive, at the end of the schedule: roll_back (MixGRPO's: windows stop short of the last two steps
    # and the start rolls back to `start` once it passes them) | clamp (flowrl's earlier rule: the window
    # stops on the last `size` steps, those two included, and stays there)
    at_end: str = "roll_back"


@dataclass
class SamplingConfig:
    sampler: str = "flow_grpo"
    noise_level: float = 0.7
    num_steps: int = 10
    eval_num_steps: int = 20  # ODE steps for sample grids, `flowrl sample` and `flowrl eval`
    # the sigma grid: pipeline (the loaded diffusers pipeline's own, FLUX's dynamic shifting included) |
    # shifted_linear (time_shift(linspace(1, 0, T + 1), shift): DanceGRPO's, BranchGRPO's) | auto:
    # shifted_linear for builtin:* models, pipeline for the rest
    schedule: str = "auto"
    shift: float = 3.0  # shifted_linear only
    window: WindowConfig = field(default_factory=WindowConfig)
    logprob_reduction: str = "mean"  # mean (Flow-GRPO's reference) | sum (exact density)
    # cps: exact (the Gaussian log-density) | reference (Flow-GRPO's CPS code: -mean((x' - mean)^2), no
    # 1 / (2 std^2): ratios of the exact density move exp(1 / (2 std^2)) times as far, so its clip ranges
    # do not carry over)
    cps_logprob: str = "exact"
    batch_size: int = 8  # samples per forward, while sampling and while training


@dataclass
class TreeConfig:
    """BranchGRPO trees (rollout.kind: tree; docs/algorithms.md section 3). One tree per prompt;
    leaves per prompt = the product of the branching factors, and must equal data.group_size.
    Depth d is the segment after the d-th split: the edges at steps split_steps[d-1] ..
    split_steps[d]-1 (to the end for the last) lead to depth-d nodes. Pruning masks gradient
    only; the rollout is the same."""

    split_steps: list[int] = field(default_factory=lambda: [0, 3, 6, 9])
    branching: list[int] = field(default_factory=lambda: [2])  # one factor for all splits, or one per split
    # sde: every step stochastic and trained (BranchGRPO) | ode: only the split steps |
    # window: BranchGRPO-Mix, SDE inside sampling.window (and at the splits), ODE elsewhere
    between: str = "sde"
    fusion: str = "mean"  # mean (of the leaves below) | prob (children weighted by softmax of sibling edge log-probs)
    width_keep: float = 1.0  # per tree, train only this fraction of last-depth edges, the largest |A| first
    prune_depths: list[int] = field(default_factory=list)  # depths (1..D) whose edges are never trained
    depth_window: int = 0  # > 0: train only this many consecutive depths, from depth 1 sliding deeper
    depth_window_shift_every: int = 10  # iterations per one-depth shift of depth_window


@dataclass
class TwoStageConfig:
    """Sol-RL, "FP4 explore, BF16 train" (rollout.kind: two_stage; docs/algorithms.md section 5).
    Stage 1 samples `candidates` chains per prompt from recorded seeds with a copy of the
    current policy in `explore_precision` (LoRA merged in, re-synchronised every iteration) and
    scores them; `selection.kind` picks data.group_size of them per prompt; stage 2 regenerates
    exactly those seeds (initial and per-step noise) with the training policy, and only the
    regenerated samples are trained on."""

    candidates: int = 32  # M per prompt, >= data.group_size (the K that are selected and trained)
    explore_precision: str = "nvfp4"  # nvfp4 | fp8 | bf16 | fp16 | fp32
    # auto: torchao's kernels where the GPU has them (NVFP4: sm100+, FP8: sm89+), fake quantisation
    # elsewhere | emulated: always fake quantisation | torchao: the kernels or an error
    backend: str = "auto"
    # linear layers whose name contains one of these stay unquantised (default: embeddings and output
    # layers; add "norm" for the adaLN modulation linears inside the norm modules)
    high_precision_layers: list[str] = field(default_factory=lambda: list(HIGH_PRECISION_LAYERS))
    preview_steps: int = 0  # 0: stage 1 runs the training sampler | P > 0: a P-step ODE preview
    # false: train on the selected candidates themselves; only allowed when they already are
    # training-precision samples of the training sampler (explore_precision = model.dtype, no preview),
    # or with objective.kind nft, which flow-matches clean samples and takes no log-prob of them
    regenerate: bool = True
    fidelity_every: int = 10  # iterations between regenerating the whole pool to log reward rank correlations (0: never)


@dataclass
class GranularConfig:
    """G2RPO (rollout.kind: granular; docs/algorithms.md section 12): per prompt one ODE anchor, at
    each branch step data.group_size one-step SDE branches from it, each finished by ODE tails at
    every granularity; advantages normalised per (prompt, branch step, granularity, channel) and
    summed. Only the branch transitions are trained."""

    branch_steps: list[int] = field(default_factory=list)  # empty: the first half of sampling.num_steps
    granularities: list[int] = field(default_factory=lambda: [1, 2])  # ODE tail strides (the paper reports [1, 2, 3])
    # the tails' sigma indices from a branch at step k: reference (the reference's: k + 1, k + 2, then every g-th
    # from k + 2) | from_branch (flowrl's earlier grid: every g-th from k + 1)
    tail_grid: str = "reference"
    # a tail whose stride misses sigma 0: zero (flowrl's fix: one more, shorter step to sigma 0) | x0_prediction
    # (the reference's: its image is the x0-prediction from the index before the stride's last, often sigma ~0.4)
    tail_end: str = "zero"
    clip: float = 5.0  # the multi-granularity advantage is clipped to +-clip after the sum
    # true: one optimizer step per branch step, as the reference | false: one per iteration (each branch
    # step's mean loss weighing 1 / |M|, as one version of the reference's two-reward script)
    step_per_branch: bool = True
    # the order the branch steps are trained in: increasing (the reference's) | shuffled (per inner epoch, flowrl's earlier order)
    step_order: str = "increasing"


@dataclass
class RolloutConfig:
    # flat: G independent chains per prompt | tree: BranchGRPO trees (rollout.tree) |
    # two_stage: low-precision exploration, selection, regeneration (rollout.two_stage) |
    # granular: G2RPO's singular branches with multi-granularity tails (rollout.granular)
    kind: str = "flat"
    tree: TreeConfig = field(default_factory=TreeConfig)
    two_stage: TwoStageConfig = field(default_factory=TwoStageConfig)
    granular: GranularConfig = field(default_factory=GranularConfig)

    def splits(self) -> dict[int, int]:
        """split step -> branching factor."""
        b = self.tree.branching
        factors = b if len(b) == len(self.tree.split_steps) else [b[0]] * len(self.tree.split_steps)
        return dict(zip(self.tree.split_steps, factors))


@dataclass
class DataConfig:
    prompts: list[str] = field(default_factory=list)
    prompt_file: Optional[str] = None  # one prompt per line; used when `prompts` is empty
    prompts_per_iteration: int = 2
    group_size: int = 8
    eval_prompts: list[str] = field(default_factory=list)  # sample grids; defaults to the first 4 prompts
    offline: Optional[str] = None  # rollout.kind offline: a group store directory (`flowrl offline build`)


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"jpeg_compressibility": 1.0})
    batch_size: int = 32
    # per reward: model path / hub id, device, dtype, batch_size, kind, url, ... (see rewards/options.py)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    on_invalid: str = "error"  # error: stop on NaN / inf / wrong shape | drop: mark those samples invalid
    # per channel ("shapes/partial": 0.5): replaces the reward's weight for that channel only
    channel_weights: dict[str, float] = field(default_factory=dict)
    # an auxiliary judge for GDRO's corrected score in `flowrl eval` (r * (u - 3) + 0.2, u the judge's
    # score mapped from judge_range onto [1, 5]); never trained on. Options under reward.options.NAME.
    judge: Optional[str] = None
    judge_range: list[float] = field(default_factory=lambda: [0.0, 1.0])


@dataclass
class AdvantageConfig:
    kind: str = "grpo"  # grpo | mc_grpo | gdpo | rank | reinforce_ada
    std: str = "group"  # group | global
    eps: float = 1e-4
    clip: float = 5.0  # |A| <= clip (Flow-GRPO: 5)


@dataclass
class AllocatorConfig:
    """Which prompts get how many of the data.prompts_per_iteration x data.group_size rollouts."""

    kind: str = "uniform"  # uniform | vade | xrpo | dars | successive_elimination | sqrt
    # a rollout "succeeds" when its weighted reward exceeds this; unset: when it exceeds the mean
    # reward of the iteration so far (continuous rewards have no natural pass/fail)
    success_threshold: Optional[float] = None
    min_group: int = 2
    prior_a: float = 1.0  # Beta prior of every prompt's success probability
    prior_b: float = 1.0
    fast_decay: float = 0.5  # VADE's two forgetting scales, applied each time a prompt is sampled
    slow_decay: float = 0.95
    first_fraction: float = 0.5  # dars: share of the budget spent in the first, uniform stage
    hard_accuracy: float = 0.5  # dars: prompts below this success rate get top-ups
    target_positives: int = 2  # dars: ...until they have this many successes
    round_size: int = 4  # successive_elimination (and dars top-up size)
    cap: int = 0  # successive_elimination: most rollouts per prompt (0: 2 x group_size)

    def build(self, num_prompts: int, prompts_per_iteration: int, group_size: int, seed: int):
        """The allocator these settings describe (flowrl/core/allocation.py) over a pool of
        `num_prompts`, spending prompts_per_iteration x group_size rollouts an iteration."""
        from flowrl.core.allocation import make_allocator

        return make_allocator(
            self.kind, num_prompts=num_prompts, budget=prompts_per_iteration * group_size,
            prompts_per_iteration=prompts_per_iteration, seed=seed, min_group=self.min_group, prior_a=self.prior_a,
            prior_b=self.prior_b, fast_decay=self.fast_decay, slow_decay=self.slow_decay, first_fraction=self.first_fraction,
            hard_accuracy=self.hard_accuracy, target_positives=self.target_positives, round_size=self.round_size,
            cap=self.cap or 2 * group_size)


@dataclass
class SelectionConfig:
    """Candidate selection (used by two-stage exploration): best_worst | max_variance | mean_deviation | random."""

    kind: str = "best_worst"


@dataclass
class GRPOConfig:
    """objective.kind grpo: the PPO-clipped surrogate over the SDE steps' log-probs (Flow-GRPO)."""

    clip_range: float = 1e-4  # PPO ratio clip (Flow-GRPO: 1e-4)
    clip_range_high: Optional[float] = None  # defaults to clip_range


@dataclass
class NFTConfig:
    """objective.kind nft: DiffusionNFT's negative-aware flow matching on the clean samples (any
    sampler, ode too; docs/algorithms.md section 4). The defaults are the reference code's
    (NVlabs/DiffusionNFT, scripts/train_nft_sd3.py); each other value is a named flowrl variant."""

    # grid: each sample trains at its own random permutation of the sampling grid's sigmas, the first
    # `timesteps` of it (the reference); stratified (flowrl variant): `timesteps` sigmas per batch, one per
    # stratum of lora.sigma_range, shared by the batch's samples
    sigma_draw: str = "grid"
    # sigmas trained per sample and iteration; 0: int(0.99 x sampling.num_steps), the reference's
    # timestep_fraction 0.99 (9 of 10 steps; with sigma_draw stratified, 0 means 2)
    timesteps: int = 0
    beta: float = 1.0  # the implicit policies' step, v_old +- beta (v - v_old)
    # sigma_draw stratified: time shift of its sigmas (1: uniform strata over lora.sigma_range)
    sigma_shift: float = 1.0
    # v_old is "sampling" (the weights that sampled the iteration, fixed through its steps, then soft-updated:
    # old <- d old + (1 - d) new with d = min(old_decay, old_decay_rate x iteration): the reference's "old"
    # adapter and decay type 1) or "current" (flowrl variant: the weights before each optimizer step)
    old_policy: str = "sampling"
    old_decay: float = 0.5
    old_decay_rate: float = 0.001
    adaptive_weight: bool = True  # the reference's per-sample normalisation of the x0-prediction error
    # false keeps the positive half of the loss only (reward-weighted flow matching on the better-than-group
    # samples, no push away from the worse ones)
    negatives: bool = True
    # adv_clip (the reference): r = 0.5 + 0.5 A / advantage.clip and the loss times advantage.clip / beta, so
    # the gradient at v = v_old is A times plain flow matching's; clip (flowrl variant, the paper's text):
    # r = 0.5 + 0.5 clip(A, -1, 1), loss unscaled; group_max (flowrl variant): A scaled per group by
    # max(1, max |A|), loss unscaled (each group's pulls and pushes still cancel, sum (2r - 1) = 0)
    r_scale: str = "adv_clip"
    # the guidance of the velocity the loss trains (and of v_old and the KL reference): 1, the conditional
    # velocity alone (the reference trains and samples without CFG); None: model.guidance_scale
    guidance_scale: Optional[float] = 1.0


@dataclass
class DGPOConfig:
    """objective.kind dgpo: group preference through the implicit reward, on online clean samples
    (docs/algorithms.md section 10). The defaults are the reference code's (Luo-Yihong/DGPO,
    GenEval/OCR settings); squared errors are means over dimensions, as there."""

    beta: float = 100.0  # the implicit reward's scale, s = -beta (err_theta - err_ref) (DGPO's code: 100)
    # reference: back-propagate mean_i sigmoid((beta / G) sum A delta).detach() A_i err_i, as DGPO's code;
    # log_sigmoid (flowrl variant): the paper's -log sigmoid(-(beta / G) sum A delta), whose gradient is beta
    # times larger (trainer.kl_beta and the gradient clip then weigh beta times less)
    loss_form: str = "reference"
    timesteps: int = 4  # distinct training sigmas per epoch, shared by every micro-batch (DGPO: 4)
    # grid: draw them from the first grid_points sigmas of the rollout's own sampling grid (DGPO: 5 GenEval,
    # 7 OCR); stratified (flowrl variant): one per stratum of sigma_range, crowded by sigma_shift
    sigma_draw: str = "grid"
    grid_points: int = 5
    sigma_range: list[float] = field(default_factory=lambda: [0.5, 1.0])  # sigma_draw stratified: the range
    sigma_shift: float = 1.0  # sigma_draw stratified: > 1 crowds the sigmas toward the noisy end
    # optimizer step every this many sigmas of a micro-batch (DGPO's code accumulates 2 (batch, sigma) pairs
    # per step on its 4-GPU settings); 0: one step per micro-batch over all its sigmas
    sigmas_per_step: int = 2
    # > 0: a sample whose error ratio exp(err_old - err) has left [1 - c, 1 + c] in its advantage's direction
    # stops pulling (DGPO's code: 0.01 GenEval and OCR); 0: off
    clip_range: float = 0.01
    # the "old" weights of the clip: ema (DGPO's code: an average of the weights updated after every optimizer
    # step with decay min(0.3, 0.001 x steps)) or sampling (flowrl variant: the weights that sampled the iteration)
    clip_old: str = "ema"
    # after this many optimizer steps the rollouts sample with the ema weights (DGPO's switch_ema_ref: 500
    # GenEval, 200 OCR); 0: always the current weights. Needs clip_old ema.
    sample_with_old_after: int = 500
    # the trained velocity's guidance: 1, the conditional velocity alone (DGPO's code); > 1 or null
    # (model.guidance_scale) trains the CFG-combined velocity through both branches (flowrl variant)
    guidance_scale: Optional[float] = 1.0


@dataclass
class GDROConfig:
    """objective.kind gdro: listwise group loss on the implicit reward, offline from a group store
    (data.offline) or online from clean samples (docs/algorithms.md section 10)."""

    form: str = "top1"  # top1 | plackett_luce
    tau: float = 0.05  # temperature of the reward's soft ranking softmax(r / tau) (GDRO: 0.05)
    # s = -beta (err_theta - err_ref) (GDRO: 6 GenEval, 12 OCR) with squared errors summed over dimensions
    # (error_reduction sum: the paper's ||.||^2) or averaged (mean, a flowrl variant: beta is then D times weaker)
    beta: float = 6.0
    error_reduction: str = "sum"
    gamma: float = 1.0  # weight of plain flow matching (a mean over dimensions) on each group's best sample
    timesteps: int = 2  # sigmas per micro-batch and epoch, shared by its samples
    sigma_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    sigma_shift: float = 1.0
    guidance_scale: Optional[float] = None


@dataclass
class ObjectiveConfig:
    """What the loop optimises (flowrl/train/objectives): kind picks a registered objective; each
    built-in one has its options under its own name."""

    kind: str = "grpo"  # grpo | nft | dgpo | gdro, or any registered objective
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    dgpo: DGPOConfig = field(default_factory=DGPOConfig)
    gdro: GDROConfig = field(default_factory=GDROConfig)


@dataclass
class TrainerConfig:
    # the iteration count, and the length every iteration-based schedule is written for
    iterations: int = 40
    # > 0: time the first budget_probe iterations, then plan the count (at most trainer.iterations) that fits
    # this many minutes from the trainer's start, again at every checkpoint from the speed measured so far, with
    # the schedules fitted onto it (flowrl/train/budget.py, plan.json)
    budget_minutes: float = 0.0
    budget_probe: int = 5
    max_minutes: float = 0.0  # > 0: also stop (with samples and a checkpoint) after this much wall time
    lr: float = 3e-4
    # constant, or decayed to 0 over the run's iterations (cosine or linear), set at each iteration's start;
    # resuming with more iterations stretches the rest of the curve, and a max_minutes stop cuts it short
    lr_schedule: str = "constant"
    warmup_iterations: int = 0  # the learning rate rises linearly to trainer.lr over this many iterations (times lr_schedule)
    weight_decay: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    inner_epochs: int = 1
    gradient_accumulation_steps: int = 1  # sample batches per optimizer step
    kl_beta: float = 0.04  # grpo: x the exact Gaussian KL per step; nft: x the mean squared velocity gap to the reference
    max_grad_norm: float = 1.0
    # an optimizer step whose gradient norm is NaN or inf is skipped (counted in skipped_steps); this many in a row stop the run
    max_skipped_steps: int = 3
    ema: bool = True
    ema_decay: float = 0.9
    seed: int = 0
    mixed_precision: str = "no"  # accelerate autocast: no | bf16 | fp16 | auto (bf16 where the device computes it natively)

    def __post_init__(self):
        if self.mixed_precision == "False":  # YAML reads a bare `no` (accelerate's word) as false
            self.mixed_precision = "no"


@dataclass
class RunConfig:
    output_dir: str = "runs"
    name: Optional[str] = None  # default: a timestamp
    tracker: str = "tensorboard"
    sample_every: int = 10  # iterations between sample grids (0: never)
    checkpoint_every: int = 10  # iterations between checkpoints (0: only at the end)
    # minutes on the budget's clock (from the trainer's start) at which a checkpoint is written too: the first
    # iteration to end past a mark writes one, and its metrics row names the mark (checkpoint_at_minutes)
    checkpoint_at_minutes: list[float] = field(default_factory=list)
    progress: bool = True
    # a CPU run with N > 1 relaunches itself as N processes (accelerate launch --cpu) that split
    # each iteration's rollouts and the cores: for small models one process per core beats threads
    cpu_processes: int = 1
    # how the trained network is laid out over processes (docs/distributed.md): ddp (whole on every process,
    # gradients all-reduced) | fsdp2 (weights, gradients, optimizer state and EMA sharded per transformer block)
    distributed: str = "ddp"


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


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    search: SearchConfig = field(default_factory=SearchConfig)

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self))


def _one_sentence(exc: OmegaConfBaseException, source: str, schema: type = None) -> str:
    schema = schema or Config
    key = getattr(exc, "full_key", None) or "?"
    msg = str(getattr(exc, "msg", exc)).splitlines()[0].strip()
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        node = OmegaConf.structured(schema)
        allowed = OmegaConf.select(node, parent) if parent else node
        names = ", ".join(allowed.keys()) if hasattr(allowed, "keys") else "?"
        return f"unknown config key '{key}' in {source}; allowed keys{' under ' + repr(parent) if parent else ''}: {names}"
    if isinstance(exc, ValidationError):
        value = msg.split("'", 2)[1] if msg.count("'") >= 2 else msg
        expected = type_name_of(key, schema)
        return f"config key '{key}' in {source} must be {expected}, got {value!r}"
    return f"invalid config in {source}: {key}: {msg}"


def type_name_of(key: str, schema: type = None) -> str:
    node: Any = (schema or Config)()
    for part in key.split("."):
        if not hasattr(node, part):
            return "a valid value"
        node = getattr(node, part)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}
    return names.get(type(node), "a valid value")


def preset_path(name_or_path: str | None) -> Path:
    """A config argument is a YAML path or the name of a preset in configs/."""
    if name_or_path is None:
        name_or_path = DEFAULT_PRESET
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"config file '{name_or_path}' does not exist; give a YAML path or a preset name from {CONFIG_DIR}")
        return p
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        names = ", ".join(preset_names())
        raise ConfigError(f"config '{name_or_path}' is neither a YAML file nor a preset; presets: {names}")
    return candidate


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None, validate_paths: bool = True) -> Config:
    """Load a preset or YAML file, apply `key=value` overrides, validate, return a `Config`."""
    src = preset_path(str(path) if path is not None else None)
    loaded = read_yaml(src)
    _refuse_moved_keys([k for k in MOVED_KEYS if OmegaConf.select(loaded, k, default=None) is not None], str(src))
    for item in overrides or []:
        key = item.partition("=")[0]
        _refuse_moved_keys([key] if key in MOVED_KEYS else [], "the command line")
    cfg: Config = merge_config(Config, loaded, str(src), overrides, REPLACED_MAPPINGS)
    validate(cfg, validate_paths=validate_paths)
    return cfg


def read_yaml(src: Path) -> DictConfig:
    try:
        loaded = OmegaConf.load(src)
    except Exception as exc:  # YAML syntax errors
        raise ConfigError(f"config file '{src}' is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file '{src}' must hold a mapping of sections (model:, trainer:, ...) at its top level, "
                          f"not a {type(loaded).__name__.removesuffix('Config').lower() or 'value'}")
    return loaded


def merge_config(schema: type, loaded: DictConfig, source: str, overrides: list[str] | None, replaced_mappings=()) -> Any:
    """`loaded` (a YAML file's mapping) over the dataclass `schema`'s defaults, then `key=value`
    overrides; any mistake is one sentence naming the key."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), loaded)
        # a mapping given in the file replaces the default instead of adding to it
        for key in replaced_mappings:
            given = OmegaConf.select(loaded, key, default=None)
            if given is not None:
                OmegaConf.update(merged, key, given, merge=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_sentence(exc, source, schema)) from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must have the form key=value, for example trainer.lr=1e-5")
        key, _, raw = item.partition("=")
        try:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]
            # an override replaces the value, mappings included (reward.weights={brightness: 1.0})
            OmegaConf.update(merged, key, value, merge=False, force_add=False)
        except OmegaConfBaseException as exc:
            raise ConfigError(_one_sentence(exc, "the command line", schema)) from None
    return OmegaConf.to_object(merged)


def _refuse_moved_keys(keys: list[str], source: str) -> None:
    if keys:
        raise ConfigError(f"config key '{keys[0]}' in {source} has moved to '{MOVED_KEYS[keys[0]]}'; rename it")


def config_from_dict(data: dict, validate_paths: bool = True) -> Config:
    _refuse_moved_keys([k for k in MOVED_KEYS if OmegaConf.select(OmegaConf.create(data), k, default=None) is not None], "the given config")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(data))
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_sentence(exc, "the given config")) from None
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    validate(cfg, validate_paths=validate_paths)
    return cfg


def check_model_path(path: str) -> None:
    """A model path is builtin:NAME, an existing local directory, or a hub id (org/name)."""
    if not path:
        raise ConfigError("model.path is empty; give a hub id (org/name), a local pipeline directory, or builtin:tiny-sd3")
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_MODELS:
            raise ConfigError(f"model.path '{path}' names no built-in model; built-ins: {', '.join(BUILTIN_PREFIX + b for b in BUILTIN_MODELS)}")
        return
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "model_index.json").is_file():
            raise ConfigError(f"model.path '{path}' is a directory without model_index.json; give a diffusers pipeline directory")
        return
    if path.startswith((".", "/", "~")) or not _HUB_ID.match(path):
        raise ConfigError(f"model.path '{path}' does not exist; give an existing pipeline directory, a hub id (org/name), or a built-in "
                          f"({', '.join(BUILTIN_PREFIX + b for b in BUILTIN_MODELS)})")


def _validate_sigma_range(cfg: Config) -> None:
    """A restricted adapter must act at every step that is trained, or those steps carry no gradient."""
    r = cfg.lora.sigma_range
    if len(r) != 2 or not 0.0 <= r[0] < r[1] <= 1.0:
        raise ConfigError(f"lora.sigma_range must be [low, high] with 0 <= low < high <= 1; got {list(r)}")
    if list(r) == [0.0, 1.0]:
        return
    if not cfg.lora.enabled:
        raise ConfigError("lora.sigma_range restricts the adapter, so it needs lora.enabled=true")
    from flowrl.train.experience import SAMPLES
    from flowrl.train.registry import objective_class

    if objective_class(cfg.objective.kind).needs == SAMPLES:
        return  # flow-matching objectives draw their training sigmas inside the range (flowrl/train/objectives/nft.py)
    s, w = cfg.sampling, cfg.sampling.window
    if cfg.rollout.kind != "flat" or w.strategy != "fixed":
        raise ConfigError(f"lora.sigma_range other than [0, 1] needs rollout.kind flat and sampling.window.strategy fixed "
                          f"(a fixed set of trained steps); got rollout.kind '{cfg.rollout.kind}', window '{w.strategy}'")
    if resolve_schedule(s.schedule, cfg.model.path) == "shifted_linear":  # the pipeline's grid is checked once it is loaded
        from flowrl.train.rollouts.common import check_trained_sigmas

        check_trained_sigmas(cfg, shifted_sigmas(s.num_steps, s.shift))



# The range of every numeric field with one, declared once: "> 0", ">= 2", "[0, 1)", "(0, 1]", and
# optionally why. `check_numbers` checks them all, and that every float anywhere in the config (lists
# and mappings too) is finite. A part's own section (objective.nft, rollout.tree, ...) is checked by
# the part's validate.
RANGES: dict[str, str | tuple[str, str]] = {
    "model.guidance_scale": "> 0",
    "model.max_sequence_length": ">= 0",
    "lora.rank": ">= 1",
    "lora.alpha": "> 0",
    "sampling.noise_level": "> 0",
    "sampling.num_steps": ">= 2",
    "sampling.eval_num_steps": ">= 1",
    "sampling.shift": "> 0",
    "sampling.batch_size": ">= 1",
    "sampling.window.shift_every": ">= 1",
    "sampling.window.stride": ">= 0",
    "data.group_size": (">= 2", "GRPO compares samples within a group"),
    "data.prompts_per_iteration": ">= 1",
    "reward.batch_size": ">= 1",
    "advantage.eps": "> 0",
    "advantage.clip": "> 0",
    "allocator.min_group": (">= 2", "a group of one has no baseline"),
    "allocator.prior_a": "> 0",
    "allocator.prior_b": "> 0",
    "allocator.fast_decay": "(0, 1]",
    "allocator.slow_decay": "(0, 1]",
    "allocator.first_fraction": "(0, 1]",
    "allocator.hard_accuracy": "(0, 1]",
    "allocator.target_positives": ">= 1",
    "allocator.round_size": ">= 1",
    "allocator.cap": ">= 0",
    "trainer.iterations": ">= 1",
    "trainer.budget_minutes": ">= 0",
    "trainer.budget_probe": ">= 1",
    "trainer.max_minutes": ">= 0",
    "trainer.lr": "> 0",
    "trainer.weight_decay": ">= 0",
    "trainer.adam_beta1": "[0, 1)",
    "trainer.adam_beta2": "[0, 1)",
    "trainer.adam_eps": "> 0",
    "trainer.inner_epochs": ">= 1",
    "trainer.gradient_accumulation_steps": ">= 1",
    "trainer.kl_beta": ">= 0",
    "trainer.max_grad_norm": "> 0",
    "trainer.max_skipped_steps": ">= 1",
    "trainer.warmup_iterations": ">= 0",
    "trainer.ema_decay": "[0, 1)",
    "run.sample_every": ">= 0",
    "run.checkpoint_every": ">= 0",
    "run.cpu_processes": ">= 1",
    "rollout.granular.clip": "> 0",
    "search.budget": ">= 0",
    "search.num_steps": ">= 0",
    "search.noise_level": "> 0",
    "search.lam": ">= 0",
    "search.resample_every": ">= 1",
    "search.branch_every": ">= 1",
    "search.width_c": "> 0",
    "search.width_alpha": ">= 0",
    "search.uct_c": ">= 0",
    "search.in_flight": ">= 1",
}
def _floats(node, key: str = ""):
    """(dotted key, value) of every float in the config: fields, list items and mapping values."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from _floats(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _floats(v, f"{key}.{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _floats(v, f"{key}[{i}]")
    elif isinstance(node, float):
        yield key, node


def check_numbers(cfg: Config) -> None:
    """Every float finite, every field of RANGES in its range: one sentence naming the first that is not."""
    for key, value in _floats(cfg):
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number; got {value}")
    for key, spec in RANGES.items():
        spec, why = (spec, "") if isinstance(spec, str) else spec
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        check_range(key, value, spec, why)


def _validate_search(cfg: Config) -> None:
    from flowrl.core.search import BACKUPS, POTENTIALS, RESAMPLINGS
    from flowrl.search import SEARCH_METHODS

    q = cfg.search
    check_choice("search.method", q.method, tuple(SEARCH_METHODS))
    check_choice("search.sampler", q.sampler, SAMPLERS)
    if q.sampler == "ode" and q.method != "bon":
        raise ConfigError(f"search.sampler=ode draws no noise after the first step, so {q.method} has nothing to choose among; "
                          "use an SDE sampler (flow_grpo, dance_grpo, cps) or search.method=bon")
    check_choice("search.potential", q.potential, POTENTIALS)
    check_choice("search.resample", q.resample, ("adaptive", "every"))
    check_choice("search.resampling", q.resampling, RESAMPLINGS)
    check_choice("search.final", q.final, ("best", "sample"))
    check_choice("search.backup", q.backup, BACKUPS)
    if q.num_steps == 1:
        raise ConfigError("search.num_steps must be 0 (sampling.num_steps) or at least 2; got 1")
    steps = q.num_steps or cfg.sampling.num_steps
    if 0 < q.budget < steps:
        raise ConfigError(f"search.budget must be at least one sample's worth ({steps} network evaluations, one per step); got {q.budget}")
    if q.reward:
        from rewards import available_rewards

        check_choice("search.reward", q.reward, tuple(available_rewards()))


def validate(cfg: Config, validate_paths: bool = True) -> None:
    m, s, d, t = cfg.model, cfg.sampling, cfg.data, cfg.trainer
    check_numbers(cfg)
    check_choice("model.kind", m.kind, MODEL_KINDS)
    check_choice("model.dtype", m.dtype, DTYPES)
    check_choice("model.compile", m.compile, COMPILE_MODES)
    if validate_paths:
        check_model_path(m.path)
    for key in ("height", "width"):
        value = getattr(m, key)
        if value <= 0 or value % 16:
            raise ConfigError(f"model.{key} must be a positive multiple of 16; got {value}")
    if cfg.lora.enabled and not cfg.lora.target_modules:
        raise ConfigError("lora.target_modules is empty; name at least one module, for example to_q")

    check_choice("sampling.sampler", s.sampler, SAMPLERS)
    check_choice("sampling.logprob_reduction", s.logprob_reduction, LOGPROB_REDUCTIONS)
    check_choice("sampling.schedule", s.schedule, SCHEDULES)
    check_choice("sampling.cps_logprob", s.cps_logprob, CPS_LOGPROBS)
    w = s.window
    check_choice("sampling.window.strategy", w.strategy, WINDOW_STRATEGIES)
    check_choice("sampling.window.at_end", w.at_end, WINDOW_ENDS)
    if w.strategy != "all":
        if not 1 <= w.size <= s.num_steps:
            raise ConfigError(f"sampling.window.size must be between 1 and sampling.num_steps ({s.num_steps}); got {w.size}")
        if w.strategy == "progressive" and w.at_end == "roll_back" and s.num_steps < 3:
            raise ConfigError(f"sampling.window.at_end roll_back needs sampling.num_steps >= 3 (its windows stop short of the "
                              f"last two steps); got {s.num_steps}, or set sampling.window.at_end=clamp")
        if w.strategy == "progressive" and w.at_end == "roll_back" and not 0 <= w.start <= s.num_steps - 3:
            raise ConfigError(
                f"sampling.window.start must be between 0 and {s.num_steps - 3} with sampling.window.at_end roll_back (its windows "
                f"stop short of the last two of the {s.num_steps} steps); got {w.start}"
            )
        if (w.strategy == "fixed" or w.strategy == "progressive" and w.at_end == "clamp") and not 0 <= w.start <= s.num_steps - w.size:
            raise ConfigError(
                f"sampling.window.start must be between 0 and {s.num_steps - w.size} so the window of {w.size} steps fits in "
                f"{s.num_steps} steps; got {w.start}"
            )

    from flowrl.train.registry import check_compatible, rollout_class

    rollout = rollout_class(cfg.rollout.kind)  # one sentence for an unknown kind, before anything checks its options
    check_compatible(cfg)  # each part's own checks, and the objective's data from the rollout
    _validate_sigma_range(cfg)
    if rollout.needs_prompts and not d.prompts and not d.prompt_file:
        raise ConfigError("data.prompts is empty and data.prompt_file is not set; give prompts or a prompt file")
    if d.prompt_file and d.prompt_file.startswith("builtin:"):
        from flowrl.train.prompts import BUILTIN_PROMPT_SETS

        check_choice("data.prompt_file", d.prompt_file, BUILTIN_PROMPT_SETS)
    elif d.prompt_file and not d.prompts and validate_paths and not Path(d.prompt_file).expanduser().is_file():
        # data.prompts, when given, wins over the file: a preset's file need not exist then
        raise ConfigError(f"data.prompt_file '{d.prompt_file}' does not exist; give a text file with one prompt per line "
                          "(the GPU presets' files: docs/usage.md) or data.prompts")

    _validate_search(cfg)  # before the rewards' check, so that an unknown search.reward is named as such
    if rollout.needs_rewards and not cfg.reward.weights:
        raise ConfigError("reward.weights is empty; name at least one reward, for example jpeg_compressibility: 1.0")
    from rewards import check_reward_config  # late: rewards imports heavy optional models lazily

    judge = {cfg.reward.judge: 0.0} if cfg.reward.judge else {}
    searched = {cfg.search.reward: 0.0} if cfg.search.reward else {}
    scored = cfg.reward.weights if rollout.needs_rewards else {}  # an offline store's channels need no registered reward
    check_reward_config({**scored, **judge, **searched}, cfg.reward.options, validate_paths=validate_paths)
    jr = cfg.reward.judge_range
    if len(jr) != 2 or not jr[0] < jr[1]:
        raise ConfigError(f"reward.judge_range must be [low, high] with low < high (the judge's scores mapped onto 1-5); got {list(jr)}")
    check_choice("reward.on_invalid", cfg.reward.on_invalid, ("error", "drop"))

    check_choice("advantage.kind", cfg.advantage.kind, ADVANTAGE_KINDS)
    check_choice("advantage.std", cfg.advantage.std, ("group", "global"))
    al = cfg.allocator
    check_choice("allocator.kind", al.kind, ALLOCATOR_KINDS)
    if d.group_size < al.min_group:
        raise ConfigError(f"data.group_size ({d.group_size}) must be >= allocator.min_group ({al.min_group})")
    check_choice("selection.kind", cfg.selection.kind, SELECTION_KINDS)

    check_choice("trainer.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    check_choice("trainer.mixed_precision", t.mixed_precision, MIXED_PRECISION)

    check_choice("run.tracker", cfg.run.tracker, TRACKERS)
    check_choice("run.distributed", cfg.run.distributed, DISTRIBUTED)
    if any(m <= 0 for m in cfg.run.checkpoint_at_minutes):
        raise ConfigError(f"run.checkpoint_at_minutes must hold positive minutes from the trainer's start; "
                          f"got {list(cfg.run.checkpoint_at_minutes)}")
    if cfg.run.distributed == "fsdp2" and t.mixed_precision == "fp16":
        raise ConfigError("run.distributed fsdp2 computes in bf16 or fp32: trainer.mixed_precision must be no, bf16 or auto, "
                          "not fp16 (its loss scaler does not take sharded gradients)")
