"""The config's schema: one dataclass per section of a run's YAML file (model, lora, sampling,
rollout, data, reward, advantage, allocator, selection, objective, trainer, run), with each field's
default and, in a comment beside or above it, its meaning (what `flowrl config show` prints), and
beside the fields their RANGES and CHOICES (checked by flowrl.errors.check_fields). Sections
defined elsewhere: the allocator's (flowrl/allocator_config.py, shared with the text config), the
runtime's run and trainer options that the sections here extend (flowrl/runtime/options.py), the
search's and the monitor's (flowrl/search/options.py, flowrl/train/monitor/options.py), and each
registered part's options, in the part's own file; flowrl/config.py's `config_class` adds them.
Nothing here loads or checks a file: flowrl/yaml_config.py reads and merges YAML over these
defaults. Below the parts that take their sections (models, sampling, training).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from omegaconf import OmegaConf

from flowrl.allocator_config import AllocatorConfig
from flowrl.runtime.options import RunOptions, TrainerOptions
from flowrl.runtime.ray_cluster import RewardRayOptions


@dataclass
class ModelConfig:
    kind: str = "sd3"
    path: str = "builtin:tiny-sd3"  # hub id, local pipeline directory, or builtin:NAME
    dtype: str = "fp32"
    height: int = 64
    width: int = 64
    num_frames: int = 1  # video families (wan): frames per sample, 1 + a multiple of 4; images: 1
    guidance_scale: float = 4.5  # SD3: classifier-free guidance; FLUX.1-dev: guidance embedding
    max_sequence_length: int = 128
    gradient_checkpointing: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # torch.compile of the transformer, for rollouts and training forwards: none (eager) | blocks (each
    # transformer block compiled, regional compilation) | full (the whole transformer). Compiled forwards
    # run on exactly sampling.batch_size rows, a short batch padded, so nothing recompiles after warm-up
    compile: str = "none"
    # the frozen transformer in 4 or 8 bits under LoRA (QLoRA; bitsandbytes, pip install 'flowrl[memory]'): none | nf4
    # (4-bit NormalFloat: 0.5 byte per Linear weight + an fp32 absmax per 64) | int8 (LLM.int8: 1 byte per Linear weight
    # + an fp32 scale per row). Computes in model.dtype; the reference policy is the same quantised network, adapter off
    quantize: str = "none"
    quantize_text_encoders: str = "none"  # the text encoders, likewise: none | nf4 | int8
    # diffusers' attention kernel for the transformer (its AttentionBackendName), set once at load for rollouts and
    # training alike: native | flash | xformers | sage | flex | ...; null: diffusers' default (torch's SDPA)
    attention_backend: Optional[str] = None
    # where the prompt encoders live (flowrl/models/text_cache.py): device (beside the transformer) | cpu (encode on the CPU) |
    # cached (the run's prompt set encoded once, by the text encoders alone, into files on disk; the pipeline then loads
    # without them and reads each batch's embeddings from the files; a prompt outside the set is encoded on the CPU)
    text_encoders: str = "device"
    text_cache_dir: Optional[str] = None  # model.text_encoders cached: where the files go; null: $FLOWRL_CACHE/text_embeddings

    RANGES: ClassVar[dict] = {"guidance_scale": (">= 0", "0 turns guidance off for Z-Image; SD3 then samples unconditionally"),
                              "max_sequence_length": ">= 0"}


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
    # trained: sigma_range set from the sigmas the objective trains (DGPO's grid: down to the midpoint below its last
    # trained sigma), the base network elsewhere; [0, 1] for an objective that trains every sigma. all: sigma_range as set
    acts_at: str = "all"

    RANGES: ClassVar[dict] = {"rank": ">= 1", "alpha": "> 0"}


@dataclass
class WindowConfig:
    """The SDE window (docs/algorithms.md section 1): only its steps are stochastic and trained.
    progressive is MixGRPO's sliding window; the defaults are its reference's (size 4, a shift of
    one step every 25 iterations, roll back at the end)."""

    strategy: str = "all"  # all | fixed | random | progressive | scattered (size distinct steps, not consecutive)
    size: int = 4  # steps in the window (MixGRPO: 4)
    start: int = 0  # fixed: the first step; progressive: where the window starts and rolls back to
    shift_every: int = 25  # progressive: iterations per shift (MixGRPO: 25, MixGRPO-Flash: 20)
    stride: int = 1  # progressive: steps per shift (MixGRPO: 1; 0 freezes the window, MixGRPO-Flash*)
    # progressive, at the end of the schedule: roll_back (MixGRPO's: windows stop short of the last two steps
    # and the start rolls back to `start` once it passes them) | clamp (flowrl's earlier rule: the window
    # stops on the last `size` steps, those two included, and stays there)
    at_end: str = "roll_back"
    # random: the first step drawn from these (Flow-Factory's sde_steps); scattered: the steps drawn from these
    choices: list[int] = field(default_factory=list)
    # all: only the first int(num_steps x trained_fraction) steps are trained, the rest sampled with noise but never
    # trained (Flow-GRPO's timestep_fraction 0.99: 9 of 10 steps, the last never); 1.0: every step (flowrl's earlier
    # rule). Trees and G2RPO's branches choose their own trained steps
    trained_fraction: float = 0.99

    RANGES: ClassVar[dict] = {"shift_every": ">= 1", "stride": ">= 0"}


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
    # the initial noise of a group's chains (flat rollouts): per_sample (Flow-GRPO's SD3 configs: each chain its own) |
    # per_group (Flow-GRPO's same_latent, DanceGRPO's init_same_noise: one noise for a prompt's group, so its rewards
    # differ only by the SDE steps' noise, the part the policy gradient can credit)
    initial_noise: str = "per_sample"

    RANGES: ClassVar[dict] = {"noise_level": "> 0", "num_steps": ">= 2", "eval_num_steps": ">= 1", "shift": "> 0", "batch_size": ">= 1"}


@dataclass
class RolloutSection:
    """How an iteration's samples are drawn: kind picks a registered rollout, its options under its name (rollout.tree)."""

    kind: str = "flat"  # a registered rollout (`flowrl config show` lists them; each one's options under its name)


@dataclass
class DataConfig:
    prompts: list[str] = field(default_factory=list)
    prompt_file: Optional[str] = None  # one prompt per line; used when `prompts` is empty
    # an editing family's prompts: a .jsonl or .parquet file of rows {instruction, source, reference?}, or a hub dataset
    edits: Optional[str] = None
    prompts_per_iteration: int = 2
    group_size: int = 8
    eval_prompts: list[str] = field(default_factory=list)  # sample grids; defaults to the first 4 prompts
    offline: Optional[str] = None  # rollout.kind offline or warm_start: a group store directory (`flowrl offline build`)

    RANGES: ClassVar[dict] = {"group_size": (">= 2", "GRPO compares samples within a group"), "prompts_per_iteration": ">= 1"}


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"jpeg_compressibility": 1.0})
    batch_size: int = 32
    # per reward: model path / hub id, device, dtype, batch_size, kind, url, ... (see rewards/options.py)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    on_invalid: str = "error"  # error: stop on NaN / inf / wrong shape | drop: mark those samples invalid
    # per channel ("shapes/partial": 0.5): replaces the reward's weight for that channel only
    channel_weights: dict[str, float] = field(default_factory=dict)
    # videos (model.kind wan): image rewards score every frame_stride-th frame and average (rewards/video.py)
    frame_stride: int = 1
    # inline: each sampling process holds the reward models | ray (with run.cluster ray): each registered reward in
    # reward.ray.workers Ray actors of its own, scoring each batch as soon as it is decoded (rewards/placement.py)
    placement: str = "inline"
    ray: RewardRayOptions = field(default_factory=RewardRayOptions)
    # an auxiliary judge for GDRO's corrected score in `flowrl eval --judge` (r * (u - 3) + 0.2, u the judge's
    # score mapped from judge_range onto [1, 5]); never trained on. Options under reward.options.NAME.
    judge: Optional[str] = None
    judge_range: list[float] = field(default_factory=lambda: [0.0, 1.0])

    RANGES: ClassVar[dict] = {"batch_size": ">= 1", "frame_stride": ">= 1"}


@dataclass
class AdvantageConfig:
    kind: str = "grpo"  # a registered advantage estimator (flowrl/core/advantages.py)
    std: str = "group"  # group | global
    eps: float = 1e-4
    clip: float = 5.0  # |A| <= clip (Flow-GRPO: 5)

    RANGES: ClassVar[dict] = {"eps": "> 0", "clip": "> 0"}


@dataclass
class SelectionConfig:
    """Candidate selection (used by two-stage exploration)."""

    kind: str = "best_worst"  # a registered selection (flowrl/core/selection.py)


@dataclass
class ObjectiveSection:
    """What the loop optimises: kind picks a registered objective, its options under its name (objective.nft)."""

    kind: str = "grpo"  # a registered objective (`flowrl config show` lists them; each one's options under its name)


@dataclass
class TrainerConfig(TrainerOptions):
    """The runtime's trainer options (flowrl/runtime/options.py), and the image trainer's own."""

    gradient_accumulation_steps: int = 1  # sample batches per optimizer step
    ema: bool = True
    ema_decay: float = 0.9
    mixed_precision: str = "no"  # accelerate autocast: no | bf16 | fp16 | auto (bf16 where the device computes it natively)

    RANGES: ClassVar[dict] = {"gradient_accumulation_steps": ">= 1", "ema_decay": "[0, 1)"}

    def __post_init__(self):
        if self.mixed_precision == "False":  # YAML reads a bare `no` (accelerate's word) as false
            self.mixed_precision = "no"


@dataclass
class RunConfig(RunOptions):
    """The runtime's run options (flowrl/runtime/options.py), and the image trainer's own."""

    tracker: str = "tensorboard"
    sample_every: int = 10  # iterations between sample grids (0: never)
    # minutes on the budget's clock (from the trainer's start) at which a checkpoint is written too: the first
    # iteration to end past a mark writes one, and its metrics row names the mark (checkpoint_at_minutes)
    checkpoint_at_minutes: list[float] = field(default_factory=list)
    # how the trained network is laid out over processes (docs/distributed.md): ddp (whole on every process,
    # gradients all-reduced) | fsdp2 (weights, gradients, optimizer state and EMA sharded per transformer block)
    distributed: str = "ddp"

    RANGES: ClassVar[dict] = {"sample_every": ">= 0"}


@dataclass
class Config:
    """A run's config, extended by flowrl/config.py's `config_class`: build one with load_config, not directly."""

    # modules imported before the config is read, so that the parts they register (rollouts, objectives, rewards, ...)
    # (with their options) can be chosen here: a user's own parts, by import path (my_package.my_objective)
    plugins: list[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self))
