"""What a search returns: for each budget mark, the chosen sample of every prompt and the cost."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SearchResult:
    method: str
    budgets: list[int] = field(default_factory=list)  # NFE per prompt of each mark, ascending
    latents: list[torch.Tensor] = field(default_factory=list)  # per mark: [P, *latent] the chosen sample of each prompt
    rewards: list[torch.Tensor] = field(default_factory=list)  # per mark: [P] its searched reward
    ledgers: list[list[dict]] = field(default_factory=list)  # per mark: each prompt's Ledger.as_dict() when it was chosen
    seconds: list[float] = field(default_factory=list)  # per mark: wall time from the start until every prompt had it

    def add(self, budget: int, latents: torch.Tensor, rewards: torch.Tensor, ledgers: list[dict], seconds: float) -> None:
        self.budgets.append(int(budget))
        self.latents.append(latents)
        self.rewards.append(rewards)
        self.ledgers.append(ledgers)
        self.seconds.append(float(seconds))

    def totals(self, mark: int = -1) -> dict:
        """The ledger of a mark summed over prompts."""
        keys = self.ledgers[mark][0].keys()
        return {k: sum(entry[k] for entry in self.ledgers[mark]) for k in keys}
