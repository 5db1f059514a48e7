"""flowrl from Python: the CLI's commands as functions, for a notebook or a script.

    from flowrl import api

    run = api.train(reward=lambda images, prompts: images[:, 0].mean(dim=(1, 2)),  # the default preset; redness
                    trainer={"iterations": 4, "budget_minutes": 0})
    run.metrics[-1]["reward_mean"], run.sample(["a red circle"], n=4), run.export("my-lora")

Each function calls the code of its command (flowrl/cli.py): `config` resolves a config as `flowrl
config show` does, `train` is `flowrl train`, `sample` `flowrl sample` (returning the images instead
of writing a grid), `evaluate` `flowrl eval` (returning its scores) and `export` `flowrl export`.
Overrides are the command line's `key=value` strings, or keyword arguments by section:
`trainer={"lr": 1e-4}` is `trainer.lr=1e-4`. A mistake raises UserError with the command's one
sentence (naming its flag where the command has one: `checkpoint=` is `--checkpoint`).
`flowrl.train` and `flowrl.config` are packages, so these functions live here, not at the top level.

Rewards. `reward=` replaces `reward.weights` with a registered reward's name; a plain function
`fn(images, prompts) -> scores` (images: the reward protocol's float tensor [B, 3, H, W] in [0, 1];
prompts: B strings; scores: one finite number per image, as a tensor, array or list); a list of
names and functions; or a mapping name -> function, (function, weight) or weight. A function is
registered as a reward under its name (a lambda: `custom`) in this process, so its scores pass the
checks every reward's do (rewards/multi.py). A run trains in this process: a function cannot
travel to another one, so `run.cpu_processes` falls back to 1 (with a note) and an asynchronous
producer is refused. For the CLI, put the function in a module named by the config's `plugins`.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from flowrl.errors import ConfigError, UserError

LAMBDA_NAME = "custom"  # the reward name of a function without one of its own
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")  # a reward name that is a config key and a metrics column
_FUNCTIONS: dict[str, Callable] = {}  # reward name -> the function this module registered under it


# ---- config ------------------------------------------------------------------------------------------
def config(preset=None, *overrides: str, reward=None, **sections):
    """The resolved, validated config of `preset` (a preset name, a YAML path or a Config; None: the
    default preset) with `overrides` ("trainer.lr=1e-4") and `sections` (trainer={"lr": 1e-4}), and
    `reward` (see the module's doc) in place of reward.weights."""
    with _one_sentence():
        return _resolve(preset, overrides, reward, sections)


def _resolve(preset, overrides, reward, sections):
    from flowrl.runs import split_config_and_overrides
    from flowrl.config import load_config

    with _config_source(preset) as source:
        source, items = split_config_and_overrides(source, [*overrides, *_section_overrides(sections)])
        _refuse_text(source)
        cfg = load_config(source, items)
    return cfg if reward is None else _with_reward(cfg, reward)


@contextlib.contextmanager
def _config_source(preset) -> Iterator[str | None]:
    """What `load_config` reads for `preset`: its name or path, or a Config written as YAML."""
    from flowrl.schema import Config

    if not isinstance(preset, Config):
        yield None if preset is None else str(preset)
        return
    with tempfile.TemporaryDirectory(prefix="flowrl-config-") as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(preset.to_yaml())
        yield str(path)


def _section_overrides(sections: dict[str, Any]) -> list[str]:
    """trainer={"lr": 1e-4} -> ["trainer.lr=0.0001"]; a value that is no mapping sets the key itself
    (plugins=["my_package.rewards"]). Values travel as JSON, which the dot-list reads as YAML."""
    items = []
    for section, value in sections.items():
        pairs = [(f"{section}.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(section, value)]
        items += [f"{key}={_as_yaml(key, v)}" for key, v in pairs]
    return items


def _as_yaml(key: str, value) -> str:
    try:
        return json.dumps(value, allow_nan=False, default=str)
    except ValueError:
        raise ConfigError(f"{key} must be a finite number; got {value}") from None


def _refuse_text(source: str | None = None, run: str | Path | None = None) -> None:
    from flowrl.text.cli import is_text_config, is_text_run

    if is_text_config(source) or is_text_run(run):
        raise UserError(f"'{source or run}' is a text {'config' if source else 'run'} (task: text); flowrl.api drives the image "
                        "models, so use the flowrl command for it (docs/text.md)")


# ---- rewards given as Python functions ---------------------------------------------------------------
def _with_reward(cfg, reward):
    """`cfg` with reward.weights from `reward`; channel weights and options stay for the rewards
    kept. Functions are registered first, so the config validates as any other."""
    from flowrl.config import validate

    weights = reward_weights(reward)
    r = cfg.reward
    r.weights = weights
    r.channel_weights = {c: w for c, w in r.channel_weights.items() if c.split("/")[0] in weights}
    r.options = {name: o for name, o in r.options.items() if name in weights}
    validate(cfg)
    return cfg


def reward_weights(reward) -> dict[str, float]:
    """`reward` as reward.weights, registering its functions (see the module's doc)."""
    if isinstance(reward, dict):
        return {_checked_name(name): _weighted(name, value) for name, value in reward.items()}
    weights: dict[str, float] = {}
    for item in reward if isinstance(reward, (list, tuple)) else [reward]:
        name = item if isinstance(item, str) else _function_name(item, taken=weights)
        if name in weights:
            raise ConfigError(f"reward names '{name}' twice; give a mapping such as reward={{'a': fn_a, 'b': fn_b}}")
        weights[name] = _weighted(name, item)
    return weights


def _weighted(name: str, value) -> float:
    """The weight of one entry: a weight or the name of a registered reward, or a function or
    (function, weight), the function registered under `name`."""
    if _is_number(value):
        return float(value)
    if value == name:
        return 1.0
    fn, weight = value if isinstance(value, tuple) and len(value) == 2 else (value, 1.0)
    if not callable(fn) or not _is_number(weight):
        raise ConfigError(f"reward '{name}' must be a function, (function, weight), a weight or a registered reward's name; "
                          f"got {value!r}")
    register_function(name, fn)
    return float(weight)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _function_name(fn, taken) -> str:
    name = getattr(fn, "__name__", "")
    if not _NAME.match(name):  # a lambda, or a callable object
        name = LAMBDA_NAME
        count = 2
        while name in taken:
            name, count = f"{LAMBDA_NAME}_{count}", count + 1
    return name


def _checked_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"reward name {name!r} must be letters, digits, '_' or '-', starting with a letter or '_' "
                          "(it becomes a config key and a metrics column)")
    return name


def register_function(name: str, fn: Callable) -> None:
    """Register `fn` as the reward `name` for this process; a name a registered reward already has
    (other than a function registered here, which a notebook's re-run replaces) is refused."""
    from rewards import available_rewards, register

    if name in available_rewards() and name not in _FUNCTIONS:
        raise ConfigError(f"reward function '{name}' has the name of a registered reward; give it another, "
                          f"such as reward={{'my_{name}': fn}}")
    where = f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    register(name, f"a Python function given to flowrl.api ({where})")(fn)
    _FUNCTIONS[name] = fn


# ---- train ---------------------------------------------------------------------------------------------
def train(config=None, *overrides: str, reward=None, run_dir: str | Path | None = None, **sections) -> "Run":
    """`flowrl train CONFIG OVERRIDES [--run-dir DIR]`, in this process: the run of `config` (as
    `flowrl.api.config` takes it, `reward` included), written to `run_dir` (default
    run.output_dir/run.name). Returns its Run."""
    from flowrl.runs import no_file_on_the_way, train_images
    from flowrl.runtime.run_dir import default_run_dir

    with _one_sentence():
        cfg = _resolve(config, overrides, reward, sections)
        functions = {name: _FUNCTIONS[name] for name in cfg.reward.weights if name in _FUNCTIONS}
        if functions and cfg.run.async_rollouts:
            raise ConfigError(f"run.async_rollouts samples in a producer process, which the reward function "
                              f"'{next(iter(functions))}' cannot reach; put it in a module named by the config's plugins "
                              "(docs/usage.md), or set run.async_rollouts: false")
        _in_this_process(cfg)
        path = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
        no_file_on_the_way(path, "run_dir")
        train_images(cfg, path, resume=False)
        return Run(path, reward=functions or None)


def _in_this_process(cfg) -> None:
    """A run of flowrl.api trains in the calling process, where its reward functions live."""
    from flowrl.runtime.processes import launches_cpu_processes

    if launches_cpu_processes(cfg):
        print(f"flowrl.api: training in this process (run.cpu_processes {cfg.run.cpu_processes} is for `flowrl train`, "
              "whose processes a Python function cannot reach)", file=sys.stderr)
        cfg.run.cpu_processes = 1


# ---- a run, and what the CLI does with one -------------------------------------------------------------
class Run:
    """A run directory: what `train` returns, or an existing one (`Run("runs/20261121-140844")`).
    `reward` registers the functions a run of another process trained with, under their names, so
    that its config loads here (as `train` takes `reward`)."""

    def __init__(self, path: str | Path, reward=None):
        from flowrl.runtime.run_dir import CONFIG_FILE

        self.path = Path(path).absolute()  # a notebook's working directory may change
        if not (self.path / CONFIG_FILE).is_file():
            raise UserError(f"'{self.path}' is not a run directory (no {CONFIG_FILE})")
        with _one_sentence():
            names = reward_weights(reward) if reward is not None else {}
        self.functions = {name: _FUNCTIONS[name] for name in names if name in _FUNCTIONS}

    def _register(self) -> None:
        """This run's functions under their names again (another run may have registered others since)."""
        for name, fn in self.functions.items():
            register_function(name, fn)

    @property
    def metrics(self) -> list[dict]:
        """metrics.jsonl's rows, one per iteration, read now."""
        from flowrl.runtime.run_dir import RunDir

        return RunDir(self.path).read_metrics()

    @property
    def config(self):
        """The config the run trained with (config.yaml)."""
        from flowrl.runtime.run_dir import CONFIG_FILE

        self._register()
        with _unknown_reward_hint(self.path):
            return config(self.path / CONFIG_FILE)

    def resume(self, *overrides: str, **sections) -> "Run":
        """`flowrl train --resume PATH OVERRIDES`, in this process: the run continues from its latest
        checkpoint with its own config and `overrides` (`trainer={"iterations": 200}` trains on past
        the planned end). Returns this Run."""
        from flowrl.runs import train_images
        from flowrl.config import load_config
        from flowrl.runtime.run_dir import CONFIG_FILE

        self._register()
        with _one_sentence(), _unknown_reward_hint(self.path):
            _refuse_text(run=self.path)
            cfg = load_config(self.path / CONFIG_FILE, [*overrides, *_section_overrides(sections)])
            _in_this_process(cfg)
            train_images(cfg, self.path, resume=True)
        return self

    def sample(self, prompts: list[str], **options):
        """`sample(prompts, run=self, ...)`."""
        return sample(prompts, run=self, **options)

    def evaluate(self, prompts=None, **options):
        """`evaluate(prompts, run=self, ...)`."""
        return evaluate(prompts, run=self, **options)

    def export(self, out: str | Path, merge: bool = False, checkpoint: int | None = None) -> Path:
        """`export(self, out, ...)`."""
        return export(self, out, merge=merge, checkpoint=checkpoint)

    def __repr__(self) -> str:
        rows = [r for r in self.metrics if "reward_mean" in r]
        trained = f", {len(rows)} iterations, reward_mean {rows[0]['reward_mean']:.4g} -> {rows[-1]['reward_mean']:.4g}" if rows else ""
        return f"Run('{self.path}'{trained})"


def _callables(reward) -> list:
    items = reward.values() if isinstance(reward, dict) else reward if isinstance(reward, (list, tuple)) else [reward]
    return [i[0] if isinstance(i, tuple) else i for i in items]


def sample(prompts: list[str], run=None, config=None, n: int = 1, seed: int = 0, steps: int | None = None,
           checkpoint: int | None = None, overrides: list[str] = ()):
    """`flowrl sample --prompt P ... -n N`: the ODE samples of `run`'s checkpoint (the latest; EMA
    weights when kept) or of `config`'s base model (neither: the default preset's), N per prompt
    with seeds seed..seed+N-1, as images [len(prompts) * N, 3, H, W] in [0, 1] (videos [.., 3, F, H, W])."""
    from flowrl.runs import ode_samples, policy_for

    with _one_sentence(), _command("sample", run, config, checkpoint, *[f"--prompt={p}" for p in prompts],
                                   "-n", str(n), "--seed", str(seed), *(["--steps", str(steps)] if steps is not None else [])) as args:
        cfg, policy, _, _ = policy_for(args.run, args.checkpoint, args.config, list(overrides))
        expanded = [p for p in args.prompt for _ in range(args.n)]
        return ode_samples(cfg, policy, expanded, [args.seed + j % args.n for j in range(len(expanded))], args.steps)


def evaluate(prompts=None, run=None, config=None, n: int = 1, seed: int = 0, checkpoint: int | None = None,
             per_category: int = 150, judge: str | bool | None = None, overrides: list[str] = ()):
    """`flowrl eval`: the mean reward per channel of one ODE sample per prompt and seed (N per
    prompt) of `run` or `config`'s base model (neither: the default preset's). `prompts` is a list,
    a prompt file or builtin:NAME (None: the shapes reward's held-out set); `judge` (a reward name, or True:
    the config's reward.judge) adds its scores and GDRO's corrected score. Returns the EvalResult:
    `.means()`, `.category_table()` (the shapes reward's categories), `.scores` [images, channels]."""
    from flowrl.cli import evaluate_policy
    from flowrl.train.prompts import read_prompt_file

    with _one_sentence(), _command("eval", run, config, checkpoint, "-n", str(n), "--seed", str(seed),
                                   "--per-category", str(per_category), *(["--judge"] if judge is True else [f"--judge={judge}"] if judge else [])) as args:
        args.overrides = list(overrides)
        if isinstance(prompts, (str, Path)):
            prompts, source = read_prompt_file(prompts, field="prompts", per_category=per_category), str(prompts)
        else:
            source = "the prompts given" if prompts is not None else None
        return evaluate_policy(args, list(prompts) if prompts is not None else None, source)[0]


def export(run, out: str | Path, merge: bool = False, checkpoint: int | None = None) -> Path:
    """`flowrl export --run RUN -o OUT [--merge]`: the checkpoint's LoRA for `pipe.load_lora_weights(OUT)`,
    or with `merge` a whole diffusers pipeline with the adapter fused in. Returns OUT."""
    from flowrl.cli import cmd_export

    if run is None:
        raise UserError("export needs run: a Run or a run directory")
    with _one_sentence(), _command("export", run, None, checkpoint, f"--out={out}", *(["--merge"] if merge else [])) as args:
        cmd_export(args)
    return Path(out)


@contextlib.contextmanager
def _command(name: str, run, config, checkpoint: int | None, *argv: str):
    """The parsed arguments of `flowrl NAME --run RUN | --config CONFIG [--checkpoint N] ARGV`, as
    the command line gives them to its command (neither run nor config: the default preset)."""
    from flowrl.cli import parse_args

    if run is not None and config is not None:
        raise UserError("give run (a trained run) or config (a base model), not both")
    if isinstance(run, Run):
        run._register()
    run = run.path if isinstance(run, Run) else run
    checkpoint_flag = [f"--checkpoint={checkpoint}"] if checkpoint is not None else []
    if run is not None:
        _refuse_text(run=run)
        with _unknown_reward_hint(run):
            yield parse_args([name, f"--run={run}", *checkpoint_flag, *argv])
        return
    with _config_source(config if config is not None else "default") as source:
        _refuse_text(source)
        yield parse_args([name, f"--config={source}", *checkpoint_flag, *argv])


@contextlib.contextmanager
def _unknown_reward_hint(run: str | Path):
    """A run trained with a Python function names it in its config, which another process does not
    know until it is given again: a config error then says how."""
    from omegaconf import OmegaConf

    from flowrl.runtime.run_dir import CONFIG_FILE
    from rewards import available_rewards

    try:
        yield
    except ConfigError:
        path = Path(run) / CONFIG_FILE
        weights = OmegaConf.select(OmegaConf.load(path), "reward.weights", default=None) if path.is_file() else None
        unknown = [name for name in weights or {} if name not in available_rewards()]
        if not unknown:
            raise
        raise ConfigError(f"run '{run}' trained with the reward '{unknown[0]}', which this process does not know (a Python "
                          f"function given to flowrl.api?); open the run as api.Run('{run}', reward={{'{unknown[0]}': fn}}) "
                          "with that function") from None


@contextlib.contextmanager
def _one_sentence():
    """A user mistake raised deep inside (a config key, a reward's output) surfaces as its sentence,
    without the frames that found it; errors of the caller's own code keep their traceback."""
    try:
        yield
    except UserError as exc:
        raise type(exc)(str(exc)) from None
