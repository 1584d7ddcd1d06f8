"""ShapesQA and MotionQA: Video-R1-format questions about coloured shapes on images and short clips.

Both tasks draw with the seeded generators of :mod:`mmgrpo.pipelines.vlm.synthetic` (64x64, black background).

- ``shapes_qa`` (images): ``colour`` "What colour is the triangle?" (A-D), ``shape`` "What shape is the red
  object?" (A-C), ``count`` "How many shapes are in the image?" (numerical, 1-4).
- ``motion_qa`` (8-frame clips, 4 fps): ``direction`` "Which direction does the red circle move?" (A-D), ``order``
  "Which shape appears first?" (A-D: the two shapes of the clip and two absent ones), ``count`` "How many shapes
  appear in the video?" (numerical, 1-4; the shapes appear one after the other, every 2 frames).

Every item carries ``solution`` (``<answer>X</answer>``) and ``think``, the short reasoning of the SFT target
``<think>{think}</think><answer>X</answer>``. In option questions the think text never starts with the answer's word,
so the word is tokenised as in the options (``" green"``, not ``"green"``); a count's think text may start with it.

Options are listed in a fixed vocabulary order (``VOCABULARY``: colours, then shapes, then directions), not
shuffled: in colour, shape and direction questions a letter always names the same word (A is red in every colour
question); order questions list their four shapes sorted the same way. With shuffled options the tiny shipped VLM
learned no multiple-choice kind above chance within CPU budgets: it does not learn the look-up "which letter holds
the word I named" (docs/demo.md). The answer words are uniform over their vocabularies, so every letter is right
about equally often and always answering one letter scores about 1/n.

Splits: item ``i`` of a kind is built from seed ``2*i`` in ``train`` and ``2*i + 1`` in ``heldout``. The held-out
split is unseen seeds (fresh layouts, motions, timings and decoys) over the same colours and shapes; it is
not compositional. :func:`write_split` materialises a split to ``{split}.jsonl`` plus PNG / MP4 files, and
:func:`cached_split` does so once per machine for a ``data.train_file: task:...`` source.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from mmgrpo.pipelines.vlm.synthetic import (
    COLOURS,
    DIRECTIONS,
    SHAPES,
    draw_scene,
    make_motion_clip,
    random_scene,
    write_mp4,
)
from mmgrpo.registry import TASKS

SPLITS = ("train", "heldout")
SIZE = 64
FRAMES = 8
FPS = 4
MAX_COUNT = 4


VOCABULARY = (*COLOURS, *SHAPES, *DIRECTIONS)
"""The order options are listed in: by colour, then shape ("red circle" before "red square" before "green circle");
directions as in ``DIRECTIONS``."""


def _vocabulary_rank(option: str) -> tuple[int, ...]:
    return tuple(VOCABULARY.index(word) for word in option.split())


def _letters(choices: list[str], correct: str) -> tuple[list[str], str]:
    """Options ``["A. ...", ...]`` in ``VOCABULARY`` order and the letter of ``correct``."""
    order = sorted(choices, key=_vocabulary_rank)
    return [f"{chr(65 + k)}. {c}" for k, c in enumerate(order)], chr(65 + order.index(correct))


def _item(kind: str, problem: str, options: list[str], answer: str, think: str, scene: dict) -> dict:
    return {"kind": kind, "problem": problem, "problem_type": "multiple choice" if options else "numerical",
            "options": options, "solution": f"<answer>{answer}</answer>", "think": think, "scene": scene}


def _image_item(kind: str, seed: int) -> dict:
    rng = np.random.default_rng([seed, 7])
    if kind == "count":
        n = int(rng.integers(1, MAX_COUNT + 1))
        objects = random_scene(n, SIZE, seed=seed)
        return _item(kind, "How many shapes are in the image?", [], str(n), f"{n} shapes", {"objects": objects})
    objects = random_scene(int(rng.integers(1, 4)), SIZE, seed=seed, distinct=True)
    target = objects[int(rng.integers(len(objects)))]
    if kind == "colour":
        options, letter = _letters(list(COLOURS), target["colour"])
        return _item(kind, f"What colour is the {target['shape']}?", options, letter,
                     f"the {target['shape']} is {target['colour']}", {"objects": objects})
    options, letter = _letters(list(SHAPES), target["shape"])
    return _item(kind, f"What shape is the {target['colour']} object?", options, letter,
                 f"the {target['colour']} object is a {target['shape']}", {"objects": objects})


def _video_item(kind: str, seed: int) -> dict:
    rng = np.random.default_rng([seed, 11])
    if kind == "direction":
        direction = str(rng.choice(list(DIRECTIONS)))
        colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
        options, letter = _letters(list(DIRECTIONS), direction)
        return _item(kind, f"Which direction does the {colour} {shape} move?", options, letter,
                     f"it moves {direction}", {"direction": direction, "colour": colour, "shape": shape, "seed": seed})
    if kind == "order":
        objects = random_scene(2, SIZE, seed=seed, distinct=True)
        names = [f"{o['colour']} {o['shape']}" for o in objects]
        absent = [f"{c} {s}" for c in COLOURS for s in SHAPES if f"{c} {s}" not in names]
        decoys = [absent[i] for i in rng.choice(len(absent), 2, replace=False)]
        options, letter = _letters(names + decoys, names[0])
        starts = [int(rng.choice([0, 2])), 4]
        return _item(kind, "Which shape appears first?", options, letter, f"the {names[0]} comes first",
                     {"objects": objects, "starts": starts})
    n = int(rng.integers(1, MAX_COUNT + 1))
    objects = random_scene(n, SIZE, seed=seed)
    return _item(kind, "How many shapes appear in the video?", [], str(n), f"{n} shapes",
                 {"objects": objects, "starts": [2 * k for k in range(n)]})


class QATask:
    """A registered QA task: ``items(split, n)`` specs and ``render(item)`` pixels."""

    name = ""
    kinds: tuple[str, ...] = ()
    data_type = ""
    splits = SPLITS

    def item(self, kind: str, index: int, split: str) -> dict:
        """Item ``index`` of ``kind`` in ``split`` (seed ``2*index``, +1 in heldout)."""
        if split not in SPLITS:
            raise ValueError(f"{self.name} has splits {SPLITS}; got {split!r}")
        if kind not in self.kinds:
            raise ValueError(f"{self.name} has kinds {self.kinds}; got {kind!r}")
        seed = 2 * index + (split == "heldout")
        spec = _image_item(kind, seed) if self.data_type == "image" else _video_item(kind, seed)
        return {"id": f"{self.name}-{kind}-{split}-{index:04d}", "task": self.name, "data_type": self.data_type,
                **spec}

    def items(self, split: str, n: int = 64, start: int = 0) -> list[dict]:
        """``n`` items per kind from index ``start`` on, kinds interleaved (colour, shape, count, colour, ...)."""
        return [self.item(kind, i, split) for i in range(start, start + n) for kind in self.kinds]


class ShapesQA(QATask):
    """Image questions: colour of a shape, which shape, how many shapes."""

    name = "shapes_qa"
    kinds = ("colour", "shape", "count")
    data_type = "image"

    def render(self, item: dict) -> np.ndarray:
        """(64, 64, 3) uint8 image."""
        return draw_scene(item["scene"]["objects"], SIZE)


class MotionQA(QATask):
    """Clip questions: direction of motion, order of appearance, count over time."""

    name = "motion_qa"
    kinds = ("direction", "order", "count")
    data_type = "video"

    def render(self, item: dict) -> np.ndarray:
        """(8, 64, 64, 3) uint8 clip."""
        scene = item["scene"]
        if item["kind"] == "direction":
            return make_motion_clip(scene["direction"], scene["colour"], scene["shape"], FRAMES, SIZE,
                                    seed=scene["seed"])
        return np.stack([draw_scene([o for o, t0 in zip(scene["objects"], scene["starts"]) if t >= t0], SIZE)
                         for t in range(FRAMES)])


SHAPES_QA = TASKS.register("shapes_qa", ShapesQA())
MOTION_QA = TASKS.register("motion_qa", MotionQA())


def write_split(out_dir: str | os.PathLike, split: str, n: int, tasks: tuple[str, ...] = ("shapes_qa", "motion_qa"),
                start: int = 0, progress: bool = False, name: str | None = None) -> int:
    """Write ``n`` items per kind of each task, from index ``start`` on (so two calls with disjoint index ranges give
    disjoint seeds), to ``out_dir/{name}.jsonl`` (Video-R1 records with the extra fields
    ``task``, ``kind``, ``think``, ``id``) and their media to ``out_dir/{name}/`` (PNG, H.264 MP4); ``name``
    defaults to ``split`` (another name keeps a second range of one split apart, e.g. a validation set drawn from
    ``train`` seeds). Paths are relative to ``out_dir``. Returns the number of records."""
    out = Path(out_dir)
    name = name or split
    (out / name).mkdir(parents=True, exist_ok=True)
    records = []
    qa_tasks = [TASKS.get(task_name) for task_name in tasks]
    bar = tqdm(total=n * sum(len(task.kinds) for task in qa_tasks), desc=f"writing {name}", unit="item",
               disable=not progress)
    for task in qa_tasks:
        for item in task.items(split, n, start):
            bar.update()
            pixels = task.render(item)
            path = f"{name}/{item['id']}.{'png' if item['data_type'] == 'image' else 'mp4'}"
            if item["data_type"] == "image":
                Image.fromarray(pixels).save(out / path, optimize=True)
            else:
                write_mp4(out / path, pixels, FPS)
            records.append({"problem": item["problem"], "problem_type": item["problem_type"],
                            "options": item["options"], "solution": item["solution"], "path": path,
                            "data_type": item["data_type"], "task": item["task"], "kind": item["kind"],
                            "think": item["think"], "id": item["id"]})
    bar.close()
    (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return len(records)


def generator_version() -> str:
    """12 hex digits of the SHA-256 of the code that draws the items (this module and the shape renderer)."""
    from mmgrpo.pipelines.vlm import synthetic

    digest = hashlib.sha256(Path(__file__).read_bytes() + Path(synthetic.__file__).read_bytes())
    return digest.hexdigest()[:12]


def cached_split(cache_dir: str | os.PathLike, split: str, n: int, tasks: tuple[str, ...], start: int = 0) -> Path:
    """The folder holding ``write_split(folder, split, n, tasks, start)``, written once under ``cache_dir``.

    The folder name holds the arguments and :func:`generator_version`, so changed drawing code writes a new folder
    instead of reusing stale media. The split is written to a temporary folder and renamed into place: an
    interrupted write leaves nothing behind, and of two processes writing at once, one folder wins."""
    cache = Path(cache_dir).expanduser()
    folder = cache / f"{'+'.join(tasks)}-{split}-{start}-{n}-{generator_version()}"
    if (folder / f"{split}.jsonl").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=cache))
    try:
        write_split(tmp, split, n, tasks, start, progress=True)
        os.replace(tmp, folder)
    except OSError:
        if not (folder / f"{split}.jsonl").is_file():  # not another process's finished copy: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
