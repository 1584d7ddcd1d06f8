"""Model-based image rewards on tiny models saved in the real formats (see conftest.py), loaded through the same code
as the published checkpoints, and the tensor CLIP preprocessing they share."""

from __future__ import annotations

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mmgrpo.registry import REWARDS
from mmgrpo.rewards import RewardBatch, build_reward
from mmgrpo.rewards.clip_models import TextEmbeddingCache, load_open_clip
from mmgrpo.rewards.preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ClipPreprocess

PROMPTS = ["a red cube", "a blue ball on green grass", "a red cube", "two cats on a sofa"]
IMAGE_REWARDS = ["clip_score", "pickscore", "hpsv2", "hpsv2.1", "aesthetic"]
TEXT_REWARDS = ["clip_score", "pickscore", "hpsv2", "hpsv2.1"]


def random_images(n: int, height: int = 32, width: int = 32, seed: int = 0) -> torch.Tensor:
    """(n, 3, H, W) float32 in [0, 1] on the uint8 grid (so a uint8 pipeline sees exactly the same pixels)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, height, width), generator=g).float() / 255


def smooth_image(height: int, width: int) -> np.ndarray:
    """(H, W, 3) uint8: gradients plus a flat rectangle (a natural-image-like test card)."""
    yy, xx = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    img = np.stack([np.sin(6 * xx + 1) * 0.5 + 0.5, np.cos(5 * yy) * 0.5 + 0.5, xx * yy], -1)
    img[height // 4:height // 2, width // 3:width // 2] = [1.0, 0.2, 0.1]
    return (img * 255).round().astype(np.uint8)


def noise_image(height: int, width: int) -> np.ndarray:
    return np.random.RandomState(0).randint(0, 256, (height, width, 3)).astype(np.uint8)


def to_tensor(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(arr).permute(2, 0, 1)[None].float() / 255


def image_batch(images: torch.Tensor, prompts: list[str]) -> RewardBatch:
    return RewardBatch(prompts=list(prompts), group=torch.arange(len(prompts)), images=images)


def reward_args(name: str, tiny) -> dict:
    if name == "clip_score":
        return {"model_name": tiny.clip_config, "pretrained": tiny.clip_checkpoint, "device": "cpu"}
    if name == "pickscore":
        return {"model": tiny.pick_model, "processor": tiny.pick_processor, "device": "cpu"}
    if name in ("hpsv2", "hpsv2.1"):
        return {"checkpoint": tiny.hps_checkpoint, "model_name": tiny.clip_config, "device": "cpu"}
    assert name == "aesthetic"
    return {"clip_model": tiny.clip_config, "clip_pretrained": tiny.clip_checkpoint,
            "checkpoint": tiny.aesthetic_checkpoint, "embed_dim": 32, "device": "cpu"}


@pytest.fixture(scope="module")
def rewards(tiny_models):
    """name -> reward built once through the registry (tests that patch a model build their own)."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_reward(name, reward_args(name, tiny_models))
        return built[name]

    return get


# ---------------------------------------------------------------- direct computations, independent of mmgrpo code


def _open_clip_features(tiny, state: dict, images: torch.Tensor, prompts: list[str]):
    """Normalised image and text features of the tiny open_clip model with ``state``; 32 px input needs no resize,
    so preprocessing is only the normalisation."""
    model = open_clip.create_model(tiny.clip_name).eval()
    model.load_state_dict(state)
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        image = F.normalize(model.encode_image((images - mean) / std), dim=-1)
        text = F.normalize(model.encode_text(open_clip.get_tokenizer(tiny.clip_name)(prompts)), dim=-1)
    return image, text


def direct_scores(name: str, tiny, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    if name == "clip_score":
        image, text = _open_clip_features(tiny, torch.load(tiny.clip_checkpoint), images, prompts)
        return 100 * (image * text).sum(-1).clamp(min=0)
    if name in ("hpsv2", "hpsv2.1"):
        image, text = _open_clip_features(tiny, torch.load(tiny.hps_checkpoint)["state_dict"], images, prompts)
        return (image * text).sum(-1)
    if name == "aesthetic":
        image, _ = _open_clip_features(tiny, torch.load(tiny.clip_checkpoint), images, prompts)
        mlp = torch.nn.Sequential(
            torch.nn.Linear(32, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1)).eval()
        mlp.load_state_dict({k.removeprefix("layers."): v for k, v in torch.load(tiny.aesthetic_checkpoint).items()})
        with torch.no_grad():
            return mlp(image).squeeze(-1)
    assert name == "pickscore"
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(tiny.pick_model).eval()
    processor = CLIPProcessor.from_pretrained(tiny.pick_processor)
    pil = [Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()) for img in images]
    inputs = processor(text=prompts, images=pil, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_image.diagonal()


# ------------------------------------------------------------------------------------------------ preprocessing


@pytest.mark.parametrize("mode", ["shortest", "longest"])
@pytest.mark.parametrize("shape", [(300, 400), (512, 512), (160, 200), (250, 180)])
@pytest.mark.parametrize("kind", ["smooth", "noise"])
def test_preprocess_close_to_open_clip_pil_transform(mode, shape, kind):
    arr = (smooth_image if kind == "smooth" else noise_image)(*shape)
    reference = open_clip.image_transform(224, is_train=False, resize_mode=mode)(Image.fromarray(arr))
    out = ClipPreprocess(224, resize_mode=mode)(to_tensor(arr))[0]
    assert out.shape == reference.shape
    diff = (out - reference).abs()
    # PIL resamples in two uint8-rounded, clamped passes; torch in float. Measured here: mean 0.0024-0.0053; pixels
    # off by > 0.05 at most 0.53% (noise upsampled, where PIL clamps the overshoot between passes); max 0.30.
    assert diff.mean() < 0.01, diff.mean()
    assert (diff > 0.05).float().mean() < 0.01
    assert diff.max() < 0.35, diff.max()


@pytest.mark.parametrize("mode,shape", [("shortest", (224, 224)), ("shortest", (224, 260)), ("shortest", (301, 224)),
                                        ("shortest", (224, 227)), ("longest", (180, 224)), ("longest", (224, 131))])
def test_preprocess_exact_when_no_resize_is_needed(mode, shape):
    """Crop only, pad only, or nothing: the same pixels as open_clip's PIL transform (incl. its crop offsets: a
    margin of 3 starts the crop at round(1.5) = 2)."""
    arr = smooth_image(*shape)
    reference = open_clip.image_transform(224, is_train=False, resize_mode=mode)(Image.fromarray(arr))
    out = ClipPreprocess(224, resize_mode=mode)(to_tensor(arr))[0]
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=0)


def test_preprocess_from_hf_processor_matches_processor(tiny_models):
    from transformers import CLIPProcessor

    processor = CLIPProcessor.from_pretrained(tiny_models.pick_processor)
    pre = ClipPreprocess.from_hf_image_processor(processor)
    assert (pre.size, pre.resize_mode, pre.interpolation) == ((32, 32), "shortest", "bicubic")
    for arr, tolerance in [(smooth_image(32, 40), 1e-6), (smooth_image(48, 64), 0.01), (noise_image(64, 48), 0.01)]:
        reference = processor(images=Image.fromarray(arr), return_tensors="pt").pixel_values[0]
        diff = (pre(to_tensor(arr))[0] - reference).abs()
        assert diff.mean() < tolerance, diff.mean()


@pytest.mark.parametrize("shape", [(32, 35), (35, 32), (480, 650), (650, 480)])
def test_preprocess_from_hf_processor_crops_like_transformers(tiny_models, shape):
    """Odd crop margins (3 px without a resize; 480x650 -> 32x43, an 11 px margin) start transformers' crop at
    margin // 2, one pixel before torchvision's round(margin / 2). Fed the same float pixels (no uint8 rounding),
    the processor and the tensor transform agree to float precision."""
    from transformers import CLIPProcessor

    processor = CLIPProcessor.from_pretrained(tiny_models.pick_processor)
    pre = ClipPreprocess.from_hf_image_processor(processor)
    images = to_tensor(noise_image(*shape))
    reference = processor(images=images[0], do_rescale=False, return_tensors="pt").pixel_values
    torch.testing.assert_close(pre(images), reference, atol=1e-5, rtol=0)
    rounded = ClipPreprocess(pre.size, pre.mean, pre.std, pre.resize_mode, pre.interpolation, crop_offset="round")
    assert (rounded(images) - reference).abs().max() > 0.1  # the shape does exercise the one-pixel difference
    if max(shape) < 40:  # no resize: the PIL/uint8 path is exact too
        pil = processor(images=Image.fromarray(noise_image(*shape)), return_tensors="pt").pixel_values
        torch.testing.assert_close(pre(images), pil, atol=1e-6, rtol=0)


def test_preprocess_batch_dtype_and_shape_checks():
    pre = ClipPreprocess((32, 32))
    images = random_images(3, 40, 56)
    out = pre(images, torch.bfloat16)
    assert out.shape == (3, 3, 32, 32) and out.dtype == torch.bfloat16
    torch.testing.assert_close(pre(images)[1:2], pre(images[1:2]))  # per-image, batch independent
    with pytest.raises(ValueError, match="RGB"):
        pre(random_images(1)[:, :1])


# ------------------------------------------------------------------------------------------------ the rewards


def test_registered_with_kind_modality_and_description():
    for name in IMAGE_REWARDS:
        info = REWARDS.entry(name).info
        assert info["kind"] == "pointwise" and info["modality"] == "image", name
        assert info["description"] and "\n" not in info["description"]


@pytest.mark.parametrize("name", IMAGE_REWARDS)
def test_score_equals_direct_computation(name, rewards, tiny_models):
    images = random_images(4)
    scores = rewards(name)(image_batch(images, PROMPTS))
    expected = direct_scores(name, tiny_models, images, PROMPTS)
    assert scores.shape == (4,) and scores.dtype == torch.float64
    torch.testing.assert_close(scores.float(), expected.float(), atol=1e-4, rtol=1e-4)
    if name == "clip_score":  # the max(cos, 0) clip is exercised: these seeds give both signs
        assert (scores == 0).any() and (scores > 0).any()


@pytest.mark.parametrize("name", ["hpsv2", "hpsv2.1"])
def test_hps_pads_non_square_images_like_its_eval_transform(name, rewards, tiny_models):
    """HPSv2 evaluates with the longer side resized and black padding (open_clip ``resize_mode='longest'``)."""
    arrays = [smooth_image(20, 32), noise_image(32, 24)]
    transform = open_clip.image_transform(32, is_train=False, resize_mode="longest")
    pixels = torch.stack([transform(Image.fromarray(a)) for a in arrays])
    model = open_clip.create_model(tiny_models.clip_name).eval()
    model.load_state_dict(torch.load(tiny_models.hps_checkpoint)["state_dict"])
    with torch.no_grad():
        image = F.normalize(model.encode_image(pixels), dim=-1)
        text = F.normalize(model.encode_text(open_clip.get_tokenizer(tiny_models.clip_name)(PROMPTS[:2])), dim=-1)
    for i, a in enumerate(arrays):
        score = rewards(name)(image_batch(to_tensor(a), PROMPTS[i:i + 1]))
        torch.testing.assert_close(score.float(), (image[i] * text[i]).sum().view(1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", IMAGE_REWARDS)
def test_batching_invariance(name, rewards):
    reward = rewards(name)
    images = random_images(4, 40, 48, seed=1)
    together = reward(image_batch(images, PROMPTS))
    for i in range(4):
        reward.to("cpu")  # also drops the text cache, so the text tower runs on this prompt alone
        alone = reward(image_batch(images[i:i + 1], PROMPTS[i:i + 1]))
        torch.testing.assert_close(alone, together[i:i + 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", IMAGE_REWARDS)
def test_images_are_encoded_batch_size_at_a_time(name, tiny_models, rewards):
    """7 images at batch_size 3 take 3 forwards of 3, 3 and 1 images, and score as one forward of all 7 does."""
    reward = build_reward(name, {**reward_args(name, tiny_models), "batch_size": 3})
    original, sizes = reward.encode_images, []

    def counting(pixels):
        sizes.append(len(pixels))
        return original(pixels)

    reward.encode_images = counting
    images, prompts = random_images(7, seed=5), (PROMPTS * 2)[:7]
    sliced = reward(image_batch(images, prompts))
    assert sizes == [3, 3, 1]
    torch.testing.assert_close(sliced, rewards(name)(image_batch(images, prompts)), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        build_reward(name, {**reward_args(name, tiny_models), "batch_size": 0})


@pytest.mark.parametrize("name", TEXT_REWARDS)
def test_text_tower_runs_once_per_distinct_prompt(name, tiny_models):
    reward = build_reward(name, reward_args(name, tiny_models))
    method = "get_text_features" if name == "pickscore" else "encode_text"
    original, encoded = getattr(reward.model, method), []

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        encoded.append(len(args[0]) if args else len(kwargs["input_ids"]))
        return out

    setattr(reward.model, method, counting)
    images = random_images(4)
    first = reward(image_batch(images, PROMPTS))  # 3 distinct prompts, one call
    assert encoded == [3]
    reward(image_batch(images, ["two cats on a sofa", "a dog", "a dog", "a red cube"]))  # only "a dog" is new
    assert encoded == [3, 1]
    again = reward(image_batch(images, PROMPTS))
    assert encoded == [3, 1]
    torch.testing.assert_close(again, first, atol=0, rtol=0)


@pytest.mark.parametrize("name", IMAGE_REWARDS)
def test_grayscale_and_rgba_inputs(name, rewards):
    reward = rewards(name)
    gray = random_images(4, 40, 48, seed=2)[:, :1]
    torch.testing.assert_close(reward(image_batch(gray, PROMPTS)),
                               reward(image_batch(gray.expand(-1, 3, -1, -1), PROMPTS)), atol=1e-6, rtol=0)
    rgb = random_images(4, seed=3)
    opaque = torch.cat([rgb, torch.ones_like(rgb[:, :1])], 1)
    torch.testing.assert_close(reward(image_batch(opaque, PROMPTS)), reward(image_batch(rgb, PROMPTS)),
                               atol=1e-6, rtol=0)
    half = torch.cat([rgb, torch.full_like(rgb[:, :1], 0.5)], 1)
    torch.testing.assert_close(reward(image_batch(half, PROMPTS)),
                               reward(image_batch(rgb * 0.5 + 0.5, PROMPTS)), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        reward(image_batch(rgb * 255, PROMPTS))


def test_write_recorder_sees_writes(no_file_writes, tmp_path):
    """The recorder the next test relies on does catch writes (builtin open, torch.save, PIL)."""
    with no_file_writes as writes:
        (tmp_path / "a.txt").write_text("x")
        torch.save(torch.zeros(1), tmp_path / "b.pt")
        Image.new("RGB", (2, 2)).save(tmp_path / "c.png")
    assert len(writes) >= 3


@pytest.mark.parametrize("name", IMAGE_REWARDS)
def test_no_file_written_during_scoring(name, rewards, no_file_writes):
    reward = rewards(name)
    batch = image_batch(random_images(4, 48, 40, seed=4), ["never seen " + p for p in PROMPTS])
    with no_file_writes as writes:
        scores = reward(batch)
    assert writes == []
    assert torch.isfinite(scores).all()


def test_scores_have_no_grad_and_model_is_frozen(rewards):
    reward = rewards("clip_score")
    images = random_images(2).requires_grad_(True)
    scores = reward(image_batch(images, PROMPTS[:2]))
    assert not scores.requires_grad
    assert not any(p.requires_grad for p in reward.model.parameters())


def test_hps_checkpoint_missing_offline_is_one_clear_line(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    for name, filename in [("hpsv2", "HPS_v2_compressed.pt"), ("hpsv2.1", "HPS_v2.1_compressed.pt")]:
        with pytest.raises(RuntimeError) as err:
            build_reward(name, {"device": "cpu"})
        message = str(err.value)
        assert filename in message and "xswu/HPSv2" in message and "checkpoint=" in message
        assert "\n" not in message
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        build_reward("hpsv2", {"checkpoint": str(tmp_path / "nope.pt"), "device": "cpu"})


def test_aesthetic_checks_embedding_size_and_key_layout(tiny_models, tmp_path):
    args = reward_args("aesthetic", tiny_models)
    with pytest.raises(RuntimeError, match="embed_dim=768"):
        build_reward("aesthetic", {**args, "embed_dim": 768})
    flat = {k.replace("layers.", "fc."): v for k, v in torch.load(tiny_models.aesthetic_checkpoint).items()}
    torch.save(flat, tmp_path / "wrong.pth")
    with pytest.raises(RuntimeError, match="layers.0"):
        build_reward("aesthetic", {**args, "checkpoint": str(tmp_path / "wrong.pth")})


def test_aesthetic_file_that_is_not_a_state_dict_is_one_line_naming_it(tiny_models, tmp_path):
    """An HTML page saved by a failed download, or a tensor saved instead of a state dict."""
    args = reward_args("aesthetic", tiny_models)
    (tmp_path / "page.pth").write_text("<html>404</html>")
    torch.save([torch.zeros(3)], tmp_path / "list.pth")
    for name in ("page.pth", "list.pth"):
        path = str(tmp_path / name)
        with pytest.raises(RuntimeError, match=f"^aesthetic: '{path}' is not a state dict") as err:
            build_reward("aesthetic", {**args, "checkpoint": path})
        assert "\n" not in str(err.value)


def test_openai_tags_get_quick_gelu(monkeypatch):
    """open_clip only warns when an OpenAI (QuickGELU) tag meets a GELU config; the loader sets it."""
    seen = {}

    def fake_create_model(name, pretrained=None, device=None, force_quick_gelu=False):
        seen[(name, pretrained)] = force_quick_gelu
        raise OSError("offline")

    monkeypatch.setattr(open_clip, "create_model", fake_create_model)
    for name, tag in [("ViT-L-14", "openai"), ("ViT-H-14", "laion2b_s32b_b79k")]:
        with pytest.raises(RuntimeError, match=f"cannot load open_clip model '{name}'"):
            load_open_clip(name, tag, torch.device("cpu"))
    assert seen == {("ViT-L-14", "openai"): True, ("ViT-H-14", "laion2b_s32b_b79k"): False}


def test_text_embedding_cache_is_lru_and_bounded():
    calls = []

    def encode(prompts):
        calls.append(list(prompts))
        return torch.tensor([[float(len(p))] for p in prompts])

    cache = TextEmbeddingCache(max_size=2)
    assert cache.lookup(["aa", "b", "aa"], encode).squeeze(1).tolist() == [2.0, 1.0, 2.0]
    cache.lookup(["ccc"], encode)  # evicts "aa", the least recently used
    cache.lookup(["b", "aa"], encode)
    assert calls == [["aa", "b"], ["ccc"], ["aa"]] and len(cache) == 2
    off = TextEmbeddingCache(max_size=0)
    off.lookup(["x"], encode)
    off.lookup(["x"], encode)
    assert calls[-2:] == [["x"], ["x"]] and len(off) == 0


@pytest.mark.parametrize("name", ["hpsv2", "pickscore"])
def test_bfloat16_weights_score_close_to_float32(name, rewards, tiny_models):
    low = build_reward(name, {**reward_args(name, tiny_models), "dtype": "bfloat16"})
    assert next(low.model.parameters()).dtype == torch.bfloat16
    batch = image_batch(random_images(4, 40, 40, seed=5), PROMPTS)
    full, half = rewards(name)(batch), low(batch)
    assert half.dtype == torch.float64
    scale = 1.0 if name == "hpsv2" else float(low.model.logit_scale.float().exp())
    torch.testing.assert_close(half, full, atol=0.03 * scale, rtol=0)


def test_pickscore_logit_scale_is_not_rounded_to_the_weights_dtype(tiny_models, tmp_path):
    """PickScore's logit scale is exp(ln 100) = 100. Cast to bfloat16, ln 100 = 4.6052 rounds to 4.5938, so a bf16
    model would scale every score by 98.86 (1.1% low); the reward keeps the float32 value the checkpoint holds."""
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(tiny_models.pick_model)
    with torch.no_grad():
        model.logit_scale.fill_(float(np.log(100.0)))
    model.save_pretrained(tmp_path / "pick100")
    args = {**reward_args("pickscore", tiny_models), "model": str(tmp_path / "pick100")}
    batch = image_batch(random_images(4, seed=6), PROMPTS)
    for dtype in ("float32", "bfloat16"):
        reward = build_reward("pickscore", {**args, "dtype": dtype})
        torch.testing.assert_close(reward(batch), 100.0 * reward.cosine(batch).double(), atol=1e-4, rtol=1e-5)
