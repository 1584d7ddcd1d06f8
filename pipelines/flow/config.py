"""Config schema of the flow/diffusion pipeline (``pipeline: flow``). Every field is documented where it is
defined."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mmgrpo.config import BaseConfig, ConfigError, cwd_hint, ranged

DTYPES = ("float32", "bfloat16", "float16")
TINY_KINDS = ("sd3", "flux", "wan")


@dataclass
class FlowModelConfig:
    """Which generator, how it is loaded and what is trained."""

    type: str = "sd3"
    """Flow model adapter (registry ``MODEL_ADAPTERS``): sd3 (SD3/SD3.5), flux (FLUX.1) or wan (Wan2.1/2.2 T2V),
    or a ``module:Class`` path to a ``FlowAdapter`` subclass. The registry's VLM entry (qwen2_vl) is an error."""
    path: str = "???"
    """Hub id (e.g. stabilityai/stable-diffusion-3.5-medium) or local diffusers pipeline folder. ``tiny:sd3``,
    ``tiny:flux`` and ``tiny:wan`` build a 2-layer random pipeline once, save it in the real format under
    ~/.cache/mmgrpo/tiny, and load it from there through the same from_pretrained path."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for ``path``."""
    dtype: str = "float32"
    """Weights dtype of the frozen parts (VAE, text encoders, base transformer): float32, bfloat16 or float16.
    Step and log-prob math always runs in fp32."""
    lora_rank: int = ranged(32, low=0)
    """LoRA rank on the transformer; 0 trains the full transformer."""
    lora_alpha: int = ranged(64, low=0, low_open=True)
    """LoRA alpha (the adapter output is scaled by alpha / rank)."""
    lora_targets: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module-name suffixes that get LoRA adapters."""
    max_sequence_length: int | None = ranged(None, low=1)
    """T5/UMT5 tokens per prompt; None keeps the pipeline's default (SD3 256, FLUX and Wan 512), and at most the
    tokenizer's ``model_max_length`` (512 for the published checkpoints). Shorter is cheaper: the tiny presets use
    10, enough for every ShapesT2I prompt."""
    train_experts: str = "both"
    """Wan2.2 A14B (two experts): which train, both, high (``transformer``, the high-noise expert) or low
    (``transformer_2``); the other keeps its base weights. Ignored by single-transformer models."""
    guidance_scale_2: float | None = ranged(None, low=0)
    """Wan2.2 A14B (two experts): the CFG scale of the steps the low-noise expert (``transformer_2``) runs, as
    ``WanPipeline(guidance_scale_2=...)``; ``sampling.guidance_scale`` is the high-noise expert's. None uses
    ``sampling.guidance_scale`` for both (the pipeline's default). As in the pipeline, ``sampling.guidance_scale``
    alone decides whether CFG runs: at <= 1 neither expert runs an unconditional forward, and this value is
    unused. An error for any other model."""
    gradient_checkpointing: bool = False
    """Recompute transformer activations in backward to save memory."""
    attention_backend: str = "auto"
    """diffusers attention backend: auto (flash where available, else SDPA), native (SDPA), xformers, flash,
    ... A backend whose kernel is missing on this machine falls back to SDPA with one warning."""


@dataclass
class FlowSamplingConfig:
    """How images/videos are sampled. Rollout and training always use the same values (ratio == 1)."""

    num_steps: int = ranged(10, low=1)
    """Denoising steps per rollout (Flow-GRPO trains with 10)."""
    eval_num_steps: int = ranged(40, low=1)
    """Denoising steps (deterministic ODE) for evaluation and ``mmgrpo sample``."""
    guidance_scale: float = ranged(4.5, low=0)
    """Classifier-free guidance scale, used in rollout and training; 1 disables CFG (no unconditional
    forward). For guidance-distilled FLUX.1-dev it is the embedded guidance value instead."""
    negative_prompt: str = ""
    """Prompt of the unconditional branch."""
    fused_cfg: bool = True
    """Run the conditional and unconditional branches as one no-grad forward of 2n rows wherever the rollout's
    velocity is not replayed by training: ODE and untrained steps, the Flash solver, BranchGRPO trees (whose old
    log-probs are recomputed) and evaluation. Trained steps always use the training forward's split form, so
    on-policy exactness holds either way; False runs every CFG velocity as two forwards."""
    height: int = ranged(512, low=1)
    """Image height in pixels."""
    width: int = ranged(512, low=1)
    """Image width in pixels."""
    num_frames: int = ranged(33, low=1)
    """Frames per video (Wan only)."""
    fps: int = ranged(16, low=1)
    """Frame rate of the videos written to ``samples/`` (Wan2.1 generates 16 fps)."""
    sde: str = "flow_grpo"
    """Stochastic step kernel: flow_grpo (Flow-GRPO SDE), dance (DanceGRPO SDE) or cps
    (coefficients-preserving)."""
    noise_level: float = ranged(0.7, low=0)
    """Noise level a of sde=flow_grpo (std_t = a*sqrt(sigma/(1-sigma)), a > 0) and of sde=cps (std =
    sigma_prev*sin(a*pi/2), a in (0, 1]); Flow-GRPO uses one noise_level for both. Unused by sde=dance."""
    eta: float = ranged(0.3, low=0)
    """DanceGRPO eta of sde=dance (std = eta*sqrt(|dt|), eta > 0); unused by flow_grpo and cps."""
    latent_dtype: str = "float32"
    """Storage dtype of rollout latents. The stored next-latent is round-tripped through it before its
    log-prob is taken, so the ratio stays exactly 1 even in bf16 storage."""


@dataclass
class FlowModeConfig:
    """The rollout mode: which steps are stochastic and trained."""

    name: str = "flow_grpo"
    """Rollout mode (registry ``ROLLOUT_MODES``): flow_grpo, dance_grpo, fast (Flow-GRPO-Fast), mixgrpo,
    mixgrpo_flash, branch (BranchGRPO) or tempflow (TempFlow-GRPO). branch computes its own advantages (per-depth
    z-scores of the backed-up weighted-sum reward), so it refuses ``reward_aggregation: gdpo`` and
    ``grpo.adv_batch_norm``, and ignores ``grpo.advantage``; its rows (leaves) own different numbers of node
    transitions, so it also refuses ``grpo.loss_aggregation: seq-mean-token-mean``, and ``grpo.adv_eps: 0`` (its
    backed-up node rewards tie only up to rounding)."""
    train_fraction: float = ranged(0.9, low=0, high=1, low_open=True)
    """flow_grpo: fraction of the first steps that are trained. dance_grpo: fraction trained per sample."""
    window_size: int = ranged(4, low=1)
    """mixgrpo / flash / fast: SDE steps in the sliding window. branch with branch_variant=mix: the SDE window
    is steps [0, window_size) (plus the split steps). mixgrpo, flash and branch-mix need 1 <= window_size <=
    sampling.num_steps (fast: at most fast_within of it); with sampling.sde=cps a 1-step window that can land on
    the deterministic last step is refused. MixGRPO publishes 4; Flow-GRPO-Fast uses 3, so set
    ``mode.window_size: 3`` with ``mode.name: fast``."""
    shift_interval: int = ranged(25, low=1)
    """mixgrpo / flash: iterations between window moves."""
    window_stride: int = ranged(1, low=1)
    """mixgrpo / flash: steps the window moves at each shift."""
    window_strategy: str = "progressive"
    """mixgrpo / flash: progressive (with roll-back), random or decay."""
    flash_compression: float | None = ranged(0.4, low=0, high=1, low_open=True)
    """mixgrpo_flash: fraction of the ODE steps after the window that are kept (None keeps all)."""
    fast_within: float = ranged(0.5, low=0, high=1, low_open=True)
    """fast: the window is placed at random inside this first fraction of the steps."""
    split_points: list[int] = ranged(default_factory=lambda: [0, 3, 6, 9], low=0)
    """branch: steps at which every node splits."""
    branch_factor: int = ranged(2, low=2)
    """branch: children per split."""
    branch_variant: str = "pure"
    """branch: pure (SDE on every step) or mix (SDE only in a window and at split steps)."""
    reward_backup: str = "mean"
    """branch: internal-node reward, mean of leaves or prob (weighted by child split-step probabilities)."""
    width_keep: float = ranged(1.0, low=0, high=1, low_open=True)
    """branch: fraction of leaf nodes kept for training (top and bottom by advantage); 1 keeps all."""
    depth_prune_window: int = ranged(0, low=0)
    """branch: untrained steps at the end of the schedule, sliding earlier over training; 0 disables."""
    depth_prune_interval: int = ranged(25, low=1)
    """branch: iterations between depth-pruning window moves."""
    tempflow_candidates: list[int] | None = ranged(None, low=0)
    """tempflow: steps that may be the single SDE branch step, drawn once per group (None: all but the
    last)."""
    shared_initial_noise: bool = False
    """The G samples of a group start from one initial latent (DanceGRPO's same-noise groups), so they differ
    only by the policy's own SDE noise and every reward difference is credited to trained steps. tempflow always
    shares it; branch trees share their root by construction."""
    timestep_weighting: str = "uniform"
    """Per-step loss weights for every mode: uniform, or noise_aware (TempFlow-GRPO): a trained step's
    transition std std_t*sqrt(|dt|) over the mean of it over the schedule's trainable steps, so a step's weight
    depends on the step alone, whatever else is in the batch: above 1 on the early steps with sde flow_grpo or cps,
    but on the late ones of a shifted schedule with sde dance (its std eta*sqrt(|dt|) grows with the step size)."""


@dataclass
class FlowDataConfig:
    """Where prompts come from."""

    train_prompts: str = "???"
    """A .txt file (one prompt per line) or .jsonl (objects with ``prompt`` plus any metadata the rewards
    read), or ``task:NAME`` for a registered synthetic task."""
    eval_prompts: str | None = None
    """Held-out prompts in the same formats; None uses the task's held-out split or the first training
    prompts."""
    num_eval: int = ranged(16, low=1)
    """Held-out prompts: in-loop evaluation, ``mmgrpo eval`` and ``mmgrpo sample`` (without ``--prompt``) use the
    first this many of the held-out set."""


@dataclass
class FlowConfig(BaseConfig):
    """``pipeline: flow``: GRPO for flow-matching image and video generators."""

    pipeline: str = "flow"
    model: FlowModelConfig = field(default_factory=FlowModelConfig)
    sampling: FlowSamplingConfig = field(default_factory=FlowSamplingConfig)
    mode: FlowModeConfig = field(default_factory=FlowModeConfig)
    data: FlowDataConfig = field(default_factory=FlowDataConfig)

    def validate(self) -> None:
        """Value checks run when the config is loaded, before any model is: the model type, dtypes, a local
        model folder that does not exist, and every ``mode.*`` / ``sampling.sde`` setting (by building the
        rollout mode)."""
        from .adapters import TRAIN_EXPERTS, WanAdapter, adapter_class
        from .modes import build_mode

        adapter = adapter_class(self.model.type)
        if self.model.train_experts not in TRAIN_EXPERTS:
            raise ConfigError(f"bad value '{self.model.train_experts}' for 'model.train_experts': expected one of "
                              f"{', '.join(TRAIN_EXPERTS)}")
        if self.model.guidance_scale_2 is not None and not issubclass(adapter, WanAdapter):
            raise ConfigError(f"bad value for 'model.guidance_scale_2': {self.model.guidance_scale_2} (model.type "
                              f"'{self.model.type}' has no low-noise expert; only Wan2.2 A14B uses it)")
        dtypes = {"model.dtype": self.model.dtype, "sampling.latent_dtype": self.sampling.latent_dtype}
        for key, value in dtypes.items():
            if value not in DTYPES:
                raise ConfigError(f"bad value '{value}' for '{key}': expected one of {', '.join(DTYPES)}")
        check_model_path(self.model.path)
        if self.grpo.ratio_level == "sequence":
            raise ConfigError("bad value 'sequence' for 'grpo.ratio_level': the flow pipeline trains its denoising "
                              "steps in separate backward passes, so its ratios are per step (token)")
        if self.mode.name == "branch":
            refused = {"reward_aggregation": self.reward_aggregation == "gdpo", "grpo.adv_batch_norm":
                       self.grpo.adv_batch_norm}
            for key in (k for k, on in refused.items() if on):
                raise ConfigError(f"bad value for '{key}': mode branch computes its own advantages (per-depth "
                                  "z-scores of the backed-up weighted-sum reward)")
            if self.grpo.loss_aggregation == "seq-mean-token-mean":
                raise ConfigError("bad value 'seq-mean-token-mean' for 'grpo.loss_aggregation': with mode branch a "
                                  "row (leaf) holds the transitions of every tree node it is the first leaf of, so a "
                                  "per-row mean weighs a node by how many its leaf holds; use token-mean")
        build_mode(self)


def check_model_path(path: str) -> None:
    """``tiny:KIND``, a hub id (``org/name``) or an existing local folder; otherwise a ConfigError naming
    ``model.path``. A path is local when it starts with ``/``, ``.`` or ``~``, has no ``/`` or more than
    one."""
    if path.startswith("tiny:"):
        if path[len("tiny:"):] not in TINY_KINDS:
            raise ConfigError(f"bad value '{path}' for 'model.path': tiny models are {', '.join(TINY_KINDS)}")
        return
    local = path.startswith(("/", ".", "~")) or path.count("/") != 1
    if local and not os.path.isdir(os.path.expanduser(path)):
        raise ConfigError(f"bad value for 'model.path': local model folder not found: {path}{cwd_hint(path)}")
