"""Run under ``accelerate launch`` with two processes: held-out evaluation with a reward whose sub-scores differ
between the processes (``uneven``: rank 0 reports ``score`` and ``extra``, rank 1 ``score`` only). Writes OUT.json
with the evaluation metrics of the last logged row.

Usage: ddp_eval_check.py OUT.json RUN_DIR
"""

import json
import sys


def uneven(batch) -> dict[str, list[float]]:
    """Rank 0: score 1 and an ``extra`` sub-score of 0.5 for every sample; rank 1: score 0 only."""
    import torch

    n = len(batch.completions)
    if torch.distributed.get_rank() == 0:
        return {"score": [1.0] * n, "extra": [0.5] * n}
    return {"score": [0.0] * n}


if __name__ == "__main__":
    from toy_bandit import ToyConfig

    from mmgrpo.config import load_config
    from mmgrpo.trainer import Trainer

    out_path, run_dir = sys.argv[1], sys.argv[2]
    cfg = load_config(None, [f"output_dir={run_dir}", "train.prompts_per_step=2", "train.max_steps=1",
                             "train.eval_every=1", "logging.progress=false", "logging.tensorboard=false",
                             "logging.plot_every=0",
                             "rewards=[{name: 'toy_bandit:match_reward'}, {name: 'ddp_eval_check:uneven', weight: 0}]"],
                      schema=ToyConfig)
    trainer = Trainer(cfg)
    history = trainer.train()
    if trainer.accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump({k: v for k, v in history[-1].items() if k.startswith("eval/")}, f)
    trainer.close()
