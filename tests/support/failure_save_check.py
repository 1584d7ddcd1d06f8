"""Run under ``accelerate launch`` with two processes: a RunError that only some processes raise before a step
trains or in its evaluation (a reward that fails on one of them) stops every process at the same step, after one
checkpoint of the steps trained so far, and nobody waits for a process that is gone. Writes OUT.json with, per
scenario, what each rank raised, the checkpoints and the logged steps; ``resumed``: the steps of a resume of the
first scenario's run.

- ``reward``: rank 1's zero-weight reward fails at its 4th call (save_every=0: 3 steps to save).
- ``refill``: rank 0's reward fails at its 5th call, in the first refill round of the second iteration, while rank
  1 goes on to the round's agreement on how many groups are missing.
- ``both``: both ranks' rewards fail at their 3rd call.
- ``eval``: rank 1's reward fails in the in-loop evaluation after step 4 (its 6th call), after training.

Usage: failure_save_check.py OUT.json RUN_DIR
"""

import json
import sys
from pathlib import Path

from accelerate.utils import gather_object
from toy_bandit import ToyConfig, constant_reward

from mmgrpo.checkpoint import checkpoint_dirs
from mmgrpo.config import load_config
from mmgrpo.errors import RunError
from mmgrpo.tracking import read_metrics
from mmgrpo.trainer import Trainer

QUIET = ["logging.progress=false", "logging.tensorboard=false", "logging.plot_every=0"]
FAIL_AT: dict[int, int] = {}
"""rank -> the call of ``flaky`` that raises (none: it never does)."""
calls = [0]


def flaky(batch) -> list[float]:
    """0 for every sample, until the call FAIL_AT[rank] of this process, which raises."""
    import torch

    calls[0] += 1
    if calls[0] == FAIL_AT.get(torch.distributed.get_rank()):
        raise ConnectionError(f"the reward server is gone (rank {torch.distributed.get_rank()})")
    return constant_reward(batch)


def run(acc, run_dir: Path, fail_at: dict[int, int], *overrides: str) -> tuple[dict, Trainer]:
    import failure_save_check as rewards  # the module the config names, not this __main__

    rewards.FAIL_AT.clear()
    rewards.FAIL_AT.update(fail_at)
    rewards.calls[0] = 0
    cfg = load_config(None, [f"output_dir={run_dir}", "train.prompts_per_step=2", "train.group_size=4",
                             "train.max_steps=6", "train.save_every=0", *QUIET, *overrides], schema=ToyConfig)
    trainer = Trainer(cfg, accelerator=acc)
    raised = None
    try:
        trainer.train()
    except RunError as err:
        raised = str(err)
    # done with it: its DDP wrapper holds the group, and the next trainer's checkpoints hold its objects only
    trainer.policy.model = acc.unwrap_model(trainer.policy.model)
    acc.free_memory()
    acc._save_model_state_pre_hook.clear()
    acc._load_model_state_pre_hook.clear()
    return {"raised": gather_object([raised]), "step": gather_object([trainer.step]),
            "checkpoints": [p.name for _, p in checkpoint_dirs(run_dir)],
            "steps": [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]}, trainer


if __name__ == "__main__":
    from accelerate import Accelerator

    out_path, root = sys.argv[1], Path(sys.argv[2])
    acc = Accelerator(cpu=True)
    result = {}
    rewards = "rewards=[{name: 'toy_bandit:match_reward'}, {name: 'failure_save_check:flaky', weight: 0}]"
    result["reward"], _ = run(acc, root / "reward", {1: 4}, rewards)
    resumed, _ = run(acc, root / "reward", {}, rewards, "resume=latest")
    result["resumed"] = resumed
    refill = ["toy.seq_len=1", "toy.num_arms=2", "train.group_size=2", "train.micro_batch_size=8",
              "grpo.mask_zero_std_groups=true", "grpo.refill_rounds=2",
              "rewards=[{name: 'failure_save_check:flaky'}]"]
    result["refill"], _ = run(acc, root / "refill", {0: 5}, *refill)
    result["both"], _ = run(acc, root / "both", {0: 3, 1: 3}, rewards)
    result["eval"], last = run(acc, root / "eval", {1: 6}, rewards, "train.eval_every=2")
    if acc.is_main_process:
        Path(out_path).write_text(json.dumps(result))
    last.close()
