"""The ``mmgrpo`` command line. Config errors exit with code 2 and one line that names the key."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmgrpo.config import ConfigError, load_config
from mmgrpo.errors import RunError
from mmgrpo.registry import RegistryError

DEMO_MISSING = """\
mmgrpo demo {which} needs {missing}, which this installation does not have: the tiny models (assets/) and the
presets (configs/) are in the repository, not in the package. Run it from a clone:
  git clone <the mmgrpo repository> && cd mmgrpo && pip install -e ".[dev]" && mmgrpo demo {which}
Nothing was trained."""


def _policy_and_weights(cfg: Any) -> tuple[Any, Path | None]:
    """The configured policy with the weights of ``cfg.resume`` (a checkpoint path or 'latest') when given, and the
    checkpoint folder they came from (None: the configured model's own weights)."""
    import torch

    from mmgrpo import checkpoint
    from mmgrpo.policy import build_policy

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    policy = build_policy(cfg)
    found = checkpoint.resolve_resume(cfg.resume, Path(cfg.output_dir))
    if cfg.resume and found is None:
        raise FileNotFoundError(f"no checkpoint to load in {Path(cfg.output_dir) / 'checkpoints'}")
    if found is not None:
        from mmgrpo.config import to_dict

        old, new = None, checkpoint.flatten(to_dict(cfg))
        try:
            saved = found / checkpoint.CONFIG_FILE
            if saved.is_file():  # the weights fit only the pipeline and base model they were trained on
                old = checkpoint.saved_config(saved)
                error = checkpoint.fixed_change(old, new, found, keys=("pipeline", "model.path"))
                if error is not None:
                    raise error
            try:
                policy.load(found / "policy")
            except Exception:  # a model.* setting the weights do not fit (lora_rank...) is named, not the files
                error = None if old is None else checkpoint.fixed_change(old, new, found, keys=("model.",))
                if error is not None:
                    raise error from None
                raise
            ema = found / "ema.safetensors"
            if ema.is_file():  # a run with train.ema_decay > 0: evaluate and sample with the averaged weights
                from safetensors.torch import load_file

                params = dict(policy.model.named_parameters())
                with torch.no_grad():
                    for name, value in load_file(str(ema)).items():
                        params[name].copy_(value.to(params[name].dtype))
        except ConfigError:
            raise
        except Exception as err:  # a torn file, weights of another shape: one line naming the checkpoint
            raise checkpoint.unreadable(found, err, Path(cfg.output_dir)) from err
    return policy, found


def trained_config_changes(cfg: Any, found: Path | None) -> list[str]:
    """The dotted keys in which ``cfg`` differs from the config checkpoint ``found`` was trained with (saved in it),
    but for the keys a run may change freely (output_dir, logging...); printed as a note, since eval and sample
    follow ``cfg``. Empty without a checkpoint or its config."""
    from mmgrpo import checkpoint
    from mmgrpo.config import to_dict

    if found is None or not (found / checkpoint.CONFIG_FILE).is_file():
        return []
    fixed, other = checkpoint.config_changes(checkpoint.saved_config(found / checkpoint.CONFIG_FILE),
                                             checkpoint.flatten(to_dict(cfg)))
    changed = sorted(fixed + other)
    if changed:
        shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
        print(f"note: this config differs from the one {found} was trained with in {shown}; these settings follow "
              f"this config (pass {found / checkpoint.CONFIG_FILE} to use the training ones)", file=sys.stderr)
    return changed


def output_tag(directory: Path, kind: str, checkpoint: Path | None) -> str:
    """A file stem in ``directory`` for ``kind`` ("eval", "sample") outputs of ``checkpoint`` that no earlier file
    or folder (``sample``'s per-sample one) has: ``sample-step-20``, ``sample-base`` (no checkpoint), then
    ``sample-step-20-2``... so nothing is overwritten."""
    stem = f"{kind}-{checkpoint.name if checkpoint is not None else 'base'}"
    tag, n = stem, 1
    while (directory / tag).exists() or any(directory.glob(f"{tag}.*")):
        n += 1
        tag = f"{stem}-{n}"
    return tag


def cmd_train(args: argparse.Namespace) -> int:
    from mmgrpo.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg)
    history = trainer.train()
    trainer.print_summary(history)
    trainer.close()
    return signal_exit_code(trainer.interrupted)


def signal_exit_code(stopped_by: str | None) -> int:
    """The shell's exit code of a run that a signal (``"SIGINT"``...) stopped early after saving: 128 + its
    number; 0 for a run that ended on its own (or that another process's signal stopped)."""
    return 128 + signal.Signals[stopped_by].value if stopped_by in signal.Signals.__members__ else 0


def cmd_eval(args: argparse.Namespace) -> int:
    from mmgrpo.rewards import RewardZoo

    cfg = load_config(args.config, args.overrides)
    policy, found = _policy_and_weights(cfg)
    changed = trained_config_changes(cfg, found)
    _, eval_items = policy.datasets()
    batch = policy.generate(eval_items)
    if len(batch) == 0:  # every held-out item was skipped (bad media, prompts over the budget: warned above)
        raise RunError(f"none of the {len(eval_items)} held-out items could be evaluated: all were skipped")
    zoo = RewardZoo(cfg.rewards)
    _main, logged, _ = zoo(batch, only=zoo.evaluation_names)
    means = {k: v.nanmean().item() for k, v in logged.items()}
    result = {"num_samples": len(batch), "num_items": len(eval_items),
              "rewards": {k: None if math.isnan(v) else v for k, v in means.items()},  # NaN: no sample applied
              "checkpoint": None if found is None else str(found), "config_changes": changed}
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = output_tag(out / "samples", "eval", found)
    text = json.dumps(result, indent=2, allow_nan=False)
    (out / "eval.json").write_text(text)  # the latest evaluation; each one is kept as samples/<tag>.json too
    policy.save_samples(batch, out / "samples", tag, per_sample=True, scores=logged)
    (out / "samples" / f"{tag}.json").write_text(text)
    for name, value in means.items():
        print(f"{name:>32s}  {value:.4f}")
    print(f"wrote {out / 'eval.json'}, {out / 'samples' / tag}.json and each sample in {out / 'samples' / tag}/")
    return 0


def inline_yaml(value: Any) -> str:
    """``value`` as one line of YAML flow style (``null``, ``[1, 2]``, ``{name: x}``)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=2**31, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def table_console() -> Any:
    """A rich console for the tables of ``config`` and ``rewards``: the terminal's width, and at least 160 columns
    (or ``COLUMNS``, when wider) when the output goes to a pipe or a file (rich would wrap the tables at 80)."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console()
    columns = os.environ.get("COLUMNS", "")
    return Console(width=max(160, int(columns) if columns.isdigit() else 0))


def cmd_config(args: argparse.Namespace) -> int:
    from rich.table import Column, Table
    from rich.text import Text

    from mmgrpo.config import key_docs, key_ranges, to_dict
    from mmgrpo.registry import PIPELINES

    if not Path(args.config).is_file() and args.config in PIPELINES:  # a pipeline name (configs/ has a flow/)
        if args.overrides:
            raise ConfigError("overrides apply to a preset file, not to a pipeline's defaults")
        schema = PIPELINES.get(args.config).config_class
        values, title = to_dict(schema), f"{args.config} pipeline defaults (??? = required)"
    else:
        cfg = load_config(args.config, args.overrides)
        schema, values, title = type(cfg), to_dict(cfg), f"{args.config} ({cfg.pipeline} pipeline)"
    docs = key_docs(schema)
    docs.update({key: f"{docs[key]} Must be {allowed}." for key, allowed in key_ranges(schema).items()})
    needle = (args.grep or "").lower()
    table = Table(Column("key", no_wrap=True), Column("value", overflow="fold"), Column("what it is", ratio=1),
                  title=title)
    shown = [key for key, doc in docs.items() if not needle or needle in key.lower() or needle in doc.lower()]
    if not shown:
        print(f"no option of {title} matches '{args.grep}' (in its key or its description)", file=sys.stderr)
        return 1
    for key in shown:
        doc = docs[key]
        value: Any = values
        for part in key.split("."):
            value = value[part]
        is_section = any(k.startswith(key + ".") for k in docs)
        table.add_row(Text(key, style="bold" if is_section else ""), Text("" if is_section else inline_yaml(value)),
                      Text(doc))  # Text: brackets in values and docs are not markup
    table_console().print(table)
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    policy, found = _policy_and_weights(cfg)
    trained_config_changes(cfg, found)
    train_items, eval_items = policy.datasets()
    known = {item["prompt"]: item for item in train_items + eval_items}
    items = [known.get(p, {"prompt": p}) for p in args.prompt] if args.prompt else eval_items[: args.num]
    if args.sample_seed is not None:
        items = [{**item, "seed": args.sample_seed} for item in items]
    # one per item: the call eval and training make, which every pipeline takes
    batch = policy.generate(items, per_prompt=args.per_prompt) if args.per_prompt > 1 else policy.generate(items)
    if len(batch) == 0:
        raise RunError(f"none of the {len(items)} items could be sampled: all were skipped")
    out = Path(cfg.output_dir) / "samples"
    for path in policy.save_samples(batch, out, output_tag(out, "sample", found), per_sample=True):
        print(f"wrote {path}")
    return 0


def cmd_rewards(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from mmgrpo.registry import REWARDS

    table = Table(title="registered rewards")
    for col in ("name", "kind", "modality", "description", "source"):
        table.add_column(col)
    for entry in REWARDS:
        info = entry.info
        table.add_row(entry.name, info.get("kind", "pointwise"), info.get("modality", "any"),
                      escape(info.get("description", "")),  # "[lo, hi]" is text, not rich markup
                      escape(info.get("source", "built-in")))
    table_console().print(table)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from mmgrpo.bench import BENCHES, BenchUsageError, run_bench

    if args.name not in BENCHES:
        known = ", ".join(BENCHES.names()) or "none yet"
        print(f"unknown benchmark '{args.name}' (available: {known})", file=sys.stderr)
        return 2
    only = tuple(filter(None, args.only.split(","))) if args.only else None
    try:
        run_bench(args.name, args.out, threads=args.threads, only=only)
    except BenchUsageError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


def cmd_serve_rewards(args: argparse.Namespace) -> int:
    from mmgrpo.rewards.server import BindError, serve

    try:
        server = serve(args.config, host=args.host, port=args.port, token_env=args.token_env)
    except BindError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    names = ", ".join(server.zoo.names)
    print(f"serving rewards [{names}] on {server.url} (POST /v1/score, GET /health); Ctrl-C or SIGTERM stops",
          flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop gets the same clean shutdown as Ctrl-C
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    return 0


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_demo(args: argparse.Namespace) -> int:
    from mmgrpo.demo import LAUNCHED_AT, demo_processes, in_repo, launch, missing_parts, run_demo

    out = args.output_dir or f"runs/demo-{args.which}"  # relative to where the user is
    missing = missing_parts(args.which)
    if missing:
        print(DEMO_MISSING.format(which=args.which, missing=", ".join(missing)), file=sys.stderr)
        return 2
    out = Path(out).resolve()
    processes = demo_processes(args.which, args.processes)
    if processes > 1 and "WORLD_SIZE" not in os.environ:  # not launched yet: run this command in each process
        minutes = [] if args.minutes is None else ["--minutes", str(args.minutes)]
        return launch(processes, ["-m", "mmgrpo.cli", "demo", args.which, "--output-dir", str(out), "--processes",
                                  str(processes), *minutes])
    with in_repo():
        try:
            _, stopped_by = run_demo(args.which, str(out), args.minutes)
        except KeyboardInterrupt:  # before or after training, or a second Ctrl-C
            if os.environ.get("RANK", "0") == "0":
                print(f"demo interrupted before it finished: no report written to {out}", file=sys.stderr)
            stopped_by = "SIGINT"
    if LAUNCHED_AT in os.environ:  # a process of launch(), which reports the signal it passed on
        return 0
    return signal_exit_code(stopped_by)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmgrpo", description="GRPO for multimodal models: flow/diffusion "
                                     "generators and vision-language reasoners.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(name: str, help_text: str, fn: Callable) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", help="YAML preset, e.g. configs/flow/tiny_flowgrpo.yaml")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=10")
        p.set_defaults(fn=fn)
        return p

    with_config("train", "train with GRPO", cmd_train)
    with_config("eval", "score held-out prompts and write eval.json to the run directory", cmd_eval)
    p = with_config("sample", "generate images, videos or text (with a checkpoint via resume=...)", cmd_sample)
    p.add_argument("--prompt", action="append", help="prompt to sample (repeatable); default: held-out prompts")
    p.add_argument("--num", type=positive_int, default=8, help="held-out prompts to sample when no --prompt is given")
    p.add_argument("--per-prompt", type=positive_int, default=1, metavar="K", help="samples per prompt (default 1), "
                   "each from its own seed (index.json's seed); the vlm needs generation.eval_temperature > 0")
    p.add_argument("--sample-seed", type=non_negative_int, metavar="SEED", help="the seed of each prompt's first "
                   "sample (default: from seed and the prompt): a seed from index.json regenerates that sample")

    p = with_config("config", "show every option of a preset (or a pipeline's defaults: 'mmgrpo config flow'): "
                    "its resolved value and what it does", cmd_config)
    p.add_argument("--grep", help="only the options whose key or description contains this text")

    p = sub.add_parser("rewards", help="list registered rewards with their kind and modality")
    p.set_defaults(fn=cmd_rewards)

    p = sub.add_parser("bench", help="run a benchmark suite, print a table, write JSON")
    p.add_argument("name", help="suite name")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--threads", type=non_negative_int, default=1, help="torch CPU threads, recorded in the output "
                   "(default 1: on a small shared CPU, more threads wait on each other and make ratios erratic; 0: "
                   "torch's own count)")
    p.add_argument("--only", help="comma-separated cases to run instead of all, for a suite that selects: "
                   "learning takes preset names of configs/learning/ (e.g. flow_grpo,mixgrpo)")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("serve-rewards", help="serve the rewards of a YAML config over HTTP (for the remote reward)")
    p.add_argument("config", help="YAML with a 'rewards:' list (as in presets) and an optional 'server:' section, "
                   "e.g. configs/rewards/image_server.yaml")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; any other address needs a token)")
    p.add_argument("--port", type=port_number, help="TCP port (default 8765; 0 = any free port)")
    p.add_argument("--token-env", help="environment variable holding the bearer token (default MMGRPO_REWARD_TOKEN)")
    p.set_defaults(fn=cmd_serve_rewards)

    p = sub.add_parser("demo", help="train the tiny shipped models on CPU and report before/after")
    p.add_argument("which", nargs="?", choices=("flow", "vlm"), default="flow")
    p.add_argument("--output-dir", help="default runs/demo-flow or runs/demo-vlm; an existing folder is cleared only if it holds an earlier demo's output (its .mmgrpo-demo marker, or a demo's demo.json)")
    p.add_argument("--minutes", type=non_negative_minutes, help="training-time budget (default: the demo's own, 11 for flow, 14 for "
                   "vlm, cut short on a slow machine so that the whole demo ends within 15 minutes)")
    p.add_argument("--processes", type=positive_int, help="training processes (default: 2 for vlm on a CPU with 2 "
                   "cores or more, DDP over gloo; 1 for flow, and on a machine with a GPU)")
    p.set_defaults(fn=cmd_demo)
    return parser


def non_negative_minutes(text: str) -> float:
    """An argparse type: a finite number of minutes >= 0."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of minutes >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value}")
    return value


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``key=value`` overrides allowed after options too (``sample CONFIG --num 2
    resume=latest``), which argparse alone would reject once an option has ended the overrides."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def one_line_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> str:
    """``warnings.formatwarning`` for the command line: the category and the message, without the source line
    that raised it."""
    return f"{category.__name__}: {message}\n"


def without_cpu_fallback_notice(record: logging.LogRecord) -> bool:
    """A filter for DeepSpeed's logger: drops the notice it logs when it is imported on a machine without an
    accelerator ("Setting accelerator to CPU..."), which accelerate's ``unwrap_model`` prints in every CPU run with
    DeepSpeed installed (the ``dev`` extra), DeepSpeed launch or not."""
    return not record.getMessage().startswith("Setting accelerator to CPU")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    warnings.formatwarning = one_line_warning
    logging.getLogger("DeepSpeed").addFilter(without_cpu_fallback_notice)
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # a second Ctrl-C, after the run's own handler saved and began to stop
        print("interrupted", file=sys.stderr)
        return 128 + signal.SIGINT.value
    except (ConfigError, RegistryError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a missing file, an output_dir under a file, a full disk: one line
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
