"""The tiny real-format VLMs and the model adapter: offline loading, prompt encoding, LoRA scope, freezing,
reference, and checkpoints."""

import os
import warnings

import pytest
import torch
import transformers

from mmgrpo.config import ConfigError
from mmgrpo.pipelines.vlm.config import VLMModelConfig
from mmgrpo.pipelines.vlm.model import VLMModel
from mmgrpo.pipelines.vlm.tiny import KINDS, SPECIAL_TOKENS, build_tiny_vlm, tiny_path
from mmgrpo.registry import MODEL_ADAPTERS

pytestmark = pytest.mark.usefixtures("one_thread")


def image(h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def video(t: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (t, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    return VLMModel(VLMModelConfig(path=f"tiny:{request.param}"))


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_builds_and_loads_offline(kind, tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = build_tiny_vlm(kind, tmp_path / kind)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    expected = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                "qwen3_vl": "Qwen3VLForConditionalGeneration"}
    assert type(model).__name__ == expected[kind]
    assert type(processor.tokenizer).__name__ == "Qwen2Tokenizer"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    video_processor = "Qwen3VLVideoProcessor" if kind == "qwen3_vl" else "Qwen2VLVideoProcessor"
    assert type(processor.video_processor).__name__ == video_processor
    assert processor.image_processor.patch_size == processor.video_processor.patch_size == (
        16 if kind == "qwen3_vl" else 14)  # the real models' patches
    assert (folder / "model.safetensors").is_file()
    tok = processor.tokenizer
    text = "<think>2+2 ≈ 4, 日本</think><answer>4</answer>"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode()) and max(ids) < 256  # byte level: tags are ordinary text
    assert tok.decode(ids) == text
    for special in SPECIAL_TOKENS:
        assert len(tok(special)["input_ids"]) == 1
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    head_dim = model.config.text_config.hidden_size // model.config.text_config.num_attention_heads
    assert sum(model.config.text_config.rope_parameters["mrope_section"]) * 2 == head_dim
    if kind == "qwen3_vl":
        assert model.config.text_config.rope_parameters["mrope_interleaved"]
        assert model.config.vision_config.deepstack_visual_indexes == [0]


def test_tiny_path_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path))
    first = tiny_path("qwen2_vl")
    assert first == tmp_path / "tiny" / f"qwen2_vl-v1-transformers{transformers.__version__}"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_path("qwen2_vl") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert os.listdir(tmp_path / "tiny") == [first.name]  # no staging folder left behind


def test_registered_as_model_adapter():
    assert MODEL_ADAPTERS.get("qwen2_vl") is VLMModel


def test_bad_paths_and_dtype_are_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="model.path") as err:
        VLMModel(VLMModelConfig(path=str(tmp_path / "missing")))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="model.path") as err:
        VLMModel(VLMModelConfig(path="nobody-here/no-such-model"))  # a hub id: no word about the working directory
    assert "\n" not in str(err.value) and "hub" in str(err.value) and "working directory" not in str(err.value)
    with monkeypatch.context() as m:  # the shipped model asked for from outside the repository reads as a hub id
        m.chdir(tmp_path)
        with pytest.raises(ConfigError, match="looked for under the working directory"):
            VLMModel(VLMModelConfig(path="assets/tiny-qwen2vl-shapes"))
    with pytest.raises(ConfigError, match=r"^model.path: './no-such-folder' is not an existing model folder \(looked "
                                          r"for under the working directory "):
        VLMModel(VLMModelConfig(path="./no-such-folder"))
    with pytest.raises(ConfigError, match="tiny:qwen2_vl"):
        VLMModel(VLMModelConfig(path="tiny:llama"))
    with pytest.raises(ConfigError, match="model.dtype"):
        VLMModel(VLMModelConfig(path="tiny:qwen2_vl", dtype="float8"))


def test_flash_attention_falls_back_to_sdpa_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_vl", attn_implementation="flash_attention_2"))
    assert vlm.model.config._attn_implementation == "sdpa"
    assert any("flash_attention_2" in str(w.message) for w in caught)


def test_special_token_ids(vlm):
    tok = vlm.tokenizer
    names = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>"]
    assert vlm.vision_token_ids == sorted(tok.convert_tokens_to_ids(names))
    assert vlm.eos_token_ids == sorted(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


def test_prompt_inputs_image_keeps_its_size(vlm):
    inputs = vlm.prompt_inputs("What colour?", [image(56, 84)], [])
    assert inputs["input_ids"].shape[0] == 1 and inputs["input_ids"].dtype == torch.int64
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]]  # 56x84 px in 14 px patches, no resize
    assert inputs["pixel_values"].shape[0] == 24
    pads = int((inputs["input_ids"] == vlm.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert pads == 24 // 4  # 2x2 patches merge into one token
    text = vlm.tokenizer.decode(inputs["input_ids"][0])
    assert text.endswith("What colour?<|im_end|>\n<|im_start|>assistant\n")
    assert text.index("<|vision_start|>") < text.index("What colour?")
    assert "pixel_values_videos" not in inputs


def test_patch_size_sets_the_tower_and_the_processors(tmp_path):
    folder = build_tiny_vlm("qwen2_vl", tmp_path / "p7", patch_size=7)
    vlm = VLMModel(VLMModelConfig(path=str(folder)))
    inputs = vlm.prompt_inputs("What colour?", [image(56, 56)], [video(4, 56, 56)])
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]  # 7 px patches: 4x the tokens of 14 px ones
    assert inputs["video_grid_thw"].tolist() == [[2, 8, 8]]
    assert inputs["pixel_values"].shape[1] == 3 * 2 * 7 * 7
    pads = int((inputs["input_ids"] == vlm.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert pads == 64 // 4
    with torch.no_grad():
        logits = vlm.model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()


def test_prompt_inputs_video_and_fps(vlm):
    inputs = vlm.prompt_inputs("What happens?", [], [video(4, 56, 56)], video_fps=[4.0])
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]]  # 4 frames -> 2 temporal patches
    assert inputs["pixel_values_videos"].shape[0] == 32
    pads = int((inputs["input_ids"] == vlm.tokenizer.convert_tokens_to_ids("<|video_pad|>")).sum())
    assert pads == 8
    kind = type(vlm.model).__name__
    if kind.startswith("Qwen2_5"):  # 2 frames per temporal patch at 4 fps
        assert inputs["second_per_grid_ts"].tolist() == [0.5]
    text = vlm.tokenizer.decode(inputs["input_ids"][0])
    if kind.startswith("Qwen3"):  # each temporal patch's time in the prompt: frames at 0.125, 0.375 | 0.625, 0.875 s
        assert "<0.2 seconds><|vision_start|>" + "<|video_pad|>" * 4 in text and "<0.8 seconds>" in text
    else:
        assert "seconds>" not in text


def test_prompt_inputs_several_images_and_a_video(vlm):
    inputs = vlm.prompt_inputs("Compare.", [image(28, 56), image(84, 28, 1)], [video(2, 28, 28)])
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 4], [1, 6, 2]]
    assert inputs["video_grid_thw"].tolist() == [[1, 2, 2]]
    starts = int((inputs["input_ids"] == vlm.tokenizer.convert_tokens_to_ids("<|vision_start|>")).sum())
    assert starts == 3 + type(vlm.model).__name__.startswith("Qwen3")  # Qwen3-VL: one more per temporal patch
    with torch.no_grad():  # placeholders and features agree: the forward runs
        vlm.model(**inputs)


def test_prompt_inputs_put_the_media_at_the_markers(vlm):
    """EasyR1 ``<image>``/``<video>`` markers: each medium's vision tokens land where its marker was, in order (the
    two images have 2 and 3 tokens), and no marker is left as text."""
    images, videos = [image(28, 56), image(84, 28, 1)], [video(2, 28, 28)]
    inputs = vlm.prompt_inputs("Compare <image> with <image>, then<video>?", images, videos)
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 4], [1, 6, 2]]

    def block(pad: str, n: int) -> str:
        inner = pad * n
        if pad == "<|video_pad|>" and type(vlm.model).__name__.startswith("Qwen3"):  # a timed block per patch
            inner = "<0.5 seconds><|vision_start|>" + inner + "<|vision_end|>"
        return "<|vision_start|>" + inner + "<|vision_end|>"

    text = vlm.tokenizer.decode(inputs["input_ids"][0])
    turn = (f"<|im_start|>user\nCompare {block('<|image_pad|>', 2)} with {block('<|image_pad|>', 3)}, then"
            f"{block('<|video_pad|>', 1)}?<|im_end|>\n<|im_start|>assistant\n")
    assert text.endswith(turn) and "<image>" not in text and "<video>" not in text
    with torch.no_grad():  # placeholders and features agree: the forward runs
        vlm.model(**inputs)
    plain = vlm.tokenizer.decode(vlm.prompt_inputs("Compare.", images, videos)["input_ids"][0])
    assert plain.endswith(f"user\n{block('<|image_pad|>', 2)}{block('<|image_pad|>', 3)}"
                          f"{block('<|video_pad|>', 1)}Compare.<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="1 <image> and 0 <video> markers but the sample has 2 images"):
        vlm.prompt_inputs("Compare <image>.", images, [])


def test_prompt_inputs_rejects_wrong_layouts(vlm):
    with pytest.raises(ValueError, match="uint8"):
        vlm.prompt_inputs("x", [image(28, 28).float()], [])
    with pytest.raises(ValueError, match=r"\(T,3,H,W\)"):
        vlm.prompt_inputs("x", [], [image(28, 28)])


@pytest.mark.parametrize("kind", KINDS)
def test_lora_targets_only_the_language_model(kind):
    # gate/up/down_proj also name the Qwen2.5-VL vision MLP: the adapter must still stay in the language model
    cfg = VLMModelConfig(path=f"tiny:{kind}", lora_rank=4,
                         lora_targets=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    vlm = VLMModel(cfg)
    lora = [n for n, _ in vlm.model.named_modules() if n.endswith(("lora_A", "lora_B"))]
    assert len(lora) == 2 * 2 * 5  # layers x (A, B) x targets
    assert all(".language_model." in n for n in lora)
    trainable = [n for n, p in vlm.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("targets, named", [(["q_proj", "vproj"], "'vproj'"), (["qkv"], "'qkv'"), ([], "empty")])
def test_a_lora_target_that_names_no_language_model_layer_is_a_config_error(targets, named):
    """PEFT stops only when no target matches: a typo beside a valid target ("vproj") would silently train
    fewer layers, and a vision-only name ("qkv") or an empty list would be a traceback."""
    with pytest.raises(ConfigError, match=r"^bad value for 'model\.lora_targets'") as err:
        VLMModel(VLMModelConfig(path="tiny:qwen2_vl", lora_rank=4, lora_targets=targets))
    message = str(err.value)
    assert named in message and "q_proj" in message and "down_proj" in message and "\n" not in message


def test_freeze_vision_full_and_lora():
    frozen = VLMModel(VLMModelConfig(path="tiny:qwen2_vl", freeze_vision=True)).model
    assert not any(p.requires_grad for p in frozen.model.visual.parameters())  # tower and merger
    assert all(p.requires_grad for p in frozen.model.language_model.parameters())
    free = VLMModel(VLMModelConfig(path="tiny:qwen2_vl", freeze_vision=False)).model
    assert all(p.requires_grad for p in free.model.visual.merger.parameters())
    lora = VLMModel(VLMModelConfig(path="tiny:qwen2_vl", lora_rank=4, freeze_vision=False)).model
    vision = [n for n, p in lora.named_parameters() if p.requires_grad and ".visual." in n]
    assert vision and all("modules_to_save" in n for n in vision)  # trained and saved with the adapter


def perturb(model: torch.nn.Module, names: tuple[str, ...] = ()) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad and (not names or any(k in n for k in names)):
                p.add_(0.05 * torch.randn(p.shape, generator=gen))


def logits_of(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_lora_reference_is_the_adapter_disabled_base():
    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_vl", lora_rank=4))
    inputs = vlm.prompt_inputs("hi", [image(28, 28)], [])
    base = logits_of(vlm.model, inputs)
    perturb(vlm.model, ("lora_B",))
    assert not torch.allclose(logits_of(vlm.model, inputs), base, atol=1e-4)
    with vlm.reference() as ref:
        assert torch.allclose(logits_of(ref, inputs), base, atol=1e-6)
    assert not torch.allclose(logits_of(vlm.model, inputs), base, atol=1e-4)  # adapter back on


def test_full_reference_is_a_frozen_copy_and_required():
    no_copy = VLMModel(VLMModelConfig(path="tiny:qwen2_vl"))
    with pytest.raises(RuntimeError, match="keep_reference"), no_copy.reference():
        pass
    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_vl"), keep_reference=True)
    inputs = vlm.prompt_inputs("hi", [image(28, 28)], [])
    base = logits_of(vlm.model, inputs)
    perturb(vlm.model)
    with vlm.reference() as ref:
        assert ref is not vlm.model and not any(p.requires_grad for p in ref.parameters())
        assert torch.allclose(logits_of(ref, inputs), base, atol=1e-6)


def assert_same_tensors(a, b):
    from safetensors.torch import load_file

    left, right = load_file(a), load_file(b)
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_full_save_load_round_trip(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_5_vl"))
    perturb(vlm.model)
    vlm.save(tmp_path / "ckpt")
    vlm.save(tmp_path / "gathered", state_dict=vlm.model.state_dict())  # as under FSDP / ZeRO-3
    assert_same_tensors(tmp_path / "ckpt" / "model.safetensors", tmp_path / "gathered" / "model.safetensors")
    inputs = vlm.prompt_inputs("hi", [image(28, 56)], [video(2, 28, 28)])
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt")
    assert torch.allclose(logits_of(reloaded, inputs), logits_of(vlm.model, inputs), atol=1e-6)
    AutoProcessor.from_pretrained(tmp_path / "ckpt")
    fresh = VLMModel(VLMModelConfig(path="tiny:qwen2_5_vl"))
    params = [p for p in fresh.model.parameters()]
    fresh.load(tmp_path / "ckpt")
    assert all(a is b for a, b in zip(params, fresh.model.parameters()))  # loaded in place
    assert torch.allclose(logits_of(fresh.model, inputs), logits_of(vlm.model, inputs), atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_load_restores_the_saved_weights_bit_for_bit(kind, tmp_path):
    """Qwen2-VL and Qwen2.5-VL checkpoints name the language model model.* and the tower visual.*, which this
    transformers' model calls model.language_model.* and model.visual.*: load maps them as from_pretrained does."""
    vlm = VLMModel(VLMModelConfig(path=f"tiny:{kind}"))
    perturb(vlm.model)
    vlm.save(tmp_path / "ckpt")
    fresh = VLMModel(VLMModelConfig(path=f"tiny:{kind}"))
    params = list(fresh.model.parameters())
    fresh.load(tmp_path / "ckpt")
    assert all(a is b for a, b in zip(params, fresh.model.parameters(), strict=True))
    saved, loaded = vlm.model.state_dict(), fresh.model.state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_a_full_load_reads_tensor_by_tensor_without_a_second_model(tmp_path):
    """load copied from a second whole model built by from_pretrained: the process grew by the model's size (+32
    MiB for this 32 MiB model; 15 GB for a 7B model in bf16). Now it grows by about a tensor (+1.6 MiB here)."""
    from mmgrpo.pipelines.flow.bench import _reset_peak_rss, _status_mib

    folder = build_tiny_vlm("qwen2_vl", tmp_path / "base", hidden_size=384, num_layers=6)
    vlm = VLMModel(VLMModelConfig(path=str(folder)))
    model_mib = sum(p.numel() * p.element_size() for p in vlm.model.parameters()) / 2**20
    perturb(vlm.model)
    vlm.model.save_pretrained(tmp_path / "ckpt", max_shard_size="8MB")
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    saved = {k: v.clone() for k, v in vlm.model.state_dict().items()}
    with torch.no_grad():
        for p in vlm.model.parameters():
            p.zero_()
    before = _status_mib("VmRSS")
    if before is None or not _reset_peak_rss():
        pytest.skip("needs Linux /proc/self/status and clear_refs to measure the peak resident size")
    vlm.load(tmp_path / "ckpt")
    growth = _status_mib("VmHWM") - before
    assert all(torch.equal(v, saved[k]) for k, v in vlm.model.state_dict().items())
    assert growth < 0.3 * model_mib, f"loading grew the process by {growth:.1f} MiB for a {model_mib:.0f} MiB model"


def test_full_weights_that_do_not_fit_are_one_line_naming_the_folder(tmp_path):
    from safetensors.torch import load_file, save_file

    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_vl"))  # 2 layers, hidden size 64
    fewer = build_tiny_vlm("qwen2_vl", tmp_path / "fewer", num_layers=1)
    with pytest.raises(ValueError, match=r"^weights in .*fewer do not fit this Qwen2VLForConditionalGeneration: "
                                         r"missing 12 \(model\.language_model\.layers\.1\.") as err:
        vlm.load(fewer)
    wider = build_tiny_vlm("qwen2_vl", tmp_path / "wider", hidden_size=128)
    with pytest.raises(ValueError, match=r"^weights in .*wider do not fit .*: shaped differently 29 "
                                         r"\(lm_head\.weight: \(272, 128\) there, \(272, 64\) here, model\.language_"):
        vlm.load(wider)
    extra = build_tiny_vlm("qwen2_vl", tmp_path / "extra")
    weights = load_file(extra / "model.safetensors")
    save_file({**weights, "lm_head.bias": torch.zeros(3)}, extra / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"^weights in .*extra do not fit .*: unexpected 1 \(lm_head\.bias\)"):
        vlm.load(extra)
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors \(or its index\) in .*nothing"):
        vlm.load(tmp_path / "nothing")


def test_load_full_fills_tied_weights_and_applies_the_mapping_conversions(tmp_path):
    """A checkpoint of tied embeddings holds one of the two names (Qwen2-VL-2B); Qwen3-VL-MoE's mapping converts its
    expert tensors (a shape-checked transpose), applied as from_pretrained applies it."""
    from safetensors.torch import load_file, save_file
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    from mmgrpo.pipelines.vlm.model import load_full

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    tied = Qwen2VLConfig(text_config={"vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
                                      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "rope_parameters": rope}, tie_word_embeddings=True,
                         vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2})
    moe = Qwen3VLMoeConfig(text_config={"vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
                                        "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                        "head_dim": 16, "rope_parameters": {**rope, "mrope_interleaved": True}},
                           vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                          "out_hidden_size": 64, "num_position_embeddings": 16,
                                          "deepstack_visual_indexes": [0]})
    for cls, config in ((Qwen2VLForConditionalGeneration, tied), (Qwen3VLMoeForConditionalGeneration, moe)):
        torch.manual_seed(0)
        model = cls(config)
        model.save_pretrained(tmp_path / cls.__name__)
        other = cls(config)
        load_full(tmp_path / cls.__name__, other)
        saved, loaded = model.state_dict(), other.state_dict()
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved), cls.__name__
    file = tmp_path / cls.__name__ / "model.safetensors"  # experts transposed: the converter transposes them back
    save_file({k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in load_file(file).items()},
              file, metadata={"format": "pt"})
    other = cls(config)
    load_full(tmp_path / cls.__name__, other)
    assert all(torch.equal(v, saved[k]) for k, v in other.state_dict().items())


def test_a_resume_loads_a_full_fine_tune_into_fsdp2_sharded_weights(launch_two_processes, tmp_path):
    """Two gloo processes on accelerate's FSDP2 (tests/support/fsdp_resume_check.py): the trainer loads a checkpoint
    after prepare, into the sharded (DTensor) parameters. The loaded weights are the saved ones exactly, and the
    resumed step 2 is the uninterrupted run's: same metrics, same weights saved. Loading failed here on the names
    (FSDP2 gives the model a class of its own, for which transformers finds no conversion mapping: Qwen2-VL's
    model.* / visual.* went unmapped) and then on the copy (a whole tensor into a DTensor shard)."""
    report = launch_two_processes("fsdp_resume_check.py", tmp_path / "runs")
    assert report["sharded"]
    assert report["loaded_max_diff"] == 0
    (straight,), (resumed,) = report["rows"]
    assert straight["step"] == resumed["step"] == 2
    assert straight.keys() == resumed.keys()
    assert {k: v for k, v in resumed.items() if not k.startswith("time/")} == {
        k: v for k, v in straight.items() if not k.startswith("time/")}  # loss, grad norm, rewards...
    assert report["step2_max_diff"] == 0
    # fsdp.yaml's SHARDED_STATE_DICT: accelerate's copies of the model and optimizer are per-process shards, the
    # weights users load are the gathered policy/ folder
    assert {"policy", "pytorch_model_fsdp_0", "optimizer_0"} <= set(report["checkpoint"])
    assert not any(name.endswith(".bin") and "fsdp" in name for name in report["checkpoint"])


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # raised inside PEFT
def test_lora_save_load_round_trip(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_vl", lora_rank=4))
    perturb(vlm.model, ("lora_B",))
    vlm.save(tmp_path / "adapter")
    vlm.save(tmp_path / "gathered", state_dict=vlm.model.state_dict())  # as under FSDP / ZeRO-3
    assert_same_tensors(*(d / "adapter_model.safetensors" for d in (tmp_path / "adapter", tmp_path / "gathered")))
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    inputs = vlm.prompt_inputs("hi", [image(28, 28)], [])
    expected = logits_of(vlm.model, inputs)
    base = AutoModelForImageTextToText.from_pretrained(vlm.path)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert torch.allclose(logits_of(peft_model, inputs), expected, atol=1e-6)
    fresh = VLMModel(VLMModelConfig(path="tiny:qwen2_vl", lora_rank=4))
    assert not torch.allclose(logits_of(fresh.model, inputs), expected, atol=1e-4)
    fresh.load(tmp_path / "adapter")
    assert torch.allclose(logits_of(fresh.model, inputs), expected, atol=1e-6)


def test_quiet_turns_transformers_progress_bars_off_and_back_as_they_were():
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    with VLMModel.quiet():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with VLMModel.quiet():
            pass
        assert not hf_logging.is_progress_bar_enabled()  # a user's choice stays
    finally:
        hf_logging.enable_progress_bar()
