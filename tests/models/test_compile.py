"""model.compile: torch.compile (Inductor on the CPU) of the tiny SD3 transformer, per block and whole."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import load_config
from flowrl.schema import ModelConfig
from flowrl.errors import ConfigError
from flowrl.models import load_policy
from flowrl.models.compile import CompileWatch, compiled_graphs
from flowrl.train.loop import Trainer

ROWS = 4  # sampling.batch_size: compiled forwards run on exactly this many rows
LORA = ["lora.rank=4", "lora.alpha=8", "lora.target_modules=[to_q,to_k,to_v,to_out.0]"]


@pytest.fixture(scope="module")
def one_block_sd3(tmp_path_factory):
    """The tiny SD3 with a single transformer block: the fewest graphs to compile (Inductor's C++
    builds dominate these tests). The tests share its graphs (guidance 3, ROWS rows), so Inductor's
    on-disk cache spares the later ones most of the building. They are not marked slow: the suite
    runs its slow tests first, side by side, where these would each build the same graphs at once."""
    from flowrl.models.tiny import build_tiny_sd3

    return str(build_tiny_sd3(tmp_path_factory.mktemp("one-block-sd3") / "pipe", num_layers=1))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from an empty dynamo cache (its graphs would otherwise carry over), and
    leaves none behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def lora_policy(path: str):
    """The tiny SD3 with classifier-free guidance and an adapter that changes the velocity (peft
    starts lora_B at zero, which would make the reference pass equal the policy's)."""
    cfg = load_config("tiny_jpeg", [f"model.path={path}", "model.guidance_scale=3.0", *LORA])
    policy = load_policy(cfg.model, device="cpu")
    policy.add_lora(cfg.lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_trainable_parameters().items():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return policy


def inputs(policy, n: int):
    prompts = ["a red circle", "a blue square", "two green triangles", "a cat"][:n] + ["a dog"] * max(0, n - 4)
    x = torch.randn((n, *policy.latent_shape()), generator=torch.Generator().manual_seed(1))
    return x, policy.encode(prompts)


def test_unknown_mode_is_refused_in_one_sentence():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_jpeg", ["model.compile=fast"])
    assert str(err.value) == "model.compile must be one of none, blocks, full; got 'fast'"
    assert ModelConfig().compile == "none"
    assert load_config("default", []).model.compile == "blocks"  # the default preset compiles (BENCHMARKS.md, bench_compile)


def test_a_compile_after_the_first_iteration_prints_one_line():
    # the trainer's watch over dynamo's graph counter: the first iteration compiles quietly (warm-up),
    # a later one that compiles gets one warning line, not dynamo's guard report
    from torch._dynamo.utils import counters

    lines = []
    watch = CompileWatch()
    counters["stats"]["unique_graphs"] += 5
    assert watch.after_iteration(0, lines.append) == 5 and not lines
    assert watch.after_iteration(1, lines.append) == 0 and not lines
    counters["stats"]["unique_graphs"] += 2
    assert watch.after_iteration(2, lines.append) == 2
    assert len(lines) == 1 and "\n" not in lines[0] and "iteration 2" in lines[0] and "TORCH_LOGS=recompiles" in lines[0]


def test_padding_and_splitting_change_no_row(one_block_sd3):
    # eager, so only the padding is tested: a single row padded to MIN_ROWS, a long batch split
    # into ROWS and a padded rest, a per-row sigma padded alike; every real row gets what the
    # unpadded forward gives it
    policy = lora_policy(one_block_sd3)
    x, cond = inputs(policy, 5)
    sigmas = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5])
    with torch.no_grad():
        plain = [policy.velocity(x[:n], 0.5, {k: v[:n] for k, v in cond.items()}) for n in (1, 3, 5)]
        plain_rows = torch.cat([policy.velocity(x[i : i + 1], float(sigmas[i]), {k: v[i : i + 1] for k, v in cond.items()})
                                for i in range(5)])
        policy.compiled_rows = ROWS
        padded = [policy.velocity(x[:n], 0.5, {k: v[:n] for k, v in cond.items()}) for n in (1, 3, 5)]
        per_row = hasattr(policy, "timestep_rows")  # a velocity that takes one sigma per row
        padded_rows = policy.velocity(x, sigmas, cond) if per_row else plain_rows
    for a, b in zip(plain, padded):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded_rows, plain_rows, atol=1e-5, rtol=1e-5)


def test_padded_micro_batches_give_the_loss_and_gradients_of_unpadded_ones(one_block_sd3):
    # a training micro-batch of 1 row (padded to MIN_ROWS) and one of 5 (split into ROWS + 1, the 1
    # padded): the dropped padding rows add nothing to the loss and pass no gradient back
    policy = lora_policy(one_block_sd3)
    params = policy.trainable_parameters()
    x, cond = inputs(policy, 5)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))

    def loss_and_grads(n: int):
        loss = (policy.velocity(x[:n], 0.6, {k: v[:n] for k, v in cond.items()}) - target[:n]).square().mean()
        return loss.detach(), torch.autograd.grad(loss, params)

    for n in (1, 5):
        policy.compiled_rows = 0
        loss, grads = loss_and_grads(n)
        policy.compiled_rows = ROWS
        padded_loss, padded_grads = loss_and_grads(n)
        torch.testing.assert_close(padded_loss, loss, atol=1e-6, rtol=1e-5)
        for a, b in zip(padded_grads, grads):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blocks", "full"])
def test_compiled_velocity_equals_eager(one_block_sd3, mode):
    # the policy's velocity and the adapter-disabled reference, a short batch (3 of ROWS rows):
    # compiled (Inductor) as eager to 1e-5; the reference pass is one more graph, compiled once
    policy = lora_policy(one_block_sd3)
    x, cond = inputs(policy, 3)
    with torch.no_grad():
        eager = policy.velocity(x, 0.7, cond)
        eager_one = policy.velocity(x[:1], 0.7, {k: v[:1] for k, v in cond.items()})
        with policy.reference():
            eager_ref = policy.velocity(x, 0.7, cond)
    assert (eager - eager_ref).abs().max() > 1e-3  # the adapter matters
    policy.compile(mode, ROWS)
    before = compiled_graphs()
    with torch.no_grad():
        compiled = policy.velocity(x, 0.7, cond)
        with policy.reference():
            compiled_ref = policy.velocity(x, 0.7, cond)
        warm = compiled_graphs()
        again = policy.velocity(x, 0.3, cond)  # another sigma, adapter back on: no new graph
        with policy.reference():
            policy.velocity(x, 0.3, cond)
        # other row counts (a tree's levels, a short last batch) run on the same graphs: the rows are dynamic
        compiled_one = policy.velocity(x[:1], 0.7, {k: v[:1] for k, v in cond.items()})  # padded to MIN_ROWS
        x4, cond4 = inputs(policy, ROWS)
        policy.velocity(x4, 0.7, cond4)
    assert warm > before and compiled_graphs() == warm
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_ref, eager_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_one, eager_one, atol=1e-5, rtol=1e-5)
    assert again.shape == eager.shape


@pytest.mark.slow
def test_training_compiles_only_in_its_first_iteration(tmp_path, one_block_sd3, capsys):
    # nft with a KL: rollouts (no grad, eval), v_old (no grad, train mode), the trained velocity (grad)
    # and the reference (adapter disabled), all with guidance; 6 samples in batches of 4, so the last is padded
    cfg = load_config("tiny_jpeg", [
        f"model.path={one_block_sd3}", "model.compile=blocks", "model.guidance_scale=3.0", "objective.nft.guidance_scale=3.0",
        *LORA, "sampling.num_steps=2", "sampling.sampler=ode",
        "sampling.batch_size=4", "data.prompts_per_iteration=2", "data.group_size=3", "objective.kind=nft",
        "objective.nft.timesteps=1", "objective.nft.old_policy=sampling", "trainer.kl_beta=0.1", "trainer.iterations=2",
        "run.sample_every=0", "run.checkpoint_every=0", "run.tracker=none", "run.progress=false",
    ])
    rows = Trainer(cfg, run_dir=tmp_path / "run").train()
    assert [r["compiled_graphs"] > 0 for r in rows] == [True, False]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows) and rows[-1]["kl"] > 0
    assert "recompiled" not in capsys.readouterr().out


SHAPE_VARYING_RUNS = {
    # BranchGRPO-Mix: levels of 1, 2 and 4 nodes sampled; its SDE window slides one step per
    # iteration, so the trained parents go 1 and 2 (iterations 1-2), then 1, 2 and 4 (iteration 3)
    "tree": ["rollout.kind=tree", "rollout.tree.split_steps=[0,1]", "rollout.tree.branching=[2]", "rollout.tree.between=window",
             "sampling.window.strategy=progressive", "sampling.window.size=1", "sampling.window.start=0",
             "sampling.window.shift_every=1", "data.prompts_per_iteration=1", "data.group_size=4"],
    # G2RPO: 3 anchors per forward, 6 branches and tails (4 + 2 rows)
    "granular": ["rollout.kind=granular", "rollout.granular.branch_steps=[0,1]", "rollout.granular.granularities=[1]",
                 "data.prompts_per_iteration=3", "data.group_size=2"],
    # flat GRPO with a sliding SDE window over 6 samples in batches of 4 and 2
    "windowed flat": ["sampling.window.strategy=progressive", "sampling.window.size=1", "sampling.window.shift_every=1",
                      "data.prompts_per_iteration=2", "data.group_size=3"],
}


@pytest.mark.parametrize("rollout", list(SHAPE_VARYING_RUNS))
def test_trees_granular_and_windowed_runs_compile_only_in_their_first_iteration(tmp_path, one_block_sd3, capsys, rollout):
    # row counts that vary between forwards and between iterations run on the first iteration's graphs
    cfg = load_config("tiny_jpeg", [
        f"model.path={one_block_sd3}", "model.compile=blocks", "model.guidance_scale=3.0", *LORA, "sampling.num_steps=3",
        "sampling.batch_size=4", "trainer.iterations=3", "run.sample_every=0", "run.checkpoint_every=0", "run.tracker=none",
        "run.progress=false", *SHAPE_VARYING_RUNS[rollout],
    ])
    rows = Trainer(cfg, run_dir=tmp_path / "run").train()
    assert [r["compiled_graphs"] > 0 for r in rows] == [True, False, False]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert "recompiled" not in capsys.readouterr().out


def test_the_slow_inductor_settings_of_torchao_are_named_before_compiling():
    # torchao's quantisation configs turn on coordinate-descent tuning for the whole process unless
    # built with set_inductor_config=False: compiling warns in one sentence when it finds it on
    import torch._inductor.config as inductor

    from flowrl.models.compile import compile_network, slow_inductor_flags

    assert slow_inductor_flags() == []
    with inductor.patch(coordinate_descent_tuning=True):  # torch's own patching: its config module has no plain attributes
        with pytest.warns(UserWarning, match=r"^model.compile: Inductor's coordinate_descent_tuning is on \(torchao"):
            compile_network(torch.nn.Sequential(torch.nn.Linear(4, 4)), "full")  # lazy: nothing is built here
    assert slow_inductor_flags() == []


def test_a_compiled_exploration_copy_equals_eager_and_a_resync_compiles_nothing(one_block_sd3):
    # the two-stage rollout compiles the copy's blocks as model.compile says: the emulated FP8 copy
    # (per-row scales) samples as its eager twin, and after a resync (new weights, loaded in
    # place) the next chain builds no graph
    from flowrl.models.compile import compile_network
    from flowrl.sampling.precision import ExplorationCopy
    from flowrl.sampling.rollout import SamplerSpec, rollout
    from flowrl.sampling.schedules import shifted_sigmas

    policy = lora_policy(one_block_sd3)
    policy.compiled_rows = ROWS  # as Trainer's policy.compile leaves it; the copy's view inherits it
    spec = SamplerSpec(shifted_sigmas(2, 3.0), torch.zeros(2, dtype=torch.bool), "ode")
    prompts, seeds = ["a red circle", "a blue square", "a cat"], [1, 2, 3]
    eager = rollout(ExplorationCopy(policy, "fp8", backend="emulated").policy, prompts, seeds, spec, ROWS)
    copy = ExplorationCopy(policy, "fp8", backend="emulated")
    compile_network(copy.net, "blocks")
    compiled = rollout(copy.policy, prompts, seeds, spec, ROWS)
    # a fused kernel may round x / scale differently in the last bit and flip an FP8 code at a rounding
    # boundary: eager and compiled agree to the quantisation's resolution, not to fp32's
    torch.testing.assert_close(compiled.final, eager.final, atol=1e-3, rtol=1e-3)
    warm = compiled_graphs()
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.01)
    copy.resync()
    moved = rollout(copy.policy, prompts, seeds, spec, ROWS)
    assert compiled_graphs() == warm and not torch.equal(moved.final, compiled.final)


def test_without_a_cpu_compiler_the_policy_stays_eager_with_one_warning(one_block_sd3, monkeypatch):
    # Inductor builds CPU kernels with a C++ compiler: where there is none, the default preset (which
    # compiles its blocks) still trains, eager, after one warning line
    import flowrl.models.compile as compile_module

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(compile_module.shutil, "which", lambda name: None)
    assert compile_module.cpu_compiler() is None
    policy = lora_policy(one_block_sd3)
    with pytest.warns(UserWarning, match=r"^model.compile blocks needs a C\+\+ compiler on the CPU .*: the transformer runs eager$"):
        policy.compile("blocks", ROWS)
    assert policy.compiled_rows == 0
    assert not any(getattr(m, "_compiled_call_impl", None) for m in policy.transformer.modules())
