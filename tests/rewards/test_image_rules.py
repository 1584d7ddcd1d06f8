"""Image checks and image rule rewards against hand-computed references."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.rewards import RewardBatch, as_rgb_images, as_rgb_videos, build_reward, completions_or_raise


def image_batch(images, meta=None):
    n = images.shape[0]
    return RewardBatch(prompts=["p"] * n, group=torch.zeros(n, dtype=torch.long), images=images, meta=meta or [])


def score(name, images, meta=None, **args):
    return build_reward(name, args)(image_batch(images, meta))


# ---------------------------------------------------------------- checks

def test_rgb_passes_through_and_grayscale_repeats():
    x = torch.rand(2, 3, 5, 4, dtype=torch.float64)
    out = as_rgb_images(x)
    assert out.dtype == torch.float32 and torch.allclose(out, x.float())
    gray = torch.rand(2, 1, 5, 6)
    out = as_rgb_images(gray)
    assert out.shape == (2, 3, 5, 6) and all(torch.equal(out[:, c], gray[:, 0]) for c in range(3))


def test_rgba_is_composited_over_white():
    rgba = torch.tensor([1.0, 0.0, 0.2, 0.5]).view(1, 4, 1, 1).repeat(1, 1, 2, 2)
    rgba[0, 3, 0, 0] = 0.0  # transparent -> white
    rgba[0, 3, 1, 1] = 1.0  # opaque -> the colour itself
    out = as_rgb_images(rgba)
    assert out[0, :, 0, 0].tolist() == [1.0, 1.0, 1.0]
    assert out[0, :, 1, 1].tolist() == pytest.approx([1.0, 0.0, 0.2])
    assert out[0, :, 0, 1].tolist() == pytest.approx([1.0, 0.5, 0.6])  # rgb * 0.5 + 0.5


@pytest.mark.parametrize("shape", [(3, 4, 4), (2, 2, 4, 4), (2, 8, 8, 3), (1, 2, 3, 4, 4)])
def test_bad_image_shapes_name_the_shape(shape):
    with pytest.raises(ValueError, match=rf"got shape \({', '.join(map(str, shape))}\)"):
        as_rgb_images(torch.zeros(shape))


@pytest.mark.parametrize("shape", [(2, 4, 4, 3), (2, 1, 8, 3), (1, 4, 6, 4), (2, 1, 3, 1)])
def test_ambiguous_channels_last_images_are_refused(shape):
    """(2, 4, 4, 3) is 4x4 RGB stored channels-last, not 4x3 RGBA: shapes that read both ways with 1 or 4 channels
    are refused, and the message gives the expected layout and the fix."""
    with pytest.raises(ValueError, match=rf"^reward 'sharpness': images of shape \({', '.join(map(str, shape))}\) "
                                         r"are ambiguous: expected \(B, 3, H, W\) .*\.permute\(0, 3, 1, 2\)$"):
        score("sharpness", torch.rand(shape))


def test_channels_last_hint_and_small_rgb_images():
    with pytest.raises(ValueError, match=r"got shape \(2, 8, 8, 3\); it looks channels-last \(B, H, W, C\)"):
        as_rgb_images(torch.rand(2, 8, 8, 3))
    with pytest.raises(ValueError, match=r"videos of shape \(1, 2, 4, 5, 3\) are ambiguous: expected "
                                         r"\(B, T, 3, H, W\) .*\.permute\(0, 1, 4, 2, 3\)"):
        as_rgb_videos(torch.rand(1, 2, 4, 5, 3))
    small = torch.rand(2, 3, 4, 4)  # reads both ways, and is the documented RGB layout: accepted as such
    assert torch.equal(as_rgb_images(small), small)
    assert as_rgb_images(torch.rand(1, 4, 3, 2)).shape == (1, 3, 3, 2)  # RGBA 2 px wide is not ambiguous


@pytest.mark.parametrize("name", ["sharpness", "jpeg_compressibility", "color_fraction"])
def test_empty_image_batches_are_one_clear_line(name):
    args = {"rgb": [255, 0, 0]} if name == "color_fraction" else {}
    with pytest.raises(ValueError, match=rf"^reward '{name}': images are empty: got shape \(0, 3, 8, 8\)"):
        score(name, torch.zeros(0, 3, 8, 8), **args)
    with pytest.raises(ValueError, match=r"^videos are empty: got shape \(1, 0, 3, 8, 8\)"):
        as_rgb_videos(torch.zeros(1, 0, 3, 8, 8))


def test_range_errors_say_what_was_passed():
    x = torch.zeros(1, 3, 2, 2)
    x[0, 0, 0, 0], x[0, 1, 0, 0] = -0.5, 1.2
    with pytest.raises(ValueError, match=r"images must be in \[0, 1\]; got min -0.5 max 1.2 — did you pass \[-1, 1\]"):
        as_rgb_images(x)
    with pytest.raises(ValueError, match=r"got min 0 max 255 — did you pass \[0, 255\]"):
        as_rgb_images(torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 1, 2).repeat(1, 3, 1, 1))
    with pytest.raises(ValueError, match="NaN or inf"):
        as_rgb_images(torch.full((1, 3, 2, 2), float("nan")))
    with pytest.raises(ValueError, match=r"did you pass \[-1, 1\]"):  # through a reward, too
        score("sharpness", torch.full((1, 3, 4, 4), -1.0))


def test_tiny_overshoot_is_clamped():
    x = torch.tensor([-5e-4, 1.0 + 5e-4]).view(1, 1, 1, 2).repeat(1, 3, 1, 1)
    assert as_rgb_images(x)[0, 0, 0].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="max 1.002"):
        as_rgb_images(x + 2e-3)


def test_videos():
    gray = torch.rand(2, 5, 1, 4, 6)
    out = as_rgb_videos(gray)
    assert out.shape == (2, 5, 3, 4, 6) and torch.equal(out[:, :, 2], gray[:, :, 0])
    with pytest.raises(ValueError, match=r"videos must be \(B, T, 3, H, W\).*got shape \(2, 3, 4, 4\)"):
        as_rgb_videos(torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError, match="videos must be in"):
        as_rgb_videos(torch.full((1, 2, 3, 4, 4), 2.0))


def test_image_rewards_reject_text_batches_and_text_rewards_image_batches():
    text = RewardBatch(prompts=["p"], group=torch.zeros(1, dtype=torch.long), completions=["c"])
    with pytest.raises(ValueError, match="reward 'jpeg_compressibility' needs images"):
        build_reward("jpeg_compressibility")(text)
    with pytest.raises(ValueError, match="reward 'x' needs text completions"):
        completions_or_raise(image_batch(torch.zeros(1, 3, 4, 4)), "x")


# ---------------------------------------------------------------- JPEG

def reference_kb(array_hwc_uint8, quality=95):
    buffer = io.BytesIO()
    Image.fromarray(array_hwc_uint8).save(buffer, format="JPEG", quality=quality)
    return len(buffer.getvalue()) / 1000


def test_jpeg_size_matches_pil_encoding_in_kb():
    rng = np.random.default_rng(0)
    arrays = [np.full((32, 48, 3), 128, np.uint8), rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)]
    images = torch.stack([torch.from_numpy(a).permute(2, 0, 1).float() / 255 for a in arrays])
    expected = [reference_kb(a) for a in arrays]
    assert score("jpeg_incompressibility", images).tolist() == pytest.approx(expected)
    assert score("jpeg_compressibility", images).tolist() == pytest.approx([-e for e in expected])
    assert expected[0] < expected[1]  # flat compresses better than noise
    q10 = score("jpeg_incompressibility", images, quality=10)
    assert q10[1] < expected[1]
    with pytest.raises(ValueError, match="quality must be in"):
        build_reward("jpeg_compressibility", {"quality": 0})


def test_jpeg_batched_equals_one_at_a_time_and_accepts_grayscale():
    images = torch.rand(4, 3, 16, 16)
    reward = build_reward("jpeg_compressibility")
    batch = image_batch(images)
    whole = reward(batch)
    single = torch.cat([reward(batch.select([i])) for i in range(4)])
    assert torch.equal(whole, single)
    gray = torch.rand(2, 1, 16, 16)
    assert torch.equal(reward(image_batch(gray)), reward(image_batch(gray.repeat(1, 3, 1, 1))))


def test_jpeg_is_encoded_in_memory(no_file_writes):
    reward = build_reward("jpeg_incompressibility")
    batch = image_batch(torch.rand(2, 3, 16, 16))
    with no_file_writes as writes:
        reward(batch)
    assert writes == []


# ---------------------------------------------------------------- sharpness

def test_sharpness_closed_forms():
    h = w = 8
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    checker = ((yy + xx) % 2).float().expand(3, h, w)  # Laplacian +-4 everywhere: variance 16
    stripes = (xx % 2).float().expand(3, h, w)  # vertical neighbours agree: Laplacian +-2, variance 4
    flat = torch.full((3, h, w), 0.3)
    red = torch.zeros(3, h, w)
    red[0] = 1.0  # constant colour: 0
    images = torch.stack([checker, stripes, flat, red])
    assert score("sharpness", images).tolist() == pytest.approx([16.0, 4.0, 0.0, 0.0], abs=1e-5)
    assert score("sharpness", images, saturate_at=8.0).tolist() == pytest.approx([1.0, 0.5, 0.0, 0.0], abs=1e-6)


def test_sharpness_drops_with_blur_and_checks_inputs():
    sharp = (torch.rand(1, 1, 32, 32) > 0.5).float()
    blurred = torch.nn.functional.avg_pool2d(sharp, 3, stride=1, padding=1)
    out = score("sharpness", torch.cat([sharp, blurred]))
    assert out[1] < out[0] / 4
    with pytest.raises(ValueError, match="at least 3x3"):
        score("sharpness", torch.zeros(1, 3, 2, 8))
    with pytest.raises(ValueError, match="saturate_at must be > 0"):
        build_reward("sharpness", {"saturate_at": 0})


# ---------------------------------------------------------------- color fraction

def test_color_fraction_counts_pixels_within_tolerance():
    image = torch.zeros(1, 3, 4, 4)  # black
    image[0, 0, 0, :] = 1.0  # 4 pure red pixels
    image[0, 0, 1, :2] = 0.9  # 2 pixels at distance 0.1: counted
    image[0, 0, 1, 2:] = 0.7  # 2 pixels at distance 0.3: not counted
    assert score("color_fraction", image, rgb=[255, 0, 0]).tolist() == [6 / 16]
    assert score("color_fraction", image, rgb=[255, 0, 0], tolerance=0.35).tolist() == [8 / 16]
    assert score("color_fraction", image, rgb=[0, 0, 0]).tolist() == [8 / 16]


def test_color_fraction_target_per_sample():
    images = torch.zeros(2, 3, 2, 2)
    images[:, 2] = 1.0  # all blue
    meta = [{"target_rgb": [0, 0, 255]}, {}]
    assert score("color_fraction", images, meta, rgb=[255, 0, 0]).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="sample 1 has no meta\\['target_rgb'\\]"):
        score("color_fraction", images, meta)
    with pytest.raises(ValueError, match="three values in 0..255"):
        build_reward("color_fraction", {"rgb": [1.0, 0.5]})
    with pytest.raises(ValueError, match="tolerance must be > 0"):
        build_reward("color_fraction", {"rgb": [1, 2, 3], "tolerance": 0})
