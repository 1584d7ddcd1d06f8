"""Qwen2-VL / Qwen2.5-VL M-RoPE positions by the original rule (text after a vision block resumes at the block's
largest position + 1): hand-computed references, equality with transformers' get_rope_index where its rule
agrees, prompt_positions using the rule, and a config that names transformers' rule (the shipped tiny model's)
keeping it."""

import copy
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from mmgrpo.pipelines.vlm.config import VLMModelConfig
from mmgrpo.pipelines.vlm.logprobs import prompt_positions
from mmgrpo.pipelines.vlm.model import VLMModel
from mmgrpo.pipelines.vlm.mrope import (
    MODEL_TYPES,
    RULE_ATTRIBUTE,
    config_positions,
    qwen_vl_positions,
    uses_original_rule,
)
from mmgrpo.pipelines.vlm.tiny import KINDS

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]

IMG, VID, TEXT = 5, 6, 1


def rule(ids: list[int], images=None, videos=None, seconds=None, tokens_per_second=None) -> torch.Tensor:
    as_grid = (lambda g: torch.tensor(g) if g is not None else None)
    return qwen_vl_positions(torch.tensor([ids]), as_grid(images), as_grid(videos), as_grid(seconds),
                             image_token_id=IMG, video_token_id=VID, spatial_merge_size=2,
                             tokens_per_second=tokens_per_second)


def test_qwen_documented_example_interval_50():
    """Qwen's example: 3 temporal patches, 2x2 merged grid, 25 tokens/s x 2 s per patch = 50 per patch; the text
    after the video resumes at 100 + 1 (transformers 5.x: at 2)."""
    pos = rule([TEXT, TEXT] + [VID] * 12 + [TEXT] * 3, videos=[[3, 4, 4]], seconds=[2.0], tokens_per_second=25)
    assert pos.shape == (3, 1, 17) and pos.dtype == torch.int64
    assert pos[:, 0, :2].tolist() == [[0, 1]] * 3
    vision = pos[:, 0, 2:14] - 2
    assert vision[0].tolist() == [0] * 4 + [50] * 4 + [100] * 4
    assert vision[1].tolist() == [0, 0, 1, 1] * 3
    assert vision[2].tolist() == [0, 1, 0, 1] * 3
    assert pos[:, 0, 14:].tolist() == [[103, 104, 105]] * 3


def test_qwen2_vl_video_longer_than_its_grid_is_wide():
    """Qwen2-VL (step 1): 5 temporal patches over a 2x2 merged grid end at start + 4; text resumes at start + 5."""
    pos = rule([TEXT] * 3 + [VID] * 20 + [TEXT], videos=[[5, 4, 4]])
    assert pos[0, 0, 3:23].tolist() == [3 + i // 4 for i in range(20)]
    assert pos[:, 0, 23].tolist() == [3 + 5] * 3


def test_fractional_interval_is_quantised_after_the_multiply():
    pos = rule([VID] * 4 + [TEXT], videos=[[4, 2, 2]], seconds=[0.5], tokens_per_second=3)  # 1.5 per patch
    assert pos[0, 0, :4].tolist() == [0, 1, 3, 4]
    assert pos[:, 0, 4].tolist() == [5] * 3


def test_placeholders_must_match_the_grids():
    with pytest.raises(ValueError, match="does not hold"):
        rule([TEXT] + [IMG] * 3 + [TEXT], images=[[1, 4, 4]])
    with pytest.raises(ValueError, match="more image placeholder"):
        rule([TEXT] + [IMG] * 4 + [TEXT] + [IMG] * 4, images=[[1, 4, 4]])
    with pytest.raises(ValueError, match="more image/video grids"):
        rule([TEXT] + [IMG] * 4, images=[[1, 4, 4], [1, 4, 4]])


@st.composite
def layouts(draw):
    """A prompt of text runs and image/video blocks: (ids, image grids, video grids, seconds per patch)."""
    ids, images, videos, seconds = [], [], [], []
    for _ in range(draw(st.integers(1, 4))):
        ids += [TEXT] * draw(st.integers(0, 3))
        t, h, w = draw(st.integers(1, 6)), 2 * draw(st.integers(1, 3)), 2 * draw(st.integers(1, 3))
        if draw(st.booleans()):
            images.append([1, h, w])
            ids += [IMG] * (h * w // 4)
        else:
            videos.append([t, h, w])
            seconds.append(draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0 / 3])))
            ids += [VID] * (t * h * w // 4)
    ids += [TEXT] * draw(st.integers(1, 3))
    return ids, images or None, videos or None, seconds or None


@settings(max_examples=60, deadline=None)
@given(layouts(), st.sampled_from([None, 2, 25]))
def test_text_continues_past_every_earlier_position(layout, tokens_per_second):
    """Every text token sits above every earlier position on all three axes, one above the previous token's
    largest axis; a text token's three axes are equal."""
    ids, images, videos, seconds = layout
    pos = rule(ids, images, videos, seconds, tokens_per_second)[:, 0]
    running_max = -1
    for i, token in enumerate(ids):
        if token == TEXT:
            assert pos[0, i] == pos[1, i] == pos[2, i] == running_max + 1
        running_max = max(running_max, int(pos[:, i].max()))


@pytest.fixture(scope="module", params=MODEL_TYPES)
def vlm(request):
    return VLMModel(VLMModelConfig(path=f"tiny:{request.param}"))


def frames(n: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, height, width), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def transformers_positions(vlm: VLMModel, inputs: dict) -> torch.Tensor:
    core = vlm.model.model
    keys = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    return core.get_rope_index(inputs["input_ids"], **{k: inputs[k] for k in keys if k in inputs})[0]


def test_equals_transformers_where_the_rules_agree(vlm):
    """Images of any size, and a video whose temporal positions stay below its merged grid's side (2 frames at
    2 fps: one temporal patch; 4 frames at 112 px: temporal max 1 or 2 < 4)."""
    image_a, image_b = frames(1, 56, 84)[0], frames(1, 84, 56, seed=1)[0]
    prompts = [vlm.prompt_inputs("Compare <image> and <image>.", [image_a, image_b], []),
               vlm.prompt_inputs("What moves?", [image_a], [frames(2, 56, 84, seed=2)]),
               vlm.prompt_inputs("What moves?", [], [frames(4, 112, 112, seed=3)], [2.0])]
    for inputs in prompts:
        assert torch.equal(config_positions(vlm.model.config, inputs), transformers_positions(vlm, inputs))


def test_a_long_video_resumes_one_above_its_last_temporal_position(vlm):
    """A 10-frame 56 px clip at 2 fps from the real processor: 5 temporal patches over a 2x2 merged grid.
    Qwen2-VL's temporal positions end at start + 4, Qwen2.5-VL's (vision_config.tokens_per_second 2 x
    second_per_grid_ts 1 s) at start + 8; the text resumes one above (transformers 5.x: at start + 2)."""
    inputs = vlm.prompt_inputs("What moves?", [], [frames(10, 56, 56)], [2.0])
    pos = config_positions(vlm.model.config, inputs)
    ids = inputs["input_ids"][0]
    video = (ids == vlm.model.config.video_token_id).nonzero()[:, 0]
    start, after = int(video[0]), int(video[-1]) + 1
    step = 2 if vlm.model.config.model_type == "qwen2_5_vl" else 1
    assert pos[0, 0, video].tolist() == [start + step * (i // 4) for i in range(20)]
    assert pos[:, 0, after].tolist() == [start + 4 * step + 1] * 3
    assert pos[:, 0, :start].tolist() == [list(range(start))] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_positions_follow_the_original_rule_on_qwen2_and_own_rope_index_elsewhere(kind):
    """Every forward's positions (prompt_positions) on a clip where the rules differ: the original rule on
    Qwen2-VL / Qwen2.5-VL, the model's own get_rope_index on Qwen3-VL (timestamps in the prompt)."""
    vlm = VLMModel(VLMModelConfig(path=f"tiny:{kind}"))
    inputs = vlm.prompt_inputs("What moves?", [], [frames(10, 56, 56)], [2.0])
    rule_of = config_positions if kind in MODEL_TYPES else (lambda _, x: transformers_positions(vlm, x))
    expected = rule_of(vlm.model.config, inputs)
    assert torch.equal(prompt_positions(vlm.model, inputs), expected)


def test_a_config_naming_the_transformers_rule_keeps_get_rope_index(vlm, tmp_path):
    """A checkpoint trained under transformers 5.x's positions says so in its config.json (RULE_ATTRIBUTE) and
    keeps them; the attribute survives a save and reload (checkpoints keep their rule); another name is refused."""
    inputs = vlm.prompt_inputs("What moves?", [], [frames(10, 56, 56)], [2.0])
    config = copy.deepcopy(vlm.model.config)
    setattr(config, RULE_ATTRIBUTE, "transformers")
    config.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert not uses_original_rule(reloaded) and uses_original_rule(vlm.model.config)
    differs = not torch.equal(config_positions(vlm.model.config, inputs), transformers_positions(vlm, inputs))
    assert differs  # a clip where the rules disagree, so the switch below is seen
    original = vlm.model.config
    try:
        vlm.model.config = reloaded
        assert torch.equal(prompt_positions(vlm.model, inputs), transformers_positions(vlm, inputs))
        setattr(reloaded, RULE_ATTRIBUTE, "qwen3")
        with pytest.raises(ValueError, match=f"{RULE_ATTRIBUTE} is 'qwen3'"):
            prompt_positions(vlm.model, inputs)
    finally:
        vlm.model.config = original


def test_the_shipped_tiny_model_was_trained_under_the_transformers_rule():
    """assets/tiny-qwen2vl-shapes was SFT'd (scripts/build_tiny_vlm.py) under transformers 5.x's positions: its
    demo clips (2x2 merged grid, 4 temporal patches) are ones where the rules differ, so it must keep them."""
    config = AutoConfig.from_pretrained(ROOT / "assets" / "tiny-qwen2vl-shapes")
    assert getattr(config, RULE_ATTRIBUTE) == "transformers" and not uses_original_rule(config)
