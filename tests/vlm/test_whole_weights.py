"""whole_weights on a one-process FSDP2 model: gathered inside the block, sharded again after it, and afterwards the
root keeps its weights after forward while the inner modules reshard (FSDP2's rule, which the block restores)."""

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mmgrpo.pipelines.vlm.whole_weights import outermost, sharded_modules, whole_weights


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)  # left to the root's own unit

    def forward(self, x):
        for block in self.blocks:
            x = block(x).relu()
        return self.head(x)


def is_sharded(module: nn.Module) -> bool:
    return all(isinstance(p, DTensor) for p in module.parameters(recurse=False))


def test_whole_weights_gathers_once_and_restores_fsdp2s_reshard_rule(one_process_group):
    torch.manual_seed(0)
    model = Tower()
    x = torch.randn(4, 8)
    expected = model(x)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    assert sharded_modules(model) == [model, *model.blocks] and outermost(sharded_modules(model)) == [model]
    with torch.no_grad(), whole_weights(model, reshard_after_forward=True):
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        assert torch.allclose(model(x), expected, atol=1e-6)
        assert not any(isinstance(p, DTensor) for p in model.parameters())  # the forward kept them whole
    assert all(is_sharded(m) for m in (model.head, *model.blocks))
    with torch.no_grad():
        assert torch.allclose(model(x), expected, atol=1e-6)
    assert not is_sharded(model.head)  # the root's own unit keeps its weights after forward
    assert all(is_sharded(block) for block in model.blocks)  # the others reshard, as configured


def test_whole_weights_leaves_an_unsharded_model_alone():
    model = Tower()
    before = [p.clone() for p in model.parameters()]
    with whole_weights(model, reshard_after_forward=True):
        model(torch.randn(2, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
