"""A toy policy for testing the trainer end to end: a categorical "language model" over a tiny vocabulary.

Each prompt p asks for a sequence of ``seq_len`` tokens from ``num_arms`` symbols; the reward is the fraction of
tokens equal to the prompt's target symbol (``p % num_arms``). The policy is a linear map from the prompt one-hot to
per-position logits, so everything (log-probs, KL, ratios, checkpoints, DDP) is exercised for real and fast.

Used as ``pipeline: toy_bandit:PIPELINE`` with ``tests/support`` on the path, which also exercises the
``module:attr`` plug-in route of the registry.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mmgrpo.config import BaseConfig, RewardSpec
from mmgrpo.grpo import kl_estimate
from mmgrpo.policy import LogProbs, PipelineSpec, Policy, Rollout
from mmgrpo.rewards import RewardBatch


@dataclass
class ToySection:
    num_prompts: int = 8
    """Distinct prompts."""
    num_arms: int = 4
    """Vocabulary size."""
    seq_len: int = 3
    """Tokens per completion (units per sample)."""
    sleep_s: float = 0.0
    """Pause per rollout, so a test can kill a run part-way."""
    nan_rollout: int = 0
    """The rollout (1-based) whose training log-probs are NaN, as a broken loss would be; 0: none."""


@dataclass
class ToyConfig(BaseConfig):
    pipeline: str = "toy_bandit:PIPELINE"
    toy: ToySection = field(default_factory=ToySection)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec(name="toy_bandit:match_reward")])


def match_reward(batch: RewardBatch) -> list[float]:
    """Fraction of completion tokens equal to the sample's target symbol."""
    out = []
    for text, meta in zip(batch.completions, batch.meta):
        tokens = text.split()
        out.append(sum(t == str(meta["target"]) for t in tokens) / max(len(tokens), 1))
    return out


class ToyPolicy(Policy):
    def __init__(self, cfg: ToyConfig):
        self.cfg = cfg
        t = cfg.toy
        torch.manual_seed(cfg.seed)
        self.model = nn.Linear(t.num_prompts, t.seq_len * t.num_arms)
        self.reference = copy.deepcopy(self.model).requires_grad_(False)

    def datasets(self) -> tuple[list[dict], list[dict]]:
        items = [{"prompt": f"prompt {i}", "index": i, "target": i % self.cfg.toy.num_arms}
                 for i in range(self.cfg.toy.num_prompts)]
        return items, items

    def _logits(self, module: nn.Module, prompt_index: torch.Tensor) -> torch.Tensor:
        t = self.cfg.toy
        onehot = nn.functional.one_hot(prompt_index, t.num_prompts).float()
        return module(onehot).view(-1, t.seq_len, t.num_arms).float()

    def _token_logp(self, module: nn.Module, prompt_index: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(self._logits(module, prompt_index), -1)
        return logp.gather(-1, tokens[..., None]).squeeze(-1)

    def rollout(self, items: list[dict], group_ids: list[int], group_size: int) -> Rollout:
        time.sleep(self.cfg.toy.sleep_s)
        index = torch.tensor([it["index"] for it in items]).repeat_interleave(group_size)
        probs = torch.softmax(self._logits(self.model, index), -1)
        tokens = torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(len(index), -1)
        # old log-probs in the training micro-batch chunking, so the first ratio is exactly 1
        old = torch.cat([self._token_logp(self.model, index[c], tokens[c])
                         for c in torch.arange(len(index)).split(self.cfg.train.micro_batch_size)])
        batch = RewardBatch(
            prompts=[items[i // group_size]["prompt"] for i in range(len(index))],
            group=torch.tensor(group_ids).repeat_interleave(group_size),
            completions=[" ".join(map(str, row.tolist())) for row in tokens],
            meta=[{"target": items[i // group_size]["target"]} for i in range(len(index))])
        self.rollouts = getattr(self, "rollouts", 0) + 1
        return Rollout(group=batch.group, old_logp=old, mask=torch.ones_like(old, dtype=torch.bool),
                       reward_batch=batch, data={"index": index, "tokens": tokens,
                                                 "nan": self.rollouts == self.cfg.toy.nan_rollout},
                       counters={"tokens/completion": float(tokens.numel())})

    def log_probs(self, rollout: Rollout, rows: torch.Tensor, units: torch.Tensor | None,
                  with_kl: bool, with_entropy: bool = False) -> LogProbs:
        index, tokens = rollout.data["index"][rows], rollout.data["tokens"][rows]
        logp = self._token_logp(self.model, index, tokens)
        if rollout.data["nan"]:
            logp = logp * math.nan
        kl = None
        if with_kl:
            with torch.no_grad():
                ref = self._token_logp(self.reference, index, tokens)
            kl = kl_estimate(logp, ref, self.cfg.grpo.kl_estimator)
        if units is not None:
            logp = logp[:, units]
            kl = None if kl is None else kl[:, units]
        return LogProbs(logp=logp, kl=kl)

    def merge_groups(self, rollouts: list[Rollout], rows: list[torch.Tensor]) -> Rollout:
        """The chosen rows of each rollout, in order (``grpo.refill_rounds``); completions all have seq_len tokens."""
        def cat(get) -> torch.Tensor:
            return torch.cat([get(r)[i] for r, i in zip(rollouts, rows)])

        batch = RewardBatch.concat([r.reward_batch.select(i.tolist()) for r, i in zip(rollouts, rows)])
        return Rollout(group=cat(lambda r: r.group), old_logp=cat(lambda r: r.old_logp), mask=cat(lambda r: r.mask),
                       reward_batch=batch, data={"index": cat(lambda r: r.data["index"]),
                                                 "tokens": cat(lambda r: r.data["tokens"]),
                                                 "nan": any(r.data["nan"] for r in rollouts)},
                       counters={"tokens/completion": sum(r.counters["tokens/completion"] for r in rollouts)})

    def generate(self, items: list[dict]) -> RewardBatch:
        index = torch.tensor([it["index"] for it in items])
        with torch.no_grad():
            tokens = self._logits(self.model, index).argmax(-1)
        return RewardBatch(prompts=[it["prompt"] for it in items], group=torch.arange(len(items)),
                           completions=[" ".join(map(str, row.tolist())) for row in tokens],
                           meta=[{"target": it["target"]} for it in items])

    def save(self, directory: Path) -> None:
        state = self.full_state_dict()
        if self.is_main_process:
            directory.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))

    def load(self, directory: Path) -> None:
        self.unwrapped_model().load_state_dict(load_file(str(directory / "model.safetensors")))


PIPELINE = PipelineSpec(config_class=ToyConfig, build=ToyPolicy, description="categorical bandit for tests")


def constant_reward(batch: RewardBatch) -> list[float]:
    """0 for every completion: a reward that never gives a signal."""
    return [0.0] * len(batch.completions)


def per_target_reward(batch: RewardBatch) -> dict[str, list[float | None]]:
    """:func:`match_reward` as ``score``, plus a ``target0`` sub-score for the samples whose target is 0, reported
    only when the batch holds one: a reward whose sub-scores differ from batch to batch (per problem type)."""
    scores = match_reward(batch)
    out: dict[str, list[float | None]] = {"score": scores}
    if any(m["target"] == 0 for m in batch.meta):
        out["target0"] = [s if m["target"] == 0 else None for s, m in zip(scores, batch.meta)]
    return out
