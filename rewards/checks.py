"""Input checks shared by the rule-based rewards: fail early with a message that says what was wrong.

Images and videos are normalised to float32 RGB in [0, 1]:

- 3 channels pass through; 1 channel (grayscale) is repeated to 3;
- 4 channels (RGBA) are composited over a **white** background, ``rgb * a + (1 - a)``, the way viewers and browsers
  show transparent pixels;
- values may overshoot [0, 1] by up to ``RANGE_TOLERANCE`` (resampling, bf16 decoding) and are then clamped; anything
  further out, NaN or inf raises ``ValueError``.
"""

from __future__ import annotations

import torch

from .base import RewardBatch

RANGE_TOLERANCE = 1e-3


def _range_hint(lo: float, hi: float) -> str:
    if lo <= -0.1:
        return " — did you pass [-1, 1]?"
    if hi > 2.0:
        return " — did you pass [0, 255]?"
    return ""


def _to_rgb(x: torch.Tensor, channel_dim: int, what: str) -> torch.Tensor:
    x = x.to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError(f"{what} contain NaN or inf")
    lo, hi = (v.item() for v in torch.aminmax(x))
    if lo < -RANGE_TOLERANCE or hi > 1 + RANGE_TOLERANCE:
        raise ValueError(f"{what} must be in [0, 1]; got min {lo:.4g} max {hi:.4g}{_range_hint(lo, hi)}")
    x = x.clamp(0, 1)
    channels = x.shape[channel_dim]
    if channels == 1:
        return x.repeat_interleave(3, dim=channel_dim)
    if channels == 4:
        rgb, alpha = x.split([3, 1], dim=channel_dim)
        return rgb * alpha + (1 - alpha)
    return x


def as_rgb_images(images: torch.Tensor) -> torch.Tensor:
    """``images`` (B, C, H, W) with C in {1, 3, 4} -> (B, 3, H, W) float32 RGB in [0, 1] (see the module notes)."""
    if images.ndim != 4 or images.shape[1] not in (1, 3, 4):
        raise ValueError(f"images must be (B, 3, H, W) (or 1/4 channels); got shape {tuple(images.shape)}")
    return _to_rgb(images, 1, "images")


def as_rgb_videos(videos: torch.Tensor) -> torch.Tensor:
    """``videos`` (B, T, C, H, W) with C in {1, 3, 4} -> (B, T, 3, H, W) float32 RGB in [0, 1]."""
    if videos.ndim != 5 or videos.shape[2] not in (1, 3, 4):
        raise ValueError(f"videos must be (B, T, 3, H, W) (or 1/4 channels); got shape {tuple(videos.shape)}")
    return _to_rgb(videos, 2, "videos")


def completions_or_raise(batch: RewardBatch, reward: str) -> list[str]:
    """The batch's completions; ``ValueError`` naming ``reward`` when the batch has none (an image batch)."""
    if batch.completions is None:
        raise ValueError(f"reward '{reward}' needs text completions; this batch has none")
    return batch.completions


def images_or_raise(batch: RewardBatch, reward: str) -> torch.Tensor:
    """The batch's images through :func:`as_rgb_images`; ``ValueError`` naming ``reward`` when it has none."""
    if batch.images is None:
        raise ValueError(f"reward '{reward}' needs images; this batch has none")
    return as_rgb_images(batch.images)
