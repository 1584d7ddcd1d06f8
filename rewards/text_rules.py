"""Rule-based rewards for text completions of reasoning VLMs: format, accuracy by problem type, length, temporal IoU.

Answers are read only from the last ``<answer>...</answer>`` block (Video-R1 reads the first; the last is the
model's final word after a revision). A completion without one, or with a blank one, scores 0: matching the ground
truth anywhere in the text would pay out for empty or hedging answers.
"""

from __future__ import annotations

import atexit
import json
import math
import re
import select
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jiwer
import torch

from mmgrpo.registry import REWARDS

from .base import GROUPWISE, POINTWISE, Reward, RewardBatch
from .checks import completions_or_raise

PROBLEM_TYPES = ("multiple choice", "numerical", "OCR", "free-form", "regression")
_TYPE_ALIASES = {
    "multiple choice": "multiple choice", "multiplechoice": "multiple choice", "mc": "multiple choice",
    "choice": "multiple choice", "numerical": "numerical", "numeric": "numerical", "number": "numerical",
    "ocr": "OCR", "free form": "free-form", "freeform": "free-form", "open ended": "free-form",
    "regression": "regression",
}


_TEMPORAL_GROUNDING = ("temporal grounding", "temporal video grounding", "video temporal grounding", "tvg", "tg")
"""Names of the temporal-grounding problem type, which ``temporal_iou`` scores and ``accuracy`` does not."""


def _type_key(name: Any) -> str:
    """``name`` lower-cased, with runs of ``_``, ``-`` and spaces made one space."""
    return re.sub(r"[\s_\-]+", " ", str(name).strip().lower())


def canonical_problem_type(name: str) -> str | None:
    """The Video-R1 problem type that ``name`` spells (case, ``_``, ``-`` and spaces ignored), or None."""
    return _TYPE_ALIASES.get(_type_key(name))


def is_temporal_grounding(name: str) -> bool:
    """Whether ``name`` spells the temporal-grounding problem type (``temporal_grounding``, ``TVG``; see
    :data:`_TEMPORAL_GROUNDING`), case, ``_``, ``-`` and spaces ignored."""
    return _type_key(name) in _TEMPORAL_GROUNDING


def last_tagged_span(text: str, tag: str = "answer") -> tuple[int, int] | None:
    """(start, end) character offsets of the content of the last ``<tag>...</tag>`` block of ``text``, tags
    excluded; None when there is none. A block holds no opening tag: in ``<tag>A <tag>B</tag>`` the block is
    ``B``, the text after the last opening tag."""
    t = re.escape(tag)
    found = list(re.finditer(rf"<{t}>((?:(?!<{t}>).)*?)</{t}>", text, flags=re.DOTALL))
    return found[-1].span(1) if found else None


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The stripped content of the last ``<tag>...</tag>`` block of ``text``; None when there is none."""
    span = last_tagged_span(text, tag)
    return text[span[0]:span[1]].strip() if span is not None else None


def raw_ground_truth(meta: dict[str, Any]) -> Any:
    """``meta["solution"]`` (Video-R1), else ``meta["answer"]`` (EasyR1), as given; a None solution counts as
    missing (a dataset with both columns holds None where a row has only the other)."""
    value = meta.get("solution")
    return meta.get("answer") if value is None else value


def ground_truth(meta: dict[str, Any], row: int, reward: str, tag: str = "answer") -> str:
    """:func:`raw_ground_truth` as text, unwrapped from ``<tag>`` if wrapped (else from ``<answer>``, as Video-R1
    data wraps every solution whatever tag the policy writes), then by :func:`unwrap_answer`.

    A missing or blank ground truth (``\\boxed{}`` too) is a data error and raises ``ValueError``."""
    value = raw_ground_truth(meta)
    if value is None:
        raise ValueError(f"reward '{reward}': sample {row} has no 'solution' or 'answer' in its meta")
    return _reference_text(value, row, reward, tag)


def ground_truths(meta: dict[str, Any], row: int, reward: str, tag: str = "answer") -> list[str]:
    """Every acceptable ground truth of a sample: each element of a list (or tuple) of them (``["3", "three"]``),
    else the one :func:`ground_truth` reads; each unwrapped as :func:`ground_truth` unwraps it.

    An empty list, an element that is not a string or a number (a bool neither), or a blank element raises
    ``ValueError`` naming the sample."""
    value = raw_ground_truth(meta)
    if not isinstance(value, (list, tuple)):
        return [ground_truth(meta, row, reward, tag)]
    if not value:
        raise ValueError(f"reward '{reward}': sample {row} has an empty list of ground truths")
    bad = [k for k, item in enumerate(value) if isinstance(item, bool) or not isinstance(item, (str, int, float))]
    if bad:
        raise ValueError(f"reward '{reward}': sample {row} ground truth {bad[0]} is a {type(value[bad[0]]).__name__}, "
                         f"not a string or number")
    return [_reference_text(item, row, reward, tag) for item in value]


def _reference_text(value: Any, row: int, reward: str, tag: str) -> str:
    """One ground truth ``value`` as text, unwrapped (see :func:`ground_truth`); ``ValueError`` when blank."""
    text = str(value)
    inner = last_tagged(text, tag)
    if inner is None:
        inner = last_tagged(text, "answer")
    text = unwrap_answer(inner if inner is not None else text)
    if not text:
        raise ValueError(f"reward '{reward}': sample {row} has an empty ground truth")
    return text


_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_WRAPPER_RE = re.compile(r"\\(?:boxed|text|textbf|mathrm|mathbf)\s*\{")


def _closing_brace(text: str, start: int) -> int:
    """Index of the ``}`` that closes the ``{`` at ``text[start]``; -1 when it is not closed."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return -1


def unwrap_answer(text: str) -> str:
    """``text`` stripped of math delimiters (``$``, ``$$``, ``\\(``, ``\\[``) and of ``\\boxed{}``, ``\\text{}``
    (``textbf``, ``mathrm``, ``mathbf``) that enclose all of it, braces balanced: ``$\\boxed{\\text{B}}$`` ->
    ``B``, ``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``. Anything else (``\\boxed{1} or \\boxed{2}``,
    ``$5``) is returned stripped."""
    text = text.strip()
    while True:
        for left, right in _DELIMITERS:
            inner = text[len(left):len(text) - len(right)]
            if (len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right)
                    and left not in inner and right not in inner):
                text = inner.strip()
                break
        else:
            m = _WRAPPER_RE.match(text)
            if not (m and _closing_brace(text, m.end() - 1) == len(text) - 1):
                return text
            text = text[m.end():-1].strip()


_CHOICE_RE = re.compile(r"\(?([A-Za-z])(\)?[.:]?)(\s.*)?", re.DOTALL)
_CHOICE_LEAD = re.compile(r"(?:the\s+)?(?:correct\s+)?(?:option|answer|choice)(?:\s+is)?\b\s*:?\s*", re.IGNORECASE)


def normalize_choice(text: str) -> str:
    """The option letter of a multiple-choice answer: ``b``, ``B.``, ``(B)``, ``B) text``, ``B. text`` -> ``B``,
    also after a lead-in ``Option``, ``Answer:``, ``Choice`` or ``The answer is`` (``Option (B)`` -> ``B``) and
    inside a wrapper (``\\boxed{B}``, see :func:`unwrap_answer`).

    Text that does not start with a lone letter (``A cat``, ``Option A or B``) is returned whitespace-collapsed,
    upper-cased, without a trailing ``.`` or ``)``. Video-R1 compares the stripped answer exactly; this is
    deliberately more lenient about how the letter is written, never about which letter."""
    text = unwrap_answer(text)
    lead = _CHOICE_LEAD.match(text)
    for candidate in (text, text[lead.end():]) if lead else (text,):
        m = _CHOICE_RE.fullmatch(candidate)
        if m and (m.group(2) or not m.group(3)):
            return m.group(1).upper()
    return " ".join(text.split()).rstrip(".)").upper()


def parse_number(text: str) -> float | None:
    """A finite float from ``text`` (``3``, ``3.0``, ``-2.5`` or ``\u22122.5`` with the Unicode minus, ``1,000``,
    ``1e3``); None if it is not one (also for Python's ``1_000``)."""
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text.strip().replace("\u2212", "-"))
    if "_" in s:
        return None
    try:
        value = float(s)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


MATH_TIMEOUT_S = 5.0
"""Seconds one math-verify comparison may take before it counts as unequal."""
MATH_IMPORT_S = 30.0
"""Extra seconds the first comparison of a new worker process may take: it imports math-verify and sympy."""
_MATH_WORKER = """
import json, sys
from math_verify import parse, verify
def read(s):
    return parse(s if "$" in s or "\\\\boxed" in s else f"${s}$", parsing_timeout=None)
for line in sys.stdin:
    pred, gt = json.loads(line)
    try:
        gold, guess = read(gt), read(pred)
        ok = bool(gold and guess and verify(gold, guess, timeout_seconds=None))
    except Exception:
        ok = False
    print(json.dumps(ok), flush=True)
"""
_math_worker: subprocess.Popen | None = None
_math_lock = threading.Lock()


@atexit.register
def _stop_math_worker() -> None:
    """End the worker with its parent: closing its stdin ends its loop (killed if it is stuck in a comparison)."""
    worker = _math_worker
    if worker is not None and worker.poll() is None:
        worker.stdin.close()
        try:
            worker.wait(timeout=1)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        worker.stdout.close()


def math_equal(pred: str, gt: str) -> bool:
    """Symbolic equality by math-verify (``\\frac{1}{2}`` == ``0.5``; bare expressions are read as LaTeX); False
    when it takes longer than ``MATH_TIMEOUT_S`` seconds.

    The comparison runs in a worker process (``python -c``, math-verify only), which is killed, and replaced at the
    next call, when it runs out of time: sympy can spend minutes on an answer such as ``9^{9^{9}}`` while holding
    the GIL, and math-verify's own timeout (``signal.alarm``) works only in the main thread, which the reward zoo's
    threads and the reward server's worker are not."""
    global _math_worker
    with _math_lock:
        wait = MATH_TIMEOUT_S
        if _math_worker is None or _math_worker.poll() is not None:
            _math_worker = subprocess.Popen([sys.executable, "-c", _MATH_WORKER], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            wait += MATH_IMPORT_S
        _math_worker.stdin.write(json.dumps([pred, gt]) + "\n")
        _math_worker.stdin.flush()
        ready, _, _ = select.select([_math_worker.stdout], [], [], wait)
        if not ready:
            _math_worker.kill()
            _math_worker.wait()
            _math_worker = None
            return False
        line = _math_worker.stdout.readline()
        if not line:  # the worker died (out of memory, say): count the pair unequal, start a new one next time
            _math_worker = None
            return False
        return bool(json.loads(line))


_OPTION_LABEL_RE = re.compile(r"\s*\(?([A-Za-z])\s*[.):]")


def option_label_ends(options: Sequence[Any]) -> list[int] | None:
    """Where each option's letter label ends, when the options carry the labels A, B, C, ... in order (either case;
    ``A. x``, ``(A) x``, ``A) x``, ``A: x``), as Video-R1 data does; None otherwise, and the options are texts to
    letter anew. Texts that start like labels out of order (``["a.m.", "p.m."]``, ``["U.S.", "U.K."]``) are texts."""
    ends = []
    for k, text in enumerate(options):
        m = _OPTION_LABEL_RE.match(str(text))
        if m is None or m.group(1).upper() != chr(ord("A") + k):
            return None
        ends.append(m.end())
    return ends


def option_letters(options: Sequence[Any]) -> dict[str, str]:
    """Each option's text, normalised as :func:`normalize_choice` does, -> its letter: ``["A. red", "B. blue"]``
    -> ``{"RED": "A", "BLUE": "B"}``. Options without in-order labels (:func:`option_label_ends`) are lettered A, B,
    C, ... in order, as the vlm pipeline's prompt shows them; a text that normalises to a single character is left
    out (a letter answer is read as a letter)."""
    texts = [str(o) for o in options]
    ends = option_label_ends(texts) or [0] * len(texts)
    letters = {}
    for k, (text, end) in enumerate(zip(texts[:26], ends)):
        key = normalize_choice(text[end:])
        if len(key) > 1:
            letters[key] = chr(ord("A") + k)
    return letters


def score_multiple_choice(pred: str, gt: str, options: Sequence[Any] = ()) -> float:
    """1.0 when the normalised option letters (see :func:`normalize_choice`) are equal. With the question's
    ``options``, an answer (or ground truth) that is the whole text of an option stands for its letter
    (:func:`option_letters`), so ``blue`` is ``B`` for ``["A. red", "B. blue"]``."""
    letters = option_letters(options)
    p, g = normalize_choice(pred), normalize_choice(gt)
    return float(letters.get(p, p) == letters.get(g, g))


def entropy(labels: Sequence[str]) -> float:
    """Shannon entropy (nats) of the empirical distribution of ``labels``."""
    counts = Counter(labels).values()
    total = sum(counts)
    return sum(c / total * math.log(total / c) for c in counts)


def answer_diversity(completions: Sequence[str], solutions: Sequence[str]) -> float:
    """How evenly multiple-choice answers spread over the options, relative to the truth: the entropy of the option
    letters answered (:func:`normalize_choice` of each completion's last ``<answer>``; completions without one are
    left out) over the entropy of the correct letters of the same questions. 1 when the answers are as spread as
    the correct ones, 0 when every answer is the same letter; NaN when no completion answers or every correct
    letter is the same. A policy that games accuracy with one letter for every question scores near 0."""
    answered = [normalize_choice(a) for a in map(last_tagged, completions) if a]
    truth = entropy([normalize_choice(last_tagged(s) or s) for s in solutions])
    return entropy(answered) / truth if answered and truth > 0 else math.nan


def score_numerical(pred: str, gt: str) -> float:
    """1.0 when both numbers agree after rounding to 2 decimals; math-verify decides when either is not a number.

    Unlike Video-R1, which scores 0 when only one of the two holds a ``.`` or ``,``, ``3.0`` equals ``3``."""
    p, g = parse_number(pred), parse_number(gt)
    if p is not None and g is not None:
        return float(round(p, 2) == round(g, 2))
    return float(math_equal(pred, gt))


def score_ocr(pred: str, gt: str) -> float:
    """``max(0, 1 - WER)`` with jiwer's default word split; case-sensitive."""
    return max(0.0, 1.0 - jiwer.wer(gt, pred))


def score_regression(pred: str, gt: str) -> float:
    """``clip(1 - |pred - gt| / |gt|, 0, 1)``. With ``gt == 0`` the relative error is undefined: 1.0 only for
    ``pred == 0`` (Video-R1's ``+ 1e-9`` terms give 0 even then). An unparsable prediction scores 0; an unparsable
    ground truth raises ``ValueError``."""
    g = parse_number(gt)
    if g is None:
        raise ValueError(f"regression ground truth {gt!r} is not a number")
    p = parse_number(pred)
    if p is None:
        return 0.0
    if g == 0:
        return float(p == 0)
    return min(1.0, max(0.0, 1.0 - abs(p - g) / abs(g)))


@REWARDS.register("format", kind=POINTWISE, modality="text",
                  description="1 if the completion is <think>...</think><answer>...</answer>, else 0")
class FormatReward(Reward):
    """1.0 for a well-formatted completion, else 0.0.

    With ``require_think``, the whole completion (surrounding whitespace allowed) must be one think block followed
    by one answer block. Without, it must end with one answer block; the text before it is free (plain reasoning or
    a think block) but may hold no answer tag. In both cases the answer must not be blank and no block may contain
    a think or answer tag. This is stricter than Video-R1's ``<think>.*?</think>\\s*<answer>.*?</answer>``, whose
    lazy dots still span tags (``...<answer>A</answer><answer>B</answer>`` matches) and which pays for a blank
    answer; it also allows surrounding whitespace, which Video-R1 does not.

    Args:
        think_tag: name of the reasoning tag (``"think"`` -> ``<think>...</think>``).
        answer_tag: name of the answer tag.
        require_think: demand the think block. False rewards a model fine-tuned without think tags for its answer
            block alone, where a strict format reward would stay at 0.
    """

    modality = "text"

    def __init__(self, think_tag: str = "think", answer_tag: str = "answer", require_think: bool = True):
        t, a = re.escape(think_tag), re.escape(answer_tag)
        body = rf"(?:(?!</?{t}>|</?{a}>).)*"
        answer = rf"<{a}>({body})</{a}>\s*"
        lead = rf"\s*<{t}>{body}</{t}>\s*" if require_think else rf"(?:(?!</?{a}>).)*"
        self.pattern = re.compile(lead + answer, re.DOTALL)

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        scores = []
        for text in completions_or_raise(batch, "format"):
            m = self.pattern.fullmatch(text)
            scores.append(float(bool(m and m.group(1).strip())))
        return torch.tensor(scores, dtype=torch.float64)


@REWARDS.register("accuracy", kind=POINTWISE, modality="text",
                  description="answer vs ground truth by problem type (choice, numerical, OCR, free-form, regression)")
class AccuracyReward(Reward):
    """Correctness of the last ``<answer>`` block against ``meta["solution"]`` or ``meta["answer"]``; when that is a
    list of acceptable answers (``["3", "three"]``, several OCR or free-form references), the best score over them
    (:func:`ground_truths`).

    The rule follows ``meta["problem_type"]`` (Video-R1 types, aliases such as ``multiple_choice`` accepted):

    - multiple choice: 1 when the option letters match (:func:`normalize_choice`); with ``meta["options"]``, an
      option's whole text stands for its letter (:func:`score_multiple_choice`);
    - numerical: 1 when equal after rounding to 2 decimals, math-verify for expressions (:func:`score_numerical`);
    - OCR: ``max(0, 1 - WER)``;
    - free-form: mean of the ROUGE-1, ROUGE-2 and ROUGE-L F-measures (rouge-score, Porter stemming; its
      tokenizer keeps only ASCII letters and digits, so other scripts score 0);
    - regression: ``clip(1 - relative error, 0, 1)`` (:func:`score_regression`).

    Both answers are first unwrapped from a ``\\boxed{}`` or ``$...$`` that encloses all of it
    (:func:`unwrap_answer`), so ``\\boxed{3.004}`` rounds as ``3.004`` does. A missing or blank answer block scores
    0 (so does a blank box). A missing ground truth raises ``ValueError``. A temporal-grounding sample
    (:func:`is_temporal_grounding`) scores NaN, does not apply: ``temporal_iou`` scores it.

    Args:
        default_type: problem type for samples whose meta has no ``problem_type``, or a None one (EasyR1 data);
            None requires it.
        unknown_type: ``"raise"`` a ``ValueError`` naming an unknown or missing problem type, or score it ``"nan"``
            (does not apply).
        answer_tag: name of the answer tag, in completions and in wrapped ground truths (which may also be wrapped
            in ``<answer>`` tags, as Video-R1 data is).
    """

    modality = "text"

    def __init__(self, default_type: str | None = None, unknown_type: str = "raise", answer_tag: str = "answer"):
        if unknown_type not in ("raise", "nan"):
            raise ValueError(f"accuracy: unknown_type must be 'raise' or 'nan'; got {unknown_type!r}")
        if default_type is not None and canonical_problem_type(default_type) is None:
            raise ValueError(f"accuracy: unknown default_type {default_type!r}; valid: {', '.join(PROBLEM_TYPES)}")
        from rouge_score import rouge_scorer

        self.default_type, self.unknown_type, self.answer_tag = default_type, unknown_type, answer_tag
        self.rouge = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)

    def score_free_form(self, pred: str, gt: str) -> float:
        """Mean of the ROUGE-1, ROUGE-2 and ROUGE-L F-measures."""
        return sum(s.fmeasure for s in self.rouge.score(gt, pred).values()) / 3

    def _rule(self, meta: dict[str, Any], row: int):
        raw = meta.get("problem_type")
        raw = self.default_type if raw is None else raw
        if raw is not None and is_temporal_grounding(raw):
            return None
        kind = None if raw is None else canonical_problem_type(raw)
        if kind is None:
            if self.unknown_type == "nan":
                return None
            raise ValueError(f"accuracy: unknown problem_type {raw!r} (sample {row}); valid: "
                             f"{', '.join(PROBLEM_TYPES)}, or set unknown_type='nan'")
        if kind == "multiple choice":
            options = meta.get("options")
            return partial(score_multiple_choice, options=options if isinstance(options, (list, tuple)) else ())
        return {"numerical": score_numerical, "OCR": score_ocr, "free-form": self.score_free_form,
                "regression": score_regression}[kind]

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        scores = []
        for row, (text, meta) in enumerate(zip(completions_or_raise(batch, "accuracy"), batch.meta)):
            rule = self._rule(meta, row)
            if rule is None:
                scores.append(math.nan)
                continue
            references = ground_truths(meta, row, "accuracy", self.answer_tag)
            pred = unwrap_answer(last_tagged(text, self.answer_tag) or "")
            try:
                scores.append(max(rule(pred, gt) for gt in references) if pred else 0.0)
            except ValueError as err:  # a ground truth the rule cannot read (regression's non-number)
                raise ValueError(f"accuracy: sample {row}: {err}") from err
        return torch.tensor(scores, dtype=torch.float64)


class RolloutAccuracyBonus(Reward):
    """Base of the groupwise bonuses on correct answers that read what the vlm pipeline adds to its training
    rollouts' meta (T-GRPO's shuffled-frame accuracy, GRPO-CARE's answer likelihoods): correctness is judged by
    ``self.accuracy``, an ``accuracy`` reward built from ``accuracy_args``; held-out evaluation leaves them out."""

    kind = GROUPWISE
    modality = "text"
    rollout_only = True

    @classmethod
    def components(cls, args: dict[str, Any]) -> list[tuple[str | None, str, Callable[[], Any]]]:
        """The ``accuracy`` reward (see :meth:`Reward.components`)."""
        return [(None, "accuracy_args", lambda: AccuracyReward)]

    def __init__(self, accuracy_args: dict[str, Any] | None = None):
        self.accuracy = AccuracyReward(**(accuracy_args or {}))


@REWARDS.register("length", kind=POINTWISE, modality="text",
                  description="1 inside [min_len, max_len] characters or words, falling linearly outside")
class LengthReward(Reward):
    """A reward on the completion's length ``n``: 1.0 inside ``[min_len, max_len]``, linear outside.

    - below ``min_len``: ``n / min_len``;
    - above ``max_len``: ``max(0, 1 - (n - max_len) / slack)``, so 0 from ``max_len + slack`` on;
    - an empty completion scores 0, whatever ``min_len``.

    With ``min_len=0`` this is DAPO's soft overlong punishment (``max_len = L_max - L_cache``, ``slack = L_cache``)
    shifted from [-1, 0] to [0, 1].

    Args:
        max_len: the longest length with full reward.
        min_len: the shortest length with full reward; 0 for no lower bound.
        slack: the length beyond ``max_len`` over which the reward falls to 0; None means ``max_len``.
        unit: ``"chars"`` counts characters, ``"tokens"`` whitespace-separated words.
    """

    modality = "text"

    def __init__(self, max_len: int, min_len: int = 0, slack: int | None = None, unit: str = "chars"):
        if unit not in ("chars", "tokens"):
            raise ValueError(f"length: unit must be 'chars' or 'tokens'; got {unit!r}")
        if not 0 <= min_len <= max_len:
            raise ValueError(f"length: need 0 <= min_len <= max_len; got min_len {min_len} max_len {max_len}")
        slack = max_len if slack is None else slack
        if slack <= 0:
            raise ValueError(f"length: slack must be > 0; got {slack}")
        self.min_len, self.max_len, self.slack, self.unit = min_len, max_len, slack, unit

    def score(self, n: int) -> float:
        """The reward for a completion of length ``n``."""
        if n == 0:
            return 0.0
        if n < self.min_len:
            return n / self.min_len
        return max(0.0, 1.0 - max(0, n - self.max_len) / self.slack)

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        texts = completions_or_raise(batch, "length")
        sizes = [len(t) if self.unit == "chars" else len(t.split()) for t in texts]
        return torch.tensor([self.score(n) for n in sizes], dtype=torch.float64)


_SECONDS_RE = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_NEGATIVE_RE = re.compile(r"(?:^|[^\w.\s]|\b(?:to|from|and|between))\s*-\s*[\d.]")
"""A minus that is a sign, not the ``s-e`` separator: at the start, after punctuation (``[3, -5]``) or a word that
joins two numbers (``3 to -5``)."""


def parse_interval(value: Any) -> tuple[float, float] | None:
    """``(start, end)`` seconds from ``[s, e]``, ``s-e``, ``s to e`` (exactly two finite non-negative numbers,
    start <= end) or from a 2-sequence of numbers; None otherwise (also for a sequence holding something that is not
    a number, or ``inf``)."""
    if isinstance(value, (list, tuple)):
        try:
            numbers = [float(v) for v in value]
        except (TypeError, ValueError):
            return None
    elif _NEGATIVE_RE.search(str(value)):
        return None
    else:
        numbers = [float(v) for v in _SECONDS_RE.findall(str(value))]
    if len(numbers) != 2 or not 0 <= numbers[0] <= numbers[1] < math.inf:
        return None
    return numbers[0], numbers[1]


def interval_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Intersection over union of two intervals; two identical points give 1.0, distinct points 0.0."""
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    union = (a[1] - a[0]) + (b[1] - b[0]) - inter
    if union == 0:
        return float(a == b)
    return inter / union


@REWARDS.register("temporal_iou", kind=POINTWISE, modality="text",
                  description="IoU of the answered [start, end] seconds with the ground-truth interval")
class TemporalIoU(Reward):
    """Temporal grounding: IoU of the interval in the last answer block with ``meta["solution"]``.

    The answer is read by :func:`parse_interval` (``[12.5, 17]``, ``12.5-17``, ``12.5s to 17s``); a missing or
    unparsable answer, or one with start > end, scores 0. The ground truth may be a list ``[s, e]`` or text in the
    same forms, wrapped in answer tags or not; an unparsable ground truth raises ``ValueError``.

    A sample is temporal grounding when its meta has no ``problem_type`` or a temporal-grounding one
    (:func:`is_temporal_grounding`). One of ``accuracy``'s problem types (``multiple choice``, ...) scores NaN
    (does not apply), whatever its ground truth, so a batch may mix both kinds; ``conditional``: a batch with no
    temporal-grounding sample is expected.

    Args:
        answer_tag: name of the answer tag.
        unknown_type: for any other problem type, ``"raise"`` a ``ValueError`` naming it, or score it ``"nan"``.
    """

    modality = "text"
    conditional = True

    def __init__(self, answer_tag: str = "answer", unknown_type: str = "raise"):
        if unknown_type not in ("raise", "nan"):
            raise ValueError(f"temporal_iou: unknown_type must be 'raise' or 'nan'; got {unknown_type!r}")
        self.answer_tag, self.unknown_type = answer_tag, unknown_type

    def applies(self, meta: dict[str, Any], row: int) -> bool:
        """Whether sample ``row`` is temporal grounding; ``ValueError`` for an unknown type under ``"raise"``."""
        kind = meta.get("problem_type")
        if kind is None or is_temporal_grounding(kind):
            return True
        if canonical_problem_type(kind) is None and self.unknown_type == "raise":
            raise ValueError(f"temporal_iou: unknown problem_type {kind!r} (sample {row}); valid: none or "
                             f"'temporal grounding' (scored), {', '.join(PROBLEM_TYPES)} (NaN), or set "
                             f"unknown_type='nan'")
        return False

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        scores = []
        for row, (text, meta) in enumerate(zip(completions_or_raise(batch, "temporal_iou"), batch.meta)):
            if not self.applies(meta, row):
                scores.append(math.nan)
                continue
            raw = raw_ground_truth(meta)
            gt = parse_interval(raw if isinstance(raw, (list, tuple)) else
                                ground_truth(meta, row, "temporal_iou", self.answer_tag))
            if gt is None:
                raise ValueError(f"temporal_iou: sample {row} ground truth {raw!r} is not an interval [start, end]")
            answer = last_tagged(text, self.answer_tag)
            pred = None if answer is None else parse_interval(answer)
            scores.append(0.0 if pred is None else interval_iou(pred, gt))
        return torch.tensor(scores, dtype=torch.float64)
