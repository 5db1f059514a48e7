#!/usr/bin/env python3
"""Pretrain the editing world's model (builtin:shapes-edit) on shapes-world edits by rectified-flow matching.

    python scripts/pretrain_shapes_edit.py --work runs/pretrain-shapes-edit --stop-at 4000 --threads 2   # the shipped model (resumes)
    python scripts/pretrain_shapes_edit.py --work runs/pretrain-shapes-edit --export flowrl/assets/shapes-edit-kontext

A FLUX.1 Kontext-architecture transformer in pixel space (flowrl/models/shapes_edit.py) learns the target image of
an edit given its source image and instruction, drawn from the editing world's train split (an edit type
uniformly, then an edit of it, then a layout: rewards/shapes_edit_world.py). The loss is SD3's (Esser et al. 2024):
x_sigma = (1 - sigma) x0 + sigma eps on the target's folded pixels, the network predicts v = eps - x0 at the
generated tokens, with the source's tokens (clean, rotary first axis 1) beside them as FluxKontextPipeline puts
them. 10% of the instructions are replaced by "" so classifier-free guidance works; the source always stays.
Every batch is a pure function of (seed, step), so a resumed run continues exactly; an EMA of the weights ships.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pretrain_shapes' training loop
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain_shapes import run_pretraining, sigmas_and_noise, training_arguments  # noqa: E402

from flowrl.models.base import fold_pixels, pack_2x2  # noqa: E402
from flowrl.models.shapes import save_shapes_pipeline  # noqa: E402
from flowrl.models.shapes_edit import build_shapes_edit_pipeline, edit_vocabulary  # noqa: E402
from flowrl.sampling.steps import flow_matching_target, forward_noise  # noqa: E402
from rewards.shapes_edit_world import EDIT_TYPES, edit_split, render_edit  # noqa: E402

IMAGE_SIZE = 32
FOLD = 2  # 32x32 RGB -> 16 channels at 16x16 -> 8x8 tokens of 64 channels
MAX_SEQUENCE_LENGTH = 16  # T5 tokens (the longest instruction is 12 words, plus BOS and EOS)


def _pool(edit_type: str):
    if edit_type not in _POOLS:
        _POOLS[edit_type] = edit_split("train", edit_type)
    return _POOLS[edit_type]


_POOLS: dict = {}


def _pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> folded pixel latents [B, 16, H / 2, W / 2] in [-1, 1]."""
    return fold_pixels(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0, FOLD)


def batch(seed: int, step: int, size: int, drop: float, sigma_sampling: str = "logit_normal", sigma_location: float = 0.0):
    """(targets, sources (folded pixel latents), instructions with "" for dropped conditions, sigmas, noise)."""
    rng = np.random.default_rng([seed, step])
    kinds = rng.integers(0, len(EDIT_TYPES), size=size)
    edits = [_pool(EDIT_TYPES[k])[int(rng.integers(0, len(_pool(EDIT_TYPES[k]))))] for k in kinds]
    pairs = [render_edit(e, rng, IMAGE_SIZE) for e in edits]
    sources, targets = _pixels(np.stack([s for s, _ in pairs])), _pixels(np.stack([t for _, t in pairs]))
    instructions = ["" if rng.random() < drop else e.instruction for e in edits]
    return (targets, sources, instructions, *sigmas_and_noise(seed, step, targets.shape, sigma_sampling, sigma_location))


def edit_flow_loss(pipe, x0, sources, instructions, sigmas, noise):
    """The flow-matching loss at the generated tokens, the source's tokens beside them (FluxKontextPipeline's layout)."""
    embeds, pooled, text_ids = pipe.encode_prompt(prompt=instructions, prompt_2=None, device=x0.device,
                                                  max_sequence_length=MAX_SEQUENCE_LENGTH)
    b, _, h, w = x0.shape
    x = pack_2x2(forward_noise(x0, noise, sigmas.view(-1, 1, 1, 1)))
    ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, x0.dtype)
    source_ids = ids.clone()
    source_ids[:, 0] = 1
    v = pipe.transformer(hidden_states=torch.cat([x, pack_2x2(sources)], dim=1), timestep=sigmas, guidance=None,
                         pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=text_ids,
                         img_ids=torch.cat([ids, source_ids]), return_dict=False)[0][:, : x.shape[1]]
    return torch.nn.functional.mse_loss(v.float(), pack_2x2(flow_matching_target(x0, noise)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_arguments(ap, 5000, "optimizer steps of --batch edits in the schedule (the shipped model: the first 4000 of 5000, "
                       "--stop-at 4000; 0.67-0.75 s a step of 64 on the 2-core dev box, 2 threads)")
    ap.add_argument("--layers", type=int, default=2, help="double-stream (MMDiT) blocks")
    ap.add_argument("--single-layers", type=int, default=4, help="single-stream blocks")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    pipe = build_shapes_edit_pipeline(edit_vocabulary(), num_layers=args.layers, num_single_layers=args.single_layers,
                                      heads=args.heads, head_dim=args.head_dim, seed=args.seed)

    def next_batch(step):
        return batch(args.seed, step, args.batch, args.drop, args.sigmas, args.sigma_location)

    return run_pretraining(args, pipe, next_batch, edit_flow_loss, save_shapes_pipeline, "pretrain shapes-edit")


if __name__ == "__main__":
    sys.exit(main())
