"""Question files of the VLM pipeline: Video-R1 and EasyR1 records, read into :class:`VLMSample`.

A file is a JSON list of records or JSONL (one record per line, blank lines ignored); either is detected from the
first character, not the extension. The format is detected per record:

- Video-R1: ``problem``, ``problem_type``, ``solution`` (often ``<answer>B</answer>``), optional ``options``
  (``["A. red", "B. blue"]``), and ``path`` with ``data_type`` (``image`` or ``video``); ``path`` may also be a list.
- EasyR1: ``problem``, ``answer``, optional ``images`` and ``videos`` (lists of paths, or of ``{"path": ...}``) and an
  optional ``problem_type``. ``<image>``/``<video>`` markers in the problem text say where each medium goes: the
  prompt is split at them and the media take their places in marker order (:func:`chat_content`).

A record with ``solution`` is Video-R1, one with ``answer`` (and no ``solution``) EasyR1. Media paths are resolved
against the data root (one starting with ``~`` is under the home folder, absolute once expanded). Any other field is
kept in :attr:`VLMSample.extra` and reaches the rewards through :func:`reward_meta`. Every problem raises ConfigError
naming ``file:line``.

A ``task:NAME[,NAME...]`` source (:func:`read_task_split`) is a split of registered synthetic QA tasks, written
once to a cache folder in the Video-R1 format and read from there like any file.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mmgrpo.config import ConfigError, cwd_hint
from mmgrpo.rewards.text_rules import (
    PROBLEM_TYPES,
    canonical_problem_type,
    is_temporal_grounding,
    last_tagged,
    normalize_choice,
    option_label_ends,
)

_CONSUMED = ("problem", "problem_type", "options", "solution", "answer", "path", "data_type", "images", "videos")
_PLACEHOLDER = re.compile(r"\{(question|options|type_instruction)\}")
_MARKER = re.compile(r"(<image>|<video>)")
_VISION_SPECIAL = re.compile(r"<\|(?:image_pad|video_pad|vision_start|vision_end|vision_pad)\|>")
"""Qwen2-VL-family vision special tokens: the processor expands each ``<|image_pad|>`` / ``<|video_pad|>`` of the
text into a medium's tokens, so written in a prompt they would take pixels meant for the markers' places."""
TEMPORAL_GROUNDING = "temporal grounding"
DATA_PROBLEM_TYPES = (*PROBLEM_TYPES, TEMPORAL_GROUNDING)
"""The problem types a record may give: ``accuracy``'s, and temporal grounding, which ``temporal_iou`` scores."""


@dataclass
class VLMSample:
    """One question with its media and ground truth."""

    question: str
    """The problem text."""
    problem_type: str | None
    """A type of ``DATA_PROBLEM_TYPES`` (aliases normalised), or None when an EasyR1 record has none."""
    options: list[str]
    """Answer options as given (Video-R1 labels them ``"A. ..."``); empty when there are none."""
    solution: str
    """Ground truth as given (``"<answer>B</answer>"`` or ``"B"``); numbers and lists are JSON-encoded."""
    images: list[Path] = field(default_factory=list)
    """Absolute image paths."""
    videos: list[Path] = field(default_factory=list)
    """Absolute video paths."""
    source: str = ""
    """``file:line`` of the record, for messages."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other field of the record."""
    references: list[str | int | float] | None = None
    """The ground truth when the record gives a list, as given: several acceptable answers (``["3", "three"]``,
    scored by the best) or a ``[start, end]`` interval in seconds (``temporal_iou``); None otherwise."""


def _json_lines(text: str, name: str) -> list[tuple[int, Any]]:
    """(line, value) of each non-blank line of a JSONL text."""
    records = []
    for line_no, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028, U+0085
        if not line.strip():
            continue
        try:
            records.append((line_no, json.loads(line)))
        except json.JSONDecodeError as err:
            hint = " (a .json file holds a list of records or one record per line)" if name.endswith(".json") else ""
            raise ConfigError(f"{name}:{line_no}: malformed JSON at column {err.colno}: {err.msg}{hint}") from err
    return records


def _json_list(text: str, name: str) -> list[tuple[int, Any]]:
    """(line where it starts, value) of each element of the JSON list in ``text`` (which starts with ``[``)."""
    decoder, space = json.JSONDecoder(), re.compile(r"\s*")
    records: list[tuple[int, Any]] = []
    line, counted = 1, 0

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line, counted = line + text.count("\n", counted, pos), pos
        return line

    pos = space.match(text, text.index("[") + 1).end()
    while text[pos:pos + 1] != "]" or records:  # "[]" is empty; after a record only the break at "]" ends it
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{name}:{err.lineno}: malformed JSON at column {err.colno}: {err.msg}") from err
        records.append((line_at(pos), value))
        pos = space.match(text, end).end()
        if text[pos:pos + 1] == "]":
            break
        if text[pos:pos + 1] != ",":
            raise ConfigError(f"{name}:{line_at(pos)}: malformed JSON: expected ',' or ']' after the record")
        pos = space.match(text, pos + 1).end()
    if text[pos + 1:].strip():
        raise ConfigError(f"{name}:{line_at(pos)}: malformed JSON: extra data after the closing ']'")
    return records


def _lone_object(text: str) -> bool:
    """Whether ``text`` is one JSON object that cannot be a one-record JSONL file: it spans several lines, or it has
    none of a record's fields (such as ``{"data": [...]}``; a record missing some is parsed, and the missing field
    named)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and ("\n" in text.strip() or not set(_CONSUMED) & value.keys())


def _media_list(value: Any, key: str, source: str) -> list[str]:
    """Paths of an ``images``/``videos``/``path`` field: a path, or a list of paths or ``{"path": ...}``."""
    items = value if isinstance(value, list) else [value]
    paths = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("path"), str):
            item = item["path"]
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{source}: field '{key}' must hold file paths (embedded bytes and frame lists are "
                              f"not supported), got {json.dumps(item)[:80]}")
        paths.append(item)
    return paths


def _text(record: dict, key: str, source: str, fmt: str) -> str:
    """A required non-blank field as text; numbers and lists are JSON-encoded."""
    if record.get(key) is None:
        raise ConfigError(f"{source}: missing required field '{key}' ({fmt} format)")
    value = record[key]
    text = value if isinstance(value, str) else json.dumps(value)
    if not text.strip():
        raise ConfigError(f"{source}: field '{key}' is empty")
    return text


def _references(value: Any, key: str, source: str) -> list[str | int | float] | None:
    """A list ground truth as given (None for any other value); ConfigError naming ``source`` when it is empty or
    holds something other than strings and numbers."""
    if not isinstance(value, list):
        return None
    if not value:
        raise ConfigError(f"{source}: field '{key}' is an empty list")
    bad = [item for item in value if isinstance(item, bool) or not isinstance(item, (str, int, float))]
    if bad:
        raise ConfigError(f"{source}: field '{key}' must hold strings or numbers, got {json.dumps(bad[0])[:40]}")
    return list(value)


def problem_type_of(name: Any) -> str | None:
    """The canonical spelling (one of ``DATA_PROBLEM_TYPES``) of a record's ``problem_type``, or None when it
    names no known type."""
    return TEMPORAL_GROUNDING if is_temporal_grounding(name) else canonical_problem_type(name)


def _parse_record(record: Any, source: str, root: Path) -> VLMSample:
    """One decoded record -> VLMSample (format detected as in the module notes); ConfigError naming ``source``."""
    if not isinstance(record, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(record).__name__}")
    if "solution" in record:
        fmt, truth = "Video-R1", "solution"
    elif "answer" in record:
        fmt, truth = "EasyR1", "answer"
    else:
        raise ConfigError(f"{source}: missing required field 'solution' (Video-R1 format) or 'answer' "
                          f"(EasyR1 format)")
    question = _text(record, "problem", source, fmt)
    solution = _text(record, truth, source, fmt)
    references = _references(record[truth], truth, source)
    raw_type = record.get("problem_type")
    if raw_type is None and fmt == "Video-R1":
        raise ConfigError(f"{source}: missing required field 'problem_type' (Video-R1 format)")
    problem_type = None if raw_type is None else problem_type_of(raw_type)
    if raw_type is not None and problem_type is None:
        raise ConfigError(f"{source}: unknown problem_type {json.dumps(raw_type)}; valid: "
                          f"{', '.join(DATA_PROBLEM_TYPES)}")
    options = record.get("options") or []
    if not isinstance(options, list) or not all(isinstance(o, (str, int, float)) for o in options):
        raise ConfigError(f"{source}: field 'options' must be a list of strings")
    media: dict[str, list[str]] = {"image": [], "video": []}
    if record.get("path") is not None:
        kind = str(record.get("data_type", "")).lower()
        if kind not in media:
            raise ConfigError(f"{source}: field 'data_type' must be 'image' or 'video' when 'path' is given, got "
                              f"{json.dumps(record.get('data_type'))}")
        media[kind] += _media_list(record["path"], "path", source)
    elif record.get("data_type") is not None and record.get("images") is None and record.get("videos") is None:
        raise ConfigError(f"{source}: missing required field 'path' (data_type is {json.dumps(record['data_type'])})")
    for key, kind in (("images", "image"), ("videos", "video")):
        if record.get(key) is not None:
            media[kind] += _media_list(record[key], key, source)
    return VLMSample(
        question=question, problem_type=problem_type, options=[str(o) for o in options], solution=solution,
        references=references,
        images=[Path(os.path.abspath(root / Path(p).expanduser())) for p in media["image"]],
        videos=[Path(os.path.abspath(root / Path(p).expanduser())) for p in media["video"]],
        source=source, extra={k: v for k, v in record.items() if k not in _CONSUMED})


def read_samples(path: str | os.PathLike, root: str | os.PathLike) -> list[VLMSample]:
    """Every sample of a Video-R1 / EasyR1 file (JSON list or JSONL), media paths resolved against ``root`` (both
    paths, and the media paths, may start with ``~``, the home folder).

    Raises ConfigError, naming ``file:line``, for a missing or empty file, malformed JSON, a record that is not an
    object, a missing or blank required field, an unknown problem type (the message lists the valid ones) or a bad
    media field; naming the file, when it is one JSON object (not a list of records, nor a one-line record); and,
    naming ``data.root``, when the file references media and not one of them exists (a wrong root). Single missing
    files are left to ``data.on_bad_media`` when they are decoded.
    """
    name, root = str(path), Path(root).expanduser()
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8-sig")
    except FileNotFoundError as err:
        raise ConfigError(f"data file not found: {name}{cwd_hint(name)}") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read data file {name}: {err}") from err
    is_list = text.lstrip().startswith("[")
    if not is_list and _lone_object(text):
        raise ConfigError(f"{name}: holds a single JSON object, not records: a data file holds a JSON list of records "
                          "or one record object per line (JSONL)")
    records = _json_list(text, name) if is_list else _json_lines(text, name)
    if not records:
        raise ConfigError(f"{name}: no records (the data file is empty)")
    samples = [_parse_record(record, f"{name}:{line}", root) for line, record in records]
    media = [p for s in samples for p in s.images + s.videos]
    if media and not any(p.exists() for p in media):
        raise ConfigError(f"{name}: none of its {len(media)} image/video files exist (first: {media[0]}); check "
                          f"'data.root' ({os.path.abspath(root)})")
    return samples


def read_task_split(source: str, split: str, n: int | None, start: int, cache_dir: str, key: str,
                    total: int | None = None) -> list[VLMSample]:
    """The samples of ``source`` (``task:NAME[,NAME...]``, registered synthetic QA tasks such as ``shapes_qa``):
    ``n`` items per kind of each task from index ``start`` of ``split`` (or, with ``n`` None, the fewest per kind
    that give ``total`` samples), generated once under ``cache_dir`` (:func:`mmgrpo.tasks.shapes_qa.cached_split`).
    A name that is not a registered QA task raises ConfigError naming ``key``."""
    from mmgrpo.registry import TASKS
    from mmgrpo.tasks.shapes_qa import QATask, cached_split

    names = tuple(name.strip() for name in source[len("task:"):].split(","))
    qa_names = [name for name in TASKS.names() if isinstance(TASKS.get(name), QATask)]
    for name in names:
        if name not in qa_names:
            raise ConfigError(f"bad value for '{key}': {name!r} is not a registered QA task (QA tasks: "
                              f"{', '.join(qa_names)})")
    if n is None:
        n = math.ceil(total / sum(len(TASKS.get(name).kinds) for name in names))
    folder = cached_split(cache_dir, split, n, names, start)
    return read_samples(folder / f"{split}.jsonl", folder)


def labelled(options: list[str]) -> bool:
    """Whether the options carry the letter labels A, B, C, ... in order (``A. x``, ``(A) x``, ``A) x``, ``A: x``;
    :func:`option_label_ends`), so they are shown as given; otherwise they are all labelled anew, their texts whole
    (``["a.m.", "p.m."]`` are texts)."""
    return option_label_ends(options) is not None


def format_options(options: list[str]) -> str:
    """``"\\nOptions:\\nA. ...\\nB. ..."``, or ``""`` without options.

    Options that carry the labels A, B, C, ... in order (``A. x``, ``(A) x``, ``A) x``, ``A: x``) are kept as given,
    as in Video-R1 data; otherwise they are labelled A, B, C, ... in order."""
    if not options:
        return ""
    if not labelled(options):
        if len(options) > 26:
            raise ConfigError(f"cannot label {len(options)} options with the letters A-Z")
        options = [f"{chr(ord('A') + i)}. {o}" for i, o in enumerate(options)]
    return "\nOptions:\n" + "\n".join(options)


def rotate_options(sample: VLMSample, shift: int) -> VLMSample:
    """``sample`` with its option texts moved ``shift`` places up (option ``k`` gets the text of option
    ``k + shift``, wrapping around), relabelled A, B, C, ... and its solution letter moved with the correct text.
    CircularEval (MMBench) asks every rotation: a model that answers by letter position cannot pass them all.
    Raises ValueError when the sample has no options or its solution is not one of their letters."""
    n = len(sample.options)
    inner = last_tagged(sample.solution)
    letter = normalize_choice(sample.solution if inner is None else inner)
    labels = [chr(ord("A") + k) for k in range(n)]
    if letter not in labels:
        raise ValueError(f"{sample.source}: cannot rotate the options, the solution {sample.solution!r} is not one "
                         f"of the option letters {labels}")
    ends = option_label_ends(sample.options) or [0] * n  # as the prompt shows them (format_options)
    texts = [o[end:].strip() for o, end in zip(sample.options, ends)]
    shift %= n
    moved = labels[(labels.index(letter) - shift) % n]
    solution = moved if inner is None else f"<answer>{moved}</answer>"
    return replace(sample, options=[f"{labels[k]}. {texts[(k + shift) % n]}" for k in range(n)], solution=solution)


def render_prompt(sample: VLMSample, template: str, type_instructions: dict[str, str] | None = None) -> str:
    """The prompt text: ``template`` (``data.prompt_template``) with ``{question}`` replaced by the problem,
    ``{options}`` by :func:`format_options` and ``{type_instruction}`` by ``type_instructions[problem_type]``
    (``data.type_instructions``; empty when the sample's type has no entry or the sample has no type). Other braces
    are left alone and inserted text is not scanned again.

    Video-R1 appends ``"Options:\\n"`` and one option per line to multiple-choice problems only, with no line break
    after the problem; here any sample with options gets them, on a new line after the problem. Raises ConfigError
    when the template has no ``{question}``, no ``{options}`` while the sample has options, or no
    ``{type_instruction}`` while the sample's type has an instruction (either would be lost); and, naming the
    sample, when it has more than 26 options to label, or when the prompt has ``<image>``/``<video>`` markers
    that do not match its media or holds a vision special token such as ``<|image_pad|>`` (:func:`chat_content`).
    """
    if "{question}" not in template:
        raise ConfigError("bad value for 'data.prompt_template': it must contain {question}")
    if sample.options and "{options}" not in template:
        raise ConfigError(f"bad value for 'data.prompt_template': it has no {{options}}, but {sample.source} has "
                          f"options")
    instruction = (type_instructions or {}).get(sample.problem_type or "", "")
    if instruction and "{type_instruction}" not in template:
        raise ConfigError(f"bad value for 'data.prompt_template': it has no {{type_instruction}}, but "
                          f"data.type_instructions has one for {sample.problem_type!r} ({sample.source})")
    try:
        options = format_options(sample.options)
        values = {"question": sample.question, "options": options, "type_instruction": instruction}
        prompt = _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
        chat_content(prompt, len(sample.images), len(sample.videos))
    except ValueError as err:  # ConfigError is one
        raise ConfigError(f"{sample.source}: {err}") from err
    return prompt


def chat_content(text: str, n_images: int, n_videos: int) -> list[dict[str, str]]:
    """The user turn's content items (``{"type": "image"}``, ``{"type": "video"}``, ``{"type": "text", "text"}``)
    for a prompt with ``n_images`` images and ``n_videos`` videos.

    Text with ``<image>``/``<video>`` markers (EasyR1) is split at them and the k-th ``<image>`` marker becomes the
    k-th image (likewise videos), the markers dropped and empty text pieces left out; text without markers gets
    every image, then every video, then the text. Raises ValueError when there are markers and their counts differ
    from the media counts, or when the text holds a vision special token (``<|image_pad|>``, ...)."""
    special = _VISION_SPECIAL.search(text)
    if special:
        raise ValueError(f"the prompt holds {special.group()}, a vision special token that the processor fills with "
                         f"pixels: use <image> / <video> markers to place the media")
    parts = _MARKER.split(text)
    markers = parts[1::2]
    if not markers:
        media = [{"type": "image"} for _ in range(n_images)] + [{"type": "video"} for _ in range(n_videos)]
        return [*media, {"type": "text", "text": text}]
    found = (markers.count("<image>"), markers.count("<video>"))
    if found != (n_images, n_videos):
        raise ValueError(f"the prompt has {found[0]} <image> and {found[1]} <video> markers but the sample has "
                         f"{n_images} images and {n_videos} videos (with markers, every image and video needs one)")
    return [{"type": part[1:-1]} if i % 2 else {"type": "text", "text": part}
            for i, part in enumerate(parts) if part]


def reward_meta(sample: VLMSample) -> dict[str, Any]:
    """The per-sample ``meta`` the rewards read: the record's extra fields, then ``solution`` (as given), ``answer``
    (the ground truth without ``<answer>`` tags), ``options``, ``source`` and ``problem_type``. ``problem_type`` is
    left out when the sample has none, so a reward's own default (``accuracy``'s ``default_type``) applies. A list
    ground truth (:attr:`VLMSample.references`) is passed as the list in both ``solution`` and ``answer``."""
    inner = last_tagged(sample.solution)
    meta = dict(sample.extra)
    meta.update(solution=sample.solution, answer=(sample.solution if inner is None else inner).strip(),
                options=list(sample.options), source=sample.source)
    if sample.references is not None:
        meta.update(solution=list(sample.references), answer=list(sample.references))
    if sample.problem_type is not None:
        meta["problem_type"] = sample.problem_type
    return meta
