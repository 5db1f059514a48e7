"""The embedded text world: 1-5-digit addition (docs/text.md).

A prompt is `a+b=`; the answer is a+b zero-padded to 6 digits, then the end-of-sequence token.
The difficulty bucket is the longer operand's digit count (1-5). The splits are fixed: the
held-out problems come from their own seed, and the training pool never contains them.

The tokenizer is one token per character over `0-9 + =` plus <pad> and <eos> (14 in all), a
`PreTrainedTokenizerFast` that `AutoTokenizer.from_pretrained` loads from the shipped directory.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

BUCKETS = (1, 2, 3, 4, 5)
# builtin:add_wide, the harder pool: operands of up to 7 digits, from trivial to far beyond what the
# shipped model learned (its pretraining never saw more than 5 digits; sums of 7 reach 8 digits)
WIDE_BUCKETS = (1, 2, 3, 4, 5, 6, 7)
ANSWER_DIGITS = 6
CHARS = "0123456789+="
PAD, EOS = "<pad>", "<eos>"
TRAIN_SEED, HELD_OUT_SEED = 1, 2
# bucket 1 has only 100 problems (0-9 + 0-9): 40 are held out, 60 stay trainable; 115 of each other bucket
HELD_OUT_PER_BUCKET = {1: 40, 2: 115, 3: 115, 4: 115, 5: 115, 6: 115, 7: 115}


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return f"{self.a + self.b:0{ANSWER_DIGITS}d}"  # zero-padded to 6 digits; longer sums keep all theirs

    @property
    def bucket(self) -> int:
        return max(len(str(self.a)), len(str(self.b)))

    def row(self) -> dict:
        """A dataset row: the prompt and the columns rewards and evaluation read."""
        return {"prompt": self.prompt, "answer": self.answer, "bucket": self.bucket}


def draw(rng: random.Random, bucket: int) -> Problem:
    """Operands of at most `bucket` digits, at least one of exactly `bucket`."""
    def operand(digits: int) -> int:
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    long_one = operand(bucket)
    other = operand(rng.randint(1, bucket))
    return Problem(long_one, other) if rng.random() < 0.5 else Problem(other, long_one)


def held_out(buckets: tuple[int, ...] = BUCKETS) -> list[Problem]:
    """The fixed held-out problems of `buckets`, drawn in bucket order from their own seed (the
    wide world's first five buckets are the default's held-out problems)."""
    rng = random.Random(HELD_OUT_SEED)
    out, seen = [], set()
    for bucket in buckets:
        count = 0
        while count < HELD_OUT_PER_BUCKET[bucket]:
            p = draw(rng, bucket)
            if p not in seen:
                seen.add(p)
                out.append(p)
                count += 1
    return out


def train_stream(seed: int = TRAIN_SEED, buckets: tuple[int, ...] = BUCKETS):
    """An endless stream of training problems, buckets uniform, never a held-out one."""
    excluded = set(held_out(buckets))
    rng = random.Random(seed)
    while True:
        p = draw(rng, rng.choice(buckets))
        if p not in excluded:
            yield p


def train_pool(size: int = 2000, seed: int = TRAIN_SEED, buckets: tuple[int, ...] = BUCKETS) -> list[Problem]:
    """The fixed pool RL samples its prompts from."""
    stream, out, seen = train_stream(seed, buckets), [], set()
    while len(out) < size:
        p = next(stream)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def build_tokenizer():
    """One token per character; left padding (prompts of different lengths end together)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")


def build_model(tokenizer, seed: int = 0):
    """The ~1M-parameter Llama the default trains: hidden 128, 4 layers, 4 heads, FFN 512, tied
    embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=True,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(cfg)


def supervised_batch(tokenizer, problems: list[Problem]):
    """Prompt + answer + <eos>, left-padded, labels only on the answer and <eos> (pretraining and
    the SFT baseline): (input_ids, attention_mask, position_ids, labels)."""
    import torch

    from flowrl.text.generate import positions_of

    texts = [p.prompt + p.answer for p in problems]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids = torch.cat([enc["input_ids"], torch.full((len(texts), 1), tokenizer.eos_token_id)], 1)
    mask = torch.cat([enc["attention_mask"], torch.ones(len(texts), 1, dtype=torch.long)], 1)
    labels = torch.full_like(ids, -100)
    answer = ANSWER_DIGITS + 1
    labels[:, -answer:] = ids[:, -answer:]
    return ids, mask, positions_of(mask), labels


def exact_match_by_bucket(model, tokenizer, problems: list[Problem]) -> dict[str, float]:
    """Greedy exact match overall ("all") and per bucket ("1" .. "5")."""
    import torch

    from flowrl.text.generate import generate

    was_training = model.training
    model.eval()
    g = generate(model, tokenizer, [p.prompt for p in problems], [0] * len(problems), max_new_tokens=ANSWER_DIGITS + 2,
                 temperature=0.0)
    model.train(was_training)
    right = torch.tensor([t == p.answer for t, p in zip(g.texts, problems)], dtype=torch.float)
    buckets = torch.tensor([p.bucket for p in problems])
    return {"all": float(right.mean()), **{str(b): float(right[buckets == b].mean()) for b in BUCKETS}}
