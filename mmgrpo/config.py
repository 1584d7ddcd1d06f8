"""Typed run configuration: OmegaConf structured configs, YAML presets with ``base:`` inheritance, dotted overrides.

Every field is documented where it is defined. A preset names its pipeline (``pipeline: flow``); the pipeline's
registered config class (a subclass of :class:`BaseConfig`) is the schema the YAML is checked against, so an unknown
key or a wrong type is caught before anything runs and reported as one line that names the key::

    config error: unknown key 'train.max_step' (closest valid key: 'train.max_steps')
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A bad configuration. ``str()`` is the one-line message the CLI prints before exiting with code 2."""


def cwd_hint(path: str | os.PathLike) -> str:
    """The end of a not-found error for a relative ``path``: where it was looked for. The presets name the shipped
    models and data relative to the repository root, so a run started elsewhere misses them. Empty for an
    absolute path."""
    if Path(path).is_absolute() or str(path).startswith("~"):
        return ""
    return (f" (looked for under the working directory {Path.cwd()}: the presets name the shipped files "
            "relative to the repository root, so run from there or give an absolute path)")


def hub_id_hint(path: str | os.PathLike) -> str:
    """The end of a failed hub load of ``path``: :func:`cwd_hint` when ``path`` names a folder of the repository
    mmgrpo is installed from but not one under the working directory (a shipped model asked for from elsewhere,
    which then reads as a hub id); empty for anything else, a real hub id included."""
    repository = Path(__file__).resolve().parents[1]
    return cwd_hint(path) if (repository / path).is_dir() and not Path(path).exists() else ""


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take: ``low`` <= value <= ``high``, strict at an ``open`` end; None is
    unbounded. NaN and the infinities are in no range."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        """Whether ``value`` lies in the range."""
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        low, high = (None if v is None else str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"
                     for v in (self.low, self.high))  # whole bounds in full (2147483647, not 2.14748e+09)
        if low is None and high is None:
            return "a finite number"
        if high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        if low is None:
            return f"{'<' if self.high_open else '<='} {high}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def ranged(default: Any = dataclasses.MISSING, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field whose value (every item, for a list) must lie in ``Range(low, high, low_open,
    high_open)``; :func:`validate` checks it when a config loads, and ``mmgrpo config`` shows it. None, the
    unset value of an optional key, always passes."""
    return field(default=default, default_factory=default_factory,
                 metadata={"range": Range(low, high, low_open, high_open)})


def key_ranges(schema: type, prefix: str = "") -> dict[str, Range]:
    """Dotted key -> :class:`Range` for every field of a config dataclass (nested sections included) declared
    with :func:`ranged`."""
    hints = typing.get_type_hints(schema)
    ranges: dict[str, Range] = {}
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            ranges.update(key_ranges(hints[f.name], f"{prefix}{f.name}."))
        elif "range" in f.metadata:
            ranges[f"{prefix}{f.name}"] = f.metadata["range"]
    return ranges


LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
                 "inverse_sqrt")
"""The transformers schedules that are a function of the optimiser step alone (the trainer steps them once per
update and may re-plan their end, :mod:`mmgrpo.schedule`); plateau and greedy schedules need a metric, and the
min-lr and warmup-stable-decay ones arguments this config does not carry."""


POLYNOMIAL_LR_END = 1e-7
"""The lr the polynomial schedule decays to: transformers' default ``lr_end``, which ``get_scheduler`` keeps; the
schedule refuses a peak lr at or below it."""


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = ranged(1e-4, low=0)
    """Peak learning rate."""
    weight_decay: float = ranged(0.0, low=0)
    """AdamW decoupled weight decay."""
    betas: list[float] = ranged(default_factory=lambda: [0.9, 0.999], low=0, high=1, high_open=True)
    """AdamW (beta1, beta2)."""
    eps: float = ranged(1e-8, low=0, low_open=True)
    """AdamW epsilon."""
    max_grad_norm: float = ranged(1.0, low=0)
    """Clip the global gradient norm to this value before each optimiser step; 0 disables clipping."""
    lr_scheduler: str = "constant_with_warmup"
    """A transformers schedule over the run's optimiser steps, one of ``LR_SCHEDULERS``: constant,
    constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial or inverse_sqrt."""
    warmup_steps: int = ranged(0, low=0)
    """Optimiser steps of linear warm-up."""


@dataclass
class GRPOConfig:
    """Advantages, policy loss and KL: the algorithm, independent of the model."""

    advantage: str = "group_zscore"
    """Advantage estimator (registry ``ADVANTAGES``): group_zscore, group_mean (Dr. GRPO), group_mean_batch_std
    (Flow-GRPO: per-group mean, std over the whole gathered batch), rloo (leave-one-out), max_rl ((r - mean) /
    mean: maximum likelihood of success, for rewards >= 0), or ``module:attr``."""
    adv_eps: float = ranged(1e-6, low=0)
    """Added to the std in the denominator of the normalising estimators. Flow-GRPO uses 1e-4."""
    adv_batch_norm: bool = False
    """Z-score the combined advantages over the whole gathered batch (before adv_clip), so their range does not
    grow with the number of rewards: the last step of GDPO as published (with ``reward_aggregation: gdpo``)."""
    adv_clip: float = ranged(0.0, low=0)
    """Clamp advantages to [-adv_clip, adv_clip]; 0 disables. Flow-GRPO uses 5."""
    mask_zero_std_groups: bool = False
    """Dynamic sampling: groups that carry no signal are left out of the loss: the weighted sum of their rewards
    does not vary (``reward_aggregation: weighted_sum``), or none of their weighted rewards varies (``gdpo``)."""
    refill_rounds: int = ranged(0, low=0)
    """DAPO's dynamic sampling refill, with ``mask_zero_std_groups``: while a process has fewer groups with signal
    than its share of ``train.prompts_per_step``, sample up to this many more rounds of prompts, then train on each
    process's share, groups with signal first (the rest stay masked). 0 only masks. Each round costs a rollout
    (flow: of the same iteration, so in the same MixGRPO window)."""
    oversample_prompts: int = ranged(0, low=0)
    """Dynamic sampling, with ``mask_zero_std_groups``: the first rollout of a step samples this many prompts more
    than ``train.prompts_per_step`` (split over the processes like them, so a multiple of their number); each
    process then trains on its share of ``train.prompts_per_step`` groups, those with signal first in sampling
    order, and drops the rest. Groups without signal are then replaced from the same rollout, so fewer refill
    rounds (each a whole rollout) are needed: verl's DAPO recipe samples ``gen_batch_size`` prompts for every
    ``train_batch_size`` it trains on for the same reason."""
    loss: str = "ppo_clip"
    """Policy loss (registry ``POLICY_LOSSES``): ppo_clip (clipped surrogate) or reinforce (unclipped ratio * A)."""
    clip_eps: float = ranged(0.2, low=0, low_open=True)
    """Lower clip range: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]. Flow-GRPO uses 1e-4."""
    clip_eps_high: float | None = ranged(None, low=0, low_open=True)
    """Upper clip range (clip-higher, DAPO uses 0.28); None means the same as clip_eps (symmetric)."""
    ratio_level: str = "token"
    """Importance ratio per unit ('token') or one per sequence, the geometric mean over its units ('sequence',
    GSPO). A unit is a token for the VLM pipeline and a denoising step for the flow pipeline. GSPO's objective is
    a mean over sequences: pair 'sequence' with loss_aggregation seq-mean-token-mean (token-mean weighs each
    sequence's term by its length)."""
    loss_aggregation: str = "token-mean"
    """token-mean (DAPO), seq-mean-token-mean (GRPO) or seq-mean-token-sum-norm (Dr. GRPO, constant denominator)."""
    kl_beta: float = ranged(0.0, low=0)
    """Weight of the KL penalty to the reference policy; 0 skips the reference forward entirely."""
    kl_estimator: str = "k3"
    """KL estimator from log-probs: k1, k2 or k3 (low-variance). The flow pipeline uses its closed form instead."""


@dataclass
class TrainConfig:
    """The loop: how many samples, how they are split, how often weights change."""

    max_steps: int = ranged(100, low=1)
    """Optimiser steps to run in total (each rollout gives num_inner_epochs * updates_per_rollout of them)."""
    prompts_per_step: int = ranged(8, low=1)
    """Prompts per rollout, summed over all processes. Must divide evenly by the number of processes."""
    group_size: int = ranged(8, low=1)
    """G: samples per prompt. A group is always sampled, scored and normalised on one process, whole."""
    micro_batch_size: int = ranged(8, low=1)
    """Samples per training forward/backward on one process. Rollouts are chunked the same way."""
    updates_per_rollout: int = ranged(1, low=1)
    """Optimiser steps per pass over a rollout: the micro-batches are dealt into this many gradient-accumulation
    groups, as evenly as possible; a process needs at least this many micro-batches."""
    num_inner_epochs: int = ranged(1, low=1)
    """K: passes over each rollout (TRL's num_iterations). Each pass after the first is off-policy."""
    mixed_precision: str | None = None
    """accelerate mixed precision for model forwards: no, fp16 or bf16; null takes the launcher's setting
    (``accelerate launch --config_file ...`` or ``--mixed_precision``), or no without a launcher. A value here
    overrides the launcher's. Log-prob math always runs in fp32."""
    ema_decay: float = ranged(0.0, low=0, high=1, high_open=True)
    """Keep an exponential moving average of the trainable weights with this decay (0 disables). The EMA weights
    are saved next to the raw ones (``checkpoints/step-N/policy_ema/``, in the format of ``policy/``) and used by
    eval and sample."""
    save_every: int = ranged(50, low=0)
    """Save a checkpoint every this many optimiser steps (and always at the end); 0 saves only at the end."""
    keep_last: int = ranged(2, low=0)
    """Checkpoints to keep; older ones are deleted after a new one is complete. 0 keeps all."""
    eval_every: int = ranged(0, low=0)
    """Evaluate on the held-out split every this many optimiser steps; 0 disables in-loop evaluation."""
    max_minutes: float = ranged(0.0, low=0)
    """Wall-clock budget of training in minutes (rollouts, rewards, updates, in-loop evaluation and checkpoints;
    summed over resumes), checked when an iteration's training ends (that iteration is still evaluated and saved);
    0: none, max_steps alone ends the run. A decaying lr
    schedule (cosine, linear, ...) is re-planned to reach its end where the budget is projected to end (at most
    max_steps), so a slower machine stops with the lr decayed instead of part-way down its schedule. The run
    still ends at max_steps if that comes first."""


@dataclass
class RewardSpec:
    """One reward in the mix."""

    name: str = "???"
    """Registered reward name or ``package.module:attr``."""
    weight: float = ranged(1.0)
    """Weight of this reward in the combination. 0 scores and logs it (``reward/<name>/mean``) without training on
    it: a monitor, such as ``grid_seams`` next to a preference reward."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the reward's constructor."""


def switched_reward(rewards: list[RewardSpec], name: str, enabled: bool, switch: str) -> tuple[int, RewardSpec] | None:
    """(index, spec) of the one ``rewards`` entry named ``name`` when the option ``switch`` is on; None when it is
    off. For a reward that only an option of the pipeline feeds (T-GRPO's and GRPO-CARE's bonuses): the reward
    without the option would always be NaN, and the option without the reward would work for nothing, so either
    is a ConfigError, as is more than one such entry."""
    found = [(i, s) for i, s in enumerate(rewards) if s.name == name]
    if not enabled:
        if found:
            raise ConfigError(f"rewards.{found[0][0]}: the {name} reward needs {switch}: true")
        return None
    if len(found) != 1:
        raise ConfigError(f"{switch} needs exactly one '{name}' entry under 'rewards' (found {len(found)})")
    return found[0]


@dataclass
class LoggingConfig:
    """Where metrics go. metrics.jsonl is always written."""

    progress: bool = True
    """Show a tqdm progress bar with reward and step time."""
    tensorboard: bool = True
    """Also write tensorboard event files to output_dir/tb when tensorboard is installed."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the ``wandb`` extra)."""
    wandb_project: str = "mmgrpo"
    """W&B project name."""
    plot_every: int = ranged(10, low=0)
    """Redraw the PNG metric curves in output_dir/plots every this many optimiser steps (0: only at the end)."""
    plot_max_share: float = ranged(0.05, low=0.0, high=1.0)
    """Skip a redraw while redrawing has taken more than this share of the run's wall-clock (since training began):
    a redraw takes 1-2 s on one CPU thread, as long as a few steps of a tiny CPU run, so there the curves lag
    instead of slowing training (redraws every 10 steps took 21% of a 100-step ``tiny_image`` run, 7% under this
    cap). The curves are always drawn at the end of a run."""


@dataclass
class BaseConfig:
    """Keys every preset has. Pipelines subclass this and add their model, rollout and data sections."""

    pipeline: str = "???"
    """Which pipeline (registry ``PIPELINES``) builds the policy and data: flow, vlm, or a registered one."""
    output_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, samples/, plots/."""
    seed: int = ranged(0, low=0, high=2**31 - 1)
    """Seed for every random generator; each process adds its rank (numpy takes seeds below 2**32)."""
    num_threads: int = ranged(0, low=0)
    """torch CPU threads per process; 0 keeps torch's default (one per core). Tiny CPU runs on a shared machine
    are often faster with 1."""
    resume: str | None = None
    """'latest' resumes from the newest complete checkpoint in output_dir (and starts fresh if there is none);
    a path resumes from that checkpoint folder."""
    train: TrainConfig = field(default_factory=TrainConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rewards: list[RewardSpec] = field(default_factory=list)
    """The rewards and their weights. See ``mmgrpo rewards`` for the registered names."""
    reward_aggregation: str = "weighted_sum"
    """weighted_sum: add the weighted raw rewards, then compute advantages. gdpo: normalise each reward within its
    group first, then add the weighted results (keeps distinct reward combinations apart)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "grpo.ratio_level": ("token", "sequence"),
    "grpo.loss_aggregation": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "grpo.kl_estimator": ("k1", "k2", "k3"),
    "reward_aggregation": ("weighted_sum", "gdpo"),
}
"""String fields with a closed set of values, checked after loading (registry-backed fields are checked on use)."""


def valid_keys(schema: type, prefix: str = "") -> dict[str, bool]:
    """All dotted keys of a config dataclass -> whether the key is an open dict (any sub-key allowed below it)."""
    keys: dict[str, bool] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp):
            keys[key] = False
            keys.update(valid_keys(tp, key + "."))
        else:
            keys[key] = origin is dict or tp is Any
    return keys


def key_docs(schema: type, prefix: str = "") -> dict[str, str]:
    """All dotted keys of a config dataclass -> the docstring written under the field (from the nearest class of
    the MRO that documents it; "" when none does). A section key (a nested dataclass) comes before its keys, and
    without a docstring of its own it takes its class docstring's first line."""
    import docstring_parser

    own: dict[str, str] = {}
    for cls in reversed([c for c in schema.__mro__ if dataclasses.is_dataclass(c)]):
        own.update({p.arg_name: " ".join((p.description or "").split())
                    for p in docstring_parser.parse_from_object(cls).params})
    hints = typing.get_type_hints(schema)
    docs: dict[str, str] = {}
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        docs[key] = own.get(f.name, "")
        if dataclasses.is_dataclass(hints[f.name]):
            docs[key] = docs[key] or docstring_parser.parse_from_object(hints[f.name]).short_description or ""
            docs.update(key_docs(hints[f.name], key + "."))
    return docs


def _closest(key: str, candidates: list[str]) -> str:
    """' (closest valid key: ...)' for an unknown dotted key, or the list of top-level keys when its first component is
    close to none of them. Each component is corrected to the closest name at its level while one is close; the
    suggestion is the valid key below the corrected part closest to the corrected key."""
    parts, fixed = key.split("."), []
    for part in parts:
        prefix = "".join(f"{name}." for name in fixed)
        names = {k[len(prefix):].split(".")[0] for k in candidates if k.startswith(prefix)}
        close = difflib.get_close_matches(part, names, n=1)
        if not close:
            break
        fixed.append(close[0])
    if not fixed:
        top = dict.fromkeys(k.split(".")[0] for k in candidates)
        return f" (no valid key is close; the top-level keys are {', '.join(top)})"
    known = ".".join(fixed)
    below = [k for k in candidates if k == known or k.startswith(known + ".")]
    best = difflib.get_close_matches(".".join(fixed + parts[len(fixed):]), below, n=1, cutoff=0.0)[0]
    return f" (closest valid key: '{best}')"


def check_key(key: str, schema: type, prefix: str = "") -> None:
    """Raise ConfigError when the dotted ``key`` is not in ``schema`` (keys below open dicts and list indices pass;
    below an index of a list of sections, ``rewards.0.weight``, the rest is checked against the section).
    ``prefix``: the path of the section ``schema`` is, for the message."""
    keys = valid_keys(schema)
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in keys:
            if i == len(parts) or keys[head]:
                return
            if parts[i].isdigit():
                item = field_type(f"{head}.{parts[i]}", schema)
                if dataclasses.is_dataclass(item) and i + 1 < len(parts):
                    check_key(".".join(parts[i + 1:]), item, f"{prefix}{head}.{parts[i]}.")
                return
            break
    raise ConfigError(f"unknown key '{prefix}{key}'{_closest(prefix + key, [prefix + k for k in keys])}")


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the plain scalars of the YAML 1.2 core schema instead of YAML 1.1's: decimal ints
    (``010`` is 10, not octal 8) plus ``0o``/``0x``, floats with a dot or an exponent (``1e-3``, ``.inf``), only
    true/false as booleans, null/~/empty as null, and every other plain scalar a string (``on``, ``yes``,
    ``12:30``, ``2024-01-01``, ``1_000``). A typed key still converts a string it can (OmegaConf reads ``off``
    for a boolean key and ``1_000`` for an int one). A key given twice in one mapping is an error (PyYAML keeps
    the last silently: a second ``train:`` drops the first)."""

    yaml_implicit_resolvers: typing.ClassVar[dict] = {}  # filled below: none of SafeLoader's YAML 1.1 resolvers

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue
            if key in lines:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {lines[key] + 1})", key_node.start_mark)
            lines[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """A core-schema int: decimal (leading zeros allowed), ``0o`` octal or ``0x`` hexadecimal."""
        text = self.construct_scalar(node)
        return int(text, 0) if text.startswith(("0o", "0x")) else int(text, 10)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)
for _tag, _pattern, _first in (
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("bool", r"true|True|TRUE|false|False|FALSE", list("tTfF")),
    ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", list("-+0123456789")),
    ("float", (r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"), list("-+0123456789.")),
    ("merge", r"<<", ["<"]),  # anchors merged into a mapping (<<: *defaults), as before
):
    ConfigLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_pattern})$"), _first)


def load_yaml(text: str | bytes) -> Any:
    """YAML text (or its bytes) as Python values, read with :class:`ConfigLoader`."""
    return yaml.load(text, Loader=ConfigLoader)


def read_preset(path: str | os.PathLike, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML preset and merge its ``base:`` chain (a path or list of paths, relative to the file).

    Bases merge in order, then the file itself; nested mappings merge key by key and lists are replaced. ``chain``
    holds the presets whose bases led here, for the messages about a missing base or a cycle."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config path {path} is a directory, not a YAML file"
                          + (f" (the base of {chain[-1]})" if chain else ""))
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (the base of {chain[-1]})" if chain else ""))
    resolved = [p.resolve() for p in chain]
    if path.resolve() in resolved:
        cycle = [*chain[resolved.index(path.resolve()):], path]
        raise ConfigError(f"'base:' cycle in presets: {' -> '.join(map(str, cycle))}")
    try:
        data = load_yaml(path.read_bytes()) or {}  # bytes: YAML's own encodings (UTF-8, or UTF-16 by its BOM)
    except yaml.YAMLError as err:
        raise ConfigError(f"cannot parse {path}: {' '.join(str(err).split())}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, not {type(data).__name__}")
    bases = data.pop("base", None) or []
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"bad value for 'base' in {path}: expected a file path or a list of file paths")
    merged = OmegaConf.create()
    for base in bases:
        merged = OmegaConf.merge(merged, read_preset(path.parent / base, (*chain, path)))
    try:
        return OmegaConf.to_container(OmegaConf.merge(merged, data))
    except (OmegaConfBaseException, TypeError, ValueError) as err:
        raise ConfigError(f"{path} does not merge onto its base: {' '.join(str(err).split())}") from err


def check_sections(data: dict, schema: type, prefix: str = "") -> None:
    """Raise ConfigError naming the first key of ``data`` (nested dicts of a preset) that holds something other than
    a mapping where ``schema`` has a section, or, in a list of sections (``rewards``), an item key the section does
    not have (``rewards.0.wieght``, with the closest)."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        tp = field_type(key, schema)
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"bad value for '{key}': expected a mapping of its keys (a section), got "
                                  f"{value!r}")
            if key.rpartition(".")[2].isdigit():  # an item of a list of sections, by an override (rewards.0={...})
                check_item_keys(value, tp, key)
            check_sections(value, schema, key + ".")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]) \
                and isinstance(value, list):
            item_type = typing.get_args(tp)[0]
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    continue
                check_item_keys(item, item_type, f"{key}.{i}")
                check_sections(item, schema, f"{key}.{i}.")
                try:  # a whole list is typed item by item with no path: name it here
                    OmegaConf.merge(OmegaConf.structured(item_type), item)
                except OmegaConfBaseException as err:
                    raise ConfigError(_omegaconf_message(err, item_type, f"{key}.{i}.")) from err


def check_item_keys(item: dict, item_type: type, path: str) -> None:
    """Raise ConfigError for the first key of ``item`` (the mapping of list item ``path``, ``rewards.0``) that the
    section ``item_type`` does not have, with the closest of its keys."""
    names = [f.name for f in dataclasses.fields(item_type)]
    unknown = next((k for k in item if k not in names), None)
    if unknown is not None:
        close = difflib.get_close_matches(str(unknown), names, n=1)
        hint = f" (closest: '{close[0]}')" if close else f" (valid: {', '.join(names)})"
        raise ConfigError(f"unknown key '{path}.{unknown}'{hint}")


def dotted_key(key: str) -> str:
    """An OmegaConf key path with its list indices dotted: ``rewards[1].name`` -> ``rewards.1.name``."""
    return re.sub(r"\[(\d+)\]", r".\1", key)


def _omegaconf_message(err: OmegaConfBaseException, schema: type, prefix: str = "") -> str:
    """One line for an OmegaConf error of ``schema`` that names its dotted key (list indices as ``.0``, not
    ``[0]``), with ``prefix`` before it: the path of the section ``schema`` is."""
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    key = prefix + dotted_key(str(key)) if key else ""
    text = " ".join(str(err).split("\n")[0].split())
    if type(err).__name__ == "ConfigKeyError" and key:
        return f"unknown key '{key}'{_closest(str(key), list(valid_keys(schema)))}"
    if key:
        return f"bad value for '{key}': {text}"
    return text


def field_type(key: str, schema: type) -> Any:
    """The annotated type of a dotted key (list indices step into the element type); None when unknown."""
    tp: Any = schema
    for part in key.split("."):
        if part.isdigit() and typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        elif dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(part)
        else:
            return None
    return tp


def unquoted(value: str) -> str | None:
    """The string ``value`` holds when it is exactly one YAML-quoted scalar (``'it''s'`` -> it's, ``"a\\tb"`` ->
    a<tab>b, by YAML's quoting rules); None for anything else (``'a' and 'b'``, ``it's``)."""
    if len(value) < 2 or value[0] not in "'\"" or value[-1] != value[0]:
        return None
    try:
        node = yaml.compose(value, Loader=ConfigLoader)
    except yaml.YAMLError:
        return None
    whole = isinstance(node, yaml.ScalarNode) and node.style == value[0] and node.end_mark.index == len(value)
    return node.value if whole else None


def parse_override(key: str, value: str, schema: type) -> Any:
    """The value of a ``key=value`` override: for string fields the unquoted string when the value is one quoted
    YAML scalar (``model.path='a b'``), else kept verbatim (so templates with braces and colons survive);
    otherwise parsed as YAML (numbers, booleans, null, lists, mappings)."""
    tp = field_type(key, schema)
    if tp is str or tp == (str | None):
        string = unquoted(value)
        if string is not None:
            return string
        return None if value in ("null", "None", "~") and tp != str else value
    try:
        return load_yaml(value) if value != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"bad value for '{key}': cannot parse '{value}' ({' '.join(str(err).split())})") from err


def check_index(cfg: Any, key: str) -> None:
    """Raise ConfigError when the dotted override ``key`` indexes past the end of a list of ``cfg`` (an OmegaConf
    config): an override changes an item a list has, or sets the whole list."""
    parts = key.split(".")
    for i, part in enumerate(parts[1:], start=1):
        items = OmegaConf.select(cfg, ".".join(parts[:i]), throw_on_missing=False)
        if part.isdigit() and isinstance(items, ListConfig) and int(part) >= len(items):
            name = ".".join(parts[:i])
            raise ConfigError(f"bad value for '{key}': '{name}' has {len(items)} item{'s' * (len(items) != 1)}; an "
                              f"override changes an item the list has or sets the whole list ({name}=[...])")


def load_config(path: str | os.PathLike | None, overrides: list[str] = (), schema: type | None = None) -> Any:
    """Build the typed config object from a preset file and ``dotted.key=value`` overrides.

    ``schema`` defaults to the config class of the pipeline the preset names. Returns an instance of it."""
    raw = read_preset(path) if path is not None else {}
    pairs = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
        pairs.append((key.strip(), value))
    if schema is None:
        pipeline = next((v for k, v in pairs if k == "pipeline"), raw.get("pipeline"))
        if not pipeline:
            raise ConfigError("no 'pipeline' key: the preset must say which pipeline it configures")
        from mmgrpo.registry import PIPELINES, RegistryError

        try:
            schema = PIPELINES.get(str(pipeline)).config_class
        except RegistryError as err:
            raise ConfigError(f"bad value for 'pipeline': {err}") from err
    for key, _ in pairs:
        check_key(key, schema)
    parsed = [(key, parse_override(key, value, schema)) for key, value in pairs]
    check_sections(raw, schema)
    check_sections(dict(parsed), schema)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), raw)
        for key, value in parsed:
            check_index(cfg, key)
            OmegaConf.update(cfg, key, value, merge=True)
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ConfigError(f"missing required key '{dotted_key(missing[0])}'")
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(_omegaconf_message(err, schema)) from err
    except (TypeError, IndexError, KeyError) as err:
        raise ConfigError(f"cannot apply overrides {[k for k, _ in pairs]}: {err}") from err
    validate(obj)
    obj.output_dir = os.path.expanduser(obj.output_dir)  # ~/runs/x is in the home folder, as in a shell
    if obj.resume not in (None, "", "latest"):
        obj.resume = os.path.expanduser(obj.resume)
    return obj


def get_key(cfg: Any, key: str) -> Any:
    """Read a dotted key from a config object."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Raise ConfigError for the first key of ``cfg`` (a config dataclass or a section of one, whose keys start
    with ``prefix``) whose value lies outside its :func:`ranged` range; sections and lists of them (``rewards``)
    are checked item by item."""
    for f in dataclasses.fields(cfg):
        key, value = f"{prefix}{f.name}", getattr(cfg, f.name)
        items = value if isinstance(value, list) else [value]
        if any(dataclasses.is_dataclass(item) for item in items):
            for i, item in enumerate(items):
                check_ranges(item, f"{key}.{i}." if isinstance(value, list) else f"{key}.")
        elif "range" in f.metadata and value is not None and not all(f.metadata["range"].holds(v) for v in items):
            raise ConfigError(f"bad value for '{key}': must be {f.metadata['range']}, got {value}")


def validate(cfg: BaseConfig) -> None:
    """Value checks that a type cannot express. Raises ConfigError naming the key."""
    if cfg.output_dir.strip() in ("", "null", "None", "~"):
        raise ConfigError(f"bad value for 'output_dir': expected the run directory, got {cfg.output_dir!r}")
    for key, allowed in CHOICES.items():
        value = get_key(cfg, key)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.0)
            raise ConfigError(f"bad value '{value}' for '{key}': expected one of {', '.join(allowed)}"
                              + (f" (closest: '{close[0]}')" if close else ""))
    if cfg.train.mixed_precision not in (None, "no", "fp16", "bf16"):
        raise ConfigError(f"bad value '{cfg.train.mixed_precision}' for 'train.mixed_precision': expected one of no, "
                          "fp16, bf16 (or null for the launcher's)")
    check_ranges(cfg)
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"bad value for 'optim.betas': expected two values (beta1, beta2), got {cfg.optim.betas}")
    from mmgrpo.rewards.zoo import check_spec

    for i, spec in enumerate(cfg.rewards):
        if spec.name in ("", "???"):
            raise ConfigError(f"missing required key 'rewards.{i}.name'")
        check_spec(spec.name, spec.args, f"rewards.{i}")
    if cfg.optim.lr_scheduler not in LR_SCHEDULERS:
        close = difflib.get_close_matches(cfg.optim.lr_scheduler, LR_SCHEDULERS, n=1, cutoff=0.0)
        raise ConfigError(f"bad value '{cfg.optim.lr_scheduler}' for 'optim.lr_scheduler': expected one of "
                          f"{', '.join(LR_SCHEDULERS)}" + (f" (closest: '{close[0]}')" if close else ""))
    if cfg.optim.lr_scheduler == "polynomial" and not cfg.optim.lr > POLYNOMIAL_LR_END:
        raise ConfigError(f"bad value for 'optim.lr': the polynomial lr_scheduler decays to {POLYNOMIAL_LR_END:g} "
                          f"and needs a peak lr above it, got {cfg.optim.lr:g} (or choose another lr_scheduler)")
    from mmgrpo.registry import ADVANTAGES, POLICY_LOSSES, RegistryError

    for key, registry in (("grpo.advantage", ADVANTAGES), ("grpo.loss", POLICY_LOSSES)):
        try:
            registry.get(get_key(cfg, key))
        except RegistryError as err:
            raise ConfigError(f"bad value for '{key}': {err}") from err
    if hasattr(cfg, "validate") and callable(cfg.validate):
        cfg.validate()


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (what ``config.yaml`` in the run directory holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config object (or a config class: its defaults, ``???`` for a required key) as nested dicts and lists."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))


__all__ = [
    "BaseConfig",
    "ConfigError",
    "GRPOConfig",
    "LoggingConfig",
    "OptimConfig",
    "Range",
    "RewardSpec",
    "TrainConfig",
    "check_ranges",
    "key_docs",
    "key_ranges",
    "load_config",
    "ranged",
    "read_preset",
    "to_dict",
    "to_yaml",
]
