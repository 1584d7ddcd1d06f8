"""Run under ``accelerate launch --multi_gpu --num_processes 2``: checks that advantages on gathered groups equal
the one-process computation, that one optimiser step leaves identical parameters on every rank, and that a time
budget (``train.max_minutes``) stops every rank at the same step, and that dynamic sampling's refill keeps the ranks
in step.

Usage: ddp_check.py OUT.json RUN_DIR
"""

import json
import sys

import torch
from toy_bandit import ToyConfig

from mmgrpo.config import load_config
from mmgrpo.grpo import clip_advantages, combine_rewards
from mmgrpo.trainer import Trainer

out_path, run_dir = sys.argv[1], sys.argv[2]
cfg = load_config(None, [f"output_dir={run_dir}", "train.prompts_per_step=4", "train.group_size=4",
                         "train.micro_batch_size=4", "grpo.advantage=group_mean_batch_std", "grpo.adv_clip=1.5",
                         "optim.lr=0.05", "logging.progress=false"], schema=ToyConfig)
trainer = Trainer(cfg)
acc = trainer.accelerator
items_idx, group_ids = trainer.sampler.next()
with torch.no_grad():
    rollout = trainer.policy.rollout([trainer.train_items[i] for i in items_idx], group_ids, cfg.train.group_size)
main, _, _ = trainer.rewards(rollout.reward_batch)
unit_adv, _ = trainer.compute_advantages(rollout, main)

all_main = acc.gather(main).cpu()
all_group = acc.gather(rollout.group).cpu()
all_adv = acc.gather(unit_adv[:, 0].contiguous()).cpu()
reference = clip_advantages(combine_rewards(all_main, trainer.rewards.weights, all_group, "weighted_sum",
                                            "group_mean_batch_std", cfg.grpo.adv_eps), cfg.grpo.adv_clip)
# what a per-process (wrong) computation would give: local statistics only
local_only = clip_advantages(combine_rewards(main, trainer.rewards.weights, rollout.group, "weighted_sum",
                                             "group_mean_batch_std", cfg.grpo.adv_eps), cfg.grpo.adv_clip)

before = torch.cat([p.detach().flatten() for p in acc.unwrap_model(trainer.policy.model).parameters()])
trainer.train_on_rollout(rollout, unit_adv, lambda metrics: None)
after = torch.cat([p.detach().flatten() for p in acc.unwrap_model(trainer.policy.model).parameters()])
params = acc.gather(after[None]).cpu()
groups_per_rank = acc.gather(torch.tensor([len(set(rollout.group.tolist()))])).cpu()

if acc.is_main_process:
    summary = {
        "num_processes": acc.num_processes,
        "adv_max_abs_diff": (all_adv.double() - reference).abs().max().item(),
        "local_vs_global_diff": (local_only - all_adv[: len(local_only)].double()).abs().max().item(),
        "param_rank_diff": (params[0] - params[1]).abs().max().item(),
        "param_change": (after - before).abs().max().item(),
        "distinct_groups": len(set(all_group.tolist())),
        "groups_per_rank": groups_per_rank.tolist(),
    }
    with open(out_path, "w") as f:
        json.dump(summary, f)
acc.wait_for_everyone()

# processes reporting different metric keys must not hang or crash the reduction
extra = {"loss": float(acc.process_index), f"only/rank{acc.process_index}": 1.0, "ratio/max_dev": 0.1 * acc.process_index}
reduced = trainer.reduce_metrics(extra)
if acc.is_main_process:
    with open(out_path) as f:
        summary = json.load(f)
    summary["reduced"] = reduced
    with open(out_path, "w") as f:
        json.dump(summary, f)
acc.wait_for_everyone()

# a time budget: rank 1's rollouts take twice as long, and its clock must stop both at the same step
trainer.cfg.train.max_minutes = 0.01
trainer.cfg.train.save_every = 0
trainer.cfg.train.max_steps = 1000
trainer.cfg.toy.sleep_s = 0.05 * (1 + acc.process_index)
trainer.train()
steps = acc.gather(torch.tensor([trainer.step])).cpu()
params = acc.gather(torch.cat([p.detach().flatten() for p in acc.unwrap_model(trainer.policy.model).parameters()])[None])
if acc.is_main_process:
    with open(out_path) as f:
        summary = json.load(f)
    summary["time_budget"] = {"steps": steps.tolist(), "param_rank_diff": (params[0] - params[1]).abs().max().item()}
    with open(out_path, "w") as f:
        json.dump(summary, f)
acc.wait_for_everyone()

# dynamic sampling's refill (one extra prompt each in the first round): the processes draw different groups, so
# each would want another number of rounds; they must run as many, keep as many rows, and end with the same parameters
refill_cfg = load_config(None, [f"output_dir={run_dir}-refill", "train.prompts_per_step=4", "train.group_size=2",
                                "train.micro_batch_size=4", "toy.seq_len=1", "toy.num_arms=2",
                                "grpo.mask_zero_std_groups=true", "grpo.refill_rounds=6", "train.max_steps=4",
                                "grpo.oversample_prompts=2",
                                "optim.lr=0.05", "logging.progress=false"], schema=ToyConfig)
trainer.policy.model = acc.unwrap_model(trainer.policy.model)  # done with it: its DDP wrapper holds the group
refill = Trainer(refill_cfg, accelerator=acc)
history = refill.train()
sampler_steps = acc.gather(torch.tensor([refill.sampler.steps])).cpu()
params = acc.gather(torch.cat([p.detach().flatten() for p in acc.unwrap_model(refill.policy.model).parameters()])[None])
if acc.is_main_process:
    with open(out_path) as f:
        summary = json.load(f)
    summary["refill"] = {"rounds": [r["dynamic/rounds"] for r in history],
                         "signal_frac": [r["dynamic/signal_frac"] for r in history],
                         "param_rank_diff": (params[0] - params[1]).abs().max().item(),
                         "sampler_steps": sampler_steps.tolist()}
    with open(out_path, "w") as f:
        json.dump(summary, f)
acc.wait_for_everyone()
refill.close()
