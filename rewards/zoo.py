"""RewardZoo: the configured rewards, loaded once, scored together on a batch.

The zoo returns raw per-reward scores. Combining them (weighted sum or GDPO) needs whole groups across processes,
so it happens in the trainer through :mod:`mmgrpo.grpo.advantages`.

Besides the reward's own constructor arguments, a spec's ``args`` may hold three keys that the zoo takes out before
building the reward:

- ``device``: where the reward runs (``cuda:1``...). The reward is built there when its constructor takes a
  ``device`` argument, and moved there with ``.to(device)`` in any case; the batch's images and videos are copied to
  that device before the call (once per device and call, shared by the rewards on it).
- ``clip: [lo, hi]``: clamp the reward's main score (the zoo does it, per sample).
- ``standardize: true``: z-score the main score over the whole batch of every process (after ``clip``; NaN
  ignored). The trainer does it through :meth:`RewardZoo.standardize` once the scores are gathered, so the result
  does not depend on how many processes share the batch. This only puts rewards of different scales on a par before
  weighting; the per-group normalisation of GRPO still happens afterwards, in the advantages.

Both change the main score (the column that enters the combination); ``logged`` keeps the raw scores.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from mmgrpo.config import ConfigError
from mmgrpo.errors import RunError
from mmgrpo.registry import REWARDS, RegistryError

from .base import (
    GROUPWISE,
    POINTWISE,
    TRL_ARGS,
    FunctionReward,
    Reward,
    RewardBatch,
    as_scores,
    is_trl_signature,
    main_score,
    trl_reward,
)
from .clip_models import one_line

ZOO_ARGS = ("device", "clip", "standardize")
"""Spec ``args`` keys that configure the zoo, not the reward (see the module notes)."""
STD_EPS = 1e-8


class RewardError(RunError):
    """A reward raised while scoring; ``str()`` is one line that names the reward."""


def _takes_device(obj: Any) -> bool:
    try:
        return "device" in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False


def build_reward(name: str, args: dict[str, Any] | None = None, device: str | torch.device | None = None) -> Reward:
    """Instantiate a reward by registered name or ``module:attr``.

    A class or factory is called with ``args``; a plain function becomes a :class:`FunctionReward` (or a TRL-style
    wrapper when it takes ``completions``, see :func:`~.base.is_trl_signature`). With ``device``, the reward is
    built there when its constructor takes ``device``, and moved there with ``.to(device)`` in any case."""
    entry = REWARDS.entry(name)
    obj, args = entry.obj, dict(args or {})
    if device is not None and _takes_device(obj):
        args["device"] = device
    if isinstance(obj, type) and issubclass(obj, Reward):
        reward = obj(**args)
    elif isinstance(obj, Reward):
        if args:
            raise ValueError(f"reward '{name}' is an instance and takes no args (got {sorted(args)})")
        reward = obj
    elif callable(obj) and is_trl_signature(obj):
        reward = trl_reward(obj, **args)
    elif callable(obj) and args:
        reward = obj(**args)
        if not isinstance(reward, Reward):
            raise TypeError(f"reward '{name}' took args but did not return a Reward")
    elif callable(obj):
        reward = FunctionReward(obj, kind=entry.info.get("kind", POINTWISE), modality=entry.info.get("modality", "any"))
    else:
        raise ValueError(f"reward '{name}' is not callable")
    return reward if device is None else reward.to(device)


def evaluated(reward: Reward) -> bool:
    """Whether held-out evaluation scores ``reward``: not when it is ``rollout_only`` (it reads what only a
    rollout adds) nor groupwise (evaluation has one sample per prompt, so win rates and other group scores are
    NaN)."""
    return not getattr(reward, "rollout_only", False) and getattr(reward, "kind", POINTWISE) != GROUPWISE


def standardize_scores(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (B,) z-scored over the non-NaN entries (population std; a constant batch becomes exact zeros). NaN
    stays NaN. The scores are first shifted by one of them, which is exact for equal values (their floating-point
    mean need not be) and keeps the mean's rounding small for scores far from 0."""
    finite = scores[~scores.isnan()]
    if not finite.numel():
        return scores
    shifted, finite = scores - finite[0], finite - finite[0]
    return (shifted - finite.mean()) / (finite.std(unbiased=False) + STD_EPS)


@dataclasses.dataclass
class _Slot:
    """One configured reward and what the zoo does around it."""

    name: str
    reward: Reward
    device: torch.device | None
    clip: tuple[float, float] | None
    standardize: bool
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def _zoo_args(args: dict[str, Any], key: str) -> tuple[torch.device | None, tuple[float, float] | None, bool]:
    """The checked ``device``, ``clip`` and ``standardize`` of the spec ``key`` (``rewards.0``...)."""
    try:
        device = None if args.get("device") is None else torch.device(args["device"])
    except RuntimeError as err:
        raise ConfigError(f"bad value for '{key}.args.device': {one_line(err)}") from None
    clip = args.get("clip")
    if clip is not None:
        if (not isinstance(clip, Sequence) or isinstance(clip, str) or len(clip) != 2
                or not float(clip[0]) <= float(clip[1])):
            raise ConfigError(f"bad value for '{key}.args.clip': must be [lo, hi] with lo <= hi; got {clip!r}")
        clip = (float(clip[0]), float(clip[1]))
    standardize = args.get("standardize", False)
    if not isinstance(standardize, bool):
        raise ConfigError(f"bad value for '{key}.args.standardize': must be true or false; got {standardize!r}")
    return device, clip, standardize


def check_spec(name: str, args: dict[str, Any] | None, key: str) -> None:
    """Check the reward spec ``key`` (``rewards.0``...) before anything is built: ``name`` resolves, the zoo's
    args are well formed, and every other arg is a parameter of the reward's class or factory (and a class gets
    all its required ones), down through the components it names (:meth:`Reward.components`: a win rate's base
    reward, a judge's backend). Raises :class:`ConfigError` naming the key, and the closest valid one."""
    try:
        obj = REWARDS.entry(name).obj
    except RegistryError as err:
        raise ConfigError(f"bad value for '{key}.name': {err}") from None
    args = dict(args or {})
    _zoo_args(args, key)
    _check_args(obj, {k: v for k, v in args.items() if k not in ZOO_ARGS}, f"{key}.args", f"reward '{name}'")


def distinct_names(names: Sequence[str]) -> list[str]:
    """``names`` (the specs' reward names, in order) with the k-th repeat of a name labelled ``name#k`` (k >= 2):
    scores, sub-scores, NaN counts and metrics are keyed by name, so a second ``vlm_judge`` (another preset) or
    ``video_frames`` (another image reward) would otherwise hide the first."""
    labels: list[str] = []
    for name in names:
        label, k = name, 1
        while label in labels:
            k += 1
            label = f"{name}#{k}"
        labels.append(label)
    return labels


def called_on_batches(fn: Any) -> bool:
    """Whether the plain function ``fn`` is a reward itself, called on each batch: ``fn(batch)`` or TRL's
    ``fn(prompts, completions, **kwargs)`` (any signature with ``completions``), rather than a factory called with
    the spec's args."""
    if is_trl_signature(fn):
        return True
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].name == "batch"


def _check_args(obj: Any, args: dict[str, Any], key: str, what: str) -> None:
    """``args`` (at config key ``key``) against the signature of ``obj``, a reward or component constructor named
    ``what`` in messages; then each component ``obj`` builds from them."""
    if isinstance(obj, Reward):
        if args:
            raise ConfigError(f"unknown key '{key}.{next(iter(args))}': {what} is an instance and takes no args")
        return
    if not args and not isinstance(obj, type):
        return  # a plain function, called on the batch
    if not isinstance(obj, type) and is_trl_signature(obj):
        unknown = next((k for k in args if k not in TRL_ARGS), None)
        if unknown is not None:
            raise ConfigError(f"unknown key '{key}.{unknown}': {what} is a TRL-style function; its only arg is "
                              f"{', '.join(TRL_ARGS)}")
        if not isinstance(args.get("conversational", False), bool):
            raise ConfigError(f"bad value for '{key}.conversational': must be true or false; got "
                              f"{args['conversational']!r}")
        return
    if not isinstance(obj, type) and called_on_batches(obj):
        raise ConfigError(f"unknown key '{key}.{next(iter(args))}': {what} is a function called on each batch "
                          f"(fn(batch)) and takes no args; to configure "
                          f"it, register a factory that takes the args and returns a Reward")
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return  # no signature to read: the call itself checks
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        for k in args:
            if k not in named:
                close = difflib.get_close_matches(k, named, n=1, cutoff=0.0)
                hint = f" (closest: '{close[0]}')" if close else f" ({what} takes no args)"
                raise ConfigError(f"unknown key '{key}.{k}' for {what}{hint}")
    for p in params:
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) \
                and p.name not in args and p.name != "device":
            raise ConfigError(f"missing required key '{key}.{p.name}' for {what}")
    if not (isinstance(obj, type) and issubclass(obj, Reward)):
        return
    for name_arg, args_arg, resolve in obj.components(args):
        if name_arg is not None and not isinstance(args.get(name_arg, ""), str):
            continue  # an object given from Python, not from a config
        try:
            component = resolve()
        except (KeyError, ValueError, RegistryError) as err:
            raise ConfigError(f"bad value for '{key}.{name_arg}': {one_line(err)}") from None
        nested = args.get(args_arg) or {}
        if not isinstance(nested, Mapping):
            raise ConfigError(f"bad value for '{key}.{args_arg}': must be a mapping of arguments; got {nested!r}")
        label = f"'{args[name_arg]}'" if name_arg in args else f"the {args_arg.removesuffix('_args')} of {what}"
        _check_args(component, dict(nested), f"{key}.{args_arg}", label)


class RewardZoo:
    """The configured rewards. ``__call__`` returns ``(main (B, R) float64, logged {name: (B,)}, seconds {name})``.

    ``main[:, r]`` is reward r's score (its ``score`` sub-score, or the mean of its sub-scores when it returns
    several), after the spec's ``clip`` (``standardize`` needs the whole batch: :meth:`standardize`); ``logged``
    holds every raw score and sub-score by name for metrics; ``seconds`` is each reward's wall time. Rewards are built once, here, and kept.

    Independent rewards run concurrently, one thread each (torch releases the GIL in its kernels, and a reward on
    its own GPU overlaps fully), under ``torch.no_grad()``. A reward never runs twice at once: concurrent calls of
    the zoo take turns per reward. ``nan_counts[name]`` counts the samples whose main score was NaN ("does not
    apply"); a reward whose main score is NaN for a whole batch triggers one warning naming it.

    Args:
        specs: the rewards, objects with ``name``, ``weight`` and ``args`` (``RewardSpec``); see the module notes for
            the ``device``, ``clip`` and ``standardize`` args.
        max_workers: threads scoring rewards at once; None = one per reward, 1 = one after another in the caller's
            thread.
    """

    def __init__(self, specs: Sequence[Any], max_workers: int | None = None):
        if not specs:
            raise ValueError("no rewards configured: add at least one entry under 'rewards'")
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1 or None; got {max_workers}")
        self.names = distinct_names([s.name for s in specs])
        """Each reward's name in scores, metrics and ``only``: its spec's, with ``#2``, ``#3``... on repeats."""
        self.weights = torch.tensor([float(s.weight) for s in specs], dtype=torch.float64)
        for i, spec in enumerate(specs):  # every spec before any model loads
            check_spec(spec.name, spec.args, f"rewards.{i}")
        self.slots = []
        for i, spec in enumerate(specs):
            args = dict(spec.args or {})
            device, clip, standardize = _zoo_args(args, f"rewards.{i}")
            reward_args = {k: v for k, v in args.items() if k not in ZOO_ARGS}
            try:
                reward = build_reward(spec.name, reward_args, device)
            except (TypeError, ValueError) as err:  # a value the constructor refused (a range, a choice)
                raise ConfigError(f"bad value in 'rewards.{i}' ({spec.name}): {one_line(err)}") from err
            self.slots.append(_Slot(self.names[i], reward, device, clip, standardize))
        self.rewards = [slot.reward for slot in self.slots]
        self.evaluation_names = [slot.name for slot in self.slots if evaluated(slot.reward)]
        """The rewards held-out evaluation scores: all but the ``rollout_only`` and the groupwise ones."""
        self.max_workers = max_workers or len(self.slots)
        self.nan_counts = dict.fromkeys(self.names, 0)
        self._warned: set[str] = set()
        self._count_lock = threading.Lock()

    def _score(self, slot: _Slot, batch: RewardBatch, on_device: dict[torch.device, RewardBatch],
               moving: threading.Lock) -> tuple[dict[str, torch.Tensor], float]:
        """Raw scores of one reward and its wall time; a failure becomes a one-line :class:`RewardError`."""
        start = time.perf_counter()
        if slot.device is not None:
            with moving:
                if slot.device not in on_device:
                    on_device[slot.device] = dataclasses.replace(
                        batch, images=None if batch.images is None else batch.images.to(slot.device),
                        videos=None if batch.videos is None else batch.videos.to(slot.device))
                batch = on_device[slot.device]
        with slot.lock, torch.no_grad():
            try:
                output = slot.reward(batch)
            except Exception as err:
                raise RewardError(f"reward '{slot.name}' failed: {type(err).__name__}: {one_line(err)}") from err
        try:
            scores = as_scores(output, len(batch), slot.name)
        except ValueError as err:
            raise RewardError(str(err)) from None
        return scores, time.perf_counter() - start

    def __call__(self, batch: RewardBatch, only: Sequence[str] | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
        """Score ``batch`` with every reward, or with the rewards named in ``only`` (then ``main`` has their
        columns, in the zoo's order)."""
        slots = self.slots
        if only is not None:
            unknown = sorted(set(only) - set(self.names))
            if unknown:
                raise ValueError(f"no reward named {unknown} in this zoo (it has {self.names})")
            slots = [slot for slot in self.slots if slot.name in only]
        n = len(batch)
        on_device: dict[torch.device, RewardBatch] = {}
        moving = threading.Lock()
        workers = min(self.max_workers, len(slots))
        if workers <= 1:
            results = [self._score(slot, batch, on_device, moving) for slot in slots]
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="reward") as pool:
                futures = [pool.submit(self._score, slot, batch, on_device, moving) for slot in slots]
                for future in futures:  # wait for every reward before raising the first failure
                    future.exception()
                results = [future.result() for future in futures]
        main = torch.empty(n, len(slots), dtype=torch.float64)
        logged: dict[str, torch.Tensor] = {}
        seconds: dict[str, float] = {}
        for r, (slot, (scores, elapsed)) in enumerate(zip(slots, results)):
            logged.update(scores)
            seconds[slot.name] = elapsed
            raw = main_score(scores, slot.name)
            self._count_nan(slot, raw)
            main[:, r] = raw if slot.clip is None else raw.clamp(*slot.clip)
        return main, logged, seconds

    def standardize(self, main: torch.Tensor) -> torch.Tensor:
        """(N, R) main scores of the whole batch (every process's, gathered) with the columns of the rewards whose
        spec sets ``standardize`` z-scored (:func:`standardize_scores`); the others unchanged."""
        columns = [standardize_scores(column) if slot.standardize else column
                   for slot, column in zip(self.slots, main.unbind(dim=1))]
        return torch.stack(columns, dim=1)

    def _count_nan(self, slot: _Slot, scores: torch.Tensor) -> None:
        """Count the NaN scores; warn once when a reward that is not ``conditional`` applies to none of a batch."""
        name, nan = slot.name, int(scores.isnan().sum())
        with self._count_lock:
            self.nan_counts[name] += nan
            warn = (0 < nan == scores.numel() and not getattr(slot.reward, "conditional", False)
                    and name not in self._warned)
            if warn:
                self._warned.add(name)
        if warn:
            warnings.warn(f"reward '{name}' returned NaN ('does not apply') for all {nan} samples of a batch; "
                          "check its inputs and args if it should apply here (warned once)", RuntimeWarning,
                          stacklevel=3)

