"""Cheap verifiable image rewards: JPEG (in)compressibility, sharpness and the fraction of a target colour.

Every reward reads ``batch.images`` through :func:`~mmgrpo.rewards.checks.as_rgb_images`, so grayscale and RGBA
inputs work and values outside [0, 1] fail with a clear message.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from mmgrpo.registry import REWARDS

from .base import POINTWISE, Reward, RewardBatch
from .checks import images_or_raise

# ITU-R BT.601 luma weights, as PIL's convert("L").
LUMA = (0.299, 0.587, 0.114)


def jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """(B,) float64 size of each (B, 3, H, W) [0, 1] image as an in-memory JPEG, in kB (1000 bytes).

    Pixels are quantised to uint8 by rounding, as when saving the image."""
    pixels = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float64)


class _JpegSize(Reward):
    sign = 1.0
    modality = "image"

    def __init__(self, quality: int = 95):
        if not 1 <= quality <= 100:
            raise ValueError(f"{self.name}: quality must be in [1, 100]; got {quality}")
        self.quality = quality

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        return self.sign * jpeg_sizes_kb(images_or_raise(batch, self.name), self.quality)


@REWARDS.register("jpeg_compressibility", kind=POINTWISE, modality="image",
                  description="minus the JPEG size in kB at quality 95 (DDPO / Flow-GRPO toy task)")
class JpegCompressibility(_JpegSize):
    """Minus the in-memory JPEG size in kB: simpler, flatter images score higher.

    Args:
        quality: JPEG quality used for encoding (95 as in DDPO and Flow-GRPO).
    """

    name = "jpeg_compressibility"
    sign = -1.0


@REWARDS.register("jpeg_incompressibility", kind=POINTWISE, modality="image",
                  description="the JPEG size in kB at quality 95 (DDPO / Flow-GRPO toy task)")
class JpegIncompressibility(_JpegSize):
    """The in-memory JPEG size in kB: detailed, textured images score higher.

    Args:
        quality: JPEG quality used for encoding (95 as in DDPO and Flow-GRPO).
    """

    name = "jpeg_incompressibility"


def luminance(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) RGB -> (B, 1, H, W) BT.601 luma."""
    weights = torch.tensor(LUMA, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    return (images * weights).sum(1, keepdim=True)


def laplacian_variance(images: torch.Tensor) -> torch.Tensor:
    """(B,) variance of the 4-neighbour Laplacian of the luma over interior pixels (no padding)."""
    if images.shape[-1] < 3 or images.shape[-2] < 3:
        raise ValueError(f"sharpness needs images of at least 3x3 pixels; got shape {tuple(images.shape)}")
    y = luminance(images)  # by shifted slices: a 1-channel conv2d is slower per image at batch 32 than at 1
    response = (y[..., :-2, 1:-1] + y[..., 2:, 1:-1] + y[..., 1:-1, :-2] + y[..., 1:-1, 2:]
                - 4 * y[..., 1:-1, 1:-1])
    return response.flatten(1).var(1, unbiased=False).to(torch.float64).cpu()


@REWARDS.register("sharpness", kind=POINTWISE, modality="image",
                  description="variance of the Laplacian of the luma (anti-blur), optionally saturating at a target")
class Sharpness(Reward):
    """Blur detector: the variance of the Laplacian of the luma. A flat or blurred image scores near 0.

    Use it as a guard against blurry reward hacking, next to a quality reward, not alone: noise has the highest
    Laplacian variance of all, and the raw value grows when an image is downscaled. ``saturate_at`` caps the
    incentive: ``min(1, variance / saturate_at)`` pays nothing for sharpness beyond "sharp enough".

    Args:
        saturate_at: variance at which the score reaches 1 and stops growing; None returns the raw variance.
    """

    modality = "image"

    def __init__(self, saturate_at: float | None = None):
        if saturate_at is not None and saturate_at <= 0:
            raise ValueError(f"sharpness: saturate_at must be > 0; got {saturate_at}")
        self.saturate_at = saturate_at

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        variance = laplacian_variance(images_or_raise(batch, "sharpness"))
        return variance if self.saturate_at is None else (variance / self.saturate_at).clamp(max=1.0)


@REWARDS.register("color_fraction", kind=POINTWISE, modality="image",
                  description="fraction of pixels within a distance of a target RGB colour (per-sample via meta)")
class ColorFraction(Reward):
    """The fraction of pixels whose RGB colour lies within ``tolerance`` (Euclidean, [0, 1] units) of a target.

    The target is ``rgb``, or per sample ``meta["target_rgb"]`` (for prompts such as "a red ball" / "a blue ball").
    The score is sparse while no pixel is near the target; a larger tolerance gives a denser signal.

    Args:
        rgb: target colour as three values in 0..255; None requires ``meta["target_rgb"]`` in every sample.
        tolerance: largest RGB distance counted as the target colour (``sqrt(3)`` covers every colour).
    """

    modality = "image"

    def __init__(self, rgb: list[float] | None = None, tolerance: float = 0.2):
        if tolerance <= 0:
            raise ValueError(f"color_fraction: tolerance must be > 0; got {tolerance}")
        self.rgb = None if rgb is None else self._target(rgb, "rgb")
        self.tolerance = tolerance

    @staticmethod
    def _target(value: list[float], where: str) -> torch.Tensor:
        target = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        if target.numel() != 3 or not ((target >= 0) & (target <= 255)).all():
            raise ValueError(f"color_fraction: {where} must be three values in 0..255; got {value!r}")
        return target / 255

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        images = images_or_raise(batch, "color_fraction")
        targets = []
        for row, meta in enumerate(batch.meta):
            if "target_rgb" in meta:
                targets.append(self._target(meta["target_rgb"], f"meta['target_rgb'] of sample {row}"))
            elif self.rgb is not None:
                targets.append(self.rgb)
            else:
                raise ValueError(f"color_fraction: sample {row} has no meta['target_rgb'] and no rgb arg is set")
        target = torch.stack(targets).to(images.device).view(-1, 3, 1, 1)
        near = (images - target).norm(dim=1) <= self.tolerance
        return near.flatten(1).to(torch.float64).mean(1).cpu()
