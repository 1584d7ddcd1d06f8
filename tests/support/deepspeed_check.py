"""Run under ``accelerate launch --num_processes 2`` with configs/accelerate/deepspeed_zero2.yaml or
deepspeed_zero3.yaml (``--mixed_precision no``), or with cpu_2proc.yaml for the DDP reference: the trainer's
DeepSpeed paths on DeepSpeed's CPU accelerator over gloo, as ``make_accelerator`` sets them up on a machine without
CUDA.

Usage: deepspeed_check.py OUT.json ROOT

1. The toy policy with a NaN gradient at step 2 of 3 (``toy.nan_rollout=2``): the update must leave the weights as
   they were (DeepSpeed's engine steps inside accelerate's ``backward``, before the trainer sees the norm).
2. A full fine-tune of the shipped tiny Qwen2-VL with its frozen KL reference: a straight 2-step run (ROOT/straight,
   saving each step) and a run resumed from its step 1 (ROOT/resumed).

OUT.json (main process): ``distributed_type``, ``zero_stage``, ``toy_skipped``, ``toy_step2_max_change`` (max
|weights after step 2 - after step 1|), ``rows`` (the straight and the resumed run's step-2 metrics), ``onpolicy``
(the straight run's ``ratio/onpolicy_max_dev`` at each step) and ``rank_max_diff`` (max |rank 0 - rank 1| over the
weights after step 2; None under ZeRO-3). The step-2 weights each run saves are in ROOT/<run>/checkpoints/step-2.
"""

import sys
from pathlib import Path

import torch
from fsdp2 import write_report_and_exit
from toy_bandit import ToyConfig

from mmgrpo.config import load_config
from mmgrpo.trainer import Trainer

out_path, root = sys.argv[1], Path(sys.argv[2])
QUIET = ["logging.progress=false", "logging.plot_every=0", "train.eval_every=0"]


def toy_nan_run() -> tuple[int, float]:
    """The skipped-update count and max |weights after step 2 - after step 1| of a toy run whose step 2 has a NaN
    gradient."""
    cfg = load_config(None, [f"output_dir={root / 'toy'}", *QUIET, "train.max_steps=3", "toy.nan_rollout=2",
                             "train.prompts_per_step=2", "train.save_every=0"], schema=ToyConfig)
    trainer = Trainer(cfg)
    weights = {}

    def keep(step, row):
        weights[step] = gathered(trainer)
        return False

    trainer.train(should_stop=keep)
    change = (weights[2] - weights[1]).abs().max().item() if trainer.accelerator.is_main_process else None
    return trainer.skipped_updates, change


def gathered(trainer: Trainer) -> torch.Tensor | None:
    """The trained model's weights, whole (ZeRO-3 gathers them), flattened in one fp32 vector on the main process;
    None on the others. Every process must call it."""
    state = trainer.accelerator.get_state_dict(trainer.policy.model, unwrap=True)
    if not trainer.accelerator.is_main_process:
        return None
    return torch.cat([v.detach().float().flatten().cpu() for _, v in sorted(state.items())])


def rank_max_diff(trainer: Trainer) -> float | None:
    """max |rank 0 - rank 1| over the model's parameters as each process holds them; None under ZeRO-3, whose
    processes hold different shards."""
    plugin = trainer.accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.zero_stage == 3:
        return None
    mine = torch.cat([p.detach().float().flatten() for p in trainer.policy.model.parameters()])
    ranks = trainer.accelerator.gather(mine[None])
    return (ranks[0] - ranks[1]).abs().max().item()


def vlm_config(run: str, *overrides: str):
    return load_config("configs/vlm/tiny_image.yaml", [
        f"output_dir={root / run}", *QUIET, "model.lora_rank=0", "train.max_steps=2", "train.save_every=1",
        "train.prompts_per_step=2", "train.group_size=4", "train.micro_batch_size=4", *overrides])


skipped, toy_change = toy_nan_run()
straight = Trainer(vlm_config("straight"))
acc = straight.accelerator
history = straight.train()
ranks = rank_max_diff(straight)
rows = [history[-1:]]
resumed = Trainer(vlm_config("resumed", f"resume={root / 'straight' / 'checkpoints' / 'step-1'}"))
rows.append(resumed.train()[-1:])
plugin = acc.state.deepspeed_plugin
write_report_and_exit(acc, {
    "distributed_type": acc.distributed_type.value, "zero_stage": plugin.zero_stage if plugin else None,
    "toy_skipped": skipped, "toy_step2_max_change": toy_change, "rows": rows,
    "onpolicy": [r["ratio/onpolicy_max_dev"] for r in history],
    "rank_max_diff": ranks}, out_path)
