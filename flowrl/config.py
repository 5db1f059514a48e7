"""A run's config, loaded and validated: `load_config(path, overrides)` reads a preset or YAML
file over the schema's defaults (flowrl/schema.py, flowrl/yaml_config.py), applies `key=value`
overrides and returns a validated `Config`; any unknown key, wrong type or impossible value
raises `ConfigError` with one sentence naming the key and what is allowed. Validation checks a
run against the registered parts (rollouts, objectives, rewards), so this module sits above them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

from omegaconf import ListConfig, OmegaConf

from flowrl.allocator_config import MOVED_DEFAULTS as MOVED_ALLOCATOR_DEFAULTS, MOVED_KEYS as MOVED_ALLOCATOR_KEYS, allocator_section
from flowrl.core.advantages import ADVANTAGES
from flowrl.core.allocation import ALLOCATORS
from flowrl.core.search import BACKUPS, POTENTIALS, RESAMPLINGS
from flowrl.core.selection import SELECTIONS
from flowrl.devices import DTYPES
from flowrl.errors import ConfigError, check_choice, check_fields, check_producers
from flowrl.models import FAMILIES
from flowrl.models.base import BUILTIN_MODELS, BUILTIN_PREFIX, SCHEDULES, resolve_schedule
from flowrl.models.attention import check_backend_name
from flowrl.models.compile import COMPILE_MODES
from flowrl.models.quantize import MEMORY_EXTRA, QUANTIZE_MODES, bitsandbytes_installed
from flowrl.models.text_cache import TEXT_ENCODER_MODES
from flowrl.sampling.noise import INITIAL_NOISES
from flowrl.sampling.schedules import WINDOW_ENDS, WINDOW_STRATEGIES, shifted_sigmas
from flowrl.sampling.steps import CPS_LOGPROBS, LOGPROB_REDUCTIONS, SAMPLERS
from flowrl.registry import deepcopy_fields, load_plugins
from flowrl.runtime.optimizers import check_optimizer
from flowrl.runtime.options import RETIRED_DEFAULTS, RETIRED_KEYS, validate_runtime
from flowrl.runtime.ray_cluster import REWARD_PLACEMENTS, check_resources
from flowrl.schema import Config, ObjectiveSection, RolloutSection
from flowrl.search.options import SearchConfig
from flowrl.search.run import SEARCH_METHODS
from flowrl.train.experience import DATA_KINDS, FIXED_STEPS, SAMPLES
from flowrl.train.monitor.options import MonitorConfig
from flowrl.train.monitor.validate import validate_monitor
from flowrl.train.prompts import BUILTIN_PROMPT_SETS
from flowrl.train.parts import OBJECTIVES, ROLLOUTS
from flowrl.train.registry import check_compatible, objective_class, rollout_class
from flowrl.train.rollouts.common import check_trained_sigmas
from flowrl.train.sharding import DISTRIBUTED
from flowrl.yaml_config import merge_config, merge_replacing, preset_path, read_yaml, schema_config
from rewards import available_rewards, check_reward_config

TRACKERS = ("tensorboard", "wandb", "none")
MIXED_PRECISION = ("no", "bf16", "fp16", "auto")
REPLACED_MAPPINGS = ("reward.weights", "reward.channel_weights", "monitor.drift")
# keys that moved: the old name is refused with a sentence naming the new one
MOVED_KEYS = {"trainer.objective": "objective.kind", "trainer.clip_range": "objective.grpo.clip_range",
              "trainer.clip_range_high": "objective.grpo.clip_range_high",
              **{f"trainer.nft_{k}": f"objective.nft.{k}" for k in ("timesteps", "beta", "sigma_shift", "old_policy", "old_decay",
                                                                   "old_decay_rate", "adaptive_weight", "negatives", "r_scale",
                                                                   "guidance_scale")},
              **MOVED_ALLOCATOR_KEYS, **RETIRED_KEYS}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None, validate_paths: bool = True) -> Config:
    """Load a preset or YAML file, apply `key=value` overrides, validate, return a `Config`."""
    src = preset_path(str(path) if path is not None else None)
    loaded = read_yaml(src)
    plugins = [o.partition("=")[2] for o in overrides or [] if o.startswith("plugins=")]
    schema = config_class(OmegaConf.to_container(OmegaConf.from_dotlist([f"v={plugins[-1]}"]))["v"] if plugins
                          else loaded.get("plugins", []))
    kinds = [o.partition("=")[2] for o in overrides or [] if o.startswith("objective.kind=")]
    kind = kinds[-1] if kinds else OmegaConf.select(loaded, "objective.kind", default=None)
    cfg: Config = merge_config(schema, loaded, str(src), overrides, REPLACED_MAPPINGS, moved=MOVED_KEYS,
                               defaults=objective_defaults(kind), retired={**RETIRED_DEFAULTS, **MOVED_ALLOCATOR_DEFAULTS})
    validate(cfg, validate_paths=validate_paths)
    return cfg


def objective_defaults(kind: str | None) -> dict:
    """The shared options whose default is the objective's reference's (Objective.defaults): they
    replace the schema's under the preset and the command line. None: the schema's objective."""
    kind = kind if kind is not None else ObjectiveSection.kind
    return dict(OBJECTIVES.get(kind).defaults) if isinstance(kind, str) and kind in OBJECTIVES else {}


# ---- the schema, with a section per registered part that has options ------------------------------
def config_class(plugins=()) -> type[Config]:
    """The schema of a run: flowrl/schema.py's sections, the search's and the monitor's, and a rollout.<name>,
    objective.<name> and allocator.<name> section for each registered rollout, objective and allocator with
    options, each typed by the part's own dataclass. `plugins` (module paths) are imported first, so the parts
    they register count."""
    if isinstance(plugins, ListConfig):
        plugins = OmegaConf.to_container(plugins)
    if not isinstance(plugins, (list, tuple)) or not all(isinstance(m, str) for m in plugins):
        raise ConfigError(f"plugins must be a list of module import paths, such as [my_package.my_objective]; got {plugins!r}")
    load_plugins(list(plugins))
    key = (ROLLOUTS.names(), OBJECTIVES.names(), ALLOCATORS.names())
    if key not in _CLASSES:
        sections = [("rollout", ROLLOUTS.section("RolloutConfig", RolloutSection)),
                    ("objective", OBJECTIVES.section("ObjectiveConfig", ObjectiveSection)),
                    ("allocator", allocator_section()), ("search", SearchConfig), ("monitor", MonitorConfig)]
        _CLASSES[key] = dataclasses.make_dataclass(
            "Config", [(name, section, dataclasses.field(default_factory=section)) for name, section in sections],
            bases=(Config,), namespace={"__doc__": Config.__doc__, "__reduce__": _reduce_config, "__deepcopy__": deepcopy_fields,
                                        "__module__": __name__})
    return _CLASSES[key]


_CLASSES: dict[tuple, type[Config]] = {}


def _reduce_config(self):
    """A config travels (to a producer process or machine) as its YAML, read back with the same plugins."""
    return config_from_yaml, (self.to_yaml(),)


def config_from_yaml(text: str) -> Config:
    """A config written by `Config.to_yaml`, as it was (already validated, so not checked again)."""
    data = OmegaConf.create(text)
    # the replaced mappings as written, not merged into the schema's defaults (a YAML from before one existed keeps it)
    merged = merge_replacing(schema_config(config_class(data.get("plugins", []))), data, REPLACED_MAPPINGS)
    return OmegaConf.to_object(merged)


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


def _resolve_acts_at(cfg: Config) -> None:
    """lora.acts_at trained: lora.sigma_range from the sigmas the objective trains (its trained_sigma_range), so
    that the adapter leaves the others to the base network, where the config gives the grid (shifted_linear); a
    pipeline's own grid is read when the model loads (registry.add_adapter). A saved run's config holds the range."""
    lora, s = cfg.lora, cfg.sampling
    check_choice("lora.acts_at", lora.acts_at, ("all", "trained"))
    if lora.acts_at == "all" or not lora.enabled:
        return
    derived = None
    if resolve_schedule(s.schedule, cfg.model.path) == "shifted_linear":
        grid = shifted_sigmas(s.num_steps, s.shift).tolist()[: s.num_steps]
        trained = objective_class(cfg.objective.kind).trained_sigma_range(cfg, grid)
        derived = [0.0, 1.0] if trained is None else [float(trained[0]), float(trained[1])]
    if list(lora.sigma_range) not in ([0.0, 1.0], derived):
        raise ConfigError(f"lora.acts_at trained sets lora.sigma_range from the objective's trained sigmas"
                          f"{f' ({derived})' if derived else ' once the model loads'}; leave lora.sigma_range at [0.0, 1.0] "
                          f"or set lora.acts_at all to keep {list(lora.sigma_range)}")
    if derived is not None:
        lora.sigma_range = derived


def _validate_sigma_range(cfg: Config) -> None:
    """A restricted adapter must act at every step that is trained, or those steps carry no gradient."""
    r = cfg.lora.sigma_range
    if len(r) != 2 or not 0.0 <= r[0] < r[1] <= 1.0:
        raise ConfigError(f"lora.sigma_range must be [low, high] with 0 <= low < high <= 1; got {list(r)}")
    if list(r) == [0.0, 1.0]:
        return
    if not cfg.lora.enabled:
        raise ConfigError(f"lora.sigma_range {list(r)} restricts the adapter, so it needs lora.enabled=true "
                          "(or lora.sigma_range=[0.0, 1.0])")

    if objective_class(cfg.objective.kind).needs == SAMPLES:
        return  # flow-matching objectives draw their training sigmas inside the range (flowrl/train/objectives/nft.py)
    s, w = cfg.sampling, cfg.sampling.window
    if FIXED_STEPS not in rollout_class(cfg.rollout.kind).provides(cfg):
        raise ConfigError(f"lora.sigma_range other than [0, 1] needs {DATA_KINDS[FIXED_STEPS]} (a rollout that provides them, "
                          f"with sampling.window.strategy fixed), which rollout.kind '{cfg.rollout.kind}' with window "
                          f"'{w.strategy}' does not provide; rollout.kind flat does with a fixed window, and "
                          "lora.sigma_range=[0.0, 1.0] lets the adapter act at every sigma")
    if resolve_schedule(s.schedule, cfg.model.path) == "shifted_linear":  # the pipeline's grid is checked once it is loaded
        check_trained_sigmas(cfg, shifted_sigmas(s.num_steps, s.shift))



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
    """Every float finite (lists and mappings too), every field in the RANGES and CHOICES its section declares
    (flowrl.errors.check_fields; a part's own section likewise), and the runtime's options: one sentence
    naming the first that is not."""
    for key, value in _floats(cfg):
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number; got {value}")
    check_fields(cfg)
    validate_runtime(cfg)


def _validate_search(cfg: Config) -> None:

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
        check_choice("search.reward", q.reward, tuple(available_rewards()))


def _validate_async(cfg: Config) -> None:
    r, w = cfg.run, cfg.sampling.window
    check_producers(r, cfg.allocator.kind)
    if not r.async_rollouts:
        return
    if r.distributed != "ddp":  # the producer's weights are whole tensors; several ddp processes are checked with the rollout
        raise ConfigError(f"run.async_rollouts trains with run.distributed: ddp (the producers receive whole weights); got {r.distributed}")
    if cfg.trainer.budget_minutes > 0 and w.strategy == "progressive":
        # the window moves on the trainer's re-planned clock, which the producer does not see
        raise ConfigError("run.async_rollouts cannot follow a progressive sampling.window on a trainer.budget_minutes plan; "
                          "set trainer.budget_minutes: 0 or another sampling.window.strategy")


def validate(cfg: Config, validate_paths: bool = True) -> None:
    """Every section in turn, then the registered parts' own checks: one sentence for the first mistake."""
    check_numbers(cfg)
    _validate_model(cfg, validate_paths)
    _validate_sampling(cfg.sampling)
    rollout = rollout_class(cfg.rollout.kind)  # one sentence for an unknown kind, before anything checks its options
    if cfg.sampling.initial_noise == "per_group" and cfg.rollout.kind != "flat":
        raise ConfigError(f"sampling.initial_noise per_group draws a flat group's chains from one noise; rollout.kind "
                          f"'{cfg.rollout.kind}' keys its own noise (trees and G2RPO share a root already): set "
                          "sampling.initial_noise: per_sample")
    _resolve_acts_at(cfg)
    check_compatible(cfg)  # each part's own checks, and the objective's data from the rollout
    _validate_sigma_range(cfg)
    _validate_data(cfg, rollout, validate_paths)
    _validate_text_encoders(cfg, rollout)
    _validate_search(cfg)  # before the rewards' check, so that an unknown search.reward is named as such
    _validate_rewards(cfg, rollout, validate_paths)
    check_choice("advantage.kind", cfg.advantage.kind, ADVANTAGES)
    check_choice("advantage.std", cfg.advantage.std, ("group", "global"))
    cfg.allocator.validate(cfg, subsets=False)  # the image rollouts train on every sample drawn
    check_choice("selection.kind", cfg.selection.kind, SELECTIONS)
    _validate_run(cfg)
    validate_monitor(cfg, validate_paths)  # reward hacking caught while it happens (docs/monitor.md)


def _validate_model(cfg: Config, validate_paths: bool) -> None:
    m = cfg.model
    check_choice("model.kind", m.kind, FAMILIES)
    check_choice("model.dtype", m.dtype, DTYPES)
    check_choice("model.compile", m.compile, COMPILE_MODES)
    check_backend_name(m.attention_backend)
    _validate_quantization(cfg)
    if validate_paths:
        check_model_path(m.path)
    for key in ("height", "width"):
        value = getattr(m, key)
        if value <= 0 or value % 16:
            raise ConfigError(f"model.{key} must be a positive multiple of 16; got {value}")
    if FAMILIES[m.kind].video and (m.num_frames < 1 or (m.num_frames - 1) % 4):
        raise ConfigError(f"model.num_frames must be 1 plus a multiple of 4 (the VAE packs 4 frames into each latent frame after "
                          f"the first), such as 5, 13 or 81; got {m.num_frames}")
    if not FAMILIES[m.kind].video and m.num_frames != 1:
        video = ", ".join(FAMILIES.where(lambda f: f.video))
        raise ConfigError(f"model.num_frames must be 1 for model.kind {m.kind} (an image family; video: {video}); got {m.num_frames}")
    if cfg.lora.enabled and not cfg.lora.target_modules:
        raise ConfigError("lora.target_modules is empty; name at least one module, for example to_q")


def _validate_text_encoders(cfg: Config, rollout) -> None:
    """model.text_encoders (flowrl/models/text_cache.py): where the prompt encoders live."""
    m = cfg.model
    check_choice("model.text_encoders", m.text_encoders, TEXT_ENCODER_MODES)
    if m.text_encoders != "device" and m.quantize_text_encoders != "none":
        raise ConfigError(f"model.text_encoders {m.text_encoders} keeps the text encoders off the GPU, where "
                          f"model.quantize_text_encoders {m.quantize_text_encoders} would place them quantised; set one of them "
                          "to its default (device, none)")
    if m.text_encoders == "cached" and not rollout.needs_prompts:
        raise ConfigError(f"model.text_encoders cached encodes the run's prompt set before training, and rollout.kind "
                          f"{cfg.rollout.kind} takes its prompts from elsewhere (a group store); set model.text_encoders: cpu")


def _validate_quantization(cfg: Config) -> None:
    """model.quantize and model.quantize_text_encoders (flowrl/models/quantize.py): what a quantised base can do."""
    m = cfg.model
    check_choice("model.quantize", m.quantize, QUANTIZE_MODES)
    check_choice("model.quantize_text_encoders", m.quantize_text_encoders, QUANTIZE_MODES)
    asked = {k: v for k, v in (("model.quantize", m.quantize), ("model.quantize_text_encoders", m.quantize_text_encoders))
             if v != "none"}
    for key, mode in asked.items():
        if not bitsandbytes_installed():
            raise ConfigError(f"{key} {mode} needs bitsandbytes, which is not installed: {MEMORY_EXTRA}, or set {key}: none")
    if m.quantize == "none":
        return
    if not cfg.lora.enabled:
        raise ConfigError(f"model.quantize {m.quantize} freezes the transformer in bitsandbytes' packed weights, which only a "
                          "LoRA adapter can train; set lora.enabled: true, or model.quantize: none for full fine-tuning")
    if cfg.run.distributed == "fsdp2":
        # unverified: FSDP2 splits plain tensors, and a packed weight's scales live beside it, not in it
        raise ConfigError(f"model.quantize {m.quantize} runs with run.distributed ddp only (FSDP2 does not shard bitsandbytes' "
                          "packed weights); set run.distributed: ddp or model.quantize: none")


def _validate_sampling(s) -> None:
    check_choice("sampling.sampler", s.sampler, SAMPLERS)
    check_choice("sampling.logprob_reduction", s.logprob_reduction, LOGPROB_REDUCTIONS)
    check_choice("sampling.schedule", s.schedule, SCHEDULES)
    check_choice("sampling.cps_logprob", s.cps_logprob, CPS_LOGPROBS)
    check_choice("sampling.initial_noise", s.initial_noise, INITIAL_NOISES)
    w = s.window
    check_choice("sampling.window.strategy", w.strategy, WINDOW_STRATEGIES)
    check_choice("sampling.window.at_end", w.at_end, WINDOW_ENDS)
    if not 0 < w.trained_fraction <= 1 or int(s.num_steps * w.trained_fraction) < 1:
        raise ConfigError(f"sampling.window.trained_fraction must be in (0, 1] and leave at least one of the {s.num_steps} steps "
                          f"trained (int(num_steps x fraction) >= 1); got {w.trained_fraction}")
    if w.strategy == "all":
        return
    if not 1 <= w.size <= s.num_steps:
        raise ConfigError(f"sampling.window.size must be between 1 and sampling.num_steps ({s.num_steps}); got {w.size}")
    if w.choices and (w.strategy not in ("random", "scattered") or w.strategy == "random" and not all(
            0 <= c <= s.num_steps - w.size for c in w.choices)):
        raise ConfigError(f"sampling.window.choices needs sampling.window.strategy random with steps between 0 and "
                          f"{s.num_steps - w.size} (sampling.num_steps - size), or strategy scattered; got {list(w.choices)} "
                          f"with strategy '{w.strategy}'")
    if w.strategy == "scattered":
        pool = sorted(set(w.choices)) if w.choices else list(range(s.num_steps // 2))
        if len(pool) < w.size or not all(0 <= c < s.num_steps for c in pool):
            raise ConfigError(f"sampling.window.strategy scattered draws sampling.window.size ({w.size}) distinct steps from "
                              f"sampling.window.choices, or from the first half of the steps when it is empty, each between 0 and "
                              f"{s.num_steps - 1}; got {pool}")
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


def _validate_data(cfg: Config, rollout, validate_paths: bool) -> None:
    d = cfg.data
    edits = FAMILIES[cfg.model.kind].edits
    if d.edits and not edits:
        raise ConfigError(f"data.edits gives source images to edit, which model.kind {cfg.model.kind} cannot (it generates from text "
                          f"alone); choose an editing family: {', '.join(FAMILIES.where(lambda f: f.edits)) or 'none registered'}")
    if edits and d.eval_prompts:
        raise ConfigError(f"data.eval_prompts are plain prompts, which model.kind {cfg.model.kind} cannot draw (it edits source "
                          "images); leave it empty: the sample grids draw the first edits of data.edits")
    if edits and d.edits and validate_paths:
        from flowrl.train.edit_data import read_edits

        read_edits(d.edits)  # every row checked now: a bad row is one sentence before anything loads
    if rollout.needs_prompts and not d.prompts and not d.prompt_file and not d.edits:
        raise ConfigError("data.prompts is empty and data.prompt_file is not set; give prompts or a prompt file")
    if d.prompt_file and d.prompt_file.startswith("builtin:"):
        check_choice("data.prompt_file", d.prompt_file, BUILTIN_PROMPT_SETS)
    elif d.prompt_file and not d.prompts and validate_paths and not Path(d.prompt_file).expanduser().is_file():
        # data.prompts, when given, wins over the file: a preset's file need not exist then
        raise ConfigError(f"data.prompt_file '{d.prompt_file}' does not exist; give a text file with one prompt per line "
                          "(the GPU presets' files: docs/usage.md) or data.prompts")


def _validate_rewards(cfg: Config, rollout, validate_paths: bool) -> None:
    if rollout.needs_rewards and not cfg.reward.weights:
        raise ConfigError("reward.weights is empty; name at least one reward, for example jpeg_compressibility: 1.0")
    judge = {cfg.reward.judge: 0.0} if cfg.reward.judge else {}
    searched = {cfg.search.reward: 0.0} if cfg.search.reward else {}
    scored = cfg.reward.weights if rollout.needs_rewards else {}  # an offline store's channels need no registered reward
    check_reward_config({**scored, **judge, **searched}, cfg.reward.options, validate_paths=validate_paths)
    jr = cfg.reward.judge_range
    if len(jr) != 2 or not jr[0] < jr[1]:
        raise ConfigError(f"reward.judge_range must be [low, high] with low < high (the judge's scores mapped onto 1-5); got {list(jr)}")
    check_choice("reward.on_invalid", cfg.reward.on_invalid, ("error", "drop"))
    _validate_reward_placement(cfg)


def _validate_reward_placement(cfg: Config) -> None:
    rw = cfg.reward
    check_choice("reward.placement", rw.placement, REWARD_PLACEMENTS)
    if rw.placement != "ray":
        return
    if cfg.run.cluster != "ray":
        raise ConfigError("reward.placement ray puts the reward models on the run's Ray cluster; set run.cluster: ray")
    if cfg.run.cpu_processes > 1:
        raise ConfigError("reward.placement ray runs beside one trainer process; set run.cpu_processes: 1")
    check_resources("reward.ray.resources", rw.ray.resources)


def _validate_run(cfg: Config) -> None:
    t = cfg.trainer
    check_choice("trainer.mixed_precision", t.mixed_precision, MIXED_PRECISION)
    check_choice("run.tracker", cfg.run.tracker, TRACKERS)
    check_choice("run.distributed", cfg.run.distributed, DISTRIBUTED)
    if any(m <= 0 for m in cfg.run.checkpoint_at_minutes):
        raise ConfigError(f"run.checkpoint_at_minutes must hold positive minutes from the trainer's start; "
                          f"got {list(cfg.run.checkpoint_at_minutes)}")
    _validate_async(cfg)
    check_optimizer(t.optimizer, cfg.run.distributed)
    if cfg.run.distributed == "fsdp2" and t.mixed_precision == "fp16":
        raise ConfigError("run.distributed fsdp2 computes in bf16 or fp32: trainer.mixed_precision must be no, bf16 or auto, "
                          "not fp16 (its loss scaler does not take sharded gradients)")
