"""Encoded prompts kept across rollouts, least recently used first out, within a memory budget.

A run draws each training prompt many times (the demo preset about 12 times in 1,700 steps), and each draw would
decode its media and run the processor again: about a tenth of a tiny model's step on CPU. Decoding and the
processor are deterministic, so a cached prompt is the same tensors a fresh encoding would give, and a run
samples the same with the cache as without it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

import torch

Value = TypeVar("Value")


def storage_sizes(tensors: Iterable[torch.Tensor]) -> dict[tuple[str, int], int]:
    """(device, address) -> bytes of each distinct storage under ``tensors``: a tensor listed twice, or views of
    one storage, count once."""
    return {(str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors}


class PromptCache(Generic[Value]):
    """At most ``max_bytes`` of values (by the storages under ``tensors_of(value)``, each counted once however many
    values hold it: a video decoded once per rollout is shared by every prompt that shows it), the least recently
    used evicted first; a value larger than the whole budget by itself is not kept. ``max_bytes`` 0 keeps nothing.
    Values are shared with the caller: do not modify their tensors in place. ``hits`` and ``misses`` count
    :meth:`get` answers."""

    def __init__(self, max_bytes: int, tensors_of: Callable[[Value], Iterable[torch.Tensor]]):
        self.max_bytes = max_bytes
        self.tensors_of = tensors_of
        self._entries: OrderedDict[Hashable, tuple[Value, dict[tuple[str, int], int]]] = OrderedDict()
        self._holders: dict[tuple[str, int], int] = {}
        """Storage -> how many kept values hold it; a held storage stays alive, so its address is not reused."""
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: Hashable, make: Callable[[], Value]) -> Value:
        """The value cached under ``key``, or ``make()`` (kept if it fits). Exceptions of ``make`` propagate and
        nothing is kept."""
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key][0]
        self.misses += 1
        value = make()
        sizes = storage_sizes(self.tensors_of(value))
        if sum(sizes.values()) <= self.max_bytes:
            self._entries[key] = (value, sizes)
            for storage, size in sizes.items():
                self.bytes += size if storage not in self._holders else 0
                self._holders[storage] = self._holders.get(storage, 0) + 1
            while self.bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                for storage, size in evicted.items():
                    self._holders[storage] -= 1
                    if not self._holders[storage]:
                        del self._holders[storage]
                        self.bytes -= size
        return value

    def __len__(self) -> int:
        return len(self._entries)
