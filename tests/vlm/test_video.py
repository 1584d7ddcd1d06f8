"""Frame counts, sizes, decoding (decord / PyAV / fallback), image loading, the media cache and frame shuffling."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.config import ConfigError
from mmgrpo.pipelines.vlm import video
from mmgrpo.pipelines.vlm.config import VLMVideoConfig
from mmgrpo.pipelines.vlm.video import (
    MediaCache,
    MediaError,
    clip_fps,
    decode_video,
    frame_count,
    load_image,
    sample_indices,
    shuffle_frames,
    smart_size,
)

TINY = Path(__file__).resolve().parents[2] / "assets" / "data" / "vlm_tiny"
CLIPS = sorted(TINY.glob("videos/*.mp4"))
CFG = VLMVideoConfig()  # fps 2, frames in [4, 16], multiple 2, 4..128 units per frame, 256 per image


def cfg(**kw) -> VLMVideoConfig:
    return dataclasses.replace(CFG, **kw)


@pytest.mark.parametrize("duration, native_fps, total, kw, expected", [
    # qwen-vl-utils' smart_nframes: clamp duration x fps to [min, max], round to the nearest multiple (ties to even)
    (4.0, 4.0, 16, {}, 8),                       # 4 s x 2 fps
    (10.0, 30.0, 300, {}, 16),                   # 20 clamped to max_frames
    (1.0, 30.0, 30, {}, 4),                      # 2 raised to min_frames
    (3.5, 30.0, 105, {}, 8),                     # 7 = 3.5 pairs, a tie, to 4 pairs (even)
    (2.5, 30.0, 75, {}, 4),                      # 5 = 2.5 pairs, a tie, to 2 pairs (even)
    (2.25, 4.0, 9, {}, 4),                       # 4.5 = 2.25 pairs -> 2
    (2.75, 4.0, 11, {}, 6),                      # 5.5 = 2.75 pairs -> 3
    (5.0, 1.0, 5, {}, 4),                        # 10, capped by the 5 frames there are, down to 4
    (0.25, 4.0, 1, {}, 2),                       # one frame: at least frame_multiple (repeated)
    (1.0, 30.0, 30, {"min_frames": 5}, 6),       # odd min_frames rounds up to a multiple
    (10.0, 30.0, 300, {"max_frames": 15}, 14),   # odd max_frames rounds down
    (3.5, 30.0, 105, {"frame_multiple": 1}, 7),
    (3.5, 30.0, 105, {"frame_multiple": 4, "fps": 3.0}, 12),  # 10.5 = 2.625 quads -> 3
    (0.0, 4.0, 16, {}, 8),                       # unknown duration: total / native fps
    (float("nan"), 8.0, 96, {"fps": 1.0}, 12),
])
def test_frame_count(duration, native_fps, total, kw, expected):
    assert frame_count(duration, native_fps, total, cfg(**kw)) == expected


def test_sample_indices():
    assert sample_indices(16, 8) == [1, 3, 5, 7, 9, 11, 13, 15]
    assert sample_indices(10, 4) == [1, 3, 6, 8]
    assert sample_indices(16, 16) == list(range(16))
    assert sample_indices(1, 2) == [0, 0]
    assert sample_indices(3, 6) == [0, 0, 1, 1, 2, 2]
    assert sample_indices(100, 1) == [50]
    with pytest.raises(ValueError):
        sample_indices(0, 2)


@pytest.mark.parametrize("h, w, lo, hi, factor, expected", [
    (64, 64, 4 * 784, 128 * 784, 28, (56, 56)),
    (56, 84, 4 * 784, 128 * 784, 28, (56, 84)),        # already multiples inside the budget: unchanged
    (1080, 1920, 4 * 784, 128 * 784, 28, (224, 420)),  # over budget: scaled by 4.5457, rounded down
    (10, 20, 4 * 784, 128 * 784, 28, (56, 84)),        # under the floor: scaled by 3.96, rounded up
    (10, 5000, 784, 16 * 784, 28, (28, 448)),          # side clamped to 28: the long side is cut to fit
    (70, 42, 784, 128 * 784, 28, (56, 56)),            # Python round: 2.5 -> 2, 1.5 -> 2 (as qwen-vl-utils)
    (480, 640, 4 * 784, 256 * 784, 32, (384, 512)),    # factor 32 (Qwen3-VL): scaled by 1.2372, down
])
def test_smart_size(h, w, lo, hi, factor, expected):
    assert smart_size(h, w, lo, hi, factor) == expected


def qwen_rule(h: int, w: int, lo: int, hi: int, f: int = 28) -> tuple[int, int]:
    """qwen-vl-utils' smart_resize (both sides down when over budget, both up when under), for comparison."""
    hh, ww = max(f, round(h / f) * f), max(f, round(w / f) * f)
    if hh * ww > hi:
        beta = math.sqrt(h * w / hi)
        return max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
    if hh * ww < lo:
        beta = math.sqrt(lo / (h * w))
        return math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
    return hh, ww


def test_smart_size_invariants():
    rng = np.random.default_rng(0)
    lo, hi = 4 * 784, 64 * 784
    for _ in range(2000):
        h, w = (int(x) for x in np.exp(rng.uniform(0, 8, 2)))
        hh, ww = smart_size(h, w, lo, hi)
        assert hh % 28 == 0 and ww % 28 == 0 and lo <= hh * ww <= hi, (h, w)
        error = abs(math.log(hh / ww) - math.log(h / w))
        qh, qw = qwen_rule(h, w, lo, hi)
        if lo <= qh * qw <= hi:  # never worse than qwen-vl-utils where its size is valid
            assert error <= abs(math.log(qh / qw) - math.log(h / w)) + 1e-9, (h, w, hh, ww, qh, qw)
        if min(hh, ww) >= 112:
            assert error < 0.25, (h, w, hh, ww)
    assert qwen_rule(87, 22, lo, hi) == (112, 56) and smart_size(87, 22, lo, hi) == (112, 28)
    with pytest.raises(ValueError):
        smart_size(10, 10, 784, 700)


def centroid_x(frame: torch.Tensor) -> float:
    mask = frame.float().sum(0) > 150
    return float(mask.nonzero()[:, 1].float().mean())


def test_decord_and_pyav_agree_on_shipped_clips():
    assert len(CLIPS) == 24
    for clip in CLIPS[::3]:
        (a, fps_a), (b, fps_b) = decode_video(clip, cfg(backend="decord")), decode_video(clip, cfg(backend="pyav"))
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape == (8, 3, 56, 56)
        assert fps_a == fps_b == 2.0
        assert (a.float() - b.float()).abs().mean() < 1.0 and (a.int() - b.int()).abs().max() <= 8


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_decoded_frames_are_the_sampled_ones(backend: str):
    records = [json.loads(line) for line in (TINY / "train.jsonl").read_text().splitlines()]
    rec = next(r for r in records if r["task"] == "motion_direction" and r["solution"][8] in "ABCD"
               and r["options"][ord(r["solution"][8]) - 65].endswith("right"))
    every, fps_all = decode_video(TINY / rec["path"], cfg(backend=backend, fps=4.0))
    half, fps_half = decode_video(TINY / rec["path"], cfg(backend=backend, fps=2.0))
    assert (every.shape[0], fps_all, half.shape[0], fps_half) == (16, 4.0, 8, 2.0)
    assert torch.equal(half, every[1::2])
    xs = [centroid_x(f) for f in every]
    assert all(b > a for a, b in itertools.pairwise(xs)), xs  # moves right: frames are in time order
    small, _ = decode_video(TINY / rec["path"], cfg(backend=backend, max_pixels=2, min_pixels=1, max_frames=4))
    assert small.shape == (4, 3, 28, 28)


def test_auto_falls_back_to_pyav(monkeypatch: pytest.MonkeyPatch):
    expected, _ = decode_video(CLIPS[0], cfg(backend="pyav"))

    def broken(path, _cfg):
        raise MediaError(path, "decord cannot open it (simulated)")

    monkeypatch.setattr(video, "read_decord", broken)
    with pytest.warns(UserWarning, match="simulated.*PyAV instead"):
        frames, fps = decode_video(CLIPS[0], cfg(backend="auto"))
    assert torch.equal(frames, expected) and fps == 2.0
    with pytest.raises(MediaError, match="simulated"):
        decode_video(CLIPS[0], cfg(backend="decord"))

    def missing(path, _cfg):
        raise ImportError("No module named 'decord'")

    monkeypatch.setattr(video, "read_decord", missing)
    assert torch.equal(decode_video(CLIPS[0], cfg(backend="auto"))[0], expected)
    with pytest.raises(ConfigError, match="'video.backend': decord is not installed"):
        decode_video(CLIPS[0], cfg(backend="decord"))


@pytest.mark.parametrize("native, total, duration, expected", [
    (30.0, 60, 2.0, 30.0),             # consistent: the container's rate
    (29.97, 60, 2.0, 29.97),           # close enough: the container's rate
    (1000.0, 60, 2.0, 30.0),           # a rate far from 60 frames in 2 s: the frames over the duration
    (2.0, 60, 2.0, 30.0),
    (0.0, 60, 2.0, 30.0),              # no rate
    (float("nan"), 60, 2.0, 30.0),
    (25.0, 60, float("nan"), 25.0),    # no duration: the rate
    (25.0, 60, 0.0, 25.0),
    (0.0, 60, 0.0, None),              # neither
])
def test_clip_fps_prefers_the_frames_over_the_duration_when_the_rate_disagrees(native, total, duration, expected):
    fps = clip_fps(native, total, duration)
    assert (math.isnan(fps) if expected is None else fps == pytest.approx(expected))


def write_clip_with_a_wrong_rate(path: Path, frames: int, true_fps: int, declared_fps: int) -> Path:
    """A Matroska clip whose frames are 1/true_fps s apart but whose header declares declared_fps (what decord and
    PyAV report as its rate)."""
    import fractions

    av = pytest.importorskip("av")
    with av.open(str(path), "w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=declared_fps)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = fractions.Fraction(1, 1000)
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 2 * i, np.uint8), format="rgb24")
            frame.pts, frame.time_base = i * 1000 // true_fps, fractions.Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_a_container_with_an_absurd_frame_rate_samples_by_its_duration(tmp_path: Path, backend: str):
    """90 frames at 30 fps (3 s) declared as 1000 fps: 6 frames at 2 fps, not 4 frames (min_frames) at 44 fps, which
    would give Qwen2.5-VL temporal positions and Qwen3-VL timestamps 22x too close together."""
    clip = write_clip_with_a_wrong_rate(tmp_path / "wrong_rate.mkv", 90, 30, 1000)
    frames, fps = decode_video(clip, cfg(backend=backend))
    assert frames.shape[0] == 6 and fps == pytest.approx(2.0, rel=0.05)
    assert frames[:, 0, 0, 0].tolist() == pytest.approx([14, 44, 74, 104, 134, 164], abs=6)  # frame i holds 2 i


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_a_longer_audio_track_does_not_stretch_the_video(tmp_path: Path, backend: str):
    """60 frames at 30 fps (2 s) beside 10 s of audio: the container lasts 10 s, the video 2 s (4 frames at 2 fps),
    and its rate is right."""
    import fractions

    av = pytest.importorskip("av")
    clip = tmp_path / "with_audio.mkv"
    with av.open(str(clip), "w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=16000)
        for i in range(60):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.full((64, 64, 3), 2 * i, np.uint8),
                                                                   format="rgb24")))
        container.mux(stream.encode())
        for start in range(0, 10 * 16000, 1024):
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            samples.sample_rate, samples.pts, samples.time_base = 16000, start, fractions.Fraction(1, 16000)
            container.mux(audio.encode(samples))
        container.mux(audio.encode())
    frames, fps = decode_video(clip, cfg(backend=backend))
    assert frames.shape[0] == 4 and fps == 2.0


@pytest.mark.parametrize("backend", ["auto", "decord", "pyav"])
def test_corrupt_and_missing_video(tmp_path: Path, backend: str):
    data = CLIPS[0].read_bytes()
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    for path in (truncated, garbage, tmp_path / "missing.mp4"):
        with pytest.raises(MediaError) as err:
            decode_video(path, cfg(backend=backend))
        assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value) and err.value.path == str(path)
    with pytest.raises(MediaError, match="no such file"):
        decode_video(tmp_path / "missing.mp4", cfg(backend=backend))


def test_bad_video_config():
    with pytest.raises(ConfigError, match="'video.backend'"):
        decode_video(CLIPS[0], cfg(backend="ffmpeg"))
    with pytest.raises(ConfigError, match="'video.min_frames'"):
        decode_video(CLIPS[0], cfg(min_frames=20))
    # 3..3 frames in pairs: min rounds up to 4, max down to 2, so no count satisfies both bounds
    with pytest.raises(ConfigError, match=r"'video.min_frames'.*multiple of video.frame_multiple \(2\)"):
        decode_video(CLIPS[0], cfg(min_frames=3, max_frames=3))
    with pytest.raises(ConfigError, match="'video.max_pixels'"):
        load_image(TINY / "images/count_00.png", cfg(max_pixels=1, size_factor=32))
    with pytest.raises(ConfigError, match="'video.image_min_pixels': must be >= 1"):
        load_image(TINY / "images/count_00.png", cfg(image_min_pixels=0))
    with pytest.raises(ConfigError, match=r"'video.image_max_pixels': must be >= video.image_min_pixels \(300\)"):
        load_image(TINY / "images/count_00.png", cfg(image_min_pixels=300))
    # an image budget below the video floor is valid when image_min_pixels sets its own floor
    assert load_image(TINY / "images/count_00.png", cfg(min_pixels=64, max_pixels=256, image_min_pixels=4,
                                                        image_max_pixels=32)).shape[1:] == (56, 56)


def test_load_image_modes_and_budget(tmp_path: Path):
    rgba = np.zeros((40, 60, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:, :30, 3] = 255  # left half opaque red, right half transparent
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    img = load_image(tmp_path / "rgba.png", cfg(min_pixels=1))
    assert img.shape == (3, 28, 56) and img.dtype == torch.uint8
    assert img[:, :, :20].float().mean(dim=(1, 2)).tolist() == pytest.approx([200, 0, 0], abs=2)
    assert img[:, :, -20:].min() >= 250  # transparent -> white
    Image.fromarray(np.full((56, 56), 90, np.uint8), "L").save(tmp_path / "grey.png")
    assert torch.equal(load_image(tmp_path / "grey.png", CFG), torch.full((3, 56, 56), 90, dtype=torch.uint8))
    Image.fromarray(np.full((56, 56), 40000, np.uint16)).save(tmp_path / "grey16.png")
    assert load_image(tmp_path / "grey16.png", CFG).unique().tolist() == [40000 >> 8]
    Image.fromarray(np.zeros((1000, 500, 3), np.uint8)).save(tmp_path / "big.png")
    big = load_image(tmp_path / "big.png", cfg(image_max_pixels=16))
    assert big.shape == (3, 140, 84) and 140 * 84 <= 16 * 784  # 140x56 is further from 2:1


def test_image_min_pixels_upscales_images_only(tmp_path: Path):
    """A 64x64 image is 56x56 (4 units) by default; with image_min_pixels=16 it is 112x112, frames unchanged."""
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / "small.png")
    assert load_image(tmp_path / "small.png", CFG).shape == (3, 56, 56)
    up = cfg(image_min_pixels=16, max_pixels=4)
    assert load_image(tmp_path / "small.png", up).shape == (3, 112, 112)
    frames, _ = decode_video(CLIPS[0], up)
    assert frames.shape[-2] * frames.shape[-1] <= 4 * 784
    cache = MediaCache()
    assert cache.get_image(tmp_path / "small.png", up).shape != cache.get_image(tmp_path / "small.png", CFG).shape


def test_an_image_too_long_for_the_processor_after_resizing_is_a_media_error(tmp_path: Path):
    """12x9000 fits a 256-unit budget only as 28x7168 (256:1): the Qwen2-VL processors refuse more than 200:1."""
    Image.fromarray(np.zeros((12, 9000, 3), np.uint8)).save(tmp_path / "banner.png")
    with pytest.raises(MediaError, match=r"banner\.png: aspect ratio 256:1 after resizing 12x9000 to 28x7168"):
        load_image(tmp_path / "banner.png", CFG)
    Image.fromarray(np.zeros((12, 4000, 3), np.uint8)).save(tmp_path / "strip.png")
    assert load_image(tmp_path / "strip.png", CFG).shape[1:] == (28, 4004)  # 143:1 is accepted


def test_load_image_exif_orientation(tmp_path: Path):
    im = Image.fromarray(np.zeros((20, 60, 3), np.uint8))
    exif = im.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    im.save(tmp_path / "rot.jpg", exif=exif)
    assert load_image(tmp_path / "rot.jpg", cfg(min_pixels=1)).shape == (3, 56, 28)


def test_load_image_corrupt(tmp_path: Path):
    bad = tmp_path / "bad.png"
    bad.write_bytes((TINY / "images/count_00.png").read_bytes()[:60])
    for path, reason in ((bad, "cannot read the image"), (tmp_path / "none.png", "no such file")):
        with pytest.raises(MediaError, match=reason) as err:
            load_image(path, CFG)
        assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


def test_media_cache_hits_and_failure_memo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    cache = MediaCache()
    a1, fps = cache.get_video(CLIPS[0], CFG)
    a2, _ = cache.get_video(CLIPS[0], CFG)
    assert a1 is a2 and fps == 2.0
    cache.get_video(CLIPS[0], cfg(fps=4.0))  # other settings: decoded again
    img = cache.get_image(TINY / "images/count_00.png", CFG)
    assert img is cache.get_image(TINY / "images/count_00.png", CFG)
    assert cache.stats() == {"hits": 2, "misses": 3, "failures": 0}

    calls = []
    real = video.decode_video

    def counting(path, c):
        calls.append(path)
        return real(path, c)

    monkeypatch.setattr(video, "decode_video", counting)
    missing = tmp_path / "gone.mp4"
    for _ in range(3):
        with pytest.raises(MediaError, match="no such file"):
            cache.get_video(missing, CFG)
    assert len(calls) == 1 and cache.stats() == {"hits": 4, "misses": 4, "failures": 1}
    cache.clear()
    assert cache.stats() == {"hits": 0, "misses": 0, "failures": 0}
    cache.get_video(CLIPS[0], CFG)
    with pytest.raises(MediaError):
        cache.get_video(missing, CFG)
    assert len(calls) == 3  # both decoded again after clear()


def test_shuffle_frames_never_identity():
    g = torch.Generator().manual_seed(0)
    for t in (2, 3, 4, 8):
        frames = torch.arange(t).view(t, 1, 1, 1).expand(t, 3, 2, 2).contiguous()
        seen = set()
        for _ in range(200 if t < 4 else 50):
            out = shuffle_frames(frames, g)
            order = tuple(out[:, 0, 0, 0].tolist())
            assert order != tuple(range(t)) and sorted(order) == list(range(t))
            assert torch.equal(out, frames[list(order)])
            seen.add(order)
        if t == 3:
            assert len(seen) == 5  # every non-identity order of 3 frames turns up
    one = torch.ones(1, 3, 2, 2)
    assert torch.equal(shuffle_frames(one, g), one)
    a = shuffle_frames(torch.arange(8), torch.Generator().manual_seed(1))
    assert torch.equal(a, shuffle_frames(torch.arange(8), torch.Generator().manual_seed(1)))
