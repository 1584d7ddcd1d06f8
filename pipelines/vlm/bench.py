"""``mmgrpo bench prefix-grouper``: the Prefix Grouper training pass and the shared-prefill rollout against their
standard baselines, on a Qwen2-VL built from config (LM width 128, 2 layers; vision depth 2) and saved in the
real format.

- Training: forward + backward of ``token_logprobs`` (loss = masked token mean) for G in {4, 8, 16} completions
  of 64 tokens after a prompt of P in {256, 1024, 4096} tokens (one image: 64 vision tokens at P=256, 256 above;
  the rest text), vision tower frozen as in the default config. Time is the median of 3 runs after one untimed
  run that also measures memory and the log-prob / gradient differences. The machine is shared, so the runs of
  the two variants alternate (a burst of load hits both) and each row records the 1-minute load average.
- Memory is the bytes of distinct tensor storages saved for backward during the forward (the activations that
  a training pass holds at its peak), counted with ``torch.autograd.graph.saved_tensors_hooks`` and excluding
  parameters. It leaves out weights, gradients and transient buffers; torch CPU allocations are not visible to
  tracemalloc, and process RSS only grows, so neither could separate the cases.
- Rollout: ``generate_group`` (prompt prefilled once, its KV cache stored once for the group) against
  ``generate_group_naive`` (prompt prefilled on G copies, a cache row each) at G=8, P=1024, 64 new tokens (EOS
  disabled so every row runs all 64 steps), same seed; plus the prefill alone and the KV-cache bytes each path
  allocates for the whole rollout.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mmgrpo.bench import BENCHES
from mmgrpo.pipelines.vlm.config import VLMGenerationConfig, VLMModelConfig
from mmgrpo.pipelines.vlm.generation import generate_group, generate_group_naive, prefill
from mmgrpo.pipelines.vlm.logprobs import token_logprobs
from mmgrpo.pipelines.vlm.model import VLMModel
from mmgrpo.pipelines.vlm.tiny import build_tiny_vlm

PREFIXES = (256, 1024, 4096)
GROUPS = (4, 8, 16)
COMPLETION = 64
HIDDEN, LAYERS = 128, 2
REPEATS = 3
FILLER = "Count the red cubes left of the sphere, then compare with the number of cylinders. "


def bench_prompt(vlm: VLMModel, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A prompt of exactly ``length`` tokens: one random image (224 px -> 64 vision tokens for short prompts,
    448 px -> 256) and byte-level text filling the rest."""
    side = 224 if length <= 256 else 448
    image = torch.randint(0, 256, (3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    overhead = vlm.prompt_inputs("", [image], [])["input_ids"].shape[1]
    text = (FILLER * (length // len(FILLER) + 1))[: length - overhead]
    inputs = vlm.prompt_inputs(text, [image], [])
    assert inputs["input_ids"].shape[1] == length, inputs["input_ids"].shape
    return inputs


def alternating_medians(first: Callable[[], object], second: Callable[[], object],
                        repeats: int = REPEATS) -> tuple[float, float]:
    """Median wall-clock seconds of ``first()`` and ``second()``, timed in alternation ``repeats`` times each."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in zip((first, second), times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def saved_activation_bytes(model: torch.nn.Module, forward) -> tuple[int, torch.Tensor]:
    """(bytes of distinct non-parameter storages saved for backward during ``forward()``, its output)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    return sum(seen.values()), out


def train_cell(vlm: VLMModel, prompt: dict[str, torch.Tensor], group: int) -> dict[str, float]:
    """One (P, G) cell: standard vs Prefix Grouper forward+backward time, activation memory and differences."""
    gen = torch.Generator().manual_seed(group)
    ids = torch.randint(0, 256, (group, COMPLETION), generator=gen)
    mask = torch.ones(group, COMPLETION, dtype=torch.bool)
    index = torch.zeros(group, dtype=torch.long)
    model = vlm.model

    def loss_of(logp: torch.Tensor) -> torch.Tensor:
        return (logp * mask).sum() / mask.sum()

    def step(grouper: bool) -> None:
        model.zero_grad(set_to_none=True)
        loss_of(token_logprobs(model, [prompt], ids, mask, index, grouper)).backward()

    measured = []
    for grouper in (False, True):
        model.zero_grad(set_to_none=True)
        nbytes, logp = saved_activation_bytes(
            model, lambda g=grouper: token_logprobs(model, [prompt], ids, mask, index, g))
        loss_of(logp).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        measured.append((nbytes, logp.detach(), grads))
    (m_std, lp_std, g_std), (m_pg, lp_pg, g_pg) = measured
    t_std, t_pg = alternating_medians(lambda: step(False), lambda: step(True))
    return {"standard_s": t_std, "grouper_s": t_pg, "train_speedup": t_std / t_pg,
            "standard_act_mib": m_std / 2**20, "grouper_act_mib": m_pg / 2**20, "act_mem_ratio": m_std / m_pg,
            "max_abs_logprob_diff": float((lp_std - lp_pg).abs().max()),
            "max_abs_grad_diff": max(float((g_std[n] - g_pg[n]).abs().max()) for n in g_std)}


def cache_mib(steps) -> float:
    """MiB of the key and value buffers of a prefill's decoding state (room for every completion token)."""
    return sum(layer.key_buffer.nbytes + layer.value_buffer.nbytes for layer in steps.cache.layers) / 2**20


def rollout_cell(vlm: VLMModel, prompt: dict[str, torch.Tensor], group: int) -> dict[str, float]:
    """Shared-prefill ``generate_group`` vs ``generate_group_naive``: end-to-end and prefill-only time, KV-cache
    size."""
    cfg = VLMGenerationConfig(max_new_tokens=COMPLETION, temperature=1.0)
    eos, vlm.eos_token_ids = vlm.eos_token_ids, []
    try:
        generate_group(vlm, prompt, group, cfg, torch.Generator().manual_seed(0))  # warm-up
        shared, naive = alternating_medians(
            lambda: generate_group(vlm, prompt, group, cfg, torch.Generator().manual_seed(0)),
            lambda: generate_group_naive(vlm, prompt, group, cfg, torch.Generator().manual_seed(0)))
        with torch.no_grad():
            prefill_shared, prefill_naive = alternating_medians(
                lambda: prefill(vlm, [prompt], group, True, COMPLETION),
                lambda: prefill(vlm, [prompt], group, False, COMPLETION))
            kv_shared = cache_mib(prefill(vlm, [prompt], group, True, COMPLETION)[1])
            kv_naive = cache_mib(prefill(vlm, [prompt], group, False, COMPLETION)[1])
    finally:
        vlm.eos_token_ids = eos
    return {"shared_s": shared, "naive_s": naive, "rollout_speedup": naive / shared,
            "prefill_shared_s": prefill_shared, "prefill_naive_s": prefill_naive,
            "prefill_only_speedup": prefill_naive / prefill_shared,
            "kv_shared_mib": kv_shared, "kv_naive_mib": kv_naive, "kv_mem_ratio": kv_naive / kv_shared}


@BENCHES.register("prefix-grouper")
def bench_prefix_grouper() -> tuple[list[dict], dict[str, float]]:
    """Rows per (prefix, group) training cell plus one rollout row; figures as in ARCHITECTURE.md."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="mmgrpo-bench-vlm-") as tmp:
        path = build_tiny_vlm("qwen2_vl", Path(tmp) / "model", hidden_size=HIDDEN, num_layers=LAYERS)
        vlm = VLMModel(VLMModelConfig(path=str(path)))
        rows, figures = [], {}
        for length in PREFIXES:
            prompt = bench_prompt(vlm, length)
            for group in GROUPS:
                cell = train_cell(vlm, prompt, group)
                rows.append({"case": "train", "prefix": length, "group": group, "completion": COMPLETION,
                             "threads": threads, "load1": os.getloadavg()[0], **cell})
                if (length, group) == (1024, 8):
                    figures["train_speedup_g8_p1024"] = cell["train_speedup"]
        roll = rollout_cell(vlm, bench_prompt(vlm, 1024), 8)
        rows.append({"case": "rollout", "prefix": 1024, "group": 8, "completion": COMPLETION, "threads": threads,
                     "load1": os.getloadavg()[0], **roll})
    figures["prefill_speedup_g8_p1024"] = roll["rollout_speedup"]
    figures["prefill_only_speedup_g8_p1024"] = roll["prefill_only_speedup"]
    figures["rollout_kv_mem_ratio_g8_p1024"] = roll["kv_mem_ratio"]
    figures["max_abs_logprob_diff"] = max(r["max_abs_logprob_diff"] for r in rows if r["case"] == "train")
    figures["max_abs_grad_diff"] = max(r["max_abs_grad_diff"] for r in rows if r["case"] == "train")
    return rows, figures
