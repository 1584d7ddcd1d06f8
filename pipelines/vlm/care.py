"""GRPO-CARE (arXiv:2506.16141) in the rollout: how likely each answer is given its own reasoning, under an EMA of
the policy.

With ``care.enabled`` the vlm policy keeps an exponential moving average of its trainable weights (``care.ema_decay``,
updated every ``care.update_every`` optimiser steps), runs the training forward over each rollout with those
weights swapped in, and stores :func:`answer_likelihood` of every completion in its meta; the groupwise
``consistency_bonus`` reward (:mod:`mmgrpo.rewards.consistency_bonus`) turns it into the bonus, per prompt group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mmgrpo.config import switched_reward
from mmgrpo.rewards.text_rules import last_tagged_span

BONUS_REWARD = "consistency_bonus"


def bonus_spec(cfg: Any) -> Any:
    """The configured ``consistency_bonus`` reward spec when ``care.enabled``, else None (ConfigError when the two
    disagree: :func:`~mmgrpo.config.switched_reward`)."""
    found = switched_reward(cfg.rewards, BONUS_REWARD, cfg.care.enabled, "care.enabled")
    return None if found is None else found[1]


def first_true(predicate: Callable[[int], bool], low: int, high: int) -> int:
    """The smallest k in [low, high] with ``predicate(k)``, for a predicate false then true; ``high`` if none."""
    while low < high:
        mid = (low + high) // 2
        if predicate(mid):
            high = mid
        else:
            low = mid + 1
    return low


def token_span(tokenizer: Any, ids: list[int], chars: tuple[int, int]) -> tuple[int, int]:
    """[start, end) indices of the tokens of ``ids`` that spell the characters ``chars`` of
    ``text = tokenizer.decode(ids)`` (special tokens skipped, as the sampler decodes): ``start`` is the first token
    whose prefix decodes past ``chars[0]``, ``end`` the first prefix length that decodes to all of
    ``text[:chars[1]]`` (a character split over byte tokens needs all of them). Both by bisection on prefixes,
    about 2 log2 len(ids) decodes."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    decoded: dict[int, str] = {}

    def prefix(k: int) -> str:
        if k not in decoded:
            decoded[k] = tokenizer.decode(ids[:k], skip_special_tokens=True)
        return decoded[k]

    start = first_true(lambda k: len(prefix(k)) > chars[0], 1, len(ids)) - 1
    return start, first_true(lambda k: prefix(k)[:chars[1]] == text[:chars[1]], start + 1, len(ids))


def answer_token_mask(tokenizer: Any, ids: torch.Tensor, mask: torch.Tensor, tag: str = "answer") -> torch.Tensor:
    """(N,L) bool: the completion tokens that spell the content of the last ``<tag>...</tag>`` block (tags
    excluded; :func:`token_span`). ``ids`` (N,L) int64 completion tokens, ``mask`` (N,L) bool their real tokens (a
    prefix of each row). Rows without a block, or with an empty one, are all False."""
    out = torch.zeros_like(mask, dtype=torch.bool)
    for row, (row_ids, n) in enumerate(zip(ids.tolist(), mask.sum(1).tolist())):
        row_ids = row_ids[:n]
        span = last_tagged_span(tokenizer.decode(row_ids, skip_special_tokens=True), tag)
        if span is not None and span[0] < span[1]:
            start, end = token_span(tokenizer, row_ids, span)
            out[row, start:end] = True
    return out


def answer_likelihood(logp: torch.Tensor, answer_mask: torch.Tensor) -> torch.Tensor:
    """(N,) float64 ``exp(mean log p)`` over each row's answer tokens, the geometric mean of their probabilities;
    NaN for a row without answer tokens. ``logp`` (N,L) token log-probs, ``answer_mask`` (N,L) bool."""
    logp = logp.detach().double()
    count = answer_mask.sum(1)
    mean = (logp * answer_mask).sum(1) / count.clamp(min=1)
    return torch.where(count > 0, mean.exp(), torch.full_like(mean, math.nan))
