"""ShapesQA / MotionQA: deterministic items, disjoint splits, Video-R1 answers, and the shipped JSONL files."""

import json
from pathlib import Path

import numpy as np
import pytest

from mmgrpo.pipelines.vlm.data import read_samples
from mmgrpo.registry import TASKS
from mmgrpo.rewards import AccuracyReward, RewardBatch
from mmgrpo.tasks import shapes_qa
from mmgrpo.tasks.shapes_qa import SPLITS, write_split

DATA = Path(__file__).resolve().parents[2] / "assets" / "data" / "shapes_qa"
TASK_NAMES = ("shapes_qa", "motion_qa")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_registered_and_deterministic(name):
    task = TASKS.get(name)
    assert task is {"shapes_qa": shapes_qa.SHAPES_QA, "motion_qa": shapes_qa.MOTION_QA}[name]
    first, again = task.items("train", 4), type(task)().items("train", 4)
    assert first == again
    for a, b in zip(first, again):
        np.testing.assert_array_equal(task.render(a), task.render(b))
    with pytest.raises(ValueError, match="splits"):
        task.items("test")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_splits_differ_and_cover_every_kind(name):
    task = TASKS.get(name)
    train, held = task.items("train", 6), task.items("heldout", 6)
    assert {it["kind"] for it in train} == {it["kind"] for it in held} == set(task.kinds)
    assert not {it["id"] for it in train} & {it["id"] for it in held}
    renders = {task.render(it).tobytes() for it in train}
    assert not renders & {task.render(it).tobytes() for it in held}
    assert task.items("train", 2, start=4) == train[4 * len(task.kinds):]  # index ranges, so disjoint by seed


@pytest.mark.parametrize("name", TASK_NAMES)
def test_answers_are_in_the_video_r1_format(name):
    task = TASKS.get(name)
    for it in task.items("heldout", 8):
        answer = it["solution"].removeprefix("<answer>").removesuffix("</answer>")
        assert it["solution"] == f"<answer>{answer}</answer>"
        if it["options"]:
            assert it["problem_type"] == "multiple choice"
            assert [o[:3] for o in it["options"]] == [f"{chr(65 + k)}. " for k in range(len(it["options"]))]
            assert answer in [o[0] for o in it["options"]]
            chosen = it["options"][ord(answer) - 65][3:]
            # the reasoning names the right option after a space, so it tokenises as in "A. green"
            assert f" {chosen}" in it["think"]
        else:
            assert it["problem_type"] == "numerical" and 1 <= int(answer) <= shapes_qa.MAX_COUNT
        pixels = task.render(it)
        assert pixels.dtype == np.uint8
        assert pixels.shape == ((64, 64, 3) if name == "shapes_qa" else (shapes_qa.FRAMES, 64, 64, 3))


@pytest.mark.parametrize("name", TASK_NAMES)
@pytest.mark.parametrize("split", SPLITS)
def test_options_follow_the_vocabulary_and_letters_are_near_uniform(name, split):
    task = TASKS.get(name)
    letters = {}
    for it in task.items(split, 240):
        if it["options"]:
            texts = [o[3:] for o in it["options"]]
            assert texts == sorted(texts, key=lambda t: [shapes_qa.VOCABULARY.index(w) for w in t.split()])
            letters.setdefault(it["kind"], []).append(it["solution"][len("<answer>")])
    assert letters
    for kind, answers in letters.items():
        n = len(task.item(kind, 0, split)["options"])
        shares = [answers.count(chr(65 + k)) / len(answers) for k in range(n)]
        assert 0.6 / n < min(shares) and max(shares) < 1.4 / n, (kind, shares)


def test_written_split_reads_back_and_scores(tmp_path):
    assert write_split(tmp_path, "heldout", 2) == 12
    samples = read_samples(tmp_path / "heldout.jsonl", tmp_path)
    assert {s.extra["kind"] for s in samples} == {"colour", "shape", "count", "direction", "order"}
    assert all((s.images or s.videos)[0].is_file() for s in samples)
    batch = RewardBatch(prompts=[""] * len(samples), group=np.arange(len(samples)),
                        completions=[f"<think>x</think>{s.solution}" for s in samples],
                        meta=[{"solution": s.solution, "problem_type": s.problem_type} for s in samples])
    assert AccuracyReward()(batch).tolist() == [1.0] * len(samples)


def test_shipped_data_matches_the_generator_and_is_small():
    size = sum(f.stat().st_size for f in DATA.rglob("*") if f.is_file())
    assert size < 4e6  # 3.7 MB: 1440 train + 192 validation + 480 held-out items; all of assets/ under 30 MB
    assets = sum(f.stat().st_size for f in DATA.parents[1].rglob("*") if f.is_file())
    assert assets < 30e6
    # the GRPO train split starts after the items the shipped model was SFT'd on, and the demo's validation
    # questions after those (scripts/build_tiny_vlm.py)
    args = json.loads((DATA.parents[1] / "tiny-qwen2vl-shapes" / "sft_report.json").read_text())["args"]
    for name, split, start in (("train", "train", args["sft_per_kind"]),
                               ("val", "train", args["sft_per_kind"] + args["train_per_kind"]),
                               ("heldout", "heldout", 0)):
        rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]
        per_kind = len(rows) // 6
        expected = [it for name in TASK_NAMES for it in TASKS.get(name).items(split, per_kind, start)]
        assert [r["id"] for r in rows] == [it["id"] for it in expected]
        assert [r["solution"] for r in rows] == [it["solution"] for it in expected]
        assert all((DATA / r["path"]).is_file() for r in rows)


def test_split_written_under_another_name_keeps_apart(tmp_path):
    write_split(tmp_path, "train", 1)
    assert write_split(tmp_path, "train", 1, start=3, name="val") == 6
    train, val = (read_samples(tmp_path / f"{name}.jsonl", tmp_path) for name in ("train", "val"))
    assert val[0].extra["id"] == "shapes_qa-colour-train-0003"
    assert {p.parent.name for s in val for p in s.images + s.videos} == {"val"}
    assert not {s.extra["id"] for s in train} & {s.extra["id"] for s in val}


def test_task_source_is_written_once_and_read_like_a_file(tmp_path, monkeypatch):
    """``data.train_file: task:shapes_qa,motion_qa``: the split is generated into the cache once, then reused."""
    from mmgrpo.config import ConfigError
    from mmgrpo.pipelines.vlm.data import read_task_split

    samples = read_task_split("task:shapes_qa,motion_qa", "train", 2, 5, str(tmp_path), "data.train_file")
    assert len(samples) == 12 and samples[0].extra["id"] == "shapes_qa-colour-train-0005"
    expected = TASKS.get("shapes_qa").items("train", 2, 5)[0]
    assert samples[0].solution == expected["solution"] and samples[0].images[0].is_file()
    [folder] = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert folder.name.endswith(shapes_qa.generator_version()) and not list(tmp_path.glob(".*"))

    def fail(*args, **kwargs):
        raise AssertionError("the cached split was written again")

    monkeypatch.setattr(shapes_qa, "write_split", fail)
    again = read_task_split("task:shapes_qa,motion_qa", "train", 2, 5, str(tmp_path), "data.train_file")
    assert [s.extra["id"] for s in again] == [s.extra["id"] for s in samples]
    with pytest.raises(AssertionError):  # another range is another folder
        read_task_split("task:shapes_qa", "train", 2, 0, str(tmp_path), "data.train_file")
    monkeypatch.undo()
    held = read_task_split("task:shapes_qa", "heldout", None, 0, str(tmp_path), "data.eval_file", total=7)
    assert len(held) == 9  # 3 per kind: the fewest that give 7
    with pytest.raises(ConfigError, match="'data.train_file': 'shapes_t2i' is not a registered QA task"):
        read_task_split("task:shapes_t2i", "train", 2, 0, str(tmp_path), "data.train_file")


def test_interrupted_task_split_leaves_no_folder(tmp_path, monkeypatch):
    def broken(out_dir, *args, **kwargs):
        (Path(out_dir) / "train").mkdir()
        raise OSError("disk full")

    monkeypatch.setattr(shapes_qa, "write_split", broken)
    with pytest.raises(OSError, match="disk full"):
        shapes_qa.cached_split(tmp_path, "train", 2, ("shapes_qa",))
    assert list(tmp_path.iterdir()) == []
