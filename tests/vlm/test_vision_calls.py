"""VisionCallBalancer: every fresh forward runs the vision tower the same number of times, decoding steps run it
not at all, and the outputs and gradients are those of the unbalanced forward; with FSDP2-sharded weights on two
processes, mixed media then trains and samples exactly as the unsharded model."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mmgrpo.config import ConfigError
from mmgrpo.pipelines.vlm.config import VLMModelConfig
from mmgrpo.pipelines.vlm.data import VLMSample
from mmgrpo.pipelines.vlm.generation import prefill
from mmgrpo.pipelines.vlm.logprobs import token_logprobs
from mmgrpo.pipelines.vlm.model import VLMModel, unwrap
from mmgrpo.pipelines.vlm.tiny import KINDS
from mmgrpo.pipelines.vlm.vision_calls import VisionCallBalancer, calls_to_balance, dummy_vision_input

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE = torch.zeros(3, 8, 8, dtype=torch.uint8)
VIDEO = torch.zeros(2, 3, 8, 8, dtype=torch.uint8)


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    return VLMModel(VLMModelConfig(path=f"tiny:{request.param}", freeze_vision=False))


@pytest.fixture
def tower_calls(vlm):
    """A list that grows by one per vision-tower call (real or dummy)."""
    calls: list[int] = []
    handle = unwrap(vlm.model).model.visual.register_forward_pre_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


def test_calls_to_balance_counts_the_media_kinds_of_mixed_data():
    sample = VLMSample(question="q", problem_type="multiple choice", options=[], solution="A", source="x:1")
    image, video = replace(sample, images=[Path("a.png")]), replace(sample, videos=[Path("a.mp4")])
    both = replace(image, videos=[Path("a.mp4")])
    assert calls_to_balance([image, image]) == 0  # one kind: every forward already calls alike
    assert calls_to_balance([both]) == 0
    assert calls_to_balance([image, sample]) == 1
    assert calls_to_balance([video, sample]) == 1
    assert calls_to_balance([image, video]) == 2
    assert calls_to_balance([both, sample]) == 2


def test_the_dummy_input_is_one_merged_token(vlm):
    config = unwrap(vlm.model).config.vision_config
    pixels, grid = dummy_vision_input(config)
    tower = unwrap(vlm.model).model.visual
    out = tower(pixels, grid_thw=grid)
    out = getattr(out, "pooler_output", out)
    assert out.shape[0] == 1 and torch.isfinite(out).all()


def forward_and_grads(vlm, prompts, ids, mask, index):
    model = vlm.model
    model.zero_grad(set_to_none=True)
    logp = token_logprobs(model, prompts, ids, mask, index, prefix_grouper=False)
    logp.sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("media", ["text", "image"])
def test_a_forward_is_topped_up_with_unchanged_outputs_and_gradients(vlm, tower_calls, media):
    images = [IMAGE] if media == "image" else []
    prompts = [vlm.prompt_inputs("How many?", images, [])]
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 5, dtype=torch.bool)
    index = torch.zeros(2, dtype=torch.long)
    plain, plain_grads = forward_and_grads(vlm, prompts, ids, mask, index)
    real = len(tower_calls)
    assert real == (media == "image")
    balancer = VisionCallBalancer(vlm.model, calls=2)
    try:
        tower_calls.clear()
        balanced, grads = forward_and_grads(vlm, prompts, ids, mask, index)
    finally:
        balancer.remove()
    assert len(tower_calls) == 2
    assert torch.equal(balanced, plain)
    assert any(".visual." in n for n in grads)  # the backward ran the tower, dummy calls included
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads.get(name, torch.zeros_like(grad)), rtol=0, atol=0)


def test_decoding_steps_are_not_topped_up(vlm, tower_calls):
    inputs = vlm.prompt_inputs("What moves?", [], [VIDEO], [2.0])
    balancer = VisionCallBalancer(vlm.model, calls=2)
    try:
        with torch.no_grad():
            logits, steps = prefill(vlm, [inputs], rows=2, shared=True, max_new_tokens=4)
            assert len(tower_calls) == 2  # the video, then one dummy
            steps.forward(vlm, logits.argmax(-1), 0)
    finally:
        balancer.remove()
    assert len(tower_calls) == 2


def test_more_real_calls_than_balanced_to_is_an_error(vlm):
    inputs = vlm.prompt_inputs("What moves?", [IMAGE], [VIDEO], [2.0])
    balancer = VisionCallBalancer(vlm.model, calls=1)
    try:
        with pytest.raises(RuntimeError, match="vision tower ran 2 times in one forward, more than the 1"), \
                torch.no_grad():
            prefill(vlm, [inputs], rows=1, shared=True, max_new_tokens=1)
    finally:
        balancer.remove()


def test_a_model_without_a_qwen_vision_tower_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=32))
    with pytest.raises(ConfigError, match="'data.media_types'.*LlamaForCausalLM has none"):
        VisionCallBalancer(model, calls=1)


def test_mixed_media_trains_with_fsdp2_sharded_weights_on_two_processes(launch_two_processes):
    """tests/support/fsdp_mixed_media_check.py: one process trains on an image and a video question, the other on
    images only, then each prefills another kind. Unbalanced, the weight gathers mismatch and gloo aborts the run;
    balanced, both run the tower twice per forward and match the unsharded model exactly."""
    report = launch_two_processes("fsdp_mixed_media_check.py")
    assert report["sharded"] and report["calls"] == 2  # the demo data mixes images and videos
    for process in report["processes"]:
        assert process["tower_calls"] == [2, 2, 2]  # standard and Prefix Grouper training forwards, a prefill
        assert process["logprob_diff"] <= 1e-6 and process["prefill_diff"] <= 1e-6
        assert process["grad_diff"] <= 1e-6
