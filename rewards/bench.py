"""``mmgrpo bench rewards``: reward throughput at batch 1 and batch 32, and the cost of scoring through the server.

The model rewards run on CPU with random weights in the real formats and a reduced but realistic shape (see
:data:`BENCH_CLIP`): 224 px input, patch 32, the real 49,408-token CLIP vocabulary, 6 layers of width 384 per tower.
Images are 256 px, so every call also resizes and crops. Prompts change on every call (a new training step) and a
batch of 32 holds 4 prompts x 8 samples, as a GRPO group does, so the text-embedding cache helps only within a call.
Everything runs on one torch thread: the machine is shared, and with two threads a busy neighbour stalls every
parallel op (small batches most), which buries the batching effect under scheduling noise. Figures:
``batch32_vs_batch1/<reward>`` (throughput at batch 32 over batch 1) and ``remote_overhead`` (clip_score at
batch 32 through a loopback reward server over in-process).
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmgrpo.bench import BENCHES, median_seconds
from mmgrpo.config import RewardSpec

from .base import Reward, RewardBatch
from .clip_models import load_open_clip
from .zoo import build_reward

BENCH_CLIP = {"embed_dim": 384,
              "vision_cfg": {"image_size": 224, "layers": 6, "width": 384, "head_width": 64, "patch_size": 32},
              "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 384, "heads": 6, "layers": 6}}
"""The open_clip config of the benchmark's CLIP towers (the transformers CLIPModel of pickscore matches it)."""
GROUP = 8
IMAGE_SIZE = 256
REPEATS = {1: 7, 32: 3}
THREADS = 1
COMPLETION = "<think>count the red squares</think><answer>B</answer>"


def _build_models(root: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """Random-weight checkpoints in the real formats under ``root``: reward name -> (model note, reward args)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from mmgrpo.pipelines.flow.tiny import clip_tokenizer

    config = root / "mmgrpo_bench_clip.json"
    config.write_text(json.dumps(BENCH_CLIP), encoding="utf-8")
    torch.manual_seed(0)
    model, _ = load_open_clip(str(config), None, torch.device("cpu"))
    params = sum(p.numel() for p in model.parameters()) / 1e6
    torch.save(model.state_dict(), root / "clip.pt")
    torch.save({"state_dict": model.state_dict()}, root / "hps.pt")
    mlp, sizes = {}, [BENCH_CLIP["embed_dim"], 1024, 128, 64, 16, 1]
    for index, (fan_in, fan_out) in zip([0, 2, 4, 6, 7], itertools.pairwise(sizes)):
        mlp[f"layers.{index}.weight"] = torch.randn(fan_out, fan_in) / fan_in ** 0.5
        mlp[f"layers.{index}.bias"] = torch.zeros(fan_out)
    torch.save(mlp, root / "aesthetic.pth")
    width, layers = BENCH_CLIP["vision_cfg"]["width"], BENCH_CLIP["vision_cfg"]["layers"]
    towers = {"hidden_size": width, "intermediate_size": 4 * width, "num_hidden_layers": layers,
              "num_attention_heads": width // 64}
    pick = CLIPModel(CLIPConfig(
        text_config={**towers, "vocab_size": 49408, "max_position_embeddings": 77, "bos_token_id": 49406,
                     "eos_token_id": 49407, "pad_token_id": 49407},
        vision_config={**towers, "image_size": 224, "patch_size": 32}, projection_dim=BENCH_CLIP["embed_dim"]))
    pick.save_pretrained(root / "pickscore")
    images = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    CLIPProcessor(image_processor=images, tokenizer=clip_tokenizer()).save_pretrained(root / "pickscore")
    pick_params = sum(p.numel() for p in pick.parameters()) / 1e6
    name, path = str(config), str(root)
    note = f"open_clip ViT 224px/32, 6x384 towers, {params:.0f}M params, random weights"
    return {
        "clip_score": (note, {"model_name": name, "pretrained": f"{path}/clip.pt", "device": "cpu"}),
        "hpsv2": (note, {"checkpoint": f"{path}/hps.pt", "model_name": name, "device": "cpu"}),
        "aesthetic": (note + " + LAION-layout MLP", {"clip_model": name, "clip_pretrained": f"{path}/clip.pt",
                                                     "checkpoint": f"{path}/aesthetic.pth", "embed_dim": 384,
                                                     "device": "cpu"}),
        "pickscore": (f"transformers CLIPModel 224px/32, 6x384 towers, {pick_params:.0f}M params, random weights",
                      {"model": f"{path}/pickscore", "processor": f"{path}/pickscore", "device": "cpu"}),
    }


def _batches(size: int, text: bool) -> Callable[[], RewardBatch]:
    """A maker of batches of ``size`` samples in groups of up to 8, with new prompts on every call."""
    counter = itertools.count()
    generator = torch.Generator().manual_seed(size)
    images = torch.rand(size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)

    def make() -> RewardBatch:
        step = next(counter)
        group = torch.arange(size) // GROUP
        prompts = [f"a photo of {int(g)} red squares on a table, step {step}" for g in group]
        meta = [{"problem_type": "multiple choice", "solution": "B"}] * size
        if text:
            return RewardBatch(prompts=prompts, group=group, completions=[COMPLETION] * size, meta=meta)
        return RewardBatch(prompts=prompts, group=group, images=images)

    return make


def _throughput(reward: Callable[[RewardBatch], Any], size: int, text: bool) -> float:
    """Samples per second of ``reward`` at batch ``size`` (median of repeats, after a warm-up call)."""
    make = _batches(size, text)
    return size / median_seconds(lambda: reward(make()), repeats=REPEATS[size])


def bench_rewards() -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Rows per reward (samples/s at batch 1 and 32) and the figures named in the module notes."""
    from .remote import RemoteReward
    from .server import RewardServer

    rows, figures = [], {}
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="mmgrpo-bench-rewards-") as tmp:
        cases: dict[str, tuple[str, dict[str, Any], bool]] = {
            "format": ("rule", {}, True), "accuracy": ("rule", {}, True),
            "jpeg_compressibility": ("rule (in-memory JPEG)", {}, False), "sharpness": ("rule", {}, False)}
        cases.update({k: (note, args, False) for k, (note, args) in _build_models(Path(tmp)).items()})
        rewards: dict[str, Reward] = {}
        for name, (note, args, text) in cases.items():
            rewards[name] = build_reward(name, args)
            one, many = _throughput(rewards[name], 1, text), _throughput(rewards[name], 32, text)
            rows.append({"reward": name, "model": note, "batch1_per_s": one, "batch32_per_s": many,
                         "speedup": many / one, "threads": THREADS})
            figures[f"batch32_vs_batch1/{name}"] = many / one
        spec = RewardSpec(name="clip_score", args=cases["clip_score"][1])
        with RewardServer([spec], port=0).start() as server:
            remote = RemoteReward(server.url, max_batch=32)
            make = _batches(32, text=False)
            local, through = (lambda: rewards["clip_score"](make())), (lambda: remote(make()))
            local(), through()  # warm-up
            # alternate the two so that load from other users of the machine hits both alike
            times = [(median_seconds(local, 1, 0), median_seconds(through, 1, 0)) for _ in range(REPEATS[32] + 2)]
            local_s = statistics.median(t for t, _ in times)
            remote_s = statistics.median(t for _, t in times)
        rows.append({"reward": "remote(clip_score)", "model": f"loopback server {server.url}, float16 pixels",
                     "batch1_per_s": None, "batch32_per_s": 32 / remote_s, "speedup": None,
                     "threads": THREADS})
        figures["remote_overhead"] = remote_s / local_s
    torch.set_num_threads(threads)
    return rows, figures


BENCHES.register("rewards", bench_rewards)
