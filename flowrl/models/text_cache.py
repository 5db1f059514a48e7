"""model.text_encoders: where the prompt encoders live, and the run's prompts encoded once on disk.

device  the encoders on the GPU beside the transformer, each prompt encoded when first met (flowrl's
        default, and Flow-GRPO's: its three SD3 encoders stay on the GPU).
cpu     the encoders on the CPU, encoding there; the embeddings then move to the GPU.
cached  every prompt of the run's set (data.prompts or data.prompt_file, the eval prompts, the monitor's;
        each entry carries the family's negative prompt where it guides with one) encoded once by the text
        encoders alone on the device (on the CPU where they do not fit there), into safetensors files of
        SHARD prompts in a directory keyed by the model (path and revision, or a local directory's
        modification time), the prompt set and the encoder settings (model.kind, model.dtype,
        model.max_sequence_length, the negative prompt). The pipeline then loads without its text encoders,
        and each batch's embeddings are read from the files and moved to the device. A prompt outside the set
        (`flowrl sample --prompt`, another eval) is encoded on demand by the encoders loaded on the CPU.
        Flow-Factory's preprocessing does the same (docs/distributed.md, "Prompt encoders off the GPU").

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


def cache_path(path: str, kind: str, dtype: str, max_sequence_length: int, negative: str, prompts: list[str],
               cache_dir: str | None) -> Path:
    """The directory the embeddings of `prompts` (in order) live in, named by a hash of everything they depend on."""
    key = {"format": FORMAT, "model": model_identity(path), "kind": kind, "dtype": dtype,
           "max_sequence_length": max_sequence_length, "negative": negative, "prompts": prompts}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root(cache_dir) / f"{kind}-{digest}"


SHARD = 256  # prompts per file: encoding holds one file's embeddings at a time, and reading opens only the files asked for
SHARED = "*"  # the row of a tensor every prompt of a file shares (a family's negative prompt, `FlowPolicy.negative_once`)
MANIFEST = "prompts.json"  # written last: a directory without it is incomplete


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def save_shard(directory: Path, number: int, prompts: list[str], encoded: dict[str, dict[str, torch.Tensor]]) -> None:
    """One file of SHARD prompts' conditioning, tensors named ROW/KEY (one tensor every prompt holds, once as */KEY);
    written to a temporary name and renamed, so a reader (or another process writing the same file) never sees half."""
    from safetensors.torch import save_file

    first = encoded[prompts[0]]
    shared = {k for k, v in first.items() if all(encoded[p][k] is v for p in prompts)}
    named = {f"{SHARED}/{k}": first[k] for k in shared}
    named.update({f"{i}/{k}": v for i, p in enumerate(prompts) for k, v in encoded[p].items() if k not in shared})
    directory.mkdir(parents=True, exist_ok=True)
    _replace(directory / shard_name(number), lambda tmp: save_file({n: v.detach().cpu().contiguous() for n, v in named.items()},
                                                                    str(tmp)))


def mark_complete(directory: Path, prompts: list[str], shard: int) -> None:
    """The manifest, written once every file is: the prompts in order, `shard` to a file."""
    _replace(directory / MANIFEST, lambda tmp: tmp.write_text(json.dumps({"shard": shard, "prompts": prompts})))


def _replace(file: Path, write) -> None:
    tmp = file.with_name(f".{file.name}.{os.getpid()}")
    write(tmp)
    tmp.replace(file)


class StoredEmbeddings:
    """A complete cache directory: each prompt's conditioning read from its file when asked for, so a prompt set's
    embeddings need not fit in memory (the files stay open, their pages in the OS cache)."""

    def __init__(self, directory: Path, prompts: list[str], shard: int):
        self.directory, self.shard = directory, shard
        self.row = {p: i for i, p in enumerate(prompts)}
        self.files = {n: _open(directory / shard_name(n)) for n in range(-(-len(prompts) // shard))}
        self.shared: dict[tuple[int, str], torch.Tensor] = {}  # each file's shared tensors, read once

    def __contains__(self, prompt: str) -> bool:
        return prompt in self.row

    def get(self, prompt: str) -> dict[str, torch.Tensor]:
        number, row = divmod(self.row[prompt], self.shard)
        f = self.files[number]
        out = {}
        for name in f.keys():
            index, key = name.split("/", 1)
            if index == SHARED:
                if (number, key) not in self.shared:
                    self.shared[number, key] = f.get_tensor(name)
                out[key] = self.shared[number, key]
            elif int(index) == row:
                out[key] = f.get_tensor(name)
        return out


def _open(file: Path):
    from safetensors import safe_open

    return safe_open(str(file), framework="pt")


def load_embeddings(directory: Path) -> StoredEmbeddings | None:
    """The complete cache in `directory`, or None where it is missing, incomplete or unreadable (then encoded anew)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        return StoredEmbeddings(directory, manifest["prompts"], manifest["shard"])
    except Exception:  # no manifest yet, a truncated or foreign file: encode again and overwrite it
        return None


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
