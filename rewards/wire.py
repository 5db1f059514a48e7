"""The reward server's wire format: safetensors bytes, never pickles.

A request body holds one tensor `images`, uint8 [N, H, W, 3], and in the safetensors header's
string metadata `prompts` (a JSON list of N strings) and `metadata` (JSON: null or a list of
N objects). A reply holds one tensor `scores`, float32 [N] or [N, K], exactly as the reward
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
    pixels = torch.from_numpy(to_uint8(images)).contiguous()
    return save({"images": pixels}, metadata={"prompts": json.dumps(list(prompts)), "metadata": meta, "protocol": str(PROTOCOL)})


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
    return images, prompts, metadata


def encode_scores(scores: torch.Tensor) -> bytes:
    return save({"scores": scores.detach().float().cpu().contiguous()})


def decode_scores(body: bytes) -> torch.Tensor:
    scores = load(body).get("scores")
    if scores is None:
        raise ValueError("the reply holds no tensor 'scores'")
    return scores
