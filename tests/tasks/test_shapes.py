"""ShapesT2I: deterministic prompts, disjoint splits, and renders that follow the data rules."""

import numpy as np
import pytest

from mmgrpo.registry import TASKS
from mmgrpo.tasks import shapes
from mmgrpo.tasks.shapes import COLOURS, GAP, MARGIN, SIZE_RANGE, parse_prompt, relation_holds, sample_scene

TASK = TASKS.get("shapes_t2i")


def test_registered_and_deterministic():
    assert TASK is shapes.SHAPES_T2I
    assert TASK.items("train") == shapes.ShapesT2I().items("train")
    np.testing.assert_array_equal(TASK.render(TASK.items("train")[5], seed=3),
                                  TASK.render(TASK.items("train")[5], seed=3))
    assert not np.array_equal(TASK.render(TASK.items("train")[5], seed=3), TASK.render(TASK.items("train")[5], seed=4))
    with pytest.raises(ValueError, match="splits"):
        TASK.items("test")


def test_splits_are_disjoint_and_heldout_compositions_are_unseen():
    train, heldout = TASK.items("train"), TASK.items("heldout")
    assert len(train) + len(heldout) == 36 + 12 * 9 * 4
    assert not {it["prompt"] for it in train} & {it["prompt"] for it in heldout}
    assert {it["kind"] for it in heldout[:16]} == {"count", "relation"}
    seen_pairs = {(o["colour"], o["shape"]) for it in train for o in it["objects"]}
    assert len(seen_pairs) == 12  # every colour-shape pair is still trained, in other compositions

    def layout(it):  # the same picture: "A left of B" == "B right of A"
        (a, b), axis = ((o["colour"], o["shape"]) for o in it["objects"]), shapes.RELATIONS[it["relation"]][0]
        return frozenset((a, b)), axis

    train_layouts = {layout(it) for it in train if it["relation"]}
    assert all(layout(it) not in train_layouts for it in heldout if it["relation"])
    assert "a green triangle" in {it["prompt"] for it in heldout}


def test_parse_prompt_round_trips_and_rejects_other_text():
    for item in TASK.items("train")[:50] + TASK.items("heldout"):
        assert parse_prompt(item["prompt"])["objects"] == item["objects"]
        assert parse_prompt(item["prompt"])["relation"] == item["relation"]
    for bad in ["a purple circle", "two red circle", "a red circle left of a red square", "red circle", ""]:
        with pytest.raises(ValueError):
            parse_prompt(bad)


@pytest.mark.parametrize("index", range(0, 40, 3))
def test_scenes_follow_the_data_rules(index):
    items = TASK.items("train")
    spec = items[index]
    for seed in range(5):
        scene = sample_scene(spec, seed)
        assert len(scene) == sum(o["count"] for o in spec["objects"])
        for obj in scene:
            assert SIZE_RANGE[0] <= obj["size"] <= SIZE_RANGE[1]
            for centre in (obj["x"], obj["y"]):
                assert MARGIN + obj["size"] / 2 <= centre <= 1 - MARGIN - obj["size"] / 2
        for i, a in enumerate(scene):
            for b in scene[i + 1:]:
                gaps = [abs(a[k] - b[k]) - (a["size"] + b["size"]) / 2 for k in ("x", "y")]
                assert max(gaps) >= GAP
        if spec["relation"]:
            assert relation_holds(scene[0], scene[1], spec["relation"])
            assert [o["colour"] for o in scene] == [o["colour"] for o in spec["objects"]]


def test_render_draws_the_scene():
    spec = parse_prompt("a blue square left of a yellow circle")
    scene = sample_scene(spec, 7)
    image = shapes.draw(scene)
    assert image.shape == (3, 64, 64) and image.dtype == np.float32 and 0 <= image.min() and image.max() <= 1
    square, circle = scene
    # pixel area of each colour matches the geometry: on black, the blue channel is the square's coverage and the
    # red one the circle's, antialiased edges included (within 1.4% over seeds 0-7; a size 2% off is 4% of area)
    assert image[2].sum() == pytest.approx((square["size"] * 64) ** 2, rel=0.025)
    assert image[0].sum() == pytest.approx(np.pi / 4 * (circle["size"] * 64) ** 2, rel=0.025)
    assert image[:, image.sum(0) == 0].size > 0.7 * image.size  # the rest is the black background
    assert image[2, :, : int(square["x"] * 64)].sum() > 0 and COLOURS["blue"] == (0.0, 0.0, 1.0)


def test_data_stats_cover_the_size_range():
    stats = TASK.data_stats(num_scenes=300)
    assert set(stats) == {"size", "x", "y"}
    assert SIZE_RANGE[0] <= stats["size"].min() < 0.24 and 0.32 < stats["size"].max() <= SIZE_RANGE[1]
    assert 0.4 < stats["x"].mean() < 0.6 and 0.4 < stats["y"].mean() < 0.6
    np.testing.assert_array_equal(stats["size"], TASK.data_stats(num_scenes=300)["size"])
