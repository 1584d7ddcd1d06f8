"""A flow adapter's trainable weights, and temporary changes of them for tests that need a trained-looking model."""

import contextlib

import torch


def trainable(adapter) -> list[torch.nn.Parameter]:
    """The parameters the optimiser updates: the LoRA weights, or the whole transformer (both Wan2.2 experts)."""
    return [p for p in adapter.transformer.parameters() if p.requires_grad]


@contextlib.contextmanager
def restored(adapter):
    """Let the body change the trainable parameters in place (a perturbation, ``load_trainable``); put the weights
    back as they were on exit."""
    params = trainable(adapter)
    saved = [p.detach().clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


@contextlib.contextmanager
def perturbed(adapter, seed: int = 0, std: float = 0.05):
    """Add Gaussian noise to every trainable parameter (LoRA B included, so LoRA is no longer a no-op); restore
    the weights on exit."""
    gen = torch.Generator().manual_seed(seed)
    with restored(adapter):
        with torch.no_grad():
            for p in trainable(adapter):
                p.add_(torch.randn(p.shape, generator=gen) * std)
        yield
