"""Deterministic synthetic images, clips and questions for the VLM pipeline (the offline ``vlm_tiny`` data set).

Scenes are coloured shapes (:data:`COLOURS` x :data:`SHAPES`) on a plain black background, drawn at 4x and
box-filtered down, so edges are antialiased. Every generator is pure: the same arguments give the same pixels.

- :func:`make_motion_clip`: one shape moving left, right, up or down ("Which direction does the red circle move?").
- :func:`make_count_clip`: several shapes drifting without touching ("How many shapes appear in the video?").
- :func:`random_scene` + :func:`draw_scene`: still images for colour, shape and count questions.
- :func:`write_tiny_dataset`: the shipped ``assets/data/vlm_tiny`` folder (``scripts/make_tiny_vlm_data.py``).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (230, 30, 30), "green": (30, 200, 50), "blue": (40, 80, 250), "yellow": (240, 220, 30)}
"""Colour name -> RGB (uint8)."""
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
"""Direction -> unit step (dx, dy) in image coordinates (y grows downwards)."""
BACKGROUND = (0, 0, 0)
MARGIN = 0.04
"""Gap between a shape's box and the image border, as a fraction of the image side."""
_SUPERSAMPLE = 4


def draw_scene(objects: list[dict], size: int = 64) -> np.ndarray:
    """(size, size, 3) uint8 image of ``objects``: dicts with ``shape``, ``colour``, centre ``x``, ``y`` and
    half-side ``r``, in pixels. A circle has radius ``r``, a square side ``2r``, a triangle base and height ``2r``."""
    side = size * _SUPERSAMPLE
    canvas = Image.new("RGB", (side, side), BACKGROUND)
    pen = ImageDraw.Draw(canvas)
    for obj in objects:
        x, y, r = (obj[k] * _SUPERSAMPLE for k in ("x", "y", "r"))
        box = (x - r, y - r, x + r - 1, y + r - 1)
        fill = COLOURS[obj["colour"]]
        if obj["shape"] == "circle":
            pen.ellipse(box, fill=fill)
        elif obj["shape"] == "square":
            pen.rectangle(box, fill=fill)
        elif obj["shape"] == "triangle":
            pen.polygon([(x, y - r), (x + r - 1, y + r - 1), (x - r, y + r - 1)], fill=fill)
        else:
            raise ValueError(f"unknown shape {obj['shape']!r}; valid: {', '.join(SHAPES)}")
    return np.asarray(canvas.resize((size, size), Image.Resampling.BOX))


def _apart(a: dict, b: dict, gap: float) -> bool:
    """Whether the square boxes of two objects are at least ``gap`` pixels apart in x or in y."""
    return max(abs(a["x"] - b["x"]), abs(a["y"] - b["y"])) - a["r"] - b["r"] >= gap


def random_scene(count: int, size: int = 64, seed: int = 0, distinct: bool = False) -> list[dict]:
    """``count`` non-overlapping random objects (see :func:`draw_scene`): radii and centres drawn uniformly (centres
    within the margins each radius leaves), the whole layout redrawn until no two objects overlap.

    With ``distinct``, no two objects share a colour or a shape (so ``count <= 3``). Deterministic in ``seed``."""
    if distinct and count > len(SHAPES):
        raise ValueError(f"at most {len(SHAPES)} objects can have distinct shapes, got {count}")
    rng = np.random.default_rng([seed, count, int(distinct)])
    for _ in range(10_000):
        if distinct:
            colours = rng.permutation(list(COLOURS))[:count]
            shapes = rng.permutation(list(SHAPES))[:count]
        else:
            colours = rng.choice(list(COLOURS), count)
            shapes = rng.choice(list(SHAPES), count)
        scene = []
        for colour, shape in zip(colours, shapes):
            r = rng.uniform(0.08, 0.12) * size
            lo, hi = MARGIN * size + r, size - MARGIN * size - r
            scene.append({"shape": str(shape), "colour": str(colour), "r": float(r),
                          "x": float(rng.uniform(lo, hi)), "y": float(rng.uniform(lo, hi))})
        if all(_apart(a, b, 0.04 * size) for a, b in itertools.combinations(scene, 2)):
            return scene
    raise RuntimeError(f"no layout of {count} objects found at size {size}")


def make_motion_clip(direction: str, colour: str, shape: str, frames: int = 16, size: int = 64,
                     seed: int = 0) -> np.ndarray:
    """(frames, size, size, 3) uint8 clip of one shape moving in a straight line in ``direction``.

    It crosses about 45% of the frame at constant speed; its size, start and cross-axis position come from
    ``seed``."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; valid: {', '.join(DIRECTIONS)}")
    rng = np.random.default_rng([seed, frames, size])
    r = rng.uniform(0.10, 0.13) * size
    lo, hi = MARGIN * size + r, size - MARGIN * size - r
    travel = 0.45 * size
    start = rng.uniform(lo, hi - travel)
    cross = rng.uniform(lo, hi)
    dx, dy = DIRECTIONS[direction]
    clip = []
    for t in range(frames):
        along = start + travel * t / max(frames - 1, 1)
        if dx + dy < 0:  # left or up: run the path backwards
            along = lo + hi - along
        x, y = (along, cross) if dx else (cross, along)
        clip.append(draw_scene([{"shape": shape, "colour": colour, "x": x, "y": y, "r": r}], size))
    return np.stack(clip)


def make_count_clip(count: int, frames: int = 16, size: int = 64, seed: int = 0) -> np.ndarray:
    """(frames, size, size, 3) uint8 clip of ``count`` random shapes, each drifting slowly in its own direction;
    they never overlap and stay inside the frame."""
    rng = np.random.default_rng([seed, count, frames, size])
    drift = 0.15 * size
    for _ in range(1000):
        scene = random_scene(count, size, seed=int(rng.integers(2**31)))
        steps = [DIRECTIONS[str(d)] for d in rng.choice(list(DIRECTIONS), count)]
        path = [[{**o, "x": o["x"] + dx * drift * t / max(frames - 1, 1),
                  "y": o["y"] + dy * drift * t / max(frames - 1, 1)} for o, (dx, dy) in zip(scene, steps)]
                for t in range(frames)]
        inside = all(o["r"] <= o[k] <= size - o["r"] for objs in path for o in objs for k in ("x", "y"))
        if inside and all(_apart(a, b, 1.0) for objs in path for a, b in itertools.combinations(objs, 2)):
            return np.stack([draw_scene(objs, size) for objs in path])
    raise RuntimeError(f"no drifting layout of {count} objects found at size {size}")


def rgb_to_yuv420p(frame: np.ndarray) -> np.ndarray:
    """(H,W,3) uint8 RGB (even H, W) -> (3H/2, W) uint8 planar YUV 4:2:0 (PyAV's ``yuv420p`` layout), BT.601
    limited range, chroma averaged over 2x2 blocks."""
    rgb = frame.astype(np.float64)
    y = 16 + rgb @ np.array([65.481, 128.553, 24.966]) / 255
    cb = 128 + rgb @ np.array([-37.797, -74.203, 112.0]) / 255
    cr = 128 + rgb @ np.array([112.0, -93.786, -18.214]) / 255
    h, w = y.shape
    planes = [y] + [c.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3)).reshape(h // 4, w) for c in (cb, cr)]
    return np.clip(np.rint(np.concatenate(planes)), 0, 255).astype(np.uint8)


def write_mp4(path: str | os.PathLike, frames: np.ndarray, fps: int) -> None:
    """Encode (T,H,W,3) uint8 RGB frames (H, W multiples of 4) as H.264 yuv420p MP4 with PyAV (libx264, CRF 18,
    one thread). The colour conversion is done here (:func:`rgb_to_yuv420p`), not by swscale, whose SIMD paths
    round differently from run to run; so the same frames give the same bytes with the same libx264."""
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": "18", "threads": "1"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb_to_yuv420p(frame), format="yuv420p")))
        container.mux(stream.encode())


def _choice_question(rng: np.random.Generator, choices: list[str], correct: str) -> tuple[list[str], str]:
    """Options ``["A. ...", ...]`` in a random order and the solution ``<answer>X</answer>``."""
    order = [choices[i] for i in rng.permutation(len(choices))]
    letters = [chr(ord("A") + i) for i in range(len(order))]
    return [f"{k}. {c}" for k, c in zip(letters, order)], f"<answer>{letters[order.index(correct)]}</answer>"


def _record(task: str, problem: str, kind: str, options: list[str], solution: str, path: str, data_type: str):
    return {"problem": problem, "problem_type": kind, "options": options, "solution": solution, "path": path,
            "data_type": data_type, "task": task, "data_source": "mmgrpo-vlm-tiny"}


def tiny_records(out_dir: str | os.PathLike, seed: int = 0, frames: int = 16, size: int = 64,
                 fps: int = 4) -> list[dict]:
    """Write the media of the tiny data set into ``out_dir`` (``videos/``, ``images/``) and return its 48 Video-R1
    records, task by task, paths relative to ``out_dir``:

    - ``motion_direction`` (x16, multiple choice A-D): "Which direction does the <colour> <shape> move?";
    - ``video_count`` (x8, numerical, 1-4): "How many shapes appear in the video?";
    - ``image_colour`` (x8, multiple choice A-D), ``image_shape`` (x8, A-C), ``image_count`` (x8, numerical, 1-5).
    """
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(16):
        direction = list(DIRECTIONS)[i % 4]
        colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
        name = f"videos/motion_{i:02d}.mp4"
        write_mp4(out / name, make_motion_clip(direction, colour, shape, frames, size, seed=int(rng.integers(2**31))),
                  fps)
        options, solution = _choice_question(rng, list(DIRECTIONS), direction)
        records.append(_record("motion_direction", f"Which direction does the {colour} {shape} move?",
                               "multiple choice", options, solution, name, "video"))
    for i in range(8):
        count = i % 4 + 1
        name = f"videos/count_{i:02d}.mp4"
        write_mp4(out / name, make_count_clip(count, frames, size, seed=int(rng.integers(2**31))), fps)
        records.append(_record("video_count", "How many shapes appear in the video?", "numerical", [],
                               f"<answer>{count}</answer>", name, "video"))
    for task in ("image_colour", "image_shape", "image_count"):
        for i in range(8):
            name = f"images/{task.split('_')[1]}_{i:02d}.png"
            if task == "image_count":
                scene = random_scene(i % 5 + 1, size, seed=int(rng.integers(2**31)))
            else:
                scene = random_scene(i % 3 + 1, size, seed=int(rng.integers(2**31)), distinct=True)
            Image.fromarray(draw_scene(scene, size)).save(out / name)
            target = scene[int(rng.integers(len(scene)))]
            if task == "image_colour":
                options, solution = _choice_question(rng, list(COLOURS), target["colour"])
                records.append(_record(task, f"What colour is the {target['shape']}?", "multiple choice", options,
                                       solution, name, "image"))
            elif task == "image_shape":
                options, solution = _choice_question(rng, list(SHAPES), target["shape"])
                records.append(_record(task, f"What shape is the {target['colour']} object?", "multiple choice",
                                       options, solution, name, "image"))
            else:
                records.append(_record(task, "How many shapes are in the image?", "numerical", [],
                                       f"<answer>{len(scene)}</answer>", name, "image"))
    return records


def write_tiny_dataset(out_dir: str | os.PathLike, seed: int = 0) -> dict[str, int]:
    """Write the ``vlm_tiny`` data set: media (:func:`tiny_records`), ``train.jsonl`` and ``eval.jsonl`` and a
    README. The k-th record of a task goes to eval when ``(k + k // 4) % 4 == 3``: a quarter of each task, covering
    all four directions (36 train, 12 eval). Returns the split sizes."""
    out = Path(out_dir)
    records = tiny_records(out, seed)
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    seen: dict[str, int] = {}
    for i, record in enumerate(records):
        k = seen[record["task"]] = seen.get(record["task"], -1) + 1
        splits["eval" if (k + k // 4) % 4 == 3 else "train"].append({"problem_id": i, **record})
    for split, rows in splits.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "README.md").write_text(
        "# vlm_tiny\n\n"
        f"Generated by `scripts/make_tiny_vlm_data.py --seed {seed}` (`mmgrpo.pipelines.vlm.synthetic`); do not edit.\n\n"
        "Video-R1-format questions about coloured shapes on black: 24 clips (`videos/`, 16 frames, 64x64, 4 fps,\n"
        "H.264) asking the direction of motion (multiple choice) or the number of shapes (numerical), and 24 PNG\n"
        "images (`images/`, 64x64) asking a colour, a shape (multiple choice) or a count (numerical).\n"
        f"`train.jsonl` holds {len(splits['train'])} records and `eval.jsonl` {len(splits['eval'])}; paths are relative "
        "to this folder.\n")
    return {split: len(rows) for split, rows in splits.items()}
