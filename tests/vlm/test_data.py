"""Question files (Video-R1 / EasyR1), prompt rendering, reward meta, and the shipped vlm_tiny data set."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.config import ConfigError, load_config
from mmgrpo.pipelines.vlm.config import VLMDataConfig, VLMVideoConfig
from mmgrpo.pipelines.vlm.data import (
    VLMSample,
    chat_content,
    format_options,
    read_samples,
    render_prompt,
    reward_meta,
    rotate_options,
)
from mmgrpo.pipelines.vlm.synthetic import make_count_clip, make_motion_clip, write_tiny_dataset
from mmgrpo.pipelines.vlm.video import decode_video
from mmgrpo.rewards import AccuracyReward, RewardBatch
from mmgrpo.rewards.text_rules import PROBLEM_TYPES, TemporalIoU

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets" / "data" / "vlm_tiny"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A data root holding a few (empty) media files: a.png, b.jpg, sub/c.png, v1.mp4, sub/v2.mp4."""
    for name in ("a.png", "b.jpg", "sub/c.png", "v1.mp4", "sub/v2.mp4"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def video_r1(**kw) -> dict:
    rec = {"problem_id": 7, "problem": "Which way?", "problem_type": "multiple choice",
           "options": ["A. left", "B. right"], "solution": "<answer>B</answer>", "path": "./v1.mp4",
           "data_type": "video", "data_source": "unit"}
    rec.update(kw)
    return rec


def test_video_r1_jsonl_with_several_media(root: Path):
    path = write_jsonl(root / "data.jsonl", [
        video_r1(),
        "",
        video_r1(problem_type="Multiple_Choice", path=["a.png", "sub/c.png"], data_type="image"),
        video_r1(problem_type="numerical", options=[], solution=3, path="sub/../sub/v2.mp4"),
    ])
    s = read_samples(path, root)
    assert len(s) == 3
    assert s[0] == VLMSample("Which way?", "multiple choice", ["A. left", "B. right"], "<answer>B</answer>",
                             [], [root / "v1.mp4"], f"{path}:1", {"problem_id": 7, "data_source": "unit"})
    assert s[1].images == [root / "a.png", root / "sub/c.png"] and s[1].videos == []
    assert s[1].problem_type == "multiple choice" and s[1].source == f"{path}:3"
    assert s[2].videos == [root / "sub/v2.mp4"] and s[2].solution == "3" and s[2].problem_type == "numerical"
    assert all(p.is_absolute() for x in s for p in x.images + x.videos)


def test_easyr1_json_list_with_several_media(root: Path):
    records = [
        {"problem": "<image><image>Which is larger?", "answer": "the first", "images": ["a.png", {"path": "b.jpg"}]},
        {"problem": "<video>Count.", "answer": 42, "videos": ["v1.mp4", "sub/v2.mp4"], "problem_type": "numeric",
         "images": ["sub/c.png"], "difficulty": 3},
    ]
    path = root / "data.json"
    path.write_text(json.dumps(records, indent=2))
    a, b = read_samples(path, str(root))
    assert a.question == "<image><image>Which is larger?" and a.problem_type is None and a.solution == "the first"
    assert a.images == [root / "a.png", root / "b.jpg"] and a.videos == [] and a.options == []
    assert b.videos == [root / "v1.mp4", root / "sub/v2.mp4"] and b.images == [root / "sub/c.png"]
    assert b.solution == "42" and b.problem_type == "numerical" and b.extra == {"difficulty": 3}
    text = path.read_text().splitlines()
    assert [int(x.source.rsplit(":", 1)[1]) for x in (a, b)] == [i + 1 for i, t in enumerate(text) if t == "  {"]


def test_malformed_jsonl_line_names_line(root: Path):
    path = write_jsonl(root / "d.jsonl", [video_r1(), video_r1(), '{"problem": "x", "solution": "<answer>B', video_r1()])
    with pytest.raises(ConfigError) as err:
        read_samples(path, root)
    assert str(err.value) == f"{path}:3: malformed JSON at column 30: Unterminated string starting at"


def test_jsonl_strings_may_hold_unicode_line_separators(root: Path):
    """U+2028, U+2029 and U+0085 are valid unescaped inside JSON strings (json.dumps(ensure_ascii=False) writes
    them): they do not end a JSONL record, and CRLF line ends still do."""
    problems = ["left\u2028or right?", "up\x85or down?", "in\u2029out?"]
    path = root / "d.jsonl"
    path.write_text("\r\n".join(json.dumps(video_r1(problem=p), ensure_ascii=False) for p in problems) + "\r\n",
                    newline="")
    samples = read_samples(path, root)
    assert [s.question for s in samples] == problems
    assert [s.source.rsplit(":", 1)[1] for s in samples] == ["1", "2", "3"]


def test_malformed_json_list_names_line(root: Path):
    path = root / "d.json"
    path.write_text('[\n  {"problem": "a", "answer": "b"},\n  {"problem": "a" "answer": "b"}\n]\n')
    with pytest.raises(ConfigError, match=r"d\.json:3: malformed JSON at column 19: Expecting ',' delimiter$"):
        read_samples(path, root)
    path.write_text('[\n  {"problem": "a", "answer": "b"},\n]\n')
    with pytest.raises(ConfigError, match=r"d\.json:3: malformed JSON"):
        read_samples(path, root)


@pytest.mark.parametrize("content", [
    '{"data": [{"problem": "a", "answer": "b"}]}',
    '{\n  "problem": "a",\n  "answer": "b"\n}\n',
])
def test_a_file_that_is_one_json_object_says_records_are_a_list(root: Path, content: str):
    path = root / "dict.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        read_samples(path, root)
    assert str(err.value) == (f"{path}: holds a single JSON object, not records: a data file holds a JSON list of "
                              "records or one record object per line (JSONL)")
    path.write_text('{"problem": "a", "answer": "b"}\n')  # one line with one record is JSONL
    assert read_samples(path, root)[0].solution == "b"


@pytest.mark.parametrize("record, field", [
    ({"problem": "Which way?", "problem_type": "multiple choice", "path": "v1.mp4", "data_type": "video"},
     "'solution' (Video-R1 format) or 'answer'"),
    ({"problem": "Which way?", "solution": "B"}, "'problem_type'"),
])
def test_a_one_record_jsonl_missing_a_field_names_the_field(root: Path, record: dict, field: str):
    path = write_jsonl(root / "one.jsonl", [record])
    with pytest.raises(ConfigError, match=rf"one\.jsonl:1: missing required field {re.escape(field)}"):
        read_samples(path, root)


def test_unknown_problem_type_lists_valid_ones(root: Path):
    path = write_jsonl(root / "d.jsonl", [video_r1(), video_r1(problem_type="mcq")])
    with pytest.raises(ConfigError) as err:
        read_samples(path, root)
    msg = str(err.value)
    assert msg.startswith(f"{path}:2: unknown problem_type \"mcq\"")
    assert all(t in msg for t in PROBLEM_TYPES) and "temporal grounding" in msg


@pytest.mark.parametrize("spelled", ["temporal grounding", "Temporal_Grounding", "TVG"])
def test_a_temporal_grounding_record_reads_and_reaches_temporal_iou(root: Path, spelled: str):
    """The rewards score temporal grounding (``temporal_iou``; ``accuracy`` does not apply), so a Video-R1 record of
    that type reads, its type kept in the canonical spelling."""
    path = write_jsonl(root / "d.jsonl", [video_r1(problem_type=spelled, options=[], solution=[4, 8])])
    (sample,) = read_samples(path, root)
    meta = reward_meta(sample)
    assert sample.problem_type == meta["problem_type"] == "temporal grounding"
    batch = RewardBatch(prompts=["p"], group=torch.tensor([0]), completions=["<answer>[4, 6]</answer>"], meta=[meta])
    assert TemporalIoU()(batch).tolist() == [0.5] and AccuracyReward()(batch).isnan().all()
    told = {"temporal grounding": " Answer [start, end] in seconds."}
    assert render_prompt(sample, "{question}{options}{type_instruction}", told).endswith(told["temporal grounding"])


@pytest.mark.parametrize("drop, field", [("problem", "problem"), ("problem_type", "problem_type"),
                                         ("solution", "solution"), ("path", "path")])
def test_missing_field_named(root: Path, drop: str, field: str):
    rec = video_r1()
    del rec[drop]
    path = write_jsonl(root / "d.jsonl", [video_r1(), rec])
    with pytest.raises(ConfigError, match=rf"d\.jsonl:2: missing required field '{field}'"):
        read_samples(path, root)


def test_bad_records(root: Path):
    cases = {
        "[1, 2]": "expected a JSON object",
        json.dumps({"problem": "q", "answer": "a", "images": [{"bytes": "xx"}]}): "field 'images' must hold file paths",
        json.dumps(video_r1(data_type="audio")): "field 'data_type' must be 'image' or 'video'",
        json.dumps(video_r1(solution="  ")): "field 'solution' is empty",
        json.dumps(video_r1(options="A. left")): "field 'options' must be a list",
    }
    for line, expected in cases.items():
        path = write_jsonl(root / "d.jsonl", [line])
        with pytest.raises(ConfigError, match=rf"d\.jsonl:1: {expected}"):
            read_samples(path, root)


@pytest.mark.parametrize("content", ["", "\n\n", "[]", "  [ ]\n"])
def test_empty_file(root: Path, content: str):
    path = root / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match="no records"):
        read_samples(path, root)


def test_a_media_path_with_a_tilde_is_under_the_home_folder(root: Path, tmp_path: Path, monkeypatch):
    home = tmp_path / "home"
    (home / "clips").mkdir(parents=True)
    (home / "clips" / "v.mp4").write_bytes(b"")
    monkeypatch.setenv("HOME", str(home))
    path = write_jsonl(root / "d.jsonl", [video_r1(path="~/clips/v.mp4"),
                                          {"problem": "q", "answer": "a", "images": ["~/clips/x.png", "a.png"]}])
    first, second = read_samples(path, root)
    assert first.videos == [home / "clips" / "v.mp4"]
    assert second.images == [home / "clips" / "x.png", root / "a.png"]


def test_missing_file_and_wrong_root(root: Path, tmp_path: Path):
    with pytest.raises(ConfigError, match="data file not found"):
        read_samples(root / "nope.jsonl", root)
    path = write_jsonl(root / "d.jsonl", [video_r1(), video_r1(path="a.png", data_type="image")])
    with pytest.raises(ConfigError, match="none of its 2 image/video files exist.*'data.root'"):
        read_samples(path, root / "sub")
    (root / "v1.mp4").unlink()
    assert len(read_samples(path, root)) == 2  # one missing file is left to data.on_bad_media


def test_data_file_and_root_expand_the_home_folder(root: Path, monkeypatch: pytest.MonkeyPatch):
    """``data.train_file: ~/x.jsonl`` and ``data.root: ~/data`` mean the home folder, as ``model.path``,
    ``data.task_cache`` and ``output_dir`` do (they were read as folders named '~' under the working directory)."""
    write_jsonl(root / "d.jsonl", [video_r1()])
    monkeypatch.setenv("HOME", str(root.parent))
    samples = read_samples(f"~/{root.name}/d.jsonl", f"~/{root.name}")
    assert samples[0].videos == [root / "v1.mp4"] and samples[0].source == f"~/{root.name}/d.jsonl:1"


def test_render_prompt_video_r1_options():
    template = VLMDataConfig.prompt_template
    s = VLMSample("Which way does it move?", "multiple choice", ["A. left", "B. right"], "<answer>B</answer>")
    assert render_prompt(s, template).startswith("Which way does it move?\nOptions:\nA. left\nB. right\nThink about")
    assert render_prompt(VLMSample("How many?", "numerical", [], "3"), "{question}{options}|") == "How many?|"


def test_render_prompt_labels_and_braces():
    s = VLMSample("Pick {options} one", "multiple choice", ["red", "{question}"], "A")
    out = render_prompt(s, 'Q: {question}{options}\nJSON: {"answer": "X"}')
    assert out == 'Q: Pick {options} one\nOptions:\nA. red\nB. {question}\nJSON: {"answer": "X"}'
    labelled = VLMSample("q", "multiple choice", ["(A) red", "(B) blue"], "A")
    assert render_prompt(labelled, "{question}{options}") == "q\nOptions:\n(A) red\n(B) blue"
    with pytest.raises(ConfigError, match="must contain {question}"):
        render_prompt(s, "{options}")
    with pytest.raises(ConfigError, match="has no {options}"):
        render_prompt(s, "{question}")
    many = VLMSample("q", "multiple choice", [str(k) for k in range(27)], "A", source="d.jsonl:4")
    with pytest.raises(ConfigError, match=r"^d\.jsonl:4: cannot label 27 options"):
        render_prompt(many, "{question}{options}")


def test_render_prompt_type_instruction():
    template = "{question}{options}\nAnswer in tags.{type_instruction}"
    told = {"multiple choice": " Give the letter.", "numerical": "\nGive the number."}
    mc = VLMSample("Which?", "multiple choice", ["A. x", "B. y"], "A")
    assert render_prompt(mc, template, told) == "Which?\nOptions:\nA. x\nB. y\nAnswer in tags. Give the letter."
    assert render_prompt(VLMSample("How many?", "numerical", [], "3"), template, told) == \
        "How many?\nAnswer in tags.\nGive the number."
    for untold in (VLMSample("Read it.", "OCR", [], "hi"), VLMSample("Say.", None, [], "hi")):
        assert render_prompt(untold, template, told) == f"{untold.question}\nAnswer in tags."
    assert render_prompt(mc, template) == "Which?\nOptions:\nA. x\nB. y\nAnswer in tags."  # empty by default
    with pytest.raises(ConfigError, match="has no {type_instruction}.*'multiple choice'"):
        render_prompt(mc, "{question}{options}", told)
    assert render_prompt(VLMSample("Read it.", "OCR", [], "hi"), "{question}", told) == "Read it."  # nothing lost


def test_chat_content_places_media_at_the_markers():
    assert chat_content("<image>Compare <image> with <video>.", 2, 1) == [
        {"type": "image"}, {"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " with "},
        {"type": "video"}, {"type": "text", "text": "."}]
    assert chat_content("<video><image>", 1, 1) == [{"type": "video"}, {"type": "image"}]
    assert chat_content("No markers.", 2, 1) == [{"type": "image"}, {"type": "image"}, {"type": "video"},
                                                 {"type": "text", "text": "No markers."}]
    for text, images, videos in [("<image>x", 2, 0), ("<image><image>x", 1, 0), ("<image>x", 1, 1),
                                 ("<video>x", 1, 0)]:
        with pytest.raises(ValueError, match="markers but the sample has"):
            chat_content(text, images, videos)


def test_marker_count_mismatch_names_the_record(root: Path):
    path = write_jsonl(root / "d.jsonl", [
        {"problem": "<image>Same?<image>", "answer": "yes", "images": ["a.png", "b.jpg"]},
        {"problem": "<image>Same?", "answer": "yes", "images": ["a.png", "b.jpg"]},
    ])
    good, bad = read_samples(path, root)
    assert render_prompt(good, "{question}") == "<image>Same?<image>"
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: the prompt has 1 <image> and 0 <video> markers but the "
                                          r"sample has 2 images and 0 videos"):
        render_prompt(bad, "{question}")


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>"])
def test_a_vision_special_token_in_the_text_names_the_record(root: Path, token: str):
    """The processor expands every ``<|image_pad|>`` of the text into an image's tokens: written in a record, it
    would stop the run at the item's first draw (or mis-place the pixels); it stops the run at start-up instead."""
    path = write_jsonl(root / "d.jsonl", [{"problem": f"Look {token} here.", "answer": "yes", "images": ["a.png"]}])
    (sample,) = read_samples(path, root)
    with pytest.raises(ConfigError, match=rf"d\.jsonl:1: the prompt holds {re.escape(token)}, .*use <image>"):
        render_prompt(sample, "{question}")
    with pytest.raises(ValueError, match="vision special token"):
        chat_content(f"{token}x", 0, 0)


@pytest.mark.parametrize("preset", ["tiny_base", "tiny_image", "tiny_video_tgrpo", "demo_shapes"])
def test_cpu_preset_prompts_are_unchanged(preset):
    """The shipped tiny VLM was fine-tuned on these exact prompts: media first, then the bare question and options."""
    cfg = load_config(ROOT / "configs" / "vlm" / f"{preset}.yaml")
    samples = read_samples(ROOT / cfg.data.train_file, ROOT / cfg.data.root)
    image = next(s for s in samples if s.images and s.question == "What colour is the triangle?")
    video = next(s for s in samples if s.videos and s.question == "Which direction does the yellow circle move?")
    prompt = render_prompt(image, cfg.data.prompt_template, cfg.data.type_instructions)
    assert prompt == "What colour is the triangle?\nOptions:\nA. red\nB. green\nC. blue\nD. yellow"
    assert chat_content(prompt, 1, 0) == [{"type": "image"}, {"type": "text", "text": prompt}]
    prompt = render_prompt(video, cfg.data.prompt_template, cfg.data.type_instructions)
    assert prompt == "Which direction does the yellow circle move?\nOptions:\nA. left\nB. right\nC. up\nD. down"
    assert chat_content(prompt, 0, 1) == [{"type": "video"}, {"type": "text", "text": prompt}]


def test_reward_meta_feeds_accuracy_reward(root: Path):
    path = write_jsonl(root / "d.jsonl", [
        video_r1(),
        {"problem": "How many?", "answer": 3, "videos": ["v1.mp4"], "difficulty": 2},
    ])
    a, b = read_samples(path, root)
    ma, mb = reward_meta(a), reward_meta(b)
    assert ma["solution"] == "<answer>B</answer>" and ma["answer"] == "B" and ma["problem_type"] == "multiple choice"
    assert ma["problem_id"] == 7 and ma["source"] == f"{path}:1" and ma["options"] == ["A. left", "B. right"]
    assert "problem_type" not in mb and mb["answer"] == "3" and mb["difficulty"] == 2
    completions = ["<think>.</think><answer>B</answer>", "<think>.</think><answer>3.0</answer>"]
    batch = RewardBatch(prompts=["p", "p"], group=torch.tensor([0, 1]), completions=completions, meta=[ma, mb])
    assert AccuracyReward(default_type="numerical")(batch).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="unknown problem_type"):
        AccuracyReward()(batch)


def test_a_list_ground_truth_reaches_the_rewards_as_a_list(root: Path):
    """Several acceptable answers are scored by the best; a [start, end] list is temporal_iou's interval."""
    path = write_jsonl(root / "d.jsonl", [
        {"problem": "How many?", "answer": ["3 shapes", "three shapes"], "problem_type": "free-form",
         "videos": ["v1.mp4"]},
        {"problem": "When?", "answer": [4, 8], "videos": ["v1.mp4"]},
    ])
    words, interval = read_samples(path, root)
    meta = [reward_meta(words), reward_meta(interval)]
    assert meta[0]["solution"] == meta[0]["answer"] == ["3 shapes", "three shapes"] and meta[1]["answer"] == [4, 8]
    batch = RewardBatch(prompts=["p"], group=torch.tensor([0]), completions=["<think>.</think><answer>three shapes</answer>"],
                        meta=meta[:1])
    assert AccuracyReward()(batch).tolist() == [1.0]
    batch = RewardBatch(prompts=["p"], group=torch.tensor([0]), completions=["<think>.</think><answer>[4, 6]</answer>"],
                        meta=meta[1:])
    assert TemporalIoU()(batch).tolist() == [0.5]


@pytest.mark.parametrize("answer, message", [([], "'answer' is an empty list"),
                                             (["3", None], "'answer' must hold strings or numbers, got null"),
                                             ([True], "'answer' must hold strings or numbers, got true")])
def test_a_bad_list_ground_truth_names_the_record(root: Path, answer, message):
    path = write_jsonl(root / "d.jsonl", [{"problem": "How many?", "answer": answer, "videos": ["v1.mp4"]}])
    with pytest.raises(ConfigError, match=re.escape(f"{path}:1: field {message}")):
        read_samples(path, root)


def test_shipped_tiny_dataset_reads():
    train, evals = read_samples(TINY / "train.jsonl", TINY), read_samples(TINY / "eval.jsonl", TINY)
    assert (len(train), len(evals)) == (36, 12)
    everything = train + evals
    assert all(p.is_file() for s in everything for p in s.images + s.videos)
    assert sum(len(s.videos) for s in everything) == 24 and sum(len(s.images) for s in everything) == 24
    assert {s.problem_type for s in everything} == {"multiple choice", "numerical"}
    for s in everything:
        answer = reward_meta(s)["answer"]
        if s.problem_type == "multiple choice":
            assert answer in [o[0] for o in s.options]
        else:
            assert s.options == [] and answer.isdigit()
    directions = [reward_meta(s)["answer"] for s in evals if s.extra["task"] == "motion_direction"]
    truth = {s.options[ord(a) - ord("A")][3:] for s, a in zip(
        [s for s in evals if s.extra["task"] == "motion_direction"], directions)}
    assert truth == {"left", "right", "up", "down"}
    size = sum(f.stat().st_size for f in TINY.rglob("*") if f.is_file())
    assert size < 1_500_000


def test_tiny_dataset_reproducible_from_seed(tmp_path: Path):
    sizes = write_tiny_dataset(tmp_path, seed=0)
    assert sizes == {"train": 36, "eval": 12}
    for name in ("train.jsonl", "eval.jsonl", "README.md"):
        assert (tmp_path / name).read_text() == (TINY / name).read_text(), name
    for png in sorted(TINY.glob("images/*.png")):
        assert np.array_equal(np.asarray(Image.open(png)), np.asarray(Image.open(tmp_path / "images" / png.name)))
    cfg = VLMVideoConfig(backend="pyav", fps=4.0, max_frames=16)
    for mp4 in sorted(TINY.glob("videos/*.mp4")):  # equal bytes with this libx264; other encoders differ a little
        shipped, new = decode_video(mp4, cfg)[0], decode_video(tmp_path / "videos" / mp4.name, cfg)[0]
        assert shipped.shape == new.shape == (16, 3, 56, 56)
        assert (shipped.float() - new.float()).abs().mean() < 0.5, mp4.name
    other = write_tiny_dataset(tmp_path / "seed1", seed=1)
    assert other == sizes and (tmp_path / "seed1/train.jsonl").read_text() != (TINY / "train.jsonl").read_text()


def test_clip_generators_are_pure():
    a = make_motion_clip("up", "green", "triangle", frames=6, size=32, seed=5)
    assert a.shape == (6, 32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, make_motion_clip("up", "green", "triangle", frames=6, size=32, seed=5))
    assert not np.array_equal(a, make_motion_clip("up", "green", "triangle", frames=6, size=32, seed=6))
    rows = [np.nonzero(f.sum(axis=(1, 2)))[0].mean() for f in a]
    assert all(b > c for b, c in itertools.pairwise(rows))  # moving up: the shape's mean row falls frame by frame
    assert np.array_equal(make_count_clip(3, frames=4, seed=1), make_count_clip(3, frames=4, seed=1))


def test_rotate_options_moves_the_texts_and_the_answer_together():
    s = VLMSample("What colour?", "multiple choice", ["A. red", "B. blue", "(C) green", "D: yellow"],
                  "<answer>C</answer>", source="q.jsonl:3")
    one = rotate_options(s, 1)
    assert one.options == ["A. blue", "B. green", "C. yellow", "D. red"] and one.solution == "<answer>B</answer>"
    assert rotate_options(s, 3).solution == "<answer>D</answer>"  # green moves down to D
    assert rotate_options(s, 4) == rotate_options(s, 0)
    assert rotate_options(s, 0).options == ["A. red", "B. blue", "C. green", "D. yellow"]
    # every rotation puts the correct text under its letter, and over the n rotations the letter takes every value
    letters = []
    for k in range(4):
        r = rotate_options(s, k)
        letter = r.solution[len("<answer>")]
        assert r.options[ord(letter) - ord("A")].endswith("green")
        letters.append(letter)
    assert sorted(letters) == ["A", "B", "C", "D"]
    plain = VLMSample("Which way?", "multiple choice", ["left", "right"], "b")  # unlabelled, bare letter
    assert rotate_options(plain, 1).options == ["A. right", "B. left"] and rotate_options(plain, 1).solution == "A"


def test_rotate_options_keeps_unlabelled_texts_whole_as_the_prompt_shows_them():
    """Options that are not all labelled are shown labelled A, B, ... with their texts whole (format_options):
    the rotation must move those texts, not cut a letter-and-dot start ("U.S." -> "S.") off some of them."""
    s = VLMSample("Which country?", "multiple choice", ["U.S.", "France", "Spain"], "A")
    assert format_options(s.options) == "\nOptions:\nA. U.S.\nB. France\nC. Spain"
    one = rotate_options(s, 1)
    assert one.options == ["A. France", "B. Spain", "C. U.S."] and one.solution == "C"


@pytest.mark.parametrize("options", [["a.m.", "p.m."], ["U.S.", "U.K."], ["B. left", "A. right"]])
def test_texts_that_start_like_labels_out_of_order_are_lettered(options):
    """["a.m.", "p.m."] each matched a letter label, so the prompt showed them unlettered while the answer is a
    letter; only the labels A, B, C, ... in order count as labels."""
    s = VLMSample("When?", "multiple choice", options, "B")
    assert format_options(s.options) == f"\nOptions:\nA. {options[0]}\nB. {options[1]}"
    assert rotate_options(s, 1).options == [f"A. {options[1]}", f"B. {options[0]}"]


def test_rotate_options_rejects_a_solution_that_is_not_an_option_letter():
    with pytest.raises(ValueError, match="q.jsonl:3: cannot rotate the options"):
        rotate_options(VLMSample("How many?", "numerical", [], "<answer>3</answer>", source="q.jsonl:3"), 1)
    with pytest.raises(ValueError, match="not one of the option letters"):
        rotate_options(VLMSample("Q?", "multiple choice", ["A. x", "B. y"], "<answer>C</answer>"), 1)
