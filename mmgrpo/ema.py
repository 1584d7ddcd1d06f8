"""Exponential moving average of the trainable weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    """``shadow = decay * shadow + (1 - decay) * param`` after every optimiser step, for trainable params only
    (a LoRA run averages just the adapter). Shadows live in fp32 on the parameters' device."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], decay: float):
        self.decay = decay
        self.params = dict(named_params)
        self.shadow = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, p in self.params.items():
            self.shadow[name].lerp_(p.detach().float(), 1.0 - self.decay)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Use the averaged weights inside the block (eval, sampling, export), then restore the raw ones."""
        raw = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n].to(p.dtype))
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
