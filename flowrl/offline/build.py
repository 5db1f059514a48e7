"""`flowrl offline build`: sample a group of k per prompt once, score every sample with every
reward channel, and write a group store (flowrl/offline/store.py), shard by shard, resumable."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from flowrl.core.seeds import sample_seed
from flowrl.offline.store import GroupStore, StoredGroup, StoreWriter
from flowrl.sampling.rollout import SamplerSpec, rollout

BUILD_ITERATION = -2  # the `iteration` key of a store's sample seeds (training iterations are >= 0, grids -1)


def build_store(policy, reward, prompts: list[str], out, spec: SamplerSpec, group_size: int, seed: int, batch_size: int,
                source: dict, shard_groups: int = 32, progress: bool = True) -> GroupStore:
    """Sample `group_size` chains per prompt under `spec` (seed of sample j of group i:
    sample_seed(seed, BUILD_ITERATION, i * group_size + j)), score them with `reward` (a
    MultiReward; invalid outputs are kept, marked invalid, when reward.on_invalid is drop) and
    write `shard_groups` groups per shard. Run again after an interruption to continue."""
    shape = list(policy.latent_shape())
    writer = StoreWriter(out, "latents", shape, list(reward.channel_names),
                         {**source, "group_size": group_size, "seed": seed, "prompts": len(prompts)})
    done = writer.groups_done
    bar = tqdm(total=len(prompts), initial=done, desc="offline build", unit="group", disable=not progress)
    for first in range(done, len(prompts), shard_groups):
        chunk = prompts[first : first + shard_groups]
        sample_prompts = [p for p in chunk for _ in range(group_size)]
        seeds = [sample_seed(seed, BUILD_ITERATION, first * group_size + j) for j in range(len(sample_prompts))]
        finals, scores, valid = [], [], []

        def on_batch(batch: slice, final: torch.Tensor) -> None:
            s, v = reward.score_with_mask(policy.decode(final), sample_prompts[batch])
            finals.append(final.cpu()), scores.append(s), valid.append(v)

        with torch.no_grad():
            rollout(policy, sample_prompts, seeds, spec, batch_size, on_batch=on_batch)
        rewards, ok = torch.cat(scores), torch.cat(valid)
        groups = [StoredGroup(p, 0, i * group_size, group_size, seeds[i * group_size : (i + 1) * group_size],
                              rewards[i * group_size : (i + 1) * group_size].tolist(), ok[i * group_size : (i + 1) * group_size].tolist())
                  for i, p in enumerate(chunk)]
        writer.add_shard(torch.cat(finals), groups)
        bar.update(len(chunk))
    bar.close()
    return writer.finish()
