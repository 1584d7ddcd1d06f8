"""PromptCache: least recently used first out within a byte budget; failures are not kept."""

import pytest
import torch

from mmgrpo.pipelines.vlm.prompt_cache import PromptCache


def entry(n_floats: int) -> list[torch.Tensor]:
    return [torch.zeros(n_floats)]  # 4 bytes a float


def test_evicts_the_least_recently_used_beyond_the_budget():
    cache = PromptCache(max_bytes=3 * 400, tensors_of=lambda v: v)
    made = []

    def make(key):
        made.append(key)
        return entry(100)

    for key in "abc":
        cache.get(key, lambda k=key: make(k))
    assert cache.get("a", lambda: make("a again")) is not None  # a hit, and now the most recent
    cache.get("d", lambda: make("d"))  # over budget: b, the least recently used, goes
    assert made == ["a", "b", "c", "d"] and len(cache) == 3 and cache.bytes == 1200
    cache.get("b", lambda: make("b again"))
    cache.get("a", lambda: make("a third"))
    assert made == ["a", "b", "c", "d", "b again"] and (cache.hits, cache.misses) == (2, 5)


def test_keeps_nothing_too_large_and_nothing_that_failed():
    cache = PromptCache(max_bytes=400, tensors_of=lambda v: v)
    big = entry(101)
    assert cache.get("big", lambda: big) is big and len(cache) == 0 and cache.bytes == 0

    def fail():
        raise ValueError("corrupt")

    with pytest.raises(ValueError, match="corrupt"):
        cache.get("bad", fail)
    assert len(cache) == 0
    off = PromptCache(max_bytes=0, tensors_of=lambda v: v)
    off.get("a", lambda: entry(1))
    assert len(off) == 0 and off.misses == 1
