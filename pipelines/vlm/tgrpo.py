"""T-GRPO (Video-R1) in the rollout: answers sampled on shuffled frames, scored, never trained.

For each prompt with a video, :func:`shuffled_accuracy` samples ``tgrpo.shuffled_group_size`` completions with every
video's frames in a random non-identity order (prefill shared, as for the ordered group) and returns their mean
``accuracy`` reward. The policy stores it in each ordered sample's ``meta["tgrpo_shuffled_acc"]``; the groupwise
``temporal_bonus`` reward (:mod:`mmgrpo.rewards.temporal_bonus`) turns it into the bonus, per prompt group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mmgrpo.config import ConfigError, switched_reward
from mmgrpo.pipelines.vlm.config import VLMConfig
from mmgrpo.pipelines.vlm.generation import generate_group
from mmgrpo.pipelines.vlm.model import VLMModel
from mmgrpo.pipelines.vlm.video import shuffle_frames
from mmgrpo.rewards import AccuracyReward, RewardBatch

BONUS_REWARD = "temporal_bonus"


def bonus_spec(cfg: VLMConfig) -> Any:
    """The configured ``temporal_bonus`` reward spec, checked against ``tgrpo``; None when T-GRPO is off.

    T-GRPO without the reward would sample shuffled answers for nothing, and the reward without T-GRPO would
    always be NaN, so either is a ConfigError; so are ``alpha``/``mu`` args that disagree with ``tgrpo.*``."""
    found = switched_reward(cfg.rewards, BONUS_REWARD, cfg.tgrpo.enabled, "tgrpo.enabled")
    if found is None:
        return None
    index, spec = found
    for key in ("alpha", "mu"):
        value = float(spec.args.get(key, getattr(cfg.tgrpo, key)))
        if not math.isclose(value, getattr(cfg.tgrpo, key)):
            raise ConfigError(f"bad value for 'rewards.{index}.args.{key}': {value} differs from tgrpo.{key} = "
                              f"{getattr(cfg.tgrpo, key)}")
    if cfg.tgrpo.shuffled_group_size < 0:
        raise ConfigError(f"bad value for 'tgrpo.shuffled_group_size': must be >= 0, got "
                          f"{cfg.tgrpo.shuffled_group_size}")
    return spec


def accuracy_reward(cfg: VLMConfig) -> AccuracyReward | None:
    """The ``accuracy`` reward that scores the shuffled-frame answers, built from the ``temporal_bonus`` reward's
    ``accuracy_args`` as that reward builds its own; None when T-GRPO is off. A value the accuracy refuses is a
    ConfigError naming the reward (the policy builds it before the reward zoo would)."""
    spec = bonus_spec(cfg)
    if spec is None:
        return None
    try:
        return AccuracyReward(**(spec.args.get("accuracy_args") or {}))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"bad value in 'rewards.{cfg.rewards.index(spec)}' ({spec.name}): {err}") from err


def shuffled_accuracy(vlm: VLMModel, prompt: str, images: list[torch.Tensor], videos: list[torch.Tensor],
                      fps: list[float], meta: dict[str, Any], count: int, cfg: VLMConfig, accuracy: AccuracyReward,
                      generator: torch.Generator | None, frame_generator: torch.Generator,
                      synced: Callable[[bool], bool] | None = None) -> tuple[float, int]:
    """(mean accuracy, completion tokens) of ``count`` answers to ``prompt`` with each video (T,3,H,W) uint8
    shuffled along T by ``frame_generator``; ``meta`` is the ordered samples' meta (ground truth, problem type).
    ``synced``: see :func:`~mmgrpo.pipelines.vlm.generation.decode`."""
    shuffled = [shuffle_frames(v, frame_generator) for v in videos]
    inputs = vlm.prompt_inputs(prompt, images, shuffled, fps)
    out = generate_group(vlm, inputs, count, cfg.generation, generator, synced)
    batch = RewardBatch(prompts=[prompt] * count, group=torch.zeros(count, dtype=torch.long),
                        completions=out.texts, meta=[meta] * count)
    scores = torch.as_tensor(accuracy(batch), dtype=torch.float64)
    return scores.nanmean().item(), int(out.mask.sum())


def temporal_counters(ordered_acc: list[float], shuffled_acc: list[float], mu: float) -> dict[str, float]:
    """``tgrpo/ordered_acc`` and ``tgrpo/shuffled_acc`` (mean accuracy of a step's video groups with ordered and
    with shuffled frames) and ``tgrpo/pass_frac`` (fraction of them whose ordered accuracy >= ``mu`` x shuffled,
    the temporal test), over the groups the accuracy applies to: a NaN accuracy (such as temporal grounding's)
    gets no bonus and is left out of all three. Empty when no group is left."""
    tested = [(o, s) for o, s in zip(ordered_acc, shuffled_acc) if not (math.isnan(o) or math.isnan(s))]
    if not tested:
        return {}
    n = len(tested)
    return {"tgrpo/ordered_acc": sum(o for o, _ in tested) / n, "tgrpo/shuffled_acc": sum(s for _, s in tested) / n,
            "tgrpo/pass_frac": sum(o >= mu * s for o, s in tested) / n}
