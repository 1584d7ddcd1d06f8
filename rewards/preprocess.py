"""CLIP image preprocessing on tensors, on the device the images already live on: no PIL, no PNG round trip.

It reproduces the evaluation transforms of open_clip and of transformers' ``CLIPImageProcessor``:

- ``shortest``: resize so the shorter side matches the model's size (torchvision ``Resize(int)`` rule: the long side
  becomes ``int(size * long / short)``), then center crop; the crop offset is rounded as torchvision and open_clip do
  (``crop_offset="round"``) or floored as transformers' image processors do (``crop_offset="floor"``), which differ
  by one pixel when the margin is odd;
- ``longest``: resize so the longer side matches, then pad with ``fill`` and center crop (open_clip's
  ``ResizeKeepRatio(longest=1)`` + ``CenterCropOrPad``; HPSv2's evaluation transform);
- ``squash``: resize both sides to the target, ignoring the aspect ratio.

Resizing is ``torch.nn.functional.interpolate`` with ``antialias=True`` and the result is clamped to [0, 1], as PIL's
uint8 output is. After a resize the result differs slightly from open_clip's PIL transform, which rounds to uint8
between its two passes (measured: mean absolute difference 0.002-0.005 in normalised units, under 1% of values off by
more than 0.05, see ``tests/rewards/test_clip_models.py``); without a resize it is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESIZE_MODES = ("shortest", "longest", "squash")
INTERPOLATIONS = ("bicubic", "bilinear")
CROP_OFFSETS = ("round", "floor")


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    size = tuple(int(s) for s in size)
    if len(size) == 1:
        return size[0], size[0]
    if len(size) != 2:
        raise ValueError(f"image size must be an int or (height, width); got {size}")
    return size


def resized_size(height: int, width: int, size: tuple[int, int], mode: str) -> tuple[int, int]:
    """(h, w) after the resize step of ``mode`` for an input of ``height x width`` and a target ``size`` (h, w)."""
    if mode == "squash":
        return size
    if mode == "shortest" and size[0] == size[1]:
        # torchvision Resize(int): the short side becomes `size`, the long side is truncated
        short, long = (height, width) if height <= width else (width, height)
        new_short, new_long = size[0], int(size[0] * long / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)
    ratio_h, ratio_w = height / size[0], width / size[1]
    ratio = max(ratio_h, ratio_w) if mode == "longest" else min(ratio_h, ratio_w)
    return round(height / ratio), round(width / ratio)


def resize(images: torch.Tensor, size: tuple[int, int], interpolation: str = "bicubic") -> torch.Tensor:
    """``images`` (B, C, H, W) in [0, 1] -> (B, C, *size), antialiased, clamped to [0, 1]; a no-op at equal size."""
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    out = F.interpolate(images, size=size, mode=interpolation, align_corners=False, antialias=True)
    return out.clamp_(0.0, 1.0)


def center_crop_or_pad(images: torch.Tensor, size: tuple[int, int], fill: float = 0.0,
                       offset: str = "round") -> torch.Tensor:
    """``images`` (B, C, H, W) -> (B, C, *size): pad with ``fill`` where smaller, then center crop. The crop's top
    and left offsets are ``round((H - h) / 2)`` (``offset="round"``: torchvision and open_clip, Python's
    half-to-even) or ``(H - h) // 2`` (``offset="floor"``: transformers' image processors)."""
    height, width = images.shape[-2:]
    crop_h, crop_w = size
    if crop_h > height or crop_w > width:
        pad_w, pad_h = max(crop_w - width, 0), max(crop_h - height, 0)
        images = F.pad(images, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2), value=fill)
        height, width = images.shape[-2:]
    if offset == "floor":
        top, left = (height - crop_h) // 2, (width - crop_w) // 2
    else:
        top, left = round((height - crop_h) / 2.0), round((width - crop_w) / 2.0)
    return images[..., top:top + crop_h, left:left + crop_w]


@dataclass(frozen=True)
class ClipPreprocess:
    """The evaluation transform of a CLIP model, as a tensor function.

    - ``size``: (height, width) the model takes, in pixels (an int means square).
    - ``mean`` / ``std``: per-channel normalisation, in [0, 1] pixel units.
    - ``resize_mode``: ``shortest`` (resize + center crop), ``longest`` (resize + pad) or ``squash``.
    - ``interpolation``: ``bicubic`` or ``bilinear``.
    - ``fill``: the padding value of ``longest`` mode, in [0, 1] pixel units (0 = black, as open_clip).
    - ``crop_offset``: how an odd crop margin is split: ``round`` (torchvision / open_clip) or ``floor``
      (transformers); see :func:`center_crop_or_pad`.
    """

    size: tuple[int, int]
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD
    resize_mode: str = "shortest"
    interpolation: str = "bicubic"
    fill: float = 0.0
    crop_offset: str = "round"

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _pair(self.size))
        if self.resize_mode not in RESIZE_MODES:
            raise ValueError(f"resize_mode must be one of {RESIZE_MODES}; got '{self.resize_mode}'")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}; got '{self.interpolation}'")
        if self.crop_offset not in CROP_OFFSETS:
            raise ValueError(f"crop_offset must be one of {CROP_OFFSETS}; got '{self.crop_offset}'")
        for name in ("mean", "std"):
            value = tuple(float(v) for v in getattr(self, name))
            object.__setattr__(self, name, value * 3 if len(value) == 1 else value)

    def __call__(self, images: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``images`` (B, 3, H, W) RGB in [0, 1] -> (B, 3, h, w) normalised pixels in ``dtype``, on their device."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected (B, 3, H, W) RGB images; got shape {tuple(images.shape)}")
        x = images.to(torch.float32)
        x = resize(x, resized_size(x.shape[-2], x.shape[-1], self.size, self.resize_mode), self.interpolation)
        if self.resize_mode != "squash":
            x = center_crop_or_pad(x, self.size, self.fill, self.crop_offset)
        mean = torch.tensor(self.mean, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        return ((x - mean) / std).to(dtype)

    @classmethod
    def from_open_clip(cls, model: Any, resize_mode: str | None = None) -> ClipPreprocess:
        """The evaluation transform an open_clip ``model`` carries (its ``preprocess_cfg``); ``resize_mode``
        overrides the model's own."""
        import open_clip

        cfg = open_clip.get_model_preprocess_cfg(model)
        return cls(
            size=_pair(cfg.get("size", 224)),
            mean=tuple(cfg.get("mean", OPENAI_CLIP_MEAN)),
            std=tuple(cfg.get("std", OPENAI_CLIP_STD)),
            resize_mode=resize_mode or cfg.get("resize_mode", "shortest"),
            interpolation="bilinear" if cfg.get("interpolation") == "bilinear" else "bicubic",
            fill=float(cfg.get("fill_color", 0)) / 255.0,
        )

    @classmethod
    def from_hf_image_processor(cls, processor: Any) -> ClipPreprocess:
        """The transform of a transformers ``CLIPImageProcessor`` (or a processor holding one): its ``size``
        (``shortest_edge`` or ``height``/``width``), ``crop_size``, ``resample``, ``image_mean`` and ``image_std``,
        with transformers' floored crop offsets."""
        ip = getattr(processor, "image_processor", processor)

        def field(size: Any, key: str) -> Any:
            if size is None:
                return None
            return size.get(key) if isinstance(size, dict) else getattr(size, key, None)

        size, crop = getattr(ip, "size", None), getattr(ip, "crop_size", None)
        shortest = field(size, "shortest_edge")
        do_crop = bool(getattr(ip, "do_center_crop", True)) and crop is not None
        if shortest is not None:
            target, mode = (field(crop, "height"), field(crop, "width")) if do_crop else None, "shortest"
            if target != (shortest, shortest):
                raise ValueError(f"unsupported image processor: shortest_edge {shortest} needs a square center crop "
                                 f"of the same size (crop_size {crop!r}, do_center_crop {do_crop})")
        elif field(size, "height") is not None:
            target, mode = (field(size, "height"), field(size, "width")), "squash"
            if do_crop and (field(crop, "height"), field(crop, "width")) != target:
                raise ValueError(f"unsupported image processor: size {target} with crop_size {crop}")
        else:
            raise ValueError(f"unsupported image processor size {size!r}: expected shortest_edge or height/width")
        resample = int(getattr(ip, "resample", 3))  # PIL codes: 2 bilinear, 3 bicubic
        return cls(
            size=_pair(target),
            mean=tuple(getattr(ip, "image_mean", OPENAI_CLIP_MEAN)),
            std=tuple(getattr(ip, "image_std", OPENAI_CLIP_STD)),
            resize_mode=mode,
            interpolation="bilinear" if resample == 2 else "bicubic",
            crop_offset="floor",
        )
