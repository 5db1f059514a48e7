"""Per-GPU memory of a training launch, planned before anything is loaded (scripts/plan_memory.py,
docs/distributed.md).

The networks are built on the meta device from their configs (no weights are read), so the
parameter counts are exact; what they cost follows from the launch: which weights are trained,
in what precision they are kept (model.quantize: bitsandbytes' 4 or 8 bits for the Linear weights),
and over how many GPUs `run.distributed fsdp2` shards them. Activations are an estimate, with the
assumptions written beside the formula.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

import torch

from flowrl.errors import UserError, check_choice
from flowrl.models import FAMILIES, pipeline_kinds
from flowrl.models.quantize import NF4_BLOCK, QUANTIZE_MODES
from flowrl.models.text_cache import TEXT_ENCODER_MODES
from flowrl.runtime.optimizers import BLOCK_SIZE, MIN_8BIT_SIZE, check_optimizer, optimizer_state_bytes

GIB = 1024**3
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def known_models() -> dict[str, dict]:
    """The published configs of the models the presets name, so a plan needs no download: every
    registered family's own `known_models` (never one inherited from the family it extends), each
    with its model.kind. Any other model is read from its own directory or hub id (the configs only)."""
    return {name: {"kind": kind, **spec} for kind, family in FAMILIES.items()
            for name, spec in vars(family).get("known_models", {}).items()}


KNOWN_MODELS = known_models()  # the families registered on import

# bytes of saved activations per token per transformer block per hidden unit, in 16-bit training
# with fused (SDPA / flash) attention that stores no seq x seq matrix. Korthikanti et al. 2022
# (arXiv:2205.05198) count 34 for a block of attention and a 4x MLP; SD3.5's blocks also carry
# dual attention, adaLN-Zero modulation and QK norms. 54 is fitted to the one measured peak
# (BENCHMARKS.md "GPU iteration": SD3.5-Medium size, LoRA, batch 16 at 512x512, 41.10 GiB on an
# H200), where 34 would predict 23 GiB of activations against the 36.6 measured. The same value
# is assumed for FLUX's blocks, unmeasured.
ACTIVATION_BYTES_PER_HIDDEN = 54


@dataclass
class Launch:
    gpus_per_node: int = 1
    nodes: int = 1
    distributed: str = "ddp"  # ddp | fsdp2
    lora_rank: int = 0  # 0: full fine-tuning
    lora_targets: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    dtype: str = "bf16"  # model.dtype: the frozen weights and the gathered ones under fsdp2
    batch: int = 1  # samples per training forward (sampling.batch_size)
    height: int = 1024
    width: int = 1024
    frames: int = 1  # model.num_frames (video families)
    gradient_checkpointing: bool = False
    ema: bool = True
    kl: bool = True  # full fine-tuning keeps a frozen reference copy for the KL
    optimizer: str = "adamw"  # trainer.optimizer: adamw | adamw8bit | paged_adamw8bit
    quantize: str = "none"  # model.quantize: the frozen transformer's Linear weights in nf4 | int8 (LoRA, ddp)
    quantize_text_encoders: str = "none"  # model.quantize_text_encoders: none | nf4 | int8
    text_encoders: str = "device"  # model.text_encoders: device | cpu | cached (cpu and cached: none of them on the GPU)
    # the reward models on the GPU, by weights name: [registered kind, dtype] (reward_models: those of a config)
    rewards: dict[str, list[str]] = field(default_factory=dict)
    # T5 tokens per prompt (model.max_sequence_length); 0: the pipeline's own default (SD3 256, FLUX 512).
    # SD3 adds CLIP's 77 in front
    max_sequence_length: int = 0

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def from_config(cls, cfg, gpus_per_node: int = 1, nodes: int = 1) -> Launch:
        """The launch an image training config describes (flowrl.schema.Config), on this many GPUs."""
        return cls(gpus_per_node=gpus_per_node, nodes=nodes, distributed=cfg.run.distributed,
                   lora_rank=cfg.lora.rank if cfg.lora.enabled else 0, lora_targets=list(cfg.lora.target_modules),
                   dtype=cfg.model.dtype, batch=cfg.sampling.batch_size, height=cfg.model.height, width=cfg.model.width,
                   frames=cfg.model.num_frames, gradient_checkpointing=cfg.model.gradient_checkpointing, ema=cfg.trainer.ema,
                   kl=cfg.trainer.kl_beta > 0, max_sequence_length=cfg.model.max_sequence_length, optimizer=cfg.trainer.optimizer,
                   quantize=cfg.model.quantize, quantize_text_encoders=cfg.model.quantize_text_encoders,
                   text_encoders=cfg.model.text_encoders, rewards=reward_models(cfg))


@dataclass
class Model:
    name: str
    kind: str  # model.kind
    transformer: torch.nn.Module  # on the meta device
    frozen_params: int  # text encoders and VAE
    text_encoders: list[torch.nn.Module] = field(default_factory=list)  # on the meta device (model.quantize_text_encoders)

    @property
    def family(self):
        """The model family's adapter class: its facts (flowrl/models/base.py's FlowPolicy)."""
        return FAMILIES[self.kind]

    @property
    def hidden(self) -> int:
        c = self.transformer.config
        return c.dim if "dim" in c else c.num_attention_heads * c.attention_head_dim  # Z-Image names its width `dim`

    def blocks(self) -> list[torch.nn.Module]:
        # the transformer blocks among the modules FSDP must not split (SANA's list also names its patch embedding)
        names = {n for n in self.transformer._no_split_modules or () if n.endswith("Block")}
        return [m for m in self.transformer.modules() if type(m).__name__ in names]

    def image_tokens(self, height: int, width: int, frames: int = 1) -> int:
        c = self.transformer.config
        # the family's patch on its VAE's latents (SD3 and SANA: their config's; the others make 2x2 latent patches tokens)
        patch = self.family.token_patch or c.patch_size
        scale = self.family.latent_scale
        latent_frames = (frames - 1) // 4 + 1  # Wan's VAE: the first frame, then 4 frames per latent frame
        # an editing family's sources ride in the sequence after the generated tokens (FLUX.1 Kontext: twice as long)
        return (1 + self.family.source_images) * latent_frames * (height // scale // patch) * (width // scale // patch)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def on_meta(build):
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=True):  # buffers too: SD3's position table alone is 0.9 GB to compute
        return build()


def load_model(name: str) -> Model:
    """A model of KNOWN_MODELS, or a diffusers pipeline directory or hub id (its configs only), on
    the meta device."""
    import diffusers
    import transformers

    known = known_models()
    if name in known:
        spec = known[name]
        cls_name, kwargs = spec["transformer"]
        transformer = on_meta(lambda: getattr(diffusers, cls_name)(**kwargs))
        encoders = [on_meta(lambda c=c, e=e: getattr(transformers, c)(getattr(transformers, e[0])(**e[1])))
                    for c, e in spec["text_encoders"]]
        vae_class, vae_kwargs = spec["vae"]
        frozen = sum(map(count, encoders)) + count(on_meta(lambda: getattr(diffusers, vae_class)(**vae_kwargs)))
        return Model(name, spec["kind"], transformer, frozen, encoders)
    try:
        index = diffusers.DiffusionPipeline.load_config(name)
    except Exception as exc:
        raise UserError(f"model '{name}' is neither a known model ({', '.join(known)}) nor a readable diffusers "
                        f"pipeline directory or hub id ({type(exc).__name__})") from None
    kinds = pipeline_kinds()
    kind = kinds.get(index.get("_class_name"))
    if kind is None:
        raise UserError(f"model '{name}' holds a {index.get('_class_name')}; the planner knows {' and '.join(kinds)}")
    transformer, frozen, encoders = None, 0, []
    for component, entry in index.items():
        library = {"diffusers": diffusers, "transformers": transformers}.get(entry[0]) if isinstance(entry, list) else None
        cls = getattr(library, entry[1], None) if library else None
        if cls is None or not issubclass(cls, (diffusers.ModelMixin, transformers.PreTrainedModel)):
            continue  # schedulers, tokenizers, absent components
        if library is diffusers:
            config = cls.load_config(name, subfolder=component)
            module = on_meta(lambda: cls.from_config(config))
        else:
            config = transformers.AutoConfig.from_pretrained(name, subfolder=component)
            module = on_meta(lambda: cls(config))
        if component == "transformer":
            transformer = module
        else:
            frozen += count(module)
            encoders += [module] if component.startswith("text_encoder") else []
    if transformer is None:
        raise UserError(f"model '{name}' has no transformer component")
    return Model(str(name), kind, transformer, frozen, encoders)


def quantized_linears(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """The Linear layers bitsandbytes quantises when diffusers or transformers load `module` quantised:
    all but those its class keeps in full precision (`_keep_in_fp32_modules`, matched as each library
    matches them) and, in a transformers model, what its quantizer keeps by default (the output
    embedding, tied weights, the last layer: CLIP's text projection)."""
    import transformers

    skip = list(getattr(module, "_keep_in_fp32_modules", None) or [])
    if isinstance(module, transformers.PreTrainedModel):
        from transformers.quantizers.base import get_keys_to_not_convert
        from transformers.quantizers.quantizers_utils import should_convert_module

        skip += get_keys_to_not_convert(module)
        kept = lambda name: not should_convert_module(name, skip)  # noqa: E731
    else:  # diffusers' replace_with_bnb_linear
        kept = lambda name: any(k + "." in name or k == name for k in skip)  # noqa: E731
    return [m for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and not kept(n)]


def weight_bytes(module: torch.nn.Module, mode: str, low: int) -> float:
    """Bytes of `module`'s parameters in model.dtype (`low` bytes each), its Linear weights quantised
    under `mode` (QUANTIZE_MODES): nf4 half a byte per weight and an fp32 absmax per block of
    NF4_BLOCK (double quantisation off), int8 a byte per weight and an fp32 scale per output row."""
    total = low * count(module)
    if mode == "none":
        return total
    for layer in quantized_linears(module):
        n = layer.weight.numel()
        packed = math.ceil(n / 2) + 4 * math.ceil(n / NF4_BLOCK) if mode == "nf4" else n + 4 * layer.out_features
        total += packed - low * n
    return total


def quantized_how(modules: list[torch.nn.Module], mode: str, low: int) -> str:
    """How `weight_bytes` counted `modules`, for the plan's table."""
    quantized = sum(layer.weight.numel() for m in modules for layer in quantized_linears(m))
    rest = sum(map(count, modules)) - quantized
    per = f"(0.5 B + 4 B per {NF4_BLOCK})" if mode == "nf4" else "(1 B + 4 B per row)"
    return f"{quantized / 1e9:.2f}B Linear weights x {per} {mode} + {rest / 1e6:.0f}M others x {low} B"


def check_quantized_launch(launch: Launch) -> None:
    """model.quantize's and model.text_encoders' rules (flowrl/config.py): a quantised base trains a LoRA, under ddp;
    text encoders off the GPU are not quantised."""
    check_choice("quantize", launch.quantize, QUANTIZE_MODES)
    check_choice("quantize_text_encoders", launch.quantize_text_encoders, QUANTIZE_MODES)
    check_choice("text_encoders", launch.text_encoders, TEXT_ENCODER_MODES)
    for name, (kind, dtype) in launch.rewards.items():
        check_choice(f"reward {name}'s kind", kind, REWARD_NETWORKS)
        check_choice(f"reward {name}'s dtype", dtype, BYTES)
    if launch.text_encoders != "device" and launch.quantize_text_encoders != "none":
        raise UserError(f"text_encoders {launch.text_encoders} keeps the text encoders off the GPU; quantize_text_encoders "
                        f"{launch.quantize_text_encoders} has nothing to quantise there")
    if launch.quantize != "none" and (launch.lora_rank == 0 or launch.distributed == "fsdp2"):
        raise UserError(f"quantize {launch.quantize} plans a LoRA over the quantised base under ddp, as model.quantize trains; "
                        f"got {'full fine-tuning' if launch.lora_rank == 0 else 'fsdp2'}")


def frozen_rows(model: Model, launch: Launch, low: int, n: int, shard: str) -> tuple[tuple[str, float, str], ...]:
    """The frozen transformer under LoRA (over `n` shards) and the text encoders and VAE, each in
    model.dtype or with its Linear weights quantised (model.quantize, model.quantize_text_encoders: ddp only)."""
    base, q = count(model.transformer), launch.quantize
    transformer = ("weights (frozen base)", weight_bytes(model.transformer, q, low) / n,
                   f"{base / 1e9:.2f}B x {low} B {shard}" if q == "none" else quantized_how([model.transformer], q, low))
    q, encoders = launch.quantize_text_encoders, model.text_encoders
    frozen = low * model.frozen_params
    how = f"{model.frozen_params / 1e9:.2f}B x {low} B, not sharded"
    if launch.text_encoders != "device" and encoders:  # model.text_encoders cpu | cached: only the VAE on the GPU
        vae = model.frozen_params - sum(map(count, encoders))
        return transformer, ("text encoders and VAE", low * vae, f"text encoders on the CPU ({launch.text_encoders}); "
                                                                  f"VAE {vae / 1e9:.2f}B x {low} B, not sharded")
    if q != "none" and encoders:
        frozen += sum(weight_bytes(e, q, low) - low * count(e) for e in encoders)
        others = model.frozen_params - sum(map(count, encoders))
        how = f"text encoders {quantized_how(encoders, q, low)}; VAE {others / 1e9:.2f}B x {low} B, not sharded"
    return transformer, ("text encoders and VAE", frozen, how)


# The networks of the registered rewards that load one, as published (built on the meta device: no download).
# Text/vision configs are the checkpoints' config.json values; HPSv2's OpenCLIP ViT-H-14 has the layer shapes of
# transformers' CLIP ViT-H-14 (PickScore's base), so it is counted as that; aesthetic adds its 0.9M-value MLP head.
CLIP_H = {"projection_dim": 1024,
          "text_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16},
          "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
                            "image_size": 224, "patch_size": 14}}
CLIP_L = {"projection_dim": 768,
          "text_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12},
          "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                            "image_size": 224, "patch_size": 14}}
REWARD_NETWORKS = {  # registered reward -> (what it is, its network's parameters by construction on meta)
    "pickscore": ("CLIP ViT-H-14 (yuvalkirstain/PickScore_v1's config)", lambda: _clip(CLIP_H)),
    "hpsv2": ("OpenCLIP ViT-H-14, counted as CLIP ViT-H-14", lambda: _clip(CLIP_H)),
    "clip_score": ("CLIP ViT-L/14 (openai/clip-vit-large-patch14's config)", lambda: _clip(CLIP_L)),
    "aesthetic": ("CLIP ViT-L/14 + the LAION MLP head", lambda: _clip(CLIP_L) + _aesthetic_head()),
    "imagereward": ("BLIP ViT-L + BERT-base with cross-attention + MLP (ImageReward-v1.0's med_config)", lambda: _image_reward()),
}


def _clip(config: dict) -> int:
    import transformers

    return count(on_meta(lambda: transformers.CLIPModel(transformers.CLIPConfig(**config))))


def _aesthetic_head() -> int:
    from rewards.aesthetic import AestheticHead

    return count(on_meta(lambda: AestheticHead(768)))


def _image_reward() -> int:
    from rewards.imagereward import ImageRewardModel

    config = {"vision": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                         "image_size": 224, "patch_size": 16},
              "text": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "encoder_hidden_size": 1024, "vocab_size": 30524}}
    return count(on_meta(lambda: ImageRewardModel(config)))


def reward_models(cfg) -> dict[str, list[str]]:
    """The reward models a config loads onto the GPU, by name: [kind, dtype], from reward.weights and the monitor's
    gold rewards (reward.options NAME.kind, .device, .dtype; a reward on the CPU or with no network counts 0)."""
    names = list(cfg.reward.weights)
    if cfg.monitor.enabled:
        names += [g.split("/")[0] for g in cfg.monitor.gold]
    out = {}
    for name in dict.fromkeys(names):
        options = cfg.reward.options.get(name, {})
        kind = options.get("kind", name)
        if kind in REWARD_NETWORKS and options.get("device", "auto") != "cpu":
            out[name] = [kind, options.get("dtype", "fp32")]
    return out


@functools.cache
def reward_params(kind: str) -> int:
    """REWARD_NETWORKS[kind]'s parameter count, counted once per process: a plan asks for it every time (--fit plans
    a launch a dozen times) and each count builds the network on the meta device (CLIP ViT-H: 70 ms)."""
    return REWARD_NETWORKS[kind][1]()


def reward_row(rewards: dict[str, list[str]]) -> tuple[str, float, str]:
    """The reward models' weights on the GPU (their activations, under no_grad on a batch of 224 px images, left out)."""
    total, how = 0, []
    for name, (kind, dtype) in rewards.items():
        what, params = REWARD_NETWORKS[kind][0], reward_params(kind)
        total += params * BYTES[dtype]
        how.append(f"{name}: {what} {params / 1e9:.2f}B x {BYTES[dtype]} B")
    return "reward models", total, "; ".join(how) or "none on the GPU"


def lora_shapes(transformer: torch.nn.Module, rank: int, targets: list[str]) -> dict[str, tuple[int, int]]:
    """The adapter's A [rank, in] and B [out, rank] of every Linear whose name ends in a target
    (peft's matching), by module name + .lora_A / .lora_B."""
    shapes = {}
    for n, m in transformer.named_modules():
        if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in targets):
            shapes[f"{n}.lora_A"], shapes[f"{n}.lora_B"] = (rank, m.in_features), (m.out_features, rank)
    if not shapes:
        raise UserError(f"lora targets {', '.join(targets)} match no Linear layer of {type(transformer).__name__}")
    return shapes


def lora_params(transformer: torch.nn.Module, rank: int, targets: list[str]) -> int:
    """rank x (in + out) for every Linear whose name ends in a target (peft's matching)."""
    return sum(a * b for a, b in lora_shapes(transformer, rank, targets).values())


def trained_numels(transformer: torch.nn.Module, launch: Launch) -> list[int]:
    """The element count of every trained tensor: the transformer's, or the LoRA adapter's."""
    if launch.lora_rank == 0:
        return [p.numel() for p in transformer.parameters()]
    return [a * b for a, b in lora_shapes(transformer, launch.lora_rank, launch.lora_targets).values()]


def optimizer_row(optimizer: str, numels: list[int], shards: int, shard: str) -> tuple[str, float, str]:
    """The optimizer's moments: AdamW's two fp32 ones, or bitsandbytes' two 8-bit ones with an fp32 absmax per
    block for the tensors of at least MIN_8BIT_SIZE elements (fp32 moments for the smaller)."""
    trained, state = sum(numels), optimizer_state_bytes(optimizer, numels)
    if optimizer == "adamw":
        return "optimizer (AdamW, 2 fp32 moments)", state / shards, f"{trained / 1e9:.3f}B x 8 B {shard}"
    small = sum(n for n in numels if n < MIN_8BIT_SIZE)
    how = (f"{(trained - small) / 1e9:.3f}B x (2 B + 8 B per {BLOCK_SIZE}) + {small / 1e6:.2f}M in tensors under "
           f"{MIN_8BIT_SIZE} values x 8 B{', paged' if optimizer.startswith('paged') else ''}")
    return f"optimizer ({optimizer}, 2 8-bit moments)", state / shards, how


def plan(model: Model, launch: Launch) -> list[tuple[str, float, str]]:
    """(what, GiB per GPU, how it was counted) rows; the last two rows are the peaks of training
    and of sampling, and the plan's peak is the larger."""
    if launch.distributed not in ("ddp", "fsdp2"):
        raise UserError(f"distributed must be ddp or fsdp2; got '{launch.distributed}'")
    check_optimizer(launch.optimizer, launch.distributed)
    check_quantized_launch(launch)
    n = launch.gpus if launch.distributed == "fsdp2" else 1  # the shard count
    base, low = count(model.transformer), BYTES[launch.dtype]
    full = launch.lora_rank == 0
    trained = base if full else lora_params(model.transformer, launch.lora_rank, launch.lora_targets)
    shard = f"/ {n} GPUs" if n > 1 else "whole on every GPU"
    rows = []
    frozen_base, frozen_components = frozen_rows(model, launch, low, n, shard)
    if full:
        rows.append(("weights (fp32 master)", 4 * base / n, f"{base / 1e9:.2f}B x 4 B {shard}"))
    else:
        rows.append(frozen_base)
        rows.append(("weights (LoRA, fp32)", 4 * trained / n, f"{trained / 1e6:.1f}M x 4 B {shard}"))
    rows.append(("gradients (fp32)", 4 * trained / n, f"{trained / 1e9:.3f}B x 4 B {shard}"))
    rows.append(optimizer_row(launch.optimizer, trained_numels(model.transformer, launch), n, shard))
    rows.append(("EMA (fp32)", 4 * trained / n if launch.ema else 0.0, "trainer.ema" if launch.ema else "off"))
    ref = full and launch.kl
    rows.append(("reference copy", low * base / n if ref else 0.0,
                 f"frozen {launch.dtype} copy {shard}" if ref else ("LoRA: the adapter disabled, no copy" if not full else "no KL")))
    rows.append(frozen_components)
    rows.append(reward_row(launch.rewards))

    blocks = model.blocks()
    unit = max(count(b) for b in blocks)
    sharded = launch.distributed == "fsdp2"  # its unsharded weights are buffers of their own, even on one GPU
    gathered = 2 * low * unit if sharded else 0.0  # the block computing and the next one prefetched
    rows.append(("gathered blocks (fsdp2)", gathered, f"2 x the largest block ({unit / 1e6:.0f}M) x {low} B" if sharded else "-"))

    acts, how = activation_bytes(model, launch, len(blocks))
    rows.append(("activations (estimate)", acts, how))

    transient = ("gathered blocks (fsdp2)", "activations (estimate)")
    resident = sum(b for what, b, _ in rows if what not in transient)
    gradients = next(b for what, b, _ in rows if what.startswith("gradients"))
    train_peak = resident + gathered + acts
    # sampling: no gradients (zeroed to None after each step); under fsdp2 the trained network is
    # gathered whole in its compute precision beside its shards
    whole = low * base if sharded else 0.0
    sample_peak = resident - gradients + whole
    rows.append(("peak while training", train_peak, "resident + gathered blocks + activations"))
    rows.append(("peak while sampling", sample_peak, f"resident - gradients + the whole network ({launch.dtype})" if sharded
                 else "resident - gradients"))
    return [(what, b / GIB, how) for what, b, how in rows]


def activation_bytes(model: Model, launch: Launch, blocks: int) -> tuple[float, str]:
    """The training forward's activations (bytes) and how they were counted."""
    # prompt tokens: the family's pipeline default (SD3's T5 256, FLUX's 512); Qwen-Image's vary with the prompt,
    # at most 512 by default
    family = model.family
    t5 = launch.max_sequence_length or family.prompt_tokens
    if family.cross_attention:  # the prompt is read by cross-attention, not carried through the blocks
        t5 = 0
    tokens = model.image_tokens(launch.height, launch.width, launch.frames) + t5 + family.extra_prompt_tokens
    rows_per_forward = launch.batch * (2 if family.trains_with_cfg else 1)  # trained with CFG: two halves per sample
    per_block = ACTIVATION_BYTES_PER_HIDDEN * model.hidden * tokens * rows_per_forward
    if launch.gradient_checkpointing:  # each block's 16-bit input kept, one block's activations recomputed at a time
        return (blocks * 2 * model.hidden * tokens * rows_per_forward + per_block,
                f"{blocks} block inputs + one block's {ACTIVATION_BYTES_PER_HIDDEN} x hidden x {tokens} tokens x {rows_per_forward} rows")
    return (blocks * per_block,
            f"{blocks} blocks x {ACTIVATION_BYTES_PER_HIDDEN} B x hidden {model.hidden} x {tokens} tokens x {rows_per_forward} rows")


def plan_peak(rows: list[tuple[str, float, str]]) -> float:
    """GiB per GPU at the plan's peak: the larger of training's and sampling's (the last two rows)."""
    return max(rows[-1][1], rows[-2][1])


def format_plan(model: Model, launch: Launch, rows: list[tuple[str, float, str]]) -> str:
    mode = "full fine-tuning" if launch.lora_rank == 0 else f"LoRA rank {launch.lora_rank}"
    head = (f"{model.name}: {launch.nodes} node(s) x {launch.gpus_per_node} GPU(s), {launch.distributed}, {mode}, "
            f"{launch.dtype}, batch {launch.batch}, {launch.height}x{launch.width}, gradient checkpointing "
            f"{'on' if launch.gradient_checkpointing else 'off'}")
    width = max(len(r[0]) for r in rows)
    lines = [head, f"{'':{width}}  GiB/GPU", *(f"{w:{width}}  {g:7.2f}  {how}" for w, g, how in rows)]
    lines.append(f"{'plan peak':{width}}  {plan_peak(rows):7.2f}")
    return "\n".join(lines)


def plan_json(model: Model, launch: Launch, rows) -> str:
    return json.dumps({"model": model.name, "launch": vars(launch), "rows": [{"what": w, "gib": g, "how": h} for w, g, h in rows],
                       "peak_gib": plan_peak(rows)}, indent=1)

