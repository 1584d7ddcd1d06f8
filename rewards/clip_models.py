"""Model-based image rewards built on CLIP towers: ``clip_score``, ``pickscore``, ``hpsv2``, ``hpsv2.1``, ``aesthetic``.

Every reward loads its weights once, in ``__init__``, and scores a whole batch of tensors in one forward per tower:
images are preprocessed on their device by :class:`~mmgrpo.rewards.preprocess.ClipPreprocess` (no PIL, no files),
and the text embedding of each distinct prompt is computed once and cached (a group repeats its prompt G times).
Weights come from a hub id or tag (GPU users) or from a local file or folder (offline; the tests use tiny models
saved in the real formats). ``open_clip`` and ``transformers`` are imported only when a reward is built.
"""

from __future__ import annotations

import json
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmgrpo.registry import REWARDS

from .base import POINTWISE, Reward, RewardBatch
from .checks import images_or_raise
from .preprocess import ClipPreprocess

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# what a failed load raises: missing/offline files (OSError), bad configs or tags, state-dict mismatches, bad pickles
LOAD_ERRORS = (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError)


def one_line(text: Any, limit: int = 400) -> str:
    """``text`` squeezed onto one line and cut at ``limit`` characters (error messages must stay one line)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device``, or CUDA when it is available and ``device`` is None, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from ``float32`` / ``float16`` / ``bfloat16`` (or a torch dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got '{dtype}'")
    return DTYPES[dtype]


def hub_file(path: str | None, repo: str, filename: str, what: str) -> str:
    """A local checkpoint: ``path`` when given, else ``filename`` downloaded (or found in the cache) from the Hugging
    Face Hub repo ``repo``. Failures raise a one-line error naming the file and how to pass it by hand."""
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what}: checkpoint file '{path}' does not exist")
        return str(path)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(repo, filename)
    except (OSError, ValueError, EntryNotFoundError) as err:  # offline, no such repo or file, no permission...
        raise RuntimeError(
            f"{what}: cannot get '{filename}' from the Hugging Face Hub repo '{repo}' ({type(err).__name__}: "
            f"{one_line(err, 160)}); download it and pass checkpoint=/path/to/{filename}"
        ) from None


def load_open_clip(
    model_name: str,
    pretrained: str | None,
    device: torch.device,
    quick_gelu: bool | None = None,
    what: str = "open_clip",
) -> tuple[nn.Module, Callable[[Sequence[str]], torch.Tensor]]:
    """An open_clip model in eval mode on ``device`` and its tokenizer.

    - ``model_name``: a built-in architecture (``ViT-L-14``), ``hf-hub:org/repo`` / ``local-dir:/path`` (config and
      weights from there; ``pretrained`` is then ignored), or the path of a model-config JSON file (registered with
      open_clip under the file's stem).
    - ``pretrained``: a pretrained tag (``openai``, ``laion2b_s34b_b79k``...), a local checkpoint file (a state dict,
      optionally under a ``state_dict`` key; ``.safetensors`` too), or None for random weights.
    - ``quick_gelu``: force QuickGELU. None follows the tag: open_clip only *warns* when an OpenAI tag meets a GELU
      config, so it is set here for tags trained with QuickGELU (all ``openai`` ones). Set it for OpenAI weights
      loaded from a local file.
    """
    import open_clip

    name = model_name
    if name.endswith(".json"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"{what}: open_clip model config '{name}' does not exist")
        config = json.loads(Path(name).read_text(encoding="utf-8"))
        if open_clip.get_model_config(Path(name).stem) != config:  # register once (open_clip appends per call)
            open_clip.add_model_config(name)
        name = Path(name).stem
    if quick_gelu is None:
        tag = {} if pretrained is None or os.path.isfile(pretrained) else open_clip.get_pretrained_cfg(name, pretrained)
        quick_gelu = bool(tag.get("quick_gelu", False))
    try:
        model = open_clip.create_model(name, pretrained=pretrained, device=device, force_quick_gelu=quick_gelu)
        tokenizer = open_clip.get_tokenizer(name)
    except LOAD_ERRORS as err:
        raise RuntimeError(
            f"{what}: cannot load open_clip model '{model_name}' with pretrained={pretrained!r}: {one_line(err)}"
        ) from None
    return model.eval().requires_grad_(False), tokenizer


class TextEmbeddingCache:
    """Prompt string -> text embedding (D,), least recently used first out; ``max_size`` 0 disables storing."""

    def __init__(self, max_size: int = 4096):
        self.max_size = int(max_size)
        self._store: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        self._store.clear()

    def lookup(self, prompts: Sequence[str], encode: Callable[[list[str]], torch.Tensor]) -> torch.Tensor:
        """(B, D) embeddings of ``prompts``; ``encode`` runs once, on the distinct prompts not cached yet."""
        fresh: dict[str, torch.Tensor] = {}
        missing = [p for p in dict.fromkeys(prompts) if p not in self._store]
        if missing:
            fresh = dict(zip(missing, encode(missing).unbind(0)))
        out = torch.stack([fresh[p] if p in fresh else self._store[p] for p in prompts])
        if self.max_size > 0:
            for p in dict.fromkeys(prompts):
                self._store[p] = fresh[p].clone() if p in fresh else self._store[p]
                self._store.move_to_end(p)
            while len(self._store) > self.max_size:
                self._store.popitem(last=False)
        return out


def encode_in_slices(encode: Callable[[torch.Tensor], torch.Tensor], preprocess: ClipPreprocess,
                     pixels: torch.Tensor, batch_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(B, D) embeddings of (B, 3, H, W) [0, 1] ``pixels``: ``batch_size`` images per forward, each slice moved to
    ``device`` just before it, so a batch of full-resolution images or video frames never sits there at once. The
    copy is asynchronous only into a CUDA device (stream-ordered there; into host memory the CPU could read the slice
    before it arrives)."""
    asynchronous = torch.device(device).type == "cuda"
    return torch.cat([encode(preprocess(chunk.to(device, non_blocking=asynchronous), dtype))
                      for chunk in pixels.split(batch_size)])


def _pooled(output: Any) -> torch.Tensor:
    """The projected features of transformers' ``get_*_features``: a tensor (transformers 4.x) or the output's
    ``pooler_output`` (5.x)."""
    return output if torch.is_tensor(output) else output.pooler_output


class ClipEmbeddingReward(Reward):
    """Shared machinery: image batch -> preprocess -> normalised image embeddings; prompts -> cached normalised text
    embeddings. Subclasses load ``self.model`` / ``self.preprocess`` and define the two encoders and the score."""

    kind = POINTWISE
    modality = "image"
    name = "clip"

    model: nn.Module
    preprocess: ClipPreprocess

    def __init__(self, device: str | torch.device | None, dtype: str | torch.dtype, text_cache_size: int,
                 batch_size: int):
        if batch_size < 1:
            raise ValueError(f"{self.name}: batch_size must be >= 1; got {batch_size}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.text_cache = TextEmbeddingCache(text_cache_size)
        self.batch_size = int(batch_size)

    def to(self, device: str | torch.device) -> ClipEmbeddingReward:
        """Move the model; cached text embeddings are dropped (they live on the old device)."""
        self.device = torch.device(device)
        self.model.to(self.device)
        self.text_cache.clear()
        return self

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed ``pixels`` (B, 3, h, w) -> (B, D) image embeddings (not normalised)."""
        raise NotImplementedError

    def encode_texts(self, prompts: list[str]) -> torch.Tensor:
        """N prompt strings -> (N, D) text embeddings (not normalised)."""
        raise NotImplementedError

    def image_features(self, batch: RewardBatch) -> torch.Tensor:
        """(B, D) float32 L2-normalised image embeddings of ``batch.images`` (grayscale/RGBA accepted), encoded
        ``batch_size`` images at a time."""
        feats = encode_in_slices(self.encode_images, self.preprocess, images_or_raise(batch, self.name),
                                 self.batch_size, self.device, self.dtype)
        return F.normalize(feats.float(), dim=-1)

    def text_features(self, prompts: Sequence[str]) -> torch.Tensor:
        """(B, D) float32 L2-normalised text embeddings, each distinct prompt encoded once and cached."""
        return self.text_cache.lookup(list(prompts), lambda p: F.normalize(self.encode_texts(p).float(), dim=-1))

    def cosine(self, batch: RewardBatch) -> torch.Tensor:
        """(B,) cosine similarity of each image with its own prompt, float32."""
        return (self.image_features(batch) * self.text_features(batch.prompts)).sum(-1)


class OpenClipReward(ClipEmbeddingReward):
    """A :class:`ClipEmbeddingReward` on an open_clip model (``encode_image`` / ``encode_text``)."""

    tokenizer: Callable[[Sequence[str]], torch.Tensor]

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(pixels)

    def encode_texts(self, prompts: list[str]) -> torch.Tensor:
        return self.model.encode_text(self.tokenizer(prompts).to(self.device))


@REWARDS.register("clip_score", kind="pointwise", modality="image",
                  description="CLIP score: scale*max(cos,0) of image and prompt, any open_clip model")
class ClipScore(OpenClipReward):
    """CLIP score of each image with its prompt: ``scale * max(cos, 0)``, in [0, scale] (about 20-35 for a matching
    image with the default scale 100, as torchmetrics' CLIPScore reports it).

    Args:
        model_name: open_clip architecture, ``hf-hub:``/``local-dir:`` source, or a model-config JSON path
            (see :func:`load_open_clip`).
        pretrained: open_clip pretrained tag or local checkpoint file.
        scale: multiplier of the clipped cosine (100 = the usual "CLIPScore"; 1 gives the raw clipped cosine).
        quick_gelu: force QuickGELU; None follows the pretrained tag.
        device: where the model runs; None = CUDA when available, else CPU.
        dtype: model weights' dtype: ``float32``, ``float16`` or ``bfloat16`` (scores are computed in float32).
        text_cache_size: how many prompt embeddings to keep (least recently used dropped; 0 = no cache).
        batch_size: images per forward pass (and per copy to ``device``): a larger batch is scored in slices of
            this size, which bounds the memory a batch of full-resolution images or video frames takes.
    """

    name = "clip_score"

    def __init__(self, model_name: str = "ViT-L-14", pretrained: str | None = "openai", scale: float = 100.0,
                 quick_gelu: bool | None = None, device: str | None = None, dtype: str = "float32",
                 text_cache_size: int = 4096, batch_size: int = 32):
        super().__init__(device, dtype, text_cache_size, batch_size)
        self.scale = float(scale)
        self.model, self.tokenizer = load_open_clip(model_name, pretrained, self.device, quick_gelu, self.name)
        self.model.to(self.dtype)
        self.preprocess = ClipPreprocess.from_open_clip(self.model)

    @torch.no_grad()
    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        """(B,) float64 CPU scores in [0, scale]."""
        return (self.scale * self.cosine(batch).clamp(min=0)).double().cpu()


@REWARDS.register("pickscore", kind="pointwise", modality="image",
                  description="PickScore (CLIP ViT-H/14 on Pick-a-Pic): logit_scale.exp()*cos, about 20-23")
class PickScore(ClipEmbeddingReward):
    """PickScore of each image with its prompt: ``logit_scale.exp() * cos`` (logit scale 100 for the published
    model, so scores are about 20-23 on real images).

    Args:
        model: transformers ``CLIPModel`` hub id or local folder (``save_pretrained`` format).
        processor: ``AutoProcessor`` hub id or local folder giving the tokenizer and the image processor's size,
            crop, mean and std (images are preprocessed on tensors with those; the processor never sees them).
        device: where the model runs; None = CUDA when available, else CPU.
        dtype: model weights' dtype: ``float32``, ``float16`` or ``bfloat16`` (scores are computed in float32).
        text_cache_size: how many prompt embeddings to keep (least recently used dropped; 0 = no cache).
        batch_size: images per forward pass (and per copy to ``device``): a larger batch is scored in slices of
            this size, which bounds the memory a batch of full-resolution images or video frames takes.
    """

    name = "pickscore"

    def __init__(self, model: str = "yuvalkirstain/PickScore_v1",
                 processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", device: str | None = None,
                 dtype: str = "float32", text_cache_size: int = 4096, batch_size: int = 32):
        super().__init__(device, dtype, text_cache_size, batch_size)
        from transformers import AutoProcessor, CLIPModel

        try:
            self.processor = AutoProcessor.from_pretrained(processor)
        except LOAD_ERRORS as err:
            raise RuntimeError(f"pickscore: cannot load the processor '{processor}': {one_line(err)}") from None
        try:
            self.model = CLIPModel.from_pretrained(model)
        except LOAD_ERRORS as err:
            raise RuntimeError(f"pickscore: cannot load the CLIPModel '{model}': {one_line(err)}") from None
        # exp(logit_scale) read before the cast: ln 100 in bfloat16 is 4.594, which would scale scores by 98.86
        self.logit_scale = float(self.model.logit_scale.detach().float().exp())
        self.model.eval().requires_grad_(False).to(self.device, self.dtype)
        self.tokenizer = self.processor.tokenizer
        self.max_length = min(int(self.tokenizer.model_max_length),
                              int(self.model.config.text_config.max_position_embeddings))
        self.preprocess = ClipPreprocess.from_hf_image_processor(self.processor)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return _pooled(self.model.get_image_features(pixel_values=pixels))

    def encode_texts(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        return _pooled(self.model.get_text_features(input_ids=tokens["input_ids"],
                                                    attention_mask=tokens["attention_mask"]))

    @torch.no_grad()
    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        """(B,) float64 CPU scores, ``logit_scale.exp() * cos`` (the scale taken from the checkpoint's own dtype,
        not rounded to ``dtype``)."""
        return (self.logit_scale * self.cosine(batch)).double().cpu()


@REWARDS.register("hpsv2", kind="pointwise", modality="image",
                  description="HPS v2: open_clip ViT-H-14 + HPS_v2_compressed.pt, cosine (about 0.25-0.35)")
class HPSv2(OpenClipReward):
    """Human Preference Score v2: the cosine of image and prompt embeddings of an open_clip ``ViT-H-14`` that carries
    the HPS weights (about 0.25-0.35 on real images).

    The checkpoint is a torch file ``{"state_dict": ...}`` with the full open_clip state dict, loaded strictly
    (``weights_only``). Images use HPSv2's evaluation transform: longer side resized to 224, padded black to a
    square (the same as a center crop for square images).

    Args:
        checkpoint: local path of the HPS file; None = ``filename`` from the Hub repo ``hub_repo`` (downloaded
            once into the Hugging Face cache; offline, this fails with a one-line error naming the file).
        model_name: open_clip architecture the checkpoint fits (``ViT-H-14``; a config JSON path for tests).
        hub_repo: Hugging Face Hub repo holding the HPS files.
        device: where the model runs; None = CUDA when available, else CPU.
        dtype: model weights' dtype: ``float32``, ``float16`` or ``bfloat16`` (scores are computed in float32).
        text_cache_size: how many prompt embeddings to keep (least recently used dropped; 0 = no cache).
        batch_size: images per forward pass (and per copy to ``device``): a larger batch is scored in slices of
            this size, which bounds the memory a batch of full-resolution images or video frames takes.
    """

    name = "hpsv2"
    filename = "HPS_v2_compressed.pt"

    def __init__(self, checkpoint: str | None = None, model_name: str = "ViT-H-14", hub_repo: str = "xswu/HPSv2",
                 device: str | None = None, dtype: str = "float32", text_cache_size: int = 4096,
                 batch_size: int = 32):
        super().__init__(device, dtype, text_cache_size, batch_size)
        path = hub_file(checkpoint, hub_repo, self.filename, self.name)
        self.checkpoint = path
        self.model, self.tokenizer = load_open_clip(model_name, path, self.device, False, self.name)
        self.model.to(self.dtype)
        self.preprocess = ClipPreprocess.from_open_clip(self.model, resize_mode="longest")

    @torch.no_grad()
    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        """(B,) float64 CPU cosines in [-1, 1]."""
        return self.cosine(batch).double().cpu()


@REWARDS.register("hpsv2.1", kind="pointwise", modality="image",
                  description="HPS v2.1: open_clip ViT-H-14 + HPS_v2.1_compressed.pt, cosine (about 0.25-0.35)")
class HPSv21(HPSv2):
    """HPS v2.1: as :class:`HPSv2` with the file ``HPS_v2.1_compressed.pt`` (same arguments)."""

    name = "hpsv2.1"
    filename = "HPS_v2.1_compressed.pt"


class AestheticMLP(nn.Module):
    """The LAION improved aesthetic predictor head: ``embed_dim``-1024-128-64-16-1 linear layers (no activations),
    with the original's dropout layers so the state-dict keys are ``layers.{0,2,4,6,7}.{weight,bias}``."""

    def __init__(self, embed_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """(B, embed_dim) L2-normalised CLIP image embeddings -> (B,) scores."""
        return self.layers(embeddings).squeeze(-1)


@REWARDS.register("aesthetic", kind="pointwise", modality="image",
                  description="LAION improved aesthetic predictor: MLP on CLIP ViT-L/14 image embeddings, 1-10")
class Aesthetic(ClipEmbeddingReward):
    """LAION improved aesthetic score (``sac+logos+ava1-l14-linearMSE``): the MLP of :class:`AestheticMLP` on the
    L2-normalised image embedding of OpenAI CLIP ViT-L/14. About 1-10 (most images 4-7). Ignores the prompt.

    Args:
        clip_model: open_clip architecture of the embedding model (a config JSON path for tests).
        clip_pretrained: its pretrained tag or local checkpoint file (``openai`` = the weights the MLP was trained on;
            run with QuickGELU, see :func:`load_open_clip`).
        checkpoint: local path of the MLP state dict (``sac+logos+ava1-l14-linearMSE.pth``); None = ``hub_filename``
            from ``hub_repo`` (TRL's copy of the LAION weights).
        hub_repo: Hugging Face Hub repo holding the MLP weights.
        hub_filename: file name of the MLP weights in ``hub_repo``.
        embed_dim: the CLIP embedding size the MLP takes (768 for ViT-L/14).
        quick_gelu: force QuickGELU in the CLIP model; None follows the pretrained tag.
        device: where the models run; None = CUDA when available, else CPU.
        dtype: CLIP weights' dtype: ``float32``, ``float16`` or ``bfloat16`` (the MLP runs in float32).
        batch_size: images per forward pass (and per copy to ``device``): a larger batch is scored in slices of
            this size, which bounds the memory a batch of full-resolution images or video frames takes.
    """

    name = "aesthetic"

    def __init__(self, clip_model: str = "ViT-L-14", clip_pretrained: str | None = "openai",
                 checkpoint: str | None = None, hub_repo: str = "trl-lib/ddpo-aesthetic-predictor",
                 hub_filename: str = "aesthetic-model.pth", embed_dim: int = 768, quick_gelu: bool | None = None,
                 device: str | None = None, dtype: str = "float32", batch_size: int = 32):
        super().__init__(device, dtype, text_cache_size=0, batch_size=batch_size)
        path = hub_file(checkpoint, hub_repo, hub_filename, self.name)
        self.mlp = AestheticMLP(embed_dim)
        try:  # a plain state dict, or one under "state_dict"
            state = torch.load(path, map_location="cpu", weights_only=True)
            state = state.get("state_dict", state) if isinstance(state, dict) else state
            state = {k.removeprefix("module."): v for k, v in state.items()}
        except (*LOAD_ERRORS, AttributeError) as err:  # not a torch file (a saved error page), or not a dict
            raise RuntimeError(f"aesthetic: '{path}' is not a state dict saved by torch.save "
                               f"({type(err).__name__}: {one_line(err, 160)})") from None
        try:
            self.mlp.load_state_dict(state)
        except RuntimeError as err:
            raise RuntimeError(f"aesthetic: '{path}' is not an aesthetic MLP for embed_dim={embed_dim} "
                               f"(keys layers.0/2/4/6/7): {one_line(err, 240)}") from None
        self.mlp.eval().requires_grad_(False).to(self.device)
        self.model, _ = load_open_clip(clip_model, clip_pretrained, self.device, quick_gelu, self.name)
        clip_dim = getattr(self.model.visual, "output_dim", embed_dim)
        if clip_dim != embed_dim:
            raise ValueError(f"aesthetic: CLIP model '{clip_model}' gives {clip_dim}-d embeddings but the MLP takes "
                             f"embed_dim={embed_dim}")
        self.model.to(self.dtype)
        self.preprocess = ClipPreprocess.from_open_clip(self.model)

    def to(self, device: str | torch.device) -> Aesthetic:
        super().to(device)
        self.mlp.to(self.device)
        return self

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(pixels)

    @torch.no_grad()
    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        """(B,) float64 CPU aesthetic scores (about 1-10)."""
        return self.mlp(self.image_features(batch)).double().cpu()
