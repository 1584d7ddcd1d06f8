"""``mmgrpo demo [flow|vlm]``: the tiny shipped models, on CPU, with no downloads: evaluate on held-out prompts,
train with GRPO, evaluate again, and write ``report.md`` and ``demo.json``. On a CPU with the cores for it, a demo
whose ``DemoSpec.num_processes`` is above 1 (vlm) relaunches itself in that many processes (:func:`launch`): they
train together (DDP over gloo) and split every evaluation.

Honesty rules:

- The held-out prompts are scored twice only, before and after training; nothing is selected on them. During
  training, a validation set (training prompts for flow, unseen questions of the training seeds for vlm; never
  held-out ones) is scored every ``eval_every`` steps, and the reported model is chosen by
  ``DemoSpec.selection``: the validation-best snapshot (flow), or the last one (vlm, whose lr decays to 0).
- The report also gives what the training reward does not see. Flow: the held-out metric is the full ShapesT2I
  evaluator (colour, shape, count, position, size, background), plus the diversity of samples for one prompt and
  the distance of object sizes and positions from the data. VLM: the answer diversity of the multiple-choice
  questions (``answer_diversity``: answering one letter everywhere games accuracy on questions the base gets
  below chance) and CircularEval accuracy (``circular_accuracy``: a multiple-choice question counts only if it is
  answered right under every rotation of its options, which no letter prior survives), and accuracy per kind of
  question (``accuracy/{task}/{kind}``).
- A snapshot counts only if its validation guard measure (``DemoSpec.guard``: sample diversity for flow,
  answer diversity for vlm, pooled and per kind of question, ``answer_diversity/{task}/{kind}``) is within 20% of
  the base model's. Flow stops training at the first check that
  fails; the VLM keeps training and passes over failing snapshots, because its answer prior drifts back and forth.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
GUARD_FLOOR = 0.8
"""A gain counts only while the guard measure (``DemoSpec.guard``) stays at or above this fraction of the base
model's."""
HONESTY_MEASURES = ("diversity", "size_position_distance", "answer_diversity", "circular_accuracy")
"""Measures the training reward does not see, reported before and after (those the demo computes)."""
SAMPLE_QUESTIONS = 8
"""Held-out VLM questions shown in samples.png."""
DEMO_LIMIT_MINUTES = 15.0
"""Wall-clock limit of a whole demo with its default budget: training stops early enough that the evaluations
after it still end within this (:func:`training_budget_s`)."""
FINISH_SECONDS = 30.0
"""Reserved for what the demo's clock does not see otherwise: loading the reported snapshot and writing the
report after the last evaluation, and starting Python and importing torch before the clock starts."""
LAUNCHED_AT = "MMGRPO_DEMO_LAUNCHED_AT"
"""Environment variable with the wall-clock time (``time.time()``) :func:`launch` started the demo's processes at,
so that their clock counts their start-up."""


@dataclass
class DemoSpec:
    """One demo: which preset, which held-out metric, how much to evaluate and how long to train."""

    preset: str
    """Preset path, relative to the repository root."""
    asset: str
    """The shipped tiny model folder the preset trains, relative to the repository root."""
    task: str
    """Name written to demo.json."""
    metric: str
    """The held-out metric: a logged reward name (``reward/sub`` for a sub-score)."""
    guard: str
    """The honesty measure a snapshot must keep at ``GUARD_FLOOR`` of the base model's value or above."""
    stop_on_guard: bool
    """Stop training at the first validation check that fails the guard (True), or keep training and only pass
    over the failing snapshots (False: for a measure that recovers, as the VLM's answer prior drifts back)."""
    samples_per_prompt: int
    """Held-out samples per prompt (seeds 0..k-1); diversity needs at least 2."""
    eval_every: int
    """Optimiser steps between validation evaluations during training."""
    num_val: int
    """Prompts in the validation set (scored with ``samples_per_prompt`` samples each)."""
    train_minutes: float
    """Wall-clock budget for the training phase (validation checks included), cut short when the whole demo would
    otherwise overrun ``DEMO_LIMIT_MINUTES`` on a slower machine."""
    selection: Literal["best", "last"] = "best"
    """Which eligible snapshot is reported: ``best`` on validation, or ``last`` (for a schedule that decays the lr
    to 0, where the policy settles at the end and the late snapshots differ by less than validation can resolve:
    the maximum of their noisy scores picks noise)."""
    val_file: str | None = None
    """Validation prompts unseen in training and disjoint from the held-out set (relative to the repository root,
    read by the policy's ``read_items``); None draws ``num_val`` training prompts (docs/demo.md: why the VLM
    needs unseen ones)."""
    overrides: list[str] = field(default_factory=list)
    num_processes: int = 1
    """Processes it trains with on a CPU that has that many cores (DDP over gloo, the prompts of a step split
    between them; :func:`demo_processes`). Validation and held-out evaluations are split between them too."""


DEMOS = {
    "flow": DemoSpec(preset="configs/flow/demo_shapes.yaml", asset="assets/tiny-sd3-shapes", task="ShapesT2I", metric="shapes_eval/score",
                     guard="diversity", stop_on_guard=True, samples_per_prompt=4, eval_every=20, num_val=24, train_minutes=11.0),
    "vlm": DemoSpec(preset="configs/vlm/demo_shapes.yaml", asset="assets/tiny-qwen2vl-shapes", task="ShapesQA+MotionQA", metric="accuracy",
                    guard="answer_diversity", stop_on_guard=False, samples_per_prompt=1, eval_every=100, num_val=192, train_minutes=14.0,
                    selection="last", val_file="assets/data/shapes_qa/val.jsonl", num_processes=2),
}


@contextlib.contextmanager
def in_repo() -> Iterator[None]:
    """Run the body with the repository root as working directory: the presets name their assets and data by
    paths relative to it, and the trainer reads media lazily, so the whole run stays inside."""
    previous = os.getcwd()
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(previous)


def missing_parts(which: str) -> list[str]:
    """The preset and asset files a demo needs that this checkout does not have."""
    spec = DEMOS[which]
    return [p for p in (spec.preset, spec.asset) if not (REPO / p).exists()]


def evaluate(policy: Any, zoo: Any, items: list[dict], spec: DemoSpec, flow: bool,
             circular: bool = False) -> tuple[dict[str, float], Any]:
    """Held-out metrics of ``policy``: the mean of every logged reward over ``samples_per_prompt`` samples per
    item, and the honesty measures: for flow diversity and the size/position distance, for vlm the answer
    diversity of the multiple-choice items and, with ``circular``, their :func:`circular_accuracy`. For vlm items
    whose record names a ``kind`` (ShapesQA, MotionQA), also ``{metric}/{task}/{kind}``: the metric per kind.
    Returns (metrics, the sample batch)."""
    expanded = [{**it, "seed": s} for it in items for s in range(spec.samples_per_prompt)]
    batch, logged = generate_and_score(policy, zoo, expanded, zoo.evaluation_names)
    metrics = {name: scores.nanmean().item() for name, scores in logged.items()}
    if flow:
        from mmgrpo.registry import TASKS
        from mmgrpo.rewards.shapes_eval import diversity, size_position_distance

        k = spec.samples_per_prompt
        images = batch.images
        metrics["diversity"] = sum(diversity(images[i:i + k]) for i in range(0, len(images), k)) / len(items)
        metrics["size_position_distance"] = size_position_distance(images, batch.meta,
                                                                   TASKS.get("shapes_t2i").data_stats())
    else:
        from mmgrpo.rewards.text_rules import answer_diversity, canonical_problem_type, ground_truth

        choice = [i for i, m in enumerate(batch.meta)
                  if canonical_problem_type(m.get("problem_type", "")) == "multiple choice"]
        by_kind_choice: dict[str, list[int]] = {"answer_diversity": choice}
        for i in choice:
            if "kind" in batch.meta[i]:
                kind = f"answer_diversity/{batch.meta[i].get('task', 'task')}/{batch.meta[i]['kind']}"
                by_kind_choice.setdefault(kind, []).append(i)
        for name, rows in by_kind_choice.items():
            metrics[name] = answer_diversity([batch.completions[i] for i in rows],
                                             [ground_truth(batch.meta[i], i, "demo") for i in rows])
        by_kind: dict[str, list[float]] = {}
        for m, value in zip(batch.meta, logged[spec.metric].tolist()):
            if "kind" in m:
                by_kind.setdefault(f"{spec.metric}/{m.get('task', 'task')}/{m['kind']}", []).append(value)
        metrics.update({name: sum(values) / len(values) for name, values in by_kind.items()})
        if circular:
            metrics["circular_accuracy"] = circular_accuracy(policy, zoo, items, batch, logged["accuracy"])
    return metrics, batch


def generate_and_score(policy: Any, zoo: Any, items: list[dict], names: list[str]) -> tuple[Any, dict]:
    """``policy.generate(items)`` scored by the ``names`` rewards of ``zoo``: (batch, {name: (B,) scores}). With
    several processes, each generates and scores a contiguous part of ``items`` and every process gets the
    whole, in order; all must call this."""
    from mmgrpo.rewards import RewardBatch

    state = PartialState()
    n, rank = state.num_processes, state.process_index
    with torch.no_grad():
        batch = policy.generate(items[len(items) * rank // n:len(items) * (rank + 1) // n])
    _, logged, _ = zoo(batch, only=names)
    if n == 1:
        return batch, logged
    parts = gather_object([(batch, logged)])
    return (RewardBatch.concat([b for b, _ in parts]),
            {name: torch.cat([scores[name] for _, scores in parts]) for name in parts[0][1]})


def circular_accuracy(policy: Any, zoo: Any, items: list[dict], batch: Any, accuracy: torch.Tensor) -> float:
    """CircularEval (MMBench): the share of ``items`` answered right under every rotation of their options
    (:func:`~mmgrpo.pipelines.vlm.data.rotate_options`); a question without options counts as answered once. A
    policy that answers by letter position fails some rotation, so it cannot gain here. ``batch`` and
    ``accuracy`` (N,) are the completions of ``items`` already scored (one per item; skipped items are left out)."""
    from mmgrpo.pipelines.vlm.data import render_prompt, rotate_options
    from mmgrpo.rewards.text_rules import canonical_problem_type

    right = {m["source"]: a == 1.0 for m, a in zip(batch.meta, accuracy.tolist())}
    template = policy.cfg.data.prompt_template
    rotated = []
    for item in items:
        sample = item["sample"]
        if sample.source in right and canonical_problem_type(sample.problem_type or "") == "multiple choice":
            for shift in range(1, len(sample.options)):
                moved = rotate_options(sample, shift)
                rotated.append({"prompt": render_prompt(moved, template), "sample": moved})
    if rotated:
        rotated_batch, logged = generate_and_score(policy, zoo, rotated, ["accuracy"])
        for m, a in zip(rotated_batch.meta, logged["accuracy"].tolist()):
            right[m["source"]] &= a == 1.0
    return sum(right.values()) / max(len(right), 1)


def guard_kept(value: float, base: float) -> bool:
    """Whether a guard measure ``value`` is at least ``GUARD_FLOOR`` of the base model's ``base``; always when the
    base is not measurable (NaN), never when ``value`` is NaN and the base is."""
    return not math.isfinite(base) or value >= GUARD_FLOOR * base


def guard_failures(metrics: dict[str, float], base: dict[str, float], guard: str) -> list[str]:
    """The guard measures of ``metrics`` that fall below ``GUARD_FLOOR`` of the base model's (:func:`guard_kept`):
    ``guard`` itself and each of its per-kind parts (``guard/<task>/<kind>``) that the base has. Per kind, because
    a letter habit that differs by kind (A for every colour question, B for every shape one) keeps the pooled
    answer spread."""
    names = [guard] + sorted(k for k in base if k.startswith(guard + "/"))
    return [k for k in names if not guard_kept(metrics.get(k, math.nan), base[k])]


def validation_items(train_items: list[dict], n: int) -> list[dict]:
    """``n`` training items drawn at random with a fixed seed (the validation set; never held-out items). Not every
    k-th item: the task files interleave kinds, so a fixed stride can pick a single kind."""
    picked = sorted(random.Random(0).sample(range(len(train_items)), min(n, len(train_items))))
    return [train_items[i] for i in picked]


def val_source(spec: DemoSpec) -> str:
    """What the validation prompts are: "unseen prompts" or "training prompts"."""
    return "unseen prompts" if spec.val_file else "training prompts"


DEMO_MARKER = ".mmgrpo-demo"
"""Written first into a demo's output folder, so that a demo stopped before its report can still be cleared."""
DEMO_JSON_KEYS = {"task", "metric", "before", "after", "minutes"}
"""The keys of demo.json."""


def is_demo_output(out: Path) -> bool:
    """Whether folder ``out`` is an earlier demo's output: it has :data:`DEMO_MARKER`, or (a demo from before the
    marker) a demo.json with :data:`DEMO_JSON_KEYS`. A report.md alone, or another tool's demo.json, is not."""
    if (out / DEMO_MARKER).is_file():
        return True
    try:
        saved = json.loads((out / "demo.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and DEMO_JSON_KEYS <= saved.keys()


def check_clearable(out: Path) -> None:
    """Raise FileExistsError naming ``out`` unless it is missing, an empty folder, or an earlier demo's output
    (:func:`is_demo_output`): the folders :func:`clear_output_dir` may clear."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not is_demo_output(out))):
        raise FileExistsError(f"refusing to clear {out}: it is not an earlier demo's output (no {DEMO_MARKER} "
                              "and no demo.json of a demo); choose another --output-dir")


def clear_output_dir(out: Path) -> None:
    """Make ``out`` an empty demo folder: only :data:`DEMO_MARKER` in it (:func:`check_clearable` first: anything
    else is left untouched)."""
    check_clearable(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / DEMO_MARKER).write_text("written by mmgrpo demo, which clears this folder when it runs again\n")


def available_cpus() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def demo_processes(which: str, requested: int | None = None) -> int:
    """Processes a demo trains with: ``requested``, else its ``DemoSpec.num_processes`` as far as the CPU has the
    cores, and 1 on a machine with a GPU (the demo's launch is for CPU processes)."""
    if requested is not None:
        return requested
    if torch.cuda.is_available():
        return 1
    return max(1, min(DEMOS[which].num_processes, available_cpus()))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(num_processes: int, program: list[str]) -> int:
    """Run ``program`` (what follows ``python``: ``-m module args`` or ``script args``) in ``num_processes`` CPU
    processes with gloo DDP (``accelerate launch`` with ``configs/accelerate/cpu_2proc.yaml``) on a free local
    port. The processes get the launch time in :data:`LAUNCHED_AT`.

    The launcher runs in its own session, so Ctrl-C reaches only this process, which passes each SIGINT, SIGTERM or
    SIGHUP (as SIGTERM) on to the worker processes, once: they stop after the step as a one-process run does.
    Signalled itself, torch's launcher would print a traceback and kill workers still saving after 30 s.

    Returns the launcher's exit code, or 128 + the first signal passed on when the workers then ended cleanly."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / "cpu_2proc.yaml"), "--num_processes", str(num_processes),
               "--main_process_port", str(free_port()), *program]
    passed_on: list[int] = []
    with subprocess.Popen(command, env={**os.environ, LAUNCHED_AT: str(time.time())},
                          start_new_session=True) as launcher:

        def pass_on(signum: int, _frame: Any) -> None:
            passed_on.append(signum)
            try:
                workers = psutil.Process(launcher.pid).children()
            except psutil.NoSuchProcess:  # the launcher has just ended
                return
            for process in workers or [launcher]:  # none yet: the launcher is still starting them
                with contextlib.suppress(psutil.NoSuchProcess):  # this worker has just ended
                    process.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

        previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            code = launcher.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    return 128 + passed_on[0] if passed_on and code == 0 else code


def training_budget_s(train_minutes: float, elapsed_s: float, held_out_eval_s: float, val_eval_s: float,
                      limit_minutes: float = DEMO_LIMIT_MINUTES) -> float:
    """Seconds of training (validation checks included) the demo can afford, given ``elapsed_s`` spent before
    training: ``train_minutes`` at most, and no more than leaves room within ``limit_minutes`` for what follows
    training. That is one last validation check (``val_eval_s``, as long as the base model's took), the held-out
    evaluation after training (``held_out_eval_s``, as long as the one before training took) and
    ``FINISH_SECONDS``. Never negative: at 0 the demo trains one step."""
    room = 60.0 * limit_minutes - elapsed_s - held_out_eval_s - val_eval_s - FINISH_SECONDS
    return max(0.0, min(60.0 * train_minutes, room))


def run_demo(which: str, output_dir: str | None,
             minutes: float | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """Run one demo end to end. Returns what demo.json holds (None on all processes but the main one), and the
    signal (``"SIGINT"``, ``"SIGTERM"``) that stopped training early, if one did: the report is written either way.
    ``minutes`` is the training budget; without it the demo's own (``DemoSpec.train_minutes``), cut to end the
    whole demo within ``DEMO_LIMIT_MINUTES``. Under ``accelerate launch`` (:func:`launch`) every process runs
    this: they train together and split the evaluations; the main one reports."""
    from rich.console import Console

    from mmgrpo.config import load_config
    from mmgrpo.trainer import Trainer

    # the clock starts when the processes were launched, if they were (their start-up counts)
    start = time.perf_counter() - (time.time() - float(os.environ.get(LAUNCHED_AT, time.time())))
    spec = DEMOS[which]
    preset = REPO / spec.preset
    if not preset.is_file():
        raise FileNotFoundError(f"demo preset not found: {preset} (run from a clone of the mmgrpo repository)")
    out = Path(output_dir or f"runs/demo-{which}")
    check_clearable(out)  # on every process, before any waits for the main one
    # The trainer's bar counts train.max_steps, which the time budget cuts short; the demo shows its own bar over
    # the budget instead.
    cfg = load_config(preset, [f"output_dir={out / 'run'}", "resume=null", "train.eval_every=0",
                               "logging.progress=false", *spec.overrides])
    trainer = Trainer(cfg)
    acc, policy, zoo = trainer.accelerator, trainer.policy, trainer.rewards
    main = acc.is_main_process
    if main:
        clear_output_dir(out)
    acc.wait_for_everyone()
    console = Console(quiet=not main)
    items = trainer.eval_items
    val_items = (policy.read_items(spec.val_file)[:spec.num_val] if spec.val_file
                 else validation_items(trainer.train_items, spec.num_val))
    processes = f", {acc.num_processes} processes" if acc.num_processes > 1 else ""
    console.print(f"[bold]mmgrpo demo {which}[/]: {spec.task}, {len(items)} held-out prompts, preset "
                  f"{spec.preset}{processes}", soft_wrap=True)

    clock = time.perf_counter()
    before, before_batch = evaluate(policy, zoo, items, spec, flow := which == "flow", circular=True)
    held_out_eval_s = time.perf_counter() - clock
    console.print(f"before training: held-out {spec.metric} = {before[spec.metric]:.3f}")
    clock = time.perf_counter()
    val_base, _ = evaluate(policy, zoo, val_items, spec, flow)
    val_eval_s = time.perf_counter() - clock
    validations = [(0, val_base)]
    reported = {"step": 0, "metrics": val_base}
    snapshot = out / "reported-policy"
    policy.save(snapshot)  # the base model, kept when no later snapshot is eligible (or beats it on validation)
    train_start = time.perf_counter()
    if minutes is not None:
        budget_s, budget_note = 60.0 * minutes, ""
    else:
        # every process plans with the slowest one's clock, so that all stop at the same step
        budget_s = training_budget_s(spec.train_minutes, *(trainer.max_on_processes(t) for t in (
            train_start - start, held_out_eval_s, val_eval_s)))
        budget_note = ("" if budget_s >= 60.0 * spec.train_minutes else
                       f" (cut from {spec.train_minutes:g} so that the demo ends within {DEMO_LIMIT_MINUTES:g} "
                       "minutes)")
    stop_reason = {"why": "step budget reached"}
    bar = tqdm(total=round(budget_s), desc="train (time budget)", unit="s", dynamic_ncols=True, disable=not main,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s{postfix}")
    note = bar.write if main else (lambda _text: None)

    def validate(step: int) -> tuple[dict[str, float], list[str]]:
        """Score the validation set, snapshot the policy if it is the one to report, and return the metrics and
        the guard's failures (empty when the snapshot counts)."""
        metrics, _ = evaluate(policy, zoo, val_items, spec, flow)
        validations.append((step, metrics))
        below = guard_failures(metrics, val_base, spec.guard)
        note(f"step {step}: validation {spec.metric} = {metrics[spec.metric]:.3f}, {spec.guard} "
             f"{metrics[spec.guard]:.2f}" + (f" (below the guard floor: {', '.join(below)})" if below else ""))
        if not below and (spec.selection == "last" or metrics[spec.metric] > reported["metrics"][spec.metric]):
            reported.update(step=step, metrics=metrics)
            policy.save(snapshot)
        return metrics, below

    def should_stop(step: int, row: dict[str, Any]) -> bool:
        elapsed = trainer.max_on_processes(time.perf_counter() - train_start)
        out_of_time = elapsed > budget_s
        bar.n = min(round(elapsed), bar.total)
        bar.set_postfix({"step": step, "reward": f"{row['reward/mean']:.3f}"})
        if step % spec.eval_every and not out_of_time:
            return False
        metrics, below = validate(step)
        if below and spec.stop_on_guard:
            stop_reason["why"] = (f"early stop at step {step}: validation {below[0]} {metrics[below[0]]:.2f} fell "
                                  f"below {GUARD_FLOOR:.0%} of the base model's {val_base[below[0]]:.2f}")
            return True
        # the pace so far includes the validation checks, which the rest of the budget has too
        end = None if out_of_time else trainer.fit_schedule_to_budget(
            trainer.max_on_processes(time.perf_counter() - train_start), budget_s)
        if end is not None:
            note(f"step {step}: the lr schedule now ends at step {end}, where the time budget is projected to end")
        if out_of_time:
            stop_reason["why"] = f"time budget of {budget_s / 60:.1f} minutes{budget_note} reached at step {step}"
        return out_of_time

    with bar:
        history = trainer.train(should_stop=should_stop)
    if trainer.interrupted:
        stop_reason["why"] = (f"stopped by {trainer.interrupted} at step {trainer.step}, which was validated too; "
                              f"its checkpoint is in run/checkpoints")
    # The step training ended on (Ctrl-C, or train.max_steps between two checks) is validated too, so that it can
    # be the one reported.
    if validations[-1][0] != trainer.step:
        validate(trainer.step)
    acc.wait_for_everyone()  # the main process saved the snapshot
    policy.load(snapshot)
    after, after_batch = evaluate(policy, zoo, items, spec, flow, circular=True)
    schedule_end = trainer.schedule_warp.planned_end()
    trainer.close()
    if not main:
        return None, trainer.interrupted
    total_minutes = (time.perf_counter() - start) / 60.0
    result = {"task": spec.task, "metric": spec.metric, "before": before[spec.metric],
              "after": after[spec.metric], "minutes": round(total_minutes, 2)}
    (out / "demo.json").write_text(json.dumps(result, indent=2))
    if flow and not cfg.model.lora_rank:
        complete_pipeline(snapshot, REPO / spec.asset)
    usage = reported_model_usage(which, spec, cfg, snapshot, items[0]["prompt"],
                                 policy.adapter if flow else None)
    write_report(out, which, spec, cfg, before, after, validations, history, reported["step"], stop_reason["why"],
                 before_batch, after_batch, total_minutes, schedule_end, acc.num_processes, usage)
    console.print(comparison_table(spec, before, after, flow))
    console.print(f"wrote {out / 'report.md'} and {out / 'demo.json'} ({total_minutes:.1f} minutes)")
    return result, trainer.interrupted


def comparison_table(spec: DemoSpec, before: dict[str, float], after: dict[str, float], flow: bool) -> Any:
    from rich.table import Table

    table = Table(title=f"held-out {spec.task}: before and after GRPO")
    for col in ("measure", "before", "after", "change"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    for row in table_rows(before, after, spec.metric):
        table.add_row(*row)
    return table


def table_rows(before: dict[str, float], after: dict[str, float], metric: str) -> list[tuple[str, str, str, str]]:
    """(name, before, after, change) as printed, the headline metric first, then the honesty measures, then the
    sub-scores; "n/a" for a value that could not be measured (NaN)."""
    def shown(x: float, sign: str = "") -> str:
        return f"{x:{sign}.3f}" if math.isfinite(x) else "n/a"

    order = [metric] + [k for k in HONESTY_MEASURES if k in before]
    order += sorted(k for k in before if k not in order)
    rows = [(k, before[k], after.get(k, math.nan)) for k in order]
    return [(k, shown(b), shown(a), shown(a - b, "+")) for k, b, a in rows]


def complete_pipeline(weights: Path, base: Path) -> None:
    """Make ``weights`` (the trained parts of a diffusers pipeline: ``transformer/``) a whole pipeline folder by
    copying in, unchanged, every file and part of the ``base`` pipeline folder that it lacks (model_index.json,
    scheduler, VAE, text encoders, tokenizers)."""
    for entry in base.iterdir():
        target = weights / entry.name
        if target.exists():
            continue
        if entry.is_dir():
            shutil.copytree(entry, target)
        else:
            shutil.copy2(entry, target)


def reported_model_usage(which: str, spec: DemoSpec, cfg: Any, weights: Path, prompt: str,
                         adapter: Any = None) -> str:
    """Markdown for report.md: how to load the reported model's weights (``weights``, the demo's
    ``reported-policy`` folder) with the stock libraries, and generate with it. Absolute paths, so the snippet runs
    from any folder on this machine. ``adapter`` is the flow model adapter (its pipeline class: an image
    pipeline, as the shipped model's is); ``prompt`` is the one the flow snippet draws."""
    weights, base = weights.resolve(), (REPO / spec.asset).resolve()
    after = ""
    if which == "flow":
        pipeline = adapter.pipeline_class
        s = cfg.sampling
        tokens = (f", max_sequence_length={cfg.model.max_sequence_length}"
                  if cfg.model.max_sequence_length else "")
        dtype = f"dtype=torch.{cfg.model.dtype}"  # the shipped files' own dtypes differ by part
        if cfg.model.lora_rank:
            load = (f'pipe = {pipeline}.from_pretrained("{base}", {dtype})\n'
                    f'pipe.load_lora_weights("{weights}")')
        else:
            load = f'pipe = {pipeline}.from_pretrained("{weights}", {dtype})'
            after = (f"\nIt is a whole pipeline folder (the shipped one with the trained `transformer/`), so from the "
                     f"repository root `mmgrpo sample {spec.preset} model.path={weights}` draws from it and "
                     f"`mmgrpo eval {spec.preset} model.path={weights}` scores it on the held-out prompts, one sample "
                     f"each (docs/flow.md).\n")
        code = (f"import torch\nfrom diffusers import {pipeline}\n\n{load}\n"
                f'image = pipe("{prompt}", height={s.height}, width={s.width}, '
                f"num_inference_steps={s.eval_num_steps},\n             guidance_scale={s.guidance_scale:g}"
                f"{tokens}, generator=torch.Generator().manual_seed(0)).images[0]\n"
                'image.save("sample.png")')
    else:
        if cfg.model.lora_rank:
            code = ("from peft import PeftModel\nfrom transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
                    f'model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained("{base}"),\n'
                    f'                                  "{weights}")\n'
                    f'processor = AutoProcessor.from_pretrained("{weights}")')
        else:
            code = ("from transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
                    f'model = AutoModelForImageTextToText.from_pretrained("{weights}")\n'
                    f'processor = AutoProcessor.from_pretrained("{weights}")')
            after = (f"\nTo score it again, or on other questions: `mmgrpo eval {spec.preset} "
                     f"model.path={weights}` from the repository root (docs/vlm.md).\n")
    return (f"## The reported model\n\nIts weights are in `{weights.name}/`, in the stock format, which the stock "
            f"libraries load:\n\n```python\n{code}\n```\n{after}")


def write_report(out: Path, which: str, spec: DemoSpec, cfg: Any, before: dict[str, float],
                 after: dict[str, float], validations: list[tuple[int, dict[str, float]]],
                 history: list[dict[str, Any]], reported_step: int, stop_reason: str, before_batch: Any,
                 after_batch: Any, minutes: float, schedule_end: float, processes: int, usage: str) -> None:
    """report.md with the before/after table, the training and validation curves, before/after samples, and how
    to load the reported model (``usage``, :func:`reported_model_usage`). ``schedule_end`` is the step the lr
    schedule was last planned to end at; ``processes`` trained together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), dpi=100)
    steps = [r["step"] for r in history]
    axes[0].plot(steps, [r["reward/mean"] for r in history])
    axes[0].set_title("training reward (rollouts)")
    axes[0].set_xlabel("optimiser step")
    axes[1].plot([s for s, _ in validations], [m[spec.metric] for _, m in validations], marker="o")
    axes[1].axvline(reported_step, color="grey", linestyle="--", label=f"reported model (step {reported_step})")
    axes[1].legend(loc="best", fontsize=8)
    axes[1].set_title(f"validation {spec.metric} ({val_source(spec)})")
    axes[1].set_xlabel("optimiser step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "reward_curve.png")
    plt.close(fig)

    sample_lines = write_samples(out, which, spec, before_batch, after_batch)
    failed = [step for step, m in validations[1:] if guard_failures(m, validations[0][1], spec.guard)]
    if failed and not spec.stop_on_guard:
        guard_note_failed = (f"Validation `{spec.guard}` (pooled or of one kind) fell below {GUARD_FLOOR:.0%} of "
                             f"the base model's at step(s) {', '.join(map(str, failed))}; those snapshots were not "
                             "eligible.\n")
    else:
        guard_note_failed = ""
    guard_note = held_out_guard_note(before, after, spec.guard)
    circular_note = ("`circular_accuracy` asks every multiple-choice question again under each rotation of its "
                     "options and counts it only if all are answered right, so an answer-letter habit gains nothing "
                     "there. A model trained on options in one fixed order (the shipped ShapesQA/MotionQA model) "
                     "never learned to read rotated ones and scores only its numeric questions there; then "
                     "`answer_diversity` and the per-kind rows show whether a gain is a letter habit.\n"
                     if "circular_accuracy" in before else "")
    rows = "\n".join(f"| {' | '.join(row)} |" for row in table_rows(before, after, spec.metric))
    schedule = cfg.optim.lr_scheduler
    if not schedule.startswith("constant"):
        schedule += f" decay over {cfg.train.max_steps} steps" + (
            f", re-planned to end at step {schedule_end:.0f}, where the time budget was projected to end"
            if schedule_end < cfg.train.max_steps else "")
    g = cfg.grpo
    refilled = [f"{g.oversample_prompts} extra prompts per step"] if g.oversample_prompts else []
    refilled += [f"up to {g.refill_rounds} refill rounds"] if g.refill_rounds else []
    sampling = ("off" if not g.mask_zero_std_groups else "groups without reward variance masked"
                + (f" and replaced ({', '.join(refilled)})" if refilled else ""))
    clip = f"{g.clip_eps}" + (f" below, {g.clip_eps_high} above" if g.clip_eps_high is not None else "")
    estimator = "Gaussian mean difference" if which == "flow" else g.kl_estimator
    kl = f"beta {g.kl_beta:g} ({estimator})" if g.kl_beta else "off"
    split = f", split over {processes} processes (DDP)" if processes > 1 else ""
    steps = history[-1]["step"] if history else 0
    k = spec.samples_per_prompt
    held_out = (f"{len(before_batch) // k} prompts, {k} sample{'s' if k > 1 else ''} each with fixed seeds, scored "
                "only before and after training")
    validation = f"{spec.num_val} {val_source(spec)}" + (f" from {spec.val_file}" if spec.val_file else "")
    selection = "validation-best" if spec.selection == "best" else "last"
    settings = [
        ("held-out set", held_out),
        ("rollouts", f"{cfg.train.prompts_per_step} prompts x {cfg.train.group_size} samples per step{split}"),
        ("dynamic sampling", sampling),
        ("rewards", ", ".join(f"{r.name} x {r.weight:g}" for r in cfg.rewards)),
        ("learning rate", f"{cfg.optim.lr:g}, {schedule}"),
        ("clip range", clip),
        ("KL to the base model", kl),
        ("training", f"{steps} optimiser step{'' if steps == 1 else 's'}: {stop_reason}"),
        ("validation", f"{validation}, every {spec.eval_every} steps"),
        ("reported model", f"the {selection} snapshot that kept `{spec.guard}`: step {reported_step} (0: the base)"),
        ("total time", f"{minutes:.1f} minutes"),
    ]
    setting_rows = "\n".join(f"| {name} | {value} |" for name, value in settings)
    text = f"""# mmgrpo demo {which}: {spec.task}

GRPO on the tiny shipped model, on CPU, with no downloads, trained with `{spec.preset}`. The headline metric is
`{spec.metric}`, on a held-out set scored only before and after training.

| measure | before | after | change |
|---|---|---|---|
{rows}

{guard_note}{guard_note_failed}{circular_note}
| setting | value |
|---|---|
{setting_rows}

![reward curve](reward_curve.png)

{sample_lines}
{usage}"""
    (out / "report.md").write_text(text)


def held_out_guard_note(before: dict[str, float], after: dict[str, float], guard: str) -> str:
    """The report's line on the held-out ``guard`` measure after training as a share of the base model's, pooled
    and per kind (``guard/<task>/<kind>``). A base at 0 (one answer everywhere) has no share to keep."""
    if not math.isfinite(before[guard]):
        return f"`{guard}` is not measurable on this held-out set, so no gain is conditioned on it.\n"
    if before[guard] == 0:
        return f"`{guard}` is 0 for the base model, so it has nothing to lose and no gain is conditioned on it.\n"
    ratio = after[guard] / before[guard]
    kept = "within" if ratio >= GUARD_FLOOR else "OUTSIDE"
    below = [k for k in guard_failures(after, before, guard) if k != guard]
    parts = sum(k.startswith(guard + "/") for k in before)
    per_kind = (f" Per kind, {parts - len(below)} of {parts} parts are within it"
                + (f"; OUTSIDE: {', '.join(f'`{k}`' for k in below)}" if below else "") + "." if parts else "")
    return (f"`{guard}` after training is {ratio:.0%} of the base model's, {kept} the 20% band the gain "
            f"is conditioned on.{per_kind}\n")


def write_samples(out: Path, which: str, spec: DemoSpec, before: Any, after: Any) -> str:
    """Before/after sample files and the markdown that shows them."""
    if which == "flow":
        from mmgrpo.pipelines.flow.media import image_grid

        k = spec.samples_per_prompt
        shown = min(len(before), 8 * k)
        for tag, batch in (("before", before), ("after", after)):
            captions = [p if i % k == 0 else "" for i, p in enumerate(batch.prompts[:shown])]
            image_grid(batch.images[:shown], captions, columns=k * 2).save(out / f"samples_{tag}.png")
        return ("Held-out samples before training:\n\n![before](samples_before.png)\n\n"
                "after training:\n\n![after](samples_after.png)\n")
    rows = sample_rows(before.meta, SAMPLE_QUESTIONS)
    question_grid(out / "samples.png", before, after, rows)
    lines = ["| prompt | before | after |", "|---|---|---|"]
    for prompt, b, a in list(zip(before.prompts, before.completions, after.completions))[:12]:
        clean = [s.replace("|", "/").replace("\n", " ") for s in (prompt[:80], b[:120], a[:120])]
        lines.append("| " + " | ".join(clean) + " |")
    (out / "samples.md").write_text("\n".join(lines) + "\n")
    return (f"{len(rows)} held-out questions, one of each kind in turn, answered before and after training "
            "(green right, red wrong):\n\n![before/after samples](samples.png)\n\n"
            "The first held-out completions before and after training (also in [samples.md](samples.md)):\n\n"
            + "\n".join(lines) + "\n")


def sample_rows(meta: list[dict], n: int) -> list[int]:
    """``n`` rows taking turns over the kinds of question (``task/kind``, in held-out order): the first question of
    each kind, then the second of each, ... Fixed by the held-out order alone, never by the answers."""
    by_kind: dict[str, list[int]] = {}
    for i, m in enumerate(meta):
        by_kind.setdefault(f"{m.get('task')}/{m.get('kind')}", []).append(i)
    turns = itertools.zip_longest(*by_kind.values())
    return [i for turn in turns for i in turn if i is not None][:n]


def media_strip(meta: dict, frames: int = 3) -> torch.Tensor | None:
    """The media a question showed the model as one (H, W, 3) uint8 picture: its image, or ``frames`` evenly spaced
    frames of its clip (first, middle, last) side by side with 2 px white gaps; None without media."""
    if meta["videos"]:
        video = meta["videos"][0]
        tiles = video[torch.linspace(0, video.shape[0] - 1, frames).round().long()]
    elif meta["images"]:
        tiles = meta["images"][0][None]
    else:
        return None
    gap = torch.full((3, tiles.shape[2], 2), 255, dtype=torch.uint8)
    parts = [part for tile in tiles for part in (tile, gap)][:-1]
    return torch.cat(parts, dim=2).permute(1, 2, 0)


def question_grid(path: Path, before: Any, after: Any, rows: list[int]) -> None:
    """A PNG at ``path`` with one row per held-out question in ``rows``: its media (nearest-neighbour upscaled)
    on the left; on the right its kind, question and options, the ground truth, and the before and after
    ``<answer>`` content in green (right) or red (wrong)."""
    import matplotlib.pyplot as plt

    from mmgrpo.rewards.text_rules import AccuracyReward, last_tagged

    accuracy = AccuracyReward()
    right = {tag: accuracy(batch.select(rows)).tolist() for tag, batch in (("before", before), ("after", after))}
    fig, axes = plt.subplots(len(rows), 2, figsize=(9, 1.5 * len(rows)), dpi=100, squeeze=False,
                             gridspec_kw={"width_ratios": [1, 1.3]})
    for k, (i, (media_ax, text_ax)) in enumerate(zip(rows, axes)):
        meta = before.meta[i]
        media_ax.axis("off")
        text_ax.axis("off")
        strip = media_strip(meta)
        if strip is not None:
            media_ax.imshow(strip.numpy(), interpolation="nearest")
        question, *options = [line for line in before.prompts[i].splitlines() if line != "Options:"]
        lines = [(f"{meta.get('task')}/{meta.get('kind')}", "grey"),
                 *[(line, "black") for text in (question, "   ".join(options)) for line in textwrap.wrap(text, 70)],
                 (f"truth: {meta['answer']}", "black")]
        for tag, batch in (("before", before), ("after", after)):
            ok = right[tag][k] == 1.0
            answer = last_tagged(batch.completions[i]) or "(no <answer>)"
            lines.append((f"{tag}: {answer}  " + ("\u2713" if ok else "\u2717"), "green" if ok else "red"))
        for j, (line, colour) in enumerate(lines):
            text_ax.annotate(line, (0, 1), xycoords="axes fraction", xytext=(0, -13 * j), textcoords="offset points",
                             va="top", fontsize=10, color=colour)
    fig.suptitle("held-out questions before and after GRPO (green: right, red: wrong)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
