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
PARALLEL = 2
"""Runs at a time, one thread each (two 2-thread runs on 2 cores would fight over them)."""


def mmgrpo(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "mmgrpo", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_all_tiny_presets_train_two_steps_exactly_on_policy(tmp_path):
    runs = {}
    for i in range(0, len(PRESETS), PARALLEL):
        batch = {p: mmgrpo("train", f"configs/flow/{p}.yaml", "train.max_steps=2",
                           f"output_dir={tmp_path / p}") for p in PRESETS[i:i + PARALLEL]}
        runs.update({p: (proc, *proc.communicate()) for p, proc in batch.items()})
    for preset, (proc, _, err) in runs.items():
        assert proc.returncode == 0, f"{preset} failed:\n{err[-3000:]}"
        rows = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2], preset
        assert all(k in rows[0] for k in KEYS), (preset, sorted(set(KEYS) - set(rows[0])))
        assert rows[0]["ratio/onpolicy_max_dev"] <= 1e-6, (preset, rows[0]["ratio/onpolicy_max_dev"])
        assert rows[0]["nfe/rollout"] > 0 and rows[0]["nfe/train"] > 0
        assert max(r["reward/std_within_group"] for r in rows) > 0, preset  # the shipped model's samples differ
        assert (tmp_path / preset / "checkpoints" / "step-2" / "policy").is_dir()
        assert (tmp_path / preset / "samples" / "step-2.png").is_file()  # eval at the last step
    first = {p: json.loads((tmp_path / p / "metrics.jsonl").read_text().splitlines()[0]) for p in PRESETS}
    # branch takes the first update's old log-probs from that update's forward, so its ratio/onpolicy_max_dev is 0
    # by construction; its exactness check is the tree-layout rollout against the training-layout recomputation
    assert first["tiny_branchgrpo"]["logp/rollout_vs_recompute_max_dev"] <= 1e-6
    # TempFlow runs each group's ODE prefix (the steps before its branch step) on one row instead of 8
    assert first["tiny_tempflow"]["nfe/rollout"] < first["tiny_flowgrpo"]["nfe/rollout"] == 160


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
