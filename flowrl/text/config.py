"""The text path's typed config (docs/text.md): a YAML file with `task: text` at its top level.
`flowrl train|eval|sample FILE` read it here instead of the image config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from flowrl.allocator_config import MOVED_DEFAULTS as MOVED_ALLOCATOR_DEFAULTS, MOVED_KEYS as MOVED_ALLOCATOR_KEYS, AllocatorConfig
from flowrl.core.advantages import ADVANTAGES
from flowrl.errors import ConfigError, check_choice, check_fields, check_producers
from flowrl.runtime.options import RETIRED_DEFAULTS, RETIRED_KEYS, RunOptions, TrainerOptions, validate_runtime
from flowrl.text.objective import TEXT_OBJECTIVES, TextLossConfig
from flowrl.yaml_config import merge_config, preset_path, read_yaml
from rewards.text import available_text_rewards

TASK = "text"
# keys that moved to the image config's names for the same concept: the old name is refused with a sentence naming the new one
TEXT_MOVED_KEYS = {"loss.kl_beta": "trainer.kl_beta", "loss.advantage": "advantage.kind", "loss.scale_rewards": "advantage.std",
                   **MOVED_ALLOCATOR_KEYS, **RETIRED_KEYS}
BUILTIN_TEXT_MODELS = ("add",)  # model.path builtin:NAME, shipped in the package


@dataclass
class TextModelConfig:
    path: str = "builtin:add"  # builtin:add, a local transformers directory, or a hub id
    dtype: str = "fp32"  # fp32 | bf16: the weights; log-probs are always computed from fp32 logits
    device: str = "auto"
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template where it has one


@dataclass
class TextLoraConfig:
    enabled: bool = False  # false: full fine-tuning (the reference is a frozen copy, made only when trainer.kl_beta > 0)
    rank: int = 16
    alpha: int = 32
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TextDataConfig:
    # builtin:add (the arithmetic world), builtin:add_wide (its harder pool, operands of 1-7 digits), a .jsonl or
    # .parquet file, or a hub dataset id (datasets' load_dataset)
    source: str = "builtin:add"
    subset: str = ""  # a hub dataset's configuration name (openai/gsm8k: main)
    split: str = "train"
    eval_split: str = "test"  # builtin:add and add_wide: their fixed held-out problems
    prompt_column: str = "prompt"
    prompt_template: str = "{prompt}"  # what the model is asked; {prompt} is the prompt column's text
    bucket_column: str = "bucket"  # eval reports exact match per value of this column when the data has it
    prompts_per_iteration: int = 32
    group_size: int = 8
    max_prompts: int = 0  # 0: the whole split


@dataclass
class TextGenerationConfig:
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    batch_size: int = 256  # sequences per generation batch


@dataclass
class TextAdvantageConfig:
    kind: str = "grpo"  # an advantage estimator of the shared core (advantage.kind of the image config)
    std: str = "group"  # group (GRPO) | global (the batch std) | none (Dr. GRPO)


@dataclass
class TextRewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"exact_match": 1.0})
    options: dict[str, Any] = field(default_factory=dict)
    on_invalid: str = "error"  # error | drop


@dataclass
class TextTrainerConfig(TrainerOptions):
    """The runtime's trainer options (flowrl/runtime/options.py), and the text trainer's own."""

    micro_batch: int = 64  # sequences per training forward


@dataclass
class TextRunConfig(RunOptions):
    """The runtime's run options (flowrl/runtime/options.py), and the text trainer's own."""

    # > 1, with async_rollouts: APRIL's partial rollouts. ceil(f x data.prompts_per_iteration) groups are in flight; a batch
    # is the first data.prompts_per_iteration groups to finish, the unfinished completions continue in the next batch
    over_provision: float = 1.0


@dataclass
class TextConfig:
    task: str = TASK
    model: TextModelConfig = field(default_factory=TextModelConfig)
    lora: TextLoraConfig = field(default_factory=TextLoraConfig)
    data: TextDataConfig = field(default_factory=TextDataConfig)
    generation: TextGenerationConfig = field(default_factory=TextGenerationConfig)
    loss: TextLossConfig = field(default_factory=TextLossConfig)
    advantage: TextAdvantageConfig = field(default_factory=TextAdvantageConfig)
    reward: TextRewardConfig = field(default_factory=TextRewardConfig)
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    trainer: TextTrainerConfig = field(default_factory=TextTrainerConfig)
    run: TextRunConfig = field(default_factory=TextRunConfig)

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self))


def is_text_config(path: str | Path | None) -> bool:
    """Whether a config argument names a YAML file whose top level says `task: text`."""
    if path is None:
        return False
    p = Path(str(path))
    if p.suffix not in (".yaml", ".yml"):
        from flowrl.presets import CONFIG_DIR

        p = CONFIG_DIR / f"{path}.yaml"
    if not p.is_file():
        return False
    try:
        return OmegaConf.load(p).get("task") == TASK
    except Exception:
        return False


def load_text_config(path: str | Path, overrides: list[str] | None = None) -> TextConfig:
    src = preset_path(str(path))
    cfg: TextConfig = merge_config(TextConfig, read_yaml(src), str(src), overrides, ("reward.weights",), moved=TEXT_MOVED_KEYS,
                                 retired={**RETIRED_DEFAULTS, **MOVED_ALLOCATOR_DEFAULTS})
    validate_text(cfg)
    return cfg


def validate_off_policy(cfg: TextConfig) -> None:
    """The run's asynchronous options (the objective checks its own off-policy loss)."""
    r = cfg.run
    if r.async_rollouts and r.cpu_processes > 1:
        raise ConfigError("run.async_rollouts runs one text trainer process beside its producers; set run.cpu_processes: 1")
    check_producers(r, cfg.allocator.kind)
    if r.producers > 1 and r.over_provision > 1:
        raise ConfigError("run.over_provision carries a producer's unfinished completions into its next batch, which needs one "
                          f"producer; set run.producers: 1 (got {r.producers})")
    if not r.over_provision >= 1:
        raise ConfigError(f"run.over_provision must be >= 1 (1: off); got {r.over_provision}")
    if r.over_provision > 1:
        if not r.async_rollouts or r.max_staleness < 1:
            raise ConfigError("run.over_provision carries unfinished completions into later batches, which needs run.async_rollouts "
                              f"true and run.max_staleness >= 1; got async_rollouts {r.async_rollouts}, max_staleness {r.max_staleness}")
        if cfg.allocator.kind != "uniform":
            raise ConfigError(f"run.over_provision draws its groups uniformly; set allocator.kind: uniform (got {cfg.allocator.kind})")


def validate_text(cfg: TextConfig) -> None:
    d, g, t = cfg.data, cfg.generation, cfg.trainer
    check_choice("model.dtype", cfg.model.dtype, ("fp32", "bf16"))
    if "{prompt}" not in d.prompt_template:
        raise ConfigError(f"data.prompt_template must contain {{prompt}} (where the prompt column's text goes); got {d.prompt_template!r}")
    check_fields(cfg)  # the ranges and choices the sections declare (the runtime's and the allocator's)
    validate_runtime(cfg)
    for key, value, low in (("data.prompts_per_iteration", d.prompts_per_iteration, 1), ("data.group_size", d.group_size, 2),
                            ("generation.max_new_tokens", g.max_new_tokens, 1), ("generation.batch_size", g.batch_size, 1),
                            ("trainer.micro_batch", t.micro_batch, 1), ("lora.rank", cfg.lora.rank, 1)):
        if value < low:
            raise ConfigError(f"{key} must be at least {low}; got {value}")
    if g.temperature < 0:
        raise ConfigError(f"generation.temperature must be >= 0 (0: greedy); got {g.temperature}")
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"generation.top_p must be in (0, 1]; got {g.top_p}")
    check_choice("advantage.std", cfg.advantage.std, ("group", "global", "none"))
    TEXT_OBJECTIVES.get(cfg.loss.kind).validate(cfg)
    validate_off_policy(cfg)
    check_choice("advantage.kind", cfg.advantage.kind, ADVANTAGES)
    check_choice("reward.on_invalid", cfg.reward.on_invalid, ("error", "drop"))
    cfg.allocator.validate(cfg, subsets=True)
    for name in cfg.reward.weights:
        check_choice("reward.weights", name, tuple(available_text_rewards()))
    if cfg.model.path.startswith("builtin:"):
        check_choice("model.path", cfg.model.path, tuple(f"builtin:{n}" for n in BUILTIN_TEXT_MODELS))
