#!/usr/bin/env python3
"""Pretrain the embedded default model on the shapes world by rectified-flow matching.

    python scripts/pretrain_shapes.py --work runs/pretrain-shapes --steps 9000 --threads 2   # the shipped model
    python scripts/pretrain_shapes.py --work runs/pretrain-shapes --steps 9000 --threads 2   # resumes
    python scripts/pretrain_shapes.py --work runs/pretrain-shapes --export flowrl/assets/shapes-sd3
    python scripts/pretrain_shapes.py --work runs/finetune --init builtin:shapes --sigmas uniform --steps 2000
    python scripts/pretrain_shapes.py --work runs/relations --category-weights 1 1 1 3 --sigma-location 1.0
        # position prompts half of the draws, and more draws at high noise: a model that conditions
        # on the relation word (the shipped one does not; scripts/probe_relations.py, BENCHMARKS.md)

Loss (Esser et al. 2024, SD3): x_sigma = (1 - sigma) x0 + sigma eps, the network predicts
v = eps - x0, sigma ~ logit-normal(0, 1) or uniform(0, 1) (`--sigmas`); x0 is the rendered image
in [-1, 1] (pixel space). Logit-normal rarely draws sigma > 0.85 (4% of draws), where a 32x32
pixel image likely decides its layout (how many objects and where); uniform spends 15% there.
The transformer (adaLN-Zero initialisation, Peebles & Xie 2023) and both text encoders train
from random weights; 10% of the prompts are replaced by "" so classifier-free guidance works. Every batch is a pure function of
(seed, step), so a resumed run continues exactly; an EMA of the weights is what ships.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from flowrl.core.lr_schedule import lr_factor
from flowrl.models.shapes import build_shapes_pipeline, save_shapes_pipeline
from flowrl.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from flowrl.runtime.ema import EMA
from flowrl.sampling.steps import flow_matching_target, forward_noise
from rewards.shapes_world import CATEGORIES, all_prompts, category_probabilities, render, sample_prompts


def vocabulary() -> list[str]:
    return sorted({w for p in all_prompts() for w in p.split()})


SIGMA_SAMPLING = ("logit_normal", "uniform")


def batch(seed: int, step: int, size: int, image_size: int, drop: float, sigma_sampling: str = "logit_normal",
          sigma_location: float = 0.0, category_weights: list[float] | None = None):
    """(images [B, 3, H, W] in [-1, 1], prompts with "" for dropped conditions, sigmas, noise)."""
    rng = np.random.default_rng([seed, step])
    prompts = sample_prompts(size, rng, split="train", category_weights=category_weights)
    images = np.stack([render(p, rng, image_size) for p in prompts])
    x0 = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    conditioned = ["" if rng.random() < drop else p for p in prompts]
    return (x0, conditioned, *sigmas_and_noise(seed, step, x0.shape, sigma_sampling, sigma_location))


def sigmas_and_noise(seed: int, step: int, shape, sigma_sampling: str = "logit_normal", sigma_location: float = 0.0):
    """A batch's training sigmas [B] and noise (`shape`), a pure function of (seed, step)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if sigma_sampling == "logit_normal":
        sigmas = torch.sigmoid(torch.randn(shape[0], generator=gen) + sigma_location)
    else:
        sigmas = torch.rand(shape[0], generator=gen)
    return sigmas, torch.randn(shape, generator=gen)


def learning_rate(step: int, total: int, peak: float, warmup: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * lr_factor("cosine", step - warmup, total - warmup))


def trainable(pipe) -> dict[str, torch.nn.Parameter]:
    named = {}
    for prefix, module in (("transformer", pipe.transformer), ("text_encoder", pipe.text_encoder), ("text_encoder_2", pipe.text_encoder_2)):
        module.requires_grad_(True).train()
        named.update({f"{prefix}.{n}": p for n, p in module.named_parameters()})
    return named


def flow_loss(pipe, x0, prompts, sigmas, noise):
    embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=x0.device,
                                              do_classifier_free_guidance=False, max_sequence_length=0)
    x = forward_noise(x0, noise, sigmas.view(-1, 1, 1, 1))
    v = pipe.transformer(hidden_states=x, timestep=sigmas * 1000.0, encoder_hidden_states=embeds,
                         pooled_projections=pooled, return_dict=False)[0]
    return torch.nn.functional.mse_loss(v.float(), flow_matching_target(x0, noise))


def training_arguments(ap: argparse.ArgumentParser, steps: int, steps_help: str) -> None:
    """The options every pretraining script of a built-in model shares (this one's and pretrain_shapes_edit.py's)."""
    ap.add_argument("--work", required=True, help="checkpoint directory (resumed when it holds one)")
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--stop-at", type=int, default=None, metavar="N",
                    help="stop after step N of the --steps schedule (its learning rate still decays over --steps)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--drop", type=float, default=0.1, help="condition dropout for classifier-free guidance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sigmas", choices=SIGMA_SAMPLING, default="logit_normal", help="how training sigmas are drawn")
    ap.add_argument("--sigma-location", type=float, default=0.0,
                    help="mean of the logit-normal sigma draws (> 0 trains more at high noise, where the layout forms)")
    ap.add_argument("--device", default="cpu",
                    help="torch device; the batches are drawn on the CPU either way, so a run's data does not depend on it")
    ap.add_argument("--checkpoint-every", type=int, default=250)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--export", metavar="DIR", help="write the EMA weights as a pipeline directory and exit")


def run_pretraining(args, pipe, next_batch, loss_of, export, desc: str) -> int:
    """Train `pipe`'s transformer and text encoders by `loss_of(pipe, batch)` on `next_batch(step)` (tensors on the
    CPU, moved to args.device here), resuming from args.work's latest checkpoint; with args.export, `export(pipe,
    directory)` writes the EMA weights instead. AdamW, linear warm-up then cosine to 5%, gradients clipped at 1,
    an EMA with a warmed-up decay, a checkpoint every args.checkpoint_every steps."""
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe.to(args.device)
    params = trainable(pipe)
    optimizer = torch.optim.AdamW(params.values(), lr=args.lr, weight_decay=0.0)
    ema = EMA(params, args.ema)
    work = Path(args.work)
    ckpts = work / "checkpoints"
    step = 0
    latest = latest_checkpoint(ckpts)
    if latest is not None:
        state = load_checkpoint(latest)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state["params"][n])
        optimizer.load_state_dict(state["optimizer"])
        ema.shadow = {n: t.float().to(args.device) for n, t in state["ema"].items()}
        step = state["state"]["iteration"]
        print(f"resumed from {latest} at step {step}", file=sys.stderr)

    if args.export:
        with ema.swapped_in(params):
            out = export(pipe, args.export)
        size = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file()) / 1e6
        print(f"exported the EMA weights of step {step} to {out} ({size:.1f} MB)")
        return 0

    work.mkdir(parents=True, exist_ok=True)
    (work / "args.json").write_text(json.dumps(vars(args), indent=1))
    log = (work / "loss.jsonl").open("a")
    last = min(args.steps, args.stop_at or args.steps)
    bar = tqdm(total=last, initial=step, desc=desc, unit="step", disable=args.quiet)
    t0, seen, running = time.time(), 0, None
    while step < last:
        batch_ = [t.to(args.device) if isinstance(t, torch.Tensor) else t for t in next_batch(step)]
        for g in optimizer.param_groups:
            g["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        loss = loss_of(pipe, *batch_)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        optimizer.step()
        # warm-up of the EMA decay, so early weights do not dominate a short run
        ema.decay = min(args.ema, (1 + step) / (10 + step))
        ema.update(params)
        step += 1
        seen += args.batch
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{running:.4f}", img_s=f"{seen / (time.time() - t0):.0f}")
        if step % 50 == 0:
            log.write(json.dumps({"step": step, "loss": running, "lr": optimizer.param_groups[0]["lr"],
                                  "elapsed_s": time.time() - t0}) + "\n")
            log.flush()
        if step % args.checkpoint_every == 0 or step == last:
            save_checkpoint(ckpts, step, params, optimizer.state_dict(), ema.shadow, {"loss": running})
    bar.close()
    print(f"done: {step} steps, smoothed loss {running}; export with --export DIR", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_arguments(ap, 9000, "optimizer steps of --batch images (9000 x 64: 56 minutes on the 2-core dev box, 2 threads)")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--zero-init", action=argparse.BooleanOptionalAction, default=True,
                    help="DiT's adaLN-Zero: every block starts as the identity and the output as zero (default; "
                         "in 5500 steps it reached 0.188 held-out strict against 0.080 without; BENCHMARKS.md)")
    ap.add_argument("--category-weights", type=float, nargs=len(CATEGORIES), metavar="W",
                    help=f"how often each category ({', '.join(CATEGORIES)}) is drawn, relative (default: equally)")
    ap.add_argument("--init", metavar="DIR", help="start from a pipeline directory or builtin:shapes (fine-tuning) instead of random weights")
    args = ap.parse_args(argv)
    if args.category_weights is not None:
        try:  # the world owns the check; here it is a usage error (one line, exit 2)
            category_probabilities(args.category_weights)
        except ValueError as e:
            ap.error(f"--category-weights: {e}")

    torch.manual_seed(args.seed)
    if args.init:
        from diffusers import StableDiffusion3Pipeline

        from flowrl.models.base import absent_components, resolve_model_path

        path = resolve_model_path(args.init)
        pipe = StableDiffusion3Pipeline.from_pretrained(path, **absent_components(path))
    else:
        pipe = build_shapes_pipeline(vocabulary(), image_size=args.image_size, num_layers=args.layers, heads=args.heads,
                                     head_dim=args.head_dim, seed=args.seed, zero_init=args.zero_init)

    def next_batch(step):
        return batch(args.seed, step, args.batch, args.image_size, args.drop, args.sigmas, args.sigma_location,
                     args.category_weights)

    return run_pretraining(args, pipe, next_batch, flow_loss, save_shapes_pipeline, "pretrain shapes")


if __name__ == "__main__":
    sys.exit(main())
