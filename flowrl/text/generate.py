"""Batched sampling from a causal LM with its KV cache, reproducible per sample: each row draws
its noise from its own generator (seeded by sample, as the image rollouts are), never from the
global RNG, so a completion does not depend on the rows it was batched with.

Behaviour log-probs are recorded at generation from fp32 logits under the sampling temperature,
the same function `sequence_log_probs` computes in training, so the first ratio is 1.

A group's completions share their prompt, so both generation and training run each distinct
prompt through the network once and copy its KV cache to the group's rows (differentiably in
training: the gradient of every completion still reaches the prompt's activations). With a
prompt of P tokens, completions of T and groups of K, a training forward processes P + K*T
tokens per group instead of K*(P + T).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Generation:
    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] bool
    completion_ids: torch.Tensor  # [N, T] right-padded with pad
    completion_mask: torch.Tensor  # [N, T] bool: the completion's tokens, its end token included
    log_probs: torch.Tensor  # [N, T] fp32 behaviour log-probs (0 outside the mask)
    truncated: torch.Tensor  # [N] bool: stopped by max_new_tokens, not by an end token or stop string
    texts: list[str]  # the decoded completions, special tokens and anything after a stop string dropped

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(1)

    def select(self, index: torch.Tensor) -> Generation:
        """The completions at `index` (a row may repeat)."""
        return Generation(self.prompt_ids[index], self.prompt_mask[index], self.completion_ids[index],
                          self.completion_mask[index], self.log_probs[index], self.truncated[index],
                          [self.texts[i] for i in index.tolist()])


def tempered_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) in fp32 (T = 0, greedy, scores with T = 1)."""
    return torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), -1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits outside the smallest set of tokens whose probability reaches top_p set to -inf."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, -1)
    drop = probs.cumsum(-1) - probs > top_p  # tokens after the nucleus is already full
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], seeds: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, stop: tuple[str, ...] = (), batch_size: int = 256) -> Generation:
    parts = [_generate(model, tokenizer, prompts[i : i + batch_size], seeds[i : i + batch_size], max_new_tokens,
                       temperature, top_p, stop) for i in range(0, len(prompts), batch_size)]
    return concat(parts, tokenizer.pad_token_id)


def concat(parts: list[Generation], pad: int) -> Generation:
    """Generations of several batches as one: prompts left-padded, completions right-padded."""
    if len(parts) == 1:
        return parts[0]
    wp, wt = max(p.prompt_ids.shape[1] for p in parts), max(p.completion_ids.shape[1] for p in parts)

    def left(x, w, value):
        return torch.nn.functional.pad(x, (w - x.shape[1], 0), value=value)

    def right(x, w, value):
        return torch.nn.functional.pad(x, (0, w - x.shape[1]), value=value)

    return Generation(
        torch.cat([left(p.prompt_ids, wp, pad) for p in parts]), torch.cat([left(p.prompt_mask, wp, False) for p in parts]),
        torch.cat([right(p.completion_ids, wt, pad) for p in parts]), torch.cat([right(p.completion_mask, wt, False) for p in parts]),
        torch.cat([right(p.log_probs, wt, 0.0) for p in parts]), torch.cat([p.truncated for p in parts]),
        [t for p in parts for t in p.texts])


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0 at each row's first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def prefill_shared(model, ids: torch.Tensor, mask: torch.Tensor, inverse: torch.Tensor):
    """Run the distinct prompts `ids` [U, P] once and copy their cache to the rows `inverse` [N]
    points at. Returns the cache of the N rows and their next-token logits [N, V]."""
    out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions_of(mask), use_cache=True)
    cache = out.cache
    inverse = inverse.to(ids.device)
    cache.reorder_cache(inverse)  # an index_select per layer: differentiable
    return cache, out.logits[:, -1].index_select(0, inverse)


def distinct_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, inverse): the first row of each distinct (ids, mask) row, and each row's distinct index."""
    _, inverse = torch.unique(torch.cat([ids, mask.long()], 1), dim=0, return_inverse=True)
    n = len(inverse)
    first = torch.full((int(inverse.max()) + 1 if n else 0,), n, dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(n), reduce="amin")
    return first, inverse


def _generate(model, tokenizer, prompts, seeds, max_new_tokens, temperature, top_p, stop) -> Generation:
    device = next(model.parameters()).device
    index = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    distinct, inverse = list(index), torch.tensor([index[p] for p in prompts], dtype=torch.long)
    enc = tokenizer(distinct, return_tensors="pt", padding=True, add_special_tokens=False)
    distinct_ids, distinct_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    ids, mask = distinct_ids[inverse.to(device)], distinct_mask[inverse.to(device)]
    n = ids.shape[0]
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    tokens = torch.full((n, max_new_tokens), pad, dtype=torch.long)
    log_probs = torch.zeros(n, max_new_tokens)
    alive = torch.ones(n, dtype=torch.bool)
    ended = torch.zeros(n, dtype=torch.bool)
    lengths = torch.zeros(n, dtype=torch.long)
    cache, next_logits = prefill_shared(model, distinct_ids, distinct_mask, inverse)
    full_mask = mask
    for t in range(max_new_tokens):
        choice, lp = sample_tokens(next_logits, temperature, top_p, generators)
        choice = torch.where(alive, choice, torch.full_like(choice, pad))
        tokens[:, t] = choice
        log_probs[:, t] = torch.where(alive, lp, torch.zeros(n))
        lengths += alive.long()
        finished = alive & (choice == eos)
        for i in torch.nonzero(alive & ~finished).flatten().tolist() if stop else ():
            if hits_stop(tokenizer, tokens[i, : t + 1], stop):
                finished[i] = True
        ended |= finished
        alive &= ~finished
        if not bool(alive.any()) or t == max_new_tokens - 1:
            break
        cache, next_logits, full_mask = decode_step(model, choice, full_mask, cache)
    width = int(lengths.max()) if n else 0
    tokens, log_probs = tokens[:, :width], log_probs[:, :width]
    completion_mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    texts = [completion_text(tokenizer, tokens[i, : int(lengths[i])], stop) for i in range(n)]
    return Generation(ids.cpu(), mask.bool().cpu(), tokens, completion_mask, log_probs, ~ended, texts)


def decode_step(model, choice: torch.Tensor, full_mask: torch.Tensor, cache):
    """One token per row [n] through the network on its cache: the next cache, the next-token logits
    [n, V] and the attention mask grown by one column (finished rows' pads are never read)."""
    full_mask = torch.cat([full_mask, torch.ones_like(full_mask[:, :1])], 1)
    out = model(input_ids=choice.unsqueeze(1).to(full_mask.device), attention_mask=full_mask,
                position_ids=positions_of(full_mask)[:, -1:], cache=cache, use_cache=True)
    return out.cache, out.logits[:, -1], full_mask


def sample_tokens(next_logits: torch.Tensor, temperature: float, top_p: float, generators) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [n, V] and its behaviour log-prob (fp32, under the temperature):
    the Gumbel-max trick with each row's own generator (argmax(s + g) ~ softmax(s)); greedy at T = 0."""
    logits = next_logits.float().cpu()
    lp = tempered_log_probs(logits, temperature)
    if temperature > 0:
        scores = top_p_filter(logits / temperature, top_p)
        u = torch.stack([torch.rand(logits.shape[-1], generator=g) for g in generators]).clamp(1e-20, 1.0)
        choice = (scores - torch.log(-torch.log(u))).argmax(-1)
    else:
        choice = logits.argmax(-1)
    return choice, lp.gather(1, choice.unsqueeze(1)).squeeze(1)


def hits_stop(tokenizer, tokens, stop: tuple[str, ...]) -> bool:
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return any(s in text for s in stop)


def completion_text(tokenizer, tokens, stop: tuple[str, ...]) -> str:
    """A completion's text: special tokens dropped, cut at the first stop string."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    cut = min((text.index(s) for s in stop if s in text), default=None)
    return text if cut is None else text[:cut]


@dataclass
class Partial:
    """A completion in progress (APRIL's partial rollouts): its tokens and behaviour log-probs so
    far, the row's own noise generator where it stopped, and the weights' version that drew its
    first token (later tokens are newer)."""

    prompt: str  # as the model reads it (chat template applied)
    seed: int
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    version: int = 0
    ended: bool = False  # an end token or a stop string
    generator: torch.Generator | None = None

    def __post_init__(self):
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(int(self.seed))

    def restart(self, version: int) -> None:
        """Drop what was drawn: the row starts over from its seed with weights of `version`."""
        self.tokens, self.log_probs, self.ended, self.version = [], [], False, version
        self.generator = torch.Generator().manual_seed(int(self.seed))

    def done(self, max_new_tokens: int) -> bool:
        return self.ended or len(self.tokens) >= max_new_tokens


@torch.no_grad()
def continue_generation(model, tokenizer, rows: list[Partial], max_new_tokens: int, temperature: float, top_p: float,
                        stop: tuple[str, ...], enough=None) -> None:
    """Advance the rows that are not done, in lockstep and in place, until each ends or holds
    max_new_tokens tokens, or until `enough(done)` (done: bool [n], the rows finished so far) says
    to stop; a stopped row keeps its tokens, log-probs and generator to continue later. Each row's
    prompt and tokens so far are prefilled together (under the current weights: APRIL recomputes
    the prefix), each distinct one once."""
    active = [r for r in rows if not r.done(max_new_tokens)]
    if not active:
        return
    device = next(model.parameters()).device
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    context = [tokenizer(r.prompt, add_special_tokens=False)["input_ids"] + r.tokens for r in active]
    width = max(len(c) for c in context)
    ids = torch.tensor([[pad] * (width - len(c)) + c for c in context], dtype=torch.long)
    mask = torch.tensor([[False] * (width - len(c)) + [True] * len(c) for c in context])
    first, inverse = distinct_rows(ids, mask)
    cache, next_logits = prefill_shared(model, ids[first].to(device), mask[first].to(device), inverse)
    full_mask = mask.long().to(device)
    alive = torch.ones(len(active), dtype=torch.bool)
    while True:
        choice, lp = sample_tokens(next_logits, temperature, top_p, [r.generator for r in active])
        for i in torch.nonzero(alive).flatten().tolist():
            r = active[i]
            r.tokens.append(int(choice[i]))
            r.log_probs.append(float(lp[i]))
            r.ended = int(choice[i]) == eos or bool(stop and hits_stop(tokenizer, r.tokens, stop))
            alive[i] = not r.done(max_new_tokens)
        if not bool(alive.any()) or (enough is not None and enough(~alive)):
            return
        choice = torch.where(alive, choice, torch.full_like(choice, pad))
        cache, next_logits, full_mask = decode_step(model, choice, full_mask, cache)


def partial_generation(tokenizer, rows: list[Partial], stop: tuple[str, ...]) -> Generation:
    """Finished rows as one Generation: prompts left-padded, completions right-padded."""
    pad = tokenizer.pad_token_id
    enc = tokenizer([r.prompt for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
    width = max(len(r.tokens) for r in rows)
    completion = torch.tensor([r.tokens + [pad] * (width - len(r.tokens)) for r in rows], dtype=torch.long)
    log_probs = torch.tensor([r.log_probs + [0.0] * (width - len(r.tokens)) for r in rows], dtype=torch.float32)
    lengths = torch.tensor([len(r.tokens) for r in rows])
    return Generation(enc["input_ids"], enc["attention_mask"].bool(), completion, torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1),
                      log_probs, torch.tensor([not r.ended for r in rows]), [completion_text(tokenizer, r.tokens, stop) for r in rows])


def sequence_log_probs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                       completion_mask: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs [N, T] of the completions under `model` (fp32 logits, the sampling
    temperature), and the per-token entropy [N, T]. Each distinct prompt runs once (its cache
    shared by its rows), then every completion but its last token runs on that cache."""
    device = next(model.parameters()).device
    first, inverse = distinct_rows(prompt_ids, prompt_mask)
    cache, first_logits = prefill_shared(model, prompt_ids[first].to(device), prompt_mask[first].to(device), inverse)
    logits = first_logits.unsqueeze(1)
    t = completion_ids.shape[1]
    if t > 1:
        mask = torch.cat([prompt_mask, completion_mask[:, :-1]], 1).to(device)
        rest = model(input_ids=completion_ids[:, :-1].to(device), attention_mask=mask.long(),
                     position_ids=positions_of(mask)[:, -(t - 1):], cache=cache, use_cache=True).logits
        logits = torch.cat([logits, rest], 1)
    lp = tempered_log_probs(logits, temperature)
    token_lp = lp.gather(-1, completion_ids.to(device).unsqueeze(-1)).squeeze(-1)
    entropy = -(lp.exp() * lp).sum(-1)
    m = completion_mask.to(device)
    return token_lp * m, entropy.detach() * m
