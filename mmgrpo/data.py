"""Group-aware sampling of prompts across processes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmgrpo.config import ConfigError


@dataclass
class GroupSampler:
    """Chooses the prompts of each rollout so that every group lives, whole, on one process.

    Each step takes ``prompts_per_step`` items from a seeded permutation of the dataset (reshuffled per epoch,
    identical on every process); process ``rank`` takes a contiguous slice of ``prompts_per_step / world_size``
    of them and samples all G outputs of each itself. Group ids are global and unique over the run:
    ``step_index * prompts_per_step + j``.

    The state (``epoch``, ``position``, ``steps``) is saved in checkpoints, so a resumed run sees the same prompts.
    """

    num_items: int
    prompts_per_step: int
    world_size: int = 1
    rank: int = 0
    seed: int = 0
    epoch: int = 0
    position: int = 0
    steps: int = 0

    def __post_init__(self) -> None:
        if self.num_items < 1:
            raise ValueError("the training dataset is empty")
        if self.prompts_per_step % self.world_size:
            raise ConfigError(f"bad value for 'train.prompts_per_step': {self.prompts_per_step} must be divisible "
                              f"by the {self.world_size} processes")

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_items, generator=g).tolist()

    def next(self, count: int | None = None) -> tuple[list[int], list[int]]:
        """(local item indices, their global group ids) for the next rollout of ``count`` prompts in all
        (``prompts_per_step`` when None; at most that, and divisible by the processes: dynamic sampling's refill
        draws only the groups it misses); advances the state."""
        count = self.prompts_per_step if count is None else count
        if not 0 < count <= self.prompts_per_step or count % self.world_size:
            raise ValueError(f"a rollout of {count} prompts over {self.world_size} processes (at most "
                             f"{self.prompts_per_step}, divisible by the processes)")
        chosen: list[int] = []
        order = self._order(self.epoch)
        while len(chosen) < count:
            if self.position == self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order(self.epoch)
            take = min(count - len(chosen), self.num_items - self.position)
            chosen += order[self.position:self.position + take]
            self.position += take
        per_rank = count // self.world_size
        lo = self.rank * per_rank
        ids = [self.steps * self.prompts_per_step + j for j in range(lo, lo + per_rank)]
        self.steps += 1
        return chosen[lo:lo + per_rank], ids

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self.steps = state["epoch"], state["position"], state["steps"]
