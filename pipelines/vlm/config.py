"""Config schema of the VLM / video reasoning pipeline (``pipeline: vlm``). Every field is documented here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmgrpo.config import BaseConfig, ranged


@dataclass
class VLMModelConfig:
    """Which vision-language model, how it is loaded and what is trained."""

    path: str = "???"
    """Hub id (e.g. Qwen/Qwen2.5-VL-7B-Instruct) or local transformers folder. ``tiny:qwen2_vl``,
    ``tiny:qwen2_5_vl`` and ``tiny:qwen3_vl`` build a tiny random model once, save it in the real format under
    ~/.cache/mmgrpo/tiny, and load it from there through the same from_pretrained path. A PEFT adapter (a folder or hub id with
    adapter_config.json, e.g. a LoRA SFT, or the ``policy`` folder of an mmgrpo LoRA checkpoint) loads as its base
    model with the adapter merged in: training starts from it, and it is the reference for the KL (full fine-tuning
    only: a new LoRA's checkpoints would name the base without the merged adapter)."""
    revision: str | None = None
    """Hub revision for ``path``."""
    dtype: str = "float32"
    """Weights dtype: float32, bfloat16 or float16. Log-prob math runs in fp32."""
    lora_rank: int = ranged(0, low=0)
    """LoRA rank on the language model; 0 trains the full model."""
    lora_alpha: int = ranged(32, low=0, low_open=True)
    """LoRA alpha."""
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module-name suffixes that get LoRA adapters (language model only)."""
    freeze_vision: bool = True
    """Keep the vision tower (and its merger) frozen."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: sdpa, eager, flash_attention_2 (falls back to sdpa without CUDA and flash-attn),
    or any other kernel transformers registers (flash_attention_3, flex_attention, ...; not with prefix_grouper,
    which needs sdpa or eager)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""


@dataclass
class VLMDataConfig:
    """Where questions, images and videos come from."""

    train_file: str = "???"
    """JSON or JSONL in the Video-R1 format (problem, problem_type, options, solution, path, data_type) or the
    EasyR1 format (problem, answer, images, videos); or ``task:NAME[,NAME...]``, registered synthetic QA tasks
    (``shapes_qa``, ``motion_qa``) whose train split is generated once into ``task_cache`` (``root`` unused)."""
    eval_file: str | None = None
    """Held-out file in the same formats, or ``task:NAME[,NAME...]`` (the tasks' held-out split, items 0 on, enough
    per kind for ``num_eval``); None holds out the last ``num_eval`` training samples."""
    task_items: int = ranged(1000, low=1)
    """Items per kind of each task in a ``task:`` train_file."""
    task_start: int = ranged(0, low=0)
    """Index of the first item of a ``task:`` train_file (item i of a kind is drawn from seed 2i). Start after the
    items a model was fine-tuned on to train on unseen ones: the shipped tiny VLM's SFT used items 0-1499."""
    task_cache: str = "~/.cache/mmgrpo/tasks"
    """Folder that generated ``task:`` splits are written to once and reused from (one subfolder per tasks, split,
    range and generator version)."""
    root: str = "."
    """Folder that image and video paths are relative to."""
    num_eval: int = ranged(32, low=1)
    """Held-out samples for evaluation when ``eval_file`` is None, and the cap on the held-out set in any case:
    in-loop evaluation, ``mmgrpo eval`` and ``mmgrpo sample`` (without ``--prompt``) use its first this many."""
    prompt_template: str = ("{question}{options}\nThink about the question step by step inside <think> </think> "
                            "tags, then give only the final answer inside <answer> </answer> tags.{type_instruction}")
    """Prompt text; ``{question}`` is the problem, ``{options}`` the newline-joined options (or empty) and
    ``{type_instruction}`` the sample's entry of ``type_instructions`` (or empty), inserted where the placeholder
    stands, never appended. ``<image>``/``<video>`` markers in the rendered text place the media (docs/vlm.md)."""
    type_instructions: dict[str, str] = field(default_factory=dict)
    """Problem type (``multiple choice``, ``numerical``, ``OCR``, ``free-form``, ``regression``, ``temporal
    grounding``) -> the text put at ``{type_instruction}`` for samples of that type, as given (include a leading
    space or line break), e.g. how to write the answer. Empty by default; samples without a type, or of a type not
    listed, get nothing."""
    on_bad_media: str = "skip"
    """A missing or corrupt image/video: skip (count it and warn) or error (stop the run)."""
    prompt_cache_mb: float = ranged(1024.0, low=0.0)
    """Encoded prompts (processor outputs, on the model's device, and decoded media, in CPU memory; a medium
    shown by several prompts counts once) kept across rollouts, per process, the least recently used dropped beyond
    this many MB; 0 encodes every draw afresh. A run draws each prompt many times, and the same
    encoding comes back (decoding and the processor are deterministic), so this only saves time: about a tenth of
    a tiny model's step on CPU."""
    max_prompt_tokens: int = ranged(4096, low=1)
    """Prompts longer than this (text plus vision tokens) are skipped with a warning, or stop the run when
    on_bad_media is error."""
    media_types: list[str] = field(default_factory=lambda: ["image", "video", "text"])
    """Keep only the samples of these kinds, in the train and held-out files: ``video`` (has a video), ``image``
    (images only) or ``text`` (no media)."""


@dataclass
class VLMVideoConfig:
    """Video decoding (Qwen2-VL conventions): frames sampled at ``fps``, clamped, rounded, and resized."""

    backend: str = "auto"
    """decord, pyav, or auto (decord, falling back to PyAV)."""
    fps: float = ranged(2.0, low=0, low_open=True)
    """Frames sampled per second of video."""
    min_frames: int = 4
    """Fewest frames per video."""
    max_frames: int = 16
    """Most frames per video."""
    frame_multiple: int = ranged(2, low=1)
    """The frame count is rounded to a multiple of this; a multiple of the model's temporal patch (the Qwen2-VL
    family merges 2 frames into one)."""
    max_pixels: int = 128
    """Per-frame pixel budget in units of 28x28 pixels (128 -> 128*28*28 pixels)."""
    min_pixels: int = ranged(4, low=1)
    """Per-frame pixel floor in units of 28x28 pixels."""
    image_max_pixels: int = 256
    """Per-image pixel budget in units of 28x28 pixels."""
    image_min_pixels: int | None = None
    """Per-image pixel floor in units of 28x28 pixels; None uses ``min_pixels``. Raising it upscales small images,
    so the vision tower sees them through more patches (4 -> 16 merged tokens for a 64x64 image at 16)."""
    size_factor: int = ranged(28, low=1)
    """Frame and image sides are resized to multiples of this many pixels: the vision patch times the spatial merge
    (28 = 14 x 2 for Qwen2-VL and Qwen2.5-VL, 32 = 16 x 2 for Qwen3-VL). The budgets above stay in 28x28 units."""


@dataclass
class VLMGenerationConfig:
    """How completions are sampled."""

    max_new_tokens: int = ranged(256, low=1)
    """Token limit per completion; completions that hit it are flagged as truncated."""
    temperature: float = ranged(1.0, low=0)
    """Sampling temperature of rollouts. Training scores the samples at the same temperature (policy, old and
    reference log-probs all use ``logits / temperature``, as TRL does), so the ratio and KL are those of the
    distribution sampled from. top_k and top_p truncate sampling only."""
    top_p: float = ranged(1.0, low=0, high=1, low_open=True)
    """Nucleus sampling threshold (1 disables)."""
    top_k: int = ranged(0, low=0)
    """Top-k sampling (0 disables)."""
    backend: str = "hf"
    """hf (transformers, prefill shared across the group) or vllm (the ``vllm`` extra, CUDA, vLLM >= 0.11): training
    rollouts sample through a vLLM engine colocated in each process (``pipelines/vlm/vllm_backend.py``); old
    log-probs still come from the training forward, and eval / sample keep the transformers path."""
    # --- vLLM rollout backend options (used only with backend: vllm; docs/vlm.md, "vLLM rollout backend") ---
    vllm_gpu_memory_utilization: float = ranged(0.3, low=0, high=1, low_open=True)
    """Fraction of each GPU the colocated engine may take (its weight copy, KV cache, activations and CUDA graphs);
    the trainer's weights, gradients, optimiser state and activations must fit in the rest."""
    vllm_max_model_len: int = ranged(0, low=0)
    """Longest sequence (prompt + completion) the engine holds; 0 uses data.max_prompt_tokens + max_new_tokens."""
    vllm_sleep: bool = False
    """Between rollouts, offload the engine's weights to CPU memory and free its KV cache (vLLM sleep level 1),
    leaving that GPU memory to training; costs a copy back at every rollout."""
    vllm_check_logprobs: bool = True
    """Ask vLLM for the sampled tokens' log-probs, which the trainer compares with the training forward's
    (``logp/rollout_vs_recompute_max_dev``), when the scoring temperature is 1 (vLLM reports raw-logit log-probs);
    training never uses them."""
    vllm_engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of ``vllm.LLM``, overriding ours (e.g. ``enforce_eager: true``, ``max_num_seqs``);
    ``mm_processor_kwargs`` given here are merged into ours (the pixel bounds that keep decoded media unresized)."""
    # --- end of vLLM options ---
    mask_truncated: bool = True
    """Leave truncated completions out of the loss."""
    eval_temperature: float = ranged(0.0, low=0)
    """Sampling temperature of ``eval`` and ``sample``; 0 decodes greedily. ``sample --per-prompt K`` (K > 1)
    needs it above 0 (K greedy completions would be equal); above 0, the completions of ``--per-prompt`` or
    ``--sample-seed`` each draw from a seed of their own, recorded in the samples' ``index.json``."""
    batch_rows: int = ranged(0, low=0)
    """Decode the groups of several prompts together, up to this many rows (a group is never split; evaluation
    groups are one row); 0 decodes one prompt's group at a time. It cuts the model calls per token, a large
    speed-up where a call costs more than its rows (small models, CPU). Each group holds one copy of its prompt's
    KV cache, left-padded to the longest prompt of the batch, plus its samples' tokens, so memory grows with
    prompts x (the longest prompt + G x ``max_new_tokens``) (rows x (the longest prompt + ``max_new_tokens``)
    for models that repeat the cache per row: sliding-window layers, flash_attention_2)."""
    gather_sharded_weights: bool = True
    """Under FSDP2, gather the whole weights once per rollout (and evaluation) and keep them through every token's
    forward (``pipelines/vlm/whole_weights.py``), instead of gathering each module's shards at every forward: one
    gather per rollout instead of one per token, no decoding in step, for one whole copy of the weights in each
    process while sampling. False keeps the weights sharded and decodes in step, for a model whose whole weights do
    not fit beside its optimiser state and gradients. DDP, ZeRO-2 and ZeRO-3 ignore it (ZeRO-3 gathers at every
    forward)."""


@dataclass
class TGRPOConfig:
    """T-GRPO temporal contrast (Video-R1)."""

    enabled: bool = False
    """Also roll out each video prompt on shuffled frames and add the temporal bonus."""
    alpha: float = ranged(0.3, low=0)
    """Bonus added to each correct ordered-frame rollout when the group passes the test."""
    mu: float = ranged(0.8, low=0)
    """The group passes when ordered accuracy >= mu * shuffled accuracy."""
    shuffled_group_size: int = ranged(0, low=0)
    """Shuffled-frame rollouts per prompt; 0 uses train.group_size."""


@dataclass
class CAREConfig:
    """GRPO-CARE consistency bonus (arXiv:2506.16141): an EMA reference judges whether each answer follows from its
    reasoning (``pipelines/vlm/care.py``); pair it with the ``consistency_bonus`` reward and ``grpo.kl_beta: 0``."""

    enabled: bool = False
    """Score every rollout's answer likelihood under the EMA reference (needs one ``consistency_bonus`` reward)."""
    ema_decay: float = ranged(0.995, low=0, high=1, high_open=True)
    """Reference update ``ref = decay * ref + (1 - decay) * policy`` of the trainable weights (GRPO-CARE: 0.995).
    The reference starts as the initial policy and holds one fp32 copy of the trainable weights (the adapter only,
    with LoRA)."""
    update_every: int = ranged(10, low=1)
    """Optimiser steps between reference updates (GRPO-CARE: 10)."""
    offload: bool = False
    """Keep the reference in CPU memory instead of beside the model: no accelerator memory for it (4 bytes per
    trainable parameter, plus the raw weights while the reference scores a rollout), for about three copies of
    the trainable weights between devices per step. For full fine-tuning of 7B-class models."""


@dataclass
class VLMConfig(BaseConfig):
    """``pipeline: vlm``: GRPO for vision-language reasoning on images and videos."""

    pipeline: str = "vlm"
    model: VLMModelConfig = field(default_factory=VLMModelConfig)
    data: VLMDataConfig = field(default_factory=VLMDataConfig)
    video: VLMVideoConfig = field(default_factory=VLMVideoConfig)
    generation: VLMGenerationConfig = field(default_factory=VLMGenerationConfig)
    tgrpo: TGRPOConfig = field(default_factory=TGRPOConfig)
    care: CAREConfig = field(default_factory=CAREConfig)
    prefix_grouper: bool = True
    """Training forward encodes each group's shared prompt (text + vision tokens) once (Prefix Grouper)."""

    def validate(self) -> None:
        """Value checks run when the config is loaded, before any model or data is read; whether the rollout
        backend can run on this machine is checked when the policy is built."""
        from .policy import check_config

        check_config(self, runnable_here=False)
