"""Metrics: metrics.jsonl always, tensorboard when installed, wandb on request, PNG curves and a summary table."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

from mmgrpo.config import ConfigError

HEADLINE = ("reward/mean", "loss", "kl", "entropy", "ratio/mean", "ratio/onpolicy_max_dev", "clip_frac", "time/step_s")
"""Metrics that get a PNG curve and a row in the end-of-run summary (plus every reward/<name>/mean)."""


def headline_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The headline metrics present in ``rows``, then every reward and eval metric, in a stable order; a
    ``nan_frac`` (a reward's share of NaN scores) only when it is not 0 in some row."""
    keys = [k for k in HEADLINE if any(k in r for r in rows)]
    extra = {k for r in rows for k in r if k.startswith(("reward/", "eval/")) and k not in keys}
    quiet = {k for k in extra if k.endswith("/nan_frac") and not any(r.get(k) for r in rows)}
    return keys + sorted(extra - quiet)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file. A torn last line (a killed run) is ignored."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``, written beside it, synced and renamed: a failed write (a full
    disk) leaves the old file whole."""
    fresh = path.with_name(f".{path.name}.tmp")
    with open(fresh, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(fresh, path)


WANDB_ID_FILE = "wandb/run_id"
"""Where in the run directory the id of its wandb run is kept (next to wandb's own files), for a resume."""


def start_wandb(run_dir: Path, project: str, config: dict[str, Any], resume_step: int | None,
                last_step: int) -> tuple[Any, int]:
    """The wandb run of ``run_dir`` and the first step to send to it.

    A fresh run (``resume_step`` None) starts a new wandb run and keeps its id in ``WANDB_ID_FILE``; a resume
    continues the run of that id (or starts one when there is none: the killed run did not log to wandb). wandb
    drops a step below one it already has, so a resume from step N of a run that had logged up to ``last_step``
    sends from ``last_step`` + 1 on: wandb keeps the killed run's values of steps N+1..last_step, metrics.jsonl and
    tensorboard get the resumed run's (and a warning says so)."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    stored = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else ""
    try:
        run = wandb.init(project=project, dir=str(run_dir), config=config, id=stored or None,
                         resume="allow" if stored else None)
    except wandb.errors.Error as err:  # no account, no network: one line, not wandb's traceback
        raise ConfigError(f"logging.wandb=true but wandb did not start: {' '.join(str(err).split())} "
                          f"(WANDB_MODE=offline logs to {run_dir / 'wandb'} without an account)") from err
    id_file.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(id_file, run.id + "\n")
    if not stored:
        return run, 0
    first = max(last_step + 1, run.step)  # online, run.step is the step after the ones wandb already has
    if first > resume_step + 1:
        warnings.warn(f"steps {resume_step + 1}-{first - 1} are logged again after the resume from step "
                      f"{resume_step}; wandb run {run.id} already has them from before and drops a step logged twice, "
                      f"so it keeps those values and gets this run from step {first} on (metrics.jsonl and "
                      "tensorboard hold the new ones)", RuntimeWarning, stacklevel=3)
    return run, first


def plain_scalar(value: Any) -> Any:
    """A numpy scalar or a 0-d torch tensor as the Python number (or bool) it holds; anything else unchanged."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


class MetricsLog:
    """Writes one JSON object per optimiser step. Only the main process should create one."""

    def __init__(self, run_dir: Path, config: dict[str, Any], tensorboard: bool, wandb: bool,
                 wandb_project: str, resume_step: int | None):
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        logged = read_metrics(self.path) if resume_step is not None else []
        kept = [r for r in logged if r.get("step", 0) <= resume_step] if resume_step is not None else []
        write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            # a resume drops the event files' points after its checkpoint, which the killed run had logged
            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=None if resume_step is None else resume_step + 1)
        self.wandb, self.wandb_from = None, 0
        if wandb:
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("logging.wandb=true but wandb is not installed (pip install -e '.[wandb]')")
            last_step = max((r.get("step", 0) for r in logged), default=0)
            self.wandb, self.wandb_from = start_wandb(run_dir, wandb_project, config, resume_step, last_step)

    def log(self, row: dict[str, Any]) -> None:
        row = {k: plain_scalar(v) for k, v in row.items()}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        step = row["step"]
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None and step >= self.wandb_from:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def plot_metrics(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Draw one PNG per headline metric (and per reward) against the step. Returns the files written. One figure
    is redrawn for every metric with fixed margins (no pyplot, no layout pass): a laid-out figure per metric took
    1.5x as long (3.6 s against 2.5 s for a tiny flow preset's 27 metrics, on one thread)."""
    if not rows:
        return []
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(5, 3.2), dpi=100)
    fig.subplots_adjust(left=0.15, right=0.97, bottom=0.15, top=0.9)
    ax = fig.add_subplot()
    written = []
    for key in headline_keys(rows):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if not points:
            continue
        ax.clear()
        ax.plot(*zip(*points), marker="." if len(points) < 50 else None)
        ax.set_xlabel("optimiser step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
        path = out_dir / plot_file_name(key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fig.savefig(path)
        written.append(path)
    return written


def plot_file_name(key: str) -> str:
    """The PNG file name of metric ``key``: each run of characters other than letters, digits, ``.``, ``_`` and
    ``-`` becomes ``_`` (a reward named by its file, ``my_rewards.py:redness``, puts ``:`` and ``/`` in keys, which
    Windows and sync tools refuse in file names)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("_") + ".png"


def redraw_due(first_step: int, last_step: int, every: int, spent_s: float, elapsed_s: float,
               max_share: float) -> bool:
    """Whether to redraw the curves after optimiser steps ``first_step..last_step`` (one iteration): a multiple of
    ``every`` (> 0) is among them, and the redraws so far took ``spent_s`` seconds, at most ``max_share`` of the
    ``elapsed_s`` seconds of the run. A redraw that is not due waits for a later multiple."""
    return last_step // every != (first_step - 1) // every and spent_s <= max_share * elapsed_s


def summary_table(rows: list[dict[str, Any]], title: str) -> Any:
    """A rich Table of the headline metrics: first, last, min and max over the run."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("metric", "first", "last", "min", "max"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    keys = headline_keys(rows)
    for key in keys:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            table.add_row(key, *(f"{v:.4g}" for v in (values[0], values[-1], min(values), max(values))))
    return table


def print_whole(renderable: Any) -> None:
    """Print a rich renderable (a table) to stdout. Off a terminal (a log file, a pipe) it gets its full width
    instead of being cut to rich's default 80 columns, where long metric names would end in an ellipsis."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        unbounded = console.options.update(max_width=10_000)
        console = Console(width=max(console.width, console.measure(renderable, options=unbounded).maximum))
    console.print(renderable)


def finite_or_null(obj: Any) -> Any:
    """``obj`` (nested dicts, lists and scalars) with every NaN or infinite float replaced by None, so that the
    JSON is strict (a bare NaN breaks jq and JavaScript)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj
