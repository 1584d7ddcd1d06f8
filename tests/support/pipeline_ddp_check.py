"""Run under ``accelerate launch --multi_gpu --num_processes 2``: trains a real pipeline (flow or vlm) from a preset
for its ``train.max_steps`` and reports whether every rank ends with the same trained parameters.

Usage: pipeline_ddp_check.py OUT.json CONFIG.yaml [dotted.key=value ...]

OUT.json (written by the main process): ``num_processes``, ``param_rank_diff`` (max |rank 0 - rank 1| over the
trained parameters), ``param_change`` (max |after - before| on rank 0) and ``onpolicy_max_dev`` of the
first step.
"""

import json
import sys

import torch

from mmgrpo.config import load_config
from mmgrpo.trainer import Trainer

out_path, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
trainer = Trainer(load_config(config, overrides))
acc = trainer.accelerator


def trained() -> torch.Tensor:
    model = acc.unwrap_model(trainer.policy.model)
    return torch.cat([p.detach().float().flatten() for p in model.parameters() if p.requires_grad])


before = trained()
history = trainer.train()
after = trained()
params = acc.gather(after[None]).cpu()
if acc.is_main_process:
    with open(out_path, "w") as f:
        json.dump({"num_processes": acc.num_processes, "param_rank_diff": (params[0] - params[1]).abs().max().item(),
                   "param_change": (after - before).abs().max().item(),
                   "onpolicy_max_dev": history[0]["ratio/onpolicy_max_dev"]}, f)
acc.wait_for_everyone()
trainer.close()
