"""Sample files for people to look at: captioned PNG grids of images or video frames, and tiled videos.

Videos are written as H.264 mp4 through imageio's PyAV plugin (the ``video`` / ``dev`` extras); without it
they fall back to an animated GIF written by PIL. All inputs are float tensors in [0, 1].
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

MIN_TILE = 128
"""Tiles are upscaled (nearest) to at least this many pixels on their short side, so small samples stay
visible."""
CAPTION_LINES = 3


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(..., 3, H, W) float in [0, 1] -> (..., H, W, 3) uint8."""
    array = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return np.moveaxis(array, -3, -1)


def _upscale(tile: Image.Image) -> Image.Image:
    factor = max(1, math.ceil(MIN_TILE / min(tile.size)))
    return tile.resize((tile.width * factor, tile.height * factor), Image.NEAREST) if factor > 1 else tile


def _caption(draw: ImageDraw.ImageDraw, text: str, box: tuple[int, int, int],
             font: ImageFont.ImageFont) -> None:
    """Write ``text`` wrapped to the tile width into the caption strip at (x, y) of width w."""
    x, y, width = box
    chars = max(8, width // 6)
    lines = textwrap.wrap(text, chars)[:CAPTION_LINES]
    for i, line in enumerate(lines):
        draw.text((x + 2, y + 2 + 11 * i), line, fill=(255, 255, 255), font=font)


def captioned_grid(tiles: list[Image.Image], captions: list[str] | None, columns: int) -> Image.Image:
    """Tiles (equal sizes) in a grid with ``columns`` columns, each with its caption below it."""
    tiles = [_upscale(t) for t in tiles]
    w, h = tiles[0].size
    strip = 4 + 11 * CAPTION_LINES if captions else 0
    rows = math.ceil(len(tiles) / columns)
    grid = Image.new("RGB", (columns * w, rows * (h + strip)), (32, 32, 32))
    draw, font = ImageDraw.Draw(grid), ImageFont.load_default()
    for i, tile in enumerate(tiles):
        x, y = (i % columns) * w, (i // columns) * (h + strip)
        grid.paste(tile, (x, y))
        if captions:
            _caption(draw, captions[i], (x, y + h, w), font)
    return grid


def image_grid(images: torch.Tensor, captions: list[str] | None = None,
               columns: int | None = None) -> Image.Image:
    """(B, 3, H, W) images in [0, 1] -> one captioned grid (about square unless ``columns`` is given)."""
    tiles = [Image.fromarray(a) for a in to_uint8(images)]
    return captioned_grid(tiles, captions, columns or math.ceil(math.sqrt(len(tiles))))


def frames_grid(videos: torch.Tensor, captions: list[str] | None = None, max_frames: int = 8) -> Image.Image:
    """(B, T, 3, H, W) videos in [0, 1] -> a grid with one row per video and up to ``max_frames`` evenly
    spaced frames per row; the caption goes under the row's first frame."""
    t = videos.shape[1]
    picks = np.unique(np.linspace(0, t - 1, min(t, max_frames)).round().astype(int))
    tiles = [Image.fromarray(a) for a in to_uint8(videos[:, picks]).reshape(-1, *videos.shape[-2:], 3)]
    row_captions = None
    if captions:
        row_captions = [captions[i // len(picks)] if i % len(picks) == 0 else "" for i in range(len(tiles))]
    return captioned_grid(tiles, row_captions, len(picks))


def tile_videos(videos: torch.Tensor) -> np.ndarray:
    """(B, T, 3, H, W) in [0, 1] -> (T, H', W', 3) uint8: the B videos side by side in an about-square grid,
    padded to even height and width (H.264 needs them)."""
    b, t, _, h, w = videos.shape
    columns = math.ceil(math.sqrt(b))
    rows = math.ceil(b / columns)
    frames = np.zeros((t, rows * h + (rows * h) % 2, columns * w + (columns * w) % 2, 3), dtype=np.uint8)
    for i, video in enumerate(to_uint8(videos)):
        y, x = (i // columns) * h, (i % columns) * w
        frames[:, y:y + h, x:x + w] = video
    return frames


def can_encode(codec: str) -> bool:
    """Whether imageio and PyAV are installed and PyAV's FFmpeg has an encoder named ``codec``."""
    try:
        import av
        import imageio.v3  # noqa: F401  (write_video writes through it)
    except ImportError:
        return False
    try:
        av.codec.Codec(codec, "w")
    except ValueError:  # av's UnknownCodecError
        return False
    return True


def write_video(frames: np.ndarray, path: Path, fps: int = 8, codec: str = "libx264") -> Path:
    """(T, H, W, 3) uint8 -> ``path`` as mp4 (PyAV, ``codec``), or ``path`` with a .gif suffix when PyAV, imageio
    or the encoder is missing."""
    if can_encode(codec):
        import imageio.v3 as iio

        iio.imwrite(path, frames, plugin="pyav", fps=fps, codec=codec)
        return path
    gif = path.with_suffix(".gif")
    first, *rest = [Image.fromarray(f) for f in frames]
    first.save(gif, save_all=True, append_images=rest, duration=round(1000 / fps), loop=0)
    return gif


def save_media(directory: Path, tag: str, prompts: list[str], images: torch.Tensor | None = None,
               videos: torch.Tensor | None = None, fps: int = 8) -> list[Path]:
    """Write ``tag.png`` (captioned grid) and, for videos, ``tag.mp4`` (or ``tag.gif``). Returns the files."""
    directory.mkdir(parents=True, exist_ok=True)
    grid_path = directory / f"{tag}.png"
    if videos is not None:
        frames_grid(videos, prompts).save(grid_path)
        return [grid_path, write_video(tile_videos(videos), directory / f"{tag}.mp4", fps)]
    if images is None:
        raise ValueError("save_media needs images or videos")
    image_grid(images, prompts).save(grid_path)
    return [grid_path]


def save_each(directory: Path, stems: list[str], images: torch.Tensor | None = None,
              videos: torch.Tensor | None = None, fps: int = 8) -> list[Path]:
    """Each sample as its own file ``directory/<stem>``, one stem per sample: a (3, H, W) image as ``.png`` at its
    own size, a (T, 3, H, W) video as ``.mp4`` (``.gif`` without an encoder, as :func:`write_video`). Returns the
    files."""
    directory.mkdir(parents=True, exist_ok=True)
    if videos is not None:
        return [write_video(tile_videos(video[None]), directory / f"{stem}.mp4", fps)
                for stem, video in zip(stems, videos, strict=True)]
    if images is None:
        raise ValueError("save_each needs images or videos")
    paths = [directory / f"{stem}.png" for stem in stems]
    for path, array in zip(paths, to_uint8(images), strict=True):
        Image.fromarray(array).save(path)
    return paths
