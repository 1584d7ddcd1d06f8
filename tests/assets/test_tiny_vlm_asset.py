"""The shipped SFT'd tiny Qwen2-VL: a real transformers folder that loads offline, is small, reads task words as single
tokens, and answers a held-out question in the think/answer format."""

from pathlib import Path

import torch

from mmgrpo.config import load_config
from mmgrpo.pipelines.vlm.config import VLMModelConfig
from mmgrpo.pipelines.vlm.data import read_samples, render_prompt
from mmgrpo.pipelines.vlm.generation import generate_group
from mmgrpo.pipelines.vlm.model import VLMModel
from mmgrpo.pipelines.vlm.video import decode_video, load_image
from mmgrpo.rewards import RewardBatch
from mmgrpo.rewards.text_rules import FormatReward

ROOT = Path(__file__).resolve().parents[2]
ASSET = ROOT / "assets" / "tiny-qwen2vl-shapes"
PRESET = ROOT / "configs" / "vlm" / "demo_shapes.yaml"


def test_folder_is_small():
    assert sum(f.stat().st_size for f in ASSET.rglob("*") if f.is_file()) < 10e6


def test_loads_offline_with_the_auto_classes():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(ASSET, dtype=torch.float32, local_files_only=True)
    processor = AutoProcessor.from_pretrained(ASSET, local_files_only=True)
    assert model.config.model_type == "qwen2_vl"
    assert processor.tokenizer.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id


def test_task_words_and_tags_are_single_tokens():
    from transformers import AutoProcessor

    tok = AutoProcessor.from_pretrained(ASSET, local_files_only=True).tokenizer
    tokens = tok.convert_ids_to_tokens(tok("<think>the circle is red</think><answer>A</answer>")["input_ids"])
    assert tokens == ["<think>", "the", "Ġcircle", "Ġis", "Ġred", "</think>", "<answer>", "A", "</answer>"]
    assert "Ġred" in tok.convert_ids_to_tokens(tok("A. red")["input_ids"])  # the think's word is the option's token
    assert tok.decode(tok("<think>4 shapes</think>")["input_ids"]) == "<think>4 shapes</think>"


def test_greedy_heldout_completions_have_the_think_answer_format():
    cfg = load_config(PRESET)
    vlm = VLMModel(VLMModelConfig(path=str(ASSET)))
    data = ROOT / cfg.data.root
    samples = read_samples(ROOT / cfg.data.eval_file, data)
    picked = [next(s for s in samples if s.images), next(s for s in samples if s.videos)]
    texts = []
    for s in picked:
        images = [load_image(p, cfg.video) for p in s.images]
        videos = [decode_video(p, cfg.video) for p in s.videos]
        inputs = vlm.prompt_inputs(render_prompt(s, cfg.data.prompt_template), images, [v for v, _ in videos],
                                   [f for _, f in videos])
        greedy = type(cfg.generation)(max_new_tokens=cfg.generation.max_new_tokens, temperature=0.0)
        texts += generate_group(vlm, inputs, 1, greedy).texts
    batch = RewardBatch(prompts=[""] * len(texts), group=torch.arange(len(texts)), completions=texts)
    assert FormatReward()(batch).tolist() == [1.0, 1.0], texts


def test_grpo_raises_sampled_accuracy_on_fixed_questions(tmp_path):
    """The demo preset's GRPO on 8 fixed training questions: sampled accuracy must rise (measured: 0.71 over steps
    1-15, 0.95 over steps 36-50), i.e. the loss pushes the policy towards rewarded answers."""
    from mmgrpo.trainer import Trainer

    lines = (ROOT / "assets/data/shapes_qa/train.jsonl").read_text().splitlines()[:8]
    (tmp_path / "eight.jsonl").write_text("\n".join(lines) + "\n")
    cfg = load_config(PRESET,
                      [f"output_dir={tmp_path / 'run'}", f"data.train_file={tmp_path / 'eight.jsonl'}",
                       "train.max_steps=50", "train.save_every=1000", "data.num_eval=8", "logging.progress=false"])
    trainer = Trainer(cfg)
    history = trainer.train()
    trainer.close()
    accuracy = [row["reward/accuracy/mean"] for row in history]
    first, last = sum(accuracy[:15]) / 15, sum(accuracy[-15:]) / 15
    assert last > first + 0.08, (first, last)
