"""``mmgrpo bench flow-modes``: seconds per iteration, NFE and memory of every tiny flow preset.

Every preset runs on the same model (the shipped ShapesT2I SD3), prompts, resolution, step count and group
(``configs/flow/tiny_base.yaml``).

Time: all presets live in one process and share one loaded model, and their iterations are interleaved
round-robin (one warm-up round, then ``ROUNDS`` timed rounds), so that a shared machine's load hits every
preset alike; each preset's time is the median of its rounds. An iteration is what ``Trainer.train`` runs per
optimiser step: rollout, rewards, advantages and the update; no evaluation or
checkpointing.

``loop_overhead`` (the spec's figure): iteration time over the pure transformer forward and backward time of the
same NFEs. Every transformer call of the iteration is recorded by its shape (rows, under grad or not); each
shape is timed as a raw call on its own, on the run's latents (a no-grad forward, or a forward and its
backward), once per round, and the pure time is the sum over the iteration's calls of their shape's median raw
time. The calls keep their batch sizes, so this covers every preset, trees and fused CFG included. Figures:
``loop_overhead`` of tiny_flowgrpo and ``loop_overhead_max`` over the presets.
``inloop_overhead`` (secondary): iteration time over the time spent inside the transformer during that
iteration, timed around every forward call and every backward pass (the same calls, timed where they run, under
the loop's cache and memory state).

Memory: each preset also runs alone in a fresh process for ``MEMORY_ITERATIONS`` iterations: the process's
peak resident set size (``ru_maxrss``, model loading included), and the peak during training alone (Linux
``VmHWM``, reset after loading through ``/proc/self/clear_refs``) with its growth over the resident size after
loading.

``compute_units`` is a compute-bound proxy of an iteration's cost, for models whose cost grows with the rows
of a call (real models on GPUs; the tiny CPU model's cost is mostly per call): forwards without grad + 3 x
forwards with grad (a backward costs about two forwards).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mmgrpo.bench import BENCHES, median_seconds

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs" / "flow"
PRESETS = ("tiny_flowgrpo", "tiny_dancegrpo", "tiny_mixgrpo", "tiny_mixgrpo_flash", "tiny_branchgrpo",
           "tiny_tempflow")
ROUNDS = 5
"""Timed iterations per preset (after one warm-up iteration)."""
MEMORY_ITERATIONS = 2
FIGURES = {"mixgrpo_vs_flowgrpo": ("tiny_mixgrpo", "tiny_flowgrpo"),
           "mixgrpo_flash_vs_flowgrpo": ("tiny_mixgrpo_flash", "tiny_flowgrpo"),
           "branchgrpo_vs_dancegrpo": ("tiny_branchgrpo", "tiny_dancegrpo")}
Shape = tuple[int, bool]
"""A transformer call: (latent rows, under grad); a call under grad is followed by one backward."""


class ModelClock:
    """Seconds spent inside the transformer's forward calls and the trainers' backward passes, and the shape of
    every forward call (``calls``: shape -> count)."""

    def __init__(self, module: torch.nn.Module):
        self.seconds = 0.0
        self.calls: Counter[Shape] = Counter()
        self._start = 0.0
        module.register_forward_pre_hook(self._forward, with_kwargs=True)
        module.register_forward_hook(lambda *_: self._end())

    def _forward(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.calls[(hidden.shape[0], torch.is_grad_enabled())] += 1
        self._begin()

    def _begin(self) -> None:
        self._start = time.perf_counter()

    def _end(self) -> None:
        self.seconds += time.perf_counter() - self._start

    def time_backward(self, accelerator: Any) -> None:
        """Time ``accelerator.backward`` too (the backward of the transformer dominates it)."""
        backward = accelerator.backward

        def timed(loss: torch.Tensor, **kwargs: Any) -> None:
            self._begin()
            backward(loss, **kwargs)
            self._end()

        accelerator.backward = timed


def build_trainers(output_dir: str, presets: tuple[str, ...] = PRESETS) -> dict[str, Any]:
    """A trainer per preset, all sharing one loaded model (the presets differ only in rollout and loss
    settings). Run from the repository root: the presets' prompt files are relative to it."""
    from mmgrpo.config import load_config
    from mmgrpo.trainer import Trainer

    from .policy import FlowPolicy

    trainers, adapter = {}, None
    for preset in presets:
        cfg = load_config(CONFIG_DIR / f"{preset}.yaml", [f"output_dir={output_dir}/{preset}",
                                                          "train.max_steps=100000", "logging.progress=false"])
        policy = FlowPolicy(cfg, adapter=adapter)
        adapter = policy.adapter
        trainers[preset] = Trainer(cfg, policy=policy)
    return trainers


def iteration(trainer: Any, clock: ModelClock | None = None) -> dict[str, Any]:
    """One timed GRPO iteration of ``trainer``, the way ``Trainer.train`` runs it."""
    model_start = clock.seconds if clock else 0.0
    if clock:
        clock.calls.clear()
    start = time.perf_counter()
    items_idx, group_ids = trainer.sampler.next()
    items = [trainer.train_items[i] for i in items_idx]
    with torch.no_grad(), trainer.accelerator.autocast():
        rollout = trainer.policy.rollout(items, group_ids, trainer.cfg.train.group_size)
    rolled = time.perf_counter()
    main, _, _ = trainer.rewards(rollout.reward_batch)
    unit_adv, _ = trainer.compute_advantages(rollout, main)
    metrics: list[dict[str, float]] = []
    trainer.train_on_rollout(rollout, unit_adv, metrics.append)
    trainer.iteration += 1
    end = time.perf_counter()
    return {"seconds": end - start, "rollout_s": rolled - start, "train_s": end - rolled,
            "model_s": (clock.seconds if clock else 0.0) - model_start, "counters": rollout.counters,
            "calls": dict(clock.calls) if clock else {},
            "onpolicy_max_dev": metrics[0]["ratio/onpolicy_max_dev"]}


def raw_call(policy: Any, shape: Shape) -> Callable[[], None]:
    """One raw transformer call of ``shape`` on the run's latents and a prompt embedding (guidance 1: one
    forward): a no-grad forward, or a forward and its backward."""
    rows, grad = shape
    s, adapter = policy.cfg.sampling, policy.adapter
    x = adapter.initial_latents(rows, s.height, s.width, s.num_frames, torch.Generator().manual_seed(0))
    embeds = adapter.encode(["a red circle"] * rows, "", 1.0)
    sigma = torch.full((rows,), 0.5)

    def call() -> None:
        with torch.set_grad_enabled(grad):
            v = adapter.velocity(x, sigma, embeds, 1.0, transformer=policy.model)
        if grad:
            v.square().mean().backward()
            policy.model.zero_grad(set_to_none=True)

    return call


def raw_call_seconds(policy: Any, shapes: set[Shape]) -> dict[Shape, float]:
    """Median seconds of one raw call of each shape (3 timed after a warm-up)."""
    return {shape: median_seconds(raw_call(policy, shape), repeats=3) for shape in sorted(shapes)}


def median_raw(rounds: list[dict[Shape, float]]) -> dict[Shape, float]:
    """Per shape, the median of its raw call seconds over the rounds that timed it."""
    shapes = {shape for timed in rounds for shape in timed}
    return {shape: statistics.median(t[shape] for t in rounds if shape in t) for shape in shapes}


def pure_seconds(calls: Mapping[Shape, int], raw: Mapping[Shape, float]) -> float:
    """Seconds the transformer alone takes for ``calls`` (shape -> count), from the raw seconds per shape."""
    return sum(count * raw[shape] for shape, count in calls.items())


def overheads(runs: list[dict[str, Any]], raw: Mapping[Shape, float]) -> dict[str, float]:
    """Median over a preset's timed iterations (``seconds``, ``model_s``, ``calls``) of ``loop_overhead``:
    iteration seconds / :func:`pure_seconds` of its calls, and ``inloop_overhead``: seconds / ``model_s``."""
    return {"loop_overhead": statistics.median(r["seconds"] / pure_seconds(r["calls"], raw) for r in runs),
            "inloop_overhead": statistics.median(r["seconds"] / r["model_s"] for r in runs)}


def summarize(preset: str, cfg: Any, runs: list[dict[str, Any]], raw: Mapping[Shape, float]) -> dict[str, Any]:
    """The table row of a preset from its timed iterations and the raw seconds per call shape."""
    counters = runs[-1]["counters"]
    row = {"preset": preset, "mode": cfg.mode.name,
           "s_per_iter": statistics.median(r["seconds"] for r in runs),
           "rollout_s": statistics.median(r["rollout_s"] for r in runs),
           "train_s": statistics.median(r["train_s"] for r in runs),
           "nfe_rollout": counters["nfe/rollout"], "nfe_train_grad": counters["nfe/train_grad"],
           "nfe_train_nograd": counters["nfe/train"] - counters["nfe/train_grad"],
           "compute_units": counters["nfe/rollout"] + counters["nfe/train"] + 2 * counters["nfe/train_grad"],
           "onpolicy_max_dev": max(r["onpolicy_max_dev"] for r in runs)}
    row.update(overheads(runs, raw))
    return row


def timing(rounds: int = ROUNDS) -> dict[str, dict[str, Any]]:
    """Rows of every preset from interleaved iterations in this process (see the module notes)."""
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="mmgrpo-bench-flow-") as tmp:
        os.chdir(ROOT)
        try:
            trainers = build_trainers(tmp)
        finally:
            os.chdir(cwd)
        first = trainers[PRESETS[0]].policy
        clock = ModelClock(first.adapter.transformer)
        for trainer in trainers.values():
            clock.time_backward(trainer.accelerator)
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PRESETS}
        raw, shapes = [], set()
        for round_index in range(rounds + 1):
            for preset, trainer in trainers.items():
                result = iteration(trainer, clock)
                if round_index:
                    runs[preset].append(result)
                    shapes |= set(result["calls"])
            if round_index:
                raw.append(raw_call_seconds(first, shapes))
        raw_median = median_raw(raw)
    return {p: summarize(p, trainers[p].cfg, runs[p], raw_median) for p in PRESETS}


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mib(field: str) -> float | None:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in MiB; None where there is none."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith(f"{field}:")), None)
    return int(line.split()[1]) / 1024 if line else None


def _reset_peak_rss() -> bool:
    """Reset Linux's peak RSS (VmHWM) to the current RSS; False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory(preset: str) -> dict[str, float]:
    """Peak RSS of ``preset`` run alone in a fresh process, and its growth over the size after loading."""
    with tempfile.TemporaryDirectory(prefix=f"mmgrpo-bench-{preset}-") as tmp:
        cmd = [sys.executable, "-m", "mmgrpo.pipelines.flow.bench", preset, "--threads",
               str(torch.get_num_threads()), "--out", f"{tmp}/memory.json"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"memory run of {preset} failed:\n{done.stderr[-3000:]}")
        return json.loads(Path(f"{tmp}/memory.json").read_text())


def flow_modes() -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every tiny preset; each row gets its time ratio to tiny_flowgrpo. Figures: see the module notes."""
    start = time.perf_counter()
    rows = timing()
    for preset, row in rows.items():
        row.update(memory(preset))
        row["vs_flowgrpo"] = row["s_per_iter"] / rows["tiny_flowgrpo"]["s_per_iter"]
    figures = {name: rows[a]["s_per_iter"] / rows[b]["s_per_iter"] for name, (a, b) in FIGURES.items()}
    dance, branch = rows["tiny_dancegrpo"], rows["tiny_branchgrpo"]
    figures["branchgrpo_vs_dancegrpo_compute_units"] = branch["compute_units"] / dance["compute_units"]
    figures["loop_overhead"] = rows["tiny_flowgrpo"]["loop_overhead"]
    figures["loop_overhead_max"] = max(row["loop_overhead"] for row in rows.values())
    figures["inloop_overhead"] = rows["tiny_flowgrpo"]["inloop_overhead"]
    figures["bench_minutes"] = (time.perf_counter() - start) / 60
    return list(rows.values()), figures


BENCHES.register("flow-modes", flow_modes)


def main(argv: list[str] | None = None) -> None:
    """Worker of :func:`memory`: run one preset alone and write its memory figures as JSON."""
    parser = argparse.ArgumentParser(description="peak memory of one tiny flow preset (a flow-modes worker)")
    parser.add_argument("preset", choices=PRESETS)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainers(tmp, (args.preset,))[args.preset]
        loaded = _status_mib("VmRSS")
        reset = _reset_peak_rss()  # loading peaks above training on the tiny model: measure training alone
        for _ in range(MEMORY_ITERATIONS):
            iteration(trainer)
        training_peak = _status_mib("VmHWM") if reset else None
    result = {"peak_rss_mib": peak_rss_mib(), "train_peak_rss_mib": training_peak,
              "train_rss_growth_mib": None if training_peak is None else training_peak - loaded}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
