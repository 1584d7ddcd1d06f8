"""What ``mmgrpo sample`` writes: next to the grid (or the VLM's markdown), a folder named after the same tag with
each sample as its own file and an ``index.json`` that says which prompt, seed and sample each file holds."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from random_flow import RANDOM_TINY_SD3

from mmgrpo.cli import main
from mmgrpo.pipelines.flow import media

ROOT = Path(__file__).resolve().parents[2]
FAST_FLOW = ["sampling.eval_num_steps=2", "num_threads=1", "logging.progress=false"]

pytestmark = pytest.mark.usefixtures("one_thread")


def index_of(folder: Path) -> list[dict]:
    index = json.loads((folder / "index.json").read_text())
    assert index["tag"] == folder.name
    return index["samples"]


def grid_tile(grid: Image.Image, i: int, n: int, size: tuple[int, int]) -> Image.Image:
    """Tile ``i`` of an n-sample captioned grid of ``size`` images, scaled back to ``size``."""
    factor = max(1, math.ceil(media.MIN_TILE / min(size)))
    w, h = size[0] * factor, size[1] * factor
    columns = math.ceil(math.sqrt(n))
    x, y = (i % columns) * w, (i // columns) * (h + 4 + 11 * media.CAPTION_LINES)
    return grid.crop((x, y, x + w, y + h)).resize(size, Image.NEAREST)


def test_flow_sample_writes_each_image_and_an_index(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the prompt files are relative to the repository root
    preset = str(ROOT / "configs" / "flow" / "tiny_flowgrpo.yaml")
    args = [preset, *RANDOM_TINY_SD3, *FAST_FLOW, f"output_dir={tmp_path}"]
    assert main(["sample", *args, "--num", "3"]) == 0
    samples = tmp_path / "samples"
    folder = samples / "sample-base"
    records = index_of(folder)
    assert sorted(p.name for p in folder.glob("*.png")) == [r["file"] for r in records]
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [(0, 0), (1, 0), (2, 0)]
    eval_prompts = [json.loads(line)["prompt"] for line in (ROOT / "configs/flow/prompts/colors_eval.jsonl")
                    .read_text().splitlines() if line.strip()]
    assert [r["prompt"] for r in records] == eval_prompts[:3]
    assert all(isinstance(r["seed"], int) for r in records) and len({r["seed"] for r in records}) == 3
    with Image.open(samples / "sample-base.png") as grid:
        grid = grid.convert("RGB")
        for i, r in enumerate(records):
            with Image.open(folder / r["file"]) as image:
                assert image.size == (32, 32) and image.mode == "RGB"
                assert np.array_equal(np.asarray(image), np.asarray(grid_tile(grid, i, 3, (32, 32))))

    # a second call gets its own tag and folder; a prompt's sample is seeded by it, not by the batch
    assert main(["sample", *args, "--prompt", records[1]["prompt"]]) == 0
    (again,) = index_of(samples / "sample-base-2")
    assert again["seed"] == records[1]["seed"] and (again["prompt_index"], again["sample_index"]) == (0, 0)
    with Image.open(samples / "sample-base-2" / again["file"]) as a, Image.open(folder / records[1]["file"]) as b:
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_video_sample_writes_each_clip(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    preset = str(ROOT / "configs" / "flow" / "tiny_flowgrpo.yaml")
    args = [preset, *RANDOM_TINY_SD3, *FAST_FLOW, "model.type=wan", "model.path=tiny:wan", "sampling.num_frames=5",
            f"output_dir={tmp_path}"]
    assert main(["sample", *args, "--num", "2"]) == 0
    folder = tmp_path / "samples" / "sample-base"
    records = index_of(folder)
    suffix = ".mp4" if media.can_encode("libx264") else ".gif"
    assert len(records) == 2 and sorted(p.name for p in folder.glob(f"*{suffix}")) == [r["file"] for r in records]
    for r in records:
        if suffix == ".mp4":
            import imageio.v3 as iio

            frames = iio.imread(folder / r["file"], plugin="pyav")
        else:
            with Image.open(folder / r["file"]) as gif:
                frames = np.stack([np.asarray(gif.seek(t) or gif.convert("RGB")) for t in range(gif.n_frames)])
        assert frames.shape == (5, 32, 32, 3)


def test_vlm_sample_writes_an_index_with_completions_and_rewards(tmp_path):
    preset = str(ROOT / "configs" / "vlm" / "tiny_image.yaml")
    args = [preset, f"data.train_file={ROOT}/assets/data/shapes_qa/train.jsonl",
            f"data.eval_file={ROOT}/assets/data/shapes_qa/heldout.jsonl", f"data.root={ROOT}/assets/data/shapes_qa",
            f"model.path={ROOT}/assets/tiny-qwen2vl-shapes", "generation.max_new_tokens=8", "data.num_eval=2",
            f"output_dir={tmp_path}"]
    assert main(["sample", *args, "--num", "2"]) == 0
    samples = tmp_path / "samples"
    records = index_of(samples / "sample-base")
    markdown = (samples / "sample-base.md").read_text()
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [(0, 0), (1, 0)]
    for r in records:
        assert r["prompt"] in markdown and f"```\n{r['completion']}\n```" in markdown
        assert r["file"] is None and r["seed"] is None and r["answer"]
        assert set(r["scores"]) == {"format", "accuracy"}
        assert f"format {r['scores']['format']:.3f}" in markdown
