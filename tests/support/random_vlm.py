"""Overrides that put a tiny vlm preset on the random tiny Qwen2-VL (``tiny:qwen2_vl``) and the ``vlm_tiny``
questions, with small media budgets: the unit tests' setting, seconds per test, independent of the shipped SFT'd
model the presets train."""

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "assets" / "data" / "vlm_tiny"

RANDOM_TINY_VLM = [
    "model.path=tiny:qwen2_vl",
    f"data.train_file={DATA / 'train.jsonl'}", f"data.eval_file={DATA / 'eval.jsonl'}", f"data.root={DATA}",
    "data.num_eval=12", "data.max_prompt_tokens=1024",
    "video.min_frames=4", "video.max_frames=4", "video.max_pixels=4", "video.image_max_pixels=4",
]
