"""Cheap verifiable image rewards: JPEG (in)compressibility, sharpness, the fraction of a target colour, and grid
seams and tile repetition (detectors for the grid-of-panels reward hack).

Every reward reads ``batch.images`` through :func:`~mmgrpo.rewards.checks.as_rgb_images`, so grayscale and RGBA
inputs work and values outside [0, 1] fail with a clear message.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.nn.functional as F
from PIL import Image

from mmgrpo.registry import REWARDS

from .base import POINTWISE, Reward, RewardBatch
from .checks import images_or_raise

# ITU-R BT.601 luma weights, as PIL's convert("L").
LUMA = (0.299, 0.587, 0.114)
STEP_TIE = 1e-9
"""grid_seams: luma steps closer than this are equal (rounding must not decide which one is an edge)."""
CHUNK_ROWS = 4
"""On the CPU the per-pixel rules score this many images (or videos) at a time: their float intermediates for a
whole batch of 32 images of 256 px outgrow the caches, which made batch 32 0.4-0.7x as fast per image as batch 1."""


def in_chunks(score: Callable[[torch.Tensor], torch.Tensor], pixels: torch.Tensor,
              rows: int = CHUNK_ROWS) -> torch.Tensor:
    """``score`` of (B, ...) ``pixels``, a function of each sample alone that returns (B,). On the CPU it is
    computed ``rows`` samples at a time and concatenated, so the working set does not grow with B; on an
    accelerator the whole batch goes in one call."""
    if pixels.device.type != "cpu":
        return score(pixels)
    return torch.cat([score(chunk) for chunk in pixels.split(rows)])


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
        whole = isinstance(quality, (int, float)) and not isinstance(quality, bool) and float(quality).is_integer()
        if not whole or not 1 <= quality <= 100:
            raise ValueError(f"{self.name}: quality must be a whole number in [1, 100]; got {quality!r}")
        self.quality = int(quality)

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
        variance = in_chunks(laplacian_variance, images_or_raise(batch, "sharpness"))
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
        """(3,) float32 colour in [0, 1] from three values in 0..255; ``ValueError`` naming ``where`` otherwise."""
        try:
            target = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        except (TypeError, ValueError, RuntimeError):  # a colour name, None, a dict...
            target = torch.empty(0)
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


def step_strength(luma: torch.Tensor, half_width: int) -> torch.Tensor:
    """(B, H, W) luma -> (B, H, W - 1) step across each column boundary b = 1..W-1: the absolute difference of the
    mean of the ``half_width`` pixels right of b and of those left of it (fewer at the image's edges)."""
    width = luma.shape[-1]
    cumulative = F.pad(luma, (1, 0)).cumsum(-1)  # [..., i] = sum of luma[..., :i]
    b = torch.arange(1, width, device=luma.device)
    lo, hi = (b - half_width).clamp(min=0), (b + half_width).clamp(max=width)
    left = (cumulative[..., b] - cumulative[..., lo]) / (b - lo)
    right = (cumulative[..., hi] - cumulative[..., b]) / (hi - b)
    return (right - left).abs()


def seam_contrast(luma: torch.Tensor, edge_threshold: float, half_width: int) -> torch.Tensor:
    """(B, H, W) luma -> (B, W - 1) how much more often than the image's typical column boundary each boundary
    carries an edge: the fraction of rows where its step exceeds ``edge_threshold`` and is a local maximum along
    the row (>= both neighbouring boundaries), minus the median of that fraction over all boundaries, clamped at
    0. A full-height seam in a smooth image scores 1; textures and noise, which have edges everywhere alike,
    score about 0. Steps within ``STEP_TIE`` of each other are ties (both local maxima), whatever the rounding."""
    step = step_strength(luma, half_width)
    padded = F.pad(step, (1, 1)) - STEP_TIE  # a neighbour within STEP_TIE does not beat this step
    edge = (step > edge_threshold) & (step >= padded[..., :-2]) & (step >= padded[..., 2:])
    coverage = edge.to(luma.dtype).mean(-2)
    return (coverage - coverage.median(-1, keepdim=True).values).clamp(min=0)


def grid_evidence(contrast: torch.Tensor, max_panels: int, tolerance: float) -> torch.Tensor:
    """(B, W - 1) seam contrast along one axis -> (B,): the best, over k = 2..max_panels equal panels, of the
    weakest of their k - 1 seams, each the largest contrast within ``tolerance`` x W (at least 1 px) of its
    position j W / k."""
    width = contrast.shape[-1] + 1
    boundary = torch.arange(1, width, device=contrast.device)
    slack = max(1.0, tolerance * width)
    best = torch.zeros(contrast.shape[0], dtype=contrast.dtype, device=contrast.device)
    for k in range(2, max_panels + 1):
        seams = [contrast[:, (boundary - j * width / k).abs() <= slack].amax(-1) for j in range(1, k)]
        best = torch.maximum(best, torch.stack(seams).amin(0))
    return best


@REWARDS.register("grid_seams", kind=POINTWISE, modality="image",
                  description="evidence in [0, 1] that the image is a grid of panels (seams at k-by-k panel "
                              "boundaries); weight it negatively against grid hacking")
class GridSeams(Reward):
    """Grid-hack detector: evidence in [0, 1] that the image is a grid of k x k, k x 1 or 1 x k equal panels.

    Preference rewards can be gamed by tiling several small pictures into one; the panels meet at straight seams
    that run the whole height or width at j/k of the side. Along each axis every boundary gets the excess of its
    edge coverage over the image's median boundary (:func:`seam_contrast`); a grid of k panels scores the weakest
    of its k - 1 seams, and the image scores its best grid. A photo scores about 0.1, a 2x2 or 3x3 tiling of it
    0.7-0.8 (tests/rewards/test_image_rules.py). Use it with a negative weight, or as a guard metric.

    It sees seams, not repetition: panels that continue each other smoothly (a mirrored diptych) read as one
    image, and a straight full-length edge at a panel position (a level horizon at mid-height) reads as a seam.
    ``tile_repetition`` sees copies joined without a seam.

    Args:
        max_panels: the largest number of panels per side tested (grids of 2..max_panels).
        edge_threshold: the smallest luma step (in [0, 1]) counted as an edge.
        step_width: half-width of the step detector in pixels: a seam blurred over a few pixels (as by a VAE
            decode) still reads as one step.
        tolerance: how far from j/k of the side a seam may lie, as a fraction of the side (at least 1 px).
    """

    modality = "image"

    def __init__(self, max_panels: int = 4, edge_threshold: float = 0.05, step_width: int = 3,
                 tolerance: float = 0.02):
        if max_panels < 2:
            raise ValueError(f"grid_seams: max_panels must be >= 2; got {max_panels}")
        if not 0 < edge_threshold < 1:
            raise ValueError(f"grid_seams: edge_threshold must be in (0, 1); got {edge_threshold}")
        if step_width < 1:
            raise ValueError(f"grid_seams: step_width must be >= 1 pixel; got {step_width}")
        if not 0 <= tolerance < 0.25:
            raise ValueError(f"grid_seams: tolerance must be in [0, 0.25); got {tolerance}")
        self.max_panels, self.edge_threshold = max_panels, edge_threshold
        self.step_width, self.tolerance = step_width, tolerance

    def _axis(self, luma: torch.Tensor) -> torch.Tensor:
        """(B, H, W) -> (B,) grid evidence from the column boundaries."""
        contrast = seam_contrast(luma, self.edge_threshold, self.step_width)
        return grid_evidence(contrast, self.max_panels, self.tolerance)

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        images = images_or_raise(batch, "grid_seams")
        smallest = 2 * self.max_panels
        if min(images.shape[-2:]) < smallest:
            raise ValueError(f"grid_seams: images must be at least {smallest}x{smallest} pixels for max_panels="
                             f"{self.max_panels}; got shape {tuple(images.shape)}")
        return in_chunks(self._score, images).cpu()

    def _score(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B,) the better of the two axes' grid evidence."""
        luma = luminance(images.to(torch.float64))[:, 0]
        return torch.maximum(self._axis(luma), self._axis(luma.transpose(1, 2)))


def detail_map(luma: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, W) luma -> (B, H, W) fine detail: each pixel minus the mean of the ``width`` x ``width`` box around
    it (edges replicated). Shading and flat regions go to 0, so only structure is compared."""
    padded = F.pad(luma[:, None], (width // 2, (width - 1) // 2) * 2, mode="replicate")
    return luma - F.avg_pool2d(padded, width, stride=1)[:, 0]


def shift_similarities(detail: torch.Tensor) -> torch.Tensor:
    """(B, H, W) detail -> (B, W - 1): for each shift s = 1..W-1, the cosine similarity of the image with itself
    moved s px along W, over the part that overlaps (columns s..W-1 against 0..W-1-s); 0 where that part is flat.
    The products for every shift come from one zero-padded FFT autocorrelation of each row."""
    width = detail.shape[-1]
    spectrum = torch.fft.rfft(detail, n=2 * width)
    products = torch.fft.irfft(spectrum.conj() * spectrum, n=2 * width)[..., 1:width].sum(-2)  # [s-1]: sum d[i] d[i+s]
    energy = F.pad(detail.square().sum(-2).cumsum(-1), (1, 0))  # [j]: energy of columns 0..j-1
    shift = torch.arange(1, width, device=detail.device)
    norms = (energy[..., width - shift] * (energy[..., width:] - energy[..., shift])).clamp(min=0).sqrt()
    return torch.where(norms > 0, products / norms.clamp(min=1e-30), 0.0)


def panel_shifts(width: int, max_panels: int, tolerance: float) -> tuple[list[int], list[int]]:
    """The shifts tested along a side of ``width`` px: those within ``tolerance`` x width (at least 1 px) of a
    panel offset j W / k (k = 2..max_panels), and the off-panel ones, farther than twice that from every panel
    offset, between W/8 and 7W/8."""
    slack = max(1.0, tolerance * width)
    offsets = [j * width / k for k in range(2, max_panels + 1) for j in range(1, k)]
    nearest = {s: min(abs(s - o) for o in offsets) for s in range(1, width)}
    on_panel = [s for s, d in nearest.items() if d <= slack]
    off_panel = [s for s, d in nearest.items() if d > 2 * slack and width / 8 <= s <= 7 * width / 8]
    return on_panel, off_panel


def repetition_evidence(detail: torch.Tensor, max_panels: int, tolerance: float) -> torch.Tensor:
    """(B, H, W) detail -> (B,) in [0, 1]: how much better the image matches itself moved by a panel offset than
    moved by any off-panel shift (:func:`panel_shifts`), clamped at 0. A tiling of copies matches at its panel
    width (about 1) and nowhere else; a photo matches nowhere; a fine periodic texture matches everywhere alike.
    The best off-panel match counts from 0: an anti-match (stripes half a period off) is no evidence of tiling."""
    on_panel, off_panel = panel_shifts(detail.shape[-1], max_panels, tolerance)
    similarity = shift_similarities(detail)  # [..., s - 1] for shift s
    on = similarity[..., [s - 1 for s in on_panel]].amax(-1)
    off = similarity[..., [s - 1 for s in off_panel]].amax(-1).clamp(min=0)
    return (on - off).clamp(min=0)


@REWARDS.register("tile_repetition", kind=POINTWISE, modality="image",
                  description="evidence in [0, 1] that the image repeats itself at a panel offset (a tiling of "
                              "copies); weight it negatively against grid hacking")
class TileRepetition(Reward):
    """Tiling detector: evidence in [0, 1] that the image is k x 1, 1 x k or k x k copies of one picture.

    The companion of ``grid_seams``: copies that join without a visible seam still repeat. The image's fine
    detail (:func:`detail_map`) is compared with itself moved along each axis; the evidence is the best match at
    a panel offset j W / k minus the best match at off-panel shifts (:func:`repetition_evidence`), the larger
    over both axes. A photo and noise score about 0, a 2x2 or 3x3 tiling of the photo about 0.9, with sharp or
    blurred seams (tests/rewards/test_image_rules.py), and stripes or a checkerboard 0: a fine periodic texture
    matches itself at every shift alike. Panels that are not copies (four different pictures) score about 0
    here; ``grid_seams`` sees those. A mirrored diptych is not a translation and scores about 0.

    Args:
        max_panels: the largest number of panels per side tested (offsets j W / k for k = 2..max_panels).
        tolerance: how far from a panel offset a match may lie, as a fraction of the side (at least 1 px).
        detail_width: the box, in pixels, whose mean is taken off each pixel before comparing.
        max_side: larger images are first shrunk (area interpolation) to this many pixels on their longer side,
            which keeps the cost bounded; tiling is a large-scale structure and survives the shrink.
    """

    modality = "image"

    def __init__(self, max_panels: int = 4, tolerance: float = 0.02, detail_width: int = 9, max_side: int = 256):
        if max_panels < 2:
            raise ValueError(f"tile_repetition: max_panels must be >= 2; got {max_panels}")
        if not 0 <= tolerance < 0.05:
            raise ValueError(f"tile_repetition: tolerance must be in [0, 0.05); got {tolerance}")
        if detail_width < 3:
            raise ValueError(f"tile_repetition: detail_width must be >= 3 pixels; got {detail_width}")
        if max_side < 32:
            raise ValueError(f"tile_repetition: max_side must be >= 32 pixels; got {max_side}")
        self.max_panels, self.tolerance = max_panels, tolerance
        self.detail_width, self.max_side = detail_width, max_side

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        images = images_or_raise(batch, "tile_repetition")
        height, width = images.shape[-2:]
        scale = min(1.0, self.max_side / max(height, width))
        size = (round(height * scale), round(width * scale))
        if not all(all(panel_shifts(side, self.max_panels, self.tolerance)) for side in size):
            raise ValueError(f"tile_repetition: images of shape {tuple(images.shape)} (compared at "
                             f"{size[0]}x{size[1]}) are too small for max_panels={self.max_panels}: no shift is left "
                             "off the panel offsets to compare with")
        return in_chunks(lambda chunk: self._score(chunk, size), images).cpu()

    def _score(self, images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """(B, 3, H, W) -> (B,) the better of the two axes' repetition evidence, compared at ``size``."""
        images = images.to(torch.float64)
        if size != tuple(images.shape[-2:]):
            images = F.interpolate(images, size=size, mode="area")
        detail = detail_map(luminance(images)[:, 0], self.detail_width)
        rows = repetition_evidence(detail, self.max_panels, self.tolerance)
        columns = repetition_evidence(detail.transpose(1, 2), self.max_panels, self.tolerance)
        return torch.maximum(rows, columns)
