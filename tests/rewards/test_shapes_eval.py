"""shapes_eval: near-perfect on true renders, 0 on every kind of wrong or gamed image, robust to blur and noise."""

import gc
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TF

from mmgrpo.registry import REWARDS, TASKS
from mmgrpo.rewards import RewardBatch
from mmgrpo.rewards.shapes_eval import detect_objects, diversity, size_position_distance, wasserstein_1d
from mmgrpo.tasks.shapes import draw, parse_prompt, sample_scene

TASK = TASKS.get("shapes_t2i")
EVAL = REWARDS.build("shapes_eval")


def score(images, specs):
    images = torch.as_tensor(np.asarray(images)) if not torch.is_tensor(images) else images
    batch = RewardBatch(prompts=[s["prompt"] for s in specs], group=torch.arange(len(specs)), images=images,
                        meta=list(specs))
    return EVAL(batch)


@pytest.fixture(scope="module")
def heldout():
    specs = TASK.items("heldout")
    return torch.from_numpy(np.stack([TASK.render(s, 100 + i) for i, s in enumerate(specs)])), specs


def test_registered_pointwise_image_reward():
    entry = REWARDS.entry("shapes_eval")
    assert entry.info["kind"] == "pointwise" and entry.info["modality"] == "image"


def test_true_renders_score_one(heldout):
    images, specs = heldout
    out = score(images, specs)
    assert set(out) == {"score", "count", "colour", "shape", "size", "position", "background"}
    assert out["score"].mean() >= 0.98
    for key in out:
        assert out[key].mean() >= 0.98, key


@pytest.mark.parametrize("name", ["blur", "noise"])
def test_robust_to_mild_blur_and_noise(heldout, name):
    images, specs = heldout
    gen = torch.Generator().manual_seed(0)
    if name == "blur":
        images = TF.gaussian_blur(images, 5, 0.7)
    else:
        images = (images + 0.03 * torch.randn(images.shape, generator=gen)).clamp(0, 1)
    assert score(images, specs)["score"].mean() >= 0.97


def one(prompt, seed=0, edit=None):
    spec = parse_prompt(prompt)
    scene = sample_scene(spec, seed)
    if edit:
        edit(scene)
    return torch.from_numpy(draw(scene))[None], [spec]


def test_the_true_image_scores_one():
    image, spec = one("a green triangle left of a yellow circle")
    assert score(image, spec)["score"].item() == 1


def set_all(key, value):
    def edit(scene):
        for obj in scene:
            obj[key] = value
    return edit


@pytest.mark.parametrize("case, sub", [
    ("wrong colour", "colour"), ("wrong shape", "shape"), ("too few", "count"), ("too many", "count"),
    ("swapped relation", "position"), ("huge shape", "size"), ("tiny shape", "size"), ("noise", "background"),
    ("grey background", "background"), ("empty", "count"),
])
def test_wrong_images_score_zero(case, sub):
    prompt = "a green triangle left of a yellow circle"
    spec = [parse_prompt(prompt)]
    image, _ = one(prompt)
    if case == "wrong colour":
        image, _ = one("a blue triangle left of a yellow circle")
    elif case == "wrong shape":
        image, _ = one("a green square left of a yellow circle")
    elif case == "too few":
        image, _ = one("a green triangle")
    elif case == "too many":
        image, _ = one("two green triangles")
        spec = [parse_prompt("a green triangle")]
    elif case == "swapped relation":
        image, _ = one("a green triangle right of a yellow circle")
    elif case == "huge shape":
        image, _ = one("a green triangle", edit=lambda s: s[0].update(size=0.7, x=0.5, y=0.5))
        spec = [parse_prompt("a green triangle")]
    elif case == "tiny shape":
        image, _ = one("a green triangle", edit=lambda s: s[0].update(size=0.12))
        spec = [parse_prompt("a green triangle")]
    elif case == "noise":
        image = (image + torch.rand(image.shape, generator=torch.Generator().manual_seed(0)) * 0.6).clamp(0, 1)
    elif case == "grey background":
        image = torch.where(image.sum(1, keepdim=True) == 0, 0.4, image)
    elif case == "empty":
        image = torch.zeros_like(image)
    out = score(image, spec)
    assert out["score"].item() == 0
    assert out[sub].item() < 1


def test_spec_is_parsed_from_the_prompt_when_meta_has_none():
    image, spec = one("three red squares", seed=2)
    batch = RewardBatch(prompts=[spec[0]["prompt"]], group=torch.arange(1), images=image)
    assert EVAL(batch)["score"].item() == 1


def test_detect_objects_reports_geometry():
    spec = parse_prompt("a blue circle above a red square")
    scene = sample_scene(spec, 4)
    objects, stray = detect_objects(torch.from_numpy(draw(scene))[None])
    assert stray.item() == 0
    found = {o["colour"]: o for o in objects[0]}
    for obj in scene:
        assert found[obj["colour"]]["shape"] == obj["shape"]
        assert found[obj["colour"]]["size"] == pytest.approx(obj["size"], abs=1.5 / 64)
        assert found[obj["colour"]]["x"] == pytest.approx(obj["x"], abs=1 / 64)


def test_positions_of_a_non_square_image_are_fractions_of_their_own_axis():
    """A 64 px render stretched to 96 px wide keeps every object's x and y as fractions of the width and the height,
    so its positions compare with the data's (fractions of the side); y was a fraction of the width."""
    spec = parse_prompt("a blue circle above a red square")
    scenes = [sample_scene(spec, seed) for seed in range(4)]
    wide = F.interpolate(torch.from_numpy(np.stack([draw(s) for s in scenes])), size=(64, 96), mode="nearest")
    objects, _ = detect_objects(wide)
    for found, scene in zip(objects, scenes):
        by_colour = {o["colour"]: o for o in found}
        for obj in scene:
            assert by_colour[obj["colour"]]["x"] == pytest.approx(obj["x"], abs=1 / 64)
            assert by_colour[obj["colour"]]["y"] == pytest.approx(obj["y"], abs=1 / 64)
    stats = {k: np.array([o[k] for s in scenes for o in s]) for k in ("size", "x", "y")}
    assert size_position_distance(wide, [spec] * 4, stats) < 1.0  # pixels


def test_diversity():
    image, _ = one("a red circle")
    assert diversity(image.repeat(4, 1, 1, 1)) == 0
    other, _ = one("a red circle", seed=9)
    pair = torch.cat([image, other])
    assert diversity(pair) == pytest.approx((image - other).norm().item(), rel=1e-6)
    with pytest.raises(ValueError):
        diversity(image)


def test_wasserstein_1d_closed_forms():
    assert wasserstein_1d([0.0, 1.0], [0.0, 1.0]) == 0
    assert wasserstein_1d([0.0], [2.5]) == pytest.approx(2.5)
    assert wasserstein_1d([0.0, 1.0], [1.0, 2.0, 1.5, 0.5]) == pytest.approx(0.75)


def test_size_position_distance_flags_the_huge_shape_hack():
    stats = TASK.data_stats(num_scenes=500)
    specs = [TASK.items("train")[i] for i in range(32)]
    true = torch.from_numpy(np.stack([TASK.render(s, 50 + i) for i, s in enumerate(specs)]))
    honest = size_position_distance(true, specs, stats)
    hack_spec = parse_prompt("a red square")
    huge = {"colour": "red", "shape": "square", "size": 0.6, "x": 0.5, "y": 0.5}
    hacked = torch.from_numpy(np.stack([draw([huge])] * 8))
    assert honest < 2.0  # pixels
    assert size_position_distance(hacked, [hack_spec] * 8, stats) > 5 * honest
    assert np.isnan(size_position_distance(torch.zeros(2, 3, 64, 64), [hack_spec] * 2, stats))


def test_layout_margin_is_signed_by_the_prompted_direction_and_nan_without_a_relation():
    layout = REWARDS.build("shapes_layout")
    left = {"colour": "red", "shape": "circle", "size": 0.28, "x": 0.25, "y": 0.5}
    right = {"colour": "blue", "shape": "square", "size": 0.28, "x": 0.75, "y": 0.5}
    image = torch.from_numpy(np.stack([draw([left, right])] * 3))
    prompts = ["a red circle left of a blue square", "a red circle right of a blue square", "a red circle"]
    specs = [parse_prompt(p) for p in prompts]
    margins = layout(RewardBatch(prompts=prompts, group=torch.arange(3), images=image, meta=specs))
    assert margins[0] == 1.0 and margins[1] == -1.0  # 0.5 apart: beyond the 0.3 scale, clipped
    assert torch.isnan(margins[2])
    near = torch.from_numpy(draw([dict(left, x=0.3, y=0.3), dict(right, x=0.45, y=0.7)]))[None]
    spec = parse_prompt(prompts[0])
    margin = layout(RewardBatch(prompts=prompts[:1], group=torch.zeros(1), images=near, meta=[spec]))
    assert margin.item() == pytest.approx(0.15 / 0.3, abs=0.05)  # half-way: partial credit
    empty = layout(RewardBatch(prompts=prompts[:1], group=torch.zeros(1), images=torch.zeros(1, 3, 64, 64),
                               meta=[spec]))
    assert empty.item() == -1.0


def test_partial_credit_is_the_mean_of_the_sub_scores(heldout):
    images, specs = heldout
    images, specs = images[:6], specs[:6]
    images[1] = 0.0  # an empty image fails most checks
    sub = score(images, specs)
    batch = RewardBatch(prompts=[s["prompt"] for s in specs], group=torch.arange(6), images=images, meta=specs)
    partial = REWARDS.build("shapes_partial")(batch)
    expected = torch.stack([sub[k] for k in ("count", "colour", "shape", "size", "position", "background")]).mean(0)
    assert torch.allclose(partial, expected) and partial[1] < 0.5 < partial[0]


def test_the_three_rewards_detect_a_batch_once_and_a_changed_batch_again(heldout, monkeypatch):
    import mmgrpo.rewards.shapes_eval as module
    from mmgrpo.config import RewardSpec
    from mmgrpo.rewards import RewardZoo

    calls = []
    real = module.detect_objects
    monkeypatch.setattr(module, "detect_objects", lambda images: calls.append(len(images)) or real(images))
    zoo = RewardZoo([RewardSpec(name=n) for n in ("shapes_eval", "shapes_partial", "shapes_layout")])
    images, specs = heldout
    images, specs = images[:8].clone(), specs[:8]
    batch = RewardBatch(prompts=[s["prompt"] for s in specs], group=torch.arange(8), images=images, meta=specs)
    _, first, _ = zoo(batch)
    assert calls == [8] and first["shapes_eval/score"].sum() >= 7  # three rewards, concurrently, one detection
    images[2] = 0.0  # in place: the cache must see it
    _, second, _ = zoo(batch)
    copy = RewardBatch(prompts=batch.prompts, group=batch.group, images=images.clone(), meta=specs)
    _, third, _ = zoo(copy)  # another tensor with the same values
    assert calls == [8, 8, 8]
    assert second["shapes_eval/score"][2] == 0 and first["shapes_eval/score"][2] == 1
    for key in second:
        torch.testing.assert_close(second[key], third[key], rtol=0, atol=0, equal_nan=True)


def test_images_made_under_inference_mode_are_scored(heldout):
    """Images made in ``torch.inference_mode()`` have no version counter; the shared detection must not need one
    (it raised 'Inference tensors do not track version counter') and scores them as the same images made outside."""
    images, specs = heldout
    images, specs = images[:2], specs[:2]
    with torch.inference_mode():
        frozen = images.clone()
    expected = score(images.clone(), specs)
    got = score(frozen, specs)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    with torch.inference_mode():
        frozen[0] = 0.0  # in place, inside inference mode: no stale detection
    assert score(frozen, specs)["score"][0] == 0 and expected["score"][0] == 1


def test_tiny_objects_are_unknown_shapes_without_warnings():
    """A 2x2-pixel object has no pixel in its corner triangles: its shape is unknown (None), with no 'Mean of empty
    slice' RuntimeWarning per object."""
    image = torch.zeros(1, 3, 16, 16)
    image[0, :, 5:7, 5:7] = torch.tensor([1.0, 0.0, 0.0]).view(3, 1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        objects, _ = detect_objects(image)
    assert [o["shape"] for o in objects[0]] == [None]


def test_a_batch_without_images_after_a_freed_one_is_a_clear_error():
    """Once the last detected tensor is freed, its weak reference reads None, like the images of a text batch:
    that must not count as cached (it raised AttributeError: 'NoneType' object has no attribute '_version')."""
    EVAL(RewardBatch(prompts=["a red circle"], group=torch.zeros(1, dtype=torch.long),
                     images=torch.zeros(1, 3, 64, 64), meta=[{}]))
    gc.collect()
    text = RewardBatch(prompts=["a red circle"], group=torch.zeros(1, dtype=torch.long), completions=["x"], meta=[{}])
    with pytest.raises(ValueError, match="shapes_eval"):
        EVAL(text)


@pytest.mark.parametrize("phase", range(4))
def test_the_seam_of_a_red_and_a_green_shape_that_touch_is_no_yellow_object(phase):
    """Antialiasing blends a red and a green edge that meet mid-pixel into (0.5, 0.5, 0): yellow at alpha 0.5. On one
    of every four quarter-pixel positions the 1 px seam was an 18 px yellow object, which failed count, colour and
    shape of a correct image; a real yellow shape against a red one still counts."""
    shift = (phase + 0.5) / 256  # the 4x supersampled render puts edges on quarter pixels
    red = {"colour": "red", "shape": "square", "size": 0.3, "x": 0.3 + shift, "y": 0.5}
    image = torch.from_numpy(draw([red, dict(red, colour="green", x=0.6 + shift)]))[None]
    objects, _ = detect_objects(image)
    assert sorted(o["colour"] for o in objects[0]) == ["green", "red"]
    assert score(image, [parse_prompt("a red square left of a green square")])["score"].item() == 1
    yellow = dict(red, colour="yellow", size=0.25, x=0.575 + shift)  # touching the red square's right edge
    objects, _ = detect_objects(torch.from_numpy(draw([red, yellow]))[None])
    assert sorted(o["colour"] for o in objects[0]) == ["red", "yellow"]
