"""Exponential moving average of the trainable weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    """``shadow = decay * shadow + (1 - decay) * param`` at every :meth:`update`, for trainable params only (a LoRA
    run averages just the adapter). Shadows are fp32, on the parameters' device, or on ``device`` (e.g. ``"cpu"``
    to keep them out of GPU memory, at the cost of a copy of the weights at every update and swap)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], decay: float,
                 device: str | torch.device | None = None):
        self.decay = decay
        self.params = dict(named_params)
        self.shadow = {n: p.detach().to(device or p.device, torch.float32, copy=True)
                       for n, p in self.params.items()}

    @torch.no_grad()
    def restart(self) -> None:
        """Set every shadow to its parameter's current value: the average starts from here."""
        for name, p in self.params.items():
            self.shadow[name].copy_(p.detach())

    @torch.no_grad()
    def update(self) -> None:
        for name, p in self.params.items():
            shadow = self.shadow[name]
            shadow.lerp_(p.detach().to(shadow.device, torch.float32), 1.0 - self.decay)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Use the averaged weights inside the block (eval, sampling, export), then restore the raw ones, which wait
        where the shadows live (off the GPU when they are)."""
        raw = {n: p.detach().to(self.shadow[n].device, copy=True) for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(raw[n])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.contiguous() for n, t in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}")
        for n in self.shadow:
            self.shadow[n].copy_(state[n])
