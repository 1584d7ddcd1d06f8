"""``mmgrpo bench rewards``: the throughput of every registered reward at batch 1 and batch 32, and the cost of
scoring through the server.

Every reward is built as a user configures it, by name through :func:`~.zoo.build_reward`, and timed on CPU at the
torch thread count that ``mmgrpo bench`` sets (``--threads``, default 1), which each row records. The model rewards
run with random weights in the real formats and a reduced but realistic shape (see :data:`BENCH_CLIP`): 224 px
input, patch 32, the real 49,408-token CLIP vocabulary, 6 layers of width 384 per tower. The VLM judges run a tiny
random Qwen2-VL (:data:`JUDGE`) through the local transformers backend, answering in at most
:data:`JUDGE_TOKENS` tokens. Inputs:

- images are 256 px, so every model call also resizes and crops; the ShapesT2I rules get the task's 64 px renders;
- videos are :data:`VIDEO_FRAMES` frames of :data:`VIDEO_SIDE` px, all of them scored;
- text rules get a ``<think>...</think><answer>...</answer>`` completion and the ground truth they read.

Prompts change on every call (a new training step) and a batch of 32 holds 4 prompts x 8 samples, as a GRPO group
does, so the text-embedding cache helps only within a call. Each call gets a new pixel tensor (the ShapesT2I
rewards cache their detections per tensor); building the batch is not timed. The batch-1 and batch-32 calls of a
reward take turns, so that load from other users of the machine hits both alike. A groupwise reward at batch 1 sees
a group of one, so ``vlm_pairwise`` (no pair to judge) is timed at batch 32 only.

Figures: ``batch32_vs_batch1/<reward>`` (throughput at batch 32 over batch 1), ``remote_overhead`` and
``remote_overhead_batch1`` (seconds per call of clip_score through a loopback reward server over in-process, the
two taking turns), and ``skipped``: how many registered rewards have no bench case (each has a row with the
reason instead of rates).
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmgrpo.bench import BENCHES
from mmgrpo.config import RewardSpec
from mmgrpo.registry import REWARDS
from mmgrpo.tasks.shapes import RESOLUTION, ShapesT2I, render

from .base import Reward, RewardBatch
from .clip_models import load_open_clip
from .zoo import build_reward

BENCH_CLIP = {"embed_dim": 384,
              "vision_cfg": {"image_size": 224, "layers": 6, "width": 384, "head_width": 64, "patch_size": 32},
              "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 384, "heads": 6, "layers": 6}}
"""The open_clip config of the benchmark's CLIP towers (the transformers CLIPModel of pickscore matches it)."""
JUDGE = {"hidden_size": 128, "num_layers": 2, "vision_depth": 2, "vision_width": 64}
"""The tiny Qwen2-VL of the judge rewards (:func:`~mmgrpo.pipelines.vlm.tiny.build_tiny_vlm` arguments)."""
JUDGE_TOKENS = 8
"""New tokens per judge answer: about what "Score: 4" or "Better: A" takes."""
GROUP = 8
IMAGE_SIZE = 256
VIDEO_FRAMES, VIDEO_SIDE = 8, 128
REPEATS = {1: 7, 32: 3}
COMPLETION = "<think>count the red squares</think><answer>B</answer>"
CHOICE = {"problem_type": "multiple choice", "solution": "B"}


@dataclass(frozen=True)
class Case:
    """One timed reward: its registered name, what it runs (``model``), its args and its inputs (``text``,
    ``image``, ``shapes`` or ``video``), with the per-sample ``meta`` and the completion of text inputs."""

    reward: str
    model: str
    args: dict[str, Any]
    inputs: str
    meta: dict[str, Any] = field(default_factory=dict)
    completion: str = COMPLETION
    batch1: bool = True


INPUTS = {"text": "text", "image": f"{IMAGE_SIZE}px image", "shapes": f"{RESOLUTION}px ShapesT2I render",
          "video": f"{VIDEO_FRAMES}x{VIDEO_SIDE}px video"}


def _build_clip_models(root: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """Random-weight CLIP-family checkpoints in the real formats under ``root``: reward -> (model note, args)."""
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
    hps = {"checkpoint": f"{path}/hps.pt", "model_name": name, "device": "cpu"}
    return {
        "clip_score": (note, {"model_name": name, "pretrained": f"{path}/clip.pt", "device": "cpu"}),
        "hpsv2": (note, hps),
        "hpsv2.1": (note, hps),
        "aesthetic": (note + " + LAION-layout MLP", {"clip_model": name, "clip_pretrained": f"{path}/clip.pt",
                                                     "checkpoint": f"{path}/aesthetic.pth", "embed_dim": 384,
                                                     "device": "cpu"}),
        "pickscore": (f"transformers CLIPModel 224px/32, 6x384 towers, {pick_params:.0f}M params, random weights",
                      {"model": f"{path}/pickscore", "processor": f"{path}/pickscore", "device": "cpu"}),
    }


def _build_judge(root: Path) -> tuple[str, dict[str, Any]]:
    """A random :data:`JUDGE` Qwen2-VL under ``root``: (model note, ``vlm_judge`` args)."""
    from safetensors.torch import load_file

    from mmgrpo.pipelines.vlm.tiny import build_tiny_vlm

    path = build_tiny_vlm("qwen2_vl", root / "judge", **JUDGE)
    params = sum(t.numel() for f in path.glob("*.safetensors") for t in load_file(f).values()) / 1e6
    note = (f"Qwen2-VL, {JUDGE['num_layers']}x{JUDGE['hidden_size']} LM + {JUDGE['vision_depth']}x"
            f"{JUDGE['vision_width']} vision, {params:.1f}M params, random weights, {JUDGE_TOKENS} new tokens")
    backend = {"model": str(path), "dtype": "float32", "max_new_tokens": JUDGE_TOKENS, "device": "cpu"}
    return note, {"backend": "transformers", "backend_args": backend, "on_parse_fail": "mid"}


def _build_models(root: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """The model rewards' checkpoints under ``root``: reward -> (model note, args)."""
    return {**_build_clip_models(root), "vlm_judge": _build_judge(root)}


def _cases(models: dict[str, tuple[str, dict[str, Any]]]) -> list[Case]:
    """Every bench case: the rules, the ``models`` and the rewards built on them."""
    clip_note, clip = models["clip_score"]
    judge_note, judge = models["vlm_judge"]
    interval = "<think>the cat jumps at 2.5 s</think><answer>[2.5, 6.0]</answer>"
    shapes = "rule: connected components, shape features"
    return [
        Case("format", "rule (regex)", {}, "text"),
        Case("accuracy", "rule (multiple choice)", {}, "text", CHOICE),
        Case("length", "rule (characters)", {"max_len": 256}, "text"),
        Case("temporal_iou", "rule (interval IoU)", {}, "text", {"solution": [2.0, 6.5]}, interval),
        Case("temporal_bonus", "rule (accuracy + group test)", {}, "text", {**CHOICE, "tgrpo_shuffled_acc": 0.25}),
        Case("consistency_bonus", "rule (accuracy + group selection)", {}, "text",
             {**CHOICE, "care_answer_likelihood": 0.9}),
        Case("jpeg_compressibility", "rule (in-memory JPEG)", {}, "image"),
        Case("jpeg_incompressibility", "rule (in-memory JPEG)", {}, "image"),
        Case("sharpness", "rule (Laplacian)", {}, "image"),
        Case("color_fraction", "rule (RGB distance)", {"rgb": [255, 0, 0]}, "image"),
        Case("grid_seams", "rule (step edges)", {}, "image"),
        Case("tile_repetition", "rule (self-similarity at panel shifts)", {}, "image"),
        Case("shapes_eval", shapes, {}, "shapes"),
        Case("shapes_partial", shapes, {}, "shapes"),
        Case("shapes_layout", shapes, {}, "shapes"),
        *(Case(name, *models[name], "image") for name in ("clip_score", "hpsv2", "hpsv2.1", "aesthetic", "pickscore")),
        Case("win_rate", f"clip_score base: {clip_note}", {"base": "clip_score", "base_args": clip}, "image"),
        Case("video_frames", f"clip_score on every frame: {clip_note}",
             {"image_reward": "clip_score", "image_reward_args": clip, "frames": VIDEO_FRAMES}, "video"),
        Case("motion", "rule (frame differences)", {"frames": VIDEO_FRAMES}, "video"),
        Case("temporal_consistency", f"image tower: {clip_note}",
             {"model_name": clip["model_name"], "pretrained": clip["pretrained"], "frames": VIDEO_FRAMES,
              "device": "cpu"}, "video"),
        Case("vlm_judge", f"score preset: {judge_note}", judge, "image"),
        Case("vlm_pairwise", f"better preset, {GROUP * (GROUP - 1) // 2} pairs per group: {judge_note}",
             {"backend": judge["backend"], "backend_args": judge["backend_args"]}, "image", batch1=False),
    ]


def _pixels(inputs: str, size: int) -> torch.Tensor | None:
    """The pixels of ``size`` samples of ``inputs``: noise images or videos, ShapesT2I renders, or None (text)."""
    generator = torch.Generator().manual_seed(size)
    if inputs == "image":
        return torch.rand(size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    if inputs == "video":
        return torch.rand(size, VIDEO_FRAMES, 3, VIDEO_SIDE, VIDEO_SIDE, generator=generator)
    if inputs == "shapes":
        items = _shapes_items()
        return torch.stack([torch.from_numpy(render(items[i // GROUP], seed=i)) for i in range(size)])
    return None


def _shapes_items() -> list[dict[str, Any]]:
    """The first ShapesT2I training prompts (counts and relations alternate), one per group of a batch of 32."""
    return ShapesT2I().items("train")[:32 // GROUP]


def _maker(case: Case, size: int) -> Callable[[], RewardBatch]:
    """A maker of batches of ``size`` samples for ``case``, in groups of up to 8, with new prompts (the ShapesT2I
    prompts excepted) and a new pixel tensor on every call."""
    counter = itertools.count()
    group = torch.arange(size) // GROUP
    pixels = _pixels(case.inputs, size)
    items = _shapes_items() if case.inputs == "shapes" else []

    def make() -> RewardBatch:
        step = next(counter)
        if items:
            meta = [items[g] for g in group.tolist()]
            prompts = [m["prompt"] for m in meta]
        else:
            prompts = [f"a photo of {g} red squares on a table, step {step}" for g in group.tolist()]
            meta = [dict(case.meta) for _ in range(size)]
        return RewardBatch(prompts=prompts, group=group, meta=meta,
                           images=pixels.clone() if case.inputs in ("image", "shapes") else None,
                           videos=pixels.clone() if case.inputs == "video" else None,
                           completions=[case.completion] * size if case.inputs == "text" else None)

    return make


def _timer(reward: Reward, case: Case, size: int) -> Callable[[], float]:
    """A timer of ``reward`` at batch ``size``: seconds of one call on a new batch (built before the clock starts)."""
    make = _maker(case, size)

    def seconds() -> float:
        batch = make()
        start = time.perf_counter()
        reward(batch)
        return time.perf_counter() - start

    return seconds


def _medians(timers: dict[Any, tuple[Callable[[], float], int]]) -> dict[Any, float]:
    """Median seconds of each ``(timer, repeats)`` after a warm-up call; the timers take turns, so that load from
    other users of the machine hits all of them alike."""
    for timer, _ in timers.values():
        timer()
    times: dict[Any, list[float]] = {key: [] for key in timers}
    for turn in range(max(repeats for _, repeats in timers.values())):
        for key, (timer, repeats) in timers.items():
            if turn < repeats:
                times[key].append(timer())
    return {key: statistics.median(values) for key, values in times.items()}


def _row(case: Case, one: float | None, many: float, threads: int) -> dict[str, Any]:
    """The output row of ``case``: samples per second at batch 1 (``one``) and 32 (``many``), and their ratio."""
    return {"reward": case.reward, "model": case.model, "inputs": INPUTS[case.inputs], "batch1_per_s": one,
            "batch32_per_s": many, "speedup": None if one is None else many / one, "threads": threads}


def _remote(case: Case, threads: int) -> tuple[dict[str, Any], dict[str, float]]:
    """The ``remote`` row (``case`` served by a loopback reward server) and its overheads over in-process scoring
    at batch 1 and 32, with two more repeats than the other rows (the ratios are noisier)."""
    from .remote import RemoteReward
    from .server import RewardServer

    local = build_reward(case.reward, case.args)
    with RewardServer([RewardSpec(name=case.reward, args=case.args)], port=0).start() as server:
        remote = RemoteReward(server.url, max_batch=32)
        seconds = _medians({(where, size): (_timer(reward, case, size), REPEATS[size] + 2)
                            for where, reward in (("local", local), ("remote", remote)) for size in (1, 32)})
    figures = {"remote_overhead_batch1": seconds["remote", 1] / seconds["local", 1],
               "remote_overhead": seconds["remote", 32] / seconds["local", 32]}
    note = f"{case.reward} through a loopback reward server, float16 pixels: {case.model}"
    row = _row(Case("remote", note, case.args, case.inputs), 1 / seconds["remote", 1], 32 / seconds["remote", 32],
               threads)
    return row, figures


def bench_rewards() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows per reward (samples/s at batch 1 and 32) and the figures named in the module notes."""
    threads = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmgrpo-bench-rewards-") as tmp, torch.no_grad():
        cases = _cases(_build_models(Path(tmp)))
        for case in cases:
            reward = build_reward(case.reward, case.args)
            sizes = (1, 32) if case.batch1 else (32,)
            seconds = _medians({size: (_timer(reward, case, size), REPEATS[size]) for size in sizes})
            rows.append(_row(case, 1 / seconds[1] if case.batch1 else None, 32 / seconds[32], threads))
        row, overheads = _remote(next(c for c in cases if c.reward == "clip_score"), threads)
    rows.append(row)
    figures = {f"batch32_vs_batch1/{r['reward']}": r["speedup"] for r in rows if r["speedup"] is not None}
    figures.update(overheads)
    timed = {r["reward"] for r in rows}
    skipped = [name for name in REWARDS.names() if name not in timed]
    rows += [{"reward": name, "skipped": "no bench case: registered outside mmgrpo.rewards (a plugin or user code), "
              "so its inputs and args are unknown here"} for name in skipped]
    figures["skipped"] = len(skipped)
    return rows, figures


BENCHES.register("rewards", bench_rewards)
