"""Diffusion Tree Sampling (DTS) and its greedy variant DTS* (Jain et al., arXiv 2506.20701).

One tree per prompt over denoising states at the branch steps (every `branch_every` steps; the
root stands before the initial noise). Each iteration selects a node by the tree's rule (core:
progressive widening, Boltzmann for DTS, UCT for DTS*), expands one new child with the proposal
p_theta, rolls it out to a finished sample while adding the state at every branch step it passes
to the tree, and backs its reward up (soft backup). A node keeps its state and velocity, so an
expansion from a node at step s costs T - s - 1 network evaluations and one from the root T.

Batched: `in_flight` iterations per tree are selected before any is rolled out (a selection
counts its visits at once, so the next goes elsewhere), and the rollouts of all trees advance
together, one batched network call per step. DTS answers with a sample drawn from the built tree
(no network call), DTS* with the best finished sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from flowrl.core.search import Ledger, SearchTree
from flowrl.sampling.tree import path_seed
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.search.problem import advance, proposal
from flowrl.search.result import SearchResult


def branch_steps(num_steps: int, every: int) -> list[int]:
    """The steps a tree branches at: 0, every, 2 every, ... below the last step (a branch there
    would cost no network call, so the NFE budget could not bound it)."""
    if every < 1:
        raise ValueError(f"branch_every must be at least 1, got {every}")
    return list(range(0, max(num_steps - 1, 1), every))


@dataclass
class _Rollout:
    tree: int
    start: int  # the node select() chose
    node: int  # the last tree node on this rollout's path
    t0: int  # the step the rollout starts from
    t: int  # the step the state x is at
    x: torch.Tensor
    v: torch.Tensor | None  # the velocity at (x, t) when the node already knows it
    seed: int


def dts(problem, seeds: Sequence[int], budgets: Sequence[int], sampler: str = "flow_grpo", noise_level: float = 0.7,
        lam: float = 10.0, star: bool = False, branch_every: int = 2, width_c: float = 2.0, width_alpha: float = 0.8,
        uct_c: float = 1.0, backup: str = "soft", in_flight: int = 8, progress=None) -> SearchResult:
    """DTS (star=False) or DTS* (star=True) per prompt, anytime: one tree grows through the budget
    marks and the answer at each mark is what it had when it reached that mark."""
    spec, T = proposal(problem.sigmas, sampler, noise_level), problem.sigmas.numel() - 1
    P, shape = problem.num_prompts, problem.latent_shape()
    budgets = sorted(int(b) for b in budgets)
    if budgets[0] < T:
        raise ValueError(f"a budget of {budgets[0]} network evaluations per prompt is less than one sample ({T} steps)")
    steps = branch_steps(T, branch_every)
    depth_of_step = {s: d + 1 for d, s in enumerate(steps)}
    leaf_depth = len(steps) + 1
    trees = [SearchTree(leaf_depth, lam, backup, width_c, width_alpha, "uct" if star else "boltzmann", uct_c) for _ in range(P)]
    states: list[dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = [{} for _ in range(P)]
    ledgers = [Ledger(budgets[-1]) for _ in range(P)]
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    rollouts_done = [0] * P
    result, start_time = SearchResult("dts_star" if star else "dts"), time.perf_counter()

    def cost(p: int, node: int) -> int:
        return T if node == 0 else T - 1 - steps[trees[p].depth[node] - 1]

    for mark in budgets:
        cut = [False] * P
        while not all(cut):
            batch: list[_Rollout] = []
            for p in range(P):
                for _ in range(in_flight):
                    if cut[p]:
                        break
                    node = trees[p].select(gens[p])
                    c = cost(p, node)
                    if ledgers[p].nfe + c > mark:
                        trees[p].cancel(node)
                        cut[p] = True
                        break
                    ledgers[p].charge(nfe=c)
                    seed = path_seed(seeds[p], rollouts_done[p])
                    rollouts_done[p] += 1
                    if node == 0:
                        batch.append(_Rollout(p, node, node, 0, 0, seeded_noise([seed], INITIAL, shape)[0], None, seed))
                    else:
                        x, v = states[p][node]
                        t0 = steps[trees[p].depth[node] - 1]
                        batch.append(_Rollout(p, node, node, t0, t0, x, v, seed))
            if batch:
                _roll_out(problem, spec, T, batch, trees, states, depth_of_step, progress)
                _score_leaves(problem, batch, trees, states, ledgers)
        _answer(result, mark, trees, states, ledgers, gens, star, start_time)
    return result


def _score_leaves(problem, batch: list[_Rollout], trees, states, ledgers) -> None:
    """Score the finished rollouts of `batch`, add each as a leaf of its tree and back its reward up."""
    finished = torch.stack([r.x for r in batch])
    rewards = problem.score(finished, [r.tree for r in batch])
    for r, reward in zip(batch, rewards.tolist()):
        ledgers[r.tree].charge(decodes=1, reward_calls=1)
        leaf = trees[r.tree].add(r.node)
        states[r.tree][leaf] = (r.x, None)
        trees[r.tree].backup(leaf, reward)
        trees[r.tree].finish_expansion(r.start)


def _answer(result: SearchResult, mark: int, trees, states, ledgers, gens, star: bool, start_time: float) -> None:
    """Add each tree's answer at budget `mark` to `result`: its best leaf (DTS*) or a draw from it (DTS)."""
    P = len(trees)
    chosen = [trees[p].best_leaf() if star else trees[p].draw(gens[p]) for p in range(P)]
    result.add(mark, torch.stack([states[p][n][0] for p, n in enumerate(chosen)]),
               torch.tensor([trees[p].value[n] for p, n in enumerate(chosen)]),
               [dict(ledgers[p].as_dict(), nodes=len(trees[p]), samples=len(trees[p].leaves())) for p in range(P)],
               time.perf_counter() - start_time)


def _roll_out(problem, spec, T: int, batch: list[_Rollout], trees, states, depth_of_step, progress) -> None:
    """Advance every rollout of `batch` to sigma = 0, one batched network call per step, adding the
    state (and its velocity) at each branch step passed to the rollout's tree."""
    for t in range(min(r.t for r in batch), T):
        active = [r for r in batch if r.t == t]
        need = [r for r in active if r.v is None]
        if need:
            v = problem.velocity(torch.stack([r.x for r in need]), t, [r.tree for r in need])
            for r, v_r in zip(need, v):
                r.v = v_r
            if progress is not None:
                progress.update(len(need))
        for r in active:
            if t in depth_of_step and (r.start == 0 or t > r.t0):  # a node's own state is in the tree already
                node = trees[r.tree].add(r.node)
                states[r.tree][node] = (r.x, r.v)
                r.node = node
        x_next = advance(spec, torch.stack([r.x for r in active]), torch.stack([r.v for r in active]), t, [r.seed for r in active])
        for r, x in zip(active, x_next):
            r.x, r.v, r.t = x, None, t + 1
