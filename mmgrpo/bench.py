"""Benchmark suites: ``mmgrpo bench NAME --out FILE.json``.

A suite is a function registered in :data:`BENCHES` that returns ``(rows, figures)``. The machine is shared and
noisy, so suites report ratios measured within one run, time each case several times and keep the median, and
fix the thread count, which :func:`machine_info` records in the output.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmgrpo.registry import Registry
from mmgrpo.tracking import finite_or_null

BENCHES = Registry("benchmark", builtin_modules=("mmgrpo.pipelines.flow.bench", "mmgrpo.pipelines.vlm.bench",
                                                  "mmgrpo.rewards.bench", "mmgrpo.learning"))


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def median_seconds(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class BenchUsageError(ValueError):
    """A bad ``mmgrpo bench`` request (a selection the suite does not take, an ``--out`` that cannot be written),
    raised before any measuring; the CLI prints it as one line, exit 2. Other errors of a suite are bugs and keep
    their traceback."""


def run_bench(name: str, out: str | None, threads: int | None = None,
              only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Run suite ``name`` with a fixed thread count (the caller's is restored after), print its table, and write
    the JSON contract ``{"bench", "machine", "rows", "figures"}`` to ``out`` when given. ``only``: the cases to
    run, for a suite that takes a selection as its argument (``learning``: preset names); BenchUsageError for another."""
    from rich.console import Console
    from rich.table import Table

    suite = BENCHES.get(name)
    if only and not inspect.signature(suite).parameters:
        raise BenchUsageError(f"benchmark '{name}' always runs all its cases; --only is for a suite that selects "
                         "(learning)")
    if out:  # checked before the minutes of measuring, whose results would be lost
        with contextlib.suppress(OSError):  # a file in the way, or no permission: the check below names --out
            Path(out).parent.mkdir(parents=True, exist_ok=True)
        if Path(out).is_dir() or not Path(out).parent.is_dir() or not os.access(Path(out).parent, os.W_OK):
            raise BenchUsageError(f"--out {out}: cannot write a file there")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        machine = machine_info()
        rows, figures = suite(only) if only else suite()
    finally:
        torch.set_num_threads(previous)
    result = {"bench": name, "machine": machine, "rows": rows, "figures": figures}
    table = Table(title=f"mmgrpo bench {name} ({result['machine']['torch_threads']} threads)")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    for col in columns:
        table.add_column(col)
    for r in rows:
        table.add_row(*(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in columns))
    console = Console(width=160)
    console.print(table)
    for key, value in figures.items():
        console.print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    if out:
        Path(out).write_text(json.dumps(finite_or_null(result), indent=2, allow_nan=False))
        console.print(f"wrote {out}")
    return result
