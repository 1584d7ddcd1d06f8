"""Group-aware sampling of prompts across processes."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from mmgrpo.config import ConfigError


@dataclass
class GroupSampler:
    """Chooses the prompts of each rollout so that every group lives, whole, on one process.

    Each step takes ``prompts_per_step`` items from a seeded permutation of the dataset (reshuffled per epoch,
    identical on every process); process ``rank`` takes a contiguous slice of ``prompts_per_step / world_size``
    of them and samples all G outputs of each itself. Group ids are global and unique over the run:
    ``step_index * prompts_per_step + j``. A step that runs past the end of an epoch continues in the next one,
    whose order puts last the items the step already holds (``held_back``): a step of at most ``num_items``
    prompts never draws one twice, and every epoch draws every item once.

    The state (``epoch``, ``position``, ``steps``, ``held_back``) is saved in checkpoints, so a resumed run sees
    the same prompts.
    """

    num_items: int
    prompts_per_step: int
    world_size: int = 1
    rank: int = 0
    seed: int = 0
    epoch: int = 0
    position: int = 0
    steps: int = 0
    held_back: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_items < 1:
            raise ValueError("the training dataset is empty")
        if self.prompts_per_step % self.world_size:
            raise ConfigError(f"bad value for 'train.prompts_per_step': {self.prompts_per_step} must be divisible "
                              f"by the {self.world_size} processes")

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_items, generator=g).tolist()

    def _epoch_order(self) -> list[int]:
        """The current epoch's item order: its permutation with the ``held_back`` items moved last (stable)."""
        held = set(self.held_back)
        order = self._order(self.epoch)
        return [i for i in order if i not in held] + [i for i in order if i in held]

    def next(self, count: int | None = None) -> tuple[list[int], list[int]]:
        """(local item indices, their global group ids) for the next rollout of ``count`` prompts in all
        (``prompts_per_step`` when None; at most that, and divisible by the processes: dynamic sampling's refill
        draws only the groups it misses); advances the state."""
        count = self.prompts_per_step if count is None else count
        if not 0 < count <= self.prompts_per_step or count % self.world_size:
            raise ValueError(f"a rollout of {count} prompts over {self.world_size} processes (at most "
                             f"{self.prompts_per_step}, divisible by the processes)")
        chosen: list[int] = []
        order = self._epoch_order()
        while len(chosen) < count:
            if self.position == self.num_items:
                self.epoch, self.position, self.held_back = self.epoch + 1, 0, list(chosen)
                order = self._epoch_order()
            take = min(count - len(chosen), self.num_items - self.position)
            chosen += order[self.position:self.position + take]
            self.position += take
        per_rank = count // self.world_size
        lo = self.rank * per_rank
        ids = [self.steps * self.prompts_per_step + j for j in range(lo, lo + per_rank)]
        self.steps += 1
        return chosen[lo:lo + per_rank], ids

    def state_dict(self) -> dict[str, int | list[int]]:
        return {"epoch": self.epoch, "position": self.position, "steps": self.steps,
                "held_back": list(self.held_back), "num_items": self.num_items}

    def load_state_dict(self, state: dict[str, int | list[int]]) -> None:
        """Restore a :meth:`state_dict`. One saved over a dataset of another size cannot continue its epoch (its
        position indexes another permutation): the next epoch starts, with a RuntimeWarning."""
        self.epoch, self.position, self.steps = state["epoch"], state["position"], state["steps"]
        self.held_back = list(state.get("held_back", []))  # none in checkpoints from before: the plain order
        saved = state.get("num_items", self.num_items)  # none in checkpoints from before: not checked
        if saved != self.num_items:
            self.epoch, self.position, self.held_back = self.epoch + (self.position > 0), 0, []
            warnings.warn(f"the checkpoint's sampler drew from {saved} training items and this run has "
                          f"{self.num_items}: epoch {self.epoch} starts here", RuntimeWarning, stacklevel=2)
