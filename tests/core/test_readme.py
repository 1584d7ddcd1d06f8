"""The README and docs/ are kept true to the code: the reward table, the commands, the files, config keys,
defaults, reward args and presets they name."""

import re
import shlex
from pathlib import Path

import pytest

from mmgrpo.registry import REWARDS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_reward_table_matches_the_registry():
    rows = [line for line in README.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 4 and cells[1] in ("pointwise", "groupwise"):
            for name in re.findall(r"`([^`]+)`", cells[0]):
                table[name] = (cells[1], cells[2])
    registered = {e.name: (e.info.get("kind"), e.info.get("modality")) for e in REWARDS
                  if not e.info.get("source", "").startswith("entry point")}
    assert table == registered


def test_quick_start_has_the_two_commands():
    assert 'pip install -e ".[dev]" && mmgrpo demo' in README
    assert 'pip install -e ".[dev]" && python -m pytest -q' in README


def test_named_paths_exist():
    for path in re.findall(r"`((?:configs|docs|mmgrpo|pipelines|rewards|assets)/[^`*]+)`", README):
        for part in path.split(", "):
            assert (ROOT / part.strip("`")).exists(), part


def test_every_shipped_preset_is_in_the_presets_table():
    named = set(re.findall(r"`(configs/(?:flow|vlm)/[^`]+\.yaml)`", README))
    shipped = {str(p.relative_to(ROOT)) for d in ("flow", "vlm") for p in (ROOT / "configs" / d).glob("*.yaml")}
    assert shipped - named == set()


def test_every_rollout_mode_is_in_the_feature_table():
    from mmgrpo.registry import ROLLOUT_MODES

    assert {e.name for e in ROLLOUT_MODES} - set(re.findall(r"`([a-z_]+)`", README)) == set()


# --- the docs/ pages: every config key, default, reward arg, command and preset they name is the code's ---

DOCS = {p.relative_to(ROOT).as_posix(): p.read_text()
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}


def schema_defaults(*pipelines: str) -> dict[str, object]:
    """Every dotted key of the config schemas of ``pipelines`` (default: flow and vlm; a key of both takes the
    last one's) -> its default (``"???"`` when required)."""
    from omegaconf import OmegaConf

    from mmgrpo.config import valid_keys
    from mmgrpo.registry import PIPELINES

    defaults = {}
    for name in pipelines or ("flow", "vlm"):
        schema = PIPELINES.get(name).config_class
        cfg = OmegaConf.structured(schema)
        for key in valid_keys(schema):
            node = OmegaConf.select(cfg, key, throw_on_missing=False)
            defaults[key] = "???" if OmegaConf.is_missing(cfg, key) else (
                OmegaConf.to_container(node) if OmegaConf.is_config(node) else node)
    return defaults


def doc_value(text: str) -> object:
    """A default as a table cell writes it: `None`/null, true/false, a number, or the bare text."""
    text = text.strip().strip("`")
    if text in ("None", "null"):
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return float(text)
    except ValueError:
        return text


def same_default(written: str, actual: object) -> bool:
    """Whether a table's default cell states ``actual``; "required" is a key without a usable default."""
    value = doc_value(written)
    if value in ("required", "pipeline default"):
        return actual in ("???", None)
    if isinstance(actual, (int, float)) and not isinstance(actual, bool):
        return value == float(actual)
    return value == actual


def table_rows(text: str, header: str) -> list[tuple[list[str], list[str]]]:
    """(names, defaults) of every row of the markdown tables whose header row starts with ``header``: the
    backticked names of the first cell and the comma-separated defaults of the second, one per name."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith(header):
            inside = True
        elif not line.startswith("|"):
            inside = False
        elif inside and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            names = re.findall(r"`([^`]+)`", cells[0])
            defaults = cells[1].split(", ") if cells[1] else []
            if defaults:
                assert len(defaults) == len(names), f"{line}: {len(names)} names, {len(defaults)} defaults"
                rows.append((names, defaults))
    return rows


def test_config_keys_named_in_the_docs_exist():
    """A backticked dotted key whose first part is a config section (`grpo.kl_beta`, `video.fps=4`) is a key
    of the flow or vlm schema."""
    keys = schema_defaults()
    sections = {k.split(".")[0] for k in keys if "." in k} - {"rewards"}
    unknown = []
    for doc, text in DOCS.items():
        for code in re.findall(r"`([^`\n]+)`", text):
            for key in re.findall(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+)(?![\w/-]|\.[a-z])", code):
                if key.split(".")[0] in sections and not key.endswith((".py", ".jsonl", ".json", ".yaml")) \
                        and key not in keys and not key.startswith(("model.language_model", "model.visual")):
                    unknown.append(f"{doc}: `{code}`")
    assert not unknown, "\n".join(unknown)


@pytest.mark.parametrize("pipeline", ["flow", "vlm"])
def test_default_tables_match_the_schema(pipeline):
    """The "| key | default |" tables of docs/<pipeline>.md: a key given without its section (`sampling.sde`,
    `noise_level`) is in the section of the first key of its row."""
    keys, doc = schema_defaults(pipeline), f"docs/{pipeline}.md"
    wrong = []
    for names, defaults in table_rows(DOCS[doc], "| key | default |"):
        section = names[0].rsplit(".", 1)[0]
        for name, written in zip(names, defaults):
            key = name if "." in name else f"{section}.{name}"
            if key not in keys:
                wrong.append(f"{key}: not a config key")
            elif not same_default(written, keys[key]):
                wrong.append(f"{key}: the table says {written}, the schema {keys[key]!r}")
    assert not wrong, "\n".join(wrong)


def test_reward_arg_tables_match_the_signatures():
    """The "| arg | default |" tables of docs/rewards.md, under a heading that names the reward(s)."""
    import inspect

    from mmgrpo.registry import REWARDS

    wrong, checked, rewards = [], 0, []
    for block in re.split(r"^(#{2,4} .*|\*\*`remote`\*\*.*)$", DOCS["docs/rewards.md"], flags=re.MULTILINE):
        if re.match(r"#{2,4} |\*\*`remote`", block):
            rewards = [n for n in re.findall(r"`([^`]+)`", block) if n in REWARDS]
            continue
        for name in rewards:
            params = inspect.signature(REWARDS.get(name).__init__).parameters
            for names, defaults in table_rows(block, "| arg | default |"):
                for arg, written in zip(names, defaults):
                    checked += 1
                    if arg not in params:
                        wrong.append(f"{name}: no arg {arg}")
                        continue
                    actual = params[arg].default
                    if not same_default(written, "???" if actual is inspect.Parameter.empty else actual):
                        wrong.append(f"{name}.{arg}: the table says {written}, the code {actual!r}")
    assert checked > 40 and not wrong, "\n".join(wrong)


def doc_commands(text: str) -> list[str]:
    """The mmgrpo command lines of the fenced bash blocks (`mmgrpo ...`, `python -m mmgrpo ...`, `accelerate
    launch ... -m mmgrpo.cli ...`), as argv lists after the program, comments and env assignments dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.sub(r"(^|\s)#.*", "", line).split("&&"):
                words = shlex.split(part)
                while words and re.match(r"[A-Z_]+=", words[0]):
                    words = words[1:]
                if words[:1] == ["mmgrpo"]:
                    commands.append(words[1:])
                elif words[:3] == ["python", "-m", "mmgrpo"]:
                    commands.append(words[3:])
                elif words[:2] == ["accelerate", "launch"] and "-m" in words:
                    commands.append(words[words.index("-m") + 2:])
    return commands


TINY_PRESETS = ["configs/flow/tiny_flowgrpo.yaml", "configs/vlm/tiny_image.yaml"]


def test_documented_commands_parse_and_their_overrides_load(capsys):
    """Every command of a fenced block parses as the CLI parses it, a bench names a registered suite, and a
    train/eval/sample/config of a shipped preset loads with the command's overrides (key names and values)."""
    from mmgrpo.bench import BENCHES
    from mmgrpo.cli import parse
    from mmgrpo.config import load_config

    count, wrong = 0, []
    for doc, text in DOCS.items():
        for argv in doc_commands(text):
            count += 1
            try:
                args = parse(argv)
            except SystemExit as stop:  # --help exits 0
                if stop.code:
                    wrong.append(f"{doc}: does not parse: mmgrpo {' '.join(argv)}")
                continue
            if args.command == "bench" and args.name not in BENCHES:
                wrong.append(f"{doc}: no bench suite {args.name!r}")
            if args.command not in ("train", "eval", "sample", "config"):
                continue
            # a placeholder CONFIG.yaml stands for any preset: its overrides must load on a tiny one
            presets = TINY_PRESETS if args.config == "CONFIG.yaml" else [args.config]
            overrides = [o for o in args.overrides if not o.startswith("model.path=runs/")]  # a demo's output
            errors = []
            for preset in (ROOT / p for p in presets if (ROOT / p).is_file()):
                try:
                    load_config(preset, overrides)
                    break
                except Exception as err:  # noqa: BLE001 - the message is the finding
                    errors.append(str(err))
            else:
                wrong += [f"{doc}: mmgrpo {' '.join(argv)}: {e}" for e in errors]
    assert count > 20 and not wrong, "\n".join(wrong)


def test_yaml_snippets_are_valid_config():
    """A ```yaml block of the docs holds config keys of the schemas, and its reward items pass the checks a
    preset's do (names resolve, every arg is a parameter); the example file `my_rewards.py` is not shipped."""
    import yaml

    from mmgrpo.config import ConfigError
    from mmgrpo.rewards.zoo import check_spec

    keys, wrong = schema_defaults(), []

    def flat(data: dict, prefix: str = "") -> list[str]:  # the dotted keys, down to a section's own keys
        return [k for key, value in data.items() for k in (
            flat(value, f"{prefix}{key}.") if isinstance(value, dict) and any(
                other.startswith(f"{prefix}{key}.") for other in keys) else [f"{prefix}{key}"])]

    for doc, text in DOCS.items():
        for block in re.findall(r"^```yaml\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
            data = yaml.safe_load(block)
            items = data if isinstance(data, list) else data.pop("rewards", [])
            wrong += [f"{doc}: unknown key {k}" for k in (flat(data) if isinstance(data, dict) else [])
                      if k not in keys]
            for i, item in enumerate(items):
                if not item["name"].startswith("my_rewards.py:"):
                    try:
                        check_spec(item["name"], item.get("args"), f"rewards.{i}")
                    except ConfigError as err:
                        wrong.append(f"{doc}: {err}")
    assert not wrong, "\n".join(wrong)


def test_each_pipeline_page_names_every_preset():
    """docs/flow.md names every flow preset, docs/vlm.md every vlm preset but the shared base, and the GPU
    recipes table of docs/vlm_models.md every vlm GPU preset (neither tiny nor the demo's)."""
    missing = [f"docs/flow.md: {p.name}" for p in (ROOT / "configs/flow").glob("*.yaml")
               if p.name not in DOCS["docs/flow.md"]]
    for p in (ROOT / "configs/vlm").glob("*.yaml"):
        if p.name != "tiny_base.yaml" and p.name not in DOCS["docs/vlm.md"]:
            missing.append(f"docs/vlm.md: {p.name}")
        gpu_table = DOCS["docs/vlm_models.md"].split("## GPU recipes")[1].split("\n## ")[0]
        if not p.name.startswith(("tiny_", "demo_")) and f"`configs/vlm/{p.name}`" not in gpu_table:
            missing.append(f"docs/vlm_models.md GPU recipes: {p.name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("pipeline", ["flow", "vlm"])
def test_model_path_help_names_every_tiny_kind(pipeline):
    """`mmgrpo config` prints each key's docstring: model.path's names every `tiny:<kind>` the pipeline builds."""
    import importlib

    from mmgrpo.config import key_docs
    from mmgrpo.registry import PIPELINES

    kinds = importlib.import_module(f"mmgrpo.pipelines.{pipeline}.tiny").KINDS
    text = key_docs(PIPELINES.get(pipeline).config_class)["model.path"]
    assert [k for k in kinds if f"tiny:{k}" not in text] == []


def test_vlm_eval_temperature_help_names_per_prompt_sampling():
    """generation.eval_temperature's help is where a user looks up why `sample --per-prompt K` stops at 0."""
    from mmgrpo.config import key_docs
    from mmgrpo.registry import PIPELINES

    text = key_docs(PIPELINES.get("vlm").config_class)["generation.eval_temperature"]
    assert "--per-prompt" in text
