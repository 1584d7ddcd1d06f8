"""Atomic checkpoints in ``output_dir/checkpoints/step-N`` and the resume rules."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first. A folder is complete once it has its final name (writes are renamed
    into place) and holds the trainer state."""
    root = run_dir / "checkpoints"
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = STEP_DIR.match(child.name)
            if match and (child / STATE_FILE).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint folder to resume from: None for a fresh run, the newest for 'latest', or the given path."""
    if resume is None or resume == "":
        return None
    if resume == "latest":
        found = checkpoint_dirs(run_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume checkpoint not found or incomplete: {path} (no {STATE_FILE})")
    return path


def temporary_dir(run_dir: Path, step: int) -> Path:
    """Where a checkpoint is written before it is renamed to ``step-N``."""
    return run_dir / "checkpoints" / f".tmp-step-{step}"


def finalize(tmp: Path, state: dict[str, Any]) -> Path:
    """Write the trainer state last, then rename the folder into place (atomic on one filesystem)."""
    with open(tmp / STATE_FILE, "w") as f:
        f.write(json.dumps(state, indent=2))
        f.flush()
        os.fsync(f.fileno())  # the state is on disk before the rename makes the checkpoint visible
    final = tmp.parent / tmp.name.removeprefix(".tmp-")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # and so is the rename
    finally:
        os.close(directory)
    return final


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints, and stale temporary folders."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return
    for child in root.glob(".tmp-step-*"):
        shutil.rmtree(child, ignore_errors=True)
    if keep_last > 0:
        for _, path in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
