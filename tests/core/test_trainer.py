"""The trainer, end to end, on the toy bandit policy (tests/support/toy_bandit.py)."""

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin
from ports import free_port
from safetensors.torch import load_file
from toy_bandit import ToyConfig

from mmgrpo import checkpoint
from mmgrpo.checkpoint import checkpoint_dirs
from mmgrpo.cli import _policy_and_weights
from mmgrpo.config import ConfigError, load_config
from mmgrpo.errors import RunError
from mmgrpo.grpo import combine_rewards, kl_estimate
from mmgrpo.policy import (
    check_even_eval_split,
    frozen_copy,
    rows_after_first_update,
    update_sizes,
)
from mmgrpo.registry import import_path
from mmgrpo.tracking import read_metrics
from mmgrpo.trainer import Trainer, check_batch_layout, configure_deepspeed, merge_metric_rows

SUPPORT = Path(__file__).resolve().parents[1] / "support"
QUIET = ["logging.progress=false", "logging.tensorboard=false", "logging.plot_every=0"]


ROOT = Path(__file__).resolve().parents[2]


def toy(tmp_path, *overrides):
    return load_config(None, [f"output_dir={tmp_path}", *QUIET, *overrides], schema=ToyConfig)


def test_reward_rises_and_first_ratio_is_exactly_one(tmp_path):
    cfg = toy(tmp_path, "train.max_steps=25", "train.prompts_per_step=4", "optim.lr=0.1", "grpo.kl_beta=0.01")
    history = Trainer(cfg).train()
    rewards = [r["reward/mean"] for r in history]
    assert len(history) == 25 and [r["step"] for r in history] == list(range(1, 26))
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.25, rewards
    assert max(r["ratio/onpolicy_max_dev"] for r in history) <= 1e-6
    required = {"step", "reward/mean", "loss", "ratio/mean", "ratio/onpolicy_max_dev", "clip_frac", "kl",
                "time/rollout_s", "time/reward_s", "time/train_s"}
    assert required <= set(history[0]), required - set(history[0])
    assert all(r["reward/toy_bandit:match_reward/nan_frac"] == 0.0 for r in history)  # a series without gaps
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "plots" / "reward_mean.png").is_file()
    assert not list((tmp_path / "plots").glob("*nan_frac*"))  # always 0: not drawn
    assert (tmp_path / "checkpoints" / "step-25" / "policy" / "model.safetensors").is_file()


def test_micro_batching_does_not_change_the_update(tmp_path):
    """Aggregation weights are computed over the whole update, so splitting it into micro-batches (and hence
    separate backward passes) gives the same step as one big batch. A large AdamW eps makes the update linear in
    the gradient, so float noise in near-zero gradients is not blown up to full-size steps by Adam's scaling."""
    finals = []
    for micro in (16, 4, 1):
        run = tmp_path / f"mb{micro}"
        cfg = toy(run, "train.max_steps=3", "train.prompts_per_step=4", "train.group_size=4",
                  f"train.micro_batch_size={micro}", "grpo.loss_aggregation=seq-mean-token-mean", "optim.lr=0.5",
                  "optim.eps=1.0")
        Trainer(cfg).train()
        finals.append(load_file(str(run / "checkpoints" / "step-3" / "policy" / "model.safetensors")))
    for other in finals[1:]:
        for key in finals[0]:
            torch.testing.assert_close(other[key], finals[0][key], atol=1e-6, rtol=0)


def test_inner_epochs_and_updates_count_optimiser_steps(tmp_path):
    cfg = toy(tmp_path, "train.max_steps=8", "train.num_inner_epochs=2", "train.updates_per_rollout=2",
              "train.prompts_per_step=2", "train.group_size=4", "train.micro_batch_size=2")
    history = Trainer(cfg).train()
    assert [r["iteration"] for r in history] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert [r["inner_epoch"] for r in history] == [0, 0, 1, 1] * 2
    # later updates of an iteration are off-policy: their ratios move away from 1
    assert history[1]["ratio/max_dev"] > 0 and history[0]["ratio/onpolicy_max_dev"] == 0


def test_deepspeed_takes_the_runs_clipping_and_micro_batch(tmp_path):
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0)  # what a launcher config file sets
    assert plugin.is_auto("train_micro_batch_size_per_gpu")  # accelerate's prepare refuses it without a dataloader
    configure_deepspeed(plugin, toy(tmp_path, "optim.max_grad_norm=5.0", "train.micro_batch_size=2"))
    assert plugin.deepspeed_config["gradient_clipping"] == 5.0
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 2


def test_deepspeed_fills_the_batch_size_from_the_runs_micro_batch(tmp_path):
    """A DeepSpeed JSON file's train_batch_size (or the one an earlier trainer's prepare filled in this process)
    disagreed with the run's micro-batch, and DeepSpeed's engine stopped on the mismatch; prepare now fills it."""
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "train_batch_size": 64,
                                           "train_micro_batch_size_per_gpu": 8})
    configure_deepspeed(plugin, toy(tmp_path, "train.micro_batch_size=2"))
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 2
    assert plugin.is_auto("train_batch_size")


def test_deepspeed_bf16_skips_a_non_finite_update_itself(tmp_path):
    """The engine steps inside accelerate's backward, before the trainer reads the norm; DeepSpeed releases before
    0.19.3 left bf16's overflow check off, and applied a NaN update."""
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True,
                                                                                       "check_grad_overflow": False}})
    configure_deepspeed(plugin, toy(tmp_path))
    assert plugin.deepspeed_config["bf16"] == {"enabled": True, "check_grad_overflow": True}


def test_deepspeed_does_not_accumulate_over_the_runs_updates(tmp_path):
    """The trainer accumulates the micro-batches of an update itself; a launcher file's gradient_accumulation_steps
    made the engine divide every loss by it (gradients, clipping threshold and logged grad_norm off by that factor)."""
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=4)
    configure_deepspeed(plugin, toy(tmp_path))
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1


@pytest.mark.usefixtures("own_accelerator_state")
def test_a_launchers_gradient_accumulation_does_not_scale_the_loss(tmp_path, monkeypatch):
    """``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` (set by ``accelerate launch --gradient_accumulation_steps``) made
    ``accelerator.backward`` divide every loss by it: the same run gave a 4x smaller gradient."""
    norms = []
    for steps in ("1", "4"):
        AcceleratorState._reset_state()
        monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", steps)
        history = Trainer(toy(tmp_path / steps, "train.max_steps=1", "optim.max_grad_norm=0")).train()
        norms.append(history[0]["grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-6) and norms[0] > 0


def test_sharded_parameters_need_held_out_items_that_split_evenly():
    with pytest.raises(ConfigError, match="'data.num_eval': 10 held-out items do not split evenly over 4 processes"):
        check_even_eval_split(10, 4, sharded=True)
    check_even_eval_split(10, 4, sharded=False)  # DDP: every process holds whole weights
    with pytest.raises(ConfigError, match=r"'data.num_eval': 1 held-out items leave some of the 2 processes none"):
        check_even_eval_split(1, 2, sharded=False)  # the idle process's collectives would pair with evaluation's
    check_even_eval_split(0, 2, sharded=False)  # no evaluation at all
    check_even_eval_split(12, 4, sharded=True)


def test_frozen_copy_is_a_frozen_equal_copy_and_refuses_weights_not_loaded_whole():
    module = torch.nn.Linear(3, 2)
    ref = frozen_copy(module)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in module.parameters())
    for a, b in zip(module.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    module.weight.ds_id = 0  # the attribute ZeRO-3 puts on the parameters it partitions at load
    with pytest.raises(ConfigError, match="DeepSpeed ZeRO-3 partitioned at load: set 'zero3_init_flag: false'"):
        frozen_copy(module)
    with pytest.raises(ConfigError, match="on the meta device .*'fsdp_cpu_ram_efficient_loading: false'"):
        frozen_copy(torch.nn.Linear(3, 2, device="meta"))  # how FSDP's RAM-efficient loading leaves other ranks


def test_update_sizes_deal_micro_batches_evenly():
    assert update_sizes(8, 2, 3) == [2, 1, 1]  # 4 micro-batches into 3 updates, not 2 + 2
    assert update_sizes(10, 4, 3) == [1, 1, 1] and update_sizes(8, 8, 1) == [1]
    assert rows_after_first_update(8, 2, 3) == 4 and rows_after_first_update(8, 8, 1) == 0
    with pytest.raises(ConfigError, match="'train.updates_per_rollout': 2 updates need as many micro-batches per "
                                          "process, and this one has 1"):
        update_sizes(8, 8, 2)


def test_every_rollout_gives_updates_per_rollout_steps(tmp_path):
    cfg = toy(tmp_path, "train.max_steps=6", "train.updates_per_rollout=3", "train.prompts_per_step=2",
              "train.group_size=4", "train.micro_batch_size=2")
    history = Trainer(cfg).train()
    assert [r["iteration"] for r in history] == [1, 1, 1, 2, 2, 2]


def test_adv_batch_norm_rescales_advantages_over_the_batch(tmp_path):
    history = Trainer(toy(tmp_path, "train.max_steps=2", "grpo.adv_batch_norm=true",
                          "grpo.advantage=group_mean")).train()
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert abs(row["adv/mean"]) < 1e-9 and abs(row["adv/std"] - 1.0) < 1e-4, row


def test_adv_clip_bounds_the_advantages_after_batch_norm(tmp_path):
    """grpo.adv_clip clamps the advantages the loss sees, after adv_batch_norm: z-scores of population std 1 have
    some |z| >= 1, so with a clip of 0.5 the largest is exactly 0.5 (clipping before the z-scoring, or not at all,
    leaves it at 1 or more)."""
    history = Trainer(toy(tmp_path, "train.max_steps=2", "grpo.adv_batch_norm=true", "grpo.adv_clip=0.5")).train()
    assert [row["adv/abs_max"] for row in history] == [0.5, 0.5]


def test_max_grad_norm_scales_the_gradient_down_to_it(tmp_path):
    """With AdamW's eps far above the gradient, a first update is lr * g / (|g| + eps), about g for lr = eps = 1e4:
    linear in g, so clipping to a quarter of the measured norm gives a quarter of the unclipped step. The logged
    grad_norm is the norm before clipping."""
    def first_step(run, max_norm):
        trainer = Trainer(toy(tmp_path / run, "train.max_steps=1", "train.save_every=0", "optim.lr=1e4",
                              "optim.eps=1e4", f"optim.max_grad_norm={max_norm}"))
        before = trainer.policy.model.weight.detach().clone()
        row = trainer.train()[0]
        return trainer.policy.model.weight.detach() - before, row["grad_norm"]

    free, norm = first_step("free", 0)
    clipped, logged = first_step("clipped", norm / 4)
    assert norm > 0 and logged == pytest.approx(norm, rel=1e-6)
    torch.testing.assert_close(clipped, free / 4, rtol=1e-3, atol=1e-9)


def test_ema_weights_are_saved_and_differ_from_raw(tmp_path):
    cfg = toy(tmp_path, "train.max_steps=4", "train.ema_decay=0.9", "optim.lr=0.1")
    trainer = Trainer(cfg)
    trainer.train()
    ckpt = tmp_path / "checkpoints" / "step-4"
    ema, raw = load_file(str(ckpt / "ema.safetensors")), load_file(str(ckpt / "policy" / "model.safetensors"))
    assert set(ema) == set(raw) and not torch.allclose(ema["weight"], raw["weight"])
    with trainer.ema.swapped_in():
        torch.testing.assert_close(trainer.policy.model.weight.detach(), ema["weight"])
    torch.testing.assert_close(trainer.policy.model.weight.detach(), raw["weight"])
    exported = load_file(str(ckpt / "policy_ema" / "model.safetensors"))  # the user-facing copy of the average
    torch.testing.assert_close(exported["weight"], ema["weight"], rtol=0, atol=0)
    # eval and sample load the averaged weights of the checkpoint
    loaded, found = _policy_and_weights(toy(tmp_path, "train.ema_decay=0.9", "resume=latest"))
    assert found == ckpt
    torch.testing.assert_close(loaded.model.weight.detach(), ema["weight"])


def test_in_loop_evaluation_scores_the_ema_weights(tmp_path):
    """With train.ema_decay, the run's evaluation scores the averaged weights (as eval and sample do): what the
    policy generates with the EMA swapped in by hand, not what the raw weights generate, which differs here."""
    trainer = Trainer(toy(tmp_path, "train.max_steps=4", "train.ema_decay=0.9", "optim.lr=0.5", "train.save_every=0"))
    trainer.train()
    key = "toy_bandit:match_reward"

    def score() -> float:
        _, logged, _ = trainer.rewards(trainer.policy.generate(trainer.eval_items), only=[key])
        return logged[key].mean().item()

    raw = score()
    with trainer.ema.swapped_in():
        averaged = score()
    assert averaged != raw and trainer.evaluate()[f"eval/{key}/mean"] == averaged


def test_an_ema_turned_on_at_a_resume_starts_from_the_restored_weights(tmp_path):
    """train.ema_decay may change on resume, but a checkpoint of a run without EMA has no ema.safetensors: the
    resume failed with 'checkpoint cannot be read', pointing at a sound checkpoint."""
    Trainer(toy(tmp_path, "train.max_steps=2", "optim.lr=0.1")).train()
    restored = load_file(str(tmp_path / "checkpoints" / "step-2" / "policy" / "model.safetensors"))
    trainer = Trainer(toy(tmp_path, "train.max_steps=3", "optim.lr=0.1", "resume=latest", "train.ema_decay=0.5"))
    trainer.train()
    raw = trainer.policy.model.weight.detach().clone()
    with trainer.ema.swapped_in():  # one update from the restored weights: halfway between them and the new ones
        torch.testing.assert_close(trainer.policy.model.weight.detach(), (restored["weight"] + raw) / 2)


def test_the_logged_lr_is_the_one_each_update_used(tmp_path):
    """Linear warm-up over 2 steps, then linear decay to step 4: the updates used 0, 1/2, 1 and 1/2 of the peak
    (transformers' schedules start at 0). The row logged the lr after the scheduler's step, one step ahead."""
    trainer = Trainer(toy(tmp_path, "train.max_steps=4", "optim.lr_scheduler=linear", "optim.warmup_steps=2",
                          "optim.lr=0.1", "train.save_every=0"))
    assert [r["lr"] for r in trainer.train()] == pytest.approx([0.0, 0.05, 0.1, 0.05], abs=1e-12)


def test_metric_rows_of_the_processes_merge_numpy_and_tensor_scalars_too():
    """A plug-in pipeline's numpy or 0-d tensor counter was dropped from the merged row of a multi-process run."""
    rows = [{"loss": 1.0, "tokens": np.int64(4), "ratio/max_dev": torch.tensor(0.5), "note": "x"},
            {"loss": 3.0, "tokens": np.float32(6.0), "ratio/max_dev": math.nan}]
    assert merge_metric_rows(rows) == {"loss": 2.0, "tokens": 5.0, "ratio/max_dev": 0.5}


def test_a_replanned_schedule_ends_there_and_survives_a_resume(tmp_path):
    """end_schedule_at(6) at step 3 of a 12-step cosine: the lr follows the squeezed schedule and reaches 0 at step
    6; a run stopped at step 4 and resumed from its checkpoint (past step 3, so only the checkpoint knows of the
    re-plan) continues on the re-planned schedule; one that changes train.max_steps gets the new schedule."""
    def run(out, stop_at, resume="null", max_steps=12):
        trainer = Trainer(toy(out, f"train.max_steps={max_steps}", "optim.lr_scheduler=cosine", "optim.lr=0.1",
                              "train.save_every=0", f"resume={resume}"))

        def should_stop(step, row):
            if step == 3:
                trainer.end_schedule_at(6)
            return step >= stop_at

        return [r["lr"] for r in trainer.train(should_stop)]

    lrs = run(tmp_path / "straight", 6)  # the lr each step's update used
    positions = [0, 1, 2, 3, 6, 9]  # steps 4..6 cover positions 3..12 of the 12-step schedule
    assert lrs == pytest.approx([0.05 * (1 + math.cos(math.pi * p / 12)) for p in positions], abs=1e-12)
    run(tmp_path / "resumed", 4)
    assert run(tmp_path / "resumed", 6, resume="latest") == pytest.approx(lrs, abs=1e-12)  # the whole metrics.jsonl
    # a resume that changes train.max_steps asks for a new horizon: the schedule as built for it
    assert run(tmp_path / "resumed", 7, resume="latest", max_steps=20)[-1] == pytest.approx(
        0.05 * (1 + math.cos(math.pi * 6 / 20)), abs=1e-12)


@pytest.mark.parametrize("scheduler, step, elapsed_s, replanned_to", [
    ("cosine", 40, 20.0, 80),  # 0.5 s per step, 20 s of the 40 left: squeezed to end at step 80
    ("cosine", 40, 16.4, None),  # projected 97, within 5% of the planned 100: kept
    ("cosine", 4, 2.0, None),  # still in warm-up: kept
    ("constant_with_warmup", 40, 20.0, None),  # nothing to re-plan
])
def test_a_decaying_schedule_is_fitted_to_the_budget_only_when_far_off(tmp_path, scheduler, step, elapsed_s,
                                                                       replanned_to):
    trainer = Trainer(toy(tmp_path, "train.max_steps=100", "optim.warmup_steps=5",
                          f"optim.lr_scheduler={scheduler}"))
    trainer.step = step
    assert trainer.fit_schedule_to_budget(elapsed_s, 40.0) == replanned_to
    assert trainer.schedule_warp.planned_end() == (replanned_to or 100)


def test_a_time_budget_ends_the_run_with_its_schedule_decayed_and_holds_across_a_resume(tmp_path):
    """train.max_minutes=0.01 (0.6 s) over rollouts of at least 0.05 s: the run stops long before max_steps, the
    cosine over 1,000 steps was re-planned to end near there (without it the last lr would be 99.9% of the peak),
    and the last step was evaluated. Resumed with the same budget, nothing is left; with twice the budget, it
    goes on, counting the first run's time."""
    base = ["train.max_steps=1000", "train.save_every=0", "optim.lr_scheduler=cosine", "optim.lr=0.1",
            "toy.sleep_s=0.05", "train.eval_every=1000"]
    trainer = Trainer(toy(tmp_path, *base, "train.max_minutes=0.01"))
    history = trainer.train()
    stopped = trainer.step
    assert 1 <= stopped < 1000 and history[-1]["step"] == stopped and trainer.train_seconds >= 0.6
    assert trainer.schedule_warp.planned_end() < 1000 and history[-1]["lr"] < 0.05, history[-1]["lr"]
    assert "eval/toy_bandit:match_reward/mean" in history[-1]
    resumed = Trainer(toy(tmp_path, *base, "train.max_minutes=0.01", "resume=latest"))
    assert len(resumed.train()) == stopped and resumed.step == stopped
    longer = Trainer(toy(tmp_path, *base, "train.max_minutes=0.02", "resume=latest"))
    longer.train()
    assert stopped < longer.step < 1000 and longer.train_seconds >= 1.2


def test_a_negative_time_budget_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="bad value for 'train.max_minutes': must be >= 0"):
        toy(tmp_path, "train.max_minutes=-1")


def test_a_reward_that_never_varies_is_reported_once(tmp_path):
    rewards = json.dumps([{"name": "toy_bandit:match_reward"}, {"name": "toy_bandit:constant_reward"}])
    trainer = Trainer(toy(tmp_path, "train.max_steps=12", "train.save_every=0", f"rewards={rewards}"))
    with pytest.warns(RuntimeWarning) as caught:
        trainer.train()
    silent = [str(w.message) for w in caught if "adds nothing to the advantages" in str(w.message)]
    assert len(silent) == 1 and silent[0].startswith("reward 'toy_bandit:constant_reward' gave every sample of the "
                                                     "first 10 rollouts the same score (0)"), silent


def _preset(path, run_dir, **train):
    data = {"pipeline": "toy_bandit:PIPELINE", "output_dir": str(run_dir), "resume": "latest",
            "train": {"max_steps": 16, "save_every": 2, "keep_last": 0, "prompts_per_step": 4, **train},
            "optim": {"lr": 0.05, "lr_scheduler": "cosine", "warmup_steps": 2},
            "toy": {"sleep_s": 0.25}, "logging": {"progress": False, "tensorboard": False}}
    path.write_text(yaml.safe_dump(data))
    return path


def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path, support_env):
    env = support_env
    cmd = [sys.executable, "-m", "mmgrpo", "train"]
    straight = _preset(tmp_path / "straight.yaml", tmp_path / "straight")
    subprocess.run(cmd + [str(straight)], env=env, check=True, timeout=300, capture_output=True)

    run = tmp_path / "killed"
    preset = _preset(tmp_path / "killed.yaml", run)
    proc = subprocess.Popen(cmd + [str(preset)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (run / "checkpoints" / "step-6").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(r["step"] for r in read_metrics(run / "metrics.jsonl"))
    assert killed_at < 16, "the run finished before the kill: nothing was resumed"

    resumed = subprocess.run(cmd + [str(preset)], env=env, timeout=300, capture_output=True, text=True, check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert steps == list(range(1, 17)), steps
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step-16" / "policy" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step-16" / "policy" / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("name", ["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3", "cpu_2proc"])
def test_shipped_accelerate_configs_parse(name):
    from accelerate.commands.config.config_args import ClusterConfig

    path = SUPPORT.parents[1] / "configs" / "accelerate" / f"{name}.yaml"
    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.num_processes >= 2 and cfg.distributed_type.value in {"MULTI_GPU", "FSDP", "DEEPSPEED"}


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="the accelerate launcher is not on PATH")
def test_two_processes_gather_whole_groups_and_stay_in_sync(tmp_path, support_env):
    out = tmp_path / "ddp.json"
    config = SUPPORT.parents[1] / "configs" / "accelerate" / "cpu_2proc.yaml"
    cmd = ["accelerate", "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
           str(SUPPORT / "ddp_check.py"), str(out), str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=support_env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["num_processes"] == 2
    assert result["adv_max_abs_diff"] <= 1e-6
    assert result["local_vs_global_diff"] > 1e-3, "batch std must come from both processes"
    assert result["param_rank_diff"] == 0.0 and result["param_change"] > 0
    assert result["distinct_groups"] == 4 and result["groups_per_rank"] == [2, 2]
    assert result["reduced"] == {"loss": 0.5, "only/rank0": 1.0, "only/rank1": 1.0, "ratio/max_dev": 0.1}
    budget = result["time_budget"]  # rank 1 is slower: its clock ends the run for both
    assert budget["steps"][0] == budget["steps"][1] and 1 <= budget["steps"][0] < 1000, budget
    assert budget["param_rank_diff"] == 0.0
    refill = result["refill"]  # every rank ran the same rounds and kept its share: the weights stayed equal
    assert refill["param_rank_diff"] == 0.0 and len(refill["rounds"]) == 4 and sum(refill["rounds"]) > 0, refill
    # both drew every round's prompts, so their samplers agree (4 steps plus the rounds)
    assert refill["sampler_steps"] == [4 + sum(refill["rounds"])] * 2, refill
    assert all(0.5 <= f <= 1.0 for f in refill["signal_frac"]), refill


def test_refill_replaces_groups_without_signal_with_freshly_sampled_ones(tmp_path):
    # one token from two arms, pairs: half the groups agree on average (no signal)
    common = ("toy.seq_len=1", "toy.num_arms=2", "train.group_size=2", "train.prompts_per_step=4",
              "train.micro_batch_size=8", "grpo.mask_zero_std_groups=true", "train.max_steps=6")
    history = Trainer(toy(tmp_path / "refill", *common, "grpo.refill_rounds=8")).train()
    rounds = [r["dynamic/rounds"] for r in history]
    assert all(r["dynamic/signal_frac"] == 1.0 for r in history)  # 8 rounds make a miss vanishingly rare
    # a round draws only the groups still missing: between 1 and 4 per round
    assert sum(rounds) > 0 and all(4 + n <= r["dynamic/groups_sampled"] <= 4 * (1 + n)
                                   for r, n in zip(history, rounds))
    assert any(r["dynamic/groups_sampled"] < 4 * (1 + n) for r, n in zip(history, rounds))
    # every trained group varies: the std within groups is that of a fair pair, never 0 for a kept group
    assert all(r["reward/std_within_group"] > 0 for r in history)
    masked = Trainer(toy(tmp_path / "mask", *common)).train()
    assert "dynamic/rounds" not in masked[0]
    # a reward that never varies: every round is spent, nothing has signal, and the step is masked, not stalled
    never = Trainer(toy(tmp_path / "never", *common, "grpo.refill_rounds=2",
                        'rewards=[{name: "toy_bandit:constant_reward"}]')).train()
    assert [r["dynamic/rounds"] for r in never] == [2.0] * 6 and all(r["dynamic/signal_frac"] == 0 for r in never)


def test_oversampled_prompts_replace_groups_without_signal_from_the_same_rollout(tmp_path):
    common = ("toy.seq_len=1", "toy.num_arms=2", "train.group_size=2", "train.prompts_per_step=4",
              "train.micro_batch_size=8", "grpo.mask_zero_std_groups=true", "train.max_steps=6",
              "grpo.refill_rounds=8")
    trained = []

    class Recording(Trainer):
        def train_on_rollout(self, rollout, unit_adv, on_step):
            trained.append(len(rollout))
            super().train_on_rollout(rollout, unit_adv, on_step)

    plain = Trainer(toy(tmp_path / "plain", *common)).train()
    history = Recording(toy(tmp_path / "over", *common, "grpo.oversample_prompts=4")).train()
    assert trained == [4 * 2] * 6  # 4 groups of 2 trained at every step, never the 8 sampled
    assert all(r["dynamic/signal_frac"] == 1.0 for r in history)
    assert all(r["dynamic/groups_sampled"] >= 8 for r in history)
    # half the pairs agree: 8 prompts usually hold 4 with signal, where 4 rarely do
    assert sum(r["dynamic/rounds"] for r in history) < sum(r["dynamic/rounds"] for r in plain)
    # without refill rounds the extra prompts alone still fill the step when they can
    alone = Trainer(toy(tmp_path / "alone", *common[:-1], "grpo.oversample_prompts=4")).train()
    assert all(r["dynamic/rounds"] == 0 and r["dynamic/groups_sampled"] == 8 for r in alone)
    masked = Trainer(toy(tmp_path / "masked", *common[:-1])).train()
    assert sum(r["groups/zero_std_frac"] for r in alone) < sum(r["groups/zero_std_frac"] for r in masked)


def test_a_reward_with_sub_scores_logs_its_main_score_under_its_name(tmp_path):
    """metrics.jsonl has reward/<name>/mean for every reward (ARCHITECTURE.md): a reward returning a dict of
    sub-scores logged only reward/<name>/<sub>/mean, not the score that enters the combination."""
    history = Trainer(toy(tmp_path, "train.max_steps=2", 'rewards=[{name: "toy_bandit:per_target_reward"}]')).train()
    key = "reward/toy_bandit:per_target_reward"
    assert all(r[f"{key}/mean"] == r[f"{key}/score/mean"] == r["reward/mean"] for r in history)
    assert all(r[f"{key}/nan_frac"] == 0.0 for r in history)


def test_refill_merges_sub_scores_that_only_some_rounds_report(tmp_path):
    """A reward's sub-scores may differ from batch to batch (here one per target, reported only when the batch holds
    that target); merging the refill rounds' logged scores raised a KeyError for a sub-score the first rollout
    reported and a later round did not, and dropped one only a later round reported."""
    # a step's first rollout holds both prompts, so both targets; a refill round of one prompt may lack target 0
    cfg = toy(tmp_path, "toy.num_prompts=2", "toy.num_arms=2", "toy.seq_len=1", "train.group_size=2",
              "train.prompts_per_step=2", "train.micro_batch_size=4", "grpo.mask_zero_std_groups=true",
              "grpo.refill_rounds=4", "train.max_steps=8", 'rewards=[{name: "toy_bandit:per_target_reward"}]')
    history = Trainer(cfg).train()
    assert [r["step"] for r in history] == list(range(1, 9)) and any(r["dynamic/rounds"] > 0 for r in history)
    key = "reward/toy_bandit:per_target_reward/target0"
    # every step's first rollout reported it; the rows of a round that did not count as not applying (NaN)
    assert all(f"{key}/nan_frac" in r for r in history)


def test_refill_needs_the_mask_and_a_policy_that_merges(tmp_path):
    from toy_bandit import ToyPolicy

    from mmgrpo.policy import Policy

    with pytest.raises(ConfigError, match="set grpo.mask_zero_std_groups: true"):
        Trainer(toy(tmp_path / "a", "grpo.refill_rounds=1"))
    with pytest.raises(ConfigError, match="'grpo.oversample_prompts'.*set grpo.mask_zero_std_groups: true"):
        Trainer(toy(tmp_path / "c", "grpo.oversample_prompts=2"))

    class NoMerge(ToyPolicy):
        merge_groups = Policy.merge_groups

    cfg = toy(tmp_path / "b", "grpo.refill_rounds=1", "grpo.mask_zero_std_groups=true")
    with pytest.raises(ConfigError, match="cannot merge rollouts"):
        Trainer(cfg, policy=NoMerge(cfg))
    cfg = toy(tmp_path / "d", "grpo.oversample_prompts=2", "grpo.mask_zero_std_groups=true")
    with pytest.raises(ConfigError, match="cannot drop groups"):
        Trainer(cfg, policy=NoMerge(cfg))


def test_in_loop_evaluation_logs_heldout_scores_and_samples(tmp_path):
    cfg = toy(tmp_path, "train.max_steps=6", "train.eval_every=3", "optim.lr=0.2")
    trainer = Trainer(cfg)
    history = trainer.train()
    evals = [r for r in history if "eval/toy_bandit:match_reward/mean" in r]
    assert [r["step"] for r in evals] == [3, 6]
    lines = (tmp_path / "samples" / "step-3.txt").read_text().splitlines()  # prompt <tab> completion per item
    assert [line.split("\t")[0] for line in lines] == [item["prompt"] for item in trainer.eval_items]
    assert all(len(line.split("\t")[1].split()) == cfg.toy.seq_len for line in lines)
    assert all(0.0 <= r["eval/toy_bandit:match_reward/mean"] <= 1.0 for r in evals)
    assert not (tmp_path / "samples" / "step-3").exists()  # per-sample files are mmgrpo eval's and sample's


def test_in_loop_evaluation_saves_the_scores_it_logged(tmp_path):
    """The VLM's samples page scored every reward a second time (for a judge: twice the calls, and scores that could
    differ from the logged ones); it shows the logged scores now, from one call."""
    (tmp_path / "counted.py").write_text("calls = []\n\n\ndef fn(batch):\n    calls.append(len(batch.prompts))\n"
                                         "    return [len(calls) + i / 8 for i in range(len(batch.prompts))]\n")
    reward, data = f"{tmp_path}/counted.py:fn", ROOT / "assets" / "data" / "shapes_qa"
    cfg = load_config(ROOT / "configs" / "vlm" / "tiny_image.yaml", [
        *QUIET, f"output_dir={tmp_path / 'run'}", f"model.path={ROOT}/assets/tiny-qwen2vl-shapes",
        f"data.train_file={data}/train.jsonl", f"data.eval_file={data}/heldout.jsonl", f"data.root={data}",
        "data.num_eval=2", "generation.max_new_tokens=4", f"rewards=[{{name: format}}, {{name: '{reward}'}}]"])
    means = Trainer(cfg).evaluate()
    assert import_path(f"{tmp_path}/counted.py:calls") == [2]
    assert means[f"eval/{reward}/mean"] == 1.0625
    page = (tmp_path / "run" / "samples" / "step-0.md").read_text()
    assert f"{reward} 1.000" in page and f"{reward} 1.125" in page and f"{reward} 2." not in page
    assert not (tmp_path / "run" / "samples" / "step-0").exists()


@pytest.mark.parametrize("updates", [1, 2])
def test_recomputed_old_logp_reports_its_distance_from_the_rollout(tmp_path, updates):
    """A policy that must recompute old log-probs gets them from the training forward (the first update's own
    forward, a separate pass for later updates' rows), so the first ratio is exactly 1; how far the sampling
    log-probs were (here: perturbed on purpose) is logged with every update."""
    cfg = toy(tmp_path, "train.max_steps=4", "train.prompts_per_step=2", "train.micro_batch_size=4",
              f"train.updates_per_rollout={updates}", "optim.lr=0.1")
    trainer = Trainer(cfg)
    items = trainer.train_items[:2]
    with torch.no_grad():
        rollout = trainer.policy.rollout(items, [0, 1], cfg.train.group_size)
    main, _, _ = trainer.rewards(rollout.reward_batch)
    unit_adv, _ = trainer.compute_advantages(rollout, main)
    exact = rollout.old_logp.clone()
    rollout.old_logp = exact + 0.25
    rollout.recompute_old_logp = True
    rows = []
    trainer.train_on_rollout(rollout, unit_adv, rows.append)
    assert len(rows) == updates
    assert rows[0]["ratio/onpolicy_max_dev"] <= 1e-6
    for row in rows:
        assert abs(row["logp/rollout_vs_recompute_max_dev"] - 0.25) < 1e-6
    torch.testing.assert_close(rollout.old_logp, exact)  # all rows scored by the policy before any update
    assert rows[0]["ratio/max_dev"] <= 1e-6
    if updates == 2:  # the second update's rows were scored before the first update moved the policy
        assert rows[1]["ratio/max_dev"] > 1e-4


def first_two_groups(trainer):
    """(rollout, unit advantages) of the first two training prompts' groups, as an iteration computes them."""
    with torch.no_grad():
        rollout = trainer.policy.rollout(trainer.train_items[:2], [0, 1], trainer.cfg.train.group_size)
    main, _, _ = trainer.rewards(rollout.reward_batch)
    unit_adv, _ = trainer.compute_advantages(rollout, main)
    return rollout, unit_adv


def test_onpolicy_check_reads_masked_samples_too(tmp_path):
    """``ratio/onpolicy_max_dev`` checks the log-probs of every valid unit of the first update, including samples
    the loss leaves out (zero-variance groups under dynamic sampling): here the masked group's rollout log-probs
    are off by 0.25, and the check sees it, |exp(-0.25) - 1|."""
    cfg = toy(tmp_path, "train.max_steps=1", "train.prompts_per_step=2", "train.micro_batch_size=4")
    trainer = Trainer(cfg)
    rollout, unit_adv = first_two_groups(trainer)
    masked = torch.arange(len(rollout)) < cfg.train.group_size
    rollout.sample_mask = rollout.sample_mask & ~masked
    rollout.old_logp[masked] += 0.25
    rows = []
    trainer.train_on_rollout(rollout, unit_adv, rows.append)
    assert abs(rows[0]["ratio/onpolicy_max_dev"] - (1 - math.exp(-0.25))) < 1e-6
    assert rows[0]["ratio/max_dev"] <= 1e-6  # the ratios the loss used (unmasked rows) are exact


@pytest.mark.parametrize("clip_high", [None, 0.3])
def test_clip_eps_high_is_the_upper_clip_of_the_trainers_loss(tmp_path, clip_high):
    """Old log-probs 0.25 below the policy's: every ratio is exp(0.25) = 1.284, inside the clip-higher range
    [0.9, 1.3] but above the symmetric one's 1.1, so the clip zeroes exactly the units with A > 0 under the symmetric
    clip and none under clip-higher."""
    cfg = toy(tmp_path, "train.max_steps=1", "train.prompts_per_step=2", "train.micro_batch_size=8",
              "grpo.clip_eps=0.1", f"grpo.clip_eps_high={'null' if clip_high is None else clip_high}")
    trainer = Trainer(cfg)
    rollout, unit_adv = first_two_groups(trainer)
    rollout.old_logp -= 0.25
    rows = []
    trainer.train_on_rollout(rollout, unit_adv, rows.append)
    positive = (unit_adv > 0)[rollout.mask].double().mean().item()
    assert rows[0]["ratio/mean"] == pytest.approx(math.exp(0.25), rel=1e-6) and 0 < positive < 1
    assert rows[0]["clip_frac"] == pytest.approx(positive if clip_high is None else 0.0, abs=1e-12)


def test_a_rollouts_unit_weights_scale_each_units_loss(tmp_path):
    """A policy's per-unit loss weights (the flow pipeline's mode.timestep_weighting, TempFlow's noise-aware one)
    multiply each unit's term: on policy (ratio 1) the first update's token-mean loss is -sum(w * A) / units."""
    cfg = toy(tmp_path, "train.max_steps=1", "train.prompts_per_step=2", "train.micro_batch_size=4")
    trainer = Trainer(cfg)
    rollout, unit_adv = first_two_groups(trainer)
    rollout.unit_weight = 2 * torch.rand(rollout.old_logp.shape, generator=torch.Generator().manual_seed(0))
    rows = []
    trainer.train_on_rollout(rollout, unit_adv, rows.append)
    expected = (-(rollout.unit_weight * unit_adv)[rollout.mask].sum() / rollout.mask.sum()).item()
    assert abs(expected) > 1e-3 and rows[0]["ratio/max_dev"] == 0
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_the_kl_term_is_kl_beta_times_the_mean_kl_of_the_trained_units(tmp_path):
    """A reference moved away from the policy: the first update is on policy (ratio 1), so its token-mean loss is
    -mean(A) + kl_beta * mean(k3), and the logged kl is the mean k3 over the trained units."""
    cfg = toy(tmp_path, "train.max_steps=1", "train.prompts_per_step=2", "train.micro_batch_size=4",
              "grpo.kl_beta=0.5", "grpo.kl_estimator=k3")
    trainer = Trainer(cfg)
    policy = trainer.policy
    with torch.no_grad():
        policy.reference.weight.add_(torch.randn(policy.reference.weight.shape,
                                                 generator=torch.Generator().manual_seed(0)))
        rollout = policy.rollout(trainer.train_items[:2], [0, 1], cfg.train.group_size)
        index, tokens = rollout.data["index"], rollout.data["tokens"]
        k3 = kl_estimate(policy._token_logp(policy.model, index, tokens),
                         policy._token_logp(policy.reference, index, tokens), "k3")
    main, _, _ = trainer.rewards(rollout.reward_batch)
    unit_adv, _ = trainer.compute_advantages(rollout, main)
    rows = []
    trainer.train_on_rollout(rollout, unit_adv, rows.append)
    kl = k3[rollout.mask].mean().item()
    assert kl > 0.01 and rows[0]["kl"] == pytest.approx(kl, rel=1e-5)
    expected = -unit_adv[rollout.mask].mean().item() + 0.5 * kl
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("aggregation", ["weighted_sum", "gdpo"])
def test_reward_aggregation_decides_the_trainers_advantages(tmp_path, aggregation):
    """The trainer's advantages are combine_rewards of the batch's rewards under the configured reward_aggregation,
    and on these rewards the two aggregations give different advantages."""
    (tmp_path / "first_zero.py").write_text(
        "def fn(batch):\n    return [float(text.split()[0] == '0') for text in batch.completions]\n")
    cfg = toy(tmp_path / "run", "train.prompts_per_step=4", f"reward_aggregation={aggregation}",
              f"rewards=[{{name: toy_bandit:match_reward}}, {{name: '{tmp_path}/first_zero.py:fn', weight: 0.5}}]")
    trainer = Trainer(cfg)
    with torch.no_grad():
        rollout = trainer.policy.rollout(trainer.train_items[:4], [0, 1, 2, 3], cfg.train.group_size)
    main, _, _ = trainer.rewards(rollout.reward_batch)
    unit_adv, _ = trainer.compute_advantages(rollout, main)
    expected = {how: combine_rewards(main, [1.0, 0.5], rollout.group, how, "group_zscore", cfg.grpo.adv_eps)
                for how in ("weighted_sum", "gdpo")}
    assert (expected["weighted_sum"] - expected["gdpo"]).abs().max() > 0.1
    torch.testing.assert_close(unit_adv, expected[aggregation].float()[:, None].expand_as(unit_adv))


def test_a_standardized_reward_is_z_scored_over_the_batch_before_the_weighted_sum(tmp_path):
    """A reward whose spec sets standardize enters the weighted sum as its z-score over the whole batch, which
    changes its weight against the other reward, so the advantages differ from those of the raw scores."""
    (tmp_path / "first_zero.py").write_text(
        "def fn(batch):\n    return [3.0 * (text.split()[0] == '0') for text in batch.completions]\n")
    second = f"{{name: '{tmp_path}/first_zero.py:fn', weight: 0.5, args: {{standardize: true}}}}"
    cfg = toy(tmp_path / "run", "train.prompts_per_step=4", f"rewards=[{{name: toy_bandit:match_reward}}, {second}]")
    trainer = Trainer(cfg)
    with torch.no_grad():
        rollout = trainer.policy.rollout(trainer.train_items[:4], [0, 1, 2, 3], cfg.train.group_size)
    main, _, _ = trainer.rewards(rollout.reward_batch)
    unit_adv, _ = trainer.compute_advantages(rollout, main)
    z = main.clone()
    z[:, 1] = (main[:, 1] - main[:, 1].mean()) / main[:, 1].std(unbiased=False)
    expected, raw = (combine_rewards(r, [1.0, 0.5], rollout.group, "weighted_sum", "group_zscore", cfg.grpo.adv_eps)
                     for r in (z, main))
    assert (expected - raw).abs().max() > 0.1
    torch.testing.assert_close(unit_adv, expected.float()[:, None].expand_as(unit_adv))


def test_a_non_finite_gradient_skips_the_update_and_is_counted(tmp_path):
    trainer = Trainer(toy(tmp_path, "train.max_steps=3", "toy.nan_rollout=2", "train.save_every=2"))
    before_step_2 = {}
    with pytest.warns(RuntimeWarning, match=r"step 2: the gradient norm is nan .* the update is skipped \(1 so far\)"):
        history = trainer.train(should_stop=lambda step, row: before_step_2.setdefault(
            step, trainer.policy.model.weight.detach().clone()) is None)
    assert [r.get("train/skipped_update", 0.0) for r in history] == [0.0, 1.0, 0.0]
    torch.testing.assert_close(load_file(str(tmp_path / "checkpoints" / "step-2" / "policy" / "model.safetensors"))
                               ["weight"], before_step_2[1], atol=0, rtol=0)  # step 2 left the weights as they were
    assert torch.isfinite(trainer.policy.model.weight).all() and trainer.skipped_updates == 1


@pytest.fixture
def own_accelerator_state():
    """Accelerate keeps one process-wide state, whose mixed precision cannot change once set: clear it before and
    after a test that needs another (accelerate's own tests do the same)."""
    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


@pytest.mark.usefixtures("own_accelerator_state")
def test_an_fp16_overflow_lowers_the_loss_scale_and_the_next_step_updates(tmp_path):
    """Under fp16 the step with a non-finite gradient still goes through the optimiser, whose loss scaler skips it
    and halves its scale; skipping the call would leave the scaler unscaled-but-not-updated, and the next step's
    clip_grad_norm_ would raise. CUDA fp16 runs get this scaler from accelerate; here it is torch's CPU one."""
    acc = Accelerator(cpu=True, mixed_precision="fp16", step_scheduler_with_optimizer=False)
    acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    trainer = Trainer(toy(tmp_path, "train.max_steps=3", "toy.nan_rollout=2"), accelerator=acc)
    with pytest.warns(RuntimeWarning, match=r"step 2: the gradient norm is nan \(an fp16 overflow: the loss scale "
                                            r"is lowered\); the update is skipped \(1 so far\)"):
        history = trainer.train()
    assert [r.get("train/skipped_update", 0.0) for r in history] == [0.0, 1.0, 0.0]
    assert acc.scaler.get_scale() == 2.0 ** 15 and trainer.skipped_updates == 1
    assert torch.isfinite(trainer.policy.model.weight).all()


def test_a_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path):
    Trainer(toy(tmp_path, "train.max_steps=2")).train()
    with pytest.raises(ConfigError, match=r"'output_dir': .* holds an earlier run \(metrics.jsonl, "
                                          r"checkpoints/step-2\); resume=latest continues it"):
        Trainer(toy(tmp_path, "train.max_steps=2")).train()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]  # nothing lost


def test_resume_keeps_what_the_checkpoint_depends_on_and_reports_other_changes(tmp_path, capsys):
    Trainer(toy(tmp_path, "train.max_steps=2")).train()
    for key, value in (("train.group_size", 4), ("train.prompts_per_step", 2), ("seed", 1)):
        with pytest.raises(ConfigError, match=rf"bad value for '{key}': {value}, but checkpoint .*step-2 was made "
                                              "with .*; its weights and state depend on it"):
            Trainer(toy(tmp_path, "train.max_steps=3", "resume=latest", f"{key}={value}")).train()
    capsys.readouterr()
    Trainer(toy(tmp_path, "train.max_steps=3", "resume=latest", "grpo.clip_eps=0.3")).train()
    assert "resuming with changed settings: grpo.clip_eps 0.2 -> 0.3" in capsys.readouterr().out
    assert "clip_eps: 0.2" in (tmp_path / "config-before-step-2.yaml").read_text()
    assert "clip_eps: 0.3" in (tmp_path / "config.yaml").read_text()


def test_resume_applies_a_changed_optimiser_config(tmp_path, capsys):
    Trainer(toy(tmp_path, "train.max_steps=2", "optim.lr=0.1")).train()
    trainer = Trainer(toy(tmp_path, "train.max_steps=3", "resume=latest", "optim.lr=0.02", "optim.weight_decay=0.5"))
    history = trainer.train()
    assert "optim.lr 0.1 -> 0.02" in capsys.readouterr().out
    assert history[-1]["step"] == 3 and history[-1]["lr"] == pytest.approx(0.02)
    assert all(g["weight_decay"] == 0.5 for g in trainer.optimizer.param_groups)


@pytest.mark.parametrize("name", ["policy/model.safetensors", "optimizer.bin"])
def test_an_unreadable_checkpoint_is_one_line_naming_it_the_file_and_the_one_before(tmp_path, name):
    Trainer(toy(tmp_path, "train.max_steps=4", "train.save_every=2", "train.keep_last=0")).train()
    torn = tmp_path / "checkpoints" / "step-4" / name
    torn.write_bytes(torn.read_bytes()[:100])  # cut short, as a full disk leaves it
    with pytest.raises(ConfigError, match=rf"'resume': checkpoint .*step-4 cannot be read \(.*; {name} does not "
                                          r"open\); with it moved away, resume=.*step-2 resumes from the one "
                                          r"before") as err:
        Trainer(toy(tmp_path, "train.max_steps=5", "resume=latest")).train()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "text"), [("trainer_state.json", '{"step": 3, "itera'),
                                             ("trainer_state.json", "[]"), ("config.yaml", "model: [unclosed\n"),
                                             ("config.yaml", "hello\n")])
def test_a_torn_or_edited_checkpoint_file_is_one_line_naming_the_checkpoint(tmp_path, name, text):
    Trainer(toy(tmp_path, "train.max_steps=4", "train.save_every=2", "train.keep_last=0")).train()
    (tmp_path / "checkpoints" / "step-4" / name).write_text(text)
    with pytest.raises(ConfigError, match=r"^bad value for 'resume': checkpoint .*step-4 cannot be read \(\w+: .*\); "
                                          r"with it moved away, resume=.*step-2 resumes from the one before$"):
        Trainer(toy(tmp_path, "train.max_steps=5", "resume=latest")).train()


def test_a_run_stopped_by_a_failing_reward_keeps_its_steps_and_resumes_with_the_failed_prompts(tmp_path):
    """The reward fails at the 4th rollout, with no checkpoint since the start (save_every=0): the 3 trained steps
    are saved before the error goes up, and a resumed run trains the prompts the failed step had drawn."""
    (tmp_path / "flaky_reward.py").write_text(
        "calls = [0]\n\n\ndef fn(batch):\n    calls[0] += 1\n    if calls[0] == 4:\n"
        "        raise ConnectionError('the reward server is gone')\n    return [1.0] * len(batch.prompts)\n")
    rewards = f"rewards=[{{name: toy_bandit:match_reward}}, {{name: '{tmp_path}/flaky_reward.py:fn', weight: 0}}]"
    run = tmp_path / "run"
    trainer = Trainer(toy(run, "train.max_steps=6", "train.save_every=0", rewards))
    with pytest.raises(RunError, match="reward .*flaky_reward.py:fn' failed: ConnectionError: the reward server"):
        trainer.train()
    assert [p.name for _, p in checkpoint_dirs(run)] == ["step-3"]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    resumed = Trainer(toy(run, "train.max_steps=6", "train.save_every=0", rewards, "resume=latest"))
    resumed.train()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    fresh = Trainer(toy(tmp_path / "fresh", "train.max_steps=3", "train.save_every=0"))
    fresh.train()  # the sampler after 3 steps: the failed 4th step's draw is not in the checkpoint
    assert checkpoint.read_state(run / "checkpoints" / "step-3")["sampler"] == fresh.sampler.state_dict()


def test_resuming_from_an_older_checkpoint_of_the_run_is_refused_and_loses_nothing(tmp_path):
    """Going back to step-2 while step-4 is in the output_dir would mix two runs: metrics rows 3-4 of one with those
    of the other, and a step-4 that resume=latest and pruning would then pick over the new run's."""
    Trainer(toy(tmp_path, "train.max_steps=4", "train.save_every=2", "train.keep_last=0")).train()
    old = tmp_path / "checkpoints" / "step-2"
    with pytest.raises(ConfigError, match=rf"^bad value for 'resume': {re.escape(str(old))} is older than "
                                          r".*step-4 in this output_dir; .*move the newer checkpoints away"):
        Trainer(toy(tmp_path, "train.max_steps=3", f"resume={old}")).train()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [p.name for _, p in checkpoint_dirs(tmp_path)] == ["step-2", "step-4"]
    shutil.move(tmp_path / "checkpoints" / "step-4", tmp_path / "step-4-kept")  # the way out the message names
    history = Trainer(toy(tmp_path, "train.max_steps=3", f"resume={old}")).train()
    assert history[-1]["step"] == 3
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_ctrl_c_finishes_the_step_saves_and_resumes(tmp_path, support_env):
    run = tmp_path / "run"
    preset = _preset(tmp_path / "run.yaml", run, save_every=0)
    cmd = [sys.executable, "-m", "mmgrpo", "train", str(preset)]
    proc = subprocess.Popen(cmd, env=support_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not (run / "metrics.jsonl").is_file() or not read_metrics(run / "metrics.jsonl"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be interrupted"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    stopped_at = max(r["step"] for r in read_metrics(run / "metrics.jsonl"))
    assert stopped_at < 16 and f"stopped by SIGINT at step {stopped_at}: saved" in out and "Traceback" not in out
    assert (run / "checkpoints" / f"step-{stopped_at}").is_dir()
    resumed = subprocess.run(cmd, env=support_env, capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0 and f"at step {stopped_at}" in resumed.stdout
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 17))


def test_should_stop_ends_the_run_early_with_a_checkpoint(tmp_path):
    cfg = toy(tmp_path, "train.max_steps=20", "train.save_every=0")
    history = Trainer(cfg).train(should_stop=lambda step, row: step >= 3)
    assert [r["step"] for r in history] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "step-3").is_dir()


def test_the_kl_of_units_not_trained_does_not_reach_the_loss(tmp_path):
    """A unit outside the mask may have any log-prob, even -inf (the policy losses ignore it); its KL estimate is
    then NaN, which the KL term added to the loss and to the logged kl, so every update was skipped."""
    from toy_bandit import ToyPolicy

    class UntrainedLastToken(ToyPolicy):
        def _token_logp(self, module, prompt_index, tokens):
            logp = super()._token_logp(module, prompt_index, tokens)
            return logp if module is self.reference else torch.cat([logp[:, :-1], torch.full_like(
                logp[:, -1:], -math.inf)], dim=1)

        def rollout(self, items, group_ids, group_size):
            out = super().rollout(items, group_ids, group_size)
            out.mask[:, -1] = False
            return out

    cfg = toy(tmp_path, "train.max_steps=2", "grpo.kl_beta=0.1", "grpo.kl_estimator=k3")
    trainer = Trainer(cfg, policy=UntrainedLastToken(cfg))
    before = trainer.policy.model.weight.detach().clone()
    history = trainer.train()
    assert trainer.skipped_updates == 0
    assert all(isinstance(r[k], float) and math.isfinite(r[k]) for r in history for k in ("kl", "loss"))  # NaN: null
    assert not torch.equal(trainer.policy.model.weight.detach(), before)


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="the accelerate launcher is not on PATH")
def test_logged_means_are_over_the_samples_and_units_of_every_process(tmp_path, support_env):
    """reward/<name>/mean, ratio/mean and clip_frac were each process's mean averaged over processes: a reward's
    mean was NaN (null) as soon as one process had no sample it applies to, a process with fewer samples or trained
    tokens weighed as much as the others, and one with none counted as ratio 1 and clip_frac 0; the nan_frac was
    averaged over the processes that had a NaN only. The update itself is the whole batch's mean."""
    out = tmp_path / "out.json"
    config = SUPPORT.parents[1] / "configs" / "accelerate" / "cpu_2proc.yaml"
    env = {**support_env, "PYTHONPATH": f"{Path(__file__).parent}:{support_env['PYTHONPATH']}", "OMP_NUM_THREADS": "1"}
    cmd = ["accelerate", "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
           str(Path(__file__).parent / "ddp_metrics.py"), str(out), str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    row = result["row"]  # 4 samples per process; rank 0: 2 NaN and 2 zeros, rank 1: 4 ones
    assert row["reward/ddp_metrics:sparse/mean"] == pytest.approx(4 / 6)
    assert row["reward/ddp_metrics:sparse/nan_frac"] == pytest.approx(2 / 8)
    # a sub-score that rank 0 does not report does not apply to its samples: half of all (it read 0)
    assert row["reward/ddp_metrics:sparse/extra/mean"] == 1.0
    assert row["reward/ddp_metrics:sparse/extra/nan_frac"] == pytest.approx(4 / 8)
    rank0, rank1 = result["steps"]  # rank 0 trains no unit: the batch's numbers are rank 1's
    assert rank1[1]["ratio/mean"] != 1.0 and rank1[1]["clip_frac"] > 0  # the second epoch is off-policy
    for key in ("ratio/mean", "clip_frac", "kl"):
        assert [m[key] for m in rank0] == [m[key] for m in rank1], key
    # the processes' losses, whose gradients DDP averages, average to the whole batch's loss on one process (each
    # divides by the mean unit count over the processes, not by its own: rank 1's alone would halve the step)
    assert abs(result["whole_loss"]) > 1e-3
    assert (rank0[0]["loss"] + rank1[0]["loss"]) / 2 == pytest.approx(result["whole_loss"], rel=1e-6)
    assert result["max_dev"] == 0.5  # a process that measured nothing (NaN) does not hide the others' maximum


def test_a_failure_on_one_process_saves_once_on_every_process_and_stops_them_together(launch_two_processes, tmp_path):
    """A RunError before a step trains saved the steps since the last checkpoint in one-process runs only: with two
    processes the one that failed left the others waiting in a collective (or pairing with a different one). Now
    the processes agree on the failure at the step boundary (and at each refill round), save once, and all raise."""
    result = launch_two_processes("failure_save_check.py", tmp_path / "runs")
    reward = result["reward"]  # rank 1's reward fails in the 4th rollout
    assert reward["checkpoints"] == ["step-3"] and reward["steps"] == [1, 2, 3] and reward["step"] == [3, 3]
    own, other = reward["raised"][1], reward["raised"][0]
    assert "the reward server is gone (rank 1)" in own
    assert other.startswith("process 1 stopped the run: ") and "the reward server is gone (rank 1)" in other
    assert result["resumed"]["steps"] == [1, 2, 3, 4, 5, 6] and result["resumed"]["raised"] == [None, None]
    refill = result["refill"]  # rank 0 fails in a refill round of the 2nd iteration
    assert refill["checkpoints"] == ["step-1"] and refill["step"] == [1, 1], refill
    assert "(rank 0)" in refill["raised"][0] and refill["raised"][1].startswith("process 0 stopped the run")
    both = result["both"]
    assert both["checkpoints"] == ["step-2"] and all(f"(rank {r})" in both["raised"][r] for r in (0, 1)), both
    evaluation = result["eval"]  # after the 4th step trained: logged and saved too
    assert evaluation["checkpoints"] == ["step-4"] and evaluation["steps"] == [1, 2, 3, 4], evaluation
    assert evaluation["raised"][0].startswith("process 1 stopped the run: ")


def test_a_policy_state_turned_on_at_a_resume_starts_from_the_restored_weights(tmp_path):
    """A policy with training state (GRPO-CARE's reference) resumed from a checkpoint of a run without it (care.enabled
    turned on at the resume) failed with 'checkpoint cannot be read', pointing at a sound checkpoint; the policy now
    restarts its state (Policy.restart_training_state) once the weights are restored."""
    from toy_bandit import ToyPolicy

    from mmgrpo.ema import EMA

    class WithReference(ToyPolicy):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.reference_ema = EMA(list(self.model.named_parameters()), 0.9)

        def training_state(self):
            return self.reference_ema.state_dict()

        def load_training_state(self, state):
            self.reference_ema.load_state_dict(state)

        def restart_training_state(self):
            self.reference_ema.restart()

    Trainer(toy(tmp_path, "train.max_steps=2", "optim.lr=0.1")).train()
    restored = load_file(str(tmp_path / "checkpoints" / "step-2" / "policy" / "model.safetensors"))
    cfg = toy(tmp_path, "train.max_steps=3", "optim.lr=0.1", "resume=latest")
    trainer = Trainer(cfg, policy=WithReference(cfg))
    trainer.train()
    torch.testing.assert_close(trainer.policy.reference_ema.shadow["weight"], restored["weight"], rtol=0, atol=0)
    saved = load_file(str(tmp_path / "checkpoints" / "step-3" / "policy_state.safetensors"))
    torch.testing.assert_close(saved["weight"], restored["weight"], rtol=0, atol=0)


def test_too_many_updates_per_rollout_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    """train.updates_per_rollout larger than a process's micro-batches was refused at the first iteration only,
    after the model had loaded and a whole rollout had run."""
    import mmgrpo.trainer

    def no_model(cfg):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(mmgrpo.trainer, "build_policy", no_model)
    cfg = toy(tmp_path, "train.updates_per_rollout=3", "train.prompts_per_step=2", "train.group_size=4",
              "train.micro_batch_size=4")
    with pytest.raises(ConfigError, match=r"'train.updates_per_rollout': 3 updates need as many micro-batches per "
                                          r"process, and this one has 2 \(8 rows, train.micro_batch_size 4\)"):
        Trainer(cfg)
    with pytest.raises(ConfigError, match="'train.prompts_per_step': 2 must be divisible by the 3 processes"):
        check_batch_layout(cfg, 3)
    check_batch_layout(toy(tmp_path, "train.prompts_per_step=4", "train.micro_batch_size=2"), 2)


def test_a_time_budget_that_a_checkpoint_spends_still_ends_with_an_evaluated_iteration(tmp_path):
    """The last iteration of a time-bounded run is evaluated: decided from the clock at the end of its training.
    When the time of a checkpoint (or evaluation, or plot) after it spent the budget instead, the loop stopped
    before another iteration, and the run ended on a step that was not evaluated."""
    class SlowSaves(Trainer):
        def save_checkpoint(self):
            time.sleep(0.6)  # the whole budget: the first checkpoint spends it
            return super().save_checkpoint()

    trainer = SlowSaves(toy(tmp_path, "train.max_steps=100", "train.save_every=1", "train.eval_every=1000",
                            "train.max_minutes=0.01"))
    history = trainer.train()
    assert trainer.step == 2 and history[-1]["step"] == 2  # one more iteration, whose end finds the budget spent
    assert "eval/toy_bandit:match_reward/mean" in history[-1], [sorted(r) for r in history[-1:]]


@pytest.mark.parametrize(("overrides", "message"), [
    (["grpo.refill_rounds=1"], "'grpo.refill_rounds': refilling replaces .* set grpo.mask_zero_std_groups: true"),
    (["grpo.oversample_prompts=2"], "'grpo.oversample_prompts': the extra groups .* set grpo.mask_zero_std_groups"),
])
def test_dynamic_sampling_without_the_mask_is_refused_before_the_model_loads(tmp_path, monkeypatch, overrides,
                                                                             message):
    """These settings are checked from the config alone, but were checked after the model had loaded."""
    import mmgrpo.trainer

    def no_model(cfg):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(mmgrpo.trainer, "build_policy", no_model)
    with pytest.raises(ConfigError, match=message):
        Trainer(toy(tmp_path, *overrides))


def test_evaluation_gathers_sub_scores_that_only_some_processes_report(launch_two_processes, tmp_path):
    """evaluate() gathered each of its own process's score names in turn: a sub-score that one process's reward
    reported and another's did not made the processes run different numbers of gathers, which paired one name's
    scores with another's or with the next collective. The 8 held-out items split 4 and 4: 'score' is 1 on rank 0
    and 0 on rank 1, 'extra' (0.5) comes from rank 0 only."""
    result = launch_two_processes("ddp_eval_check.py", tmp_path / "run")
    assert result["eval/ddp_eval_check:uneven/score/mean"] == pytest.approx(0.5)
    assert result["eval/ddp_eval_check:uneven/extra/mean"] == pytest.approx(0.5)
    assert 0.0 <= result["eval/toy_bandit:match_reward/mean"] <= 1.0


def test_a_reward_failing_in_the_in_loop_evaluation_keeps_the_trained_steps(tmp_path):
    """The in-loop evaluation comes after the iteration's training: a reward that failed there (a judge server gone)
    stopped the run before the iteration's metrics were logged and without saving, so every step since the last
    checkpoint was lost. Now the rows are logged (without the evaluation), the step is saved, and the error goes up."""
    (tmp_path / "flaky_reward.py").write_text(
        "calls = [0]\n\n\ndef fn(batch):\n    calls[0] += 1\n    if calls[0] == 6:\n"
        "        raise ConnectionError('the judge server is gone')\n    return [1.0] * len(batch.prompts)\n")
    rewards = f"rewards=[{{name: toy_bandit:match_reward}}, {{name: '{tmp_path}/flaky_reward.py:fn', weight: 0}}]"
    run = tmp_path / "run"
    common = ["train.max_steps=6", "train.save_every=0", "train.eval_every=2", rewards]
    with pytest.raises(RunError, match="the judge server is gone"):  # calls: 2 steps, then their evaluation...
        Trainer(toy(run, *common)).train()
    assert [p.name for _, p in checkpoint_dirs(run)] == ["step-4"]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "eval/toy_bandit:match_reward/mean" not in rows[-1]
    Trainer(toy(run, *common, "resume=latest")).train()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
