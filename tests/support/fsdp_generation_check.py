"""Run under ``accelerate launch`` with two gloo processes (configs/accelerate/cpu_2proc.yaml): sampling with the
weights really sharded. accelerate runs FSDP on GPUs only, so this shards the shipped tiny Qwen2-VL with torch's
``fully_shard`` (FSDP2) itself, one unit per decoder layer and vision block as ``TRANSFORMER_BASED_WRAP`` does
(resharding after forward, as accelerate's default), and samples different held-out questions on each process.

Usage: fsdp_generation_check.py OUT.json

OUT.json (main process), per process:

- ``forwards`` (model calls of the sharded, synced sampling), ``forwards_alone`` (model calls this process's rows
  need on their own), ``lengths`` (completion lengths), and ``same_as_unsharded`` (the sharded, synced samples
  equal the whole model's synced samples, token for token, with log-probs within 1e-5);
- whole weights (:func:`whole_weights`): ``whole_inside`` (no parameter is sharded inside the block),
  ``forwards_whole`` (model calls of unsynced sampling inside it), ``whole_same_as_alone`` (those samples equal the
  unsharded model's unsynced ones), ``sharded_after`` (every parameter is sharded again after it);
- ``policy_eval_same`` (``VLMPolicy.generate`` on held-out items, sharded and gathering through
  ``sampling_weights``, answers what the unsharded policy answers), ``tgrpo_video_groups`` (a T-GRPO rollout of a
  video and an image prompt on one process and two image prompts on the other: the shuffled-frame rollouts run on
  one process only, which sharded decoding in step could not do), and ``grad_max_diff`` (after all that sampling,
  the averaged gradient of a training forward and backward against the unsharded model's);

plus ``sharded`` (the parameters are DTensors after sharding).
"""

import sys

import torch
from accelerate import Accelerator
from fsdp2 import write_report_and_exit
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mmgrpo.config import load_config
from mmgrpo.pipelines.vlm.generation import generate_groups
from mmgrpo.pipelines.vlm.policy import VLMPolicy
from mmgrpo.pipelines.vlm.whole_weights import whole_weights
from mmgrpo.policy import any_process
from mmgrpo.rewards import AccuracyReward

out_path = sys.argv[1]
acc = Accelerator(cpu=True)
rank = acc.process_index
cfg = load_config("configs/vlm/demo_shapes.yaml", ["output_dir=/tmp/unused", "num_threads=1",
                                                   "generation.max_new_tokens=40", "generation.batch_rows=8"])
policy = VLMPolicy(cfg)
model = policy.vlm.model
videos = [item for item in policy.held_items if item["sample"].videos][:4]
prompts = [policy._prepare(item).inputs for item in videos[rank::2]]
eval_items = policy.held_items[rank * 3:rank * 3 + 3]
gen_cfg = cfg.generation
forwards = [0]
model.register_forward_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))


def same_samples(first, second) -> bool:
    return all(torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
               and (a.logprobs - b.logprobs).abs().max() < 1e-5 for a, b in zip(first, second))


def sample(synced) -> tuple[list, int]:
    """G=4 completions of this process's prompts at temperature 1.5 (lengths vary), and the model calls made."""
    forwards[0] = 0
    generator = torch.Generator().manual_seed(100 + rank)
    hot = type(gen_cfg)(**{**gen_cfg.__dict__, "temperature": 1.5})
    outs = generate_groups(policy.vlm, prompts, 4, hot, generator, synced)
    return outs, forwards[0]


def gradients() -> dict[str, torch.Tensor]:
    """A training forward and backward on this process's first prompt; the gradients averaged over processes."""
    model.zero_grad()
    logits = model(**prompts[0]).logits.float()
    logits.log_softmax(-1).amax(-1).mean().backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad.clone()
        if not isinstance(param.grad, DTensor):  # unsharded: average by hand, as FSDP's reduce-scatter does
            torch.distributed.all_reduce(grad)
            grad /= acc.num_processes
        grads[name] = grad
    return grads


alone_outs, alone = sample(None)
whole, _ = sample(any_process)
eval_reference = policy.generate(eval_items).completions
grad_reference = gradients()
for module in list(model.modules()):
    if type(module).__name__ in model._no_split_modules:
        fully_shard(module, reshard_after_forward=True)
fully_shard(model)
sharded_before = all(isinstance(p, DTensor) for p in model.parameters())
sharded, calls = sample(any_process)
with whole_weights(model, reshard_after_forward=True):
    whole_inside = not any(isinstance(p, DTensor) for p in model.parameters())
    gathered, gathered_calls = sample(None)  # unsynced: the processes run different numbers of forwards
sharded_after = all(isinstance(p, DTensor) for p in model.parameters())
policy.synced, policy.reshard_after_forward = any_process, True  # what VLMPolicy.setup sets under FSDP2
policy_eval_same = policy.generate(eval_items).completions == eval_reference
policy.accuracy = AccuracyReward()  # T-GRPO's shuffled rollouts, as a temporal_bonus reward turns them on
clips = [item for item in policy.train_items if item["sample"].videos]
stills = [item for item in policy.train_items if not item["sample"].videos]
tgrpo_video_groups = policy.rollout([clips[0], stills[0]] if rank == 0 else stills[1:3], [0, 1], 2).counters[
    "tgrpo/video_groups"]
grad_max_diff = max((g - grad_reference[name]).abs().max().item() for name, g in gradients().items())
report = {"forwards": calls, "forwards_alone": alone, "same_as_unsharded": same_samples(whole, sharded),
          "lengths": [o.mask.sum(1).tolist() for o in sharded], "whole_inside": whole_inside,
          "forwards_whole": gathered_calls, "whole_same_as_alone": same_samples(alone_outs, gathered),
          "sharded_after": sharded_after, "policy_eval_same": policy_eval_same, "grad_max_diff": grad_max_diff,
          "tgrpo_video_groups": tgrpo_video_groups}
reports = [None] * acc.num_processes
torch.distributed.all_gather_object(reports, report)
write_report_and_exit(acc, {"processes": reports, "sharded": sharded_before}, out_path)
