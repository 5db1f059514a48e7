"""model.quantize and model.quantize_text_encoders: the frozen base in 4 or 8 bits under LoRA (QLoRA).

bitsandbytes quantises the weight of every Linear layer as it loads, through the libraries' own
`quantization_config=`: diffusers' BitsAndBytesConfig on the transformer's `from_pretrained`,
transformers' on each text encoder's; the pipeline is then assembled around those components.
Norms, embeddings, convolutions and biases stay in model.dtype, and the matmuls compute in it.

nf4   4-bit NormalFloat: half a byte per weight and one fp32 absmax per block of 64 weights
      (double quantisation off).
int8  LLM.int8: one byte per weight and one fp32 scale per output row; its matmuls quantise their
      inputs from fp16, outlier features (|x| > 6) kept in 16 bits.

The LoRA adapter sits on top in fp32, and the reference policy is the same quantised network with
the adapter disabled, so at initialisation (LoRA B = 0) the ratio is 1 and the KL 0 exactly. The
adapter loads onto the full-precision pipeline like any other (`flowrl export` writes it, and
merges it, from the full-precision base). bitsandbytes is the `memory` extra; it runs on CPUs too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import types

import torch

from flowrl.errors import UserError
from flowrl.schema import ModelConfig

QUANTIZE_MODES = ("none", "nf4", "int8")  # model.quantize, model.quantize_text_encoders
NF4_BLOCK = 64  # weights per fp32 absmax: bitsandbytes' 4-bit blocksize
MEMORY_EXTRA = "pip install 'flowrl[memory]'"


def bitsandbytes_installed() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def bitsandbytes_config(mode: str, dtype: torch.dtype, library):
    """`library`'s BitsAndBytesConfig (diffusers' or transformers', the same fields) for `mode`."""
    if mode == "nf4":
        return library.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                          bnb_4bit_use_double_quant=False)
    return library.BitsAndBytesConfig(load_in_8bit=True)


def quantized_components(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> dict[str, torch.nn.Module]:
    """The pipeline components that model.quantize (the transformer) and model.quantize_text_encoders
    (every text_encoder*) name, loaded quantised onto `device`, by component name: the pipeline's
    `from_pretrained` takes them as they are. {} when both are none."""
    if cfg.quantize == "none" and cfg.quantize_text_encoders == "none":
        return {}
    import diffusers
    import transformers

    libraries = {"diffusers": diffusers, "transformers": transformers}
    index = diffusers.DiffusionPipeline.load_config(path)
    modes = {name: cfg.quantize_text_encoders for name in index if name.startswith("text_encoder")}
    modes["transformer"] = cfg.quantize
    # an indexed CUDA device: accelerate compares a quantised model's device map with its own device
    target = f"cuda:{torch.cuda.current_device()}" if device.type == "cuda" and device.index is None else str(device)
    out = {}
    for name, mode in modes.items():
        entry = index.get(name)
        if mode == "none" or not isinstance(entry, list) or entry[0] is None:  # a component the pipeline leaves out
            continue
        library = libraries.get(entry[0])
        if library is None:
            key = "model.quantize" if name == "transformer" else "model.quantize_text_encoders"
            raise UserError(f"{key} {mode}: the pipeline's {name} is a {entry[0]} {entry[1]}, which flowrl quantises only "
                            f"from diffusers or transformers; set {key}: none")
        with _diffusers_bitsandbytes_on_cpu(device):
            module = getattr(library, entry[1]).from_pretrained(
                path, subfolder=name, dtype=dtype, quantization_config=bitsandbytes_config(mode, dtype, library),
                device_map={"": target})
        out[name] = _one_kernel_per_layer(module)
    if "int8" in modes.values():
        # bitsandbytes logs a warning at every int8 matmul whose input is not fp16 (it casts it, by design)
        logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    return out


@contextlib.contextmanager
def _diffusers_bitsandbytes_on_cpu(device: torch.device):
    """diffusers (0.42) refuses to quantise with bitsandbytes without a GPU, or onto a CPU: a check from
    before bitsandbytes' CPU backend (0.48), which runs nf4 and int8 there. A CPU load lifts that one
    check of diffusers' quantizers (transformers' already accept a CPU)."""
    if device.type != "cpu":
        yield
        return
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    classes = (bnb_quantizer.BnB4BitDiffusersQuantizer, bnb_quantizer.BnB8BitDiffusersQuantizer)
    saved = [vars(c).get("validate_environment") for c in classes]  # None: inherited (a later diffusers)
    for c in classes:
        c.validate_environment = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        for c, check in zip(classes, saved):
            if check is None:
                del c.validate_environment
            else:
                c.validate_environment = check


def _one_kernel_per_layer(module: torch.nn.Module) -> torch.nn.Module:
    """Rollouts (no grad, eval mode) and training forwards (grad, train mode) must run one kernel, or the
    ratio is not 1 at initialisation. bitsandbytes switches on both: on a CPU with AVX512-BF16 a 4-bit
    layer repacks its weight in place at its first no-grad forward in eval mode and from then on
    multiplies with a kernel that has no backward (gradients would stop at every frozen layer), and an
    int8 layer in train mode on a CPU dequantises its weight instead of quantising its input as in
    eval mode. Every 4-bit layer keeps the shared path, and every int8 layer computes as in eval mode
    (which is what its train mode does on a GPU)."""
    from bitsandbytes.nn import Linear4bit, Linear8bitLt

    for layer in module.modules():
        if isinstance(layer, Linear4bit):
            layer.support_avx512bf16_for_cpu = False
        elif isinstance(layer, Linear8bitLt):
            layer.train = types.MethodType(_stay_in_eval, layer)
            layer.eval()
    return module


def _stay_in_eval(layer: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
    return torch.nn.Module.train(layer, False)
