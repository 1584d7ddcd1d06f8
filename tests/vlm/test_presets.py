"""Acceptance: the tiny vlm presets train the shipped model end to end through the CLI, on policy, with token
counters and their algorithm's keys; every vlm preset (the GPU recipes included) loads and passes the policy's
config checks."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmgrpo.config import load_config
from mmgrpo.pipelines.vlm import care, tgrpo
from mmgrpo.pipelines.vlm.policy import check_config

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "configs" / "vlm").glob("*.yaml"))
TOKEN_KEYS = {"tokens/prompt", "tokens/vision", "tokens/completion", "tokens/truncated_frac", "tokens/rollout",
              "tokens/train", "entropy"}


@pytest.mark.parametrize("preset, extra_keys", [
    ("tiny_video_tgrpo", {"tgrpo/pass_frac", "tgrpo/shuffled_acc", "reward/temporal_bonus/mean", "tokens/shuffled"}),
    ("tiny_image", {"reward/format/mean", "reward/accuracy/mean"}),
    ("tiny_image_care", {"care/answer_likelihood", "care/answer_found_frac", "reward/consistency_bonus/mean"}),
])
def test_tiny_preset_trains_on_policy(tmp_path, preset, extra_keys):
    out = tmp_path / preset
    env = dict(os.environ, OMP_NUM_THREADS="1")  # intra-op threads only spin-wait on a shared 2-core machine
    proc = subprocess.run([sys.executable, "-m", "mmgrpo", "train", f"configs/vlm/{preset}.yaml", "train.max_steps=2",
                           f"output_dir={out}", "logging.progress=false"],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    assert first["ratio/onpolicy_max_dev"] <= 1e-5
    # the sampler (KV-cache decoding, batched, left-padded) scores its tokens as the training forward does
    assert all(r["logp/rollout_vs_recompute_max_dev"] <= 1e-4 for r in rows)
    assert TOKEN_KEYS | extra_keys <= set(first) and not any(k.startswith("nfe/") for k in first)
    assert first["tokens/completion"] > 0 and first["data/skipped_media"] == 0
    config = json.loads((ROOT / "assets" / "tiny-qwen2vl-shapes" / "config.json").read_text())
    assert all(0 < r["entropy"] < math.log(config["text_config"]["vocab_size"]) for r in rows)  # nats per token
    # the shipped SFT'd model answers some questions right and some wrong, so the first step already trains
    assert 0 < first["reward/accuracy/mean"] < 1 and first["reward/std_within_group"] > 0
    assert first.get("tgrpo/video_groups", 0) == (4 if "tgrpo/pass_frac" in extra_keys else 0)  # all 4 prompts
    assert (out / "checkpoints" / "step-2" / "policy").is_dir()


def test_qwen3_vl_trains_the_video_preset_on_policy(tmp_path):
    """A Qwen3-VL (16-px patches, interleaved M-RoPE, DeepStack, frame times written into the prompt) trains
    the T-GRPO video preset through the CLI, with ``video.size_factor`` set to its 32 px."""
    out = tmp_path / "qwen3"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "mmgrpo", "train", "configs/vlm/tiny_video_tgrpo.yaml",
                           "model.path=tiny:qwen3_vl", "video.size_factor=32", "train.max_steps=1",
                           f"output_dir={out}", "logging.progress=false"],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["ratio/onpolicy_max_dev"] <= 1e-5 and first["logp/rollout_vs_recompute_max_dev"] <= 1e-4
    assert first["tgrpo/video_groups"] == 4 and first["tokens/vision"] > 0 and first["data/skipped_media"] == 0


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_and_checks(preset):
    cfg = load_config(preset)
    assert cfg.pipeline == "vlm"
    check_config(cfg)
    assert (tgrpo.bonus_spec(cfg) is not None) == cfg.tgrpo.enabled
    assert (care.bonus_spec(cfg) is not None) == cfg.care.enabled
    if not preset.stem.startswith(("tiny", "demo")):  # CPU presets; GPU recipes must cite their sources
        text = preset.read_text()
        assert "Hardware:" in text and "Sources" in text  # recipes say what they assume and where numbers come from
