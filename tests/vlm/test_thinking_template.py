"""Reasoning checkpoints whose chat template opens the thinking block in the generation prompt (Qwen3-VL Thinking:
the prompt ends with ``<think>\\n``): the rewards see the completion as the model effectively wrote it, the opened
tag first, so ``<think>...</think><answer>...</answer>`` can be met."""

import shutil

import pytest
import torch

from mmgrpo.pipelines.vlm.config import VLMGenerationConfig, VLMModelConfig
from mmgrpo.pipelines.vlm.generation import generate_group
from mmgrpo.pipelines.vlm.model import VLMModel, opened_tag
from mmgrpo.pipelines.vlm.tiny import tiny_path
from mmgrpo.pipelines.vlm.vllm_backend import to_completions
from mmgrpo.rewards import RewardBatch
from mmgrpo.rewards.text_rules import FormatReward

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("chat, lead", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", "<think>\n"),  # Qwen3-VL Thinking
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>", "<think>"),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", ""),  # thinking off
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", ""),  # Qwen2.5-VL
    ("<|im_start|>user\nsay <think>\n<|im_end|>\n<|im_start|>assistant\n", ""),  # the user's text is not it
])
def test_opened_tag_is_the_unclosed_tag_that_ends_the_rendered_prompt(chat, lead):
    assert opened_tag(chat) == lead


@pytest.fixture(scope="module")
def thinking_vlm(tmp_path_factory):
    """The tiny Qwen2-VL with a chat template whose generation prompt opens ``<think>`` (as Qwen3-VL Thinking's)."""
    folder = tmp_path_factory.mktemp("thinking") / "qwen2_vl"
    shutil.copytree(tiny_path("qwen2_vl"), folder)
    template = folder / "chat_template.jinja"
    text = template.read_text()
    gen = "{% if add_generation_prompt %}<|im_start|>assistant\n"
    assert gen in text
    template.write_text(text.replace(gen, gen + "<think>\n"))
    return VLMModel(VLMModelConfig(path=str(folder)))


def test_a_template_that_opens_the_thinking_block_puts_it_before_the_completion_texts(thinking_vlm):
    inputs = thinking_vlm.prompt_inputs("Which colour?", [], [], [])
    chat = thinking_vlm.tokenizer.decode(inputs["input_ids"][0])
    assert chat.endswith("assistant\n<think>\n")
    assert thinking_vlm.completion_lead == "<think>\n"
    out = generate_group(thinking_vlm, inputs, 3, VLMGenerationConfig(max_new_tokens=5),
                         torch.Generator().manual_seed(0))
    for row, text in zip(out.ids.tolist(), out.texts):
        assert text == "<think>\n" + thinking_vlm.tokenizer.decode(row, skip_special_tokens=True)
    # what such a model writes after the prompt scores as well formatted once the opened tag leads it
    written = "I see red.</think><answer>A</answer>"
    ids = thinking_vlm.tokenizer(written)["input_ids"] + thinking_vlm.eos_token_ids[:1]
    done = to_completions([(ids, "stop")], thinking_vlm.pad_token_id, thinking_vlm.eos_token_ids,
                          thinking_vlm.tokenizer, lead=thinking_vlm.completion_lead)
    assert done.texts == ["<think>\n" + written]
    batch = RewardBatch(prompts=["Which colour?"], completions=done.texts, group=torch.zeros(1, dtype=torch.long),
                        meta=[{}])
    assert FormatReward()(batch).tolist() == [1.0]


def test_a_plain_template_leaves_the_texts_as_decoded():
    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_vl"))
    assert vlm.completion_lead == ""
    inputs = vlm.prompt_inputs("Which colour?", [], [], [])
    out = generate_group(vlm, inputs, 2, VLMGenerationConfig(max_new_tokens=4), torch.Generator().manual_seed(0))
    assert out.texts == [vlm.tokenizer.decode(row, skip_special_tokens=True) for row in out.ids.tolist()]
