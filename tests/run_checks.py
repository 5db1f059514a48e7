"""Checks on run directories shared by the training tests (imported from the tests folder)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.runtime.checkpoint import latest_checkpoint, load_checkpoint


def run_metrics(run: Path) -> list[dict]:
    """metrics.jsonl rows without the wall-clock timings and rates (which no two runs share)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k.startswith("time_") or k.endswith("_per_s"))} for r in rows]


def trainable(run: Path, iteration: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"iter_{iteration:06d}" / "trainable.safetensors"))


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The trained weights of the run's latest checkpoint (every run writes one as it ends)."""
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None, f"{run} has no checkpoint"
    return load_checkpoint(ckpt)["params"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit for bit, every tensor."""
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


def assert_resume_repeats(args: list[str], straight: Path, stopped: Path) -> None:
    """`straight` ran `args` for 4 iterations with a checkpoint every 2. Running them for 2 into
    `stopped` and resuming to 4 must give the same metrics and bit-identical weights."""
    assert main(["train", *args, "trainer.iterations=2", "--run-dir", str(stopped)]) == 0
    assert len(run_metrics(stopped)) == 2
    assert main(["train", "--resume", str(stopped), "trainer.iterations=4"]) == 0
    assert run_metrics(stopped) == run_metrics(straight)
    a, b = trainable(straight, 4), trainable(stopped, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def lora_grads(loss: torch.Tensor, policy) -> torch.Tensor:
    """The gradient of `loss` on the policy's trainable weights, flattened (the graph is kept)."""
    params = list(policy.named_trainable_parameters().values())
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])


def assert_close_relative(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-6) -> None:
    """The largest gap within `rel` of the reference's largest magnitude."""
    scale = ref.abs().max().clamp(min=1e-30)
    assert ((ours - ref).abs().max() / scale).item() <= rel, ((ours - ref).abs().max().item(), scale.item())


def record_decays(ema) -> list:
    """The decay of every later `ema.update(params, decay)` call, in order (the update still runs)."""
    decays, update = [], ema.update

    def recording_update(params, decay=None):
        decays.append(decay)
        update(params, decay)

    ema.update = recording_update
    return decays


def permute_rewards_within_groups(monkeypatch) -> None:
    """The learning tests' control for any engine: as samples are scored (flowrl.train.scoring,
    which flat, windowed, tree, granular and two-stage rollouts all go through), each reward is
    swapped with that of another sample of the same prompt (runs of one prompt in scoring order; a
    fixed generator); a group store's rewards are permuted within each group as it opens. The
    rewards' values and spread stay, so every objective takes updates of the same size and noise,
    but their link to the images goes: a score that still rises did so by drift, not learning."""
    import flowrl.offline.store as store
    import flowrl.train.scoring as scoring

    generator = torch.Generator().manual_seed(1234)

    def order(prompts: list[str]) -> torch.Tensor:
        perm, i = torch.arange(len(prompts)), 0
        while i < len(prompts):
            j = i
            while j < len(prompts) and prompts[j] == prompts[i]:
                j += 1
            perm[i:j] = i + torch.randperm(j - i, generator=generator)
            i = j
        return perm

    start, finish, opened = scoring.Scoring.start, scoring.Scoring.finish, store.GroupStore.open.__func__

    def start_recording(self, prompts):
        self.control_prompts = list(prompts)
        return start(self, prompts)

    def finish_permuted(self, n):
        scores = finish(self, n)
        assert len(scores.rewards) == len(self.control_prompts), "the control permutes one process's rewards"
        perm = order(self.control_prompts)
        for name in ("rewards", "valid", "local_rewards", "local_valid"):
            setattr(scores, name, getattr(scores, name)[perm])
        return scores

    def open_permuted(cls, *args, **kwargs):
        groups = opened(cls, *args, **kwargs)
        for g in groups.groups:
            perm = torch.randperm(g.size, generator=generator).tolist()
            g.rewards, g.valid = [g.rewards[i] for i in perm], [g.valid[i] for i in perm]
        return groups

    monkeypatch.setattr(scoring.Scoring, "start", start_recording)
    monkeypatch.setattr(scoring.Scoring, "finish", finish_permuted)
    monkeypatch.setattr(store.GroupStore, "open", classmethod(open_permuted))


def permute_text_rewards_within_groups(monkeypatch) -> None:
    """The text path's control: before the advantages are estimated (flowrl.text.collect.
    TextCollector.advantages), each completion's rewards are swapped with those of another
    completion of the same prompt (a fixed generator). Group sizes and reward spread stay, so the
    updates keep their size and noise but lose their link to the completions."""
    from flowrl.text.collect import TextCollector

    generator, estimate = torch.Generator().manual_seed(1234), TextCollector.advantages

    def advantages_of_permuted_rewards(self, iteration, prompt_ids, rewards, valid):
        perm = torch.arange(len(prompt_ids))
        for prompt in prompt_ids.unique():
            rows = (prompt_ids == prompt).nonzero().flatten()
            perm[rows] = rows[torch.randperm(len(rows), generator=generator)]
        return estimate(self, iteration, prompt_ids, rewards[perm], valid[perm])

    monkeypatch.setattr(TextCollector, "advantages", advantages_of_permuted_rewards)
