"""Acceptance: every tiny flow preset trains the shipped ShapesT2I model through the CLI, on-policy exact, with the
logged counters; bad keys exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmgrpo.cli import main
from mmgrpo.config import load_config
from mmgrpo.pipelines.flow.modes import build_mode

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ["tiny_flowgrpo", "tiny_dancegrpo", "tiny_mixgrpo", "tiny_mixgrpo_flash", "tiny_branchgrpo",
           "tiny_tempflow"]
KEYS = ["ratio/onpolicy_max_dev", "nfe/rollout", "nfe/train", "time/rollout_s", "time/reward_s",
        "time/train_s", "time/step_s", "reward/mean", "reward/shapes_eval/score/mean", "loss", "kl"]
FLOWGRPO_ROLLOUT_NFE = 160
"""tiny_flowgrpo's rollout: 1 prompt x 8 samples x 10 SDE steps x 2 rows (CFG's conditional and unconditional)."""


def mmgrpo(*args):
    """Runs the CLI in a one-thread subprocess (the other test worker has the other core)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "mmgrpo", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False)


@pytest.mark.parametrize("preset", PRESETS)
def test_tiny_preset_trains_two_steps_exactly_on_policy(preset, tmp_path):
    proc = mmgrpo("train", f"configs/flow/{preset}.yaml", "train.max_steps=2", f"output_dir={tmp_path}")
    assert proc.returncode == 0, f"{preset} failed:\n{proc.stderr[-3000:]}"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(k in rows[0] for k in KEYS), sorted(set(KEYS) - set(rows[0]))
    assert rows[0]["ratio/onpolicy_max_dev"] <= 1e-6, rows[0]["ratio/onpolicy_max_dev"]
    assert rows[0]["nfe/rollout"] > 0 and rows[0]["nfe/train"] > 0
    assert max(r["reward/std_within_group"] for r in rows) > 0  # the shipped model's samples differ
    assert (tmp_path / "checkpoints" / "step-2" / "policy").is_dir()
    assert (tmp_path / "samples" / "step-2.png").is_file()  # eval at the last step
    if preset == "tiny_branchgrpo":
        # branch takes the first update's old log-probs from that update's forward, so its ratio/onpolicy_max_dev
        # is 0 by construction; its exactness check is the tree-layout rollout against the training-layout
        # recomputation
        assert rows[0]["logp/rollout_vs_recompute_max_dev"] <= 1e-6
    if preset == "tiny_flowgrpo":
        assert rows[0]["nfe/rollout"] == FLOWGRPO_ROLLOUT_NFE
        # a checkpoint given as model.path: the one-line error says how to load it, and that way works
        checkpoint, args = tmp_path / "checkpoints" / "step-2", [f"configs/flow/{preset}.yaml", "--num", "1"]
        proc = mmgrpo("sample", *args, f"model.path={checkpoint / 'policy'}")
        fix = f"model.path=assets/tiny-sd3-shapes resume={checkpoint}"
        assert proc.returncode == 2 and proc.stderr.strip().endswith(f"set {fix}") and proc.stderr.count("\n") == 1
        proc = mmgrpo("sample", *args, *fix.split(), f"output_dir={tmp_path / 'sampled'}")
        assert proc.returncode == 0 and (tmp_path / "sampled" / "samples" / "sample-step-2.png").is_file()
    if preset == "tiny_tempflow":  # each group's ODE prefix (the steps before its branch step) runs on one row, not 8
        assert rows[0]["nfe/rollout"] < FLOWGRPO_ROLLOUT_NFE


@pytest.mark.parametrize("preset", sorted((ROOT / "configs" / "flow").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_preset_loads_and_builds_its_mode(preset):
    cfg = load_config(preset)  # validates every key and builds the rollout mode
    assert cfg.pipeline == "flow" and build_mode(cfg).num_steps == cfg.sampling.num_steps
    if not preset.stem.startswith(("tiny", "demo")):  # GPU recipes say what they assume and where values come from
        header = "\n".join(line for line in preset.read_text().splitlines() if line.startswith("#"))
        assert "Hardware:" in header and ("published" in header.lower() or "derived" in header.lower())
    if "dancegrpo" in preset.stem:  # DanceGRPO's scripts pass --init_same_noise: one start latent per group
        header = "\n".join(line for line in preset.read_text().splitlines() if line.startswith("#"))
        if preset.stem.startswith("tiny"):  # the tiny model's groups would get identical rewards; it says so
            assert "Deviation: each sample starts from its own noise" in header
        else:
            assert cfg.mode.shared_initial_noise


def test_bad_keys_and_values_exit_2_naming_the_key(tmp_path, capsys):
    """In process (the exit code and one-line message through a real process: tests/core/test_config.py)."""
    cases = [("tiny_mixgrpo", ["no.such.key=1"], "no.such.key"),
             ("tiny_branchgrpo", ["mode.split_points=[2,4,12]"], "mode.split_points"),
             ("tiny_branchgrpo", ["mode.branch_variant=mix", "mode.window_size=11"], "mode.window_size"),
             ("tiny_flowgrpo", ["grpo.ratio_level=sequence"], "grpo.ratio_level"),
             ("tiny_mixgrpo", ["model.type=qwen2_vl"], "model.type"),  # the VLM's adapter, same registry
             # the prompts are read before the model loads, so the missing file is reported, not the model
             ("tiny_flowgrpo", ["model.path=nobody/no-such-model", "data.train_prompts=no/such/prompts.txt"],
              "data.train_prompts")]
    # more: test_modes.py
    for preset, args, key in cases:
        code = main(["train", str(ROOT / f"configs/flow/{preset}.yaml"), f"output_dir={tmp_path / preset}",
                     "logging.progress=false", *args])
        err = capsys.readouterr().err
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"'{key}'" in lines[0], err
