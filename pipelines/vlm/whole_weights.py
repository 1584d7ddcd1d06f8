"""Whole weights while sampling under FSDP2: one gather per sampling call instead of one per token.

Under FSDP2 a sharded module gathers its parameters from all processes before each forward and frees them after it
(``reshard_after_forward``). Decoding calls the model once per token, so sampling T tokens moves the whole model T
times (for a 7B model in bf16, about 15 GB per token). :func:`whole_weights` gathers every sharded module once, on
entry, keeps the whole parameters through all the forwards of the block, and shards them again on exit. The price
is one whole copy of the weights in each process while sampling, which DDP and ZeRO-2 hold all the time. Inside the
block the forwards make no collective calls, so the processes need not run the same ones.

It uses FSDP2's public calls only (``unshard``, ``reshard``, ``set_reshard_after_forward``). FSDP2 has no getter for
a module's reshard setting, so on exit the outermost sharded modules keep their weights after forward (FSDP2's own
rule for the root, which needs them again at once for backward) and every other one follows
``reshard_after_forward`` (the accelerate config's ``fsdp_reshard_after_forward``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule


def sharded_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP2 modules of ``model`` (itself included), in ``modules()`` order: the same on every process."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def outermost(modules: list[FSDPModule]) -> list[FSDPModule]:
    """The ``modules`` that no other module of the list contains (the root of a sharded model)."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


@contextlib.contextmanager
def whole_weights(model: torch.nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """Inside the block every FSDP2 module of ``model`` holds its whole parameters, gathered once on entry (by all
    processes together, so every process must enter); on exit they are sharded again. A model without FSDP2
    modules is left as it is."""
    modules = sharded_modules(model)
    roots = {id(m) for m in outermost(modules)}
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(reshard_after_forward and id(module) not in roots, recurse=False)
