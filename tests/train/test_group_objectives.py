"""DGPO and GDRO on tiny models: the implicit reward of a fresh adapter is 0, one GDRO step
separates the best sample from the worst, GDRO on a group store never samples, DGPO trains
online; group stores are built resumably and refused when partial or corrupted."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import flowrl.sampling.rollout as sampling_rollout
from flowrl.cli import main
from flowrl.config import load_config
from flowrl.core.group_losses import listwise_group_loss
from flowrl.core.seeds import sample_seed
from flowrl.errors import ConfigError, UserError
from flowrl.models import load_policy
from flowrl.offline.store import GroupStore, StoredGroup, StoreWriter
from flowrl.runtime.checkpoint import checkpoint_name, load_checkpoint
from flowrl.train.experience import Experience, SampleBatch
from flowrl.train.objectives.implicit import draw_sigmas, flow_errors, group_batches, group_noise
from flowrl.train.rollouts.offline import STORE_ORDER
from run_checks import run_metrics, trainable

TINY = ["run.tracker=none", "run.progress=false", "run.sample_every=0", "lora.rank=4", "lora.alpha=8", "trainer.kl_beta=0",
        "sampling.sampler=ode", "sampling.num_steps=3", "sampling.eval_num_steps=3", "data.group_size=4", "sampling.batch_size=8",
        "run.cpu_processes=1", "objective.kind=gdro"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_sd3_dir):
    out = tmp_path_factory.mktemp("stores") / "store"
    assert main(["offline", "build", "tiny_jpeg", *TINY, f"model.path={tiny_sd3_dir}", "-o", str(out), "--shard-groups", "2"]) == 0
    return out


def test_a_built_store_holds_every_prompt_group_with_its_rewards(store):
    s = GroupStore.open(store)
    assert len(s) == 4 and len(s.shards) == 2 and s.channel_names == ["jpeg_compressibility"]
    assert [g.prompt for g in s.groups] == ["a red circle", "a blue square", "two green triangles", "a yellow star above a cat"]
    x0 = s.x0([2, 0])
    assert x0.shape == (8, *s.shape) and torch.isfinite(x0).all()
    assert all(len(set(g.seeds)) == 4 and all(math.isfinite(r[0]) for r in g.rewards) for g in s.groups)
    assert not torch.equal(x0[0], x0[1])  # a group's samples differ by their seeds


def test_an_interrupted_build_resumes_to_the_same_store(tmp_path, store, tiny_sd3_dir, monkeypatch):
    out = tmp_path / "store"
    real_add = StoreWriter.add_shard

    def add_once(self, x0, groups):
        if self.index["shards"]:
            raise KeyboardInterrupt
        real_add(self, x0, groups)

    monkeypatch.setattr(StoreWriter, "add_shard", add_once)
    args = ["offline", "build", "tiny_jpeg", *TINY, f"model.path={tiny_sd3_dir}", "-o", str(out), "--shard-groups", "2"]
    assert main(args) == 130
    with pytest.raises(UserError, match="is a partial store \\(2 groups written\\); finish it"):
        GroupStore.open(out)
    monkeypatch.setattr(StoreWriter, "add_shard", real_add)
    assert main(args) == 0
    a, b = GroupStore.open(store), GroupStore.open(out)
    assert [g.rewards for g in a.groups] == [g.rewards for g in b.groups]
    assert torch.equal(a.x0([0, 1, 2, 3]), b.x0([0, 1, 2, 3]))
    assert main(args) == 2  # a complete store is never overwritten


def test_a_corrupted_store_is_refused_with_one_sentence(tmp_path, store, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    shard = bad / GroupStore.open(store).shards[1]["file"]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="shard-00001.safetensors does not match its checksum; the store is corrupted"):
        GroupStore.open(bad)
    index = json.loads((bad / "index.json").read_text())
    index["groups"][0]["rewards"][1] = [float("nan")]
    (bad / "index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="group 0's rewards must be 1 finite numbers"):
        GroupStore.open(bad, verify=False)
    (bad / "index.json").write_text("{not json")
    assert main(["train", "tiny_jpeg", *TINY, "objective.kind=gdro", "rollout.kind=offline", f"data.offline={bad}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"flowrl: error: data.offline '{bad}': index.json is not valid JSON; the store is corrupted, rebuild it"


def test_a_fresh_adapter_has_zero_implicit_reward_and_top1_loss_log_k(tiny_sd3_dir):
    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}"])
    policy = load_policy(cfg.model)
    policy.add_lora(cfg.lora, seed=0)
    x0 = torch.randn(4, *policy.latent_shape(), generator=torch.Generator().manual_seed(0))
    groups = torch.zeros(4, dtype=torch.long)
    eps = group_noise(groups, 0, 0, 0, x0.shape[1:], "cpu")
    assert torch.equal(eps[0], eps[3])  # one noise per group
    with torch.no_grad():
        e = flow_errors(policy, x0, eps, 0.7, policy.encode(["a red circle"] * 4))
    s = -6.0 * (e.err - e.err_ref)
    assert torch.equal(s, torch.zeros(4))
    loss = listwise_group_loss(s, torch.tensor([0.1, 0.9, 0.3, 0.5]), groups, tau=0.05)
    assert loss.item() == pytest.approx(math.log(4))


def _implicit_rewards(run, store_dir, tiny_sd3_dir, group: int, sigma: float) -> torch.Tensor:
    """s = -(err_theta - err_ref) of one stored group under the run's weights (None: a fresh
    adapter), at the (sigma, eps) GDRO trained that group with at iteration 0."""
    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "lora.rank=4", "lora.alpha=8"])
    policy = load_policy(cfg.model)
    policy.add_lora(cfg.lora, seed=0)
    if run is not None:
        policy.load_lora(run / "checkpoints" / "iter_000001" / "lora")
    s = GroupStore.open(store_dir)
    x0 = s.x0([group])
    eps = group_noise(torch.full((len(x0),), group), 0, 0, 0, x0.shape[1:], "cpu")
    with torch.no_grad():
        e = flow_errors(policy, x0, eps, sigma, policy.encode([s.groups[group].prompt] * len(x0)))
    return -(e.err - e.err_ref)


def test_gdro_trains_from_the_store_without_a_sampler_call(tmp_path, store, tiny_sd3_dir, monkeypatch):
    real = sampling_rollout.rollout

    def forbidden(*args, **kwargs):
        raise AssertionError("GDRO on a group store called the sampler")

    for module in list(sys.modules.values()):  # every module that imported the sampler
        if getattr(module, "rollout", None) is real:
            monkeypatch.setattr(module, "rollout", forbidden)
    run = tmp_path / "run"
    args = ["train", "tiny_jpeg", *TINY, f"model.path={tiny_sd3_dir}", "objective.kind=gdro", "rollout.kind=offline",
            f"data.offline={store}", "data.prompts_per_iteration=1", "objective.gdro.gamma=0", "trainer.lr=1e-4",
            "trainer.iterations=1", "trainer.ema=false", "objective.gdro.timesteps=1", "objective.gdro.sigma_range=[0.55,0.65]",
            "--run-dir", str(run)]
    group_index = torch.randperm(4, generator=torch.Generator().manual_seed(sample_seed(0, 0, STORE_ORDER)))[0].item()
    sigma = draw_sigmas(0, 0, 1, [0.55, 0.65], 1.0)[0]
    before = _implicit_rewards(None, store, tiny_sd3_dir, group_index, sigma)
    assert main(args) == 0
    row = run_metrics(run)[0]
    assert row["sampled"] == 0 and row["trained_groups"] == 1 and row["listwise_loss"] == pytest.approx(math.log(4), rel=1e-5)
    group = GroupStore.open(store).groups[group_index]
    rewards = torch.tensor([r[0] for r in group.rewards])
    best, worst = int(rewards.argmax()), int(rewards.argmin())
    after = _implicit_rewards(run, store, tiny_sd3_dir, group_index, sigma)
    assert torch.equal(before, torch.zeros(4))
    assert after[best] - after[worst] > 0  # one step raised the best sample's implicit reward over the worst's


def test_dgpo_trains_online_with_its_clip_kl_and_old_sampler(tmp_path, tiny_sd3_dir):
    run = tmp_path / "run"
    args = ["train", "tiny_jpeg", *TINY, f"model.path={tiny_sd3_dir}", "objective.kind=dgpo", "objective.dgpo.timesteps=2",
            "objective.dgpo.grid_points=3", "objective.dgpo.stepping=micro_batch", "objective.dgpo.sigmas_per_step=1",
            "objective.dgpo.sample_with_old_after=1",
            "trainer.kl_beta=0.1", "trainer.iterations=2", "run.checkpoint_every=2", "--run-dir", str(run)]
    assert main(args) == 0
    rows = run_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1]
    # both groups in one micro-batch, one optimizer step per sigma (sigmas_per_step 1): two steps
    assert all(math.isfinite(r["loss"]) and r["sampled"] == 8 and r["optimizer_steps"] == 2 for r in rows)
    assert rows[1]["kl"] > 0 and 0 <= rows[1]["clip_fraction"] <= 1
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)
    ckpt = load_checkpoint(run / "checkpoints" / checkpoint_name(2))
    assert int(ckpt["dgpo_steps"]["steps"][0]) == 4 and set(ckpt["dgpo_old"]) == set(ckpt["params"])


def test_dgpo_steps_once_per_iteration_and_its_old_model_follows_the_references_schedule(tmp_path, tiny_sd3_dir):
    """DGPO's code (Luo-Yihong/DGPO) accumulates the gradient over all its batches and training
    timesteps and steps once per epoch; its old model is then updated after each step with decay
    min(0.3, 0.001 x steps), steps counted before that update. tiny_jpeg's 4-step grid: the
    default grid_points (the first half, at least `timesteps`) is the whole grid."""
    run = tmp_path / "run"
    args = ["train", "tiny_jpeg", *TINY, f"model.path={tiny_sd3_dir}", "objective.kind=dgpo", "sampling.batch_size=4", "sampling.num_steps=4",
            "trainer.iterations=3", "run.checkpoint_every=1", "--run-dir", str(run)]
    assert main(args) == 0
    rows = run_metrics(run)
    # 2 micro-batches (one group of 4 each) x 4 sigmas = 8 pairs, one optimizer step
    assert [(r["trained_transitions"], r["optimizer_steps"]) for r in rows] == [(8, 1)] * 3
    for i in (1, 2, 3):
        ckpt = load_checkpoint(run / "checkpoints" / checkpoint_name(i))
        assert int(ckpt["dgpo_steps"]["steps"][0]) == i
    old = lambda i: load_checkpoint(run / "checkpoints" / checkpoint_name(i))["dgpo_old"]
    for i in (1, 2, 3):
        decay = min(0.3, 0.001 * (i - 1))  # the decay at step i - 1 (0: the first update copies)
        new, prev = trainable(run, i), (old(i - 1) if i > 1 else None)
        for k in new:
            expected = new[k] if prev is None else decay * prev[k] + (1 - decay) * new[k]
            assert torch.allclose(old(i)[k], expected, atol=1e-7), (i, k)


def test_dgpo_stepping_plans_the_references_and_flowrls_steps():
    from flowrl.train.objectives.stepping import step_plan

    # the reference: every (micro-batch, sigma) pair of the epoch in one step
    assert step_plan(2, 4, "iteration") == [[(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]]
    # flowrl's: every 2 sigmas of a micro-batch; a short last chunk steps alone
    assert step_plan(2, 3, "micro_batch", 2) == [[(0, 0), (0, 1)], [(0, 2)], [(1, 0), (1, 1)], [(1, 2)]]
    # gradient accumulation: whole micro-batches, 2 per step, the last one alone
    assert step_plan(3, 2, "micro_batch", 0, 2) == [[(0, 0), (0, 1), (1, 0), (1, 1)], [(2, 0), (2, 1)]]
    with pytest.raises(ConfigError, match="objective.dgpo.sigmas_per_step"):
        load_config("tiny_jpeg", ["objective.kind=dgpo", "objective.dgpo.stepping=micro_batch", "trainer.gradient_accumulation_steps=2"])
    with pytest.raises(ConfigError, match="objective.dgpo.stepping must be one of"):
        load_config("tiny_jpeg", ["objective.kind=dgpo", "objective.dgpo.stepping=epoch"])


def test_dgpo_log_sigmoid_form_starts_at_log_2(tmp_path, tiny_sd3_dir):
    run = tmp_path / "run"
    args = ["train", "tiny_jpeg", *TINY, f"model.path={tiny_sd3_dir}", "objective.kind=dgpo", "objective.dgpo.loss_form=log_sigmoid",
            "objective.dgpo.sigma_draw=stratified", "objective.dgpo.clip_range=0", "objective.dgpo.sample_with_old_after=0",
            "objective.dgpo.sigmas_per_step=0",
            "trainer.iterations=1", "--run-dir", str(run)]
    assert main(args) == 0
    assert run_metrics(run)[0]["loss"] == pytest.approx(math.log(2), rel=1e-4)  # delta = 0 at the first forward: log 2 per group


class _Acc:
    def __init__(self, num_processes=1):
        self.num_processes, self.device = num_processes, "cpu"

    def gather(self, t):
        return t


def _experience(prompt_ids, local_index, advantages=None):
    n = len(prompt_ids)
    advantages = torch.tensor([1.0, -1.0] * n)[:n] if advantages is None else torch.tensor(advantages)
    x0 = torch.arange(len(local_index), dtype=torch.float32)[:, None].expand(-1, 2)
    batch = SampleBatch(x0, [f"p{i}" for i in local_index.tolist()], torch.zeros(len(local_index), dtype=torch.long), local_index)
    return Experience(0, torch.zeros(n, 1), torch.tensor(prompt_ids), torch.ones(n, dtype=torch.bool), advantages, "float32",
                      samples=[batch])


def test_group_batches_pack_whole_groups():
    exp = _experience([0, 0, 1, 1, 1, 2, 2], torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))  # 7 is a padding copy
    packs = group_batches(exp, _Acc(), batch_size=4)
    assert [p.groups.tolist() for p in packs] == [[0, 0], [1, 1, 1], [2, 2]]  # packing never splits a group
    assert all(p.weight == 1.0 for p in packs)
    tied = _experience([0, 0, 1, 1], torch.tensor([0, 1, 2, 3]), advantages=[0.0, 0.0, 1.0, -1.0])
    assert [p.groups.tolist() for p in group_batches(tied, _Acc(), batch_size=4)] == [[1, 1]]  # no preference, not trained
    all_tied = _experience([0, 0, 1, 1], torch.tensor([0, 1, 2, 3]), advantages=[0.0] * 4)
    assert group_batches(all_tied, _Acc(), batch_size=4) == []  # an iteration with no preference anywhere trains nothing


def test_groups_split_across_processes_come_together_whole_and_balanced():
    from flowrl.runtime.shards import whole_group_owners
    from flowrl.train.objectives.implicit import local_samples, take_whole_groups

    # largest first onto the least-loaded process: 5 | 3 + 2, not 5 + 2 | 3 as in id order
    assert whole_group_owners({0: 2, 1: 5, 2: 3}, 2) == {1: 0, 2: 1, 0: 1}
    assert whole_group_owners({7: 4}, 3) == {7: 0}  # more processes than groups: the rest hold none
    # an allocator's two stages, each split evenly: group 1's samples 2, 3 on process 0, samples 6, 7 on process 1
    prompt_ids = [0, 0, 1, 1, 2, 2, 1, 1]
    processes = [_experience(prompt_ids, torch.tensor([0, 1, 2, 3])), _experience(prompt_ids, torch.tensor([4, 5, 6, 7]))]
    everyone = [local_samples(e) for e in processes]
    mine = [take_whole_groups(everyone, torch.tensor(prompt_ids), 2, p) for p in range(2)]
    assert [m.index.tolist() for m in mine] == [[2, 3, 6, 7], [0, 1, 4, 5]]  # group 1 (4 samples) whole on process 0
    assert mine[0].prompts == ["p2", "p3", "p6", "p7"]  # each sample keeps its own prompt, seed and image
    torch.testing.assert_close(mine[1].x0[:, 0], torch.tensor([0.0, 1.0, 0.0, 1.0]))


def test_a_store_of_ones_own_images_trains(tmp_path, tiny_sd3_dir):
    store = tmp_path / "mine"
    writer = StoreWriter(store, data="images", shape=[3, 64, 64], channel_names=["my_score"], source={"origin": "test"})
    images = torch.rand(8, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    writer.add_shard(images, [StoredGroup("a cat", 0, 0, 4, [0, 1, 2, 3], [[0.1], [0.7], [0.4], [0.9]], [True] * 4),
                              StoredGroup("a dog", 0, 4, 4, [4, 5, 6, 7], [[0.3], [0.2], [0.8], [0.5]], [True] * 4)])
    writer.finish()
    run = tmp_path / "run"
    assert main(["train", "tiny_jpeg", *TINY, f"model.path={tiny_sd3_dir}", "rollout.kind=offline", f"data.offline={store}",
                 "reward.weights={my_score: 1.0}", "trainer.iterations=2", "data.prompts_per_iteration=1", "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert [r["trained_groups"] for r in rows] == [1, 1] and all(math.isfinite(r["loss"]) for r in rows)
    assert main(["train", "tiny_jpeg", *TINY, f"model.path={tiny_sd3_dir}", "rollout.kind=offline", f"data.offline={store}",
                 "reward.weights={pickscore: 1.0}", "--run-dir", str(tmp_path / "other")]) == 2  # a channel the store lacks


def test_the_corrected_score_follows_gdro_and_the_judge_sees_artefacts():
    from flowrl.train.evaluate import corrected_score
    from rewards.shapes import cleanliness_batch

    r = torch.tensor([1.0, 1.0, 0.0])
    # u on 1-5: judge 1.0 -> 5, 0.5 -> 3, 0.0 -> 1
    torch.testing.assert_close(corrected_score(r, torch.tensor([1.0, 0.5, 0.0])), torch.tensor([2.2, 0.2, 0.2]))
    torch.testing.assert_close(corrected_score(r, torch.tensor([0.99, 0.98, 1.0]), (0.98, 1.0)), torch.tensor([0.2, -1.8, 0.2]))
    clean = torch.ones(2, 3, 8, 8)  # the background
    clean[1, :, 2:6, 2:6] = torch.tensor([0.5, 0.5, 0.5])[:, None, None]  # a grey smear, on no palette colour
    torch.testing.assert_close(cleanliness_batch(clean), torch.tensor([1.0, 0.75]))


def test_eval_prints_the_corrected_score_next_to_each_channel(tmp_path, tiny_sd3_dir, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    assert main(["eval", "--config", "tiny_jpeg", "--prompts", str(prompts), "--judge", "brightness", f"model.path={tiny_sd3_dir}",
                 "sampling.eval_num_steps=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("judge ") for line in lines)
    assert any(line.startswith("corrected jpeg_compressibility ") for line in lines)
    assert any(line.startswith("judge = the mean of brightness, which the run did not train on; corrected CHANNEL = GDRO's")
               for line in lines)
    # shapes-world prompts: the artefact measures (docs/monitor.md), patch energy on the tiny SD3's 16-pixel tokens
    for row in ("background impurity ", "fill nonuniformity ", "patch energy "):
        assert any(line.startswith(row) for line in lines), row
    assert any(line.startswith("artefacts, lower is cleaner") for line in lines)
    assert main(["eval", "--config", "tiny_jpeg", "--prompts", str(prompts), "--judge", "no_such_judge",
                 f"model.path={tiny_sd3_dir}"]) == 2
