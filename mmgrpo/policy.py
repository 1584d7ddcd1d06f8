"""The small interface between the trainer and a pipeline.

A pipeline (flow, vlm, or the toy bandit in the tests) implements :class:`Policy`. The trainer never looks inside a
rollout: it asks the policy for samples to score, for log-probs of chosen units under grad, and for the KL to the
reference. A *unit* is whatever one log-prob belongs to: a denoising step (flow) or a completion token (vlm).
"""

from __future__ import annotations

import copy
import json
import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmgrpo.config import ConfigError
from mmgrpo.tracking import finite_or_null


@dataclass
class Rollout:
    """What one rollout produced on this process. N samples = local prompts x G, U units per sample.

    - ``group``: (N,) int64 global group ids; the G samples of a prompt share one id.
    - ``old_logp``: (N, U) fp32 log-probs of the units at sampling time, computed with the same forward path and
      micro-batch chunking that training uses (so the first ratio is exactly 1).
    - ``mask``: (N, U) bool, the units that are trained.
    - ``unit_weight``: (N, U) fp32 per-unit loss weights (timestep weighting); ones when unused.
    - ``reward_batch``: the batch the reward zoo scores (``mmgrpo.rewards.RewardBatch``).
    - ``data``: pipeline tensors needed to recompute log-probs (latents, noise, token ids, ...).
    - ``counters``: numbers to log for this rollout, e.g. ``nfe/rollout`` or ``tokens/completion``; logged after
      training, so ``log_probs`` may add to them.
    - ``sample_mask``: (N,) bool, samples that may be trained at all (False for a failed decode, etc.).
    - ``recompute_old_logp``: set by a policy whose sampling forwards cannot use the training chunking (consecutive
      rows in ``train.micro_batch_size`` chunks, then ``unit_chunks``); the trainer then takes ``old_logp`` from
      ``log_probs``: for the rows of the first update from that update's own forward, for the rows of later updates
      (:func:`rows_after_first_update`) from a no-grad pass before it, and logs how far the sampling log-probs were
      (``old_logp`` NaN where the sampler did not report them).
    - ``weights_updated``: set by the trainer after its first optimiser step on this rollout. Until then the
      weights are the ones that sampled it, so a policy may reuse no-grad forwards it kept from sampling (the flow
      policy's unconditional CFG velocities) instead of running them again.
    """

    group: torch.Tensor
    old_logp: torch.Tensor
    mask: torch.Tensor
    reward_batch: Any
    data: dict[str, Any] = field(default_factory=dict)
    unit_weight: torch.Tensor | None = None
    counters: dict[str, float] = field(default_factory=dict)
    sample_mask: torch.Tensor | None = None
    recompute_old_logp: bool = False
    weights_updated: bool = False

    def __post_init__(self) -> None:
        self.old_logp = self.old_logp.detach().float()
        n, u = self.old_logp.shape
        if self.group.shape != (n,) or self.mask.shape != (n, u):
            raise ValueError(f"rollout shapes disagree: group {tuple(self.group.shape)}, old_logp {(n, u)}, "
                             f"mask {tuple(self.mask.shape)}")
        if self.unit_weight is None:
            self.unit_weight = torch.ones_like(self.old_logp)
        if self.sample_mask is None:
            self.sample_mask = torch.ones(n, dtype=torch.bool, device=self.old_logp.device)

    def __len__(self) -> int:
        return self.old_logp.shape[0]


@dataclass
class LogProbs:
    """Log-probs recomputed under grad for ``rows`` x ``units`` of a rollout.

    - ``logp``: (n, u) fp32.
    - ``kl``: (n, u) fp32 per-unit KL to the reference, or None when it was not asked for.
    - ``entropy``: (n, u) fp32 entropy in nats of the distribution each unit was sampled from, without grad, or
      None when it was not asked for or for a pipeline whose policy entropy says nothing (flow: the Gaussian's std
      is the scheduler's).
    """

    logp: torch.Tensor
    kl: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


class Policy(ABC):
    """What the trainer needs from a pipeline.

    ``model`` is the trainable ``nn.Module``; the trainer wraps it with ``accelerator.prepare`` and assigns the
    wrapped module back, so ``log_probs`` must call ``self.model`` (never a cached unwrapped reference) for gradients
    to synchronise across processes.
    """

    model: nn.Module

    def setup(self, accelerator: Any) -> None:
        """Called once before training, after ``model`` is prepared. Move frozen parts to the device here."""
        self.accelerator = accelerator

    @abstractmethod
    def rollout(self, items: list[dict], group_ids: list[int], group_size: int) -> Rollout:
        """Sample ``group_size`` outputs for each item. ``group_ids[i]`` is item i's global group id."""

    @abstractmethod
    def log_probs(self, rollout: Rollout, rows: torch.Tensor, units: torch.Tensor | None,
                  with_kl: bool, with_entropy: bool = False) -> LogProbs:
        """Recompute log-probs of ``rows`` (n,) at ``units`` (u,) (None: all units) under grad, in fp32; with
        ``with_kl`` the KL to the reference, with ``with_entropy`` the entropy, where the pipeline has one."""

    def unit_chunks(self, rollout: Rollout) -> list[torch.Tensor | None]:
        """How the units of a micro-batch are split into separate backward passes. ``[None]`` (the default) is one
        backward over all units; the flow pipeline returns one chunk per trained step to bound activation memory."""
        return [None]

    def unit_advantages(self, rollout: Rollout, advantages: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """(N, U) advantages per unit from the (N,) per-sample advantages and combined rewards of this process.

        The default gives every unit its sample's advantage. A tree rollout (BranchGRPO) overrides this to give
        each node's transitions the advantage of that node."""
        return advantages[:, None].to(rollout.old_logp.device).expand_as(rollout.old_logp)

    def max_units(self) -> int | None:
        """The constant unit count ``seq-mean-token-sum-norm`` divides by (the most units a sample can have), or
        None for the rollout's width U when that does not change from rollout to rollout."""
        return None

    def refill_rollout(self, items: list[dict], group_ids: list[int], group_size: int, round_index: int) -> Rollout:
        """Refill round ``round_index`` (1, 2, ...) of dynamic sampling (``grpo.refill_rounds``): more samples of
        the training iteration whose :meth:`rollout` came last. The default is :meth:`rollout`; a policy whose
        rollouts follow the iteration (the flow pipeline's window schedules) keeps the iteration instead."""
        return self.rollout(items, group_ids, group_size)

    def merge_groups(self, rollouts: list[Rollout], rows: list[torch.Tensor]) -> Rollout:
        """One rollout of ``rollouts[i]``'s ``rows[i]`` (whole groups, in order), for dynamic sampling's refill
        (``grpo.refill_rounds``). Counters that count work (tokens sampled, items skipped) are summed over all of
        ``rollouts``, the rest describe the merged batch or are averaged. Pipelines without it raise."""
        raise NotImplementedError(f"{type(self).__name__} cannot merge rollouts (grpo.refill_rounds)")

    def after_optimizer_step(self, step: int) -> None:
        """Called after every optimiser step; ``step`` counts them from 1. For state that follows the weights (the
        GRPO-CARE reference of the vlm pipeline); the default does nothing."""

    def training_state(self) -> dict[str, torch.Tensor]:
        """Tensors beside the weights and optimiser that a resumed run needs (e.g. a moving reference model); the
        trainer saves them in each checkpoint (``policy_state.safetensors``) and gives them back through
        :meth:`load_training_state`. The default has none."""
        return {}

    def load_training_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`training_state` returned."""

    def restart_training_state(self) -> None:
        """Called instead of :meth:`load_training_state` when a checkpoint holds no training state (its run kept
        none: GRPO-CARE turned on at this resume), once its weights are restored: start the state from them (an
        EMA reference: from the restored weights). The default keeps the state as built."""

    @property
    def is_main_process(self) -> bool:
        acc = getattr(self, "accelerator", None)
        return acc is None or acc.is_main_process

    def unwrapped_model(self) -> nn.Module:
        """``model`` without its DDP/FSDP/DeepSpeed wrapper."""
        acc = getattr(self, "accelerator", None)
        return acc.unwrap_model(self.model) if acc is not None else self.model

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (gathered) state dict of ``model``; collective under FSDP / ZeRO-3, so call it on every
        process. Only the main process gets the complete dict."""
        acc = getattr(self, "accelerator", None)
        return acc.get_state_dict(self.model) if acc is not None else self.model.state_dict()

    @property
    def sharded(self) -> bool:
        """Whether ``model`` trains with parameters sharded over processes (:func:`sharded_parameters`)."""
        acc = getattr(self, "accelerator", None)
        return acc is not None and sharded_parameters(acc)

    def sharded_state_dict(self) -> dict[str, torch.Tensor] | None:
        """:meth:`full_state_dict` when ``model`` is sharded (FSDP or DeepSpeed ZeRO-3), else None (the unwrapped
        module holds every weight). Collective when sharded: ``save`` calls it on every process."""
        return self.full_state_dict() if self.sharded else None

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write the trainable weights in their user-facing format (PEFT adapter or full model, safetensors).

        Called on every process (gathering sharded weights is collective); only the main process writes."""

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Load weights written by :meth:`save` into ``model`` in place."""

    @abstractmethod
    def datasets(self) -> tuple[list[dict], list[dict]]:
        """(train items, held-out items). Each item is a dict with at least ``prompt``."""

    @abstractmethod
    def generate(self, items: list[dict], per_prompt: int = 1) -> Any:
        """One sample per item (with the eval sampler settings), as a reward batch, for eval and ``sample``.
        ``per_prompt`` (``mmgrpo sample --per-prompt``): K samples per item, consecutive and sharing a group id,
        sample k seeded by :func:`sample_seeds`; only ``sample`` passes it, and pipelines may refuse K > 1."""

    def save_samples(self, batch: Any, directory: Path, tag: str, per_sample: bool = False,
                     scores: dict[str, torch.Tensor] | None = None) -> list[Path]:
        """Write a batch of samples for people to look at (image grids, videos, text). Returns the files.

        ``per_sample`` (``mmgrpo sample`` and ``eval``): also a ``tag/`` folder with each sample's media as its own
        file, where the pipeline has media, and ``tag/index.json`` (:func:`write_sample_index`). ``scores``: the
        rewards the caller logged for ``batch`` (name -> (B,) tensor, NaN where a reward does not apply), in the
        index as each sample's ``scores``; none given, a pipeline may score the batch itself (the VLM's page)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{tag}.txt"
        completions = batch.completions or [""] * len(batch)
        path.write_text("\n".join(f"{p}\t{c}" for p, c in zip(batch.prompts, completions)) + "\n")
        if not per_sample:
            return [path]
        columns: dict[str, list] = {"completion": completions}
        if scores is not None:
            columns["scores"] = score_records(scores, len(batch))
        return [path, write_sample_index(directory / tag, batch.prompts, batch.group, **columns)]


def hash_seed(*parts: int) -> int:
    """A 32-bit seed from the integers ``parts`` (CRC-32 of their JSON list): the same on every machine."""
    return zlib.crc32(json.dumps(list(parts)).encode())


def first_seed(item: dict, seed: int) -> int:
    """The seed of an item's sample 0 in ``generate``: its ``seed`` key, else a 32-bit hash of the run's ``seed``
    and the item's prompt, so that it does not depend on the batch."""
    if "seed" in item:
        return int(item["seed"])
    return hash_seed(seed, -1, zlib.crc32(item["prompt"].encode()))


def sample_seeds(first: int, count: int) -> list[int]:
    """The seeds of samples 0..count-1 of a prompt whose sample 0 has seed ``first``: ``first``, then for sample k
    a 32-bit hash of (``first``, k). Sample k's seed depends neither on ``count`` nor on the batch, and an item
    whose ``seed`` is sample k's regenerates sample k (as its sample 0)."""
    return [first] + [hash_seed(first, k) for k in range(1, count)]


SAMPLE_INDEX = "index.json"
"""The index that ``save_samples(..., per_sample=True)`` writes into its ``<tag>/`` folder."""


def sample_positions(group: Any) -> list[tuple[int, int]]:
    """(prompt index, sample index) of each sample of a batch with (N,) group ids: prompts numbered in the order
    their group first appears, samples in batch order within their group."""
    prompts: dict[int, int] = {}
    counts: dict[int, int] = {}
    out = []
    for g in map(int, group):
        out.append((prompts.setdefault(g, len(prompts)), counts.get(g, 0)))
        counts[g] = counts.get(g, 0) + 1
    return out


def sample_stems(group: Any) -> list[str]:
    """A file stem per sample, ``p000-s00`` (prompt and sample index of :func:`sample_positions`), zero-padded to
    at least 3 and 2 digits and to the batch's largest index, so the names sort in (prompt, sample) order."""
    positions = sample_positions(group)
    widths = [max(minimum, len(str(max(pos[i] for pos in positions)))) for i, minimum in ((0, 3), (1, 2))]
    return [f"p{p:0{widths[0]}d}-s{s:0{widths[1]}d}" for p, s in positions]


def score_records(scores: dict[str, torch.Tensor], n: int) -> list[dict[str, float]]:
    """Per sample of an n-sample batch, reward name -> its score (a float, NaN where it does not apply), from
    ``scores`` (name -> (n,) tensor): the index's ``scores`` column."""
    return [{name: float(values[i]) for name, values in scores.items()} for i in range(n)]


def write_sample_index(folder: Path, prompts: list[str], group: Any, files: list[str] | None = None,
                       seeds: list[int | None] | None = None, **columns: list) -> Path:
    """``folder/index.json``: ``{"tag": folder name, "samples": [...]}`` with one record per sample, in batch
    order: ``file`` (name in ``folder``, null without one), ``prompt_index``, ``sample_index``
    (:func:`sample_positions`), ``prompt``, ``seed`` (null when unknown) and each of ``columns`` (name -> one value
    per sample). NaN and infinite floats are written as null."""
    files = files or [None] * len(prompts)
    seeds = seeds or [None] * len(prompts)
    records = [{"file": f, "prompt_index": p, "sample_index": s, "prompt": prompt, "seed": seed,
                **{name: values[i] for name, values in columns.items()}}
               for i, (f, (p, s), prompt, seed) in enumerate(zip(files, sample_positions(group), prompts, seeds))]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SAMPLE_INDEX
    path.write_text(json.dumps({"tag": folder.name, "samples": finite_or_null(records)}, indent=1, allow_nan=False))
    return path


@dataclass
class PipelineSpec:
    """What a pipeline registers in ``mmgrpo.registry.PIPELINES``: its config schema and its policy factory."""

    config_class: type
    """A dataclass subclassing :class:`mmgrpo.config.BaseConfig`."""
    build: Callable[[Any], Policy]
    """``build(cfg) -> Policy``."""
    description: str = ""


def merged_counters(rollouts: list[Rollout], summed: set[str]) -> dict[str, float]:
    """The counters of rollouts merged by dynamic sampling's refill: the ``summed`` keys (work done: samples,
    tokens, forwards) added up over every rollout, the others (rates) averaged over the rollouts that have them."""
    out = {}
    for key in {k for r in rollouts for k in r.counters}:
        values = [r.counters[key] for r in rollouts if key in r.counters]
        out[key] = sum(values) if key in summed else sum(values) / len(values)
    return out


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is True on any process: an all-reduce when torch.distributed runs (collective: every process
    must call it), ``flag`` itself otherwise."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    from accelerate import PartialState

    value = torch.tensor([int(flag)], device=PartialState().device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def sharded_parameters(acc: Any) -> bool:
    """Whether the accelerate run ``acc`` shards the parameters over processes (FSDP, DeepSpeed ZeRO-3): every
    process must then run the same forwards, since each one gathers the shards from all of them."""
    from accelerate.utils import DistributedType

    if acc.distributed_type == DistributedType.FSDP:
        return True
    plugin = acc.state.deepspeed_plugin
    return acc.distributed_type == DistributedType.DEEPSPEED and plugin is not None and plugin.zero_stage == 3


def check_even_eval_split(num_items: int, num_processes: int, sharded: bool) -> None:
    """ConfigError when a process would get no held-out item (its collectives, a DDP buffer broadcast among them,
    would pair with another process's evaluation), or when sharded parameters (``sharded``: FSDP, ZeRO-3) meet
    held-out items that do not split evenly over the processes: each process samples its share, and with sharded
    weights every process must run the same forwards."""
    if 0 < num_items < num_processes:  # none at all: no process evaluates
        raise ConfigError(f"bad value for 'data.num_eval': {num_items} held-out items leave some of the "
                          f"{num_processes} processes none; use at least {num_processes}")
    if sharded and num_items % num_processes:
        raise ConfigError(f"bad value for 'data.num_eval': {num_items} held-out items do not split evenly over "
                          f"{num_processes} processes, which sharded parameters (FSDP, ZeRO-3) need; use a "
                          f"multiple of {num_processes}")


def frozen_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without grad, in eval mode: the KL reference of a full fine-tune.

    Refuses weights that were not loaded whole in this process: on the meta device (FSDP's RAM-efficient loading)
    or partitioned by DeepSpeed ZeRO-3 (``zero3_init_flag: true``), whose copy would hold this process's shards
    only, which no engine gathers."""
    if any(p.is_meta for p in module.parameters()):
        raise ConfigError("the KL reference of a full fine-tune is a copy of the loaded weights, which this process "
                          "holds on the meta device (FSDP's cpu_ram_efficient_loading loads them on the main process "
                          "only): set 'fsdp_cpu_ram_efficient_loading: false' in the accelerate config "
                          "(configs/accelerate/fsdp.yaml does), use LoRA, or set grpo.kl_beta=0")
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        raise ConfigError("the KL reference of a full fine-tune is a copy of the loaded weights, which DeepSpeed "
                          "ZeRO-3 partitioned at load: set 'zero3_init_flag: false' in the accelerate config "
                          "(configs/accelerate/deepspeed_zero3.yaml does), use LoRA, or set grpo.kl_beta=0")
    return copy.deepcopy(module).requires_grad_(False).eval()


def update_sizes(n: int, micro_batch_size: int, updates_per_rollout: int) -> list[int]:
    """How the trainer splits a process's n rollout rows: into ceil(n / micro_batch_size) micro-batches of
    consecutive rows, dealt to ``updates_per_rollout`` optimiser updates as evenly as possible (the first ones get
    one more). Returns the micro-batch count of each update; raises ConfigError when there are fewer micro-batches
    than updates."""
    micro_batches = math.ceil(n / micro_batch_size)
    if micro_batches < updates_per_rollout:
        raise ConfigError(f"bad value for 'train.updates_per_rollout': {updates_per_rollout} updates need as many "
                          f"micro-batches per process, and this one has {micro_batches} ({n} rows, "
                          f"train.micro_batch_size {micro_batch_size}); lower one of the two")
    base, extra = divmod(micro_batches, updates_per_rollout)
    return [base + (i < extra) for i in range(updates_per_rollout)]


def rows_after_first_update(n: int, micro_batch_size: int, updates_per_rollout: int) -> int:
    """How many of a process's n rollout rows the trainer trains after the first update of an iteration."""
    first = update_sizes(n, micro_batch_size, updates_per_rollout)[0] * micro_batch_size
    return max(n - first, 0)


def build_policy(cfg: Any) -> Policy:
    """The policy for ``cfg.pipeline`` (a registered name or ``module:attr`` naming a PipelineSpec)."""
    from mmgrpo.registry import PIPELINES

    return PIPELINES.get(cfg.pipeline).build(cfg)
