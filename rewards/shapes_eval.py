"""``shapes_eval``: a GenEval-like, rule-based evaluator of ShapesT2I images, and the demo's honesty metrics.

How an image is read (all thresholds in fractions of the image side or of [0, 1] intensities, so any resolution
works):

1. **Pixels.** A pixel belongs to palette colour c when its projection on the black-to-c line covers at least half
   of c (``alpha >= 0.5``, the 50% contour of an antialiased or blurred edge) and it lies within ``COLOUR_TOL`` of
   that line (the closest such colour wins). It is background when it is within ``BACKGROUND_TOL`` of the background.
2. **Objects.** 8-connected components of each colour. Components smaller than ``SPECK_AREA`` are specks (stray
   pixels); every other component is an object: its size is the longer side of its bounding box, its position the
   box centre. A component that lies within ``EDGE_BAND`` of larger objects of two other colours, and nowhere else,
   is the antialiased seam where they meet (a red edge against a green one blends to yellow), not an object.
3. **Shape.** The object's mask inside its box gives three features: fill ratio, fill of the two top corners and of
   the two bottom corners (corner triangles, see :func:`shape_features`). A shape is recognised when the box aspect
   is within ``ASPECT_RANGE`` and the features fall in its ``SHAPE_RULES`` box; otherwise it is unknown.

Sub-scores, one per image:

- ``count``: matched objects per colour over max(expected, detected) objects (1 = exact counts, nothing extra);
- ``colour``: Jaccard index of the detected and the prompted colour sets;
- ``shape``: objects of the prompted colour and shape, over max(expected, detected) objects;
- ``size``: fraction of detected objects whose size is in the data's ``SIZE_RANGE`` (+- ``SIZE_TOL``);
- ``position``: 1 if no object touches the border and, for a relation prompt, the relation holds on box centres
  (signed offset along the axis > 0 and larger than the offset across it);
- ``background``: 1 if stray pixels (neither background nor object, further than ``EDGE_BAND`` from every object)
  are at most ``STRAY_MAX`` of the image;
- ``score``: 1 only if all of the above are 1. This is the honest accuracy.

The prompt's spec is read from ``meta`` (``objects``, ``relation``, as ``task:shapes_t2i`` items carry it), else
parsed from the prompt.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch
from scipy import ndimage

from mmgrpo.registry import REWARDS
from mmgrpo.tasks.shapes import BACKGROUND, COLOURS, RELATIONS, SIZE_RANGE, parse_prompt

from .base import POINTWISE, Reward, RewardBatch
from .checks import as_rgb_images, images_or_raise

COLOUR_TOL = 0.25
BACKGROUND_TOL = 0.3
SPECK_AREA = 0.0025
"""Components below this fraction of the image area (10 px at 64x64) are specks, not objects."""
CORNER = 0.3
SHAPE_RULES = {
    "circle": ((0.65, 0.92), (0.0, 0.45), (0.0, 0.45)),
    "square": ((0.88, 1.0), (0.5, 1.0), (0.5, 1.0)),
    "triangle": ((0.4, 0.72), (0.0, 0.2), (0.5, 1.0)),
}
"""shape -> allowed (fill, top-corner fill, bottom-corner fill) ranges. The corner ranges exclude each other. Rendered
shapes measure circle (0.79, 0.03, 0.01), square (1, 1, 1), triangle (0.55, 0, 0.75); blurred (sigma 1 px) the
extremes are circle fill 0.69-0.88 / corners <= 0.4, square fill >= 0.92 / corners >= 0.5, triangle fill
0.50-0.67 / bottom >= 0.55."""
ASPECT_RANGE = (0.75, 1 / 0.75)
SIZE_TOL = 0.03
EDGE_BAND = 1 / 32
STRAY_MAX = 0.005
MAX_OBJECTS = 16
"""Components beyond the largest MAX_OBJECTS are counted but not analysed (noise images)."""
SUB_SCORES = ("count", "colour", "shape", "size", "position", "background")
EIGHT_CONNECTED = np.pad(np.ones((1, 1, 3, 3), dtype=bool), ((1, 1), (1, 1), (0, 0), (0, 0)))
"""Connectivity of an object's pixels over (B, K, H, W) colour masks: the 8 neighbours within one image and colour
(a diagonal step joins an antialiased edge)."""


def _pixel_labels(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, W) colour index into COLOURS (-1: none) and (B, H, W) background mask, for (B, 3, H, W) images."""
    palette = torch.tensor(list(COLOURS.values()), dtype=images.dtype)
    dot = torch.einsum("bchw,kc->bkhw", images, palette)
    alpha = dot / (palette**2).sum(1).view(1, -1, 1, 1)
    # squared distance to the line through c: |x|^2 - (x.c)^2 / |c|^2 (no (B, K, 3, H, W) difference tensor)
    residual_sq = (images.square().sum(1, keepdim=True) - alpha * dot).clamp_min(0)
    residual_sq = torch.where((alpha >= 0.5) & (residual_sq <= COLOUR_TOL**2), residual_sq, torch.inf)
    best, label = residual_sq.min(1)
    label = torch.where(torch.isfinite(best), label, -1)
    background = torch.tensor(BACKGROUND, dtype=images.dtype).view(1, 3, 1, 1)
    return label, (images - background).square().sum(1) <= BACKGROUND_TOL**2


def shape_features(crop: np.ndarray) -> np.ndarray:
    """(fill ratio, top-corner fill, bottom-corner fill) of a boolean object mask cropped to its bounding box.

    A corner region is the triangle of pixels whose centres are within ``CORNER`` (L1, in fractions of the box side)
    of that box corner."""
    h, w = crop.shape
    v = (np.arange(h)[:, None] + 0.5) / h
    u = (np.arange(w)[None, :] + 0.5) / w

    def fill(region: np.ndarray) -> float:
        """NaN for an empty region (a box of at most 3 px a side): no shape rule matches it."""
        pixels = crop[np.broadcast_to(region, crop.shape)]
        return float(pixels.mean()) if pixels.size else float("nan")

    top = (fill(u + v < CORNER) + fill(1 - u + v < CORNER)) / 2
    bottom = (fill(u + 1 - v < CORNER) + fill(2 - u - v < CORNER)) / 2
    return np.array([crop.mean(), top, bottom])


def classify_shape(crop: np.ndarray) -> str | None:
    """The shape name of a boolean mask cropped to its box (``SHAPE_RULES``), or None when it is none of them."""
    h, w = crop.shape
    if not ASPECT_RANGE[0] <= w / h <= ASPECT_RANGE[1]:
        return None
    features = shape_features(crop)
    for shape, ranges in SHAPE_RULES.items():
        if all(lo <= f <= hi for f, (lo, hi) in zip(features, ranges)):
            return shape
    return None


def dilate(mask: np.ndarray, band: int) -> np.ndarray:
    """(H, W) boolean: the pixels within ``band`` px (in x and in y) of a pixel of the (H, W) boolean ``mask``."""
    return ndimage.binary_dilation(mask, np.ones((2 * band + 1, 2 * band + 1), dtype=bool))


def is_seam(mask: np.ndarray, near_others: list[np.ndarray]) -> bool:
    """Whether the (H, W) boolean component ``mask`` is a blend seam: it touches the bands (``near_others``, one
    (H, W) mask per other colour, :func:`dilate` of its objects) of two colours or more and has no pixel outside
    them."""
    touched = [n for n in near_others if (mask & n).any()]
    return len(touched) >= 2 and not (mask & ~np.logical_or.reduce(touched)).any()


def detect_objects(images: torch.Tensor) -> tuple[list[list[dict]], torch.Tensor]:
    """Objects and stray-pixel fraction of (B, 3, H, W) images in [0, 1].

    Returns, per image, a list of objects (``colour``, ``shape`` (None: unknown), ``size`` and ``x`` (box centre) in
    fractions of the image width, ``y`` (box centre) in fractions of its height, ``area`` in pixels, ``border``:
    touches the border), largest first; and a
    (B,) tensor of stray-pixel fractions (on the CPU: the components are found with scipy, whatever the images'
    device)."""
    images = as_rgb_images(images).detach().cpu()
    b, _, h, w = images.shape
    label, background = _pixel_labels(images)
    masks = label.numpy()[:, None] == np.arange(len(COLOURS)).reshape(1, -1, 1, 1)
    comps, _ = ndimage.label(masks, structure=EIGHT_CONNECTED)  # ids are unique over the whole (B, K, H, W)
    min_area = SPECK_AREA * h * w
    band = max(1, round(EDGE_BAND * w))
    results, stray = [], []
    for i in range(b):
        found, object_pixels = [], np.zeros((h, w), dtype=bool)
        for k, colour in enumerate(COLOURS):
            ids, areas = np.unique(comps[i, k], return_counts=True)
            for cid, area in zip(ids, areas):
                if cid and area >= min_area:
                    found.append((int(area), colour, comps[i, k] == cid))
        found.sort(key=lambda f: -f[0])
        objects, near = [], {}  # near: colour -> (H, W) pixels within the band of its objects so far
        for area, colour, mask in found:
            object_pixels |= mask
            if is_seam(mask, [n for c, n in near.items() if c != colour]):
                continue
            if len(objects) >= MAX_OBJECTS:
                objects.append({"colour": colour, "shape": None, "size": np.nan, "x": np.nan, "y": np.nan,
                                "area": area, "border": False})
                continue
            near[colour] = near.get(colour, False) | dilate(mask, band)
            rows, cols = np.nonzero(mask)
            r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
            objects.append({"colour": colour, "shape": classify_shape(mask[r0:r1, c0:c1]),
                            "size": max(r1 - r0, c1 - c0) / w, "x": (c0 + c1) / 2 / w, "y": (r0 + r1) / 2 / h,
                            "area": area, "border": bool(r0 == 0 or c0 == 0 or r1 == h or c1 == w)})
        stray.append(float((~background[i] & ~torch.from_numpy(dilate(object_pixels, band))).float().mean()))
        results.append(objects)
    return results, torch.tensor(stray, dtype=torch.float64)


class SharedDetections:
    """:func:`detect_objects` of the last batch, shared by the ShapesT2I rewards: a zoo scores one batch with
    several of them (concurrently, from its threads) and the detection is most of their cost, so it runs once per
    batch. The cache holds a weak reference to ``batch.images`` and its version counter: another tensor, or the
    same one modified in place, is detected again. An inference tensor (made in ``torch.inference_mode()``) has no
    version counter and is detected each time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._images: weakref.ref | None = None
        self._version = -1
        self._result: tuple[list[list[dict]], torch.Tensor] | None = None

    def __call__(self, batch: RewardBatch, reward: str) -> tuple[list[list[dict]], torch.Tensor]:
        """:func:`detect_objects` of ``batch.images`` (checked as ``reward``'s input); the result is read-only."""
        images = batch.images
        if images is None or images.is_inference():
            return detect_objects(images_or_raise(batch, reward))
        with self._lock:
            cached = self._images is not None and self._images() is images and images._version == self._version
            if not cached:
                self._result = detect_objects(images_or_raise(batch, reward))
                self._images, self._version = weakref.ref(images), images._version
            return self._result


DETECTIONS = SharedDetections()


def _spec(prompt: str, meta: dict) -> dict:
    return meta if "objects" in meta else parse_prompt(prompt)


def _relation_ok(objects: list[dict], spec: dict) -> bool:
    first, second = (spec["objects"][j]["colour"] for j in (0, 1))
    a = [o for o in objects if o["colour"] == first]
    b = [o for o in objects if o["colour"] == second]
    if len(a) != 1 or len(b) != 1:
        return False
    axis, sign = RELATIONS[spec["relation"]]
    along = (a[0]["x"] - b[0]["x"], a[0]["y"] - b[0]["y"])
    return sign * along[axis] > 0 and abs(along[axis]) > abs(along[1 - axis])


def judge(objects: list[dict], stray: float, spec: dict) -> dict[str, float]:
    """The sub-scores and ``score`` of one image's detections against a prompt spec (module notes)."""
    expected = {o["colour"]: (o["shape"], o["count"]) for o in spec["objects"]}
    n_exp = sum(n for _, n in expected.values())
    denom = max(n_exp, len(objects))
    per_colour = {c: [o for o in objects if o["colour"] == c] for c in COLOURS}
    detected_colours = {o["colour"] for o in objects}
    size_ok = [SIZE_RANGE[0] - SIZE_TOL <= o["size"] <= SIZE_RANGE[1] + SIZE_TOL for o in objects]
    inside = bool(objects) and not any(o["border"] for o in objects)
    scores = {
        "count": sum(min(n, len(per_colour[c])) for c, (_, n) in expected.items()) / denom,
        "colour": len(detected_colours & set(expected)) / len(detected_colours | set(expected)),
        "shape": sum(min(n, sum(o["shape"] == s for o in per_colour[c])) for c, (s, n) in expected.items()) / denom,
        "size": float(np.mean(size_ok)) if objects else 0.0,
        "position": float(inside and (spec["relation"] is None or _relation_ok(objects, spec))),
        "background": float(stray <= STRAY_MAX),
    }
    scores["score"] = float(all(v == 1.0 for v in scores.values()))
    return scores


@REWARDS.register("shapes_eval", kind=POINTWISE, modality="image",
                  description="GenEval-like ShapesT2I check: colour, shape, count, position, size, background")
class ShapesEval(Reward):
    """Rule-based ShapesT2I evaluator (see the module notes). Returns ``score`` (1 only if everything holds) and the
    sub-scores ``count``, ``colour``, ``shape``, ``size``, ``position``, ``background`` in [0, 1]."""

    modality = "image"

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        detections, stray = DETECTIONS(batch, "shapes_eval")
        rows = [judge(objs, float(s), _spec(p, m))
                for objs, s, p, m in zip(detections, stray, batch.prompts, batch.meta)]
        return {k: torch.tensor([r[k] for r in rows], dtype=torch.float64) for k in ("score", *SUB_SCORES)}


@REWARDS.register("shapes_partial", kind=POINTWISE, modality="image",
                  description="ShapesT2I partial credit: the mean of the six shapes_eval sub-scores, in [0, 1]")
class ShapesPartial(Reward):
    """The mean of the ``shapes_eval`` sub-scores (count, colour, shape, size, position, background): partial
    credit for training, so a group in which no sample passes every check still ranks its samples. ``shapes_eval``
    ``score`` stays the honest metric."""

    modality = "image"

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        detections, stray = DETECTIONS(batch, "shapes_partial")
        rows = [judge(objs, float(s), _spec(p, m))
                for objs, s, p, m in zip(detections, stray, batch.prompts, batch.meta)]
        return torch.tensor([sum(r[k] for k in SUB_SCORES) / len(SUB_SCORES) for r in rows], dtype=torch.float64)


RELATION_SCALE = 0.3
"""Offset (fraction of the image side) at which ``shapes_layout`` saturates: about the centre distance of two
objects placed side by side in the data."""


def relation_margin(objects: list[dict], spec: dict) -> float:
    """Signed offset of the first prompted object from the second along the relation's axis, positive in the
    prompted direction, over ``RELATION_SCALE`` and clipped to [-1, 1]; -1 when either object is missing; NaN for a
    prompt without a relation. Each object is the largest detection of its colour."""
    if spec["relation"] is None:
        return float("nan")
    found = []
    for obj in spec["objects"][:2]:
        same = [o for o in objects if o["colour"] == obj["colour"] and np.isfinite(o["x"])]
        if not same:
            return -1.0
        found.append(same[0])
    axis, sign = RELATIONS[spec["relation"]]
    key = "xy"[axis]
    offset = sign * (found[0][key] - found[1][key])
    return float(np.clip(offset / RELATION_SCALE, -1.0, 1.0))


@REWARDS.register("shapes_layout", kind=POINTWISE, modality="image",
                  description="ShapesT2I relation margin in [-1, 1]: a dense training signal for left/right/above/below")
class ShapesLayout(Reward):
    """:func:`relation_margin` per image: how far the prompted objects are placed in the prompted direction. It is
    a dense shaping term for training (a binary check gives no credit for moving half-way); ``shapes_eval`` stays
    the honest metric. NaN ("does not apply") for prompts without a relation."""

    modality = "image"
    conditional = True

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        detections, _ = DETECTIONS(batch, "shapes_layout")
        margins = [relation_margin(objs, _spec(p, m)) for objs, p, m in zip(detections, batch.prompts, batch.meta)]
        return torch.tensor(margins, dtype=torch.float64)


def diversity(images: torch.Tensor) -> float:
    """Mean pairwise L2 distance between (n, 3, H, W) samples of one prompt, with pixel values in [0, 1] (so it
    grows with sqrt(3*H*W); two different 64x64 shape scenes are about 20-40 apart)."""
    flat = as_rgb_images(images).flatten(1).double()
    if len(flat) < 2:
        raise ValueError("diversity needs at least 2 samples")
    return float(torch.pdist(flat).mean())


def wasserstein_1d(a: np.ndarray, b: np.ndarray) -> float:
    """The 1-Wasserstein (earth mover's) distance between two 1-D empirical distributions."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    points = np.sort(np.concatenate([a, b]))
    cdf_a = np.searchsorted(a, points[:-1], side="right") / len(a)
    cdf_b = np.searchsorted(b, points[:-1], side="right") / len(b)
    return float(np.sum(np.abs(cdf_a - cdf_b) * np.diff(points)))


def size_position_distance(images: torch.Tensor, meta: list[dict], data_stats: dict[str, np.ndarray]) -> float:
    """Mean of the 1-D Wasserstein distances, in pixels of these images, between the sizes, box-centre x and
    box-centre y of the detected objects of the prompted colours and those of the data (``data_stats`` of the
    task, in fractions of the side): size and x in pixels of the width, y of the height. NaN when no such object is
    found."""
    detections, _ = detect_objects(images)
    height, width = images.shape[-2:]
    found = [o for objs, m in zip(detections, meta, strict=True) for o in objs
             if o["colour"] in {x["colour"] for x in m["objects"]} and np.isfinite(o["size"])]
    if not found:
        return float("nan")
    distances = [wasserstein_1d([o[k] for o in found], data_stats[k]) * side
                 for k, side in (("size", width), ("x", width), ("y", height))]
    return float(np.mean(distances))

