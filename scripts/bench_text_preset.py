"""Two iterations of the Qwen2.5-0.5B GSM8K text preset at the model's real size, with random
weights: seconds per iteration and peak GPU memory.

    python scripts/bench_text_preset.py               # on a CUDA machine (scripts/gpu_checks.sh text_preset)
    python scripts/bench_text_preset.py --cpu-smoke   # the same code path with a tiny Qwen2, no reading

Nothing is downloaded: a Qwen2ForCausalLM with Qwen2.5-0.5B's config (494M parameters, its
151,936-row embedding included) is saved with random weights beside flowrl's one-character
tokenizer with a chat template (ids it lacks decode to nothing), and the prompts are a
GSM8K-shaped JSONL (question, '#### N' answer). The preset trains as written (bf16, its group of
16 x 16, clip-higher, overlong masking, the numeric checker) but with --max-new-tokens (a random
model never ends a completion, so every row runs to the cap). The reading is the second
iteration's seconds and torch.cuda.max_memory_allocated, printed and appended to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import append_result, use_cuda  # noqa: E402

PRESET = "qwen25_05b_gsm8k_1gpu"
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)


def build_model(path: Path, tiny: bool) -> int:
    """Save the random model and the tokenizer to `path`; returns the model's parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flowrl.text.arithmetic import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    sizes = dict(QWEN25_05B)
    if tiny:
        sizes.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**sizes, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).to(torch.bfloat16)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny Qwen2 on the CPU: the code path, no reading")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="append the reading as one JSON line")
    a = ap.parse_args(argv)
    cuda = use_cuda("bench_text_preset", a.cpu_smoke)
    if cuda is None:
        return 0
    from flowrl.cli import main as flowrl

    with tempfile.TemporaryDirectory(prefix="bench_text_preset-") as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "model"
        params = build_model(model_dir, tiny=not cuda)
        data = tmp / "gsm8k.jsonl"
        data.write_text("".join(json.dumps({"question": f"What is {a} plus {a}?", "answer": f"{a} + {a}\n#### {2 * a}"}) + "\n"
                                for a in range(64)))
        size = [] if cuda else ["data.prompts_per_iteration=2", "data.group_size=2", "trainer.micro_batch=2"]
        tokens = a.max_new_tokens if cuda else 4
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        run = tmp / "run"
        code = flowrl(["train", PRESET, f"model.path={model_dir}", f"data.source={data}", f"model.device={'cuda' if cuda else 'cpu'}",
                       f"generation.max_new_tokens={tokens}", "trainer.iterations=2", "run.progress=false",
                       "run.checkpoint_every=0", *size, "--run-dir", str(run)])
        if code != 0:
            return code
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out = {"check": "text_preset", "preset": PRESET, "params": params, "max_new_tokens": tokens,
           "seconds_per_iteration": rows[-1]["time_iteration"], "first_iteration_s": rows[0]["time_iteration"],
           "completions_per_iteration": rows[-1]["samples"], "cpu_smoke": not cuda}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(out))
    append_result(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
