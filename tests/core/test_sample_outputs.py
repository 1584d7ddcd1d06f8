"""What ``mmgrpo sample`` and ``mmgrpo eval`` write: next to the grid (or the VLM's markdown), a folder named after
the same tag with each sample as its own file and an ``index.json`` that says which prompt, seed and sample each file
holds (and, for ``eval``, the scores it logged)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from random_flow import RANDOM_TINY_SD3

from mmgrpo.cli import main
from mmgrpo.pipelines.flow import media
from mmgrpo.registry import import_path

ROOT = Path(__file__).resolve().parents[2]
FAST_FLOW = ["sampling.eval_num_steps=2", "num_threads=1", "logging.progress=false"]

pytestmark = pytest.mark.usefixtures("one_thread")

COUNTED = """
import math

calls = []


def fn(batch):
    # call k scores sample i k + i / 8, but NaN for the third: a second call would show other scores
    calls.append(len(batch.prompts))
    return [math.nan if i == 2 else len(calls) + i / 8 for i in range(len(batch.prompts))]
"""


def counted_reward(tmp_path: Path) -> tuple[str, list[int]]:
    """(the name of a plain-function reward whose scores depend on how often it was called, its list of calls: the
    batch size of each)."""
    (tmp_path / "counted.py").write_text(COUNTED)
    return f"{tmp_path}/counted.py:fn", import_path(f"{tmp_path}/counted.py:calls")


def index_of(folder: Path) -> list[dict]:
    index = json.loads((folder / "index.json").read_text())
    assert index["tag"] == folder.name
    return index["samples"]


SAME_IMAGE = 1
"""A sample regenerated alone is its batch's image up to float rounding (about 1e-4: matmuls depend on the batch
size, test_generate_is_deterministic_per_item), which may move a pixel across a uint8 rounding boundary."""


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
        assert np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max() <= SAME_IMAGE


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


def test_flow_eval_writes_each_image_with_the_scores_it_logged(tmp_path, monkeypatch):
    """``mmgrpo eval`` wrote only the grid and eval.json: now each image too, and its scores in the index (NaN as
    null), the very ones eval.json averages, scored once."""
    monkeypatch.chdir(ROOT)
    reward, calls = counted_reward(tmp_path)
    preset = str(ROOT / "configs" / "flow" / "tiny_flowgrpo.yaml")
    args = [preset, *RANDOM_TINY_SD3, *FAST_FLOW, "data.num_eval=3", f"output_dir={tmp_path / 'run'}",
            f"rewards=[{{name: color_fraction, args: {{tolerance: 0.5}}}}, {{name: '{reward}'}}]"]
    assert main(["eval", *args]) == 0
    assert calls == [3]
    samples = tmp_path / "run" / "samples"
    records = index_of(samples / "eval-base")
    assert sorted(p.name for p in (samples / "eval-base").glob("*.png")) == [r["file"] for r in records]
    assert [r["scores"][reward] for r in records] == [1.0, 1.125, None]
    means = json.loads((tmp_path / "run" / "eval.json").read_text())["rewards"]
    assert means[reward] == 1.0625
    assert means["color_fraction"] == pytest.approx(sum(r["scores"]["color_fraction"] for r in records) / 3)
    with Image.open(samples / "eval-base.png") as grid, Image.open(samples / "eval-base" / records[0]["file"]) as a:
        assert np.array_equal(np.asarray(a), np.asarray(grid_tile(grid.convert("RGB"), 0, 3, (32, 32))))


VLM_ARGS = [str(ROOT / "configs" / "vlm" / "tiny_image.yaml"), f"data.train_file={ROOT}/assets/data/shapes_qa/train.jsonl",
            f"data.eval_file={ROOT}/assets/data/shapes_qa/heldout.jsonl", f"data.root={ROOT}/assets/data/shapes_qa",
            f"model.path={ROOT}/assets/tiny-qwen2vl-shapes", "generation.max_new_tokens=8"]


def test_vlm_eval_scores_once_and_writes_the_logged_scores(tmp_path):
    """The VLM's samples page scored every reward a second time (for a judge: twice the calls, scores that could
    differ from eval.json's); now it shows the scores eval.json averages, and the index holds them too."""
    reward, calls = counted_reward(tmp_path)
    args = [*VLM_ARGS, "data.num_eval=3", f"output_dir={tmp_path}",
            f"rewards=[{{name: format}}, {{name: '{reward}'}}]"]
    assert main(["eval", *args]) == 0
    assert calls == [3]
    assert json.loads((tmp_path / "eval.json").read_text())["rewards"][reward] == 1.0625
    samples = tmp_path / "samples"
    records = index_of(samples / "eval-base")
    assert [r["scores"][reward] for r in records] == [1.0, 1.125, None]
    assert all(r["file"] is None and r["answer"] and set(r["scores"]) == {"format", reward} for r in records)
    markdown = (samples / "eval-base.md").read_text()
    assert f"{reward} 1.000" in markdown and f"{reward} 1.125" in markdown and f"{reward} 2." not in markdown


def test_vlm_sample_writes_an_index_with_completions_and_rewards(tmp_path):
    args = [*VLM_ARGS, "data.num_eval=2", f"output_dir={tmp_path}"]
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


def test_flow_sample_per_prompt_writes_k_seeded_images_and_a_seed_regenerates_one(tmp_path, monkeypatch):
    """``--per-prompt K``: K images per prompt, grouped in the index with distinct noise seeds; one of those seeds
    given back with ``--sample-seed`` regenerates that image alone."""
    monkeypatch.chdir(ROOT)
    preset = str(ROOT / "configs" / "flow" / "tiny_flowgrpo.yaml")
    args = [preset, *RANDOM_TINY_SD3, *FAST_FLOW, f"output_dir={tmp_path}"]
    assert main(["sample", *args, "--num", "1", "--per-prompt", "3"]) == 0
    folder = tmp_path / "samples" / "sample-base"
    records = index_of(folder)
    assert [r["file"] for r in records] == ["p000-s00.png", "p000-s01.png", "p000-s02.png"]
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [(0, 0), (0, 1), (0, 2)]
    assert len({r["prompt"] for r in records}) == 1 and len({r["seed"] for r in records}) == 3
    pixels = [np.asarray(Image.open(folder / r["file"])).astype(int) for r in records]
    assert all(np.abs(a - b).max() > 2 for a, b in ((pixels[0], pixels[1]), (pixels[1], pixels[2])))
    assert main(["sample", *args, "--prompt", records[2]["prompt"], "--sample-seed", str(records[2]["seed"])]) == 0
    (again,) = index_of(tmp_path / "samples" / "sample-base-2")
    assert again["seed"] == records[2]["seed"]
    regenerated = np.asarray(Image.open(tmp_path / "samples" / "sample-base-2" / again["file"])).astype(int)
    assert np.abs(regenerated - pixels[2]).max() <= SAME_IMAGE


def test_vlm_sample_per_prompt_needs_a_sampling_temperature_and_records_seeds(tmp_path, capsys):
    args = [*VLM_ARGS, "data.num_eval=2", f"output_dir={tmp_path}", "rewards=[{name: format}]"]
    assert main(["sample", *args, "--num", "1", "--per-prompt", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading bar
    assert err.startswith("config error: bad value for 'generation.eval_temperature': 0 decodes greedily")
    assert not (tmp_path / "samples").exists()
    hot = [*args, "generation.eval_temperature=1.5"]
    assert main(["sample", *hot, "--num", "1", "--per-prompt", "3"]) == 0
    records = index_of(tmp_path / "samples" / "sample-base")
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [(0, 0), (0, 1), (0, 2)]
    assert len({r["seed"] for r in records}) == 3 and all(isinstance(r["seed"], int) for r in records)
    assert main(["sample", *hot, "--prompt", records[1]["prompt"], "--sample-seed", str(records[1]["seed"])]) == 0
    (again,) = index_of(tmp_path / "samples" / "sample-base-2")
    assert (again["seed"], again["completion"], again["answer"]) == (records[1]["seed"], records[1]["completion"],
                                                                   records[1]["answer"])
