"""A temporary change of a flow adapter's trainable weights, for tests that need a trained-looking model."""

import contextlib

import torch


@contextlib.contextmanager
def perturbed(adapter, seed: int = 0, std: float = 0.05):
    """Add Gaussian noise to every trainable parameter (LoRA B included, so LoRA is no longer a no-op); restore
    the weights on exit."""
    params = adapter.trainable_parameters()
    saved = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * std)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
