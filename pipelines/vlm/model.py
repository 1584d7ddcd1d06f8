"""The vision-language model adapter: loading (tiny, local folder or hub id), LoRA / full fine-tuning, prompt
encoding through the real processor, the KL reference, and checkpoints.

Any ``AutoModelForImageTextToText`` with the Qwen2-VL processor contract works (Qwen2-VL, Qwen2.5-VL, Qwen3-VL);
the tiny models (``tiny:qwen2_vl``, ``tiny:qwen2_5_vl``, ``tiny:qwen3_vl``) are loaded through exactly the same
``from_pretrained`` path.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmgrpo.checkpoint import checkpoint_hint, placed_like, safetensors_files
from mmgrpo.config import ConfigError, cwd_hint, hub_id_hint
from mmgrpo.pipelines.vlm.config import VLMModelConfig
from mmgrpo.pipelines.vlm.data import chat_content
from mmgrpo.pipelines.vlm.tiny import KINDS, tiny_path
from mmgrpo.policy import frozen_copy
from mmgrpo.registry import MODEL_ADAPTERS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")
VISION_CONFIG_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
MEDIA_TOKENS = ("<|image_pad|>", "<|video_pad|>")
MEDIA_CONFIG_IDS = ("image_token_id", "video_token_id")
"""The tokens that stand for patch embeddings (one per merged patch), without the markers around them."""
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")
"""Names of the vision tower / projector submodules (Qwen2-VL keeps its merger inside ``visual``)."""
HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w.-]+)?")
OPENED_TAG = re.compile(r"<[A-Za-z][\w-]*>\s*\Z")
_warned: set[str] = set()


def resolve_path(cfg: VLMModelConfig) -> tuple[str, bool]:
    """``(path, is_local)`` for ``cfg.path``: a tiny kind is built into the cache; a missing local folder is a
    ConfigError naming ``model.path``."""
    if cfg.path.startswith("tiny:"):
        kind = cfg.path.removeprefix("tiny:")
        if kind not in KINDS:
            raise ConfigError(f"model.path: unknown tiny model '{cfg.path}' (known: "
                              f"{', '.join('tiny:' + k for k in KINDS)})")
        return str(tiny_path(kind)), True
    local = Path(cfg.path).expanduser()
    if local.is_dir():
        return str(local), True
    if local.exists() or not HUB_ID.fullmatch(cfg.path):
        raise ConfigError(f"model.path: '{cfg.path}' is not an existing model folder"
                          f"{'' if local.exists() else cwd_hint(cfg.path)}")
    return cfg.path, False


def adapter_base(path: str, revision: str | None) -> str | None:
    """The base model (``base_model_name_or_path``) when ``path`` (a local folder or hub id) is a PEFT adapter,
    such as the ``policy`` folder of an mmgrpo LoRA checkpoint; None for a full model."""
    from peft import PeftConfig
    from transformers.utils import find_adapter_config_file

    if find_adapter_config_file(path, revision=revision) is None:
        return None
    return PeftConfig.from_pretrained(path, revision=revision).base_model_name_or_path


def load_pretrained(path: str, base_path: str, revision: str | None, dtype: torch.dtype,
                    attn: str) -> tuple[nn.Module, Any]:
    """(model, processor) from ``path``, or when that is a PEFT adapter of ``base_path``, the base model with the
    adapter merged in and the adapter folder's processor (the base's for an adapter folder without one or a hub
    adapter)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    adapter = base_path != path
    model = AutoModelForImageTextToText.from_pretrained(base_path, revision=None if adapter else revision,
                                                        dtype=dtype, attn_implementation=attn)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path, revision=revision).merge_and_unload()
        model.requires_grad_(True)  # PEFT froze the base weights; a loaded model trains every one
    own = not adapter or (Path(path) / "tokenizer_config.json").is_file()
    processor = AutoProcessor.from_pretrained(path if own else base_path, revision=revision if own else None)
    return model, processor


def load_error(name: str, path: str, local: bool, err: Exception) -> ConfigError:
    """The one-line ConfigError for ``model.path`` (``name``, found at ``path``) that failed to load with ``err``."""
    where = "the local folder" if local else "the Hugging Face hub (offline or unreachable?)"
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    hint = "" if local else hub_id_hint(name)
    return ConfigError(f"model.path: cannot load '{name}' from {where}{hint}: {reason}{checkpoint_hint(path)}")


def video_metadata(frames: int, fps: float) -> dict:
    """The processor's metadata for a clip whose ``frames`` were already sampled at ``fps``, shared by the
    transformers path and the vLLM requests so both build the same prompt. Qwen2.5-VL reads the fps
    (``second_per_grid_ts``); Qwen3-VL writes each temporal patch's time into the prompt (``<0.2 seconds>``),
    ``frames_indices / fps``. The indices are ``i + 0.5``: :func:`~mmgrpo.pipelines.vlm.video.sample_indices`
    takes frame i from the centre of the i-th of ``frames`` equal segments, so it shows second ``(i + 0.5) / fps``
    of the clip (to within one native frame)."""
    return {"total_num_frames": frames, "fps": float(fps), "frames_indices": [i + 0.5 for i in range(frames)],
            "duration": frames / float(fps)}


def opened_tag(chat: str) -> str:
    """The opening tag, with the whitespace after it, that ends a rendered prompt ``chat`` (``"<think>\\n"`` when a
    reasoning model's chat template opens the thinking block in its generation prompt, as Qwen3-VL Thinking's
    does), else ``""``. The model then writes only the block's inside and its closing tag."""
    found = OPENED_TAG.search(chat)
    return found.group(0) if found else ""


def check_attention(name: str) -> None:
    """ConfigError naming ``model.attn_implementation`` and the choices when transformers has no attention kernel
    called ``name`` (a hub kernel, ``org/repo``, is left to transformers)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = list(dict.fromkeys(["sdpa", "eager", "flash_attention_2", *ALL_ATTENTION_FUNCTIONS.valid_keys()]))
    if name not in known and "/" not in name:
        raise ConfigError(f"bad value '{name}' for 'model.attn_implementation': expected one of {', '.join(known)}")


def pick_attention(name: str) -> str:
    """``name``, or sdpa (with a one-time warning) when flash_attention_2 cannot run here."""
    if name != "flash_attention_2":
        return name
    from transformers.utils import is_flash_attn_2_available

    if torch.cuda.is_available() and is_flash_attn_2_available():
        return name
    if name not in _warned:
        _warned.add(name)
        warnings.warn("model.attn_implementation: flash_attention_2 is not available here (needs CUDA and the "
                      "flash-attn package); falling back to sdpa", stacklevel=3)
    return "sdpa"


def strip_parallel(model: nn.Module) -> nn.Module:
    """The module inside DDP / FSDP / DeepSpeed-style wrappers (their ``.module``)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside parallel and PEFT wrappers (for config and helper methods, never for
    forwards)."""
    model = strip_parallel(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def module_names(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Qualified names of submodules whose last name component is in ``names`` (outermost only)."""
    found: list[str] = []
    for qualified, _ in model.named_modules():
        last = qualified.rsplit(".", 1)[-1]
        if last in names and not any(qualified.startswith(f + ".") for f in found):
            found.append(qualified)
    return found


def language_model_prefix(model: nn.Module) -> str:
    """Qualified name of the language-model decoder inside ``model`` (e.g. ``model.language_model``)."""
    decoder = model.get_decoder()
    for qualified, module in model.named_modules():
        if module is decoder:
            return qualified
    raise ValueError(f"cannot locate the language model inside {type(model).__name__}")


def check_lora_targets(model: nn.Module, prefix: str, targets: list[str]) -> None:
    """ConfigError naming ``model.lora_targets`` when it is empty or one of its module-name suffixes matches no
    module of the language model at ``prefix`` (a regex, escaped) as the LoRA config matches them: PEFT stops only
    when none matches, so a typo beside a valid target would silently train fewer layers."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(re.fullmatch(rf"{prefix}\..*\.{re.escape(t)}", n) for n in names)]
    if targets and not missing:
        return
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, nn.Linear) and re.match(rf"{prefix}\.", n)})
    what = f"no module of the language model is named {', '.join(map(repr, missing))}" if missing else "it is empty"
    raise ConfigError(f"bad value for 'model.lora_targets': {what}; the language model's linear layers are "
                      f"{', '.join(linear)}")


def weight_plan(folder: Path, model: nn.Module, targets: dict[str, torch.Tensor],
                mapping: list | None = None) -> list[tuple[Path, str, str, Any]]:
    """(file, checkpoint name, ``targets`` name, None or (the converter that matched it, its source pattern)) for
    every weight of the ``save_pretrained`` ``folder`` of ``model``, read from the files' headers only. A checkpoint
    name becomes the model's as ``from_pretrained`` renames it (the renamings, then at most one converter, of
    transformers' conversion mapping: ``mapping``, by default the one transformers finds for ``model``; a name the
    model has as it is stays). Missing, unexpected or differently shaped weights (a converted weight is checked once
    converted) are one ValueError naming the folder; a weight tied to another counts as loaded with it."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    mapping = get_model_conversion_mapping(model) if mapping is None else mapping
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: t for t in converters for p in t.source_patterns}
    plan, unexpected, shaped, found = [], [], [], set()
    for file in safetensors_files(folder, SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME):
        with safe_open(file, "pt") as f:
            keys = f.keys()  # a safe_open handle is no mapping
            for key in keys:
                name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, targets)
                if name not in targets and key in targets:
                    name, pattern = key, None
                if name not in targets:
                    unexpected.append(key)
                    continue
                found.add(id(targets[name]))
                shape = tuple(f.get_slice(key).get_shape())
                if pattern is None and shape != tuple(targets[name].shape):
                    shaped.append(f"{name}: {shape} there, {tuple(targets[name].shape)} here")
                else:
                    plan.append((file, key, name, None if pattern is None else (by_pattern[pattern], pattern)))
    missing = [name for name, t in targets.items() if id(t) not in found]
    wrong = [f"{what} {len(keys)} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
             for what, keys in (("missing", missing), ("unexpected", unexpected), ("shaped differently", shaped))
             if keys]
    if wrong:
        raise ValueError(f"weights in {folder} do not fit this {type(model).__name__}: {'; '.join(wrong)}")
    return plan


def load_full(folder: Path, model: nn.Module, mapping: list | None = None) -> None:
    """Copy the weights of a ``save_pretrained`` folder of ``model`` (a transformers model) into ``model`` in place,
    one tensor at a time: the process grows by about the largest tensor, not by a second model. Each tensor is read
    through its own ``safe_open``, since the pages of a memory-mapped file stay resident while it is open. Into
    parameters FSDP2 has sharded (DTensors), each process copies its own part of each tensor (:func:`placed_like`).

    Names are mapped as ``from_pretrained`` maps them (:func:`weight_plan`): Qwen2-VL and Qwen2.5-VL checkpoints
    name the language model ``model.*`` and the tower ``visual.*``, which transformers 5 calls
    ``model.language_model.*`` and ``model.visual.*``; a one-tensor conversion (Qwen3-VL-MoE's shape-checked
    transpose of its experts) is applied as transformers applies it. Weights that do not fit are one ValueError
    naming the folder, raised before any weight is copied (for a converted weight, once it is converted).
    ``mapping`` is transformers' conversion mapping for ``model`` (``get_model_conversion_mapping``), taken by
    default from ``model`` itself; pass the one taken before sharding for a model FSDP2 has sharded, since
    ``fully_shard`` gives the model a class of its own, which transformers takes for custom code and maps nothing
    for."""
    from safetensors import safe_open

    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for file, key, name, conversion in weight_plan(folder, model, targets, mapping):
            with safe_open(file, "pt") as f:
                tensor = f.get_tensor(key)
            if conversion is not None:
                converter, pattern = copy.deepcopy(conversion[0]), conversion[1]
                converter.add_tensor(name, key, pattern, tensor)
                tensor = converter.convert(name, model=model, config=model.config)[name]
            if tensor.shape != targets[name].shape:
                raise ValueError(f"weights in {folder} do not fit this {type(model).__name__}: {key} converts to "
                                 f"{tuple(tensor.shape)}, {tuple(targets[name].shape)} here")
            targets[name].copy_(placed_like(tensor, targets[name]))


@MODEL_ADAPTERS.register("qwen2_vl")
class VLMModel:
    """A loaded VLM plus its processor.

    - ``model``: the trainable module (a ``PeftModel`` with LoRA on the language model, or the full model). A
      ``model.path`` that is a PEFT adapter loads as its base model (``base_path``) with the adapter merged in, so
      training starts from the adapted model, which is also the reference.
    - ``vision_token_ids``: every vision special token id; generation never samples them.
    - ``media_token_ids``: the image and video token ids only (one per merged patch embedding).
    - ``eos_token_ids``: ``<|im_end|>`` and ``<|endoftext|>``; ``pad_token_id`` right-pads completions.
    - ``completion_lead``: the tag the chat template's generation prompt leaves open (:func:`opened_tag`, e.g.
      ``"<think>\\n"``), put before every completion text so the rewards see the completion as the model effectively
      wrote it; ``""`` for most templates.
    """

    def __init__(self, cfg: VLMModelConfig, device: str | torch.device = "cpu", keep_reference: bool = False):
        if cfg.dtype not in DTYPES:
            raise ConfigError(f"model.dtype: '{cfg.dtype}' is not one of {', '.join(DTYPES)}")
        self.cfg = cfg
        self.device = torch.device(device)
        check_attention(cfg.attn_implementation)
        self.path, local = resolve_path(cfg)
        attn = pick_attention(cfg.attn_implementation)
        revision = None if local else cfg.revision
        try:
            self.base_path = adapter_base(self.path, revision) or self.path
        except (OSError, ValueError) as err:
            raise load_error(cfg.path, self.path, local, err) from err
        if self.base_path != self.path and cfg.lora_rank > 0:  # its checkpoints would name the base without it
            raise ConfigError(f"model.lora_rank: '{cfg.path}' is a PEFT adapter, which loads merged into its base "
                              f"{self.base_path}, and a new LoRA on it would save checkpoints that load onto that "
                              "base without it: set model.lora_rank=0 (full fine-tuning from the merged model), or "
                              "save the merged model (merge_and_unload, save_pretrained) and give its folder")
        try:
            model, self.processor = load_pretrained(self.path, self.base_path, revision, DTYPES[cfg.dtype], attn)
        except (OSError, ValueError) as err:  # missing files / offline hub; a config that is no image-text model
            raise load_error(cfg.path, self.path, local, err) from err
        self.tokenizer = self.processor.tokenizer
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.weight_mapping: list = get_model_conversion_mapping(model)
        """transformers' conversion mapping of the model as built, which :meth:`load` maps a checkpoint's names
        with; taken before any launcher shards the model (transformers finds none for FSDP2's sharded class)."""
        model.to(self.device)
        vision = module_names(model, VISION_MODULES)
        if cfg.freeze_vision:
            for name in vision:
                model.get_submodule(name).requires_grad_(False)
        if cfg.gradient_checkpointing:  # non-reentrant: frozen inputs (LoRA) still get gradients
            if hasattr(model, "activation_checkpointing_enable"):  # the transformers 5 name
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.reference_model: nn.Module | None = None
        if cfg.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            prefix = re.escape(language_model_prefix(model))
            check_lora_targets(model, prefix, cfg.lora_targets)
            targets = "|".join(re.escape(t) for t in cfg.lora_targets)
            lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                              target_modules=rf"{prefix}\..*\.({targets})",
                              modules_to_save=None if cfg.freeze_vision else vision)
            with warnings.catch_warnings():  # PEFT still calls a deprecated transformers 5 property
                warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
                model = get_peft_model(model, lora)
        elif keep_reference:
            self.reference_model = frozen_copy(model)
        self.model: nn.Module = model

        vocab = self.tokenizer.get_vocab()
        config = unwrap(model).config
        ids = {vocab[t] for t in VISION_TOKENS if t in vocab}
        ids |= {getattr(config, k) for k in VISION_CONFIG_IDS if getattr(config, k, None) is not None}
        self.vision_token_ids: list[int] = sorted(ids)
        self.media_token_ids: list[int] = sorted({vocab[t] for t in MEDIA_TOKENS if t in vocab}
                                                 | {getattr(config, k) for k in MEDIA_CONFIG_IDS
                                                    if getattr(config, k, None) is not None})
        self.eos_token_ids: list[int] = sorted({vocab[t] for t in EOS_TOKENS if t in vocab}
                                               | ({self.tokenizer.eos_token_id} - {None}))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else self.eos_token_ids[-1]
        self.vocab_size: int = len(self.tokenizer)
        """Token ids at or past this are padding rows of the embedding; generation never samples them."""
        turn = [{"role": "user", "content": [{"type": "text", "text": "?"}]}]
        self.completion_lead: str = opened_tag(self.processor.apply_chat_template(turn, tokenize=False,
                                                                                  add_generation_prompt=True))

    @property
    def is_lora(self) -> bool:
        return self.cfg.lora_rank > 0

    @property
    def size_factor(self) -> int:
        """Pixels per side of one merged vision token: the image processor's patch size times its merge size (28
        for Qwen2-VL and Qwen2.5-VL, 32 for Qwen3-VL); ``video.size_factor`` must equal it."""
        image = self.processor.image_processor
        return image.patch_size * image.merge_size

    @property
    def temporal_patch_size(self) -> int:
        """Frames the vision tower merges into one temporal patch (2 for the Qwen2-VL family; 1 without a video
        processor); ``video.frame_multiple`` must be a multiple of it."""
        video = getattr(self.processor, "video_processor", None)
        return int(getattr(video, "temporal_patch_size", 1) or 1)

    def prompt_inputs(self, text: str, images: list[torch.Tensor], videos: list[torch.Tensor],
                      video_fps: list[float] | None = None) -> dict[str, torch.Tensor]:
        """Chat-template one user turn plus the assistant prompt, and run the processor at the given sizes (each side
        only rounded to the token grid: 28 px for Qwen2-VL and Qwen2.5-VL, 32 px for Qwen3-VL). The turn is
        ``text`` with the media at its ``<image>``/``<video>`` markers, or the images, then the videos, then
        ``text`` when it has none (:func:`~mmgrpo.pipelines.vlm.data.chat_content`, which raises ValueError for
        markers that do not match).

        ``images``: (3,H,W) uint8; ``videos``: (T,3,H,W) uint8, frames already sampled at ``video_fps`` (default
        2.0 each; :func:`video_metadata`). Returns batch-1 tensors on ``device``: ``input_ids`` (1,P) int64,
        ``attention_mask`` (1,P), ``mm_token_type_ids`` (1,P), and ``pixel_values`` (N,C*2*p*p) fp32 +
        ``image_grid_thw`` (n_img,3) and/or ``pixel_values_videos`` + ``video_grid_thw`` (n_vid,3) (+
        ``second_per_grid_ts`` (n_vid,) on Qwen2.5-VL), p the patch size (14, or 16 for Qwen3-VL).
        """
        for i, image in enumerate(images):
            if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
                raise ValueError(f"image {i} must be a (3,H,W) uint8 tensor, got {tuple(image.shape)} {image.dtype}")
        for i, video in enumerate(videos):
            if video.dtype != torch.uint8 or video.ndim != 4 or video.shape[1] != 3:
                raise ValueError(f"video {i} must be a (T,3,H,W) uint8 tensor, got {tuple(video.shape)} {video.dtype}")
        if video_fps is not None and len(video_fps) != len(videos):
            raise ValueError(f"video_fps has {len(video_fps)} entries for {len(videos)} videos")
        messages = [{"role": "user", "content": chat_content(text, len(images), len(videos))}]
        chat = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        kwargs = {}
        if images:
            kwargs["images"] = [image.cpu() for image in images]
            kwargs["images_kwargs"] = {"size": self._keep_size([i.shape[-2:] for i in images], self.processor.
                                                               image_processor)}
        if videos:
            fps = video_fps or [2.0] * len(videos)
            kwargs["videos"] = [video.cpu() for video in videos]
            kwargs["videos_kwargs"] = {
                "size": self._keep_size([v.shape[-2:] for v in videos], self.processor.video_processor,
                                        max(v.shape[0] for v in videos)),
                "do_sample_frames": False, "cap_pixels_per_frame": False,
                "video_metadata": [video_metadata(v.shape[0], f) for v, f in zip(videos, fps)]}
        out = self.processor(text=[chat], return_tensors="pt", **kwargs)
        return {k: torch.as_tensor(v).to(self.device) for k, v in out.items()}

    @staticmethod
    def _keep_size(sizes: list[torch.Size], processor, frames: int = 1) -> dict[str, int]:
        """A processor ``size`` (pixel-count bounds) under which every given (H,W) is only rounded to the grid.
        ``frames``: the most frames of a video; the upper bound covers them too, since Qwen3-VL's video processor
        bounds a clip's frames x pixels where Qwen2-VL's bounds each frame's pixels (a larger bound changes nothing
        for the latter)."""
        factor = processor.patch_size * processor.merge_size
        areas = [max(factor, round(h / factor) * factor) * max(factor, round(w / factor) * factor) for h, w in sizes]
        step = getattr(processor, "temporal_patch_size", 1) if frames > 1 else 1
        return {"shortest_edge": min(areas), "longest_edge": max(areas) * (frames + -frames % step)}

    @contextlib.contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """The KL reference: with LoRA, the same model with the adapter disabled; in full fine-tuning, the frozen
        copy kept at construction (``keep_reference=True``)."""
        if self.is_lora:
            with self.model.disable_adapter():
                yield self.model
        elif self.reference_model is not None:
            yield self.reference_model
        else:
            raise RuntimeError("no reference model: full fine-tuning keeps a frozen copy only when VLMModel is "
                               "built with keep_reference=True (or use LoRA, whose reference is the base model)")

    @staticmethod
    @contextlib.contextmanager
    def quiet() -> Iterator[None]:
        """transformers' own progress bars off, then as they were: a checkpoint's "Writing model shards" bar would
        break the run's progress bar at every save."""
        from transformers.utils import logging as hf_logging

        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if shown:
                hf_logging.enable_progress_bar()

    def save(self, directory: str | Path, model: nn.Module | None = None,
             state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the weights (LoRA: the PEFT adapter as safetensors; full: a ``save_pretrained`` folder that
        ``AutoModelForImageTextToText.from_pretrained`` loads) and the processor to ``directory``. ``state_dict``
        is the gathered full state dict when the trained model is sharded (FSDP / ZeRO-3)."""
        model = strip_parallel(model if model is not None else self.model)
        directory = Path(directory)
        with self.quiet():
            model.save_pretrained(directory, safe_serialization=True, state_dict=state_dict)
        self.processor.save_pretrained(directory)

    def load(self, directory: str | Path) -> None:
        """Load weights written by :meth:`save` into ``model`` in place (parameters keep their identity); a full
        model tensor by tensor (:func:`load_full`)."""
        directory = Path(directory)
        if self.is_lora:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            file = directory / "adapter_model.safetensors"
            if not file.is_file():
                raise FileNotFoundError(f"no LoRA adapter at {file}")
            result = set_peft_model_state_dict(self.model, load_file(file, device=str(self.device)))
            if result.unexpected_keys:
                raise ValueError(f"adapter at {directory} does not fit this model: {result.unexpected_keys[:3]}")
            return
        load_full(directory, self.model, self.weight_mapping)
