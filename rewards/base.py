"""The reward interface: a batch in, one float per sample (or named sub-scores) out. NaN means "does not apply".

Three ways to write a reward, all accepted wherever a reward is named:

- a :class:`Reward` subclass, registered with ``@REWARDS.register(name, kind=..., modality=...)``;
- a plain function ``fn(batch: RewardBatch) -> list[float] | Tensor | dict[str, ...]``;
- a TRL-style function ``fn(prompts, completions, **kwargs) -> list[float]`` (or any signature with a
  ``completions`` parameter, such as ``fn(completions, solution, **kwargs)``), wrapped by :func:`trl_reward` and
  called by keyword as TRL calls it (the per-sample ``meta`` fields arrive as keyword lists, as TRL passes dataset
  columns).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

POINTWISE = "pointwise"
GROUPWISE = "groupwise"


@dataclass
class RewardBatch:
    """What a reward sees. B samples; only the fields the pipeline produces are set.

    - ``prompts``: B prompt strings.
    - ``group``: (B,) int64 group ids; the samples of one prompt share an id and are always all present.
    - ``images``: (B, 3, H, W) float in [0, 1], or None.
    - ``videos``: (B, T, 3, H, W) float in [0, 1], or None.
    - ``completions``: B generated texts, or None.
    - ``meta``: B dicts of per-sample inputs and ground truth (``solution``, ``problem_type``, input ``frames``...).
    """

    prompts: list[str]
    group: torch.Tensor
    images: torch.Tensor | None = None
    videos: torch.Tensor | None = None
    completions: list[str] | None = None
    meta: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        b = len(self.prompts)
        if not self.meta:
            self.meta = [{} for _ in range(b)]
        sizes = {"group": len(self.group), "meta": len(self.meta)}
        if self.images is not None:
            sizes["images"] = self.images.shape[0]
        if self.videos is not None:
            sizes["videos"] = self.videos.shape[0]
        if self.completions is not None:
            sizes["completions"] = len(self.completions)
        bad = {k: v for k, v in sizes.items() if v != b}
        if bad:
            raise ValueError(f"reward batch has {b} prompts but {bad}")

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, rows: Sequence[int]) -> RewardBatch:
        """The sub-batch of ``rows`` (used to split work and to test batching)."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return RewardBatch(
            prompts=[self.prompts[i] for i in rows],
            group=self.group[index],
            images=None if self.images is None else self.images[index],
            videos=None if self.videos is None else self.videos[index],
            completions=None if self.completions is None else [self.completions[i] for i in rows],
            meta=[self.meta[i] for i in rows],
        )

    @staticmethod
    def concat(batches: Sequence[RewardBatch]) -> RewardBatch:
        """One batch of ``batches`` in order; a field must be set in all of them or in none."""
        def joined(name: str) -> Any:
            values = [getattr(b, name) for b in batches]
            if all(v is None for v in values):
                return None
            if any(v is None for v in values):
                raise ValueError(f"cannot concatenate reward batches: '{name}' is set in some and not in others")
            return torch.cat(values) if isinstance(values[0], torch.Tensor) else [x for v in values for x in v]

        return RewardBatch(prompts=joined("prompts"), group=joined("group"), images=joined("images"),
                           videos=joined("videos"), completions=joined("completions"), meta=joined("meta"))


class Reward:
    """Base class for rewards that hold state (a loaded model). Load once in ``__init__``; score in ``__call__``.

    Subclasses set ``kind`` (pointwise: each sample alone; groupwise: sees whole groups) and ``modality``
    (image, video, text or any). ``rollout_only`` marks a reward that reads what only a training rollout adds to
    the samples (T-GRPO's shuffled-frame accuracy); held-out evaluation leaves it out. ``conditional`` marks a
    reward that applies to some samples only by design (NaN for the rest, e.g. prompts without a relation), so a
    batch it does not apply to at all is expected and not warned about.
    """

    kind: str = POINTWISE
    modality: str = "any"
    rollout_only: bool = False
    conditional: bool = False

    def __call__(self, batch: RewardBatch) -> torch.Tensor | dict[str, torch.Tensor]:
        raise NotImplementedError

    def to(self, device: torch.device | str) -> Reward:
        """Move any model the reward holds; rules have none."""
        return self

    @classmethod
    def components(cls, args: dict[str, Any]) -> list[tuple[str | None, str, Callable[[], Any]]]:
        """What the constructor builds from other entries named in its ``args`` (a base reward, a judge backend):
        one ``(name arg, args arg, resolve)`` each, where ``resolve()`` returns the component's class or factory
        (and raises ``KeyError`` or ``RegistryError`` for a bad name; ``name arg`` is None for a fixed component).
        Config loading checks the ``args arg`` against that constructor as it checks the reward's own args."""
        return []


class FunctionReward(Reward):
    """A plain function ``fn(batch) -> scores`` used as a reward."""

    def __init__(self, fn: Callable[[RewardBatch], Any], kind: str = POINTWISE, modality: str = "any"):
        self.fn, self.kind, self.modality = fn, kind, modality
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, batch: RewardBatch) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.fn(batch)


def trl_reward(fn: Callable[..., Sequence[float]], conversational: bool = False) -> FunctionReward:
    """Wrap a TRL-style reward ``fn(prompts, completions, **columns) -> list[float]``, called by keyword as TRL
    calls it: ``fn(prompts=..., completions=..., **columns)``, so ``fn(completions, solution, **kwargs)`` works too.

    Every key present in the samples' ``meta`` is passed as a keyword list, so a TRL reward that reads
    ``solution`` works unchanged. ``None`` scores (TRL's "not applicable") become NaN. ``conversational``: pass
    TRL's chat format, as TRL does for conversational datasets (every VLM dataset): each prompt as
    ``[{"role": "user", "content": prompt}]`` and each completion as ``[{"role": "assistant", "content": text}]``,
    which rewards written for it read as ``completion[0]["content"]`` (open-r1, Video-R1); else plain strings."""

    def call(batch: RewardBatch) -> torch.Tensor:
        if batch.completions is None:
            raise ValueError(f"TRL-style reward '{fn.__name__}' needs text completions; this batch has none")
        columns = sorted({k for m in batch.meta for k in m})
        kwargs = {k: [m.get(k) for m in batch.meta] for k in columns}
        prompts, completions = list(batch.prompts), list(batch.completions)
        if conversational:
            prompts = [[{"role": "user", "content": p}] for p in prompts]
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        scores = fn(prompts=prompts, completions=completions, **kwargs)
        return torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float64)

    call.__name__ = getattr(fn, "__name__", "trl_reward")
    return FunctionReward(call, kind=POINTWISE, modality="text")


TRL_ARGS = ("conversational",)
"""The args a TRL-style reward function takes in a config (passed to :func:`trl_reward`)."""


def is_trl_signature(fn: Callable) -> bool:
    """True for a TRL reward, which takes ``completions`` by keyword (``fn(prompts, completions, **kwargs)``,
    ``fn(completions, solution, **kwargs)``); False for ``fn(batch)``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return "completions" in names and names[0] != "batch"


def as_scores(output: Any, n: int, name: str) -> dict[str, torch.Tensor]:
    """Normalise what a reward returned into ``{sub_name: (n,) float64 cpu tensor}``; ``None`` becomes NaN.

    A single score vector becomes ``{name: scores}``; a dict becomes ``{name/key: scores}``. Anything else (not
    numbers, the wrong count, an infinite score) is a one-line ``ValueError`` naming the reward: NaN means "does not
    apply", but an infinite score has no meaning and would turn the advantages into NaN. An empty dict is one too."""
    if isinstance(output, dict) and not output:
        raise ValueError(f"reward '{name}' returned an empty dict, not scores (one per sample, or named sub-scores)")
    items = output.items() if isinstance(output, dict) else [(None, output)]
    scores = {}
    for key, value in items:
        sub = name if key is None else f"{name}/{key}"
        try:
            if not torch.is_tensor(value):
                value = [math.nan if v is None else v for v in value]
            t = torch.as_tensor(value, dtype=torch.float64).detach().to("cpu").reshape(-1)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"reward '{sub}' returned {type(value).__name__}, not numbers (one per sample): "
                             f"{str(err).splitlines()[0]}") from None
        if t.numel() != n:
            raise ValueError(f"reward '{sub}' returned {t.numel()} scores for a batch of {n}")
        if t.isinf().any():
            raise ValueError(f"reward '{sub}' returned an infinite score for {int(t.isinf().sum())} of {n} samples "
                             "(return NaN for a sample it does not apply to)")
        scores[sub] = t
    return scores


def main_score(scores: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The one score of reward ``name`` that enters the combination, from what :func:`as_scores` returned: the
    plain score, else its ``score`` sub-score, else the mean of its sub-scores (ignoring NaN)."""
    if name in scores:
        return scores[name]
    if f"{name}/score" in scores:
        return scores[f"{name}/score"]
    return torch.stack(list(scores.values()), 1).nanmean(1)
