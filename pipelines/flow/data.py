"""Prompt data of the flow pipeline: ``.txt`` (one prompt a line), ``.jsonl`` (``prompt`` + metadata) or
``task:NAME``.

An item is a dict with ``prompt``; every other key of a jsonl object (or of a task item) is metadata that
reaches the rewards as ``RewardBatch.meta`` (e.g. ``target_rgb`` for ``color_fraction``). An optional ``seed``
(an integer >= 0) fixes the item's evaluation noise. The suffix ``.jsonl`` (any case) marks JSON lines; any
other file but ``.json`` (refused) is read as one prompt a line. Problems are reported as
:class:`mmgrpo.config.ConfigError` naming the config key and the file.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from mmgrpo.config import ConfigError, cwd_hint


def read_prompt_file(path: str, key: str) -> list[dict]:
    """Items of a ``.txt`` or ``.jsonl`` prompt file; ``key`` is the config key that named it (for errors)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"bad value for '{key}': prompt file not found: {file}{cwd_hint(file)}")
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not prompt text
    except UnicodeDecodeError as err:
        raise ConfigError(f"bad value for '{key}': {file} is not UTF-8 text ({err.reason} at byte "
                          f"{err.start})") from err
    suffix = file.suffix.lower()
    if suffix == ".json":
        raise ConfigError(f"bad value for '{key}': {file} is a .json file; prompt files are .jsonl (one JSON object "
                          "with a 'prompt' a line) or .txt (one prompt a line)")
    comments = suffix != ".jsonl"
    lines = [(n, line) for n, line in enumerate(text.split("\n"), start=1)  # JSON strings may hold U+2028
             if line.strip() and not (comments and line.strip().startswith("#"))]
    if suffix == ".jsonl":
        items = [_jsonl_item(line, n, file, key) for n, line in lines]  # unstripped: JSON columns stay right
    else:
        items = [{"prompt": line.strip()} for _, line in lines]
    if not items:
        raise ConfigError(f"bad value for '{key}': {file} holds no prompts")
    return items


def _jsonl_item(line: str, number: int, file: Path, key: str) -> dict:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"bad value for '{key}': {file}:{number}: malformed JSON at column {err.colno}: "
                          f"{err.msg}") from err
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
        raise ConfigError(f"bad value for '{key}': {file}:{number} must be an object with a non-empty "
                          "'prompt'")
    seed = item.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ConfigError(f"bad value for '{key}': {file}:{number}: 'seed' must be an integer >= 0 (the item's "
                          f"evaluation noise), got {json.dumps(seed)}")
    return item


def task_items(name: str, split: str, key: str) -> list[dict]:
    """Items of a registered synthetic task (``mmgrpo.registry.TASKS``); split 'train' or the held-out one."""
    from mmgrpo.registry import TASKS, RegistryError

    try:
        task = TASKS.get(name)
    except RegistryError as err:
        raise ConfigError(f"bad value for '{key}': {err}") from err
    splits = list(getattr(task, "splits", ("train", "heldout")))
    items = task.items(split if split in splits else splits[-1])
    if not items:
        raise ConfigError(f"bad value for '{key}': task '{name}' has no {split} items")
    if not isinstance(items[0].get("prompt"), str):
        raise ConfigError(f"bad value for '{key}': task '{name}' has no text prompts (its items hold "
                          f"{sorted(items[0])}): it is not a text-to-image task")
    return items


def load_items(source: str, key: str, split: str) -> list[dict]:
    """Items from a prompt file or ``task:NAME`` (``split`` picks the task split)."""
    if source.startswith("task:"):
        return task_items(source[len("task:"):], split, key)
    return read_prompt_file(source, key)


def prompt_datasets(train_source: str, eval_source: str | None,
                    num_eval: int) -> tuple[list[dict], list[dict]]:
    """(train items, held-out items). Held-out: ``eval_source``, else the task's held-out split, else the
    first training prompts (with a warning: the evaluation is then on prompts the policy trains on); at most
    ``num_eval`` of them."""
    train = load_items(train_source, "data.train_prompts", "train")
    if eval_source is not None:
        held_out = load_items(eval_source, "data.eval_prompts", "heldout")
    elif train_source.startswith("task:"):
        held_out = load_items(train_source, "data.train_prompts", "heldout")
    else:
        warnings.warn(f"data.eval_prompts is not set: evaluation uses the first {min(num_eval, len(train))} "
                      f"training prompts of {train_source}, which the policy trains on; set data.eval_prompts to "
                      "held-out prompts for a held-out score", stacklevel=2)
        held_out = train
    return train, held_out[:num_eval]
