"""FlowPolicy: GRPO for flow-matching image and video generators (``pipeline: flow``).

One rollout: the rollout mode (:mod:`.modes`) plans which steps are SDE and trained -> prompts are encoded
once (cached by the adapter) -> the latents are denoised with CFG -> the final latents are decoded for the
rewards. For every trained step the rollout keeps the step's input latent, its stored next latent, the two
sigmas and the log-prob; :meth:`FlowPolicy.log_probs` replays exactly that step under grad.

On-policy exactness (ratio == 1 on the first update) holds by construction for chains of samples: every step's
transformer forwards run over consecutive-row chunks of ``train.micro_batch_size`` (the trainer's first-epoch
micro-batches, one unit per backward), with the same prompt embeddings, guidance scale, sigmas and kernel;
latents are stored in ``sampling.latent_dtype`` and the trajectory continues from the stored value, so the
training replay sees bit-for-bit the rollout's inputs. A row's output depends only on its own content, its
position and the batch size (measured on the tiny SD3: another row's content changes it by exactly 0), so
per-sample trained steps (dance_grpo, tempflow) are exact too, and a chunk holding a trained row runs whole
even where the other rows' velocities are not needed. A group with shared start noise runs the steps before its
first SDE step (TempFlow: its branch step k) on one row and expands it to the G rows there, as a tree splits.
Tree nodes (branch) are forwarded depth by depth, a layout training cannot share, so branch rollouts ask the
trainer to recompute the old log-probs in training chunking; so do rollouts that dynamic sampling's refill merged
from several rounds (:meth:`FlowPolicy.merge_groups`), whose rows were sampled in other chunks.

NFE convention: one NFE is one sample (one latent row) through the transformer once; a CFG step costs 2.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from torch import Tensor

from mmgrpo.config import ConfigError
from mmgrpo.grpo import clip_advantages, gaussian_mean_kl
from mmgrpo.policy import (
    LogProbs,
    Policy,
    Rollout,
    any_process,
    first_seed,
    hash_seed,
    merged_counters,
    rows_after_first_update,
    sample_seeds,
    sample_stems,
    score_records,
    write_sample_index,
)
from mmgrpo.rewards import RewardBatch

from . import kernels, media, schedules, tree
from .adapters import WanExperts, check_autocast, load_adapter
from .config import FlowConfig
from .data import prompt_datasets
from .modes import LinearPlan, TreePlan, build_mode, checked, sde_kernel

STATE_FILE = "flow_policy_state.json"
"""Written next to the weights by :meth:`FlowPolicy.save`: the rollout count (the iteration of window
schedules)."""


def batch_view(values: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ..., 1) broadcasting against ``like`` (B, ...)."""
    return values.reshape(-1, *([1] * (like.ndim - 1)))


class FlowPolicy(Policy):
    """The flow pipeline's :class:`~mmgrpo.policy.Policy`; ``model`` is the adapter's (LoRA-wrapped)
    transformer."""

    def __init__(self, cfg: FlowConfig, adapter: Any = None):
        """``adapter``: an already loaded adapter of ``cfg.model`` to use (e.g. shared by tests); None loads
        one."""
        self.cfg = cfg
        self.mode = build_mode(cfg)
        d = cfg.data
        # bad prompt data fails before any weights load
        self.train_items, self.held_items = prompt_datasets(d.train_prompts, d.eval_prompts, d.num_eval)
        state = PartialState()
        self.device, self.rank = state.device, state.process_index
        self.adapter = adapter if adapter is not None else self._load_adapter(cfg)
        self.model = self.adapter.transformer
        s = cfg.sampling
        self.latent_dtype = getattr(torch, s.latent_dtype)
        self.adapter.latent_shape(1, s.height, s.width, s.num_frames)  # a size the model cannot take fails here
        self.sigmas = self.adapter.sigmas(s.num_steps, s.height, s.width, s.num_frames).float()
        self.kernel = sde_kernel(s, float(self.sigmas[1]))
        self.schedule_std = self._schedule_std()
        """The noise-aware weights' normaliser: a constant of the schedule, the same on every process."""
        # noise_aware needs a noisy schedule (not noise_level or eta 0)
        checked("mode.timestep_weighting", schedules.timestep_weights, cfg.mode.timestep_weighting,
                self.schedule_std, self.schedule_std)
        self.rollouts = 0
        """Rollouts done so far: the training iteration that window schedules (mixgrpo, fast, pruning)
        follow."""

    def _load_adapter(self, cfg: FlowConfig) -> Any:
        keep_reference = cfg.grpo.kl_beta > 0 and cfg.model.lora_rank == 0
        adapter = load_adapter(cfg.model, self.device, keep_reference=keep_reference)
        if cfg.model.max_sequence_length is not None:
            if cfg.model.max_sequence_length > adapter.sequence_limit:
                raise ConfigError(f"bad value for 'model.max_sequence_length': {cfg.model.max_sequence_length} (this "
                                  f"model's text encoder takes at most {adapter.sequence_limit} tokens)")
            adapter.max_sequence_length = cfg.model.max_sequence_length  # read by its encode_prompt call
        return adapter

    def _schedule_std(self) -> Tensor:
        """(S,) fp32 transition std of each step that can be trained (the first ``mode.trainable_steps``):
        the kernel's std at the step's sigmas, which does not depend on the latents."""
        t = self.mode.trainable_steps
        zeros = torch.zeros(t, 1)
        return self.kernel(zeros, zeros, self.sigmas[:t], self.sigmas[1:t + 1], noise=zeros).std

    def setup(self, accelerator: Any) -> None:
        """Refuses ``model.dtype`` under an autocast it cannot run in (:func:`check_autocast`). Under sharded
        weights, a two-expert Wan2.2 model runs on every process the experts any process needs
        (:attr:`WanExperts.synced`): a DanceGRPO replay can need both on one process and one on another."""
        super().setup(accelerator)
        device = accelerator.device.type
        with accelerator.autocast():
            check_autocast(self.cfg.model.dtype,
                           torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        if self.sharded and isinstance(self.adapter.transformer, WanExperts):
            self.adapter.transformer.synced = any_process

    # ------------------------------------------------------------------------------------------ data, io
    def datasets(self) -> tuple[list[dict], list[dict]]:
        """(train items, held-out items) as read and checked at construction, before the model loads."""
        return self.train_items, self.held_items

    def save(self, directory: Path) -> None:
        """Trainable weights in their user-facing format (a PEFT LoRA folder that ``pipe.load_lora_weights``
        reads, or a full ``transformer`` folder) plus the rollout count."""
        state = self.sharded_state_dict()
        if not self.is_main_process:
            return
        directory.mkdir(parents=True, exist_ok=True)
        self.adapter.save_trainable(directory, transformer=self.unwrapped_model(), state_dict=state)
        (directory / STATE_FILE).write_text(json.dumps({"rollouts": self.rollouts}))

    def load(self, directory: Path) -> None:
        self.adapter.load_trainable(directory)
        state = directory / STATE_FILE
        if state.is_file():
            self.rollouts = int(json.loads(state.read_text())["rollouts"])

    def save_samples(self, batch: RewardBatch, directory: Path, tag: str, per_sample: bool = False,
                     scores: dict[str, Tensor] | None = None) -> list[Path]:
        """``tag.png``, a grid captioned with the prompts; for videos also ``tag.mp4`` (or ``tag.gif``).
        ``per_sample``: also ``tag/p000-s00.png`` (or the clip, :func:`media.save_each`) per sample and
        ``tag/index.json``, whose ``seed`` is the sample's ``meta["seed"]``: the noise seed of :meth:`generate`,
        and, given ``scores`` (reward name -> (B,) tensor, as the caller logged them), each sample's ``scores``
        (null where a reward does not apply)."""
        s = self.cfg.sampling
        files = media.save_media(directory, tag, batch.prompts, batch.images, batch.videos, s.fps)
        if per_sample:
            folder = directory / tag
            each = media.save_each(folder, sample_stems(batch.group), batch.images, batch.videos, s.fps)
            seeds = [m.get("seed") for m in batch.meta]
            columns = {} if scores is None else {"scores": score_records(scores, len(batch))}
            files.append(write_sample_index(folder, batch.prompts, batch.group, [f.name for f in each], seeds,
                                            **columns))
        return files

    # ------------------------------------------------------------------------------------- building blocks
    def _chunks(self, n: int) -> list[Tensor]:
        """Consecutive row chunks of ``train.micro_batch_size``: the trainer's first-epoch micro-batches."""
        return list(torch.arange(n).split(self.cfg.train.micro_batch_size))

    def _velocity(self, x: Tensor, sigma: Tensor, embeds: Any, replayed: bool = True,
                  uncond: Tensor | None = None) -> Tensor:
        """(n, ...) fp32 velocity of the trained transformer (``self.model``: the DDP-wrapped one), CFG
        inside. ``replayed=False`` (training never recomputes this velocity) allows ``sampling.fused_cfg``;
        ``uncond`` is the unconditional velocity of the same weights, already computed."""
        s = self.cfg.sampling
        return self.adapter.velocity(x, sigma, embeds, s.guidance_scale, transformer=self.model,
                                     fused_cfg=s.fused_cfg and not replayed, uncond=uncond)

    def _guided(self, x: Tensor, sigma: Tensor, embeds: Any, replayed: bool) -> tuple[Tensor, Tensor | None]:
        """:meth:`_velocity` and its unconditional part (None without CFG), which the first update reuses. A
        replayed velocity runs the two branches as separate forwards, as training does."""
        s = self.cfg.sampling
        if embeds.uncond is None:
            return self._velocity(x, sigma, embeds, replayed), None
        if s.fused_cfg and not replayed:
            v_cond, uncond = self.adapter.fused_cfg_velocities(x, sigma, embeds, s.guidance_scale, self.model)
            return self.adapter.guided(v_cond, uncond, sigma, s.guidance_scale), uncond
        uncond = self.adapter.unconditional_velocity(x, sigma, embeds, s.guidance_scale, self.model)
        return self._velocity(x, sigma, embeds, replayed, uncond=uncond), uncond

    def _stored(self, x: Tensor) -> Tensor:
        """``x`` round-tripped through the storage dtype: the value training will replay."""
        return x.to(self.latent_dtype).float()

    def _initial(self, n: int, generator: torch.Generator, repeat: int = 1) -> Tensor:
        s = self.cfg.sampling
        x = self.adapter.initial_latents(n, s.height, s.width, s.num_frames, generator)
        return self._stored(x.to(self.device)).repeat_interleave(repeat, dim=0)

    def _noise(self, x: Tensor, generator: torch.Generator) -> Tensor:
        return torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device)

    def _transition(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, sde: Tensor,
                    noise: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """One step of n rows: SDE rows (``sde`` (n,) bool) draw with ``noise``, the others take the Euler
        step.

        Returns the stored next latents and, per row, the log-prob of that stored value and the transition std
        (0 for ODE rows). The log-prob is computed the way :meth:`log_probs` recomputes it."""
        nxt = kernels.ode_euler_step(x, v, sigma, sigma_next)
        if not bool(sde.any()):
            zeros = torch.zeros(len(x), device=x.device)
            return self._stored(nxt), zeros, zeros
        drawn = self.kernel(x, v, sigma, sigma_next, noise=noise).prev_sample
        nxt = self._stored(torch.where(batch_view(sde, x), drawn, nxt))
        out = self.kernel(x, v, sigma, sigma_next, prev_sample=nxt)
        return nxt, torch.where(sde, out.log_prob, 0.0), torch.where(sde, out.std, 0.0)

    def _decode(self, latents: Tensor) -> Tensor:
        return torch.cat([self.adapter.decode(latents[c]).float().cpu() for c in self._chunks(len(latents))])

    def _reward_batch(self, items: list[dict], repeat: int, group: Tensor, media_out: Tensor) -> RewardBatch:
        rows = [it for it in items for _ in range(repeat)]
        key = "videos" if self.adapter.modality == "video" else "images"
        return RewardBatch(prompts=[it["prompt"] for it in rows], group=group,
                           meta=[{k: v for k, v in it.items() if k != "prompt"} for it in rows],
                           **{key: media_out})

    def _cfg_factor(self, embeds: Any) -> int:
        """Transformer forwards per velocity: 2 with classifier-free guidance (a separate uncond forward),
        else 1."""
        return 1 if embeds.uncond is None else 2

    def _seed(self, *parts: int) -> int:
        """A 32-bit seed from ``seed`` and ``parts``."""
        return hash_seed(self.cfg.seed, *parts)

    # ------------------------------------------------------------------------------------------ rollout
    def rollout(self, items: list[dict], group_ids: list[int], group_size: int) -> Rollout:
        """The rollout of training iteration ``self.rollouts`` (which window schedules follow), then the next."""
        rollout = self._rollout(items, group_ids, group_size, self.rollouts, (self.rank, self.rollouts))
        self.rollouts += 1
        return rollout

    def refill_rollout(self, items: list[dict], group_ids: list[int], group_size: int, round_index: int) -> Rollout:
        """Refill round ``round_index`` of the last rollout's iteration: its plan schedule (the same MixGRPO window
        and pruning), noise of its own."""
        iteration = self.rollouts - 1
        return self._rollout(items, group_ids, group_size, iteration, (self.rank, iteration, round_index))

    @torch.no_grad()
    def _rollout(self, items: list[dict], group_ids: list[int], group_size: int, iteration: int,
                 seed_parts: tuple[int, ...]) -> Rollout:
        """Sample ``group_size`` outputs per item under the mode's plan at ``iteration``, with noise seeded by
        ``seed_parts``."""
        generator = torch.Generator().manual_seed(self._seed(*seed_parts))
        plan = self.mode.plan(iteration, len(items), group_size, generator)
        s = self.cfg.sampling
        embeds = self.adapter.encode([it["prompt"] for it in items], s.negative_prompt, s.guidance_scale)
        group = torch.tensor(group_ids, dtype=torch.int64).repeat_interleave(group_size)
        sample = self._sample_tree if isinstance(plan, TreePlan) else self._sample_chain
        latents, data, nfe = sample(plan, embeds, group_size, generator)
        batch = self._reward_batch(items, group_size, group, self._decode(latents))
        mask = data.pop("mask")
        old_logp = data.pop("logp")
        weight = self._unit_weights(data.pop("std"), mask)
        rollout = Rollout(group=group, old_logp=old_logp, mask=mask, reward_batch=batch, data=data,
                          unit_weight=weight, recompute_old_logp=isinstance(plan, TreePlan))
        rollout.counters = self._counters(plan, nfe, self._cfg_factor(embeds))
        return rollout

    def _sample_chain(self, plan: LinearPlan, embeds: Any, group_size: int,
                      generator: torch.Generator) -> tuple[Tensor, dict[str, Any], int]:
        """Run N samples; returns (final latents, stored units, NFE). Each step's velocities come from
        :meth:`_chain_velocities`; every trained step's kernel runs on the training micro-batch chunks. A group
        that shares its prefix (:meth:`LinearPlan.shared_steps`) runs it on its first row, whose velocity every
        member takes, so the members stay identical until their first SDE step. With sharded weights every row
        runs (the members still take the first row's velocity): each process must run the same forwards, and how
        many rows a shared prefix saves differs between processes."""
        n, u = plan.train_steps.shape
        if plan.shared_noise:
            x = self._initial(n // group_size, generator, repeat=group_size)
        else:
            x = self._initial(n, generator)
        row_embeds = embeds.select(torch.arange(len(embeds)).repeat_interleave(group_size))
        unit_of = plan.unit_of()
        shared = plan.shared_steps(group_size)
        rows = torch.arange(n)
        leader = rows - rows % group_size
        store = self._unit_store(n, u, x, keep_uncond=embeds.uncond is not None)
        nfe = 0
        for i in range(plan.main_steps):
            sde = plan.sde[:, i].to(self.device)
            noise = self._noise(x, generator) if bool(sde.any()) else None
            sigma = self.sigmas[i].expand(n).to(self.device)
            sigma_next = self.sigmas[i + 1].expand(n).to(self.device)
            source = torch.where(shared > i, leader, rows)
            needed = rows if self.sharded else source.unique()
            v, uncond, ran = self._chain_velocities(x, sigma, row_embeds, unit_of[:, i] >= 0, needed)
            nfe += ran
            v = v[source]
            nxt = torch.empty_like(x)
            for c in self._chunks(n):
                nxt[c], logp, std = self._transition(x[c], v[c], sigma[c], sigma_next[c], sde[c],
                                                     None if noise is None else noise[c])
                trained = c[unit_of[c, i] >= 0]
                if len(trained):
                    k, cols = trained - c[0], unit_of[trained, i]
                    store["x"][trained, cols] = x[trained].to(self.latent_dtype)
                    store["x_next"][trained, cols] = nxt[trained].to(self.latent_dtype)
                    store["sigma"][trained, cols] = sigma[trained]
                    store["sigma_next"][trained, cols] = sigma_next[trained]
                    store["logp"][trained, cols] = logp[k]
                    store["std"][trained, cols] = std[k]
                    if uncond is not None:
                        store["v_uncond"][trained, cols] = uncond[trained].to(self.adapter.dtype)
            x = nxt
        if plan.solver_after == "dpm2":
            x, extra = self._dpm_after(x, plan, row_embeds)
            nfe += extra
        store.update(embeds=row_embeds, mask=torch.ones(n, u, dtype=torch.bool, device=self.device))
        return x, store, nfe

    def _chain_velocities(self, x: Tensor, sigma: Tensor, embeds: Any, trained: Tensor,
                          needed: Tensor) -> tuple[Tensor, Tensor | None, int]:
        """One step's velocities of N chain rows: ``x`` (N, ...), ``sigma`` (N,), ``trained`` (N,) bool (rows
        that train this step), ``needed`` (M,) int64 (rows whose velocity is used).

        A micro-batch chunk holding a trained row runs whole, CFG as separate forwards: the layout in which
        training replays it (a row's output depends on its position and the batch size). The other needed rows
        run packed into micro-batch chunks. Returns the fp32 velocities (set on those rows), the unconditional
        velocities of the replayed chunks (None without CFG) and the rows run. With sharded weights a chunk is
        replayed when it holds a trained row on any process, so that all run the same forwards."""
        v = torch.zeros_like(x)
        uncond = None
        replayed = torch.zeros(len(x), dtype=torch.bool)
        chunks = self._chunks(len(x))
        replay = torch.tensor([int(trained[c].any()) for c in chunks], device=self.device)
        if self.sharded:
            torch.distributed.all_reduce(replay, op=torch.distributed.ReduceOp.MAX)
        for c, replay_chunk in zip(chunks, replay.tolist()):
            if replay_chunk:
                v[c], part = self._guided(x[c], sigma[c], embeds.select(c), replayed=True)
                if part is not None:
                    uncond = part.new_zeros(x.shape) if uncond is None else uncond
                    uncond[c] = part
                replayed[c] = True
        rest = needed[~replayed[needed]]
        for c in rest.split(self.cfg.train.micro_batch_size) if len(rest) else ():
            v[c] = self._guided(x[c], sigma[c], embeds.select(c), replayed=False)[0]
        return v, uncond, int(replayed.sum()) + len(rest)

    def _unit_store(self, n: int, u: int, x: Tensor, keep_uncond: bool) -> dict[str, Tensor]:
        """Empty per-unit storage for n rows x u units of latents shaped like ``x`` (., ...). ``keep_uncond``
        adds ``v_uncond``, the unconditional CFG velocity at each unit in the model dtype, which the first update
        reuses: the fp32 value is kept exactly, as the transformer's output is in the model dtype (half weights run
        without autocast or under their own dtype, :func:`check_autocast`) or fp32 weights' is stored in fp32."""
        latents = {"dtype": self.latent_dtype, "device": self.device}
        floats = {"dtype": torch.float32, "device": self.device}
        shape = (n, u, *x.shape[1:])
        store = {"x": torch.zeros(shape, **latents), "x_next": torch.zeros(shape, **latents),
                 "sigma": torch.zeros(n, u, **floats), "sigma_next": torch.zeros(n, u, **floats),
                 "logp": torch.zeros(n, u, **floats), "std": torch.zeros(n, u, **floats)}
        if keep_uncond:
            store["v_uncond"] = torch.zeros(shape, dtype=self.adapter.dtype, device=self.device)
        return store

    def _dpm_after(self, x: Tensor, plan: LinearPlan, embeds: Any) -> tuple[Tensor, int]:
        """MixGRPO-Flash: DPM-Solver++(2M) from the end of the SDE window to sigma = 0 on the plan's sigma
        indices."""
        start = plan.main_steps
        idx = plan.ode_sigmas_after or tuple(range(start, plan.num_steps + 1))
        prev_x0 = prev_sigma = None
        nfe = 0
        for a, b in pairwise(idx):
            sigma = self.sigmas[a].expand(len(x)).to(self.device)
            v = self._chunked_velocity(x, sigma, embeds)
            nfe += len(x)
            x, prev_x0 = kernels.dpm_solver_2m_step(x, v, sigma, float(self.sigmas[b]), prev_x0=prev_x0,
                                                     prev_sigma=prev_sigma)
            prev_sigma = sigma
        return x, nfe

    def _chunked_guided(self, x: Tensor, sigma: Tensor, embeds: Any) -> tuple[Tensor, Tensor | None]:
        """A velocity training does not replay (Flash solver, tree nodes, evaluation) and its unconditional part
        (None without CFG), by micro-batch chunks."""
        parts = [self._guided(x[c], sigma[c], embeds.select(c), replayed=False) for c in self._chunks(len(x))]
        uncond = None if parts[0][1] is None else torch.cat([u for _, u in parts])
        return torch.cat([v for v, _ in parts]), uncond

    def _chunked_velocity(self, x: Tensor, sigma: Tensor, embeds: Any) -> Tensor:
        """:meth:`_chunked_guided` without the unconditional part."""
        return self._chunked_guided(x, sigma, embeds)[0]

    def _sample_tree(self, plan: TreePlan, embeds: Any, group_size: int,
                     generator: torch.Generator) -> tuple[Tensor, dict[str, Any], int]:
        """BranchGRPO: all nodes of a depth go through one batched forward per step (chunked by the
        micro-batch size), children of a split reuse their parent's velocity and draw their own noise. Returns
        the leaves' final latents, the units in leaf-row layout (a node's transition is owned by its first
        leaf) and the NFE."""
        b = plan.branch
        p = len(embeds)
        x = self._initial(p, generator)
        depth_embeds = [embeds.select(torch.arange(p).repeat_interleave(m)) for m in b.nodes_per_depth()]
        splits, trained = set(b.split_points), set(plan.train_steps)
        records: dict[int, tuple[Tensor, ...]] = {}
        split_logp = []
        depth = nfe = 0
        for i in range(b.num_steps):
            sigma = self.sigmas[i].expand(len(x)).to(self.device)
            v, uncond = self._chunked_guided(x, sigma, depth_embeds[depth])
            nfe += len(x)
            if i in splits:
                parents = torch.arange(len(x) * b.branch_factor, device=self.device) // b.branch_factor
                x, v, depth = x[parents], v[parents], depth + 1
                uncond = None if uncond is None else uncond[parents]
            n = len(x)
            sde = torch.full((n,), plan.sde[i], dtype=torch.bool, device=self.device)
            noise = self._noise(x, generator) if plan.sde[i] else None
            nxt, logp, std = self._transition(x, v, self.sigmas[i].expand(n).to(self.device),
                                              self.sigmas[i + 1].expand(n).to(self.device), sde, noise)
            if i in trained:
                records[i] = (x, nxt, logp, std, uncond)
            if i in splits:
                split_logp.append(logp.view(p, -1))
            x = nxt
        data = self._leaf_layout(plan, records, depth_embeds[-1])
        data.update(tree_plan=plan, split_logp=split_logp)
        return x, data, nfe

    def _leaf_layout(self, plan: TreePlan, records: dict[int, tuple[Tensor, ...]], leaf_embeds: Any) -> dict:
        """Per-node step records -> (N, U) leaf-row units: row (prompt p, leaf j) at unit u holds the
        transition of its ancestor at the unit's depth; only that node's first leaf has it in ``mask``."""
        b = plan.branch
        p = len(leaf_embeds) // b.num_leaves
        cols = {"x": [], "x_next": [], "logp": [], "std": [], "sigma": [], "sigma_next": [], "v_uncond": []}
        for step, depth in zip(plan.train_steps, plan.unit_depths()):
            x, nxt, logp, std, uncond = records[step]
            node = (torch.arange(p)[:, None] * b.branch_factor**depth + plan.ancestor(depth)).flatten()
            node = node.to(self.device)
            cols["x"].append(x[node].to(self.latent_dtype))
            cols["x_next"].append(nxt[node].to(self.latent_dtype))
            cols["logp"].append(logp[node])
            cols["std"].append(std[node])
            if uncond is not None:
                cols["v_uncond"].append(uncond[node].to(self.adapter.dtype))
            cols["sigma"].append(self.sigmas[step].expand(len(node)).to(self.device))
            cols["sigma_next"].append(self.sigmas[step + 1].expand(len(node)).to(self.device))
        n = p * b.num_leaves
        empty = torch.zeros(n, 0, device=self.device)
        uncond = cols.pop("v_uncond")
        data = {k: torch.stack(v, dim=1) if v else empty for k, v in cols.items()}
        if uncond:
            data["v_uncond"] = torch.stack(uncond, dim=1)
        data["mask"] = plan.owners().repeat(p, 1).to(self.device)
        data["embeds"] = leaf_embeds
        return data

    def _unit_weights(self, std: Tensor, mask: Tensor) -> Tensor:
        """(N, U) loss weights of ``mode.timestep_weighting`` for the trained units, from their transition std
        ``std`` (N, U) (noise_aware: over the mean std of the schedule's trainable steps, so a step's weight
        depends on the step alone, not on the rest of the rollout)."""
        weight = torch.ones_like(std)
        if mask.any():
            weight[mask] = schedules.timestep_weights(self.cfg.mode.timestep_weighting, std[mask],
                                                      self.schedule_std.to(std.device))
        return weight

    def _counters(self, plan: LinearPlan | TreePlan, nfe: int, cfg_factor: int) -> dict[str, float]:
        """NFE of sampling and the SDE steps per sample; the training counters follow once the trained units
        are final (:meth:`_train_counters`)."""
        sde_steps = sum(plan.sde) if isinstance(plan, TreePlan) else plan.sde.sum(dim=1).float().mean().item()
        return {"nfe/rollout": float(nfe * cfg_factor), "steps/sde": float(sde_steps)}

    def _train_counters(self, rollout: Rollout) -> dict[str, float]:
        """NFE of the training the trainer will run on ``rollout``, from its final mask (after width pruning;
        a tree node's transition is in the mask of one leaf only). ``log_probs`` adds placeholder forwards."""
        n, trained = len(rollout), int(rollout.mask.sum())
        cfg_factor = self._cfg_factor(rollout.data["embeds"])
        epochs, kl = self.cfg.train.num_inner_epochs, int(self.cfg.grpo.kl_beta > 0)
        t = self.cfg.train
        first = int(rollout.mask[:n - rows_after_first_update(n, t.micro_batch_size, t.updates_per_rollout)].sum())
        kept = "v_uncond" in rollout.data  # before any update, the rollout's unconditional forwards are reused
        # only rows of later updates need a separate old-log-prob pass (see Rollout)
        recompute = (trained - first) * (cfg_factor - kept) if rollout.recompute_old_logp else 0
        reused = first if kept else 0
        return {
            "nfe/train": float(trained * cfg_factor * (1 + kl) * epochs + recompute - reused),
            "nfe/train_grad": float(trained * epochs),
            "nfe/recompute": float(recompute),
            "nfe/placeholder": 0.0,
            "steps/trained": trained / n,
        }

    def merge_groups(self, rollouts: list[Rollout], rows: list[Tensor]) -> Rollout:
        """``rows[i]`` (whole groups) of each of ``rollouts``, in order, as one rollout (``grpo.refill_rounds``).

        The rollouts are rounds of one iteration, so they share the unit layout (and a tree rollout its plan):
        per-row units, embeddings and reward inputs are concatenated, and a tree keeps the split log-probs of its
        kept prompts. A row now sits elsewhere in the micro-batch chunks than where it was sampled, so the trainer
        recomputes the old log-probs (ratio exactly 1 on the first update). Counters: ``nfe/rollout`` summed over
        every rollout (the work done), the others averaged."""
        parts = [(r, i.to(r.group.device)) for r, i in zip(rollouts, rows) if len(i)]
        widths = {r.old_logp.shape[1] for r, _ in parts}
        if len(widths) > 1:
            raise ValueError(f"refill rounds of one iteration must share the unit count, got {sorted(widths)}")
        first = parts[0][0].data
        data: dict[str, Any] = {"embeds": type(first["embeds"]).cat([r.data["embeds"].select(i.cpu())
                                                                     for r, i in parts])}
        for key, value in first.items():
            if isinstance(value, Tensor):
                data[key] = torch.cat([r.data[key][i.to(r.data[key].device)] for r, i in parts])
        plan = first.get("tree_plan")
        if plan is not None:
            leaves = plan.branch.num_leaves
            prompts = [(r, (i[::leaves] // leaves).cpu()) for r, i in parts]
            data["tree_plan"] = plan
            data["split_logp"] = [torch.cat([r.data["split_logp"][k][p.to(r.data["split_logp"][k].device)]
                                             for r, p in prompts]) for k in range(len(first["split_logp"]))]

        def joined(name: str) -> Tensor:
            return torch.cat([getattr(r, name)[i] for r, i in parts])

        return Rollout(group=joined("group"), old_logp=joined("old_logp"), mask=joined("mask"),
                       reward_batch=RewardBatch.concat([r.reward_batch.select(i.tolist()) for r, i in parts]),
                       data=data, unit_weight=joined("unit_weight"),
                       counters=merged_counters(rollouts, {"nfe/rollout"}),
                       sample_mask=joined("sample_mask"), recompute_old_logp=True)

    # ------------------------------------------------------------------------------------------ training
    def max_units(self) -> int:
        """The most trained steps one sample has under the mode and schedule (:meth:`.modes.RolloutMode.max_units`): the
        constant ``seq-mean-token-sum-norm`` divides by. A rollout's width varies below it (a MixGRPO window
        reaching the deterministic last cps step, depth pruning)."""
        return self.mode.max_units()

    def unit_chunks(self, rollout: Rollout) -> list[Tensor | None]:
        """How trained steps are split into backward passes, each at most one micro-batch of transitions (the
        activation memory of one ``train.micro_batch_size`` forward).

        Chains: one step per pass (every row owns every step). Trees: consecutive steps are packed while the
        transitions a first-epoch micro-batch owns at them fit one micro-batch (a tree's node owns few
        rows), counted as the most any process owns (width pruning differs between processes), so that every
        process runs the same passes: FSDP and ZeRO-3 gather shards from all processes in every forward."""
        num_units = rollout.old_logp.shape[1]
        if "tree_plan" not in rollout.data:
            return [torch.tensor([u]) for u in range(num_units)]
        mb = self.cfg.train.micro_batch_size
        mask = rollout.mask.cpu()
        owned = torch.stack([mask[c].sum(dim=0) for c in self._chunks(len(rollout))]).max(dim=0).values
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            owned = owned.to(self.device)
            torch.distributed.all_reduce(owned, op=torch.distributed.ReduceOp.MAX)
        chunks: list[list[int]] = [[]]
        load = 0
        for u, n in enumerate(owned.tolist()):
            if chunks[-1] and load + n > mb:
                chunks.append([])
                load = 0
            chunks[-1].append(u)
            load += n
        return [torch.tensor(c) for c in chunks]

    def log_probs(self, rollout: Rollout, rows: Tensor, units: Tensor | None, with_kl: bool,
                  with_entropy: bool = False) -> LogProbs:
        """Replay the stored steps of ``rows`` at ``units`` under grad: velocity of ``self.model`` on the
        stored input latents, then the rollout's kernel scoring the stored next latents.

        All (row, step) pairs in ``rollout.mask`` go through ONE forward, in row-major order (one step of
        consecutive rows: the rollout's layout). Pairs outside the mask (tree nodes owned by another leaf,
        pruned transitions) are not computed and return 0; when none is in the mask, the first pair is
        computed anyway (its value is masked out of the loss) so that the backward has a graph and DDP sees a
        forward; it is added to the rollout's ``nfe/*`` counters. ``with_entropy`` is ignored: the Gaussian's std is
        the scheduler's, not the policy's."""
        units = torch.arange(rollout.old_logp.shape[1]) if units is None else units
        rows, units = rows.to(self.device), units.to(self.device)
        active = rollout.mask[rows][:, units]
        if not bool(active.any()):
            active = torch.zeros_like(active)
            active[0, 0] = True
            self._count_placeholder(rollout, with_kl)
        r, u = active.nonzero(as_tuple=True)
        logp, kl = self._log_prob(rollout.data, rows[r], units[u], with_kl, not rollout.weights_updated)
        out = torch.zeros(active.shape, device=self.device)
        kl = None if kl is None else out.index_put((r, u), kl)
        return LogProbs(logp=out.index_put((r, u), logp), kl=kl)

    def _count_placeholder(self, rollout: Rollout, with_kl: bool) -> None:
        """Add one placeholder transition's forwards to ``rollout.counters``: the policy's (its unconditional
        forward reused while the weights are the rollout's), the reference's with KL, and a backward under
        grad."""
        cfg_factor = self._cfg_factor(rollout.data["embeds"])
        reused = not rollout.weights_updated and "v_uncond" in rollout.data
        added = {"nfe/placeholder": 1, "nfe/train": (1 if reused else cfg_factor) + cfg_factor * int(with_kl),
                 "nfe/train_grad": int(torch.is_grad_enabled())}
        for key, value in added.items():
            rollout.counters[key] = rollout.counters.get(key, 0.0) + value

    def _log_prob(self, data: dict[str, Any], rows: Tensor, units: Tensor, with_kl: bool,
                  sampling_weights: bool) -> tuple[Tensor, Tensor | None]:
        """(log-prob, KL to the reference or None) of the stored transitions (rows[i], units[i]), each (m,)
        fp32. ``sampling_weights``: the weights have not changed since the rollout, so its stored unconditional
        velocities are this forward's (the rollout computed them on the same rows) and are reused."""
        x, nxt = data["x"][rows, units].float(), data["x_next"][rows, units].float()
        sigma, sigma_next = data["sigma"][rows, units], data["sigma_next"][rows, units]
        embeds = data["embeds"].select(rows.cpu())
        uncond = data["v_uncond"][rows, units].float() if sampling_weights and "v_uncond" in data else None
        out = self.kernel(x, self._velocity(x, sigma, embeds, uncond=uncond), sigma, sigma_next, prev_sample=nxt)
        if not with_kl:
            return out.log_prob, None
        with torch.no_grad():
            v_ref = self.adapter.reference_velocity(x, sigma, embeds, self.cfg.sampling.guidance_scale,
                                                    transformer=self.model)
            ref = self.kernel(x, v_ref, sigma, sigma_next, prev_sample=nxt)
        return out.log_prob, gaussian_mean_kl(out.mean, ref.mean, batch_view(out.kl_std, out.mean))

    def unit_advantages(self, rollout: Rollout, advantages: Tensor, rewards: Tensor) -> Tensor:
        """Chains: every unit gets its sample's advantage. Trees: each unit gets the depth-wise advantage of
        the node that owns it, from leaf rewards backed up the tree; width pruning then clears
        ``rollout.mask`` on the leaf-depth transitions of the leaves it drops. Either way the training
        counters are added to ``rollout.counters`` from the final mask."""
        plan = rollout.data.get("tree_plan")
        if plan is None:
            out = super().unit_advantages(rollout, advantages, rewards)
            rollout.counters.update(self._train_counters(rollout))
            return out
        b, g = plan.branch, self.cfg.grpo
        leaf = rewards.double().view(-1, b.num_leaves)
        fill = leaf.nanmean(dim=1, keepdim=True).nan_to_num(0.0).expand_as(leaf)
        leaf = torch.where(leaf.isnan(), fill, leaf)
        child = [lp.double().cpu() for lp in rollout.data["split_logp"]] if plan.backup == "prob" else None
        levels = tree.backup_rewards(leaf, b, plan.backup, child)
        node_adv = [clip_advantages(a, g.adv_clip) for a in tree.depthwise_advantages(levels, g.adv_eps)]
        out = torch.zeros_like(rollout.old_logp)
        for u, depth in enumerate(plan.unit_depths()):
            out[:, u] = node_adv[depth][:, plan.ancestor(depth)].flatten().to(out)
        if plan.width_keep < 1:
            keep = tree.width_prune(node_adv[b.depth], plan.width_keep).flatten().to(rollout.mask.device)
            leaf_units = torch.tensor([d == b.depth for d in plan.unit_depths()], device=rollout.mask.device)
            rollout.mask &= ~leaf_units | keep[:, None]
        rollout.counters.update(self._train_counters(rollout))
        return out

    # ------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def generate(self, items: list[dict], per_prompt: int = 1) -> RewardBatch:
        """``per_prompt`` (K) deterministic Euler-ODE samples per item with ``sampling.eval_num_steps`` steps, the
        K of item i consecutive with group id i. Sample k starts from noise seeded by
        ``sample_seeds(first_seed(item, seed), K)[k]`` (sample 0: ``seed`` and the prompt, or the item's ``seed``
        key), so it does not depend on the batch or on K. Each sample's ``meta["seed"]`` is its noise seed."""
        s = self.cfg.sampling
        rows = [{**it, "seed": seed} for it in items for seed in sample_seeds(first_seed(it, self.cfg.seed), per_prompt)]
        sigmas = self.adapter.sigmas(s.eval_num_steps, s.height, s.width, s.num_frames).float()
        embeds = self.adapter.encode([row["prompt"] for row in rows], s.negative_prompt, s.guidance_scale)
        x = torch.cat([self._initial(1, torch.Generator().manual_seed(row["seed"])) for row in rows])
        for i in range(s.eval_num_steps):
            sigma = sigmas[i].expand(len(x)).to(self.device)
            v = self._chunked_velocity(x, sigma, embeds)
            x = kernels.ode_euler_step(x, v, sigma, float(sigmas[i + 1]))
        group = torch.arange(len(items)).repeat_interleave(per_prompt)
        return self._reward_batch(rows, 1, group, self._decode(x))
