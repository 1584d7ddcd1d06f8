"""Model adapters of the flow pipeline: one small class per diffusers model family, behind one interface.

An adapter loads a stock diffusers pipeline (hub id, local folder, or ``tiny:<kind>``) with ``from_pretrained``, makes
its transformer trainable (PEFT LoRA or full fine-tuning) and freezes everything else. It then exposes exactly what
GRPO needs, in the pipeline's own conventions:

- :meth:`FlowAdapter.encode`: prompt embeddings through the pipeline's ``encode_prompt``, cached per prompt string.
- :meth:`FlowAdapter.initial_latents` and :meth:`FlowAdapter.sigmas`: the starting noise and the sigma schedule the
  pipeline's scheduler would use.
- :meth:`FlowAdapter.velocity`: the (CFG-combined) velocity at noise level sigma, in fp32.
- :meth:`FlowAdapter.reference_velocity`: the same under the frozen reference policy (KL).
- :meth:`FlowAdapter.decode`: pixels in [0, 1].
- :meth:`FlowAdapter.save_trainable` / :meth:`FlowAdapter.load_trainable`: LoRA in the diffusers format that
  ``pipe.load_lora_weights`` reads, or a full ``transformer/`` folder (and ``transformer_2/`` for Wan2.2 A14B).

Conventions: ``sigma`` is the rectified-flow noise level in [0, 1] (``x = (1 - sigma) * x0 + sigma * noise``), the
velocity is ``noise - x0``. The conversion from sigma to each transformer's ``timestep`` argument happens in one
place, :meth:`FlowAdapter.timestep`.

Adapters are registered in ``mmgrpo.registry.MODEL_ADAPTERS`` as ``sd3``, ``flux`` and ``wan``; build one from a
config with :func:`load_adapter`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import json
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from mmgrpo.checkpoint import checkpoint_hint, placed_like, safetensors_files
from mmgrpo.config import ConfigError, cwd_hint, hub_id_hint
from mmgrpo.pipelines.flow.config import FlowModelConfig
from mmgrpo.pipelines.flow.tiny import KINDS, tiny_path
from mmgrpo.policy import frozen_copy
from mmgrpo.registry import MODEL_ADAPTERS, RegistryError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Accepted values of ``model.dtype``."""

MIXED_PRECISION = {torch.float16: "fp16", torch.bfloat16: "bf16"}
"""accelerate's mixed precision name of each half-precision autocast dtype."""

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
"""File name diffusers' ``save_lora_weights`` writes and ``load_lora_weights`` reads by default."""

DECODE_CHUNK = 4
"""Samples decoded by the VAE at once (bounds VAE activation memory for large images and videos)."""


class AttentionFallbackWarning(RuntimeWarning):
    """The requested attention backend cannot run here; native PyTorch SDPA is used instead."""


_warned: set[tuple[str, str]] = set()
"""(backend, reason) pairs already warned about in this process: each fallback is reported once."""


def input_dtype(model: nn.Module, configured: torch.dtype) -> torch.dtype:
    """The dtype a forward of ``model`` takes its inputs in: ``configured`` (the adapter's :attr:`dtype`) while
    some floating weight of ``model`` is in it (a bf16 base may hold fp32 LoRA weights and fp32 norms); that of
    its first weight once none is, as after DeepSpeed's bf16 or fp16 cast every weight it trains."""
    dtypes = (p.dtype for p in model.parameters() if p.is_floating_point())
    first = next(dtypes, configured)
    return configured if first == configured or configured in dtypes else first


def check_autocast(model_dtype: str, autocast: torch.dtype | None) -> None:
    """ConfigError when weights in ``model_dtype`` (a key of :data:`DTYPES`) cannot run under ``autocast``, the
    dtype forwards autocast to (None: no autocast). torch's autocast rejects float16 and bfloat16 inputs mixed in one
    op it promotes ("Unexpected floating ScalarType in at::autocast::prioritize"), such as a ``torch.cat`` of text
    embeddings or the transformers' own ops, so half weights under the other half type fail in the first rollout.
    float32 weights run under either; half weights run without autocast or under their own dtype, where the
    transformer's output, and so the unconditional velocity a rollout stores in the model dtype, is exact."""
    weights = DTYPES[model_dtype]
    if autocast in MIXED_PRECISION and weights in MIXED_PRECISION and autocast != weights:
        raise ConfigError(f"bad value for 'model.dtype': {model_dtype} cannot run under {MIXED_PRECISION[autocast]} "
                          "mixed precision (train.mixed_precision or the launcher's; torch's autocast rejects float16 "
                          f"and bfloat16 inputs in one op): use model.dtype {str(autocast).removeprefix('torch.')} or "
                          f"float32, or mixed precision {MIXED_PRECISION[weights]} or no")


# ----------------------------------------------------------------------------------------------------------------
# Prompt embeddings
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PromptEmbeds:
    """Text conditioning for n rows, on the adapter's device, in the model dtype.

    - ``cond``: the transformer's keyword arguments for the prompts, each tensor (n, ...): ``encoder_hidden_states``
      (n, L, D) for every model, plus ``pooled_projections`` (n, P) for SD3 and FLUX. FLUX's ``txt_ids`` are the
      same zeros for every row and are built in :meth:`FlowAdapter.velocity`, so every entry here has a row axis.
    - ``uncond``: the same for the negative prompt (each row a copy), or None when CFG is off (guidance_scale <= 1,
      or a guidance-distilled FLUX, which takes the scale as an embedding instead).
    """

    cond: dict[str, Tensor]
    uncond: dict[str, Tensor] | None = None

    def __len__(self) -> int:
        return next(iter(self.cond.values())).shape[0]

    def select(self, rows: Tensor | list[int]) -> PromptEmbeds:
        """The embeddings of ``rows`` (indices into the n rows), as contiguous copies."""
        index = torch.as_tensor(rows, dtype=torch.long)

        def pick(part: dict[str, Tensor]) -> dict[str, Tensor]:
            return {k: v[index.to(v.device)] for k, v in part.items()}

        return PromptEmbeds(pick(self.cond), None if self.uncond is None else pick(self.uncond))

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        """Rows of all ``parts`` in order. Either every part has ``uncond`` or none has."""
        if not parts:
            raise ValueError("PromptEmbeds.cat needs at least one part")
        with_uncond = {p.uncond is not None for p in parts}
        if len(with_uncond) != 1:
            raise ValueError("PromptEmbeds.cat: some parts have unconditional embeddings and some do not")
        cond = {k: torch.cat([p.cond[k] for p in parts]) for k in parts[0].cond}
        uncond = {k: torch.cat([p.uncond[k] for p in parts]) for k in parts[0].uncond} if True in with_uncond else None
        return PromptEmbeds(cond, uncond)


# ----------------------------------------------------------------------------------------------------------------
# Loading helpers
# ----------------------------------------------------------------------------------------------------------------


def _one_line(err: BaseException, limit: int = 200) -> str:
    """The first line of an exception message, shortened; the class name when the message is empty."""
    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def resolve_model_path(path: str) -> tuple[str, bool]:
    """``(where to load from, is_local)`` for ``model.path``.

    ``tiny:<kind>`` builds (once) and returns the cached tiny pipeline. A path that looks local (starts with ``/``,
    ``./``, ``../`` or ``~``, exists, or has an existing parent folder) must be a diffusers pipeline folder (with
    ``model_index.json``); anything else is treated as a hub id."""
    if path.startswith("tiny:"):
        kind = path.removeprefix("tiny:")
        if kind not in KINDS:
            known = ", ".join(f"tiny:{k}" for k in KINDS)
            raise ConfigError(f"bad value for 'model.path': unknown tiny pipeline '{path}' (known: {known})")
        return str(tiny_path(kind)), True
    if path in ("", "???"):
        raise ConfigError("missing value for 'model.path': give a hub id, a local pipeline folder or tiny:<kind>")
    local = Path(path).expanduser()
    parent_exists = str(local.parent) not in ("", ".") and local.parent.exists()
    if path.startswith(("/", "./", "../", "~")) or local.exists() or parent_exists:
        if not local.exists():
            raise ConfigError(f"bad value for 'model.path': local model folder not found: {path}{cwd_hint(path)}")
        if not (local / "model_index.json").is_file():
            raise ConfigError(f"bad value for 'model.path': {path} is not a diffusers pipeline folder "
                              f"(no model_index.json){checkpoint_hint(local)}")
        return str(local), True
    return path, False


def _load_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "this model cannot be loaded from there" (not a bug in mmgrpo)."""
    types: list[type[BaseException]] = [OSError, ValueError]
    with contextlib.suppress(ImportError):
        from huggingface_hub.errors import HfHubHTTPError

        types.append(HfHubHTTPError)
    return tuple(types)


def _warn_fallback(backend: str, reason: str) -> None:
    if (backend, reason) in _warned:
        return
    _warned.add((backend, reason))
    warnings.warn(f"model.attention_backend: '{backend}' is not usable here ({reason}); "
                  "using native PyTorch SDPA instead", AttentionFallbackWarning, stacklevel=4)


def _check_backend_name(name: str) -> None:
    """ConfigError unless ``name`` is "auto" or one of diffusers' attention backends."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    known = {b.value for b in AttentionBackendName}
    if name != "auto" and name not in known:
        public = ", ".join(sorted(k for k in known if not k.startswith("_")))
        raise ConfigError(f"bad value for 'model.attention_backend': '{name}' (auto or one of: {public})")


def _probe_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when diffusers' ``backend`` runs a tiny attention on ``device`` in ``dtype``, else the reason."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    q = torch.randn(1, 8, 2, 32, device=device, dtype=dtype)  # (batch, tokens, heads, head_dim)
    try:
        dispatch_attention_fn(q, q, q, backend=AttentionBackendName(backend))
    except Exception as err:  # noqa: BLE001 - any kernel failure (package, no CPU kernel, dtype) = unusable
        return f"{type(err).__name__}: {_one_line(err, 160)}"
    return None


# ----------------------------------------------------------------------------------------------------------------
# The base adapter
# ----------------------------------------------------------------------------------------------------------------


def guide(v_cond: Tensor, v_uncond: Tensor, guidance_scale: float | Tensor) -> Tensor:
    """Classifier-free guidance: ``v_u + guidance_scale * (v_c - v_u)``, fp32 in, fp32 out; a tensor scale
    broadcasts over the rows (one scale per row, shaped (n, 1, ...))."""
    return v_uncond + guidance_scale * (v_cond - v_uncond)


class FlowAdapter:
    """A diffusers flow-matching pipeline made trainable, with GRPO's view of it.

    Attributes:

    - ``kind``: the registry name (sd3, flux, wan); ``modality``: "image" or "video".
    - ``pipe``: the loaded diffusers pipeline; text encoders and VAE are frozen and in eval mode.
    - ``parts``: the pipeline's denoising transformers by component name (``transformer``; Wan2.2 A14B adds
      ``transformer_2``); ``trained_parts``: the names of those that train.
    - ``transformer``: the trainable module velocity calls: the pipeline's own transformer, or one module holding
      all parts (Wan2.2 A14B's :class:`WanExperts`). Each trained part carries PEFT LoRA layers with
      ``cfg.lora_rank > 0`` (injected with diffusers' ``add_adapter``, adapter name "default"; only the LoRA
      weights train, kept in fp32); with ``lora_rank == 0`` its every parameter trains, in fp32.
    - ``dtype``: the dtype of the transformer forward ("model dtype"): ``cfg.dtype`` with LoRA, float32 for a
      full fine-tune (accelerate's mixed precision may autocast it).
    - ``attention_backend``: the attention backend actually in use.
    - ``device``: where every part lives.

    Args:
        cfg: the ``model`` config section.
        device: torch device for all parts.
        keep_reference: full fine-tune only: keep a frozen copy of the initial trained parts for
            :meth:`reference_velocity` (LoRA needs none; the base weights are the reference).
        prompt_cache_size: distinct prompt strings whose embeddings are kept (least recently used are dropped).
            Each prompt is encoded on its own (batch of one), so a dropped entry re-encodes to bitwise the same
            tensors.
    """

    kind: ClassVar[str] = ""
    modality: ClassVar[str] = "image"
    pipeline_class: ClassVar[str] = ""
    """Name of the diffusers pipeline class that loads the checkpoint."""
    default_max_sequence_length: ClassVar[int] = 256
    """T5/UMT5 tokens per prompt in the pipeline's ``__call__``; :attr:`max_sequence_length` caps it at the
    tokenizer's ``model_max_length`` (512 for the published checkpoints, so no change there; 32 for tiny ones)."""
    t5_tokenizer: ClassVar[str] = "tokenizer"
    """Pipeline attribute holding the T5/UMT5 tokenizer."""

    def __init__(self, cfg: FlowModelConfig, device: torch.device | str = "cpu", keep_reference: bool = False,
                 prompt_cache_size: int = 256):
        if cfg.dtype not in DTYPES:
            raise ConfigError(f"bad value for 'model.dtype': '{cfg.dtype}' (use one of {', '.join(DTYPES)})")
        if cfg.lora_rank < 0:
            raise ConfigError(f"bad value for 'model.lora_rank': {cfg.lora_rank} (0 = full fine-tune, or > 0)")
        _check_backend_name(cfg.attention_backend)
        self.cfg = cfg
        self.device = torch.device(device)
        self.is_lora = cfg.lora_rank > 0
        self.dtype = DTYPES[cfg.dtype] if self.is_lora else torch.float32
        self.pipe = self._load_pipeline(cfg)
        self.pipe.set_progress_bar_config(disable=True)
        for component in self.pipe.components.values():
            if isinstance(component, nn.Module):
                component.requires_grad_(False).eval()
        tokenizer = getattr(self.pipe, self.t5_tokenizer, None)
        self.sequence_limit = getattr(tokenizer, "model_max_length", None) or self.default_max_sequence_length
        """The most T5/UMT5 tokens per prompt: the tokenizer's ``model_max_length`` (512 for the published
        checkpoints, the most their stock pipelines take)."""
        self.max_sequence_length = min(self.default_max_sequence_length, self.sequence_limit)
        self.parts = self._transformer_parts()
        self.trained_parts = self._trained_names(self.parts)
        for name in self.trained_parts:
            self._make_trainable(self.parts[name], cfg)
        backends = {name: self._set_attention_backend(m, cfg.attention_backend) for name, m in self.parts.items()}
        self.attention_backend = backends["transformer"]  # the parts are one model class: the same backend
        self._reference: nn.Module | None = None
        if keep_reference and not self.is_lora:
            self._reference = self._assemble({n: frozen_copy(m) if n in self.trained_parts else m
                                              for n, m in self.parts.items()})
        if cfg.gradient_checkpointing:
            for name in self.trained_parts:
                self.parts[name].enable_gradient_checkpointing()
        self.transformer: nn.Module = self._assemble(self.parts)
        if cfg.guidance_scale_2 is not None and "transformer_2" not in self.parts:
            raise ConfigError(f"bad value for 'model.guidance_scale_2': {cfg.guidance_scale_2} ('{cfg.path}' has no "
                              "low-noise expert; only Wan2.2 A14B uses it)")
        self._cache: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        self._cache_size = prompt_cache_size
        self._latent_grids: dict[int, tuple[int, int]] = {}

    # -- loading ---------------------------------------------------------------------------------------------------

    def _load_pipeline(self, cfg: FlowModelConfig):
        """``from_pretrained`` of the pipeline class (a local folder must name that class in model_index.json)."""
        import diffusers

        path, local = resolve_model_path(cfg.path)
        if local:
            found = json.loads((Path(path) / "model_index.json").read_text()).get("_class_name")
            if found != self.pipeline_class:
                raise ConfigError(f"bad value for 'model.path': '{cfg.path}' holds a {found}, but model.type "
                                  f"'{self.kind}' loads a {self.pipeline_class}")
        try:
            pipe = getattr(diffusers, self.pipeline_class).from_pretrained(
                path, revision=None if local else cfg.revision, dtype=DTYPES[cfg.dtype])
        except _load_error_types() as err:
            where = "local folder" if local else "hub id (offline, gated or misspelt?)"
            raise ConfigError(f"bad value for 'model.path': cannot load {where} '{cfg.path}'"
                              f"{'' if local else hub_id_hint(cfg.path)}: {_one_line(err, 160)}") from err
        return pipe.to(self.device)

    def _transformer_parts(self) -> dict[str, nn.Module]:
        """The pipeline's denoising transformers by component name: here the one ``transformer``."""
        return {"transformer": self.pipe.transformer}

    def _trained_names(self, parts: dict[str, nn.Module]) -> tuple[str, ...]:
        """Names of the ``parts`` that train (LoRA or full): here all of them."""
        return tuple(parts)

    def _assemble(self, parts: dict[str, nn.Module]) -> nn.Module:
        """The one module velocity calls, built from ``parts``: here the single transformer itself."""
        return parts["transformer"]

    def _make_trainable(self, transformer: nn.Module, cfg: FlowModelConfig) -> None:
        """LoRA layers (fp32) on ``transformer``, or every parameter trainable in fp32 (full fine-tune)."""
        if self.is_lora:
            self._add_lora(transformer, cfg)
            return
        if transformer.dtype != torch.float32:  # trained weights are fp32 (diffusers warns on a no-op cast)
            transformer.to(torch.float32)
        transformer.requires_grad_(True)

    @staticmethod
    def _add_lora(transformer: nn.Module, cfg: FlowModelConfig) -> None:
        from diffusers.training_utils import cast_training_params
        from peft import LoraConfig

        _check_lora_targets(transformer, list(cfg.lora_targets))
        config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, init_lora_weights="gaussian",
                            target_modules=list(cfg.lora_targets), lora_dropout=0.0)
        try:
            transformer.add_adapter(config)
        except ValueError as err:
            raise ConfigError(f"bad value for 'model.lora_targets': {cfg.lora_targets} ({_one_line(err)})") from err
        cast_training_params(transformer, torch.float32)

    def _set_attention_backend(self, transformer: nn.Module, name: str) -> str:
        """Apply ``model.attention_backend``; returns the backend in use (native when the request cannot run)."""
        processors = [getattr(m, "processor", None) for m in transformer.modules()]
        dispatched = any(hasattr(p, "_attention_backend") for p in processors if p is not None)
        if name == "auto":
            flash_ready = importlib.util.find_spec("flash_attn") is not None
            half = self.dtype in (torch.float16, torch.bfloat16)
            name = "flash" if dispatched and flash_ready and half and self.device.type == "cuda" else "native"
        if not dispatched:
            # These processors (e.g. SD3's JointAttnProcessor2_0) call torch SDPA directly, which already picks
            # flash / memory-efficient kernels on CUDA; only xformers has a replacement processor.
            if name == "native":
                return "native"
            if name == "xformers":
                try:
                    transformer.enable_xformers_memory_efficient_attention()
                    return "xformers"
                except Exception as err:  # noqa: BLE001 - missing package or no CUDA: fall back
                    _warn_fallback(name, _one_line(err, 160))
                    return "native"
            _warn_fallback(name, f"{type(transformer).__name__}'s attention processors call torch SDPA directly "
                                 "and do not dispatch to other backends")
            return "native"
        try:
            transformer.set_attention_backend(name)
            reason = _probe_backend(name, self.device, self.dtype) if name != "native" else None
        except Exception as err:  # noqa: BLE001 - diffusers' requirement checks: fall back
            reason = _one_line(err, 160)
        if reason is None:
            return name
        _warn_fallback(name, reason)
        transformer.set_attention_backend("native")
        return "native"

    # -- prompts ---------------------------------------------------------------------------------------------------

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether velocity runs a separate unconditional forward (classifier-free guidance)."""
        return guidance_scale > 1.0

    def guided(self, v_cond: Tensor, v_uncond: Tensor, sigma: Tensor, guidance_scale: float) -> Tensor:
        """:func:`guide` of (n, ...) velocities at noise levels ``sigma`` (n,): one scale for every row here;
        models whose scale depends on the step override it."""
        return guide(v_cond, v_uncond, guidance_scale)

    def _encode_one(self, prompt: str) -> dict[str, Tensor]:
        """Transformer kwargs for one prompt, each (1, ...), from the pipeline's ``encode_prompt``."""
        raise NotImplementedError

    def _embedding(self, prompt: str) -> dict[str, Tensor]:
        if prompt in self._cache:
            self._cache.move_to_end(prompt)
            return self._cache[prompt]
        with torch.no_grad():
            entry = {k: v.to(self.device, self.dtype) for k, v in self._encode_one(prompt).items()}
        self._cache[prompt] = entry
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return entry

    def encode(self, prompts: list[str], negative_prompt: str, guidance_scale: float) -> PromptEmbeds:
        """Embeddings for ``prompts`` (n rows) and, when CFG is on, n copies of ``negative_prompt``'s.

        Each distinct string goes through the text encoders once (then comes from the cache); no grad."""
        if not prompts:
            raise ValueError("encode needs at least one prompt")
        rows = [self._embedding(p) for p in prompts]
        cond = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        uncond = None
        if self.uses_cfg(guidance_scale):
            negative = self._embedding(negative_prompt)
            uncond = {k: v.repeat(len(prompts), *([1] * (v.ndim - 1))) for k, v in negative.items()}
        return PromptEmbeds(cond, uncond)

    # -- latents and schedule --------------------------------------------------------------------------------------

    def latent_shape(self, n: int, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        """Shape of the noise the pipeline draws (before any packing)."""
        raise NotImplementedError

    def _check_size(self, height: int, width: int, multiple: int) -> None:
        for key, value in (("height", height), ("width", width)):
            if value <= 0 or value % multiple:
                raise ConfigError(f"bad value for 'sampling.{key}': {value} (must be a positive multiple of "
                                  f"{multiple} for {self.kind})")

    def initial_latents(self, n: int, height: int, width: int, num_frames: int,
                        generator: torch.Generator | None) -> Tensor:
        """fp32 standard normal noise (n, ...) in the shape the transformer takes, on the adapter's device.

        Drawn on ``generator``'s device in the shape the pipeline draws, so a seed gives the pipeline's noise."""
        shape = self.latent_shape(n, height, width, num_frames)
        draw_device = generator.device if generator is not None else self.device
        noise = torch.randn(shape, generator=generator, device=draw_device, dtype=torch.float32)
        return noise.to(self.device)

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int) -> None:
        """Call ``scheduler.set_timesteps`` exactly as the pipeline's ``__call__`` does."""
        raise NotImplementedError

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> Tensor:
        """The pipeline scheduler's sigma schedule: (num_steps + 1,) fp32 on CPU, from ~1 down to a final 0.

        Computed on a fresh copy of ``pipe.scheduler``, so the pipeline's own scheduler state is untouched."""
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        self._set_timesteps(scheduler, num_steps, height, width, num_frames)
        sigmas = scheduler.sigmas.detach().to("cpu", torch.float32).clone()
        if sigmas.shape != (num_steps + 1,) or sigmas[-1] != 0:
            raise ValueError(f"{type(scheduler).__name__} gave sigmas {sigmas.tolist()} for {num_steps} steps; "
                             "mmgrpo needs num_steps + 1 values ending at 0")
        return sigmas

    # -- velocity --------------------------------------------------------------------------------------------------

    def timestep(self, sigma: Tensor) -> Tensor:
        """The transformer's ``timestep`` argument for noise level ``sigma`` (n,), fp32. The one conversion point.

        SD3 and Wan take diffusers' [0, 1000] timestep, ``sigma * 1000``, as their pipelines pass
        ``scheduler.timesteps``."""
        return sigma * 1000.0

    def _forward(self, model: nn.Module, x: Tensor, timestep: Tensor, embeds: dict[str, Tensor],
                 guidance_scale: float) -> Tensor:
        """One transformer forward: x in the model dtype, returns the raw prediction."""
        raise NotImplementedError

    def _run(self, model: nn.Module, x: Tensor, timestep: Tensor, embeds: dict[str, Tensor],
             guidance_scale: float) -> Tensor:
        """:meth:`_forward` with ``x`` and the floating prompt embeddings in the dtype of ``model``'s weights
        (:func:`input_dtype`), which may differ from :attr:`dtype`: DeepSpeed's bf16 or fp16 casts the weights it
        trains (and not a full fine-tune's frozen reference) instead of running under autocast."""
        dtype = input_dtype(model, self.dtype)
        if x.dtype != dtype:
            x = x.to(dtype)
            embeds = {k: v.to(dtype) if v.is_floating_point() else v for k, v in embeds.items()}
        return self._forward(model, x, timestep, embeds, guidance_scale)

    def _model_inputs(self, latents: Tensor, sigma: Tensor, embeds: PromptEmbeds,
                      guidance_scale: float) -> tuple[Tensor, Tensor, bool]:
        """(latents in the model dtype, timesteps (n,), whether CFG applies), with the shapes checked."""
        n = latents.shape[0]
        if len(embeds) != n:
            raise ValueError(f"velocity: {n} latent rows but {len(embeds)} prompt-embedding rows")
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1).expand(n)
        cfg = self.uses_cfg(guidance_scale)
        if cfg and embeds.uncond is None:
            raise ValueError(f"guidance_scale {guidance_scale} needs unconditional embeddings: encode the prompts "
                             "with the same guidance_scale")
        return latents.to(self.dtype), self.timestep(sigma), cfg

    @torch.no_grad()
    def unconditional_velocity(self, latents: Tensor, sigma: Tensor, embeds: PromptEmbeds, guidance_scale: float,
                               transformer: nn.Module | None = None) -> Tensor | None:
        """The unconditional forward of :meth:`velocity` alone, (n, ...) fp32, no grad; None without CFG. Pass it
        back as ``velocity(..., uncond=...)`` to get the guided velocity without running it again."""
        x, t, cfg = self._model_inputs(latents, sigma, embeds, guidance_scale)
        if not cfg:
            return None
        model = self.transformer if transformer is None else transformer
        return self._run(model, x, t, embeds.uncond, guidance_scale).float()

    @torch.no_grad()
    def fused_cfg_velocities(self, latents: Tensor, sigma: Tensor, embeds: PromptEmbeds, guidance_scale: float,
                             transformer: nn.Module | None = None) -> tuple[Tensor, Tensor]:
        """(conditional, unconditional) velocities (n, ...) fp32 from ONE no-grad forward of 2n rows [cond;
        uncond]. Needs CFG."""
        x, t, cfg = self._model_inputs(latents, sigma, embeds, guidance_scale)
        if not cfg:
            raise ValueError(f"fused_cfg_velocities needs classifier-free guidance; guidance_scale {guidance_scale} "
                             "does not use it with this model")
        model = self.transformer if transformer is None else transformer
        both = {k: torch.cat([embeds.cond[k], embeds.uncond[k]]) for k in embeds.cond}
        v_cond, v_uncond = self._run(model, x.repeat(2, *[1] * (x.dim() - 1)), t.repeat(2), both,
                                     guidance_scale).float().chunk(2)
        return v_cond, v_uncond

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: PromptEmbeds, guidance_scale: float,
                 transformer: nn.Module | None = None, fused_cfg: bool = False,
                 uncond: Tensor | None = None) -> Tensor:
        """The velocity v (n, ...) fp32 at ``latents`` (n, ...) and noise levels ``sigma`` (n,) in [0, 1].

        ``transformer`` defaults to :attr:`transformer`; pass the DDP/FSDP-wrapped module in training so gradients
        synchronise. With CFG, the conditional forward runs in the ambient grad mode and the unconditional one,
        a separate forward over the same n rows, always under ``torch.no_grad()``; then
        ``v = v_u + guidance_scale * (v_c - v_u)`` in fp32 (:meth:`guided`). ``uncond`` is that unconditional velocity from
        :meth:`unconditional_velocity` of the same weights and inputs: the forward is skipped. ``fused_cfg``
        instead runs both as one forward of 2n rows [cond; uncond] (no grad only; :meth:`fused_cfg_velocities`):
        fewer calls, but a result that differs from the split form by float rounding, so never for a velocity
        whose log-prob training replays. Latents are cast to the model dtype."""
        model = self.transformer if transformer is None else transformer
        x, t, cfg = self._model_inputs(latents, sigma, embeds, guidance_scale)
        if cfg and fused_cfg:
            if torch.is_grad_enabled():
                raise RuntimeError("velocity(fused_cfg=True) runs without grad; call it under torch.no_grad()")
            v_cond, v_uncond = self.fused_cfg_velocities(latents, sigma, embeds, guidance_scale, model)
            return self.guided(v_cond, v_uncond, sigma, guidance_scale)
        v = self._run(model, x, t, embeds.cond, guidance_scale).float()
        if not cfg:
            return v
        if uncond is None:
            uncond = self.unconditional_velocity(latents, sigma, embeds, guidance_scale, transformer=model)
        return self.guided(v, uncond, sigma, guidance_scale)

    @functools.cached_property
    def _lora_layers(self) -> list[nn.Module]:
        """The PEFT tuner layers of the trained parts (LoRA only), listed once: toggling them directly skips a
        walk over every module per reference call."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        return [m for name in self.trained_parts for m in self.parts[name].modules() if isinstance(m, BaseTunerLayer)]

    @contextlib.contextmanager
    def _base_weights(self) -> Iterator[None]:
        """LoRA layers bypassed (the base model) inside the block; their parameters' trainability flags (which
        PEFT's toggle resets) restored afterwards."""
        flags = [(p, p.requires_grad) for layer in self._lora_layers for p in layer.parameters()]
        for layer in self._lora_layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in self._lora_layers:
                layer.enable_adapters(True)
            for p, flag in flags:
                p.requires_grad_(flag)

    def reference_velocity(self, latents: Tensor, sigma: Tensor, embeds: PromptEmbeds, guidance_scale: float,
                           transformer: nn.Module | None = None) -> Tensor:
        """:meth:`velocity` of the reference policy, under no_grad.

        LoRA: the base weights (adapters disabled; ``transformer`` may be the wrapped trainable module, whose
        adapters are switched off for the call). Full fine-tune: the frozen copy made at init with
        ``keep_reference=True``."""
        with torch.no_grad():
            if self.is_lora:
                with self._base_weights():
                    return self.velocity(latents, sigma, embeds, guidance_scale, transformer=transformer)
            if self._reference is None:
                raise RuntimeError("reference_velocity of a full fine-tune needs the adapter built with "
                                   "keep_reference=True (a frozen copy of the initial transformer)")
            return self.velocity(latents, sigma, embeds, guidance_scale, transformer=self._reference)

    # -- decoding --------------------------------------------------------------------------------------------------

    def _vae_latents(self, latents: Tensor) -> Tensor:
        """Final latents -> the VAE's input scale and layout, as the pipeline does before ``vae.decode``."""
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Pixels in [0, 1], float32: images (n, 3, H, W) or videos (n, T, 3, H, W). No grad."""
        vae = self.pipe.vae
        x = self._vae_latents(latents.float())
        out = [vae.decode(chunk.to(vae.dtype), return_dict=False)[0].float() for chunk in x.split(DECODE_CHUNK)]
        pixels = (torch.cat(out) / 2 + 0.5).clamp(0, 1)
        return pixels.permute(0, 2, 1, 3, 4).contiguous() if self.modality == "video" else pixels

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def save_trainable(self, directory: Path, transformer: nn.Module | None = None,
                       state_dict: dict[str, Tensor] | None = None) -> None:
        """Write the trained weights (safetensors) for stock diffusers, one file or folder per trained part.

        LoRA: ``pytorch_lora_weights.safetensors`` in :func:`lora_folder` (``directory`` for ``transformer``,
        ``directory/<part>`` for another) via the pipeline class's ``save_lora_weights``, with the LoRA config
        (rank, alpha) as metadata, so ``pipe.load_lora_weights(directory)`` reproduces the adapter (and
        ``load_lora_weights(directory / "transformer_2", load_into_transformer_2=True)`` Wan2.2's second expert's).
        Full fine-tune: a
        ``directory/<part>`` folder (``directory/transformer``) that ``from_pretrained`` loads. ``transformer`` is
        the unwrapped module to save (default: :attr:`transformer`); ``state_dict`` is its gathered full state
        dict when the trained module is sharded (FSDP / ZeRO-3), whose own tensors are then only shards."""
        model = self.transformer if transformer is None else transformer
        for name, part, part_state in self._split_trained(model, state_dict):
            if self.is_lora:
                self._save_lora(Path(directory), name, part, part_state)
            else:
                _save_full(Path(directory) / name, part, part_state)

    def _split_trained(self, model: nn.Module, state_dict: dict[str, Tensor] | None
                       ) -> list[tuple[str, nn.Module, dict[str, Tensor] | None]]:
        """(part name, module, its state dict or None) of every trained part of ``model`` (:meth:`_assemble`'s
        result): here the single transformer."""
        return [("transformer", model, state_dict)]

    def _save_lora(self, directory: Path, name: str, part: nn.Module, state_dict: dict[str, Tensor] | None) -> None:
        from peft.utils import get_peft_model_state_dict

        lora = get_peft_model_state_dict(part, state_dict=state_dict)
        type(self.pipe).save_lora_weights(
            lora_folder(directory, name), transformer_lora_layers={k: v.detach().contiguous() for k, v in lora.items()},
            weight_name=LORA_WEIGHT_NAME, safe_serialization=True,
            transformer_lora_adapter_metadata=part.peft_config["default"].to_dict(),
        )

    def load_trainable(self, directory: Path) -> None:
        """Load weights written by :meth:`save_trainable` into :attr:`transformer`, in place."""
        for name, part, _ in self._split_trained(self.transformer, None):
            if self.is_lora:
                self._load_lora(lora_folder(Path(directory), name) / LORA_WEIGHT_NAME, part)
            else:
                load_full(Path(directory) / name, part)

    def _load_lora(self, file: Path, part: nn.Module) -> None:
        from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        prefix = f"{type(self.pipe).transformer_name}."
        _check_lora_config(file, prefix, part.peft_config["default"])
        state = {k.removeprefix(prefix): v for k, v in load_file(file).items() if k.startswith(prefix)}
        targets = get_peft_model_state_dict(part)
        if set(state) != set(targets):
            missing, extra = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
            raise ValueError(f"LoRA weights in {file} do not match this adapter (rank/targets?): "
                             f"missing {missing[:3]}, unexpected {extra[:3]}")
        # into LoRA weights FSDP2 has sharded, each process's own part (PEFT 0.18 copies the whole tensors, and fails)
        set_peft_model_state_dict(part, {k: placed_like(v, targets[k]) for k, v in state.items()})


def _check_lora_targets(transformer: nn.Module, targets: list[str]) -> None:
    """ConfigError naming ``model.lora_targets`` when it is empty or one of its entries matches no module name of
    ``transformer`` as PEFT matches a list (the whole name, or its end after a dot): PEFT stops only when none
    matches, so an entry of another model family (FLUX's ``proj_mlp`` on SD3, ``ff.net.0.proj`` on Wan, whose FFN
    is ``ffn``) beside valid ones would silently train fewer layers. The message lists the transformer's linear
    layers by their name inside a block."""
    names = [name for name, _ in transformer.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if targets and not missing:
        return
    linear = sorted({re.sub(r"^.*?\.\d+\.", "", n) for n, m in transformer.named_modules() if isinstance(m, nn.Linear)})
    what = f"no module is named {', '.join(map(repr, missing))}" if missing else "it is empty"
    raise ConfigError(f"bad value for 'model.lora_targets': {what} in {type(transformer).__name__}; its linear "
                      f"layers are {', '.join(linear)}")


def _check_lora_config(file: Path, prefix: str, config: Any) -> None:
    """A ValueError unless the rank and alpha that ``file``'s adapter metadata (``prefix`` + ``r`` / ``lora_alpha``,
    as diffusers' ``save_lora_weights`` writes it) records equal those of the PEFT ``config`` it loads into: the
    same weights under another alpha are another model. A file without that metadata is not checked."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        raw = (f.metadata() or {}).get("lora_adapter_metadata")
    saved = json.loads(raw) if raw else {}
    for key, name in (("r", "lora_rank"), ("lora_alpha", "lora_alpha")):
        value = saved.get(prefix + key)
        if value is not None and value != getattr(config, key):
            raise ValueError(f"LoRA weights in {file} were trained with {name} {value}, but 'model.{name}' is "
                             f"{getattr(config, key)}")


def lora_folder(directory: Path, part: str) -> Path:
    """Folder of a trained part's LoRA file (``pytorch_lora_weights.safetensors``): ``directory`` for
    ``transformer``, what ``pipe.load_lora_weights(directory)`` reads; ``directory/<part>`` for another (Wan2.2's
    ``transformer_2``), out of the way of diffusers' guess of the file when only that part is trained, which would
    load it into ``transformer``."""
    return directory if part == "transformer" else directory / part


def load_full(folder: Path, part: nn.Module) -> None:
    """Copy the weights of a ``save_pretrained`` folder of ``part`` (one safetensors file, or shards listed in an
    index) into ``part``, in place, one shard at a time: host memory grows by a shard, not by a second model (a
    12B transformer in fp32 is 48 GB). Into parameters FSDP2 has sharded (DTensors), each process copies its own
    part of each tensor (:func:`~mmgrpo.checkpoint.placed_like`). Missing, extra or differently shaped (whole)
    weights are one ValueError naming the folder."""
    from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import load_file

    targets = part.state_dict()  # a DTensor's shape is the whole tensor's
    seen: set[str] = set()
    for file in safetensors_files(folder, SAFETENSORS_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME):
        shard = load_file(file)
        wrong = sorted(k for k, v in shard.items() if k not in targets or v.shape != targets[k].shape)
        if wrong:
            raise ValueError(f"weights in {file} do not fit this {type(part).__name__}: {wrong[:3]}")
        part.load_state_dict({k: placed_like(v, targets[k]) for k, v in shard.items()}, strict=False)
        seen |= set(shard)
        del shard
    if missing := sorted(set(targets) - seen):
        raise ValueError(f"weights in {folder} miss {len(missing)} of this {type(part).__name__}'s: {missing[:3]}")


def _stock_class(module: nn.Module) -> type[nn.Module]:
    """``module``'s own class: FSDP2's ``fully_shard`` swaps in a subclass of its own (``FSDP<name>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _save_full(folder: Path, part: nn.Module, state_dict: dict[str, Tensor] | None) -> None:
    """A ``from_pretrained`` folder of ``part``; from ``state_dict`` (gathered weights) when given. The config
    names ``part``'s own class (:func:`_stock_class`), which diffusers' loaders look up, even when FSDP2 shards it."""
    if state_dict is None:
        part.save_pretrained(folder, safe_serialization=True)
        return
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    part.save_config(folder)  # what save_pretrained writes: config + one safetensors shard
    config = folder / part.config_name
    config.write_text(json.dumps({**json.loads(config.read_text()), "_class_name": _stock_class(part).__name__},
                                 indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().contiguous() for k, v in state_dict.items()}, folder / SAFETENSORS_WEIGHTS_NAME,
              metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------------------------
# SD3 / SD3.5
# ----------------------------------------------------------------------------------------------------------------


class _ImageAdapter(FlowAdapter):
    """Shared by SD3 and FLUX: an ``AutoencoderKL`` with ``scaling_factor`` and ``shift_factor``."""

    def _vae_latents(self, latents: Tensor) -> Tensor:
        config = self.pipe.vae.config
        return latents / config.scaling_factor + (config.shift_factor or 0.0)


@MODEL_ADAPTERS.register("sd3", modality="image")
class SD3Adapter(_ImageAdapter):
    """Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): latents (n, 16, H/8, W/8); CLIP-L + CLIP-G + T5."""

    kind = "sd3"
    modality = "image"
    pipeline_class = "StableDiffusion3Pipeline"
    default_max_sequence_length = 256
    t5_tokenizer = "tokenizer_3"

    def _encode_one(self, prompt: str) -> dict[str, Tensor]:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=[prompt], prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def latent_shape(self, n: int, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        scale = self.pipe.vae_scale_factor
        self._check_size(height, width, scale * self.pipe.transformer.config.patch_size)
        return (n, self.pipe.transformer.config.in_channels, height // scale, width // scale)

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int) -> None:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            patch, scale = self.pipe.transformer.config.patch_size, self.pipe.vae_scale_factor
            seq_len = (height // scale // patch) * (width // scale // patch)
            c = scheduler.config
            kwargs["mu"] = calculate_shift(seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                           c.get("base_shift", 0.5), c.get("max_shift", 1.16))
        retrieve_timesteps(scheduler, num_steps, "cpu", **kwargs)

    def _forward(self, model: nn.Module, x: Tensor, timestep: Tensor, embeds: dict[str, Tensor],
                 guidance_scale: float) -> Tensor:
        return model(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds["encoder_hidden_states"],
                     pooled_projections=embeds["pooled_projections"], return_dict=False)[0]



# ----------------------------------------------------------------------------------------------------------------
# FLUX.1
# ----------------------------------------------------------------------------------------------------------------


@MODEL_ADAPTERS.register("flux", modality="image")
class FluxAdapter(_ImageAdapter):
    """FLUX.1 (``FluxPipeline``): packed latents (n, H/16 * W/16, 64); CLIP-L (pooled) + T5.

    FLUX.1-dev (``guidance_embeds``) is guidance-distilled: ``guidance_scale`` goes into the guidance embedding and
    there is one forward per step. A FLUX model without a guidance embedding gets true CFG when the scale is > 1."""

    kind = "flux"
    modality = "image"
    pipeline_class = "FluxPipeline"
    default_max_sequence_length = 512
    t5_tokenizer = "tokenizer_2"

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.pipe.transformer.config.guidance_embeds)

    def uses_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1.0 and not self.guidance_embeds

    def _encode_one(self, prompt: str) -> dict[str, Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=[prompt], prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length,
        )
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def latent_shape(self, n: int, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        scale = self.pipe.vae_scale_factor
        self._check_size(height, width, 2 * scale)
        return (n, self.pipe.transformer.config.in_channels // 4, height // scale, width // scale)

    def initial_latents(self, n: int, height: int, width: int, num_frames: int,
                        generator: torch.Generator | None) -> Tensor:
        noise = super().initial_latents(n, height, width, num_frames, generator)
        _, channels, h, w = noise.shape
        self._latent_grids[(h // 2) * (w // 2)] = (h, w)
        return self.pipe._pack_latents(noise, n, channels, h, w)

    def _grid(self, seq_len: int) -> tuple[int, int]:
        """Unpacked latent (h, w) of a packed sequence: the size seen by initial_latents/sigmas, else square."""
        if seq_len in self._latent_grids:
            return self._latent_grids[seq_len]
        side = round(seq_len**0.5)
        if side * side != seq_len:
            raise ValueError(f"cannot tell the image size of {seq_len} packed FLUX tokens: call initial_latents "
                             "or sigmas with the height and width first")
        return 2 * side, 2 * side

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int) -> None:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        scale = self.pipe.vae_scale_factor
        h, w = 2 * (height // (2 * scale)), 2 * (width // (2 * scale))
        self._latent_grids[(h // 2) * (w // 2)] = (h, w)
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps,
                                                                                         num_steps)
        c = scheduler.config
        mu = calculate_shift((h // 2) * (w // 2), c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)

    def timestep(self, sigma: Tensor) -> Tensor:
        """FLUX's pipeline passes ``timestep / 1000`` and the transformer multiplies by 1000 itself: so sigma."""
        return sigma

    def _forward(self, model: nn.Module, x: Tensor, timestep: Tensor, embeds: dict[str, Tensor],
                 guidance_scale: float) -> Tensor:
        n, seq_len, _ = x.shape
        h, w = self._grid(seq_len)
        text = embeds["encoder_hidden_states"]
        img_ids = self.pipe._prepare_latent_image_ids(n, h // 2, w // 2, x.device, text.dtype)
        txt_ids = torch.zeros(text.shape[1], 3, device=x.device, dtype=text.dtype)
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((n,), float(guidance_scale), device=x.device, dtype=torch.float32)
        return model(hidden_states=x, timestep=timestep, guidance=guidance, encoder_hidden_states=text,
                     pooled_projections=embeds["pooled_projections"], txt_ids=txt_ids, img_ids=img_ids,
                     return_dict=False)[0]

    def _vae_latents(self, latents: Tensor) -> Tensor:
        h, w = self._grid(latents.shape[1])
        scale = self.pipe.vae_scale_factor
        unpacked = self.pipe._unpack_latents(latents, h * scale, w * scale, scale)
        return super()._vae_latents(unpacked)


# ----------------------------------------------------------------------------------------------------------------
# Wan2.1 / Wan2.2 text-to-video
# ----------------------------------------------------------------------------------------------------------------


TRAIN_EXPERTS = {"both": ("transformer", "transformer_2"), "high": ("transformer",), "low": ("transformer_2",)}
"""``WanAdapter(train_experts=...)``: which of Wan2.2 A14B's experts train (the high-noise one is ``transformer``)."""


def _sub_state(state_dict: dict[str, Tensor] | None, prefix: str) -> dict[str, Tensor] | None:
    """The entries of ``state_dict`` under ``prefix.``, with the prefix removed (None stays None)."""
    if state_dict is None:
        return None
    return {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}


class WanExperts(nn.Module):
    """Wan2.2 A14B's two experts as one module, switching per row exactly as ``WanPipeline`` switches per step.

    A row whose timestep t (the pipeline's [0, 1000] scale) is >= ``boundary`` (``boundary_ratio *
    num_train_timesteps``) goes through ``transformer``, the high-noise expert; any other row through
    ``transformer_2``. A batch whose rows all lie on one side runs that expert alone (every rollout step). A mixed
    batch (per-row timesteps, as a DanceGRPO replay has) runs BOTH experts on the whole batch and keeps each row
    from its own expert, so each row comes out of a forward of the same batch size and position as in the rollout
    (bitwise exact replays, at twice the cost). Each expert gets its inputs in its own dtype.

    Under grad, the trainable parameters of an expert that did not run join the output times 0: every trained
    weight is in every graph (as DDP without ``find_unused_parameters`` needs; a step that only a frozen expert
    ran still back-propagates), with a zero gradient. Under sharded weights see :attr:`synced`."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary: float):
        super().__init__()
        self.transformer, self.transformer_2, self.boundary = transformer, transformer_2, boundary
        self._no_split_modules = sorted({name for t in (transformer, transformer_2)
                                         for name in getattr(t, "_no_split_modules", None) or []})
        """The experts' block classes, which FSDP's transformer-based wrapping shards one by one (it reads the
        root module's list)."""
        self.synced: Callable[[bool], bool] | None = None
        """Set under sharded weights (FSDP, ZeRO-3), where every process must run the same experts: called with
        whether this process's rows need an expert, it returns whether any process's do, and an expert any
        process needs runs everywhere (its rows taken from the other where this process needs none). The
        zero-gradient join of idle experts, which only DDP needs, is then left out."""

    def high_noise(self, timestep: Tensor) -> Tensor:
        """(n,) bool: the rows of ``timestep`` ((n,), or per token (n, L) with the row's t as maximum) that
        ``transformer`` handles."""
        return timestep.reshape(timestep.shape[0], -1).amax(dim=1) >= self.boundary

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                return_dict: bool = False) -> tuple[Tensor]:
        """The experts' prediction (n, C, F, H, W), as a 1-tuple (what an expert returns with
        ``return_dict=False``, the only form asked for)."""
        high = self.high_noise(timestep)
        pairs = ((self.transformer, high), (self.transformer_2, ~high))
        needed = [bool(rows.any()) for _, rows in pairs]
        if self.synced is not None:
            needed = [self.synced(need) for need in needed]
        ran = [expert for (expert, _), need in zip(pairs, needed) if need]
        outs = [expert(hidden_states=hidden_states.to(expert.dtype), timestep=timestep,
                       encoder_hidden_states=encoder_hidden_states.to(expert.dtype), return_dict=False)[0]
                for expert in ran]
        out = outs[0] if len(outs) == 1 else torch.where(high.view(-1, *[1] * (outs[0].ndim - 1)), *outs)
        idle = [p for expert, _ in pairs if all(expert is not r for r in ran)
                for p in expert.parameters() if p.requires_grad]
        if idle and torch.is_grad_enabled() and self.synced is None:
            out = out + 0.0 * sum(p.sum() for p in idle)
        return (out,)


@MODEL_ADAPTERS.register("wan", modality="video")
class WanAdapter(FlowAdapter):
    """Wan2.1 / Wan2.2 text-to-video (``WanPipeline``): latents (n, C, (F - 1)/4 + 1, H/s, W/s); UMT5 encoder.

    C and s come from the checkpoint: 16 channels at 8x (Wan2.1, Wan2.2 A14B), 48 at 16x (Wan2.2 TI2V-5B's VAE).

    - Wan2.2 A14B (``transformer_2`` and ``boundary_ratio`` in the pipeline config): :attr:`transformer` is a
      :class:`WanExperts` of both experts; ``guidance_scale`` applies to the high-noise expert's steps and
      ``model.guidance_scale_2`` (None: ``guidance_scale``, the pipeline's default) to the low-noise expert's,
      chosen per row as the expert is. A ``transformer_2`` without ``boundary_ratio`` is unused, as in the pipeline.
    - Wan2.2 TI2V-5B (``expand_timesteps``): every patch token gets its row's timestep, (n, tokens), as the
      pipeline builds it for text-to-video (an all-ones mask).

    The stock pipeline's UniPC scheduler passes integer timesteps; here the transformer gets the exact
    ``sigma * 1000`` of the sigma the step kernel uses, and the expert is chosen on that value (the same expert
    as the pipeline's whenever the boundary is a whole number, as 0.875 * 1000 is).

    Args (beyond :class:`FlowAdapter`'s):
        train_experts: with two experts, which train (a key of :data:`TRAIN_EXPERTS`): "both", "high"
            (``transformer``) or "low" (``transformer_2``); the other keeps its base weights and takes no
            LoRA. None takes ``model.train_experts``.
    """

    kind = "wan"
    modality = "video"
    pipeline_class = "WanPipeline"
    default_max_sequence_length = 512

    def __init__(self, cfg: FlowModelConfig, device: torch.device | str = "cpu", keep_reference: bool = False,
                 prompt_cache_size: int = 256, train_experts: str | None = None):
        train_experts = cfg.train_experts if train_experts is None else train_experts
        if train_experts not in TRAIN_EXPERTS:
            raise ConfigError(f"bad value '{train_experts}' for 'model.train_experts': expected one of "
                              f"{', '.join(TRAIN_EXPERTS)}")
        self.train_experts = train_experts
        super().__init__(cfg, device, keep_reference, prompt_cache_size)

    def _transformer_parts(self) -> dict[str, nn.Module]:
        """``transformer``, plus ``transformer_2`` when the pipeline config sets ``boundary_ratio``."""
        if self.pipe.transformer is None:
            raise ConfigError(f"bad value for 'model.path': '{self.cfg.path}' has no transformer (mmgrpo needs the "
                              "high-noise expert)")
        parts = {"transformer": self.pipe.transformer}
        if self.pipe.config.get("boundary_ratio") is None:
            return parts
        if getattr(self.pipe, "transformer_2", None) is None:
            raise ConfigError(f"bad value for 'model.path': '{self.cfg.path}' sets boundary_ratio but has no "
                              "transformer_2")
        return {**parts, "transformer_2": self.pipe.transformer_2}

    def _trained_names(self, parts: dict[str, nn.Module]) -> tuple[str, ...]:
        names = tuple(n for n in TRAIN_EXPERTS[self.train_experts] if n in parts)
        if not names:
            raise ValueError(f"train_experts='{self.train_experts}': '{self.cfg.path}' has a single transformer")
        return names

    def _assemble(self, parts: dict[str, nn.Module]) -> nn.Module:
        if "transformer_2" not in parts:
            return parts["transformer"]
        boundary = self.pipe.config.boundary_ratio * self.pipe.scheduler.config.num_train_timesteps
        return WanExperts(parts["transformer"], parts["transformer_2"], boundary)

    def guided(self, v_cond: Tensor, v_uncond: Tensor, sigma: Tensor, guidance_scale: float) -> Tensor:
        scale_2 = self.cfg.guidance_scale_2
        if scale_2 is None:
            return guide(v_cond, v_uncond, guidance_scale)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=v_cond.device).reshape(-1).expand(len(v_cond))
        high = self.transformer.high_noise(self.timestep(sigma))
        scale = torch.where(high, guidance_scale, scale_2).view(-1, *[1] * (v_cond.dim() - 1))
        return guide(v_cond, v_uncond, scale)

    def _split_trained(self, model: nn.Module, state_dict: dict[str, Tensor] | None
                       ) -> list[tuple[str, nn.Module, dict[str, Tensor] | None]]:
        if not isinstance(model, WanExperts):
            return super()._split_trained(model, state_dict)
        return [(name, getattr(model, name), _sub_state(state_dict, name)) for name in self.trained_parts]

    def _encode_one(self, prompt: str) -> dict[str, Tensor]:
        embeds, _ = self.pipe.encode_prompt(prompt=[prompt], do_classifier_free_guidance=False, device=self.device,
                                            max_sequence_length=self.max_sequence_length)
        return {"encoder_hidden_states": embeds}

    def latent_shape(self, n: int, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        spatial, temporal = self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        self._check_size(height, width, spatial * self.pipe.transformer.config.patch_size[1])
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ConfigError(f"bad value for 'sampling.num_frames': {num_frames} (must be 1 + a multiple of "
                              f"{temporal} for wan)")
        channels = self.pipe.transformer.config.in_channels
        return (n, channels, (num_frames - 1) // temporal + 1, height // spatial, width // spatial)

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int) -> None:
        scheduler.set_timesteps(num_steps, device="cpu")

    def _token_timesteps(self, x: Tensor, timestep: Tensor) -> Tensor:
        """TI2V's per-token timesteps (n, F'/p_t * H'/p_h * W'/p_w) for latents x (n, C, F', H', W'): each row's
        timestep (n,) on every patch token (WanPipeline's ``mask * t`` with the all-ones text-to-video mask)."""
        p_t, p_h, p_w = self.pipe.transformer.config.patch_size
        tokens = (x.shape[2] // p_t) * (x.shape[3] // p_h) * (x.shape[4] // p_w)
        return timestep[:, None].expand(-1, tokens)

    def _forward(self, model: nn.Module, x: Tensor, timestep: Tensor, embeds: dict[str, Tensor],
                 guidance_scale: float) -> Tensor:
        if self.pipe.config.get("expand_timesteps", False):
            timestep = self._token_timesteps(x, timestep)
        return model(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds["encoder_hidden_states"],
                     return_dict=False)[0]

    def _vae_latents(self, latents: Tensor) -> Tensor:
        config = self.pipe.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, dtype=latents.dtype, device=latents.device).view(shape)
        std = torch.tensor(config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
        return latents * std + mean


# ----------------------------------------------------------------------------------------------------------------
# Building from a config
# ----------------------------------------------------------------------------------------------------------------


def adapter_class(name: str) -> type[FlowAdapter]:
    """The :class:`FlowAdapter` subclass ``model.type`` names: a registered flow type (sd3, flux, wan) or a
    ``module:Class`` import path. Anything else, an unknown name or a non-flow entry of ``MODEL_ADAPTERS`` (the
    VLM's ``qwen2_vl``), is a one-line ConfigError naming ``model.type`` and the flow types."""
    flow_types = [e.name for e in MODEL_ADAPTERS if _is_flow_adapter(e.obj)]
    known = f"(flow types: {', '.join(flow_types)}, or a module:Class path to a FlowAdapter subclass)"
    if ":" not in name and name not in MODEL_ADAPTERS:
        close = difflib.get_close_matches(name, flow_types, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"bad value for 'model.type': unknown flow model type '{name}'{hint} {known}")
    try:
        cls = MODEL_ADAPTERS.get(name)
    except RegistryError as err:  # an import path that does not resolve: the registry's message says why
        raise ConfigError(f"bad value for 'model.type': {err}") from err
    if not _is_flow_adapter(cls):
        raise ConfigError(f"bad value for 'model.type': '{name}' is not a flow model adapter {known}")
    return cls


def _is_flow_adapter(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, FlowAdapter)


def load_adapter(cfg: FlowModelConfig, device: torch.device | str = "cpu", keep_reference: bool = False,
                 **kwargs: Any) -> FlowAdapter:
    """The adapter of ``cfg.type`` (see :func:`adapter_class`), built from ``cfg``. ``kwargs`` go to the adapter
    (e.g. ``prompt_cache_size``)."""
    return adapter_class(cfg.type)(cfg, device, keep_reference=keep_reference, **kwargs)
