"""Run under ``accelerate launch`` with two processes; writes OUT.json with what the checks below found.

- ``row``: the logged row of one training step of the toy bandit with a zero-weight reward that applies to half of
  rank 0's samples (score 0) and to all of rank 1's (score 1), with a sub-score that only rank 1 reports.
- ``steps``: per rank, the metrics of two updates (two inner epochs, the second off-policy) in which rank 0 trains no
  unit and rank 1 all but the last two of its first row.
- ``whole_loss``: the on-policy loss of those updates' whole batch (both ranks' rows) on one process.
- ``max_dev``: ``reduce_metrics`` of a max_dev that rank 0 could not measure (NaN) and rank 1 measured as 0.5.

Usage: ddp_metrics.py OUT.json RUN_DIR
"""

import json
import math
import sys

import torch


def sparse(batch) -> dict[str, list[float]]:
    """Rank 0: NaN for the first half of the batch, 0 for the rest; rank 1: 1 for every sample, and a sub-score
    ``extra`` of 1 that rank 0 does not report."""
    n = len(batch.completions)
    if torch.distributed.get_rank() == 1:
        return {"score": [1.0] * n, "extra": [1.0] * n}
    return {"score": [math.nan] * (n // 2) + [0.0] * (n - n // 2)}


if __name__ == "__main__":
    from accelerate.utils import gather_object
    from toy_bandit import ToyConfig, ToyPolicy

    from mmgrpo.config import load_config
    from mmgrpo.grpo import aggregation_weights
    from mmgrpo.trainer import Trainer

    out_path, run_dir = sys.argv[1], sys.argv[2]
    quiet = ["logging.progress=false", "logging.tensorboard=false", "logging.plot_every=0"]
    cfg = load_config(None, [f"output_dir={run_dir}", "train.prompts_per_step=2", "train.group_size=4",
                             "train.max_steps=1", *quiet,
                             "rewards=[{name: 'toy_bandit:match_reward'}, {name: 'ddp_metrics:sparse', weight: 0}]"],
                      schema=ToyConfig)
    trainer = Trainer(cfg)
    history = trainer.train()
    acc = trainer.accelerator
    trainer.policy.model = acc.unwrap_model(trainer.policy.model)  # done with it: its DDP wrapper holds the group

    class RankZeroTrainsNothing(ToyPolicy):
        def rollout(self, items, group_ids, group_size):
            out = super().rollout(items, group_ids, group_size)
            out.mask[:] = acc.process_index == 1
            out.mask[0, 1:] = False  # uneven rows: a whole group's advantages no longer cancel in the token mean
            return out

    cfg = load_config(None, [f"output_dir={run_dir}-second", "train.prompts_per_step=2", "train.group_size=4",
                             "train.num_inner_epochs=2", "grpo.clip_eps=0.01", "optim.lr=0.5", *quiet],
                      schema=ToyConfig)
    second = Trainer(cfg, policy=RankZeroTrainsNothing(cfg), accelerator=acc)
    items_idx, group_ids = second.sampler.next()
    with torch.no_grad():
        rollout = second.policy.rollout([second.train_items[i] for i in items_idx], group_ids, 4)
    main, _, _ = second.rewards(rollout.reward_batch)
    unit_adv, _ = second.compute_advantages(rollout, main)
    all_mask = acc.gather(rollout.mask.float()).cpu().bool()
    all_adv = acc.gather(unit_adv.contiguous()).cpu()
    whole_loss = (aggregation_weights(all_mask, cfg.grpo.loss_aggregation) * -all_adv).sum().item()  # ratio 1
    steps = []
    second.train_on_rollout(rollout, unit_adv, steps.append)
    steps = gather_object([steps])
    max_dev = second.reduce_metrics({"ratio/onpolicy_max_dev": 0.5 if acc.process_index else math.nan})
    if acc.is_main_process:
        with open(out_path, "w") as f:
            json.dump({"row": history[-1], "steps": steps, "whole_loss": whole_loss,
                       "max_dev": max_dev["ratio/onpolicy_max_dev"]}, f)
    second.close()
