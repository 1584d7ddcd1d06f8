"""The same vision-tower calls on every process when the weights are sharded, or the tower trains under DDP.

Under FSDP2 or DeepSpeed ZeRO-3 each module gathers its parameters from all processes when it runs (and
reduce-scatters their gradients in backward), so every process must run the same modules in the same order. A
Qwen2-VL forward calls its vision tower once for its images and once for its videos, so on data that mixes kinds
(images, videos, text-only) one process may run the tower twice where another runs it once, and the collectives
no longer pair up. Under DDP a trainable tower that one process's forward never ran gets no gradient there, and
the other processes wait in the all-reduce of its bucket. :class:`VisionCallBalancer` tops every fresh forward (a
training forward or a prefill: no KV cache yet) up to the same number of tower calls, with a one-token dummy input
whose output enters the forward times zero: the outputs are unchanged, and backward runs the tower as many times as
forward did.
"""

from __future__ import annotations

import torch
from torch import nn

from mmgrpo.config import ConfigError
from mmgrpo.pipelines.vlm.data import VLMSample
from mmgrpo.pipelines.vlm.model import module_names, unwrap


def vision_calls(sample: VLMSample) -> tuple[bool, bool]:
    """(has images, has videos): which vision-tower calls (one per kind, whatever the count) a forward of the
    sample makes."""
    return bool(sample.images), bool(sample.videos)


def calls_to_balance(samples: list[VLMSample]) -> int:
    """Tower calls every fresh forward must make when some of ``samples`` differ in :func:`vision_calls` (the
    kinds of media the data has, 1 or 2); 0 when all call the tower alike and nothing needs balancing."""
    kinds = {vision_calls(s) for s in samples}
    if len(kinds) <= 1:
        return 0
    return any(images for images, _ in kinds) + any(videos for _, videos in kinds)


def dummy_vision_input(config) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest input a Qwen2-VL-style vision tower accepts, from its ``config``: (pixels (m*m, C*T*P*P) zeros,
    grid_thw (1,3) = [[1, m, m]]) with m the spatial merge size, which the tower merges into one token."""
    merge = config.spatial_merge_size
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    return torch.zeros(merge * merge, width), torch.tensor([[1, merge, merge]])


class VisionCallBalancer:
    """Hooks on ``model`` (plain, PEFT or FSDP2-sharded) that make every fresh forward run the vision tower
    exactly ``calls`` times: a forward pre-hook on the tower counts its real calls, and a pre-hook on the
    language model adds the missing ones before any decoder layer runs. :meth:`remove` takes the hooks off."""

    def __init__(self, model: nn.Module, calls: int):
        core = unwrap(model)
        towers = module_names(core, ("visual",))
        config = getattr(getattr(core, "config", None), "vision_config", None)
        if len(towers) != 1 or not all(hasattr(config, k) for k in ("spatial_merge_size", "in_channels",
                                                                       "temporal_patch_size", "patch_size")):
            raise ConfigError(f"bad value for 'data.media_types': with sharded weights (or a trainable vision tower "
                              f"on several processes), data that mixes media kinds needs a Qwen2-VL-style vision "
                              f"tower ('visual') to balance its calls, and {type(core).__name__} has none; keep one "
                              f"kind, or freeze the tower and launch with DDP or ZeRO-2")
        self.calls = calls
        self.tower = core.get_submodule(towers[0])
        self.pixels, self.grid = dummy_vision_input(config)
        self.real = 0
        self.handles = [self.tower.register_forward_pre_hook(self._count),
                        core.get_decoder().register_forward_pre_hook(self._top_up, with_kwargs=True)]

    def _count(self, module: nn.Module, args: tuple) -> None:
        self.real += 1

    def _top_up(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        real, self.real = self.real, 0
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and cache.get_seq_length() > 0:
            return None  # a decoding step: no process runs the tower
        if real > self.calls:
            raise RuntimeError(f"the vision tower ran {real} times in one forward, more than the {self.calls} every "
                               f"process balances to: the processes would disagree on sharded weights")
        embeds = kwargs["inputs_embeds"]
        for _ in range(self.calls - real):
            out = self.tower(self.pixels.to(embeds.device, self.tower.dtype), grid_thw=self.grid.to(embeds.device))
            out = getattr(out, "pooler_output", out)  # an output object in recent transformers, a tensor before
            embeds = embeds + (0.0 * out.float().sum()).to(embeds.dtype)  # fp32: a half-precision sum may overflow
        self.real = 0  # the dummy calls above were counted
        return args, {**kwargs, "inputs_embeds": embeds}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
