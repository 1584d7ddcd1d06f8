"""The shipped tiny ShapesT2I model: a real SD3 pipeline folder that loads offline, is small and fast, and is capable
but imperfect on held-out prompts."""

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mmgrpo.registry import REWARDS, TASKS
from mmgrpo.rewards import RewardBatch

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-sd3-shapes"
MAX_SEQUENCE_LENGTH = 10


@pytest.fixture(scope="module")
def pipe():
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(ASSET, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompts, seed=0, steps=10):
    return pipe(prompts, num_inference_steps=steps, guidance_scale=4.5, max_sequence_length=MAX_SEQUENCE_LENGTH,
                output_type="pt", generator=torch.Generator().manual_seed(seed)).images


def test_folder_is_small_and_in_the_sd3_format():
    size = sum(f.stat().st_size for f in ASSET.rglob("*") if f.is_file())
    assert size < 15e6
    index = json.loads((ASSET / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        weights = next((ASSET / part).glob("*.safetensors"))
        with safe_open(weights, "pt") as f:
            assert f.get_tensor(next(iter(f.keys()))).dtype == torch.float16  # stored half, loaded as fp32


def test_loads_offline_as_fp32_and_tokenizes_task_words_whole(pipe):
    assert pipe.transformer.dtype == torch.float32 and pipe.vae.dtype == torch.float32
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    for tokenizer in (pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3):
        ids = tokenizer("a yellow triangle left of a green square", add_special_tokens=False).input_ids
        assert len(ids) == 8
    embeds, _, pooled, _ = pipe.encode_prompt("two red circles", None, None, do_classifier_free_guidance=False,
                                               max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert embeds.shape == (1, 2 * MAX_SEQUENCE_LENGTH, pipe.transformer.config.joint_attention_dim)
    assert pooled.shape == (1, pipe.transformer.config.pooled_projection_dim)


def test_generates_64px_images_quickly(pipe):
    generate(pipe, ["a red circle"], steps=2)  # warm-up
    start = time.perf_counter()
    images = generate(pipe, ["a red circle", "two blue squares"], steps=10)
    assert time.perf_counter() - start < 10
    assert images.shape == (2, 3, 64, 64) and 0 <= images.min() and images.max() <= 1


def test_heldout_accuracy_is_clearly_capable_but_imperfect(pipe):
    specs = TASKS.get("shapes_t2i").items("heldout")[:16]
    images = generate(pipe, [s["prompt"] for s in specs], seed=1)
    batch = RewardBatch(prompts=[s["prompt"] for s in specs], group=torch.arange(16), images=images, meta=specs)
    correct = int(REWARDS.build("shapes_eval")(batch)["score"].sum())
    assert 4 <= correct <= 12  # docs/tasks.md: 0.44 held-out at 10 steps, CFG 4.5 (this seed: 6 of 16)


def test_places_relation_objects_in_the_prompted_order(pipe):
    """The words decide which object goes left (or on top): the old base did this in 39% of samples, as often as the
    opposite order; the shipped one does in 96% (docs/tasks.md)."""
    specs = [s for s in TASKS.get("shapes_t2i").items("heldout") if s["kind"] == "relation"][::5][:16]
    images = generate(pipe, [s["prompt"] for s in specs], seed=2)
    batch = RewardBatch(prompts=[s["prompt"] for s in specs], group=torch.arange(16), images=images, meta=specs)
    margin = REWARDS.build("shapes_layout")(batch)
    assert int((margin > 0).sum()) >= 14, margin  # the old base: 5-10 of 16 over three seeds
