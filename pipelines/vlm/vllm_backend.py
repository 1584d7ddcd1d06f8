"""Optional vLLM rollout backend (``generation.backend: vllm``; the ``vllm`` extra, CUDA only).

Targets vLLM >= 0.11 (the V1 engine; checked at start-up, see :data:`MIN_VLLM`). Each training process runs one
vLLM engine colocated in its own process, on its own GPU, built lazily at the first rollout from the model folder or
hub id of ``model.path`` (of its base model when it is a PEFT adapter). Per rollout:

1. :meth:`VLLMSampler.sync_weights` pushes the current policy weights into the engine when they changed since the
   last push (:func:`weights_version`), named as the base checkpoint (:func:`policy_weights`), and resets the
   engine's prefix cache, whose KV entries were computed with the old weights.
2. :meth:`VLLMSampler.generate` sends one request per prepared prompt (:func:`build_request`) with ``n = G``
   (:func:`sampling_kwargs`); prefix caching is on, so a group's samples can reuse their shared prompt's KV.
3. The outputs become the same :class:`~mmgrpo.pipelines.vlm.generation.Completions` the transformers path returns
   (:func:`to_completions`). The old log-probs are *not* taken from vLLM: the trainer takes them from the
   training forward (``token_logprobs``; ``Rollout.recompute_old_logp``), so the first ratio is exactly 1, as with
   ``backend: hf``, and logs how far vLLM's were when it reported them.

Weight names (:func:`checkpoint_name`): the trained module's state dict, stripped of wrapper prefixes (``module.``
from DDP, ``_orig_mod.`` from torch.compile, ``base_model.model.`` from PEFT), with LoRA layers merged (``W +
scale * B @ A`` of the active adapters, read through PEFT's ``get_delta_weight``; the ``lora_*`` tensors themselves
are not sent), PEFT's ``base_layer`` / ``modules_to_save.<adapter>`` levels removed (``original_module`` copies
dropped), and, for Qwen2-VL and Qwen2.5-VL (:data:`RENAMED_MODEL_TYPES`), transformers >= 4.52 runtime names mapped
back to the names of their checkpoints:

=========================== ==================
runtime (transformers)      checkpoint / vLLM
=========================== ==================
``model.language_model.X``  ``model.X``
``model.visual.X``          ``visual.X``
``lm_head.weight``          ``lm_head.weight`` (left out when tied to the input embeddings)
=========================== ==================

These are the names in the Qwen2-VL / Qwen2.5-VL safetensors files, which vLLM's ``load_weights`` maps itself
(its ``hf_to_vllm_mapper`` takes both these and the runtime names; fused ``qkv_proj`` / ``gate_up_proj`` shards are
split out of ``q_proj``/``k_proj``/``v_proj`` by its loader). Qwen3-VL checkpoints keep the runtime names
(``model.language_model.X``, ``model.visual.X``), the only ones vLLM's Qwen3-VL mapper takes, so they are sent as
they are. The tests check the names against every tiny model's safetensors file.

Everything above the :class:`VLLMSampler` class is pure and tested without vLLM (``tests/vlm/test_vllm_backend.py``);
the engine calls themselves run only on a GPU machine with vLLM installed, which this project's CPU CI is not.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmgrpo.config import ConfigError
from mmgrpo.pipelines.vlm.config import VLMConfig, VLMGenerationConfig, VLMVideoConfig
from mmgrpo.pipelines.vlm.data import chat_content
from mmgrpo.pipelines.vlm.generation import Completions, scoring_temperature
from mmgrpo.pipelines.vlm.model import VLMModel, strip_parallel, unwrap, video_metadata
from mmgrpo.pipelines.vlm.video import PIXEL_UNIT, shuffle_frames
from mmgrpo.rewards import RewardBatch

MIN_VLLM = "0.11"
"""Oldest vLLM release this backend is written for (V1 engine only; ``(frames, metadata)`` video items)."""
INSTALL_HINT = "pip install -e '.[vllm]' in a CUDA environment of its own (vLLM pins its own torch)"
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
"""Name prefixes of DDP / DeepSpeed, torch.compile and PEFT wrappers, stripped from weight names."""
RUNTIME_TO_CHECKPOINT = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""transformers >= 4.52 module names of Qwen2-VL / Qwen2.5-VL -> the names in their safetensors checkpoints."""
RENAMED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""``config.model_type`` of the models whose checkpoints use the names of :data:`RUNTIME_TO_CHECKPOINT`; other
models (Qwen3-VL) save, and vLLM loads, their runtime names."""
_LORA_TENSOR = re.compile(r"\.lora_[A-Za-z_]+(\.|$)")
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


# ---------------------------------------------------------------------------------------------- availability
def backend_unavailable() -> str | None:
    """Why the vLLM backend cannot run here (no vllm package, no CUDA), or None. Does not import vllm."""
    if importlib.util.find_spec("vllm") is None:
        return f"the vllm package is not installed ({INSTALL_HINT})"
    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and none is visible"
    return None


def import_vllm() -> Any:
    """The vllm module, or a one-line ConfigError naming ``generation.backend`` when it is missing, broken, older
    than :data:`MIN_VLLM`, or there is no CUDA GPU."""
    reason = backend_unavailable()
    if reason is None:
        try:
            import vllm
        except (ImportError, OSError, RuntimeError, AttributeError) as err:  # a broken install
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            reason = f"importing vllm failed ({type(err).__name__}: {first})"
        else:
            from packaging.version import Version

            version = getattr(vllm, "__version__", "0")
            if Version(version).release < Version(MIN_VLLM).release:
                reason = f"vllm {version} is older than {MIN_VLLM}, the oldest release this backend targets"
            else:
                return vllm
    raise ConfigError(f"bad value 'vllm' for 'generation.backend': the vLLM rollout backend is not available here: "
                      f"{reason}; use 'hf'")


# ---------------------------------------------------------------------------------------------- requests
def to_pil(image: torch.Tensor) -> Image.Image:
    """(3,H,W) uint8 -> an RGB PIL image with the same pixels."""
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"expected a (3,H,W) uint8 image, got {tuple(image.shape)} {image.dtype}")
    return Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).cpu().numpy()))


def to_frames(video: torch.Tensor) -> np.ndarray:
    """(T,3,H,W) uint8 -> (T,H,W,3) uint8 numpy frames (vLLM's video item), contiguous."""
    if video.dtype != torch.uint8 or video.ndim != 4 or video.shape[1] != 3:
        raise ValueError(f"expected a (T,3,H,W) uint8 video, got {tuple(video.shape)} {video.dtype}")
    return np.ascontiguousarray(video.permute(0, 2, 3, 1).cpu().numpy())


def chat_text(processor: Any, prompt: str, n_images: int, n_videos: int) -> str:
    """The chat-templated prompt exactly as the transformers path builds it (one user turn, media at their
    ``<image>``/``<video>`` markers or first, then the assistant prompt); each image / video stands as one
    ``<|vision_start|><|image_pad|><|vision_end|>`` (``video_pad``) placeholder, which vLLM expands itself."""
    messages = [{"role": "user", "content": chat_content(prompt, n_images, n_videos)}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_request(processor: Any, prompt: str, images: Sequence[torch.Tensor], videos: Sequence[torch.Tensor],
                  fps: Sequence[float] | None = None) -> dict[str, Any]:
    """The vLLM prompt dict of one prepared prompt: ``{"prompt": chat text, "multi_modal_data": {"image": [PIL],
    "video": [((T,H,W,3) uint8, metadata)]}, "mm_processor_kwargs": {"fps": ..., "do_sample_frames": False}}``.

    Media keep their decoded pixels (the engine's ``min_pixels``/``max_pixels`` from :func:`engine_mm_kwargs`
    leave grid-aligned sizes as they are). ``fps`` (sampled frames per second, default 2.0 each) reaches Qwen2.5-VL's
    temporal positions through ``mm_processor_kwargs`` (one number when the videos share it, else one per video)
    and the metadata; frames are never resampled (``do_sample_frames: False``)."""
    fps = list(fps) if fps else [2.0] * len(videos)
    if len(fps) != len(videos):
        raise ValueError(f"fps has {len(fps)} entries for {len(videos)} videos")
    request: dict[str, Any] = {"prompt": chat_text(processor, prompt, len(images), len(videos))}
    data: dict[str, Any] = {}
    if images:
        data["image"] = [to_pil(image) for image in images]
    if videos:
        data["video"] = [(to_frames(v), video_metadata(v.shape[0], f)) for v, f in zip(videos, fps)]
        request["mm_processor_kwargs"] = {"fps": float(fps[0]) if len(set(fps)) == 1 else [float(f) for f in fps],
                                          "do_sample_frames": False}
    if data:
        request["multi_modal_data"] = data
    return request


def engine_mm_kwargs(cfg: VLMVideoConfig) -> dict[str, int]:
    """Engine-wide ``mm_processor_kwargs``: pixel bounds wide enough that every decoded image and frame (already
    resized to multiples of ``video.size_factor`` within the ``video.*`` budgets) passes the processor unresized."""
    return {"min_pixels": cfg.size_factor ** 2, "max_pixels": max(cfg.image_max_pixels, cfg.max_pixels) * PIXEL_UNIT}


def media_limits(items: Iterable[dict]) -> dict[str, int]:
    """``limit_mm_per_prompt``: the most images and videos any item's sample has."""
    images = videos = 0
    for item in items:
        sample = item.get("sample")
        if sample is not None:
            images, videos = max(images, len(sample.images)), max(videos, len(sample.videos))
    return {"image": images, "video": videos}


def engine_kwargs(cfg: VLMConfig, model_path: str, limits: dict[str, int], process_index: int = 0,
                  distributed: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for this run; ``generation.vllm_engine_kwargs`` override them (its
    ``mm_processor_kwargs`` are merged into ours). ``model_path`` is a full model: ``model.path`` or, when that
    is a PEFT adapter, its base (``model.revision`` applies to ``model.path`` only).

    ``distributed`` (several training processes under torch.distributed): ``external_launcher``, vLLM's executor
    for torchrun-style launchers, so each process's engine lives in that process on its own GPU (tensor parallel 1).
    """
    gen = cfg.generation
    pinned = model_path == cfg.model.path and not Path(model_path).is_dir()  # not the base of an adapter
    kwargs: dict[str, Any] = {
        "model": model_path, "tokenizer": model_path, "revision": cfg.model.revision if pinned else None,
        "dtype": cfg.model.dtype, "tensor_parallel_size": 1,
        "gpu_memory_utilization": gen.vllm_gpu_memory_utilization,
        "max_model_len": gen.vllm_max_model_len or cfg.data.max_prompt_tokens + gen.max_new_tokens,
        "enable_prefix_caching": True, "limit_mm_per_prompt": dict(limits),
        "mm_processor_kwargs": engine_mm_kwargs(cfg.video), "seed": cfg.seed + process_index,
        "generation_config": "vllm",  # our sampling settings, never the checkpoint's generation_config defaults
        "enable_sleep_mode": gen.vllm_sleep,
    }
    if distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"
    extra = dict(gen.vllm_engine_kwargs)
    kwargs["mm_processor_kwargs"].update(extra.pop("mm_processor_kwargs", None) or {})
    kwargs.update(extra)
    return kwargs


# ---------------------------------------------------------------------------------------------- sampling
def allowed_token_ids(vocab_size: int, banned: Iterable[int]) -> list[int]:
    """Every tokenizer id (``0 .. vocab_size - 1``) except ``banned`` (the vision special tokens): the same tokens
    the transformers path can sample (embedding rows past the tokenizer are never allowed)."""
    banned = set(banned)
    return [i for i in range(vocab_size) if i not in banned]


def draw_seeds(generator: torch.Generator | None, count: int) -> list[int]:
    """``count`` request seeds in [0, 2^31 - 1) from ``generator`` (on its device), so rollouts follow the run's
    RNG as with the transformers path."""
    device = generator.device if generator is not None else "cpu"
    return torch.randint(0, 2**31 - 1, (count,), generator=generator, device=device).tolist()


def sampling_kwargs(gen_cfg: VLMGenerationConfig, group_size: int, seed: int | None, allowed: list[int],
                    stop_token_ids: Sequence[int], logprobs: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt's group: ``n = group_size`` samples at the
    rollout temperature / top-p / top-k (``top_k`` 0 -> -1, "all tokens"), at most ``max_new_tokens``, stopping at
    any EOS id, sampling only ``allowed`` ids (vision tokens banned). Texts are decoded by :func:`to_completions`
    (``detokenize: False``); ``logprobs`` asks for the sampled tokens' log-probs (a diagnostic only)."""
    return {"n": group_size, "temperature": float(gen_cfg.temperature), "top_p": float(gen_cfg.top_p),
            "top_k": int(gen_cfg.top_k) if gen_cfg.top_k > 0 else -1, "max_tokens": int(gen_cfg.max_new_tokens),
            "seed": seed, "allowed_token_ids": allowed, "stop_token_ids": [int(t) for t in stop_token_ids],
            "skip_special_tokens": True, "detokenize": False, "logprobs": 0 if logprobs else None}


def to_completions(samples: Sequence[tuple], pad_token_id: int, eos_token_ids: Sequence[int], tokenizer: Any,
                   device: torch.device | str = "cpu", lead: str = "") -> Completions:
    """One prompt's G samples -> :class:`Completions`. A sample is ``(token_ids, finish_reason)`` or ``(token_ids,
    finish_reason, logprobs)``, as vLLM returns them: ``token_ids`` include the EOS that ended a ``stop`` sample
    (vLLM appends the sampled token before its stop check), ``length`` means the token limit.

    ``ids`` are right-padded with ``pad_token_id``, ``mask`` covers the real tokens including the EOS,
    ``truncated`` is ``length`` without a final EOS, ``texts`` are ``lead`` (``VLMModel.completion_lead``, the tag
    the prompt left open) plus the tokens decoded with special tokens skipped, and ``logprobs`` are the given ones,
    or NaN (not reported), on the real tokens and 0 where masked. A ``stop`` without a final EOS (a stop string, or a
    vLLM that drops the EOS) or any other finish reason raises ValueError rather than training on a guess."""
    eos = {int(t) for t in eos_token_ids}
    rows, truncated, logps = [], [], []
    for i, sample in enumerate(samples):
        ids, reason = [int(t) for t in sample[0]], sample[1]
        ends_in_eos = bool(ids) and ids[-1] in eos
        if reason == "stop" and not ends_in_eos:
            raise ValueError(f"sample {i} stopped ('stop') without an EOS token at its end; the vLLM backend "
                             f"expects the EOS id in token_ids (vLLM >= {MIN_VLLM}) and no stop strings")
        if reason not in ("stop", "length"):
            raise ValueError(f"sample {i} finished with reason {reason!r}; expected 'stop' or 'length'")
        rows.append(ids)
        truncated.append(reason == "length" and not ends_in_eos)
        values = sample[2] if len(sample) > 2 else None
        if values is not None and len(values) != len(ids):
            raise ValueError(f"sample {i} has {len(values)} log-probs for {len(ids)} tokens")
        logps.append(values)
    width = max([len(r) for r in rows] + [1])
    out_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, (ids, values) in enumerate(zip(rows, logps)):
        out_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, :len(ids)] = True
        logprobs[i, :len(ids)] = math.nan if values is None else torch.tensor([float(v) for v in values])
    texts = [lead + text for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]
    return Completions(ids=out_ids.to(device), mask=mask.to(device),
                       truncated=torch.tensor(truncated, dtype=torch.bool, device=device), texts=texts,
                       logprobs=logprobs.to(device))


def sampled_logprobs(token_ids: Sequence[int], steps: Sequence[Any] | None) -> list[float] | None:
    """The sampled tokens' log-probs from a vLLM ``CompletionOutput.logprobs`` (per step, token id -> Logprob)."""
    if steps is None:
        return None
    return [float(step[int(t)].logprob) for t, step in zip(token_ids, steps)]


# ---------------------------------------------------------------------------------------------- weights
def checkpoint_name(name: str, model_type: str) -> str | None:
    """The checkpoint name of a state-dict entry of a trained ``model_type`` module (see the module docstring), or
    None for tensors that have no checkpoint counterpart (LoRA factors, PEFT's ``original_module`` copies)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    if _LORA_TENSOR.search(name) or ".original_module." in name:
        return None
    name = _MODULES_TO_SAVE.sub(".", name.replace(".base_layer.", "."))
    if model_type not in RENAMED_MODEL_TYPES:
        return name
    for runtime, checkpoint in RUNTIME_TO_CHECKPOINT:
        if name.startswith(runtime):
            return checkpoint + name[len(runtime):]
    return name


def _check_full_parameters(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id") or type(p).__name__ in ("DTensor", "FlatParameter"):
            raise RuntimeError(f"generation.backend 'vllm' needs every process to hold the full weights (single "
                               f"process or DDP), but {name} is sharded (FSDP / DeepSpeed ZeRO-3)")


def _lora_deltas(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``<module>.base_layer.weight`` state-dict name -> its LoRA layer, for layers whose active adapters are not
    merged into the base weight."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not module.merged and not module.disable_adapters:
            layers[f"{name}.base_layer.weight" if name else "base_layer.weight"] = module
    return layers


@torch.no_grad()
def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every weight of the policy as vLLM should hold it: the state dict of the
    module inside any DDP wrapper, LoRA merged, names mapped by :func:`checkpoint_name`, a tied ``lm_head``
    left out. Lazy: merged LoRA weights are built one at a time as the engine consumes them."""
    model = strip_parallel(model)
    _check_full_parameters(model)
    lora = _lora_deltas(model) if hasattr(model, "get_base_model") else {}
    base = unwrap(model)
    out_emb, in_emb = base.get_output_embeddings(), base.get_input_embeddings()
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    seen: set[str] = set()
    for name, tensor in model.state_dict().items():
        target = checkpoint_name(name, base.config.model_type)
        if target is None or (tied and target == "lm_head.weight"):
            continue
        if target in seen:
            raise ValueError(f"two weights map to the checkpoint name {target} (last: {name})")
        seen.add(target)
        layer = lora.get(name)
        if layer is not None:
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            tensor = tensor + delta.to(tensor.dtype)
        yield target, tensor


def weights_version(model: torch.nn.Module) -> int:
    """A number that grows whenever any parameter is modified in place (optimiser steps, ``load_state_dict``):
    the sum of the parameters' autograd version counters."""
    return sum(p._version for p in model.parameters())


# ---------------------------------------------------------------------------------------------- engine
class VLLMSampler:
    """Rollout sampling through a vLLM engine colocated in this process (see the module docstring).

    ``limits`` is ``limit_mm_per_prompt`` (:func:`media_limits` of the training items). The engine is built at the
    first :meth:`generate` / :meth:`sync_weights`, so ``eval`` / ``sample`` (which sample through transformers)
    never build one. Raises a one-line ConfigError naming ``generation.backend`` when vLLM or CUDA is missing."""

    def __init__(self, cfg: VLMConfig, vlm: VLMModel, limits: dict[str, int]):
        self.vllm = import_vllm()
        self.cfg, self.vlm, self.limits = cfg, vlm, dict(limits)
        self.allowed = allowed_token_ids(vlm.vocab_size, vlm.vision_token_ids)
        self._llm: Any = None
        self._synced: int | None = None
        self._asleep = False
        self._counters: dict[str, float] = {}
        self._warned = False

    def engine(self) -> Any:
        """The ``vllm.LLM`` (built on first use, woken up when asleep)."""
        if self._llm is None:
            from accelerate import PartialState

            state = PartialState()
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and \
                state.num_processes > 1
            # the engine core must run in this process: weights are pushed by a function call on the live model
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # from the base of an adapter (vLLM loads full models); every weight is pushed before sampling anyway
            kwargs = engine_kwargs(self.cfg, self.vlm.base_path, self.limits, state.process_index, distributed)
            self._llm = self.vllm.LLM(**kwargs)
        if self._asleep:
            self._llm.wake_up()
            self._llm.reset_prefix_cache()  # the KV blocks were freed while asleep
            self._asleep = False
        return self._llm

    def sync_weights(self, model: torch.nn.Module) -> bool:
        """Push the policy weights into the engine if they changed since the last push (always the first time),
        then reset its prefix cache. Returns whether weights were pushed."""
        version = weights_version(strip_parallel(model))
        llm = self.engine()
        if version == self._synced:
            self._counters["vllm/weight_sync"] = 0.0
            return False
        start = time.perf_counter()
        weights = policy_weights(model)
        llm.apply_model(lambda vllm_model: vllm_model.load_weights(weights))
        llm.reset_prefix_cache()
        self._synced = version
        self._counters["vllm/weight_sync"] = 1.0
        self._counters["time/vllm_sync_s"] = time.perf_counter() - start
        return True

    def generate(self, prepared: Sequence[Any], group_size: int, gen_cfg: VLMGenerationConfig,
                 generator: torch.Generator | None) -> list[Completions]:
        """``group_size`` completions of each prepared prompt (``policy.Prepared``: ``item["prompt"]``, ``images``,
        ``videos``, ``fps``, ``inputs``), in order. Counts in ``vllm/prompt_mismatch`` the prompts whose token ids
        in vLLM differ from the training forward's (the processors disagree: see docs/vlm.md)."""
        llm = self.engine()
        processor, vlm = self.vlm.processor, self.vlm
        requests = [build_request(processor, p.item["prompt"], p.images, p.videos, p.fps) for p in prepared]
        seeds = draw_seeds(generator, len(requests))
        # vLLM reports log-probs of the raw logits: comparable with the trainer's only at scoring temperature 1
        logprobs = gen_cfg.vllm_check_logprobs and scoring_temperature(gen_cfg) == 1.0
        params = [self.vllm.SamplingParams(**sampling_kwargs(gen_cfg, group_size, seed, self.allowed,
                                                             vlm.eos_token_ids, logprobs))
                  for seed in seeds]
        outputs = llm.generate(requests, params, use_tqdm=False)
        mismatch = 0
        completions = []
        for p, output in zip(prepared, outputs):
            if list(output.prompt_token_ids) != p.inputs["input_ids"][0].tolist():
                mismatch += 1
            samples = sorted(output.outputs, key=lambda c: c.index)
            completions.append(to_completions(
                [(c.token_ids, c.finish_reason, sampled_logprobs(c.token_ids, c.logprobs)) for c in samples],
                vlm.pad_token_id, vlm.eos_token_ids, vlm.tokenizer, vlm.device, vlm.completion_lead))
        self._counters["vllm/prompt_mismatch"] = self._counters.get("vllm/prompt_mismatch", 0.0) + mismatch
        if mismatch and not self._warned:
            self._warned = True
            warnings.warn(f"vLLM tokenised {mismatch} of {len(prepared)} prompts differently from the training "
                          f"forward (vision token counts differ?); see docs/vlm.md, 'vLLM rollout backend'",
                          stacklevel=2)
        return completions

    def sleep(self) -> None:
        """With ``generation.vllm_sleep``: offload the engine's weights to CPU and free its KV cache until the next
        rollout (vLLM sleep level 1)."""
        if self.cfg.generation.vllm_sleep and self._llm is not None and not self._asleep:
            self._llm.sleep(level=1)
            self._asleep = True

    def rollout_counters(self) -> dict[str, float]:
        """This rollout's ``vllm/*`` counters (and ``time/vllm_sync_s``), then cleared."""
        counters, self._counters = self._counters, {}
        return counters


def shuffled_accuracy(sampler: VLLMSampler, prepared: Sequence[Any], count: int, gen_cfg: VLMGenerationConfig,
                      accuracy: Any, generator: torch.Generator | None,
                      frame_generator: torch.Generator) -> dict[int, tuple[float, int]]:
    """T-GRPO through vLLM: for every prepared prompt with a video, ``count`` answers with each video's frames
    shuffled by ``frame_generator`` (as :func:`~mmgrpo.pipelines.vlm.tgrpo.shuffled_accuracy`), all sampled in one
    engine call. Returns prompt index -> (mean ``accuracy``, completion tokens)."""
    indices = [i for i, p in enumerate(prepared) if p.videos]
    if not indices:
        return {}
    shuffled = [replace(prepared[i], videos=[shuffle_frames(v, frame_generator) for v in prepared[i].videos])
                for i in indices]
    out = {}
    for i, completions in zip(indices, sampler.generate(shuffled, count, gen_cfg, generator)):
        p = prepared[i]
        batch = RewardBatch(prompts=[p.item["prompt"]] * count, group=torch.zeros(count, dtype=torch.long),
                            completions=completions.texts, meta=[p.meta()] * count)
        scores = torch.as_tensor(accuracy(batch), dtype=torch.float64)
        out[i] = (scores.nanmean().item(), int(completions.mask.sum()))
    return out
