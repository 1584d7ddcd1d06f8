"""Run under ``accelerate launch`` with two gloo processes (configs/accelerate/cpu_2proc.yaml): flow rollouts with
the transformer really sharded. accelerate runs FSDP on GPUs only, so this shards the shipped tiny SD3 transformer
with torch's ``fully_shard`` (FSDP2) itself, one unit per transformer block plus the root (resharding after forward,
as accelerate's default), and tells the policy its weights are sharded, as ``FlowPolicy.setup`` learns from an
FSDP or ZeRO-3 launch.

Each process then rolls out its own prompt with its own noise, so DanceGRPO's random trained steps and TempFlow's
branch step differ between the processes: with micro-batches smaller than a group, which chunks replay and how
many rows a shared prefix runs would differ too, and the sharded forwards' gathers would no longer pair up.

Usage: flow_fsdp_rollout_check.py OUT.json

OUT.json (main process): ``sharded`` (the parameters are DTensors), and per preset the transformer forwards of each
rollout on each process (``forwards``: [process][rollout]) and whether every rollout gave finite latents.
"""

import sys

import torch
from accelerate import Accelerator
from fsdp2 import write_report_and_exit
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mmgrpo.config import load_config
from mmgrpo.pipelines.flow.policy import FlowPolicy

out_path = sys.argv[1]
acc = Accelerator(cpu=True)
rank = acc.process_index
PRESETS = {"tiny_dancegrpo": ["train.micro_batch_size=2", "mode.train_fraction=0.2"],
           "tiny_tempflow": ["train.micro_batch_size=4"]}
FlowPolicy.sharded = property(lambda self: True)  # what an FSDP / ZeRO-3 launch tells setup
report = {}
adapter = None
calls = [0]


def counting(forward):
    """``forward`` (the adapter's one transformer call), counting its calls in ``calls``."""
    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    return counted


for preset, overrides in PRESETS.items():
    cfg = load_config(f"configs/flow/{preset}.yaml", ["output_dir=/tmp/unused", "num_threads=1",
                                                      "train.prompts_per_step=1", *overrides])
    policy = FlowPolicy(cfg, adapter=adapter)
    if adapter is None:
        adapter = policy.adapter
        for block in adapter.transformer.transformer_blocks:
            fully_shard(block, reshard_after_forward=True)
        fully_shard(adapter.transformer)
        report["sharded"] = all(isinstance(p, DTensor) for p in adapter.transformer.parameters())
        adapter._forward = counting(adapter._forward)
    forwards, finite = [], True
    for iteration in range(3):
        calls[0] = 0
        item = policy.train_items[2 * iteration + rank]  # a different prompt and noise on each process
        rollout = policy.rollout([item], [rank], cfg.train.group_size)
        forwards.append(calls[0])
        finite &= bool(torch.isfinite(rollout.reward_batch.images).all())
    report[preset] = {"forwards": acc.gather_for_metrics([forwards], use_gather_object=True),
                      "finite": all(acc.gather_for_metrics([finite], use_gather_object=True))}
write_report_and_exit(acc, report, out_path)
