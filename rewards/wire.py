"""The reward server's wire format: safetensors bytes, never pickles.

A request body holds one tensor `images`, uint8 [N, H, W, 3], and in the safetensors header's
string metadata `prompts` (a JSON list of N strings) and `metadata` (JSON: null or a list of
N objects). Edits (EditPrompts) also carry `sources`, uint8 [N, H, W, 3] at the images' size (and
`references` where every edit has one), and `edits`, a JSON list of N {"instruction", "name"}: the
server rebuilds the EditPrompts, so a reward that compares with the source works remotely too. A reply holds one tensor `scores`, float32 [N] or [N, K], exactly as the reward
returned it (NaN included: the client's MultiReward decides what to do with bad rows).
Errors come back as JSON `{"error": "one sentence"}`.
"""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load, save

from flowrl.errors import UserError

PROTOCOL = 1


def read_header_metadata(body: bytes) -> dict[str, str]:
    """The string metadata of a safetensors blob (the torch loader returns only tensors)."""
    if len(body) < 8:
        raise ValueError("body is shorter than a safetensors header")
    (size,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + size])
    return header.get("__metadata__") or {}


def encode_request(images: torch.Tensor, prompts, metadata=None) -> bytes:
    from rewards.simple import to_uint8

    try:
        meta = json.dumps(metadata)
    except TypeError as exc:
        raise UserError(f"reward metadata must be JSON-serialisable to travel to a reward server ({exc})") from None
    tensors = {"images": torch.from_numpy(to_uint8(images)).contiguous()}
    header = {"prompts": json.dumps(list(prompts)), "metadata": meta, "protocol": str(PROTOCOL)}
    if any(hasattr(p, "instruction") for p in prompts):  # edits: their sources (and references) travel beside them
        from rewards.registry import at_size, source_images

        tensors["sources"] = torch.from_numpy(to_uint8(source_images("remote", prompts, images))).contiguous()
        references = [p.reference_image() for p in prompts]
        if all(r is not None for r in references):
            size = tuple(images.shape[-2:])
            tensors["references"] = torch.from_numpy(to_uint8(torch.stack([at_size(r, size) for r in references]))).contiguous()
        header["edits"] = json.dumps([{"instruction": p.instruction, "name": p.source_name} for p in prompts])
    return save(tensors, metadata=header)


def decode_request(body: bytes) -> tuple[torch.Tensor, list[str], list | None]:
    """-> (images float [N, 3, H, W] in [0, 1], prompts, metadata); ValueError if malformed."""
    header = read_header_metadata(body)
    tensors = load(body)
    pixels = tensors.get("images")
    if pixels is None or pixels.dtype != torch.uint8 or pixels.ndim != 4 or pixels.shape[-1] != 3:
        raise ValueError("the request must hold a uint8 tensor 'images' of shape [N, H, W, 3]")
    prompts = json.loads(header.get("prompts", "null"))
    metadata = json.loads(header.get("metadata", "null"))
    n = pixels.shape[0]
    if n == 0:
        raise ValueError("the request holds no images")
    if not isinstance(prompts, list) or len(prompts) != n or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"the request must hold {n} prompts, one string per image")
    if metadata is not None and (not isinstance(metadata, list) or len(metadata) != n):
        raise ValueError(f"the request's metadata must be null or a list of {n} entries")
    images = pixels.permute(0, 3, 1, 2).float() / 255.0
    if "edits" in header:
        prompts = _edits(json.loads(header["edits"]), tensors, n, tuple(pixels.shape[1:3]))
    return images, prompts, metadata


def _edits(rows, tensors: dict, n: int, size: tuple[int, int]) -> list:
    """The request's EditPrompts, rebuilt from their instructions, names, sources (and references)."""
    from flowrl.models.edit_prompt import EditPrompt

    if not isinstance(rows, list) or len(rows) != n or not all(
            isinstance(r, dict) and isinstance(r.get("instruction"), str) and r["instruction"].strip() and isinstance(r.get("name"), str)
            for r in rows):
        raise ValueError(f"the request's edits must be a list of {n} objects with an instruction and a name")
    images = {}
    for key in ("sources", "references"):
        t = tensors.get(key)
        if t is None:
            continue
        if t.dtype != torch.uint8 or tuple(t.shape) != (n, *size, 3):
            raise ValueError(f"the request's {key} must be a uint8 tensor of shape [{n}, {size[0]}, {size[1]}, 3]")
        images[key] = t.permute(0, 3, 1, 2).float() / 255.0
    if "sources" not in images:
        raise ValueError("the request's edits need a tensor 'sources'")
    references = images.get("references")
    return [EditPrompt(r["instruction"], images["sources"][i], name=r["name"],
                       reference=None if references is None else references[i]) for i, r in enumerate(rows)]


def encode_scores(scores: torch.Tensor) -> bytes:
    return save({"scores": scores.detach().float().cpu().contiguous()})


def decode_scores(body: bytes) -> torch.Tensor:
    scores = load(body).get("scores")
    if scores is None:
        raise ValueError("the reply holds no tensor 'scores'")
    return scores
