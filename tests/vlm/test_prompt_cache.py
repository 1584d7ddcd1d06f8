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


def test_a_tensor_shared_by_several_values_counts_once():
    """A video decoded once per rollout is held by every prompt that shows it: its bytes are held once."""
    video = torch.zeros(100)  # 400 bytes, shared
    cache = PromptCache(max_bytes=400 + 2 * 40, tensors_of=lambda v: v)
    a = cache.get("a", lambda: [video, torch.zeros(10)])
    cache.get("b", lambda: [video, video, torch.zeros(10)])  # listed twice in one value: still once
    assert len(cache) == 2 and cache.bytes == 480
    cache.get("a", lambda: [video, torch.zeros(10)])
    assert cache.hits == 1
    cache.get("c", lambda: entry(10))  # 40 new bytes: b, the least recently used, goes; the video stays with a
    assert len(cache) == 2 and cache.bytes == 480
    assert cache.get("a", lambda: None) is a
    cache.get("d", lambda: entry(100))  # c, then a go, and with a the last holder of the video
    assert len(cache) == 1 and cache.bytes == 400


def test_a_value_sharing_a_tensor_is_kept_only_if_it_fits_alone():
    video = torch.zeros(100)
    cache = PromptCache(max_bytes=420, tensors_of=lambda v: v)
    cache.get("a", lambda: [video])
    big = [video, torch.zeros(10)]  # 40 new bytes, but 440 in all: over the budget by itself
    assert cache.get("b", lambda: big) is big and len(cache) == 1 and cache.bytes == 400
