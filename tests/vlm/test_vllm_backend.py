"""The vLLM rollout backend's pure parts, on the real tiny Qwen2-VL / Qwen2.5-VL (vLLM itself is not installed here
and the engine path is not exercised): requests, sampling parameters, outputs -> Completions, weight names, the
one-line error without vLLM, and the policy's rollout wiring behind the sampler interface."""

from __future__ import annotations

import copy
import importlib.util
import re
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from random_vlm import RANDOM_TINY_VLM
from safetensors import safe_open

from mmgrpo.config import ConfigError, load_config
from mmgrpo.pipelines.vlm import vllm_backend as vb
from mmgrpo.pipelines.vlm.config import VLMGenerationConfig, VLMModelConfig, VLMVideoConfig
from mmgrpo.pipelines.vlm.generation import generate_group, generate_groups
from mmgrpo.pipelines.vlm.model import VLMModel
from mmgrpo.pipelines.vlm.policy import VLMPolicy, check_config
from mmgrpo.pipelines.vlm.tiny import KINDS

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["data.prompt_template='{question}{options}'", "generation.max_new_tokens=6", "train.group_size=3",
         "train.micro_batch_size=2", "train.prompts_per_step=2", "logging.progress=false"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    return VLMModel(VLMModelConfig(path=f"tiny:{request.param}"))


def config(tmp_path: Path, preset: str = "tiny_image", overrides: tuple[str, ...] = ()):
    return load_config(ROOT / "configs" / "vlm" / f"{preset}.yaml",
                       [*RANDOM_TINY_VLM, f"output_dir={tmp_path / 'run'}", *SHORT, *overrides])


def media(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (3, 56, 84), dtype=torch.uint8, generator=g)
    video = torch.randint(0, 256, (4, 3, 56, 56), dtype=torch.uint8, generator=g)
    return image, video


# ---------------------------------------------------------------------------------------------- requests
@pytest.mark.parametrize("prompt", ["What is <image> and then <video>?", "Which way does it move?"])
def test_request_is_the_training_prompt_with_unexpanded_placeholders(vlm, prompt):
    image, video = media()
    inputs = vlm.prompt_inputs(prompt, [image], [video], [1.5])
    request = vb.build_request(vlm.processor, prompt, [image], [video], [1.5])
    # the text the transformers path tokenises, each run of vision pad tokens collapsed to the one vLLM expands
    fed = vlm.tokenizer.decode(inputs["input_ids"][0], skip_special_tokens=False)
    for pad in ("<|image_pad|>", "<|video_pad|>"):
        fed = re.sub(f"({re.escape(pad)})+", pad, fed)
    timed = re.escape("<|vision_start|><|video_pad|><|vision_end|>")  # Qwen3-VL: one timed block per patch
    fed = re.sub(rf"<\|vision_start\|>(<[0-9.]+ seconds>{timed})+<\|vision_end\|>",
                 "<|vision_start|><|video_pad|><|vision_end|>", fed)
    assert request["prompt"] == fed
    assert request["prompt"].count("<|image_pad|>") == 1 and request["prompt"].count("<|video_pad|>") == 1
    pil, = request["multi_modal_data"]["image"]
    assert pil.mode == "RGB" and np.array_equal(np.asarray(pil), image.permute(1, 2, 0).numpy())
    (frames, meta), = request["multi_modal_data"]["video"]
    assert frames.dtype == np.uint8 and frames.shape == (4, 56, 56, 3)
    assert np.array_equal(frames, video.permute(0, 2, 3, 1).numpy())
    assert meta == {"total_num_frames": 4, "fps": 1.5, "frames_indices": [0.5, 1.5, 2.5, 3.5], "duration": 4 / 1.5}
    assert request["mm_processor_kwargs"] == {"fps": 1.5, "do_sample_frames": False}


def test_request_contents_reproduce_the_training_inputs_through_the_processor(vlm):
    """What vLLM's processing does with a request, done here with the same transformers processor: the request's
    text and media, the engine's pixel bounds and the request's kwargs (the metadata passed as ``video_metadata``, as
    recent vLLM does for models that take it) give exactly the training forward's inputs: no resize, same tokens."""
    image, video = media(1)
    inputs = vlm.prompt_inputs("Count <video> then look at <image>", [image], [video], [3.0])
    request = vb.build_request(vlm.processor, "Count <video> then look at <image>", [image], [video], [3.0])
    (frames, meta), = request["multi_modal_data"]["video"]
    with warnings.catch_warnings():  # recent transformers deprecate min_pixels / max_pixels (vLLM documents them)
        warnings.simplefilter("ignore", FutureWarning)
        out = vlm.processor(text=[request["prompt"]], images=request["multi_modal_data"]["image"], videos=[frames],
                            video_metadata=[meta], cap_pixels_per_frame=False, return_tensors="pt",
                            **vb.engine_mm_kwargs(VLMVideoConfig()), **request["mm_processor_kwargs"])
    assert set(out.keys()) == set(inputs.keys())
    for key, value in inputs.items():
        assert torch.equal(torch.as_tensor(out[key]), value.cpu()), key


def test_text_only_request_has_no_media(vlm):
    request = vb.build_request(vlm.processor, "2 + 2 = ?", [], [], [])
    assert set(request) == {"prompt"}
    assert request["prompt"] == vb.chat_text(vlm.processor, "2 + 2 = ?", 0, 0)
    with pytest.raises(ValueError, match="fps has 1 entries for 2 videos"):
        vb.build_request(vlm.processor, "x", [], list(media()[1:]) * 2, [2.0])
    with pytest.raises(ValueError, match=r"\(3,H,W\) uint8"):
        vb.to_pil(torch.zeros(3, 8, 8))


def test_several_videos_with_different_fps_pass_one_fps_each(vlm):
    _, video = media()
    request = vb.build_request(vlm.processor, "<video><video>same?", [], [video, video], [2.0, 4.0])
    assert request["mm_processor_kwargs"]["fps"] == [2.0, 4.0]
    assert [m["fps"] for _, m in request["multi_modal_data"]["video"]] == [2.0, 4.0]


def test_engine_kwargs(tmp_path):
    cfg = config(tmp_path, overrides=("generation.vllm_gpu_memory_utilization=0.4",))
    limits = {"image": 2, "video": 1}
    kwargs = vb.engine_kwargs(cfg, "/some/hub-like/path", limits, process_index=3)
    assert kwargs["model"] == kwargs["tokenizer"] == "/some/hub-like/path"
    assert kwargs["max_model_len"] == cfg.data.max_prompt_tokens + cfg.generation.max_new_tokens
    assert kwargs["gpu_memory_utilization"] == 0.4 and kwargs["enable_prefix_caching"] is True
    assert kwargs["limit_mm_per_prompt"] == limits and kwargs["seed"] == cfg.seed + 3
    assert kwargs["dtype"] == cfg.model.dtype and kwargs["generation_config"] == "vllm"
    assert kwargs["mm_processor_kwargs"] == {"min_pixels": 28 * 28, "max_pixels": 4 * 28 * 28}
    assert "distributed_executor_backend" not in kwargs and kwargs["enable_sleep_mode"] is False
    assert vb.engine_kwargs(cfg, "x", limits, distributed=True)["distributed_executor_backend"] == \
        "external_launcher"
    cfg = config(tmp_path, overrides=(
        "generation.vllm_engine_kwargs={enforce_eager: true, seed: 7, mm_processor_kwargs: {max_pixels: 5}}",
        "generation.vllm_max_model_len=333"))
    kwargs = vb.engine_kwargs(cfg, "x", limits)
    assert kwargs["enforce_eager"] is True and kwargs["seed"] == 7 and kwargs["max_model_len"] == 333
    assert kwargs["mm_processor_kwargs"] == {"min_pixels": 28 * 28, "max_pixels": 5}
    assert cfg.generation.vllm_engine_kwargs["mm_processor_kwargs"] == {"max_pixels": 5}  # not consumed
    cfg = config(tmp_path, overrides=("model.path=org/adapter", "model.revision=abc"))
    assert vb.engine_kwargs(cfg, "org/adapter", limits)["revision"] == "abc"
    assert vb.engine_kwargs(cfg, "org/base", limits)["revision"] is None  # the adapter's base: its own default


def test_media_limits():
    from mmgrpo.pipelines.vlm.data import VLMSample

    def item(images, videos):
        return {"sample": VLMSample(question="q", problem_type=None, options=[], solution="a", images=images,
                                    videos=videos, source="f:1")}

    assert vb.media_limits([item(["a", "b"], []), item([], ["v"]), {"prompt": "free"}]) == {"image": 2, "video": 1}


# ---------------------------------------------------------------------------------------------- sampling
def test_sampling_kwargs_ban_what_the_hf_path_never_samples(vlm):
    gen = VLMGenerationConfig(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=0)
    allowed = vb.allowed_token_ids(vlm.vocab_size, vlm.vision_token_ids)
    kwargs = vb.sampling_kwargs(gen, 5, 1234, allowed, vlm.eos_token_ids)
    assert kwargs == {"n": 5, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 12, "seed": 1234,
                      "allowed_token_ids": allowed, "stop_token_ids": vlm.eos_token_ids,
                      "skip_special_tokens": True, "detokenize": False, "logprobs": None}
    assert vb.sampling_kwargs(replace(gen, top_k=20), 5, 1, allowed, [], logprobs=True)["top_k"] == 20
    assert vb.sampling_kwargs(gen, 5, 1, allowed, [], logprobs=True)["logprobs"] == 0
    # the transformers path suppresses the vision tokens and every embedding row past the tokenizer
    vocab_rows = vlm.model.get_input_embeddings().weight.shape[0]
    suppressed = set(vlm.vision_token_ids) | set(range(vlm.vocab_size, vocab_rows))
    assert set(allowed) == set(range(vocab_rows)) - suppressed and len(allowed) == len(set(allowed))
    assert set(vlm.eos_token_ids) <= set(allowed)


def test_seeds_follow_the_generator():
    a = vb.draw_seeds(torch.Generator().manual_seed(5), 4)
    assert a == vb.draw_seeds(torch.Generator().manual_seed(5), 4) and len(set(a)) == 4
    assert vb.draw_seeds(torch.Generator().manual_seed(6), 4) != a  # another seed, other request seeds
    g = torch.Generator().manual_seed(5)
    assert vb.draw_seeds(g, 4) == a and vb.draw_seeds(g, 4) != a  # drawing moves the generator on
    assert all(0 <= s < 2**31 - 1 for s in a) and all(isinstance(s, int) for s in a)


# ---------------------------------------------------------------------------------------------- outputs
def test_outputs_become_padded_masked_completions(vlm):
    tok = vlm.tokenizer
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    answer, rambling = tok.encode("<think>left</think><answer>B</answer>"), tok.encode("it moves and moves")
    samples = [(answer + [im_end], "stop"), (rambling, "length"), (tok.encode("up") + [endoftext], "stop"),
               (rambling[:3] + [im_end], "length")]  # an EOS sampled exactly at the limit is not truncated
    out = vb.to_completions(samples, vlm.pad_token_id, vlm.eos_token_ids, tok)
    lengths = [len(s[0]) for s in samples]
    assert out.ids.shape == (4, max(lengths)) and out.ids.dtype == torch.long
    assert out.mask.sum(1).tolist() == lengths
    for row, (ids, _) in zip(range(4), samples):
        assert out.ids[row, :len(ids)].tolist() == ids
        assert (out.ids[row, len(ids):] == vlm.pad_token_id).all()
    assert out.truncated.tolist() == [False, True, False, False]
    assert out.texts == ["<think>left</think><answer>B</answer>", "it moves and moves", "up",
                         tok.decode(rambling[:3])]
    assert out.logprobs[out.mask].isnan().all() and (out.logprobs[~out.mask] == 0).all()  # not reported
    with_logp = vb.to_completions([(answer[:2], "length", [-0.5, -1.5])], 0, vlm.eos_token_ids, tok)
    assert with_logp.logprobs.tolist() == [[-0.5, -1.5]]
    with pytest.raises(ValueError, match="without an EOS"):
        vb.to_completions([(answer, "stop")], 0, vlm.eos_token_ids, tok)
    with pytest.raises(ValueError, match="'abort'"):
        vb.to_completions([(answer, "abort")], 0, vlm.eos_token_ids, tok)
    with pytest.raises(ValueError, match="1 log-probs for 2 tokens"):
        vb.to_completions([(answer[:2], "length", [-1.0])], 0, vlm.eos_token_ids, tok)


def test_hf_samples_round_trip_through_the_conversion(vlm):
    """The transformers sampler's own completions, handed over as vLLM hands them (real tokens, 'stop' / 'length'),
    come back identical: same ids, padding, mask, truncation flags and texts."""
    image, video = media(2)
    inputs = vlm.prompt_inputs("Describe <image> and <video>", [image], [video], [2.0])
    gen = VLMGenerationConfig(max_new_tokens=7, temperature=1.0)
    hf = generate_group(vlm, inputs, 5, gen, torch.Generator().manual_seed(0))
    samples = [(hf.ids[r][hf.mask[r]].tolist(), "length" if hf.truncated[r] else "stop",
                hf.logprobs[r][hf.mask[r]].tolist()) for r in range(5)]
    out = vb.to_completions(samples, vlm.pad_token_id, vlm.eos_token_ids, vlm.tokenizer)
    assert torch.equal(out.ids, hf.ids) and torch.equal(out.mask, hf.mask)
    assert torch.equal(out.truncated, hf.truncated) and out.texts == hf.texts
    assert torch.allclose(out.logprobs, hf.logprobs)


# ---------------------------------------------------------------------------------------------- weights
def test_checkpoint_names():
    def name(n):
        return vb.checkpoint_name(n, "qwen2_vl")

    assert name("module.base_model.model.model.language_model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert name("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert name("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.default.weight") is None
    assert name("base_model.model.model.visual.modules_to_save.default.blocks.0.attn.qkv.weight") == \
        "visual.blocks.0.attn.qkv.weight"
    assert name("base_model.model.model.visual.original_module.blocks.0.attn.qkv.weight") is None
    assert name("_orig_mod.model.visual.merger.mlp.0.bias") == "visual.merger.mlp.0.bias"
    assert name("lm_head.weight") == "lm_head.weight"
    assert name("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"  # already old-style
    # Qwen3-VL checkpoints keep the runtime names: only the wrappers and PEFT levels go
    assert vb.checkpoint_name("module.base_model.model.model.language_model.layers.0.self_attn.q_proj.base_layer"
                              ".weight", "qwen3_vl") == "model.language_model.layers.0.self_attn.q_proj.weight"
    assert vb.checkpoint_name("model.visual.blocks.0.attn.qkv.weight", "qwen3_vl") == "model.visual.blocks.0.attn.qkv.weight"


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = list(f.keys())
        return {k: f.get_tensor(k) for k in names}


class Wrapper(torch.nn.Module):
    """A DDP-like wrapper (the trained module as ``.module``)."""

    def __init__(self, module):
        super().__init__()
        self.module = module


@pytest.mark.parametrize("kind", KINDS)
def test_full_model_weights_are_the_checkpoint(kind):
    vlm = VLMModel(VLMModelConfig(path=f"tiny:{kind}"))
    saved = checkpoint_tensors(vlm.path)
    pushed = dict(vb.policy_weights(Wrapper(vlm.model)))
    assert set(pushed) == set(saved)
    assert all(torch.equal(pushed[k], saved[k]) for k in saved)
    before = vb.weights_version(vlm.model)
    assert vb.weights_version(vlm.model) == before  # reading does not count as a change
    with torch.no_grad():
        vlm.model.get_input_embeddings().weight.add_(1.0)
    assert vb.weights_version(vlm.model) > before
    (embed,) = [k for k in saved if k.endswith("embed_tokens.weight")]  # model.(language_model.)embed_tokens
    assert torch.equal(dict(vb.policy_weights(vlm.model))[embed], saved[embed] + 1.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("freeze_vision", [True, False])
def test_lora_weights_are_merged_under_the_base_checkpoint_names(kind, freeze_vision):
    vlm = VLMModel(VLMModelConfig(path=f"tiny:{kind}", lora_rank=4, freeze_vision=freeze_vision))
    saved = checkpoint_tensors(vlm.path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in vlm.model.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:  # a trained adapter (and trained vision copy)
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pushed = dict(vb.policy_weights(vlm.model))
    assert set(pushed) == set(saved)
    merged = {vb.checkpoint_name(k, kind): v
              for k, v in copy.deepcopy(vlm.model).merge_and_unload().state_dict().items()}
    for k in saved:
        assert torch.allclose(pushed[k], merged[k], atol=1e-6), k
    changed = {k for k in saved if not torch.equal(pushed[k], saved[k])}
    targets = tuple(f".{t}.weight" for t in vlm.cfg.lora_targets)
    vision = ("visual.", "model.visual.")  # Qwen2-VL / Qwen2.5-VL checkpoints, Qwen3-VL's
    text = {k for k in saved if k.startswith("model.") and not k.startswith(vision)}
    assert changed & text == {k for k in text if k.endswith(targets)}
    assert any(k.startswith(vision) for k in changed) == (not freeze_vision)
    # the adapter stays unmerged in the trained model
    assert all(not m.merged for m in vlm.model.modules() if hasattr(m, "merged"))


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_backend_vllm_without_vllm_is_a_one_line_config_error(tmp_path):
    cfg = config(tmp_path, overrides=("generation.backend=vllm",))  # loads: a GPU machine may run it
    for attempt in (lambda: check_config(cfg), lambda: VLMPolicy(cfg), lambda: vb.import_vllm(),
                    lambda: vb.VLLMSampler(cfg, None, {})):
        with pytest.raises(ConfigError) as err:
            attempt()
        message = str(err.value)
        assert "'generation.backend'" in message and "not available" in message and "vllm" in message
        assert "\n" not in message and not isinstance(err.value, ImportError)
    with pytest.raises(ConfigError, match="expected hf or vllm"):
        config(tmp_path, overrides=("generation.backend=sglang",))  # value checks run when the config loads
    with pytest.raises(ConfigError, match="'generation.vllm_gpu_memory_utilization'"):
        config(tmp_path, overrides=("generation.backend=vllm", "generation.vllm_gpu_memory_utilization=2"))


# ---------------------------------------------------------------------------------------------- policy wiring
class TransformersBehindTheSamplerInterface(vb.VLLMSampler):
    """Not vLLM: the policy's rollout path for ``backend: vllm`` with sampling done by transformers, each output
    handed over as vLLM hands it (real tokens, finish reason, log-probs) through :func:`vb.to_completions`."""

    def __init__(self, cfg, vlm):
        self.cfg, self.vlm, self._counters, self._asleep, self._llm = cfg, vlm, {}, False, None
        self.synced, self.calls = [], []

    def sync_weights(self, model):
        self.synced.append(vb.weights_version(model))
        self._counters["vllm/weight_sync"] = 1.0
        return True

    def generate(self, prepared, group_size, gen_cfg, generator):
        self.calls.append((len(prepared), group_size))
        out = []
        for hf in generate_groups(self.vlm, [p.inputs for p in prepared], group_size, gen_cfg, generator):
            samples = [(hf.ids[r][hf.mask[r]].tolist(), "length" if hf.truncated[r] else "stop",
                        hf.logprobs[r][hf.mask[r]].tolist()) for r in range(group_size)]
            out.append(vb.to_completions(samples, self.vlm.pad_token_id, self.vlm.eos_token_ids,
                                         self.vlm.tokenizer, self.vlm.device))
        return out


def test_policy_rollout_through_the_sampler_interface_starts_on_policy(tmp_path):
    policy = VLMPolicy(config(tmp_path, "tiny_video_tgrpo", ("tgrpo.shuffled_group_size=2",)))
    policy.sampler = sampler = TransformersBehindTheSamplerInterface(policy.cfg, policy.vlm)
    items = [i for i in policy.train_items if i["sample"].videos][:2]
    with torch.no_grad():
        rollout = policy.rollout(items, [0, 1], 3)
    assert sampler.synced == [vb.weights_version(policy.model)]
    assert sampler.calls == [(2, 3), (2, 2)]  # the ordered groups, then T-GRPO's shuffled ones in one call
    assert rollout.counters["tgrpo/video_groups"] == 2 and "tgrpo/shuffled_acc" in rollout.counters
    assert rollout.counters["vllm/weight_sync"] == 1.0
    assert rollout.recompute_old_logp  # the trainer takes the old log-probs from its forward: ratio exactly 1
    real = rollout.data["mask"]
    for rows in torch.arange(len(rollout)).split(policy.cfg.train.micro_batch_size):
        logp = policy.log_probs(rollout, rows, None, with_kl=False).logp.detach()
        assert (logp - rollout.old_logp[rows])[real[rows]].abs().max() < 1e-4  # the sampler's, handed over
