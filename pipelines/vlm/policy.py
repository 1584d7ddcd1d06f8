"""The VLM / video reasoning GRPO policy (``pipeline: vlm``).

One rollout, per prompt: decode its images and videos once (:class:`MediaCache`, cleared every rollout), encode the
prompt once (and keep it for later rollouts within ``data.prompt_cache_mb``: :class:`PromptCache`), sample G completions with the prefill shared across the group and the groups of a rollout decoded
together (:func:`generate_groups`), and, with T-GRPO, G' more on shuffled frames that are scored but never trained
(:mod:`.tgrpo`). Old log-probs are then computed by :func:`token_logprobs_and_entropy`, the training forward (Prefix Grouper
included when it is on), in the training chunking (consecutive rows in ``train.micro_batch_size`` chunks), so the
first ratio is exactly 1.

A unit is a completion token: a rollout of N = prompts x G rows has (N, L) log-probs, L the longest completion.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState

from mmgrpo.config import ConfigError, check_ranges
from mmgrpo.ema import EMA
from mmgrpo.errors import RunError
from mmgrpo.grpo import kl_estimate
from mmgrpo.pipelines.vlm import care, tgrpo
from mmgrpo.pipelines.vlm.config import VLMConfig
from mmgrpo.pipelines.vlm.data import (
    DATA_PROBLEM_TYPES,
    VLMSample,
    chat_content,
    read_samples,
    read_task_split,
    render_prompt,
    reward_meta,
)
from mmgrpo.pipelines.vlm.generation import generate_groups, scoring_temperature
from mmgrpo.pipelines.vlm.logprobs import BLOCK_MASK_ATTENTION, token_logprobs_and_entropy
from mmgrpo.pipelines.vlm.model import VLMModel, check_attention
from mmgrpo.pipelines.vlm.prompt_cache import PromptCache
from mmgrpo.pipelines.vlm.video import MediaCache, MediaError, check_video_config
from mmgrpo.pipelines.vlm.vision_calls import VisionCallBalancer, calls_to_balance
from mmgrpo.pipelines.vlm.vllm_backend import (
    VLLMSampler,
    backend_unavailable,
    media_limits,
)
from mmgrpo.pipelines.vlm.vllm_backend import shuffled_accuracy as vllm_shuffled_accuracy
from mmgrpo.pipelines.vlm.whole_weights import whole_weights
from mmgrpo.policy import (
    LogProbs,
    Policy,
    Rollout,
    any_process,
    first_seed,
    merged_counters,
    sample_seeds,
    score_records,
    write_sample_index,
)
from mmgrpo.rewards import RewardBatch, RewardZoo
from mmgrpo.rewards.consistency_bonus import LIKELIHOOD_KEY
from mmgrpo.rewards.temporal_bonus import SHUFFLED_ACC_KEY
from mmgrpo.rewards.zoo import RewardError

BAD_MEDIA_POLICIES = ("skip", "error")
MEDIA_TYPES = ("image", "video", "text")
SKIP_COUNTERS = ("data/skipped_media", "data/skipped_too_long", "data/replaced")
"""Counters every rollout logs: items skipped for bad media or an over-long prompt, and replacements drawn."""
REPLACEMENT_DRAWS = 64
"""Random training items tried in place of one that is skipped before the rollout gives up."""


class PromptTooLong(ValueError):
    """A prompt whose text plus vision tokens exceed ``data.max_prompt_tokens``."""


class BadItem(RunError):
    """An item that cannot be rolled out while ``data.on_bad_media`` is ``error``."""


@dataclass
class Prepared:
    """One prompt ready to sample: its item, decoded media and batch-1 model inputs (``VLMModel.prompt_inputs``)."""

    item: dict
    inputs: dict[str, torch.Tensor]
    images: list[torch.Tensor] = field(default_factory=list)
    """(3,H,W) uint8."""
    videos: list[torch.Tensor] = field(default_factory=list)
    """(T,3,H,W) uint8."""
    fps: list[float] = field(default_factory=list)
    """Sampled fps of each video."""

    def meta(self) -> dict[str, Any]:
        """Reward meta: ground truth and problem type (:func:`reward_meta`) plus the inputs the model saw (the
        decoded media, shared, not copied): ``image_paths`` / ``video_paths`` (absolute, as str), ``images``
        ((3,H,W) uint8), ``videos`` ((T,3,H,W) uint8), ``video_fps`` (sampled frames per second) and ``frames``
        (video frames in all). uint8, as decoded: float copies would hold 4x the memory over a held-out set."""
        sample = self.item.get("sample")
        meta = reward_meta(sample) if sample is not None else {}
        images, videos = (sample.images, sample.videos) if sample is not None else ([], [])
        meta.update(image_paths=[str(p) for p in images], video_paths=[str(p) for p in videos],
                    images=list(self.images), videos=list(self.videos),
                    video_fps=list(self.fps), frames=sum(v.shape[0] for v in self.videos))
        return meta


def prepared_tensors(prepared: Prepared) -> list[torch.Tensor]:
    """The tensors a :class:`Prepared` holds: its model inputs and decoded media."""
    return [*prepared.inputs.values(), *prepared.images, *prepared.videos]


def item_source(item: dict) -> str:
    """``file:line`` of the item's sample, or ``prompt`` for a free prompt (``mmgrpo sample --prompt``)."""
    sample = item.get("sample")
    return sample.source if sample is not None else "prompt"


def media_type(sample: VLMSample) -> str:
    """``video`` (has a video), ``image`` (images only) or ``text`` (no media)."""
    return "video" if sample.videos else "image" if sample.images else "text"


def check_free_prompt(prompt: str) -> None:
    """BadItem (one line) when a free prompt (``mmgrpo sample --prompt``), which has no images or videos, holds an
    ``<image>`` or ``<video>`` marker that no medium can fill (:func:`chat_content`)."""
    try:
        chat_content(prompt, 0, 0)
    except ValueError as err:
        raise BadItem(f"--prompt {prompt!r}: {err}; a free prompt has no images or videos") from err


def check_tgrpo_in_step(samples: list[VLMSample]) -> None:
    """ConfigError when T-GRPO must decode in step (sharded weights not gathered for sampling: ZeRO-3, or FSDP2
    with ``generation.gather_sharded_weights: false``) on training ``samples`` that mix video prompts with others.
    T-GRPO samples shuffled frames once per video prompt, so processes holding different numbers of video prompts
    would run different numbers of forwards, whose weight gathers would never match: the run would hang."""
    if len({media_type(sample) == "video" for sample in samples}) > 1:
        raise ConfigError("bad value for 'tgrpo.enabled': T-GRPO samples shuffled frames once per video prompt, "
                          "and with sharded weights decoded in step (ZeRO-3, or FSDP2 with "
                          "'generation.gather_sharded_weights: false') every process must sample as often; this "
                          "training data mixes video prompts with others: use FSDP2 with "
                          "'generation.gather_sharded_weights: true' (the default), or video prompts only")


def check_config(cfg: VLMConfig, runnable_here: bool = True) -> None:
    """Raise ConfigError naming the key of a value the vlm policy cannot run with. ``VLMConfig.validate`` runs it
    when the config loads; with ``runnable_here`` (when the policy is built) it also checks that the rollout
    backend can run on this machine (vLLM needs its package and a CUDA GPU)."""
    check_ranges(cfg)
    gen = cfg.generation
    if gen.backend == "vllm":
        reason = backend_unavailable() if runnable_here else None
        if reason is not None:
            raise ConfigError(f"bad value 'vllm' for 'generation.backend': the vLLM rollout backend is not "
                              f"available here: {reason}; use 'hf'")
    elif gen.backend != "hf":
        raise ConfigError(f"bad value '{gen.backend}' for 'generation.backend': expected hf or vllm")
    if cfg.data.on_bad_media not in BAD_MEDIA_POLICIES:
        raise ConfigError(f"bad value '{cfg.data.on_bad_media}' for 'data.on_bad_media': expected one of "
                          f"{', '.join(BAD_MEDIA_POLICIES)}")
    unknown = set(cfg.data.media_types) - set(MEDIA_TYPES)
    if unknown:
        raise ConfigError(f"bad value {sorted(unknown)} for 'data.media_types': expected some of "
                          f"{', '.join(MEDIA_TYPES)}")
    unknown = sorted(set(cfg.data.type_instructions) - set(DATA_PROBLEM_TYPES))
    if unknown:
        raise ConfigError(f"bad value for 'data.type_instructions': {unknown} are not problem types; expected some "
                          f"of {', '.join(DATA_PROBLEM_TYPES)}")
    check_attention(cfg.model.attn_implementation)
    if cfg.prefix_grouper and cfg.model.attn_implementation not in BLOCK_MASK_ATTENTION:
        raise ConfigError(f"prefix_grouper needs a block attention mask, which {cfg.model.attn_implementation} "
                          "cannot take: set 'model.attn_implementation' to sdpa (its memory-efficient kernel takes "
                          "the mask) or prefix_grouper=false")
    check_video_config(cfg.video)
    care.bonus_spec(cfg)


class VLMPolicy(Policy):
    """GRPO policy over a Qwen2-VL-family model (see the module docstring). ``model`` is ``vlm.model``."""

    def __init__(self, cfg: VLMConfig):
        check_config(cfg)
        self.cfg = cfg
        self.accuracy = tgrpo.accuracy_reward(cfg)
        """T-GRPO's scorer of the shuffled-frame answers; None when T-GRPO is off."""
        self.train_items, self.held_items = self._read_datasets()  # bad data fails before any weights load
        keep_reference = cfg.grpo.kl_beta > 0 and cfg.model.lora_rank == 0
        self.vlm = VLMModel(cfg.model, PartialState().device, keep_reference=keep_reference)
        if cfg.video.size_factor != self.vlm.size_factor:
            raise ConfigError(f"video.size_factor: {cfg.video.size_factor} px does not match {cfg.model.path}, whose "
                              f"vision tokens cover {self.vlm.size_factor} px (patch x merge): set "
                              f"video.size_factor={self.vlm.size_factor}")
        if cfg.video.frame_multiple % self.vlm.temporal_patch_size:  # Qwen2-VL would pad, Qwen3-VL refuses 1 frame
            raise ConfigError(f"video.frame_multiple: {cfg.video.frame_multiple} is not a multiple of the "
                              f"{self.vlm.temporal_patch_size} frames {cfg.model.path} merges per temporal patch: "
                              f"set video.frame_multiple={self.vlm.temporal_patch_size}")
        self.model = self.vlm.model
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.care_reference = EMA(trainable, cfg.care.ema_decay, "cpu" if cfg.care.offload else None) \
            if cfg.care.enabled else None
        """GRPO-CARE's reference (:mod:`.care`): an EMA of the trainable weights, swapped in to score answers."""
        # generation.backend: vllm -> training rollouts sample through a colocated engine, built at the first rollout
        self.sampler = VLLMSampler(cfg, self.vlm, media_limits(self.train_items)) \
            if cfg.generation.backend == "vllm" else None
        self.cache = MediaCache()
        self.prompts: PromptCache[Prepared] = PromptCache(int(cfg.data.prompt_cache_mb * 2**20), prepared_tensors)
        self._bad: dict[str, str] = {}
        """Source of every item found bad -> the counter it is reported under."""
        self._zoo: RewardZoo | None = None
        self.synced: Callable[[bool], bool] | None = None
        """:func:`~mmgrpo.policy.any_process` when the parameters are sharded (set by :meth:`setup`): decoding
        goes on in step, unless :meth:`sampling_weights` gathers the whole weights."""
        self.vision_balancer: VisionCallBalancer | None = None
        """Set by :meth:`setup` when the parameters are sharded and the data mixes media kinds."""
        self.reshard_after_forward: bool | None = None
        """The accelerate FSDP2 config's ``reshard_after_forward`` when sampling gathers the whole weights
        (``generation.gather_sharded_weights``; set by :meth:`setup`), else None."""

    # ------------------------------------------------------------------------------------------------ data
    def datasets(self) -> tuple[list[dict], list[dict]]:
        """(train items, held-out items) as read and checked at construction (:meth:`_read_datasets`)."""
        return self.train_items, self.held_items

    def _read_datasets(self) -> tuple[list[dict], list[dict]]:
        """Items ``{"prompt", "sample"}`` from ``data.train_file`` and ``data.eval_file`` (or the last
        ``data.num_eval`` training samples); held-out items are capped at ``data.num_eval``."""
        d = self.cfg.data
        train = self._read(d.train_file, "train")
        if d.eval_file is not None:
            held = self._read(d.eval_file, "heldout")[:d.num_eval]
        else:
            if d.num_eval >= len(train):
                raise ConfigError(f"bad value for 'data.num_eval': holding out {d.num_eval} of the {len(train)} "
                                  f"samples of {d.train_file} leaves none to train on (or set data.eval_file)")
            train, held = train[:len(train) - d.num_eval], train[len(train) - d.num_eval:]
        return [self._item(s) for s in train], [self._item(s) for s in held]

    def read_items(self, path: str) -> list[dict]:
        """Items of another file (or ``task:...`` source, read as a held-out split) in the preset's data format,
        e.g. a validation set."""
        return [self._item(s) for s in self._read(path, "heldout")]

    def _read(self, path: str, split: str) -> list[VLMSample]:
        """The samples of ``path`` (a file, or ``task:...`` generating ``split``) whose kind is in
        ``data.media_types``; none left is a ConfigError."""
        d = self.cfg.data
        if path.startswith("task:"):
            train = split == "train"
            loaded = read_task_split(path, split, d.task_items if train else None, d.task_start if train else 0,
                                     d.task_cache, "data.train_file" if train else "data.eval_file", d.num_eval)
        else:
            loaded = read_samples(path, d.root)
        kinds = d.media_types
        samples = [s for s in loaded if media_type(s) in kinds]
        if not samples:
            raise ConfigError(f"bad value for 'data.media_types': {path} has no samples of kinds {list(kinds)}")
        return samples

    def _item(self, sample: VLMSample) -> dict:
        """``{"prompt": the rendered prompt (:func:`render_prompt`), "sample": sample}``."""
        d = self.cfg.data
        return {"prompt": render_prompt(sample, d.prompt_template, d.type_instructions), "sample": sample}

    def _prepare(self, item: dict) -> Prepared:
        """Decode the item's media (through the per-rollout cache) and encode its prompt. Raises MediaError or
        PromptTooLong."""
        sample = item.get("sample")
        images = [self.cache.get_image(p, self.cfg.video) for p in sample.images] if sample is not None else []
        decoded = [self.cache.get_video(p, self.cfg.video) for p in sample.videos] if sample is not None else []
        videos, fps = [v for v, _ in decoded], [f for _, f in decoded]
        inputs = self.vlm.prompt_inputs(item["prompt"], images, videos, fps)
        length = inputs["input_ids"].shape[1]
        if length > self.cfg.data.max_prompt_tokens:
            raise PromptTooLong(f"the prompt has {length} tokens (text + vision), over data.max_prompt_tokens = "
                                f"{self.cfg.data.max_prompt_tokens}")
        return Prepared(item, inputs, images, videos, fps)

    def _try_prepare(self, item: dict, counters: dict[str, float]) -> Prepared | None:
        """:meth:`_prepare`, or None for a bad item, which is counted (``data/skipped_media``,
        ``data/skipped_too_long``) and warned about; with ``data.on_bad_media: error`` it raises BadItem instead."""
        source = item_source(item)
        if source in self._bad:
            counters[self._bad[source]] += 1
            return None
        try:
            return self.prompts.get((source, item["prompt"]), lambda: self._prepare(item))
        except (MediaError, PromptTooLong) as err:
            key = "data/skipped_media" if isinstance(err, MediaError) else "data/skipped_too_long"
            if self.cfg.data.on_bad_media == "error":
                raise BadItem(f"{source}: {err} (data.on_bad_media is 'error'; 'skip' counts and skips such "
                              f"items)") from err
            warnings.warn(f"skipping {source}: {err}", stacklevel=2)
            if "sample" in item:  # free prompts share one source name; only dataset items are remembered
                self._bad[source] = key
            counters[key] += 1
            return None

    def _prepare_rollout(self, items: list[dict], counters: dict[str, float],
                         generator: torch.Generator) -> list[Prepared]:
        """One Prepared per item; a skipped item is replaced by a random valid training item, so the groups and
        the number of rows per process stay the same."""
        out = []
        for item in items:
            prepared = self._try_prepare(item, counters)
            draws = 0
            while prepared is None:
                if draws == REPLACEMENT_DRAWS or not self.train_items:
                    raise RunError(f"no valid training item found in {draws} random draws to replace a skipped "
                                       f"one; {len(self._bad)} items are bad so far (see the warnings)")
                index = int(torch.randint(len(self.train_items), (1,), generator=generator))
                prepared = self._try_prepare(self.train_items[index], counters)
                draws += 1
                counters["data/replaced"] += prepared is not None
            out.append(prepared)
        return out

    # ------------------------------------------------------------------------------------------------ rollout
    def _generators(self) -> tuple[torch.Generator, torch.Generator]:
        """(sampling generator on the model device, CPU generator) seeded from the global RNG, so a resumed run
        (accelerate restores the global RNG) samples the same."""
        seed = int(torch.randint(0, 2**62, (1,)))
        device = self.vlm.device
        return torch.Generator(device=device).manual_seed(seed), torch.Generator().manual_seed(seed + 1)

    def _logprobs(self, module: torch.nn.Module, data: dict[str, Any], rows: torch.Tensor,
                  entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(n, L) fp32 log-probs of rollout ``rows`` under ``module``, the forward trimmed to their longest
        completion (so the same rows give the same forward in every pass), and with ``entropy`` the (n, L) entropy
        of the sampling distribution at each token (:func:`token_logprobs_and_entropy`), else None."""
        rows = rows.to(data["ids"].device)
        index = data["prompt_index"][rows]
        used, local = index.unique(return_inverse=True)
        mask = data["mask"][rows]
        width = max(int(mask.sum(1).max()), 1)
        logp, ent = token_logprobs_and_entropy(
            module, [data["prompts"][j] for j in used.tolist()], data["ids"][rows, :width], mask[:, :width], local,
            self.cfg.prefix_grouper, scoring_temperature(self.cfg.generation), entropy)
        pad = (0, data["ids"].shape[1] - width)
        return torch.nn.functional.pad(logp, pad), None if ent is None else torch.nn.functional.pad(ent, pad)

    def rollout(self, items: list[dict], group_ids: list[int], group_size: int) -> Rollout:
        """G completions per item (plus T-GRPO's shuffled ones), rewards' batch, and the sampler's log-probs (the
        trainer takes the old log-probs from the training forward: ``recompute_old_logp``)."""
        cfg = self.cfg
        self.cache.clear()
        counters: dict[str, float] = defaultdict(float, dict.fromkeys(SKIP_COUNTERS, 0.0))
        generator, cpu_generator = self._generators()
        prepared = self._prepare_rollout(items, counters, cpu_generator)
        shuffled_count = cfg.tgrpo.shuffled_group_size or group_size
        ids, masks, sampled, truncated, texts, meta, prompts = [], [], [], [], [], [], []
        ordered_acc, shuffled_acc = [], []
        rollout_tokens = 0
        shuffled = None  # T-GRPO results of the vLLM backend, by prompt index
        # one gather of the whole weights for all of the rollout's sampling under FSDP2 (else synced decoding)
        with self.sampling_weights() as synced:
            if self.sampler is not None:  # vLLM: weights pushed if they changed, then one engine call
                self.sampler.sync_weights(self.model)
                completions = self.sampler.generate(prepared, group_size, cfg.generation, generator)
                if self.accuracy is not None:
                    shuffled = vllm_shuffled_accuracy(self.sampler, prepared, shuffled_count, cfg.generation,
                                                      self.accuracy, generator, cpu_generator)
                self.sampler.sleep()
            else:
                completions = generate_groups(self.vlm, [p.inputs for p in prepared], group_size, cfg.generation,
                                              generator, synced)
            for i, (p, out) in enumerate(zip(prepared, completions)):
                rollout_tokens += int(out.mask.sum())
                base = p.meta()
                if self.accuracy is not None and p.videos:
                    if shuffled is not None:
                        acc, tokens = shuffled[i]
                    else:
                        acc, tokens = tgrpo.shuffled_accuracy(self.vlm, p.item["prompt"], p.images, p.videos, p.fps,
                                                              base, shuffled_count, cfg, self.accuracy, generator,
                                                              cpu_generator, synced)
                    rollout_tokens += tokens
                    counters["tokens/shuffled"] += tokens
                    base[SHUFFLED_ACC_KEY] = acc
                    shuffled_acc.append(acc)
                    scored = RewardBatch(prompts=[p.item["prompt"]] * group_size, completions=out.texts,
                                         group=torch.zeros(group_size, dtype=torch.long), meta=[base] * group_size)
                    ordered_acc.append(torch.as_tensor(self.accuracy(scored), dtype=torch.float64).nanmean().item())
                ids.append(out.ids)
                masks.append(out.mask)
                sampled.append(out.logprobs)
                truncated.append(out.truncated)
                texts += out.texts
                meta += [{**base, "truncated": bool(t)} for t in out.truncated.tolist()]
                prompts.append(p.inputs)

        n = len(texts)
        width = max(x.shape[1] for x in ids)
        all_ids = torch.full((n, width), self.vlm.pad_token_id, dtype=torch.long, device=self.vlm.device)
        all_mask = torch.zeros(n, width, dtype=torch.bool, device=self.vlm.device)
        # the sampler's log-probs (KV-cache decoding, or vLLM's; NaN where not reported): the trainer replaces them
        # by the training forward's (recompute_old_logp), so the first ratio is exactly 1, and logs how far they were
        old = torch.zeros(n, width, device=self.vlm.device)
        row = 0
        for x, m, lp in zip(ids, masks, sampled):
            all_ids[row:row + len(x), :x.shape[1]] = x
            all_mask[row:row + len(x), :x.shape[1]] = m
            old[row:row + len(x), :x.shape[1]] = lp
            row += len(x)
        all_truncated = torch.cat(truncated).to(self.vlm.device)
        prompt_index = torch.arange(len(prepared), device=self.vlm.device).repeat_interleave(group_size)
        data = {"prompts": prompts, "ids": all_ids, "mask": all_mask, "prompt_index": prompt_index}
        trained = all_mask & ~all_truncated[:, None] if cfg.generation.mask_truncated else all_mask
        counters.update(self._token_counters(data, all_truncated, rollout_tokens))
        if self.care_reference is not None:
            likelihood = self._answer_likelihoods(data)
            for m, value in zip(meta, likelihood.tolist()):
                m[LIKELIHOOD_KEY] = value
            found = ~likelihood.isnan()
            counters["care/answer_found_frac"] = found.double().mean().item()
            counters["care/answer_likelihood"] = likelihood[found].mean().item() if found.any() else math.nan
        if self.sampler is not None:
            counters.update(self.sampler.rollout_counters())
        if self.accuracy is not None:
            counters["tgrpo/video_groups"] = float(len(shuffled_acc))
            counters.update(tgrpo.temporal_counters(ordered_acc, shuffled_acc, cfg.tgrpo.mu))
        group = torch.tensor(group_ids, dtype=torch.long).repeat_interleave(group_size)
        batch = RewardBatch(prompts=[p.item["prompt"] for p in prepared for _ in range(group_size)],
                            group=group, completions=texts, meta=meta)
        return Rollout(group=group.to(self.vlm.device), old_logp=old, mask=trained, reward_batch=batch, data=data,
                       counters=dict(counters), recompute_old_logp=True)

    def merge_groups(self, rollouts: list[Rollout], rows: list[torch.Tensor]) -> Rollout:
        """``rows[i]`` (whole groups) of each of ``rollouts``, in order, as one rollout (``grpo.refill_rounds``):
        their prompts, completions (right-padded to the longest) and meta. Counters: the ``tokens/*`` of the merged
        batch, work counters (``tokens/rollout``, ``tokens/shuffled``, ``data/*``, ``tgrpo/video_groups``) summed
        over every rollout, the other rates averaged over them."""
        parts = [(r, i.to(r.group.device)) for r, i in zip(rollouts, rows) if len(i)]
        width = max(r.data["ids"].shape[1] for r, _ in parts)
        device = parts[0][0].group.device

        def padded(t: torch.Tensor, value: float | bool) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        prompts, index, ids, masks, old, trained, batches = [], [], [], [], [], [], []
        for r, i in parts:
            used, local = r.data["prompt_index"][i].unique(return_inverse=True)
            index.append(local + len(prompts))
            prompts += [r.data["prompts"][j] for j in used.tolist()]
            ids.append(padded(r.data["ids"][i], self.vlm.pad_token_id))
            masks.append(padded(r.data["mask"][i], False))
            old.append(padded(r.old_logp[i], 0.0))
            trained.append(padded(r.mask[i], False))
            batches.append(r.reward_batch.select(i.tolist()))
        data = {"prompts": prompts, "ids": torch.cat(ids), "mask": torch.cat(masks),
                "prompt_index": torch.cat(index).to(device)}
        work = {"tokens/rollout", "tokens/shuffled", "tgrpo/video_groups", *SKIP_COUNTERS}
        counters = merged_counters(rollouts, work)
        batch = RewardBatch.concat(batches)
        truncated = torch.tensor([bool(m["truncated"]) for m in batch.meta])
        counters.update({k: v for k, v in self._token_counters(data, truncated, 0).items() if k != "tokens/rollout"})
        return Rollout(group=torch.cat([r.group[i] for r, i in parts]), old_logp=torch.cat(old),
                       mask=torch.cat(trained), reward_batch=batch, data=data, counters=counters,
                       sample_mask=torch.cat([r.sample_mask[i] for r, i in parts]), recompute_old_logp=True)

    @torch.no_grad()
    def _answer_likelihoods(self, data: dict[str, Any]) -> torch.Tensor:
        """(N,) float64 GRPO-CARE answer likelihoods of a rollout's completions (:func:`care.answer_likelihood`)
        under the EMA reference, through the training forward in ``train.micro_batch_size`` chunks."""
        model = self.unwrapped_model()
        with self.care_reference.swapped_in():
            logp = torch.cat([self._logprobs(model, data, rows)[0] for rows in
                              torch.arange(len(data["ids"])).split(self.cfg.train.micro_batch_size)])
        answer = care.answer_token_mask(self.vlm.tokenizer, data["ids"], data["mask"]).to(logp.device)
        return care.answer_likelihood(logp, answer).cpu()

    def after_optimizer_step(self, step: int) -> None:
        """Move the GRPO-CARE reference toward the policy every ``care.update_every`` optimiser steps."""
        if self.care_reference is not None and step % self.cfg.care.update_every == 0:
            self.care_reference.update()

    def training_state(self) -> dict[str, torch.Tensor]:
        """The GRPO-CARE reference's weights (trainable parameter name -> fp32 tensor), if CARE is on."""
        return self.care_reference.state_dict() if self.care_reference is not None else {}

    def load_training_state(self, state: dict[str, torch.Tensor]) -> None:
        self.care_reference.load_state_dict(state)

    def restart_training_state(self) -> None:
        """GRPO-CARE turned on at this resume: its reference starts from the restored weights."""
        if self.care_reference is not None:
            self.care_reference.restart()

    def max_units(self) -> int:
        """``generation.max_new_tokens``: a rollout's width is its longest completion, which varies."""
        return self.cfg.generation.max_new_tokens

    def _token_counters(self, data: dict[str, Any], truncated: torch.Tensor, rollout_tokens: int) -> dict:
        """``tokens/*``: prompt tokens and vision tokens (image and video tokens, one per merged patch, without the
        markers around them) per prompt, completion lengths, the truncated fraction, tokens sampled in the rollout,
        and tokens one training pass forwards (``tokens/train``, which the Prefix Grouper shrinks: each prompt once
        per micro-batch instead of once per completion)."""
        vision_ids = torch.tensor(self.vlm.media_token_ids, device=self.vlm.device)
        prompt_len = [p["input_ids"].shape[1] for p in data["prompts"]]
        vision = [int(torch.isin(p["input_ids"], vision_ids).sum()) for p in data["prompts"]]
        lengths = data["mask"].sum(1)
        train = 0
        for chunk in torch.arange(len(lengths)).split(self.cfg.train.micro_batch_size):
            chunk = chunk.to(lengths.device)
            used = data["prompt_index"][chunk].unique().tolist()
            if self.cfg.prefix_grouper:
                train += sum(prompt_len[j] for j in used) + int(lengths[chunk].sum())
            else:
                train += len(chunk) * (max(prompt_len[j] for j in used) + int(lengths[chunk].max()))
        return {"tokens/prompt": sum(prompt_len) / len(prompt_len), "tokens/vision": sum(vision) / len(vision),
                "tokens/completion": lengths.float().mean().item(), "tokens/completion_max": float(lengths.max()),
                "tokens/truncated_frac": truncated.float().mean().item(), "tokens/rollout": float(rollout_tokens),
                "tokens/train": float(train)}

    # ------------------------------------------------------------------------------------------------ training
    def log_probs(self, rollout: Rollout, rows: torch.Tensor, units: torch.Tensor | None,
                  with_kl: bool, with_entropy: bool = False) -> LogProbs:
        """Token log-probs of ``rows`` under grad with the pixel inputs; with ``with_kl``, the per-token KL
        (``grpo.kl_estimator``) to the reference (adapter disabled for LoRA, the frozen copy otherwise) computed
        with the same forward path under no_grad; with ``with_entropy``, the sampling distribution's entropy from
        the same forward."""
        logp, entropy = self._logprobs(self.model, rollout.data, rows, entropy=with_entropy)
        kl = None
        if with_kl:
            with torch.no_grad(), self.vlm.reference() as reference:
                ref, _ = self._logprobs(reference, rollout.data, rows)
            kl = kl_estimate(logp, ref, self.cfg.grpo.kl_estimator)
        if units is not None:
            units = units.to(logp.device)
            logp = logp[:, units]
            entropy = None if entropy is None else entropy[:, units]
            kl = None if kl is None else kl[:, units]
        return LogProbs(logp=logp, kl=kl, entropy=entropy)

    # ------------------------------------------------------------------------------------------------ eval
    def generate(self, items: list[dict], per_prompt: int = 1) -> RewardBatch:
        """One completion per item at ``generation.eval_temperature`` (0: greedy). Items without a ``sample``
        (``mmgrpo sample --prompt``) are text-only; bad items are skipped (or stop the run) as in training.
        Sampling draws from a generator seeded by ``seed``, never from the global RNG: evaluating during training
        leaves the training rollouts as they would have been, and every evaluation of a policy samples the same.
        Always through transformers, also with ``generation.backend: vllm`` (only training rollouts use vLLM).

        ``per_prompt`` K > 1, or items with a ``seed`` key, at a temperature > 0 (``mmgrpo sample``): K
        completions per item, consecutive with one group id, each drawn from a generator of its own, seeded by
        ``sample_seeds(first_seed(item, seed), K)[k]`` and recorded as its ``meta["seed"]``, so a completion
        depends neither on K nor on the batch (up to float rounding of the batched forwards). K > 1 at
        temperature 0 (K identical greedy completions) is a ConfigError."""
        gen_cfg = replace(self.cfg.generation, temperature=self.cfg.generation.eval_temperature)
        if per_prompt > 1 and gen_cfg.temperature <= 0:
            raise ConfigError(f"bad value for 'generation.eval_temperature': 0 decodes greedily, so the {per_prompt} "
                              f"samples per prompt would be identical; set it above 0 (e.g. 1.0) to sample them")
        for item in items:
            if item.get("sample") is None:
                check_free_prompt(item["prompt"])
        self.cache.clear()
        counters: dict[str, float] = defaultdict(float)
        generator = torch.Generator(device=self.vlm.device).manual_seed(self.cfg.seed)
        seeded = gen_cfg.temperature > 0 and (per_prompt > 1 or any("seed" in item for item in items))
        prompts, texts, meta = [], [], []
        per_call = max(1, gen_cfg.batch_rows // per_prompt)  # prepared (decoded) media are held for one call's items
        with self.sampling_weights() as synced:
            for start in range(0, len(items), per_call):
                chunk = items[start:start + per_call]
                prepared = [self._try_prepare(item, counters) for item in chunk]
                answered = [p is not None for p in prepared]
                if synced is not None and not all(answered):
                    # every process must run the same forwards: a skipped item is stood in for, its answer dropped
                    stand_in = next((p for p in prepared if p is not None), None) or self._prepare_rollout(
                        self.train_items[:1], counters, torch.Generator().manual_seed(self.cfg.seed))[0]
                    prepared = [p or stand_in for p in prepared]
                rows = [(p, real, item) for p, real, item in zip(prepared, answered, chunk) if p is not None]
                # from the item itself: a Prepared may come from the prompt cache, made for an item without a seed
                seeds = [sample_seeds(first_seed(item, self.cfg.seed), per_prompt) if seeded else [None] * per_prompt
                         for _, _, item in rows]
                draw = ([torch.Generator(device=self.vlm.device).manual_seed(s) for each in seeds for s in each]
                        if seeded else generator)
                outs = generate_groups(self.vlm, [p.inputs for p, _, _ in rows], per_prompt, gen_cfg, draw, synced)
                for (p, real, _), out, each in zip(rows, outs, seeds):
                    if real:
                        prompts += [p.item["prompt"]] * per_prompt
                        texts += out.texts
                        meta += [{**p.meta(), "truncated": bool(cut), **({} if s is None else {"seed": s})}
                                 for cut, s in zip(out.truncated, each)]
        group = torch.arange(len(prompts) // per_prompt).repeat_interleave(per_prompt)
        return RewardBatch(prompts=prompts, group=group, completions=texts, meta=meta)

    def save_samples(self, batch: RewardBatch, directory: Path, tag: str, per_sample: bool = False,
                     scores: dict[str, torch.Tensor] | None = None) -> list[Path]:
        """``directory/tag.md``: per sample the prompt, ground truth, completion and its rewards: ``scores`` (name ->
        (B,) tensor, the caller's, as logged) or, when None (``mmgrpo sample``), every configured evaluation reward
        scored here. ``per_sample``: also ``tag/index.json`` (:func:`~mmgrpo.policy.write_sample_index`) with each
        sample's ``completion``, ``truncated``, ground truth ``answer`` (null without one) and, when there are any,
        ``scores`` (reward name -> value, null where it does not apply); ``seed`` is the sample's ``meta["seed"]``
        (:meth:`generate`'s per-sample seed, null when the batch shared one generator or decoded greedily) and
        ``file`` is null."""
        directory.mkdir(parents=True, exist_ok=True)
        note = ""
        if scores is None:
            scores, note = self._score_for_page(batch)
        lines = [f"# {tag}\n", f"{len(batch)} samples.\n", note]
        for i, (prompt, text, meta) in enumerate(zip(batch.prompts, batch.completions, batch.meta)):
            lines.append(f"## {i}: {meta.get('source', 'prompt')}\n")
            lines.append(f"**Prompt**\n\n```\n{prompt}\n```\n")
            if "answer" in meta:
                lines.append(f"**Ground truth**: `{meta['answer']}`\n")
            flag = " (truncated)" if meta.get("truncated") else ""
            lines.append(f"**Completion**{flag}\n\n```\n{text}\n```\n")
            if scores:
                cells = ", ".join(f"{k} {v[i]:.3f}" for k, v in scores.items() if not math.isnan(v[i]))
                lines.append(f"**Rewards**: {cells or 'none apply'}\n")
        path = directory / f"{tag}.md"
        path.write_text("\n".join(lines))
        if not per_sample:
            return [path]
        columns = {"completion": batch.completions, "truncated": [bool(m.get("truncated")) for m in batch.meta],
                   "answer": [m.get("answer") for m in batch.meta]}
        if scores:
            columns["scores"] = score_records(scores, len(batch))
        seeds = [m.get("seed") for m in batch.meta]
        return [path, write_sample_index(directory / tag, batch.prompts, batch.group, seeds=seeds, **columns)]

    def _score_for_page(self, batch: RewardBatch) -> tuple[dict[str, torch.Tensor], str]:
        """(every configured evaluation reward's (B,) scores, "") for :meth:`save_samples`; ({}, a note for the
        page) when there are no samples or rewards, or the rewards cannot score them (free prompts without ground
        truth)."""
        if not len(batch) or not self.cfg.rewards:
            return {}, ""
        try:
            self._zoo = self._zoo or RewardZoo(self.cfg.rewards)
            _, scores, _ = self._zoo(batch, only=self._zoo.evaluation_names)
        except (ValueError, RewardError) as err:
            return {}, f"Rewards not computed: {err}\n\n"
        return scores, ""

    # ------------------------------------------------------------------------------------------------ weights
    def setup(self, accelerator: Any) -> None:
        """With sharded parameters, make every forward run the same modules on all processes (FSDP2 shards the
        model in place, which the sampler calls; FSDP1 wraps it): decode in step (:func:`decode`'s ``synced``)
        and, on data that mixes media kinds, balance the vision-tower calls (:class:`VisionCallBalancer`). Under
        FSDP2, sampling gathers the whole weights once per rollout instead (:meth:`sampling_weights`). Under DDP
        with a trainable vision tower, mixed data is balanced too: a process whose micro-batch holds no media would
        leave the tower without gradients, and DDP's all-reduce would wait for them forever."""
        super().setup(accelerator)
        calls = calls_to_balance([item["sample"] for item in self.train_items + self.held_items])
        if not self.sharded:
            if calls and accelerator.num_processes > 1 and not self.cfg.model.freeze_vision:
                self.vision_balancer = VisionCallBalancer(self.vlm.model, calls)
            return
        if self.care_reference is not None:
            raise ConfigError("bad value for 'care.enabled': the GRPO-CARE reference keeps a whole copy of the "
                              "trainable weights, which FSDP and DeepSpeed ZeRO-3 shard; use DDP or ZeRO-2")
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        if plugin is not None and getattr(plugin, "fsdp_version", 1) != 2:
            raise ConfigError("the vlm pipeline samples through the model itself, which FSDP1 hides inside its "
                              "wrapper: set fsdp_version: 2 in the accelerate config (configs/accelerate/fsdp.yaml)")
        if calls:
            self.vision_balancer = VisionCallBalancer(self.vlm.model, calls)
        self.synced = any_process
        if plugin is not None and self.cfg.generation.gather_sharded_weights:
            self.reshard_after_forward = bool(plugin.reshard_after_forward)
        elif self.accuracy is not None:
            check_tgrpo_in_step([item["sample"] for item in self.train_items])

    @contextlib.contextmanager
    def sampling_weights(self) -> Iterator[Callable[[bool], bool] | None]:
        """Context of sampling; yields the ``synced`` to decode with. Under FSDP2 with
        ``generation.gather_sharded_weights`` the whole weights are gathered once on entry (:func:`whole_weights`;
        every process enters together), the forwards inside make no collective calls, and each process decodes on
        its own (None), whatever it samples (T-GRPO's shuffled rollouts of its video prompts, skipped items).
        Otherwise :attr:`synced`: every sharded forward gathers, so decoding goes on in step."""
        if self.reshard_after_forward is None:
            yield self.synced
            return
        with whole_weights(self.vlm.model, self.reshard_after_forward):
            yield None

    def save(self, directory: Path) -> None:
        """PEFT adapter (LoRA) or a full ``save_pretrained`` folder, plus the processor (:meth:`VLMModel.save`)."""
        state = self.sharded_state_dict()  # collective under FSDP / ZeRO-3
        if self.is_main_process:
            self.vlm.save(directory, self.unwrapped_model(), state_dict=state)

    def load(self, directory: Path) -> None:
        self.vlm.load(directory)
