"""ShapesT2I: text-to-image prompts about coloured shapes, with held-out compositions and a scene renderer.

Prompts come in two kinds:

- ``count``: one to three copies of one coloured shape, "a red circle", "two blue squares", "three green triangles";
- ``relation``: two single objects of different colours and a spatial relation,
  "a green triangle left of a yellow circle" (relations: left of, right of, above, below).

Scenes are drawn at any resolution (64x64 for the shipped model) on a black background. Geometry is in fractions of
the image side, so it does not depend on the resolution:

- every shape has a square bounding box of side ``size`` in ``SIZE_RANGE``: a circle of that diameter, an
  axis-aligned square of that side, an upright triangle of that base and height;
- boxes stay ``MARGIN`` away from the border and ``GAP`` away from each other (in x or in y);
- "A left of B": B's box centre is right of A's by at least their half-sizes plus ``GAP``, and the vertical offset is
  at most half the horizontal one (likewise for the other relations).

Edges are antialiased (drawn at 4x and box-filtered). Layouts are drawn by rejection sampling: each size uniform in
its range and each centre uniform within the margins its size leaves, the whole layout redrawn until it is valid
(that distribution conditioned on validity; not uniform over valid layouts, since a larger size leaves less room).

Held-out split (compositions never seen in training; colour index c, shape index s in the orders below):

- ``count`` prompts with ``(c + s + count) % 4 == 0`` (9 of 36, e.g. "a green triangle", "two red triangles");
- ``relation`` prompts whose unordered colour-shape pair is held out on that axis (horizontal: left/right, vertical:
  above/below): ``(cA + sA + cB + sB + axis) % 5 == 0``, axis 0 horizontal, 1 vertical. Every pair stays in training
  on the other axis, and every colour-shape pair stays in training.
"""

from __future__ import annotations

import itertools

import numpy as np
from PIL import Image, ImageDraw

from mmgrpo.registry import TASKS

COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "yellow": (1.0, 1.0, 0.0)}
BACKGROUND = (0.0, 0.0, 0.0)
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
RELATIONS = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}
"""relation -> (axis: 0 x / 1 y, sign of the first object's centre minus the second's)."""
SIZE_RANGE = (0.22, 0.34)
MARGIN = 0.04
GAP = 0.06
RESOLUTION = 64
SPLITS = ("train", "heldout")
_SUPERSAMPLE = 4


def _obj_words(colour: str, shape: str, count: int) -> str:
    return f"{COUNT_WORDS[count]} {colour} {shape}{'s' if count > 1 else ''}"


def _index(colour: str, shape: str) -> int:
    return list(COLOURS).index(colour) + SHAPES.index(shape)


def _count_item(colour: str, shape: str, count: int) -> dict:
    return {"prompt": _obj_words(colour, shape, count), "kind": "count",
            "objects": [{"colour": colour, "shape": shape, "count": count}], "relation": None}


def _relation_item(a: tuple[str, str], relation: str, b: tuple[str, str]) -> dict:
    return {"prompt": f"{_obj_words(*a, 1)} {relation} {_obj_words(*b, 1)}", "kind": "relation",
            "objects": [{"colour": a[0], "shape": a[1], "count": 1}, {"colour": b[0], "shape": b[1], "count": 1}],
            "relation": relation}


def is_heldout(item: dict) -> bool:
    """Whether a prompt spec belongs to the held-out split (rule in the module notes)."""
    objs = item["objects"]
    if item["relation"] is None:
        return (_index(objs[0]["colour"], objs[0]["shape"]) + objs[0]["count"]) % 4 == 0
    axis = RELATIONS[item["relation"]][0]
    return (sum(_index(o["colour"], o["shape"]) for o in objs) + axis) % 5 == 0


def all_items() -> list[dict]:
    """Every prompt spec of the task, both splits, in a fixed order."""
    kinds = list(itertools.product(COLOURS, SHAPES))
    items = [_count_item(c, s, n) for c, s in kinds for n in COUNT_WORDS]
    items += [_relation_item(a, r, b) for a in kinds for b in kinds for r in RELATIONS if a[0] != b[0]]
    return items


def parse_prompt(prompt: str) -> dict:
    """The spec of a ShapesT2I prompt (as in :meth:`ShapesT2I.items`); ``ValueError`` if it is not one."""
    words = prompt.lower().split()
    numbers = {w: n for n, w in COUNT_WORDS.items()}
    relation = next((r for r in RELATIONS if f" {r} " in f" {' '.join(words)} "), None)
    if relation is None:
        parts = [words]
    else:
        at = next(i for i in range(len(words)) if " ".join(words[i:i + len(relation.split())]) == relation)
        parts = [words[:at], words[at + len(relation.split()):]]
    objects = []
    for part in parts:
        if len(part) != 3 or part[0] not in numbers or part[1] not in COLOURS:
            raise ValueError(f"not a ShapesT2I prompt: {prompt!r}")
        count, shape = numbers[part[0]], part[2]
        if count > 1:
            shape = shape[:-1] if shape.endswith("s") else ""
        if shape not in SHAPES:
            raise ValueError(f"not a ShapesT2I prompt: {prompt!r}")
        objects.append({"colour": part[1], "shape": shape, "count": count})
    if relation is not None and (any(o["count"] != 1 for o in objects) or objects[0]["colour"] == objects[1]["colour"]):
        raise ValueError(f"relation prompts take two single objects of different colours: {prompt!r}")
    return {"prompt": prompt, "kind": "count" if relation is None else "relation", "objects": objects,
            "relation": relation}


def _separated(a: dict, b: dict) -> bool:
    gap_x = abs(a["x"] - b["x"]) - (a["size"] + b["size"]) / 2
    gap_y = abs(a["y"] - b["y"]) - (a["size"] + b["size"]) / 2
    return max(gap_x, gap_y) >= GAP


def relation_holds(a: dict, b: dict, relation: str) -> bool:
    """The renderer's rule for "a <relation> b" on box centres ``x``, ``y`` and sizes (module notes)."""
    axis, sign = RELATIONS[relation]
    along = (a["x"] - b["x"], a["y"] - b["y"])
    return sign * along[axis] >= (a["size"] + b["size"]) / 2 + GAP and abs(along[1 - axis]) <= abs(along[axis]) / 2


def sample_scene(spec: dict, seed: int) -> list[dict]:
    """A random valid layout for a prompt spec: one dict per object with colour, shape, size, x, y (box centre);
    all in fractions of the image side. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    wanted = [(o["colour"], o["shape"]) for o in spec["objects"] for _ in range(o["count"])]
    for _ in range(10_000):
        scene = []
        for colour, shape in wanted:
            size = rng.uniform(*SIZE_RANGE)
            lo, hi = MARGIN + size / 2, 1 - MARGIN - size / 2
            scene.append({"colour": colour, "shape": shape, "size": float(size),
                          "x": float(rng.uniform(lo, hi)), "y": float(rng.uniform(lo, hi))})
        if not all(_separated(a, b) for a, b in itertools.combinations(scene, 2)):
            continue
        if spec["relation"] is None or relation_holds(scene[0], scene[1], spec["relation"]):
            return scene
    raise RuntimeError(f"no valid layout found for {spec['prompt']!r}")


def draw(scene: list[dict], resolution: int = RESOLUTION) -> np.ndarray:
    """(3, H, W) float32 image in [0, 1] of a scene from :func:`sample_scene`."""
    side = resolution * _SUPERSAMPLE
    canvas = Image.new("RGB", (side, side), tuple(round(255 * v) for v in BACKGROUND))
    pen = ImageDraw.Draw(canvas)
    for obj in scene:
        half = obj["size"] * side / 2
        x, y = obj["x"] * side, obj["y"] * side
        fill = tuple(round(255 * v) for v in COLOURS[obj["colour"]])
        box = (x - half, y - half, x + half - 1, y + half - 1)
        if obj["shape"] == "circle":
            pen.ellipse(box, fill=fill)
        elif obj["shape"] == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(x - 0.5, y - half), (x + half - 1, y + half - 1), (x - half, y + half - 1)], fill=fill)
    small = canvas.resize((resolution, resolution), Image.BOX)
    return np.asarray(small, dtype=np.float32).transpose(2, 0, 1) / 255.0


def render(spec: dict, seed: int, resolution: int = RESOLUTION) -> np.ndarray:
    """(3, H, W) float32 image in [0, 1] of a random layout of ``spec`` (pretraining data)."""
    return draw(sample_scene(spec, seed), resolution)


class ShapesT2I:
    """The registered task object (``task:shapes_t2i``)."""

    name = "shapes_t2i"
    splits = SPLITS

    def items(self, split: str) -> list[dict]:
        """Prompt specs of a split: ``prompt``, ``kind``, ``objects`` [{colour, shape, count}], ``relation``.

        Kinds alternate (count, relation, count, ...) while both last, so the first N items are balanced."""
        if split not in SPLITS:
            raise ValueError(f"shapes_t2i has splits {SPLITS}; got {split!r}")
        chosen = [it for it in all_items() if is_heldout(it) == (split == "heldout")]
        rng = np.random.default_rng(0)
        by_kind = [[it for it in chosen if it["kind"] == kind] for kind in ("count", "relation")]
        by_kind = [[group[i] for i in rng.permutation(len(group))] for group in by_kind]
        mixed = [it for pair in itertools.zip_longest(*by_kind) for it in pair if it is not None]
        return [dict(it, task=self.name) for it in mixed]

    def data_stats(self, num_scenes: int = 2000, seed: int = 0) -> dict[str, np.ndarray]:
        """Object ``size`` and box-centre ``x``, ``y`` (fractions of the image side) over ``num_scenes`` training
        scenes, the reference for the demo's size/position distance."""
        train = self.items("train")
        rng = np.random.default_rng(seed)
        objects = [obj for i in range(num_scenes)
                   for obj in sample_scene(train[rng.integers(len(train))], seed * 1_000_003 + i)]
        return {key: np.array([o[key] for o in objects]) for key in ("size", "x", "y")}

    def render(self, spec: dict, seed: int, resolution: int = RESOLUTION) -> np.ndarray:
        """See :func:`render`."""
        return render(spec, seed, resolution)


SHAPES_T2I = TASKS.register("shapes_t2i", ShapesT2I())
