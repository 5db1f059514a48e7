"""Policy adapters over diffusers pipelines: the pieces RL needs from a flow model.

A `FlowPolicy` loads a pipeline with `from_pretrained` (hub id or local directory), caches
prompt embeddings, predicts the velocity v(x, sigma, cond) in fp32, decodes latents to
images, and carries an optional LoRA adapter (peft) whose disabled state is the reference
policy. `self.net` is the module used for forwards; the trainer may replace it with the
accelerate-prepared (DDP / autocast) wrapper of `self.transformer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import torch

from flowrl.devices import DTYPES, pick_device
from flowrl.errors import UserError
from flowrl.hub import check_hub_id
from flowrl.models.attention import set_attention_backend
from flowrl.models.compile import MIN_ROWS, compile_network, padded_velocity
from flowrl.models.edit_prompt import EditPrompt
from flowrl.models.quantize import quantized_components
from flowrl.models.text_cache import (SHARD, StoredEmbeddings, cache_path, load_embeddings, load_text_encoders_on_cpu,
                                      mark_complete, save_shard, text_encoder_names)
from flowrl.models.tiny import TINY_BUILDERS
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.schema import LoraConfig, ModelConfig


BUILTIN_PREFIX = "builtin:"
# model.path builtin:NAME: the pretrained shapes and shapes-edit models shipped in the package, and each tiny pipeline
# flowrl/models/tiny.py builds (its `builtin` decorator names them)
SHIPPED_MODELS = ("shapes", "shapes-edit")  # pretrained, inside the package (flowrl/assets)
BUILTIN_MODELS = (*SHIPPED_MODELS, *TINY_BUILDERS)
# sampling.schedule: the sigma grid. pipeline: what the loaded diffusers pipeline samples with
# (its scheduler, dynamic shifting included); shifted_linear: time_shift(linspace(1, 0, T + 1),
# sampling.shift), DanceGRPO's and BranchGRPO's grid; auto: shifted_linear for the built-in models
# (what they were trained and tuned with), pipeline for every other model
SCHEDULES = ("auto", "pipeline", "shifted_linear")


def resolve_schedule(schedule: str, model_path: str) -> str:
    if schedule == "auto":
        return "shifted_linear" if model_path.startswith(BUILTIN_PREFIX) else "pipeline"
    return schedule



def builtin_model_dir(name: str) -> Path:
    """Materialise a built-in tiny pipeline once into the cache, then load it like any other."""
    import os

    root = Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl")) / "builtin"
    target = root / name
    if not (target / "model_index.json").is_file():
        tmp = root / f".{name}.tmp{os.getpid()}"
        TINY_BUILDERS[name](tmp)
        try:
            tmp.replace(target)  # atomic; another process may have won the race
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(path: str) -> str:
    if path == BUILTIN_PREFIX + "shapes":  # pretrained, shipped inside the package
        from flowrl.models.shapes import shapes_model_dir

        return str(shapes_model_dir())
    if path == BUILTIN_PREFIX + "shapes-edit":
        from flowrl.models.shapes_edit import shapes_edit_model_dir

        return str(shapes_edit_model_dir())
    if path.startswith(BUILTIN_PREFIX):
        return str(builtin_model_dir(path[len(BUILTIN_PREFIX) :]))
    return str(Path(path).expanduser()) if Path(path).expanduser().exists() else path


def absent_components(path: str) -> dict[str, None]:
    """Components a local pipeline directory declares null in model_index.json (the pixel-space
    shapes model has no VAE and no T5). diffusers drops null entries but then insists on every
    non-optional component, so they are passed explicitly as None."""
    import json

    index = Path(path) / "model_index.json"
    if not index.is_file():
        return {}
    entries = json.loads(index.read_text())
    return {k: None for k, v in entries.items() if isinstance(v, list) and len(v) == 2 and v[0] is None}


def pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Rows of different sequence lengths (dim 1) as one batch, each right-padded with zeros to the
    longest: padding a text stream at its end leaves every real token's position alone, and a zero
    in the mask beside it keeps the padding out of attention."""
    longest = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, longest - t.shape[1])) for t in tensors])


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """VAE latents [B, C, H, W] as tokens of 2x2 patches [B, H/2 x W/2, 4C] (FluxPipeline's and
    QwenImagePipeline's `_pack_latents`)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack_2x2`: tokens [B, H/2 x W/2, 4C] back to latents [B, C, H, W]."""
    b, _, c = tokens.shape
    return tokens.view(b, h // 2, w // 2, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c // 4, h, w)


def pixel_fold(latent_channels: int) -> int:
    """A pixel-space model's (no VAE) image pixels per latent pixel on a side: its latents are the image in
    [-1, 1] itself (3 channels), or the image with a zero fourth channel folded r x r into depth (4 r^2
    channels: 16 at r = 2, the latent channels the Flux pipelines assume without a VAE; `fold_pixels`)."""
    if latent_channels == 3:
        return 1
    r = math.isqrt(latent_channels // 4)
    if r < 2 or 4 * r * r != latent_channels:
        raise ValueError(f"a pixel-space model (no VAE) takes 3 or 4 r^2 latent channels (16, 36, ...); its transformer "
                         f"has {latent_channels}")
    return r


def fold_pixels(images: torch.Tensor, r: int) -> torch.Tensor:
    """Images [B, 3, H, W] in [-1, 1] as pixel-space latents of `pixel_fold` r: [B, 4 r^2, H / r, W / r] (a zero
    fourth channel, then r x r space-to-depth); r = 1: the images themselves."""
    if r == 1:
        return images
    return torch.nn.functional.pixel_unshuffle(torch.nn.functional.pad(images, (0, 0, 0, 0, 0, 1)), r)


def unfold_pixels(latents: torch.Tensor, r: int) -> torch.Tensor:
    """The inverse of `fold_pixels` (the fourth channel dropped)."""
    if r == 1:
        return latents
    return torch.nn.functional.pixel_shuffle(latents, r)[:, :3]


class DiffusersClass:
    """A class attribute that names a diffusers class by a string attribute of its owner and imports it
    on first use: importing an adapter does not import its pipeline (a few seconds each)."""

    def __init__(self, name_attribute: str):
        self.name_attribute = name_attribute

    def __get__(self, obj, owner) -> Any:
        name = getattr(owner, self.name_attribute)
        if not name:
            return None
        import diffusers

        return getattr(diffusers, name)


class FlowPolicy:
    """Shared machinery; subclasses implement encoding, the transformer call and latent layout.

    A family's facts are its class attributes below (a subclass sets those it differs on and
    registers itself with `flowrl.models.register_family`); nothing about a family lives elsewhere."""

    kind = ""  # model.kind: the name it is registered under in flowrl.models.FAMILIES
    pipeline_name = ""  # its diffusers pipeline class, by name (model_index.json's _class_name)
    pipeline_class = DiffusersClass("pipeline_name")  # that class, imported from diffusers on first use
    video = False  # samples are videos [B, 3, F, H, W] (model.num_frames); else images [B, 3, H, W]
    trains_with_cfg = False  # its presets train through classifier-free guidance: two rows per sample in a forward
    cross_attention = False  # its blocks attend to the prompt rather than carry the prompt's tokens in the sequence
    token_patch: int | None = 2  # latent pixels per side of one image token; None: the transformer config's patch_size
    latent_scale = 8  # image pixels per latent pixel on a side (the VAE's spatial downsampling)
    prompt_tokens = 512  # prompt tokens per sample at model.max_sequence_length 0 (its pipeline's default)
    extra_prompt_tokens = 0  # tokens the sequence carries beside the prompt's (SD3: CLIP's 77)
    # published hub id -> the configs the memory planner builds it from on the meta device (no download):
    # {"transformer": (diffusers class, kwargs), "text_encoders": [(transformers model class, (config
    # class, kwargs))], "vae": (diffusers class, kwargs)}; a subclass family declares its own
    known_models: dict[str, dict[str, Any]] = {}
    variable_length = False  # prompt embeddings of each prompt's own length, padded per batch (`_batch`)
    guidance_argument = "guidance_scale"  # the pipeline __call__'s argument that model.guidance_scale is
    # it edits a source image: its prompts are EditPrompts, whose sources `encode_source` turns into conditioning
    edits = False
    # source images the transformer's sequence carries beside the generated one, each at the output's token count
    # (FLUX.1 Kontext's: 1): the memory planner counts their tokens
    source_images = 0

    def __init__(self, pipe, cfg: ModelConfig, device: torch.device | str = "cpu"):
        self.pipe = pipe
        self.cfg = cfg
        self._guidance_override: float | None = None  # set by `guidance()`; cfg stays as configured
        self.device = torch.device(device)
        self.dtype = DTYPES[cfg.dtype]
        self.transformer = pipe.transformer
        self.transformer_class = type(pipe.transformer)  # before sharding swaps in a subclass (flowrl/train/sharding.py)
        self.vae = pipe.vae  # None: the transformer works in pixel space, images in [-1, 1]
        # the pipeline's own rule (a video pipeline names its spatial factor apart from the temporal one)
        spatial = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None)
        # (a pipeline loaded for its text encoders alone has neither: model.text_encoders cached)
        self.vae_scale_factor = spatial if self.vae is not None else pixel_fold(self.latent_channels()) if self.transformer else 1
        # model.text_encoders (flowrl/models/text_cache.py): cpu and cached keep them (where loaded at all) on the CPU
        self.text_device = self.device if cfg.text_encoders == "device" else torch.device("cpu")
        self.model_dir: str | None = None  # the pipeline's directory or hub id: text encoders left unloaded load from it
        for module in self._modules():
            module.requires_grad_(False)
            module.to(self.device)  # already loaded in self.dtype
            module.eval()
        for module in self._text_encoders().values():
            module.requires_grad_(False)
            module.to(self.text_device)
            module.eval()
        if cfg.attention_backend is not None:  # once, before anything runs: rollouts and training share the kernel
            set_attention_backend(self.transformer, cfg.attention_backend, self.device)
        self.net = self.transformer
        self._cache: dict[str, dict[str, torch.Tensor]] = {}  # on the text encoders' device
        self._source_cache: dict[str, dict[str, torch.Tensor]] = {}  # an editing family's sources, on the CPU
        self._stored: StoredEmbeddings | None = None  # model.text_encoders cached: the run's prompt set, read from disk
        self._negative: dict[str, torch.Tensor] | None = None  # `negative_once`
        self.has_lora = False
        self.lora_sigma_range: tuple[float, float] | None = None  # None: the adapter acts at every sigma
        self._reference_depth = 0
        self._reference_net = None  # full fine-tuning with a KL: a frozen copy of the network (set_reference_network)
        self.compiled_rows = 0  # model.compile: every forward runs on MIN_ROWS to this many rows (0: eager, any batch)
        if cfg.gradient_checkpointing:
            self.transformer.enable_gradient_checkpointing()

    # ---- loading -------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: ModelConfig, device: torch.device | str | None = None, prompts: list[str] | None = None) -> "FlowPolicy":
        """The policy model.path holds, on `device`. Under model.text_encoders cached, `prompts` is the run's prompt
        set: read from its cache file, or encoded into it first; the pipeline then loads without its text encoders."""
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        path = resolve_model_path(cfg.path)
        if not Path(path).exists():  # a hub id: one sentence within seconds if it cannot be fetched
            check_hub_id(path, "model_index.json")
        cls._check_pipeline_class(cfg.path, path)
        device = torch.device(device) if device is not None else pick_device(cfg.device)
        prompt_set = list(dict.fromkeys(prompts or [])) if cfg.text_encoders == "cached" else []
        stored = None
        if prompt_set:
            stored = load_embeddings(cls._text_cache_dir(path, cfg, prompt_set)) or cls._encode_prompt_set(path, cfg, device, prompt_set)
        # model.quantize, model.quantize_text_encoders: those components load quantised onto their device first
        unloaded = {name: None for name in text_encoder_names(path)} if stored is not None else {}
        pipe = cls._load_pipeline(path, cfg, **quantized_components(path, cfg, DTYPES[cfg.dtype], device), **unloaded)
        policy = cls(pipe, cfg, device)
        policy.model_dir, policy._stored = path, stored
        return policy

    @classmethod
    def _load_pipeline(cls, path: str, cfg: ModelConfig, **components) -> Any:
        """The pipeline from model.path in model.dtype, `components` given (None: left out; a module: as loaded)."""
        try:
            return cls.pipeline_class.from_pretrained(path, dtype=DTYPES[cfg.dtype], **{**absent_components(path), **components})
        except (OSError, ValueError) as exc:
            raise UserError(f"model.path '{cfg.path}' could not be loaded as a {cls.pipeline_name}: {str(exc).splitlines()[0]}") from None
        except ImportError as exc:  # a component's class needs a package flowrl does not (FLUX.2 [dev]'s processor: torchvision)
            missing = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise UserError(f"model.path '{cfg.path}' needs a package that is not installed to load its {cls.pipeline_name}: "
                            f"{missing}") from None

    @classmethod
    def _text_cache_dir(cls, path: str, cfg: ModelConfig, prompts: list[str]) -> Path:
        return cache_path(path, cls.kind, cfg.dtype, cfg.max_sequence_length, getattr(cls, "negative_prompt", ""), prompts,
                          cfg.text_cache_dir)

    @classmethod
    def _encode_prompt_set(cls, path: str, cfg: ModelConfig, device: torch.device,
                           prompts: list[str]) -> StoredEmbeddings:
        """model.text_encoders cached, no complete cache: the text encoders alone (no transformer, no VAE) encode the set
        on `device`, or on the CPU where they do not fit beside what it holds, SHARD prompts at a time into the cache
        directory (named once the pipeline is loaded, so a hub id's revision is known)."""
        pipe = cls._load_pipeline(path, cfg, transformer=None, vae=None)
        size = sum(p.numel() * p.element_size() for n in text_encoder_names(path) for p in getattr(pipe, n).parameters())
        fits = device.type != "cuda" or size < 0.9 * torch.cuda.mem_get_info(device)[0]
        if not fits:
            print(f"model.text_encoders cached: the text encoders ({size / 2**30:.1f} GiB) do not fit on {device}; "
                  f"encoding {len(prompts)} prompts on the CPU, once")
        plain = dict(gradient_checkpointing=False, attention_backend=None, compile="none", quantize="none")
        encoder = cls(pipe, dataclasses.replace(cfg, text_encoders="device" if fits else "cpu", **plain), device)
        encoder.model_dir = path  # what a family reads its transformer's config from (FLUX: whether it guides by true CFG)
        directory = cls._text_cache_dir(path, cfg, prompts)
        for number, start in enumerate(range(0, len(prompts), SHARD)):
            shard = prompts[start:start + SHARD]
            encoder._encode_new(shard)
            save_shard(directory, number, shard, {p: encoder._cache.pop(p) for p in shard})
        mark_complete(directory, prompts, SHARD)
        del encoder, pipe
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return load_embeddings(directory)

    @classmethod
    def _check_pipeline_class(cls, given: str, path: str) -> None:
        """The pipeline's own model_index.json names its class: refuse another kind's pipeline with
        the kind to set, before diffusers fails on it somewhere deeper."""
        from diffusers import DiffusionPipeline

        try:
            found = DiffusionPipeline.load_config(path).get("_class_name")
        except Exception:  # no index to read (yet): from_pretrained gives its own sentence
            return
        expected = cls.pipeline_name
        if found and found != expected:
            from flowrl.models import pipeline_kinds

            kinds = pipeline_kinds()
            kind = kinds.get(found)
            fix = f"set model.kind={kind}" if kind else f"flowrl loads {' and '.join(kinds)} pipelines"
            raise UserError(f"model.path '{given}' holds a {found}, not the {expected} that model.kind needs; {fix}")

    def _modules(self):
        """The modules that live on the policy's device: the transformer and the VAE (the text encoders: `_text_encoders`)."""
        return [m for m in (getattr(self.pipe, n, None) for n in ("transformer", "vae")) if m is not None]

    def _text_encoders(self) -> dict[str, torch.nn.Module]:
        names = ("text_encoder", "text_encoder_2", "text_encoder_3")  # every family's pipeline names them so
        return {n: m for n in names if isinstance(m := getattr(self.pipe, n, None), torch.nn.Module)}

    def _load_missing_text_encoders(self) -> None:
        """The encoders a complete cache let the pipeline skip, loaded onto the CPU for a prompt outside the set."""
        if self.model_dir is None:
            return
        missing = [n for n in text_encoder_names(self.model_dir) if getattr(self.pipe, n, None) is None]
        for name, module in load_text_encoders_on_cpu(self.model_dir, missing, self.dtype).items():
            setattr(self.pipe, name, module)

    # ---- prompts -------------------------------------------------------------------
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batched conditioning for `prompts`; each distinct prompt is encoded once and cached. An editing
        family's prompts are EditPrompts (flowrl/models/edit_prompt.py): their sources' conditioning
        (`encode_source`) joins the text's, cached likewise by prompt."""
        # one prompt at a time: batched text encoders differ in the last bits with the batch's
        # other prompts, and a prompt's embedding must not depend on who it was cached with
        self._check_edits(prompts)
        self._encode_new(prompts)
        per_prompt = [self._cache[p] if p in self._cache else self._stored.get(p) for p in prompts]
        if self.edits:
            per_prompt = [{**text, **self._source(p)} for text, p in zip(per_prompt, prompts)]
        batch = self._batch(per_prompt)
        return {k: v.to(self.device) for k, v in batch.items()}  # cpu, cached: from the CPU to the policy's device

    def _check_edits(self, prompts: list[str]) -> None:
        """An editing family needs every prompt's source; any other family refuses one (its text encoder would
        read the edit's key as a caption)."""
        if self.edits:
            plain = next((p for p in prompts if not isinstance(p, EditPrompt)), None)  # a type check: no image decoded
            if plain is not None:
                raise UserError(f"model.kind {self.kind} edits a source image, so every prompt needs one (an EditPrompt: "
                                f"an instruction and its source image); got the plain prompt '{plain}'")
        elif any(isinstance(p, EditPrompt) for p in prompts):
            from flowrl.models import FAMILIES  # this module is below the registry's

            editing = ", ".join(FAMILIES.where(lambda family: family.edits)) or "none registered"
            raise UserError(f"model.kind {self.kind} generates from text alone, so it cannot edit a source image; "
                            f"the editing families: {editing}")

    def _source(self, prompt: "EditPrompt") -> dict[str, torch.Tensor]:
        if prompt not in self._source_cache:
            with torch.no_grad():
                self._source_cache[prompt] = {k: v.cpu() for k, v in self.encode_source(prompt.image()).items()}
        return self._source_cache[prompt]

    def encode_source(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """An editing family's conditioning from one source image [3, H, W] in [0, 1] (each entry with a batch
        dimension of 1), which its `_velocity` reads from `cond` beside the text's."""
        raise NotImplementedError

    def _encode_new(self, prompts: list[str]) -> None:
        """Each of `prompts` neither encoded nor stored yet, encoded into the cache on the text encoders' device."""
        stored = self._stored or ()
        new = [p for p in dict.fromkeys(prompts) if p not in self._cache and p not in stored]
        if new and self.cfg.text_encoders == "cached":  # a complete cache let the pipeline load without its encoders
            self._load_missing_text_encoders()
        for p in new:
            with torch.no_grad():
                self._cache[p] = self._encode_uncached([p])

    def _batch(self, per_prompt: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One conditioning batch from each prompt's own; a family whose prompt embeddings vary in
        length (`variable_length`) pads them to the longest, with a mask beside them."""
        join = pad_cat if self.variable_length else torch.cat
        return {k: join([c[k] for c in per_prompt]) for k in per_prompt[0]}

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def negative_once(self, encode: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The negative prompt's conditioning for one prompt, its keys prefixed "neg_": the same beside
        every prompt, so `encode()` runs once per policy, not once per prompt."""
        if self._negative is None:
            self._negative = {"neg_" + k: v for k, v in encode().items()}
        return self._negative

    # ---- the sigma grid ------------------------------------------------------------
    def sigmas(self, num_steps: int, schedule: str, shift: float) -> torch.Tensor:
        """[num_steps + 1] fp32 sigmas from 1 to 0 under sampling.schedule (SCHEDULES)."""
        if resolve_schedule(schedule, self.cfg.path) == "pipeline":
            return self.pipeline_sigmas(num_steps)
        return shifted_sigmas(num_steps, shift)

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """The grid the model's own diffusers pipeline samples `num_steps` steps on."""
        raise NotImplementedError

    # ---- the model -----------------------------------------------------------------
    def latent_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def latent_channels(self) -> int:
        """The VAE latents' channels the transformer takes (a pixel-space model's: `pixel_fold`)."""
        return self.transformer.config.in_channels

    def _packed_latent_shape(self) -> tuple[int, int]:
        """[tokens, channels] of the families that pack 2x2 latent patches (FLUX.1, FLUX.2, Qwen-Image):
        the transformer's in_channels are already the patches' 4C."""
        h, w = self._latent_hw()
        return ((h // 2) * (w // 2), self.transformer.config.in_channels)

    def _latent_hw(self) -> tuple[int, int]:
        """The VAE latents' height and width for model.height x model.width, even for the families
        that pack 2x2 latent patches into tokens (FLUX.1, FLUX.2, Qwen-Image), as their pipelines round."""
        f = self.vae_scale_factor * 2
        return 2 * (self.cfg.height // f), 2 * (self.cfg.width // f)

    @property
    def pixel_patch(self) -> int:
        """Image pixels per side of one transformer token: the family's `token_patch` (else the transformer
        config's patch_size) times the VAE's spatial factor, 1 in pixel space. The period of a pattern the
        network repeats in every token (the monitor's `patch_energy`): the shapes model's 4 (patch 4, no VAE),
        SD3's 16 (patch 2 on 8x latents), SANA's 32, the families that pack 2x2 latent patches 16."""
        patch = type(self).token_patch or self.transformer.config.patch_size
        if isinstance(patch, (list, tuple)):  # (frames, height, width) patches of a video transformer
            patch = patch[-1]
        return int(patch) * int(self.vae_scale_factor)

    def velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """v(x, sigma | cond) in fp32 for latents x [B, *latent_shape]; sigma is one float or one per
        row ([B]). Outside the adapter's sigma range (lora.sigma_range) the base network answers:
        the reference policy there."""
        if self.compiled_rows and not MIN_ROWS <= x.shape[0] <= self.compiled_rows:  # the rows the graphs take: nothing recompiles
            return padded_velocity(self.velocity, x, sigma, cond, self.compiled_rows)
        if self.adapter_acts_at(sigma):
            return self._velocity(x, sigma, cond)
        with self.reference():
            return self._velocity(x, sigma, cond)

    def adapter_acts_at(self, sigma: float | torch.Tensor) -> bool:
        if self.lora_sigma_range is None:
            return True
        low, high = self.lora_sigma_range
        inside = [low < s <= high for s in torch.as_tensor(sigma, dtype=torch.float64).reshape(-1).tolist()]
        if len(set(inside)) > 1:
            raise ValueError(f"one velocity call mixes sigmas inside and outside lora.sigma_range {list(self.lora_sigma_range)}")
        return inside[0]

    def timestep_rows(self, sigma: float | torch.Tensor, rows: int, scale: float = 1.0) -> torch.Tensor:
        """scale x sigma as one fp32 value per row [rows] on the device (one float repeated, or a
        tensor of the batch's sigmas, tiled when guidance doubles the batch); the product is taken
        in fp64, then rounded once."""
        s = (torch.as_tensor(sigma, dtype=torch.float64).reshape(-1) * scale).to(self.device, torch.float32)
        return s.expand(rows) if s.numel() == 1 else s.repeat(rows // s.numel())

    def _velocity(self, x: torch.Tensor, sigma: float, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] in [0, 1], fp32."""
        raise NotImplementedError

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] -> latents (the inverse of `decode`, the VAE's posterior
        mean): for samples that arrive as images, such as a group store of a user's own images."""
        return self._vae_encode(images)

    def _vae_encode(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.device, torch.float32) * 2 - 1
        if self.vae is None:  # pixel space
            return fold_pixels(x, self.vae_scale_factor)
        vc = self.vae.config
        with torch.no_grad():
            latents = self.vae.encode(x.to(self.dtype)).latent_dist.mean.float()
        return (latents - (vc.shift_factor or 0.0)) * vc.scaling_factor

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.vae is None:  # pixel space
            return (unfold_pixels(latents.float(), self.vae_scale_factor) / 2 + 0.5).clamp(0, 1)
        vc = self.vae.config
        latents = latents.to(self.device, self.dtype) / vc.scaling_factor + (vc.shift_factor or 0.0)
        with torch.no_grad():
            image = self.vae.decode(latents, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def per_channel_latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The video VAEs' (Qwen-Image's, Wan's) per-channel latent mean and std, shaped [1, C, 1, 1, 1]
        like `like`: latents = (posterior mean - mean) / std."""
        c = self.vae.config
        shape = (1, c.z_dim, 1, 1, 1)
        return (torch.tensor(c.latents_mean, device=like.device, dtype=like.dtype).view(shape),
                torch.tensor(c.latents_std, device=like.device, dtype=like.dtype).view(shape))

    # ---- the family's own diffusers pipeline (flowrl/models/pipeline_call.py) ------------------------
    def diffusers_call(self, pipe, latents: torch.Tensor, prompts: list[str], num_steps: int, schedule: str = "pipeline",
                       shift: float = 3.0, gated: bool = False) -> torch.Tensor:
        """flowrl's `num_steps`-step ODE sample on sampling.schedule `schedule` (sampling.shift `shift`), drawn
        by `pipe`, the family's own diffusers pipeline, from flowrl's initial noise `latents` [B, *latent_shape]
        (seeded_noise(seeds, INITIAL, ...)): images [B, 3, H, W] (videos [B, 3, F, H, W]) in [0, 1], which
        equal `decode` of flowrl's ODE sample up to float rounding. `gated`: `pipe`'s loaded adapter acts only
        inside this policy's lora.sigma_range, as flowrl's does."""
        from flowrl.models.pipeline_call import draw

        return draw(self, pipe, latents, prompts, num_steps, resolve_schedule(schedule, self.cfg.path) == "pipeline", shift, gated)

    def pipeline_arguments(self) -> dict[str, Any]:
        """The keyword arguments of the pipeline's __call__ that make it sample as flowrl does, besides
        prompt, latents, the steps and the grid: the size, the guidance (with the family's negative prompt)
        and max_sequence_length as configured (the shapes model's 0 T5 tokens). A family adds its own."""
        # a pixel-space model: the pipeline divides the size by the VAE factor it assumes without a VAE
        scale = 1 if self.vae is not None else getattr(self.pipe, "vae_scale_factor", 8) // self.vae_scale_factor
        args = {"height": self.cfg.height * scale, "width": self.cfg.width * scale, self.guidance_argument: self.guidance_scale}
        negative = getattr(self, "negative_prompt", None)
        if negative is not None and self.guidance_scale > 1.0:
            args["negative_prompt"] = negative
        args["max_sequence_length"] = self.cfg.max_sequence_length
        return args

    def pipeline_source_arguments(self, prompts: list["EditPrompt"]) -> dict[str, Any]:
        """An editing family: the keyword arguments of its pipeline's __call__ that pass `prompts`' sources
        (`image=`, in the form the pipeline takes them)."""
        raise NotImplementedError

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """flowrl's latents [B, *latent_shape] in the layout the pipeline's `latents` argument takes."""
        return latents

    def pipeline_latents_code(self, name: str) -> str:
        """`pipeline_latents` as Python source over the variable `name` ('' where the layouts agree)."""
        return ""

    def pipeline_pixels_code(self, name: str) -> list[str]:
        """A pixel-space model: the lines that turn the pipeline's "latent" output `name` into the image
        [B, 3, H, W] in [-1, 1] (none where they are the image already, as the shapes model's)."""
        return []

    def pipeline_source_code(self, path: str) -> list[str]:
        """An editing family: the lines that set `image`, `pipeline_source_arguments`' image= for the source
        saved at `path`, in the form the pipeline takes it."""
        raise NotImplementedError

    # ---- LoRA and the reference policy ----------------------------------------------
    def add_lora(self, lora: LoraConfig, seed: int = 0) -> None:
        from peft import LoraConfig as PeftLoraConfig

        names = [n for n, _ in self.transformer.named_modules()]
        # peft matches a target by module-name suffix
        unknown = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
        if unknown:
            raise UserError(f"lora.target_modules names modules that {type(self.transformer).__name__} lacks: {', '.join(unknown)}")
        torch.manual_seed(seed)  # adapter init is the one place that draws from the global RNG
        self.transformer.add_adapter(
            PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, init_lora_weights="gaussian", target_modules=list(lora.target_modules))
        )
        for p in self.trainable_parameters():
            p.data = p.data.float()  # trainable weights stay fp32 whatever the network dtype
        self.has_lora = True
        low, high = lora.sigma_range
        self.lora_sigma_range = None if (low, high) == (0.0, 1.0) else (float(low), float(high))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.transformer.named_parameters() if p.requires_grad}

    def enable_full_finetune(self) -> None:
        self.transformer.requires_grad_(True)
        for p in self.trainable_parameters():
            p.data = p.data.float()

    @property
    def guidance_scale(self) -> float:
        """The guidance velocities use: model.guidance_scale unless `guidance()` overrides it."""
        return self.cfg.guidance_scale if self._guidance_override is None else self._guidance_override

    @contextlib.contextmanager
    def guidance(self, scale: float | None):
        """Velocities inside use guidance `scale` (None: model.guidance_scale, unchanged)."""
        saved, self._guidance_override = self._guidance_override, (None if scale is None else float(scale))
        try:
            yield self
        finally:
            self._guidance_override = saved

    def compile(self, mode: str, rows: int) -> None:
        """model.compile (flowrl/models/compile.py): compile the network in place (and the reference
        copy of full fine-tuning), after the adapter is added; from then on every velocity runs on
        MIN_ROWS to `rows` rows (sampling.batch_size; the batch dimension is dynamic), a longer batch
        split and a single row padded, so no batch size recompiles."""
        if not compile_network(self.transformer, mode):  # none, or no C++ compiler on a CPU (warned)
            return
        if self._reference_net is not None:
            compile_network(self._reference_net, mode)
        self.compiled_rows = int(rows)

    def set_reference_network(self, net: torch.nn.Module) -> None:
        """Full fine-tuning has no adapter to disable: `reference()` then swaps in `net`, a frozen copy
        of the initial network (made only when a KL term needs it)."""
        self._reference_net = net

    @contextlib.contextmanager
    def reference(self):
        """The reference policy: the same network with the LoRA adapter disabled, or under full
        fine-tuning the frozen copy (re-entrant: only the outermost exit restores the policy)."""
        if not self.has_lora and self._reference_net is None:
            raise UserError("the reference policy needs a LoRA adapter (lora.enabled=true) or, under full fine-tuning, "
                            "a frozen copy (made when trainer.kl_beta > 0)")
        if self._reference_depth == 0:
            if self.has_lora:
                self.transformer.disable_adapters()
            else:
                self._trained_net, self.net = self.net, self._reference_net
        self._reference_depth += 1
        try:
            yield self
        finally:
            self._reference_depth -= 1
            if self._reference_depth == 0:
                if self.has_lora:
                    self.transformer.enable_adapters()
                else:
                    self.net = self._trained_net

    def lora_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The adapter's weights in peft's naming; from `state` (the transformer's full state dict,
        gathered from shards) when given, else from the network itself."""
        from peft.utils import get_peft_model_state_dict

        return get_peft_model_state_dict(self.transformer, state_dict=state)

    def save_lora(self, directory: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """The adapter in the diffusers format: loadable with `pipe.load_lora_weights(directory)`."""
        state = {k: v.detach().cpu().contiguous() for k, v in self.lora_state_dict(state).items()}
        # the adapter metadata carries lora_alpha; without it loaders assume alpha = rank
        metadata = self.transformer.peft_config["default"].to_dict()
        self.pipeline_class.save_lora_weights(
            str(directory), transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata, safe_serialization=True
        )

    def save_transformer(self, directory: str | Path, state: dict[str, torch.Tensor]) -> None:
        """A fully fine-tuned transformer in the diffusers format, in model.dtype, from its full
        state dict: loadable with `<TransformerClass>.from_pretrained(directory)`."""
        from accelerate import init_empty_weights

        with init_empty_weights():
            empty = self.transformer_class.from_config(self.transformer.config)
        empty.load_state_dict({k: v.to(self.dtype) for k, v in state.items()}, strict=True, assign=True)
        empty.save_pretrained(str(directory), safe_serialization=True)

    def load_transformer(self, directory: str | Path) -> None:
        """Load the weights of a transformer `save_transformer` wrote into this policy's network."""
        try:
            loaded = self.transformer_class.from_pretrained(str(directory), dtype=self.dtype)
        except (OSError, ValueError) as exc:
            raise UserError(f"checkpoint '{directory}' holds no loadable {self.transformer_class.__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        self.transformer.load_state_dict(loaded.state_dict())

    def load_lora(self, directory: str | Path) -> None:
        """Load an adapter written by `save_lora` into this policy's (already added) adapter."""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        f = Path(directory) / "pytorch_lora_weights.safetensors"
        if not f.is_file():
            raise UserError(f"checkpoint '{directory}' has no pytorch_lora_weights.safetensors")
        try:
            state = {k.removeprefix("transformer."): v for k, v in load_file(str(f)).items()}
            result = set_peft_model_state_dict(self.transformer, state)
        except Exception as exc:  # a truncated file, or tensors of another rank
            raise UserError(f"checkpoint '{directory}' holds an unreadable or mismatched LoRA "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise UserError(f"checkpoint '{directory}' does not match this model's LoRA layout ({len(unexpected)} unexpected keys)")
        for p in self.trainable_parameters():
            p.data = p.data.float()
