"""Video rewards: ``video_frames`` (any image reward over sampled frames), ``temporal_consistency`` and
``motion`` (its counterpart: how much the frames change).

All three take ``batch.videos`` (B, T, C, H, W) in [0, 1] (C = 3, or grayscale / RGBA, see :mod:`.checks`) and sample
``frames`` evenly spaced frames per video (first and last included; one frame = the middle one; None = all).
A VideoAlign-style judge comes through the VLM judge rewards, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mmgrpo.registry import REWARDS

from .base import GROUPWISE, POINTWISE, Reward, RewardBatch, as_scores
from .checks import as_rgb_videos
from .clip_models import encode_in_slices, load_open_clip, resolve_device, resolve_dtype
from .image_rules import in_chunks, luminance
from .preprocess import ClipPreprocess

REDUCTIONS = ("mean", "min")
CONSISTENCY_FORMULAS = ("adjacent", "vbench")


def sample_frame_indices(num_frames: int, frames: int | None) -> torch.Tensor:
    """(F,) int64 indices of ``frames`` evenly spaced frames out of ``num_frames`` (all when None or >= T)."""
    if frames is None or frames >= num_frames:
        return torch.arange(num_frames)
    if frames == 1:
        return torch.tensor([(num_frames - 1) // 2])
    return torch.linspace(0, num_frames - 1, frames, dtype=torch.float64).round().long()


def frame_count(frames: Any, reward: str, minimum: int) -> int | None:
    """The ``frames`` argument of ``reward`` as an int (a whole float such as YAML's ``8.0`` included) or None;
    ``ValueError`` naming it for a fraction, a non-number or a count below ``minimum``."""
    if frames is None:
        return None
    if isinstance(frames, bool) or not isinstance(frames, (int, float)) or not float(frames).is_integer():
        raise ValueError(f"{reward}: frames must be a whole number of frames or None; got {frames!r}")
    if frames < minimum:
        raise ValueError(f"{reward}: frames must be >= {minimum} (or None for all); got {frames}")
    return int(frames)


def videos_or_raise(batch: RewardBatch, reward: str) -> torch.Tensor:
    """The batch's videos as (B, T, 3, H, W) float32 RGB in [0, 1]; ``ValueError`` naming ``reward`` if none."""
    if batch.videos is None:
        raise ValueError(f"reward '{reward}' needs videos; this batch has none")
    return as_rgb_videos(batch.videos, reward)


def _reduce(scores: torch.Tensor, how: str) -> torch.Tensor:
    """(B, F) -> (B,), ignoring NaN frames; NaN when every frame is NaN."""
    if how == "mean":
        return scores.nanmean(1)
    nan = scores.isnan()
    low = scores.masked_fill(nan, float("inf")).amin(1)
    return low.masked_fill(nan.all(1), float("nan"))


@REWARDS.register("video_frames", kind="pointwise", modality="video",
                  description="any image reward on sampled frames, reduced by mean or min (one batched call)")
class VideoFrames(Reward):
    """An image reward applied to ``frames`` sampled frames of each video, then reduced per video.

    All sampled frames of all videos go to the image reward in ONE call: a batch of B*F images in which each
    video's prompt, group id and meta are repeated per frame (meta gains ``video_frame``, the frame index). A
    CLIP-family image reward encodes them its ``batch_size`` at a time.
    Sub-scores (a dict output) are reduced one by one. The score range is the image reward's.

    Args:
        image_reward: a registered image reward name (or ``module:attr``), or a :class:`Reward` instance.
        image_reward_args: constructor arguments of the image reward (with a name only).
        frames: frames sampled per video, evenly spaced (None = all frames).
        reduce: ``mean`` or ``min`` over the frames (NaN frames are ignored).
    """

    kind = POINTWISE
    modality = "video"

    @classmethod
    def components(cls, args: dict[str, Any]) -> list[tuple[str | None, str, Callable[[], Any]]]:
        """The image reward (see :meth:`Reward.components`)."""
        return [("image_reward", "image_reward_args", lambda: REWARDS.entry(args["image_reward"]).obj)]

    def __init__(self, image_reward: str | Reward, image_reward_args: dict[str, Any] | None = None,
                 frames: int | None = 8, reduce: str = "mean"):
        if reduce not in REDUCTIONS:
            raise ValueError(f"video_frames: reduce must be one of {REDUCTIONS}; got '{reduce}'")
        frames = frame_count(frames, "video_frames", 1)
        if isinstance(image_reward, Reward):
            if image_reward_args:
                raise ValueError("video_frames: image_reward_args need image_reward given by name")
            self.inner = image_reward
        else:
            from .zoo import build_reward

            self.inner = build_reward(image_reward, image_reward_args)
        if getattr(self.inner, "modality", "any") not in ("image", "any"):
            raise ValueError(f"video_frames: '{image_reward}' is a {self.inner.modality} reward, not an image reward")
        if getattr(self.inner, "kind", POINTWISE) == GROUPWISE:
            raise ValueError(f"video_frames: '{image_reward}' is groupwise; only pointwise image rewards apply")
        self.frames = frames
        self.reduce = reduce

    def to(self, device: str | torch.device) -> VideoFrames:
        self.inner.to(device)
        return self

    @torch.no_grad()
    def __call__(self, batch: RewardBatch) -> torch.Tensor | dict[str, torch.Tensor]:
        """(B,) float64 scores, or a dict of them when the image reward returns sub-scores."""
        videos = videos_or_raise(batch, "video_frames")
        b, t = videos.shape[:2]
        index = sample_frame_indices(t, self.frames)
        n = len(index)
        frames = videos[:, index.to(videos.device)].reshape(b * n, *videos.shape[2:])
        frame_batch = RewardBatch(
            prompts=[p for p in batch.prompts for _ in range(n)],
            group=batch.group.repeat_interleave(n),
            images=frames,
            meta=[{**m, "video_frame": int(i)} for m in batch.meta for i in index],
        )
        output = self.inner(frame_batch)

        def per_video(value: Any, name: str) -> torch.Tensor:
            (scores,) = as_scores(value, b * n, name).values()  # None -> NaN; a wrong count is a ValueError
            return _reduce(scores.view(b, n), self.reduce)

        if isinstance(output, dict):
            return {key: per_video(value, f"video_frames/{key}") for key, value in output.items()}
        return per_video(output, "video_frames")


@REWARDS.register("temporal_consistency", kind="pointwise", modality="video",
                  description="mean CLIP cosine similarity of adjacent frames, in [-1, 1] (1 = static)")
class TemporalConsistency(Reward):
    """Mean cosine similarity of the CLIP image embeddings of adjacent sampled frames, in [-1, 1]: 1 for a static
    video, lower as content changes (real CLIP embeddings of natural frames rarely go below 0.5). NaN for a video
    with fewer than 2 frames. Ignores the prompt. Rewards stillness: pair it with ``motion`` or a quality reward.

    ``formula="vbench"`` gives VBench's ``background_consistency`` per video instead (Vchitect/VBench
    ``vbench/background_consistency.py``, same model, OpenAI CLIP ViT-B/32, on all frames with ``frames=None``): each
    frame i >= 1 scores ``(max(0, cos(f[i-1], f[i])) + max(0, cos(f[0], f[i]))) / 2``, in [0, 1]; its first-frame
    term also penalises slow drift, which adjacent pairs alone barely see. The two agree only for a static video
    (1), so compare values of one formula only (see :func:`frame_consistency`).

    Args:
        model_name: open_clip architecture, ``hf-hub:``/``local-dir:`` source, or a model-config JSON path.
        pretrained: open_clip pretrained tag or local checkpoint file.
        frames: frames sampled per video, evenly spaced (None = all frames).
        quick_gelu: force QuickGELU; None follows the pretrained tag.
        device: where the model runs; None = CUDA when available, else CPU.
        dtype: model weights' dtype: ``float32``, ``float16`` or ``bfloat16`` (similarities in float32).
        batch_size: frames per forward pass (and per copy to ``device``), which bounds the memory of a batch of
            long videos.
        formula: ``adjacent`` (mean adjacent-frame cosine) or ``vbench`` (VBench's background consistency).
    """

    kind = POINTWISE
    modality = "video"

    def __init__(self, model_name: str = "ViT-B-32", pretrained: str | None = "openai", frames: int | None = 16,
                 quick_gelu: bool | None = None, device: str | None = None, dtype: str = "float32",
                 batch_size: int = 32, formula: str = "adjacent"):
        if batch_size < 1:
            raise ValueError(f"temporal_consistency: batch_size must be >= 1; got {batch_size}")
        if formula not in CONSISTENCY_FORMULAS:
            raise ValueError(f"temporal_consistency: formula must be one of {CONSISTENCY_FORMULAS}; got {formula!r}")
        self.formula = formula
        self.frames = frame_count(frames, "temporal_consistency", 2)
        self.batch_size = int(batch_size)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.model, _ = load_open_clip(model_name, pretrained, self.device, quick_gelu, "temporal_consistency")
        self.model.to(self.dtype)
        self.preprocess = ClipPreprocess.from_open_clip(self.model)

    def to(self, device: str | torch.device) -> TemporalConsistency:
        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    @torch.no_grad()
    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        """(B,) float64 CPU :func:`frame_consistency` of each video's sampled frames; NaN for single-frame
        videos."""
        videos = videos_or_raise(batch, "temporal_consistency")
        b, t = videos.shape[:2]
        index = sample_frame_indices(t, self.frames)
        n = len(index)
        if n < 2:
            return torch.full((b,), float("nan"), dtype=torch.float64)
        frames = videos[:, index.to(videos.device)].reshape(b * n, *videos.shape[2:])
        feats = encode_in_slices(self.model.encode_image, self.preprocess, frames, self.batch_size, self.device,
                                 self.dtype)
        return frame_consistency(feats.float().view(b, n, -1), self.formula).double().cpu()


def frame_consistency(feats: torch.Tensor, formula: str) -> torch.Tensor:
    """(B,) consistency of (B, F >= 2, D) frame embeddings: ``adjacent``: mean over i >= 1 of cos(f[i-1], f[i]), in
    [-1, 1]; ``vbench``: mean over i >= 1 of (max(0, cos(f[i-1], f[i])) + max(0, cos(f[0], f[i]))) / 2, in [0, 1]."""
    feats = F.normalize(feats, dim=-1)
    previous = (feats[:, 1:] * feats[:, :-1]).sum(-1)
    if formula == "adjacent":
        return previous.mean(1)
    first = (feats[:, 1:] * feats[:, :1]).sum(-1)
    return ((previous.clamp_min(0) + first.clamp_min(0)) / 2).mean(1)


def frame_differences(videos: torch.Tensor, max_side: int, ignore_brightness: bool = False) -> torch.Tensor:
    """(B, F, 3, H, W) RGB in [0, 1] -> (B, F - 1) mean absolute luma change between adjacent frames, in luma
    units ([0, 1]). Frames larger than ``max_side`` px on their longer side are first shrunk (area interpolation),
    which averages pixel noise away and bounds the cost. ``ignore_brightness`` subtracts each frame's mean luma
    first, so a change of the whole frame's brightness (exposure flicker) counts 0, and motion within the frame,
    which keeps the mean, counts as before."""
    b, f = videos.shape[:2]
    luma = luminance(videos.flatten(0, 1))  # float32: a float64 copy of every RGB frame made batch 32 1.6x slower
    height, width = luma.shape[-2:]
    scale = max_side / max(height, width)
    if scale < 1:
        luma = F.interpolate(luma, size=(max(1, round(height * scale)), max(1, round(width * scale))), mode="area")
    luma = luma.to(torch.float64).view(b, f, -1)
    if ignore_brightness:
        luma = luma - luma.mean(-1, keepdim=True)
    return (luma[:, 1:] - luma[:, :-1]).abs().mean(-1)


@REWARDS.register("motion", kind=POINTWISE, modality="video",
                  description="mean absolute luma change between adjacent frames (anti-stillness guard), "
                              "optionally saturating at a target")
class Motion(Reward):
    """How much a video moves: the mean absolute change of the luma between adjacent sampled frames
    (:func:`frame_differences`), averaged over the pairs. 0 for a still video; NaN with fewer than 2 frames.

    The counterpart of ``temporal_consistency``, which rewards stillness: a policy trained on consistency and
    per-frame quality alone can learn to stop moving, and this shows it (as a monitor, weight 0) or pays against
    it. Changes of the whole frame's brightness (exposure flicker) count 0 by default (``ignore_brightness``), but
    any other change counts, local flicker included, so do not train on it alone: with ``temporal_consistency``
    beside it, smooth motion is what scores on both. The value grows with the frame stride, so compare runs at the same
    ``frames`` and clip length. ``saturate_at`` caps the incentive: ``min(1, value / saturate_at)`` pays nothing
    beyond "moving enough".

    Args:
        frames: frames sampled per video, evenly spaced (None = all frames).
        max_side: frames are shrunk to at most this many pixels on their longer side before differencing.
        saturate_at: mean luma change at which the score reaches 1 and stops growing; None returns the raw value.
        ignore_brightness: subtract each frame's mean luma before differencing, so that brightening or darkening
            the whole frame is not motion.
    """

    kind = POINTWISE
    modality = "video"

    def __init__(self, frames: int | None = 16, max_side: int = 64, saturate_at: float | None = None,
                 ignore_brightness: bool = True):
        frames = frame_count(frames, "motion", 2)
        if max_side < 1:
            raise ValueError(f"motion: max_side must be >= 1 pixel; got {max_side}")
        if saturate_at is not None and saturate_at <= 0:
            raise ValueError(f"motion: saturate_at must be > 0; got {saturate_at}")
        self.frames, self.max_side, self.saturate_at = frames, max_side, saturate_at
        self.ignore_brightness = ignore_brightness

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        """(B,) float64 CPU mean adjacent-frame luma change; NaN for single-frame videos."""
        videos = videos_or_raise(batch, "motion")
        index = sample_frame_indices(videos.shape[1], self.frames)
        if len(index) < 2:
            return torch.full((videos.shape[0],), float("nan"), dtype=torch.float64)
        index = index.to(videos.device)
        value = in_chunks(lambda chunk: frame_differences(chunk[:, index], self.max_side,
                                                          self.ignore_brightness).mean(1), videos).cpu()
        return value if self.saturate_at is None else (value / self.saturate_at).clamp(max=1.0)
