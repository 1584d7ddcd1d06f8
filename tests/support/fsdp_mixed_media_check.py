"""Run under ``accelerate launch`` with two gloo processes (configs/accelerate/cpu_2proc.yaml): training forwards,
backwards and prefills on data that mixes images and videos, with the weights really sharded. As in
fsdp_generation_check.py, the shipped tiny Qwen2-VL is sharded with torch's ``fully_shard`` (FSDP2), one unit per
decoder layer and vision block, and balanced as ``VLMPolicy.setup`` balances it (``calls_to_balance`` over the
preset's data, which mixes ShapesQA images and MotionQA videos).

Process 0 trains on an image question and a video question in one mini-batch (two tower calls), process 1 on two
image questions (one call, topped up with a dummy); each then prefills a prompt of another kind.

Usage: fsdp_mixed_media_check.py OUT.json

OUT.json (main process): ``calls`` (the balanced tower calls per fresh forward), ``sharded`` (the parameters are
DTensors), and per process ``tower_calls`` (real and dummy tower calls of the training forward and the prefill),
``logprob_diff`` and ``prefill_diff`` (max abs difference from the unsharded model on the same rows), and
``grad_diff`` (max abs difference of the gathered gradients from the mean of both processes' unsharded gradients).
"""

import sys

import torch
from accelerate import Accelerator
from fsdp2 import write_report_and_exit
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mmgrpo.config import load_config
from mmgrpo.pipelines.vlm.generation import prefill
from mmgrpo.pipelines.vlm.logprobs import token_logprobs
from mmgrpo.pipelines.vlm.policy import VLMPolicy
from mmgrpo.pipelines.vlm.vision_calls import VisionCallBalancer, calls_to_balance

out_path = sys.argv[1]
acc = Accelerator(cpu=True)
rank = acc.process_index
torch.manual_seed(0)
cfg = load_config("configs/vlm/demo_shapes.yaml", ["output_dir=/tmp/unused", "num_threads=1"])
policy = VLMPolicy(cfg)
model = policy.vlm.model
items = policy.train_items + policy.held_items
images = [policy._prepare(i).inputs for i in items if i["sample"].images][:3]
videos = [policy._prepare(i).inputs for i in items if i["sample"].videos][:2]
batches = [[images[0], videos[0]], [images[1], images[2]]]  # per process: the prompts of its mini-batch
prefills = [images[0], videos[1]][::-1]  # process 0 prefills a video prompt, process 1 an image prompt
generator = torch.Generator().manual_seed(0)
ids = torch.randint(0, 40, (4, 6), generator=generator)
mask = torch.arange(6) < torch.tensor([6, 3, 5, 2])[:, None]
index = torch.tensor([0, 1, 1, 0])


def loss_and_logprobs(prompts, grouper: bool):
    logp = token_logprobs(model, prompts, ids, mask, index, grouper)
    return (logp * torch.linspace(0.5, 1.5, 6)).sum() / mask.sum(), logp


def reference(grouper: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Unsharded: every process's log-probs, and the mean of their gradients (what FSDP's reduce-scatter gives)."""
    model.zero_grad(set_to_none=True)
    logps = []
    for prompts in batches:
        loss, logp = loss_and_logprobs(prompts, grouper)
        (loss / len(batches)).backward()
        logps.append(logp.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logps, grads


expected = {grouper: reference(grouper) for grouper in (False, True)}
with torch.no_grad():
    expected_prefill = prefill(policy.vlm, [prefills[rank]], 2, True, 4)[0]

calls = calls_to_balance([i["sample"] for i in items])
balancer = VisionCallBalancer(model, calls)
tower = balancer.tower
tower_calls = [0]
tower.register_forward_pre_hook(lambda *_: tower_calls.__setitem__(0, tower_calls[0] + 1))
for module in list(model.modules()):
    if type(module).__name__ in model._no_split_modules:
        fully_shard(module)
fully_shard(model)
sharded = all(isinstance(p, DTensor) for p in model.parameters())

report = {"tower_calls": [], "logprob_diff": 0.0, "grad_diff": 0.0}
for grouper in (False, True):
    logps, grads = expected[grouper]
    tower_calls[0] = 0
    loss, logp = loss_and_logprobs(batches[rank], grouper)
    loss.backward()
    report["tower_calls"].append(tower_calls[0])
    report["logprob_diff"] = max(report["logprob_diff"], float((logp.detach() - logps[rank]).abs().max()))
    for name, param in model.named_parameters():
        got = param.grad.full_tensor() if param.grad is not None else torch.zeros(param.shape)
        want = grads.get(name, torch.zeros(param.shape))
        report["grad_diff"] = max(report["grad_diff"], float((got - want).abs().max()))
    model.zero_grad(set_to_none=True)
tower_calls[0] = 0
with torch.no_grad():
    logits = prefill(policy.vlm, [prefills[rank]], 2, True, 4)[0]
report["tower_calls"].append(tower_calls[0])
report["prefill_diff"] = float((logits - expected_prefill).abs().max())

reports = [None] * acc.num_processes
torch.distributed.all_gather_object(reports, report)
write_report_and_exit(acc, {"calls": calls, "sharded": sharded, "processes": reports}, out_path)
