"""``mmgrpo bench learning``: the algorithms side by side on the same work, held-out accuracy against wall-clock.

Every preset of ``configs/learning/`` (``PRESETS``) is its pipeline's demo preset (``mmgrpo.demo.DEMOS``) with only
the algorithm changed, so each starts from the same shipped tiny model and trains for the same wall-clock budget.
The held-out set is scored at fixed marks of training time (evaluation time is not counted), so each row is a
curve of accuracy against minutes; the reported ``after`` is the final model (no selection). The honesty
measures of the demo (diversity and size/position distance for flow, answer diversity and CircularEval accuracy
for vlm) are reported before and after as well; CircularEval only then, as it costs a few plain passes.

Figures (the ARCHITECTURE.md contract): ``<preset>/before``, ``<preset>/after``, ``<preset>/minutes`` (training
minutes), and for MixGRPO and Flash ``<preset>/time_to_flow_grpo_final`` (the training time at which they first
reached Flow-GRPO's final accuracy, divided by Flow-GRPO's budget; left out when they never did, and their row
says ``reached_flow_grpo_final: false``).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from typing import Any

import torch

from mmgrpo.bench import BENCHES, BenchUsageError

BUDGET_MINUTES = {"flow": 8.0, "vlm": 6.0}
"""Training wall-clock per preset, by pipeline."""
MARKS = 8
"""Held-out evaluations during training, evenly spaced over the budget (plus one before training)."""
PRESET_DIR = "configs/learning"
"""Where the presets are, relative to the repository root; ``<name>.yaml`` each."""
PRESETS = ("flow_grpo", "dance_grpo", "mixgrpo", "mixgrpo_flash", "branch", "tempflow",
           "vlm_grpo", "vlm_maxrl", "vlm_tgrpo")
"""Every preset of ``PRESET_DIR``, in the order the bench runs them (the flow ones first)."""


def run_preset(name: str, output_dir: str) -> dict[str, Any]:
    """Train preset ``name`` for its pipeline's budget of training time; return its row (curve included).
    KeyboardInterrupt when a signal (Ctrl-C) stopped the training first."""
    from mmgrpo.config import load_config
    from mmgrpo.demo import DEMOS, HONESTY_MEASURES, REPO, evaluate
    from mmgrpo.trainer import Trainer

    # The preset's lr schedule, with a horizon no run reaches: a decaying one is re-planned at each mark to end
    # where the budget is projected to (the presets' steps differ in cost), as the demo does.
    # num_threads=0: the thread count ``mmgrpo bench --threads`` set (and recorded), not the preset's.
    # No checkpoints: the run folder is temporary, and saving would count as training time.
    cfg = load_config(REPO / PRESET_DIR / f"{name}.yaml",
                      [f"output_dir={output_dir}", "resume=null", "train.eval_every=0", "train.save_every=0",
                       "train.max_steps=100000", "logging.progress=false", "num_threads=0"])
    which = cfg.pipeline
    spec = DEMOS[which]
    budget_minutes = BUDGET_MINUTES[which]
    trainer = Trainer(cfg)
    flow = which == "flow"
    items = trainer.eval_items
    before, _ = evaluate(trainer.policy, trainer.rewards, items, spec, flow, circular=True)
    curve = [(0.0, before[spec.metric])]
    marks = [budget_minutes * 60 * (k + 1) / MARKS for k in range(MARKS)]
    clock = {"train_s": 0.0, "since": time.perf_counter(), "steps": 0}
    last: dict[str, float] = {}

    def should_stop(step: int, row: dict[str, Any]) -> bool:
        clock["train_s"] += time.perf_counter() - clock["since"]
        clock["steps"] = step
        done = clock["train_s"] >= marks[-1]
        # one evaluation per step at most: a step that spans several marks (a loaded machine) records one point,
        # and the last step always gets the final one. CircularEval costs a few plain passes: only at the end.
        if done or clock["train_s"] >= marks[len(curve) - 1]:
            metrics, _ = evaluate(trainer.policy, trainer.rewards, items, spec, flow, circular=done)
            curve.append((clock["train_s"] / 60, metrics[spec.metric]))
            last.update(metrics)
            if not done:
                trainer.fit_schedule_to_budget(clock["train_s"], marks[-1])
        clock["since"] = time.perf_counter()
        return done

    trainer.train(should_stop=should_stop)
    if trainer.interrupted:  # a run cut short has no final model: stop the bench rather than report it
        raise KeyboardInterrupt(f"{name} stopped by {trainer.interrupted} at step {trainer.step}")
    row = {"preset": name, "pipeline": which, "metric": spec.metric, "before": before[spec.metric],
           "after": last[spec.metric], "train_minutes": clock["train_s"] / 60, "steps": clock["steps"],
           "curve": curve}
    for key in HONESTY_MEASURES:
        if key in before:
            row[f"{key}_before"], row[f"{key}_after"] = before[key], last[key]
    return row


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float:
    """Minutes of training at which ``curve`` (minutes, accuracy) first reaches ``target``; NaN if never."""
    return next((minutes for minutes, acc in curve if acc >= target), math.nan)


def learning(presets: tuple[str, ...] = PRESETS) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every preset in turn; see the module notes for the figures. ValueError for a name not in ``PRESETS``,
    before anything runs."""
    from mmgrpo.demo import in_repo

    unknown = [name for name in presets if name not in PRESETS]
    if unknown:
        raise BenchUsageError(f"unknown learning preset '{unknown[0]}' (available: {', '.join(PRESETS)})")

    rows = []
    for name in presets:
        with tempfile.TemporaryDirectory(prefix=f"mmgrpo-learning-{name}-") as tmp, in_repo():
            torch.manual_seed(0)
            rows.append(run_preset(name, tmp))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    by_name = {r["preset"]: r for r in rows}
    figures: dict[str, float] = {}
    for r in rows:
        figures.update({f"{r['preset']}/before": r["before"], f"{r['preset']}/after": r["after"],
                        f"{r['preset']}/minutes": r["train_minutes"]})
    if "flow_grpo" in by_name:
        reference = by_name["flow_grpo"]
        for name in ("mixgrpo", "mixgrpo_flash"):
            if name in by_name:
                reached = time_to_reach(by_name[name]["curve"], reference["after"])
                by_name[name]["reached_flow_grpo_final"] = math.isfinite(reached)
                if math.isfinite(reached):
                    figures[f"{name}/time_to_flow_grpo_final"] = reached / reference["train_minutes"]
    return rows, figures


BENCHES.register("learning", learning)
