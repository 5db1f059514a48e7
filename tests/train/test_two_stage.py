"""Sol-RL two-stage exploration: NVFP4 / FP8 fake quantisation against torchao, the merged
exploration copy, exact regeneration of selected seeds, the precision guard, selection spread,
rank correlations, and a short training run."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.core.correlation import kendall_tau, rankdata, spearman
from flowrl.core.selection import select_per_group
from flowrl.errors import ConfigError, UserError
from flowrl.sampling.precision import (E2M1_GRID, ExplorationCopy, fp8_fake_quantize, merged_state, nvfp4_fake_quantize,
                                       quantizable, round_to_e2m1)
from flowrl.sampling.rollout import rollout
from flowrl.train.loop import Trainer
from flowrl.train.rollouts.common import Stage, stage_experience, training_spec

FAST = ["sampling.num_steps=3", "sampling.eval_num_steps=3", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8",
        "run.sample_every=0", "run.checkpoint_every=0"]


def two_stage(tiny_sd3_dir, *extra):
    return [*FAST, f"model.path={tiny_sd3_dir}", "rollout.kind=two_stage", "rollout.two_stage.candidates=8", *extra]


def _randomise_lora(policy, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_trainable_parameters().items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


# ---- fake quantisation against torchao -----------------------------------------------
def test_nvfp4_and_fp8_fake_quantisation_match_torchao_bit_for_bit():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    from torchao.quantization.quant_primitives import _choose_scale_float8, _dequantize_affine_float8, _quantize_affine_float8

    g = torch.Generator().manual_seed(0)
    for i in range(12):
        # rows on very different scales, so block scales span the E4M3 range; some exact zeros
        x = torch.randn(32, 64, generator=g) * torch.exp(3 * torch.randn(32, 1, generator=g))
        x[0, :16] = 0
        x = x.bfloat16() if i % 3 == 0 else x
        ours = nvfp4_fake_quantize(x)
        ref = NVFP4Tensor.to_nvfp4(x.contiguous(), per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax())).dequantize(torch.float32)
        assert torch.equal(ours, ref), i
        scale = _choose_scale_float8(x.float(), list(x.shape))
        assert torch.equal(fp8_fake_quantize(x), _dequantize_affine_float8(_quantize_affine_float8(x.float(), scale), scale)), i
    # the rounding itself, ties included (random data rarely lands exactly on a midpoint)
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    v = torch.cat([torch.arange(0, 7.0, 0.125), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1e-8])])
    v = torch.cat([v, -v])
    assert torch.equal(round_to_e2m1(v), f4_unpacked_to_f32(f32_to_f4_unpacked(v)))


def test_fp8_row_scaling_matches_torchao_per_row_bit_for_bit():
    # rollout.two_stage.fp8_scaling row: one scale per row, as torchao's PerRow (block [1, K]); on rows
    # of very different magnitudes it errs less than one scale for the whole tensor
    pytest.importorskip("torchao")
    from torchao.quantization.quant_primitives import _choose_scale_float8, _dequantize_affine_float8, _quantize_affine_float8

    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g) * torch.exp(3 * torch.randn(32, 1, generator=g))
    scale = _choose_scale_float8(x, [1, x.shape[-1]])
    assert scale.shape == (32, 1)
    ref = _dequantize_affine_float8(_quantize_affine_float8(x, scale), scale)
    assert torch.equal(fp8_fake_quantize(x, "row"), ref)
    row_err, tensor_err = ((fp8_fake_quantize(x, s) - x).abs() / x.abs().amax(-1, keepdim=True) for s in ("row", "tensor"))
    assert row_err.max() < 0.07 < tensor_err.max()  # E4M3 keeps 3 mantissa bits of every row; one scale flushes the small rows
    assert torch.equal(fp8_fake_quantize(torch.zeros(2, 16), "row"), torch.zeros(2, 16))


def test_nvfp4_format_holds_e2m1_values_under_e4m3_block_scales():
    """Independently of torchao: each block of 16 is an E2M1 value times one E4M3-representable
    scale (times the per-tensor FP32 scale), and the largest block maps its amax near 6."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    q = nvfp4_fake_quantize(x).reshape(-1, 16)
    pts = x.abs().amax() / (448 * 6)
    blocks = x.reshape(-1, 16)
    block_scale = (blocks.abs().amax(-1) / 6 / pts).to(torch.float8_e4m3fn).float()
    codes = q / (pts * block_scale).unsqueeze(-1)
    grid = torch.tensor(E2M1_GRID)
    assert torch.isclose(codes.abs().unsqueeze(-1), grid, atol=1e-5).any(-1).all()
    assert torch.allclose(codes.abs().amax(-1), torch.full((len(codes),), 6.0))  # every block's amax lands on 6
    assert (q - blocks).abs().max() <= (pts * block_scale).max()  # at most one grid step (1 or 2) x scale off
    assert torch.equal(nvfp4_fake_quantize(torch.zeros(2, 16)), torch.zeros(2, 16))
    assert torch.equal(fp8_fake_quantize(torch.zeros(3, 5)), torch.zeros(3, 5))


# ---- the exploration copy ------------------------------------------------------------
def test_exploration_copy_holds_torchao_dequantised_merged_weights(tiny_sd3_dir):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig
    from torchao.quantization import quantize_

    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "lora.rank=4", "lora.alpha=8"])
    from flowrl.models import load_policy

    policy = load_policy(cfg.model, device="cpu")
    policy.add_lora(cfg.lora)
    _randomise_lora(policy)
    copy = ExplorationCopy(policy, "nvfp4", backend="emulated")
    assert copy.label == "nvfp4-emulated" and len(copy.quantized) > 4
    state = merged_state(policy.transformer)
    for name in copy.quantized:
        lora_layer = policy.transformer.get_submodule(name)
        x = torch.randn(3, lora_layer.in_features)
        # the merged weight is the adapter's forward...
        assert torch.allclose(torch.nn.functional.linear(x, state[f"{name}.weight"], state.get(f"{name}.bias")), lora_layer(x), atol=1e-5)
        # ...and the copy holds exactly torchao's NVFP4 round trip of it
        ref = torch.nn.Linear(lora_layer.in_features, lora_layer.out_features)
        with torch.no_grad():
            ref.weight.copy_(state[f"{name}.weight"])
        quantize_(ref, NVFP4WeightOnlyConfig())
        assert torch.equal(copy.quantized_weight(name), ref.weight.dequantize(torch.float32)), name

    # resync follows the trained adapter
    _randomise_lora(policy, seed=1)
    name = next(n for n in copy.quantized if "to_q" in n)
    before = copy.quantized_weight(name).clone()
    assert copy.resync() > 0
    assert not torch.equal(before, copy.quantized_weight(name))
    assert torch.equal(copy.quantized_weight(name), nvfp4_fake_quantize(merged_state(policy.transformer)[f"{name}.weight"]))

    # samples through the copy are labelled, close to but not equal to full precision
    from flowrl.sampling.rollout import SamplerSpec
    from flowrl.sampling.schedules import shifted_sigmas

    spec = SamplerSpec(shifted_sigmas(3, 3.0), torch.zeros(3, dtype=torch.bool), "ode")
    low = rollout(copy.policy, ["a red circle"] * 2, [1, 2], spec, 2)
    full = rollout(policy, ["a red circle"] * 2, [1, 2], spec, 2)
    assert low.precision == "nvfp4-emulated" and full.precision == "float32"
    assert torch.equal(low.latents[:, 0], full.latents[:, 0])  # same seeds, same initial noise
    assert not torch.equal(low.final, full.final)
    assert (low.final - full.final).abs().mean() < 0.5 * full.final.abs().mean()

    # the adaLN modulation linears (inside the norm modules) are quantised unless kept out by name
    modulation = [n for n, m in policy.transformer.named_modules()
                  if n.endswith("norm1.linear") and isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0 == m.out_features % 16]
    assert modulation and set(modulation) <= set(copy.quantized)
    mod = modulation[0]
    state = merged_state(policy.transformer)  # after the resync above
    assert torch.equal(copy.quantized_weight(mod), nvfp4_fake_quantize(state[f"{mod}.weight"]))
    keep_norms = ExplorationCopy(policy, "nvfp4", backend="emulated", high_precision_layers=("embed", "proj_out", "norm"))
    assert not any("norm" in n for n in keep_norms.quantized) and len(keep_norms.quantized) < len(copy.quantized)
    assert torch.equal(keep_norms.net.get_submodule(mod).weight.float(), state[f"{mod}.weight"])

    bf16 = ExplorationCopy(policy, "bf16")
    assert bf16.label == "bfloat16" and rollout(bf16.policy, ["a red circle"], [1], spec, 1).precision == "bfloat16"
    fp32 = ExplorationCopy(policy, "fp32")
    assert fp32.policy is policy and fp32.resync() == 0.0  # the training precision explores itself


def test_fp8_copy_scales_per_row_and_keeps_narrow_layers(tiny_sd3_dir):
    # the default fp8 copy: weights and activations with a scale per row (FakeQuantLinear's product
    # written out), layers narrower than min_features left in fp32; torchao's config for the GPU is
    # PerRow without its process-wide Inductor settings
    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "lora.rank=4", "lora.alpha=8"])
    from flowrl.models import load_policy

    policy = load_policy(cfg.model, device="cpu")
    policy.add_lora(cfg.lora)
    _randomise_lora(policy)
    copy = ExplorationCopy(policy, "fp8", backend="emulated")
    assert copy.label == "fp8-emulated-row" and copy.quantized
    state = merged_state(policy.transformer)
    name = copy.quantized[0]
    layer = copy.net.get_submodule(name)
    w = state[f"{name}.weight"]
    assert torch.equal(copy.quantized_weight(name), fp8_fake_quantize(w, "row"))
    x = torch.randn(2, 5, layer.in_features)
    xq = fp8_fake_quantize(x.reshape(10, -1), "row")  # one scale per token
    want = torch.nn.functional.linear(xq, fp8_fake_quantize(w, "row"), state.get(f"{name}.bias")).reshape(2, 5, -1)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-6)

    # min_features compares the smaller dimension (every linear of the tiny SD3 is 32 wide on one side)
    assert quantizable("transformer_blocks.0.ff.net.2", torch.nn.Linear(64, 256), min_features=64)
    assert not quantizable("transformer_blocks.0.ff.net.2", torch.nn.Linear(256, 32), min_features=64)
    assert ExplorationCopy(policy, "fp8", backend="emulated", min_features=32).quantized == copy.quantized
    with pytest.raises(UserError, match=r"^rollout.two_stage.explore_precision 'fp8': .* at least rollout.two_stage.min_features \(100000\)"):
        ExplorationCopy(policy, "fp8", backend="emulated", min_features=100_000)

    pytest.importorskip("torchao")
    from torchao.quantization import PerRow, PerTensor

    for scaling, granularity in (("row", PerRow), ("tensor", PerTensor)):
        config = ExplorationCopy(policy, "fp8", backend="emulated", fp8_scaling=scaling).torchao_config()
        assert config.set_inductor_config is False and all(isinstance(g, granularity) for g in config.granularity)  # activation, weight


def test_first_block_cache_reuses_blocks_within_a_chain_and_starts_each_chain_afresh(tmp_path, tiny_sd3_dir):
    # rollout.two_stage.first_block_cache: with a threshold nothing passes, the copy samples as the policy;
    # with one everything passes, each chain computes its first step in full and reuses the blocks after
    # it, and the next chain (its timestep back at the top) starts with an empty cache. SD3's last block
    # stays outside the cache, so the 2-block tiny SD3 has too few blocks for it
    from flowrl.models import load_policy
    from flowrl.models.tiny import build_tiny_sd3
    from flowrl.sampling.rollout import SamplerSpec
    from flowrl.sampling.schedules import shifted_sigmas

    two = load_policy(load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}"]).model, device="cpu")
    with pytest.raises(UserError, match="^rollout.two_stage.first_block_cache needs a transformer with at least two cacheable blocks; "
                                        "SD3Transformer2DModel has 1: set it to 0$"):
        ExplorationCopy(two, "fp32", first_block_cache=0.1)
    three = build_tiny_sd3(tmp_path / "three", num_layers=3)
    cfg = load_config("tiny_jpeg", [f"model.path={three}", "lora.rank=4", "lora.alpha=8"])
    policy = load_policy(cfg.model, device="cpu")
    policy.add_lora(cfg.lora)
    _randomise_lora(policy)
    spec = SamplerSpec(shifted_sigmas(3, 3.0), torch.zeros(3, dtype=torch.bool), "ode")
    prompts, seeds = ["a red circle", "a blue square"], [1, 2]
    full = rollout(policy, prompts, seeds, spec, 2)

    never = ExplorationCopy(policy, "fp32", first_block_cache=1e-12)
    assert never.policy is not policy and never.label == "float32+fbc1e-12"
    torch.testing.assert_close(rollout(never.policy, prompts, seeds, spec, 2).final, full.final, atol=1e-5, rtol=1e-5)
    assert never.cache_reuse() == (3, 0)

    always = ExplorationCopy(policy, "fp32", first_block_cache=1e9)
    cached = rollout(always.policy, prompts, seeds, spec, 2)
    assert always.cache_reuse() == (3, 2) and always.cache_reuse() == (0, 0)
    assert cached.precision == "float32+fbc1e+09" and not torch.allclose(cached.final, full.final, atol=1e-3)
    again = rollout(always.policy, prompts, seeds, spec, 1)  # two chains of one: each starts afresh
    assert always.cache_reuse() == (6, 4)
    torch.testing.assert_close(again.final, cached.final, atol=1e-5, rtol=1e-5)


# ---- regeneration ----------------------------------------------------------------------
def _capture(trainer):
    """Record every stage the two-stage rollout samples and every experience the objective trains on."""
    stages, trained = [], []
    sample_stage, update = trainer.rollout.flat.sample_stage, trainer.objective.update

    def record_stage(*args, **kwargs):
        st = sample_stage(*args, **kwargs)
        stages.append(st)
        return st

    def record_update(experience):
        trained.append(experience)
        return update(experience)

    trainer.rollout.flat.sample_stage, trainer.objective.update = record_stage, record_update
    return stages, trained


def _trained_samples(experience):
    """(seeds, advantages, clean samples) of this process's trained samples, in order."""
    batches = experience.samples
    return (torch.cat([b.seeds for b in batches]), torch.cat([experience.advantages_at(b.index) for b in batches]),
            torch.cat([b.x0 for b in batches]))


def _selected_seeds(trainer, pool, k):
    """The seeds best_worst picks from the pool's stage-1 rewards, K per prompt."""
    explore = pool.rewards.float() @ trainer.reward_fn.channel_weights
    picked = select_per_group("best_worst", explore, pool.prompt_ids, {int(p): k for p in pool.prompt_ids.unique()})
    return pool.traj.seeds[picked].tolist()


def test_same_precision_regeneration_equals_the_candidates_bit_for_bit(tmp_path, tiny_sd3_dir):
    cfg = load_config("tiny_jpeg", two_stage(tiny_sd3_dir, "rollout.two_stage.explore_precision=fp32",
                                             "rollout.two_stage.fidelity_every=0", "trainer.iterations=1"))
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    stages, trained = _capture(trainer)
    row = trainer.train()[0]
    pool, regen = stages
    assert len(pool.traj) == 16 and len(regen.traj) == 8 and row["samples"] == 8
    assert regen.traj.seeds.tolist() == _selected_seeds(trainer, pool, 4)
    rows = [pool.traj.seeds.tolist().index(s) for s in regen.traj.seeds.tolist()]
    assert torch.equal(regen.traj.latents, pool.traj.latents[rows])
    assert torch.equal(regen.traj.log_probs, pool.traj.log_probs[rows])
    assert torch.equal(regen.rewards, pool.rewards[rows])
    seeds, _, x0 = _trained_samples(trained[0])
    assert torch.equal(seeds, regen.traj.seeds) and torch.equal(x0, regen.traj.final)
    assert trained[0].precision == "float32" and regen.traj.precision == "float32"


def test_low_precision_candidates_are_replayed_in_the_training_precision(tmp_path, tiny_sd3_dir):
    """Stage 2 replays the selected seeds' initial and per-step noise with the training policy."""
    from flowrl.sampling.noise import seeded_noise

    cfg = load_config("tiny_jpeg", two_stage(tiny_sd3_dir, "rollout.two_stage.explore_precision=nvfp4",
                                             "rollout.two_stage.backend=emulated", "rollout.two_stage.fidelity_every=0"))
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    stages, trained = _capture(trainer)
    trained.append(trainer.rollout.collect(0))  # no update: the policy stays the sampler
    pool, regen = stages
    assert pool.traj.precision == "nvfp4-emulated" and regen.traj.precision == "float32"
    assert [e.precision for e in trained] == ["float32"]
    assert regen.traj.seeds.tolist() == _selected_seeds(trainer, pool, 4)
    rows = [pool.traj.seeds.tolist().index(s) for s in regen.traj.seeds.tolist()]
    assert torch.equal(regen.traj.latents[:, 0], pool.traj.latents[rows, 0])  # the initial noise
    assert not torch.equal(regen.traj.latents[:, -1], pool.traj.latents[rows, -1])  # other precision, other chain
    spec, bs = training_spec(cfg, 0, trainer.policy), cfg.sampling.batch_size
    # the per-step noise: (x_{t+1} - mean_t) / std recovers the seed's noise in both stages
    for policy, traj in ((trainer.rollout.explorer.policy, pool.traj), (trainer.policy, regen.traj)):
        for start in range(0, len(traj), bs):  # the sampling batches (the fake-quantised activations are batch-scaled)
            c = slice(start, start + bs)
            cond = policy.encode(traj.prompts[c])
            for t in spec.trained_steps():
                x, x_next = traj.latents[c, t], traj.latents[c, t + 1]
                out = spec.step(t, x, policy.velocity(x, float(spec.sigmas[t]), cond), x_next=x_next)
                noise = seeded_noise(traj.seeds[c].tolist(), t, x.shape[1:])
                assert torch.allclose((x_next - out.mean) / out.std, noise, atol=1e-4), (traj.precision, t)


# ---- the guard ------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, field", [
    # low-precision or preview candidates into a log-prob ratio: the rollout provides no transitions for grpo
    (["rollout.two_stage.regenerate=false"], "objective.kind 'grpo' trains on transitions"),
    (["rollout.two_stage.regenerate=false", "rollout.two_stage.explore_precision=bf16"], "objective.kind 'grpo' trains on transitions"),
    (["rollout.two_stage.regenerate=false", "rollout.two_stage.explore_precision=fp32", "rollout.two_stage.preview_steps=2"],
     "objective.kind 'grpo' trains on transitions"),
    (["rollout.two_stage.regenerate=false", "rollout.two_stage.explore_precision=fp32", "rollout.two_stage.first_block_cache=0.1"],
     "objective.kind 'grpo' trains on transitions"),
    (["rollout.two_stage.fp8_scaling=block"], "rollout.two_stage.fp8_scaling"),
    (["rollout.two_stage.min_features=-1"], "rollout.two_stage.min_features"),
    (["rollout.two_stage.first_block_cache=-0.1"], "rollout.two_stage.first_block_cache"),
    (["rollout.tree.split_steps=[0,1]"], "rollout.tree"),  # two_stage + tree
    (["rollout.two_stage.candidates=3"], "rollout.two_stage.candidates"),
    (["rollout.two_stage.explore_precision=int4"], "rollout.two_stage.explore_precision"),
    (["rollout.two_stage.backend=cuda"], "rollout.two_stage.backend"),
    (["allocator.kind=vade"], "allocator.kind"),
])
def test_config_guard_rejects_mixed_precision_and_bad_two_stage_settings(tiny_sd3_dir, overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_jpeg", two_stage(tiny_sd3_dir, *overrides))
    msg = str(err.value)
    assert msg.startswith(field) and msg.count(". ") == 0 and "\n" not in msg
    if field.startswith("objective.kind"):
        from flowrl.train.experience import SAMPLES
        from flowrl.train.parts import OBJECTIVES

        able = ", ".join(OBJECTIVES.where(lambda o: o.needs == SAMPLES))  # every registered clean-sample objective
        assert "unless rollout.two_stage.regenerate is true" in msg and msg.endswith(f"objective.kind may be {able} with it")


def test_guard_allows_training_on_same_precision_candidates_and_the_cli_exits_2(tmp_path, tiny_sd3_dir, capsys):
    cfg = load_config("tiny_jpeg", two_stage(tiny_sd3_dir, "rollout.two_stage.regenerate=false",
                                             "rollout.two_stage.explore_precision=fp32"))
    assert not cfg.rollout.two_stage.regenerate
    args = two_stage(tiny_sd3_dir, "rollout.two_stage.regenerate=false", "trainer.iterations=1")
    assert main(["train", "tiny_jpeg", *args, "--run-dir", str(tmp_path / "r")]) == 2
    assert "unless rollout.two_stage.regenerate is true" in capsys.readouterr().err


def test_grpo_refuses_a_low_precision_trajectory(tmp_path, tiny_sd3_dir):
    trainer = Trainer(load_config("tiny_jpeg", [*FAST, f"model.path={tiny_sd3_dir}"]), run_dir=tmp_path / "run")
    spec = training_spec(trainer.cfg, 0, trainer.policy)

    def experience(traj, advantages):
        stage = Stage(traj, torch.zeros(4, 1), torch.zeros(4, dtype=torch.long), torch.arange(4), 0.0, 0.0, torch.ones(4, dtype=torch.bool))
        return stage_experience(trainer.rollout.ctx, 0, [stage], spec, stage.rewards, stage.prompt_ids, stage.valid, advantages, {},
                                with_transitions=True)

    copy = ExplorationCopy(trainer.policy, "fp8", backend="emulated")
    traj = rollout(copy.policy, ["a red circle"] * 4, [1, 2, 3, 4], spec, 4)
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    with pytest.raises(UserError, match="refusing to train on samples drawn in fp8-emulated-row by a policy trained in float32"):
        trainer.objective.update(experience(traj, torch.ones(4)))
    assert all(torch.equal(before[n], p) for n, p in trainer.params.items())
    full = rollout(trainer.policy, ["a red circle"] * 4, [1, 2, 3, 4], spec, 4)
    assert trainer.objective.update(experience(full, torch.tensor([1.0, -1.0, 0.5, -0.5])))["trained_transitions"] > 0


# ---- selection ------------------------------------------------------------------------
def test_selected_subsets_have_the_spread_their_selector_promises():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(3 * 8, generator=g)
    groups = torch.arange(3).repeat_interleave(8)
    k = {0: 4, 1: 4, 2: 3}
    picked = select_per_group("best_worst", rewards, groups, k)
    for grp in range(3):
        sel = picked[groups[picked] == grp]
        pool = rewards[groups == grp]
        assert len(sel) == k[grp]
        assert rewards[sel].max() == pool.max() and rewards[sel].min() == pool.min()
    picked = select_per_group("max_variance", rewards, groups, k)
    for grp in range(3):
        idx = torch.nonzero(groups == grp).flatten().tolist()
        best = max(rewards[list(c)].var(unbiased=False).item() for c in itertools.combinations(idx, k[grp]))
        assert rewards[picked[groups[picked] == grp]].var(unbiased=False).item() == pytest.approx(best, rel=1e-6)
    # invalid candidates are skipped while a group has enough valid ones
    valid = torch.ones(24, dtype=torch.bool)
    valid[torch.argmax(rewards[:8])] = False
    sel = select_per_group("best_worst", rewards, groups, k, valid)
    assert torch.argmax(rewards[:8]).item() not in sel.tolist() and len(sel) == 11


# ---- correlations ----------------------------------------------------------------------
def test_rank_correlations_with_ties():
    a, b = torch.tensor([1.0, 2.0, 2.0, 3.0, 5.0]), torch.tensor([2.0, 1.0, 3.0, 3.0, 4.0])
    assert rankdata(a).tolist() == [1.0, 2.5, 2.5, 4.0, 5.0]
    # by hand: 10 pairs; concordant 7, discordant 1, tied only in a 1, only in b 1 -> tau_b = 6 / sqrt(9 x 9)
    assert kendall_tau(a, b) == pytest.approx(6 / 9)
    assert spearman(a, -a) == pytest.approx(-1.0) and math.isnan(spearman(a, torch.ones(5)))
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 6, (200,), generator=g).float(), torch.randint(0, 6, (200,), generator=g).float()
    y = y + x
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x.numpy(), y.numpy()).statistic, abs=1e-12)
    assert kendall_tau(x, y) == pytest.approx(stats.kendalltau(x.numpy(), y.numpy()).statistic, abs=1e-12)


# ---- end to end ------------------------------------------------------------------------
def test_two_stage_training_run_logs_its_metrics(tmp_path, tiny_sd3_dir):
    run = tmp_path / "run"
    args = two_stage(tiny_sd3_dir, "rollout.two_stage.backend=emulated", "rollout.two_stage.fidelity_every=2",
                     "rollout.two_stage.preview_steps=2", "trainer.iterations=3", "trainer.kl_beta=0.01")
    assert main(["train", "tiny_jpeg", *args, "--run-dir", str(run)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["explore_precision"] == "nvfp4-emulated"
        assert r["samples"] == 8 and r["candidates"] == 16 and r["nfe_explore"] == 16 * 2
        assert r["explore_images_per_s"] > 0 and r["time_resync"] > 0 and r["trained_transitions"] > 0
        assert r["selection/selected_range"] == pytest.approx(r["selection/pool_range"])  # best_worst keeps both ends
        assert r["selection/selected_std"] >= r["selection/pool_std"]
    # fidelity on iterations 0 and 2: the whole pool of 16 regenerated, the 8 selected trained
    assert {"fidelity/spearman", "fidelity/kendall"} <= rows[0].keys() and "fidelity/spearman" not in rows[1]
    assert -1 <= rows[2]["fidelity/spearman"] <= 1 and -1 <= rows[2]["fidelity/kendall"] <= 1
    assert rows[0]["nfe_regenerate"] == 16 * 3 and rows[1]["nfe_regenerate"] == 8 * 3
    ckpt = load_config(run / "config.yaml")
    assert ckpt.rollout.kind == "two_stage" and ckpt.rollout.two_stage.preview_steps == 2


def test_two_stage_without_regeneration_trains_on_the_selected_candidates(tmp_path, tiny_sd3_dir):
    cfg = load_config("tiny_jpeg", two_stage(tiny_sd3_dir, "rollout.two_stage.explore_precision=fp32",
                                             "rollout.two_stage.regenerate=false", "selection.kind=max_variance",
                                             "trainer.iterations=1"))
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    stages, trained = _capture(trainer)
    row = trainer.train()[0]
    assert len(stages) == 1 and row["nfe_regenerate"] == 0 and row["samples"] == 8
    seeds, adv, _ = _trained_samples(trained[0])
    assert len(seeds) == 8 and set(seeds.tolist()) <= set(stages[0].traj.seeds.tolist())
    assert row["first_ratio_deviation"] < 1e-5 and (adv != 0).any()


# ---- DiffusionNFT on a low-precision explorer's candidates ------------------------------
NFT = ["objective.kind=nft", "sampling.sampler=ode", "trainer.kl_beta=0", "objective.nft.timesteps=1",
       "rollout.two_stage.explore_precision=bf16", "rollout.two_stage.regenerate=false"]


def test_nft_may_train_on_low_precision_candidates_but_not_with_a_sigma_range(tiny_sd3_dir):
    cfg = load_config("tiny_jpeg", two_stage(tiny_sd3_dir, *NFT))
    assert cfg.objective.kind == "nft" and not cfg.rollout.two_stage.regenerate
    # the exploration copy has the adapter merged in at every sigma
    with pytest.raises(ConfigError, match=r"^lora\.sigma_range must be \[0, 1\] when rollout\.kind is two_stage"):
        load_config("tiny_jpeg", two_stage(tiny_sd3_dir, *NFT, "lora.sigma_range=[0.5, 1.0]"))


def test_nft_trains_on_the_selected_bf16_candidates_without_regenerating(tmp_path, tiny_sd3_dir):
    cfg = load_config("tiny_jpeg", two_stage(tiny_sd3_dir, *NFT, "trainer.iterations=1"))
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    stages, trained = _capture(trainer)
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    row = trainer.train()[0]
    (pool,), (experience,) = stages, trained
    seeds, adv, _ = _trained_samples(experience)
    assert pool.traj.precision == "bfloat16" and experience.precision == "bfloat16"
    assert row["nfe_regenerate"] == 0 and row["samples"] == 8 and row["candidates"] == 16
    assert seeds.tolist() == _selected_seeds(trainer, pool, 4)
    assert (adv != 0).any() and row["trained_transitions"] > 0 and math.isfinite(row["loss"])
    assert any(not torch.equal(before[n], p) for n, p in trainer.params.items())


def test_nft_old_weights_are_what_the_exploration_copy_is_merged_from(tmp_path, tiny_sd3_dir):
    # decay min(0.9, 1.0 x the optimizer steps so far): 0.9 from the first iteration on, the old weights lag the trained ones
    cfg = load_config("tiny_jpeg", two_stage(tiny_sd3_dir, *NFT, "trainer.iterations=3", "objective.nft.old_policy=sampling",
                                             "objective.nft.old_decay=0.9", "objective.nft.old_decay_rate=1.0", "trainer.lr=0.1"))
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    for _ in range(2):
        trainer.train_iteration()
    current = merged_state(trainer.policy.transformer)
    with trainer.objective.old.swapped_in(trainer.params):
        old = {n: t.clone() for n, t in merged_state(trainer.policy.transformer).items()}
    changed = [n for n in old if not torch.equal(old[n].bfloat16(), current[n].bfloat16())]
    assert changed  # else the check below could not tell the two apart
    trainer.train_iteration()  # resyncs the copy at its start, then trains
    copy_state = trainer.rollout.explorer.net.state_dict()
    assert all(torch.equal(copy_state[n], old[n].to(copy_state[n].dtype)) for n in changed)
