"""Image checks and image rule rewards against hand-computed references."""

import io

import matplotlib.cbook
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision.transforms.functional import gaussian_blur

from mmgrpo.rewards import RewardBatch, as_rgb_images, as_rgb_videos, build_reward, completions_or_raise
from mmgrpo.rewards.image_rules import (
    CHUNK_ROWS,
    detail_map,
    in_chunks,
    panel_shifts,
    repetition_evidence,
    shift_similarities,
)


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


@pytest.mark.parametrize("name", ["sharpness", "jpeg_compressibility", "color_fraction", "grid_seams",
                                  "tile_repetition"])
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


@pytest.mark.parametrize("quality", [95.5, "95", True, 0, 101])
def test_jpeg_quality_that_is_not_a_whole_number_in_1_100_is_refused_at_construction(quality):
    """quality 95.5 or "95" failed only when scoring, with PIL's 'Invalid quality setting' or a TypeError naming
    no reward; True encoded at quality 1."""
    with pytest.raises(ValueError, match=r"^jpeg_compressibility: quality must be a whole number in \[1, 100\]"):
        build_reward("jpeg_compressibility", {"quality": quality})


def test_jpeg_quality_given_as_a_whole_float_is_that_quality():
    image = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(score("jpeg_incompressibility", image, quality=80.0),
                       score("jpeg_incompressibility", image, quality=80))


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
    with pytest.raises(ValueError, match="quality must be a whole number in"):
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


def test_in_chunks_equals_one_call_on_the_whole_batch():
    pixels = torch.rand(9, 3, 5, 5, dtype=torch.float64)
    whole = pixels.flatten(1).sum(1)
    for rows in (1, 2, 4, 9, 100):
        torch.testing.assert_close(in_chunks(lambda chunk: chunk.flatten(1).sum(1), pixels, rows), whole)


@pytest.mark.parametrize("name", ["sharpness", "grid_seams", "tile_repetition"])
def test_per_pixel_rules_score_each_image_alone(name):
    """They score CHUNK_ROWS images at a time: a batch that is not a multiple of it gives every image the score it
    gets alone. Every other image is a 2x2 tiling (seams and copies, so both detectors score well above 0)."""
    g = torch.Generator().manual_seed(0)
    smooth = F.interpolate(torch.rand(9, 3, 8, 8, generator=g), size=(32, 32), mode="bilinear")
    tiled = smooth.repeat(1, 1, 2, 2)
    plain = F.interpolate(smooth, size=(64, 64), mode="bilinear")
    images = torch.where(torch.arange(9)[:, None, None, None] % 2 == 1, tiled, plain).clamp(0, 1)
    assert len(images) % CHUNK_ROWS != 0
    reward = build_reward(name)
    batch = image_batch(images)
    whole = reward(batch)
    single = torch.cat([reward(batch.select([i])) for i in range(len(images))])
    torch.testing.assert_close(whole, single, rtol=1e-6, atol=1e-9)
    assert whole[1::2].min() > 0.3 or name == "sharpness"
    assert whole.std() > 0


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
    image[0, :2, 2, :2] = torch.tensor([0.85, 0.15])[:, None]  # 2 pixels 0.15 off in two channels: 0.212 away
    assert score("color_fraction", image, rgb=[255, 0, 0]).tolist() == [6 / 16]
    assert score("color_fraction", image, rgb=[255, 0, 0], tolerance=0.35).tolist() == [10 / 16]
    assert score("color_fraction", image, rgb=[0, 0, 0]).tolist() == [6 / 16]


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


@pytest.mark.parametrize("value", ["red", None, {"r": 255}, ["255", 0, 0]])
def test_color_fraction_target_that_is_not_numbers_is_a_clear_error(value):
    """A target_rgb that is not three numbers (a colour name from a dataset, None) is the one-line ValueError of
    a wrong target, naming the sample, not a TypeError from torch ('new(): invalid data type 'str'')."""
    images = torch.zeros(1, 3, 2, 2)
    with pytest.raises(ValueError, match=r"meta\['target_rgb'\] of sample 0 must be three values in 0..255"):
        score("color_fraction", images, [{"target_rgb": value}])
    if value is not None:  # rgb: None means "from meta"
        with pytest.raises(ValueError, match="color_fraction: rgb must be three values in 0..255"):
            build_reward("color_fraction", {"rgb": value})


# ---------------------------------------------------------------- grid_seams

@pytest.mark.parametrize("step_width", [1, 3])
def test_grid_seams_counts_a_seam_split_over_two_tied_boundaries(step_width):
    """Black | one mid-grey column | white, at W/2: the boundaries either side of the grey column carry equal
    steps (0.5 each at width 1, 5/6 at width 3), so both are local maxima and the seam scores 1, as the docstring
    says ties are; it scored 0 (a tie counted as a maximum on neither side)."""
    row = torch.zeros(32)
    row[16], row[17:] = 0.5, 1.0
    image = row.view(1, 1, 1, 32).expand(1, 3, 32, 32)
    assert score("grid_seams", image, step_width=step_width).tolist() == [1.0]
    assert score("grid_seams", image.transpose(2, 3), step_width=step_width).tolist() == [1.0]


def test_grid_seams_closed_forms():
    """One step edge at x = W/2 is a 1x2 grid seam in every row and nowhere else: evidence 1. An edge at W/3
    alone is no equal-panel grid (3 panels need a second seam at 2W/3): 0. Stripes at W/3 and 2W/3: 1."""
    half = torch.zeros(1, 3, 48, 48)
    half[..., 24:] = 1.0
    third = torch.zeros(1, 3, 48, 48)
    third[..., 16:] = 1.0
    stripes = torch.zeros(1, 3, 48, 48)
    stripes[..., 16:32] = 1.0
    images = torch.cat([half, third, stripes, half.transpose(2, 3), torch.full((1, 3, 48, 48), 0.5)])
    assert score("grid_seams", images).tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert score("grid_seams", images, step_width=1).tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert score("grid_seams", third, max_panels=3).tolist() == [0.0]
    # an edge covering the top half of the rows only: its column's coverage is 0.5
    partial = torch.zeros(1, 3, 48, 48)
    partial[..., :24, 24:] = 1.0
    assert score("grid_seams", partial).tolist() == [0.5]


def photo(size: int) -> torch.Tensor:
    """(1, 3, size, size) in [0, 1]: the Grace Hopper portrait that matplotlib ships as sample data."""
    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as file:
        pixels = np.asarray(Image.open(file).convert("RGB"), dtype=np.float32) / 255
    return F.interpolate(torch.from_numpy(pixels).permute(2, 0, 1)[None], size=(size, size), mode="area")


def test_grid_seams_tells_a_tiled_photo_from_the_photo():
    """A real photo has edges, but none that runs its whole height at a panel position; tiling it 2x2 or 3x3 (the
    grid hack) does, with sharp seams, seams blurred as by a VAE decode, or white gutters."""
    whole = photo(256)
    grid2 = photo(128).repeat(1, 1, 2, 2)
    grid3 = photo(85).repeat(1, 1, 3, 3)
    gutters = grid2.clone()
    gutters[..., 126:130, :] = 1.0
    gutters[..., :, 126:130] = 1.0
    soft = gaussian_blur(grid2, kernel_size=13, sigma=2.0)
    noise = torch.rand(1, 3, 256, 256, generator=torch.Generator().manual_seed(0))
    grid3 = F.pad(grid3, (0, 1, 0, 1), mode="replicate")  # 255 -> 256 px
    photo_score, grid2_score, grid3_score, gutter_score, soft_score, noise_score = score(
        "grid_seams", torch.cat([whole, grid2, grid3, gutters, soft, noise])).tolist()
    assert photo_score < 0.15 and noise_score < 0.15
    assert min(grid2_score, grid3_score, gutter_score) > 0.65 and soft_score > 0.45


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 31), st.integers(0, 31), st.integers(1, 32), st.integers(1, 32),
                          st.integers(0, 4)), min_size=1, max_size=6),
       st.integers(1, 4))
def test_grid_seams_is_invariant_to_flips_transposition_and_inversion(rectangles, panels):
    """Rectangles of levels k/4 (exact in binary, so every sum is exact): mirroring, transposing or inverting the
    image changes no step, so the evidence stays the same to the bit."""
    image = torch.zeros(1, 3, 32, 32)
    for top, left, height, width, level in rectangles:
        image[..., top:top + height, left:left + width] = level / 4
    image = image.repeat(1, 1, panels, panels)  # a grid of panels x panels copies
    variants = torch.cat([image, image.flip(3), image.flip(2), image.transpose(2, 3), 1 - image])
    scores = score("grid_seams", variants).tolist()
    assert scores == [scores[0]] * 5


def test_grid_seams_checks_its_inputs():
    with pytest.raises(ValueError, match=r"^grid_seams: images must be at least 8x8 pixels for max_panels=4; "
                                         r"got shape \(1, 3, 6, 40\)$"):
        score("grid_seams", torch.rand(1, 3, 6, 40))
    with pytest.raises(ValueError, match="max_panels must be >= 2"):
        build_reward("grid_seams", {"max_panels": 1})
    with pytest.raises(ValueError, match=r"edge_threshold must be in \(0, 1\)"):
        build_reward("grid_seams", {"edge_threshold": 0})
    with pytest.raises(ValueError, match=r"tolerance must be in \[0, 0.25\)"):
        build_reward("grid_seams", {"tolerance": 0.3})
    with pytest.raises(ValueError, match="step_width must be >= 1 pixel"):
        build_reward("grid_seams", {"step_width": 0})


# ---------------------------------------------------------------- tile_repetition

def test_detail_map_removes_shading():
    """A pixel minus its box mean: 0 on a flat image and inside a linear ramp (the box mean of a linear function
    is its centre value); the mean comes off each pixel, as a direct 5x5 average at one pixel shows."""
    ramp = torch.arange(20, dtype=torch.float64).view(1, 1, 20).expand(1, 16, 20) / 20
    assert detail_map(ramp, 5)[:, 2:-2, 2:-2].abs().max() < 1e-15
    assert detail_map(torch.full((1, 8, 8), 0.3, dtype=torch.float64), 3).abs().max() < 1e-15
    x = torch.rand(1, 12, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert detail_map(x, 5)[0, 6, 7].item() == pytest.approx(x[0, 6, 7].item() - x[0, 4:9, 5:10].mean().item())


def test_shift_similarities_are_the_cosines_of_the_overlaps():
    """Every shift against a direct cosine of the overlapping columns; a flat image gives 0, not NaN; two copies
    side by side match exactly at half the width."""
    x = torch.randn(3, 10, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[2] = 0.0
    got = shift_similarities(x)
    assert got.shape == (3, 29)
    for shift in (1, 7, 15, 29):
        direct = F.cosine_similarity(x[:2, :, :-shift].flatten(1), x[:2, :, shift:].flatten(1), dim=1)
        assert torch.allclose(got[:2, shift - 1], direct, atol=1e-12), shift
    assert got[2].abs().max().item() == 0.0
    tiled = x[:1, :, :15].repeat(1, 1, 2)
    assert shift_similarities(tiled)[0, 14].item() == pytest.approx(1.0, abs=1e-12)


def test_panel_shifts_by_hand():
    """64 px, 2 panels, 1 px slack: panel offset 32, so 31..33 are on-panel; off-panel shifts lie more than 2 px
    from 32 and within [8, 56]."""
    on_panel, off_panel = panel_shifts(64, max_panels=2, tolerance=0.0)
    assert on_panel == [31, 32, 33]
    assert off_panel == [*range(8, 30), *range(35, 57)]
    on_panel, _ = panel_shifts(300, max_panels=3, tolerance=0.01)  # offsets 100, 150, 200; slack 3 px
    assert on_panel == [*range(97, 104), *range(147, 154), *range(197, 204)]


def test_repetition_evidence_closed_forms():
    """Two exact copies of noise side by side match at W/2 exactly; the evidence is 1 minus the best off-panel
    match, which for noise is small. A flat image matches nowhere: 0."""
    noise = torch.randn(1, 32, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tiled = noise[..., :32].repeat(1, 1, 2)
    _, off_panel = panel_shifts(64, 4, 0.02)
    off = max(shift_similarities(tiled)[0, s - 1].item() for s in off_panel)
    assert repetition_evidence(tiled, 4, 0.02).item() == pytest.approx(1.0 - off, abs=1e-12) and off < 0.2
    assert repetition_evidence(torch.zeros(1, 32, 64, dtype=torch.float64), 4, 0.02).item() == 0.0


def test_tile_repetition_tells_a_tiling_from_photos_textures_and_collages():
    """Copies of the photo, 2x2, 3x3, blurred or with pixel noise, repeat at their panel width; the photo, noise,
    a mirrored diptych and a collage of four different panels do not; a checkerboard and stripes repeat at every
    shift alike, so they are texture, not tiling."""
    whole, half = photo(256), photo(128)
    grid2 = half.repeat(1, 1, 2, 2)
    grid3 = F.pad(photo(85).repeat(1, 1, 3, 3), (0, 1, 0, 1), mode="replicate")
    soft = gaussian_blur(grid2, kernel_size=13, sigma=2.0)
    grainy = (grid2 + 0.05 * torch.randn(grid2.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    noise = torch.rand(1, 3, 256, 256, generator=torch.Generator().manual_seed(0))
    mirror = torch.cat([whole[..., :128], whole[..., :128].flip(3)], -1)
    collage = torch.cat([torch.cat([half, half.flip(3)], -1), torch.cat([half.transpose(2, 3), 1 - half], -1)], -2)
    x = torch.arange(256.0)
    checker = ((x[:, None] // 16 + x[None] // 16) % 2).expand(1, 3, 256, 256)
    stripes = (0.5 + 0.5 * torch.sin(2 * torch.pi * x / 10)).expand(1, 3, 256, 256)
    tilings = score("tile_repetition", torch.cat([grid2, grid3, soft, grainy])).tolist()
    others = score("tile_repetition", torch.cat([whole, noise, mirror, collage, checker, stripes])).tolist()
    assert min(tilings) > 0.75, tilings
    assert max(others) < 0.15, others
    wide = half.repeat(1, 1, 1, 3)  # 1 x 3 copies, 128 x 384
    large = F.interpolate(grid2, size=(1024, 1024), mode="bilinear")  # shrunk to 256 before comparing
    assert min(score("tile_repetition", wide).item(), score("tile_repetition", large).item()) > 0.75


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.floats(-0.2, 0.2))
def test_tile_repetition_is_invariant_to_flips_transposition_inversion_and_brightness(seed, panels, offset):
    """Mirroring moves the overlaps but keeps their sums, transposing swaps the axes, inverting negates the
    detail on both sides of every product, and a brightness offset leaves the detail as it is (up to the float32
    rounding of the inputs, which the image checks cast to)."""
    tile = torch.rand(1, 3, 96 // panels, 96 // panels, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(seed)) * 0.6 + 0.2
    image = gaussian_blur(tile.repeat(1, 1, panels, panels), kernel_size=5, sigma=1.0)
    variants = torch.cat([image, image.flip(3), image.flip(2), image.transpose(2, 3), 1 - image, image + offset])
    scores = score("tile_repetition", variants).tolist()
    assert scores == pytest.approx([scores[0]] * 6, abs=1e-6)


def test_tile_repetition_checks_its_inputs():
    with pytest.raises(ValueError, match=r"^tile_repetition: images of shape \(1, 3, 20, 64\) \(compared at "
                                         r"20x64\) are too small for max_panels=4: no shift is left"):
        score("tile_repetition", torch.rand(1, 3, 20, 64))
    with pytest.raises(ValueError, match="max_panels must be >= 2"):
        build_reward("tile_repetition", {"max_panels": 1})
    with pytest.raises(ValueError, match=r"tolerance must be in \[0, 0.05\)"):
        build_reward("tile_repetition", {"tolerance": 0.1})
    with pytest.raises(ValueError, match="detail_width must be >= 3 pixels"):
        build_reward("tile_repetition", {"detail_width": 1})
    with pytest.raises(ValueError, match="max_side must be >= 32 pixels"):
        build_reward("tile_repetition", {"max_side": 16})


@settings(max_examples=25, deadline=None)
@given(st.integers(6, 16), st.integers(2, 4), st.floats(0.0, 1.0))
def test_tile_repetition_stays_in_0_1_on_stripes(period, panels, phase):
    """Stripes whose period is a panel width match at the panel offsets (1) and anti-match at every off-panel
    shift (-0.7 for period 8 at 32 px): an anti-match is no evidence, so the score stays at most 1, as documented
    (it reached 1.54 there)."""
    width = max(32, period * panels)
    x = 0.5 + 0.5 * torch.cos(2 * torch.pi * (torch.arange(width) / period + phase))
    stripes = x.view(1, 1, 1, width).expand(1, 3, width, width).contiguous()
    value = score("tile_repetition", stripes).item()
    assert 0.0 <= value <= 1.0, value


def test_tile_repetition_of_period_8_stripes_at_32_px_is_at_most_1():
    x = 0.5 + 0.5 * torch.cos(2 * torch.pi * torch.arange(32) / 8)
    value = score("tile_repetition", x.view(1, 1, 1, 32).expand(1, 3, 32, 32).contiguous()).item()
    assert 0.9 < value <= 1.0, value  # matches at 8 px (edges of the detail map aside) and nowhere else
