"""The text default on the CPU: held-out exact-match gain of RLVR after a wall-clock budget, beside
supervised training on the true answers for the same budget, and the allocators at equal rollouts.

    python scripts/bench_text.py --minutes 10 --seeds 0 1 2          # RL (uniform), SFT, VADE, successive elimination
    python scripts/bench_text.py --minutes 10 --seeds 0 --parts rl   # one part

Every run starts from the shipped checkpoint (builtin:add) and is judged by greedy exact match on
the 500 held-out problems, overall and per operand length. RL is `flowrl train configs/text_add.yaml`
with trainer.max_minutes; SFT is next-token cross-entropy on `a+b=` -> the 6-digit sum and <eos>
(batch 256, AdamW, the RL run's learning rate unless --sft-lr), for the same minutes. The allocators
run the uniform seed-0 run's iteration count, so all three spend the same rollouts; the table
gives their held-out gains and fractions of zero-variance groups. The side-by-side with TRL's
GRPOTrainer is not part of this script yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flowrl.text.arithmetic import BUCKETS, exact_match_by_bucket, held_out, supervised_batch, train_stream
from flowrl.text.config import load_text_config
from flowrl.text.policy import CausalLMPolicy
from flowrl.text.train import TextTrainer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "text_add.yaml"


def held_out_exact_match(policy: CausalLMPolicy) -> dict[str, float]:
    return exact_match_by_bucket(policy.model, policy.tokenizer, held_out())


def rl(seed: int, minutes: float, out: Path, overrides: list[str], iterations: int | None = None) -> dict:
    extra = [f"trainer.seed={seed}", "run.progress=false", "run.checkpoint_every=0"]
    extra += [f"trainer.iterations={iterations}"] if iterations else ["trainer.iterations=100000", f"trainer.max_minutes={minutes}"]
    cfg = load_text_config(CONFIG, [*extra, *overrides])
    start = time.perf_counter()
    trainer = TextTrainer(cfg, run_dir=out)
    history = trainer.train()
    seconds = time.perf_counter() - start
    return {"iterations": len(history), "minutes": seconds / 60, "rollouts": sum(r["samples"] for r in history),
            "zero_variance": statistics.mean(r["zero_variance_fraction"] for r in history),
            "held_out": held_out_exact_match(trainer.policy)}


def sft(seed: int, minutes: float, lr: float) -> dict:
    cfg = load_text_config(CONFIG, [f"trainer.seed={seed}"])
    policy = CausalLMPolicy.from_config(cfg.model)
    model = policy.model.train()
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    stream, steps, start = train_stream(seed=100 + seed), 0, time.perf_counter()
    while time.perf_counter() - start < minutes * 60:
        ids, mask, pos, labels = supervised_batch(policy.tokenizer, [next(stream) for _ in range(256)])
        model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    model.eval()
    return {"steps": steps, "minutes": (time.perf_counter() - start) / 60, "held_out": held_out_exact_match(policy)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--parts", nargs="+", default=["rl", "sft", "allocators"], choices=["rl", "sft", "allocators"])
    ap.add_argument("--sft-lr", type=float, default=0.0, help="SFT's learning rate; 0: the RL config's trainer.lr")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    from flowrl.train.budget import machine_name

    base = held_out_exact_match(CausalLMPolicy.from_config(load_text_config(CONFIG).model))
    print(f"machine: {machine_name()}, torch threads {torch.get_num_threads()}")
    print(f"base (builtin:add): held-out exact match {base['all']:.3f} ({' '.join(f'{b}:{base[b]:.2f}' for b in map(str, BUCKETS))})")
    results: dict = {"base": base, "rl": {}, "sft": {}, "allocators": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if "rl" in a.parts:
            for seed in a.seeds:
                r = rl(seed, a.minutes, Path(tmp) / f"rl{seed}", [])
                results["rl"][seed] = r
                print(f"RL seed {seed}: {r['iterations']} iterations ({r['rollouts']} rollouts) in {r['minutes']:.1f} min; "
                      f"held-out {r['held_out']['all']:.3f} (gain {r['held_out']['all'] - base['all']:+.3f}); "
                      f"zero-variance groups {r['zero_variance']:.2f}", flush=True)
            gains = [r["held_out"]["all"] - base["all"] for r in results["rl"].values()]
            print(f"RL mean gain {statistics.mean(gains):+.3f} over {len(gains)} seed(s) (goal +0.15)")
        if "sft" in a.parts:
            lr = a.sft_lr or load_text_config(CONFIG).trainer.lr
            s = sft(a.seeds[0], a.minutes, lr)
            results["sft"][a.seeds[0]] = s
            print(f"SFT seed {a.seeds[0]} (lr {lr:g}): {s['steps']} steps in {s['minutes']:.1f} min; held-out {s['held_out']['all']:.3f} "
                  f"(gain {s['held_out']['all'] - base['all']:+.3f})", flush=True)
        if "allocators" in a.parts:
            uniform = results["rl"].get(a.seeds[0]) or rl(a.seeds[0], a.minutes, Path(tmp) / "uniform", [])
            results["allocators"]["uniform"] = uniform
            for kind in ("vade", "successive_elimination"):
                r = rl(a.seeds[0], a.minutes, Path(tmp) / kind, [f"allocator.kind={kind}"], iterations=uniform["iterations"])
                results["allocators"][kind] = r
            print(f"allocators at {uniform['rollouts']} rollouts each (seed {a.seeds[0]}):")
            for kind, r in results["allocators"].items():
                ratio = r["zero_variance"] / max(uniform["zero_variance"], 1e-9)
                print(f"  {kind:<24} zero-variance groups {r['zero_variance']:.3f} ({ratio:.2f}x uniform); held-out gain "
                      f"{r['held_out']['all'] - base['all']:+.3f}; {r['minutes']:.1f} min", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
