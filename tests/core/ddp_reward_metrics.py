"""Run under ``accelerate launch`` with two processes: one training step of the toy bandit with a zero-weight
reward that applies to half of rank 0's samples (score 0) and to all of rank 1's (score 1); writes the logged row.

Usage: ddp_reward_metrics.py OUT.json RUN_DIR
"""

import json
import math
import sys

import torch


def sparse(batch) -> list[float]:
    """Rank 0: NaN for the first half of the batch, 0 for the rest; rank 1: 1 for every sample."""
    n = len(batch.completions)
    if torch.distributed.get_rank() == 1:
        return [1.0] * n
    return [math.nan] * (n // 2) + [0.0] * (n - n // 2)


if __name__ == "__main__":
    from toy_bandit import ToyConfig

    from mmgrpo.config import load_config
    from mmgrpo.trainer import Trainer

    out_path, run_dir = sys.argv[1], sys.argv[2]
    cfg = load_config(None, [f"output_dir={run_dir}", "train.prompts_per_step=2", "train.group_size=4",
                             "train.max_steps=1", "logging.progress=false", "logging.tensorboard=false",
                             "logging.plot_every=0",
                             "rewards=[{name: 'toy_bandit:match_reward'}, {name: 'ddp_reward_metrics:sparse', weight: 0}]"],
                      schema=ToyConfig)
    trainer = Trainer(cfg)
    history = trainer.train()
    if trainer.accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump(history[-1], f)
    trainer.close()
