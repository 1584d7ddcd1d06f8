"""Atomic checkpoints in ``output_dir/checkpoints/step-N`` and the resume rules."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmgrpo.config import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
"""The resolved config of the run, in the run directory and in each checkpoint."""
FIXED_ON_RESUME = ("pipeline", "seed", "model.", "train.group_size", "train.prompts_per_step",
                   "train.micro_batch_size", "train.updates_per_rollout")
"""Config keys (or prefixes) a resumed run must keep: the weights, sampler and RNG state in the checkpoint were made
with them. (``optim.*`` may change: the trainer applies it to the restored optimiser and schedule.)"""
FREE_ON_RESUME = ("resume", "output_dir", "num_threads", "train.max_steps", "train.max_minutes", "train.save_every",
                  "train.eval_every", "train.keep_last", "logging.")
"""Config keys (or prefixes) a resumed run may change without comment. Any other change is allowed with a
warning."""


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


def newer_checkpoint(run_dir: Path, step: int) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` past ``step``, or None. Resuming from ``step`` into that run
    directory would mix two runs: their metrics, and checkpoints that ``resume=latest`` and pruning would pick."""
    later = [path for n, path in checkpoint_dirs(run_dir) if n > step]
    return later[-1] if later else None


def checkpoint_hint(path: str | os.PathLike) -> str:
    """The end of a model-loading error for a ``model.path`` that is an mmgrpo checkpoint (``step-N``) or its
    ``policy`` folder: the weights in it load onto the run's base model through ``resume``, so name both. Empty
    for any other path."""
    import yaml

    local = Path(path).expanduser()
    folder = next((f for f in (local, local.parent) if (f / STATE_FILE).is_file()), None)
    if folder is None:
        return ""
    saved = folder / CONFIG_FILE
    base = (yaml.safe_load(saved.read_text()) or {}).get("model", {}).get("path") if saved.is_file() else None
    return (f"; {folder} is an mmgrpo checkpoint, whose weights load onto its run's base model: set "
            f"model.path={base or 'the base model'} resume={folder}")


def existing_run(run_dir: Path) -> str | None:
    """What in ``run_dir`` shows an earlier run (its metrics or checkpoints), or None. An empty metrics.jsonl (a
    run that failed in its first step) does not."""
    found = [name for name in ("metrics.jsonl",) if (run_dir / name).is_file() and (run_dir / name).stat().st_size]
    found += [f"checkpoints/{path.name}" for _, path in checkpoint_dirs(run_dir)[-1:]]
    return ", ".join(found) or None


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def matches(key: str, patterns: tuple[str, ...]) -> bool:
    """Whether dotted ``key`` is one of ``patterns``: a key, or a prefix ending in '.' (``model.``)."""
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The dotted keys whose value differs between the checkpoint's config ``old`` and the resumed run's ``new``
    (both :func:`flatten`-ed): ``(fixed, other)``, where ``fixed`` match :data:`FIXED_ON_RESUME` and ``other`` are
    the rest, minus :data:`FREE_ON_RESUME`."""
    changed = sorted(k for k in old.keys() | new.keys()
                     if old.get(k) != new.get(k) and not matches(k, FREE_ON_RESUME))
    rank = {k: next(i for i, p in enumerate(FIXED_ON_RESUME) if matches(k, (p,)))
            for k in changed if matches(k, FIXED_ON_RESUME)}
    fixed = sorted(rank, key=lambda k: (rank[k], k))  # the pipeline first: the root of any other difference
    return fixed, [k for k in changed if k not in rank]


def saved_config(path: Path) -> dict[str, Any]:
    """The :func:`flatten`-ed config of a ``config.yaml`` file; TypeError when it holds no mapping."""
    import yaml

    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise TypeError(f"{path} holds {type(data).__name__}, not a mapping of config keys")
    return flatten(data)


def torn_file(folder: Path) -> Path | None:
    """The first file under ``folder`` whose container does not open: a ``.safetensors`` whose header does not
    parse, a ``.bin`` / ``.pt`` / ``.pth`` that is not a torch zip archive, a ``.json`` that is not JSON. Only
    headers and zip directories are read, so this is cheap on large checkpoints. None when all open."""
    import zipfile

    from safetensors import SafetensorError, safe_open

    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), "pt"):
                    pass
            elif file.suffix in (".bin", ".pt", ".pth"):
                zipfile.ZipFile(file).close()
            elif file.suffix == ".json":
                json.loads(file.read_text())
        except (OSError, ValueError, zipfile.BadZipFile, SafetensorError):  # JSON and UTF-8 errors are ValueErrors
            return file
    return None


def unreadable(path: Path, err: Exception, run_dir: Path) -> ConfigError:
    """The one-line error for checkpoint ``path`` that ``err`` stopped reading, naming the file in it that does not
    open (:func:`torn_file`) and the checkpoint of ``run_dir`` before it to resume from instead."""
    import textwrap

    earlier = [p for _, p in checkpoint_dirs(run_dir) if p.resolve() != path.resolve()]
    hint = f"; with it moved away, resume={earlier[-1]} resumes from the one before" if earlier else ""
    first = textwrap.shorten((str(err).strip().splitlines() or [""])[0], 300, placeholder=" ...")
    torn = torn_file(path) if path.is_dir() else None
    where = f"; {torn.relative_to(path)} does not open" if torn is not None else ""
    return ConfigError(f"bad value for 'resume': checkpoint {path} cannot be read ({type(err).__name__}: "
                       f"{first}{where}){hint}")


def fixed_change(old: dict[str, Any], new: dict[str, Any], path: Path, keys: tuple[str, ...] = FIXED_ON_RESUME
                 ) -> ConfigError | None:
    """The ConfigError for the first of ``keys`` (dotted, or prefixes ending in '.') that differs between the
    config checkpoint ``path`` was made with (``old``) and this run's (``new``), both flattened; None if none."""
    fixed, _ = config_changes(old, new)
    key = next((k for k in fixed if matches(k, keys)), None)
    if key is None:
        return None
    return ConfigError(f"bad value for '{key}': {new.get(key)!r}, but checkpoint {path} was made with "
                       f"{old.get(key)!r}; its weights and state depend on it: use the old value, or another "
                       f"checkpoint")


def temporary_dir(run_dir: Path, step: int) -> Path:
    """Where a checkpoint is written before it is renamed to ``step-N``."""
    return run_dir / "checkpoints" / f".tmp-step-{step}"


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize(tmp: Path, state: dict[str, Any]) -> Path:
    """Put everything in ``tmp`` on disk, write the trainer state last, then rename the folder into place (atomic
    on one filesystem): after a crash, a folder with its final name holds every file whole."""
    for path in sorted(tmp.rglob("*"), reverse=True):  # files before the folders that list them
        _fsync(path)
    with open(tmp / STATE_FILE, "w") as f:
        f.write(json.dumps(state, indent=2))
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    final = tmp.parent / tmp.name.removeprefix(".tmp-")
    replaced = tmp.parent / f".old-{final.name}"
    if final.exists():  # the same step saved again: set the old one aside, delete it once the new one is in place
        final.rename(replaced)
    tmp.rename(final)
    _fsync(final.parent)  # and so is the rename
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints, and stale temporary and set-aside folders. A
    checkpoint is renamed to a set-aside folder before its files go, so a prune cut short (a killed run) leaves no
    ``step-N`` with part of its files; the next prune deletes the rest."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return
    for child in [*root.glob(".tmp-step-*"), *root.glob(".old-step-*")]:
        shutil.rmtree(child, ignore_errors=True)
    if keep_last > 0:
        for _, path in checkpoint_dirs(run_dir)[:-keep_last]:
            doomed = path.with_name(f".old-{path.name}")
            try:
                path.rename(doomed)
            except OSError:  # a set-aside folder of that name that could not be deleted: delete in place
                doomed = path
            shutil.rmtree(doomed, ignore_errors=True)


def safetensors_files(folder: Path, weights_name: str, index_name: str) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` folder: ``weights_name`` (transformers' ``model.safetensors``,
    diffusers' ``diffusion_pytorch_model.safetensors``), or the shards its index ``index_name`` lists.
    FileNotFoundError naming the folder when it holds neither."""
    index = folder / index_name
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (folder / weights_name).is_file():
        return [folder / weights_name]
    raise FileNotFoundError(f"no {weights_name} (or its index) in {folder}")


def placed_like(tensor: Tensor, target: Tensor) -> Tensor:
    """The whole weight ``tensor`` laid out as ``target`` holds it: for a DTensor (a parameter FSDP2 shards), this
    process's part on the target's mesh and placements, cut from ``tensor`` here without any communication (every
    process reads the whole tensor itself); any other target takes ``tensor`` as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor):
        return tensor
    return distribute_tensor(tensor, target.device_mesh, target.placements, src_data_rank=None)
