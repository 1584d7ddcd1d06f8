"""Image and video loading for the VLM pipeline, with the Qwen2-VL sizing conventions taken from ``VLMVideoConfig``.

A video becomes ``frame_count`` frames picked uniformly over the clip (:func:`sample_indices`), each resized by
:func:`smart_size` to sides that are multiples of ``size_factor`` within the per-frame pixel budget. An image is
resized the same way within the image budget. Budgets in the config count units of 28x28 = 784 pixels
(:data:`PIXEL_UNIT`).

Decoding goes through decord or PyAV (``video.backend``); ``auto`` tries decord and falls back to PyAV when decord is
not installed or cannot read the file. Both backends turn the clip into the same frame indices, so they give the
same frames up to codec rounding. A missing or unreadable file raises :class:`MediaError`; what to do with it (skip
or stop) is the caller's policy (``data.on_bad_media``).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from mmgrpo.config import ConfigError, check_ranges

from .config import VLMVideoConfig

PIXEL_UNIT = 28 * 28
"""Pixels per unit of ``video.max_pixels``, ``video.min_pixels``, ``video.image_max_pixels`` and
``video.image_min_pixels``."""
BACKENDS = ("auto", "decord", "pyav")
MAX_ASPECT = 200
"""The longest side over the shortest that the Qwen2-VL-family processors accept for an image or frame."""
FPS_TOLERANCE = 1.5
"""How many times the container's frame rate may differ from its frames over its duration before the latter is
taken (:func:`clip_fps`)."""


class MediaError(Exception):
    """A missing, corrupt or undecodable image or video. ``str()`` is one line: ``"<path>: <reason>"``."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = str(path), " ".join(str(reason).split())
        super().__init__(f"{self.path}: {self.reason}")


def _reason(err: BaseException) -> str:
    """The first line of a library error (decord appends a C++ stack), prefixed by its type, at most 200 chars."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text[:200]


def check_video_config(cfg: VLMVideoConfig) -> None:
    """Raise ConfigError naming the ``video.*`` key whose value cannot work."""
    check_ranges(cfg, "video.")
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"bad value '{cfg.backend}' for 'video.backend': expected one of {', '.join(BACKENDS)}")
    if not 1 <= cfg.min_frames <= cfg.max_frames:
        raise ConfigError(f"bad value for 'video.min_frames': need 1 <= min_frames <= max_frames, got "
                          f"{cfg.min_frames} and {cfg.max_frames}")
    if cfg.max_frames < cfg.frame_multiple:
        raise ConfigError(f"bad value for 'video.max_frames': must be >= video.frame_multiple "
                          f"({cfg.frame_multiple}), got {cfg.max_frames}")
    m = cfg.frame_multiple
    if -(-cfg.min_frames // m) * m > cfg.max_frames:
        raise ConfigError(f"bad value for 'video.min_frames': a multiple of video.frame_multiple ({m}) must lie "
                          f"between min_frames and max_frames, got {cfg.min_frames} and {cfg.max_frames}")
    if cfg.image_min_pixels is not None and cfg.image_min_pixels < 1:
        raise ConfigError(f"bad value for 'video.image_min_pixels': must be >= 1, got {cfg.image_min_pixels}")
    image_floor = "min_pixels" if cfg.image_min_pixels is None else "image_min_pixels"
    for key, floor in (("max_pixels", "min_pixels"), ("image_max_pixels", image_floor)):
        value, low = getattr(cfg, key), getattr(cfg, floor)
        if value < low or value * PIXEL_UNIT < cfg.size_factor ** 2:
            raise ConfigError(f"bad value for 'video.{key}': must be >= video.{floor} ({low}) and "
                              f"hold one {cfg.size_factor}x{cfg.size_factor} patch, got {value}")


def image_min_pixels(cfg: VLMVideoConfig) -> int:
    """The per-image pixel floor in 28x28 units: ``image_min_pixels``, or ``min_pixels`` when that is None."""
    return cfg.min_pixels if cfg.image_min_pixels is None else cfg.image_min_pixels


def frame_count(duration_s: float, native_fps: float, total_frames: int, cfg: VLMVideoConfig) -> int:
    """Frames to sample from a clip, by Qwen2-VL's rule (qwen-vl-utils' ``smart_nframes`` as Qwen2-VL, Qwen2.5-VL
    and Video-R1 use it), all knobs from ``cfg``.

    ``duration_s * cfg.fps`` clamped to ``[min_frames, max_frames]`` (``min_frames`` rounded up and ``max_frames``
    rounded down to multiples of ``frame_multiple``), then rounded to the nearest multiple of ``frame_multiple``
    (Python's ``round``: ties to even), then, beyond qwen-vl-utils (which refuses it), capped by ``total_frames``
    rounded down to a multiple and at least ``frame_multiple``: a clip shorter than that repeats frames (see
    :func:`sample_indices`). ``duration_s`` that is not positive and finite is replaced by ``total_frames /
    native_fps``.
    """
    if total_frames < 1:
        raise ValueError(f"frame_count: total_frames must be >= 1, got {total_frames}")
    if not (math.isfinite(duration_s) and duration_s > 0):
        duration_s = total_frames / native_fps if math.isfinite(native_fps) and native_fps > 0 else 0.0
    m = cfg.frame_multiple
    lo, hi = -(-cfg.min_frames // m) * m, cfg.max_frames // m * m
    n = round(min(max(duration_s * cfg.fps, lo), hi) / m) * m
    return max(m, min(n, total_frames // m * m))


def sample_indices(total_frames: int, count: int) -> list[int]:
    """``count`` frame indices spread uniformly over ``total_frames``: the centre frame of each of ``count`` equal
    segments, ``floor((i + 0.5) * total_frames / count)``. Indices repeat when ``count > total_frames``."""
    if total_frames < 1 or count < 1:
        raise ValueError(f"sample_indices: need total_frames >= 1 and count >= 1, got {total_frames}, {count}")
    return [(2 * i + 1) * total_frames // (2 * count) for i in range(count)]


def smart_size(height: int, width: int, min_pixels: int, max_pixels: int, factor: int = 28) -> tuple[int, int]:
    """(height, width) for resizing, the Qwen2-VL rule: both sides multiples of ``factor`` and at least ``factor``,
    area (in pixels) in ``[min_pixels, max_pixels]``, aspect ratio kept as well as the rounding allows.

    Each side is first rounded to the nearest multiple (Python ``round``, like qwen-vl-utils); if that fits, done.
    Otherwise both sides are scaled by one factor onto the violated bound and each is rounded down or up: of those
    (up to four) sizes that fit, the one closest in aspect ratio wins, then the one closest in area to the bound.
    (qwen-vl-utils always rounds both down, or both up, which can distort a small image's aspect by 2x.) When none
    fits, both are rounded down (over budget) or up (under the floor), and then, if the area is still over budget
    (a side clamped to ``factor``: aspect ratios beyond ``max_pixels / factor**2``), the longer side is shortened
    until it fits. ``max_pixels`` is always met; ``min_pixels`` unless the band is too narrow for the rounding.
    """
    if height < 1 or width < 1 or factor < 1:
        raise ValueError(f"smart_size: need positive sizes and factor, got {height}x{width}, factor {factor}")
    if not factor * factor <= max_pixels or min_pixels > max_pixels:
        raise ValueError(f"smart_size: need factor**2 <= max_pixels and min_pixels <= max_pixels, got factor "
                         f"{factor}, min_pixels {min_pixels}, max_pixels {max_pixels}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if not min_pixels <= h * w <= max_pixels:
        over = h * w > max_pixels
        bound = max_pixels if over else min_pixels
        beta = math.sqrt(bound / (height * width))
        down = [max(factor, math.floor(x * beta / factor) * factor) for x in (height, width)]
        up = [max(factor, math.ceil(x * beta / factor) * factor) for x in (height, width)]
        fits = [(a, b) for a in {down[0], up[0]} for b in {down[1], up[1]} if min_pixels <= a * b <= max_pixels]
        aspect = math.log(height / width)
        if fits:
            h, w = min(fits, key=lambda s: (abs(math.log(s[0] / s[1]) - aspect), abs(s[0] * s[1] - bound), s))
        else:
            h, w = down if over else up
    while h * w > max_pixels:  # ends at the latest at factor x factor, which fits
        if h >= w:
            h -= factor
        else:
            w -= factor
    return h, w


def fitted_size(path: str | os.PathLike, height: int, width: int, min_pixels: int, max_pixels: int,
                factor: int) -> tuple[int, int]:
    """:func:`smart_size` of an image or frame of ``path``; MediaError when the result is still longer than
    ``MAX_ASPECT`` times its width (or the reverse), which the Qwen2-VL-family processors refuse."""
    h, w = smart_size(height, width, min_pixels, max_pixels, factor)
    if max(h, w) > MAX_ASPECT * min(h, w):
        raise MediaError(path, f"aspect ratio {max(h, w) / min(h, w):.0f}:1 after resizing {height}x{width} to "
                               f"{h}x{w}; the processor takes at most {MAX_ASPECT}:1")
    return h, w


def _resize(frames: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """(N,H,W,3) uint8 -> (N,3,h,w) uint8 tensor, PIL bicubic (antialiased when shrinking) frame by frame."""
    if frames.shape[1:3] != size:
        frames = np.stack([np.asarray(Image.fromarray(f).resize((size[1], size[0]), Image.Resampling.BICUBIC))
                           for f in frames])
    return torch.from_numpy(np.require(frames, np.uint8, ["C", "W"])).permute(0, 3, 1, 2).contiguous()


def clip_fps(native_fps: float, total: int, duration_s: float) -> float:
    """The clip's frame rate (frames per second): the container's ``native_fps``, unless ``total`` frames over its
    ``duration_s`` seconds disagree with it by more than :data:`FPS_TOLERANCE` times, or it is not a positive finite
    number (containers report 1000 fps, the time base, or 0 for some Matroska / WebM files): then ``total /
    duration_s``. NaN when neither is usable."""
    usable = math.isfinite(native_fps) and native_fps > 0
    if not (math.isfinite(duration_s) and duration_s > 0 and total > 0):
        return native_fps if usable else math.nan
    measured = total / duration_s
    if not usable or max(native_fps / measured, measured / native_fps) > FPS_TOLERANCE:
        return measured
    return native_fps


def _frame_plan(path: Path, total: int, native_fps: float, duration_s: float,
                cfg: VLMVideoConfig) -> tuple[list[int], float]:
    """The frame indices to decode and the sampled fps they amount to (frames per second of video), from the
    container's frame count, rate and duration (seconds; NaN when unknown) through :func:`clip_fps`."""
    if total < 1:
        raise MediaError(path, "no frames")
    native_fps = clip_fps(native_fps, total, duration_s)
    if math.isnan(native_fps):
        raise MediaError(path, "no usable frame rate or duration in the container")
    count = frame_count(total / native_fps, native_fps, total, cfg)
    return sample_indices(total, count), count * native_fps / total


def read_decord(path: Path, cfg: VLMVideoConfig) -> tuple[np.ndarray, float]:
    """Decode the sampled frames with decord: (T,H,W,3) uint8 at native resolution, and the sampled fps. The
    duration is from the first frame's start to the last frame's end.

    Raises ImportError when decord is not installed and MediaError when it cannot read the file."""
    import decord

    try:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
        total, native_fps = len(reader), float(reader.get_avg_fps())
        duration = float(reader.get_frame_timestamp(total - 1)[1] - reader.get_frame_timestamp(0)[0]) \
            if total else math.nan
    except Exception as err:  # decord raises its own DECORDError, RuntimeError, ... for unreadable input
        raise MediaError(path, f"decord cannot open it ({_reason(err)})") from err
    indices, fps = _frame_plan(path, total, native_fps, duration, cfg)
    try:
        batch = reader.get_batch(indices)
    except Exception as err:
        raise MediaError(path, f"decord cannot decode it ({_reason(err)})") from err
    return np.asarray(batch.asnumpy() if hasattr(batch, "asnumpy") else batch, dtype=np.uint8), fps


def tag_seconds(value: str | None) -> float:
    """Seconds of a ``HH:MM:SS.fraction`` duration tag (Matroska's ``DURATION``); NaN when it is not one."""
    parts = (value or "").split(":")
    try:
        hours, minutes, seconds = (float(p) for p in parts) if len(parts) == 3 else (math.nan,) * 3
    except ValueError:
        return math.nan
    return hours * 3600 + minutes * 60 + seconds


def pyav_duration(container, stream) -> float:
    """Seconds of a PyAV video ``stream``: its own duration, or its ``DURATION`` tag (Matroska), or the
    container's when the video is its only stream (another stream, such as longer audio, may set that); NaN when
    none is known."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    tagged = tag_seconds(stream.metadata.get("DURATION"))
    if not math.isnan(tagged) or len(container.streams) > 1 or not container.duration:
        return tagged
    return container.duration / 1_000_000  # AV_TIME_BASE units


def read_pyav(path: Path, cfg: VLMVideoConfig) -> tuple[np.ndarray, float]:
    """Decode the sampled frames with PyAV: (T,H,W,3) uint8 at native resolution, and the sampled fps.

    The frame count comes from the stream header, or from counting packets when the header has none; the duration
    from :func:`pyav_duration`. When the
    stream then decodes to fewer frames than that, the frames are picked again over the frames that exist."""
    import av

    def open_stream(container):
        if not container.streams.video:
            raise MediaError(path, "no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        return stream

    try:
        with av.open(str(path)) as container:
            stream = open_stream(container)
            rate = stream.average_rate or stream.guessed_rate
            native_fps = float(rate) if rate else 0.0
            duration = pyav_duration(container, stream)
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        for _ in range(2):
            indices, fps = _frame_plan(path, total, native_fps, duration, cfg)
            wanted, decoded, seen = set(indices), {}, 0
            with av.open(str(path)) as container:
                for frame in container.decode(open_stream(container)):
                    if seen in wanted:
                        decoded[seen] = frame.to_ndarray(format="rgb24")
                    seen += 1
                    if seen > indices[-1]:
                        break
            if len(decoded) == len(wanted):
                return np.stack([decoded[i] for i in indices]), fps
            total = seen
    except MediaError:
        raise
    except Exception as err:  # av.error.FFmpegError, OSError, ValueError, ... for unreadable input
        raise MediaError(path, f"PyAV cannot decode it ({_reason(err)})") from err
    raise MediaError(path, f"PyAV decoded {seen} frames, fewer than the stream reports")


def decode_video(path: str | os.PathLike, cfg: VLMVideoConfig) -> tuple[torch.Tensor, float]:
    """(T,3,H,W) uint8 frames of a video, sampled and resized per ``cfg``, and the sampled fps they represent.

    T is :func:`frame_count` of the clip; H, W are :func:`smart_size` of the native size with the per-frame budget
    ``[cfg.min_pixels, cfg.max_pixels] * PIXEL_UNIT`` and ``cfg.size_factor``. The fps is ``T * native_fps /
    total_frames``, ``native_fps`` the container's rate checked against its duration (:func:`clip_fps`);
    Qwen2.5-VL's processor sets ``second_per_grid_ts`` to its temporal patch (2 frames) over this fps, whatever
    ``frame_multiple`` (a multiple of the patch) is.
    Raises MediaError for a missing or unreadable file, ConfigError for a bad ``video.*`` value or
    ``backend: decord`` without decord installed.
    """
    check_video_config(cfg)
    path = Path(path)
    if not path.is_file():
        raise MediaError(path, "no such file")
    if cfg.backend == "pyav":
        frames, fps = read_pyav(path, cfg)
    else:
        try:
            frames, fps = read_decord(path, cfg)
        except ImportError as err:
            if cfg.backend == "decord":
                raise ConfigError("bad value 'decord' for 'video.backend': decord is not installed "
                                  "(pip install decord, or use backend pyav or auto)") from err
            frames, fps = read_pyav(path, cfg)
        except MediaError as err:
            if cfg.backend == "decord":
                raise
            try:
                frames, fps = read_pyav(path, cfg)
            except MediaError as err2:
                raise MediaError(path, f"{err.reason}; {err2.reason}") from err2
            warnings.warn(f"{err}; decoded it with PyAV instead", stacklevel=2)
    size = fitted_size(path, frames.shape[1], frames.shape[2], cfg.min_pixels * PIXEL_UNIT,
                       cfg.max_pixels * PIXEL_UNIT, cfg.size_factor)
    return _resize(frames, size), fps


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB version of any PIL image: transparency is composited over white, 16-bit grey scaled to 8 bits."""
    if image.mode.startswith("I;16"):
        grey = (np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def load_image(path: str | os.PathLike, cfg: VLMVideoConfig) -> torch.Tensor:
    """(3,H,W) uint8 RGB image resized by :func:`smart_size` to the budget ``[image_min_pixels(cfg),
    cfg.image_max_pixels] * PIXEL_UNIT`` and ``cfg.size_factor``.

    EXIF orientation is applied; transparency is composited over white; grey, palette, CMYK and 16-bit images
    become RGB. Raises MediaError for a missing or unreadable file."""
    check_video_config(cfg)
    path = Path(path)
    if not path.is_file():
        raise MediaError(path, "no such file")
    try:
        with Image.open(path) as image:
            rgb = np.asarray(_to_rgb(ImageOps.exif_transpose(image)))
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        raise MediaError(path, f"cannot read the image ({_reason(err)})") from err
    size = fitted_size(path, rgb.shape[0], rgb.shape[1], image_min_pixels(cfg) * PIXEL_UNIT,
                       cfg.image_max_pixels * PIXEL_UNIT, cfg.size_factor)
    return _resize(rgb[None], size)[0]


class MediaCache:
    """Decoded images and videos, kept for one iteration so the G copies of a prompt (and T-GRPO's shuffled copy)
    decode each file once. A failed decode is remembered too: asking again raises the same MediaError without
    retrying. Call :meth:`clear` between iterations. Cached tensors are shared; do not modify them in place.

    ``hits`` counts answers from the cache (remembered failures included), ``misses`` decodes, ``failures`` decodes
    that raised MediaError.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, object] = {}
        self.hits = self.misses = self.failures = 0

    def _get(self, key: tuple, load: Callable[[], object]):
        if key in self._entries:
            self.hits += 1
            value = self._entries[key]
        else:
            self.misses += 1
            try:
                value = load()
            except MediaError as err:
                self.failures += 1
                value = err
            self._entries[key] = value
        if isinstance(value, MediaError):
            raise MediaError(value.path, value.reason)
        return value

    def get_video(self, path: str | os.PathLike, cfg: VLMVideoConfig) -> tuple[torch.Tensor, float]:
        """:func:`decode_video`, cached per path and decoding settings."""
        key = ("video", os.path.abspath(path), cfg.backend, cfg.fps, cfg.min_frames, cfg.max_frames,
               cfg.frame_multiple, cfg.min_pixels, cfg.max_pixels, cfg.size_factor)
        return self._get(key, lambda: decode_video(path, cfg))

    def get_image(self, path: str | os.PathLike, cfg: VLMVideoConfig) -> torch.Tensor:
        """:func:`load_image`, cached per path and size settings."""
        key = ("image", os.path.abspath(path), image_min_pixels(cfg), cfg.image_max_pixels, cfg.size_factor)
        return self._get(key, lambda: load_image(path, cfg))

    def stats(self) -> dict[str, int]:
        """``{"hits", "misses", "failures"}`` since the last :meth:`clear`."""
        return {"hits": self.hits, "misses": self.misses, "failures": self.failures}

    def clear(self) -> None:
        """Forget every entry (and remembered failure) and reset the counters."""
        self._entries.clear()
        self.hits = self.misses = self.failures = 0


def shuffle_frames(frames: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``frames`` (T, ...) reordered along dim 0 by a random permutation that is never the identity (T-GRPO's
    shuffled-frame rollouts); uniform over the other T! - 1 orders. A clip with T <= 1 is returned as a copy."""
    t = frames.shape[0]
    if t < 2:
        return frames.clone()
    identity = torch.arange(t)
    while True:
        order = torch.randperm(t, generator=generator)
        if not torch.equal(order, identity):
            return frames[order]
