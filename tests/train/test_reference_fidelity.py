"""Reference fidelity: each algorithm's loss as its public reference implementation computes it,
written out here from the reference's formulas (never imported from flowrl), on a small batch,
against flowrl's loss and gradient to 1e-6 relative (docs/algorithms.md gives each reference's
settings and flowrl's named variants).

One section per algorithm; every helper and fixture of a section carries its prefix and is used
by that section alone:

- G2RPO (bcmi/Granular-GRPO, FLUX.1-dev): the multi-granularity advantage from rewards
  [prompts, branch steps, granularities, G, reward models], the tails' sigma grids, and the
  clipped loss on the branch transitions, one optimizer step per branch step in increasing order.
- MixGRPO's SDE window (Tencent-Hunyuan/MixGRPO): the window of every iteration (W(l), a shift
  every tau iterations, the roll back) and the loss over the window's steps with its reduction.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch

from flowrl.config import load_config
from flowrl.train.loop import Trainer


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    """|actual - expected| <= rel * max |expected|, elementwise (relative to the tensor's scale; a
    gradient is compared as one vector over every trained weight)."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape
    scale = expected.abs().max().item()
    assert scale > 0
    err = (actual - expected).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} against scale {scale:.3g} (relative {err / scale:.3g})"


def reference_flow_grpo_log_prob(x, v, x_next, sigmas, t: int, eta: float) -> torch.Tensor:
    """The Flow-GRPO SDE step's log-density of x_next, averaged over dimensions, as the FastVideo-based
    references (G2RPO, MixGRPO) write it: std_t = eta sqrt(sigma / (1 - sigma)) with the first sigma
    below 1 in the denominator at sigma = 1, mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2
    (1 - sigma) / (2 sigma)) dt, N(mean, (std_t sqrt(-dt))^2)."""
    sigma, sigma_next, sigma_max = sigmas[t], sigmas[t + 1], sigmas[1]
    dt = sigma_next - sigma
    std_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * torch.sqrt(-dt)
    log_prob = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - torch.log(torch.sqrt(torch.tensor(2 * math.pi)))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def reference_clipped_loss(log_prob, old_log_prob, advantages, clip_range: float, adv_clip: float) -> torch.Tensor:
    """PPO's clipped surrogate as both references write it: advantages clamped to +-adv_clip, the mean
    over the batch of max(-A r, -A clip(r, 1 - c, 1 + c)), r = exp(log_prob - old_log_prob)."""
    a = torch.clamp(advantages, -adv_clip, adv_clip)
    ratio = torch.exp(log_prob - old_log_prob)
    return torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)))


@contextlib.contextmanager
def one_torch_thread():
    """Tiny models run many small ops: one intra-op thread is several times faster than two on a
    busy 2-core machine. The setting is process-wide, so it is restored on the way out."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def single_thread():
    with one_torch_thread():
        yield


def flat_gradient(grads) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads])


def capture_optimizer_steps(trainer: Trainer) -> list[torch.Tensor]:
    """Replace the trainer's optimizer step by a recorder: each step's accumulated gradient (one
    vector over every trained weight) is kept and zeroed and the weights stay as they are, so every
    step can be checked at one point."""
    steps: list[torch.Tensor] = []

    def record() -> float:
        steps.append(flat_gradient(p.grad.detach().clone() for p in trainer.params.values()))
        for p in trainer.params.values():
            p.grad = None
        return 0.0

    trainer.objective.ctx.optimizer_step = record
    return steps


def random_lora_b(trainer: Trainer, seed: int = 0) -> None:
    """LoRA's B starts at zero, which leaves A without gradient: make it small and random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.params.items():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


FIDELITY_COMMON = [
    "run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0", "lora.rank=4", "lora.alpha=8",
    "model.kind=flux", "model.guidance_scale=3.5", "model.height=32", "model.width=32", "sampling.sampler=flow_grpo",
    "sampling.noise_level=0.7", "sampling.schedule=shifted_linear", "sampling.shift=3.0", "objective.kind=grpo",
    "objective.grpo.clip_range=1e-4", "trainer.kl_beta=0", "trainer.inner_epochs=1", "sampling.batch_size=1",
    "run.cpu_processes=1", "trainer.budget_minutes=0", "trainer.max_minutes=0",
]


# =====================================================================================================
# G2RPO (bcmi/Granular-GRPO, fastvideo/train_g2rpo_hps.py and train_g2rpo_hps_clip.py)
# =====================================================================================================
def g2rpo_reference_mgai(rewards: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """The reference's multi-granularity advantage from rewards [prompts, M, L, G, K]: for every
    reward model and granularity, each (prompt, branch step) column is normalised over its G samples,
    (r - mean) / (std + 1e-8) with torch's (unbiased) std; the results are added over granularities,
    then over reward models, and the sum is clamped to +-adv_clip in the loss. Returns [prompts, M, G]."""
    total = torch.zeros(rewards.shape[0], rewards.shape[1], rewards.shape[3], dtype=rewards.dtype)
    for k in range(rewards.shape[4]):
        per_model = torch.zeros_like(total)
        for g in range(rewards.shape[2]):
            r = rewards[:, :, g, :, k]
            per_model += (r - r.mean(dim=-1, keepdim=True)) / (r.std(dim=-1, keepdim=True) + 1e-8)
        total += per_model
    return torch.clamp(total, -adv_clip, adv_clip)


def test_g2rpo_mgai_advantages_match_the_reference():
    from flowrl.train.rollouts.granular import granular_advantages

    P, M, L, G, K = 2, 3, 2, 12, 2
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(P, M, L, G, K, generator=gen) * torch.tensor([0.3, 7.0])  # two reward models on different scales
    rewards[0, 1, :, 5, :] += 40.0  # one outlier sample in every column: its sum of four normalised values is clipped
    rewards[1, 2, 1, :, 0] = 0.5  # one flat column adds nothing (the reference: exactly 0 / 1e-8)
    expected = g2rpo_reference_mgai(rewards.double(), adv_clip=5.0)
    assert expected[0, 1, 5] == 5.0  # the clip is exercised
    flat = rewards.reshape(-1, K)  # (prompt, branch step, granularity, sample) order, as the tails are scored
    got, _, out = granular_advantages(flat, torch.ones(len(flat), dtype=torch.bool), P, M, L, G, torch.ones(K), clip=5.0)
    assert got.shape == (P, M, G) and not out.degenerate.any()
    assert_relative(got, expected)


def g2rpo_reference_tail(k: int, g: int, T: int) -> list[int]:
    """The reference's tail: the schedule sigma[:k + 2] followed by sigma[k + 2::g]; the ODE runs
    from position k + 1 to the end, so the tail visits k + 1, k + 2, k + 2 + g, ..."""
    return [k + 1, *range(k + 2, T + 1, g)]


def test_g2rpo_tail_grids_follow_the_reference():
    from flowrl.sampling.granular import tail_indices

    for T in (6, 16):
        for k in range(T - 1):
            for g in (1, 2, 3):
                ref = g2rpo_reference_tail(k, g, T)
                # flowrl's default: the reference's grid, with one more step to sigma 0 where its stride stops short
                assert tail_indices(k, g, T) == (ref if ref[-1] == T else ref + [T])
                # tail_end x0_prediction: the reference scores x - sigma v at the next-to-last index (an Euler step to 0)
                assert tail_indices(k, g, T, end="x0_prediction") == ref[:-1] + [T]
                # tail_grid from_branch: flowrl's earlier grid, strides from k + 1
                assert tail_indices(k, g, T, grid="from_branch")[:-1] == list(range(k + 1, T, g))


class G2rpoAnalyticFlow:
    """A stand-in policy whose velocity is a fixed smooth function of (x, sigma, prompt): no network,
    so the rollout's batching cannot change a single bit and the tails can be checked exactly."""

    device = torch.device("cpu")

    def latent_shape(self):
        return (4, 3)

    def encode(self, prompts):
        return torch.tensor([float(len(p)) for p in prompts])

    def velocity(self, x, sigma, cond):
        return torch.sin(3 * x) * (1 + sigma) + 0.01 * cond.view(-1, 1, 1) - 0.5 * sigma


@pytest.mark.parametrize("tail_end", ["zero", "x0_prediction"])
def test_g2rpo_tails_reproduce_the_reference_ode(tail_end):
    """From each branched latent the reference runs Euler steps on sigma[:k + 2] + sigma[k + 2::g] and
    scores the x0-prediction of its last step; flowrl's default agrees wherever the stride reaches sigma 0
    and ends there otherwise; tail_end x0_prediction agrees everywhere."""
    from flowrl.sampling.granular import granular_rollout
    from flowrl.sampling.rollout import SamplerSpec
    from flowrl.sampling.schedules import shifted_sigmas

    T, branch, granularities, G = 7, [0, 1, 2, 3], [1, 2, 3], 3
    sigmas = shifted_sigmas(T, 3.0)
    sde = torch.zeros(T, dtype=torch.bool)
    sde[branch] = True
    policy, prompts = G2rpoAnalyticFlow(), ["a red circle", "two cats"]
    batch = granular_rollout(policy, prompts, [3, 4], SamplerSpec(sigmas, sde, "flow_grpo", 0.7), branch, granularities, G,
                             batch_size=5, tail_end=tail_end)
    cond = policy.encode(prompts).repeat_interleave(G)
    for m, k in enumerate(branch):
        for l_, g in enumerate(granularities):
            schedule = torch.cat([sigmas[: k + 2], sigmas[k + 2 :: g]])
            x = batch.branch_next[:, m].reshape(-1, 4, 3)
            for i in range(k + 1, len(schedule) - 1):
                v = policy.velocity(x, float(schedule[i]), cond)
                scored = x - schedule[i] * v  # the reference's pred_original
                x = x + (schedule[i + 1] - schedule[i]) * v
            got = batch.finals[:, m, l_].reshape(-1, 4, 3)
            if tail_end == "x0_prediction" or schedule[-1] == 0:
                assert_relative(got, scored)
            else:  # the stride stops short of sigma 0: flowrl takes the last step to it
                v = policy.velocity(x, float(schedule[-1]), cond)
                assert_relative(got, x - schedule[-1] * v)
                assert not torch.allclose(got, scored, atol=1e-3)


@pytest.fixture(scope="module")
def g2rpo_trainer_and_batch(tmp_path_factory, tiny_flux_dir):
    """One granular iteration on the tiny FLUX pipeline: 3 prompts x 4 samples, T = 4, branch steps 0-2,
    granularities 1 and 2, sampling batches of 2 prompts (so one training micro-batch holds 2 prompts'
    branches and the other 1)."""
    import flowrl.train.rollouts.granular as granular_rollouts

    cfg = load_config("tiny_jpeg", [
        *FIDELITY_COMMON, f"model.path={tiny_flux_dir}", "rollout.kind=granular", "advantage.kind=grpo",
        "sampling.num_steps=4", "rollout.granular.branch_steps=[0,1,2]", "rollout.granular.granularities=[1,2]",
        "data.prompts_per_iteration=3", "data.group_size=4", "sampling.batch_size=2", "trainer.iterations=1",
    ])
    seen = {}
    original = granular_rollouts.granular_rollout
    granular_rollouts.granular_rollout = lambda *a, **k: seen.setdefault("batch", original(*a, **k))
    try:
        with one_torch_thread():
            trainer = Trainer(cfg, run_dir=tmp_path_factory.mktemp("g2rpo") / "run")
            random_lora_b(trainer)
            trainer.policy.transformer.eval()
            experience = trainer.rollout.collect(0)
    finally:
        granular_rollouts.granular_rollout = original
    return trainer, seen["batch"], experience


def test_g2rpo_clipped_loss_on_the_branch_transitions_matches_the_reference(g2rpo_trainer_and_batch, single_thread):
    """The reference, for each branch step k in increasing order: one forward at the anchor's x_k per
    prompt, the G samples' log-probs from it, loss_k = mean over G of the clipped surrogate (advantages
    clamped to +-5), averaged over prompts (one prompt per GPU), then an optimizer step. flowrl's
    gradient at each of its optimizer steps matches loss_k's, in that order, with every prompt weighing
    the same although its micro-batches hold 2 prompts and 1. (The reference's forwards are grouped as
    flowrl's, 2 anchors and 1, so that the network's outputs agree to the bit; the math is per prompt.)"""
    trainer, batch, experience = g2rpo_trainer_and_batch
    P, M, G = len(batch.prompts), len(batch.branch_steps), batch.group_size
    assert batch.branch_steps == [0, 1, 2] and len(experience.transitions) == M and not experience.shuffle
    sigmas = trainer.rollout.spec(0).sigmas
    eta, clip_range = 0.7, 1e-4
    micro = [slice(0, 2), slice(2, 3)]  # the anchor's sampling batches
    # move the behaviour log-probs so that some ratios leave [1 - 1e-4, 1 + 1e-4] (the first ratio is exactly 1)
    gen = torch.Generator().manual_seed(1)
    old = batch.log_probs + 2e-4 * torch.randn(batch.log_probs.shape, generator=gen)  # [P, M, G]
    for m, step in enumerate(experience.transitions):
        assert len(step) == len(micro)
        for j, (b, mb) in enumerate(zip(micro, step)):
            assert torch.equal(mb.old_log_prob, batch.log_probs[b, m].reshape(-1))
            step[j] = mb._replace(old_log_prob=old[b, m].reshape(-1).clone())
    advantages = experience.advantages.view(P, M, G)
    steps = capture_optimizer_steps(trainer)
    stats = trainer.objective.update(experience)
    assert len(steps) == M and stats["optimizer_steps"] == M
    assert 0 < stats["clipfrac"] < 1

    params = list(trainer.params.values())
    trainer.policy.transformer.train()
    for m, k in enumerate(batch.branch_steps):
        per_prompt = []
        for b in micro:
            x = batch.anchors[b, k]
            v = trainer.policy.velocity(x, float(sigmas[k]), trainer.policy.encode(batch.prompts[b]))
            for p in range(b.start, b.stop):
                q = p - b.start
                log_prob = reference_flow_grpo_log_prob(x[q].expand(G, *x.shape[1:]), v[q].expand(G, *v.shape[1:]),
                                                        batch.branch_next[p, m], sigmas, k, eta)
                per_prompt.append(reference_clipped_loss(log_prob, old[p, m], advantages[p, m], clip_range, 5.0))
        loss = torch.stack(per_prompt).mean()
        assert_relative(steps[m], flat_gradient(torch.autograd.grad(loss, params)))
        # flowrl's loss of the step: its micro-batches' losses weighed by their transitions, as backpropagated
        with torch.no_grad():
            step = experience.transitions[m]
            kept = [mb.kept() for mb in step]
            flowrl_loss = sum(trainer.objective.micro_batch_loss(mb)[0] * n for mb, n in zip(step, kept)) / sum(kept)
        # relative to the size of its terms A r (about |A|): their mean nearly cancels, to ~1e-5 here
        assert abs(flowrl_loss.item() - loss.item()) <= 1e-6 * advantages[:, m].abs().mean().item()
    trainer.policy.transformer.eval()


# =====================================================================================================
# MixGRPO's SDE window (Tencent-Hunyuan/MixGRPO, fastvideo/utils/grpo_states.py, fastvideo/train_grpo_flux.py)
# =====================================================================================================
def mixgrpo_reference_windows(iterations: int, num_steps: int, size: int, tau: int, stride: int, start: int) -> list[list[int]]:
    """The reference's progressive window, iteration by iteration: the window is read, then the
    iteration counter advances; every tau iterations the start moves `stride` steps later, and once
    it passes max_t = num_steps - 2 it rolls back to where it began. The window is
    [l, min(l + size, max_t)) (empty at l = max_t)."""
    max_t = num_steps - 2
    first, count, windows = start, 0, []
    for _ in range(iterations):
        windows.append(list(range(first, min(first + size, max_t))))
        count += 1
        if count >= tau:
            count, first = 0, first + stride
        if first > max_t:
            count, first = 0, start
    return windows


@pytest.mark.parametrize("num_steps, size, tau, stride, start", [
    (25, 4, 25, 1, 0),  # MixGRPO's script: 25 steps, window 4, a one-step shift every 25 iterations, roll back
    (25, 4, 20, 0, 0),  # MixGRPO-Flash*: the window frozen at steps 0-3
    (8, 3, 2, 1, 0), (8, 3, 3, 2, 1), (8, 2, 1, 3, 2), (6, 6, 2, 1, 0),
])
def test_mixgrpo_window_of_every_iteration_matches_the_reference(num_steps, size, tau, stride, start):
    from flowrl.sampling.schedules import window_steps

    iterations = 3 * (num_steps + 1) * tau
    ref = mixgrpo_reference_windows(iterations, num_steps, size, tau, stride, start)
    got = [window_steps("progressive", num_steps, size, start, n, seed=0, shift_every=tau, stride=stride)
           for n in range(iterations)]
    for n, (want, have) in enumerate(zip(ref, got)):
        # where the reference's window is empty (start at max_t) flowrl keeps the last one-step window
        assert have == (want or [num_steps - 3]), f"iteration {n}"
    assert any(not w for w in ref) == (stride > 0 and (num_steps - 2 - start) % stride == 0)
    if num_steps == 25 and stride == 1:
        assert got[0] == [0, 1, 2, 3] and got[24] == [0, 1, 2, 3] and got[25] == [1, 2, 3, 4] and got[299] == [11, 12, 13, 14]
        assert got[20 * 25] == [20, 21, 22] and got[22 * 25] == [22] and got[24 * 25] == [0, 1, 2, 3]  # cut short, rolled back


@pytest.fixture(scope="module")
def mixgrpo_trainer(tmp_path_factory, tiny_flux_dir):
    """Flat GRPO with a progressive window on the tiny FLUX pipeline: T = 6 (so max_t = 4), window 3
    shifting every iteration; 2 prompts x 3 samples at sampling batch 1 (as the reference's batch-1
    samples), 3 samples per optimizer step (the reference's gradient_accumulation_steps 3)."""
    cfg = load_config("tiny_jpeg", [
        *FIDELITY_COMMON, f"model.path={tiny_flux_dir}", "sampling.num_steps=6", "sampling.window.strategy=progressive",
        "sampling.window.size=3", "sampling.window.start=0", "sampling.window.shift_every=1", "data.prompts_per_iteration=2",
        "data.group_size=3", "trainer.gradient_accumulation_steps=3", "trainer.iterations=4",
    ])
    with one_torch_thread():
        trainer = Trainer(cfg, run_dir=tmp_path_factory.mktemp("mixgrpo") / "run")
    random_lora_b(trainer, seed=1)
    return trainer


def test_mixgrpo_window_loss_and_reduction_match_the_reference(mixgrpo_trainer, monkeypatch, single_thread):
    """Iteration 2 of the window above: l = 2 and the window [2, min(5, 4)) = steps 2 and 3, cut short.
    The reference: SDE on the window's steps only, ODE elsewhere; each sample (batch 1) and window step
    t gives the clipped surrogate (advantages clamped to +-5) divided by gradient_accumulation_steps x
    |W|, and every 3 samples make an optimizer step. flowrl's steps hold the same gradients."""
    import flowrl.train.rollouts.flat as flat

    trainer, iteration, accum = mixgrpo_trainer, 2, 3
    window = mixgrpo_reference_windows(iteration + 1, 6, 3, 1, 1, 0)[iteration]
    assert window == [2, 3]
    seen = []
    original = flat.rollout
    monkeypatch.setattr(flat, "rollout", lambda *a, **k: seen.append(original(*a, **k)) or seen[-1])
    trainer.policy.transformer.eval()
    experience = trainer.rollout.collect(iteration)
    (traj,) = seen
    N = len(traj.prompts)
    assert N == 6 and traj.trained.nonzero().flatten().tolist() == window
    outside = [t for t in range(6) if t not in window]
    assert torch.equal(traj.log_probs[:, outside], torch.zeros(N, len(outside)))  # ODE outside the window
    with torch.no_grad():
        for i, t in itertools.product(range(N), outside):  # an Euler step there
            x = traj.latents[i : i + 1, t]
            v = trainer.policy.velocity(x, float(traj.sigmas[t]), trainer.policy.encode([traj.prompts[i]]))
            assert_relative(traj.latents[i : i + 1, t + 1], x + (traj.sigmas[t + 1] - traj.sigmas[t]) * v)

    gen = torch.Generator().manual_seed(2)
    old = traj.log_probs + 2e-4 * torch.randn(traj.log_probs.shape, generator=gen)
    assert len(experience.transitions) == N  # one accumulation group per sampling batch of one sample
    for i, group in enumerate(experience.transitions):
        assert len(group) == len(window)  # one micro-batch per window step
        for j, (t, mb) in enumerate(zip(window, group)):
            assert torch.equal(mb.old_log_prob, traj.log_probs[i : i + 1, t])
            group[j] = mb._replace(old_log_prob=old[i : i + 1, t].clone())
    steps = capture_optimizer_steps(trainer)
    stats = trainer.objective.update(experience)
    assert len(steps) == N // accum and 0 < stats["clipfrac"] < 1

    params = list(trainer.params.values())
    trainer.policy.transformer.train()
    per_sample = []  # the reference's gradient of each sample's share, sum over t in W of loss_(i,t) / (accum |W|)
    for i in range(N):
        loss = 0.0
        for t in window:
            x, x_next = traj.latents[i : i + 1, t], traj.latents[i : i + 1, t + 1]
            v = trainer.policy.velocity(x, float(traj.sigmas[t]), trainer.policy.encode([traj.prompts[i]]))
            log_prob = reference_flow_grpo_log_prob(x, v, x_next, traj.sigmas, t, 0.7)
            loss = loss + reference_clipped_loss(log_prob, old[i : i + 1, t], experience.advantages[i : i + 1], 1e-4, 5.0) / (
                accum * len(window))
        per_sample.append(flat_gradient(torch.autograd.grad(loss, params)))
    trainer.policy.transformer.eval()
    # flowrl shuffles its sampling batches: each optimizer step is the sum over some 3 of the samples, and
    # the two steps together are the sum over all of them
    subsets = list(itertools.combinations(range(N), accum))
    candidates = [sum(per_sample[i] for i in subset) for subset in subsets]
    chosen = []
    for got in steps:
        best = min(range(len(subsets)), key=lambda j: (got - candidates[j]).abs().max().item())
        assert_relative(got, candidates[best])
        chosen.append(set(subsets[best]))
    assert chosen[0] | chosen[1] == set(range(N))
    assert_relative(sum(steps), sum(per_sample))
