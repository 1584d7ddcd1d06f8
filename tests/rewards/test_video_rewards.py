"""Video rewards: an image reward over sampled frames, CLIP temporal consistency (tiny models from conftest.py), and
motion."""

from __future__ import annotations

import math

import open_clip
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo.registry import REWARDS
from mmgrpo.rewards import FunctionReward, RewardBatch, build_reward
from mmgrpo.rewards.preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from mmgrpo.rewards.video import frame_consistency, frame_differences, sample_frame_indices

PROMPTS = ["a red cube spinning", "waves on a beach", "a cat jumps"]


def random_videos(b: int, t: int, height: int = 32, width: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t, 3, height, width), generator=g).float() / 255


def video_batch(videos: torch.Tensor, prompts: list[str]) -> RewardBatch:
    return RewardBatch(prompts=list(prompts), group=torch.tensor([0, 0, 1][: len(prompts)]), videos=videos)


def clip_args(tiny) -> dict:
    return {"model_name": tiny.clip_config, "pretrained": tiny.clip_checkpoint, "device": "cpu"}


class Recorder(FunctionReward):
    """An image reward whose score is each image's mean brightness; it records every batch it is called with."""

    def __init__(self, output: str = "tensor"):
        super().__init__(self.score, modality="image")
        self.calls: list[RewardBatch] = []
        self.output = output

    def score(self, batch: RewardBatch):
        self.calls.append(batch)
        brightness = batch.images.mean(dim=(1, 2, 3)).double()
        if self.output == "dict":
            return {"bright": brightness, "dark": 1 - brightness}
        return brightness


def test_registered_as_video_rewards():
    for name in ("video_frames", "temporal_consistency", "motion"):
        info = REWARDS.entry(name).info
        assert info["kind"] == "pointwise" and info["modality"] == "video" and info["description"]


def test_frames_are_sampled_evenly():
    assert sample_frame_indices(10, 4).tolist() == [0, 3, 6, 9]
    assert sample_frame_indices(17, 5).tolist() == [0, 4, 8, 12, 16]
    assert sample_frame_indices(3, 8).tolist() == [0, 1, 2]
    assert sample_frame_indices(6, None).tolist() == list(range(6))
    assert sample_frame_indices(9, 1).tolist() == [4]


@pytest.mark.parametrize("reduce", ["mean", "min"])
def test_video_frames_reduces_sampled_frames_in_one_call(reduce):
    levels = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.7], [0.6, 0.2, 0.4, 0.8, 0.0]])  # per-frame brightness
    videos = levels.view(2, 5, 1, 1, 1).expand(2, 5, 3, 8, 8).contiguous()
    inner = Recorder()
    reward = build_reward("video_frames", {"image_reward": inner, "frames": 3, "reduce": reduce})
    scores = reward(video_batch(videos, PROMPTS[:2]))
    picked = levels[:, [0, 2, 4]].double()  # frames 0, 2, 4 of 5
    expected = picked.mean(1) if reduce == "mean" else picked.min(1).values
    torch.testing.assert_close(scores, expected)
    assert len(inner.calls) == 1
    call = inner.calls[0]
    assert call.images.shape == (6, 3, 8, 8)
    assert call.prompts == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert call.group.tolist() == [0, 0, 0, 0, 0, 0]
    assert [m["video_frame"] for m in call.meta] == [0, 2, 4] * 2


def test_video_frames_sub_scores_nan_frames_and_bad_inner():
    videos = torch.tensor([0.2, 0.6]).view(1, 2, 1, 1, 1).expand(1, 2, 3, 4, 4)
    out = build_reward("video_frames", {"image_reward": Recorder("dict"), "frames": None})(
        video_batch(videos, PROMPTS[:1]))
    torch.testing.assert_close(out["bright"], torch.tensor([0.4], dtype=torch.float64))
    torch.testing.assert_close(out["dark"], torch.tensor([0.6], dtype=torch.float64))

    def half_nan(batch):
        return torch.tensor([math.nan, 0.5, math.nan, math.nan])

    for reduce in ("mean", "min"):
        reward = build_reward("video_frames", {"image_reward": FunctionReward(half_nan, modality="image"),
                                               "frames": None, "reduce": reduce})
        scores = reward(video_batch(torch.rand(2, 2, 3, 4, 4), PROMPTS[:2]))
        assert scores[0].item() == 0.5 and math.isnan(scores[1].item())

    def none_for_the_second_video(batch):  # None is "does not apply", as for any reward
        return [None if m["video_frame"] is not None and p == PROMPTS[1] else 0.25
                for p, m in zip(batch.prompts, batch.meta)]

    reward = build_reward("video_frames", {"image_reward": FunctionReward(none_for_the_second_video,
                                                                          modality="image"), "frames": None})
    scores = reward(video_batch(torch.rand(2, 2, 3, 4, 4), PROMPTS[:2]))
    assert scores[0].item() == 0.25 and math.isnan(scores[1].item())
    short = build_reward("video_frames", {"image_reward": FunctionReward(lambda batch: [0.5], modality="image"),
                                          "frames": None})
    with pytest.raises(ValueError, match="reward 'video_frames' returned 1 scores for a batch of 4"):
        short(video_batch(torch.rand(2, 2, 3, 4, 4), PROMPTS[:2]))
    with pytest.raises(ValueError, match="not an image reward"):
        build_reward("video_frames", {"image_reward": FunctionReward(half_nan, modality="text")})
    with pytest.raises(ValueError, match="reduce"):
        build_reward("video_frames", {"image_reward": Recorder(), "reduce": "max"})
    with pytest.raises(ValueError, match="needs videos"):
        build_reward("video_frames", {"image_reward": Recorder()})(
            RewardBatch(prompts=["x"], group=torch.zeros(1), images=torch.rand(1, 3, 4, 4)))


@pytest.mark.parametrize("reduce", ["mean", "min"])
def test_video_frames_with_clip_score_by_name_matches_frame_by_frame(reduce, tiny_models):
    videos = random_videos(3, 6, seed=1)
    reward = build_reward("video_frames", {"image_reward": "clip_score", "image_reward_args": clip_args(tiny_models),
                                           "frames": 3, "reduce": reduce})
    scores = reward(video_batch(videos, PROMPTS))
    image_reward = build_reward("clip_score", clip_args(tiny_models))
    per_frame = torch.stack([
        image_reward(RewardBatch(prompts=PROMPTS, group=torch.arange(3), images=videos[:, t])) for t in (0, 2, 5)
    ], 1)
    expected = per_frame.mean(1) if reduce == "mean" else per_frame.min(1).values
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)


def test_temporal_consistency_static_changing_and_single_frame(tiny_models):
    reward = build_reward("temporal_consistency", {**clip_args(tiny_models), "frames": None})
    static = random_videos(2, 1, seed=2).expand(2, 5, 3, 32, 32)
    torch.testing.assert_close(reward(video_batch(static, PROMPTS[:2])), torch.ones(2, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    moving = random_videos(2, 4, seed=3)
    scores = reward(video_batch(moving, PROMPTS[:2]))
    model = open_clip.create_model(tiny_models.clip_name).eval()
    model.load_state_dict(torch.load(tiny_models.clip_checkpoint))
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        feats = F.normalize(model.encode_image((moving.flatten(0, 1) - mean) / std), dim=-1).view(2, 4, -1)
    expected = torch.stack([(feats[:, t] * feats[:, t + 1]).sum(-1) for t in range(3)], 1).mean(1)
    torch.testing.assert_close(scores.float(), expected, atol=1e-5, rtol=0)
    assert (scores < 1 - 1e-3).all() and (scores >= -1).all()
    single = reward(video_batch(random_videos(2, 1), PROMPTS[:2]))
    assert torch.isnan(single).all()


def test_temporal_consistency_encodes_batch_size_frames_at_a_time(tiny_models):
    reward = build_reward("temporal_consistency", {**clip_args(tiny_models), "frames": None, "batch_size": 4})
    original, sizes = reward.model.encode_image, []

    def counting(pixels):
        sizes.append(len(pixels))
        return original(pixels)

    reward.model.encode_image = counting
    videos = random_videos(2, 5, seed=6)
    sliced = reward(video_batch(videos, PROMPTS[:2]))
    assert sizes == [4, 4, 2]
    whole = build_reward("temporal_consistency", {**clip_args(tiny_models), "frames": None})
    torch.testing.assert_close(sliced, whole(video_batch(videos, PROMPTS[:2])), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        build_reward("temporal_consistency", {**clip_args(tiny_models), "batch_size": 0})
    for frames in (0, 1):  # no pair of frames to compare: every video would score NaN
        with pytest.raises(ValueError, match=r"temporal_consistency: frames must be >= 2 \(or None for all\)"):
            build_reward("temporal_consistency", {**clip_args(tiny_models), "frames": frames})


def test_temporal_consistency_samples_frames_and_takes_grayscale(tiny_models, no_file_writes):
    reward = build_reward("temporal_consistency", {**clip_args(tiny_models), "frames": 3})
    videos = random_videos(2, 7, 40, 48, seed=4)
    with no_file_writes as writes:
        sampled = reward(video_batch(videos, PROMPTS[:2]))
    assert writes == []
    torch.testing.assert_close(sampled, reward(video_batch(videos[:, [0, 3, 6]], PROMPTS[:2])), atol=1e-6, rtol=0)
    gray = videos[:, :, :1]
    torch.testing.assert_close(reward(video_batch(gray, PROMPTS[:2])),
                               reward(video_batch(gray.expand(-1, -1, 3, -1, -1), PROMPTS[:2])), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- motion

def moving_square(t: int, step: int, side: int = 8, size: int = 32) -> torch.Tensor:
    """(1, t, 3, size, size): a white side x side square on black, moved ``step`` px right per frame."""
    video = torch.zeros(1, t, 3, size, size)
    for k in range(t):
        video[0, k, :, 4:4 + side, 2 + k * step:2 + k * step + side] = 1.0
    return video


def test_frame_differences_closed_forms():
    """A square of side s moved d < s px uncovers d x s pixels and covers d x s others, each changing by 1: the
    mean change is 2 d s / (H W) per pair. A frame that brightens by c everywhere changes by c."""
    diffs = frame_differences(moving_square(4, step=3), max_side=64)
    assert diffs.shape == (1, 3) and torch.allclose(diffs, torch.full((1, 3), 2 * 3 * 8 / 32**2, dtype=torch.float64))
    levels = torch.tensor([0.1, 0.35, 0.5]).view(1, 3, 1, 1, 1).expand(1, 3, 3, 16, 16)
    assert torch.allclose(frame_differences(levels, 64), torch.tensor([[0.25, 0.15]], dtype=torch.float64))
    # shrinking averages 2x2 blocks: a square on the block grid moved by whole blocks keeps its mean change
    assert torch.allclose(frame_differences(moving_square(3, step=4), max_side=16), diffs[:, :2] * 4 / 3)


def test_motion_scores_still_moving_and_single_frame_videos():
    still = moving_square(5, step=0)
    moving = moving_square(5, step=3)
    scores = build_reward("motion", {})(video_batch(torch.cat([still, moving]), PROMPTS[:2]))
    assert scores.dtype == torch.float64 and scores.tolist() == pytest.approx([0.0, 2 * 3 * 8 / 32**2])
    capped = build_reward("motion", {"saturate_at": 0.02})(video_batch(torch.cat([still, moving]), PROMPTS[:2]))
    assert capped.tolist() == pytest.approx([0.0, 1.0])
    half = build_reward("motion", {"saturate_at": 0.1})(video_batch(moving, PROMPTS[:1]))
    assert half.item() == pytest.approx(2 * 3 * 8 / 32**2 / 0.1)
    assert math.isnan(build_reward("motion", {})(video_batch(moving[:, :1], PROMPTS[:1])).item())


def test_motion_scores_each_video_alone():
    """Scored a few videos at a time: a batch of 7 gives every video the score it gets alone."""
    videos = torch.cat([random_videos(3, 6), moving_square(6, step=2), moving_square(6, step=0),
                        random_videos(2, 6, seed=1)])
    batch = RewardBatch(prompts=["p"] * 7, group=torch.zeros(7, dtype=torch.long), videos=videos)
    reward = build_reward("motion", {"frames": 4})
    whole = reward(batch)
    torch.testing.assert_close(whole, torch.cat([reward(batch.select([i])) for i in range(7)]), rtol=1e-9, atol=0)
    assert whole[4] == 0 and whole[3] > 0


def test_motion_ignores_whole_frame_brightness_flicker():
    """Brightening the whole frame by c changes every pixel by c: motion 0 under ``ignore_brightness`` (the
    default), c without it. A square moving within the frame keeps the frame's mean, so it scores the same with or
    without the flicker laid over it."""
    flicker = torch.tensor([0.1, 0.4, 0.1, 0.4]).view(1, 4, 1, 1, 1)
    lit = build_reward("motion", {})(video_batch(flicker.expand(1, 4, 3, 16, 16), PROMPTS[:1]))
    raw = build_reward("motion", {"ignore_brightness": False})(video_batch(flicker.expand(1, 4, 3, 16, 16),
                                                                            PROMPTS[:1]))
    assert lit.item() == pytest.approx(0.0, abs=1e-12) and raw.item() == pytest.approx(0.3)
    square = moving_square(4, step=3) * 0.5
    flickering = square + flicker * 0.5
    reward = build_reward("motion", {})
    assert reward(video_batch(flickering, PROMPTS[:1])).item() == pytest.approx(
        reward(video_batch(square, PROMPTS[:1])).item()) == pytest.approx(2 * 3 * 8 / 32**2 * 0.5)


def test_motion_samples_frames_and_takes_grayscale():
    videos = random_videos(2, 9, 24, 40, seed=5)
    reward = build_reward("motion", {"frames": 3})
    torch.testing.assert_close(reward(video_batch(videos, PROMPTS[:2])),
                               build_reward("motion", {"frames": None})(video_batch(videos[:, [0, 4, 8]], PROMPTS[:2])))
    gray = videos[:, :, :1]
    torch.testing.assert_close(reward(video_batch(gray, PROMPTS[:2])),
                               reward(video_batch(gray.expand(-1, -1, 3, -1, -1), PROMPTS[:2])), atol=1e-6, rtol=0)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 6))
def test_motion_is_invariant_to_time_reversal_mirroring_and_inversion(seed, frames):
    """|a - b| is symmetric, so playing the clip backwards changes nothing; nor does mirroring the frames (the
    shrink averages the same pixels) or inverting them (every change flips sign)."""
    videos = random_videos(1, frames, 20, 28, seed=seed)
    variants = torch.cat([videos, videos.flip(1), videos.flip(4), 1 - videos])
    batch = RewardBatch(prompts=["p"] * 4, group=torch.zeros(4, dtype=torch.long), videos=variants)
    scores = build_reward("motion", {"frames": None, "max_side": 16})(batch).tolist()
    assert scores == pytest.approx([scores[0]] * 4, abs=1e-6)


def test_motion_checks_its_inputs():
    with pytest.raises(ValueError, match="reward 'motion' needs videos"):
        build_reward("motion", {})(RewardBatch(prompts=["p"], group=torch.zeros(1, dtype=torch.long),
                                               images=torch.rand(1, 3, 8, 8)))
    with pytest.raises(ValueError, match=r"motion: frames must be >= 2"):
        build_reward("motion", {"frames": 1})
    with pytest.raises(ValueError, match="motion: max_side must be >= 1 pixel"):
        build_reward("motion", {"max_side": 0})
    with pytest.raises(ValueError, match="motion: saturate_at must be > 0"):
        build_reward("motion", {"saturate_at": 0})


def test_a_whole_float_frame_count_from_yaml_is_accepted_and_a_fraction_refused():
    """YAML may give ``frames: 8.0``: it samples as 8 does; 8.5 is refused by name rather than truncated."""
    batch = video_batch(random_videos(2, 12, 16, 16, seed=3), PROMPTS[:2])
    torch.testing.assert_close(build_reward("motion", {"frames": 8.0})(batch),
                               build_reward("motion", {"frames": 8})(batch), rtol=0, atol=0)
    recorder = build_reward("video_frames", {"image_reward": Recorder(), "frames": 4.0})
    recorder(batch)
    assert len(recorder.inner.calls[-1]) == 8  # 2 videos x 4 frames
    for name in ("motion", "video_frames", "temporal_consistency"):
        args = {"image_reward": Recorder()} if name == "video_frames" else {}
        for bad in (8.5, float("nan"), float("inf"), "8", True):
            with pytest.raises(ValueError, match=f"^{name}: frames must be a whole number of frames or None; got"):
                build_reward(name, {**args, "frames": bad})


def test_frame_consistency_formulas_against_their_closed_forms():
    """Unit embeddings at angles 0, 60, 120 degrees: adjacent pairs have cos 1/2 each; VBench's score of frame 1 is
    (1/2 + 1/2) / 2 and of frame 2 (1/2 + max(0, -1/2)) / 2, so its mean is (1/2 + 1/4) / 2."""
    angles = torch.tensor([0.0, 60.0, 120.0]).deg2rad()
    feats = torch.stack([angles.cos(), angles.sin()], -1)[None] * torch.tensor([1.0, 3.0, 0.5])[None, :, None]
    torch.testing.assert_close(frame_consistency(feats, "adjacent"), torch.tensor([0.5]))
    torch.testing.assert_close(frame_consistency(feats, "vbench"), torch.tensor([0.375]))
    static = torch.ones(2, 4, 8)
    for formula in ("adjacent", "vbench"):
        torch.testing.assert_close(frame_consistency(static, formula), torch.ones(2))
    # angles 0, 60, 180: adjacent cosines 1/2 and -1/2 (mean 0); VBench clamps both terms of frame 2 to 0, so its
    # mean is ((1/2 + 1/2) / 2 + 0) / 2
    angles = torch.tensor([0.0, 60.0, 180.0]).deg2rad()
    turning = torch.stack([angles.cos(), angles.sin()], -1)[None]
    torch.testing.assert_close(frame_consistency(turning, "adjacent"), torch.tensor([0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(frame_consistency(turning, "vbench"), torch.tensor([0.25]))


def test_temporal_consistency_vbench_formula_through_the_reward(tiny_models):
    batch = RewardBatch(prompts=["a"], group=torch.zeros(1, dtype=torch.long), videos=torch.rand(1, 5, 3, 32, 32))
    adjacent = build_reward("temporal_consistency", {**clip_args(tiny_models), "frames": None})(batch)
    vbench = build_reward("temporal_consistency", {**clip_args(tiny_models), "frames": None, "formula": "vbench"})(batch)
    assert 0.0 <= vbench.item() <= 1.0 and vbench.item() != adjacent.item()
    with pytest.raises(ValueError, match="temporal_consistency: formula must be one of"):
        build_reward("temporal_consistency", {**clip_args(tiny_models), "formula": "vbnech"})
