"""Run under ``accelerate launch`` with two gloo processes (configs/accelerate/cpu_2proc.yaml): synced decoding with
the weights really sharded. accelerate runs FSDP on GPUs only, so this shards the shipped tiny Qwen2-VL with torch's
``fully_shard`` (FSDP2) itself, one unit per decoder layer and vision block as ``TRANSFORMER_BASED_WRAP`` does, and
samples different held-out questions on each process.

Usage: fsdp_generation_check.py OUT.json

OUT.json (main process), per process: ``forwards`` (model calls of the sharded, synced sampling),
``forwards_alone`` (model calls this process's rows need on their own), ``lengths`` (completion lengths), and
``same_as_unsharded`` (the sharded, synced samples equal the whole model's synced samples, token for token, with
log-probs within 1e-5); plus ``sharded`` (the parameters are DTensors).
"""

import json
import sys

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mmgrpo.config import load_config
from mmgrpo.pipelines.vlm.generation import generate_groups
from mmgrpo.pipelines.vlm.policy import VLMPolicy
from mmgrpo.policy import any_process

out_path = sys.argv[1]
acc = Accelerator(cpu=True)
rank = acc.process_index
cfg = load_config("configs/vlm/demo_shapes.yaml", ["output_dir=/tmp/unused", "num_threads=1",
                                                   "generation.max_new_tokens=40", "generation.batch_rows=8"])
policy = VLMPolicy(cfg)
model = policy.vlm.model
videos = [item for item in policy.held_items if item["sample"].videos][:4]
prompts = [policy._prepare(item).inputs for item in videos[rank::2]]
gen_cfg = cfg.generation
forwards = [0]
model.register_forward_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))


def sample(synced) -> tuple[list, int]:
    """G=4 completions of this process's prompts at temperature 1.5 (lengths vary), and the model calls made."""
    forwards[0] = 0
    generator = torch.Generator().manual_seed(100 + rank)
    hot = type(gen_cfg)(**{**gen_cfg.__dict__, "temperature": 1.5})
    outs = generate_groups(policy.vlm, prompts, 4, hot, generator, synced)
    return outs, forwards[0]


_, alone = sample(None)
whole, _ = sample(any_process)
for module in list(model.modules()):
    if type(module).__name__ in model._no_split_modules:
        fully_shard(module)
fully_shard(model)
sharded_before = all(isinstance(p, DTensor) for p in model.parameters())
sharded, calls = sample(any_process)
same = all(torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and (a.logprobs - b.logprobs).abs().max() < 1e-5
           for a, b in zip(whole, sharded))
report = {"forwards": calls, "forwards_alone": alone, "same_as_unsharded": same,
          "lengths": [o.mask.sum(1).tolist() for o in sharded]}
reports = [None] * acc.num_processes
torch.distributed.all_gather_object(reports, report)
if acc.is_main_process:
    with open(out_path, "w") as f:
        json.dump({"processes": reports,
                   "sharded": sharded_before}, f)
acc.wait_for_everyone()
# destroy the group while the interpreter is fully alive, after releasing the sharded modules that hold it: a gloo
# group left to interpreter exit can abort the process (Trainer.close does the same)
policy = model = whole = sharded = None
acc.end_training()
