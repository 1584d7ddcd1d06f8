"""Build the shipped demo VLM and its data: ``assets/data/shapes_qa`` and ``assets/tiny-qwen2vl-shapes``.

1. Writes the ShapesQA + MotionQA train and held-out splits (``mmgrpo.tasks.shapes_qa.write_split``).
2. Builds a tiny random Qwen2-VL (``build_tiny_vlm``) and fine-tunes all of it (vision tower included) with AdamW on
   ``<think>{think}</think><answer>X</answer><|im_end|>`` targets for more items of the train split (same seeds,
   written to a temporary folder), prompts encoded exactly as the demo preset encodes them. It stops after
   ``--minutes`` or once greedy accuracy on a slice of train-split items kept out of the SFT reaches
   ``--stop-acc``, so the model is capable but imperfect and GRPO has room to improve it.
3. Saves model + processor with ``save_pretrained`` and measures the held-out split through ``VLMModel`` and
   ``generate_group``: greedy accuracy, mean accuracy of temperature-1 samples, format rate (``sft_report.json``).

    python scripts/build_tiny_vlm.py --minutes 9
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from mmgrpo.config import load_config
from mmgrpo.pipelines.vlm.config import VLMModelConfig
from mmgrpo.pipelines.vlm.data import read_samples, render_prompt, reward_meta
from mmgrpo.pipelines.vlm.generation import generate_group
from mmgrpo.pipelines.vlm.logprobs import token_logprobs
from mmgrpo.pipelines.vlm.model import VLMModel
from mmgrpo.pipelines.vlm.tiny import build_tiny_vlm
from mmgrpo.pipelines.vlm.video import decode_video, load_image
from mmgrpo.rewards import AccuracyReward, RewardBatch
from mmgrpo.rewards.text_rules import FormatReward
from mmgrpo.tasks.shapes_qa import write_split


def encode(vlm: VLMModel, samples, cfg) -> list[dict]:
    """Batch-1 prompt inputs of each sample, decoded and templated as the preset's policy does."""
    out = []
    for s in samples:
        images = [load_image(p, cfg.video) for p in s.images]
        decoded = [decode_video(p, cfg.video) for p in s.videos]
        out.append(vlm.prompt_inputs(render_prompt(s, cfg.data.prompt_template), images,
                                     [v for v, _ in decoded], [f for _, f in decoded]))
    return out


def score(vlm: VLMModel, prompts: list[dict], samples, cfg, group: int, temperature: float,
          seed: int = 0) -> dict[str, float]:
    """Mean accuracy and format rate of ``group`` completions per prompt at ``temperature`` (0: greedy)."""
    gen = replace(cfg.generation, temperature=temperature)
    generator = torch.Generator().manual_seed(seed)
    texts, meta = [], []
    for inputs, s in zip(prompts, samples):
        texts += generate_group(vlm, inputs, group, gen, generator).texts
        meta += [reward_meta(s)] * group
    batch = RewardBatch(prompts=[""] * len(texts), group=torch.arange(len(texts)) // group, completions=texts,
                        meta=meta)
    return {"accuracy": AccuracyReward()(batch).mean().item(), "format": FormatReward()(batch).mean().item(),
            "example": texts[0]}


def targets(vlm: VLMModel, samples) -> list[list[int]]:
    """Token ids of each SFT target, ``<|im_end|>`` included."""
    end = vlm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return [vlm.tokenizer(f"<think>{s.extra['think']}</think>{s.solution}", add_special_tokens=False).input_ids
            + [end] for s in samples]


def sft(vlm: VLMModel, prompts, ids, monitor, monitor_samples, cfg, args) -> dict:
    """AdamW on the targets until the time budget or ``--stop-acc`` on the monitor items; returns a log."""
    model = vlm.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    rng = random.Random(args.seed)
    start = last_check = time.time()
    step, history = 0, []
    while True:
        batch = rng.sample(range(len(prompts)), args.batch)
        width = max(len(ids[i]) for i in batch)
        comp = torch.full((len(batch), width), vlm.pad_token_id)
        for row, i in enumerate(batch):
            comp[row, :len(ids[i])] = torch.tensor(ids[i])
        mask = comp != vlm.pad_token_id
        for g in optimizer.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 50)
        logp = token_logprobs(model, [prompts[i] for i in batch], comp, mask, torch.arange(len(batch)), False)
        loss = -(logp.sum() / mask.sum())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        elapsed = (time.time() - start) / 60
        if time.time() - last_check > args.check_minutes * 60 or elapsed > args.minutes:
            last_check = time.time()
            result = score(vlm, monitor, monitor_samples, cfg, 1, 0.0)
            model.train()
            history.append({"step": step, "minutes": round(elapsed, 2), "loss": round(loss.item(), 4),
                            "monitor_greedy_accuracy": result["accuracy"], "monitor_format": result["format"]})
            print(json.dumps(history[-1]), flush=True)
            if elapsed > args.minutes or (result["format"] > 0.95 and result["accuracy"] >= args.stop_acc):
                return {"steps": step, "minutes": round(elapsed, 2), "history": history}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/vlm/demo_shapes.yaml")
    parser.add_argument("--out", default="assets/tiny-qwen2vl-shapes")
    parser.add_argument("--data", default="assets/data/shapes_qa")
    parser.add_argument("--minutes", type=float, default=9.0, help="SFT wall-clock budget")
    parser.add_argument("--stop-acc", type=float, default=0.6, help="stop once monitor greedy accuracy reaches it")
    parser.add_argument("--check-minutes", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--train-per-kind", type=int, default=80, help="shipped train items per kind")
    parser.add_argument("--heldout-per-kind", type=int, default=12, help="shipped held-out items per kind")
    parser.add_argument("--sft-per-kind", type=int, default=400, help="train-split items per kind for the SFT")
    parser.add_argument("--monitor-per-kind", type=int, default=4, help="of those, kept out of the SFT")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--samples", type=int, default=8, help="temperature-1 samples per held-out prompt")
    parser.add_argument("--sampled-prompts", type=int, default=24, help="held-out prompts sampled at temperature 1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = load_config(args.config)
    data = Path(args.data)
    write_split(data, "train", args.train_per_kind)
    write_split(data, "heldout", args.heldout_per_kind)
    with tempfile.TemporaryDirectory() as tmp:
        write_split(tmp, "train", args.sft_per_kind)
        samples = read_samples(Path(tmp) / "train.jsonl", tmp)
        kinds = len(samples) // args.sft_per_kind
        cut = len(samples) - args.monitor_per_kind * kinds  # items are interleaved by kind: the tail is balanced
        build_tiny_vlm("qwen2_vl", Path(tmp) / "init", args.seed, hidden_size=args.hidden_size,
                       num_layers=args.num_layers)
        vlm = VLMModel(VLMModelConfig(path=str(Path(tmp) / "init"), freeze_vision=False))
        prompts = encode(vlm, samples, cfg)
        log = sft(vlm, prompts[:cut], targets(vlm, samples[:cut]), prompts[cut:], samples[cut:], cfg, args)
    vlm.model.eval()
    vlm.save(args.out)
    shipped = VLMModel(VLMModelConfig(path=args.out))
    heldout = read_samples(data / "heldout.jsonl", data)
    held_prompts = encode(shipped, heldout, cfg)
    report = {"args": vars(args), "sft": log,
              "heldout_greedy": score(shipped, held_prompts, heldout, cfg, 1, 0.0),
              "heldout_sampled": score(shipped, held_prompts[:args.sampled_prompts],
                                               heldout[:args.sampled_prompts], cfg, args.samples, 1.0, args.seed)}
    (Path(args.out) / "sft_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("heldout_greedy", "heldout_sampled")}, indent=2))


if __name__ == "__main__":
    main()
