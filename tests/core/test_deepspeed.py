"""The trainer under DeepSpeed ZeRO-2 and ZeRO-3, with the shipped launcher configs, on DeepSpeed's CPU accelerator
in two gloo processes (tests/support/deepspeed_check.py), against the same run under DDP."""

import pytest
from safetensors.torch import load_file

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")


def step2_weights(root, run="straight"):
    return load_file(root / run / "checkpoints" / "step-2" / "policy" / "model.safetensors")


def test_zero_trains_skips_and_resumes_as_ddp_does(launch_two_processes, tmp_path):
    """A full fine-tune of the tiny Qwen2-VL with its frozen KL reference trains as under DDP, and a resumed step 2
    equals the uninterrupted one, under ZeRO-2 and ZeRO-3. Before, on a machine without CUDA,
    ``Accelerator(cpu=True)`` dropped DeepSpeed without a word; under ZeRO-3, accelerate registers its config with
    transformers whatever zero3_init_flag says, so from_pretrained partitioned the weights and the KL reference
    could not be copied; and a train_batch_size left from an earlier prepare (or a DeepSpeed JSON file) stopped
    DeepSpeed's engine. One test, one launch after another: each launch takes both cores."""
    reference = launch_two_processes("deepspeed_check.py", tmp_path / "ddp")  # configs/accelerate/cpu_2proc.yaml
    (ddp,), _ = reference["rows"]
    expected = step2_weights(tmp_path / "ddp")
    for stage in (2, 3):
        launcher = f"deepspeed_zero{stage}"
        report = launch_two_processes("deepspeed_check.py", tmp_path / launcher, launcher=launcher)
        assert report["distributed_type"] == "DEEPSPEED" and report["zero_stage"] == stage
        # the NaN gradient of step 2 skips the update: the engine steps inside accelerate's backward, and must not
        assert report["toy_skipped"] == 1 and report["toy_step2_max_change"] == 0, launcher
        assert report["onpolicy"] == [0.0, 0.0], launcher
        (straight,), (resumed,) = report["rows"]
        assert straight["step"] == resumed["step"] == 2
        assert {k: v for k, v in resumed.items() if not k.startswith("time/")} == {
            k: v for k, v in straight.items() if not k.startswith("time/")}, launcher
        for key in ("loss", "kl", "reward/mean", "entropy"):
            assert straight[key] == pytest.approx(ddp[key], rel=1e-5, abs=1e-9), (launcher, key)
        assert straight["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-5), launcher
        if stage == 2:
            assert report["rank_max_diff"] == 0
        for run in ("straight", "resumed"):
            saved = step2_weights(tmp_path / launcher, run)
            assert saved.keys() == expected.keys()
            # k_proj biases have no gradient but reduction noise (softmax ignores a shift shared by all keys),
            # which Adam scales up to lr-sized steps (lr 3e-4): they differ between any two reduction orders, and
            # through them step 2's other gradients a little (ZeRO-3: under 2e-6); a wrong update is off by ~lr
            diffs = {k: (saved[k] - expected[k]).abs().max().item() for k in expected
                     if not k.endswith("k_proj.bias")}
            assert max(diffs.values()) <= 1e-5, (launcher, run, max(diffs.items(), key=lambda kv: kv[1]))
