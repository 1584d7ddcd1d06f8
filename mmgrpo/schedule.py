"""Re-planning where a learning-rate schedule ends while the run goes, for runs bounded by wall-clock time.

A transformers schedule (cosine, linear, ...) is a function of the optimiser step over a fixed horizon
(``train.max_steps``). A run that stops on a time budget instead ends wherever its machine's speed puts it, so a
decaying schedule is cut off part-way (a slow machine stops with the lr still high). :class:`ScheduleWarp` maps
optimiser steps onto the schedule's own step axis so that the rest of the schedule, from the current step on, is
stretched or squeezed to end at another step: the lr is continuous at the re-planning step, and the shape of the
schedule (warm-up, decay) is kept. :func:`replanned_end` decides where to end it, from the pace so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

from torch.optim.lr_scheduler import LambdaLR

REPLAN_TOLERANCE = 0.05
"""A schedule is re-planned only when the projected end is this far (as a fraction) from the planned one: the pace
of the first steps is noisy, a machine fast enough for the whole schedule keeps it as built, and a schedule that
ends 5% late leaves a cosine at 0.6% of its peak."""


@dataclass
class ScheduleWarp:
    """Optimiser step -> position on the schedule's axis [0, horizon]; the identity until :meth:`replan`.

    From ``anchor_step`` on, positions run linearly from ``anchor_position`` to ``horizon``, reached at step
    ``end``, and stay there (so a cosine schedule holds 0 instead of rising again)."""

    horizon: float
    """The step count the schedule was built for (``train.max_steps``)."""
    anchor_step: float = 0.0
    """The optimiser step of the last re-planning."""
    anchor_position: float = 0.0
    """The schedule position at ``anchor_step``."""
    end: float | None = None
    """The optimiser step at which the schedule reaches its end; None: ``horizon``."""

    def __call__(self, step: float) -> float:
        if self.end is None:  # never re-planned: exactly the schedule as built
            return min(self.horizon, step)
        fraction = (step - self.anchor_step) / (self.end - self.anchor_step)
        return min(self.horizon, self.anchor_position + (self.horizon - self.anchor_position) * fraction)

    def replan(self, step: int, end: int) -> None:
        """From optimiser ``step`` on, reach the schedule's end at step ``end`` (at least ``step + 1``)."""
        self.anchor_position = self(step)
        self.anchor_step = float(step)
        self.end = float(max(end, step + 1))

    def planned_end(self) -> float:
        """The optimiser step at which the schedule reaches its end."""
        return self.horizon if self.end is None else self.end

    def state_dict(self) -> dict[str, float | None]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def _warped(lr_lambda: Callable[[float], float], warp: ScheduleWarp, step: int) -> float:
    return lr_lambda(warp(step))


def warp_schedule(schedule: LambdaLR, horizon: int) -> ScheduleWarp:
    """Route every lr factor of ``schedule`` through a new :class:`ScheduleWarp` (the identity until re-planned)
    and return it. The lr factors accept a fractional step, as transformers' schedules do."""
    warp = ScheduleWarp(float(horizon))
    schedule.lr_lambdas = [partial(_warped, fn, warp) for fn in schedule.lr_lambdas]
    return warp


def projected_end(step: int, elapsed_s: float, budget_s: float) -> int:
    """The optimiser step at which a budget of ``budget_s`` seconds ends, if the steps after ``step`` (reached after
    ``elapsed_s`` seconds) go at the pace of the ones before."""
    return step + int((budget_s - elapsed_s) * step / elapsed_s)


def replanned_end(step: int, elapsed_s: float, budget_s: float, planned_end: float, max_steps: int) -> int | None:
    """Where a decaying schedule at optimiser ``step``, ``elapsed_s`` into a time budget of ``budget_s``, should now
    end: the projected end of the budget (:func:`projected_end`, at most ``max_steps``), or None to keep
    ``planned_end`` (the projection is within ``REPLAN_TOLERANCE`` of it, or the budget is spent)."""
    end = min(projected_end(step, elapsed_s, budget_s), max_steps)
    if end <= step or abs(end - planned_end) <= REPLAN_TOLERANCE * planned_end:
        return None
    return end
