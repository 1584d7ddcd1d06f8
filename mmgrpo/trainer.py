"""The one GRPO loop for every pipeline.

Per iteration: sample prompts (whole groups per process) -> ``policy.rollout`` -> reward zoo -> gather rewards from
all processes -> advantages on whole groups -> K inner epochs of mini-batch updates -> log -> checkpoint.
Everything model-specific is behind :class:`mmgrpo.policy.Policy`; everything mathematical is in :mod:`mmgrpo.grpo`.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DeepSpeedPlugin,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    gather_object,
    set_seed,
)
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import get_scheduler
from transformers.integrations import unset_hf_deepspeed_config

from mmgrpo import checkpoint
from mmgrpo.config import BaseConfig, ConfigError, to_dict, to_yaml
from mmgrpo.data import GroupSampler
from mmgrpo.ema import EMA
from mmgrpo.errors import RunError
from mmgrpo.grpo import (
    advantage_stats,
    aggregation_count,
    aggregation_weights,
    batch_normalize,
    clip_advantages,
    combine_rewards,
    constant_columns,
    no_signal_groups,
    ratio_stats,
    weighted_reward,
)
from mmgrpo.policy import (
    Policy,
    Rollout,
    build_policy,
    check_even_eval_split,
    sharded_parameters,
    update_sizes,
)
from mmgrpo.registry import POLICY_LOSSES
from mmgrpo.rewards import RewardZoo
from mmgrpo.schedule import projected_end, replanned_end, warp_schedule
from mmgrpo.tracking import (
    MetricsLog,
    plain_scalar,
    plot_metrics,
    print_whole,
    read_metrics,
    redraw_due,
    summary_table,
)

POLICY_STATE_FILE = "policy_state.safetensors"
"""Checkpoint file of :meth:`Policy.training_state`, written when the policy has any."""
SILENT_REWARD_ROLLOUTS = 10
"""Rollouts after which a reward that has given every sample the same score is reported (once per run)."""
REPLAN_EVERY = 0.05
"""With ``train.max_minutes``, the lr schedule is fitted to the time budget at every this fraction of it."""


def make_accelerator(cfg: BaseConfig) -> Accelerator:
    """An Accelerator for this run. On a machine without CUDA it runs on CPU (gloo for several processes), under
    DeepSpeed too when the launcher asks for it (DeepSpeed's CPU accelerator; ``Accelerator(cpu=True)`` would drop
    DeepSpeed without a word).

    The LR scheduler is stepped exactly once per optimiser step whatever the process count, and losses are not
    divided by a launcher's gradient accumulation steps: the trainer accumulates each update's micro-batches itself,
    with loss weights that already average over the whole update. Under ZeRO-3, models load whole (see
    :func:`partitioned_at_load`)."""
    deepspeed_on_cpu = (not torch.cuda.is_available()
                        and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true")
    acc = Accelerator(cpu=not torch.cuda.is_available() and not deepspeed_on_cpu,
                      kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else None,
                      mixed_precision=cfg.train.mixed_precision, step_scheduler_with_optimizer=False,
                      gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
    if acc.state.deepspeed_plugin is not None:
        configure_deepspeed(acc.state.deepspeed_plugin, cfg)
        unset_hf_deepspeed_config()
    return acc


@contextmanager
def partitioned_at_load(acc: Accelerator) -> Iterator[None]:
    """Inside, transformers' ``from_pretrained`` partitions weights as they load (``deepspeed.zero.Init``) when the
    launcher set ZeRO-3 with ``zero3_init_flag: true``; otherwise, and everywhere outside, models load whole.

    accelerate registers its ZeRO-3 config with transformers whatever ``zero3_init_flag`` says, and every
    ``from_pretrained`` would partition: the frozen KL reference, a reward model or a text encoder that no engine
    gathers would hold empty shards. :func:`make_accelerator` unregisters it; the trainer builds the policy in here."""
    plugin = acc.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3 or not plugin.zero3_init_flag:
        yield
        return
    plugin.set_deepspeed_weakref()
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def check_run_dir(run_dir: Path) -> None:
    """Raise the OSError that making ``run_dir`` would raise (a file on its path, a folder without write access),
    without making it."""
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"output_dir {run_dir} is under a file", str(existing))
    if existing != run_dir and not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"output_dir {run_dir} cannot be made", str(existing))


def check_batch_layout(cfg: BaseConfig, num_processes: int) -> None:
    """ConfigError for a batch that ``num_processes`` processes cannot split: ``train.prompts_per_step`` not
    divisible by them, or fewer micro-batches per process (its prompts x ``train.group_size`` rows, the rows of every
    rollout the trainer trains on) than ``train.updates_per_rollout``."""
    t = cfg.train
    GroupSampler(1, t.prompts_per_step, num_processes)  # names train.prompts_per_step when it does not divide
    update_sizes(t.prompts_per_step // num_processes * t.group_size, t.micro_batch_size, t.updates_per_rollout)


def merge_scores(scores: list[dict[str, torch.Tensor]], rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The logged scores (name -> (B_k,) tensor) of rollouts k at their ``rows`` (n_k,), concatenated: every name
    that any rollout reported, NaN ("does not apply") on the rows of a rollout that did not report it (a reward's
    sub-scores may differ from batch to batch)."""
    def column(part: dict[str, torch.Tensor], name: str, r: torch.Tensor) -> torch.Tensor:
        if name in part:
            return part[name][r.to(part[name].device)].cpu()
        return torch.full((len(r),), math.nan, dtype=torch.float64)

    names = dict.fromkeys(name for part in scores for name in part)
    return {name: torch.cat([column(part, name, r) for part, r in zip(scores, rows)]) for name in names}


def merge_metric_rows(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One metrics row from the processes' ``rows``: each key's mean over the rows that have it as a number (a
    Python, numpy or 0-d tensor scalar), or for ``*max_dev`` keys the maximum over those that measured one (NaN
    only when none did). Other values are left out."""
    merged: dict[str, list[float]] = {}
    for row in rows:
        for k, v in row.items():
            v = plain_scalar(v)
            if isinstance(v, (int, float)):
                merged.setdefault(k, []).append(float(v))
    return {k: (max((x for x in v if not math.isnan(x)), default=math.nan) if "max_dev" in k else sum(v) / len(v))
            for k, v in merged.items()}


def configure_deepspeed(plugin: DeepSpeedPlugin, cfg: BaseConfig) -> None:
    """Fill the DeepSpeed config from the run's, before ``prepare``, replacing the launcher file's values:
    ``gradient_clipping`` = ``optim.max_grad_norm`` (0 = none; under DeepSpeed the engine clips, and accelerate's
    ``clip_grad_norm_`` only reads the norm back), ``train_micro_batch_size_per_gpu`` = ``train.micro_batch_size``
    (accelerate reads it from a dataloader, and the trainer prepares none), ``gradient_accumulation_steps`` = 1
    (the engine would divide every loss by it; the trainer accumulates each update's micro-batches itself), and
    ``train_batch_size`` = "auto", which ``prepare`` fills as micro-batch x processes (DeepSpeed refuses any other
    value: one from a DeepSpeed JSON file, or from an earlier trainer's ``prepare`` in this process). Under bf16,
    ``bf16.check_grad_overflow`` = true: the engine steps inside accelerate's ``backward``, before the trainer reads
    the gradient norm, so the engine must skip a non-finite update itself (fp16 always does; fp32 does from
    DeepSpeed 0.19.8, the floor of the ``deepspeed`` extra)."""
    plugin.deepspeed_config["gradient_clipping"] = float(cfg.optim.max_grad_norm)
    plugin.deepspeed_config["gradient_accumulation_steps"] = 1
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = int(cfg.train.micro_batch_size)
    plugin.deepspeed_config["train_batch_size"] = "auto"
    bf16 = plugin.deepspeed_config.get("bf16")
    if bf16 is not None and bf16.get("enabled") not in (False, "false"):
        bf16["check_grad_overflow"] = True


class Trainer:
    """Runs ``cfg.train.max_steps`` optimiser steps of GRPO on ``policy``. See the module docstring."""

    def __init__(self, cfg: BaseConfig, policy: Policy | None = None, accelerator: Accelerator | None = None):
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        check_run_dir(self.run_dir)  # before the model loads
        self.accelerator = accelerator or make_accelerator(cfg)
        acc = self.accelerator
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        # before the model loads: what the config and the launcher decide
        check_batch_layout(cfg, acc.num_processes)
        if cfg.train.ema_decay > 0 and sharded_parameters(acc):
            raise ConfigError("bad value for 'train.ema_decay': the EMA keeps full copies of the parameters, which "
                              "FSDP and DeepSpeed ZeRO-3 shard; set it to 0 or use DDP or ZeRO-2")
        if cfg.grpo.refill_rounds and not cfg.grpo.mask_zero_std_groups:
            raise ConfigError("bad value for 'grpo.refill_rounds': refilling replaces the groups that "
                              "grpo.mask_zero_std_groups leaves out; set grpo.mask_zero_std_groups: true")
        if cfg.grpo.oversample_prompts and not cfg.grpo.mask_zero_std_groups:
            raise ConfigError("bad value for 'grpo.oversample_prompts': the extra groups replace those that "
                              "grpo.mask_zero_std_groups leaves out; set grpo.mask_zero_std_groups: true")
        if cfg.grpo.oversample_prompts % acc.num_processes:
            raise ConfigError(f"bad value for 'grpo.oversample_prompts': {cfg.grpo.oversample_prompts} must be "
                              f"divisible by the {acc.num_processes} processes")
        set_seed(cfg.seed, device_specific=True)
        if policy is None:
            with partitioned_at_load(acc):
                policy = build_policy(cfg)
        self.policy = policy
        self.rewards = RewardZoo(cfg.rewards)
        self.loss_fn = POLICY_LOSSES.get(cfg.grpo.loss)
        named = [(n, p) for n, p in self.policy.model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the policy has no trainable parameters")
        o = cfg.optim
        optimizer = torch.optim.AdamW([p for _, p in named], lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                      weight_decay=o.weight_decay)
        scheduler = get_scheduler(o.lr_scheduler, optimizer, num_warmup_steps=o.warmup_steps,
                                  num_training_steps=cfg.train.max_steps)
        self.schedule_warp = warp_schedule(scheduler, cfg.train.max_steps)
        self.policy.model, self.optimizer, self.scheduler = acc.prepare(self.policy.model, optimizer, scheduler)
        self.policy.setup(acc)
        self.ema = EMA(named, cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
        if cfg.grpo.refill_rounds and type(self.policy).merge_groups is Policy.merge_groups:
            raise ConfigError(f"bad value for 'grpo.refill_rounds': the {cfg.pipeline} pipeline cannot merge "
                              "rollouts; set it to 0 (grpo.mask_zero_std_groups still masks the groups)")
        if cfg.grpo.oversample_prompts and type(self.policy).merge_groups is Policy.merge_groups:
            raise ConfigError(f"bad value for 'grpo.oversample_prompts': the {cfg.pipeline} pipeline cannot "
                              "drop groups from a rollout; set it to 0")
        acc.register_save_state_pre_hook(self._save_hook)
        acc.register_load_state_pre_hook(self._load_hook)

        self.train_items, self.eval_items = self.policy.datasets()
        check_even_eval_split(len(self.eval_items), acc.num_processes, sharded_parameters(acc))
        self.sampler = GroupSampler(len(self.train_items), cfg.train.prompts_per_step + cfg.grpo.oversample_prompts,
                                    acc.num_processes, acc.process_index, cfg.seed)
        self.step = 0
        self.iteration = 0
        self.skipped_updates = 0
        """Optimiser updates skipped for a non-finite gradient norm in this process's run."""
        self.rollouts_scored = 0
        self.rewards_varied = torch.zeros(len(self.rewards.names), dtype=torch.bool)
        """(R,) bool: whether each reward has scored two samples differently in this process's run."""
        self.train_seconds = 0.0
        """Wall-clock seconds spent in training iterations, summed over resumes (``train.max_minutes``)."""
        self._replan_mark = 0
        """The last ``REPLAN_EVERY`` mark of the time budget at which the lr schedule was fitted to it."""
        self.rollout_is_collective = acc.num_processes > 1 and sharded_parameters(acc)
        """Whether every rollout forward gathers sharded weights from all processes (FSDP, ZeRO-3)."""
        self.failure_agreed = False
        """Whether every process stopped at the same RunError of a rollout, reward or evaluation
        (:meth:`_stop_together`), so that they can save together."""
        self.interrupted: str | None = None
        """The signal (SIGINT, SIGTERM) that ended :meth:`train` early, after saving a checkpoint; None otherwise."""

    # ----------------------------------------------------------------------------------------- checkpoints
    def _save_hook(self, models: list, weights: list, output_dir: str) -> None:
        """Save the policy in its user-facing format instead of accelerate's full model dump (a LoRA run saves the
        adapter, not the frozen base), plus the EMA shadows, and the EMA weights in the same user-facing format
        (``policy_ema/``: what eval and sample use). Runs on every process: gathering sharded weights (FSDP,
        DeepSpeed ZeRO-3) is collective; only the main process writes."""
        self.policy.save(Path(output_dir) / "policy")
        if self.ema is not None:  # never sharded (refused at start-up)
            with self.ema.swapped_in():
                self.policy.save(Path(output_dir) / "policy_ema")
        if self.accelerator.is_main_process:
            if self.ema is not None:
                save_file(self.ema.state_dict(), str(Path(output_dir) / "ema.safetensors"))
            policy_state = self.policy.training_state()
            if policy_state:
                save_file(policy_state, str(Path(output_dir) / POLICY_STATE_FILE))
        weights.clear()

    def _load_hook(self, models: list, input_dir: str) -> None:
        """Load what :meth:`_save_hook` saved. An EMA that the checkpoint's run did not keep (``train.ema_decay``
        turned on at this resume) starts from the restored weights, and so does a policy's training state
        (:meth:`Policy.restart_training_state`: GRPO-CARE's reference turned on at this resume)."""
        self.policy.load(Path(input_dir) / "policy")
        ema_file = Path(input_dir) / "ema.safetensors"
        if self.ema is not None and ema_file.is_file():
            self.ema.load_state_dict(load_file(str(ema_file)))
        elif self.ema is not None:
            self.ema.restart()
            self.accelerator.print(f"{input_dir} holds no EMA weights: the EMA (train.ema_decay) starts from its "
                                   "weights")
        state_file = Path(input_dir) / POLICY_STATE_FILE
        if self.policy.training_state():
            if state_file.is_file():
                self.policy.load_training_state(load_file(str(state_file)))
            else:
                self.policy.restart_training_state()
                self.accelerator.print(f"{input_dir} holds no {POLICY_STATE_FILE} (its run kept no policy state, "
                                       "such as GRPO-CARE's reference): that state starts afresh")
        models.clear()

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step-N`` atomically: everything goes to a temporary folder that is renamed last."""
        acc = self.accelerator
        tmp = checkpoint.temporary_dir(self.run_dir, self.step)
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier write of this step leaves nothing behind
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp), safe_serialization=True)
        acc.wait_for_everyone()
        final = tmp.parent / f"step-{self.step}"
        if acc.is_main_process:
            state = {"step": self.step, "iteration": self.iteration, "sampler": self.sampler.state_dict(),
                     "num_processes": acc.num_processes, "schedule_warp": self.schedule_warp.state_dict(),
                     "train_seconds": self.train_seconds}
            (tmp / checkpoint.CONFIG_FILE).write_text(to_yaml(self.cfg))
            final = checkpoint.finalize(tmp, state)
            checkpoint.prune(self.run_dir, self.cfg.train.keep_last)
        acc.wait_for_everyone()
        return final

    def load_checkpoint(self, path: Path) -> None:
        """Restore weights, optimiser, scheduler, RNG and sampler from ``path``. A file that cannot be read is a
        one-line ConfigError naming the checkpoint (and the one before it, to resume from instead)."""
        try:
            state = checkpoint.read_state(path)
            if state["num_processes"] != self.accelerator.num_processes:
                raise ConfigError(f"bad value for 'resume': checkpoint {path} was written by "
                                  f"{state['num_processes']} processes and this run has "
                                  f"{self.accelerator.num_processes} (RNG streams would not line up)")
            self.accelerator.load_state(str(path))
        except ConfigError:
            raise
        except Exception as err:
            raise checkpoint.unreadable(path, err, self.run_dir) from err
        self.step, self.iteration = state["step"], state["iteration"]
        self.train_seconds = state.get("train_seconds", 0.0)  # none in checkpoints from before train.max_minutes
        self.sampler.load_state_dict(state["sampler"])
        warp = state.get("schedule_warp")  # none in checkpoints from before re-planning
        if warp is not None and warp["horizon"] == self.cfg.train.max_steps:  # else: a new horizon, as built
            self.schedule_warp.load_state_dict(warp)
        self.apply_optim_config()

    def end_schedule_at(self, step: int) -> None:
        """Re-plan the rest of the lr schedule, from the current step, to reach its end at optimiser step ``step``
        (at most ``train.max_steps``): for a run bounded by wall-clock time, whose caller projects where its
        budget ends. The lr is continuous; a constant schedule does not change. Saved in checkpoints."""
        self.schedule_warp.replan(self.step, min(step, self.cfg.train.max_steps))

    def fit_schedule_to_budget(self, elapsed_s: float, budget_s: float) -> int | None:
        """Re-plan a decaying lr schedule, at the current step ``elapsed_s`` into a time budget of ``budget_s``
        seconds, to end where the budget is projected to end (``schedule.replanned_end``: only when that is more
        than ``REPLAN_TOLERANCE`` off the plan), once warm-up is over. Returns the new end step, or None when the
        plan stays (a constant schedule always keeps it). Pass the same numbers on every process."""
        o = self.cfg.optim
        if o.lr_scheduler.startswith("constant") or self.step < max(1, o.warmup_steps) or elapsed_s <= 0:
            return None
        end = replanned_end(self.step, elapsed_s, budget_s, self.schedule_warp.planned_end(),
                            self.cfg.train.max_steps)
        if end is not None:
            self.end_schedule_at(end)
        return end

    def apply_optim_config(self) -> None:
        """Make the restored optimiser and LR schedule follow ``optim.*`` and ``train.max_steps`` of this run:
        AdamW's betas, eps and weight decay, and the lr of this run's schedule (peak ``lr``, horizon) at the restored
        position (the moments and step counts stay). With an unchanged config the state stays as restored (to float
        rounding)."""
        o = self.cfg.optim
        schedule = getattr(self.scheduler, "scheduler", self.scheduler)  # inside accelerate's wrapper
        for group, factor in zip(self.optimizer.param_groups, schedule.lr_lambdas):  # LambdaLR: peak lr x factor
            group.update(lr=o.lr * factor(schedule.last_epoch), betas=tuple(o.betas), eps=o.eps,
                         weight_decay=o.weight_decay)
        schedule.base_lrs = [o.lr] * len(schedule.base_lrs)

    def check_resumed_config(self, path: Path) -> None:
        """Compare this run's config with the one checkpoint ``path`` was made with: a change of a key in
        ``checkpoint.FIXED_ON_RESUME`` is a ConfigError; other changes are printed, and the run directory's
        previous config.yaml is kept as ``config-before-step-N.yaml``."""
        saved = next((f for f in (path / checkpoint.CONFIG_FILE, self.run_dir / checkpoint.CONFIG_FILE)
                      if f.is_file()), None)
        if saved is None:
            return
        old = checkpoint.saved_config(saved)
        new = checkpoint.flatten(to_dict(self.cfg))
        error = checkpoint.fixed_change(old, new, path)
        if error is not None:
            raise error
        _, other = checkpoint.config_changes(old, new)
        if other:
            self.accelerator.print("resuming with changed settings: " + ", ".join(
                f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in other))
            previous = self.run_dir / checkpoint.CONFIG_FILE
            if self.accelerator.is_main_process and previous.is_file():
                step = checkpoint.read_state(path)["step"]
                shutil.copyfile(previous, self.run_dir / f"config-before-step-{step}.yaml")

    # ----------------------------------------------------------------------------------------- one iteration
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(t.to(self.accelerator.device)).cpu()

    def compute_advantages(self, rollout: Rollout, main: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Gather the (B, R) rewards and group ids of all processes, standardise the columns whose spec asks for it
        (over the whole batch), compute advantages on whole groups, and
        return this process's (N, U) unit advantages plus statistics. Groups never straddle processes, but global
        statistics (batch std, logging) need everyone's rewards."""
        g = self.cfg.grpo
        gathered = self._gather(main)
        self.check_silent_rewards(gathered)
        all_main = self.rewards.standardize(gathered)
        all_group = self._gather(rollout.group)
        weights = self.rewards.weights
        adv = combine_rewards(all_main, weights, all_group, self.cfg.reward_aggregation, g.advantage, g.adv_eps)
        combined = weighted_reward(all_main, weights, all_group)
        if g.adv_batch_norm:
            adv = batch_normalize(adv, ~combined.isnan(), g.adv_eps)
        adv = clip_advantages(adv, g.adv_clip)
        stats = advantage_stats(adv, combined, all_group)
        keep = torch.ones_like(adv, dtype=torch.bool)
        if g.mask_zero_std_groups:
            keep = ~no_signal_groups(all_main, weights, all_group, self.cfg.reward_aggregation)
        n = len(rollout)
        lo = self.accelerator.process_index * n
        local_adv, local_keep = adv[lo:lo + n], keep[lo:lo + n]
        rollout.sample_mask = rollout.sample_mask & local_keep.to(rollout.sample_mask.device)
        unit_adv = self.policy.unit_advantages(rollout, local_adv, combined[lo:lo + n])
        return unit_adv.float(), stats

    def _sample_and_score(self, items_idx: list[int], group_ids: list[int], round_index: int = 0
                          ) -> tuple[Rollout, torch.Tensor, dict[str, torch.Tensor], float]:
        """Roll out the training items ``items_idx`` (round 0: the iteration's rollout, else refill round
        ``round_index``) and score them: (rollout, (N, R) main scores, logged scores, ``time.perf_counter()`` when
        the rollout ended). Collective: a RunError of the rollout or the rewards on any process is raised on every
        process, through :meth:`_stop_together`, before any other collective (see :meth:`_holding`)."""
        cfg, acc = self.cfg, self.accelerator
        items = [self.train_items[i] for i in items_idx]
        held: list[RunError] = []
        with self._holding(held, others_wait=self.rollout_is_collective), torch.no_grad(), acc.autocast():
            if round_index:
                rollout = self.policy.refill_rollout(items, group_ids, cfg.train.group_size, round_index)
            else:
                rollout = self.policy.rollout(items, group_ids, cfg.train.group_size)
        done = time.perf_counter()
        if not held:
            with self._holding(held):
                main, logged, _ = self.rewards(rollout.reward_batch)
        self._stop_together(held)
        return rollout, main, logged, done

    @contextmanager
    def _holding(self, held: list[RunError], others_wait: bool = False) -> Iterator[None]:
        """Append a RunError raised in the block to ``held`` instead of raising it, for :meth:`_stop_together` to
        raise on every process. A process that raised runs none of the block's collectives, so this holds only
        where the other processes run none either: rewards (scored per process), and the rollouts of DDP and
        one-process runs (the vlm pipeline raises for bad data before it samples). With ``others_wait`` (a rollout
        with sharded parameters, whose forwards gather the weights from every process) the error is raised at
        once: the others wait in a gather until the launcher ends them, and the run stops without saving."""
        try:
            yield
        except RunError as err:
            if others_wait:
                raise
            held.append(err)

    def _stop_together(self, held: list[RunError]) -> None:
        """Raise on every process when any holds a RunError (``held``, from :meth:`_holding`): its own, or on the
        others a RunError naming the first process that failed and its message; then ``failure_agreed`` is set,
        and the trainer may save (collective). Collective: call it at the same point on every process."""
        if not self._on_any_process(bool(held)):
            return
        own = str(held[0]) if held else None
        messages = gather_object([own]) if self.accelerator.num_processes > 1 else [own]
        self.failure_agreed = True
        if held:
            raise held[0]
        rank, message = next((i, m) for i, m in enumerate(messages) if m is not None)
        raise RunError(f"process {rank} stopped the run: {message}")

    def _signal_rows(self, main: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """(N,) bool: the sample's group carries a signal (:func:`no_signal_groups` of the (N, R) rewards)."""
        return ~no_signal_groups(main, self.rewards.weights, group.to(main.device), self.cfg.reward_aggregation)

    def refill(self, rollout: Rollout, main: torch.Tensor,
               logged: dict[str, torch.Tensor]) -> tuple[Rollout, torch.Tensor, dict[str, torch.Tensor], dict]:
        """DAPO's dynamic sampling refill (``grpo.refill_rounds``, ``grpo.oversample_prompts``): while any process
        has fewer groups with signal than its share of ``train.prompts_per_step``, roll out another round of as
        many prompts per process as the most any process misses; then keep that share on each process, groups with
        signal first and in sampling order (every process keeps as many rows, so their updates stay in step).
        Returns the merged rollout, its (N, R) rewards and logged scores, and metrics.

        Every process runs every round (rewards and sharded forwards may be collective); a group's signal is
        decided by its own rewards, which live on one process."""
        cfg, acc = self.cfg, self.accelerator
        rollouts, mains, loggeds = [rollout], [main], [logged]
        signal = [self._signal_rows(main, rollout.group)]
        share = cfg.train.prompts_per_step // acc.num_processes
        sampled = len(rollout.group.unique())

        def groups_with_signal() -> int:
            return sum(len(r.group[s.to(r.group.device)].unique()) for r, s in zip(rollouts, signal))

        rounds = 0
        while rounds < cfg.grpo.refill_rounds:
            missing = int(self.max_on_processes(share - groups_with_signal()))  # the same on every process
            if missing <= 0:
                break
            items_idx, group_ids = self.sampler.next(missing * acc.num_processes)
            extra, extra_main, extra_logged, _ = self._sample_and_score(items_idx, group_ids, rounds + 1)
            rollouts.append(extra)
            mains.append(extra_main)
            loggeds.append(extra_logged)
            signal.append(self._signal_rows(extra_main, extra.group))
            rounds += 1
        if rounds == 0 and sampled == share:  # nothing sampled to replace a group with
            return rollout, main, logged, {"dynamic/rounds": 0.0, "dynamic/groups_sampled": float(share),
                                           "dynamic/signal_frac": groups_with_signal() / share}
        candidates = []  # (no signal, round, rows of the group): a stable sort puts groups with signal first
        for k, (r, s) in enumerate(zip(rollouts, signal)):
            group = r.group.cpu()
            for gid in group.unique_consecutive().tolist():
                rows = (group == gid).nonzero().flatten()
                candidates.append((not bool(s[rows[0]]), k, rows))
        kept = sorted(candidates, key=lambda c: c[0])[:share]
        rows = [torch.cat([c[2] for c in kept if c[1] == k] or [torch.zeros(0, dtype=torch.long)])
                for k in range(len(rollouts))]
        merged = self.policy.merge_groups(rollouts, rows)
        main = torch.cat([m[r.to(m.device)] for m, r in zip(mains, rows)])
        logged = merge_scores(loggeds, rows)
        stats = {"dynamic/rounds": float(rounds), "dynamic/groups_sampled": float(len(candidates)),
                 "dynamic/signal_frac": sum(not c[0] for c in kept) / max(len(kept), 1)}
        return merged, main, logged, stats

    def check_silent_rewards(self, rewards: torch.Tensor) -> None:
        """Warn once, at the ``SILENT_REWARD_ROLLOUTS``-th rollout of this run, about every reward that has given
        every sample the same score so far, from the gathered (B, R) ``rewards``: it adds nothing to the advantages.
        A format reward stuck at 0 is the usual case (a policy SFT'd without the tags it asks for)."""
        self.rewards_varied |= ~constant_columns(rewards)
        self.rollouts_scored += 1
        if self.rollouts_scored != SILENT_REWARD_ROLLOUTS or not self.accelerator.is_main_process:
            return
        for r, name in enumerate(self.rewards.names):
            if not self.rewards_varied[r]:
                score = rewards[:, r].nanmean().item()
                what = "no score (NaN: it did not apply)" if math.isnan(score) else f"the same score ({score:g})"
                warnings.warn(f"reward '{name}' gave every sample of the first {SILENT_REWARD_ROLLOUTS} rollouts "
                              f"{what}, so it adds nothing to the advantages (a format reward at 0: the policy "
                              "never writes the format it asks for; docs/rewards.md)", RuntimeWarning, stacklevel=2)

    def _micro_batches(self, n: int, generator: torch.Generator | None) -> list[list[torch.Tensor]]:
        """Split the n local rows into updates_per_rollout updates of micro-batches of consecutive rows, the
        chunking rollouts use (so the first ratio is exactly 1); with a generator, the rows are shuffled first."""
        t = self.cfg.train
        order = torch.arange(n) if generator is None else torch.randperm(n, generator=generator)
        micro = list(order.split(t.micro_batch_size))
        bounds = [0, *itertools.accumulate(update_sizes(n, t.micro_batch_size, t.updates_per_rollout))]
        return [micro[lo:hi] for lo, hi in itertools.pairwise(bounds)]

    @contextmanager
    def _accumulating(self, last_pass: bool) -> Iterator[None]:
        """A backward pass that is not the last of an update keeps its gradients local (no all-reduce) and, under
        DeepSpeed, does not step the engine; the last pass synchronises."""
        acc = self.accelerator
        acc.gradient_state._set_sync_gradients(last_pass)
        try:
            with nullcontext() if last_pass else acc.no_sync(self.policy.model):
                yield
        finally:
            acc.gradient_state._set_sync_gradients(True)

    @torch.no_grad()
    def recompute_old_logp(self, rollout: Rollout, micro_batches: list[torch.Tensor]) -> None:
        """Replace ``rollout.old_logp`` of the rows in ``micro_batches`` by log-probs from the training forward path
        (the first epoch's unit chunking), before any update."""
        fresh = rollout.old_logp.clone()
        for rows in micro_batches:
            for units in self.policy.unit_chunks(rollout):
                cols = slice(None) if units is None else units
                with self.accelerator.autocast():
                    logp = self.policy.log_probs(rollout, rows, units, with_kl=False).logp.float()
                block = fresh[rows]
                block[:, cols] = logp
                fresh[rows] = block
        rollout.old_logp = fresh

    def aggregation_weights(self, mask: torch.Tensor) -> torch.Tensor:
        """(n, U) loss weights of one update's rows (``grpo.loss_aggregation``), normalised by the count over all
        processes, so that their averaged gradients give the mean over the whole batch (every process calls this
        once per update)."""
        mode, acc = self.cfg.grpo.loss_aggregation, self.accelerator
        count = torch.tensor(aggregation_count(mask, mode), dtype=torch.float64, device=acc.device)
        total = acc.reduce(count, reduction="sum").item() / acc.num_processes
        return aggregation_weights(mask, mode, self.policy.max_units(), total=total)

    def train_on_rollout(self, rollout: Rollout, unit_adv: torch.Tensor, on_step: Any) -> None:
        """K inner epochs over ``rollout``; one optimiser step per update; ``on_step(metrics)`` after each."""
        cfg, acc, g = self.cfg, self.accelerator, self.cfg.grpo
        device = rollout.old_logp.device
        unit_adv = unit_adv.to(device)
        mask = rollout.mask & rollout.sample_mask[:, None]
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.iteration)
        chunks = self.policy.unit_chunks(rollout)
        if g.ratio_level == "sequence" and len(chunks) > 1:
            raise ConfigError("grpo.ratio_level=sequence needs all units of a sample in one backward pass; this "
                             "policy splits them into chunks")
        onpolicy_dev = recompute_dev = sampled_logp = None
        first_devs: list[torch.Tensor] = []  # |ratio - 1| of every valid unit of the first update
        if rollout.recompute_old_logp:
            # The sampling forwards could not use the training layout, so old log-probs come from the training
            # forward: rows of the first update from that update's own forward (the policy has not moved yet, so
            # this is what a separate pass would give, without its cost), rows of later updates from a pass now.
            sampled_logp = rollout.old_logp.clone()
            later = self._micro_batches(len(rollout), None)[1:]
            self.recompute_old_logp(rollout, [rows for update in later for rows in update])
        for epoch in range(cfg.train.num_inner_epochs):
            updates = self._micro_batches(len(rollout), None if epoch == 0 else gen)
            for u, micro_batches in enumerate(updates):
                old_from_forward = sampled_logp is not None and epoch == 0 and u == 0
                rows_all = torch.cat(micro_batches)
                weights_all = self.aggregation_weights(mask[rows_all]) * rollout.unit_weight[rows_all]
                sums = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "units": 0.0}
                entropy_reported = False
                ratios, masks, clips = [], [], []
                offset = 0
                for b, rows in enumerate(micro_batches):
                    w_rows = weights_all[offset:offset + len(rows)]
                    offset += len(rows)
                    for c, units in enumerate(chunks):
                        cols = slice(None) if units is None else units
                        w, m = w_rows[:, cols], mask[rows][:, cols]
                        old, adv = rollout.old_logp[rows][:, cols], unit_adv[rows][:, cols]
                        last_pass = b == len(micro_batches) - 1 and c == len(chunks) - 1
                        with acc.autocast(), self._accumulating(last_pass):
                            out = self.policy.log_probs(rollout, rows, units, with_kl=g.kl_beta > 0,
                                                        with_entropy=True)
                            logp = out.logp.float()
                            if old_from_forward:
                                old = logp.detach()
                                block = rollout.old_logp[rows]
                                block[:, cols] = old
                                rollout.old_logp[rows] = block
                            if epoch == 0 and u == 0:  # masked samples too: the check is of the log-probs
                                valid = rollout.mask[rows][:, cols].to(logp.device)
                                first_devs.append(((logp.detach() - old).exp() - 1).abs()[valid])
                            unit_loss, ratio, clipped = self.loss_fn(
                                logp=logp, old_logp=old, advantages=adv, mask=m, clip_low=g.clip_eps,
                                clip_high=g.clip_eps_high, level=g.ratio_level)
                            if g.kl_beta > 0:
                                if out.kl is None:
                                    raise ValueError("grpo.kl_beta > 0 but the policy returned no KL")
                                kl = torch.where(m, out.kl.float(), 0.0)  # untrained units: anything, NaN too
                                unit_loss = unit_loss + g.kl_beta * kl
                                sums["kl"] += kl.detach().sum().item()
                            if out.entropy is not None:
                                sums["entropy"] += torch.where(m, out.entropy.float(), 0.0).sum().item()
                                entropy_reported = True
                            loss = (w * unit_loss).sum()
                            acc.backward(loss)
                        sums["loss"] += loss.item()
                        sums["units"] += m.sum().item()
                        ratios.append(ratio.detach().flatten())
                        masks.append(m.flatten())
                        clips.append(clipped.flatten())
                if onpolicy_dev is None:  # the first update, measured before its optimiser step
                    first = torch.cat(first_devs)
                    onpolicy_dev = first.max().item() if first.numel() else math.nan
                if sampled_logp is not None and recompute_dev is None:  # every row has its old log-prob now
                    reported = mask & sampled_logp.isfinite()  # NaN: a sampler that did not report it
                    dev = (rollout.old_logp - sampled_logp).abs()[reported]
                    recompute_dev = dev.max().item() if dev.numel() else math.nan
                # all parameters: accelerate clips FSDP's sharded gradients by their global norm only when given
                # the model's full parameter list (frozen ones have no gradient and do not count); an infinite
                # max_norm measures the norm without clipping
                max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else math.inf
                grad_norm = acc.clip_grad_norm_(self.policy.model.parameters(), max_norm)
                finite = grad_norm is None or math.isfinite(float(grad_norm))
                if finite or acc.scaler is not None:
                    # fp16's loss scaler skips a non-finite step itself, and must see it to lower its scale
                    self.optimizer.step()
                    rollout.weights_updated |= finite
                if not finite:  # the same decision on every process: the norm is global
                    self.skipped_updates += 1
                    cause = ("an fp16 overflow: the loss scale is lowered" if acc.scaler is not None else
                             "a non-finite loss: look at the rewards and advantages of this step")
                    warnings.warn(f"step {self.step + 1}: the gradient norm is {float(grad_norm)} ({cause}); the "
                                  f"update is skipped ({self.skipped_updates} so far)", RuntimeWarning, stacklevel=2)
                lr = self.optimizer.param_groups[0]["lr"]  # the lr this update used
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                if self.ema is not None:
                    self.ema.update()
                self.step += 1
                self.policy.after_optimizer_step(self.step)
                ratio, trained, clipped = torch.cat(ratios), torch.cat(masks), torch.cat(clips)
                metrics = ratio_stats(ratio, trained, clipped)  # ratio/max_dev: reduce_metrics takes the max
                # the ratio, clipping, KL and entropy of the whole batch: per-unit means over all processes' units
                # (a process with fewer trained tokens, or none, must not weigh as much as the others)
                kl_sum, entropy_sum, ratio_sum, clipped_sum, units = acc.reduce(torch.tensor(
                    [sums["kl"], sums["entropy"], ratio.detach().double()[trained].sum().item(),
                     clipped[trained].sum().item(), sums["units"]], dtype=torch.float64, device=acc.device),
                    reduction="sum").tolist()
                if units:
                    metrics.update({"ratio/mean": ratio_sum / units, "clip_frac": clipped_sum / units})
                metrics.update({
                    "loss": sums["loss"],
                    "kl": kl_sum / max(units, 1.0),
                    "ratio/onpolicy_max_dev": onpolicy_dev,
                    "lr": lr,
                    "inner_epoch": epoch,
                })
                if entropy_reported:
                    metrics["entropy"] = entropy_sum / max(units, 1.0)
                if grad_norm is not None:
                    metrics["grad_norm"] = float(grad_norm)
                if not finite:
                    metrics["train/skipped_update"] = 1.0
                if recompute_dev is not None and not math.isnan(recompute_dev):
                    metrics["logp/rollout_vs_recompute_max_dev"] = recompute_dev
                on_step(metrics)
                if self.step >= cfg.train.max_steps:
                    return

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Score one sample per held-out item (EMA weights when enabled); save them to samples/step-N, with the
        scores just logged (the main process's share).

        Held-out items are split over processes and the scores gathered, so every process must call this. Each
        score's mean is over the samples of the processes whose rewards reported it (NaN: does not apply)."""
        acc = self.accelerator
        items = self.eval_items[acc.process_index::acc.num_processes]
        held: list[RunError] = []  # a RunError is raised on every process (_stop_together)
        with self._holding(held, others_wait=self.rollout_is_collective), \
                self.ema.swapped_in() if self.ema is not None else nullcontext(), acc.autocast():
            batch = self.policy.generate(items)
        if not held:
            with self._holding(held):
                _, logged, _ = self.rewards(batch, only=self.rewards.evaluation_names)
        self._stop_together(held)
        if acc.is_main_process:
            self.policy.save_samples(batch, self.run_dir / "samples", f"step-{self.step}", scores=logged)
        # one gather of every score: the processes' rewards may report different sub-scores
        parts = gather_object([{name: scores.tolist() for name, scores in logged.items()}])
        means = {}
        for name in sorted({name for part in parts for name in part}):
            scores = torch.tensor([x for part in parts for x in part.get(name, [])], dtype=torch.float64)
            means[f"eval/{name}/mean"] = scores.nanmean().item()
        return means

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Average scalar metrics over processes (max for the *max_dev keys, over the processes that measured one:
        NaN only when none did). Processes may report different keys (a counter only one of them hit); each key is
        reduced over the processes that have it."""
        if self.accelerator.num_processes == 1:
            return metrics
        return merge_metric_rows(gather_object([metrics]))

    # ----------------------------------------------------------------------------------------- the loop
    @contextmanager
    def _stop_on_signals(self) -> Iterator[dict[str, str | None]]:
        """While open, a first SIGINT (Ctrl-C) or SIGTERM only asks the loop to stop: it finishes the step, saves
        a checkpoint and returns. A second SIGINT interrupts at once. Yields ``{"signal": name or None}``. Handlers
        can only be set in the main thread; elsewhere signals keep their usual effect."""
        asked: dict[str, str | None] = {"signal": None}
        if threading.current_thread() is not threading.main_thread():
            yield asked
            return

        def ask(signum: int, _frame: Any) -> None:
            if asked["signal"] is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            asked["signal"] = signal.Signals(signum).name
            self.accelerator.print(f"\n{asked['signal']}: stopping after this step and saving a checkpoint "
                                   "(Ctrl-C again stops at once)", flush=True)

        previous = {s: signal.signal(s, ask) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield asked
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def max_on_processes(self, value: float) -> float:
        """The largest ``value`` over the processes (every process gets the same answer)."""
        if self.accelerator.num_processes == 1:
            return value
        return self.accelerator.gather(torch.tensor([float(value)], device=self.accelerator.device)).max().item()

    def _on_any_process(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any process (every process gets the same answer)."""
        return self.max_on_processes(float(flag)) > 0

    @property
    def budget_s(self) -> float:
        """The ``train.max_minutes`` budget in seconds; 0: none."""
        return 60.0 * self.cfg.train.max_minutes

    def _budget_spent(self, seconds: float) -> bool:
        """Whether ``seconds`` of training (on the slowest process) reach the ``train.max_minutes`` budget; False
        without one. The same answer on every process."""
        return bool(self.budget_s) and self.max_on_processes(seconds) >= self.budget_s

    def _follow_budget(self, bar: tqdm) -> None:
        """With a ``train.max_minutes`` budget (nothing without one), at every ``REPLAN_EVERY`` of it, fit a decaying
        lr schedule to end with it; the progress bar's total is the step where the budget is projected to end.
        The slowest process's clock decides: every process must call this."""
        budget_s = self.budget_s
        if not budget_s:
            return
        elapsed = self.max_on_processes(self.train_seconds)
        if elapsed >= budget_s or self.step == 0 or elapsed <= 0:  # spent, or no pace to project from yet
            return
        mark = int(elapsed / (REPLAN_EVERY * budget_s))
        if mark > self._replan_mark:
            self._replan_mark = mark
            end = self.fit_schedule_to_budget(elapsed, budget_s)
            if end is not None:
                bar.write(f"step {self.step}: the lr schedule now ends at step {end}, where the time budget of "
                          f"{self.cfg.train.max_minutes:g} minutes is projected to end")
        bar.total = min(self.cfg.train.max_steps, max(self.step + 1, projected_end(self.step, elapsed, budget_s)))
        bar.refresh()

    def train(self, should_stop: Callable[[int, dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """Run to ``train.max_steps``, or until ``should_stop(step, last_row)`` returns True after an iteration
        (it must answer the same on every process). Returns the metric rows of this run (main process; empty
        elsewhere)."""
        cfg, acc = self.cfg, self.accelerator
        resume_from = checkpoint.resolve_resume(cfg.resume, self.run_dir)
        if resume_from is None:
            earlier = checkpoint.existing_run(self.run_dir)
            if earlier and not cfg.resume:
                raise ConfigError(f"bad value for 'output_dir': {self.run_dir} holds an earlier run ({earlier}); "
                                  "resume=latest continues it, and a new output_dir (or deleting this one) starts "
                                  "over")
            if cfg.resume == "latest":
                acc.print(f"no checkpoint in {self.run_dir / 'checkpoints'}: starting a fresh run")
        else:
            try:
                self.check_resumed_config(resume_from)
                step = int(checkpoint.read_state(resume_from)["step"])
            except ConfigError:
                raise
            except Exception as err:  # a torn or edited trainer_state.json or config.yaml
                raise checkpoint.unreadable(resume_from, err, self.run_dir) from err
            newer = checkpoint.newer_checkpoint(self.run_dir, step)
            if newer is not None:
                raise ConfigError(f"bad value for 'resume': {resume_from} is older than {newer} in this output_dir; "
                                  "going back would mix the two runs' metrics and checkpoints: move the newer "
                                  "checkpoints away, or resume into a new output_dir")
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        acc.wait_for_everyone()
        if resume_from is not None:
            self.load_checkpoint(resume_from)
            acc.print(f"resumed from {resume_from} at step {self.step}")
        log = None
        if acc.is_main_process:
            log = MetricsLog(self.run_dir, to_dict(cfg), cfg.logging.tensorboard, cfg.logging.wandb,
                             cfg.logging.wandb_project, resume_step=self.step if resume_from else None)
        bar = tqdm(total=cfg.train.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (cfg.logging.progress and acc.is_main_process))
        last_saved = self.step if resume_from else None
        self._plots_started, self._plot_seconds = time.perf_counter(), 0.0  # for logging.plot_max_share
        # a resumed run re-plans from the next mark it has not passed
        self._replan_mark = int(self.train_seconds / (REPLAN_EVERY * self.budget_s)) if self.budget_s else 0
        out_of_time = self._budget_spent(self.train_seconds)  # a resumed run may have spent its budget
        with self._stop_on_signals() as asked, closing(bar):
            while self.step < cfg.train.max_steps and not out_of_time:
                self._follow_budget(bar)
                t0 = time.perf_counter()
                sampler_state = self.sampler.state_dict()
                try:
                    items_idx, group_ids = self.sampler.next()
                    rollout, main, logged, t1 = self._sample_and_score(items_idx, group_ids)
                    t2 = time.perf_counter()
                    iteration_metrics = {"time/rollout_s": t1 - t0, "time/reward_s": t2 - t1}
                    if cfg.grpo.refill_rounds or cfg.grpo.oversample_prompts:  # more rounds, timed apart
                        rollout, main, logged, refill_stats = self.refill(rollout, main, logged)
                        iteration_metrics.update(refill_stats)
                        iteration_metrics["time/refill_s"] = time.perf_counter() - t2
                        t2 = time.perf_counter()
                except RunError:
                    # a reward server gone, bad data under on_bad_media=error: nothing of this step is trained
                    # yet, so keep the steps since the last checkpoint, the failed step's prompts first again on
                    # resume; saving is collective: only when every process stopped here (_stop_together)
                    if self.failure_agreed and last_saved != self.step and self.step > 0:
                        self.sampler.load_state_dict(sampler_state)
                        self.save_checkpoint()
                        acc.print(f"saved step {self.step} before stopping: resume=latest continues from there")
                    raise
                unit_adv, adv_stats = self.compute_advantages(rollout, main)
                iteration_metrics.update(self._reward_metrics(main, logged))
                iteration_metrics.update(adv_stats)
                rows: list[dict[str, float]] = []
                self.train_on_rollout(rollout, unit_adv, rows.append)
                iteration_metrics.update(rollout.counters)  # after training, which may add to them
                t3 = time.perf_counter()
                self.iteration += 1
                # the last iteration (by steps, or by the time budget: decided here, so that the time of its
                # evaluation, metrics and checkpoint cannot end the run on a step that was not evaluated) ends
                # with an evaluation too
                out_of_time = self._budget_spent(self.train_seconds + t3 - t0)
                last = self.step >= cfg.train.max_steps or out_of_time
                every = cfg.train.eval_every
                failed_eval = None
                if every and (self.step // every != (self.step - len(rows)) // every or last):
                    try:
                        rows[-1].update(self.evaluate())
                    except RunError as err:  # after training: log the steps and save them before it goes up
                        if not self.failure_agreed:
                            raise
                        failed_eval = err
                for i, row in enumerate(rows):
                    row.update(iteration_metrics)
                    row.update({"time/train_s": (t3 - t2) / len(rows), "time/step_s": (t3 - t0) / len(rows),
                                "iteration": self.iteration})
                    rows[i] = self.reduce_metrics(row)
                self._emit(rows, log, bar)
                self.train_seconds += time.perf_counter() - t0
                if failed_eval is not None:
                    self.save_checkpoint()
                    acc.print(f"saved step {self.step} before stopping: resume=latest continues from there")
                    raise failed_eval
                every = cfg.train.save_every
                if every and self.step // every != (self.step - len(rows)) // every:
                    t4 = time.perf_counter()
                    self.save_checkpoint()
                    self.train_seconds += time.perf_counter() - t4
                    last_saved = self.step
                if self._on_any_process(asked["signal"] is not None):
                    self.interrupted = asked["signal"] or "a signal to another process"
                    break
                if should_stop is not None and should_stop(self.step, rows[-1]):
                    break
            if last_saved != self.step:
                self.save_checkpoint()
        if out_of_time and self.step < cfg.train.max_steps:
            acc.print(f"time budget of {cfg.train.max_minutes:g} minutes (train.max_minutes) reached at step "
                      f"{self.step}; the lr schedule ended at step {self.schedule_warp.planned_end():.0f}")
        if self.interrupted:
            acc.print(f"stopped by {self.interrupted} at step {self.step}: saved {self.run_dir / 'checkpoints'}/"
                      f"step-{self.step}; resume=latest continues the run")
        history = []
        if acc.is_main_process:
            log.close()
            history = read_metrics(self.run_dir / "metrics.jsonl")
            plot_metrics(history, self.run_dir / "plots")
        return history

    def _reward_metrics(self, main: torch.Tensor, logged: dict[str, torch.Tensor]) -> dict[str, float]:
        """reward/mean (the weighted combination) and reward/<name>/mean for every reward and sub-score: means over
        the non-NaN scores of every process's samples (NaN when there is none), and reward/<name>/nan_frac, the
        fraction of all samples with a NaN score (every step, so its series has no gaps; the summary and the plots
        leave out a nan_frac that stays 0). A reward that returned sub-scores logs its main score, the (N, R)
        ``main`` column that enters the combination, as reward/<name>. Every process must call this."""
        mains = {name: main[:, r] for r, name in enumerate(self.rewards.names) if name not in logged}
        columns = {"reward/mean": weighted_reward(main, self.rewards.weights),
                   **{f"reward/{name}": scores for name, scores in {**mains, **logged}.items()}}
        local = {key: (v.double().nansum().item(), int((~v.isnan()).sum())) for key, v in columns.items()}
        parts = gather_object([(len(main), local)]) if self.accelerator.num_processes > 1 else [(len(main), local)]
        count = sum(n for n, _ in parts)
        out = {}
        # a sub-score that one process's rewards did not report does not apply to its samples: NaN, as in a batch
        for key in dict.fromkeys(k for _, part in parts for k in part):
            total, valid = (sum(part[key][i] for _, part in parts if key in part) for i in range(2))
            out[key if key == "reward/mean" else f"{key}/mean"] = total / valid if valid else math.nan
            if key != "reward/mean":
                out[f"{key}/nan_frac"] = 1 - valid / count if count else 0.0
        return out

    def _emit(self, rows: list[dict[str, float]], log: MetricsLog | None, bar: tqdm) -> None:
        first = self.step - len(rows) + 1
        for i, row in enumerate(rows):
            row["step"] = first + i
            if log is not None:
                log.log(row)
        if rows:
            last = rows[-1]
            bar.update(len(rows))
            bar.set_postfix(reward=f"{last['reward/mean']:.4g}", step_s=f"{last['time/step_s']:.2f}")
            logging_cfg = self.cfg.logging
            now = time.perf_counter()
            if log is not None and logging_cfg.plot_every and redraw_due(
                    first, self.step, logging_cfg.plot_every, self._plot_seconds, now - self._plots_started,
                    logging_cfg.plot_max_share):
                plot_metrics(read_metrics(log.path), self.run_dir / "plots")
                self._plot_seconds += time.perf_counter() - now

    def close(self) -> None:
        """End the run on every process: release the DDP wrapper and optimiser (they hold the process group), then
        stop the trackers and destroy the group while the interpreter is fully alive. A gloo group left to be
        destroyed at interpreter exit can abort the process. The trainer cannot train after this."""
        acc = self.accelerator
        acc.wait_for_everyone()
        self.policy.model = acc.unwrap_model(self.policy.model)
        self.optimizer = self.scheduler = None
        acc.free_memory()
        acc.end_training()

    def print_summary(self, history: list[dict[str, Any]]) -> None:
        if self.accelerator.is_main_process and history:
            print_whole(summary_table(history, f"mmgrpo run {self.run_dir}"))
