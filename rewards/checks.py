"""Input checks shared by the rule-based rewards: fail early with a message that says what was wrong.

Images and videos are normalised to float32 RGB in [0, 1]:

- 3 channels pass through; 1 channel (grayscale) is repeated to 3;
- 4 channels (RGBA) are composited over a **white** background, ``rgb * a + (1 - a)``, the way viewers and browsers
  show transparent pixels;
- values may overshoot [0, 1] by up to ``RANGE_TOLERANCE`` (resampling), or one rounding step of a low-precision
  input dtype (bf16 has nothing between 1 and 1 + 2**-7), and are then clamped; anything further out, NaN or inf
  raises ``ValueError``.

Layouts are channels-first. A shape that reads both ways, such as (2, 4, 4, 3) (4-channel 4x3 images, or 3-channel
4x4 images stored channels-last), is taken only as the documented RGB layout (B, 3, H, W); one whose channel count
would be 1 or 4 while its last dimension is 1, 3 or 4 is rejected as ambiguous, so grayscale and RGBA images may not
be 1, 3 or 4 pixels wide. An empty batch (no samples or no pixels) raises ``ValueError`` too.
"""

from __future__ import annotations

import torch

from .base import RewardBatch

RANGE_TOLERANCE = 1e-3
CHANNELS = (1, 3, 4)
LAYOUTS = {4: ("images", "(B, 3, H, W)", "(B, H, W, C)"), 5: ("videos", "(B, T, 3, H, W)", "(B, T, H, W, C)")}
"""By number of dimensions: what the tensor holds, its expected layout and the channels-last one it is told from."""


def _range_hint(lo: float, hi: float) -> str:
    if lo <= -0.1:
        return " — did you pass [-1, 1]?"
    if hi > 2.0:
        return " — did you pass [0, 255]?"
    return ""


def _check_layout(x: torch.Tensor, ndim: int, who: str) -> None:
    """``ValueError`` (prefixed by ``who``) unless ``x`` is a non-empty batch of images (``ndim`` 4) or videos (5)
    whose channel dimension is 1, 3 or 4 and that is not ambiguous with a channels-last layout (module notes)."""
    what, layout, last = LAYOUTS[ndim]
    shape = tuple(x.shape)
    channels_last = len(shape) == ndim and shape[-1] in CHANNELS
    hint = (f"; it looks channels-last {last}: move the channels with "
            f".permute({', '.join(map(str, range(ndim - 3)))}, {ndim - 1}, {ndim - 3}, {ndim - 2})"
            if channels_last else "")
    if len(shape) != ndim or shape[ndim - 3] not in CHANNELS:
        raise ValueError(f"{who}{what} must be {layout} (or 1/4 channels); got shape {shape}{hint}")
    if channels_last and shape[ndim - 3] != 3:
        raise ValueError(f"{who}{what} of shape {shape} are ambiguous: expected {layout} (or 1/4 channels, not 1, 3 "
                         f"or 4 pixels wide){hint}")
    if x.numel() == 0:
        raise ValueError(f"{who}{what} are empty: got shape {shape}; score at least one sample of at least 1x1 pixels")


def _tolerance(dtype: torch.dtype) -> float:
    """How far past [0, 1] values of ``dtype`` may be: ``RANGE_TOLERANCE``, or the dtype's step at 1 when larger."""
    return max(RANGE_TOLERANCE, torch.finfo(dtype).eps if dtype.is_floating_point else 0.0)


def _to_rgb(x: torch.Tensor, channel_dim: int, what: str, who: str) -> torch.Tensor:
    tolerance = _tolerance(x.dtype)
    x = x.to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError(f"{who}{what} contain NaN or inf")
    lo, hi = (v.item() for v in torch.aminmax(x))
    if lo < -tolerance or hi > 1 + tolerance:
        raise ValueError(f"{who}{what} must be in [0, 1]; got min {lo:.4g} max {hi:.4g}{_range_hint(lo, hi)}")
    x = x.clamp(0, 1)
    channels = x.shape[channel_dim]
    if channels == 1:
        return x.repeat_interleave(3, dim=channel_dim)
    if channels == 4:
        rgb, alpha = x.split([3, 1], dim=channel_dim)
        return rgb * alpha + (1 - alpha)
    return x


def _who(reward: str | None) -> str:
    return "" if reward is None else f"reward '{reward}': "


def as_rgb_images(images: torch.Tensor, reward: str | None = None) -> torch.Tensor:
    """``images`` (B, C, H, W) with C in {1, 3, 4} -> (B, 3, H, W) float32 RGB in [0, 1] (see the module notes);
    errors name ``reward`` when given."""
    _check_layout(images, 4, _who(reward))
    return _to_rgb(images, 1, "images", _who(reward))


def as_rgb_videos(videos: torch.Tensor, reward: str | None = None) -> torch.Tensor:
    """``videos`` (B, T, C, H, W) with C in {1, 3, 4} -> (B, T, 3, H, W) float32 RGB in [0, 1]; errors name
    ``reward`` when given."""
    _check_layout(videos, 5, _who(reward))
    return _to_rgb(videos, 2, "videos", _who(reward))


def completions_or_raise(batch: RewardBatch, reward: str) -> list[str]:
    """The batch's completions; ``ValueError`` naming ``reward`` when the batch has none (an image batch)."""
    if batch.completions is None:
        raise ValueError(f"reward '{reward}' needs text completions; this batch has none")
    return batch.completions


def images_or_raise(batch: RewardBatch, reward: str) -> torch.Tensor:
    """The batch's images through :func:`as_rgb_images`; ``ValueError`` naming ``reward`` when it has none."""
    if batch.images is None:
        raise ValueError(f"reward '{reward}' needs images; this batch has none")
    return as_rgb_images(batch.images, reward)
