"""The text default on the CPU: held-out exact-match gain of RLVR after a wall-clock budget, beside
supervised training on the true answers for the same budget, and the allocators at equal rollouts.

    python scripts/bench_text.py --minutes 10 --seeds 0 1 2          # RL (uniform), SFT, VADE, successive elimination
    python scripts/bench_text.py --minutes 10 --seeds 0 --parts rl   # one part
    python scripts/bench_text.py --smoke                             # the parts' code path in seconds, measuring nothing

Every run starts from the shipped checkpoint (builtin:add) and is judged by greedy exact match on
the 500 held-out problems, overall and per operand length. RL is `flowrl train configs/text_add.yaml`
with trainer.max_minutes; SFT is next-token cross-entropy on `a+b=` -> the 6-digit sum and <eos>
(batch 256, AdamW, the RL run's learning rate unless --sft-lr), for the same minutes. The allocators
run the uniform seed-0 run's iteration count, so all three spend the same rollouts; the table
gives their held-out gains and fractions of zero-variance groups.

`--parts trl` trains the same checkpoint with TRL's GRPOTrainer (`pip install -e .[trl]`; not a
dependency of flowrl) on the same training pool, group size, prompts per step, learning rate,
clip range, token-mean loss (TRL's "dapo"), temperature, completion length, gradient clipping and
minutes, one optimizer step per generation batch, and prints its held-out gain and completions per
minute beside flowrl's as ratios. Both count minutes and completions inside their training loops.
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
# --smoke: one iteration of 2 prompts x 2 per RL run, one SFT step of 8 problems, every 32nd held-out problem judged
SMOKE = ["data.prompts_per_iteration=2", "data.group_size=2", "trainer.iterations=1"]
JUDGED = slice(None)  # the held-out problems judged (--smoke: a sixteenth of them)


def held_out_exact_match(policy: CausalLMPolicy) -> dict[str, float]:
    return exact_match_by_bucket(policy.model, policy.tokenizer, held_out()[JUDGED])


def rl(seed: int, minutes: float, out: Path, overrides: list[str], iterations: int | None = None) -> dict:
    # the measured minutes end the run (trainer.max_minutes), not the preset's budget plan
    extra = [f"trainer.seed={seed}", "run.progress=false", "run.checkpoint_every=0", "trainer.budget_minutes=0"]
    extra += [f"trainer.iterations={iterations}"] if iterations else ["trainer.iterations=100000", f"trainer.max_minutes={minutes}"]
    cfg = load_text_config(CONFIG, [*extra, *overrides])
    trainer = TextTrainer(cfg, run_dir=out)
    start = time.perf_counter()
    history = trainer.train()
    seconds = time.perf_counter() - start
    return {"iterations": len(history), "minutes": seconds / 60, "rollouts": sum(r["samples"] for r in history),
            "zero_variance": statistics.mean(r["zero_variance_fraction"] for r in history),
            "held_out": held_out_exact_match(trainer.policy)}


def trl_grpo(seed: int, minutes: float, out: Path) -> dict:
    """TRL's GRPOTrainer on the RL config's settings, stopped after `minutes` of training."""
    try:
        import trl
    except ImportError:
        raise SystemExit("--parts trl needs TRL: pip install -e .[trl]") from None
    from datasets import Dataset
    from transformers import TrainerCallback

    from flowrl.text.data import load_prompt_set
    from rewards.text import exact_match

    cfg = load_text_config(CONFIG, [f"trainer.seed={seed}"])
    d, g, lo, t = cfg.data, cfg.generation, cfg.loss, cfg.trainer
    if lo.aggregation != "token_mean" or t.kl_beta or lo.clip_low != lo.clip_high or t.inner_epochs != 1:
        raise SystemExit("the TRL side-by-side maps only the default's loss: token_mean, no KL, a symmetric clip, one inner epoch")
    pool = load_prompt_set(cfg, d.split)
    dataset = Dataset.from_dict({"prompt": pool.prompts, **{k: list(v) for k, v in pool.columns.items()}})
    policy = CausalLMPolicy.from_config(cfg.model)
    batch = d.prompts_per_iteration * d.group_size

    def exact_match_reward(prompts, completions, answer, **_):
        return exact_match(prompts, completions, answer)

    class Budget(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds = time.perf_counter() - self.start
            control.should_training_stop = self.seconds >= minutes * 60

    args = trl.GRPOConfig(
        output_dir=str(out), seed=seed, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        logging_steps=50, disable_tqdm=True, gradient_checkpointing=False, disable_dropout=True, max_steps=10**6,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=t.inner_epochs,
        num_generations=d.group_size, max_completion_length=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
        top_k=0, learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, loss_type="dapo", epsilon=lo.clip_low, beta=0.0,
        scale_rewards=cfg.advantage.std, mask_truncated_completions=lo.overlong_mask)
    budget = Budget()
    trainer = trl.GRPOTrainer(model=policy.model, reward_funcs=[exact_match_reward], args=args, train_dataset=dataset,
                              processing_class=policy.tokenizer, callbacks=[budget])
    trainer.train()
    policy.model = trainer.model.eval()
    steps = trainer.state.global_step
    return {"version": trl.__version__, "steps": steps, "rollouts": steps * batch, "minutes": budget.seconds / 60,
            "held_out": held_out_exact_match(policy)}


def sft(seed: int, minutes: float, lr: float, batch: int = 256, max_steps: int = 0) -> dict:
    cfg = load_text_config(CONFIG, [f"trainer.seed={seed}"])
    policy = CausalLMPolicy.from_config(cfg.model)
    model = policy.model.train()
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    stream, steps, start = train_stream(seed=100 + seed), 0, time.perf_counter()
    while time.perf_counter() - start < minutes * 60 and not (max_steps and steps >= max_steps):
        ids, mask, pos, labels = supervised_batch(policy.tokenizer, [next(stream) for _ in range(batch)])
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
    ap.add_argument("--parts", nargs="+", default=["rl", "sft", "allocators"], choices=["rl", "sft", "allocators", "trl"])
    ap.add_argument("--sft-lr", type=float, default=0.0, help="SFT's learning rate; 0: the RL config's trainer.lr")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--smoke", action="store_true", help="the parts' code path in seconds, measuring nothing: one seed, one "
                    "iteration of 2 prompts x 2 per RL run, one SFT step of 8 problems, every 32nd held-out problem judged")
    a = ap.parse_args(argv)
    global JUDGED
    small = []
    if a.smoke:
        a.seeds, small, JUDGED = a.seeds[:1], SMOKE, slice(None, None, 32)
    from flowrl.runtime.budget import machine_name

    base = held_out_exact_match(CausalLMPolicy.from_config(load_text_config(CONFIG).model))
    print(f"machine: {machine_name()}, torch threads {torch.get_num_threads()}")
    print(f"base (builtin:add): held-out exact match {base['all']:.3f} ({' '.join(f'{b}:{base[b]:.2f}' for b in map(str, BUCKETS))})")
    results: dict = {"base": base, "rl": {}, "sft": {}, "allocators": {}, "trl": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if "rl" in a.parts:
            for seed in a.seeds:
                r = rl(seed, a.minutes, Path(tmp) / f"rl{seed}", small)
                results["rl"][seed] = r
                print(f"RL seed {seed}: {r['iterations']} iterations ({r['rollouts']} rollouts) in {r['minutes']:.1f} min; "
                      f"held-out {r['held_out']['all']:.3f} (gain {r['held_out']['all'] - base['all']:+.3f}); "
                      f"zero-variance groups {r['zero_variance']:.2f}", flush=True)
            gains = [r["held_out"]["all"] - base["all"] for r in results["rl"].values()]
            print(f"RL mean gain {statistics.mean(gains):+.3f} over {len(gains)} seed(s) (goal +0.15)")
        if "sft" in a.parts:
            lr = a.sft_lr or load_text_config(CONFIG).trainer.lr
            s = sft(a.seeds[0], a.minutes, lr, *((8, 1) if a.smoke else ()))
            results["sft"][a.seeds[0]] = s
            print(f"SFT seed {a.seeds[0]} (lr {lr:g}): {s['steps']} steps in {s['minutes']:.1f} min; held-out {s['held_out']['all']:.3f} "
                  f"(gain {s['held_out']['all'] - base['all']:+.3f})", flush=True)
        if "allocators" in a.parts:
            uniform = results["rl"].get(a.seeds[0]) or rl(a.seeds[0], a.minutes, Path(tmp) / "uniform", small)
            results["allocators"]["uniform"] = uniform
            for kind in ("vade", "successive_elimination"):
                r = rl(a.seeds[0], a.minutes, Path(tmp) / kind, [*small, f"allocator.kind={kind}"], iterations=uniform["iterations"])
                results["allocators"][kind] = r
            print(f"allocators at {uniform['rollouts']} rollouts each (seed {a.seeds[0]}):")
            for kind, r in results["allocators"].items():
                ratio = r["zero_variance"] / max(uniform["zero_variance"], 1e-9)
                print(f"  {kind:<24} zero-variance groups {r['zero_variance']:.3f} ({ratio:.2f}x uniform); held-out gain "
                      f"{r['held_out']['all'] - base['all']:+.3f}; {r['minutes']:.1f} min", flush=True)
        if "trl" in a.parts:
            for seed in a.seeds:
                ours = results["rl"].get(seed) or rl(seed, a.minutes, Path(tmp) / f"rl{seed}", small)
                results["rl"][seed] = ours
                r = trl_grpo(seed, a.minutes, Path(tmp) / f"trl{seed}")
                results["trl"][seed] = r
                print(f"TRL {r['version']} GRPOTrainer seed {seed}: {r['steps']} steps ({r['rollouts']} completions) in "
                      f"{r['minutes']:.1f} min; held-out {r['held_out']['all']:.3f} (gain {r['held_out']['all'] - base['all']:+.3f})",
                      flush=True)
            print("flowrl against TRL, same checkpoint, settings and minutes:")
            for seed, r in results["trl"].items():
                ours = results["rl"][seed]
                speed = (ours["rollouts"] / ours["minutes"]) / (r["rollouts"] / r["minutes"])
                print(f"  seed {seed}: held-out gain {ours['held_out']['all'] - base['all']:+.3f} vs {r['held_out']['all'] - base['all']:+.3f}; "
                      f"completions per minute {ours['rollouts'] / ours['minutes']:.0f} vs {r['rollouts'] / r['minutes']:.0f} "
                      f"({speed:.2f}x, goal 1.5x)")
            ours_gain = statistics.mean(results["rl"][s]["held_out"]["all"] for s in results["trl"]) - base["all"]
            trl_gain = statistics.mean(r["held_out"]["all"] for r in results["trl"].values()) - base["all"]
            print(f"  mean held-out gain: flowrl {ours_gain:+.3f}, TRL {trl_gain:+.3f} (goal: flowrl at least TRL's)")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
