"""VLM judges: a vision-language model prompted to score samples.

- ``vlm_judge`` (pointwise): one judgement per sample, with a preset prompt and parser:
  ``score`` (a rating "Score: N" in a range), ``artifacts`` (MagicAssessor-style artifact list as JSON) or
  ``video_align`` (VideoAlign-style VQ / MQ / TA ratings of a video).
- ``vlm_pairwise`` (groupwise): the judge compares every pair of samples of a prompt group; each sample's reward is
  its win rate (Pref-GRPO, through :func:`~mmgrpo.rewards.winrate.pairwise_win_rate`). Presets: ``better`` ("Better:
  A / B / tie") and ``unified_reward`` (UnifiedReward's "Image 1 is better than Image 2." conclusions).

The judge itself is a :class:`JudgeBackend`: a local transformers model (:class:`TransformersJudge`, Qwen2-VL family,
loaded once, batched greedy generation, tensors in) or any OpenAI-compatible chat-completions endpoint such as vLLM
(:class:`OpenAIJudge`, images as in-memory PNG data URLs). Judges answer in free text, so every reward logs
``parse_fail`` (the fraction of unparsable answers) next to its score.
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image

from mmgrpo.registry import REWARDS

from .base import GROUPWISE, POINTWISE, Reward, RewardBatch
from .checks import as_rgb_images, as_rgb_videos
from .clip_models import LOAD_ERRORS, one_line, resolve_device, resolve_dtype
from .remote import RemoteError, request_json
from .server import bearer_token
from .video import sample_frame_indices
from .winrate import pairwise_win_rate

JudgeContent = list[Any]
"""One judge request, the user message as pieces in order: text (str), images (3, H, W) and videos (T, 3, H, W)
as float tensors in [0, 1]."""

PARSE_FAIL_POLICIES = ("nan", "zero", "mid")
VISION_WORDS = ("image", "video", "vision")
NUMBER = r"[-+]?\d+(?:\.\d+)?"

SCORE_TEMPLATE = (
    'You are an expert judge of generated content. The {subject} above was made for this request: "{prompt}".\n'
    "Rate how well it fulfils the request, and its overall quality, from {lo} (worst) to {hi} (best).\n"
    "Reply with exactly one line of the form: Score: N"
)
ARTIFACTS_TEMPLATE = (
    'Inspect the {subject} above, generated for the request "{prompt}", for artifacts: anatomy errors (extra or '
    "missing fingers or limbs, distorted faces), broken or melted objects, garbled text, unnatural textures, "
    "physically impossible lighting or shadows, and in videos flicker or objects that morph or vanish.\n"
    'Reply with JSON only: {"artifacts": [{"type": "<short name>", "severity": <1 minor, 2 clear or 3 severe>}]}, '
    'with an empty list when there are none.'
)
VIDEO_ALIGN_TEMPLATE = (
    'Watch the video above, generated for the request "{prompt}". Rate it on three criteria from {lo} to {hi}:\n'
    "VQ, visual quality (sharpness, aesthetics, no artifacts); MQ, motion quality (smooth, natural, physically "
    "plausible motion); TA, text alignment (how well it matches the request).\n"
    "Reply with exactly three lines: VQ: N, MQ: N and TA: N"
)
PRESETS = {"score": SCORE_TEMPLATE, "artifacts": ARTIFACTS_TEMPLATE, "video_align": VIDEO_ALIGN_TEMPLATE}
VIDEO_ALIGN_KEYS = ("VQ", "MQ", "TA")
SUBSCORES = {"score": ("score", "parse_fail"), "artifacts": ("score", "artifacts", "parse_fail"),
             "video_align": (*VIDEO_ALIGN_KEYS, "score", "parse_fail")}
"""What :class:`VLMJudge` returns for each preset."""

PAIRWISE_TEMPLATE = (
    'Two {subject}s, A and B, were made for this request: "{prompt}".\n'
    "Which one fulfils the request better, with higher overall quality?\n"
    "Reply with exactly one line: Better: A, Better: B or Better: tie"
)
UNIFIED_REWARD_PAIRWISE_TEMPLATE = (
    "You are given a text caption and two {subject}s generated from it. Compare them on two criteria:\n"
    "1. Alignment with the caption: how accurately each {subject} shows the objects, attributes and relations the "
    "caption describes.\n"
    "2. Overall quality: clarity, detail, colour accuracy and aesthetic appeal.\n"
    "Pick the {subject} that follows the caption better while having the higher quality.\n"
    'Give a clear conclusion such as "{Subject} 1 is better than {Subject} 2.", "{Subject} 2 is better than '
    '{Subject} 1." or "Both {subject}s are equally good."\n'
    "Text Caption: [{prompt}]"
)
VERDICTS = {"A": 1.0, "B": 0.0, "tie": 0.5}
"""P(first beats second) of each pairwise verdict: ``A`` (the first sample shown wins), ``B`` or ``tie``."""
BETTER_PATTERNS = {
    "A": r"\bbetter\s*[:=]\s*\**\s*A\b|\A[\s*.\"']*A[\s*.\"']*\Z",
    "B": r"\bbetter\s*[:=]\s*\**\s*B\b|\A[\s*.\"']*B[\s*.\"']*\Z",
    "tie": r"\bbetter\s*[:=]\s*\**\s*tie\b|\A[\s*.\"']*tie[\s*.\"']*\Z",
}
"""``Better: A`` / ``B`` / ``tie`` (``better = **B**`` too), or an answer that is just ``A``, ``B`` or ``tie``."""
_SUBJECT = r"\b(?:image|video|response)\s*"
UNIFIED_REWARD_PATTERNS = {
    "A": rf"{_SUBJECT}1\**\s+is\s+(?:the\s+)?better\b|{_SUBJECT}2\**\s+is\s+(?:the\s+)?worse\b",
    "B": rf"{_SUBJECT}2\**\s+is\s+(?:the\s+)?better\b|{_SUBJECT}1\**\s+is\s+(?:the\s+)?worse\b",
    "tie": r"\bequally\s+(?:good|bad)\b",
}
"""UnifiedReward's conclusions: ``Image 1 is better than Image 2.``, ``Image 2 is better ...`` (also ``is the
better``, ``... is worse``, ``Video`` / ``Response`` and bold markup), ``Both images are equally good.``"""


@dataclass(frozen=True)
class PairwisePreset:
    """How a pairwise judge is asked and read.

    - ``template``: the prompt (see :class:`VLMPairwise`'s ``template``).
    - ``labels``: the names of the first and second sample in the request (``Image A:`` / ``Image 1:``).
    - ``patterns``: verdict (``A``, ``B``, ``tie``) -> case-insensitive regex of an answer giving it.
    """

    template: str
    labels: tuple[str, str]
    patterns: Mapping[str, str]


PAIRWISE_PRESETS = {
    "better": PairwisePreset(PAIRWISE_TEMPLATE, ("A", "B"), BETTER_PATTERNS),
    "unified_reward": PairwisePreset(UNIFIED_REWARD_PAIRWISE_TEMPLATE, ("1", "2"), UNIFIED_REWARD_PATTERNS),
}


def fill(template: str, **values: Any) -> str:
    """``template`` with each ``{name}`` of ``values`` replaced, in one pass (a value's own text, such as a prompt
    holding ``{hi}``, stays as it is); other braces (JSON examples) are left alone."""
    pattern = "|".join(re.escape("{" + name + "}") for name in values)
    return re.sub(pattern, lambda m: str(values[m.group(0)[1:-1]]), template) if values else template


# ---------------------------------------------------------------------------------------------------- parsers
def parse_score(text: str, lo: float, hi: float, label: str = "Score") -> float | None:
    """The number after the last ``label:`` in ``text`` (``Score: 4``, ``score = **4.5**``, ``Score: 4/5``), or
    the whole answer when it is just a number; None when there is none or it lies outside [lo, hi]."""
    found = re.findall(rf"\b{label}\s*[:=]\s*\**\s*({NUMBER})", text, flags=re.IGNORECASE)
    bare = text.strip().strip("*.").strip()
    if found:
        value = float(found[-1])
    elif re.fullmatch(NUMBER, bare):
        value = float(bare)
    else:
        return None
    return value if lo <= value <= hi else None


def check_patterns(patterns: Mapping[str, str], reward: str) -> dict[str, str]:
    """``patterns`` (verdict -> regex) as a dict, after checking that it gives ``A`` and ``B`` (``tie`` optional),
    nothing else, and that every regex compiles; ``ValueError`` naming ``reward`` otherwise."""
    patterns = dict(patterns)
    if not {"A", "B"} <= set(patterns) <= set(VERDICTS):
        raise ValueError(f"{reward}: answer_patterns needs the verdicts 'A' and 'B' (and optionally 'tie'), "
                         f"nothing else; got {sorted(patterns)}")
    for verdict, pattern in patterns.items():
        try:
            re.compile(pattern)
        except (re.error, TypeError) as err:
            raise ValueError(f"{reward}: answer_patterns['{verdict}'] is not a regex: {err}") from None
    return patterns


def parse_choice(text: str, patterns: Mapping[str, str] = BETTER_PATTERNS) -> float | None:
    """P(A beats B) from a pairwise answer: 1 for the verdict ``A``, 0 for ``B``, 0.5 for ``tie``, where
    ``patterns`` maps each verdict to a case-insensitive regex. The verdict matched last in ``text`` wins (a
    judge's conclusion comes after its reasoning); None when no pattern matches, or two verdicts match there."""
    hits = [(m.start(), verdict) for verdict, pattern in patterns.items()
            for m in re.finditer(pattern, text, flags=re.IGNORECASE)]
    if not hits:
        return None
    last = max(start for start, _ in hits)
    verdicts = {verdict for start, verdict in hits if start == last}
    return VERDICTS[verdicts.pop()] if len(verdicts) == 1 else None


def parse_artifacts(text: str) -> list[float] | None:
    """The severities (each 1, 2 or 3) of the first JSON object in ``text`` with an ``artifacts`` list
    (``{"artifacts": [{"type": "extra fingers", "severity": 2}]}``; code fences around it are fine); None when there
    is no such object or an entry has no numeric severity in [1, 3]."""
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"\{", text)):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("artifacts"), list):
            severities = []
            for item in obj["artifacts"]:
                severity = item.get("severity") if isinstance(item, dict) else None
                if isinstance(severity, bool) or not isinstance(severity, (int, float)) or not 1 <= severity <= 3:
                    return None
                severities.append(float(severity))
            return severities
    return None


# ---------------------------------------------------------------------------------------------------- backends
@runtime_checkable
class JudgeBackend(Protocol):
    """What a judge rewards need from a model: answers to a batch of requests, in order, as text.

    A backend whose ``generate`` also takes ``video_metadata`` receives, for the requests' videos in order of
    appearance, where each video's frames come from (:func:`judge_video_metadata`)."""

    def generate(self, requests: Sequence[JudgeContent]) -> list[str]:
        """One answer per request (see :data:`JudgeContent`)."""
        ...


class TransformersJudge:
    """A judge run locally with transformers: ``AutoModelForImageTextToText`` + ``AutoProcessor`` (Qwen2-VL,
    Qwen2.5-VL and other chat VLMs), loaded once. Requests are generated in batches (left padding, greedy). Images and
    videos go to the processor as float tensors (no PIL image, no file), videos with their frames' metadata, from
    which Qwen2.5-VL takes the frame rate it encodes and Qwen3-VL the timestamps it writes into the prompt (without
    it the processor assumes 24 fps). Vision special tokens are suppressed during generation (a sampled image token
    breaks the next forward).

    Args:
        model: hub id or local folder of the model.
        processor: hub id or local folder of its processor; None = ``model``.
        device: where the model runs; None = CUDA when available, else CPU.
        dtype: weights' dtype: ``float32``, ``float16`` or ``bfloat16``.
        max_new_tokens: answer length limit, in tokens.
        batch_size: requests per ``generate`` call.
    """

    def __init__(self, model: str, processor: str | None = None, device: str | None = None, dtype: str = "bfloat16",
                 max_new_tokens: int = 64, batch_size: int = 8):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.device = resolve_device(device)
        try:
            self.processor = AutoProcessor.from_pretrained(processor or model)
            self.model = AutoModelForImageTextToText.from_pretrained(model, dtype=resolve_dtype(dtype))
        except LOAD_ERRORS as err:
            raise RuntimeError(f"vlm judge: cannot load '{model}' with transformers: {one_line(err)}") from None
        self.model.eval().requires_grad_(False).to(self.device)
        self.processor.tokenizer.padding_side = "left"
        config = self.model.config.to_dict()
        ids = {v for k, v in config.items() if k.endswith("token_id") and any(w in k for w in VISION_WORDS)}
        ids |= {i for t, i in self.processor.tokenizer.get_added_vocab().items() if any(w in t for w in VISION_WORDS)}
        self.suppress = sorted(i for i in ids if isinstance(i, int))
        self.max_new_tokens, self.batch_size = int(max_new_tokens), int(batch_size)

    def to(self, device: str | torch.device) -> TransformersJudge:
        """Move the model."""
        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    def inputs(self, requests: Sequence[JudgeContent], video_metadata: Sequence[dict] | None = None) -> Any:
        """The processor's batch (left-padded, on the model's device) for ``requests``; ``video_metadata``: one
        dict per video of the requests, in order (:func:`judge_video_metadata`), or None."""
        texts = [self.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str)
                                          else {"type": "image" if p.ndim == 3 else "video"} for p in content]}],
            tokenize=False, add_generation_prompt=True) for content in requests]
        images = [p.cpu() for c in requests for p in c if torch.is_tensor(p) and p.ndim == 3]
        videos = [p.cpu() for c in requests for p in c if torch.is_tensor(p) and p.ndim == 4]
        extra = {"video_metadata": list(video_metadata)} if videos and video_metadata is not None else {}
        return self.processor(text=texts, images=images or None, videos=videos or None, padding=True,
                              return_tensors="pt", do_rescale=False, **extra).to(self.device)

    @torch.no_grad()
    def generate(self, requests: Sequence[JudgeContent], video_metadata: Sequence[dict] | None = None) -> list[str]:
        answers: list[str] = []
        seen = 0  # videos of the earlier chunks
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            count = sum(torch.is_tensor(p) and p.ndim == 4 for c in chunk for p in c)
            inputs = self.inputs(chunk, None if video_metadata is None else video_metadata[seen:seen + count])
            seen += count
            out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                      suppress_tokens=self.suppress)
            answers += self.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        return answers


def png_data_url(image: torch.Tensor) -> str:
    """A (3, H, W) image in [0, 1] as a ``data:image/png;base64,...`` URL, encoded in memory."""
    pixels = (image.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class OpenAIJudge:
    """A judge behind any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, SGLang, LMDeploy, a hosted
    API). Greedy (temperature 0). Images go as PNG data URLs made in memory; a video goes as its sampled frames, one
    image each, in order. Requests run ``concurrency`` at a time (the server batches them).

    Args:
        base_url: the API root, as for the OpenAI client: ``http://127.0.0.1:8000/v1``.
        model: the served model name.
        api_key_env: environment variable holding the API key (sent as a bearer token); None = no key.
        max_tokens: answer length limit, in tokens.
        timeout: socket timeout of each request, in seconds.
        retries: extra attempts after a connection failure, a timeout or a 429/502/503/504 answer.
        backoff: seconds before the first retry, doubled after each attempt.
        concurrency: requests in flight at once.
    """

    def __init__(self, base_url: str, model: str, api_key_env: str | None = None, max_tokens: int = 256,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 1.0, concurrency: int = 8):
        self.endpoint = base_url.rstrip("/") + "/chat/completions"
        self.model, self.max_tokens = model, int(max_tokens)
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.concurrency = max(1, int(concurrency))
        key = bearer_token(api_key_env, "vlm judge") if api_key_env else None
        if api_key_env and not key:
            raise ValueError(f"vlm judge: the environment variable {api_key_env} (api_key_env) is not set")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def _message(self, content: JudgeContent) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        for piece in content:
            if isinstance(piece, str):
                parts.append({"type": "text", "text": piece})
            else:
                frames = [piece] if piece.ndim == 3 else list(piece)
                parts += [{"type": "image_url", "image_url": {"url": png_data_url(f)}} for f in frames]
        return parts

    def _answer(self, content: JudgeContent) -> str:
        payload = {"model": self.model, "messages": [{"role": "user", "content": self._message(content)}],
                   "max_tokens": self.max_tokens, "temperature": 0.0}
        answer = request_json(self.endpoint, payload, headers=self.headers, timeout=self.timeout,
                              retries=self.retries, backoff=self.backoff)
        try:
            return answer["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise RemoteError(f"POST {self.endpoint} answered without choices[0].message.content: "
                              f"{one_line(json.dumps(answer), 200)}") from None

    def generate(self, requests: Sequence[JudgeContent]) -> list[str]:
        if self.concurrency == 1 or len(requests) <= 1:
            return [self._answer(c) for c in requests]
        with ThreadPoolExecutor(min(self.concurrency, len(requests)), thread_name_prefix="judge") as pool:
            return list(pool.map(self._answer, requests))


BACKENDS = {"transformers": TransformersJudge, "openai": OpenAIJudge}


def backend_class(name: str) -> type:
    """The judge backend class called ``name``; ValueError naming the choices otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} (or a JudgeBackend); got {name!r}")
    return BACKENDS[name]


# ---------------------------------------------------------------------------------------------------- rewards
def judge_frame_indices(total: int, input_fps: float, fps: float, max_frames: int) -> torch.Tensor:
    """(F,) int64 indices of the frames a judge sees of a clip of ``total`` frames at ``input_fps``: resampled to
    ``fps`` (evenly spaced), at most ``max_frames``, an even count of at least 2 (Qwen2-VL encodes frames in pairs;
    a single frame is repeated). The count ``total / input_fps * fps`` is floored to even, as qwen-vl-utils'
    ``smart_nframes`` does (its ``min_frames`` of 4 aside)."""
    if total < 2:
        return torch.zeros(2, dtype=torch.long)
    count = max(2, min(math.floor(total / input_fps * fps), max_frames, total))
    return sample_frame_indices(total, count - count % 2)


def judge_video_metadata(total: int, input_fps: float, indices: torch.Tensor) -> dict[str, Any]:
    """Where a judge's frames come from, as transformers' ``VideoMetadata`` fields: frames ``indices`` (F,) of a
    clip of ``total`` frames at ``input_fps`` (frames per second). The processor derives the frame rate the model
    sees, ``F / total * input_fps``, and the frames' times, ``index / input_fps`` seconds, from it."""
    return {"total_num_frames": int(total), "fps": float(input_fps), "frames_indices": indices.tolist(),
            "duration": total / float(input_fps)}


def empty_scores(keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """The result of scoring an empty batch: a (0,) float64 tensor for each of ``keys``."""
    return {key: torch.empty(0, dtype=torch.float64) for key in keys}


class _JudgeReward(Reward):
    """Shared by the judge rewards: the backend, and each sample turned into what the judge sees."""

    name = "vlm_judge"

    @classmethod
    def components(cls, args: dict[str, Any]) -> list[tuple[str | None, str, Callable[[], Any]]]:
        """The judge backend (see :meth:`Reward.components`)."""
        return [("backend", "backend_args", lambda: backend_class(args.get("backend", "transformers")))]

    def __init__(self, backend: str | JudgeBackend, backend_args: dict[str, Any] | None, fps: float,
                 input_fps: float | None, max_frames: int):
        if isinstance(backend, JudgeBackend):
            self.backend = backend
        else:
            try:
                backend_type = backend_class(backend)
            except ValueError as err:
                raise ValueError(f"{self.name}: {err}") from None
            self.backend = backend_type(**(backend_args or {}))
        if fps <= 0 or max_frames < 2 or (input_fps is not None and input_fps <= 0):
            raise ValueError(f"{self.name}: needs fps > 0, input_fps > 0 and max_frames >= 2")
        self.fps, self.input_fps, self.max_frames = float(fps), input_fps, int(max_frames)
        self._video_metadata: dict[int, dict[str, Any]] = {}  # id of a video's frames -> judge_video_metadata

    def ask(self, requests: list[JudgeContent]) -> list[str]:
        """The backend's answers to ``requests``, made of :meth:`subjects`' items; a backend whose ``generate`` takes
        ``video_metadata`` gets the metadata of the requests' videos, in order."""
        if self._video_metadata and "video_metadata" in inspect.signature(self.backend.generate).parameters:
            metadata = [self._video_metadata[id(p)] for c in requests for p in c if torch.is_tensor(p) and p.ndim == 4]
            return self.backend.generate(requests, video_metadata=metadata)
        return self.backend.generate(requests)

    def to(self, device: str | torch.device) -> _JudgeReward:
        """Move a local judge model; a remote endpoint has nothing to move."""
        if isinstance(self.backend, TransformersJudge):
            self.backend.to(device)
        return self

    def subjects(self, batch: RewardBatch) -> tuple[str, list[Any]]:
        """What is judged: ``("image", images)``, ``("video", frames)`` or ``("response", completions)``. The
        frames' :func:`judge_video_metadata` are kept for :meth:`ask`."""
        self._video_metadata = {}
        if batch.images is not None:
            return "image", list(as_rgb_images(batch.images, self.name).cpu())
        if batch.videos is not None:
            videos = as_rgb_videos(batch.videos, self.name).cpu()
            frames = []
            for video, meta in zip(videos, batch.meta):
                input_fps = meta.get("fps", self.input_fps)
                if input_fps is None:
                    raise ValueError(f"{self.name}: the videos' frame rate is unknown; set input_fps or meta['fps']")
                indices = judge_frame_indices(len(video), float(input_fps), self.fps, self.max_frames)
                frames.append(video[indices])
                self._video_metadata[id(frames[-1])] = judge_video_metadata(len(video), float(input_fps), indices)
            return "video", frames
        if batch.completions is not None:
            return "response", list(batch.completions)
        raise ValueError(f"{self.name}: the batch has no images, videos or completions to judge")


@REWARDS.register("vlm_judge", kind=POINTWISE, modality="any",
                  description="a VLM prompted to score each sample: 1-5 rating, artifact list (JSON) or VQ/MQ/TA")
class VLMJudge(_JudgeReward):
    """A vision-language judge that scores each sample alone (images, videos or text completions).

    Presets (the prompt and how its answer is read):

    - ``score``: "Score: N" with N in ``score_range``; ``score`` is N, normalised to [0, 1] unless
      ``normalize`` is false.
    - ``artifacts`` (MagicAssessor style): the judge lists artifacts as JSON,
      ``{"artifacts": [{"type": "extra fingers", "severity": 2}, ...]}`` with severity 1 (minor), 2 (clear) or
      3 (severe); ``score = clip(1 - artifact_penalty * sum of severities, 0, 1)`` and ``artifacts`` is their
      count.
    - ``video_align`` (VideoAlign style, videos only): "VQ: N", "MQ: N", "TA: N" (visual quality, motion quality,
      text alignment) in ``score_range``; returns ``VQ``, ``MQ``, ``TA`` (normalised unless ``normalize`` is false)
      and ``score``, their mean. Frames are sampled at the judge's training frame rate ``fps`` (2).

    Every answer is parsed; ``parse_fail`` is 1 for an unparsable answer, which scores ``on_parse_fail``:
    ``nan`` (does not apply), ``zero`` (0) or ``mid`` (the middle of the score range: 0.5 when normalised).

    Args:
        preset: ``score``, ``artifacts`` or ``video_align``.
        backend: ``transformers`` (a local model) or ``openai`` (an OpenAI-compatible endpoint), or a
            :class:`JudgeBackend` instance (from Python).
        backend_args: constructor arguments of the backend (:class:`TransformersJudge` / :class:`OpenAIJudge`).
        template: the prompt, replacing the preset's; ``{prompt}``, ``{subject}`` (image, video or response),
            ``{lo}`` and ``{hi}`` are filled in. The answer must still follow the preset's format.
        score_range: [lo, hi] of the ratings (``score`` and ``video_align``).
        normalize: map ratings to [0, 1]; false keeps them raw.
        artifact_penalty: score lost per severity point (``artifacts``).
        on_parse_fail: ``nan``, ``zero`` or ``mid``.
        fps: frames per second the judge sees (2 for Qwen2-VL and VideoAlign).
        input_fps: frame rate of the batch's videos when ``meta["fps"]`` does not give it.
        max_frames: most frames per video the judge sees.
    """

    kind = POINTWISE
    modality = "any"

    def __init__(self, preset: str = "score", backend: str | JudgeBackend = "transformers",
                 backend_args: dict[str, Any] | None = None, template: str | None = None,
                 score_range: Sequence[float] = (1, 5), normalize: bool = True, artifact_penalty: float = 0.1,
                 on_parse_fail: str = "nan", fps: float = 2.0, input_fps: float | None = None, max_frames: int = 16):
        if preset not in PRESETS:
            raise ValueError(f"vlm_judge: preset must be one of {sorted(PRESETS)}; got '{preset}'")
        if on_parse_fail not in PARSE_FAIL_POLICIES:
            raise ValueError(f"vlm_judge: on_parse_fail must be one of {PARSE_FAIL_POLICIES}; got '{on_parse_fail}'")
        lo, hi = (float(v) for v in score_range)
        if not lo < hi:
            raise ValueError(f"vlm_judge: score_range must be [lo, hi] with lo < hi; got {list(score_range)}")
        if artifact_penalty <= 0:
            raise ValueError(f"vlm_judge: artifact_penalty must be > 0; got {artifact_penalty}")
        super().__init__(backend, backend_args, fps, input_fps, max_frames)
        self.preset, self.template = preset, template or PRESETS[preset]
        self.lo, self.hi, self.normalize = lo, hi, bool(normalize)
        self.artifact_penalty, self.on_parse_fail = float(artifact_penalty), on_parse_fail

    def _on_fail(self, bottom: float, top: float) -> float:
        """The score of an unparsable answer on a [bottom, top] scale."""
        return {"nan": math.nan, "zero": 0.0, "mid": (bottom + top) / 2}[self.on_parse_fail]

    def _rating(self, value: float | None) -> float:
        """A parsed rating on the output scale ([0, 1] when normalised, else raw), or the parse-failure score."""
        if self.normalize:
            return self._on_fail(0.0, 1.0) if value is None else (value - self.lo) / (self.hi - self.lo)
        return self._on_fail(self.lo, self.hi) if value is None else value

    def read(self, answer: str) -> dict[str, float]:
        """The scores of one judge answer (with ``parse_fail``)."""
        if self.preset == "score":
            value = parse_score(answer, self.lo, self.hi)
            return {"score": self._rating(value), "parse_fail": float(value is None)}
        if self.preset == "artifacts":
            severities = parse_artifacts(answer)
            if severities is None:
                return {"score": self._on_fail(0.0, 1.0), "artifacts": math.nan, "parse_fail": 1.0}
            score = min(1.0, max(0.0, 1.0 - self.artifact_penalty * sum(severities)))
            return {"score": score, "artifacts": float(len(severities)), "parse_fail": 0.0}
        values = {k: parse_score(answer, self.lo, self.hi, label=k) for k in VIDEO_ALIGN_KEYS}
        failed = any(v is None for v in values.values())
        out = {k: self._rating(None if failed else v) for k, v in values.items()}
        out["score"] = sum(out.values()) / len(VIDEO_ALIGN_KEYS)
        out["parse_fail"] = float(failed)
        return out

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        keys = SUBSCORES[self.preset]
        if len(batch) == 0:
            return empty_scores(keys)
        subject, items = self.subjects(batch)
        if self.preset == "video_align" and subject != "video":
            raise ValueError(f"vlm_judge: the video_align preset judges videos; this batch has {subject}s")
        requests = []
        for prompt, item in zip(batch.prompts, items):
            text = fill(self.template, prompt=prompt, subject=subject, lo=f"{self.lo:g}", hi=f"{self.hi:g}")
            requests.append([f"Response:\n{item}\n\n{text}"] if subject == "response" else [item, text])
        rows = [self.read(answer) for answer in self.ask(requests)]
        return {key: torch.tensor([row[key] for row in rows], dtype=torch.float64) for key in keys}


@REWARDS.register("vlm_pairwise", kind=GROUPWISE, modality="any",
                  description="Pref-GRPO: a VLM judges all pairs of a prompt group; reward = win rate")
class VLMPairwise(_JudgeReward):
    """Pref-GRPO win rates from a pairwise VLM judge: every unordered pair of samples of a prompt group is shown to
    the judge (first then second) and each sample's ``score`` is its win rate over its G - 1 comparisons. An
    unparsable answer (no verdict found, see :func:`parse_choice`) counts as a tie, 0.5 for both; ``parse_fail`` is
    the fraction of a sample's comparisons without a usable answer. A group of one sample scores NaN.

    Presets (the prompt, the samples' labels and the answer patterns):

    - ``better``: samples ``A`` and ``B``; the judge answers ``Better: A``, ``Better: B`` or ``Better: tie``.
    - ``unified_reward``: UnifiedReward's pairwise task (samples ``1`` and ``2``; caption alignment and quality);
      the judge concludes ``Image 1 is better than Image 2.``, ``Image 2 is better than Image 1.`` or ``Both images
      are equally good.`` (``Video`` / ``Response`` for other subjects).

    Judges favour one position; ``both_orders`` asks each pair twice (first-second and second-first) and averages
    the two verdicts (one failed answer leaves the other), at twice the cost.

    Args:
        preset: ``better`` or ``unified_reward``.
        backend: ``transformers`` or ``openai``, or a :class:`JudgeBackend` instance (from Python).
        backend_args: constructor arguments of the backend.
        template: the prompt, replacing the preset's; ``{prompt}``, ``{subject}`` (image, video or response) and
            ``{Subject}`` (capitalised) are filled in. The answer must still match ``answer_patterns``.
        answer_patterns: verdict -> case-insensitive regex, replacing the preset's: ``A`` (the first sample shown is
            better), ``B`` (the second) and optionally ``tie``. The verdict matched last in the answer counts.
        both_orders: judge each pair in both orders.
        fps: frames per second the judge sees of videos.
        input_fps: frame rate of the batch's videos when ``meta["fps"]`` does not give it.
        max_frames: most frames per video the judge sees.
    """

    name = "vlm_pairwise"
    kind = GROUPWISE
    modality = "any"

    def __init__(self, preset: str = "better", backend: str | JudgeBackend = "transformers",
                 backend_args: dict[str, Any] | None = None, template: str | None = None,
                 answer_patterns: Mapping[str, str] | None = None, both_orders: bool = False, fps: float = 2.0,
                 input_fps: float | None = None, max_frames: int = 16):
        if preset not in PAIRWISE_PRESETS:
            raise ValueError(f"vlm_pairwise: preset must be one of {sorted(PAIRWISE_PRESETS)}; got '{preset}'")
        chosen = PAIRWISE_PRESETS[preset]
        self.patterns = check_patterns(chosen.patterns if answer_patterns is None else answer_patterns, self.name)
        super().__init__(backend, backend_args, fps, input_fps, max_frames)
        self.template, self.labels = template or chosen.template, chosen.labels
        self.both_orders = bool(both_orders)

    def _request(self, subject: str, prompt: str, first: Any, second: Any) -> JudgeContent:
        text = fill(self.template, prompt=prompt, subject=subject, Subject=subject.capitalize())
        one, two = (f"{subject.capitalize()} {label}:" for label in self.labels)
        if subject == "response":
            return [f"{one}\n{first}\n\n{two}\n{second}\n\n{text}"]
        return [one, first, two, second, text]

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        if len(batch) == 0:
            return empty_scores(("score", "parse_fail"))
        subject, items = self.subjects(batch)
        group = batch.group.cpu()
        pairs = []
        for gid in torch.unique(group):
            rows = torch.nonzero(group == gid).flatten().tolist()
            pairs += [(i, j) for a, i in enumerate(rows) for j in rows[a + 1:]]
        orders = pairs + [(j, i) for i, j in pairs] if self.both_orders else pairs
        answers = self.ask([self._request(subject, batch.prompts[i], items[i], items[j]) for i, j in orders])
        verdicts = dict(zip(orders, (parse_choice(a, self.patterns) for a in answers)))

        def compare(i: int, j: int) -> float | None:
            votes = [verdicts[(i, j)]]
            if self.both_orders:
                votes.append(None if verdicts[(j, i)] is None else 1.0 - verdicts[(j, i)])
            votes = [v for v in votes if v is not None]
            return sum(votes) / len(votes) if votes else None

        rates, failures = pairwise_win_rate(group, compare, return_failures=True)
        inverse = torch.unique(group, return_inverse=True)[1]
        games = (torch.bincount(inverse)[inverse] - 1).to(torch.float64)
        parse_fail = torch.where(games > 0, failures.to(torch.float64) / games.clamp(min=1), math.nan)
        return {"score": rates, "parse_fail": parse_fail}
