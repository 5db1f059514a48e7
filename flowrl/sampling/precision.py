"""Low-precision exploration copies of the current policy (Sol-RL, docs/algorithms.md section 5).

An `ExplorationCopy` holds a second transformer in the exploration precision with the LoRA
adapter merged into its base weights, and a policy view that samples through it. After every
optimizer update `resync()` merges the trained adapter into the base again and re-quantises.

Precisions and how they run:

  nvfp4  FP4 E2M1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} (signed), one FP8 E4M3 scale per block
         of 16 values along the input dimension, one FP32 scale per tensor; weights and
         activations (dynamic per-tensor scale), fp32 accumulation. Real kernels: torchao's
         NVFP4DynamicActivationNVFP4WeightConfig on sm100+ (Blackwell). Elsewhere: fake
         quantisation with `nvfp4_fake_quantize`, which reproduces torchao's NVFP4Tensor
         quantise/dequantise bit for bit (tests/train/test_two_stage.py).
  fp8    float8_e4m3fn with dynamic FP32 scales, weights and activations: one per row
         (`fp8_scaling` row: per output channel of a weight, per token of an activation) or one
         per tensor. Real: torchao's Float8DynamicActivationFloat8WeightConfig (PerRow or
         PerTensor) on sm89+ (Ada, Hopper), built with set_inductor_config=False: its default
         turns on Inductor's coordinate-descent tuning for the whole process, which makes every
         compile 5-10x slower. Elsewhere fake quantisation (scale, cast to float8_e4m3fn, cast
         back, unscale).
  bf16 / fp16 / fp32   a plain copy in that dtype; when it is the training dtype there is no
         copy at all: the policy explores itself (and `resync` costs nothing).

Only the linear layers inside the transformer blocks with both dimensions a multiple of 16
are quantised (torchao's NVFP4/FP8 kernels need that). Layers whose name contains one of
`high_precision_layers` (default HIGH_PRECISION_LAYERS: embeddings and the output layers)
stay in the copy's compute dtype, the usual choice for quantised diffusion transformers.
Adding "norm" keeps the adaLN modulation linears (inside the norm modules: norm1.linear,
norm1_context.linear, FLUX's norm.linear) unquantised too; they run once per sample, not per
token, so FP4 saves little there (on the shapes model it did not change the reward ranking,
BENCHMARKS.md). `min_features` also keeps the narrow linears out (FP8 GEMMs gain only at
large widths).

The copy serves exploration only, so it may also take shortcuts that the training policy may
not: the two-stage rollout compiles its network as model.compile says (`.net`, in place), and
`first_block_cache` applies diffusers' First Block Cache (a step whose first block's residual
barely changed reuses the previous step's other blocks). Candidates from a cached copy carry a
label that no training precision has, so the GRPO guard refuses them like low-precision ones.

torchao is an optional dependency (`pip install flowrl[fp4]`), imported only by the real
kernel backends.
"""

from __future__ import annotations

import copy
import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from flowrl.devices import DTYPES
from flowrl.errors import UserError

# layers an exploration copy keeps in its compute precision (rollout.two_stage.high_precision_layers'
# default): the embeddings and the output layers
HIGH_PRECISION_LAYERS = ("embed", "proj_out", "norm_out")

EXPLORE_PRECISIONS = ("nvfp4", "fp8", "bf16", "fp16", "fp32")
FP8_SCALINGS = ("row", "tensor")  # rollout.two_stage.fp8_scaling
BACKENDS = ("auto", "emulated", "torchao")

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7, sign in a separate bit
E2M1_MAX = 6.0
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)  # 2**-6, the smallest normal
NVFP4_BLOCK = 16
CAST_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections")


# ---- fake quantisation (plain tensor code, any device) -------------------------------
def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest FP4 E2M1 value, ties to the even code, saturating at
    +-6 (what an fp32 -> float4_e2m1 conversion does). The grid's spacing is 0.5 below 2, 1
    below 4 and 2 up to 6, so within each range this is round-half-even of x / spacing (the
    even quotient is the even code; x / spacing is exact)."""
    x = x.clamp(-E2M1_MAX, E2M1_MAX)
    a = x.abs()
    spacing = 0.5 + (a >= 2) * 0.5 + (a >= 4)
    return torch.round(x / spacing) * spacing


def nvfp4_fake_quantize(x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantise to NVFP4 and back, in fp32: blocks of 16 along the last dimension, each with an
    FP8 E4M3 scale, all under one FP32 per-tensor scale amax / (448 x 6). The operations and
    their order follow torchao's `nvfp4_quantize` and `NVFP4Tensor.dequantize`, so the values
    are the same bit for bit."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs the last dimension to be a multiple of {NVFP4_BLOCK}, got {tuple(x.shape)}")
    xf = x.float()
    blocks = xf.reshape(-1, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    if per_tensor_scale is None:
        per_tensor_scale = block_amax.amax() / (E4M3_MAX * E2M1_MAX)
    # an all-zero tensor: any positive scale quantises it to zeros (and no host sync to find out)
    per_tensor_scale = torch.where(per_tensor_scale > 0, per_tensor_scale, torch.ones_like(per_tensor_scale))
    block_scale = block_amax / E2M1_MAX
    scale_fp8 = (block_scale / per_tensor_scale).clamp(min=E4M3_TINY, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    reciprocal = (1.0 / per_tensor_scale) / scale_fp8
    codes = round_to_e2m1((blocks * reciprocal.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return (codes * (per_tensor_scale * scale_fp8).unsqueeze(-1)).reshape(xf.shape)


def fp8_fake_quantize(x: torch.Tensor, scaling: str = "tensor") -> torch.Tensor:
    """Quantise to float8_e4m3fn and back with FP32 scales amax / 448: one per tensor (`scaling`
    tensor) or one per row, the amax over the last dimension (row: torchao's PerRow, per output
    channel of a weight [out, in], per token of an activation [tokens, in]). As torchao's float8
    scaling: x / scale, clamp, round-to-nearest-even cast, x_fp8 x scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if scaling == "row" else xf.abs().amax()
    scale = amax / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all zeros stay zeros
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


FAKE_QUANTIZERS = {"nvfp4": nvfp4_fake_quantize, "fp8": fp8_fake_quantize}


class FakeQuantLinear(nn.Module):
    """y = Q(x) Q(W)^T + b in fp32, Q the format's fake quantisation (activations with dynamic
    scales: NVFP4's per-tensor and per-block, FP8's per tensor or per token under `fp8_scaling`):
    what the NVFP4 / FP8 tensor-core GEMMs compute (exact low-precision products, fp32
    accumulation), on any device. The output has the input's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: str, device=None, fp8_scaling: str = "tensor"):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.scaling = fp8_scaling if fmt == "fp8" else None
        self.quantize = functools.partial(fp8_fake_quantize, scaling=fp8_scaling) if fmt == "fp8" else FAKE_QUANTIZERS[fmt]
        self.register_buffer("weight", torch.zeros(out_features, in_features, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight.copy_(self.quantize(weight.float()))
        if self.bias is not None:
            self.bias.copy_(bias.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq = self.quantize(x.reshape(-1, shape[-1]).float())
        return F.linear(xq, self.weight, self.bias).reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        scaling = f", scaling={self.scaling}" if self.scaling else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}{scaling}"


# ---- the copy ------------------------------------------------------------------------
def real_kernels_available(fmt: str, device: torch.device) -> bool:
    """NVFP4 GEMMs need sm100+ (Blackwell); FP8 GEMMs sm89+ (Ada, Hopper)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    cap = torch.cuda.get_device_capability(device)
    return cap >= (10, 0) if fmt == "nvfp4" else cap >= (8, 9)


def native_bf16(cpu: bool) -> bool:
    """Whether the device computes bf16 matmuls natively (a CUDA GPU from Ampere on; a CPU with
    AVX512-BF16 or AMX, or Arm's BF16 extension), not by emulation slower than fp32."""
    if not cpu:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def autocast_precision(requested: str, cpu: bool) -> str:
    """`trainer.mixed_precision` as accelerate takes it: `auto` is bf16 where it is native, else no.
    On the 2-core AVX512-BF16 dev box bf16 autocast made the shapes preset's iterations 1.47x
    faster, for a lower held-out gain (BENCHMARKS.md); emulated bf16 would make them slower."""
    if requested != "auto":
        return requested
    return "bf16" if native_bf16(cpu) else "no"


def quantizable(name: str, module: nn.Module, high_precision_layers=HIGH_PRECISION_LAYERS, min_features: int = 0) -> bool:
    return (isinstance(module, nn.Linear) and module.in_features % NVFP4_BLOCK == 0 and module.out_features % NVFP4_BLOCK == 0
            and min(module.in_features, module.out_features) >= min_features and not any(k in name for k in high_precision_layers))


@torch.no_grad()
def merged_state(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's parameters and buffers under their plain (adapter-free) names, with
    every active LoRA adapter merged into its base weight (in fp32). The source is not touched."""
    from peft.tuners.lora import LoraLayer

    lora = {name: m for name, m in transformer.named_modules() if isinstance(m, LoraLayer)}
    adapter_tensors = set()
    for name, m in lora.items():
        for sub, _ in [*m.named_parameters(), *m.named_buffers()]:
            if not sub.startswith("base_layer."):
                adapter_tensors.add(f"{name}.{sub}")
    out = {}
    for name, t in [*transformer.named_parameters(), *transformer.named_buffers()]:
        if name not in adapter_tensors:
            out[name.replace(".base_layer.", ".")] = t.detach()
    for name, m in lora.items():
        w = m.base_layer.weight.detach().float()
        if not m.disable_adapters:
            for adapter in m.active_adapters:
                if adapter in m.lora_A:
                    w = w + m.get_delta_weight(adapter).float()
        out[f"{name}.weight"] = w
    return out


class _CastInputs(nn.Module):
    """Feeds the copy its compute dtype: the policy hands over latents and prompt embeddings in
    the training dtype."""

    def __init__(self, net: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.net, self.dtype = net, dtype

    def forward(self, *args, **kwargs):
        kwargs = {k: v.to(self.dtype) if k in CAST_INPUTS and torch.is_tensor(v) else v for k, v in kwargs.items()}
        return self.net(*args, **kwargs)


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


class FirstBlockCache(nn.Module):
    """diffusers' First Block Cache (its FBC hooks, as `apply_first_block_cache` places them) on
    `net`, called through `inner` (net itself or a wrapper of it). The cache is per denoising
    chain: a call whose timestep is not below the previous call's, or whose batch has another
    shape, starts a new chain with an empty cache (chains step from sigma 1 down, one call per
    step). `calls` and `reused` count the forwards and those that skipped the cached blocks.

    SD3's last block outputs no context stream (`context_pre_only`), which the hooks' tail
    residual needs, so it stays outside the cache and always runs (diffusers' own
    `apply_first_block_cache` fails on SD3 for that reason)."""

    def __init__(self, inner: nn.Module, net: nn.Module, threshold: float):
        super().__init__()
        from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
        from diffusers.hooks.first_block_cache import (_FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK, FBCBlockHook, FBCHeadBlockHook,
                                                       FBCSharedBlockState)
        from diffusers.hooks.hooks import HookRegistry, StateManager

        blocks = [b for name, child in net.named_children() if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
                  and isinstance(child, nn.ModuleList) for b in child]
        if blocks and getattr(blocks[-1], "context_pre_only", False):
            blocks = blocks[:-1]
        if len(blocks) < 2:
            raise UserError(f"rollout.two_stage.first_block_cache needs a transformer with at least two cacheable blocks; "
                            f"{type(net).__name__} has {len(blocks)}: set it to 0")
        self.state = StateManager(FBCSharedBlockState, (), {})
        try:
            head, *middle, tail = blocks
            HookRegistry.check_if_exists_or_initialize(head).register_hook(FBCHeadBlockHook(self.state, threshold), _FBC_LEADER_BLOCK_HOOK)
            for block in middle:
                HookRegistry.check_if_exists_or_initialize(block).register_hook(FBCBlockHook(self.state), _FBC_BLOCK_HOOK)
            HookRegistry.check_if_exists_or_initialize(tail).register_hook(FBCBlockHook(self.state, is_tail=True), _FBC_BLOCK_HOOK)
        except (KeyError, ValueError) as exc:  # a block class diffusers' TransformerBlockRegistry does not know
            raise UserError(f"rollout.two_stage.first_block_cache: diffusers has no first-block cache for {type(net).__name__}'s "
                            f"blocks ({exc}); set it to 0") from None
        self.inner = inner
        self.last: tuple[float, tuple] | None = None  # (timestep, batch shape) of the previous call
        self.calls = self.reused = 0

    def forward(self, *args, **kwargs):
        from diffusers.hooks.hooks import CacheContext

        t = kwargs.get("timestep", kwargs.get("t"))
        if t is None:
            raise UserError("rollout.two_stage.first_block_cache needs a network called with a timestep keyword; set it to 0")
        x = kwargs.get("hidden_states", args[0] if args else None)
        now = (float(torch.as_tensor(t).reshape(-1)[0]), tuple(x.shape) if torch.is_tensor(x) else ())
        if self.last is None or now[0] >= self.last[0] or now[1] != self.last[1]:
            self.state.reset()  # a new chain: nothing cached
        self.last = now
        self.state.set_context(CacheContext("explore"))
        out = self.inner(*args, **kwargs)
        self.calls += 1
        self.reused += not self.state.get_state().should_compute
        return out


def _check_copy_options(precision: str, backend: str, fp8_scaling: str) -> None:
    """Refuse an exploration copy's unknown precision, backend or fp8 scaling."""
    if precision not in EXPLORE_PRECISIONS:
        raise UserError(f"rollout.two_stage.explore_precision must be one of {', '.join(EXPLORE_PRECISIONS)}; got '{precision}'")
    if backend not in BACKENDS:
        raise UserError(f"rollout.two_stage.backend must be one of {', '.join(BACKENDS)}; got '{backend}'")
    if fp8_scaling not in FP8_SCALINGS:
        raise UserError(f"rollout.two_stage.fp8_scaling must be one of {', '.join(FP8_SCALINGS)}; got '{fp8_scaling}'")


class ExplorationCopy:
    """The current policy in `precision` (EXPLORE_PRECISIONS) for stage-1 exploration.

    backend: auto (torchao kernels where the GPU has them, fake quantisation elsewhere) |
    emulated (always fake quantisation) | torchao (real kernels or an error). Use `.policy` to
    sample (its `precision` label goes into every Trajectory it produces), and `resync()` after
    each optimizer update; it returns the seconds it took. Layers whose name contains one of
    `high_precision_layers`, or narrower than `min_features`, are never quantised; fp8 scales per
    `fp8_scaling` (FP8_SCALINGS). `first_block_cache` > 0 caches blocks between steps (its
    threshold); the copy is then its own network even in the training precision."""

    def __init__(self, policy, precision: str, backend: str = "auto", high_precision_layers=HIGH_PRECISION_LAYERS,
                 fp8_scaling: str = "row", min_features: int = 0, first_block_cache: float = 0.0):
        _check_copy_options(precision, backend, fp8_scaling)
        self.source, self.requested, self.fp8_scaling = policy, precision, fp8_scaling
        self.quantized: list[str] = []
        self._torchao_loaded: set[str] = set()
        compute = self._choose_mode(policy, precision, backend, first_block_cache)
        self.compute_dtype = compute
        self.cache: FirstBlockCache | None = None
        if self.mode == "identity":
            self.net, self.policy, self.label = None, policy, None
            return
        self.label = {"plain": str(compute).removeprefix("torch."), "emulated": f"{precision}-emulated", "torchao": precision}[self.mode]
        if precision == "fp8" and self.mode != "plain":
            self.label += f"-{fp8_scaling}"
        net = self._build_network(policy, precision, compute, high_precision_layers, fp8_scaling, min_features)
        self.net = net
        view = copy.copy(policy)  # shares the prompt cache, the text encoders and the VAE
        view.net = _CastInputs(net, compute) if compute != policy.dtype else net
        if first_block_cache:
            self.cache = view.net = FirstBlockCache(view.net, net, first_block_cache)
            self.label += f"+fbc{first_block_cache:g}"  # no training precision is called so: the GRPO guard refuses these samples
        view.precision = self.label
        self.policy = view
        self.resync()

    def _choose_mode(self, policy, precision: str, backend: str, first_block_cache: float) -> torch.dtype:
        """Set `self.mode` (identity | plain | emulated | torchao) and return the copy's compute dtype."""
        device = policy.device
        if precision in DTYPES:
            self.mode = "identity" if DTYPES[precision] == policy.dtype and not first_block_cache else "plain"
            compute = DTYPES[precision]
        elif backend == "emulated" or (backend == "auto" and not real_kernels_available(precision, device)):
            self.mode, compute = "emulated", policy.dtype
        else:
            if not real_kernels_available(precision, device):
                need = "an sm100+ (Blackwell) GPU" if precision == "nvfp4" else "an sm89+ (Ada or Hopper) GPU"
                raise UserError(f"rollout.two_stage.backend 'torchao' runs {precision} kernels, which need {need}; this "
                                f"device is {device}: use backend auto or emulated")
            _import_torchao()
            self.mode, compute = "torchao", torch.bfloat16
        return compute

    def _build_network(self, policy, precision: str, compute: torch.dtype, high_precision_layers, fp8_scaling: str,
                       min_features: int) -> nn.Module:
        """An empty copy of the policy's network in `compute`, its quantisable linears chosen (and faked when emulated)."""
        from accelerate import init_empty_weights

        device = policy.device
        src = policy.transformer
        with init_empty_weights():  # every tensor is loaded from the policy by resync()
            net = type(src).from_config(src.config)
        net = net.to_empty(device=device)
        nn.Module.to(net, compute)  # diffusers' own .to() warns about fp32-pinned modules; there are none to keep
        net.requires_grad_(False).eval()
        if self.mode != "plain":
            self.quantized = [n for n, m in net.named_modules() if quantizable(n, m, tuple(high_precision_layers), min_features)]
            if not self.quantized:
                raise UserError(f"rollout.two_stage.explore_precision '{precision}': {type(src).__name__} has no linear layer "
                                f"with both dimensions a multiple of {NVFP4_BLOCK} and at least rollout.two_stage.min_features "
                                f"({min_features}) to quantise; choose bf16 or fp32, or a lower min_features")
        self.shapes = {}
        for name in self.quantized:
            lin = net.get_submodule(name)
            self.shapes[name] = (lin.in_features, lin.out_features, lin.bias is not None)
            if self.mode == "emulated":
                _set_module(net, name, FakeQuantLinear(lin.in_features, lin.out_features, lin.bias is not None, precision, device,
                                                       fp8_scaling))
        prefixes = tuple(n + "." for n in self.quantized)
        self._plain = {n: t for n, t in [*net.named_parameters(), *net.named_buffers()] if not n.startswith(prefixes)}
        return net

    @torch.no_grad()
    def resync(self) -> float:
        """Merge the policy's current adapter into the base weights and load (and quantise)
        them into the copy, in place (the modules stay, so a compiled copy does not recompile).
        Returns the seconds taken (0 when the policy explores itself)."""
        if self.mode == "identity":
            return 0.0
        t0 = time.perf_counter()
        state = merged_state(self.source.transformer)
        for name, t in self._plain.items():
            t.copy_(state[name])
        for name in self.quantized:
            weight, bias = state[f"{name}.weight"], state.get(f"{name}.bias")
            if self.mode == "emulated":
                self.net.get_submodule(name).load(weight, bias)
            else:
                self._load_torchao(name, weight, bias)
        if self.source.device.type == "cuda":
            torch.cuda.synchronize(self.source.device)
        return time.perf_counter() - t0

    def cache_reuse(self) -> tuple[int, int]:
        """(forwards, forwards that reused the cached blocks) since the last call; (0, 0) without a cache."""
        if self.cache is None:
            return 0, 0
        out = (self.cache.calls, self.cache.reused)
        self.cache.calls = self.cache.reused = 0
        return out

    def torchao_config(self):
        """The torchao quantisation config of this copy's precision: NVFP4's, or FP8's with the
        `fp8_scaling` granularity and without torchao's process-wide Inductor settings."""
        torchao = _import_torchao()
        if self.requested == "nvfp4":
            return torchao.prototype.mx_formats.NVFP4DynamicActivationNVFP4WeightConfig()
        q = torchao.quantization
        granularity = q.PerRow() if self.fp8_scaling == "row" else q.PerTensor()
        return q.Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=False)

    def _load_torchao(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantise the merged weight with torchao; the first time the quantised linear replaces
        the copy's, later its weight and bias are swapped into the same module."""
        torchao = _import_torchao()
        in_f, out_f, has_bias = self.shapes[name]
        lin = nn.Linear(in_f, out_f, bias=has_bias, device=self.source.device, dtype=torch.bfloat16).requires_grad_(False)
        lin.weight.copy_(weight)
        if has_bias:
            lin.bias.copy_(bias)
        torchao.quantization.quantize_(lin, self.torchao_config())
        if name not in self._torchao_loaded:
            _set_module(self.net, name, lin)
            self._torchao_loaded.add(name)
            return
        current = self.net.get_submodule(name)
        current.weight = lin.weight
        if has_bias:
            current.bias = lin.bias

    def quantized_weight(self, name: str) -> torch.Tensor:
        """The weight layer `name` computes with, dequantised to fp32 (for checks)."""
        w = self.net.get_submodule(name).weight
        return w.dequantize().float() if self.mode == "torchao" else w.float()


def _import_torchao():
    try:
        import torchao
        import torchao.prototype.mx_formats  # noqa: F401
        import torchao.quantization  # noqa: F401
    except ImportError:
        raise UserError("rollout.two_stage.backend 'torchao' (or auto on a GPU with FP8/NVFP4 kernels) needs torchao: "
                        "pip install 'flowrl[fp4]', or set rollout.two_stage.backend=emulated") from None
    return torchao


def check_training_precision(trajectory_precision: str, training_precision: str) -> None:
    """The run-time half of the guard: samples enter the loss only in the training precision."""
    if trajectory_precision != training_precision:
        raise UserError(
            f"refusing to train on samples drawn in {trajectory_precision} by a policy trained in {training_precision}: "
            "exploration samples must be regenerated in the training precision first (rollout.two_stage.regenerate=true)"
        )
