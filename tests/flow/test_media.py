"""Sample files: captioned grids, tiled videos, mp4 with a GIF fallback."""

import sys

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.pipelines.flow import media


def test_to_uint8_rounds_clamps_and_moves_channels_last():
    x = torch.tensor([0.0, 0.5, 1.2, -0.1]).view(1, 1, 4).expand(3, 1, 4)
    out = media.to_uint8(x)
    assert out.shape == (1, 4, 3) and out.dtype == np.uint8
    assert out[0, :, 0].tolist() == [0, 128, 255, 0]


def test_image_grid_upscales_small_tiles_and_adds_captions():
    images = torch.zeros(4, 3, 16, 16)
    images[1, 0] = 1.0  # the second image is red
    grid = media.image_grid(images, ["a", "b", "c", "d"])
    strip = 4 + 11 * media.CAPTION_LINES
    assert grid.size == (2 * 128, 2 * (128 + strip))
    assert grid.getpixel((128 + 64, 64)) == (255, 0, 0) and grid.getpixel((64, 64)) == (0, 0, 0)
    caption = np.asarray(grid.crop((0, 128, 128, 128 + strip)))
    assert caption.max() > 200  # light caption text on the dark strip
    assert media.image_grid(images).size == (256, 256)  # no captions, no strips


def test_frames_grid_has_one_row_per_video_and_evenly_spaced_frames():
    level = torch.arange(9.0) / 8  # frame t of video 0 has grey level t / 8, video 1 half that
    videos = (level.view(1, 9, 1, 1, 1) * torch.tensor([1.0, 0.5]).view(2, 1, 1, 1, 1)).expand(2, 9, 3, 8, 8)
    grid = media.frames_grid(videos, ["first", "second"], max_frames=3)
    strip = 4 + 11 * media.CAPTION_LINES
    assert grid.size == (3 * 128, 2 * (128 + strip))
    # frames 0, 4 and 8 of 9: levels 0, 1/2, 1 in the first row and 0, 1/4, 1/2 in the second
    tiles = [[grid.getpixel((c * 128 + 64, r * (128 + strip) + 64))[0] for c in range(3)] for r in range(2)]
    assert tiles == [[0, 128, 255], [0, 64, 128]]


def test_tile_videos_places_samples_and_pads_to_even_sizes():
    videos = torch.zeros(3, 2, 3, 5, 7)
    videos[2, :, 1] = 1.0  # the third video is green
    frames = media.tile_videos(videos)
    assert frames.shape == (2, 10, 14, 3)  # 2 x 2 tiles of 5 x 7
    assert frames[0, 5:10, 0:7, 1].min() == 255 and frames[0, 0:5, 0:7].max() == 0


def test_write_video_mp4_round_trips(tmp_path):
    import imageio.v3 as iio

    frames = np.zeros((6, 16, 16, 3), dtype=np.uint8)
    frames[3:] = 200
    path = media.write_video(frames, tmp_path / "v.mp4", fps=4)
    assert path.suffix == ".mp4"
    back = iio.imread(path, plugin="pyav")
    assert back.shape == (6, 16, 16, 3)
    assert abs(int(back[0].mean())) < 10 and abs(int(back[5].mean()) - 200) < 10


def test_write_video_falls_back_to_gif_without_imageio(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio.v3", None)  # importing it now raises ImportError
    frames = np.zeros((4, 8, 8, 3), dtype=np.uint8)
    frames[:, :, :, 2] = np.arange(4)[:, None, None] * 60
    path = media.write_video(frames, tmp_path / "v.mp4", fps=4)
    assert path == tmp_path / "v.gif"
    with Image.open(path) as gif:
        assert gif.n_frames == 4


def test_write_video_falls_back_to_gif_when_pyav_lacks_the_encoder(tmp_path):
    """A PyAV build without the codec (libx264 is missing from some) writes a GIF instead of failing."""
    assert media.can_encode("libx264") and not media.can_encode("no-such-encoder")
    frames = np.zeros((3, 8, 8, 3), dtype=np.uint8)
    frames[:, :, :, 0] = np.arange(3)[:, None, None] * 80
    path = media.write_video(frames, tmp_path / "v.mp4", fps=4, codec="no-such-encoder")
    assert path == tmp_path / "v.gif" and not (tmp_path / "v.mp4").exists()
    with Image.open(path) as gif:
        assert gif.n_frames == 3


def test_save_media(tmp_path):
    files = media.save_media(tmp_path / "s", "step-1", ["x", "y"], images=torch.rand(2, 3, 8, 8))
    assert [f.name for f in files] == ["step-1.png"]
    files = media.save_media(tmp_path / "s", "vid", ["x"], videos=torch.rand(1, 4, 3, 8, 8), fps=8)
    assert [f.name for f in files] == ["vid.png", "vid.mp4"]
    with pytest.raises(ValueError, match="images or videos"):
        media.save_media(tmp_path, "none", ["x"])
