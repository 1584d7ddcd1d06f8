"""``mmgrpo bench learning``: the algorithms side by side on the same work, held-out accuracy against wall-clock.

Every variant starts from the same shipped tiny model and the demo preset of its pipeline (``mmgrpo.demo.DEMOS``),
changes only the algorithm (``VARIANTS``), and trains for the same wall-clock budget. The held-out set is scored
at fixed marks of training time (evaluation time is not counted), so each row is a curve of accuracy against
minutes; the reported ``after`` is the final model (no selection). The honesty measures of the demo (diversity
and size/position distance for flow, answer diversity and CircularEval accuracy for vlm) are reported before and
after as well; CircularEval only then, as it costs a few plain passes.

Figures (the ARCHITECTURE.md contract): ``<variant>/before``, ``<variant>/after``, ``<variant>/minutes`` (training
minutes), and for MixGRPO and Flash ``<variant>/time_to_flow_grpo_final`` (the training time at which they first
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

from mmgrpo.bench import BENCHES

BUDGET_MINUTES = {"flow": 8.0, "vlm": 6.0}
"""Training wall-clock per variant."""
MARKS = 8
"""Held-out evaluations during training, evenly spaced over the budget (plus one before training)."""
TEMPORAL_BONUS = {"name": "temporal_bonus", "weight": 1.0, "args": {"alpha": 0.3, "mu": 0.8}}

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "flow_grpo": ("flow", ["mode.name=flow_grpo"]),
    "dance_grpo": ("flow", ["mode.name=dance_grpo", "mode.train_fraction=0.6"]),
    "mixgrpo": ("flow", []),
    "mixgrpo_flash": ("flow", ["mode.name=mixgrpo_flash"]),
    "branch": ("flow", ["mode.name=branch", "mode.split_points=[0,1,2]", "mode.branch_factor=2"]),
    "tempflow": ("flow", ["mode.name=tempflow", "mode.tempflow_candidates=[0,1,2,3]"]),
    "vlm_grpo": ("vlm", ["tgrpo.enabled=false", "grpo.advantage=group_zscore", "reward_aggregation=weighted_sum"]),
    "vlm_maxrl": ("vlm", ["tgrpo.enabled=false"]),
    "vlm_tgrpo": ("vlm", ["tgrpo.enabled=true"]),
}
"""variant -> (demo, overrides of the demo preset). Every flow variant keeps the demo's rewards, group, lr and
shared initial noise; only the rollout mode changes, each with its published defaults (Flow-GRPO trains the first
90% of the steps, DanceGRPO a random 60% per sample). vlm_maxrl is the VLM demo preset (MaxRL advantages per
reward); vlm_grpo swaps them for GRPO's z-score of the weighted sum; vlm_tgrpo adds T-GRPO's temporal bonus reward
to the preset."""


def run_variant(name: str, output_dir: str, budget_minutes: float) -> dict[str, Any]:
    """Train one variant for ``budget_minutes`` of training time; return its row (curve included)."""
    from mmgrpo.config import load_config
    from mmgrpo.demo import DEMOS, HONESTY_MEASURES, REPO, evaluate, fit_schedule_to_budget
    from mmgrpo.trainer import Trainer

    which, overrides = VARIANTS[name]
    spec = DEMOS[which]
    # The preset's lr schedule, with a horizon no run reaches: a decaying one is re-planned at each mark to end
    # where the budget is projected to (the variants' steps differ in cost), as the demo does.
    # num_threads=0: the thread count ``mmgrpo bench --threads`` set (and recorded), not the preset's.
    # No checkpoints: the run folder is temporary, and saving would count as training time.
    base = [f"output_dir={output_dir}", "resume=null", "train.eval_every=0", "train.save_every=0",
            "train.max_steps=100000", "logging.progress=false",
            *spec.overrides, *overrides, "num_threads=0"]
    cfg = load_config(REPO / spec.preset, base)
    if which == "vlm" and cfg.tgrpo.enabled:
        rewards = [{"name": r.name, "weight": r.weight, "args": dict(r.args)} for r in cfg.rewards]
        cfg = load_config(REPO / spec.preset, [*base, f"rewards={json.dumps([*rewards, TEMPORAL_BONUS])}"])
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
                fit_schedule_to_budget(trainer, step, clock["train_s"], marks[-1])
        clock["since"] = time.perf_counter()
        return done

    trainer.train(should_stop=should_stop)
    row = {"variant": name, "pipeline": which, "metric": spec.metric, "before": before[spec.metric],
           "after": last[spec.metric], "train_minutes": clock["train_s"] / 60, "steps": clock["steps"],
           "curve": curve}
    for key in HONESTY_MEASURES:
        if key in before:
            row[f"{key}_before"], row[f"{key}_after"] = before[key], last[key]
    return row


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float:
    """Minutes of training at which ``curve`` (minutes, accuracy) first reaches ``target``; NaN if never."""
    return next((minutes for minutes, acc in curve if acc >= target), math.nan)


def learning(variants: tuple[str, ...] = tuple(VARIANTS)) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every variant in turn; see the module notes for the figures."""
    from mmgrpo.demo import in_repo

    rows = []
    for name in variants:
        with tempfile.TemporaryDirectory(prefix=f"mmgrpo-learning-{name}-") as tmp, in_repo():
            torch.manual_seed(0)
            rows.append(run_variant(name, tmp, BUDGET_MINUTES[VARIANTS[name][0]]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    by_name = {r["variant"]: r for r in rows}
    figures: dict[str, float] = {}
    for r in rows:
        figures.update({f"{r['variant']}/before": r["before"], f"{r['variant']}/after": r["after"],
                        f"{r['variant']}/minutes": r["train_minutes"]})
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
