"""Pretrain the embedded text model (`builtin:add`) from scratch on 1-5-digit addition.

    python scripts/pretrain_text.py --out flowrl/assets/add-llama
    python scripts/pretrain_text.py --smoke     # the code path in seconds: one step of 8, judged on 16 problems, exported

A ~1M-parameter Llama (flowrl.text.arithmetic.build_model) learns `a+b=` -> the 6-digit sum
and <eos>, with the loss on the answer tokens only (batch 256, AdamW 1e-3, 200 warm-up steps).
From step --eval-from on, every --eval-every steps it measures greedy held-out exact match, and
exports the first checkpoint inside [--low, --high] as a transformers directory (safetensors,
the tokenizer, and pretrain.json with the step and the per-bucket accuracy): a base that RL has
room to improve. Seeded and single-process: the same command on the same machine gives the same
model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch

from flowrl.text.arithmetic import BUCKETS, build_model, build_tokenizer, exact_match_by_bucket, held_out, supervised_batch, train_stream


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="the exported model directory (required but with --smoke, where it defaults to a "
                    "temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=900, help="the most steps to train before giving up")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--eval-from", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--low", type=float, default=0.20)
    ap.add_argument("--high", type=float, default=0.45)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    ap.add_argument("--smoke", action="store_true", help="the code path: one step of 8 problems, judged on 16 held-out problems (every "
                    "32nd) and exported whatever its accuracy")
    a = ap.parse_args(argv)
    if a.out is None and not a.smoke:
        ap.error("--out is required")
    with contextlib.ExitStack() as stack:
        if a.smoke:
            a.out = a.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pretrain_text-smoke-"))) / "model"
            a.steps, a.batch, a.warmup, a.eval_from, a.eval_every, a.low, a.high = 1, 8, 1, 1, 1, 0.0, 1.0
            a.threads = 0  # torch's thread count as it is
        return pretrain(a, held_out()[::32] if a.smoke else held_out())


def pretrain(a, evals) -> int:
    if a.threads:
        torch.set_num_threads(a.threads)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup))
    stream = train_stream(seed=a.seed + 1)
    start = time.perf_counter()
    for step in range(1, a.steps + 1):
        ids, mask, pos, labels = supervised_batch(tokenizer, [next(stream) for _ in range(a.batch)])
        loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step >= a.eval_from and step % a.eval_every == 0:
            em = exact_match_by_bucket(model, tokenizer, evals)
            minutes = (time.perf_counter() - start) / 60
            print(f"step {step}: loss {loss.item():.4f}, held-out exact match {em['all']:.3f} "
                  f"({' '.join(f'{b}:{em[str(b)]:.2f}' for b in BUCKETS)}), {minutes:.1f} min", flush=True)
            if a.low <= em["all"] <= a.high:
                a.out.mkdir(parents=True, exist_ok=True)
                model.save_pretrained(str(a.out), safe_serialization=True)
                tokenizer.save_pretrained(str(a.out))
                info = {"step": step, "seed": a.seed, "held_out_exact_match": em["all"],
                        "per_bucket": {str(b): em[str(b)] for b in BUCKETS}, "minutes": round(minutes, 2), "threads": a.threads,
                        "parameters": sum(p.numel() for p in model.parameters())}
                (a.out / "pretrain.json").write_text(json.dumps(info, indent=1))
                print(f"exported to {a.out}: {json.dumps(info)}")
                return 0
            if em["all"] > a.high:
                print(f"held-out exact match jumped past {a.high} between evaluations; lower --eval-every")
                return 1
    print(f"no checkpoint reached {a.low} in {a.steps} steps")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
