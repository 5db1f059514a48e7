"""model.text_encoders: where the prompt encoders live, and the run's prompts encoded once on disk.

device  the encoders on the GPU beside the transformer, each prompt encoded when first met (flowrl's
        default, and Flow-GRPO's: its three SD3 encoders stay on the GPU).
cpu     the encoders on the CPU, encoding there; the embeddings then move to the GPU.
cached  every prompt of the run's set (data.prompts or data.prompt_file, the eval prompts; each entry
        carries the family's negative prompt where it guides with one) encoded once on the device, then
        the encoders move to the CPU. The embeddings go to a safetensors file keyed by the model (path and
        revision, or a local directory's modification time), the prompt set and the encoder settings
        (model.kind, model.dtype, model.max_sequence_length, the negative prompt); a later run finding it
        complete loads the pipeline without its text encoders at all. A prompt outside the set (`flowrl
        sample --prompt`, another eval) is encoded on demand by the encoders loaded on the CPU.
        Flow-Factory's preprocessing does the same (docs/ALGORITHMS.md III.7d).

A cached embedding is the tensor encoding produced, stored and read back unchanged, so the conditioning a
run trains on is bit for bit that of encoding on the fly on the same device.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

TEXT_ENCODER_MODES = ("device", "cpu", "cached")  # model.text_encoders
ENCODER_PREFIX = "text_encoder"  # model_index.json's text_encoder, text_encoder_2, text_encoder_3
FORMAT = 1  # bump when what a cache file holds changes: older files are then simply not found


def text_encoder_names(path: str) -> list[str]:
    """The text-encoder components a pipeline directory or hub id declares (not null) in model_index.json."""
    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(path)
    return [k for k, v in index.items() if k.startswith(ENCODER_PREFIX) and isinstance(v, list) and v[0] is not None]


def model_identity(path: str) -> str:
    """What tells one set of encoder weights from another: a local directory's path and the latest
    modification time of its files; a hub id with the snapshot (commit) the hub cache holds."""
    local = Path(path)
    if local.is_dir():
        latest = max((f.stat().st_mtime_ns for f in local.rglob("*") if f.is_file()), default=0)
        return f"{local.resolve()}@{latest}"
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(path, "model_index.json")
    return f"{path}@{Path(found).parent.name if isinstance(found, str) else 'unknown'}"


def cache_root(cache_dir: str | None) -> Path:
    """model.text_cache_dir, else text_embeddings/ under flowrl's cache ($FLOWRL_CACHE, ~/.cache/flowrl)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl")) / "text_embeddings"


def cache_file(path: str, kind: str, dtype: str, max_sequence_length: int, negative: str, prompts: list[str],
               cache_dir: str | None) -> Path:
    """The file the embeddings of `prompts` (in order) live in, named by a hash of everything they depend on."""
    key = {"format": FORMAT, "model": model_identity(path), "kind": kind, "dtype": dtype,
           "max_sequence_length": max_sequence_length, "negative": negative, "prompts": prompts}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root(cache_dir) / f"{kind}-{digest}.safetensors"


SHARED = "*"  # the index of a tensor every prompt shares (a family's negative prompt, `FlowPolicy.negative_once`)


def save_embeddings(file: Path, prompts: list[str], encoded: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each prompt's conditioning as tensors named INDEX/KEY (one tensor every prompt holds, once as */KEY), the
    prompts in the metadata; written to a temporary name and renamed, so a reader (or another process writing the
    same file) never sees half."""
    from safetensors.torch import save_file

    first = encoded[prompts[0]]
    shared = {k for k, v in first.items() if all(encoded[p][k] is v for p in prompts)}
    named = {f"{SHARED}/{k}": first[k] for k in shared}
    named.update({f"{i}/{k}": v for i, p in enumerate(prompts) for k, v in encoded[p].items() if k not in shared})
    tensors = {name: v.detach().cpu().contiguous() for name, v in named.items()}
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"prompts": json.dumps(prompts)})
    tmp.replace(file)


def load_embeddings(file: Path) -> dict[str, dict[str, torch.Tensor]] | None:
    """prompt -> its conditioning as saved, or None where the file is missing or unreadable (then encoded anew)."""
    from safetensors import safe_open

    if not file.is_file():
        return None
    try:
        with safe_open(str(file), framework="pt") as f:
            prompts = json.loads(f.metadata()["prompts"])
            out: dict[str, dict[str, torch.Tensor]] = {p: {} for p in prompts}
            for name in f.keys():
                index, key = name.split("/", 1)
                tensor = f.get_tensor(name)
                for p in prompts if index == SHARED else [prompts[int(index)]]:
                    out[p][key] = tensor
    except Exception:  # a truncated or foreign file: encode again and overwrite it
        return None
    return out if all(out.values()) else None


def load_text_encoders_on_cpu(path: str, names: list[str], dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The pipeline's text encoders, each loaded by its own class as the pipeline would, onto the CPU."""
    import diffusers
    import transformers
    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(path)
    libraries = {"diffusers": diffusers, "transformers": transformers}
    out = {}
    for name in names:
        library, class_name = index[name]
        module = getattr(libraries[library], class_name).from_pretrained(path, subfolder=name, dtype=dtype)
        out[name] = module.requires_grad_(False).eval()
    return out
