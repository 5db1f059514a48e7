"""flowrl.core is modality-free: a toy token-level language model learns through the same
advantage estimators, clipped loss and allocators the image trainer uses. Only torch and
flowrl.core are imported here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flowrl.core.advantages import estimate_advantages
from flowrl.core.allocation import make_allocator, run_stages
from flowrl.core.losses import clipped_policy_loss

V, L = 4, 3  # vocabulary, sequence length
BOS = V  # the previous-token id at position 0
TARGETS = torch.tensor([[0, 1, 2], [3, 2, 1], [1, 1, 0], [2, 0, 3], [0, 3, 3], [2, 2, 1], [3, 0, 0], [1, 3, 2]])


class TinyLM(torch.nn.Module):
    """Autoregressive policy over V tokens: logits(prompt, t, prev) = theta[prompt, t] + W[prev],
    a per-prompt positional table plus a bigram table shared by every prompt."""

    def __init__(self, num_prompts: int):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(num_prompts, L, V))
        self.bigram = torch.nn.Parameter(torch.zeros(V + 1, V))

    def logits(self, prompts: torch.Tensor, t: int, prev: torch.Tensor) -> torch.Tensor:
        return self.theta[prompts, t] + self.bigram[prev]

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        tokens = torch.empty(len(prompts), L, dtype=torch.long)
        prev = torch.full((len(prompts),), BOS)
        for t in range(L):
            probs = torch.softmax(self.logits(prompts, t, prev), -1)
            tokens[:, t] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            prev = tokens[:, t]
        return tokens

    def log_prob(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs [n, L] (teacher forcing)."""
        prev = torch.cat([torch.full((len(prompts), 1), BOS), tokens[:, :-1]], 1)
        out = []
        for t in range(L):
            lp = torch.log_softmax(self.logits(prompts, t, prev[:, t]), -1)
            out.append(lp.gather(1, tokens[:, t : t + 1]).squeeze(1))
        return torch.stack(out, 1)


def reward_channels(prompts: torch.Tensor, tokens: torch.Tensor, channels: int) -> torch.Tensor:
    match = (tokens == TARGETS[prompts]).float()
    if channels == 1:
        return match.mean(1)  # [n]: fraction of tokens right
    return torch.stack([match[:, 0], match[:, 1:].mean(1)], 1)  # [n, 2]: first token, the rest


def policy_step(model, opt, prompts, tokens, rewards, kind, weights=None, inner_steps=2, clip=0.2):
    adv = estimate_advantages(kind, rewards, prompts, weights)
    a = torch.where(adv.mask, adv.advantages, torch.zeros_like(adv.advantages))
    old = model.log_prob(prompts, tokens).detach()  # the sampling policy's log-probs
    for _ in range(inner_steps):
        new = model.log_prob(prompts, tokens)
        loss = clipped_policy_loss(new.flatten(), old.flatten(), a[:, None].expand(-1, L).flatten(), clip).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return adv


def evaluate(model, num_prompts, generator, n=32) -> float:
    prompts = torch.arange(num_prompts).repeat_interleave(n)
    tokens = model.sample(prompts, generator)
    return (tokens == TARGETS[prompts]).float().mean().item()


@pytest.mark.parametrize(
    "kind, channels, weights",
    [
        ("grpo", 1, None),
        ("grpo", 2, torch.tensor([1 / 3, 2 / 3])),  # weighted sum = fraction of tokens right
        ("gdpo", 2, torch.tensor([1 / 3, 2 / 3])),
        ("mc_grpo", 1, None),
        ("rank", 1, None),
    ],
)
def test_token_policy_learns_through_core(kind, channels, weights):
    torch.manual_seed(0)
    num_prompts, group = 4, 8
    model = TinyLM(num_prompts)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    eval_gen = torch.Generator().manual_seed(1)
    start = evaluate(model, num_prompts, eval_gen)
    prompts = torch.arange(num_prompts).repeat_interleave(group)
    for _ in range(100):
        tokens = model.sample(prompts, gen)
        policy_step(model, opt, prompts, tokens, reward_channels(prompts, tokens, channels), kind, weights)
    end = evaluate(model, num_prompts, eval_gen, n=64)
    assert 0.15 < start < 0.35  # uniform over 4 tokens
    assert end > 0.8, (start, end)


def test_allocator_drives_text_policy():
    # VADE over 8 prompts, 4 per iteration, 32 rollouts: the allocator's stages ask for
    # rollouts per prompt, the toy LM produces them, outcomes (>= 2 of 3 tokens right) feed back
    num_prompts = len(TARGETS)
    model = TinyLM(num_prompts)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    alloc = make_allocator("vade", num_prompts=num_prompts, budget=32, prompts_per_iteration=4, seed=0)
    start = evaluate(model, num_prompts, torch.Generator().manual_seed(1))
    seen = torch.zeros(num_prompts, dtype=torch.long)
    for it in range(120):
        batch = []

        def outcome(ids):
            tokens = model.sample(ids, gen)
            batch.append((ids, tokens))
            return reward_channels(ids, tokens, 1) > 0.5

        counts, _ = run_stages(alloc, it, outcome)
        assert int(counts.sum()) == 32
        prompts = torch.cat([i for i, _ in batch])
        tokens = torch.cat([t for _, t in batch])
        rewards = reward_channels(prompts, tokens, 1)
        policy_step(model, opt, prompts, tokens, rewards, "grpo")
        alloc.observe(prompts, rewards > 0.5)
        seen += counts > 0
    end = evaluate(model, num_prompts, torch.Generator().manual_seed(2), n=64)
    assert (seen > 0).all()  # every prompt got trained at some point
    assert end > 0.8, (start, end)
    # the posteriors moved from the prior toward success for the prompts it learned
    assert alloc.stats.mean().mean() > 0.5


def test_core_imports_no_image_stack():
    code = (
        "import sys, flowrl.core, flowrl.core.advantages, flowrl.core.allocation, flowrl.core.losses, "
        "flowrl.core.selection\n"
        "heavy = {'diffusers', 'transformers', 'PIL', 'accelerate', 'peft', 'safetensors', 'omegaconf'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
